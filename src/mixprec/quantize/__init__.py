"""Quantized layers: `quantize(model, mode)` swaps Linear/Embedding layers for int8 or int4
ones (or Linear for float8 training), in place, as Keras's ``model.quantize`` does.
int8/int4 also take Hugging Face's ``Conv1D`` (GPT-2's Linear with a transposed weight) as
the Linear it computes; `dequantize` gives such a layer back as an ``nn.Linear``.

``mixprec.quantize`` is both this package and the function: ``mixprec.quantize(model,
"int8")`` calls `quantize`, and ``mixprec.quantize.dequantize(model)`` reaches the rest.

- int8 (`Int8Linear`, `Int8Embedding`): weights per output channel, activations per token at
  run time, exact int8 x int8 -> int32 matmuls (oneDNN's int8 linear with a prepacked weight
  where its sums are exact, else `torch._int_mm` or float32 matmuls); the bias trains, the weight
  does not.
- int4 (`Int4Linear`, `Int4Embedding`): grouped weights with a zero point, packed two per
  byte; Linear layers multiply through torch's packed int4 kernel with bfloat16 activations
  where it exists (groups of 32-256, float32/bfloat16 inputs), else dequantize first.
- float8: `mixprec.quantize.float8.convert_to_float8` (training numerics).
- mxfp8, mxfp6, mxfp4, nvfp4 (`MicroscalingLinear`): block-scaled formats, emulated
  (`mixprec.quantize.microscaling`); the weight stays a float parameter and trains.

Each format is a `mixprec.formats.Format` declared in its layer's module (`Int8Format`,
`Int4Format`, `Float8Format`, `MicroscalingFormat`) and registered by `mixprec` in the order
`BUILTIN_FORMATS` lists them; `quantize` and `apply` swap a layer through its policy's format
(`Format.swap`), and a format registered later is quantized the same way.
`QuantizeResult.kernels` says which matmul each quantized int8/int4 Linear runs, and why.

Quantized layers keep their int tensors and scales as buffers, so ``state_dict`` holds them
and a checkpoint loads into a model quantized the same way without quantizing again.
`dequantize` gives float layers back; `enable_lora` / `merge_lora` fine-tune them (LoRA
adapters on the int8/int4 Linear and Embedding layers).
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.errors import PolicySpecError, caller_level
from mixprec.formats.registry import format_named, formats
from mixprec.policy import QuantizedPolicy, as_policy, is_quantized
from mixprec.quantize.float8 import FLOAT8
from mixprec.quantize.int4 import INT4, Int4Embedding, Int4Linear
from mixprec.quantize.int8 import INT8, Int8Embedding, Int8Linear
from mixprec.quantize.lora import LoraMixin
from mixprec.quantize.microscaling import MICROSCALING_FORMATS, MicroscalingLinear
from mixprec.quantize.rules import (
    Filter,
    check_same_options,
    describe,
    hugging_face_conv1d,
    linear_view,
    path_filter,
    refuse_applied,
    skip_reason,
    swap_modules,
    weights_read_by_parents,
)

# the builtin formats, in the order names, messages and searches list them (`mixprec`
# registers them); a new format's module declares its Format and it is added to this line
BUILTIN_FORMATS = (INT8, INT4, FLOAT8, *MICROSCALING_FORMATS)

__all__ = [
    "BUILTIN_FORMATS",
    "Int4Embedding",
    "Int4Linear",
    "Int8Embedding",
    "Int8Linear",
    "MicroscalingLinear",
    "QuantizeResult",
    "dequantize",
    "enable_lora",
    "merge_lora",
    "quantize",
    "quantize_modules",
    "weight_bytes",
]


@dataclass
class QuantizeResult:
    """What `quantize` did: quantized layers (path -> what they became), the matmul each
    quantized int8/int4 Linear runs on the device it is on (path -> kernel, and why that
    one; ``layer.kernel`` answers again after a move) and the layers with parameters it
    left in float (path -> why)."""

    quantized: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    kernels: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"quantized {len(self.quantized)} layer(s)"]
        lines += [
            f"  {p}: {what}" + (f"; matmul: {self.kernels[p]}" if p in self.kernels else "")
            for p, what in self.quantized.items()
        ]
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)}")
            lines += [f"  {p or '<root>'}: {why}" for p, why in self.skipped.items()]
        return "\n".join(lines)


def _as_policy(mode: str | QuantizedPolicy, options: dict[str, Any]) -> QuantizedPolicy:
    """The quantized policy a `quantize` call means (its source is irrelevant here): a
    quantized policy or its name, or a mode with its options after a '/' or as keywords."""
    given = {k: v for k, v in options.items() if v is not None}
    keyworded = [f.name for f in formats() if f.keywords]
    if is_quantized(mode):
        if given:
            raise PolicySpecError(
                f"{mode!r} names its options already; pass {'/'.join(options)} only with a "
                f"bare mode ({', '.join(repr(n) for n in keyworded)}; the other modes take "
                "their options in the name, e.g. 'mxfp8/floor')"
            )
        return as_policy(mode)  # type: ignore[return-value]
    name = mode.strip().lower() if isinstance(mode, str) else None
    fmt = None if name is None else format_named(name.partition("/")[0])
    if fmt is None:
        raise PolicySpecError(
            f"unknown quantization mode {mode!r}; modes are "
            f"{', '.join(f.name for f in formats())} "
            "(or a quantized policy such as 'int4/64_from_float32')"
        )
    if given and fmt.config_keys and not fmt.keywords:  # options it spells in the name only
        raise PolicySpecError(
            f"{mode!r} takes no {'/'.join(options)}; its options go in the name. " + fmt.accepted
        )
    if given and "/" in name:  # type: ignore[operator]
        raise PolicySpecError(
            f"{mode!r} names its options already; pass {'/'.join(options)} only with a "
            f"bare mode ({', '.join(repr(n) for n in keyworded)})"
        )
    return QuantizedPolicy(name, "float32", **given)


def _quantized_layer(
    path: str,
    module: nn.Module,
    policy: QuantizedPolicy,
    memo: dict[Any, Any],
) -> nn.Module:
    """The quantized layer `policy`'s format swaps in for the module at `path`; `memo`
    lets a tied weight quantized the same way share one quantized copy. The scales hold
    values of the dtype they will be stored in: the policy's 16-bit buffer dtype (`apply`
    casts them to it: its param dtype, or its compute dtype where it casts parameters), else
    the weight's."""
    tie = (id(module.weight), hugging_face_conv1d(module))
    module = linear_view(module)
    buffers = policy.buffer_dtype
    storage = buffers if torch.finfo(buffers).bits < 32 else module.weight.dtype
    return policy.format.swap(module, policy.config, path=path, storage=storage, tie=tie, memo=memo)


def quantize_modules(model: nn.Module, policies: Mapping[str, QuantizedPolicy]) -> QuantizeResult:
    """Quantize the modules at the given paths, each by its policy (the call `apply` makes
    for quantized rules); modules already quantized in that mode are left as they are."""
    modules = dict(model.named_modules(remove_duplicate=False))
    result = QuantizeResult()
    new: dict[int, nn.Module] = {}
    codes: set[int] = set()  # the modules swapped for layers holding codes, not the weight
    memo: dict[Any, Any] = {}
    read = weights_read_by_parents(model)
    for path, policy in policies.items():
        module = modules[path]
        reason = skip_reason(policy, module, read.get(id(module)))
        if reason is not None:
            result.skipped[path] = reason
        elif isinstance(getattr(module, "quantization_mode", None), str):
            check_same_options(path, module, policy)
            continue
        elif not path:
            raise ValueError(
                f"quantize swaps submodules, and the model itself is a "
                f"{type(module).__name__}: wrap it, e.g. nn.Sequential(model)"
            )
        else:
            if id(module) not in new:
                new[id(module)] = _quantized_layer(path, module, policy, memo)
                if not policy.format.keeps_weight:
                    codes.add(id(module))
            result.quantized[path] = describe(policy)
            kernel = getattr(new[id(module)], "kernel", None)
            if isinstance(kernel, str):
                result.kernels[path] = kernel
    _warn_untied(modules, new, codes)
    swap_modules(model, lambda path, child: new.get(id(child)))
    return result


def _warn_untied(modules: dict[str, nn.Module], new: dict[int, nn.Module], codes: set[int]) -> None:
    """Warn when a layer holding codes (int8/int4: the ids in `codes`) has its weight tied
    to a module that keeps a float weight (one left float, or in a format that keeps the
    weight itself: float8, block-scaled): it holds codes of the weight as it is now, so the
    tie ends and the float side trains away from them. Two sides in formats that keep the
    weight keep the tie."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for path, module in modules.items():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((f"{path}.{name}", module))
    for path, module in modules.items():
        if id(module) not in codes:
            continue
        weight = module._parameters.get("weight")
        # (a side swapped for a layer that keeps the weight itself, float8's or a block
        # format's, trains it as a float side does)
        float_side = [p for p, m in owners.get(id(weight), []) if id(m) not in codes]
        if float_side:
            warnings.warn(
                f"{path}.weight is tied to {', '.join(float_side)}, which stays float: "
                f"quantizing {path} alone unties them (its codes keep today's weight while "
                f"the float side trains on). Quantize both (a filter naming both paths) or "
                f"neither",
                stacklevel=caller_level(),
            )
            break


def quantize(
    model: nn.Module, mode: str | QuantizedPolicy, *, filter: Filter = None, **options: Any
) -> QuantizeResult:
    """Quantize `model`'s Linear (and, for int8/int4, Embedding) layers in place.

    `mode` and its `options`, the keywords its format takes (`mixprec.formats.Format.keywords`):
    "int8", "int4" (`group_size`, default 128; -1 per channel), "float8" (`recipe`
    tensorwise/rowwise/rowwise_with_gw_hp/delayed, `amax_history_length` for delayed), a
    block-scaled mode with its options in the name ("mxfp8", "mxfp8/floor", "mxfp4",
    "nvfp4/2d:rht:sr", ...: Linear layers only, emulated), or a quantized policy or its
    name ("int4/64_from_float32"). `filter`: a callable
    ``(path, module) -> bool`` or a regex ``re.fullmatch``'ed on module paths; layers it
    rejects stay float. Layers too small or of other types stay float too; the result says
    which and why. A layer already quantized in this mode stays as it is; with other options
    (int4 group size, float8 recipe) it is refused. Tied weights (an embedding and its
    output head) share one quantized copy.
    Biases stay the same Parameter objects (an optimizer built before keeps training them);
    the float weights leave the model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize needs an nn.Module, got {type(model).__name__}")
    known = {k: f.name for f in reversed(formats()) for k in f.keywords}
    unknown = sorted(set(options) - set(known))
    if unknown:
        taken = ", ".join(f"{k} ({known[k]})" for k in sorted(known))
        raise TypeError(
            f"quantize() got unknown option(s) {', '.join(unknown)}; the formats take {taken}"
        )
    policy = _as_policy(mode, options)
    refuse_applied(model, "quantize")
    keep = path_filter(filter)
    chosen: dict[str, QuantizedPolicy] = {}
    excluded: dict[str, str] = {}
    read = weights_read_by_parents(model)
    for path, module in model.named_modules():
        own = any(True for _ in module.parameters(recurse=False)) or isinstance(
            getattr(module, "quantization_mode", None), str
        )
        if not own:
            continue
        if skip_reason(policy, module, read.get(id(module))) is None and not keep(path, module):
            excluded[path] = "excluded by filter"
        else:
            chosen[path] = policy
    result = quantize_modules(model, chosen)
    result.skipped.update(excluded)
    return result


def dequantize(model: nn.Module) -> nn.Module:
    """Swap every quantized layer of `model` back to the float layer its format gives
    (`mixprec.formats.Format.to_float`); returns `model`. An int8/int4 layer becomes a
    Linear/Embedding holding its dequantized weight (LoRA adapters folded in; tied weights
    tied again), a float8 or block-scaled layer the Linear holding its own (float)
    parameters. A bare quantized layer gives its float layer back (use the result)."""
    refuse_applied(model, "dequantize")
    _refuse_sharded_adapters(_lora_layers(model), "dequantize")
    memo: dict[int, Any] = {}
    new: dict[int, nn.Module] = {}
    for m in model.modules():
        mode = getattr(m, "quantization_mode", None)
        fmt = format_named(mode) if isinstance(mode, str) else None
        if fmt is not None:
            new[id(m)] = fmt.to_float(m, memo)
    swap_modules(model, lambda path, child: new.get(id(child)))
    return new.get(id(model), model)


def _lora_layers(module: nn.Module) -> list[LoraMixin]:
    return [m for m in module.modules() if isinstance(m, LoraMixin)]


def enable_lora(module: nn.Module, rank: int, alpha: float | None = None) -> list[nn.Parameter]:
    """Add LoRA adapters of `rank` to every int8/int4 Linear and Embedding in `module` (a
    layer or a whole model) and return the new trainable parameters (give them to the
    optimizer). The quantized weights never train; the biases of those layers are frozen
    too. Enable them before wrapping the model in DistributedDataParallel or sharding it:
    a wrapper's reducer knows only the parameters it was built with (a DDP wrapper given
    here is refused)."""
    layers = _lora_layers(module)
    if not layers:
        raise ValueError(
            f"enable_lora found no int8/int4 Linear or Embedding in {type(module).__name__}: "
            "quantize first, e.g. mixprec.quantize(model, 'int8')"
        )
    ddp = nn.parallel.DistributedDataParallel
    if any(isinstance(m, ddp) for m in module.modules()):
        raise ValueError(
            "enable_lora on a model DistributedDataParallel wraps already: its reducer does "
            "not know the new adapters, so each rank would train its own (the replicas "
            "drift); enable LoRA before wrapping: enable_lora(model, ...), then "
            "DistributedDataParallel(model)"
        )
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in module.modules()):
        raise ValueError(
            "enable_lora on a model FSDP2 has sharded: the new adapters would be plain "
            "tensors each rank trains apart (the replicas drift); enable LoRA before "
            "sharding (mixprec.sharding.shard, fully_shard)"
        )
    return [p for layer in layers for p in layer.enable_lora(rank, alpha)]


def merge_lora(module: nn.Module) -> int:
    """Fold the adapters of every LoRA-enabled layer of `module` into its weight and quantize
    it again; returns how many layers were merged.

    Layers that shared one quantized weight (a tied embedding and output head) trained
    different changes of it, so after merging each holds its own copy, exactly as trained;
    a warning names them and the bytes this adds."""
    sharers: dict[int, list[tuple[str, LoraMixin]]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        if isinstance(m, LoraMixin):
            sharers.setdefault(id(m.qweight), []).append((name or "<root>", m))  # type: ignore[attr-defined]
    layers = [m for m in _lora_layers(module) if m.lora_rank]
    _refuse_sharded_adapters(layers, "merge_lora")
    for layer in layers:
        layer.merge_lora()
    for group in sharers.values():
        copies = {id(m.qweight): m for _, m in group}  # type: ignore[attr-defined]
        if len(copies) > 1:
            extra = sum(_storage_bytes(m) for m in list(copies.values())[1:])
            names = ", ".join(sorted({n for n, _ in group}))
            warnings.warn(
                f"merge_lora untied the quantized weight shared by {names}: their adapters "
                f"trained different changes, so each now holds its own copy (+{extra} "
                "bytes). To keep one copy, leave the shared layers without adapters "
                "(enable_lora on the other layers only). A model tied again (freshly "
                "quantized) loads only one of the copies from this state dict: load it "
                "into a model untied the same way (merged too).",
                stacklevel=2,
            )
    return len(layers)


def _refuse_sharded_adapters(layers: list[Any], what: str) -> None:
    """A ``ValueError`` if an adapter is an FSDP2 shard: folding it into the replicated codes
    needs the whole adapter (torch refused the mixed arithmetic midway)."""
    plain = (torch.Tensor, nn.Parameter)  # (an FSDP2 shard is a DTensor)
    if any(type(layer.lora_A) not in plain for layer in layers if layer.lora_rank):
        raise ValueError(
            f"{what} on a model FSDP2 has sharded: its adapters are shards; gather the "
            "model's full state dict (torch.distributed.checkpoint.state_dict."
            "get_model_state_dict with full_state_dict=True), load it into an unsharded "
            f"copy and call {what} there"
        )


def _storage_bytes(layer: nn.Module) -> int:
    """Bytes of a quantized layer's own weight buffers (the codes and their scales)."""
    return sum(b.numel() * b.element_size() for b in layer.buffers(recurse=False))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers of `model`, each storage counted once (tied
    weights and shared quantized copies count once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.is_meta:  # (no memory: every storage's address is 0; a tied tensor is one object)
            seen["meta", id(t)] = t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        seen["memory", storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class _CallablePackage(types.ModuleType):
    """Makes ``mixprec.quantize(model, mode)`` call `quantize` while the package's other
    names stay reachable as ``mixprec.quantize.<name>``."""

    def __call__(
        self, model: nn.Module, mode: str | QuantizedPolicy, **options: Any
    ) -> QuantizeResult:
        return quantize(model, mode, **options)


sys.modules[__name__].__class__ = _CallablePackage
