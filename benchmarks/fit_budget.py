"""`mixprec doctor --fit` on the char LM (examples/charlm.py's model, random weights) under
two memory budgets set from a first measurement: fractions of the peak of one training step
with every activation kept. For each budget the report gives every plan measured (peak in a
fresh process against the budget, the bytes the search counted, the loss after two AdamW
steps), the plan written and its activation options; results in
benchmarks/results/fit_budget.md.

    PYTHONPATH=src python benchmarks/fit_budget.py --fractions 0.8,0.6

The factory (`make`) is what ``mixprec doctor benchmarks/fit_budget.py:make --fit SIZE``
calls, here and in each fresh process.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from charlm import CharGPT, charlm_loaders  # noqa: E402

from mixprec.cli import main as cli  # noqa: E402
from mixprec.plan.fitting import step_peaks  # noqa: E402
from mixprec.policy.map import PolicyMap  # noqa: E402

BLOCK, DIM, LAYERS, BATCH = 128, 128, 4, 32
FLAGS = ["--baseline", "32-true", "--formats", "32-true,int8_from_32-true"]


def make() -> dict:
    """The char LM and one training batch, the same on every call (seeded)."""
    torch.manual_seed(0)
    train, _ = charlm_loaders(BLOCK, BATCH)
    batch = next(iter(train))
    return {"model": CharGPT(block=BLOCK, dim=DIM, layers=LAYERS), "batches": [batch]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fractions", default="0.8,0.6")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/fit_budget.md"))
    args = parser.parse_args()
    made = make()
    every = r"blocks\.\d+|ln|head"
    keep, recomputed = step_peaks(
        made["model"],
        made["batches"][0],
        None,
        [
            PolicyMap("32-true", activations={every: "keep"}),
            PolicyMap("32-true", activations={every: "checkpoint"}),
        ],
    )
    lines = [
        "# `mixprec doctor --fit` on the char LM",
        "",
        f"Command: `PYTHONPATH=src python benchmarks/fit_budget.py --fractions {args.fractions}`",
        "",
        f"Model: examples/charlm.py's CharGPT (dim {DIM}, {LAYERS} blocks, context {BLOCK}, "
        f"random weights), batch {BATCH}; baseline 32-true, formats 32-true and "
        "int8_from_32-true (the same numerics on every CPU). A first measurement in this "
        f"process: one training step's peak with every activation kept {keep.bytes} bytes, "
        f"with every block recomputed {recomputed.bytes} bytes. Each budget is a fraction of "
        "the first. Peaks: parameters and buffers plus the tensor peak of AdamW built and two "
        "training steps, measured in a fresh process; loss: on the batch after those steps.",
        "",
    ]
    for fraction in (float(f) for f in args.fractions.split(",")):
        budget = int(keep.bytes * fraction)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "plan"
            command = ["doctor", f"{__file__}:make", "--fit", f"{budget}B", *FLAGS]
            printed = io.StringIO()
            started = time.perf_counter()
            with contextlib.redirect_stdout(printed):
                status = cli([*command, "--out", str(out)])
            seconds = time.perf_counter() - started
            policy = (out / "policy.json").read_text() if status == 0 else "(none fits)"
        shown = " ".join(["mixprec", *command]).replace(str(ROOT) + "/", "")
        lines += [
            f"## Budget {fraction:g} of the all-keep peak: {budget} bytes",
            "",
            f"`{shown}` (exit status {status}, {seconds:.0f} s on a shared 2-core machine)",
            "",
            "```",
            printed.getvalue().strip(),
            "```",
            "",
            "policy.json:",
            "",
            "```json",
            policy.strip(),
            "```",
            "",
        ]
        print(f"budget {fraction:g}: exit {status}, {seconds:.0f} s", flush=True)
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
