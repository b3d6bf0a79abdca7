"""Where a low-bit optimizer step goes on the small MLP of `states_step.py`: the step, the
step with its compiled update stood in by a call that does nothing (the step's own Python,
copies and the float32 biases' fused step), the compiled update alone (dynamo's call and the
kernel), and the update built with each format's nearest-code computation stood in by a
trivial one (``floor(y * 127) + 128``: what the nearest code costs in the kernel; a build of
its own, run in a fresh process so that the real build is untouched).

CPU time of the stepping thread, one thread; each figure the median of ``--steps`` calls,
the parts taking turns (`rounds` of each). Results differ with a neighbour's load: compare
figures of one run.

    python benchmarks/states_step_parts.py [--optimizer AdamW8bit] [--steps 400] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

from mixprec.optim.states import AdamW4bit, AdamW8bit, AdamWFp8, codecs, kernels

_OPTIMIZERS = {"AdamW8bit": AdamW8bit, "AdamW4bit": AdamW4bit, "AdamWFp8": AdamWFp8}


def _median_us(call, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.thread_time_ns()
        call()
        times.append(time.thread_time_ns() - start)
    return statistics.median(times) / 1e3


def _parts(name: str, steps: int, rounds: int, trivial: bool) -> dict[str, float]:
    """The parts' median times (us) of ``name`` on the small MLP; with ``trivial`` the
    update alone, built with a trivial nearest code."""
    if trivial:
        for codec in (codecs.Int8Codec, codecs.Int4Codec):
            codec.nearest = lambda self, y, signed: (
                torch.floor(y * 127.0) + (128.0 if signed else 0.0)
            )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 32))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = _OPTIMIZERS[name](model.parameters(), lr=1e-3)
    real = kernels.run_compiled
    seen: list[tuple] = []

    def recorded(algorithm: str, args: tuple) -> None:
        seen[:] = [(algorithm, args)]
        return real(algorithm, args)

    kernels.run_compiled = recorded
    for _ in range(5):
        opt.step()
    kernels.run_compiled = real
    if not seen:
        raise SystemExit(f"{name}: the step ran no compiled update (compile=None chose eager)")
    algorithm, args = seen[0]
    found: dict[str, list[float]] = {"step": [], "step without update": [], "update alone": []}
    for _ in range(rounds):
        if not trivial:
            found["step"].append(_median_us(opt.step, steps))
            kernels.run_compiled = lambda algorithm, args: None
            found["step without update"].append(_median_us(opt.step, steps))
            kernels.run_compiled = real
        found["update alone"].append(_median_us(lambda: real(algorithm, args), steps))
    return {k: statistics.median(v) for k, v in found.items() if v}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", default="AdamW8bit", choices=sorted(_OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trivial-nearest", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trivial_nearest:
        print(json.dumps(_parts(args.optimizer, args.steps, args.rounds, trivial=True)))
        return
    found = _parts(args.optimizer, args.steps, args.rounds, trivial=False)
    child = subprocess.run(
        [sys.executable, __file__, "--optimizer", args.optimizer, "--steps", str(args.steps),
         "--rounds", str(args.rounds), "--trivial-nearest"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    trivial = json.loads(child.stdout.splitlines()[-1])["update alone"]
    print(f"{args.optimizer} on the small MLP, one thread, median us of {args.steps} calls:")
    print("| part | us |\n|---|---:|")
    for part, us in found.items():
        print(f"| {part} | {us:.0f} |")
    print(f"| update alone, nearest code trivial (a fresh process) | {trivial:.0f} |")
    print(
        f"| the nearest code in the update (difference) | {found['update alone'] - trivial:.0f} |"
    )


if __name__ == "__main__":
    main()
