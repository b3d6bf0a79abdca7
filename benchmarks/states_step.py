"""Low-bit optimizer states: state bytes and optimizer-step time against torch's AdamW.

A ~4.2M-parameter MLP (three 1024x1024 Linear layers and a 1024x1000 head) gets gradients
once; then torch's ``AdamW(foreach=True)`` and mixprec's ``LowBitAdamW`` in each state
format (compiled, ``compile=True``) take turns stepping, after two warm-up steps that
include the first call's build. Each step is timed in CPU time of the stepping thread on
one thread (``torch.set_num_threads(1)``), which waiting on a busy host does not inflate;
the table gives the fastest and the median of ``--steps`` steps and the state bytes
(`mixprec.states.state_bytes`, scales included) against torch's.

    python benchmarks/states_step.py [--steps 15] [--formats float32 int8 int4 fp8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from mixprec.states import LowBitAdamW, state_bytes


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 1000)
    )


def _optimizer(kind: str) -> torch.optim.Optimizer:
    model = _model()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), foreach=True)
    return LowBitAdamW(model.parameters(), states=kind, compile=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--formats", nargs="+", default=["float32", "int8", "int4", "fp8"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    kinds = ["torch", *args.formats]
    optimizers = {k: _optimizer(k) for k in kinds}
    for opt in optimizers.values():
        opt.step()
        opt.step()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.steps):
        for kind, opt in optimizers.items():
            start = time.thread_time()
            opt.step()
            times[kind].append(time.thread_time() - start)
    params = sum(p.numel() for g in optimizers["torch"].param_groups for p in g["params"])
    base_time = statistics.median(times["torch"])
    base_bytes = state_bytes(optimizers["torch"])
    print(f"{params} parameters, {args.steps} steps, one thread, CPU time of the step\n")
    print("| optimizer | fastest ms | median ms | x torch | state bytes | x torch |")
    print("|---|---|---|---|---|---|")
    for kind, opt in optimizers.items():
        name = "torch AdamW(foreach=True)" if kind == "torch" else f"LowBitAdamW({kind!r})"
        median = statistics.median(times[kind])
        size = state_bytes(opt)
        print(
            f"| {name} | {1000 * min(times[kind]):.1f} | {1000 * median:.1f} | "
            f"{median / base_time:.2f} | {size} | {size / base_bytes:.3f} |"
        )


if __name__ == "__main__":
    main()
