"""What `torch.compile` gains on this machine: eager vs compiled, mixprec vs a raw torch loop,
for float32 and (allowed, slow without bf16 hardware) bf16-mixed, on a small MLP and a small
transformer. All variants of one model and precision live in one process and take turns step
by step, the order rotating every round, so they see the same machine load; medians.

    python benchmarks/compile_speedup.py [--rounds 60] [--threads 1] \
        [--out benchmarks/results/compile_cpu.md]

Variants: "raw" is the plain model (under `torch.autocast` for bf16-mixed); "mixprec" is the
same model converted by `mixprec.apply` (bf16-mixed: LayerNorm in float32 islands, which CPU
autocast leaves in bfloat16, so that pair is not like for like). Compiled variants are
`torch.compile(model)` with torch's defaults (inductor), built after conversion; their first
step (the compilation) is timed apart. A step is zero_grad, forward, cross-entropy, backward
and an SGD step.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch._dynamo
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import mixprec
from mixprec.hardware import detect

VARIANTS = ("eager raw", "eager mixprec", "compiled raw", "compiled mixprec")


class MLP(nn.Module):
    """Two hidden layers with LayerNorm, GELU."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(width, 2 * width),
            nn.LayerNorm(2 * width),
            nn.GELU(),
            nn.Linear(2 * width, 2 * width),
            nn.LayerNorm(2 * width),
            nn.GELU(),
            nn.Linear(2 * width, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    """A pre-LayerNorm transformer block (causal attention, GELU MLP)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    """Token embedding, learned positions, blocks, final LayerNorm, vocabulary head."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos)))


@dataclass
class Workload:
    name: str
    make: Callable[[], nn.Module]
    inputs: torch.Tensor
    targets: torch.Tensor


def workloads(bf16: bool) -> list[Workload]:
    """Small enough that bf16 steps stay short on a CPU that emulates bfloat16."""
    g = torch.Generator().manual_seed(0)
    width, batch = (64, 32) if bf16 else (256, 64)
    vocab, d, seq, tb = (128, 32, 16, 4) if bf16 else (256, 64, 32, 8)
    return [
        Workload(
            f"MLP {width}-{2 * width}-{2 * width}-10, 2 LayerNorms, batch {batch}",
            lambda: MLP(width),
            torch.randn(batch, width, generator=g),
            torch.randint(0, 10, (batch,), generator=g),
        ),
        Workload(
            f"transformer 2x(d {d}, 4 heads), seq {seq}, batch {tb}",
            lambda: Transformer(vocab, d, 4, 2, seq),
            torch.randint(0, vocab, (tb, seq), generator=g),
            torch.randint(0, vocab, (tb * seq,), generator=g),
        ),
    ]


@dataclass
class Variant:
    step: Callable[[], None]
    ms: list[float] = field(default_factory=list)
    first_s: float | None = None
    graphs: int | None = None


def variants(work: Workload, spec: str) -> dict[str, Variant]:
    """The four loops on one set of initial weights, each with its own copy and optimizer."""
    torch.manual_seed(0)
    base = work.make()
    mixed = spec != "32-true"
    out = {}
    for name in VARIANTS:
        model = copy.deepcopy(base)
        if "mixprec" in name:
            mixprec.apply(model, spec, warn=False)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        run = torch.compile(model) if name.startswith("compiled") else model
        region = mixed and "raw" in name

        def step(run=run, opt=opt, region=region) -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=region):
                out = run(work.inputs)
            loss = F.cross_entropy(out.float().flatten(0, -2), work.targets)
            loss.backward()
            opt.step()

        out[name] = Variant(step)
    return out


def measure(work: Workload, spec: str, rounds: int, warmup: int) -> dict[str, Variant]:
    loops = variants(work, spec)
    for v in loops.values():  # first step: compilation for the compiled variants
        before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        v.step()
        v.first_s = time.perf_counter() - t0
        v.graphs = counters["stats"]["unique_graphs"] - before
        for _ in range(warmup):
            v.step()
    names = list(loops)
    gc.collect()
    gc.disable()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):  # compiled once, or raise
            for r in range(rounds):
                k = r % len(names)
                for name in names[k:] + names[:k]:
                    t0 = time.perf_counter()
                    loops[name].step()
                    loops[name].ms.append((time.perf_counter() - t0) * 1e3)
    finally:
        gc.enable()
    return loops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60, help="timed steps per variant (float32)")
    ap.add_argument("--bf16-rounds", type=int, default=20, help="timed steps per bf16 variant")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/compile_cpu.md")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="disable inductor's on-disk caches, so first steps time a full compilation",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.cold:
        inductor_config.force_disable_caches = True
    load_before = [round(x, 2) for x in os.getloadavg()]
    rows = []
    t_start = time.perf_counter()
    for spec, rounds in (("32-true", args.rounds), ("bf16-mixed", args.bf16_rounds)):
        for work in workloads(spec != "32-true"):
            torch._dynamo.reset()
            loops = measure(work, spec, rounds, args.warmup)
            med = {n: statistics.median(v.ms) for n, v in loops.items()}
            rows.append((work.name, spec, med, loops))
            print(work.name, spec, {n: round(m, 2) for n, m in med.items()}, flush=True)
    load_after = [round(x, 2) for x in os.getloadavg()]
    host = detect(torch.device("cpu")).describe()
    command = "python benchmarks/compile_speedup.py " + " ".join(sys.argv[1:])
    lines = [
        "# torch.compile on CPU: eager vs compiled, mixprec vs raw torch",
        "",
        f"Command: `{command.strip()}`",
        f"Host: {host}; torch {torch.__version__}; {args.threads} thread(s); load "
        f"average (1/5/15 min) {load_before} before, {load_after} after; took "
        f"{time.perf_counter() - t_start:.0f} s",
        "",
        "ms/step, median of the timed steps (float32: "
        f"{args.rounds}, bf16-mixed: {args.bf16_rounds} per variant), the four variants "
        "taking turns every step. Compile speedup = eager median / compiled median; "
        "mixprec overhead = mixprec median / raw median - 1 at the same setting.",
        "",
        "| model | precision | eager raw | eager mixprec | compiled raw | compiled mixprec "
        "| compile speedup raw | compile speedup mixprec | mixprec overhead eager "
        "| mixprec overhead compiled | graphs raw / mixprec | first step s raw / mixprec |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, spec, med, loops in rows:
        er, em, cr, cm = (med[v] for v in VARIANTS)
        raw_c, mp_c = loops["compiled raw"], loops["compiled mixprec"]
        lines.append(
            f"| {name} | {spec} | {er:.2f} | {em:.2f} | {cr:.2f} | {cm:.2f} | {er / cr:.2f}x "
            f"| {em / cm:.2f}x | {(em / er - 1) * 100:+.1f}% | {(cm / cr - 1) * 100:+.1f}% "
            f"| {raw_c.graphs} / {mp_c.graphs} | {raw_c.first_s:.1f} / {mp_c.first_s:.1f} |"
        )
    lines += [
        "",
        "graphs: graphs compiled for the variant's first step (1 = no graph break); the "
        "warm-up and timed steps ran with torch._dynamo.config.error_on_recompile, so none "
        "recompiled. first step: the compiled variants' compilation, "
        + ("inductor's caches disabled (--cold)." if args.cold else "inductor's caches on."),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
