"""Microscaling formats on examples/charlm.py: held-out loss of MX training against the float
run, and NVFP4 inference of the float-trained model.

Training: for each format F given (``--train``), a run with the same seed, data order and
steps as the float precision P's run, every Linear of the blocks swapped for a
`MicroscalingLinear` in F (the output head, tied to the embedding, stays in P, as the
published MXFP8 and NVFP4 recipes keep it). Inference: the float run's trained model, its
block Linears swapped for each format of ``--infer``, validated on the same held-out batches.
Every block-scaled matmul is emulated (quantize, dequantize, float32 matmul): this measures
the formats' numerics, not their speed.

    PYTHONPATH=src python benchmarks/microscaling_charlm.py --width 64 --steps 300 \\
        --batch-size 16 --val-batches 10 --precision bf16-mixed \\
        --train mxfp8,mxfp8/floor --infer nvfp4,nvfp4/fwd-rht,mxfp8

On a shared CPU set OMP_NUM_THREADS=1 (and run formats side by side with --no-float): two
threads per process under load made these runs 5-10x slower. Results:
benchmarks/results/microscaling.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from charlm import CharGPT, charlm_loaders, median_rate  # noqa: E402

from mixprec.hardware import detect  # noqa: E402
from mixprec.quantize.microscaling import MicroscalingLinear  # noqa: E402
from mixprec.quantize.rules import swap_modules  # noqa: E402
from mixprec.trainer import Trainer  # noqa: E402

BLOCK = 128


def to_format(model: nn.Module, fmt: str) -> nn.Module:
    """`model` with every Linear but the tied head swapped for a MicroscalingLinear."""
    swap_modules(
        model,
        lambda path, m: (
            MicroscalingLinear.from_float(m, fmt)
            if type(m) is nn.Linear and path != "head"
            else None
        ),
    )
    return model


def validate(model: nn.Module, precision: str, val: object, args: argparse.Namespace) -> float:
    trainer = Trainer(
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=args.val_batches,
        allow_slow_precision=True,
        enable_progress_bar=False,
    )
    return trainer.validate(model, val)[0]["val_loss"]


def train(fmt: str | None, args: argparse.Namespace) -> tuple[dict[str, object], nn.Module]:
    """One training run; `fmt` is a microscaling format or None for the float run."""
    torch.manual_seed(args.seed)
    train_data, val = charlm_loaders(BLOCK, args.batch_size)
    model = CharGPT(block=BLOCK, dim=args.width, steps=args.steps)
    if fmt is not None:
        to_format(model, fmt)
    trainer = Trainer(
        precision=args.precision,
        max_steps=args.steps,
        val_check_interval=min(len(train_data), args.steps),
        limit_val_batches=args.val_batches,
        default_root_dir=args.root,
        seed=args.seed,
        enable_progress_bar=False,
        allow_slow_precision=True,
    )
    start = time.perf_counter()
    trainer.fit(model, train_data, val)
    seconds = time.perf_counter() - start
    row = {
        "precision": args.precision,
        "format": fmt or "-",
        "use": "training",
        "steps": trainer.global_step,
        "val_loss": round(validate(model, args.precision, val, args), 4),
        "fit_seconds": round(seconds, 1),
        "median_ms_per_step": round(1000 * args.batch_size / median_rate(trainer), 1),
    }
    return row, model


def table(rows: list[dict[str, object]]) -> str:
    """Markdown rows, each against the float run's held-out loss."""
    base = next(r for r in rows if r["format"] == "-")
    lines = [
        "| format | used for | val loss (nats/byte) | vs float run | median ms/step |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        diff = "" if r is base else f"{100 * (r['val_loss'] / base['val_loss'] - 1):+.2f}%"
        ms = r.get("median_ms_per_step", "")
        fmt = r["format"] if r is not base else f"{r['precision']} (float)"
        lines.append(f"| {fmt} | {r['use']} | {r['val_loss']} | {diff} | {ms} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--train", default="mxfp8,mxfp8/floor", help="comma-separated formats")
    parser.add_argument("--infer", default="nvfp4,nvfp4/fwd-rht", help="comma-separated formats")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--val-batches", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default="runs/microscaling_charlm")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument(
        "--no-float",
        action="store_true",
        help="only the --train runs (another process runs the float one, and --infer)",
    )
    args = parser.parse_args()
    rows = []
    for fmt in filter(None, args.train.split(",")) if args.no_float else ():
        rows.append(train(fmt, args)[0])
        print(json.dumps(rows[-1]), flush=True)
    if args.no_float:
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2) + "\n")
        return
    base, model = train(None, args)
    rows.append(base)
    print(json.dumps(base), flush=True)
    _, val = charlm_loaders(BLOCK, args.batch_size)
    for fmt in filter(None, args.infer.split(",")):
        quantized = to_format(copy.deepcopy(model), fmt)
        loss = validate(quantized, args.precision, val, args)
        rows.append(
            {
                "precision": args.precision,
                "format": fmt,
                "use": "inference",
                "val_loss": round(loss, 4),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    for fmt in filter(None, args.train.split(",")):
        rows.append(train(fmt, args)[0])
        print(json.dumps(rows[-1]), flush=True)
    print(
        f"host: {detect('cpu').describe()}; torch {torch.__version__}; "
        f"python {platform.python_version()}"
    )
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
