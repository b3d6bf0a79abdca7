"""The layers a format search chooses for, the formats it tries, and what a layer costs.

A *unit* is one choice of the search: a Linear, an Embedding or a Hugging Face ``Conv1D``,
or several of them that share one weight (a tied embedding and output head), which must
take one format so that the weight stays one tensor. Everything else in the model (norms,
convolutions, attention's own parameters) stays in the baseline policy.

A *format* is any mixprec policy a layer can take: a float policy (``"32-true"``,
``"bf16-mixed"``, ``"bf16-true"``...) or a quantized one (``"int8_from_bf16-mixed"``,
``"int4/32_from_bf16-mixed"``, float8 recipes, block-scaled formats). A candidate is a deep
copy of a unit's layers converted to a format by `mixprec.apply`, the same conversion the
plan gets, so what is scored, timed and weighed is what will run.

Bytes are measured on the converted copies, each storage once (a tied weight counts once):
``"weights"`` counts parameters and buffers; ``"training"`` adds, per trainable parameter,
its gradient and AdamW's two moments in the parameter's dtype (float32 for a float16 one,
as the compensated step keeps them), and for a 16-bit parameter the Kahan buffer that
``Precision(compensation="kahan")`` keeps (the way a search's training run trains): 16
bytes per float32 weight, 10 per bfloat16 one, 14 per float16 one, int8/int4 weights frozen.
A compensated step (any trainable 16-bit parameter: `compensated`) steps every parameter,
float32 ones too, and those under `mixprec.optim.compensated.SMALL` elements (or not
contiguous) from a packed copy of the weight, gradient and states: such a parameter counts
those bytes twice (32 per small float32 weight, 20 per small bfloat16 one), so a small layer
in bfloat16 is no cheaper than in float32. The step's transient temporaries are not counted.
In a plan with optimizer-state formats (`mixprec.optim.states`, whose optimizer then steps
every parameter) a parameter given one counts its two moments as that format stores them
(`StateFormat.bytes`: codes and block scales, the block cut to the parameter as the
optimizer cuts it), and every other parameter float32 moments, which that optimizer keeps
whatever the parameter's dtype (8 bytes an element).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from mixprec.convert import apply
from mixprec.formats.registry import formats
from mixprec.hardware import SUPPORTED, DeviceInfo, policy_support
from mixprec.optim.compensated import SMALL
from mixprec.optim.states import StateFormat, fitted_format
from mixprec.policy import Policy, QuantizedPolicy, as_policy
from mixprec.policy.map import PolicyMap
from mixprec.quantize.rules import hugging_face_conv1d, skip_reason

__all__: list[str] = []

COUNTS = ("weights", "training")


def path_rule(path: str) -> str:
    """A policy or activation rule key naming the module at `path` alone: a regex matching
    `path` only, wrapped so that it is no ordinary module's path (a key equal to a path is that
    module's exact rule, and ``a\\.b`` is the path of ``b`` under a child named ``a\\``)."""
    return "(?:" + re.escape(path) + ")"


@dataclass(frozen=True)
class Unit:
    """One choice of the search: the paths of the layers sharing one weight (usually one),
    and the further paths those same modules are registered at (a layer listed twice), which
    the plan's rules name too: one module runs in one policy."""

    paths: tuple[str, ...]
    kinds: tuple[str, ...]
    params: int  # elements of the unit's parameters, each storage once
    aliases: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return " + ".join(self.paths)


def _searchable(module: nn.Module) -> bool:
    if type(module) not in (nn.Linear, nn.Embedding) and not hugging_face_conv1d(module):
        return False
    weight = getattr(module, "weight", None)
    return isinstance(weight, nn.Parameter) and weight.is_floating_point()


def find_units(model: nn.Module) -> list[Unit]:
    """The model's Linear, Embedding and Hugging Face Conv1D layers, grouped by shared weight,
    in the order the model lists them (the feed-forward Linears of an
    ``nn.TransformerEncoderLayer`` too: a swap or a region turns its fused inference path
    off, `mixprec.quantize.rules.set_fast_paths`)."""
    groups: dict[int, list[tuple[str, nn.Module]]] = {}
    aliases: dict[int, list[str]] = {}  # id of a layer -> the paths after its first
    for path, module in model.named_modules(remove_duplicate=False):
        if not path or not _searchable(module):
            continue
        if id(module) in aliases:
            aliases[id(module)].append(path)
            continue
        aliases[id(module)] = []
        groups.setdefault(id(module.weight), []).append((path, module))
    units = []
    for members in groups.values():
        seen: dict[int, int] = {}
        for _, m in members:
            for p in m.parameters(recurse=False):
                seen[id(p)] = p.numel()
        units.append(
            Unit(
                paths=tuple(path for path, _ in members),
                kinds=tuple(type(m).__name__ for _, m in members),
                params=sum(seen.values()),
                aliases=tuple(p for _, m in members for p in aliases[id(m)]),
            )
        )
    return units


def format_name(spec: object) -> str:
    """The canonical name of a format (`PolicySpecError` naming what is accepted if `spec`
    is none)."""
    return as_policy(spec).name


def unit_applies(
    policy: Policy, modules: list[nn.Module], read: Mapping[int, str] | None = None
) -> str | None:
    """Why `policy` cannot take this unit (None: it can): a quantized policy must quantize
    every layer of the unit, or the shared weight would split; ``read``: the model's
    `weights_read_by_parents`."""
    if not isinstance(policy, QuantizedPolicy):
        return None
    for m in modules:
        reason = skip_reason(policy, m, (read or {}).get(id(m)))
        if reason is not None:
            return reason
    return None


def default_formats(baseline: Policy, info: DeviceInfo) -> tuple[list[str], dict[str, str]]:
    """The formats a search tries by default on `info`'s device, and those it leaves out with
    why: float32, the baseline and the 16-bit "true" policies, and each registered format's
    `Format.search` spellings built on the baseline (int8; int4 in groups of 32, the finest
    the packed kernel takes, and 128; float8 tensorwise and rowwise), each only where the
    device runs it fast or at least saves memory there (int8 without VNNI), or no slower
    than the baseline itself (a baseline slow here, allowed by the caller, admits formats as
    slow as it)."""
    source = baseline.name
    quantized = [f"{spelled}_from_{source}" for fmt in formats() for spelled in fmt.search]
    specs = ["32-true", source, "bf16-true", "16-true", *quantized]
    chosen: list[str] = []
    left_out: dict[str, str] = {}
    # "supported": runs at float32's speed or saves memory only (int8 without VNNI) - a
    # search under a memory budget wants those; "slow" ones only beside a slow baseline
    slowest = max(SUPPORTED.rank, policy_support(PolicyMap(baseline), info).status.rank)
    for spec in specs:
        name = format_name(spec)
        if name in chosen or name in left_out:
            continue
        support = policy_support(PolicyMap(spec), info)
        if support.status.rank <= slowest:
            chosen.append(name)
        else:
            left_out[name] = f"{support.status}: {support.reason}"
    return chosen, left_out


def candidate(model: nn.Module, unit: Unit, policy: Policy) -> nn.ModuleList:
    """Deep copies of the unit's layers (sharing their weight as the originals do), converted
    to `policy` by `apply`, each with its own region: call ``holder[i](*args)``."""
    modules = dict(model.named_modules())
    copies = copy.deepcopy([modules[p] for p in unit.paths])
    holder = nn.ModuleList(copies)
    rules = {str(i): policy for i in range(len(copies))}
    apply(holder, PolicyMap("32-true", rules), warn=False)
    return holder


def sixteen_bit(dtype: torch.dtype) -> bool:
    """Whether `dtype` is a 16-bit float (one a compensated step compensates)."""
    return dtype.is_floating_point and torch.finfo(dtype).bits == 16


def compensated(modules: nn.Module) -> bool:
    """Whether a search's training step of `modules` is compensated: it trains with Kahan
    compensation where a trainable parameter is 16-bit, and that step steps every parameter
    (packing the small ones: the module's docstring)."""
    return any(p.requires_grad and sixteen_bit(p.dtype) for p in modules.parameters())


def _packed(p: torch.Tensor) -> bool:
    """Whether a compensated step steps `p` from a packed copy: small, not contiguous, or
    bfloat16 of an odd size (stepped as pairs)."""
    odd = p.dtype == torch.bfloat16 and p.numel() % 2 == 1
    return p.numel() < SMALL or not p.is_contiguous() or odd


def state_bytes(
    modules: nn.Module,
    count: str,
    formats: dict[int, StateFormat] | None = None,
    step: bool | None = None,
) -> int:
    """Bytes of `modules`' parameters and buffers, each storage once; under
    ``count="training"`` also the gradient, the optimizer's two moments and (16-bit) Kahan
    buffer of each trainable parameter, and under a compensated step the packed copy of
    each small one (see the module's docstring). ``formats``: given (a run with low-bit
    optimizer states), the state format of some parameters (by ``id``), whose moments count
    as that format stores them (its block cut to the parameter, as the optimizer cuts it),
    every other parameter's as float32 moments, which the low-bit optimizer keeps for them
    whatever their dtype; None: torch's AdamW, moments in each parameter's dtype (float32
    for a float16 parameter, as the compensated step keeps them). ``step``: whether the
    step is compensated, for `modules` part of a model (None: `compensated(modules)`)."""
    seen: dict[int, tuple[int, torch.Tensor | None]] = {}
    for t in modules.parameters():
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = (storage.nbytes(), t if t.requires_grad else None)
    for t in modules.buffers():
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), (storage.nbytes(), None))
    training = count == "training"
    packs = training and formats is None and (compensated(modules) if step is None else step)
    total = 0
    for nbytes, trained in seen.values():
        total += nbytes
        if training and trained is not None:
            kept = nbytes * (2 if sixteen_bit(trained.dtype) else 1)
            kept += _moment_bytes(trained, nbytes, formats)
            total += kept + (nbytes + kept if packs and _packed(trained) else 0)
    return total


def _moment_bytes(p: torch.Tensor, nbytes: int, formats: dict[int, StateFormat] | None) -> int:
    """Bytes of the two moments the optimizer keeps for ``p`` (``nbytes`` of storage)."""
    if formats is None:  # (a float16 weight's: float32, as the compensated step keeps them)
        return 2 * (2 * nbytes if p.dtype == torch.float16 else nbytes)
    fmt = formats.get(id(p))
    real = p.numel() * (2 if p.is_complex() else 1)
    if fmt is None or not fmt.quantized:
        return 2 * 4 * real
    return 2 * fitted_format(fmt, p).bytes(real)


def describe_bytes(n: float) -> str:
    """Bytes in the unit that reads best (B, KB, MB, GB; powers of 1000)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
