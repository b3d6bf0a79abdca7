"""Float8 training of examples/charlm.py: held-out loss and step time against the float run.

For each float precision P given, two runs with the same seed, data order and steps: P
itself, and "float8 from P" (every Linear of the blocks swapped for a tensorwise
`Float8Linear`; the output head, tied to the embedding, stays in P: the logits layer is the
one most often kept out of float8). The model is far below torchao's size rule, so
`skip_small=False`: this measures float8's numerics, not its speed (on a CPU it is emulated
and slower).

    PYTHONPATH=src python benchmarks/float8_charlm.py --width 64 --steps 150 --batch-size 16 \\
        --val-batches 10 --precisions 32-true,bf16-mixed
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from charlm import CharGPT, charlm_loaders, median_rate  # noqa: E402

from mixprec.hardware import detect  # noqa: E402
from mixprec.quantize.float8 import convert_to_float8  # noqa: E402
from mixprec.trainer import Trainer  # noqa: E402

BLOCK = 128


def run(precision: str, float8: str | None, args: argparse.Namespace) -> dict[str, object]:
    """One training run; `float8` is a recipe or None for the plain float run."""
    torch.manual_seed(args.seed)
    train, val = charlm_loaders(BLOCK, args.batch_size)
    model = CharGPT(block=BLOCK, dim=args.width, steps=args.steps)
    skipped: dict[str, str] = {}
    if float8 is not None:
        model = convert_to_float8(
            model,
            recipe=float8,
            skip_small=False,
            filter=lambda path, m: path != "head",
            skipped=skipped,
        )
    common = {"limit_val_batches": args.val_batches, "allow_slow_precision": True}
    trainer = Trainer(
        precision=precision,
        max_steps=args.steps,
        val_check_interval=min(len(train), args.steps),
        default_root_dir=args.root,
        seed=args.seed,
        enable_progress_bar=False,
        **common,
    )
    start = time.perf_counter()
    trainer.fit(model, train, val)
    seconds = time.perf_counter() - start
    final = Trainer(
        precision=precision, logger=False, enable_checkpointing=False, **common
    ).validate(model, val)[0]
    return {
        "precision": precision,
        "float8": float8 or "-",
        "steps": trainer.global_step,
        "val_loss": round(final["val_loss"], 4),
        "fit_seconds": round(seconds, 1),
        "median_ms_per_step": round(1000 * args.batch_size / median_rate(trainer), 1),
        "skipped": skipped,
    }


def table(results: list[dict[str, object]]) -> str:
    """Markdown rows: each float8 run beside its float baseline."""
    rows = [
        "| precision | float8 | val loss | vs float run | median ms/step | vs float run |",
        "|---|---|---|---|---|---|",
    ]
    base = {r["precision"]: r for r in results if r["float8"] == "-"}
    for r in results:
        b = base[r["precision"]]
        loss = f"{100 * (r['val_loss'] / b['val_loss'] - 1):+.2f}%"
        speed = f"{r['median_ms_per_step'] / b['median_ms_per_step']:.2f}x"
        rows.append(
            f"| {r['precision']} | {r['float8']} | {r['val_loss']} | {loss} | "
            f"{r['median_ms_per_step']} | {speed} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default="bf16-mixed", help="comma-separated")
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--val-batches", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default="runs/float8_charlm")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()
    results = []
    for precision in args.precisions.split(","):
        for float8 in (None, args.recipe):
            results.append(run(precision, float8, args))
            print(json.dumps(results[-1]), flush=True)
    print(
        f"host: {detect('cpu').describe()}; torch {torch.__version__}; "
        f"python {platform.python_version()}"
    )
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
