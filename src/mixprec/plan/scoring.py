"""A search's first phases: each (layer, format) candidate built once and weighed
(`candidates`), then scored against float32 and timed, batch by batch (`score`)."""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

from mixprec.optim.states import StateFormat
from mixprec.plan import sensitivity
from mixprec.plan.inputs import SearchInputs, check_finite
from mixprec.plan.measure import convert
from mixprec.plan.report import Option, UnitRow
from mixprec.plan.state_choice import choose_states, holder_formats
from mixprec.plan.units import candidate, sixteen_bit, state_bytes, unit_applies
from mixprec.policy import QuantizedPolicy
from mixprec.policy.map import PolicyMap
from mixprec.precision import Precision
from mixprec.quantize.rules import weights_read_by_parents
from mixprec.step import batch_loss, fresh, seeded

__all__: list[str] = []

# per layer, per format: the layer built in that format, or None where it does not apply
Holders = list[list[nn.ModuleList | None]]


def candidates(
    s: SearchInputs,
) -> tuple[nn.Module, Holders, list[UnitRow], list[StateFormat | None] | None, int]:
    """The float32 reference model, every layer built in every format that applies to it, a
    row per layer with each candidate's bytes (the others marked with why not), each layer's
    optimizer-state formats when `s.states` offers some (`state_choice.choose_states`;
    None otherwise), and the baseline's bytes with float32 states, the memory budget's
    reference."""
    reference = convert(s.model, PolicyMap("32-true"))
    unit_states = (
        choose_states(reference, s.units, s.batches, s.loss_fn, s.states, lr=s.lr, seed=s.seed)
        if s.states is not None
        else None
    )
    # a plan with any low-bit state format trains with the low-bit optimizer, which keeps
    # float32 moments for every parameter given none
    low_bit = unit_states is not None and any(f is not None for f in unit_states)
    step = True if _compensated_outside(s) else None
    base_bytes = 0
    holders: Holders = []
    rows: list[UnitRow] = []
    modules = dict(reference.named_modules())
    read = weights_read_by_parents(reference)
    for unit in s.units:
        row = UnitRow(unit=unit)
        built: list[nn.ModuleList | None] = []
        for p in s.policies:
            reason = unit_applies(p, [modules[path] for path in unit.paths], read)
            if reason is not None:
                row.not_applicable[p.name] = reason
                built.append(None)
                continue
            holder = candidate(reference, unit, p)
            built.append(holder)
            formats = holder_formats(holder, unit_states[len(rows)]) if low_bit else None
            row.options[p.name] = Option(bytes=state_bytes(holder, s.count, formats, step))
            if p.name == s.base.name:  # the budget's reference: torch's AdamW
                base_bytes += state_bytes(holder, s.count, step=step)
        holders.append(built)
        rows.append(row)
    return reference, holders, rows, unit_states, base_bytes


def _compensated_outside(s: SearchInputs) -> bool:
    """Whether every plan's training step is compensated (`units.compensated`): the
    baseline stores parameters in 16 bits and a trainable one lies outside the searched
    layers (a norm under "bf16-true"). A float32 layer in such a plan is packed too."""
    searched = {
        id(p) for u in s.units for path in u.paths for p in s.model.get_submodule(path).parameters()
    }
    return sixteen_bit(s.base.param_dtype) and any(
        p.requires_grad and p.is_floating_point() and id(p) not in searched
        for p in s.model.parameters()
    )


def score(
    s: SearchInputs,
    reference: nn.Module,
    holders: Holders,
    rows: list[UnitRow],
    phases: dict[str, float],
) -> list[float]:
    """Each candidate's damage and step time, written into `rows`, from one float32 run of
    `reference` per search batch (the candidates timed on the first); returns the reference
    losses. Adds the seconds spent to ``phases["scores"]`` and ``phases["layer times"]``."""
    precision = Precision("32-true", device=s.device)
    scores = [[sensitivity.Scores() for _ in s.policies] for _ in s.units]
    paths = [p for u in s.units for p in u.paths]
    ref_losses = []
    for b, batch in enumerate(s.batches):
        clock = time.perf_counter()
        with seeded(s.seed, s.device):  # the caller's RNG state is theirs
            loss, calls, read_outside = sensitivity.record(
                reference,
                paths,
                lambda batch=batch: batch_loss(precision, reference, fresh(batch), s.loss_fn),
            )
        reference.zero_grad(set_to_none=True)
        check_finite(loss, f"batches[{b}]")
        ref_losses.append(loss)
        _drop_read_outside(s, holders, rows, read_outside)
        for u, unit in enumerate(s.units):
            for f, holder in enumerate(holders[u]):
                if holder is not None:
                    sensitivity.score(holder, unit, calls, scores[u][f])
        phases["scores"] += time.perf_counter() - clock
        clock = time.perf_counter()
        if b == 0:
            _time_candidates(s, holders, rows, calls)
        phases["layer times"] += time.perf_counter() - clock
        del calls
    names = s.names
    for u, row in enumerate(rows):
        for f, name in enumerate(names):
            if name in row.options:
                row.options[name].damage = scores[u][f].damage
                row.options[name].taylor = scores[u][f].first_order
    return ref_losses


def _drop_read_outside(
    s: SearchInputs, holders: Holders, rows: list[UnitRow], read_outside: dict[str, str]
) -> None:
    """Candidates a layer's outside readers could not run with, marked not applicable: a
    quantized layer has no float weight left for that reader, and the reader, run as the
    baseline runs, needs the weight in the baseline's dtype."""
    names = s.names
    for u, unit in enumerate(s.units):
        readers = [
            f"{p}'s weight is read by {read_outside[p]}" for p in unit.paths if p in read_outside
        ]
        if not readers:
            continue
        base_dtype = _weight_dtype(holders[u][names.index(s.base.name)])
        for f, p in enumerate(s.policies):
            if holders[u][f] is not None and (
                isinstance(p, QuantizedPolicy) or _weight_dtype(holders[u][f]) != base_dtype
            ):
                holders[u][f] = None
                rows[u].options.pop(p.name)
                rows[u].not_applicable[p.name] = "; ".join(readers)


def _time_candidates(
    s: SearchInputs, holders: Holders, rows: list[UnitRow], calls: dict[str, sensitivity.Calls]
) -> None:
    """Each live candidate's median step time, written into its row's option; seeded, as
    every run of the search: a stochastic-rounding backward draws from the generator, and
    the caller's RNG state is theirs."""
    with seeded(s.seed, s.device):
        for u, unit in enumerate(s.units):
            live = [(n, h) for n, h in zip(s.names, holders[u], strict=True) if h is not None]
            seconds = sensitivity.time_candidates(
                [h for _, h in live], unit, calls, s.training, s.reps
            )
            for (name, _), sec in zip(live, seconds, strict=True):
                rows[u].options[name].seconds = sec


def _weight_dtype(holder: nn.ModuleList) -> torch.dtype | None:
    """The dtype a candidate stores its (first layer's) float weight in; None: it has none."""
    weight = getattr(holder[0], "weight", None)
    return weight.dtype if isinstance(weight, Tensor) else None
