"""Pure 16-bit training: bytes per parameter and optimizer-step time, measured from tensors.

For an MLP (2.1M parameters) with AdamW, each configuration counts the bytes of the tensors a
step keeps alive (parameters, gradients, optimizer state incl. Kahan buffers, float32 masters
and their gradients) and times the optimizer step alone (gradients set once, median of
``--steps`` steps, the configurations taking turns step by step, after warm-up steps that
include the compiled steps' first-call build). The Kahan step of mixprec
(`mixprec.optim.compensated`, compiled as ``LossScaleOptimizer(compensation=...)`` builds it, and
its eager fallback) runs next to torch's plain bfloat16 AdamW and torch-optimi's
``AdamW(kahan_sum=True)`` when ``optimi`` is installed (the ``bench`` extra; the report
says when it is missing), and they are compared for
accuracy: 1,000 AdamW updates of ~1e-4 of each weight against float64.

With ``--profile`` the report ends with torch.profiler's table of where mixprec's compiled
and eager Kahan steps spend their time (10 steps each).

    python benchmarks/compensated.py [--steps 30] [--profile] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from mixprec.hardware import detect
from mixprec.optim import LossScaleOptimizer
from mixprec.optim.compensated import Compensator

OPTIMI = "bf16-true + Kahan (torch-optimi 0.3.3)"
KAHAN = "bf16-true + Kahan (mixprec, compiled)"
EAGER = "bf16-true + Kahan (mixprec, eager: compile=False)"
PLAIN = "bf16-true plain (torch AdamW)"


def mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512)
    ).to(dtype)


class Eager:
    """A torch optimizer stepped by ``Compensator(kind, compile=False)``: the eager path."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str) -> None:
        self.optimizer = optimizer
        self.compensator = Compensator(kind, seed=0, compile=False)

    def step(self) -> None:
        self.compensator.step(self.optimizer)


class Config:
    """One configuration: a model, the thing to step, and the tensors to count."""

    def __init__(self, name: str, dtype: torch.dtype, make: Callable[[nn.Module], object]):
        self.name = name
        self.model = mlp(dtype)
        for p in self.model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        self.opt = make(self.model)
        self.times: list[float] = []
        self.first: float | None = None  # the first step (a compiled step's build)

    def step(self) -> None:
        if isinstance(self.opt, LossScaleOptimizer):
            for p in self.model.parameters():  # the wrapper moves gradients into the masters
                if p.grad is None:
                    p.grad = torch.randn_like(p) * 1e-3
        start = time.perf_counter()
        self.opt.step()
        self.times.append(time.perf_counter() - start)
        if self.first is None:
            self.first = self.times[-1]

    def bytes_per_param(self) -> float:
        inner = getattr(self.opt, "optimizer", self.opt)
        seen: dict[int, int] = {}
        for p in self.model.parameters():
            seen[id(p)] = p.nbytes + (p.grad.nbytes if p.grad is not None else p.nbytes)
        for group in inner.param_groups:
            for p in group["params"]:
                if id(p) not in seen:  # a float32 master and its gradient
                    seen[id(p)] = p.nbytes + p.nbytes
                for v in inner.state.get(p, {}).values():
                    if torch.is_tensor(v) and v.dim() > 0:
                        seen[id(p)] += v.nbytes
        n = sum(p.numel() for p in self.model.parameters())
        return sum(seen.values()) / n


def configs() -> list[Config]:
    def adamw(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)

    bf16 = torch.bfloat16
    out = [
        Config("fp32 (torch AdamW)", torch.float32, adamw),
        Config("bf16-mixed (float32 weights and state)", torch.float32, adamw),
        Config(
            "bf16-true + float32 masters",
            bf16,
            lambda m: LossScaleOptimizer(adamw(m), "none", master_weights=True),
        ),
        Config(PLAIN, bf16, adamw),
        Config(
            KAHAN,
            bf16,
            lambda m: LossScaleOptimizer(adamw(m), "none", compensation="kahan"),
        ),
        Config(
            "bf16-true + stochastic rounding (mixprec, compiled)",
            bf16,
            lambda m: LossScaleOptimizer(adamw(m), "none", compensation="stochastic"),
        ),
        Config(EAGER, bf16, lambda m: Eager(adamw(m), "kahan")),
    ]
    try:
        import optimi
    except ImportError:
        return out
    out.append(
        Config(
            OPTIMI,
            bf16,
            lambda m: optimi.AdamW(
                m.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, kahan_sum=True, foreach=True
            ),
        )
    )
    return out


def trajectory(make: Callable[[list[nn.Parameter]], object], dtype: torch.dtype) -> torch.Tensor:
    """256 weights in [1, 2) (bfloat16 values, stored in ``dtype``) after 1,000 steps of
    ``make``'s optimizer on the same gradients, as float64."""
    gen = torch.Generator().manual_seed(1)
    p = nn.Parameter((1 + torch.rand(256, generator=gen)).to(torch.bfloat16).to(dtype))
    opt = make([p])
    for _ in range(1000):
        p.grad = (1 + 0.1 * torch.randn(256, generator=gen, dtype=torch.float64)).to(dtype)
        opt.step()
    return p.detach().double()


def accuracy_lines() -> list[str]:
    def torch_adamw(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1)

    ref = trajectory(torch_adamw, torch.float64)
    start = trajectory(lambda ps: torch.optim.SGD(ps, lr=0.0), torch.float64)
    runs = {
        "bf16 plain (torch AdamW)": lambda ps: torch_adamw(ps),
        "bf16 + Kahan (mixprec)": lambda ps: LossScaleOptimizer(
            torch_adamw(ps), "none", compensation="kahan"
        ),
        "bf16 + stochastic rounding (mixprec)": lambda ps: LossScaleOptimizer(
            torch_adamw(ps), "none", compensation="stochastic"
        ),
    }
    try:
        import optimi
    except ImportError:
        optimi = None
    if optimi is not None:
        runs["bf16 + Kahan (torch-optimi 0.3.3)"] = lambda ps: optimi.AdamW(
            ps, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, kahan_sum=True
        )
    step = 2.0**-7
    lines = [
        "",
        "Accuracy: 1,000 AdamW updates (lr 1e-4, weight decay 0.1) of 256 weights in [1, 2), "
        f"against float64; the float64 weights move {(ref - start).abs().mean() / step:.1f} "
        "bfloat16 steps on average.",
        "",
        "| run | max distance from float64 (bfloat16 steps) | mean distance moved (steps) |",
        "|---|---:|---:|",
    ]
    for name, make in runs.items():
        w = trajectory(make, torch.bfloat16)
        err = (w - ref).abs().max() / step
        lines.append(f"| {name} | {err:.2f} | {(w - start).abs().mean() / step:.1f} |")
    return lines


def profile_lines(runs: list[Config]) -> list[str]:
    """torch.profiler's table (the ten largest rows by own time) for 10 steps of each of
    mixprec's compiled and eager Kahan steps."""
    from torch.profiler import profile

    lines = []
    for c in runs:
        if c.name not in (KAHAN, EAGER):
            continue
        with profile() as prof:
            for _ in range(10):
                c.step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)
        lines += ["", f"Profile of 10 steps: {c.name}", "", "```", table.strip(), "```"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()
    runs = configs()
    for _ in range(3):  # warm-up: state allocation, the compiled steps' build
        for c in runs:
            c.step()
    for c in runs:
        c.times.clear()
    for _ in range(args.steps):
        for c in runs:
            c.step()
    load_after = os.getloadavg()
    n = sum(p.numel() for p in runs[0].model.parameters())
    lines = [
        "# Pure bfloat16 training: bytes per parameter and AdamW step time",
        "",
        f"Command: `{' '.join(['python', *sys.argv])}` (threads: {torch.get_num_threads()})",
        f"Device: {detect(torch.device('cpu')).describe()}; torch {torch.__version__}",
        f"Model: MLP 512-1024-1024-512 ({n / 1e6:.2f}M parameters), AdamW.",
        f"Load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after.",
        "",
        "| configuration | bytes/param (params+grads+state+masters) | optimizer step (ms), "
        "median | min | first step (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    medians = {}
    for c in runs:
        medians[c.name] = statistics.median(c.times) * 1e3
        lines.append(
            f"| {c.name} | {c.bytes_per_param():.2f} | {medians[c.name]:.2f} | "
            f"{min(c.times) * 1e3:.2f} | {(c.first or 0.0) * 1e3:.0f} |"
        )
    lines.append("")
    ratios = (
        f"mixprec's compiled Kahan step is {medians[KAHAN] / medians[PLAIN]:.2f}x plain bf16 "
        f"torch AdamW"
    )
    if OPTIMI in medians:
        ratios += f" and {medians[KAHAN] / medians[OPTIMI]:.2f}x torch-optimi's Kahan AdamW"
    else:
        ratios += (
            ' (torch-optimi is not installed: `pip install "torch==2.13.0" -e ".[bench]"` '
            "adds its row)"
        )
    lines.append(ratios + " (medians).")
    lines += [
        "",
        "Bytes are counted from the tensors after warm-up: each parameter and its gradient, "
        "every parameter-shaped optimizer state tensor (moments, Kahan buffers), and float32 "
        "masters with their gradients. bf16-mixed keeps float32 weights and state (the same "
        "tensors as fp32; its bf16 activations are not counted). Step times take turns step "
        "by step on the same host; bfloat16 arithmetic on a CPU without bf16 instructions is "
        "emulated, so absolute times say little about a GPU, the side-by-side ratio more.",
    ]
    lines += accuracy_lines()
    if args.profile:
        lines += profile_lines(runs)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
