"""Summaries and outputs of a bench run: the terminal table, results.json, results.csv,
report.md and bench.png (ms/step and peak memory against batch size, one line per precision).
"""

from __future__ import annotations

import csv
import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mixprec.bench.runner import OK, OOM
from mixprec.bench.suite import BLOG_V100_MS, MIXED_CANDIDATES, BenchReport, Row
from mixprec.textout import Column, FittedTable

__all__ = [
    "BASELINE",
    "COLUMNS",
    "OUTPUT_FILES",
    "Summary",
    "busy_machine_warning",
    "comparison_gap_lines",
    "shown_columns",
    "conclusion",
    "markdown",
    "max_batch_lines",
    "notes",
    "plot",
    "progress_line",
    "rich_table",
    "stopped_line",
    "summarize",
    "to_json",
    "write_csv",
    "write_outputs",
]

BASELINE = "32-true"
OUTPUT_FILES = ("results.json", "results.csv", "report.md", "bench.png")
COLUMNS = (
    "batch",
    "precision",
    "ms/step median",
    "min-max",
    "samples/s",
    "speedup",
    "peak memory",
    "raw torch ms/step",
    "mixprec overhead",
)
# which columns a narrow terminal keeps longest (absent: always shown)
_KEEP = {
    "peak memory": 5,
    "mixprec overhead": 4,
    "min-max": 3,
    "raw torch ms/step": 2,
    "samples/s": 1,
}


@dataclass
class Summary:
    """The numbers of one table row (None where the configuration did not run)."""

    label: str
    precision: str
    batch_size: int
    tf32: bool | None
    status: str
    median_ms: float | None
    min_ms: float | None
    max_ms: float | None
    samples_per_s: float | None
    speedup: float | None
    peak_memory: int | None
    raw_median_ms: float | None
    raw_peak_memory: int | None
    overhead: float | None
    skipped_steps: int
    raw_skipped_steps: int | None
    error: str | None
    compiled: bool = False
    first_step_s: float | None = None
    raw_first_step_s: float | None = None


def _baseline(rows: list[Row], batch: int) -> float | None:
    for row in rows:
        r = row.result
        if row.config.spec == BASELINE and row.config.batch_size == batch and r.status == OK:
            return statistics.median(r.mixprec.step_ms)
    return None


def summarize(report: BenchReport) -> list[Summary]:
    """One summary per configuration: medians, speedup vs float32 at the same batch size,
    and our overhead vs the raw torch loop (our median / raw median - 1)."""
    out = []
    for row in report.rows:
        c, r = row.config, row.result
        ours = r.mixprec
        ok = r.status == OK and bool(ours.step_ms)
        med = statistics.median(ours.step_ms) if ok else None
        base = _baseline(report.rows, c.batch_size)
        raw = r.raw
        raw_ok = ok and raw is not None and raw.status == OK and bool(raw.step_ms)
        raw_med = statistics.median(raw.step_ms) if raw_ok and raw is not None else None
        out.append(
            Summary(
                label=c.label,
                precision=c.spec,
                batch_size=c.batch_size,
                tf32=c.tf32,
                status=r.status,
                median_ms=med,
                min_ms=min(ours.step_ms) if ok else None,
                max_ms=max(ours.step_ms) if ok else None,
                samples_per_s=c.batch_size / med * 1e3 if med else None,
                speedup=base / med if med and base else None,
                peak_memory=ours.peak_memory,
                raw_median_ms=raw_med,
                raw_peak_memory=raw.peak_memory if raw is not None else None,
                overhead=med / raw_med - 1 if med and raw_med else None,
                skipped_steps=ours.skipped_steps,
                raw_skipped_steps=raw.skipped_steps if raw is not None else None,
                error=r.error or ours.error,
                compiled=c.compiled,
                first_step_s=ours.first_step_s,
                raw_first_step_s=raw.first_step_s if raw is not None else None,
            )
        )
    return out


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def _cells(s: Summary) -> list[str]:
    if s.status != OK:
        shown = "OOM" if s.status == OOM else s.status
        return [str(s.batch_size), s.label, shown, "-", "-", "-", "-", "-", "-"]
    return [
        str(s.batch_size),
        s.label,
        f"{s.median_ms:,.1f}",
        f"{s.min_ms:,.1f}-{s.max_ms:,.1f}",
        f"{s.samples_per_s:,.1f}",
        f"{s.speedup:.2f}x" if s.speedup is not None else "-",
        _mib(s.peak_memory),
        f"{s.raw_median_ms:,.1f}" if s.raw_median_ms is not None else "-",
        f"{s.overhead * 100:+.1f}%" if s.overhead is not None else "-",
    ]


def progress_line(row: Row, index: int, total: int, seconds: float) -> str:
    """The line printed as configuration `index` of `total` finishes: its median ms/step,
    peak memory and the raw torch loop's median, or how it ended."""
    c, r = row.config, row.result
    head = f"[{index}/{total}] {c.label} @ {c.batch_size}:"
    where = f"{seconds:.1f} s" + (", fresh process" if r.fresh_process else "")
    ours = r.mixprec
    if r.status != OK or not ours.step_ms:
        return f"{head} {'OOM' if r.status == OOM else r.status} ({where})"
    med = statistics.median(ours.step_ms)
    parts = [f"{med:,.1f} ms/step", f"peak {_mib(ours.peak_memory)}"]
    raw = r.raw
    if raw is not None and raw.status == OK and raw.step_ms:
        raw_med = statistics.median(raw.step_ms)
        parts.append(f"raw torch {raw_med:,.1f} ms/step ({med / raw_med - 1:+.1%})")
    return f"{head} ok, {', '.join(parts)} ({where})"


def stopped_line(report: BenchReport) -> str | None:
    """How a stopped run ended (what stopped it, how many configurations finished, which
    did not run); None for a run that finished."""
    stopped = report.metadata.get("stopped")
    if not stopped:
        return None
    by = f" by {stopped['by']}" if stopped.get("by") else ""
    line = f"stopped{by} after {stopped['finished']} of {stopped['planned']} configurations"
    if stopped["not_run"]:
        line += f"; not run: {', '.join(stopped['not_run'])}"
    return line


def shown_columns(summaries: list[Summary]) -> list[int]:
    """The indices of the columns with something to say: one that is "-" in every row (the
    raw loop's columns in a float32-only run, the speedup without a float32 row) is left
    out. Batch and precision always stay."""
    rows = [_cells(s) for s in summaries]
    return [i for i in range(len(COLUMNS)) if i < 2 or any(row[i] != "-" for row in rows)]


def rich_table(report: BenchReport, summaries: list[Summary]) -> FittedTable:
    """The blog-style table for the terminal: columns all "-" left out, and in a narrow
    terminal the least useful ones too (named under it), never cut; report.md has the rest."""
    meta = report.metadata
    keep = shown_columns(summaries)
    table = FittedTable(
        f"mixprec bench: {meta['model']} on {meta['device']}",
        [Column(COLUMNS[i], "left" if i == 1 else "right", _KEEP.get(COLUMNS[i])) for i in keep],
        full="every column is in report.md",
    )
    for s in summaries:
        cells = _cells(s)
        table.add_row([cells[i] for i in keep], style="red" if s.status != OK else None)
    return table


def max_batch_lines(report: BenchReport) -> list[str]:
    """One line per precision: the largest batch that fit and the first that did not, or
    where a failed probe stopped the search."""
    lines = []
    for name, found in report.max_batch.items():
        if found["error"]:
            fitted = (
                f"the largest that fitted before it: {found['max_batch']}"
                if found["max_batch"]
                else "no batch fitted before it"
            )
            oom = f", {found['first_oom']} ran out of memory" if found["first_oom"] else ""
            lines.append(f"{name}: search stopped at {found['error']} ({fitted}{oom})")
        elif found["capped"]:
            lines.append(f"{name}: >= {found['max_batch']} (search stopped at the cap)")
        elif found["max_batch"] == 0:
            lines.append(f"{name}: not even batch 1 fits (batch {found['first_oom']}: OOM)")
        else:
            lines.append(
                f"{name}: {found['max_batch']} fits, {found['first_oom']} runs out of memory"
            )
    return lines


def busy_machine_warning(load: list[float] | None, threads: int, device_type: str) -> str | None:
    """A warning when other work keeps the CPUs busy: with every core in use, threads wait
    for each other at each parallel op and CPU timings lose their meaning."""
    if device_type != "cpu" or not load:
        return None
    cores = os.cpu_count() or 1
    if load[0] <= cores - threads + 0.5:
        return None
    return (
        f"WARNING: other work was using the CPUs (1-minute load {load[0]} on {cores} cores, "
        f"{threads} thread(s) asked for): timings may be distorted; check the min-max "
        "spread, and rerun on an idle machine or with fewer --threads"
    )


def notes(report: BenchReport, summaries: list[Summary], busy: bool = True) -> list[str]:
    """How the numbers were taken, shown under the table and in report.md (`busy=False`
    leaves out the busy-machine warning, for a terminal that was already warned)."""
    meta = report.metadata
    out = [
        f"timing: {meta['timing']}; {meta['steps']} timed steps after the memory step and "
        f"{meta['warmup']} warm-up step(s), {meta['threads']} thread(s)",
        f"peak memory: {meta['memory_method']}",
        "speedup: float32 (32-true) median / this median at the same batch size",
    ]
    if any(s.overhead is not None for s in summaries):  # else its column is left out
        out.append(
            "mixprec overhead: our median / the raw torch.autocast loop's median - 1 (mixed "
            "precisions only); mixprec computes layer-norm-type and softmax layers in float32 "
            "islands where the device's autocast does not (rows marked 'no f32 islands' leave "
            "them to autocast, as the raw loop does)"
        )
    warning = busy_machine_warning(
        meta.get("load_average_before"), meta["threads"], meta.get("device_type", "")
    )
    if busy and warning:
        out.append(warning)
    for name, status in meta["support"].items():
        if status.startswith("slow"):
            out.append(f"{name} is {status} (run because of --allow-slow)")
    for s in summaries:
        if s.skipped_steps or s.raw_skipped_steps:
            raw = f" (raw loop: {s.raw_skipped_steps})" if s.raw_skipped_steps is not None else ""
            out.append(
                f"{s.label} at batch {s.batch_size}: {s.skipped_steps} steps skipped on "
                f"gradient overflow while the loss scale settled{raw}"
            )
    if meta.get("memory_limit"):
        out.append(f"memory limit: {meta['memory_limit']} bytes per loop (OOM above it)")
    if meta.get("compile"):
        out.append(
            "compiled: every model runs under torch.compile (torch's defaults), compiled after "
            "mixprec's conversion, in our loop and the raw torch loop alike; the first step "
            "compiles, so it is timed apart (below) and the timed steps exclude it"
        )
    for s in summaries:
        if s.compiled and s.first_step_s is not None:
            raw = f", raw loop {s.raw_first_step_s:.1f} s" if s.raw_first_step_s else ""
            out.append(
                f"{s.label} at batch {s.batch_size}: first step (compilation) "
                f"{s.first_step_s:.1f} s{raw}"
            )
    return out


def _duration(ms: float) -> str:
    seconds = ms / 1e3
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.0f} min"
    return f"{seconds / 3600:,.1f} h"


def comparison_gap_lines(report: BenchReport, summaries: list[Summary]) -> list[str]:
    """Why no mixed precision was timed, as short labelled lines: what was timed, each
    precision left out and why, the dtype rates measured here, what timing them would cost,
    where they pay, and the command to time them anyway. Empty when nothing was left out."""
    gap = report.metadata.get("comparison_gap")
    if not gap:
        return []
    meta = report.metadata
    rates = gap["matmul_gflops"]
    base = rates.get("float32")
    if gap["asked"]:
        asked = meta["precisions"]
        were = "was" if len(asked) == 1 else "were"
        first = f"only {', '.join(asked)} {were} asked for (--precision), so "
    else:
        first = "no mixed precision is fast on this device, so "
    lines = ["timed: " + first + f"only {' and '.join(gap['timed'])} was timed"]
    for name, why in gap["left_out"].items():
        lines.append(f"left out: {name}, {why['status']} here ({why['reason']})")
    if base:
        shown = [f"float32 {base:,.1f} GFLOP/s"]
        for dtype, rate in rates.items():
            if dtype == "float32" or not rate:
                continue
            factor = base / rate
            rel = f"{factor:,.0f}x slower" if factor >= 1.5 else f"{1 / factor:.1f}x float32"
            shown.append(f"{dtype} {rate:,.1f} ({rel})")
        lines.append("matmul rates measured now: " + ", ".join(shown))
    fp32 = [s for s in summaries if s.precision == BASELINE and s.median_ms is not None]
    steps = meta["steps"] + meta["warmup"] + 1
    per_step, timing = [], []
    for name, why in gap["left_out"].items():
        rate = rates.get(why["dtype"])
        if why["status"] == "refused" or not (fp32 and base and rate) or base / rate < 1.5:
            continue
        largest = max(fp32, key=lambda s: s.batch_size)
        per_step.append(f"{_duration(largest.median_ms * base / rate)} in {name}")
        # ours and the raw torch loop alternate, so a mixed configuration runs its steps twice
        timing.append(f"{_duration(sum(s.median_ms for s in fp32) * base / rate * steps * 2)}")
    if per_step:
        lines.append(
            f"estimate: a step at batch {largest.batch_size} (float32 "
            f"{largest.median_ms:,.1f} ms) about {' and '.join(per_step)}; timing "
            f"{'it' if len(per_step) == 1 else 'them'} about {' and '.join(timing)}"
        )
    fast = [f"{w['dtype']} is fast on {w['fast_on']}" for w in gap["left_out"].values()]
    if fast:
        lines.append("where it pays: " + "; ".join(fast))
    if gap["command"]:
        lines.append(f"to time them anyway: {gap['command']}")
    return lines


def _span(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return (
        fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"
    )


def conclusion(report: BenchReport, summaries: list[Summary]) -> str:
    """One plain sentence closing the run: what the recommended mixed precision buys on this
    machine against float32 (speed and peak memory, over the batch sizes both ran at), and
    how that compares with the seed experiment's V100 (`BLOG_V100_MS`)."""
    meta = report.metadata
    blog = [fp32 / mixed for mixed, fp32 in BLOG_V100_MS.values()]
    seed = f"the seed experiment got {_span(blog, '{:.1f}')}x from mixed precision on its V100 GPU"
    fp32 = {s.batch_size: s for s in summaries if s.precision == BASELINE and s.median_ms}
    ok = [s for s in summaries if s.precision != BASELINE and s.speedup and s.batch_size in fp32]
    if not fp32 or not ok:
        if meta.get("comparison_gap"):
            return (
                "No mixed precision is fast on this machine, so float32 is the one to train "
                f"in here (as said above); {seed}."
            )
        return f"No mixed precision and float32 ran side by side here to compare; {seed}."
    fast = [n for n in MIXED_CANDIDATES if meta["support"].get(n) == "fast"]
    labels = list(dict.fromkeys(s.label for s in ok))
    label = next((n for n in fast if n in labels), labels[0])
    rows = [s for s in ok if s.label == label]
    speed = [s.speedup for s in rows]
    memory = [
        1 - s.peak_memory / fp32[s.batch_size].peak_memory
        for s in rows
        if s.peak_memory and fp32[s.batch_size].peak_memory
    ]
    batches = _span([float(s.batch_size) for s in rows], "{:.0f}")
    if min(speed) >= 1:
        buys = f"trains the {meta['model']} model {_span(speed, '{:.1f}')}x as fast as float32"
    else:
        buys = f"runs the {meta['model']} model at {_span(speed, '{:.2f}')}x the speed of float32"
    if memory:
        saved = _span([abs(m) * 100 for m in memory], "{:.0f}")
        more_or_less = (
            "less" if min(memory) >= 0 else "more" if max(memory) <= 0 else "less or more"
        )
        buys += f" with {saved}% {more_or_less} peak memory"
    median = statistics.median(speed)
    if median > 1.2 * max(blog):
        than = "so mixed precision pays more here than it did there"
    elif median >= 0.9 * min(blog):
        than = "about what it pays here"
    else:
        than = "so here it pays less than there: train in float32 unless memory is what you need"
    return f"On this machine {label} {buys} (batch {batches}); {seed}, {than}."


def to_json(report: BenchReport, summaries: list[Summary]) -> dict[str, Any]:
    """results.json: metadata, every raw step time, and the summaries."""
    return {
        "metadata": report.metadata,
        "results": [
            {"config": asdict(row.config), "result": asdict(row.result), "summary": asdict(s)}
            for row, s in zip(report.rows, summaries, strict=True)
        ],
        "max_batch": report.max_batch,
    }


def write_csv(path: Path, summaries: list[Summary]) -> None:
    """results.csv: one row per configuration."""
    fields = list(Summary.__dataclass_fields__)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for s in summaries:
            writer.writerow(asdict(s))


def markdown(report: BenchReport, summaries: list[Summary]) -> str:
    """report.md: environment, command, the table (columns all "-" left out), notes and
    the max-batch search."""
    meta = report.metadata
    keep = shown_columns(summaries)
    lines = [
        f"# mixprec bench: {meta['model']}",
        "",
        f"- device: {meta['device']}",
        f"- torch {meta['torch_version']}, mixprec {meta['mixprec_version']}"
        + (f", CUDA {meta['cuda_version']}" if meta.get("cuda_version") else ""),
        f"- started {meta['started']}, took {meta.get('elapsed_s', '?')} s; load average "
        f"(1/5/15 min) {meta.get('load_average_before')} before, "
        f"{meta.get('load_average_after')} after",
        f"- reproduce: `{meta['command']}`",
        *([f"- **{stopped_line(report)}**"] if stopped_line(report) else []),
        "",
        "| " + " | ".join(COLUMNS[i] for i in keep) + " |",
        "|" + "---|" * len(keep),
    ]
    lines += ["| " + " | ".join(_cells(s)[i] for i in keep) + " |" for s in summaries]
    lines += ["", *[f"- {n}" for n in notes(report, summaries)]]
    gap = comparison_gap_lines(report, summaries)
    if gap:
        lines += ["", "## Why no mixed precision was timed", "", *[f"- {line}" for line in gap]]
    lines += ["", "## In one sentence", "", conclusion(report, summaries)]
    failed = [s for s in summaries if s.status != OK and s.error]
    if failed:
        lines += ["", "## Configurations that did not run", ""]
        lines += [f"- {s.label} at batch {s.batch_size}: {s.status} ({s.error})" for s in failed]
    if meta.get("preset") == "blog":
        lines += [
            "",
            "## Beside the seed blog (Tesla V100, TensorFlow 2.1, mixed_float16 vs float32)",
            "",
            "| batch | blog mixed ms/step | blog float32 ms/step | blog speedup |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {b} | {mixed} | {fp32} | {fp32 / mixed:.2f}x |"
            for b, (mixed, fp32) in BLOG_V100_MS.items()
        ]
    if report.max_batch:
        lines += ["", "## Largest batch that fits", ""]
        lines += [f"- {line}" for line in max_batch_lines(report)]
    return "\n".join(lines) + "\n"


def plot(path: Path, report: BenchReport, summaries: list[Summary]) -> None:
    """bench.png: ms/step (median, min-max bars) and peak memory against batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    batches = sorted({s.batch_size for s in summaries})
    for label in dict.fromkeys(s.label for s in summaries):
        ok = [s for s in summaries if s.label == label and s.median_ms is not None]
        if not ok:
            continue
        xs = [s.batch_size for s in ok]
        med = [s.median_ms for s in ok]
        err = [
            [m - s.min_ms for m, s in zip(med, ok, strict=True)],
            [s.max_ms - m for m, s in zip(med, ok, strict=True)],
        ]
        ax_t.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=label)
        ax_m.plot(xs, [s.peak_memory / 2**20 for s in ok], marker="o", label=label)
    for ax, ylabel in ((ax_t, "ms/step (median, min-max)"), (ax_m, "peak memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend()
    fig.suptitle(f"{report.metadata['model']} on {report.metadata['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out: Path, report: BenchReport, png: bool = True) -> list[Path]:
    """Write results.json, results.csv, report.md and (with `png`, which needs matplotlib)
    bench.png into `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    summaries = summarize(report)
    paths = [out / n for n in OUTPUT_FILES]
    paths[0].write_text(json.dumps(to_json(report, summaries), indent=1))
    write_csv(paths[1], summaries)
    paths[2].write_text(markdown(report, summaries))
    if not png:
        return paths[:3]
    plot(paths[3], report, summaries)
    return paths
