"""`apply` and `remove`: the only code that changes a module's dtypes or its forward.

Parameters and floating buffers go to each module's param dtype. The root module's forward
runs in the policy's compute region (autocast for mixed policies, a cast of floating inputs
for "true" ones) and casts floating outputs to the output dtype. Below the root, a module
gets a region of its own only where its policy computes differently from its parent's, so a
uniform policy costs one region. A module whose forward calls attention under a policy
computing in 16 bits may also get an attention island (`Resolution.float32_attention`): its
`scaled_dot_product_attention` calls run in float32. State-dict keys and shapes never change.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import re
import sys
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode

from mixprec.activations import ActivationForward, mark_region_cast, saved_bytes
from mixprec.activations import check as check_activations
from mixprec.activations import install as install_activations
from mixprec.activations.rules import never_called
from mixprec.device import detect, device_of, parse_device
from mixprec.dtypes import default_dtype, dtype_name, exclusive, needs_default_dtype
from mixprec.eager import DYNAMO, backward_outside_autocast, compiled_wrapper
from mixprec.errors import DtypeChangedError, PolicySpecError, PrecisionError, caller_level
from mixprec.hardware import slow_attention, warn_if_unsupported
from mixprec.policy import APPLIED_STATE, REGION_MARK, Policy, explanation
from mixprec.policy.explanation import Explanation
from mixprec.policy.map import (
    PolicyMap,
    Resolution,
    as_map,
    check_bypassed,
    dtype_plan,
)
from mixprec.quantize import quantize_modules
from mixprec.quantize.int8 import CodeCasts, ScaledCodes
from mixprec.quantize.rules import set_fast_paths
from mixprec.tree import iter_tensors, map_tensors

__all__ = [
    "applied_policy",
    "apply",
    "cast_buffer",
    "cast_floating",
    "check_scales",
    "default_dtype",
    "explain",
    "hook_loads",
    "needs_default_dtype",
    "remove",
]

_STATE = APPLIED_STATE


_F64 = torch.float64
_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# (source, target) -> (the largest finite value of source, of target), for each cast that
# turns the first into an infinity (float32 to bfloat16 or float16...)
_SENTINELS = {
    (a, b): (torch.finfo(a).max, torch.finfo(b).max)
    for a in _FLOATS
    for b in _FLOATS
    if torch.finfo(b).max < torch.finfo(a).max
}


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``; in a tensor without grad (an attention mask, data), a value at its
    dtype's lowest or largest finite value (the fill a model picks for its own dtype:
    ``torch.finfo(dtype).min``) takes ``dtype``'s, where the cast would make it an infinity
    (a fully masked row's softmax then gave NaN, and the next layer spread it); every other
    value casts as it is, an overflow to infinity included (a loss scaler's signal)."""
    out = t.to(dtype)
    sentinels = None if t.requires_grad or t.is_nested else _SENTINELS.get((t.dtype, dtype))
    if sentinels is None or not t.numel():  # (a nested tensor: torch's padded fast path's data)
        return out
    top, narrow = sentinels
    if t.layout is not torch.strided:  # (sparse: its stored values, in place in the copy)
        values = _sparse_values(t)
        if values is not None and values.numel() and not torch.compiler.is_compiling():
            _keep_finite(values, _sparse_values(out), top, narrow)  # type: ignore[arg-type]
        return out
    if torch.compiler.is_compiling():  # (out of place, no branch on values: one graph)
        return torch.where(t == -top, -narrow, torch.where(t == top, narrow, out))
    if t.device.type == "cpu":  # (`_keep_finite` inline: a call less on every forward)
        low, high = torch.aminmax(t)  # (no sync on a CPU: the common tensor holds neither)
        if -top < float(low) and float(high) < top:
            return out
    return out.masked_fill_(t == -top, -narrow).masked_fill_(t == top, narrow)


def _keep_finite(t: Tensor, out: Tensor, top: float, narrow: float) -> Tensor:
    """``out`` (``t`` cast, strided) with ``t``'s values at ``-top`` and ``top`` set to
    ``-narrow`` and ``narrow``, in place (`_cast`'s, for a sparse tensor's values)."""
    if t.device.type == "cpu":
        low, high = torch.aminmax(t)  # (no sync on a CPU: the common tensor holds neither)
        if -top < float(low) and float(high) < top:
            return out
    return out.masked_fill_(t == -top, -narrow).masked_fill_(t == top, narrow)


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _sparse_values(t: Tensor) -> Tensor | None:
    """The stored values of a sparse ``t`` (COO, coalesced or not, or compressed), as an
    alias of its own; None for another layout."""
    if t.layout is torch.sparse_coo:
        return t._values()
    return t.values() if t.layout in _COMPRESSED else None


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor in a nested structure (see `mixprec.tree`) to `dtype`
    (`_cast`: a mask's lowest value stays finite)."""
    if isinstance(obj, Tensor):  # the common cases, without the walker's bookkeeping
        return _cast(obj, dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if type(obj) in (tuple, list):
        for t in obj:  # (a batch with nothing to cast, the usual one, is kept as it is)
            if type(t) is not Tensor or (t.dtype != dtype and t.dtype.is_floating_point):
                break
        else:
            return obj
        if type(obj) is tuple and all(isinstance(t, Tensor) for t in obj):
            # a tensor given twice (attention's query, key and value) is cast once: the
            # callee's `query is key` still holds (compared by identity: an `id()` memo
            # would make torch.compile guard on each batch)
            out: list[Tensor] = []
            for i, t in enumerate(obj):
                same = next((out[j] for j in range(i) if obj[j] is t), None)
                out.append(cast_floating(t, dtype) if same is None else same)
            return tuple(out)
    if type(obj) is dict and not obj:
        return obj
    return map_tensors(
        lambda t: _cast(t, dtype) if t.is_floating_point() and t.dtype != dtype else t, obj
    )


def _cast_but_losses(obj: Any, dtype: torch.dtype) -> Any:
    """`cast_floating` of ``obj``, but a floating 0-dim tensor wider than ``dtype`` (a loss
    computed in float32 in the forward) kept as it is."""

    def cast(t: Tensor) -> Tensor:
        if not t.is_floating_point() or t.dtype == dtype:
            return t
        if t.dim() == 0 and t.element_size() > dtype.itemsize:
            return t
        return _cast(t, dtype)

    return cast(obj) if isinstance(obj, Tensor) else map_tensors(cast, obj)


# a 16-bit dtype's other: its tensors reach a mixed region of the first from outside it
_OTHER_16_BIT = {torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}


def _as_float32(obj: Any, dtypes: tuple[torch.dtype, ...]) -> Any:
    """``obj`` with its tensors of `dtypes` as float32 (`_cast`), for a mixed region:
    autocast leaves float64 alone, so a float64 neighbour's output would reach float32
    weights uncast (an error), and the other 16-bit dtype's tensors (a float16 neighbour's
    output in a bfloat16 region) would run the ops autocast does not list in that dtype,
    not float32 (an ``exp`` overflowing float16 in a region meant to keep it in range);
    every other tensor as it is, autocast's to cast."""
    if type(obj) is dict and not obj:
        return obj
    return map_tensors(lambda t: _cast(t, torch.float32) if t.dtype in dtypes else t, obj)


def _device_type(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    module: nn.Module,
    probe: tuple[nn.Module, str] | None = None,
) -> str:
    """The device type the region's autocast must name: an accelerator as soon as an input
    or the module's weights are on one (a CPU tensor passed first, such as sequence lengths,
    must not turn on CPU autocast for a GPU model), else the first tensor's."""
    first = None
    for x in args:
        if isinstance(x, Tensor):
            if x.is_cpu:  # read without building a torch.device
                first = first or "cpu"
                continue
            kind = x.device.type
            if kind not in ("cpu", "meta"):
                return kind
            first = first or kind
    if kwargs:
        for x in kwargs.values():
            if isinstance(x, Tensor):
                kind = x.device.type
                if kind not in ("cpu", "meta"):
                    return kind
                first = first or kind
    # the module's weights: the parameter `probe` names (its owner and key, read in one
    # lookup every call, so that a model moved after `apply` is seen), else its first
    # parameter or buffer
    param = probe[0]._parameters.get(probe[1]) if probe is not None else None
    if param is None:
        own = device_of(module).type
    else:
        own = "cpu" if param.is_cpu else param.device.type
    return own if own not in ("cpu", "meta") else (first or own)


def _weight_probe(module: nn.Module) -> tuple[nn.Module, str] | None:
    """Where `module`'s first parameter lives (owner module, key), for `_device_type`."""
    for name, _ in module.named_parameters():
        owner, _, key = name.rpartition(".")
        return (module.get_submodule(owner) if owner else module), key
    return None


def _signature(module: nn.Module, original: Any) -> inspect.Signature:
    """The signature of the forward a region or island stands for: code that reads
    `inspect.signature(model.forward)` (Hugging Face's Trainer picks the batch keys to keep
    by it) sees the real arguments, not `(*args, **kwargs)`."""
    if original is not None:
        return inspect.signature(original)
    return inspect.signature(type(module).forward.__get__(module))


_SDPA = F.scaled_dot_product_attention


class _Float32Attention(TorchFunctionMode):
    """While on, `scaled_dot_product_attention` computing in `dtype` runs in float32: under
    a mixed policy (`mixed`) where autocast computes in `dtype` on the query's device, under
    a "true" one where autocast is off and the query is in `dtype`; `mixed` None, either
    (an FSDP2 unit: its caller may run autocast or not). Autocast off, every floating
    argument (query, key, value, a float mask) cast to float32, the result cast back to
    `dtype`, the dtype the call would have given. Float32 inputs are used as they are, not
    rounded to `dtype` first. Every other call runs as it is."""

    def __init__(self, dtype: torch.dtype, mixed: bool | None) -> None:
        super().__init__()
        self.dtype = dtype
        self.mixed = mixed

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        query = args[0] if args else kwargs["query"]
        device = query.device.type
        autocast = torch.is_autocast_enabled(device)
        if autocast and self.mixed is not False:
            here = torch.get_autocast_dtype(device) == self.dtype
        else:
            here = not (autocast or self.mixed) and query.dtype == self.dtype
        if not here:
            return func(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            out = func(*cast_floating(args, torch.float32), **cast_floating(kwargs, torch.float32))
        return out.to(self.dtype)


class _StandIn:
    """What a stand-in for a module's `forward` (its `module`, the `original` forward it
    replaced or None for the class's) shows tools inspecting that forward."""

    module: nn.Module
    original: Any

    @property
    def __signature__(self) -> inspect.Signature:
        return _signature(self.module, self.original)

    @property
    def __code__(self) -> Any:
        """The code of the forward it stands in for: tools read a forward's (torch.export's
        non-strict trace names its shapes after it, and failed on a converted model)."""
        forward = type(self.module).forward if self.original is None else self.original
        return forward.__code__

    def _as_is(self, *args: Any, **kwargs: Any) -> Any:
        """The forward it stands in for, called as it is (the class's function with the
        module, not a bound method, which torch.compile rebuilds as the stand-in)."""
        if self.original is None:
            return type(self.module).forward(self.module, *args, **kwargs)
        return self.original(*args, **kwargs)


class _AttentionIsland(_StandIn):
    """Stands in for the `forward` of a module that calls attention under a policy computing
    in `dtype` (`Resolution.float32_attention`): runs it with `_Float32Attention` on. Outside
    the region it may wrap, so the mode sees what the region set up (autocast, the casts).

    Confined to that module's forward because a torch function mode costs a few
    microseconds on every torch call it sees."""

    mixprec_wrapper = True  # (keeps the forward it replaced as `original`)

    def __init__(
        self, module: nn.Module, policy: Policy, original: Any, *, either: bool = False
    ) -> None:
        self.module = module
        self.dtype = policy.compute_dtype
        # (`either`: an FSDP2 unit's, whose caller may run autocast or not)
        self.mixed = None if either else policy.is_mixed
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _Float32Attention(self.dtype, self.mixed):
            return self._as_is(*args, **kwargs)


class _Region(_StandIn):
    """Stands in for one module's `forward`: enters its compute region, casts outputs.

    Stored in the module's `__dict__` under "forward", so `module(...)` and hooks behave
    as before; holds the module itself (not a bound method) so pickling and deepcopy work.
    """

    mixprec_wrapper = True  # (keeps the forward it replaced as `original`)
    uncast: tuple[torch.dtype, ...] = (torch.float64,)  # (a region pickled before it was kept)

    def __init__(
        self,
        module: nn.Module,
        policy: Policy,
        *,
        parent: Policy | None,
        original: Any,
        cast: tuple[str, ...] = (),
        follow_input: bool = False,
    ) -> None:
        self.module = module
        self.autocast = policy.is_mixed
        self.compute_dtype = policy.compute_dtype
        # (a mixed region's inputs taken to float32 first, `_as_float32`)
        self.uncast = (torch.float64, _OTHER_16_BIT.get(policy.compute_dtype, torch.float64))
        # parameters (paths below `module`) the region computes on as compute-dtype copies:
        # those of a policy that `casts_params` (float16 params computing in bfloat16...)
        self.cast = cast
        self.output_dtype = _output_dtype(policy, parent)
        self.root = parent is None  # (the model's own region: its caller's autocast is kept)
        # a "true" model's losses computed in float32 inside its forward (a Hugging Face
        # model's) are handed back so: rounded to 16 bits, float16's scaled loss overflowed
        self.keeps_losses = self.root and not self.autocast
        # a mixed region inside a "true" one computing in another dtype than its weights':
        # that region made its compute dtype torch's default, which this one puts back to
        # its weights' (tensors its forward makes without a dtype matched the parent's)
        self.default = (
            policy.param_dtype
            if self.autocast
            and parent is not None
            and not parent.is_mixed
            and parent.compute_dtype != policy.param_dtype
            else None
        )
        # a module shared by parents that want its result in different dtypes hands it back
        # in its caller's: the dtype of its first floating input, or with none (an
        # embedding's ids) the dtype its caller computes in (`_caller_dtype`)
        self.follow_input = follow_input
        self.mixed_output = (  # (`_output_dtype` inside a mixed parent)
            torch.float32 if policy.output_dtype == torch.float64 else policy.output_dtype
        )
        self.original = original
        self.probe = _weight_probe(module)

    # the modules below a root region whose rule a forward could pass over (`_arm_probe`):
    # looked at in its first eager forward, then emptied
    carriers: tuple[tuple[str, nn.Module, str, tuple[tuple[str, nn.Module], ...]], ...] = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # (empty after the first eager forward, read without a call; a compiled call made
        # before it guards on it, and compiles once more after it)
        if self.carriers and not torch.compiler.is_compiling():
            return self._first(args, kwargs)
        try:  # (no cost in the common case; torch's dtype clash explained where dtypes moved)
            module = self.module
            output_dtype = self.output_dtype
            if self.follow_input:
                output_dtype = next(
                    (t.dtype for t in iter_tensors((args, kwargs)) if t.is_floating_point()),
                    None,
                ) or _caller_dtype(
                    self.mixed_output,
                    _device_type(args, kwargs, module, self.probe),
                    self.compute_dtype,
                )
            # the common case, one plain tensor, tested without a call
            one = not kwargs and args and not args[1:] and type(args[0]) is Tensor
            if self.autocast:
                # a float64 input (a float64 neighbour's output), or one of the other 16-bit
                # dtype, computes as float32 here (`_as_float32`)
                uncast = self.uncast
                if not one or args[0].dtype in uncast:
                    args, kwargs = _as_float32((args, kwargs), uncast)
            elif not one:  # a "true" region computes on its inputs in its own dtype
                if kwargs:  # (one walk: a tensor passed both ways stays one tensor)
                    args, kwargs = cast_floating((args, kwargs), self.compute_dtype)
                else:
                    args = cast_floating(args, self.compute_dtype)
            elif args[0].dtype != self.compute_dtype and args[0].is_floating_point():
                t, dtype = args[0], self.compute_dtype
                # (`_cast`, called only where it may change a value: a call here cost torch.compile
                # a graph of its own before the region's break)
                narrows = not t.requires_grad and (t.dtype, dtype) in _SENTINELS
                args = (_cast(t, dtype) if narrows else t.to(dtype),)
            if self.original is None:
                # the class's function with the module as an argument, never a bound method:
                # torch.compile rebuilds bound methods as `module.forward`, which is this region
                args = (module, *args)
                forward = type(module).forward
            else:
                forward = self.original
            if self.autocast:
                if self.default is not None:  # (rare: not a call on the common path)
                    forward = functools.partial(_with_default_dtype, self.default, forward)
                device_type = _device_type(args, kwargs, module, self.probe)
                if (
                    torch.is_autocast_enabled(device_type)
                    and torch.get_autocast_dtype(device_type) == self.compute_dtype
                ):
                    # This very autocast runs already: the region adds none. The root's caller
                    # runs it (a training step, the precision's forward context): the outputs
                    # stay as autocast made them for the loss computed inside it, as in a
                    # torch.autocast loop. Inside the model (a parent region's, or the caller's
                    # around a layer it calls) a region still hands back its output dtype.
                    out = forward(*args, **kwargs)
                    if self.root:
                        return out
                else:
                    # (dynamo loaded: a torch.compile made, whose code this may call)
                    first = not torch.is_autocast_enabled(device_type) and DYNAMO in sys.modules
                    with torch.autocast(device_type, dtype=self.compute_dtype):
                        # With no autocast before, this one ends with the forward and
                        # its backward runs outside it. Run eagerly, code it calls that
                        # torch.compile traces (a compiled submodule; after a graph
                        # break, the rest of a compiled model, for which dynamo runs
                        # this block eagerly) gets its backward traced so too: under
                        # torch's default ("same_as_forward") a float32 rule's backward
                        # ran in bfloat16. Checked inside the `with`, in this frame,
                        # where dynamo's eager fallback resumes; traced whole, the
                        # autocast is in the graph and nothing surrounds it.
                        if first and not torch.compiler.is_compiling():
                            restore = backward_outside_autocast()
                            try:
                                out = forward(*args, **kwargs)
                            finally:
                                restore()
                        else:
                            out = forward(*args, **kwargs)
            else:
                # A "true" region computes in its own dtype even inside an enclosing autocast (a
                # parent's mixed region, or the caller's): autocast is switched off for it.
                autocast_on = torch._C._is_any_autocast_enabled()
                if self.cast:  # (copies swapped in: one thread at a time, `exclusive`)
                    with exclusive():
                        copies = _compute_copies(module, self.cast, self.compute_dtype)
                        out = self._swapped(forward, args, kwargs, copies, autocast_on)
                elif not (autocast_on or needs_default_dtype(self.compute_dtype)):
                    out = forward(*args, **kwargs)  # (float32 as it is: nothing to set)
                else:
                    out = self._swapped(forward, args, kwargs, {}, autocast_on)
            if self.keeps_losses:
                return _cast_but_losses(out, output_dtype)
            if isinstance(out, Tensor):  # `cast_floating`'s first case, without its call
                if not out.is_floating_point() or out.dtype == output_dtype:
                    return out
                if type(out) is Tensor and output_dtype == torch.float32 and out.dtype != _F64:
                    return out.float()  # a plain tensor's `to(torch.float32)`, parsed faster
                return _cast(out, output_dtype)
            return cast_floating(out, output_dtype)
        except RuntimeError as err:
            if self.autocast:  # (also where the caller's autocast runs it: a training step)
                device_type = _device_type(args, kwargs, self.module, self.probe)
                _explain_rnn_error(err, self.module, device_type, self.compute_dtype)
            _explain_dtype_change(err, self.module)
            raise

    def _first(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The root's first eager forward, watching its `carriers`: a module with a rule
        whose forward did not run while modules only it holds did was passed over (its
        parent iterates, indexes or slices it, an nn.Sequential, or calls its children by
        name), so its rule was not carried out and they ran as their caller computes. Warned
        of once, by path. Not watched where compiled code may run inside (a compiled
        submodule, the eager rest of a compiled model after a graph break): the watch would
        change what its graphs were guarded on, and compile them again at the next step.
        A first forward that raises leaves the watch to the next."""
        carriers, self.carriers = self.carriers, ()
        if _compiled_inside(self.module):
            return _Region.__call__(self, *args, **kwargs)
        ran: set[int] = set()

        def seen(module: nn.Module, _: Any) -> None:
            ran.add(id(module))

        handles, watched = [], []
        try:
            for _, module, _, children in carriers:
                # (its own stand-in watched: a hook misses a call of ``module.forward(x)``)
                watched.append(_Watched.install(module, ran))
                handles.extend(child.register_forward_pre_hook(seen) for _, child in children)
            out = _Region.__call__(self, *args, **kwargs)
        except BaseException:
            self.carriers = carriers
            raise
        finally:
            for handle in handles:
                handle.remove()
            for watch in watched:
                watch.uninstall()
        for path, module, rule, children in carriers:
            called = [name for name, child in children if id(child) in ran]
            if id(module) in ran or not called:
                continue
            names = sorted({name[len(path) + 1 :].split(".")[0] for name in called})
            key = r"\d+" if all(n.isdigit() for n in names) else f"({'|'.join(names)})"
            warnings.warn(
                f"the {rule} of {path!r} ({type(module).__name__}) was not carried out: its "
                f"forward did not run while modules inside it did ({', '.join(called[:3])}"
                f"{', ...' if len(called) > 3 else ''}), called directly (the parent "
                "iterates, indexes or slices it, or calls them by name), so they ran without "
                f"it. Give the rule to the modules it holds in its place "
                f"({re.escape(path)}\\.{key} as a regex key, no rule on {path!r}: they "
                "compute as it does otherwise) or call the module itself (docs/conversion.md)",
                UserWarning,
                stacklevel=caller_level(past_modules=True),
            )
        return out

    def _swapped(
        self,
        forward: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        copies: dict[str, Tensor],
        autocast_on: bool,
    ) -> Any:
        """A "true" region's forward: autocast off, ``copies`` swapped in for the stored
        parameters and torch's default dtype set where needed. Plain `with` blocks, not an
        ExitStack: torch.compile traces them without a break."""
        module = self.module
        off = (
            torch.autocast(_device_type(args, kwargs, module, self.probe), enabled=False)
            if autocast_on
            else contextlib.nullcontext()
        )
        swap = _reparametrize_module(module, copies) if copies else contextlib.nullcontext()
        if needs_default_dtype(self.compute_dtype):
            with default_dtype(self.compute_dtype), off, swap:
                return forward(*args, **kwargs)
        with off, swap:
            return forward(*args, **kwargs)


setattr(_Region, REGION_MARK, True)  # (what layer-swapping tools look for)


class _Watched(_StandIn):
    """A module's forward stand-in, for the root's first forward (`_Region._first`): notes
    the module ran, then runs what stood there."""

    def __init__(self, module: nn.Module, ran: set[int]) -> None:
        self.module, self.ran = module, ran
        self.original = module.__dict__.get("forward")

    @classmethod
    def install(cls, module: nn.Module, ran: set[int]) -> _Watched:
        watch = cls(module, ran)
        module.__dict__["forward"] = watch
        return watch

    def uninstall(self) -> None:
        if self.module.__dict__.get("forward") is self:  # (unless replaced meanwhile)
            if self.original is None:
                del self.module.__dict__["forward"]
            else:
                self.module.__dict__["forward"] = self.original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.ran.add(id(self.module))
        return self._as_is(*args, **kwargs)


def _compiled_inside(model: nn.Module) -> bool:
    """Whether compiled code may run in `model`'s forward now: dynamo's frame evaluation is
    on (the eager rest of a compiled call), or a module of it is compiled in place."""
    if DYNAMO not in sys.modules:
        return False
    if torch._C._dynamo.eval_frame.get_eval_frame_callback() is not None:
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


class _Inside(threading.local):
    """The converted models (their `_Family`) whose counted regions run in this thread now,
    eagerly, and how deep: an `_Entry` of a model running is called from its forward."""

    def __init__(self) -> None:
        self.running: dict[_Family, int] = {}


class _Family:
    """What the regions and entries one `apply` installed share: the model they belong to
    (compared by identity; a deepcopy of the model copies it once, for all of them), and how
    deep its counted regions are being traced by torch.compile now (`_CountedRegion`)."""

    def __init__(self) -> None:
        # (on the instance from the start: dynamo's replay of the count writes it there,
        # and a guard on its absence would recompile every model at its second call)
        self.traced = 0
        # its counted regions running eagerly now, in any thread: what a traced entry reads
        # (dynamo guards this by value; `_INSIDE`'s keys it does not tell apart)
        self.eager = 0

    def __getstate__(self) -> dict[str, int]:
        """A copy (deepcopy, pickle) runs nothing: a copy taken while a forward ran (an
        asynchronous checkpoint, an EMA snapshot) kept its count forever, and its entries
        compiled on their own passed through, in float32."""
        return {"traced": 0, "eager": 0}


_INSIDE = _Inside()


class _CountedRegion(_Region):
    """A region of a module holding entries (`_Entry`) of its model (``family``): counts
    that model running in `_INSIDE` while it runs eagerly (a region without entries below
    costs no call more)."""

    family: _Family | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # (traced: counted on the family, for the trace)
            family = self.family
            family.traced += 1  # type: ignore[union-attr]
            try:
                return super().__call__(*args, **kwargs)
            finally:
                family.traced -= 1  # type: ignore[union-attr]
        return _counted(self.family, super().__call__, args, kwargs)  # type: ignore[arg-type]


def _counted(family: _Family, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``forward(*args, **kwargs)`` with ``family``'s model counted as running eagerly, in
    this thread (`_INSIDE`) and in any (``family.eager``)."""
    running = _INSIDE.running
    running[family] = running.get(family, 0) + 1
    family.eager += 1
    try:
        return forward(*args, **kwargs)
    finally:
        family.eager -= 1
        if running[family] == 1:
            del running[family]
        else:
            running[family] -= 1


class _Entry(_CountedRegion):
    """Stands in for the forward of a module inside a mixed region that computes as its
    caller does (no region of its own, `_regions`): called while its own model's forward
    runs (its parent's, which may have switched autocast off or to another dtype for it on
    purpose) or under its own autocast, it runs as it is, nothing cast; called from outside
    its model's forward (a Hugging Face ``generate`` calls ``get_encoder()`` directly;
    another model's forward calls it), it enters its policy's region as the root does,
    where it computed in float32 or in its caller's dtype. Recomputed by torch's checkpoint
    in the backward, it enters its region again where its forward in that checkpoint did
    (checkpointed from outside its model, its recomputation ran in float32: the checkpoint
    records it, `_checkpoints_around`), else runs as it is, also where the checkpoint
    recomputed is an outer one, around a plain function that ran inside the model. Run as
    it is from outside its model's forward (its own autocast, a recomputation), its model
    counts as running, so its children run as inside it (a float32 router stays float32). Traced by
    torch.compile, it runs as it is inside its model's traced regions (counted on the
    family) or under its own autocast, else enters its region (compiled on its own,
    ``torch.compile(model.get_encoder())`` ran in float32)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        family = self.family
        if torch.compiler.is_compiling():  # (a region traced, or one running eagerly around)
            through = family.traced > 0 or family.eager > 0  # type: ignore[union-attr]
            through = through or self._under_own_autocast(args, kwargs)
        elif family in _INSIDE.running:
            through = True
        else:
            recomputed, forwards = _checkpoints_around()
            through = self._under_own_autocast(args, kwargs)
            if recomputed is not None and not through:  # (as its forward ran there)
                through = id(self) not in getattr(recomputed, _MARK, ())
            if not through:  # (said on every checkpoint around whose forward runs now)
                for record in forwards:
                    marks = getattr(record, _MARK, None)
                    if marks is None:
                        marks = set()
                        setattr(record, _MARK, marks)
                    marks.add(id(self))
            if through:  # (counted as inside its model: so its children run as there, a
                # float32 router its forward runs with autocast off staying float32)
                return _counted(family, self._as_is, args, kwargs)  # type: ignore[arg-type]
        if through:
            return self._as_is(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def _under_own_autocast(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        device_type = _device_type(args, kwargs, self.module, self.probe)
        return (
            torch.is_autocast_enabled(device_type)
            and torch.get_autocast_dtype(device_type) == self.compute_dtype
        )


# the attribute of a torch checkpoint's record (`_checkpoints_around`) naming the entries
# (by id) that entered their region in its forward (once is enough: a call under its own
# autocast from the same forward recomputes under it again, and passes through)
_MARK = "_mixprec_entries_entered"
_CHECKPOINT = inspect.unwrap(torch.utils.checkpoint.checkpoint).__code__
_REENTRANT_FORWARD = torch.utils.checkpoint.CheckpointFunction.forward.__code__
_REENTRANT_BACKWARD = torch.utils.checkpoint.CheckpointFunction.backward.__code__
_HOOKS = [
    code
    for code in torch.utils.checkpoint._checkpoint_hook.__init__.__code__.co_consts
    if inspect.iscode(code)
]
# the non-reentrant checkpoint's unpack hooks, which recompute, and its pack hook
_RECOMPUTING = frozenset(code for code in _HOOKS if code.co_name == "unpack_hook")
_CHECKPOINT_PACK = next((code for code in _HOOKS if code.co_name == "pack_hook"), None)


def _checkpoints_around() -> tuple[Any, list[Any]]:
    """(the record of the innermost torch checkpoint recomputing its function in the
    backward around the caller, or None; the records of the checkpoints whose forwards run
    inside that recomputation, or of every one around the caller where none recomputes,
    innermost first), found on the stack. A record, the same object in a checkpoint's
    forward and in its recomputation, is where an entry that entered its region in the
    forward says so, for the recomputation to enter it alike; said on every checkpoint
    around, so that the recomputation of an outer one (around a plain function, whose
    forward ran the entry inside its model or entered it) finds it too: a reentrant
    checkpoint's ``ctx``; a non-reentrant one's frame (its generator's ``new_frame``, or the
    composable checkpoint's saved-tensor hooks' ``frame``, while the forward runs; its
    unpack hook's ``frame`` while it recomputes)."""
    # (the innermost forward's hooks: a composable checkpoint runs no function of its own;
    # in a backward only hooks pushed in the recomputation are active)
    hooked = _hooked_checkpoint()
    forwards = [] if hooked is None else [hooked]
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        record = None
        if code in _RECOMPUTING or code is _REENTRANT_BACKWARD:
            return frame.f_locals.get("frame" if code in _RECOMPUTING else "ctx"), forwards
        if code is _REENTRANT_FORWARD:
            record = frame.f_locals.get("ctx")
        elif code is _CHECKPOINT:
            inner = getattr(frame.f_locals.get("gen"), "gi_frame", None)
            record = None if inner is None else inner.f_locals.get("new_frame")
        elif code is _MODULE_CALL:  # (a module torch's composable checkpoint runs)
            record = _composable_record(frame.f_locals.get("self"))
        if record is not None and all(record is not seen for seen in forwards):
            forwards.append(record)
        frame = frame.f_back
    return None, forwards


_MODULE_CALL = nn.Module._call_impl.__code__


def _composable_record(module: Any) -> Any:
    """The frame of torch's composable checkpoint whose forward ``module`` runs now (its
    hooks keep the checkpoint's generator on the module while it runs), or None: found so
    even where other saved-tensor hooks (``save_on_cpu``, an activation option's) cover its
    own."""
    if not isinstance(module, nn.Module) or not torch.distributed.is_available():
        return None
    from torch.distributed._composable import checkpoint as composable

    gen = getattr(composable.state(module), "_ac_generator", None)
    inner = getattr(gen, "gi_frame", None)
    return None if inner is None else inner.f_locals.get("new_frame")


def _hooked_checkpoint() -> Any:
    """The frame of the non-reentrant checkpoint whose saved-tensor hooks are the innermost
    (torch's composable checkpoint runs no function of its own around the forward, only
    them), or None."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    pack = hooks[0] if hooks else None
    if getattr(pack, "__code__", None) is not _CHECKPOINT_PACK:
        return None
    cells = dict(zip(pack.__code__.co_freevars, pack.__closure__ or (), strict=True))
    return cells["frame"].cell_contents if "frame" in cells else None


def _with_default_dtype(dtype: torch.dtype, forward: Any, *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)`` with `dtype` torch's default dtype (`_Region.default`)."""
    with default_dtype(dtype):
        return forward(*args, **kwargs)


_LAZY = nn.parameter.UninitializedParameter


def _compute_copies(
    module: nn.Module, names: tuple[str, ...], dtype: torch.dtype
) -> dict[str, Tensor]:
    """The parameters `names` of `module` cast to `dtype` for one forward: differentiable
    copies, so gradients flow back to the stored parameters in their own dtype. A parameter
    tied under two names gets one copy; one an enclosing region swapped already is left, and
    so is a lazy layer's, not yet materialized (its hook gives it a shape when the layer is
    called, and the layer's own region casts it then)."""
    copies: dict[int, Tensor] = {}
    out = {}
    for name in names:
        owner, _, key = name.rpartition(".")
        param = (module.get_submodule(owner) if owner else module)._parameters[key]
        if param.dtype == dtype or isinstance(param, _LAZY):
            continue
        copy = copies.get(id(param))
        if copy is None:
            copy = copies[id(param)] = param.to(dtype)
            mark_region_cast(copy, param)
        out[name] = copy
    return out


def _explain_rnn_error(
    err: RuntimeError, module: nn.Module, device_type: str, dtype: torch.dtype
) -> None:
    """Turn oneDNN's refusal of a 16-bit RNN under CPU autocast into the known limitation."""
    if device_type != "cpu" or dtype not in (torch.float16, torch.bfloat16):
        return
    if "primitive" not in str(err):  # oneDNN: "could not create a primitive descriptor ..."
        return
    rnns = {name or "<root>": m for name, m in module.named_modules() if isinstance(m, nn.RNNBase)}
    if rnns:
        kinds = sorted({type(m).__name__ for m in rnns.values()})
        rule = ", ".join(f"nn.{k}: 'float32'" for k in kinds)
        raise PrecisionError(
            f"torch's CPU autocast has no {dtype_name(dtype)} kernel for RNN layers on this "
            f"CPU ({', '.join(rnns)}), so {dtype_name(dtype)} mixed precision cannot run them "
            f"here. Give them a float32 rule: PolicyMap(..., {{{rule}}})"
        ) from err


@dataclass
class AppliedState:
    """What `apply` left on the root module: the map used, the dtypes it replaced and
    those it set its parameters to."""

    policy: PolicyMap
    original_dtypes: dict[tuple[str, str], torch.dtype]
    applied_dtypes: dict[tuple[str, str], torch.dtype] = field(default_factory=dict)


def _explain_dtype_change(err: RuntimeError, module: nn.Module) -> None:
    """Turn torch's dtype clash inside a region into what caused it, where a model's
    parameters changed dtype after `apply` (``model.half()``, ``.float()``,
    ``.to(dtype)``): the regions still cast inputs to the dtypes `apply` chose. Other errors
    (a shape, out of memory) and buffers a model re-registers itself (a cache made in its
    input's dtype) are left as they are."""
    if type(err) is not RuntimeError or not _DTYPE_CLASH.search(str(err)):
        return
    for owner in list(_OWNERS.get(module, ())):
        state = owner.__dict__.get(_STATE)
        if state is None or not state.applied_dtypes:
            continue
        now = _floating_dtypes(owner, buffers=False)
        moved = [
            (name, key, was, now[name, key])
            for (name, key), was in state.applied_dtypes.items()
            if (name, key) in now and now[name, key] != was
        ]
        if moved:
            name, key, was, is_ = moved[0]
            where = f"{name}.{key}" if name else key
            raise DtypeChangedError(
                f"{type(owner).__name__}'s {where} is {dtype_name(is_)}, but mixprec.apply "
                f"set it to {dtype_name(was)} ({len(moved)} of its parameters changed dtype "
                "since, as .half(), .float() or .to(dtype) change them) while its regions "
                "still cast inputs as apply chose. To compute in another precision, call "
                "mixprec.apply(model, policy) with it (mixprec.remove(model) puts the "
                f"original dtypes back). Torch said: {err}"
            ) from err


# torch's words for operands of different dtypes ("mat1 and mat2 must have the same dtype",
# "expected scalar type Float but found BFloat16", "mixed dtype (CPU)")
_DTYPE_CLASH = re.compile(r"dtype|scalar type|BFloat16|Half|Float|Double")


def _region_key(p: Policy) -> tuple[bool, torch.dtype, torch.dtype]:
    return (p.is_mixed, p.compute_dtype, p.output_dtype)


_STAND_INS = (_Region, _AttentionIsland, ActivationForward)
# the modules whose forward `apply` replaced with one of mixprec's stand-ins
_INSTALLED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _record_installed(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), _STAND_INS):
            _INSTALLED.add(module)
        else:
            _INSTALLED.discard(module)


def _check_forwards(model: nn.Module) -> None:
    """Refuse, before anything changes, a model a forward of which `apply` replaced with
    its own and something else replaced since (a wrapper around it: a user's, a library's):
    mixprec's region would stay inside that wrapper, unseen, and a re-apply or `remove`
    would leave it computing as before, silently. (A forward deleted since holds nothing.)"""
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if module in _INSTALLED and forward is not None and not isinstance(forward, _STAND_INS):
            raise PolicySpecError(
                f"the forward of {name or '<root>'!r} ({type(module).__name__}) was replaced "
                f"after mixprec.apply, by {forward!r}: mixprec's region may be inside it, "
                "where neither a new policy nor mixprec.remove can reach it. Put back the "
                "forward apply left in its place, or build the model again"
            )


def _strip_regions(model: nn.Module) -> None:
    for module in model.modules():
        region = module.__dict__.get("forward")
        while isinstance(region, _STAND_INS):
            if region.original is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = region.original
            region = region.original


def _convert(plan: list[tuple[nn.Module, str, str, torch.dtype]], paths: dict[int, str]) -> None:
    """Cast each tensor of `plan` (`dtype_plan`), then warn of finite values the casts made
    infinities (`_warn_lost`; ``paths``: each module's path, by id)."""
    # under inference_mode the converted tensors would be inference tensors, which can
    # never be trained again: convert as plain tensors whatever the caller's mode
    converted: dict[int, Tensor] = {}  # a buffer shared by two modules stays shared
    casts = CodeCasts()  # codes shared by two layers (a tied embedding and head) stay shared
    lost: list[tuple[str, torch.dtype, int, float]] = []
    with torch.inference_mode(False):
        for module, kind, key, dtype in plan:
            if kind == "parameter":
                t = module._parameters[key]
                if t.dtype == dtype:  # shared with a module converted before
                    continue
                old = t.data
                t.data = old.to(dtype)
                if t.grad is not None:
                    t.grad = t.grad.to(dtype)
                new = t.data
            else:
                old = module._buffers[key]
                first = id(old) not in converted
                cast_buffer(module, key, dtype, casts, converted)
                new = module._buffers[key]
                if not first or new is old or isinstance(module, ScaledCodes):
                    continue  # (once; a quantized layer's scales are its own business)
            found = _lost_to_infinity(old, new)
            if found is not None:
                path = paths.get(id(module), "")
                lost.append((f"{path}.{key}" if path else key, dtype, *found))
    _warn_lost(lost, "mixprec.apply stores")


def _lost_to_infinity(old: Tensor, new: Tensor) -> tuple[int, float] | None:
    """(how many, the largest magnitude) of the finite values of ``old`` that its narrowing
    cast ``new`` holds as infinities (float32 weights past float16's range under 16-true);
    None where there are none. A reduction only (``aminmax``), unless a value is past the
    new dtype's range: checks every tensor at `apply` without copies of it."""
    if (old.dtype, new.dtype) not in _SENTINELS or old.is_meta or old.is_nested:
        return None
    if old.layout is not torch.strided:  # (sparse: its stored values)
        old, new = _sparse_values(old), _sparse_values(new)  # type: ignore[assignment]
        if old is None or new is None:
            return None
    if not old.numel():
        return None
    low, high = torch.aminmax(old.detach())
    limit = torch.finfo(new.dtype).max
    if -limit <= float(low) and float(high) <= limit:
        return None
    gone = new.isinf() & old.isfinite()
    count = int(gone.sum())
    return (count, float(old.detach().abs()[gone].max())) if count else None


def _warn_lost(lost: list[tuple[str, torch.dtype, int, float]], doing: str) -> None:
    """One warning per dtype of the finite values casts made infinities (``lost``: path,
    dtype, how many, the largest magnitude), naming the tensors."""
    for dtype in dict.fromkeys(d for _, d, _, _ in lost):
        here = [(path, n, top) for path, d, n, top in lost if d == dtype]
        count = sum(n for _, n, _ in here)
        names = [path for path, _, _ in here]
        warnings.warn(
            f"{doing} {count} finite value{'s' if count != 1 else ''} of "
            f"{', '.join(names[:5])}{', ...' if len(names) > 5 else ''} as infinities: past "
            f"{dtype_name(dtype)}'s range ({torch.finfo(dtype).max:g}; the largest of them "
            f"{max(top for _, _, top in here):g}). What reads them computes inf or NaN, and "
            "float32 masters made from them, or mixprec.remove, cannot give the values back. "
            "Keep their layers wider with a rule (PolicyMap(policy, {path: '32-true'})), "
            "bring the values into range first, or use bfloat16 (float32's range)",
            UserWarning,
            stacklevel=caller_level(past_modules=True),
        )


def _load_cast(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    *_: Any,
) -> None:
    """A converted module's ``load_state_dict`` pre-hook (`apply` and `sharding.shard`
    register it, `remove` takes it off): a floating value loaded into a narrower tensor of
    the module is cast as `apply` casts: a buffer by `_cast` (a float32 mask's lowest value
    stays finite, not the -inf a plain copy made), a parameter as it is; finite values made
    infinities are warned of. Torch's ``assign=True`` takes the checkpoint's tensors as they are."""
    if local_metadata.get("assign_to_params_buffers"):
        return
    lost: list[tuple[str, torch.dtype, int, float]] = []
    skip = module._non_persistent_buffers_set
    for buffers, store in ((False, module._parameters), (True, module._buffers)):
        for key, t in store.items():
            value = state_dict.get(prefix + key)
            if (
                t is None
                or not isinstance(value, Tensor)
                or (value.dtype, t.dtype) not in _SENTINELS  # (no narrowing: torch's copy)
                or value.shape != t.shape
                or (buffers and key in skip)
            ):
                continue
            value = value.detach()
            new = state_dict[prefix + key] = _cast(value, t.dtype) if buffers else value.to(t.dtype)
            found = _lost_to_infinity(value, new)
            if found is not None:
                lost.append((prefix + key, t.dtype, *found))
    _warn_lost(lost, "load_state_dict stores")


def hook_loads(model: nn.Module) -> None:
    """Register `_load_cast` on each module of ``model`` holding floating tensors, once."""
    for module in model.modules():
        hooks = module._load_state_dict_pre_hooks.values()
        if any(getattr(h, "hook", None) is _load_cast for h in hooks):
            continue
        own = (*module._parameters.values(), *module._buffers.values())
        if any(t is not None and t.is_floating_point() for t in own):
            module._register_load_state_dict_pre_hook(_load_cast, with_module=True)


def _unhook_loads(model: nn.Module) -> None:
    """Take `_load_cast` off every module of ``model`` (`remove`)."""
    for module in model.modules():
        hooks = module._load_state_dict_pre_hooks
        for key in [k for k, h in hooks.items() if getattr(h, "hook", None) is _load_cast]:
            del hooks[key]


def cast_buffer(
    module: nn.Module, key: str, dtype: torch.dtype, casts: CodeCasts, done: dict[int, Tensor]
) -> None:
    """Store ``module``'s buffer ``key`` in ``dtype``. A quantized layer's scales change with
    its codes (`ScaledCodes.cast_scales`: requantized where a rounded scale would no longer
    cover its row; `check_scales` makes sure the dtype can hold them), the codes of layers
    sharing them once (``casts``); any other buffer is cast once (``done``, by the old
    tensor's id), so one shared by two modules stays shared, as inputs are cast (`_cast`: a
    causal mask filled with float32's lowest value keeps bfloat16's, not -inf)."""
    t = module._buffers[key]
    if key == "weight_scale" and isinstance(module, ScaledCodes):
        module.cast_scales(dtype, casts)
        done[id(t)] = module.weight_scale
    elif id(t) not in done:
        module._buffers[key] = done[id(t)] = _cast(t, dtype)
    else:
        module._buffers[key] = done[id(t)]


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"apply needs an nn.Module, got {type(model).__name__}; pass the model, then the "
            "policy: mixprec.apply(model, 'bf16-mixed')"
        )
    sharded = sharded_units(model)
    if sharded:
        raise TypeError(
            f"cannot apply a policy to a model sharded by FSDP2 ({', '.join(sharded)}): FSDP2 "
            "casts per unit from the policy it was sharded with; give the policy to "
            "mixprec.shard(model, policy) on the unsharded model instead"
        )
    scripted = [
        name or "<root>"
        for name, m in model.named_modules()
        if isinstance(m, torch.jit.ScriptModule)
    ]
    if scripted:
        raise TypeError(
            f"cannot apply a policy to TorchScript modules ({', '.join(scripted)}): their "
            "forward is compiled and cannot be wrapped; apply the policy to the eager module "
            "first, then torch.jit.trace / torch.jit.script it (or use torch.compile)"
        )


def sharded_units(model: nn.Module) -> list[str]:
    """The paths of `model`'s modules that FSDP2's ``fully_shard`` has sharded ("<root>" for
    the model itself); none without torch.distributed.fsdp loaded (nothing can be sharded)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return []
    return [name or "<root>" for name, m in model.named_modules() if isinstance(m, fsdp.FSDPModule)]


def warn_unmatched(pmap: PolicyMap, model: nn.Module) -> None:
    """A path rule that matches no module is a typo far more often than intent: say so, in
    one warning for all of them (a generated map may hold thousands); activation rules
    likewise, in a warning of their own."""
    if pmap.activations is not None:
        pmap.activations.warn_unmatched(model, stacklevel=3)
    pmap.warn_unmatched_rules(model, stacklevel=3)


def _floating_dtypes(
    model: nn.Module, *, buffers: bool = True
) -> dict[tuple[str, str], torch.dtype]:
    """Dtype of every floating parameter and (``buffers``) buffer, persistent or not, by
    (owner, key)."""
    return {
        (name, key): t.dtype
        for name, module in model.named_modules()
        for store in ((module._parameters, module._buffers) if buffers else (module._parameters,))
        for key, t in store.items()
        if t is not None and t.is_floating_point()
    }


def _after_swap(model: nn.Module, resolved: dict[str, Resolution]) -> dict[str, Resolution]:
    """Resolutions for the modules after quantized layers replaced float ones: a path keeps
    its resolution, a path new below a swapped layer takes its nearest ancestor's."""
    out: dict[str, Resolution] = {}
    for name, _ in model.named_modules(remove_duplicate=False):
        up = name
        while up not in resolved:
            up = up.rpartition(".")[0]
        out[name] = resolved[up]
    return out


def apply(model: nn.Module, policy: Any = None, *, warn: bool = True) -> nn.Module:
    """Convert `model` in place to `policy` (a spec, Policy or PolicyMap; None: the global
    policy) and return it. Re-applying replaces the previous policy cleanly.

    Under a quantized policy (or rule) the layers it can quantize are swapped for quantized
    ones (see `mixprec.quantize`; a one-way change that `remove` keeps) and everything else
    follows its source float policy.

    Warns when the policy is slow or refused on the model's device, and when path rules
    match no module (one warning naming them); `warn=False` warns of neither.

    Of a torch.compile wrapper, its model is converted (rule paths are the model's) and the
    wrapper returned: on the wrapper, regions would enter autocast outside the compiled
    graph, whose backward then ran in 16 bits in float32 layers."""
    if compiled_wrapper(model):
        apply(model._orig_mod, policy, warn=warn)
        return model
    _check_model(model)
    _check_nesting(model)
    pmap = as_map(policy)
    if warn:
        warn_if_unsupported(pmap, device_of(model))
    state: AppliedState | None = model.__dict__.get(_STATE)
    device = device_of(model)
    slow = device_slow_attention(device)
    resolved = pmap.resolve(model, slow_attention=slow, device_type=device.type)
    if warn:
        warn_unmatched(pmap, model)
    if pmap.activations is not None:
        check_activations(model, pmap.activation_choices(model))
    # everything that can refuse the policy runs before the model changes: a refused
    # re-apply leaves the previous policy in place, weights unrounded
    check_bypassed(model, resolved)
    _check_shared(model, resolved, slow)
    if state is not None:
        _check_forwards(model)
    dtype_plan(model, resolved, replaced=True)
    check_scales(model, resolved)
    if state is None:
        original = _floating_dtypes(model)
    else:
        # (the dtypes the first apply found; a tensor added since is recorded as it is now)
        original = {**_floating_dtypes(model), **state.original_dtypes}
        _strip_regions(model)
    to_quantize = {name: r.policy for name, r in resolved.items() if r.quantized}
    if to_quantize:  # on plain forwards: layers with a region are not swapped
        try:
            quantize_modules(model, to_quantize)  # type: ignore[arg-type]
        except Exception:
            # quantize checks every layer (finite weights...) before it swaps any: the
            # model is as it was but for the regions and activation wrappers, which go back
            if state is not None:
                _install_regions(
                    model,
                    state.policy.resolve(model, slow_attention=slow, device_type=device.type),
                )
                if state.policy.activations is not None:  # (stripped with the regions)
                    install_activations(model, state.policy.activation_choices(model))
            raise
        resolved = _after_swap(model, resolved)
    _convert(dtype_plan(model, resolved), {id(m): n for n, m in model.named_modules()})
    hook_loads(model)  # (a checkpoint loaded after apply is cast as apply casts)
    _install_regions(model, resolved)
    if pmap.activations is not None:  # outside the regions
        install_activations(model, pmap.activation_choices(model))
    set_fast_paths(model)  # torch's fused transformer layers would pass regions over
    _arm_probe(model, resolved)
    model.__dict__[_STATE] = AppliedState(pmap, original, _floating_dtypes(model, buffers=False))
    _record_installed(model)
    for module in model.modules():
        _OWNERS.setdefault(module, weakref.WeakSet()).add(model)
    return model


def check_scales(model: nn.Module, resolved: dict[str, Resolution]) -> None:
    """Refuse, before anything changes, a policy storing a quantized layer's scales in a
    dtype that cannot hold them (`ScaledCodes.scales_refused`: a float16 scale whose product
    with the largest code is past its range), naming the layer and what is accepted."""
    seen: set[int] = set()  # (shared scales are asked once)
    for name, module in model.named_modules():
        if not isinstance(module, ScaledCodes) or id(module.weight_scale) in seen:
            continue
        seen.add(id(module.weight_scale))
        policy = resolved[name].policy
        why = module.scales_refused(policy.buffer_dtype)
        if why is not None:
            path = name or "<root>"
            raise PolicySpecError(
                f"{path!r} ({type(module).__name__}) cannot store its scales in "
                f"{policy.buffer_dtype}, as {policy.name!r} would: {why}. Accepted: a "
                "policy storing them in bfloat16 or float32 (bf16-true, bf16-mixed, "
                "16-mixed), or a rule keeping this layer in float32: "
                f"PolicyMap(policy, {{{path!r}: '32-true'}})"
            )


# each module of an applied model -> the applied models holding it (weakly, all): a module
# shared by two models is asked whether both apply it the same policy (`_check_shared`)
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[nn.Module]] = (
    weakref.WeakKeyDictionary()
)


def _check_shared(model: nn.Module, resolved: dict[str, Resolution], slow: bool) -> None:
    """Refuse to apply a policy to a module that another applied model holds too (a layer,
    an embedding shared between a student and a teacher) unless both models give it the
    same policy: its region, its weights' dtype and its forward are one module's, so the
    second policy would silently change how the first model runs it (a shared Linear of a
    bf16-mixed model given a float32 rule in another computed in float32 in both). A layer
    of an applied model applied a policy of its own, as the model, is an override on purpose
    and is not asked."""
    conflict = _shared_conflict(model, resolved, slow)
    if conflict is not None:  # (a model dropped but not yet collected holds nothing)
        gc.collect()
        conflict = _shared_conflict(model, resolved, slow)
    if conflict is not None:
        raise PolicySpecError(conflict)


def _shared_conflict(model: nn.Module, resolved: dict[str, Resolution], slow: bool) -> str | None:
    """What `_check_shared` refuses, or None."""
    # another applied model -> (its modules' paths, its policy per path), made once
    others: dict[int, tuple[dict[int, str], dict[str, Resolution]]] = {}
    for name, module in model.named_modules():
        if not name:  # (a layer of an applied model given a policy of its own, on purpose)
            continue
        for other in list(_OWNERS.get(module, ())):
            if other is model or _STATE not in other.__dict__:
                continue
            if id(other) not in others:
                paths = {id(m): path for path, m in other.named_modules()}
                theirs = other.__dict__[_STATE].policy.resolve(
                    other, slow_attention=slow, device_type=device_of(other).type
                )
                others[id(other)] = (paths, theirs)
            paths, theirs = others[id(other)]
            path = paths.get(id(module))
            if path is None:  # (no longer in that model)
                continue
            policy = theirs[path].policy
            if policy != resolved[name].policy:
                return (
                    f"{name!r} ({type(module).__name__}) is also {path or '<root>'!r} of "
                    f"another model mixprec.apply converted, under {policy.name!r}; this map "
                    f"gives it {resolved[name].policy.name!r}. A shared module runs under one "
                    "policy: give it the same rule in both maps, or remove the other model's "
                    "policy first"
                )
    return None


def _check_nesting(model: nn.Module) -> None:
    """Refuse `apply` to a model holding a module converted by an `apply` of its own, or to
    a module inside a model an `apply` converted: each would cast and wrap the same layers
    (the inner policy's regions kept running under the outer one, its dtypes recorded after
    the outer's, so that `remove` gave bfloat16 weights back)."""
    for name, module in model.named_modules():
        if name and _STATE in module.__dict__:
            raise PolicySpecError(
                f"{name!r} was converted by an apply of its own: remove that first "
                f"(mixprec.remove(model.get_submodule({name!r}))), then give {name!r} its "
                "policy as a rule of this map"
            )
    if _STATE not in model.__dict__ and any(
        isinstance(m.__dict__.get("forward"), (_Region, _AttentionIsland, ActivationForward))
        for m in model.modules()
    ):
        raise PolicySpecError(
            f"this {type(model).__name__} is part of a model mixprec.apply converted: give it "
            "a rule in that model's policy map (its path), or remove that model's policy first"
        )


def _install_regions(model: nn.Module, resolved: dict[str, Resolution]) -> None:
    regions = _regions(model, resolved)
    policies = {id(module): policy for module, policy, _, _ in regions}
    entries = _entries(model, resolved, policies)
    above = _above(model, {id(entry) for entry, _ in entries})
    family = _Family()
    for module, policy_here, parent, follow_input in regions:
        cast = () if policy_here.is_mixed else _to_cast(module, policy_here, policies)
        kind = _CountedRegion if id(module) in above else _Region
        region = module.__dict__["forward"] = kind(
            module,
            policy_here,
            parent=parent,
            original=module.__dict__.get("forward"),
            cast=cast,
            follow_input=follow_input,
        )
        if kind is _CountedRegion:
            region.family = family
    for module, policy_here in entries:
        forward = module.__dict__.get("forward")
        entry = _Entry(module, policy_here, parent=None, original=forward)
        entry.family = family
        module.__dict__["forward"] = entry
    install_attention_islands(model, resolved)


def _arm_probe(model: nn.Module, resolved: dict[str, Resolution]) -> None:
    """Give `model`'s root region the modules whose rule (a policy region of their own, an
    activation option) a forward could pass over, each with the modules only it holds that
    a parent could call directly (`_Region._first`)."""
    root = model.__dict__.get("forward")
    while root is not None and not isinstance(root, _Region):
        root = getattr(root, "original", None)
    if root is None:
        return
    paths = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    carriers = []
    for path, module in model.named_modules():
        if not path or never_called(module):
            continue
        rule = _rule_of(module, resolved[path].policy)
        children = tuple(
            (f"{path}.{name}", child)
            for name, child in _called_children(module)
            if paths[id(child)] == 1  # (shared: the other path may call it)
        )
        if rule is not None and children:
            carriers.append((path, module, rule, children))
    root.carriers = tuple(carriers)


def _rule_of(module: nn.Module, policy: Policy) -> str | None:
    """What `module`'s stand-ins carry out that its children do not on their own: its
    activation option, its region's policy (an `_Entry` computes as its caller does)."""
    said = []
    forward = module.__dict__.get("forward")
    while forward is not None:
        if isinstance(forward, ActivationForward):
            said.append(f"activation option {forward.option!r}")
        elif isinstance(forward, _Region) and not isinstance(forward, _Entry):
            said.append(f"policy {str(policy)!r}")
        forward = getattr(forward, "original", None)
    return " and ".join(reversed(said)) or None


def _called_children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """`module`'s children that a forward calls, past containers nothing calls."""
    found = []
    for name, child in module.named_children():
        if never_called(child):
            found.extend((f"{name}.{n}", c) for n, c in _called_children(child))
        else:
            found.append((name, child))
    return found


def _above(model: nn.Module, targets: set[int]) -> set[int]:
    """The ids of the modules of `model` holding one of `targets` (ids) below them."""
    paths: dict[str, nn.Module] = {}
    found: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        paths[name] = module
        if id(module) in targets:
            parts = name.split(".") if name else []
            found.update(id(paths[".".join(parts[:i])]) for i in range(len(parts)))
    return found


def _entries(
    model: nn.Module, resolved: dict[str, Resolution], regions: dict[int, Policy]
) -> list[tuple[nn.Module, Policy]]:
    """(module, policy) of each module with modules of its own that computes in a mixed
    region without one of its own (`_Entry`): a caller may reach it directly. Leaves are
    left out (a layer called alone computes in its inputs' dtype, as a plain one does)."""
    found: dict[int, tuple[nn.Module, Policy]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        here = resolved[name].policy
        if (
            name
            and here.is_mixed
            and id(module) not in regions
            and not never_called(module)
            and next(iter(module.children()), None) is not None
        ):
            found.setdefault(id(module), (module, here))
    return list(found.values())


def install_attention_islands(
    model: nn.Module, resolved: dict[str, Resolution], *, either: bool = False
) -> None:
    """Run attention in float32 in the modules `resolved` says so of
    (`Resolution.float32_attention`). `either`: under autocast or without it, as FSDP2's
    units run (`mixprec.sharding.shard`: FSDP2 casts, and the caller may add autocast), in
    place of the policy's way (autocast for a mixed policy, `apply`)."""
    islands: set[int] = set()  # a module at two paths resolves alike at both: one island
    for name, module in model.named_modules(remove_duplicate=False):
        res = resolved[name]
        if res.float32_attention is None or id(module) in islands:
            continue
        islands.add(id(module))
        module.__dict__["forward"] = _AttentionIsland(
            module, res.policy, module.__dict__.get("forward"), either=either
        )


def device_slow_attention(device: torch.device) -> frozenset[torch.dtype]:
    """`hardware.slow_attention` of `device` (as `assume` may describe it): the 16-bit
    dtypes whose attention a policy computing in them runs in float32 there. Only CPUs have any, so
    nothing is detected elsewhere (a model on the meta device)."""
    return slow_attention(detect(device)) if device.type == "cpu" else frozenset()


def explain(
    model: nn.Module,
    policy: Any = None,
    *,
    device: torch.device | str | None = None,
    optimizer_states: str | None = None,
    batch: Any = None,
) -> Explanation:
    """What each layer of `model` runs in under `policy` (default: the policy `apply` gave
    the model, else the global one), and under quantized policies which layers are
    quantized and which skipped, and why; which modules run their attention in float32 and
    which layers are float32 islands beyond what the device's own autocast does, as `apply`
    decides it on `device` (default: the model's; "cuda" on a CPU-only machine shows what a
    GPU run would do); each parameter's optimizer-state format under a map with ``states``
    or with ``optimizer_states`` (`Precision`'s); each module's activation option under a map
    with ``activations``, and with ``batch`` (a tensor, a tuple of the forward's arguments,
    or a mapping of its keyword arguments) the bytes each module's own ops save for the
    backward in one training-mode forward of a converted copy of `model` on it
    (`Explanation.saved_bytes`). A module whose region hands
    its result back in another dtype than its policy's output dtype (inside a "true"
    parent: the parent's compute dtype) shows that dtype (`Explanation.handed_back`). Of a
    torch.compile wrapper, its model's."""
    if compiled_wrapper(model):
        model = model._orig_mod
    where = parse_device(device) if device is not None else device_of(model)
    found = explanation.explain(
        model,
        policy,
        slow_attention=device_slow_attention(where),
        device_type=where.type,
        optimizer_states=optimizer_states,
    )
    found.handed_back = _handed_back(model, found)
    if batch is not None:
        found.saved_bytes = _saved_in_training(model, policy or applied_policy(model), batch)
    return found


def _takes_keywords(model: nn.Module, batch: Mapping[Any, Any]) -> bool:
    """Whether `model`'s forward takes `batch`'s keys as keyword arguments (a Hugging Face
    model's ``input_ids=``...); else the mapping is its one argument (``forward(batch)``)."""
    try:
        inspect.signature(model.forward).bind(**{str(k): None for k in batch})
    except (TypeError, ValueError):
        return False
    return True


def _saved_in_training(model: nn.Module, policy: Any, batch: Any) -> dict[str, int]:
    """`saved_bytes` of one forward on `batch` (a tensor, a tuple of positional arguments, a
    mapping of keyword arguments, as a Hugging Face batch, or a mapping the forward takes
    whole, `_takes_keywords`) of a copy of `model` converted
    to `policy`, in training mode as a step runs it (dropout, a BatchNorm's batch
    statistics), whatever mode `model` is in: `model` itself is left as it is."""
    converted = apply(copy.deepcopy(model).train(), policy, warn=False)
    if isinstance(batch, Mapping) and _takes_keywords(model, batch):
        args, kwargs = (), dict(batch)
    else:
        args, kwargs = (batch if isinstance(batch, tuple) else (batch,)), {}
    # (the batch as a step hands it over: cast to a "true" policy's compute dtype, as
    # `Precision.convert_input` does, not saved beside a 16-bit copy the step never makes)
    default = as_map(policy).default
    if not default.is_mixed:
        args, kwargs = cast_floating((args, kwargs), default.compute_dtype)
    return saved_bytes(converted, *args, **kwargs)


def _handed_back(model: nn.Module, policies: Mapping[str, Policy]) -> dict[str, torch.dtype]:
    """The dtype each module of `model` hands its result back in where that is not its
    policy's output dtype, as `apply` runs it: inside a "true" parent its parent's compute
    dtype (a region's cast, or what it computed in that very dtype); inside a mixed parent,
    a region's output dtype (float32 for a float64 one). A module shared by callers wanting
    other dtypes follows its input's (nothing is claimed for it)."""
    paths: dict[str, nn.Module] = {}
    claims: dict[int, dict[str, torch.dtype | None]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        paths[name] = module
        if not name or never_called(module):
            continue
        here, parent = policies[name], policies[_caller(name, paths)]
        if not parent.is_mixed:
            out: torch.dtype | None = parent.compute_dtype
        elif _region_key(parent) != _region_key(here):
            out = _output_dtype(here, parent)
        else:
            out = None  # (what autocast computed it in: each op's own)
        claims.setdefault(id(module), {})[name] = out
    found: dict[str, torch.dtype] = {}
    for at in claims.values():
        if len(set(at.values())) > 1:
            continue
        for name, out in at.items():
            if out is not None and out != policies[name].output_dtype:
                found[name] = out
    return found


def _to_cast(module: nn.Module, policy: Policy, regions: dict[int, Policy]) -> tuple[str, ...]:
    """Paths (below `module`) of the floating parameters a region of `policy` (not autocast)
    computes on as copies in its compute dtype: those stored in another dtype, in `module`
    and below it, down to the regions that compute otherwise (`regions`: the policy of each
    module with a region). A parent may read a child's weight itself (MultiheadAttention
    reads its out_proj's); a region below computing alike, called through this one, finds
    the copies already there."""
    dtype = policy.compute_dtype
    found: dict[tuple[int, str], str] = {}  # (owner, key) -> first path: swapped once

    def walk(prefix: str, m: nn.Module) -> None:
        for key, p in m._parameters.items():
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                found.setdefault((id(m), key), prefix + key)
        for child_name, child in m._modules.items():
            if child is None:
                continue
            inner = regions.get(id(child))
            if inner is not None and _region_key(inner) != _region_key(policy):
                continue
            walk(f"{prefix}{child_name}.", child)

    walk("", module)
    return tuple(found.values())


def _casts_own(module: nn.Module, policy: Policy) -> bool:
    """Whether `module` holds a parameter that `policy` (not autocast) computes on in
    another dtype: it gets a region of its own, so calling it directly casts too."""
    return not policy.is_mixed and any(
        p is not None and p.is_floating_point() and p.dtype != policy.compute_dtype
        for p in module._parameters.values()
    )


def _output_dtype(policy: Policy, parent: Policy | None) -> torch.dtype:
    """The dtype a region of `policy` hands its result back in, inside `parent`: inside a
    "true" parent nothing casts between siblings, so the parent's compute dtype; inside a
    mixed one autocast casts between them but leaves float64 alone, so a float64 result
    comes back as float32 (the mixed parent's parameters'), and so does the result of a
    layer computing in the other 16-bit dtype (a float16 layer's in a bfloat16 parent would
    run the ops autocast does not list in float16: an ``exp`` overflowing; an output dtype
    asked apart from the compute dtype, ``o=f16``, is kept); elsewhere its own output dtype."""
    if parent is not None and not parent.is_mixed:
        return parent.compute_dtype
    other = _OTHER_16_BIT.get(parent.compute_dtype) if parent is not None else None
    if parent is not None and (
        policy.output_dtype == torch.float64 or policy.output_dtype == policy.compute_dtype == other
    ):
        return torch.float32
    return policy.output_dtype


def _caller_dtype(
    mixed_output: torch.dtype, device_type: str, compute_dtype: torch.dtype
) -> torch.dtype:
    """The dtype the caller of a shared region given no floating input wants its result
    in, read from where the call runs: under autocast on the region's device (a mixed
    parent's, or the caller's), ``mixed_output``, as for any child of a mixed parent
    (`_output_dtype`: float32 for a region computing in the other 16-bit dtype); else the
    caller's "true" compute dtype, which its region made torch's default."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        other = _OTHER_16_BIT.get(torch.get_autocast_dtype(device_type))
        if mixed_output == compute_dtype == other:
            return torch.float32
        return mixed_output
    return torch.get_default_dtype()


def _regions(
    model: nn.Module, resolved: dict[str, Resolution]
) -> list[tuple[nn.Module, Policy, Policy | None, bool]]:
    """(module, policy, parent policy) for each module that needs a region of its own: the
    root, a module computing differently from its parent at any of its paths (a module
    shared by two parents gets one when either differs, so it computes as its policy says
    whichever path calls it), and a module whose parameters its policy casts for compute
    (so a training step calling it directly, not through the root, casts them too)."""
    found: dict[int, tuple[nn.Module, Policy, Policy | None]] = {}
    outputs: dict[int, set[torch.dtype]] = {}  # what each path's parent wants back
    paths: dict[str, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        paths[name] = module
        if name and never_called(module):
            continue  # (a list's children: its parent calls them, in its own region)
        here = resolved[name].policy
        parent = resolved[_caller(name, paths)].policy if name else None
        outputs.setdefault(id(module), set()).add(_output_dtype(here, parent))
        if parent is None or _region_key(parent) != _region_key(here) or _casts_own(module, here):
            found.setdefault(id(module), (module, here, parent))
    # (a module shared by parents wanting its result in different dtypes: its caller's)
    return [(*entry, len(outputs[key]) > 1) for key, entry in found.items()]


def _caller(name: str, paths: dict[str, nn.Module]) -> str:
    """The path of the module whose forward calls the one at ``name``: its parent, or past a
    container never called (`nn.ModuleList`, `nn.ModuleDict`), the container's. A rule on
    such a container (a Hugging Face model's ``model.layers``) is carried out by each child,
    which computes differently from its caller, not from the container."""
    parent = name.rpartition(".")[0]
    while parent and never_called(paths[parent]):
        parent = parent.rpartition(".")[0]
    return parent


def remove(model: nn.Module) -> nn.Module:
    """Undo `apply`: plain forwards again and the dtypes the model had before, for every
    parameter and buffer (non-persistent ones such as a rotary `inv_freq` included).
    Layers a quantized policy swapped stay quantized (`mixprec.quantize.dequantize`). A
    torch.compile wrapper's model is the one changed (the wrapper compiles it anew)."""
    if compiled_wrapper(model):
        remove(model._orig_mod)
        return model
    state: AppliedState | None = model.__dict__.get(_STATE)
    if state is None:
        return model
    _check_forwards(model)
    shared = _held_by_others(model, state)
    if shared:  # (a model dropped but not yet collected holds nothing)
        gc.collect()
        shared = _held_by_others(model, state)
    if shared:
        paths, other = shared
        raise PolicySpecError(
            f"cannot remove the policy of this {type(model).__name__}: {', '.join(paths)} "
            f"{'is' if len(paths) == 1 else 'are'} also in a {type(other).__name__} that is "
            "still converted, whose forward and weights' dtypes would change under it. Remove "
            "that model's policy first (mixprec.remove), then this one's"
        )
    del model.__dict__[_STATE]
    for module in model.modules():
        _OWNERS.get(module, weakref.WeakSet()).discard(model)
    _strip_regions(model)
    _unhook_loads(model)
    set_fast_paths(model)
    modules = dict(model.named_modules())
    restored: dict[int, Tensor] = {}  # a buffer shared by two modules stays shared
    casts = CodeCasts()
    with torch.inference_mode(False):
        for (owner_name, key), dtype in state.original_dtypes.items():
            owner = modules.get(owner_name)
            if owner is None:
                continue
            if key in owner._parameters:
                t = owner._parameters[key]
                if t is not None and t.dtype != dtype:
                    t.data = t.data.to(dtype)
                    if t.grad is not None:
                        t.grad = t.grad.to(dtype)
            elif owner._buffers.get(key) is not None and owner._buffers[key].dtype != dtype:
                cast_buffer(owner, key, dtype, casts, restored)
    return model


def _held_by_others(model: nn.Module, state: AppliedState) -> tuple[list[str], nn.Module] | None:
    """The paths of `model`'s modules that `remove` would change (a forward of mixprec's, a
    tensor in another dtype than `state` recorded) and that another model converted by
    `apply` holds too (a layer shared by a teacher and a student), and that model; None when
    there are none. A model inside `model`, or holding it, applied on its own is an override
    of one by the other (as `_check_shared` takes it), not another model."""
    found: dict[int, tuple[list[str], nn.Module]] = {}
    mine = {id(m) for m in model.modules()}
    for name, module in model.named_modules():
        if not _changed_by_apply(name, module, state):
            continue
        for other in list(_OWNERS.get(module, ())):
            if id(other) in mine or _STATE not in other.__dict__:
                continue
            if any(m is model for m in other.modules()):
                continue
            found.setdefault(id(other), ([], other))[0].append(name or "<root>")
    return next(iter(found.values()), None)


def _changed_by_apply(name: str, module: nn.Module, state: AppliedState) -> bool:
    """Whether `apply` changed `module` (at `name`): a forward of mixprec's in its place, or
    one of its own parameters or buffers in another dtype than it had."""
    if isinstance(module.__dict__.get("forward"), _STAND_INS):
        return True
    own = {**module._parameters, **module._buffers}
    return any(
        t is not None
        and (name, key) in state.original_dtypes
        and t.dtype != state.original_dtypes[(name, key)]
        for key, t in own.items()
    )


def applied_policy(model: nn.Module) -> PolicyMap | None:
    """The policy map `apply` used on `model`, or None if it is a plain module."""
    state: AppliedState | None = model.__dict__.get(_STATE)
    return state.policy if state is not None else None
