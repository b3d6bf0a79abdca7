"""How a Diagnosis looks: a rich table for the terminal, markdown and PNG plots on disk."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixprec.doctor.verdicts import AT_RISK, BROKEN, DOWNSTREAM, OK, UPSTREAM, scale_text
from mixprec.dtypes import format_info
from mixprec.files import write_atomically, write_figure

if TYPE_CHECKING:
    from mixprec.doctor.diagnosis import Diagnosis, Recommendation
    from mixprec.doctor.verdicts import ModuleReport

__all__ = [
    "REPORT_FILES",
    "scale_needed",
    "writes_policy",
]

# what `save` writes (policy.json only with a recommendation); a run never overwrites them
REPORT_FILES = ("report.md", "error.png", "range.png", "policy.json")

_STYLE = {OK: "green", AT_RISK: "yellow", BROKEN: "red bold"}
_COLUMNS = (
    "module",
    "type",
    "out dtype",
    "amax",
    "min abs",
    "overflow",
    "underflow",
    "inf/nan",
    "rel err",
    "SQNR dB",
    "param grad underflow",
    "verdict",
)


def _num(x: float) -> str:
    if x is None or math.isnan(x):
        return "-"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    return f"{x:.3g}" if 1e-2 <= abs(x) < 1e4 else f"{x:.2e}"


def _pct(x: float) -> str:
    if x == 0:
        return "0"
    return f"{x:.1%}" if x >= 0.001 else "<0.1%"


# the terminal shows fewer columns than the markdown report
_TERMINAL = ("module", "type", "out dtype", "amax", "inf/nan", "rel err", "SQNR dB", "verdict")
# which of them a narrow terminal keeps longest (absent: always shown)
_KEEP = {"SQNR dB": 5, "type": 4, "rel err": 3, "inf/nan": 2, "out dtype": 1}


def _cells(m: ModuleReport, columns: tuple[str, ...] = _COLUMNS) -> list[str]:
    cells = {
        "module": m.display_name,
        "type": m.type,
        "out dtype": m.dtype,
        "amax": _num(m.amax),
        "min abs": _num(m.amin),
        "overflow": _pct(m.overflow),
        "underflow": _pct(m.underflow),
        "inf/nan": str(m.nonfinite),
        "rel err": _num(m.rel_error),
        "SQNR dB": _num(m.sqnr_db),
        "param grad underflow": _pct(max(m.param_grad_underflow, m.param_grad_flushed)),
        "verdict": verdict_text(m),
    }
    return [cells[c] for c in columns]


def verdict_text(m: ModuleReport) -> str:
    """A module's verdict as the tables show it: an ok module holding inf/NaN is never just
    "ok", since it only passes on what a broken module made (or holds one that is): in its
    outputs, from upstream, or only in its gradients, from downstream."""
    if m.verdict != OK or not (m.nonfinite or m.grad_nonfinite):
        return m.verdict
    if m.note.startswith("contains"):
        return "inf/NaN from inside"
    return UPSTREAM if m.nonfinite else DOWNSTREAM


def hidden_downstream(d: Diagnosis) -> str | None:
    """Why a run with a broken module cannot rule out another, or None: the modules after it
    hold its inf/NaN in their outputs and those before it in their gradients, so whether one
    of them breaks on its own shows only in a run with it fixed."""
    shown = [verdict_text(m) for m in d.modules.values()]
    after, before = shown.count(UPSTREAM), shown.count(DOWNSTREAM)
    origins = [m.display_name for m in d.findings if m.verdict == BROKEN]
    if not (after or before) or not origins:
        return None
    names = ", ".join(origins)
    made = f"the inf/NaN {'it' if len(origins) == 1 else 'they'} made"
    where = [f"{after} module(s) after {names} hold {made}"] if after else []
    if before:
        where.append(
            f"{before} module(s) before {names} hold {'it' if after else made} in their gradients"
        )
    return (
        f"{'; '.join(where)}, so whether one of them breaks on its own shows only in a run "
        "with it fixed: the recommendation fixes one module at a time and runs again after "
        "each fix, naming any it finds (mixprec doctor without --no-recommend, or run again "
        "with its policy.json)"
    )


def summary(d: Diagnosis) -> str:
    """What was compared, the two losses, the loss scale and the verdict counts."""
    broken = sum(m.verdict == BROKEN for m in d.modules.values())
    risky = sum(m.verdict == AT_RISK for m in d.modules.values())
    scale = ""
    if d.precision.needs_loss_scaling:
        scale = (
            f"; loss scale {scale_text(d.loss_scale)} (recommended initial scale "
            f"{scale_text(d.recommended_loss_scale)})"
        )
    return (
        f"{d.precision.name} vs {d.reference.name} on {d.device}: loss {d.target_loss:.6g} vs "
        f"{d.loss:.6g} (relative error {_num(d.loss_rel_error)}), gradient relative error "
        f"{_num(d.grad_rel_error)}{scale}\n"
        f"{len(d.modules)} modules: {broken} broken, {risky} at risk"
    )


def rich_view(d: Diagnosis, rows: int = 15) -> Any:
    """A rich renderable: summary, the worst modules as a table, and the findings."""
    from rich.console import Group
    from rich.text import Text

    from mixprec.textout import Column, FittedTable

    table = FittedTable(
        f"worst modules ({min(rows, len(d.modules))} of {len(d.modules)})",
        [
            Column(c, "left" if c in ("module", "type", "verdict") else "right", _KEEP.get(c))
            for c in _TERMINAL
        ],
        full="every column is in the report",
    )
    for m in d.worst(rows):
        cells = _cells(m, _TERMINAL)
        style = _STYLE[m.verdict] if cells[-1] == m.verdict else _STYLE[AT_RISK]
        cells[-1] = f"[{style}]{cells[-1]}[/]"
        table.add_row(cells)
    parts: list[Any] = [Text(summary(d)), table]
    for m in d.findings:
        parts.append(
            Text.from_markup(
                f"[{_STYLE[m.verdict]}]{m.verdict}[/] [bold]{m.display_name}[/] "
                f"({m.type}): {m.reason}"
            )
        )
    if not d.findings:
        parts.append(Text.from_markup("[green]no finding: every module is ok[/]"))
    hidden = hidden_downstream(d)
    if hidden:
        parts.append(Text(hidden))
    return Group(*parts)


def as_text(d: Diagnosis) -> str:
    """The rich view rendered as plain text (what `str(diagnosis)` gives)."""
    from rich.console import Console

    console = Console(width=160, record=True, file=io.StringIO(), color_system=None)
    console.print(rich_view(d))
    return console.export_text()


def writes_policy(d: Diagnosis, recommendation: Recommendation | None) -> bool:
    """Whether `save` writes policy.json: with a recommendation, unless its fix is a loss
    scale alone (its policy is the diagnosed one, which would fail again as it is)."""
    if recommendation is None:
        return False
    return recommendation.loss_scale is None or recommendation.policy != d.precision


def scale_needed(d: Diagnosis, recommendation: Recommendation | None) -> str | None:
    """Where the fix changes the loss scale, that in a sentence: a policy (policy.json)
    holds no loss scale, so a check or a training run must be given it; None otherwise."""
    if recommendation is None or recommendation.loss_scale is None:
        return None
    scale = scale_text(recommendation.loss_scale)
    if writes_policy(d, recommendation):
        what = f"the fix also needs loss scale {scale}, which policy.json (a policy) does not hold"
    else:
        what = (
            f"the fix is loss scale {scale} alone, with {d.precision.name} as it is: a policy "
            "file cannot hold a loss scale, so no policy.json is written"
        )
    return f"{what}; check it with --loss-scale {scale}, and train at that scale"


def to_markdown(
    d: Diagnosis,
    plots: dict[str, str] | None = None,
    recommendation: Recommendation | None = None,
    unrecommended: str | None = None,
    check: str | None = None,
) -> str:
    """The report as markdown: summary, findings, the recommended policy and how its run
    compares (or, ``unrecommended``, why no policy was recommended), the command that
    checks the fix again (``check``), the plots, every module's and parameter's
    statistics."""
    lines = ["# mixprec doctor report", ""]
    for line in summary(d).splitlines():
        lines += [line, ""]
    lines += ["## Findings", ""]
    if d.findings:
        lines += [
            f"- **{m.verdict}** `{m.display_name}` ({m.type}): {m.reason}" for m in d.findings
        ]
    else:
        lines.append("No finding: every module is ok.")
    hidden = hidden_downstream(d)
    if hidden:
        lines += ["", hidden[0].upper() + hidden[1:] + "."]
    if recommendation is None and unrecommended:
        # ("<root>" reads as an HTML tag in markdown: the table writes "(root)" too)
        said = unrecommended.replace("<root>", "(root)")
        lines += ["", "## Recommended policy", "", f"No recommendation: {said}"]
    if recommendation is not None and not recommendation.log:
        lines += ["", "## Recommended policy", ""]
        lines.append(
            f"No rule needed: the run is within tolerance {recommendation.tolerance:g} as it is."
        )
    elif recommendation is not None:
        lines += ["", "## Recommended policy", ""]
        if recommendation.policy == d.precision:
            lines += [f"{d.precision.name} as it is (no rule needed).", ""]
        else:
            lines += ["```python", recommendation.to_code(), "```", ""]
        needed = scale_needed(d, recommendation)
        if needed:
            lines += [f"**{needed[0].upper() + needed[1:]}.**", ""]
        advice = recommendation.scaler_advice()
        if advice:
            lines += [advice[0].upper() + advice[1:] + ".", ""]
        if check:
            lines += ["Check it again:", "", "```bash", check, "```", ""]
        lines += ["Found by fixing one thing at a time and running again after each fix:", ""]
        lines += [f"- {line}".replace("<root>", "(root)") for line in recommendation.log]
        lines += ["", "With the recommended policy:", ""]
        for line in summary(recommendation.verified).splitlines():
            lines += [line, ""]
    for caption, path in (plots or {}).items():
        lines += ["", f"![{caption}]({path})"]
    lines += ["", "## Every module (execution order)", ""]
    lines.append("| " + " | ".join(_COLUMNS) + " | note |")
    lines.append("|" + "---|" * (len(_COLUMNS) + 1))
    for m in d.modules.values():
        note = m.reason or m.note
        note = "" if note == verdict_text(m) else note
        lines.append("| " + " | ".join([*_cells(m), note]).replace("<root>", "(root)") + " |")
    lines += ["", "## Parameter gradients", ""]
    lines.append("| parameter | dtype | grad amax | underflow | flushed | overflow | inf/nan |")
    lines.append("|---|---|---|---|---|---|---|")
    for p in d.params.values():
        lines.append(
            f"| {p.name} | {p.dtype} | {_num(p.grad_amax)} | {_pct(p.underflow)} | "
            f"{_pct(p.flushed)} | {_pct(p.overflow)} | {p.nonfinite} |"
        )
    return "\n".join(lines) + "\n"


def _plot_error(d: Diagnosis, path: Path, fixed: Diagnosis | None) -> None:
    import matplotlib.pyplot as plt

    mods = list(d.modules.values())
    runs = [(d.precision.name if not d.precision.rules else "target policy", d)]
    if fixed is not None:
        runs.append(("recommended policy", fixed))
    finite = [
        m.rel_error
        for _, run in runs
        for m in run.modules.values()
        if math.isfinite(m.rel_error) and m.rel_error > 0
    ]
    top = max(finite, default=1e-3) * 30
    bottom = min(finite, default=1e-4) / 3
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(mods)), 4.2))
    for j, (label, run) in enumerate(runs):
        xs = [i + (j - (len(runs) - 1) / 2) * width for i in range(len(mods))]
        values = [
            run.modules[m.name].rel_error if m.name in run.modules else math.nan for m in mods
        ]
        shown = [top if not math.isfinite(v) else max(v, bottom) for v in values]
        bars = ax.bar(xs, shown, width=width, label=label, color=_RUN_COLOR[j])
        for bar, value in zip(bars, values, strict=True):
            if not math.isfinite(value):
                bar.set_hatch("//")
                bar.set_edgecolor("black")
    for i, m in enumerate(mods):
        if m.verdict != OK:
            ax.annotate(
                m.verdict, (i, top), ha="center", va="bottom", fontsize=7, color=_COLOR[m.verdict]
            )
    ax.set_yscale("log")
    ax.set_ylim(bottom, top * 3)
    ax.set_xticks(range(len(mods)), [m.display_name for m in mods], rotation=90, fontsize=7)
    ax.set_ylabel("relative error vs reference")
    ax.set_title(
        f"per-layer output error vs {d.reference.default.name} (hatched: inf/NaN)", fontsize=10
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    write_figure(path, fig, dpi=110)


def _plot_range(d: Diagnosis, path: Path) -> None:
    import matplotlib.pyplot as plt

    info = format_info(d.dtype)
    mods = list(d.modules.values())
    xs = list(range(len(mods)))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(mods)), 4.2))
    ax.scatter(
        xs,
        [m.amax if m.amax > 0 else math.nan for m in mods],
        c=[_COLOR[m.verdict] for m in mods],
        marker="^",
        label="amax (colour: verdict)",
    )
    ax.scatter(
        xs,
        [m.amin if 0 < m.amin < math.inf else math.nan for m in mods],
        color="tab:blue",
        marker="v",
        label="smallest nonzero magnitude",
    )
    ax.axhline(info.max, color="red", linestyle="--", label=f"{info.name} max {info.max:g}")
    ax.axhline(
        info.smallest_normal,
        color="orange",
        linestyle="--",
        label=f"{info.name} smallest normal {info.smallest_normal:.2g}",
    )
    ax.set_yscale("log")
    ax.set_xticks(xs, [m.display_name for m in mods], rotation=90, fontsize=7)
    ax.set_ylabel("magnitude of the output (reference run)")
    ax.set_title(f"per-layer output range against {info.name}'s limits", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    write_figure(path, fig, dpi=110)


_COLOR = {OK: "tab:green", AT_RISK: "tab:orange", BROKEN: "tab:red"}
_RUN_COLOR = ("tab:gray", "tab:green")


def save(
    d: Diagnosis,
    directory: str | Path,
    recommendation: Recommendation | None = None,
    unrecommended: str | None = None,
    check: str | None = None,
) -> Path:
    """Write report.md, error.png and range.png into `directory`; return report.md's path.
    With a recommendation, the report shows the policy and its verified run next to the
    target, and policy.json holds the policy (`PolicyMap.save`: `PolicyMap.load`, `Precision`,
    the Trainer's ``precision=`` and ``--precision policy.json`` read it back), unless the
    fix is a loss scale alone (`writes_policy`; the report says the scale it needs); without
    one, ``unrecommended`` says why (what `Diagnosis.recommend` raised). ``check``: the
    command that checks the fix again, shown in the report. Each file is written whole or
    not at all (`mixprec.files.write_atomically`)."""
    fixed = recommendation.verified if recommendation is not None else None
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "writing the doctor's plots needs matplotlib: "
            "pip install 'matplotlib>=3.7' 'torch==2.13.0' (the plot extra: -e '.[plot]' in a "
            "clone)"
        ) from None
    matplotlib.use("Agg")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _plot_error(d, out / "error.png", fixed)
    _plot_range(d, out / "range.png")
    plots = {"per-layer relative error": "error.png", "per-layer range": "range.png"}
    report = out / "report.md"
    write_atomically(report, to_markdown(d, plots, recommendation, unrecommended, check))
    policy = out / "policy.json"
    if recommendation is not None and writes_policy(d, recommendation):
        recommendation.policy.save(policy)
    else:  # an earlier run's recommendation would read as this run's
        policy.unlink(missing_ok=True)
    return report
