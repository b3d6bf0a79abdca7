"""What a format search found, as a value: per layer the chosen format, its cost and score;
the plan measured beside the baseline, float32 and every uniform plan; the attempts; the
training run. Markdown, JSON, a terminal table, and the policy file the plan is."""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixprec.plan.budget import Budget
from mixprec.plan.measure import Measured, Trained
from mixprec.plan.units import Unit, describe_bytes
from mixprec.policy.map import PolicyMap

__all__ = [
    "REPORT_FILES",
    "Attempt",
    "BlockRow",
    "Option",
    "SearchReport",
    "UnitRow",
]

REPORT_FILES = ("policy.json", "search.md", "search.json")


@dataclass
class Option:
    """One format for one layer: bytes, median seconds of its step, damage (the Fisher
    term), first-order term, the damage measured alone when a retry needed it, and under a
    search's ``batch_size`` what the layer's saved activations grow by in this format over
    the baseline's (a float32 layer under a bfloat16 baseline saves float32 ones), which a
    budget's count of the layer adds (`counted_bytes`)."""

    bytes: int
    seconds: float = 0.0
    damage: float = 0.0
    taylor: float = 0.0
    measured_damage: float | None = None
    activation_bytes: int = 0

    @property
    def counted_bytes(self) -> int:
        """What a memory budget counts for the layer in this format."""
        return self.bytes + self.activation_bytes


@dataclass
class UnitRow:
    """A searched layer (or tied group): its options, the chosen one, and why it was kept
    above cheaper formats: (format, its damage over the median layer's in that format; inf
    where it overflows)."""

    unit: Unit
    options: dict[str, Option] = field(default_factory=dict)
    not_applicable: dict[str, str] = field(default_factory=dict)
    chosen: str = ""
    why: list[tuple[str, float]] = field(default_factory=list)

    def reason(self) -> str:
        """Why this layer is not in a cheaper format (empty when it is in the cheapest, or
        the budget had room for it): one that overflows here before one that hurts it most."""
        if not self.why:
            return ""
        fmt, ratio = max(self.why, key=lambda w: (w[1], self.options[w[0]].damage))
        if self.options[fmt].damage == math.inf:
            return f"{fmt} overflows here (its output is not finite where float32's is)"
        times = "inf" if ratio == math.inf else f"{ratio:.3g}"
        return f"{fmt} would hurt it {times}x the median layer's damage in {fmt}"


@dataclass
class BlockRow:
    """One block's activation options (`mixprec.plan.activation_choice`): each option's
    counted bytes at the batch, seconds and damage, those it cannot take with why, and the
    option chosen."""

    path: str
    kind: str
    options: dict[str, Option] = field(default_factory=dict)
    not_applicable: dict[str, str] = field(default_factory=dict)
    chosen: str = "keep"


@dataclass
class Attempt:
    """One solve and its verification: the formats chosen, the measured loss and its gap
    to the baseline's (a fraction), and the predicted loss change (both terms summed)."""

    chosen: list[str]
    loss: float
    gap: float
    predicted: float
    note: str = ""
    kept: bool = False  # the attempt the report's plan is (the lowest measured loss), if one


def formats_of(
    name: str, rows: list[UnitRow], baseline: str, formats: list[str]
) -> list[str] | None:
    """The format of each searched layer in measured plan `name` ("plan", "baseline",
    "float32", "all <format>"); None for float32 when it is not one of the `formats`."""
    if name == "plan":
        return [r.chosen for r in rows]
    if name == "baseline":
        return [baseline for _ in rows]
    if name.startswith("all "):
        fmt = name[4:]
        return [fmt if fmt in r.options else baseline for r in rows]
    if "32-true" in formats:
        return ["32-true" for _ in rows]
    return None


def costs_of(
    measured: Measured, rows: list[UnitRow], formats: list[str] | None
) -> dict[str, float]:
    """A measured plan's cost per budget kind, as the budget counts it: bytes of the
    searched layers; the summed step time of its layers' `formats`, when each was timed
    (float32 puts a layer whose weight is read outside it in float32, an option its row
    lacks); each with its blocks' activations, when counted."""
    out: dict[str, float] = {
        "memory": measured.unit_bytes + measured.activation_bytes + measured.extra_bytes
    }
    if formats is not None and all(f in r.options for r, f in zip(rows, formats, strict=True)):
        out["speed"] = measured.activation_seconds + sum(
            r.options[f].seconds for r, f in zip(rows, formats, strict=True)
        )
    return out


def ranked(loss: float) -> float:
    """`loss` as plans are compared by it: a non-finite one (a plan that overflowed) is
    +inf, above every finite loss; a NaN would lose no comparison, and stay chosen."""
    return loss if math.isfinite(loss) else math.inf


def within(costs: dict[str, float], limits: dict[str, float]) -> bool | None:
    """Whether `costs` fit every budgeted limit (None: a budgeted kind is not known)."""
    if any(kind not in costs for kind in limits):
        return None
    return all(costs[kind] <= limit * (1 + 1e-9) for kind, limit in limits.items())


def _num(x: float) -> str:
    if x == 0 or not math.isfinite(x):
        return str(x) if not math.isfinite(x) else "0"
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.2e}"


@dataclass
class SearchReport:
    """The result of `mixprec.search` (see its docstring); `policy` is the plan.

    Attributes:
        rows: each searched layer (or tied group), its formats' costs and scores, its format.
        formats: the formats the search tried.
        left_out: formats not tried, each with why (slow or refused on the device, ...).
        baseline: the baseline policy's name, which the plan's loss is held to.
        budget: the budget the plan had to fit (fractions of the baseline's costs).
        count: what the bytes count: "weights", or "training" (also gradients, optimizer state).
        base_costs: the searched layers' baseline bytes ("memory"), summed step seconds ("speed").
        limits: each budget kind's limit in those units.
        policy: the plan, as a `PolicyMap`.
        measured: each verified plan ("plan", "baseline", "float32", "all <format>") as run.
        attempts: every solve and its verification; the kept one is the plan.
        tolerance: how far (a fraction) the plan's loss may exceed the baseline's.
        held_out: whether the losses were measured on held-out evaluation batches.
        trained: the short training runs of the plan and the baseline, if asked for.
        reference_loss: the float32 model's mean loss on the search batches (not held out).
        device: the device searched on, as `mixprec info` describes it.
        seconds: how long the search took.
        phases: seconds per step of the search.
        uniform_won: the name of the uniform plan (the baseline, float32 among them) returned
            as it fits and measured a lower loss than every solved one; None for a solved one.
        blocks: under ``batch_size``, each block with its activation options' bytes at that
            batch, seconds and damage, and the option chosen; empty otherwise.
        batch_size: the batch activations were counted at (None: not counted).
        fixed_bytes: bytes no choice changes, counted with a budget in bytes: the unsearched
            parameters (as ``count`` counts them) and the activations saved outside blocks.
        untrained: why the training runs asked for were not run ("" when they were).
    """

    rows: list[UnitRow]
    formats: list[str]
    left_out: dict[str, str]
    baseline: str
    budget: Budget
    count: str
    base_costs: dict[str, float]
    limits: dict[str, float]
    policy: PolicyMap
    measured: dict[str, Measured]
    attempts: list[Attempt]
    tolerance: float
    held_out: bool
    trained: dict[str, Trained]
    reference_loss: float
    device: str
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    uniform_won: str | None = None
    blocks: list[BlockRow] = field(default_factory=list)
    batch_size: int | None = None
    fixed_bytes: int = 0
    untrained: str = ""

    # --- verdicts -------------------------------------------------------------------
    @property
    def plan(self) -> dict[str, str]:
        """The chosen format of each searched layer, by path (each path a layer is at)."""
        return {p: r.chosen for r in self.rows for p in r.unit.paths + r.unit.aliases}

    @property
    def total_bytes(self) -> int:
        """The whole model's bytes the search counted for the plan: its searched layers, its
        blocks' activations, the fixed bytes and what the plan holds beyond them in its own
        dtypes (what a budget in bytes is held to)."""
        p = self.measured["plan"]
        return int(p.unit_bytes + p.activation_bytes + p.extra_bytes + self.fixed_bytes)

    @property
    def activations(self) -> dict[str, str]:
        """The chosen activation option of each block, by path (empty: none counted)."""
        return {b.path: b.chosen for b in self.blocks}

    @property
    def gap(self) -> float:
        """The plan's measured loss above the baseline's, as a fraction of it."""
        plan, base = self.measured["plan"].loss, self.measured["baseline"].loss
        return (plan - base) / max(abs(base), 1e-12)

    @property
    def met(self) -> bool:
        """Whether the verified plan's loss is within `tolerance` of the baseline's."""
        return self.gap <= self.tolerance

    def _costs(self, name: str) -> dict[str, float]:
        return costs_of(self.measured[name], self.rows, self._formats_of(name))

    def _formats_of(self, name: str) -> list[str] | None:
        return formats_of(name, self.rows, self.baseline, self.formats)

    def fits(self, name: str) -> bool | None:
        """Whether measured plan `name` fits the budget (None: not known for a kind)."""
        return within(self._costs(name), self.limits)

    @property
    def uniform(self) -> list[str]:
        """The uniform plans measured ("all <format>")."""
        return [n for n in self.measured if n.startswith("all ")]

    def _one_format(self) -> list[str]:
        """The measured plans of one format everywhere a summary weighs the plan against:
        the baseline, float32 when it is one of the formats (under a 32-true baseline it is
        the baseline), and the uniform plans."""
        f32 = "32-true" in self.formats and self.baseline != "32-true"
        return ["baseline", *(["float32"] if f32 else []), *self.uniform]

    @property
    def beats_uniform(self) -> bool:
        """Whether the plan's loss is strictly below every uniform plan that fits."""
        plan = ranked(self.measured["plan"].loss)
        return all(plan < ranked(self.measured[n].loss) for n in self.uniform if self.fits(n))

    # --- views ----------------------------------------------------------------------
    def _budget_line(self) -> str:
        parts = []
        for kind, limit in self.limits.items():
            frac = getattr(self.budget, kind)
            if kind == "memory" and self.budget.memory_bytes is not None:
                acts = f", activations at batch {self.batch_size}" if self.batch_size else ""
                parts.append(
                    f"memory <= {describe_bytes(self.budget.memory_bytes)} for the whole model "
                    f"({self.count} bytes{acts}; {describe_bytes(limit)} left to the searched "
                    f"layers and blocks after {describe_bytes(self.fixed_bytes)} fixed)"
                )
            elif kind == "memory":
                whole = describe_bytes(self.base_costs["memory"])
                parts.append(
                    f"memory <= {frac:g}x the baseline's {self.count} bytes of the searched "
                    f"layers ({describe_bytes(limit)} of {whole})"
                )
            else:
                parts.append(
                    f"speed: the searched layers' summed step time <= {frac:g}x the "
                    f"baseline's ({limit * 1e3:.3g} of {self.base_costs['speed'] * 1e3:.3g} ms)"
                )
        return "; ".join(parts)

    def summary(self) -> str:
        """A few lines: the verdict, the plan's loss, bytes and time against the baseline."""
        p, b = self.measured["plan"], self.measured["baseline"]
        gap = self.gap
        verdict = "within" if self.met else "MISSES"
        where = "held-out batches" if self.held_out else "the search batches (no held-out ones)"
        lines = [
            f"plan {verdict} tolerance: loss {p.loss:.6g} vs baseline {self.baseline} "
            f"{b.loss:.6g} ({gap:+.2%}, tolerance {self.tolerance:.2%}) on {where}",
            f"searched layers: {describe_bytes(p.unit_bytes)} vs {describe_bytes(b.unit_bytes)} "
            f"({p.unit_bytes / b.unit_bytes:.3f}x); step {p.seconds * 1e3:.3g} ms vs "
            f"{b.seconds * 1e3:.3g} ms ({p.seconds / b.seconds:.2f}x)",
        ]
        # (a plan storing or recomputing a block's activations equals none of them)
        same = [
            n
            for n in self._one_format()
            if all(b.chosen == "keep" for b in self.blocks)
            and self._formats_of(n) == self._formats_of("plan")
        ]
        solved = min(self.attempts, key=lambda a: ranked(a.loss)) if self.attempts else None
        if (
            self.uniform_won is not None
            and solved is not None
            and ranked(p.loss) >= ranked(solved.loss)
        ):
            lines.append(
                f"a uniform plan won: the plan is {self.uniform_won}, which fits where the "
                f"plan the solver chose (loss {solved.loss:.6g}) measured over the byte limit"
            )
        elif self.uniform_won is not None and solved is not None:
            lines.append(
                f"a uniform plan won: the plan is {self.uniform_won}, which fits and measured "
                f"a lower loss than every plan the solver chose (the lowest {solved.loss:.6g})"
            )
        elif same:
            whole = {
                "baseline": f"no layer moved from {self.baseline}",
                "float32": "every layer in 32-true",
            }
            lines.append(
                f"the plan is {same[0]}: "
                + whole.get(same[0], "every layer the format takes is in it")
            )
        fitting = [n for n in self._one_format() if self.fits(n) and n not in same]
        beaten = [n for n in fitting if ranked(p.loss) < ranked(self.measured[n].loss)]
        if beaten:
            lines.append(f"better than the uniform plans that fit: {', '.join(beaten)}")
        for n in fitting:
            if n in beaten:
                continue
            m = self.measured[n]
            if (m.loss, m.unit_bytes) == (p.loss, p.unit_bytes):  # (another name, one plan)
                lines.append(f"the same loss and bytes as {n}")
                continue
            frozen = (
                self.count == "training"
                and m.trainable is not None
                and p.trainable is not None
                and m.trainable < p.trainable
            )
            lines.append(
                f"NOT better than {n}, which fits: loss {m.loss:.6g} "
                f"({m.unit_bytes / b.unit_bytes:.3f}x the bytes)"
                + (
                    f"; it trains {m.trainable} parameters to the plan's {p.trainable} "
                    "(int8/int4 weights are frozen), and a lower loss before training "
                    "within the tolerance does not replace the plan"
                    if frozen
                    else ""
                )
            )
        if not fitting and not same:
            lines.append("no uniform plan fits the budget")
        if self.fits("plan") is False:
            lines.append("the plan does NOT fit the budget as measured")
        if self.blocks:
            chosen = [b.chosen for b in self.blocks]
            counts = ", ".join(f"{chosen.count(o)} {o}" for o in dict.fromkeys(chosen))
            lines.append(
                f"activations at batch {self.batch_size}: {describe_bytes(p.activation_bytes)} "
                f"saved by the blocks ({counts}) vs {describe_bytes(b.activation_bytes)} kept"
            )
        speed = getattr(self.budget, "speed", None)
        # (the plan is the baseline: its ratio to itself is timing noise)
        if speed is not None and p.seconds is not None and b.seconds and "baseline" not in same:
            ratio = p.seconds / b.seconds
            if ratio > speed:
                lines.append(
                    f"the speed budget holds for the layers' times measured alone "
                    f"({self._costs('plan')['speed'] / self.base_costs['speed']:.2f}x), but "
                    f"the whole step measures {ratio:.2f}x the baseline's: regions, casts and "
                    "the unsearched ops do not shrink with the layers"
                )
        if self.uniform_won is not None:
            lines.append(f"{len(self.attempts)} solved plan(s) measured, none as low")
        elif len(self.attempts) > 1:
            k = next(i for i, a in enumerate(self.attempts, 1) if a.kept)
            how = "met the tolerance" if self.met else "missed too, the lowest loss"
            lines.append(f"{len(self.attempts)} attempts; the plan is attempt {k} ({how})")
        elif self.attempts[0].note:
            lines.append(self.attempts[0].note)
        if self.untrained:
            lines.append(self.untrained)
        return "\n".join(lines)

    def _plan_rows(self) -> list[list[str]]:
        b = self.measured["baseline"]
        rows = []
        for name, m in self.measured.items():
            fits = self.fits(name)
            rows.append(
                [
                    name,
                    f"{m.loss:.6g}",
                    f"{(m.loss - b.loss) / max(abs(b.loss), 1e-12):+.3%}",
                    describe_bytes(m.unit_bytes),
                    f"{m.unit_bytes / b.unit_bytes:.3f}",
                    describe_bytes(m.model_bytes),
                    "-" if m.seconds is None else f"{m.seconds * 1e3:.3g}",
                    "-" if m.seconds is None else f"{m.seconds / b.seconds:.2f}",
                    "?" if fits is None else ("yes" if fits else "no"),
                ]
            )
        return rows

    _PLAN_HEADERS = (
        "plan",
        "loss",
        "vs baseline",
        "layers' bytes",
        "x baseline",
        "model bytes",
        "step ms",
        "x baseline",
        "fits budget",
    )
    # "fits budget": bytes as measured; time as the budget counts it, the layers' times
    # measured alone (the step column is the whole step)
    _LAYER_HEADERS = ("layer", "type", "params", "format", "bytes", "ms", "damage", "why")

    def _layer_rows(self) -> list[list[str]]:
        """A row per layer. A layer in a format its row has no option for (float32 won,
        putting there a layer whose weight is read outside it) has no bytes, time or damage
        of its own to show, and says why."""
        rows = []
        for r in self.rows:
            o = r.options.get(r.chosen)
            costs = (
                ["-", "-", "-"]
                if o is None
                else [describe_bytes(o.bytes), f"{o.seconds * 1e3:.3g}", _num(o.damage)]
            )
            why = r.reason()
            if o is None and r.chosen in r.not_applicable:
                why = f"not searched in {r.chosen}: {r.not_applicable[r.chosen]}"
            rows.append(
                [
                    r.unit.name,
                    "+".join(dict.fromkeys(r.unit.kinds)),
                    str(r.unit.params),
                    r.chosen,
                    *costs,
                    why,
                ]
            )
        return rows

    def to_markdown(self, command: str | None = None, title: str = "Format search") -> str:
        """The whole report as markdown (what `save` writes to search.md)."""
        out = io.StringIO()
        w = out.write
        w(f"# {title}\n\n")
        if command:
            w(f"Command: `{command}`\n\n")
        w(f"Device: {self.device}. Baseline: {self.baseline}. Budget: {self._budget_line()}. ")
        w(f"Search took {self.seconds:.1f} s")
        if self.phases:
            w(" (" + ", ".join(f"{k} {v:.1f} s" for k, v in self.phases.items()) + ")")
        w(".\n\n")
        w(f"Formats tried: {', '.join(self.formats)}.")
        if self.left_out:
            w(" Left out: " + "; ".join(f"{k} ({v})" for k, v in self.left_out.items()) + ".")
        w("\n\n")
        w(self.summary().replace("\n", "  \n") + "\n\n")
        w("## Plans, measured\n\n")
        w(f"Loss: mean over the {'held-out' if self.held_out else 'search'} batches; ")
        w("bytes of the searched layers and of the whole model, counted as ")
        step = "training step" if self.count == "training" else "forward"
        w(f"`{self.count}`; step: median ms of one whole {step} ")
        w("(plans taking turns; uniform plans are timed under a speed budget only). A uniform ")
        w("plan puts every layer the format can take in it. Fits budget: bytes as measured; ")
        w("time as the budget counts it, the searched layers' times measured alone.\n\n")
        w(_md_table(self._PLAN_HEADERS, self._plan_rows()))
        w("\n## Attempts\n\n")
        w("Predicted: the layers' first- and second-order terms summed, on the search batches ")
        w(f"(float32 loss there {self.reference_loss:.6g}); measured: against float32 on the ")
        w(f"{'held-out' if self.held_out else 'search'} batches.\n\n")
        f32 = self.measured["float32"].loss
        for i, a in enumerate(self.attempts, 1):
            w(
                f"{i}. loss {a.loss:.6g} ({a.gap:+.3%} vs baseline); change from float32: "
                f"predicted {_num(a.predicted)}, measured {_num(a.loss - f32)}"
                f"{'; ' + a.note if a.note else ''}{' (the plan)' if a.kept else ''}\n"
            )
        w("\n## Per layer\n\n")
        w("damage: the Fisher-weighted output error of the chosen format (predicted loss ")
        w("increase over float32); why: a cheaper format that overflows there, or the one ")
        w("that would have hurt it most, against the median layer.\n\n")
        w(_md_table(self._LAYER_HEADERS, self._layer_rows()))
        w("\n## Damage per format\n\n")
        headers = ("layer", *self.formats)
        rows = [
            [r.unit.name]
            + [_num(r.options[f].damage) if f in r.options else "n/a" for f in self.formats]
            for r in self.rows
        ]
        w(_md_table(headers, rows))
        if self.blocks:
            w(f"\n## Activations per block (batch {self.batch_size})\n\n")
            w("bytes: what each option leaves saved at the batch, measured; damage: the ")
            w("first-order loss change of one SGD step with the stored gradients; ms: the ")
            w("block's forward and backward alone.\n\n")
            options = list(dict.fromkeys(o for b in self.blocks for o in b.options))
            headers = ("block", "type", "chosen", *(f"{o} bytes" for o in options))
            rows = [
                [b.path, b.kind, b.chosen]
                + [describe_bytes(b.options[o].bytes) if o in b.options else "n/a" for o in options]
                for b in self.blocks
            ]
            w(_md_table(headers, rows))
        if self.trained:
            w("\n## Training run\n\n")
            w("| plan | first loss | last loss | eval loss after |\n|---|---:|---:|---:|\n")
            for name, t in self.trained.items():
                w(f"| {name} | {t.losses[0]:.6g} | {t.losses[-1]:.6g} | {t.eval_loss:.6g} |\n")
            w(f"\n{len(next(iter(self.trained.values())).losses)} AdamW steps each.\n")
        elif self.untrained:
            w(f"\n## Training run\n\n{self.untrained}.\n")
        return out.getvalue()

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready values (what `save` writes to search.json)."""
        return _strict_json(
            {
                "device": self.device,
                "baseline": self.baseline,
                "budget": {k: v for k, v in vars(self.budget).items() if v is not None},
                "batch_size": self.batch_size,
                "fixed_bytes": self.fixed_bytes,
                "activations": [
                    {
                        "path": b.path,
                        "kind": b.kind,
                        "chosen": b.chosen,
                        "options": {k: vars(o) for k, o in b.options.items()},
                        "not_applicable": b.not_applicable,
                    }
                    for b in self.blocks
                ],
                "count": self.count,
                "limits": self.limits,
                "baseline_costs": self.base_costs,
                "formats": self.formats,
                "left_out": self.left_out,
                "tolerance": self.tolerance,
                "met": self.met,
                "beats_uniform": self.beats_uniform,
                "uniform_won": self.uniform_won,
                "held_out": self.held_out,
                "reference_loss": self.reference_loss,
                "seconds": self.seconds,
                "phases": self.phases,
                "plan": self.plan,
                "measured": {
                    name: {**vars(m), "fits": self.fits(name)} for name, m in self.measured.items()
                },
                "attempts": [vars(a) for a in self.attempts],
                "layers": [
                    {
                        "paths": list(r.unit.paths),
                        "kinds": list(r.unit.kinds),
                        "params": r.unit.params,
                        "chosen": r.chosen,
                        "why": r.reason(),
                        "options": {k: vars(o) for k, o in r.options.items()},
                        "not_applicable": r.not_applicable,
                    }
                    for r in self.rows
                ],
                "trained": {k: vars(t) for k, t in self.trained.items()},
                "untrained": self.untrained,
            }
        )

    def save(self, directory: str | Path, command: str | None = None) -> Path:
        """Write policy.json (the plan, for `Precision`, the Trainer, the CLI), search.md
        and search.json into `directory` (made if missing); returns the policy file."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "search.md").write_text(self.to_markdown(command))
        (directory / "search.json").write_text(
            json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"
        )
        return self.policy.save(directory / "policy.json")

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.text import Text

        from mixprec.textout import Column, FittedTable

        plans = FittedTable(
            "plans, measured",
            [
                Column(h, "left" if i == 0 else "right", None if i < 3 else 9 - i)
                for i, h in enumerate(self._PLAN_HEADERS)
            ],
            full="search.md has every column",
        )
        for cells in self._plan_rows():
            plans.add_row(cells)
        layers = FittedTable(
            "per layer",
            [
                Column(
                    h,
                    "left" if h in ("layer", "type", "format", "why") else "right",
                    None if h in ("layer", "format") else 8 - i,
                )
                for i, h in enumerate(self._LAYER_HEADERS)
            ],
            full="search.md has every column",
        )
        for cells in self._layer_rows():
            layers.add_row(cells)
        return Group(Text(self.summary()), plans, layers)

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=160, record=True, file=io.StringIO(), color_system=None)
        console.print(self.__rich__())
        return console.export_text()


def _strict_json(value: Any) -> Any:
    """`value` with non-finite floats as strings ("inf", "nan"): strict JSON has none."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def _md_table(headers: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
