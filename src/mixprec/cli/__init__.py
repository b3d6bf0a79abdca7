"""The `mixprec` command: argument parsing and printing only; the work lives in the library.

`main` parses and dispatches and `info` is here; each other subcommand has its module
(`mixprec.cli.bench`, `mixprec.cli.doctor`). `python -m mixprec.cli` runs `main`.
"""

from __future__ import annotations

import argparse
import os
import traceback

import torch
from rich.console import Console

from mixprec import textout
from mixprec.bench.report import ratio_places
from mixprec.cli.bench import add_parser as add_bench_parser
from mixprec.cli.doctor import add_parser as add_doctor_parser
from mixprec.device import DeviceInfo, detect, remeasure
from mixprec.errors import PrecisionError
from mixprec.formats.registry import formats
from mixprec.hardware import (
    FAST,
    REFUSED,
    SLOW,
    SLOW_BELOW,
    fast_on,
    policy_support,
    resolve_auto,
    support_matrix,
    times_text,
)
from mixprec.hardware.measuring import measure_notice, measure_rates
from mixprec.policy import Policy
from mixprec.textout import Column, FittedTable
from mixprec.version import __version__

__all__ = ["build_parser", "main"]

_STYLE = {FAST: "green", "supported": "yellow", SLOW: "red", REFUSED: "red bold"}


def _info(args: argparse.Namespace) -> int:
    console = textout.console()
    try:
        info = detect(args.device)
    except (PrecisionError, RuntimeError) as err:
        Console(stderr=True).print(f"[red]mixprec info: error:[/] {err}", highlight=False)
        return 2
    if args.measure and info.type == "cpu":
        info = remeasure()  # the ratings' own GEMMs too, replacing the cached ones
    console.print(f"[bold]mixprec {__version__}[/] · torch {torch.__version__}")
    console.print(f"device: {info.describe()}")
    table = FittedTable(
        "precision support on this device",
        [Column("precision", "left"), Column("status", "left"), Column("why", "left")],
    )
    for name, s in support_matrix(info).items():
        table.add_row([name, f"[{_STYLE[s.status]}]{s.status}[/]", s.reason])
    # the quantized formats whose speed depends on the device (int4 runs anywhere)
    for fmt in formats():
        if not fmt.info_row:
            continue
        name = f"{fmt.name}_from_float32"
        s = policy_support(name, info)
        table.add_row([name, f"[{_STYLE[s.status]}]{s.status}[/]", s.reason])
    console.print(table)
    if info.type == "cpu":
        console.print(_ratings_source(info), highlight=False)
    console.print(f'"auto" resolves to: [bold]{resolve_auto(info).name}[/]')
    slow = {
        Policy(name).compute_dtype
        for name, s in support_matrix(info).items()
        if s.status in (SLOW, REFUSED)
    }
    for dtype in sorted(slow, key=str):
        where = fast_on(dtype)
        if where:
            name = str(dtype).removeprefix("torch.")
            console.print(f"{name} would be fast on: {where}", highlight=False)
    console.print(_STRATEGIES, highlight=False)
    console.print(_GLOSSARY, style="dim", highlight=False)
    if args.measure:
        rates = measure_rates(device=info.device, seconds=args.seconds, repeats=args.repeats)
        t = FittedTable(
            "matmul throughput, measured now (median of the rounds; vs float32: the lower "
            "quartile of the paired rounds' ratios, and their spread)",
            [
                Column("dtype", "left"),
                Column("GFLOP/s", "right"),
                Column("rounds: min-max", "right", keep=1),
                Column("matrix", "right", keep=0),
                Column("vs float32", "right"),
                Column("spread", "right", keep=2),
            ],
        )
        for dtype, r in rates.items():
            t.add_row(
                [
                    dtype,
                    f"{r.median:,.1f}",
                    f"{r.low:,.1f}-{r.high:,.1f}",
                    f"{r.size}^2",
                    _relative(r.ratio),
                    f"{r.ratio_spread:.2f}x" if r.ratio is not None else "-",
                ]
            )
        console.print(t)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        notice = measure_notice(rates, info, load, seconds=args.seconds)
        if notice:
            console.print(f"[yellow]{notice}[/]", highlight=False)
    return 0


def _ratings_source(info: DeviceInfo) -> str:
    """Where a CPU's bfloat16 and float16 ratings come from: measured GEMMs or flags alone."""
    if not info.gemm_ratios:
        why = info.gemm_note or "no GEMM speed measured"
        return f"bfloat16 and float16 rated by this CPU's flags alone ({why})"
    ratios = ", ".join(f"{name} {times_text(r)}" for name, r in sorted(info.gemm_ratios.items()))
    return (
        f"bfloat16 and float16 rated by their GEMM (matrix multiply, most of a training "
        f"step's work) speed against float32 ({ratios}; below "
        f"{SLOW_BELOW}x is slow): {info.gemm_note or 'as described'}"
    )


_GLOSSARY = (
    "words used here (GEMM, VNNI, amax, float32 island, 16-mixed, int8_from_float32, ...) are "
    "explained in docs/glossary.md"
)

_STRATEGIES = (
    "several processes: Trainer(strategy='ddp') while the model, its gradients and optimizer "
    "state fit one device (each process holds all of them; one all-reduce per step); "
    "strategy='fsdp' when they do not (each of N processes holds 1/N of them, plus one unit's "
    "gathered parameters at a time; an all-gather per unit in forward and backward). Memory "
    "per rank, measured: mixprec bench --strategy fsdp --devices 2"
)


def _relative(ratio: float | None) -> str:
    """A speed against float32's: "1.00x", "3.10x", or "0.0081x (124x slower)"; more
    decimals where two would print a ratio that is not 1 as one, as the bench's cells."""
    if not ratio:
        return "-"
    if ratio >= 0.5:
        return f"{ratio:.{ratio_places(ratio)}f}x"
    return f"{ratio:.2g}x ({1 / ratio:,.0f}x slower)"


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixprec",
        description="Mixed-precision training tools for PyTorch. Exit status: 0 success; 1 the "
        "run did not pass (doctor: the target precision fails its tolerance; bench: a "
        "configuration, its raw torch.autocast twin or a max-batch probe failed); 2 bad "
        "arguments; 3 an error stopped the command (traceback on stderr).",
    )
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="this device and which precisions are fast on it")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: best)")
    p.add_argument("--measure", action="store_true", help="also measure matmul GFLOP/s")
    p.add_argument(
        "--seconds",
        type=_positive,
        default=None,
        help="with --measure: measuring time per dtype (0.5), up to 3x while the paired "
        "rounds disagree",
    )
    p.add_argument(
        "--repeats",
        type=_at_least_one,
        default=None,
        help="with --measure: rounds at least (5), up to 3x while they disagree; the median "
        "is shown, with their range",
    )
    p.set_defaults(func=_info)
    add_bench_parser(sub)
    add_doctor_parser(sub)
    return parser


ERROR_EXIT = 3  # 1 is the commands' own "it did not pass", 2 bad arguments (argparse's too)


def main(argv: list[str] | None = None) -> int:
    """Run `mixprec` with `argv`; returns the exit status. An exception that escapes a command
    prints its traceback and one line naming it on stderr, and exits with 3."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "info":
        if not args.measure and (args.seconds is not None or args.repeats is not None):
            parser.error("info: --seconds and --repeats set how --measure measures; add --measure")
        args.seconds = 0.5 if args.seconds is None else args.seconds
        args.repeats = 5 if args.repeats is None else args.repeats
    try:
        return args.func(args)
    except Exception as err:  # noqa: BLE001 - any failure gets its own exit status
        traceback.print_exc()
        message = f"mixprec {args.command}: stopped by an error: {type(err).__name__}: {err}"
        Console(stderr=True, soft_wrap=True).print(message, markup=False, highlight=False)
        return ERROR_EXIT
