"""How stable the GEMM ratio that rates a CPU's bfloat16 and float16 is, measured as mixprec
measures it (`mixprec.device.gemm_ratio.measure`: one thread) and, beside it, the same
measurement at torch's thread count, the two taking turns, each run of each recorded with
the 1-minute load average before it. On a host whose cores other processes share, a
multi-threaded float32 GEMM waits for its slowest thread while torch's one-thread 16-bit
path does not, which is why the rating measures on one thread::

    python benchmarks/gemm_ratio_stability.py [--runs 8] [--out PATH.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from mixprec.device import gemm_ratio


def _at_threads(threads: int) -> gemm_ratio.GemmRatios:
    """`gemm_ratio.measure`'s work at `threads` threads instead of one."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return gemm_ratio._measure(gemm_ratio.DTYPES)
    finally:
        torch.set_num_threads(before)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    threads = torch.get_num_threads()
    rows = []
    for run in range(args.runs):
        for label, fn in (
            ("one thread (mixprec's)", gemm_ratio.measure),
            (f"{threads} threads", lambda: _at_threads(threads)),
        ):
            load = os.getloadavg()[0]
            m = fn()
            rows.append((run, label, load, m))
    lines = [
        "# GEMM ratio stability: one thread against torch's thread count",
        "",
        f"`python {' '.join(sys.argv)}` on {os.cpu_count()} cores, torch {torch.__version__}, "
        f"torch threads {threads}; {gemm_ratio.SIZE}x{gemm_ratio.SIZE} GEMMs, the fastest "
        "multiply of each dtype over interleaved rounds; ratio = float32 time / dtype time.",
        "",
        "| run | measured at | load (1 min) | bfloat16 | float16 | float32 rounds spread |",
        "|---|---|---|---|---|---|",
    ]
    for run, label, load, m in rows:
        lines.append(
            f"| {run} | {label} | {load:.2f} | {m.ratios['bfloat16']:.3g}x | "
            f"{m.ratios['float16']:.3g}x | {m.spread['float32']:.1f}x |"
        )
    lines += ["", "| measured at | bfloat16 min-max | float16 min-max | median bfloat16 |"]
    lines.append("|---|---|---|---|")
    for label in dict.fromkeys(label for _, label, _, _ in rows):
        bf = [m.ratios["bfloat16"] for _, lab, _, m in rows if lab == label]
        fp = [m.ratios["float16"] for _, lab, _, m in rows if lab == label]
        lines.append(
            f"| {label} | {min(bf):.3g}-{max(bf):.3g}x | {min(fp):.3g}-{max(fp):.3g}x | "
            f"{statistics.median(bf):.3g}x |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
