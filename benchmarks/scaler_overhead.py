"""The loss scaler's share of a training step (unscale + inf check + scale update) on an
11.8M-parameter MLP, measured two ways in one run:

- in the step: the optimizer phase of the same step through `Precision` with a dynamic
  scaler and with none, and with `torch.amp.GradScaler` for comparison, taking turns step
  by step (this machine is noisy, so only side-by-side numbers mean much);
- directly: the scaler's own work (`unscale_` over the real gradients, the one
  host read of the overflow flag, `update`) timed in isolation on fresh copies of the
  gradients, as a share of the median plain step.

    python benchmarks/scaler_overhead.py [--steps 40] [--warmup 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.optim.scaling import DynamicLossScaler
from mixprec.precision import Precision


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1024, 2560), nn.GELU(), nn.Linear(2560, 2560), nn.GELU(), nn.Linear(2560, 1024)
    )


def make_optimizer(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    if fused:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def run_variants(spec: str, fused: bool, steps: int, warmup: int, batch: int) -> dict[str, float]:
    """Median ms per phase of one step with no scaler, mixprec's dynamic scaler, and
    torch.amp.GradScaler, the three taking turns step by step on copies of one model."""
    torch.manual_seed(0)
    base = mlp()
    x, y = torch.randn(batch, 1024), torch.randn(batch, 1024)
    steppers = {}
    for name, scaler in (("plain", "none"), ("scaled", "dynamic")):
        precision = Precision(spec, allow_slow=True, scaler=scaler)
        model = copy.deepcopy(base)
        model, opt = precision.setup(model, make_optimizer(model, fused))
        steppers[name] = (
            lambda m=model, o=opt, p=precision: p.backward(F.mse_loss(m(x), y)),
            lambda o=opt, p=precision: p.step(o),
            opt,
        )
    model = mixprec.apply(copy.deepcopy(base), spec)
    opt = make_optimizer(model, fused)
    grad_scaler = torch.amp.GradScaler("cpu")

    def torch_step(o: torch.optim.Optimizer = opt) -> None:
        grad_scaler.step(o)
        grad_scaler.update()

    steppers["torch"] = (
        lambda m=model: grad_scaler.scale(F.mse_loss(m(x), y)).backward(),
        torch_step,
        opt,
    )
    probe = DynamicLossScaler()  # a scaler of its own, so the runs' scalers are not disturbed
    times: dict[str, list[float]] = {"alone": []}
    for name in steppers:
        times[f"{name}_fb"], times[f"{name}_opt"] = [], []
    names = list(steppers)
    gc.disable()
    try:
        for i in range(warmup + steps):
            for name in names[i % 3 :] + names[: i % 3]:
                backward, step, opt = steppers[name]
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                backward()
                t1 = time.perf_counter()
                step()
                t2 = time.perf_counter()
                if i >= warmup:
                    times[f"{name}_fb"].append((t1 - t0) * 1e3)
                    times[f"{name}_opt"].append((t2 - t1) * 1e3)
            # the scaler's own work, on fresh copies of this step's real gradients
            grads = [p.grad for p in steppers["scaled"][2].params_with_grads()]
            work = [g.clone() for g in grads]
            for _ in range(3):
                torch._foreach_copy_(work, grads)
                t0 = time.perf_counter()
                found = probe.unscale_(work)
                probe.update(found, bool(found.item()))
                if i >= warmup:
                    times["alone"].append((time.perf_counter() - t0) * 1e3)
    finally:
        gc.enable()
    out = {k: statistics.median(v) for k, v in times.items()}
    # paired: each step's difference with its neighbours in time, robust to load drifting
    for name in ("scaled", "torch"):
        out[f"{name}_cost"] = statistics.median(
            s - p for s, p in zip(times[f"{name}_opt"], times["plain_opt"], strict=True)
        )
    return out


CONFIGS = (
    ("16-mixed", True, 256, "16-mixed, fused AdamW"),
    ("16-mixed", False, 256, "16-mixed, foreach AdamW"),
    ("16-mixed", True, 1024, "16-mixed, fused AdamW"),
    ("bf16-mixed", True, 256, "bf16-mixed + forced dynamic scaler, fused AdamW"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=None, help="write a markdown result file here")
    args = parser.parse_args(argv)
    params = sum(p.numel() for p in mlp().parameters())
    load_before = os.getloadavg()[0]
    rows = []
    for spec, fused, batch, label in CONFIGS:
        t = run_variants(spec, fused, args.steps, args.warmup, batch)
        step = t["plain_fb"] + t["plain_opt"]
        rows.append(
            f"| {label} | {batch} | {step:.1f} | {t['plain_opt']:.2f} | {t['scaled_opt']:.2f} "
            f"| {t['scaled_cost']:.2f} | {t['scaled_cost'] / step:.2%} "
            f"| {t['torch_cost']:.2f} | {t['torch_cost'] / step:.2%} "
            f"| {t['alone']:.2f} | {t['alone'] / step:.2%} |"
        )
    lines = [
        "# Loss scaler overhead: its share of a training step",
        "",
        f"Command: `python benchmarks/scaler_overhead.py --steps {args.steps} --warmup "
        f"{args.warmup}`",
        f"Device: {mixprec.hardware.detect('cpu').describe()}; torch {torch.__version__}",
        f"Model: MLP 1024-2560-2560-1024 ({params / 1e6:.1f}M parameters), MSE loss.",
        f"Load average (1 min) before / after the run: {load_before:.2f} / "
        f"{os.getloadavg()[0]:.2f} (the run itself adds about 2; more means other work "
        "shared the cores).",
        "",
        "| setting | batch | step without scaler (ms) | optimizer phase, no scaler (ms) "
        "| optimizer phase, mixprec scaler (ms) | mixprec scaler cost in the step (ms) "
        "| share | torch GradScaler cost in the step (ms) | share "
        "| mixprec scaler work alone (ms) | share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "A step is zero_grad + forward + loss + scaled backward (the first phase) and "
        "`precision.step` (the optimizer phase), through `mixprec.Precision`; copies of one "
        "model with no scaler, with mixprec's dynamic scaler, and with `torch.amp.GradScaler` "
        "(`scaler.step` + `scaler.update` on the same applied model) take turns step by step; "
        f"medians of {args.steps} steps. A scaler's cost in the step is the median over steps "
        "of the difference between its optimizer phase and the scaler-free one run next to "
        "it. mixprec's is the fused "
        "`unscale_` + inf check pass, the one host read of the overflow flag and `update` "
        "(fused optimizers get the flag and skip in their kernel). "
        "'Scaler work alone' times those calls in isolation on fresh copies of the step's "
        "real gradients. Shares are of the step without scaler.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
