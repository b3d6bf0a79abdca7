"""`mixprec bench`: argument parsing, progress and printing; the work is in `mixprec.bench`
(`suite`, `distributed`)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import os
import re
import signal
import threading
from collections.abc import Iterable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markdown import Markdown
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from mixprec import textout
from mixprec.activations.options import OPTIONS
from mixprec.bench import distributed
from mixprec.bench.journal import JOURNAL, Journal
from mixprec.bench.journal import load as load_journal
from mixprec.bench.models import BUILTIN_MODELS, check_model, check_workload
from mixprec.bench.report import (
    FRESH_PROCESS_OPTIONS,
    OUTPUT_FILES,
    Summary,
    busy_machine_warning,
    comparison_gap_lines,
    conclusion,
    max_batch_lines,
    notes,
    progress_line,
    rerun_for_verdict,
    rich_table,
    stopped_line,
    summarize,
    write_outputs,
)
from mixprec.bench.rounds import STOP_CONFIDENCE
from mixprec.bench.runner import OK, OOM
from mixprec.bench.suite import (
    DEFAULT_TIME_BUDGET,
    PRESETS,
    BenchOptions,
    BenchReport,
    Listener,
    Plan,
    Row,
    plan,
    run_bench,
    times_paired,
)
from mixprec.bench.verdict import TARGET_WIDTH
from mixprec.cli.outputs import check_output_dir, new_output_dir
from mixprec.hardware import detect, parse_device, resolve_auto
from mixprec.policy import is_auto
from mixprec.version import __version__

__all__ = [
    "add_parser",
    "parse_size",
]

_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """Bytes from "2GiB", "512M", "1.5g", "1000000": a bare prefix (K, M...) or one with
    "iB" is binary (K = 1024), one with "B" decimal (KB = 1000), as the doctor's and the
    search's sizes read them; a bare number counts bytes, and a bare prefix is binary,
    where the doctor's ``--fit`` wants the unit written out (its budgets also take
    fractions, which a bare number would read as)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(ib|b)?|b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use bytes or a number with K, M, G or T, then iB "
            "(binary) or B (decimal) (e.g. 2GiB, 512M, 500MB)"
        )
    prefix, suffix = m.group(2) or "", m.group(3)
    base = 1000 if suffix == "b" else 1024
    size = int(Fraction(m.group(1)) * base ** _POWERS[prefix])  # (exact decimal arithmetic)
    if size >= 1 << 62:  # (the OS's limits take 64-bit sizes: a larger one failed each row)
        raise argparse.ArgumentTypeError(f"{text!r} is larger than any machine's memory")
    if size < 1:  # '0.5' read as bytes rounded to 0, refused as 'got 0'
        raise argparse.ArgumentTypeError(
            f"{text!r} is less than one byte (a bare number counts bytes); use a number with "
            "K, M, G or T (e.g. 0.5G, 512M)"
        )
    return size


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in re.split(r"[,\s]+", text) if x]  # "8 16" quoted as one too
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"batch sizes must be positive integers (space- or comma-separated), got {text!r}"
        ) from None
    if not sizes or any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return sizes


def add_parser(subparsers: Any) -> argparse.ArgumentParser:  # a flat list of options, kept whole
    """Register `mixprec bench` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="float32 vs mixed precision: ms/step, speedup, memory",
        description=(
            "Time training steps of a model in float32 and in mixed precision on this machine, "
            "across batch sizes; with no arguments: the seed blog's CNN, float32 vs the "
            "precision `mixprec info` recommends here. Each configuration's row is written to "
            "rows.jsonl in --out as soon as it is measured, and the outputs are written from it "
            "whatever happens to a configuration, also when Ctrl-C or SIGTERM stops the run. "
            "Exit status 0: every configuration and max-batch probe ran (out of memory is a "
            "result); 1: one failed (an error or --timeout), or a configuration's raw "
            "torch.autocast twin failed; 2: bad arguments; 3: an error "
            "stopped the command; 130 / 143: Ctrl-C / SIGTERM stopped it (what finished is "
            "written)."
        ),
    )
    p.add_argument(
        "--model",
        help=f"{', '.join(BUILTIN_MODELS)}, or module:factory / file.py:factory (a function "
        "returning (model, make_batch(batch_size), loss_fn(outputs, targets))); default cnn "
        "(transformer with --strategy)",
    )
    p.add_argument(
        "--precision",
        nargs="+",
        action="extend",
        metavar="SPEC",
        help="precision specs, space-separated (32-true bf16-mixed 16-mixed "
        "'p=f32,c=bf16,o=f32' ...), or policy files such as the policy.json `mixprec doctor` "
        "writes (per-layer rules); default: 32-true and the recommended mixed one",
    )
    p.add_argument(
        "--batch-sizes",
        nargs="+",
        action="extend",
        type=_batch_sizes,
        metavar="N",
        help="batch sizes (space- or comma-separated; repeated flags add up); default depends "
        "on the model",
    )
    p.add_argument("--image-size", type=int, help="image side for --model cnn (default 128)")
    p.add_argument(
        "--steps",
        type=int,
        help="timed rounds per batch size, one step of each configuration a round (default "
        "10); given alone, exactly that many",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help=f"after --steps rounds, more rounds while a speedup's {STOP_CONFIDENCE * 100:.0f}%% "
        f"interval is wider than {TARGET_WIDTH:.2f}x (high/low), until this many seconds of "
        f"rounds per batch size (default {DEFAULT_TIME_BUDGET:g}, or 0 when --steps is given)",
    )
    p.add_argument(
        "--warmup", type=int, help="untimed rounds after the (untimed) memory step (default 1)"
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="blog: 256x256, batch 32..512 (GPU)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: the best available)")
    p.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: torch's default here, fewer when other work keeps "
        "cores busy as the run begins)",
    )
    p.add_argument("--tf32", choices=("on", "off", "both"), help="CUDA float32 rows (default both)")
    p.add_argument(
        "--allow-slow",
        action="store_true",
        help="also run precisions far slower than float32 here (float16 without fp16 hardware)",
    )
    p.add_argument(
        "--memory-limit",
        type=parse_size,
        metavar="SIZE",
        help="memory a configuration may use (e.g. 2GiB, 512M: binary; 500MB: decimal); above "
        "it the row is OOM",
    )
    p.add_argument(
        "--max-batch",
        action="store_true",
        help="also find the largest batch that fits per precision (CPU: needs --memory-limit)",
    )
    p.add_argument(
        "--float32-islands",
        choices=("on", "off", "both"),
        default="on",
        help="mixed rows with LayerNorm/softmax in float32 (on, mixprec's default), left to "
        "autocast (off), or both, to see what the islands cost",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (torch's defaults) in every row, mixprec's and the raw "
        "torch loop alike; the first step compiles and is reported apart",
    )
    p.add_argument(
        "--activations",
        nargs="+",
        action="extend",
        metavar="OPTION",
        help=f"also run every precision with these activation options ({', '.join(OPTIONS)}), "
        "one row each beside keep, with its step time against keep's (and its largest batch "
        "with --max-batch); checkpoint and selective recompute each block of the model (the "
        "entries of its repeated layer stacks), the others apply to the whole model",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    p.add_argument(
        "--strategy",
        choices=distributed.STRATEGIES,
        help="instead of timing: memory per rank of data-parallel training over --devices "
        "processes, sharded (fsdp, compared with ddp) or whole (ddp); default precisions "
        f"{' '.join(distributed.DEFAULT_PRECISIONS)}, model transformer, batch 2, 2 steps, "
        "on the CPU unless --device cuda; it takes one batch size and none of the timing "
        "options (--max-batch, --timeout, ...)",
    )
    p.add_argument("--devices", type=int, help="processes for --strategy (default 2)")
    p.add_argument("--out", type=Path, help="output folder (default ./mixprec-bench/<timestamp>)")
    p.set_defaults(func=run_command)
    return p


def _options(args: argparse.Namespace) -> BenchOptions:
    batch_sizes = [b for group in args.batch_sizes for b in group] if args.batch_sizes else None
    return BenchOptions(
        model=args.model or "cnn",
        precisions=args.precision,
        batch_sizes=batch_sizes,
        image_size=args.image_size,
        steps=args.steps,
        time_budget=args.time_budget,
        warmup=args.warmup,
        device=args.device,
        threads=args.threads,
        tf32=args.tf32,
        allow_slow=args.allow_slow,
        memory_limit=args.memory_limit,
        max_batch=args.max_batch,
        preset=args.preset,
        float32_islands=args.float32_islands,
        timeout=args.timeout,
        compile=args.compile,
        activations=args.activations,
    )


# the timing run's options, which --strategy does not take (flag, attribute, default)
_TIMING_ONLY = (
    ("--image-size", "image_size", None),
    ("--time-budget", "time_budget", None),
    ("--warmup", "warmup", None),
    ("--preset", "preset", None),
    ("--tf32", "tf32", None),
    ("--memory-limit", "memory_limit", None),
    ("--max-batch", "max_batch", False),
    ("--float32-islands", "float32_islands", "on"),
    ("--compile", "compile", False),
    ("--activations", "activations", None),
    ("--timeout", "timeout", 900.0),
)


def _memory_device(name: str | None) -> str:
    """The device kind --strategy runs on: cpu (the default) or cuda; ValueError for others."""
    if name is None:
        return "cpu"
    kind = parse_device(name).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--strategy runs on cpu or cuda, not {kind}")
    return kind


def _output_dir(given: Path | None, keep: Iterable[str]) -> Path:
    """``--out`` checked, or without it a new ``./mixprec-bench/<timestamp>`` made now."""
    if given is not None:
        return check_output_dir(given, "--out", keep=keep)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return check_output_dir(new_output_dir("mixprec-bench", stamp), "--out", keep=keep)


def _run_configs(p: Plan, console: Console, out: Path) -> tuple[Journal, str | None]:
    """Run the plan's configurations with a progress bar, each row journaled in `out` as
    it ends; the journal and what stopped the run early (Ctrl-C, SIGTERM or None)."""
    progress = Progress(
        TextColumn("{task.description}", markup=False),  # (labels are user text)
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
    )
    journal = Journal(out / JOURNAL)
    stopped_by = None
    with progress, _sigterm_stops():
        task = progress.add_task("configurations", total=len(p.configs))
        try:
            run_bench(p, [journal, _Printer(console, progress, task, len(p.configs))])
        except KeyboardInterrupt:
            stopped_by = "Ctrl-C"
        except Terminated:
            stopped_by = "SIGTERM"
    return journal, stopped_by


def _print_results(
    report: BenchReport,
    summaries: list[Summary],
    console: Console,
    err: Console,
    busy: bool,
) -> None:
    """The table, its notes (`busy`: whether to warn of a busy machine), the failed rows
    and raw torch.autocast twins, why no mixed precision was timed, the largest batches."""
    console.print(rich_table(report, summaries))
    for line in notes(report, summaries, busy=busy):
        console.print(f"  {line}", highlight=False, markup=False)
    for s in summaries:
        if s.status not in (OK, OOM):
            err.print(_styled(f"{s.label} @ {s.batch_size}: {s.status}", "red", f" {s.error}"))
        if s.raw_error:  # (its table row ran: the raw column's "-" says nothing more)
            head = f"{s.label} @ {s.batch_size}, its raw torch.autocast twin:"
            rest = f" {s.raw_error}; mixprec's loop ran (its row above)"
            err.print(_styled(head, "red", rest))
    gap = comparison_gap_lines(report, summaries)
    if gap:
        console.print("[yellow bold]why no mixed precision was timed[/]")
        for line in gap:
            console.print(f"  {line}", highlight=False, markup=False)
    if report.max_batch:
        console.print("[bold]largest batch that fits[/]")
        for line in max_batch_lines(report):
            console.print(f"  {line}", highlight=False, markup=False)


def run_memory_command(
    args: argparse.Namespace, console: Console, err: Console, out: Path | None
) -> int:
    """`--strategy`: memory per rank of DDP and FSDP training (`mixprec.bench.distributed`)."""
    strategies = ["ddp", "fsdp"] if args.strategy == "fsdp" else ["ddp"]
    sizes = [b for group in args.batch_sizes for b in group] if args.batch_sizes else [2]
    devices = args.devices if args.devices is not None else 2
    model = args.model or "transformer"
    try:
        device, precisions, out = _checked_memory_args(args, console, model, sizes, devices, out)
    except ValueError as e:
        err.print(_styled("mixprec bench: error:", "red", f" {e}"), soft_wrap=True)
        return 2
    batch = sizes[0]
    threads = args.threads or max(1, (os.cpu_count() or 1) // devices)
    specs = [
        distributed.MemorySpec(
            strategy,
            precision,
            model,
            batch,
            args.steps or 2,
            devices,
            device,
            threads,
            args.allow_slow,
        )  # fmt: skip
        for precision in precisions
        for strategy in strategies
    ]
    command = distributed.command_line()
    console.print(f"reproduce: {command}", highlight=False, soft_wrap=True, markup=False)
    rows, interrupted = _run_memory_specs(specs, out, console)
    meta = {
        "command": command,
        "host": f"{detect(torch.device(device)).describe()}; {threads} threads per rank; "
        f"torch {torch.__version__}; mixprec {__version__}",
        "devices": devices,
        "model": specs[0].model,
        "batch_size": batch,
        "steps": specs[0].steps,
    }
    paths = distributed.write(out, rows, meta)
    console.print(Markdown(paths[1].read_text()))
    failed = [r for r in rows if isinstance(r, distributed.FailedRun)]
    for r in failed:
        err.print(_styled(f"{r.strategy} {r.precision}: failed", "red", f" {r.error}"))
    console.print(f"results: {', '.join(map(str, paths))}", highlight=False, markup=False)
    if interrupted:
        err.print("[red]interrupted (Ctrl-C):[/] the rows measured before it are written")
        return 130
    return 1 if failed else 0


def _checked_memory_args(
    args: argparse.Namespace,
    console: Console,
    model: str,
    sizes: list[int],
    devices: int,
    out: Path | None,
) -> tuple[str, list[str], Path]:
    """The device, the precisions and the output directory of a `--strategy` run, each
    argument checked (`ValueError` naming the bad one); precisions left out are printed."""
    for flag, name, default in _TIMING_ONLY:
        if getattr(args, name) != default:
            raise ValueError(
                f"{flag} is an option of the timing run, not of --strategy (memory per rank: "
                "--model, --precision, --batch-sizes, --steps, --devices, --device, "
                "--threads, --allow-slow, --out)"
            )
    if len(sizes) > 1:
        raise ValueError(f"--strategy measures one batch size, got {' '.join(map(str, sizes))}")
    if devices < 1 or (args.steps is not None and args.steps < 1):
        raise ValueError("--devices and --steps must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    device = _memory_device(args.device)
    if device == "cuda" and devices > torch.cuda.device_count():
        raise ValueError(f"--devices {devices} but {torch.cuda.device_count()} GPUs are visible")
    check_model(model)
    precisions = args.precision
    if not precisions:
        precisions, left_out = distributed.default_precisions(device, args.allow_slow)
        for spec, why in left_out.items():
            console.print(
                f"left out {spec}: slow or refused here ({why}); --allow-slow times it anyway",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
    # "auto" means the fastest stable precision of the measured device
    auto = resolve_auto(detect(torch.device(device))).name
    precisions = list(dict.fromkeys(auto if is_auto(p) else p for p in precisions))
    distributed.check_precisions(precisions, device, args.allow_slow)
    out = _output_dir(out, distributed.OUTPUT_FILES)
    check_workload(model)  # last: it calls a user's factory
    return device, precisions, out


def _run_memory_specs(
    specs: list[distributed.MemorySpec], out: Path, console: Console
) -> tuple[list[distributed.Row], bool]:
    """Run each spec's ranks, printing each spec's memory as it ends; the rows and whether
    Ctrl-C stopped the run (every rank has ended then; what was measured is kept)."""

    def done(spec: distributed.MemorySpec, rows: list[distributed.Row]) -> None:
        ranks = [r for r in rows if isinstance(r, distributed.RankMemory)]
        if len(ranks) != len(rows):
            console.print(
                f"{spec.strategy} {spec.precision}: failed", highlight=False, markup=False
            )
            return
        held = ", ".join(f"rank {r.rank} {r.held / 2**20:.2f} MiB" for r in ranks)
        console.print(
            f"{spec.strategy} {spec.precision}: held {held}", highlight=False, markup=False
        )

    try:
        return distributed.run(specs, out / "ranks", done), False
    except distributed.Interrupted as stop:
        return stop.rows, True


class Terminated(BaseException):
    """SIGTERM arrived: raised where the run is, so that it stops as on Ctrl-C."""


# the shell's convention: 128 + the signal's number
_STOPPED_EXIT = {"Ctrl-C": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}


@contextlib.contextmanager
def _sigterm_stops() -> Iterator[None]:
    """While the configurations run, SIGTERM raises `Terminated` (the run then writes what
    it finished, as on Ctrl-C); the previous handler afterwards. Signals reach the main
    thread only, so elsewhere nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Terminated

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


class _Printer(Listener):
    """One line per configuration and per max-batch probe as it finishes (in a log as on a
    terminal, where the progress bar follows them)."""

    def __init__(self, console: Console, progress: Progress, task: TaskID, total: int) -> None:
        self.console, self.progress, self.task, self.total = console, progress, task, total

    def measured(self, row: Row, index: int, seconds: float) -> None:
        self.console.print(
            progress_line(row, index, self.total, seconds), highlight=False, markup=False
        )
        shown = "OOM" if row.result.status == OOM else row.result.status
        c = row.config
        self.progress.update(
            self.task, advance=1, description=f"{c.label} @ {c.batch_size}: {shown}"
        )

    def probed(self, name: str, batch: int, status: str) -> None:
        shown = {OK: "fits", OOM: "OOM"}.get(status, status)
        self.console.print(f"max batch {name}: {batch} {shown}", highlight=False, markup=False)
        self.progress.update(self.task, description=f"max batch {name}: {batch} {shown}")


def _busy_warning(p: Plan) -> str | None:
    """The pre-run busy-machine warning (`report.busy_machine_warning`) from the plan: the
    busy cores it sampled where it did, the options it runs with."""
    o = p.options
    load = [round(x, 2) for x in os.getloadavg()]
    given = [flag for flag, key in FRESH_PROCESS_OPTIONS if getattr(o, key)]
    return busy_machine_warning(
        load,
        o.threads or 1,
        p.device.type,
        paired=times_paired(p),
        rerun=rerun_for_verdict(given, o.max_batch, p.device.type),
        busy_cores=p.busy_cores,
    )


def _twin_failed(row: Row) -> bool:
    """Whether the raw torch.autocast twin of a configuration that ran failed, which fails
    the run as a configuration's failure does (out of memory is a result for it too)."""
    raw = row.result.raw
    return row.result.status == OK and raw is not None and raw.status not in (OK, OOM)


def _console(stderr: bool = False) -> Console:
    """`textout.console`, reading no emoji codes: user text (a path such as
    ``run:100:a/policy.json``, a label in the table) is printed as typed, and mixprec's own
    text has none."""
    made = textout.console(stderr=stderr)
    # (a file's console has a width of its own; a terminal's follows the terminal)
    width = {} if type(made) is Console else {"width": made.width}
    return type(made)(stderr=stderr, emoji=False, **width)


def _styled(head: str, style: str, rest: str = "") -> Text:
    """`head` in `style`, then `rest`, both as given: user text is not read as rich markup
    (escaping it doubled a trailing backslash)."""
    return Text.assemble((head, style), rest)


def run_command(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed `args`; returns the exit code."""
    console, err = _console(), _console(stderr=True)
    out = args.out
    if args.strategy is not None:
        return run_memory_command(args, console, err, out)
    if args.devices is not None:
        err.print("[red]mixprec bench: error:[/] --devices is an option of --strategy")
        return 2
    try:
        p = plan(_options(args))
        out = _output_dir(out, (*OUTPUT_FILES, JOURNAL))
    except ValueError as e:
        err.print(_styled("mixprec bench: error:", "red", f" {e}"), soft_wrap=True)
        return 2
    png = importlib.util.find_spec("matplotlib") is not None
    if not png:
        err.print(
            "matplotlib is not installed: bench.png will not be written "
            "(pip install 'matplotlib>=3.7' 'torch==2.13.0', the plot extra)"
        )
    o = p.options
    sizes = ", ".join(map(str, o.batch_sizes or []))
    console.print(
        _styled("mixprec bench", "bold", f": {o.model}, {', '.join(p.precisions)}, ")
        + f"batch {sizes} on {p.device}"
    )
    console.print(f"reproduce: {p.command}", highlight=False, soft_wrap=True, markup=False)
    if p.threads_note:
        err.print(_styled(p.threads_note, "yellow"), soft_wrap=True)
    busy = _busy_warning(p)
    if busy:
        err.print(_styled(busy, "yellow"), soft_wrap=True)

    journal, stopped_by = _run_configs(p, console, out)
    report = load_journal(journal.path)  # what is on disk, however the run ended
    if report is None:
        err.print(f"[red]mixprec bench: stopped by {stopped_by}[/] before the first configuration")
        return _STOPPED_EXIT[stopped_by or "Ctrl-C"]
    if stopped_by is not None:
        report.metadata["stopped"]["by"] = stopped_by
    summaries = summarize(report)
    # the busy-machine warning was given once, at the start
    _print_results(report, summaries, console, err, busy=busy is None)
    paths = [*write_outputs(out, report, png=png), journal.path]
    console.print(f"results: {', '.join(map(str, paths))}", highlight=False, markup=False)
    console.print(_styled(f"\n{conclusion(report, summaries)}", "bold"))
    stopped = stopped_line(report)
    if stopped_by is not None and stopped is not None:
        err.print(_styled(stopped, "yellow bold"), soft_wrap=True)
        return _STOPPED_EXIT[stopped_by]
    failed = (
        any(s.status not in (OK, OOM) for s in summaries)
        or any(_twin_failed(row) for row in report.rows)
        or any(found["error"] for found in report.max_batch.values())
    )
    return 1 if failed else 0
