"""Putting the options on a model: `install` wraps the `forward` of each module whose option
differs from its parent's in an `ActivationForward`, which runs it under its codec's
``saved_tensors_hooks``, under ``save_on_cpu``, or recomputed. `mixprec.apply` calls it after
its regions, so the wrapper is outermost: a recomputed layer re-enters its own region, and a
codec sees what the region saved. Below a recomputed module nothing is wrapped.

`check` refuses, before the model changes, an option a module cannot take (`refusal`) and
``offload`` where no CUDA device exists.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.overrides import TorchFunctionMode

from mixprec.activations.codecs import (
    ATTENTION,
    CODECS,
    FP8,
    Centered,
    Codec,
    Keep,
    NearOne,
    has_storage,
    weights_standing,
)
from mixprec.activations.options import OPTIONS, accepted, refusal
from mixprec.activations.recompute import recomputed
from mixprec.activations.rules import Choice, never_called
from mixprec.eager import compiled_wrapper, uncompiled
from mixprec.errors import PolicySpecError, caller_level

__all__ = [
    "ActivationForward",
    "check",
    "check_device",
    "install",
    "installed",
    "warn_if_root_unused",
    "wrapped",
]


def _offload_refused(where: str) -> PolicySpecError:
    others = tuple(o for o in OPTIONS if o != "offload")
    return PolicySpecError(
        f"'offload' moves saved tensors from a CUDA device to pinned host memory, but {where}: "
        f"it runs on CUDA only; on this device choose {accepted(others)}"
    )


def check_device(options: set[str], device_type: str) -> None:
    """Refuse ``offload`` among `options` for a run on `device_type` other than CUDA."""
    if "offload" in options and device_type != "cuda":
        raise _offload_refused(f"the run is on {device_type}")


# one codec per storage option for every module taking it: a tensor several modules save
# (the input of separate query, key and value projections; a block's output, the next
# block's input) is stored once, as one module saving it several times stores it
_CODECS: dict[str, Codec] = {}


def _shared(option: str) -> Codec | None:
    """The codec of every module whose activations take ``option`` (None: recomputed or
    offloaded)."""
    if option not in CODECS:
        return None
    if option not in _CODECS:
        _CODECS[option] = CODECS[option]()
    return _CODECS[option]


class ActivationForward:
    """Stands in for one module's `forward`, kept in the module's ``__dict__`` as mixprec's
    regions are (holding the module, not a bound method, so copies and pickles work): runs
    the forward with its saved tensors stored, offloaded or recomputed as `option` says.
    Without autograd recording (``no_grad``, inference) it only calls the forward."""

    mixprec_wrapper = True  # (keeps the forward it replaced as `original`)

    def __init__(self, module: nn.Module, option: str, original: Any) -> None:
        self.module = module
        self.option = option
        self.original = original
        self.codec = _shared(option)
        # whether a forward ran with autograd recording, and whether its absence was told
        self.recorded = self.told = False

    @property
    def __signature__(self) -> inspect.Signature:
        if self.original is not None:
            return inspect.signature(self.original)
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __getstate__(self) -> dict[str, Any]:
        return {"module": self.module, "option": self.option, "original": self.original}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["module"], state["option"], state["original"])  # type: ignore[misc]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if self.original is None:
            forward = functools.partial(type(module).forward, module)
        else:
            forward = self.original
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        self.recorded = True  # (`warn_if_root_unused`)
        if self.codec is not None or self.option == "offload":
            return _stored(self, forward, args, kwargs)
        # (in eval mode too: a forward may update a buffer there, a count or a scale)
        seen = {id(module): _buffer_marks(module, recurse=True)}
        if torch.compiler.is_compiling():  # (a hook would break the graph: its own only)
            with _exact_inputs():
                out = recomputed(forward, self.option, args, kwargs, module)
        else:
            thread = threading.get_ident()

            def note(called: nn.Module, _: Any) -> None:  # (a module it calls from elsewhere,
                if id(called) not in seen and threading.get_ident() == thread:  # a BatchNorm
                    seen[id(called)] = _buffer_marks(called, recurse=False)  # handed in)

            hook = nn.modules.module.register_module_forward_pre_hook(note)
            try:
                with _exact_inputs():
                    out = recomputed(forward, self.option, args, kwargs, module)
            finally:
                hook.remove()
        for owner, marks in seen.values():
            now = dict(owner.named_buffers()) if marks else {}
            for name, b, version in marks:
                parameter = isinstance(b, nn.Parameter)  # (its place may hold a stand-in)
                if (not parameter and now.get(name) is not b) or b._version != version:
                    what = "parameter" if parameter else "buffer"
                    raise PolicySpecError(
                        f"{type(owner).__name__} updated its {what} {name!r} in a forward "
                        f"that {self.option!r} recomputes (of {type(module).__name__}), so "
                        "the backward updates it again; give this module 'keep', 'bf16', "
                        "'fp8' or 'offload', or recompute the modules around the one "
                        "updating it"
                    )
        return out


def _buffer_marks(
    module: nn.Module, recurse: bool
) -> tuple[nn.Module, list[tuple[str, Tensor, int]]]:
    """``module`` with each of its buffers' and parameters' name, tensor and version
    counter: one written in place (a running statistic kept in a frozen parameter too), or a
    buffer assigned anew (``self.ema = 0.9 * self.ema + x``), changes one. Parameters only
    as `nn.Parameter` objects (not the stand-ins a region or ``functional_call`` puts in
    their place for a forward), and not while torch.compile traces (their version counters
    are not known to it; buffers are)."""
    marks = [(n, b, b._version) for n, b in module.named_buffers(recurse=recurse)]
    if not torch.compiler.is_compiling():
        marks += [
            (n, p, p._version)
            for n, p in module.named_parameters(recurse=recurse)
            if isinstance(p, nn.Parameter)
        ]
    return module, marks


def warn_if_root_unused(model: nn.Module) -> None:
    """Warn once when a backward runs on a model whose own forward carries an activation
    option (a rule for the root: one option for every layer) but never ran recording: the
    training step called a submodule (a LightningModule's ``self.net(x)``), around which
    nothing stores, offloads or recomputes, so the option takes no effect."""
    root = model.__dict__.get("forward")
    if not isinstance(root, ActivationForward) or root.recorded or root.told:
        return
    root.told = True
    children = [name for name, _ in model.named_children()]
    example = f"{{{children[0]!r}: {root.option!r}}}" if children else "a rule for it"
    warnings.warn(
        f"the activation option {root.option!r} is the model's own ({type(model).__name__}), "
        "but a backward ran without its forward: the step called a submodule directly, "
        "around which nothing is stored otherwise or recomputed. Give the submodule the "
        f"step calls the option (e.g. activations={example})",
        UserWarning,
        stacklevel=caller_level(),
    )


_SDPA = F.scaled_dot_product_attention
_MHA = F.multi_head_attention_forward
# runs a function's body with a torch function mode left on for the calls inside it (a
# mode sees the outermost torch function of a call only); torch 2.13 and later
_REDISPATCH = getattr(torch.overrides, "redispatch_function", None)
# the functions whose saves `_SavesByFunction` stores as bf16 stores them under fp8:
# attention, and, where its body cannot be entered (`_REDISPATCH`), nn.MultiheadAttention's
# functional form, which calls attention inside, so all it saves goes so
_ATTENTION_FUNCTIONS = (_SDPA, _MHA)
_T = torch.Tensor
# functions whose backward finds the elements it picked by comparing its saved input with
# its saved result (``result == self``): stored apart, a rounded one matches no element and
# the gradient is NaN (divided by a count of 0) or zero. Their saves are kept exact; a norm's
# only for an infinite order (`_kept_exact`).
_PICKING = frozenset(
    [torch.amax, _T.amax, torch.amin, _T.amin, torch.max, _T.max, torch.min, _T.min]
    + [torch.median, _T.median, torch.nanmedian, _T.nanmedian]
)
_NORMS = frozenset([torch.norm, _T.norm, torch.linalg.vector_norm, torch.linalg.norm])
_A = torch.ops.aten
# functions whose backward sends each element's gradient to one side by comparing two saved
# tensors (``maximum(a, b)``: ``a >= b``), or a saved tensor with a bound where the gradient
# jumps (a clamp's 0 or 1, a threshold's or a shrink's 1 or 0, a hard sigmoid's 1/6 or 0):
# rounded each on its own, two close values (an offset shared by both) swap sides, and the
# gradient goes to the wrong one. Kept exact where a bound is a tensor or a number other
# than 0 (a bound of 0 compares signs, which rounding keeps: a ReLU's save is stored, and so
# are those of leaky_relu, rrelu, elu, celu and selu, which compare with 0) (`_kept_exact`).
_NN = torch._C._nn
_COMPARING = frozenset(
    [torch.maximum, _T.maximum, _A.maximum, torch.minimum, _T.minimum, _A.minimum]
    + [torch.fmax, _T.fmax, _A.fmax, torch.fmin, _T.fmin, _A.fmin]
    + [torch.clamp, _T.clamp, _T.clamp_, torch.clamp_, _A.clamp, _A.clamp_]
    + [torch.clip, _T.clip, _T.clip_, torch.clip_, _A.clip, _A.clip_]
    + [torch.clamp_min, _T.clamp_min, _T.clamp_min_, torch.clamp_min_, _A.clamp_min]
    + [_A.clamp_min_, torch.clamp_max, _T.clamp_max, _T.clamp_max_, torch.clamp_max_]
    + [_A.clamp_max, _A.clamp_max_, F.hardtanh, F.hardtanh_, _A.hardtanh, _A.hardtanh_]
    + [F.relu6, _A.relu6, F.threshold, torch.threshold, torch.threshold_, _A.threshold]
    + [_A.threshold_, torch.hardshrink, _T.hardshrink, _A.hardshrink, _NN.softshrink]
    + [_A.softshrink, F.hardsigmoid, _NN.hardsigmoid, _NN.hardsigmoid_, _A.hardsigmoid]
    + [_A.hardsigmoid_, F.hardswish, _NN.hardswish, _NN.hardswish_, _A.hardswish]
    + [_A.hardswish_]
)
# the bounds of a `_COMPARING` function: (position, keyword, value when not given) of each
_BOUNDS = {
    **dict.fromkeys([torch.clamp, _T.clamp, _T.clamp_, torch.clamp_, _A.clamp, _A.clamp_],
                    ((1, "min", None), (2, "max", None))),
    **dict.fromkeys([torch.clip, _T.clip, _T.clip_, torch.clip_, _A.clip, _A.clip_],
                    ((1, "min", None), (2, "max", None))),
    **dict.fromkeys([torch.clamp_min, _T.clamp_min, _T.clamp_min_, torch.clamp_min_,
                     _A.clamp_min, _A.clamp_min_], ((1, "min", None),)),
    **dict.fromkeys([torch.clamp_max, _T.clamp_max, _T.clamp_max_, torch.clamp_max_,
                     _A.clamp_max, _A.clamp_max_], ((1, "max", None),)),
    **dict.fromkeys([F.hardtanh, F.hardtanh_, _A.hardtanh, _A.hardtanh_],
                    ((1, "min_val", -1.0), (2, "max_val", 1.0))),
    **dict.fromkeys([F.threshold, torch.threshold, torch.threshold_, _A.threshold,
                     _A.threshold_], ((1, "threshold", None),)),
    **dict.fromkeys([torch.hardshrink, _T.hardshrink, _A.hardshrink, _NN.softshrink,
                     _A.softshrink], ((1, "lambd", 0.5),)),
}  # fmt: skip
# functions whose backward divides by a saved value: fp8's block scales round a small
# value to exactly 0, and their gradient is infinite. Kept exact under fp8 (bfloat16 keeps
# float32's range); a power's only for an exponent below 1 (`_kept_exact`).
_DIVIDING = frozenset(
    [torch.log, _T.log, _T.log_, torch.log2, _T.log2, _T.log2_, torch.log10, _T.log10]
    + [_T.log10_, torch.sqrt, _T.sqrt, _T.sqrt_, F.normalize]
    + [torch.div, _T.div, _T.div_, torch.divide, _T.divide, _T.divide_, torch.true_divide]
    + [_T.true_divide, _T.true_divide_, _T.__truediv__, _T.__itruediv__, _T.__rtruediv__]
    + [torch.xlogy, _T.xlogy, _T.xlogy_, torch.special.xlogy]
    # (a quotient by a sum of squares, a saved root, a pole at 0: one at 0 is NaN)
    + [torch.atan2, _T.atan2, _T.atan2_, torch.arctan2, _T.arctan2, _T.arctan2_, _A.atan2]
    + [torch.hypot, _T.hypot, _T.hypot_, _A.hypot, torch.special.entr, _A.special_entr]
    + [torch.lgamma, _T.lgamma, _T.lgamma_, _A.lgamma, torch.special.gammaln]
    + [torch.digamma, _T.digamma, _T.digamma_, _A.digamma, torch.special.digamma]
    + [torch.special.psi, torch.polygamma, _T.polygamma, _T.polygamma_, _A.polygamma]
    + [torch.special.polygamma, torch.mvlgamma, _T.mvlgamma, _T.mvlgamma_, _A.mvlgamma]
    + [torch.special.multigammaln]
)
# functions whose backward grows without bound as the saved value nears a point of
# magnitude one (asin at 1, log1p at -1, logit at 1, a binary cross-entropy's
# probability at 1): rounded to bfloat16 (8 bits: 0.998 is 1.0) or fp8, a value next to it
# lands on it and the gradient is infinite. Kept exact under both (`_kept_exact`).
_NEAR_ONE = frozenset(
    [torch.asin, _T.asin, _T.asin_, torch.arcsin, _T.arcsin, _T.arcsin_]
    + [torch.acos, _T.acos, _T.acos_, torch.arccos, _T.arccos, _T.arccos_]
    + [torch.atanh, _T.atanh, _T.atanh_, torch.arctanh, _T.arctanh, _T.arctanh_]
    + [torch.acosh, _T.acosh, _T.acosh_, torch.arccosh, _T.arccosh, _T.arccosh_]
    + [torch.logit, _T.logit, _T.logit_, torch.special.logit]
    + [torch.log1p, _T.log1p, _T.log1p_, torch.special.log1p]
    + [torch.erfinv, _T.erfinv, _T.erfinv_, torch.special.erfinv]
    + [F.binary_cross_entropy]
)
# sigmoids, whose output p the backward's p (1 - p) reads, which a binary cross-entropy of p
# divides by: rounded, a confident p's gradient is lost (nn.Sigmoid then nn.BCELoss). Their
# output is stored as its distance from 0 or 1 (`NearOne`), at the codec's bytes. So is a
# softmax's (a softmin's), whose backward p (g - sum(g p)) cancels for a confident p (a
# cross-entropy of a softmax probability, an unlikelihood loss's -log1p(-p)); not a
# log-softmax's, whose backward reads exp(output), rounded relative to itself. Each saves
# its output alone, which `NearOne` takes for a value in its range
_SIGMOIDS = frozenset(
    [torch.sigmoid, torch.sigmoid_, _T.sigmoid, _T.sigmoid_, F.sigmoid, torch.special.expit]
    + [_A.sigmoid, _A.sigmoid_]
)
_SOFTMAXES = frozenset(
    [torch.softmax, _T.softmax, F.softmax, torch.special.softmax, _A.softmax, _A._softmax]
    + [F.softmin]
)
# tanh, whose output a the backward's 1 - a^2 reads (a tanh-squashed policy's log-density
# divides by it): stored as its distance from -1 or +1 (`NearOne`, signed)
_TANHS = frozenset([torch.tanh, torch.tanh_, _T.tanh, _T.tanh_, F.tanh, _A.tanh, _A.tanh_])
# whether each of those outputs is signed (a tanh's)
_NEAR_ONE_OUTPUTS = {**dict.fromkeys(_SIGMOIDS | _SOFTMAXES, False), **dict.fromkeys(_TANHS, True)}
# functions whose backward subtracts saved values of about the same size, each rounded on
# its own: a log-sum-exp's exp(input - result), a layer norm's or a variance's
# input - mean, a distance's (cdist, dist, pdist) or a regression loss's input - other, a
# cosine's part of one input along the other. Where the inputs' spread is small against
# their size (confident logits, a residual stream with an offset), what is left is mostly
# the rounding of bfloat16 or fp8. Kept exact under both (`_kept_exact`), also called as
# aten ops. Not batch norms: their input, a convolution's output, is a CNN's largest save,
# often saved by a ReLU too, and its means run over other samples, not along a row
# (docs/activations.md).
_CANCELLING = frozenset(
    [torch.logsumexp, _T.logsumexp, torch.special.logsumexp, _A.logsumexp]
    + [torch.logaddexp, _T.logaddexp, _A.logaddexp, torch.logaddexp2, _T.logaddexp2]
    + [_A.logaddexp2, torch.logcumsumexp, _T.logcumsumexp, _A.logcumsumexp]
    + [torch.var, _T.var, _A.var, torch.var_mean, _A.var_mean]
    + [torch.std, _T.std, _A.std, torch.std_mean, _A.std_mean]
    + [F.mse_loss, _A.mse_loss, F.huber_loss, _A.huber_loss, F.smooth_l1_loss]
    + [_A.smooth_l1_loss, torch.cdist, _A.cdist, torch.cosine_similarity]
    + [_A.cosine_similarity, torch.dist, _T.dist, _A.dist, torch.pdist, F.pdist, _A.pdist]
    + [_A._pdist_forward]
)
# norms that subtract each row's mean, a row lying whole in memory: a layer norm's (the
# normalized size), a group norm's (a sample's group of channels) and an instance norm's (a
# sample's channel). Their input (a transformer's residual stream, the largest input its
# norms save; a convolution's output) is stored centred on those means (`Centered`: the
# rounding relative to the row's spread, as the norm's result is), not kept whole
_LAYER_NORMS = frozenset(
    [F.layer_norm, torch.layer_norm, _A.layer_norm, torch.native_layer_norm]
    + [_A.native_layer_norm]
)
_GROUP_NORMS = frozenset([F.group_norm, torch.group_norm, _A.group_norm])
_INSTANCE_NORMS = frozenset([F.instance_norm, torch.instance_norm, _A.instance_norm])
_ROW_NORMS = _LAYER_NORMS | _GROUP_NORMS | _INSTANCE_NORMS | {_A.native_group_norm}


_POWERS = frozenset([torch.pow, _T.pow, _T.pow_, _T.__pow__, _T.__ipow__])


def _op(func: Any) -> Any:
    """``func``, or an aten overload's op (``aten.add.Tensor`` -> ``aten.add``)."""
    return func.overloadpacket if isinstance(func, torch._ops.OpOverload) else func


def _argument(
    args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any = None
) -> Any:
    """A call's argument, given by position ``index`` or by keyword ``name`` (else
    ``default``)."""
    return args[index] if len(args) > index else kwargs.get(name, default)


def _row(func: Any, given: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The elements of one of ``func``'s rows (`_ROW_NORMS`) for its input ``given``, or
    None where the call's arguments do not say it."""
    op = _op(func)
    if op in _LAYER_NORMS:
        shape = _argument(args, kwargs, 1, "normalized_shape")
        return None if shape is None else math.prod([shape] if isinstance(shape, int) else shape)
    if op is _A.native_group_norm:  # (input, weight, bias, N, C, HxW, group, eps)
        channels, spatial, groups = (_argument(args, kwargs, i, "") for i in (4, 5, 6))
        if not all(isinstance(n, int) and n > 0 for n in (channels, spatial, groups)):
            return None
        return channels // groups * spatial if channels % groups == 0 else None
    if given.dim() < 2 or given.shape[0] == 0:
        return None
    if op in _INSTANCE_NORMS:
        return math.prod(given.shape[2:])
    groups = _argument(args, kwargs, 1, "num_groups")
    if not isinstance(groups, int) or groups <= 0 or given.shape[1] % groups:
        return None
    return given.numel() // (given.shape[0] * groups)


def _centred(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Tensor, int] | None:
    """(input, row size) of a norm call whose input is stored centred (`_ROW_NORMS`,
    `Centered`); None for any other call."""
    if _op(func) not in _ROW_NORMS:
        return None
    given = _argument(args, kwargs, 0, "input")
    if not isinstance(given, Tensor) or not has_storage(given):
        return None
    row = _row(func, given, args, kwargs)
    return (given, row) if row and given.numel() % row == 0 else None


def _with_input(
    args: tuple[Any, ...], kwargs: dict[str, Any], given: Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A layer norm call's arguments with its input replaced by ``given``: its contiguous
    copy, for an input not contiguous (ConvNeXt's, permuted to channels-last). Its kernels,
    forward and backward, normalize such a copy anyway (their output is contiguous either
    way), and a saved contiguous input has its rows whole in memory, to store centred
    (`Centered`), where saved as it is it would be stored uncentred."""
    if args:
        return (given, *args[1:]), kwargs
    return args, {**kwargs, "input": given}


def _kept_exact(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], fp8: bool) -> bool:
    """Whether ``func(*args, **kwargs)``'s saves are kept exact (`_PICKING`, `_NEAR_ONE`,
    `_CANCELLING`, `_COMPARING`, `_DIVIDING`; an aten op's overload as the op): a norm of an
    infinite order (which picks its largest element) and, under fp8, any other (divided by);
    a clamp, threshold or shrink to a tensor or to a bound other than 0, a hard sigmoid or
    swish; a power of an exponent below 1 (or of a tensor exponent) under fp8."""
    func = _op(func)
    if func in _PICKING or func in _NEAR_ONE or func in _CANCELLING:
        return True
    if func in _COMPARING:
        places = _BOUNDS.get(func)
        if places is None:  # (two tensors compared; relu6's bound is 6, a hard sigmoid's 3)
            return True
        bounds = [_argument(args, kwargs, *place) for place in places]
        return any(torch.is_tensor(b) or (b is not None and b != 0) for b in bounds)
    if func in _NORMS:
        order = kwargs.get("ord", kwargs.get("p", args[1] if len(args) > 1 else None))
        return fp8 or (isinstance(order, (int, float)) and math.isinf(order))
    if not fp8:
        return False
    if func in _POWERS:
        exponent = kwargs.get("exponent", args[1] if len(args) > 1 else None)
        return not isinstance(exponent, (int, float)) or exponent < 1
    return func in _DIVIDING


class _SavesByFunction(TorchFunctionMode):
    """While on (around a ``bf16`` or ``fp8`` module's forward), the saves of a few
    functions are stored otherwise than the module's codec stores them:

    - under fp8, what attention saves is stored as ``bf16`` stores it (float32 as bfloat16,
      the rest as it is): its backward computes the attention weights again from the saved
      query and key against the saved log-sum-exp of the exact ones, and fp8's query and key
      no longer match it (docs/activations.md). nn.MultiheadAttention's functional form is
      stored so whole, its projections' inputs too (its body entered where torch can:
      `_REDISPATCH`, the softmax of ``need_weights`` stored as a softmax's);
    - the saves of functions picking elements by equality (`_PICKING`: amax, median, an inf
      norm) or by comparing two saves, or a save with a bound (`_COMPARING`: maximum, a
      clamp, threshold or shrink to a tensor or a bound other than 0, hardtanh, hardsigmoid,
      hardswish), growing without bound near magnitude one (`_NEAR_ONE`: asin, atanh,
      logit, log1p, binary cross-entropy) or subtracting saved values of about the same size
      (`_CANCELLING`: logsumexp, var, mse_loss), and under fp8 of those dividing by a saved
      value (`_DIVIDING`: log, division, sqrt), are kept exact; a layer, group or instance
      norm's input (`_ROW_NORMS`) is stored centred on its rows' means (`Centered`), a
      sigmoid's or softmax's output (`_SIGMOIDS`, `_SOFTMAXES`) as its distance from 0 or
      1, a tanh's (`_TANHS`) from -1 or 1 (`NearOne`).

    Only where the innermost saved-tensor hooks are a storing codec's (a module inside
    keeping, recomputing or offloading has its way). Every other call runs as it is."""

    def __init__(self, fp8: bool) -> None:
        super().__init__()
        self.fp8 = fp8

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # (traced by dynamo, inside a block compiled on its own: its graphs do not store
            # through a codec's hooks, and a break inside this method let code traced for
            # one function run for the next, a tanh's branch for a clamp's: KeyError)
            return func(*args, **kwargs)
        norm = None
        if func is _MHA and _enterable(types):
            codec = _innermost_codec()
            if codec is None or codec.name not in ("bf16", "fp8"):
                return func(*args, **kwargs)
            # its body under this mode (the softmax of ``need_weights`` stored as a
            # softmax's), under fp8 all else as bf16 stores it, as before
            whole = saved_tensors_hooks(ATTENTION.pack, ATTENTION.unpack)
            with self, whole if self.fp8 else contextlib.nullcontext():
                return _REDISPATCH(func, types, args, kwargs)
        if _kept_exact(func, args, kwargs, self.fp8):
            hooks = _EXACT
        elif self.fp8 and func in _ATTENTION_FUNCTIONS:
            hooks = ATTENTION
        elif _op(func) in _ROW_NORMS:
            # (a call whose input or rows are not found: kept exact)
            norm, hooks = _centred(func, args, kwargs), _EXACT
        elif _op(func) in _NEAR_ONE_OUTPUTS:
            hooks = None
        else:
            return func(*args, **kwargs)
        codec = _innermost_codec()
        if codec is None or codec.name not in ("bf16", "fp8"):
            return func(*args, **kwargs)
        if norm is not None:  # (per call: the input it centres is this call's)
            given, row = norm
            # (only a copy the codec stores centred: one it keeps as it is, a 16-bit input
            # under bf16, would be held beside the input's own memory for nothing)
            if (
                _op(func) in _LAYER_NORMS
                and not given.is_contiguous()
                and given.numel() >= FP8.block
                and codec.stores(given)
            ):
                given = given.contiguous()
                args, kwargs = _with_input(args, kwargs, given)
            hooks = Centered(codec, given, row)
        elif hooks is None:
            hooks = NearOne(codec, signed=_NEAR_ONE_OUTPUTS[_op(func)])
        with saved_tensors_hooks(hooks.pack, hooks.unpack):
            return func(*args, **kwargs)


def _enterable(types: Any) -> bool:
    """Whether nn.MultiheadAttention's functional form can be entered by `_REDISPATCH`:
    with torch 2.13 or later, and only where no other torch function mode and no tensor
    subclass would see the call (redispatching skips them all for it)."""
    return (
        _REDISPATCH is not None
        and torch._C._len_torch_function_stack() == 0
        and all(t in (Tensor, nn.Parameter) for t in types)
    )


def _innermost_codec() -> Codec | None:
    """The codec whose saved-tensor hooks torch calls now (None: no codec's)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    codec = getattr(top[0], "__self__", None) if top is not None else None
    return codec if isinstance(codec, Codec) else None


_EXACT = Keep()


def _exact_inputs() -> Any:
    """Where a storing codec's hooks are innermost (a recomputed module inside a ``bf16``
    or ``fp8`` one), ``keep``'s hooks: torch's checkpoint saves the module's inputs through
    the hooks around it, and a recomputation from rounded inputs gives other gradients than
    the forward's. Elsewhere (offloaded, kept, traced by torch.compile) nothing changes."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    codec = _innermost_codec()
    if codec is None or codec.name == "keep":
        return contextlib.nullcontext()
    return saved_tensors_hooks(_EXACT.pack, _EXACT.unpack)


@uncompiled
def _stored(
    wrapper: ActivationForward, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """`forward` under `wrapper`'s codec hooks (a few functions' saves stored otherwise:
    `_SavesByFunction`) or ``save_on_cpu``. Never traced: the graphs of torch.compile do
    not run saved_tensors_hooks, so under it this module's forward runs eagerly (the modules
    around it still compile)."""
    if _in_torch_checkpoint():
        return forward(*args, **kwargs)
    codec = wrapper.codec
    if codec is not None:
        by_function = (
            _SavesByFunction(codec.name == "fp8")
            if codec.name in ("bf16", "fp8")
            else contextlib.nullcontext()
        )
        with (
            weights_standing(_standing_in(wrapper.module)),
            saved_tensors_hooks(codec.pack, codec.unpack),
            by_function,
        ):
            return forward(*args, **kwargs)
    device = _device_of(args, kwargs, wrapper.module)
    if device is not None and device.type != "cuda":
        raise _offload_refused(f"{type(wrapper.module).__name__} runs on {device.type}")
    with save_on_cpu(pin_memory=True):
        return forward(*args, **kwargs)


def _standing_in(module: nn.Module) -> dict[int, Tensor]:
    """The tensors, by id, in the place of parameters of `module` and below that are not
    parameters: a "true" region's compute-dtype copies (or ``functional_call``'s tensors).
    A codec keeps them as the weights they are; made by a compiled graph around the module
    (a region computing on copies in another dtype: ``p=bf16,c=f32``) they have that graph's
    history, and `is_activation` alone would store them rounded (eagerly, casts of the
    parameters, they are kept)."""
    return {
        id(t): t
        for m in module.modules()
        for t in m._parameters.values()
        if t is not None and not isinstance(t, nn.Parameter)
    }


# torch's checkpoint's saved-tensor hooks: in the forward, dropping each save for the
# recomputation; in the recomputation, handing its saves to the backward
_TORCH_CHECKPOINT_HOOKS = ("_checkpoint_hook.", "_recomputation_hook.")


def _in_torch_checkpoint() -> bool:
    """Whether the module runs inside ``torch.utils.checkpoint`` (as under Hugging Face's
    gradient checkpointing): the innermost saved-tensor hooks are its checkpoint's, which
    hold nothing from the forward to the backward, or a backward runs (the reentrant one's
    recomputation, whose saves live only for its block's backward). A storing module's hooks,
    put innermost, stored and held its saves instead, undoing the recomputation, or rounded
    them for nothing. Its saves are left to torch's checkpoint, as a module inside the
    ``checkpoint`` option leaves its own (docs/activations.md)."""
    if torch._C._current_graph_task_id() != -1:  # (reentrant: recomputed in a backward)
        return True
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    name = getattr(top[0], "__qualname__", "") if top is not None else ""
    return name.startswith(_TORCH_CHECKPOINT_HOOKS)


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any], module: nn.Module) -> Any:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            return value.device
    param = next(module.parameters(), None)
    return param.device if param is not None else None


def _wrapped(choices: dict[str, Choice], model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, option) of each module that gets a wrapper: where its option differs from
    the one in force where it is called (its nearest called ancestor's: a container never
    called, `never_called`, is not wrapped, its children are), outside any recomputed
    module (the root: unless it keeps). Of torch.compile's wrapper of a module compiled on its
    own (``blocks[i] = torch.compile(block)``), the module it wraps, as `mixprec.apply` takes
    a compiled model's: on the wrapper, outside its graph, a codec's hooks saw only the
    graph's saves, made without history, and kept them all; a recomputation ran torch's
    checkpoint around a compiled call, which failed."""
    found: dict[int, tuple[nn.Module, str]] = {}
    active: dict[str, str] = {}  # path -> the option in force inside that module's forward
    for name, module in model.named_modules(remove_duplicate=False):
        option, why = choices[name]
        ambient = active[name.rpartition(".")[0]] if name else "keep"
        active[name] = ambient
        if why.startswith("recomputed with") or never_called(module):
            continue
        active[name] = option
        if option != ambient:
            if compiled_wrapper(module):
                module = module._orig_mod
            found.setdefault(id(module), (module, option))
    return list(found.values())


def check(model: nn.Module, choices: dict[str, Choice]) -> None:
    """Refuse the options the modules of `model` cannot take (`refusal`), and ``offload``
    where no CUDA device exists; changes nothing. A container never called (`never_called`)
    is not checked: its children carry its option, and each is checked on its own."""
    for name, module in model.named_modules():
        option, why = choices[name]
        if why.startswith("recomputed with") or never_called(module):
            continue
        reason = refusal(module, option)
        if reason is not None:
            raise PolicySpecError(
                f"module {name or '<root>'!r} ({type(module).__name__}) cannot take the "
                f"activation option {option!r} ({why}): {reason}"
            )
        if option == "offload" and not torch.cuda.is_available():
            raise _offload_refused("this machine has no CUDA device")


def install(model: nn.Module, choices: dict[str, Choice]) -> None:
    """Wrap the forwards that `choices` (`ActivationRules.resolve`) ask for, outermost."""
    for module, option in _wrapped(choices, model):
        module.__dict__["forward"] = ActivationForward(
            module, option, module.__dict__.get("forward")
        )


def installed(model: nn.Module, choices: dict[str, Choice]) -> bool:
    """Whether the wrappers on ``model`` are those `install` puts on for `choices`, no
    more and no fewer (a model converted, or sharded by `mixprec.shard`, under them)."""
    on = {
        (id(module), forward.option)
        for module in model.modules()
        if isinstance(forward := module.__dict__.get("forward"), ActivationForward)
    }
    return on == {(id(module), option) for module, option in _wrapped(choices, model)}


def wrapped(model: nn.Module) -> dict[str, str]:
    """The option of each module of `model` wrapped by `install`, by path."""
    return {
        name: forward.option
        for name, module in model.named_modules()
        if isinstance(forward := module.__dict__.get("forward"), ActivationForward)
    }
