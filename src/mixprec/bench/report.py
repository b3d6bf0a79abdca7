"""Summaries and outputs of a bench run: the terminal table, results.json, results.csv,
report.md and bench.png (ms/step and peak memory against batch size, one line per precision).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.text import Text

from mixprec.bench.runner import OK, OOM, UNTIMED_STEPS
from mixprec.bench.suite import (
    BASELINE,
    BLOG_V100_MS,
    MIXED_CANDIDATES,
    BenchReport,
    Row,
    activation_label,
    cores_shared,
    quantized,
    size_text,
    threads_over_cores,
)
from mixprec.bench.verdict import (
    CONFIDENCE,
    FASTER,
    FEW,
    MAX_WIDTH,
    MIN_ROUNDS,
    NOISY,
    Interval,
    carries_finding,
    ratio_interval,
    speed_verdict,
)
from mixprec.errors import PolicySpecError
from mixprec.files import write_atomically, write_figure
from mixprec.policy.map import PolicyMap, is_policy_file
from mixprec.textout import Column, FittedTable

__all__ = [
    "BASELINE",
    "COLUMNS",
    "FRESH_PROCESS_OPTIONS",
    "OUTPUT_FILES",
    "Summary",
    "busy_machine_warning",
    "comparison_gap_lines",
    "conclusion",
    "markdown",
    "max_batch_lines",
    "notes",
    "plot",
    "progress_line",
    "ratio_places",
    "rerun_for_verdict",
    "rich_table",
    "stopped_line",
    "summarize",
    "write_outputs",
]

OUTPUT_FILES = ("results.json", "results.csv", "report.md", "bench.png")
COLUMNS = (
    "batch",
    "precision",
    "ms/step median",
    "min-max",
    "samples/s",
    "speedup",
    "step vs keep",
    "peak memory",
    "raw torch ms/step",
    "mixprec overhead",
)
# the options that put each configuration in a fresh process of its own (flag, the
# metadata key and BenchOptions attribute that holds it)
FRESH_PROCESS_OPTIONS = (("--memory-limit", "memory_limit"), ("--compile", "compile"))
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
    """The numbers of one table row (None where the configuration did not run).

    `speedup` is the median over rounds of float32's step time / this one's at the same
    batch size, `speedup_low`-`speedup_high` its interval at `speedup_confidence`
    (`verdict.ratio_interval`), from `rounds` ratios, where `paired` (rows timed side by
    side, step i of each from round i); rows run one after another in separate processes
    share no rounds, so their `speedup` is the ratio of the medians, with no interval or
    rounds (a neighbour's load between the runs moves it). `overhead`
    is the median over rounds of our step time / the raw torch loop's, minus 1.
    `vs_keep` (`vs_keep_low`-`vs_keep_high`) is, for a row of ``--activations`` option
    `activations`, the median over rounds of its step time / the same precision's with
    every activation kept, and its interval.
    """

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
    # why the raw twin's cold compile was not timed (`LoopResult.first_step_error`)
    raw_first_step_error: str | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    speedup_confidence: float | None = None
    rounds: int | None = None
    paired: bool = False
    activations: str | None = None
    vs_keep: float | None = None
    vs_keep_low: float | None = None
    vs_keep_high: float | None = None
    vs_keep_rounds: int | None = None
    vs_keep_confidence: float | None = None
    vs_keep_paired: bool = True  # `vs_keep` from shared rounds (False: the medians' ratio)
    raw_error: str | None = None  # why the raw twin did not run, where mixprec's loop did
    overhead_low: float | None = None  # `overhead`'s interval, as the speedup's
    overhead_high: float | None = None
    overhead_rounds: int | None = None
    overhead_confidence: float | None = None


def _baseline(rows: list[Row], batch: int) -> Row | None:
    for row in rows:
        c = row.config
        if c.spec == BASELINE and c.batch_size == batch and c.activations in (None, "keep"):
            if row.result.status == OK:
                return row
    return None


def _kept(rows: list[Row], row: Row) -> Row | None:
    """The row that runs `row`'s configuration with every activation kept (``keep``)."""
    if row.config.activations is None:
        return None
    for other in rows:
        c, r = other.config, other.result
        if (
            c.activations == "keep"
            and r.status == OK
            and c == replace(row.config, label=c.label, raw=c.raw, activations="keep")
        ):
            return other
    return None


def summarize(report: BenchReport) -> list[Summary]:
    """One summary per configuration: medians, the speedup against float32 at the same batch
    size and our overhead against the raw torch loop, each a median of per-round ratios."""
    out = []
    for row in report.rows:
        c, r = row.config, row.result
        ours = r.mixprec
        ok = r.status == OK and bool(ours.step_ms)
        med = statistics.median(ours.step_ms) if ok else None
        base = _baseline(report.rows, c.batch_size)
        speed = ratio_interval(base.result.mixprec.step_ms, ours.step_ms) if ok and base else None
        paired = bool(speed and base and r.paired and base.result.paired)
        if speed and base and med and not paired:  # (no rounds to pair: the medians' ratio)
            speed = _medians_ratio(base.result.mixprec.step_ms, ours.step_ms)
        raw = r.raw
        raw_ok = ok and raw is not None and raw.status == OK and bool(raw.step_ms)
        raw_med = statistics.median(raw.step_ms) if raw_ok and raw is not None else None
        overhead = ratio_interval(ours.step_ms, raw.step_ms) if raw_ok and raw is not None else None
        kept = _kept(report.rows, row)
        vs_keep = ratio_interval(ours.step_ms, kept.result.mixprec.step_ms) if ok and kept else None
        keep_paired = bool(vs_keep and kept and r.paired and kept.result.paired)
        if vs_keep and kept and not keep_paired:
            vs_keep = _medians_ratio(ours.step_ms, kept.result.mixprec.step_ms)
        # (keep's own row is 1 against itself: no interval to give)
        keep_interval = vs_keep if vs_keep and keep_paired and c.activations != "keep" else None
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
                speedup=speed.median if speed else None,
                peak_memory=ours.peak_memory,
                raw_median_ms=raw_med,
                raw_peak_memory=raw.peak_memory if raw is not None else None,
                overhead=overhead.median - 1 if overhead else None,
                overhead_low=overhead.low - 1 if overhead else None,
                overhead_high=overhead.high - 1 if overhead else None,
                overhead_rounds=overhead.n if overhead else None,
                overhead_confidence=overhead.confidence if overhead else None,
                skipped_steps=ours.skipped_steps,
                raw_skipped_steps=raw.skipped_steps if raw is not None else None,
                error=r.error or ours.error,
                compiled=c.compiled,
                first_step_s=ours.first_step_s,
                raw_first_step_s=raw.first_step_s if raw is not None else None,
                raw_first_step_error=raw.first_step_error if raw is not None else None,
                speedup_low=speed.low if speed and paired else None,
                speedup_high=speed.high if speed and paired else None,
                speedup_confidence=speed.confidence if speed and paired else None,
                rounds=speed.n if speed and paired else None,
                paired=paired,
                activations=c.activations,
                vs_keep=vs_keep.median if vs_keep else None,
                vs_keep_low=keep_interval.low if keep_interval else None,
                vs_keep_high=keep_interval.high if keep_interval else None,
                vs_keep_rounds=vs_keep.n if vs_keep and keep_paired else None,
                vs_keep_confidence=vs_keep.confidence if vs_keep and keep_paired else None,
                vs_keep_paired=keep_paired or vs_keep is None,
                raw_error=(
                    f"{raw.status} ({raw.error})"
                    if ok and raw is not None and raw.status != OK and raw.error
                    else None
                ),
            )
        )
    return out


def _medians_ratio(base_ms: list[float], other_ms: list[float]) -> Interval:
    """``median(base) / median(other)`` for rows not timed in shared rounds: the ratio of
    their medians, with no interval (``confidence`` 0: see `Summary`)."""
    ratio = statistics.median(base_ms) / statistics.median(other_ms)
    return Interval(ratio, ratio, ratio, min(len(base_ms), len(other_ms)), 0.0)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def _is_baseline(s: Summary) -> bool:
    """Whether `s` is a row of float32 itself, its activations kept."""
    return s.precision == BASELINE and s.activations in (None, "keep")


def ratio_places(value: float, low: float | None = None, high: float | None = None) -> int:
    """Decimals (2 to 4) that keep a ratio off "1.00" when it is not 1, and an interval
    wholly on one side of 1 from reaching it once rounded outward (`_outward`): a slowdown
    under half a percent read "1.00x (1.00-1.00)"; and, far below 1, as many as show two
    significant digits of the ratio, one of its interval's low end (emulated bfloat16 read
    "0.00x (0.00-0.01)"; `mixprec info` prints "0.0081x")."""
    places = max(2, _significant(value, 2), _significant(low, 1))
    while places < 4:
        near = value != 1 and f"{value:.{places}f}" == f"{1:.{places}f}"
        if low is not None and high is not None:
            lo, hi = _outward(low, high, places)
            near = near or (low > 1 and lo <= 1) or (high < 1 and hi >= 1)
        if not near:
            break
        places += 1
    return places


def _significant(value: float | None, digits: int) -> int:
    """The decimals that show `digits` significant digits of `value` (0 for none given)."""
    if not value or value <= 0 or math.isinf(value):
        return 0
    return digits - 1 - math.floor(math.log10(value))


def _ratio_cell(value: float, low: float | None, high: float | None, rounds: int | None,
                confidence: float | None, paired: bool) -> str:  # fmt: skip
    """ "4.58x (4.41-4.80)": a median ratio and its interval, rounded outward; "(medians)"
    after a ratio of medians (rows that shared no rounds); "(1 round)" after one ratio; the
    rounds after an interval of too few of them for the stated confidence."""
    if not paired:
        return f"{value:.{ratio_places(value)}f}x (medians)"
    if low is None or high is None:
        return f"{value:.{ratio_places(value)}f}x"
    if rounds == 1:  # (one ratio: no interval to give, "1.00-1.00" would read as certain)
        return f"{value:.{ratio_places(value)}f}x (1 round)"
    few = confidence is not None and confidence < CONFIDENCE
    shown = f", {rounds} rounds" if few and rounds else ""
    return f"{value:.{ratio_places(value, low, high)}f}x ({_bounds(value, low, high)}{shown})"


def _bounds(value: float, low: float, high: float) -> str:
    """ "4.41-4.80": the ends of the interval of ratio `value`, rounded outward to its
    decimals (`ratio_places`), as its table cell and the sentence print them."""
    places = ratio_places(value, low, high)
    lo, hi = _outward(low, high, places)
    return f"{lo:.{places}f}-{hi:.{places}f}"


def _speedup_cell(s: Summary) -> str:
    """The speedup against float32 (`_ratio_cell`; float32's row itself, 1 against itself
    in every round: "1.00x"; a second float32 row, CUDA's "TF32 on", takes its interval)."""
    if s.speedup is None:
        return "-"
    if _is_baseline(s) and s.speedup == 1.0 and s.speedup_low in (None, 1.0):
        return f"{s.speedup:.2f}x"
    return _ratio_cell(
        s.speedup, s.speedup_low, s.speedup_high, s.rounds, s.speedup_confidence, s.paired
    )


def _vs_keep_cell(s: Summary) -> str:
    """ "1.18x (1.12-1.25)": this row's step time over keep's (keep itself: "1.00x")."""
    if s.vs_keep is None:
        return "-"
    if s.activations == "keep":
        return f"{s.vs_keep:.2f}x"
    return _ratio_cell(
        s.vs_keep,
        s.vs_keep_low,
        s.vs_keep_high,
        s.vs_keep_rounds,
        s.vs_keep_confidence,
        s.vs_keep_paired,
    )


def _cells(s: Summary) -> list[str]:
    if s.status != OK:
        shown = "OOM" if s.status == OOM else s.status
        return [str(s.batch_size), s.label, shown, *["-"] * (len(COLUMNS) - 3)]
    return [
        str(s.batch_size),
        s.label,
        f"{s.median_ms:,.1f}",
        f"{s.min_ms:,.1f}-{s.max_ms:,.1f}",
        f"{s.samples_per_s:,.1f}",
        _speedup_cell(s),
        _vs_keep_cell(s),
        _mib(s.peak_memory),
        f"{s.raw_median_ms:,.1f}" if s.raw_median_ms is not None else "-",
        _overhead_cell(s),
    ]


def _overhead_cell(s: Summary) -> str:
    """ "+1.9% (-3.0 to +6.0)": the overhead with its interval (a median alone read as a
    finding where the interval held 0, on a busy machine)."""
    if s.overhead is None:
        return "-"
    if s.overhead_low is None or s.overhead_high is None or s.overhead_rounds == 1:
        return f"{s.overhead * 100:+.1f}%"
    few = s.overhead_confidence is not None and s.overhead_confidence < CONFIDENCE
    rounds = f", {s.overhead_rounds} rounds" if few and s.overhead_rounds else ""
    low, high = s.overhead_low * 100, s.overhead_high * 100
    return f"{s.overhead * 100:+.1f}% ({low:+.1f} to {high:+.1f}{rounds})"


def progress_line(row: Row, index: int, total: int, seconds: float) -> str:
    """The line printed as configuration `index` of `total` finishes: its median ms/step,
    peak memory and the raw torch loop's median, or how it ended; `seconds` are its batch
    size's, said so where other rows ran in them (side by side, or one after another in
    fresh processes)."""
    c, r = row.config, row.result
    head = f"[{index}/{total}] {c.label} @ {c.batch_size}:"
    ours = r.mixprec
    where = f"{seconds:.1f} s"  # (the batch size's: the time of this row alone where it is)
    if r.paired:
        where = f"{len(ours.step_ms)} rounds side by side, batch in {where}"
    elif r.fresh_process:
        where = f"in a fresh process, batch in {where}"
    if r.status != OK or not ours.step_ms:
        return f"{head} {'OOM' if r.status == OOM else r.status} ({where})"
    med = statistics.median(ours.step_ms)
    parts = [f"{med:,.1f} ms/step", f"peak {_mib(ours.peak_memory)}"]
    raw = r.raw
    if raw is not None and raw.status == OK and raw.step_ms:
        raw_med = statistics.median(raw.step_ms)
        overhead = ratio_interval(ours.step_ms, raw.step_ms)
        if overhead is not None:
            parts.append(f"raw torch {raw_med:,.1f} ms/step ({overhead.median - 1:+.1%})")
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
    unsearched = [
        label
        for label in report.metadata.get("max_batch_searches", [])
        if label not in report.max_batch or report.max_batch[label].get("cut")
    ]
    if unsearched:
        line += f"; max-batch search not finished: {', '.join(unsearched)}"
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
    # (cells and title are rich markup: a label such as "exp[lr=1e-3]/policy.json" escaped)
    table = FittedTable(
        _literal(f"mixprec bench: {meta['model']} on {meta['device']}"),
        [Column(COLUMNS[i], "left" if i == 1 else "right", _KEEP.get(COLUMNS[i])) for i in keep],
        full="every column is in report.md",
    )
    for s in summaries:
        cells = _cells(s)
        table.add_row([_literal(cells[i]) for i in keep], style="red" if s.status != OK else None)
    return table


def _literal(text: str) -> str:
    """`text` as rich markup that reads as itself where no tag follows it (a table cell):
    `escape` less the backslash it adds after a trailing one (there to keep a tag after it
    a tag: it would print doubled here), and no emoji code read in it (a path such as
    ``run:100:a/policy.json``, else printed and sized by `FittedTable` as an emoji)."""
    markup = escape(text + ".")[:-1]
    if Text.from_markup(markup).plain != text:  # (an empty tag after each colon ends the
        markup = markup.replace(":", ":[b][/b]")  # text there: no code spans two colons)
    return markup


def max_batch_lines(report: BenchReport) -> list[str]:
    """One line per precision: the largest batch that fit and the first that did not, or
    where a failed probe or the run's stop cut the search short."""
    lines = []
    for name, found in report.max_batch.items():
        if found.get("cut"):
            so_far = _so_far(found, ":", "yet")
            lines.append(f"{name}: search cut short when the run was stopped ({so_far})")
        elif found["error"]:
            so_far = _so_far(found, " before it:", "before it")
            lines.append(f"{name}: search stopped at {found['error']} ({so_far})")
        elif found["capped"]:
            lines.append(f"{name}: >= {found['max_batch']} (search stopped at the cap)")
        elif found["max_batch"] == 0:
            lines.append(f"{name}: not even batch 1 fits (batch {found['first_oom']}: OOM)")
        else:
            lines.append(
                f"{name}: {found['max_batch']} fits, {found['first_oom']} runs out of memory"
                + _vs_kept(report, found)
            )
    return lines


def _so_far(found: dict[str, Any], then: str, none: str) -> str:
    """How far a search stopped short went: "the largest that fitted{then} 256, 512 ran
    out of memory", or "no batch fitted {none}"."""
    fitted = (
        f"the largest that fitted{then} {found['max_batch']}"
        if found["max_batch"]
        else f"no batch fitted {none}"
    )
    return fitted + (f", {found['first_oom']} ran out of memory" if found["first_oom"] else "")


def _vs_kept(report: BenchReport, found: dict[str, Any]) -> str:
    """ " (1.44x keep's)": an activation option's largest batch over keep's, where both were
    found; "" otherwise."""
    option = found.get("activations")
    if option in (None, "keep"):
        return ""
    kept = report.max_batch.get(activation_label(found["precision"], "keep"))
    if not kept or kept["error"] or kept["capped"] or not kept["max_batch"]:
        return ""
    return f" ({found['max_batch'] / kept['max_batch']:.2f}x keep's)"


def _cores(meta: dict[str, Any]) -> int:
    """The run's core count, as recorded (a run recorded before it was: this machine's)."""
    return meta.get("cores") or os.cpu_count() or 1


def _other_load(meta: dict[str, Any]) -> tuple[float, str] | None:
    """How many cores other work kept busy, and in words: measured through the run
    (``other_busy_cores``: the CPUs' busy ticks less this process's CPU time), else as the
    run began (``busy_cores_before``), else the 1-minute load before it, which the pre-run
    warning reads (the load after it cannot be charged the run's threads: the average lags,
    and a short run moves it by a fraction of them); None when nothing was recorded."""
    cores = _cores(meta)
    for key, when in (("other_busy_cores", "through"), ("busy_cores_before", "as")):
        if (busy := meta.get(key)) is not None:
            began = "through the run" if when == "through" else "as the run began"
            return busy, f"other work kept {busy:.1f} of {cores} cores busy {began}"
    before = meta.get("load_average_before")
    if before:
        return before[0], f"1-minute load {before[0]:.1f} on {cores} cores"
    return None


def _is_busy(load: float | None, threads: int, device_type: str, cores: int | None = None) -> bool:
    """Whether other work keeps the CPUs busy (`suite.cores_shared`)."""
    return cores_shared(load, threads, cores or os.cpu_count() or 1, device_type)


def _rerun_advice(threads: int) -> str:
    return "rerun on a quieter machine" + (" or with --threads 1" if threads > 1 else "")


def busy_machine_warning(
    load: list[float] | None,
    threads: int,
    device_type: str,
    cores: int | None = None,
    paired: bool | None = None,
    rerun: str | None = None,
    busy_cores: float | None = None,
) -> str | None:
    """A warning, before the run, when other work keeps the CPUs busy: what the verdict
    then rests on, by how the steps are timed (`paired`: side by side in rounds; False:
    each configuration in a process of its own, one after another, where `rerun` says how
    to get paired rounds (`rerun_for_verdict`); None: not known, both said). `busy_cores`,
    other work's cores sampled as the run began (`timing.busy_cores`, which chose the
    threads), decides and is said where given; else the 1-minute `load`. The run's own
    threads outnumbering the cores are said as such, not as other work."""
    measured = busy_cores if busy_cores is not None else (load[0] if load else None)
    cores = cores or os.cpu_count() or 1
    busy = measured is not None and _is_busy(measured, threads, device_type, cores)
    over = threads_over_cores(threads, cores, device_type)
    if not busy and not over:
        return None
    if busy_cores is not None:
        what = f"other work kept {busy_cores:.1f} of {cores} cores busy as the run began"
    else:
        what = f"1-minute load {measured} on {cores} cores"
    if paired:
        how = (
            "the speedup is taken from paired rounds with its interval, and withheld if still "
            "too noisy"
        )
    elif paired is None:
        how = (
            "configurations timed side by side take the speedup from paired rounds with its "
            "interval, withheld if still too noisy; those in separate processes (--memory-limit, "
            "--compile) get the ratio of medians and no verdict"
        )
    else:
        how = (
            "the configurations run one after another in separate processes here, so the "
            "speedup is the ratio of their medians, which a neighbour's load between them "
            "moves: no interval and no verdict"
        )
    # (its own threads alone, no other work to blame: fewer threads, not a quieter machine)
    advice = _rerun_advice(threads) if busy else f"rerun with --threads {cores} or fewer"
    then = (
        f"for a verdict, {rerun or 'time them side by side in paired rounds in one process'}"
        if paired is False
        else f"for tighter figures, {advice}"
    )
    outnumber = f"this run's {threads} threads outnumber the {cores} cores"
    if not busy:
        idle = "" if measured is None else f" (1-minute load {measured})"
        if busy_cores is not None:
            idle = f" (other work kept {busy_cores:.1f} of them busy as the run began)"
        return (
            f"WARNING: {outnumber}{idle}: its threads wait for each other at each parallel op, "
            f"so single steps are slowed at random; {how}; {then}"
        )
    return (
        f"WARNING: other work was using the CPUs ({what}, {threads} thread(s) timing)"
        + (f", and {outnumber}" if over else "")
        + f": single steps are slowed at random; {how}; {then}"
    )


def _low_confidence(summaries: list[Summary]) -> str:
    """What the intervals of rows with too few rounds for the stated confidence are."""
    low = sorted(
        {
            s.speedup_confidence
            for s in summaries
            if s.speedup_confidence is not None and s.speedup_confidence < CONFIDENCE
        }
    )
    if not low:
        return ""
    return (
        f"; rows with too few rounds for that give the lowest and highest ratio, at "
        f"{', '.join(f'{c:.0%}' for c in low)} confidence"
    )


def notes(report: BenchReport, summaries: list[Summary], busy: bool = True) -> list[str]:
    """How the numbers were taken, shown under the table and in report.md (`busy=False`
    leaves out the busy-machine warning, for a terminal that was already warned)."""
    meta = report.metadata
    paired = not _timed_apart(meta, summaries)
    out = [
        f"timing: {meta['timing']}; {meta['warmup']} warm-up round(s) after the memory "
        f"step, {meta['threads']} thread(s)"
        + (f" ({meta['threads_note']})" if meta.get("threads_note") else ""),
        f"peak memory: {meta['memory_method']}",
        (
            f"speedup: the median over rounds of float32's (32-true) step time / this row's at "
            f"the same batch size, and its {CONFIDENCE:.0%} interval (order statistics of the "
            "rounds' ratios)" + _low_confidence(summaries)
            if paired
            else "speedup: float32's (32-true) median step time / this row's at the same batch "
            "size, marked (medians): the configurations ran one after another in separate "
            "processes, so no rounds pair their steps, a neighbour's load between them moves "
            "the ratio, and no interval or verdict is given"
        ),
    ]
    if any(s.vs_keep is not None for s in summaries):
        out.append(
            "step vs keep: the median over rounds of this row's step time / the same "
            "precision's with every activation kept (--activations keep) at the same batch "
            f"size, and its {CONFIDENCE:.0%} interval (with too few rounds for that, the "
            "interval their number gives, which the cell names); above 1: slower. checkpoint and "
            "selective recompute each block of the model, the other options apply to all of it"
        )
    if any(s.overhead is not None for s in summaries):  # else its column is left out
        out.append(
            "mixprec overhead: the median over rounds of our step time / the raw "
            f"torch.autocast loop's - 1, with its {CONFIDENCE:.0%} interval (mixed "
            "precisions only); mixprec computes layer-norm-type and softmax layers in float32 "
            "islands where the device's autocast does not (rows marked 'no f32 islands' leave "
            "them to autocast, as the raw loop does); empty where a row has no raw twin: "
            "policy files, activation options other than keep, quantized precisions"
        )
        if bare := _quantized_labels(summaries):  # (labels hold commas: "; " between them)
            they = "it quantizes" if len(bare) == 1 else "they quantize"
            out.append(
                f"mixprec overhead: none for {'; '.join(bare)}: {they} matmuls (float8, "
                "block-scaled) where torch.autocast cannot, so a raw autocast twin would be a "
                "plain 16-bit loop, and its overhead the quantization's cost, not mixprec's; "
                "there is no twin"
            )
    warning = busy_machine_warning(
        meta.get("load_average_before"),
        meta["threads"],
        meta.get("device_type", ""),
        _cores(meta),
        paired,
        rerun=_apart_why(meta)[1],
        busy_cores=meta.get("busy_cores_before"),
    )
    if busy and warning:
        out.append(warning)
    for name, status in meta["support"].items():
        if status.startswith("slow"):
            out.append(
                f"{name} is {status} (run because --allow-slow or MIXPREC_ALLOW_SLOW=1 allowed it)"
            )
    for s in summaries:
        if s.skipped_steps or s.raw_skipped_steps:
            raw = f" (raw loop: {s.raw_skipped_steps})" if s.raw_skipped_steps is not None else ""
            out.append(
                f"{s.label} at batch {s.batch_size}: {s.skipped_steps} steps skipped on "
                f"gradient overflow while the loss scale settled{raw}"
            )
    if meta.get("memory_limit"):
        limit = meta.get("memory_limit_text") or size_text(meta["memory_limit"])
        unit = " bytes" if limit.isdigit() else ""
        out.append(f"memory limit: {limit}{unit} per loop (OOM above it)")
    if meta.get("compile"):
        out.append(
            "compiled: every model runs under torch.compile (torch's defaults), compiled after "
            "mixprec's conversion, in our loop and the raw torch loop alike; the first step "
            "compiles, so it is timed apart (below) and the timed steps exclude it; each "
            "loop's first step compiles first in a fresh process with empty compile caches "
            "(the raw loop's in one of its own, not after ours)"
        )
    for s in summaries:
        if s.compiled and s.first_step_s is not None:
            raw = f", raw loop {s.raw_first_step_s:.1f} s" if s.raw_first_step_s else ""
            if s.raw_first_step_error:
                raw = f"; raw loop's cold compile not measured: {s.raw_first_step_error}"
            out.append(
                f"{s.label} at batch {s.batch_size}: first step (compilation) "
                f"{s.first_step_s:.1f} s{raw}"
            )
    return out


def _quantized_labels(summaries: list[Summary]) -> list[str]:
    """The labels of rows left without a raw twin only because their precision quantizes
    matmuls: mixed, not a policy file, every activation kept (others have none anyway)."""
    labels = []
    for s in summaries:
        if is_policy_file(s.precision) or s.activations not in (None, "keep"):
            continue
        try:
            policy = PolicyMap(s.precision)
        except (PolicySpecError, ValueError):  # (a name an older mixprec wrote)
            continue
        if policy.default.is_mixed and quantized(policy):
            labels.append(s.label)
    return list(dict.fromkeys(labels))


def _was(names: list[str]) -> str:
    """ "was" after one name, "were" after several."""
    return "was" if len(names) == 1 else "were"


def _duration(ms: float) -> str:
    seconds = ms / 1e3
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.0f} min"
    return f"{seconds / 3600:,.1f} h"


def _auto_resolved(gap: dict[str, Any]) -> str:
    """What "auto" among the precisions asked for resolved to on this device, and why
    (empty when it was not asked for). A gap is only where no mixed precision was timed,
    so auto, where asked for, resolved to float32 (`comparison_gap`)."""
    auto = gap.get("auto")
    if auto is None:
        return ""
    why = "auto picks bf16-mixed or 16-mixed only where it is fast, and neither is here"
    return f"; auto resolved to {auto} on this device ({why})"


def comparison_gap_lines(report: BenchReport, summaries: list[Summary]) -> list[str]:
    """Why no mixed precision was timed, as short labelled lines: what was timed, each
    precision left out and why, the dtype rates measured here, what timing them would cost,
    where they pay, and the commands to time them anyway (the fast ones, then with the slow
    ones too). Empty when nothing was left out."""
    gap = report.metadata.get("comparison_gap")
    if not gap:
        return []
    meta = report.metadata
    rates = gap["matmul_gflops"]
    base = rates.get("float32")
    if gap["asked"]:
        asked = gap.get("given") or meta["precisions"]
        first = (
            f"only {', '.join(asked)} {_was(asked)} asked for (--precision)"
            f"{_auto_resolved(gap)}, so "
        )
    else:
        first = "no mixed precision is fast on this device, so "
    # (results written before the gap said what was timed: the rows' precisions)
    timed = gap.get("timed") or sorted({s.label for s in summaries})
    lines = ["timed: " + first + f"only {' and '.join(timed)} {_was(timed)} timed"]
    for name, why in gap["left_out"].items():
        lines.append(f"left out: {name}, {why['status']} here ({why['reason']})")
    doubts = gap.get("matmul_doubts") or []
    if base and not doubts:
        shown = [f"float32 {base:,.1f} GFLOP/s"]
        for dtype, rate in rates.items():
            if dtype == "float32" or not rate:
                continue
            factor = base / rate
            rel = f"{factor:,.0f}x slower" if factor >= 1.5 else f"{1 / factor:.1f}x float32"
            shown.append(f"{dtype} {rate:,.1f} ({rel})")
        lines.append("matmul rates measured now: " + ", ".join(shown))
    if doubts:  # (their figures left out too: docs/bench.md, "On a machine where ...")
        why = [
            re.sub(r"measured [\d.,]+x ", "measured ", re.sub(r" \([^()]*\d\.\d[^()]*\)", "", d))
            for d in doubts
        ]
        lines.append(
            "matmul rates measured now: not shown, as other work used the cores while they "
            "were measured (" + "; ".join(why) + "); no rate or time is estimated from them"
        )
    fp32 = [s for s in summaries if _is_baseline(s) and s.median_ms is not None]
    steps = meta["steps"] + meta["warmup"] + UNTIMED_STEPS
    per_step, timing = [], []
    for name, why in gap["left_out"].items():
        rate = rates.get(why["dtype"])
        if why["status"] == "refused" or doubts or not (fp32 and base and rate):
            continue
        if base / rate < 1.5:
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
        names = " and ".join(gap.get("runnable") or ["them"])
        lines.append(f"to time {names} anyway: {gap['command']}")
    if gap.get("slow_command"):
        names = " and ".join(gap["slow_runnable"])
        lines.append(f"to time {names} too (slow here): {gap['slow_command']}")
    return lines


def _span(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return (
        fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"
    )


def _batches(named: list[int], run: list[int]) -> str:
    """The batch sizes a finding covers: a span ("8-128") when it covers every batch size
    of the run between them, else each one ("8 and 128": a span would take in the ones set
    aside, too noisy or failed)."""
    inside = sorted(b for b in set(run) if named[0] <= b <= named[-1])
    if named == inside or len(named) == 1 or not run:
        return _span([float(b) for b in named], "{:.0f}")
    return ", ".join(map(str, named[:-1])) + f" and {named[-1]}"


def _interval(s: Summary) -> Interval:
    speed = s.speedup or 0.0
    low = s.speedup_low if s.speedup_low is not None else speed
    high = s.speedup_high if s.speedup_high is not None else speed
    return Interval(speed, low, high, s.rounds or 0, s.speedup_confidence or 0.0)


def _outward(low: float, high: float, places: int) -> tuple[float, float]:
    """``low`` rounded down and ``high`` up to ``places`` decimals (a printed interval is
    never tighter than the measured one; a number already at that many decimals, up to
    binary rounding, stays)."""
    scale = 10**places
    return math.floor(low * scale + 1e-9) / scale, math.ceil(high * scale - 1e-9) / scale


def _memory_clause(rows: list[Summary], fp32: dict[int, Summary]) -> str | None:
    """ "29-45% less peak memory" over the rows, against float32 at each batch size (where
    it is less at some and more at others, or the same at some, each side with its batch
    sizes). A change that rounds to no whole percent is on neither side: "none less at
    batch 8" read as a saving."""
    memory = {
        s.batch_size: 1 - s.peak_memory / fp32[s.batch_size].peak_memory
        for s in rows
        if s.peak_memory and fp32[s.batch_size].peak_memory
    }
    changed = {b: m for b, m in memory.items() if f"{abs(m) * 100:.0f}" != "0"}
    if not changed:  # (equal peaks, to the percent: no finding to state)
        return None

    def at(sign: int) -> tuple[str, str]:
        batches = sorted(b for b, m in changed.items() if m * sign > 0)
        share = _span([abs(memory[b]) * 100 for b in batches], "{:.0f}") if batches else ""
        where = f" at batch {', '.join(map(str, batches))}" if len(batches) < len(memory) else ""
        return share, where

    (less, where_less), (more, where_more) = at(1), at(-1)
    if not more:
        return f"{less}% less peak memory{where_less}"
    if not less:
        return f"{more}% more peak memory{where_more}"
    return f"{less}% less peak memory{where_less} and {more}% more{where_more}"


def _float32_name(rows: list[Summary], fp32: dict[int, Summary]) -> str:
    """What the speedups of `rows` are against: "float32", or with its row's setting where
    the row says one ("float32 (TF32 off)")."""
    labels = {fp32[s.batch_size].label for s in rows}
    if len(labels) == 1 and (label := labels.pop()) != BASELINE:
        setting = label.removeprefix(BASELINE).strip(" ,()")  # "(TF32 off)", ", activations keep"
        return f"float32 ({setting})"
    return "float32"


def _other_float32(
    report: BenchReport, rows: list[Summary], summaries: list[Summary], fp32: dict[int, Summary]
) -> str:
    """The finding against float32's second row at the same batch sizes (on CUDA, "TF32
    on" beside "TF32 off"): its speed ratio and memory, as a sentence; '' with none. The
    ratio is the median of the rounds' ratios with its interval where both rows were timed
    in the same rounds, and said to be within the noise where no interval carries a finding
    (`carries_finding`); the ratio of the medians, so named, where they were not."""
    others: dict[int, Summary] = {}
    for s in summaries:
        if _is_baseline(s) and s.median_ms and s is not fp32.get(s.batch_size):
            others.setdefault(s.batch_size, s)
    paired = [s for s in rows if s.batch_size in others and s.median_ms]
    if not paired:
        return ""
    name = _float32_name(paired, others)
    memory = _memory_clause(paired, others)
    where = (
        ""
        if len(paired) == len(rows)
        else f" at batch {', '.join(str(s.batch_size) for s in paired)}"
    )
    row_of = {id(s): row for row, s in zip(report.rows, summaries, strict=True)}
    intervals = []
    for s in paired:
        theirs, ours = row_of[id(others[s.batch_size])].result, row_of[id(s)].result
        shared = theirs.paired and ours.paired
        interval = ratio_interval(theirs.mixprec.step_ms, ours.mixprec.step_ms) if shared else None
        intervals.append(interval)
    if all(i is not None and i.n > 1 for i in intervals):
        known = [i for i in intervals if i is not None]
        low, high = min(i.low for i in known), max(i.high for i in known)
        places = max(ratio_places(i.median, i.low, i.high) for i in known)
        lo, hi = _outward(low, high, places)
        bounds = f"{CONFIDENCE:.0%} intervals within {lo:.{places}f}-{hi:.{places}f}x"
        if any(carries_finding(i) for i in known):
            medians = [i.median for i in known]
            speed = f"it runs at {_span(medians, f'{{:.{places}f}}')}x its speed ({bounds})"
        else:
            speed = f"its speed is within this run's noise of it ({bounds})"
    else:
        ratios = [others[s.batch_size].median_ms / s.median_ms for s in paired]  # type: ignore[operator]
        speed = f"it runs at {_span(ratios, '{:.2f}')}x its speed (medians)"
    return f" Against {name}{where} {speed}" + (f", with {memory}" if memory else "") + "."


def _fits_where_float32_did_not(summaries: list[Summary]) -> str:
    """The memory finding when float32 ran out of memory at a batch size where a mixed
    precision fit (the seed's "-" rows), else ''."""
    ran = {s.batch_size for s in summaries if _is_baseline(s) and s.median_ms}
    oom = {s.batch_size for s in summaries if _is_baseline(s) and s.status == OOM} - ran
    fit = [s for s in summaries if s.precision != BASELINE and s.batch_size in oom and s.median_ms]
    if not fit:
        return ""
    parts = ", ".join(f"{s.label} at batch {s.batch_size} ({s.median_ms:.1f} ms/step)" for s in fit)
    return (
        f"float32 ran out of memory where mixed precision fit: {parts}, so there is no "
        "speed to compare there, and memory is what it buys"
    )


def _withheld(meta: dict[str, Any], label: str, kind: str, decisive: Interval, batch: int) -> str:
    """The sentence of a verdict withheld: why, and what to do."""
    model, threads = meta["model"], meta.get("threads") or 1
    how = f"how fast {label} trains the {model} model against float32 here"
    if kind == FEW:
        return (
            f"Too few rounds to conclude {how}: {decisive.n} at batch {batch}, where a "
            f"{CONFIDENCE:.0%} interval needs at least {MIN_ROUNDS} (their median: "
            f"{_ratio(decisive)}x); rerun with --steps {MIN_ROUNDS} or more."
        )
    under = _under_load(meta)
    # (as the table rounds it, and the width up: "1.50x wide" read as within the limit)
    places = ratio_places(decisive.median, decisive.low, decisive.high)
    width = math.ceil(decisive.width * 10**places) / 10**places
    bounds = _bounds(decisive.median, decisive.low, decisive.high)
    return (
        f"Too noisy to conclude {how}: at batch {batch} its speedup lies anywhere in "
        f"{bounds}x (the {CONFIDENCE:.0%} interval of {decisive.n} rounds is "
        f"{width:.{places}f}x wide and holds 1, a verdict needs at most {MAX_WIDTH:.1f}x or one "
        f"side of 1){', ' + under if under else ''}; {_rerun_advice(threads)}."
    )


def _ratio(i: Interval) -> str:
    """An interval's median as its table cell prints it (`ratio_places`)."""
    return f"{i.median:.{ratio_places(i.median, i.low, i.high)}f}"


def _fresh_process_options(meta: dict[str, Any]) -> list[str]:
    """The options of a run that put each configuration in a fresh process of its own
    (`runner.fresh_process_reason`): ``--memory-limit``, ``--compile``."""
    return [flag for flag, key in FRESH_PROCESS_OPTIONS if meta.get(key)]


def _timed_apart(meta: dict[str, Any], summaries: list[Summary]) -> bool:
    """Whether a run's configurations ran one after another in separate processes: by its
    options, as `suite.times_paired` decides, or, recorded by a mixprec version that ran
    every configuration so, by a row that shares no rounds with float32. float32's own rows
    decide nothing: alone at its batch size (a float32-only run) a row shares no rounds
    either, yet ran in this process."""
    return bool(_fresh_process_options(meta)) or any(
        not s.paired for s in summaries if s.speedup is not None and not _is_baseline(s)
    )


def _apart_why(meta: dict[str, Any]) -> tuple[str, str]:
    """Why a run's configurations ran in separate processes, and how to get paired rounds."""
    options = _fresh_process_options(meta)
    how = rerun_for_verdict(
        options, bool(meta.get("max_batch_searches")), meta.get("device_type", "")
    )
    if options:
        return f"{' and '.join(options)}: a fresh process each", how
    return "as the mixprec version of this run timed every configuration", how


def rerun_for_verdict(given: list[str], max_batch: bool, device_type: str) -> str:
    """How a run timed apart gets paired rounds: without the options `given` that put each
    configuration in a fresh process (``--memory-limit``, ``--compile``), and without
    ``--max-batch`` where a CPU's search needs the memory limit (the command advised would
    be refused); with none given (results of a version that timed every configuration
    apart), with this version."""
    if not given:
        return "rerun with this version, which times them side by side in paired rounds"
    drop = " and ".join(given)
    if max_batch and device_type == "cpu" and "--memory-limit" in given:
        search = "a CPU's search needs --memory-limit: search in a run of its own"
        drop = f"{', '.join(given)} and --max-batch ({search})"
    return f"rerun without {drop}, which times them side by side in paired rounds in one process"


def _unpaired(
    report: BenchReport,
    label: str,
    rows: list[Summary],
    fp32: dict[int, Summary],
    summaries: list[Summary],
) -> str:
    """The sentence where the rows shared no rounds: the ratio of the medians, no interval
    and no verdict, why, and how to get one; then the memory finding."""
    meta = report.metadata
    why, how = _apart_why(meta)
    speed = [s.speedup or 0.0 for s in rows]
    digits = f"{{:.{max(ratio_places(x) for x in speed)}f}}"
    batches = _batches(sorted(s.batch_size for s in rows), meta.get("batch_sizes") or [])
    sentence = (
        f"No verdict on how fast {label} trains the {meta['model']} model against float32 "
        f"here: the configurations ran one after another in separate processes ({why}), so "
        "a neighbour's load between them moves the ratio, and no interval can hold it; the "
        f"ratio of their median step times is {_span(speed, digits)}x (batch {batches}). For "
        f"a verdict, {how}."
    )
    return sentence + _memory_tail(_memory_clause(rows, fp32), label, summaries)


def _memory_tail(memory: str | None, label: str, summaries: list[Summary]) -> str:
    """What a sentence without a speed verdict still says: the memory `label` saves (its
    `_memory_clause`), and the batch sizes it fits where float32 did not."""
    tail = f" It uses {memory} than float32 (memory does not depend on the load)." if memory else ""
    fits = _fits_where_float32_did_not(
        [s for s in summaries if s.label == label or _is_baseline(s)]
    )
    return tail + (f" Also, {fits}." if fits else "")


def _under_load(meta: dict[str, Any]) -> str:
    """ "under a 1-minute load of 7.2 on 2 cores" when other work kept the CPUs busy, else
    nothing."""
    other = _other_load(meta)
    busy = other and _is_busy(
        other[0], meta.get("threads") or 1, meta.get("device_type", ""), _cores(meta)
    )
    if not other or not busy:
        return ""
    if other[1].startswith("1-minute"):
        return f"under a 1-minute load of {other[0]:.1f} on {_cores(meta)} cores"
    return f"while {other[1]}"


def _untimed_auto(meta: dict[str, Any]) -> str:
    """ "; bf16-mixed, which mixprec info rates fast here, was not timed: ..." where the
    precision "auto" means on this device is a mixed one the run did not time (advice to
    train in float32 would pass it by); '' otherwise, and for results recorded before it."""
    auto = meta.get("auto_precision")
    if not auto or auto == BASELINE or auto in (meta.get("precisions") or []):
        return ""
    return (
        f"; {auto}, which mixprec info rates fast here, was not timed: add it to --precision "
        "before settling on float32"
    )


def _noisy_clause(meta: dict[str, Any], noisy: list[tuple[Summary, Interval]]) -> str:
    """The batch sizes left out of a finding as too noisy, with their intervals."""
    threads = meta.get("threads") or 1
    parts = ", ".join(
        f"batch {s.batch_size}: anywhere in {_bounds(i.median, i.low, i.high)}x from {i.n} rounds"
        for s, i in noisy
    )
    under = _under_load(meta)
    return (
        f" Too noisy{' ' + under if under else ''} to state the speedup at the other batch "
        f"size(s) ({parts}; a "
        f"verdict needs a {CONFIDENCE:.0%} interval at most {MAX_WIDTH:.1f}x wide or on one side "
        "of 1); "
        f"{_rerun_advice(threads)}."
    )


def _nothing_compared(summaries: list[Summary]) -> str:
    """Why no mixed precision was compared with float32, from what ran: float32 not asked
    for, nothing fitting under the memory limit, every configuration (or every one of
    mixed precision, or of float32) failing, or float32 and mixed precision at no common
    batch size."""
    mixed = [s for s in summaries if not _is_baseline(s)]
    float32 = [s for s in summaries if _is_baseline(s)]
    if not summaries:
        return "Nothing ran"
    if all(s.status == OOM for s in summaries):
        return "No configuration fit under the memory limit (see the table)"
    if all(s.status != OK for s in summaries):
        return "Every configuration failed (see the errors above)"
    if mixed and not float32:
        ran = ", ".join(dict.fromkeys(s.label for s in mixed if s.status == OK))
        return f"{ran} ran without float32 to compare it with (add 32-true to --precision)"
    if mixed and all(s.status != OK for s in mixed):
        how = "ran out of memory" if all(s.status == OOM for s in mixed) else "failed"
        return f"Every mixed precision configuration {how} (see the table)"
    if float32 and all(s.status != OK for s in float32):
        how = "ran out of memory" if all(s.status == OOM for s in float32) else "failed"
        return f"Every float32 configuration {how} (see the table), so nothing was compared with it"
    return "No mixed precision and float32 ran side by side here to compare"


def conclusion(report: BenchReport, summaries: list[Summary]) -> str:
    """What the recommended mixed precision buys on this machine against float32 (speed,
    with its interval, and peak memory, over the batch sizes both ran at), and how that
    compares with the seed experiment's V100 (`BLOG_V100_MS`); or, when the intervals are
    too wide or too few rounds ran (`verdict.speed_verdict`), no speed finding but why not,
    and the memory finding, which the load does not touch. Under `assume` (a described
    device) the step times are the host's: no advice is drawn from them, and it says so."""
    sentence = _conclusion(report, summaries)
    if report.metadata.get("described_device"):
        sentence += (
            " The device was described (mixprec.device.assume): these are this host's step "
            "times, which say nothing of the described device's speed; time it there before "
            "choosing."
        )
    return sentence


def _conclusion(report: BenchReport, summaries: list[Summary]) -> str:
    meta = report.metadata
    blog = [fp32 / mixed for mixed, fp32 in BLOG_V100_MS.values()]
    seed = f"the seed experiment got {_span(blog, '{:.1f}')}x from mixed precision on its V100 GPU"
    # float32's first row at each batch size, as the speedups take it (`_baseline`): on CUDA
    # "TF32 off", before "TF32 on", which `_other_float32` states beside it
    fp32: dict[int, Summary] = {}
    for s in summaries:
        if _is_baseline(s) and s.median_ms:
            fp32.setdefault(s.batch_size, s)
    ok = [s for s in summaries if s.precision != BASELINE and s.speedup and s.batch_size in fp32]
    if not ok and (fits := _fits_where_float32_did_not(summaries)):
        return f"On this machine {fits}; {seed}."
    if not fp32 or not ok:
        gap = meta.get("comparison_gap")
        left_out = (gap or {}).get("left_out", {})
        fast = [n for n, why in left_out.items() if why["status"] == "fast"]
        if gap and gap["asked"]:  # left out because not asked for: nothing found against them
            also = f" ({', '.join(fast)} would be fast here: see above)" if fast else ""
            beside = "beside float32 " if BASELINE in meta["precisions"] else ""
            asked = gap.get("given") or meta["precisions"]
            return (
                f"Only {', '.join(asked)} {_was(asked)} asked for{_auto_resolved(gap)}, so no "
                f"mixed precision ran {beside}to compare{also}; {seed}."
            )
        if gap:
            described = bool(meta.get("described_device"))  # (it rated them, `assume`)
            where = "the described device" if described else "this machine"
            return (
                f"No mixed precision is fast on {where}, so float32 is the one to train "
                f"in {'there' if described else 'here'} (as said above); {seed}."
            )
        return f"{_nothing_compared(summaries)}; {seed}."
    fast = [n for n in MIXED_CANDIDATES if meta["support"].get(n) == "fast"]
    labels = list(dict.fromkeys(s.label for s in ok))
    # the recommended precision's own row, else a row of it under another label ("bf16-mixed
    # (compiled)": without it the first mixed row was judged, 16-mixed's where it came first)
    label = next((n for n in fast if n in labels), None) or next(
        (s.label for n in fast for s in ok if s.precision == n), labels[0]
    )
    rows = [s for s in ok if s.label == label]
    if not all(s.paired for s in rows):  # (no rounds shared: no interval, no verdict)
        return _unpaired(report, label, rows, fp32, summaries)
    verdict = speed_verdict([_interval(s) for s in rows])
    noisy_tail = ""
    if verdict.kind == NOISY:  # a finding from the batch sizes that allow one, if any
        clear = [carries_finding(i) for i in verdict.intervals]
        if any(clear):
            pairs = zip(rows, verdict.intervals, clear, strict=True)
            noisy = [(s, i) for s, i, c in pairs if not c]
            noisy_tail = _noisy_clause(meta, noisy)
            rows = [s for s, c in zip(rows, clear, strict=True) if c]
            verdict = speed_verdict([_interval(s) for s in rows])
    memory = _memory_clause(rows, fp32)  # over the batch sizes the sentence names
    if verdict.withheld:
        batch = rows[verdict.intervals.index(verdict.decisive)].batch_size
        sentence = _withheld(meta, label, verdict.kind, verdict.decisive, batch)
        return sentence + _memory_tail(memory, label, summaries)
    speed = [s.speedup or 0.0 for s in rows]
    digits = "{:.1f}" if verdict.kind == FASTER else "{:.2f}"
    if verdict.kind == FASTER and min(float(f"{x:.1f}") for x in speed) <= 1.0:
        digits = "{:.2f}"  # ("1.0x as fast" reads as no faster)
    if digits == "{:.2f}":  # as the table's cells round each ratio (`ratio_places`)
        places = max(ratio_places(i.median, i.low, i.high) for i in verdict.intervals)
        digits = f"{{:.{places}f}}"
    if verdict.kind == FASTER and _span(speed, digits) == _span(blog, digits):
        # ("1.1x ... the seed got 1.1x ..., so it pays more here" reads as a contradiction)
        digits = "{:.2f}"
        seed = seed.replace(f"{_span(blog, '{:.1f}')}x", f"{_span(blog, digits)}x")
    base = _float32_name(rows, fp32)
    if verdict.kind == FASTER:
        buys = f"trains the {meta['model']} model {_span(speed, digits)}x as fast as {base}"
    else:
        buys = f"runs the {meta['model']} model at {_span(speed, digits)}x the speed of {base}"
        if min(speed) < 0.1:  # (as `mixprec info`: "0.0081x (124x slower)")
            buys += f", {_span([1 / x for x in speed], '{:,.0f}')}x slower,"
    if memory:
        buys += f" with {memory}"
    buys = buys.removesuffix(",")  # (", 250x slower," closes before the parenthesis)
    batches = _batches(sorted(s.batch_size for s in rows), meta.get("batch_sizes") or [])
    low = min(i.low for i in verdict.intervals)
    high = max(i.high for i in verdict.intervals)
    rounds = _span([float(i.n) for i in verdict.intervals], "{:.0f}")
    # (rounded outward: an interval reaching 1.07 read '1.1-...', tighter than it is)
    places = 1 if digits == "{:.1f}" else int(digits[3:-2])  # ("{:.4f}": 4)
    low_out, high_out = _outward(low, high, places)
    bounds = f"{digits.format(low_out)}-{digits.format(high_out)}"
    if (low > 1 and low_out <= 1.0) or (high < 1 and high_out >= 1.0):
        # ("1.0-1.8x" reads as reaching 1)
        places = max(places, ratio_places(1.0, low, high))
        bounds = "{0:.{2}f}-{1:.{2}f}".format(*_outward(low, high, places), places)
    certainty = f"{CONFIDENCE:.0%} intervals within {bounds}x from {rounds} paired rounds"
    # against the seed's figure only what the intervals carry: more or less when every
    # interval lies above or below it, about the same when every one holds it
    intervals = verdict.intervals
    # (plain words where it does not pay at all: slower than float32 at every batch size, or
    # no faster and slower by the median; and the batch sizes where it is slower, named)
    slower_at = [s.batch_size for s, i in zip(rows, intervals, strict=True) if i.high < 1]
    slower = len(slower_at) == len(intervals)
    named = "batch " + (
        ", ".join(map(str, slower_at[:-1])) + f" and {slower_at[-1]}"
        if len(slower_at) > 1
        else "".join(map(str, slower_at))
    )
    if slower or (
        verdict.kind != FASTER
        and statistics.median(speed) < 1
        and not any(i.low > 1 for i in intervals)
    ):
        than = (
            "while here it is slower than float32"
            if slower
            else "while here it is no faster than float32"
            + (f", and slower at {named}" if slower_at else "")
        )
    elif all(i.low > max(blog) for i in intervals):
        than = "so mixed precision pays more here than it did there"
    elif all(i.high < min(blog) for i in intervals):
        than = "so here it pays less than there"
    elif all(i.low <= max(blog) and i.high >= min(blog) for i in intervals):
        than = "about what it pays here"
    else:  # (each class the intervals fall in, named only where one does)
        above = any(i.low > max(blog) for i in intervals)
        below = any(i.high < min(blog) for i in intervals)
        about = any(i.low <= max(blog) and i.high >= min(blog) for i in intervals)
        parts = [
            word
            for word, found in (("more than that", above), ("about that", about), ("less", below))
            if found
        ]
        if len(parts) == 2:
            than = f"{parts[0]} at some batch sizes here and {parts[1]} at others"
        else:
            than = f"{parts[0]} at some batch sizes here, {parts[1]} at some and less at others"
    if slower_at and not slower and "slower" not in than:
        than += f"; at {named} it is slower than float32"
    threads = meta.get("threads") or 1
    other = _other_load(meta)
    # several threads on cores other work used: a ratio that may be low for that alone
    # gives no advice to train in float32 (the caveat below says how to measure it)
    contended = bool(
        other
        and threads > 1
        and _is_busy(other[0], threads, meta.get("device_type", ""), _cores(meta))
    )
    # the run's own threads outnumbering the cores: the user's setting, so the advice
    # follows the ratio, with the caveat (no other work to blame)
    over = threads_over_cores(threads, _cores(meta), meta.get("device_type", ""))
    # (float32 advised where this row is slower or pays less than the seed did, by a tenth)
    advice = (slower or all(i.high < min(blog) for i in intervals)) and statistics.median(
        speed
    ) < 0.9 * min(blog)
    # (a described device: the host's speed is no advice for it, `conclusion`)
    if advice and not contended and not meta.get("described_device"):
        untimed = _untimed_auto(meta)
        if memory and memory.endswith("less peak memory"):
            than += ": train in float32 unless memory is what you need"
        elif untimed:  # (float32 is better than this row, not than every precision here)
            than += f": train in float32 rather than {label}"
        else:  # (no memory saved at every batch size: nothing to weigh the speed against)
            than += ": train in float32 here"
        than += untimed
    sentence = f"On this machine {label} {buys} (batch {batches}; {certainty}); {seed}, {than}."
    sentence += _other_float32(report, rows, summaries, fp32)
    sentence += noisy_tail
    fits = _fits_where_float32_did_not(
        [s for s in summaries if s.label == label or _is_baseline(s)]
    )
    if fits:  # (a batch size float32 could not run is in no interval: said apart)
        sentence += f" Also, {fits}."
    if contended:
        sentence += (
            f" Measured with {threads} threads on cores other work was using ({other[1]})"
            + (f", more threads than the {_cores(meta)} cores" if over else "")
            + ": threads then wait for each other at every op, which may cost the shorter "
            "low-precision step more, so this ratio can be lower than free cores give; "
            f"--threads 1 measures what {label} itself buys"
            + (" before float32 is chosen over it" + _untimed_auto(meta) if advice else "")
            + "."
        )
    elif over:
        sentence += (
            f" Measured with {threads} threads on {_cores(meta)} cores: the run's threads "
            "outnumber the cores, so they wait for each other at every op, which may cost the "
            "shorter low-precision step more, so this ratio can be lower than "
            f"{_cores(meta)} threads or fewer give; --threads 1 measures what {label} itself "
            "buys."
        )
    return sentence


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
    """results.csv: one row per configuration (written whole)."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(Summary.__dataclass_fields__))
    writer.writeheader()
    for s in summaries:
        writer.writerow(asdict(s))
    write_atomically(path, text.getvalue())


def markdown(report: BenchReport, summaries: list[Summary]) -> str:
    """report.md: environment, command, the table (columns all "-" left out), notes and
    the max-batch search."""
    meta = report.metadata
    keep = shown_columns(summaries)
    device = [f"- device: {meta['device']}"]
    if described := meta.get("described_device"):  # (`assume`: it rated, the host timed)
        device = [
            f"- device: {meta['device']}, the host that took every step time",
            f"- described device: {described} (mixprec.device.assume): support and "
            "auto_precision are rated for it, not for the host; the step times are the "
            "host's, not its",
        ]
    lines = [
        f"# mixprec bench: {meta['model']}",
        "",
        *device,
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
    twins = [s for s in summaries if s.raw_error]
    if failed or twins:
        lines += ["", "## Configurations that did not run", ""]
        lines += [f"- {s.label} at batch {s.batch_size}: {s.status} ({s.error})" for s in failed]
        lines += [
            f"- the raw torch.autocast twin of {s.label} at batch {s.batch_size}: "
            f"{s.raw_error}; mixprec's loop ran (its row above)"
            for s in twins
        ]
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
    write_figure(path, fig, dpi=120)


def write_outputs(out: Path, report: BenchReport, png: bool = True) -> list[Path]:
    """Write results.json, results.csv, report.md and (with `png`, which needs matplotlib)
    bench.png into `out`, each whole (`write_atomically`: a run stopped while writing, or a
    reader, never finds half of one, nor the last run's results half overwritten); returns
    the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    summaries = summarize(report)
    paths = [out / n for n in OUTPUT_FILES]
    write_atomically(paths[0], json.dumps(to_json(report, summaries), indent=1))
    write_csv(paths[1], summaries)
    write_atomically(paths[2], markdown(report, summaries))
    if not png:
        return paths[:3]
    plot(paths[3], report, summaries)
    return paths
