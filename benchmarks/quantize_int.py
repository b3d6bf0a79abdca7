"""int8 and int4 quantization of the char LM (examples/charlm.py): held-out loss, weight bytes
and CPU forward latency against the float32 model it came from, in one run.

Trains CharGPT in float32 with the Trainer, then quantizes copies with
`mixprec.quantize(model, "int8")` / `"int4"` (tied embedding and head share one quantized
copy) and evaluates all three on the same held-out batches. Latency: forwards of the float32
and int8 models (and one large Linear of each kind) alternate, median of the repeats.

    python benchmarks/quantize_int.py [--steps 300] [--width 128] [--out PATH.md]
"""

from __future__ import annotations

import argparse
import collections
import copy
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.hardware import detect
from mixprec.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from charlm import CharGPT, charlm_loaders  # noqa: E402

BLOCK = 128


@torch.no_grad()
def held_out_loss(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy (nats per byte) over `batches`."""
    model.eval()
    total = sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in batches)
    return total / len(batches)


@torch.no_grad()
def alternate(fns: dict[str, object], repeats: int) -> dict[str, float]:
    """Median ms per call of each function, the functions called in turn `repeats` times."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _skips(skipped: dict[str, str]) -> str:
    """'9 LayerNorm (unsupported type ...)': skipped layers counted by reason."""
    counts = collections.Counter(skipped.values())
    return "; ".join(f"{n} layer(s): {why}" for why, n in counts.items()) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--val-batches", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quantize_int.md"))
    args = parser.parse_args()

    torch.manual_seed(0)
    train, val = charlm_loaders(BLOCK, args.batch_size)
    model = CharGPT(block=BLOCK, dim=args.width, steps=args.steps)
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        Trainer(
            precision="32-true",
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            default_root_dir=root,
            seed=0,
        ).fit(model, train)
        fit_seconds = time.perf_counter() - start
    batches = [b for _, b in zip(range(args.val_batches), val, strict=False)]

    models = {"float32": model}
    notes = {}
    for mode in ("int8", "int4"):
        models[mode] = copy.deepcopy(model)
        notes[mode] = mixprec.quantize(models[mode], mode)
    losses = {name: held_out_loss(m, batches) for name, m in models.items()}
    sizes = {name: mixprec.quantize.weight_bytes(m) for name, m in models.items()}

    x = batches[0][0][:2]
    latency = alternate(
        {name: (lambda m=m: m(x)) for name, m in models.items() if name != "int4"}, args.repeats
    )
    big = nn.Linear(1024, 1024)
    big_int8 = nn.Sequential(copy.deepcopy(big))
    mixprec.quantize(big_int8, "int8")
    tokens = torch.randn(128, 1024)
    linear = alternate(
        {"float32": lambda: big(tokens), "int8": lambda: big_int8(tokens)}, args.repeats
    )

    base = losses["float32"]
    rows = [
        f"| {name} | {loss:.4f} | {(loss / base - 1) * 100:+.2f}% | {loss / math.log(2):.4f} | "
        f"{sizes[name]:,} | {sizes['float32'] / sizes[name]:.2f}x |"
        for name, loss in losses.items()
    ]
    command = "python benchmarks/quantize_int.py " + " ".join(sys.argv[1:])
    text = "\n".join(
        [
            "# int8 and int4 quantization of the char LM",
            "",
            f"Command: `{command.strip()}`",
            f"Device: {detect('cpu').describe()}; torch {torch.__version__}",
            "",
            f"CharGPT width {args.width}, 4 blocks, block {BLOCK}, trained {args.steps} steps "
            f"in float32 (batch {args.batch_size}, {fit_seconds:.0f} s); held-out loss over "
            f"the first {len(batches)} validation batches. `mixprec.quantize(model, mode)` "
            "with defaults (int4: groups of 128); the embedding and the tied head share one "
            "quantized copy.",
            "",
            "| model | held-out loss (nats/byte) | vs float32 | bits/byte | weight bytes "
            "| smaller |",
            "|---|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "Weight bytes: every parameter and buffer (LayerNorms and biases stay float32), each "
            "storage once.",
            "",
            *(f"Skipped by {mode}: {_skips(notes[mode].skipped)}." for mode in ("int8", "int4")),
            "",
            "## CPU forward latency, float32 vs int8 (side by side, median of "
            f"{args.repeats} alternating calls)",
            "",
            "| what | float32 ms | int8 ms | int8 / float32 |",
            "|---|---:|---:|---:|",
            f"| CharGPT forward, 2 x {BLOCK} bytes | {latency['float32']:.2f} | "
            f"{latency['int8']:.2f} | {latency['int8'] / latency['float32']:.2f}x |",
            f"| one Linear 1024 -> 1024, 128 tokens | {linear['float32']:.2f} | "
            f"{linear['int8']:.2f} | {linear['int8'] / linear['float32']:.2f}x |",
            "",
            "int8 quantizes the activations per token at run time and multiplies int8 x int8 -> "
            f"int32 with the kernel the layer names here: {big_int8[0].kernel}; the latency is "
            "what this CPU's kernels give, not a promise for others.",
            "",
        ]
    )
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
