"""What a `diagnose` costs, against one training step in each of the two precisions it
compares (float32 and 16-mixed), measured side by side in one run.

Models: the doctor example (examples/doctor_demo.py) at its default size and at a toy size
where fixed per-module costs dominate, and two of `mixprec bench`'s workloads (the
transformer LM at batch 4, the MLP at batch 64). A training step is zero_grad + forward +
loss + scaled backward + Adam step through `Precision`; a diagnosis is
`diagnose(model, batch, loss_fn)` (two probed forward/backward passes, copies of the model,
statistics), and `recommend()` is timed too where there is something to fix. Each figure
is the median of `--repeats` runs after a warm-up, the variants interleaved.

The clock is this process's CPU time with one intra-op thread by default (`--clock cpu
--threads 1`): on a shared machine, wall time mostly measures the neighbours. `--clock wall`
measures wall time instead.

    python benchmarks/doctor_cost.py [--repeats 9] [--clock cpu|wall] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.bench.models import load_workload
from mixprec.doctor import diagnose
from mixprec.hardware import detect
from mixprec.precision import Precision

ROOT = Path(__file__).resolve().parent.parent


def demo(batch_size: int, steps: int) -> Callable[[], tuple[nn.Module, Any, Any, str]]:
    def build() -> tuple[nn.Module, Any, Any, str]:
        sys.path.insert(0, str(ROOT / "examples"))
        from doctor_demo import make

        model, batch, loss_fn = make(batch_size, steps)
        label = f"doctor example SensorNet, {batch_size} x {steps} readings (2 planted faults)"
        return model, batch, loss_fn, label

    return build


def bench_model(name: str, batch_size: int) -> Callable[[], tuple[nn.Module, Any, Any, str]]:
    def build() -> tuple[nn.Module, Any, Any, str]:
        w = load_workload(name)
        return w.model, w.make_batch(batch_size), w.loss_fn, f"{w.description}, batch {batch_size}"

    return build


CLOCK: Callable[[], float] = time.process_time


def step_timer(model: nn.Module, batch: Any, loss_fn: Any, spec: str) -> Callable[[], float]:
    """A function running one training step of a copy of `model` in `spec`; returns seconds."""
    net = copy.deepcopy(model)
    precision = Precision(spec, allow_slow=True)
    net, opt = precision.setup(net, torch.optim.Adam(net.parameters(), lr=1e-4))
    x, y = batch

    def one() -> float:
        t0 = CLOCK()
        opt.zero_grad()
        precision.backward(loss_fn(net(x), y))
        precision.step(opt)
        return CLOCK() - t0

    return one


def timed(fn: Callable[[], Any]) -> float:
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def measure(build: Callable[[], tuple[nn.Module, Any, Any, str]], repeats: int) -> dict[str, Any]:
    model, batch, loss_fn, label = build()
    step32 = step_timer(model, batch, loss_fn, "32-true")
    step16 = step_timer(model, batch, loss_fn, "16-mixed")
    diag = lambda: diagnose(model, batch, loss_fn, precision="16-mixed")  # noqa: E731
    for fn in (step32, step16, step32, step16, diag):  # warm-up
        fn()
    t32, t16, td = [], [], []
    for _ in range(repeats):
        t32.append(step32())
        t16.append(step16())
        td.append(timed(diag))
    d = diag()
    rec = statistics.median(timed(d.recommend) for _ in range(3)) if d.findings else None
    s32, s16, sd = (statistics.median(t) for t in (t32, t16, td))
    return {
        "model": label,
        "params": sum(p.numel() for p in model.parameters()),
        "step_32_ms": 1e3 * s32,
        "step_16_ms": 1e3 * s16,
        "diagnose_ms": 1e3 * sd,
        "ratio": sd / (s32 + s16),
        "recommend_ms": 1e3 * rec if rec is not None else None,
        "findings": ", ".join(f"{m.display_name} ({m.verdict})" for m in d.findings) or "none",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/doctor_cost.md"))
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    rows = [
        measure(b, args.repeats)
        for b in (
            demo(64, 32),
            demo(8, 16),
            bench_model("transformer", 4),
            bench_model("mlp", 64),
        )
    ]
    lines = [
        "# Cost of `mixprec doctor`: one diagnosis vs one training step in each precision",
        "",
        f"Command: `python benchmarks/doctor_cost.py --repeats {args.repeats} --clock "
        f"{args.clock} --threads {args.threads}`",
        f"Device: {detect('cpu').describe()}; torch {torch.__version__}; "
        f"clock: {'process CPU time' if args.clock == 'cpu' else 'wall time'}",
        "",
        "| model | params | step 32-true ms | step 16-mixed ms | diagnose ms | "
        "diagnose / (both steps) | recommend ms | findings |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        rec = f"{r['recommend_ms']:.0f}" if r["recommend_ms"] is not None else "-"
        lines.append(
            f"| {r['model']} | {r['params']:,} | {r['step_32_ms']:.1f} | {r['step_16_ms']:.1f} | "
            f"{r['diagnose_ms']:.1f} | {r['ratio']:.2f}x | {rec} | {r['findings']} |"
        )
    lines += [
        "",
        "Medians of the repeats (ms of the clock above), steps and diagnoses interleaved. "
        "A step is zero_grad + forward + loss + scaled backward + Adam step through "
        "`Precision`; a diagnosis is "
        '`diagnose(model, batch, loss_fn, precision="16-mixed")` (reference and target '
        "forward/backward with every module probed, model copies, statistics). `recommend` "
        "re-runs the target once per candidate fix plus once per fix when pruning.",
    ]
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
