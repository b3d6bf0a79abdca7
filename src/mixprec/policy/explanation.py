"""What each layer of a model runs in, and why: `explain` resolves a policy (a plain one, a
`PolicyMap` or a policy file) over a model as `Precision.setup` would, and returns an
`Explanation`, a mapping from module path to its effective policy and reason that prints as
a table: where a step computes otherwise than `torch.autocast` alone would, which layers a
quantized policy quantizes or skips, each parameter's optimizer-state format and each
module's activation option with the bytes it saves."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mixprec.activations.rules import Choice
from mixprec.optim.states.assign import Assignment
from mixprec.optim.states.formats import StateFormat
from mixprec.optim.states.optimizers import fitted_format
from mixprec.policy import APPLIED_STATE
from mixprec.policy.map import Resolution, as_map, check_bypassed, dtype_plan

__all__ = ["Explanation", "explain"]


def _autocast_differences(
    resolved: dict[str, Resolution], types: dict[str, str], device_type: str
) -> dict[str, str]:
    """Where a step computes otherwise than `torch.autocast` alone would on `device_type`
    (each float32 island and float32 attention inside a mixed policy), with the reason."""
    out = {}
    for name, r in resolved.items():
        if r.source == "float32 island":
            parent = resolved[name.rpartition(".")[0]].policy if name else r.policy
            low = str(parent.compute_dtype).removeprefix("torch.")
            out[name] = (
                f"{types.get(name, 'this layer')} computes in float32 whatever its input: "
                f"{device_type} autocast would run it in its input's dtype ({low} after a "
                f"{low} layer); a float32 island, float32_islands=False drops it"
            )
        elif r.float32_attention:
            out[name] = f"attention in float32: {r.float32_attention}"
    return out


class Explanation(dict):
    """Effective policy per module path, with the reason; prints as a rich table."""

    def __init__(
        self,
        model: nn.Module,
        resolved: dict[str, Resolution],
        device_type: str = "cpu",
        states: Mapping[str, Assignment] | None = None,
        activations: Mapping[str, Choice] | None = None,
    ) -> None:
        super().__init__({name: r.policy for name, r in resolved.items()})
        # under a map with ``activations``: each module's activation option and why; with a
        # batch (`mixprec.explain(..., batch=)`), the bytes each module's own ops saved
        self.activations = dict(activations or {})
        self.saved_bytes: dict[str, int] = {}
        # under a map with ``states``: each parameter's optimizer-state format and why
        self.states = {name: (str(fmt), why) for name, (fmt, why) in (states or {}).items()}
        self.sources = {name: r.source for name, r in resolved.items()}
        # modules whose attention runs in float32 inside their 16-bit autocast, and why
        self.float32_attention = {
            name: r.float32_attention for name, r in resolved.items() if r.float32_attention
        }
        # (every path of a module reached at several: each row names its type)
        self.types = {
            name: type(m).__name__ for name, m in model.named_modules(remove_duplicate=False)
        }
        self.device_type = device_type
        self.autocast_differences = _autocast_differences(resolved, self.types, device_type)
        # the dtype a module's region hands its result back in where that is not its
        # policy's output dtype: inside a "true" parent, the parent's compute dtype
        # (`mixprec.explain` fills it in, as `apply` installs the regions)
        self.handed_back: dict[str, torch.dtype] = {}
        # under a quantized policy: "int8" etc. for a quantized layer, "skipped: why" for a
        # layer it leaves in its source float policy; layers quantized before, their mode
        self.quantization: dict[str, str] = {}
        for name, module in model.named_modules():
            r = resolved.get(name)
            if r is not None and r.quantized:
                self.quantization[name] = r.policy.mode  # type: ignore[attr-defined]
            elif r is not None and r.skipped:
                self.quantization[name] = f"skipped: {r.skipped}"
            elif isinstance(getattr(module, "quantization_mode", None), str):
                self.quantization[name] = module.quantization_mode

    @property
    def quantized(self) -> list[str]:
        """Paths of the layers that are (or will be) quantized."""
        return [n for n, q in self.quantization.items() if not q.startswith("skipped")]

    @property
    def skipped(self) -> dict[str, str]:
        """Layers a quantized policy leaves in float, with the reason."""
        return {
            n: q.removeprefix("skipped: ")
            for n, q in self.quantization.items()
            if q.startswith("skipped")
        }

    def __rich__(self) -> Any:
        from rich.table import Table

        caption = None
        if self.autocast_differences:
            # each reason once, after the modules it holds for (every LayerNorm shares one)
            names: dict[str, list[str]] = {}
            for name, why in self.autocast_differences.items():
                names.setdefault(why, []).append(name or "<root>")
            caption = f"beyond {self.device_type} torch.autocast: " + "; ".join(
                f"{', '.join(where)}: {why}" for why, where in names.items()
            )
        table = Table(title="effective precision per module", caption=caption)
        columns = ["module", "type", "policy", "param", "compute", "output", "why"]
        if self.quantization:
            columns.insert(6, "quantized")
        if self.states:
            columns.append("optimizer states")
        if self.activations:
            columns.append("activations")
        if self.saved_bytes:
            columns.append("saved")
        for col in columns:
            table.add_column(col)
        for name, p in self.items():
            quantized = [self.quantization.get(name, "")] if self.quantization else []
            table.add_row(
                name or "<root>",
                self.types.get(name, ""),
                p.name,
                str(p.param_dtype).removeprefix("torch."),
                str(p.compute_dtype).removeprefix("torch."),
                str(self.handed_back.get(name, p.output_dtype)).removeprefix("torch."),
                *quantized,
                self.sources[name]
                + (
                    f"; hands back {str(self.handed_back[name]).removeprefix('torch.')}"
                    if name in self.handed_back
                    else ""
                )
                + (
                    f"; attention in float32 ({self.float32_attention[name]})"
                    if name in self.float32_attention
                    else ""
                ),
                *([self._states_of(name)] if self.states else []),
                *([self._activation_of(name)] if self.activations else []),
                *([_size(self.saved_bytes.get(name, 0))] if self.saved_bytes else []),
            )
        return table

    def _activation_of(self, module: str) -> str:
        option, why = self.activations.get(module, ("keep", "default"))
        return f"{option} ({why})"

    def _states_of(self, module: str) -> str:
        """The state formats of ``module``'s own parameters: ``weight int8 (default)``."""
        return "; ".join(
            f"{param.rpartition('.')[2]} {fmt} ({why})"
            for param, (fmt, why) in self.states.items()
            if param.rpartition(".")[0] == module
        )

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=140, record=True, file=io.StringIO())
        console.print(self)
        return console.export_text()


def _size(n: int) -> str:
    """Bytes as a table shows them: in B, KiB or MiB, with one decimal above B."""
    if n < 1024:
        return f"{n} B" if n else "0"
    return f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.1f} MiB"


def explain(
    model: nn.Module,
    policy: Any = None,
    *,
    slow_attention: frozenset[torch.dtype] = frozenset(),
    device_type: str = "cpu",
    optimizer_states: str | StateFormat | None = None,
) -> Explanation:
    """What each layer of `model` runs in under `policy` (default: the policy `apply` gave
    the model, else the global one), and under quantized policies which layers are
    quantized and which skipped, and why; under a map with ``states`` or with
    ``optimizer_states`` (`Precision`'s, the run's default state format), each parameter's
    optimizer-state format and why (`Explanation.states`), as `Precision.setup` gives them;
    under a map with ``activations``, each module's activation option and why
    (`Explanation.activations`).
    `slow_attention` and `device_type` as `PolicyMap.resolve` takes them (`mixprec.explain`
    passes the model's device's)."""
    if policy is None:
        applied = model.__dict__.get(APPLIED_STATE)
        policy = applied.policy if applied is not None else None
    pmap = as_map(policy)
    default = pmap.state_default(optimizer_states)
    resolved = pmap.resolve(model, slow_attention=slow_attention, device_type=device_type)
    check_bypassed(model, resolved)  # (refuses what apply refuses)
    dtype_plan(model, resolved, replaced=True)
    # (warnings point at the caller of mixprec.explain, which calls this)
    pmap.warn_unmatched_rules(model, stacklevel=3)
    pmap.warn_unmatched_states(model, stacklevel=3)
    has_states = pmap.states is not None or default is not None
    states = pmap.state_formats(model, default) if has_states else None
    if states is not None:  # (a block larger than a parameter is cut, as the run cuts it)
        named = dict(model.named_parameters())
        states = {n: (fitted_format(fmt, named[n]), why) for n, (fmt, why) in states.items()}
    activations = None
    if pmap.activations is not None:
        pmap.activations.warn_unmatched(model, stacklevel=3)
        activations = pmap.activation_choices(model)
    return Explanation(model, resolved, device_type, states, activations)
