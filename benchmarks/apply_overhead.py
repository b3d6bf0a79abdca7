"""Cost of `mixprec.apply`'s wrappers: an applied bf16-mixed model vs the same model inside a
hand-written `torch.autocast` region, interleaved step by step in one run (this machine is
noisy, so only side-by-side ratios mean anything).

    python benchmarks/apply_overhead.py [--steps 60] [--out benchmarks/results/apply_overhead.md]
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time

import torch
from torch import nn

import mixprec


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 10)
    )


def mlp_norm() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1024, 2048),
        nn.LayerNorm(2048),
        nn.GELU(),
        nn.Linear(2048, 2048),
        nn.LayerNorm(2048),
        nn.GELU(),
        nn.Linear(2048, 10),
    )


def time_pair(make, islands: bool, steps: int, warmup: int, batch: int) -> tuple[float, float]:
    """Median ms/step of (raw autocast, mixprec.apply), alternating every step."""
    torch.manual_seed(0)
    raw = make()
    ours = mixprec.apply(
        copy.deepcopy(raw), mixprec.PolicyMap("bf16-mixed", float32_islands=islands)
    )
    x = torch.randn(batch, 1024)
    y = torch.randint(0, 10, (batch,))
    loss_fn = nn.CrossEntropyLoss()
    opt_raw = torch.optim.SGD(raw.parameters(), lr=1e-3)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=1e-3)

    def step_raw() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = raw(x)
        loss_fn(out.float(), y).backward()
        opt_raw.step()
        opt_raw.zero_grad(set_to_none=True)

    def step_ours() -> None:
        loss_fn(ours(x), y).backward()
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"raw": [], "ours": []}
    gc.disable()
    try:
        for i in range(warmup + steps):
            order = [("raw", step_raw), ("ours", step_ours)]
            if i % 2:
                order.reverse()
            for name, fn in order:
                t0 = time.perf_counter()
                fn()
                if i >= warmup:
                    times[name].append((time.perf_counter() - t0) * 1e3)
    finally:
        gc.enable()
    return statistics.median(times["raw"]), statistics.median(times["ours"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--out", default=None, help="write a markdown result file here")
    args = parser.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    rows = []
    for label, make, islands in (
        ("MLP 1024-2048-2048-10 (no norms)", mlp, True),
        ("MLP with 2 LayerNorms, islands off", mlp_norm, False),
        ("MLP with 2 LayerNorms, float32 islands (default)", mlp_norm, True),
    ):
        raw, ours = time_pair(make, islands, args.steps, args.warmup, args.batch)
        rows.append((label, raw, ours, ours / raw - 1))
    lines = [
        "# apply() overhead: bf16-mixed via mixprec.apply vs hand-written torch.autocast",
        "",
        f"Command: `python benchmarks/apply_overhead.py --steps {args.steps} --warmup "
        f"{args.warmup} --batch {args.batch}`",
        f"Device: {mixprec.hardware.detect('cpu').describe()}; torch {torch.__version__}",
        "",
        "| model | raw autocast ms/step | mixprec.apply ms/step | overhead |",
        "|---|---:|---:|---:|",
        *(f"| {label} | {raw:.2f} | {ours:.2f} | {ovh:+.1%} |" for label, raw, ours, ovh in rows),
        "",
        "Step = forward + cross-entropy + backward + SGD step, batch "
        f"{args.batch}; median of {args.steps} steps, the two variants alternating every step.",
        "The last row is not like for like: the islands run LayerNorm in float32 (more "
        "accurate), which raw CPU autocast keeps in bfloat16.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
