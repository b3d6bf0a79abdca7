"""Which layers a quantized policy quantizes, written once: the skip rules every format
shares (then each format's own, `mixprec.formats.Format.skip`) and their reasons, how a
quantized layer is described, and the one module filter and the one module swap that
every quantization goes through (int8/int4 layers, float8 and block-scaled layers, and undoing
them).

`mixprec.policy.map` reads `skip_reason` to resolve and explain quantized rules;
`quantize`, `apply` and `convert_to_float8` swap what it leaves.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from mixprec.errors import PolicySpecError
from mixprec.policy import APPLIED_STATE, REGION_MARK, QuantizedPolicy

__all__ = [
    "hugging_face_conv1d",
    "parent_computes_reason",
    "reparametrized_reason",
    "set_fast_paths",
    "skip_reason",
    "weights_read_by_parents",
]

# A Linear/Embedding with fewer input features than this stays float: its weight is too small
# for the bytes saved to matter, and per-token int8 activations of so few features lose most.
MIN_QUANTIZED_FEATURES = 16

Filter = Callable[[str, nn.Module], bool] | str | re.Pattern[str] | None


def hugging_face_conv1d(module: nn.Module) -> bool:
    """Whether `module` is a ``transformers`` ``Conv1D`` (GPT-2's Linear with a transposed
    weight), recognised without importing transformers."""
    utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(utils, "Conv1D", None)
    return conv1d is not None and type(module) is conv1d


def rows_and_features(module: nn.Module) -> tuple[int, int]:
    """(output rows, input features) of a quantizable layer's weight: a Hugging Face
    ``Conv1D`` stores its weight ``[in, out]``, the others ``[out, in]`` (an Embedding's
    rows its tokens)."""
    rows, features = module.weight.shape
    return (features, rows) if hugging_face_conv1d(module) else (rows, features)


def linear_view(module: nn.Module) -> nn.Module:
    """`module` itself, or for a Hugging Face ``Conv1D`` an ``nn.Linear`` computing the same
    function: its weight a transposed view of the Conv1D's (``[in, out]`` -> ``[out, in]``;
    quantizing makes the codes contiguous), its bias the same Parameter. What int8/int4
    quantize a Conv1D from."""
    if not hugging_face_conv1d(module):
        return module
    linear = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = module.weight.shape
    linear.weight = nn.Parameter(module.weight.detach().t(), module.weight.requires_grad)
    linear.bias = module.bias
    carry_hooks(module, linear)
    return linear.train(module.training)


# what a forward may read of a child's weight without computing with it (T5's feed-forward
# casts its input to ``self.wo.weight.dtype`` after ``isinstance(self.wo.weight, Tensor)``)
_METADATA = re.compile(r"\s*\.\s*(dtype|device|shape|size|ndim|dim|is_floating_point)\b")


class MetadataRead(str):
    """A parent's class name (a `weights_read_by_parents` value) whose forward reads only its
    child's weight's dtype, device or shape: harmless where the format keeps the weight."""


# a read of a descendant's weight after the module's own name, or after a local name or loop
# variable naming one: ``.wo.weight``, ``.block[0].weight``, ``.a.b.weight``,
# ``.heads["q"].weight``, ``[i].weight`` (an index or key that is not a literal: any child)
_STEPS = r"((?:\.\w+|\[(?:[^\[\]\n]|\[[^\[\]\n]*\])*\])*)"
_STEP = re.compile(r"\.(\w+)|\[((?:[^\[\]\n]|\[[^\[\]\n]*\])*)\]")
# the steps `_descendants` reads as every child (an index or key that is not a literal, the
# items of a loop) and as every module below (a loop over ``.modules()``)
_ANY_CHILD = "*"
_ANY_BELOW = "**"


def _chain(steps: str) -> tuple[str | int, ...]:
    """The names and indices a `_STEPS` match steps through: `_ANY_CHILD` for an index or key
    that is not a literal; a slice leaves the module's children as they were."""
    chain: list[str | int] = []
    for name, index in _STEP.findall(steps):
        index = index.strip()
        if name:
            chain.append(name)
        elif re.fullmatch(r"-?\d+", index):
            chain.append(int(index))
        elif re.fullmatch(r"'[^']*'|\"[^\"]*\"", index):
            chain.append(index[1:-1])
        elif ":" not in index:
            chain.append(_ANY_CHILD)
    return tuple(chain)


def _iterated(source: str, start: int) -> str:
    """What the ``for`` whose ``in`` ends at ``start`` iterates over: up to its ``:``, or the
    bracket closing its comprehension or generator (across lines inside brackets)."""
    depth = 0
    for end in range(start, len(source)):
        depth += (source[end] in "([{") - (source[end] in ")]}")
        if depth < 0 or (depth == 0 and source[end] in ":\n"):
            return source[start:end]
    return source[start:]


@functools.cache
def _weights_read(cls: type) -> dict[tuple[str | int, ...], bool]:
    """The descendants whose weight ``cls``'s forward reads itself (``self.wo.weight``, as
    Hugging Face's T5 feed-forward does to pick its input's dtype; ``layer.weight`` for
    ``layer`` in ``self.layers``; ``self.layers[i].weight``), as the chain of names and
    indices down to each (`_ANY_CHILD`, `_ANY_BELOW` where a loop or an index that is not a
    literal may reach any), from the source of forward and of the methods and properties
    it reaches through ``self`` (`_own_function`), each with whether it computes with it (a
    read other than of its dtype, device or shape); none where the source cannot be read,
    or the reads are in torch's inference fast path of an encoder or its layers (checks of
    the first layer's weights, through a local name), which `set_fast_paths` turns off
    around quantized layers."""
    if issubclass(cls, (nn.TransformerEncoderLayer, nn.TransformerEncoder)):
        return {}
    out: dict[tuple[str | int, ...], bool] = {}
    todo, seen = ["forward"], {"forward"}
    while todo:
        function = _own_function(cls, todo.pop())
        if function is None:
            continue
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            continue
        # (the module as the method names it: ``self`` by convention, not always)
        me = next(iter(inspect.signature(function).parameters), "self")
        for name in re.findall(rf"\b{re.escape(me)}\.(\w+)", source):
            if name not in seen:
                seen.add(name)
                todo.append(name)
        # the names for the module and what is below it: ``head = self.head``, ``layer`` in
        # ``for layer in self.layers`` or ``[e.weight for e in self.experts]``, zip's and
        # enumerate's variables (each for all it iterates over), ``.items()``'s
        roots: list[tuple[str, tuple[str | int, ...]]] = [(me, ())]
        for root, above in roots:  # (growing as it goes: a loop inside a loop)
            at = rf"(?<![\w.]){re.escape(root)}{_STEPS}"
            below = [
                (alias[1], above + _chain(alias[2]))
                for alias in re.finditer(rf"^\s*(\w+)\s*=\s*{at}\s*(?:#.*)?$", source, re.M)
            ]
            # (a tuple or list of them under a name: ``projs = (self.q, self.k, self.v)``)
            for held in re.finditer(r"^\s*(\w+)\s*=\s*[(\[]([^()\[\]\n]*)[)\]]", source, re.M):
                below += [(held[1], above + _chain(m[1])) for m in re.finditer(at, held[2])]
            for loop in re.finditer(r"\bfor\s+([\w\s,()]+?)\s+in\b", source):
                for each in re.finditer(rf"{at}(\()?", _iterated(source, loop.end())):
                    chain, step = above + _chain(each[1]), _ANY_CHILD
                    if each[2] and re.search(r"\.\w+$", each[1]):  # (``.values()``)
                        if chain[-1] in ("modules", "named_modules"):
                            step = _ANY_BELOW
                        chain = chain[:-1]
                    # (each item of a container; or the module itself, an item of a tuple
                    # or list written out: ``for lin in (self.q, self.k, self.v)``)
                    items = [(*chain, step)] + ([chain] if not each[2] and chain else [])
                    below += [(n, c) for n in re.findall(r"\w+", loop[1]) for c in items]
            for name, chain in below:
                # (a name assigned from itself, ``node = node.next``: every module below)
                known = [c for n, c in roots if n == name and chain[: len(c)] == c]
                if known and chain not in known:
                    chain = (*min(known, key=len), _ANY_BELOW)
                if (name, chain) not in roots:
                    roots.append((name, chain))
            for read in re.finditer(rf"{at}\.weight\b", source):
                chain = above + _chain(read[1])
                if not chain:  # (the module's own weight)
                    continue
                metadata = _METADATA.match(source, read.end()) or re.search(
                    r"isinstance\(\s*$", source[: read.start()]
                )
                out[chain] = out.get(chain, False) or not metadata
    return out


def _own_function(cls: type, name: str) -> Callable[..., Any] | None:
    """The function of method or property ``name`` of ``cls``, where ``cls`` or a base
    class below nn.Module defines it (not nn.Module's own methods); None for anything else
    (a submodule, a TorchScript module's forward, a staticmethod)."""
    for klass in cls.__mro__:
        if klass is nn.Module:
            return None
        found = klass.__dict__.get(name)
        if found is not None:
            found = found.fget if isinstance(found, property) else found
            return found if inspect.isfunction(found) else None
    return None


def _descendants(module: nn.Module, chain: tuple[str | int, ...]) -> list[nn.Module]:
    """The submodules of ``module`` a `_weights_read` chain names: attribute names and
    ModuleDict keys, positions in a Sequential or ModuleList, every child (`_ANY_CHILD`) or
    every module below (`_ANY_BELOW`); none where it names none."""
    found = [module]
    for step in chain:
        below: list[nn.Module | None] = []
        for m in found:
            if step == _ANY_CHILD:
                below += m.children()
            elif step == _ANY_BELOW:
                below += list(m.modules())[1:]
            elif isinstance(step, str):
                below.append(m._modules.get(step))
            elif isinstance(m, (nn.Sequential, nn.ModuleList)) and -len(m) <= step < len(m):
                below.append(m[step])
        found = [m for m in below if isinstance(m, nn.Module)]
    return found


def weights_read_by_parents(model: nn.Module) -> dict[int, str]:
    """The modules of ``model`` whose weight a module above them reads itself (its forward or
    a method forward calls: ``self.proj.weight``, ``self.block[0].weight``), by id, with the
    reader's class name (a `MetadataRead` where all it reads is the weight's dtype, device or
    shape): a layer holding codes in place of its weight would break that forward, and one
    computing in another format would be passed by (`skip_reason`'s ``read_by``)."""
    out: dict[int, str] = {}
    for parent in model.modules():
        for chain, computes in _weights_read(type(parent)).items():
            for child in _descendants(parent, chain):
                # (a reader computing with the weight outranks one reading its dtype)
                if computes or id(child) not in out:
                    kind = str if computes else MetadataRead
                    out[id(child)] = kind(type(parent).__name__)
        if type(parent).__module__.startswith("peft."):
            for child in parent._modules.values():
                weight = getattr(child, "_parameters", {}).get("weight")
                if isinstance(weight, torch.Tensor) and weight.requires_grad:
                    out[id(child)] = PEFT_TRAINED
            for name, reason in _PEFT_KEPT.items():
                kept = parent._modules.get(name)
                for child in kept.modules() if kept is not None else ():
                    out[id(child)] = reason
    return out


# `weights_read_by_parents` answers for the modules peft trains in float: the layers of a
# LoRA adapter, the copies ``modules_to_save`` trains (a ModulesToSaveWrapper's), by the
# module dicts peft keeps them in, and any other child of a peft module whose weight trains
PEFT_ADAPTER = "peft's LoRA"
PEFT_SAVED = "peft's modules_to_save"
PEFT_TRAINED = "peft, training its weight"
_PEFT_KEPT = {
    "lora_A": PEFT_ADAPTER,
    "lora_B": PEFT_ADAPTER,
    "lora_magnitude_vector": PEFT_ADAPTER,
    "modules_to_save": PEFT_SAVED,
}


def replaced_forward(module: nn.Module) -> bool:
    """Whether ``module``'s forward is replaced on the instance by something other than
    mixprec's own wrappers (regions, activation options: they keep what they replaced as
    ``original``, and come off before a layer is swapped)."""
    forward = module.__dict__.get("forward")
    while getattr(type(forward), "mixprec_wrapper", False):
        forward = forward.original  # type: ignore[union-attr]
    return forward is not None


def skip_reason(
    policy: QuantizedPolicy, module: nn.Module, read_by: str | None = None
) -> str | None:
    """Why `policy` leaves `module` in its source float policy (None: it quantizes it, or
    it is already quantized in this mode). The rules every format shares (the layer types
    it takes, enough input features, a weight its parent reads: ``read_by``, the parent's
    class from `weights_read_by_parents`; no torch.nn.utils reparametrization) come first,
    then the format's own (`Format.skip`)."""
    fmt = policy.format
    done = getattr(module, "quantization_mode", None)
    if isinstance(done, str):
        return None if done == fmt.name else f"already quantized to {done}"
    if replaced_forward(module):
        return (
            "its forward is replaced on the instance (an accelerate hook, an adapter's patch), "
            "which a quantized layer would drop: quantize before replacing it"
        )
    linear_only = not fmt.embeddings
    kinds = "Linear" if linear_only else "Linear, Embedding and Hugging Face's Conv1D"
    if read_by == PEFT_ADAPTER:
        return (
            "a peft LoRA adapter: it trains in float beside the layer it adapts, whose base "
            "layer is quantized"
        )
    if read_by in (PEFT_SAVED, PEFT_TRAINED) and not fmt.keeps_weight:
        what = "a peft modules_to_save copy" if read_by == PEFT_SAVED else "trained by peft"
        return (
            f"{what}: peft trains its weight in float, and a layer in {fmt.name} holds codes "
            "that never train"
        )
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return (
            "unsupported type: the output projection of nn.MultiheadAttention, whose "
            "forward reads its weight directly"
        )
    if read_by is not None and not fmt.keeps_weight:
        return (
            f"unsupported: its parent {read_by} reads its weight in its own forward, where "
            f"a layer in {fmt.name} holds codes"
        )
    computes = parent_computes_reason(fmt.name, read_by)
    if computes is not None:
        return computes
    embedding = not linear_only and type(module) is nn.Embedding
    if embedding and (module.max_norm is not None or module.sparse or module.scale_grad_by_freq):
        return (
            "unsupported option: an Embedding with max_norm, sparse=True or "
            "scale_grad_by_freq=True changes its weight or gradient in ways a quantized table "
            "cannot"
        )
    conv1d = not linear_only and hugging_face_conv1d(module)
    if type(module) is not nn.Linear and not embedding and not conv1d:
        return f"unsupported type {type(module).__name__}: {fmt.name} quantizes {kinds}"
    reparametrized = reparametrized_reason(module)
    if reparametrized is not None:
        return reparametrized
    if conv1d:
        features = module.weight.shape[0]
    else:
        features = module.in_features if type(module) is nn.Linear else module.embedding_dim
    if features < MIN_QUANTIZED_FEATURES:
        return (
            f"too small: {features} input features (fewer than "
            f"{MIN_QUANTIZED_FEATURES} save little and lose the most accuracy)"
        )
    return fmt.skip(policy.config, module)


def parent_computes_reason(name: str, read_by: str | None) -> str | None:
    """Why a layer in format `name` that keeps its float weight is skipped where a module
    above it computes with that weight itself (``read_by``, from `weights_read_by_parents`:
    not a peft module, not a `MetadataRead`), or None: that module would pass the layer by."""
    peft = read_by in (PEFT_ADAPTER, PEFT_SAVED, PEFT_TRAINED)
    if read_by is None or peft or isinstance(read_by, MetadataRead):
        return None
    return (
        f"unsupported: its parent {read_by} computes with its weight in its own forward, "
        f"which would pass the {name} layer by (the model would compute in float)"
    )


# torch.nn.utils's reparametrizations by a forward pre-hook, which recomputes a tensor of the
# module before each forward from parameters of its own (weight_norm's weight_g and weight_v,
# spectral_norm's and pruning's weight_orig), with what takes each off
_REPARAMETRIZATIONS: dict[type, tuple[str, str]] = {
    WeightNorm: ("weight_norm", "torch.nn.utils.remove_weight_norm"),
    SpectralNorm: ("spectral_norm", "torch.nn.utils.remove_spectral_norm"),
    BasePruningMethod: ("pruning", "torch.nn.utils.prune.remove"),
}


def reparametrized_reason(module: nn.Module) -> str | None:
    """Why a layer reparametrized by torch.nn.utils (`_REPARAMETRIZATIONS`) is not swapped
    (None: it is not): the swapped layer would carry the hook without the parameters it
    reads (``weight_g``, ``weight_orig``, ``bias_mask``: AttributeError at its forward)."""
    for hook in module._forward_pre_hooks.values():
        for kind, (what, undo) in _REPARAMETRIZATIONS.items():
            if isinstance(hook, kind):
                tensor = getattr(hook, "name", None) or getattr(hook, "_tensor_name", "weight")
                return (
                    f"unsupported: torch.nn.utils's {what} recomputes its {tensor} before each "
                    f"forward (a forward pre-hook), which a swapped layer would break: "
                    f"{undo} first"
                )
    return None


def describe(policy: QuantizedPolicy) -> str:
    """What a layer quantized by `policy` becomes, in words ("int4 (groups of 64)")."""
    return policy.format.describe(policy.config)


def check_same_options(path: str, layer: nn.Module, policy: QuantizedPolicy) -> None:
    """Raise ValueError if the already quantized `layer` (in `policy`'s mode) was quantized
    with other options than `policy` asks for, rather than leave it as it is, silently."""
    fmt = policy.format
    have = fmt.layer_config(layer)
    if have is None:
        return
    if fmt.describe(have) != describe(policy):
        raise ValueError(
            f"{path or '<root>'} is already quantized to {fmt.describe(have)}, not "
            f"{describe(policy)} as asked; to quantize it again with other options, make it "
            f"float first: {fmt.undo}"
        )


def path_filter(filter: Filter) -> Callable[[str, nn.Module], bool]:
    """A layer filter as a callable ``(path, module) -> bool``: None keeps every layer, a
    regex (str or re.Pattern) the paths it fullmatches (the model's own path is "")."""
    if filter is None:
        return lambda path, module: True
    if isinstance(filter, (str, re.Pattern)):
        try:
            rx = re.compile(filter)
        except re.error as err:
            raise PolicySpecError(f"filter {filter!r} is not a valid regex: {err}") from None
        return lambda path, module: rx.fullmatch(path) is not None
    if callable(filter):
        return filter
    raise TypeError(
        f"filter must be None, a callable (path, module) -> bool or a regex on module paths "
        f"(str or re.Pattern, matched with fullmatch), got {type(filter).__name__}"
    )


def swap_modules(model: nn.Module, make: Callable[[str, nn.Module], nn.Module | None]) -> None:
    """Replace, in place, each submodule for which ``make(path, module)`` returns a module.
    A module reachable at several paths is decided once, at its first path, and replaced at
    every one (a layer tied at two paths stays one layer). `model` itself is never replaced;
    the walk is over the modules as they were before any swap. Transformer layers whose
    feed-forward Linears changed get their fused inference path set (`set_fast_paths`)."""
    done: dict[int, nn.Module | None] = {}
    for parent_path, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = f"{parent_path}.{name}" if parent_path else name
            if id(child) not in done:
                done[id(child)] = make(path, child)
            if done[id(child)] is not None:
                parent._modules[name] = done[id(child)]
    set_fast_paths(model)


# the attribute that keeps what a transformer layer's fast-path switch was before a swap
_FAST_PATH_KEPT = "_mixprec_fast_path"


def set_fast_paths(model: nn.Module) -> None:
    """Turn off torch's inference fast path in each ``nn.TransformerEncoderLayer`` one of
    whose submodules a swap replaced or a mixprec region wraps, and the nested-tensor path
    of an ``nn.TransformerEncoder`` any of whose layers is one (it nests the batch for them
    all, and a layer off its fused path fails on a nested tensor); turn them back on once the
    layer is plain torch again.

    In eval mode without gradients those paths compute the layer in one fused call that
    reads the attention's, the norms' and the feed-forward's weights itself: a quantized
    layer has no float weight (AttributeError), a float8 or block-scaled layer's forward
    would be passed over (its float weight used as it is), and a region's casts or autocast
    too (a bf16 attention or norm beside float32 ones failed on mixed dtypes). The switches
    are the layer's ``activation_relu_or_gelu`` (0: not fused) and the encoder's
    ``use_nested_tensor``; the values they had are kept on the module and put back."""
    modules = list(model.modules())
    for module in modules:  # the layers first: an encoder asks its layers
        if isinstance(module, nn.TransformerEncoderLayer):
            changed = any(_changed(m) for m in module.modules() if m is not module)
            _switch(module, "activation_relu_or_gelu", 0, off=changed)
    for module in modules:
        if isinstance(module, nn.TransformerEncoder):
            changed = any(hasattr(layer, _FAST_PATH_KEPT) for layer in module.layers)
            _switch(module, "use_nested_tensor", False, off=changed)


def _changed(module: nn.Module) -> bool:
    """Whether `module` computes other than torch's own forward for it: swapped for a
    mixprec layer, or its forward replaced on the instance (a mixprec region or island)."""
    return type(module).__module__.startswith("mixprec.") or "forward" in module.__dict__


def _switch(module: nn.Module, name: str, value: object, *, off: bool) -> None:
    """Set `module`'s attribute `name` to `value` keeping its value (`off`), or put the
    kept value back (not `off`)."""
    if off and not hasattr(module, _FAST_PATH_KEPT):
        setattr(module, _FAST_PATH_KEPT, getattr(module, name))
        setattr(module, name, value)
    elif not off and hasattr(module, _FAST_PATH_KEPT):
        setattr(module, name, getattr(module, _FAST_PATH_KEPT))
        delattr(module, _FAST_PATH_KEPT)


# a module's hook dicts a swap must not lose: the forward pre/post hooks with the flags saying
# which take kwargs or always run, and the backward hooks (all keyed by hook id)
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def carry_hooks(source: nn.Module, target: nn.Module) -> None:
    """Copy the forward and backward hooks a module swap must not lose, with how each was
    registered (``with_kwargs``, ``always_call``, full backward hooks)."""
    for name in _HOOK_DICTS:
        getattr(target, name).update(getattr(source, name))
    if source._is_full_backward_hook is not None:
        target._is_full_backward_hook = source._is_full_backward_hook


M = TypeVar("M", bound=nn.Module)


def swapped_in(source: nn.Module, target: M) -> M:
    """`target`, the layer swapped in for `source`, given `source`'s hooks (`carry_hooks`)
    and training mode: a user's hook, or a model in eval mode, stays as it was. A layer
    holding codes remembers whether its float weight trained (``weight_requires_grad``), which
    `mixprec.quantize.dequantize` gives back (a frozen weight stays frozen)."""
    carry_hooks(source, target)
    weight = getattr(source, "weight", None)
    if "qweight" in target._buffers and isinstance(weight, torch.Tensor):
        target.weight_requires_grad = weight.requires_grad
    return target.train(source.training)


L = TypeVar("L", bound=nn.Linear)
S = TypeVar("S", bound="SwappedLinear")


def linear_like(cls: type[L], layer: nn.Module) -> L:
    """A `cls` (nn.Linear or a subclass), made without its ``__init__``, holding `layer`'s
    parameters (shared, not copied), hooks and training mode."""
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"from_float needs an nn.Linear, got {type(layer).__name__}")
    linear = cls.__new__(cls)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = layer.in_features, layer.out_features
    linear.weight, linear.bias = layer.weight, layer.bias
    carry_hooks(layer, linear)
    return linear.train(layer.training)


class SwappedLinear(nn.Linear):
    """An nn.Linear whose matmuls a format replaces (float8, block-scaled): built as a Linear
    is, plus the format's keyword options, or from a Linear's own parameters
    (`from_float`), and turned back into a plain Linear (`to_float`). Type rules naming
    ``nn.Linear`` keep matching it (`float_type`). A subclass takes its options in
    ``_setup`` and defines ``forward``."""

    float_type = nn.Linear

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **options: Any,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup(**options)

    def _setup(self, **options: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} takes its options in _setup")

    @classmethod
    def from_float(cls: type[S], linear: nn.Linear, *args: Any, **options: Any) -> S:
        """A layer holding `linear`'s own weight and bias parameters (no copy), with its
        training mode and hooks, and these options (``_setup``'s arguments)."""
        new = linear_like(cls, linear)
        new._setup(*args, **options)
        return new

    def to_float(self) -> nn.Linear:
        """A plain nn.Linear holding this layer's parameters (its own buffers dropped)."""
        return linear_like(nn.Linear, self)


def refuse_applied(model: nn.Module, what: str) -> None:
    """Refuse to swap layers of a model `mixprec.apply` converted: a swapped layer would
    leave its policy region behind (a float32 rule's layer computing in bfloat16 while
    `explain` still lists float32) and the applied map would not describe it."""
    for path, m in model.named_modules():
        if APPLIED_STATE in m.__dict__ or getattr(m.__dict__.get("forward"), REGION_MARK, False):
            where = f"module {path!r}" if path else "the model"
            raise ValueError(
                f"{what} swaps layers, and {where} carries a precision policy mixprec.apply "
                f"gave it (its layers' regions would be dropped): {what} before apply, or "
                "mixprec.remove(model) first and apply again after; a quantized rule in the "
                "policy map ('int8_from_bf16-mixed') quantizes as it applies"
            )
