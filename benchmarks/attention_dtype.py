"""CPU attention in bfloat16 against float32, beside a matmul of the char LM's size; the char
LM's training step with mixprec's attention island on and off; where a bf16-mixed step's time
goes; the blog CNN's step in both memory formats.

Issue 24 item 4 asks where a bf16-mixed training step spends the time a bf16 GEMM does not
explain. This script times attention (forward and backward, the char LM's shape: batch 32,
4 heads, 128 tokens, head size 64, causal) in float32 and in bfloat16, fused (torch's
`scaled_dot_product_attention`) and unfused in bfloat16 (bf16 matmuls, float32 softmax: the
other way a bf16 step could run it), and a 4096x256x1024 matmul in both, the variants
taking turns, medians. Then the char LM's whole training step
(examples/charlm.py, AdamW): float32, raw bf16 autocast, and mixprec's bf16-mixed with its
attention island as the device decides (`PolicyMap.float32_attention` left to
`hardware.slow_attention`: attention in float32 inside autocast on CPUs without AMX) and
with it off (``float32_attention=False``), the four taking turns. Then torch.profiler's
self CPU time of the float32 and the bf16-mixed step, grouped: GEMMs, attention, the casts
autocast and the islands insert, LayerNorm/softmax/loss, GELU, the optimizer, the rest. And
the seed blog's CNN (`mixprec bench`'s default model) in float32 and bf16-mixed, each in the
default and in channels_last memory format::

    python benchmarks/attention_dtype.py [--repeats 20] [--lm-repeats 8] [--cnn-repeats 10]
        [--threads 1] [--out PATH.md]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mixprec import PolicyMap, Precision, explain
from mixprec.bench.models import load_workload
from mixprec.hardware import detect

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import charlm  # noqa: E402
from kernels import take_turns  # noqa: E402  (the same turn-taking as the kernels table)


def attention(dtype: torch.dtype) -> Callable[[], None]:
    """Forward and backward of causal attention of the char LM's shape in `dtype`."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(32, 4, 128, 64, generator=g).to(dtype).requires_grad_() for _ in range(3)
    )

    def call() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return call


def attention_unfused() -> Callable[[], None]:
    """The same attention unfused, as eager attention code under bf16 autocast runs it:
    bfloat16 matmuls (scores rounded to bfloat16), the causal softmax in float32, its
    probabilities rounded to bfloat16 for the product with the values."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(32, 4, 128, 64, generator=g).bfloat16().requires_grad_() for _ in range(3)
    )
    future = torch.ones(128, 128, dtype=torch.bool).triu(1)

    def call() -> None:
        scores = (q * 64**-0.5) @ k.transpose(-1, -2)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1, dtype=torch.float32)
        (probs.bfloat16() @ v).sum().backward()

    return call


def matmul(dtype: torch.dtype) -> Callable[[], None]:
    """One 4096x256 by 256x1024 matmul (the char LM's MLP at batch 32 x 128) in `dtype`."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4096, 256, generator=g).to(dtype), torch.randn(256, 1024).to(dtype)
    return lambda: a @ b


def lm_step(policy: PolicyMap | None, autocast: bool = False) -> Callable[[], None]:
    """One AdamW training step of examples/charlm.py's model (d 256, 4 layers, batch 32 x
    128 bytes) on a fixed batch: through mixprec's `Precision` of `policy`, else a plain torch
    loop (under bf16 autocast when `autocast`)."""
    torch.manual_seed(0)
    model = charlm.CharGPT(block=128, dim=256, layers=4)
    data = torch.randint(0, 256, (32, 129))
    x, y = data[:, :-1], data[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    precision = Precision(policy) if policy is not None else None
    if precision is not None:
        model, opt = precision.setup(model, opt)

    def call() -> None:
        if precision is None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(x)
        else:
            with precision.forward_context():
                logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        if precision is None:
            loss.backward()
            opt.step()
        else:
            precision.backward(loss)
            precision.step()
        opt.zero_grad()

    return call


def cnn_step(policy: str, channels_last: bool) -> Callable[[], None]:
    """One Adam training step of the seed blog's CNN (`mixprec bench`'s default model, batch
    16 of 3x128x128) through mixprec's `Precision` of `policy`, the model and its inputs in
    channels_last memory format when asked."""
    torch.manual_seed(0)
    workload = load_workload("cnn")
    model = workload.model
    x, y = workload.make_batch(16)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    precision = Precision(policy)
    model, opt = precision.setup(model, opt)

    def call() -> None:
        with precision.forward_context():
            out = model(x)
        precision.backward(workload.loss_fn(out, y))
        precision.step()
        opt.zero_grad()

    return call


GROUPS = (
    "GEMMs (mm, addmm, bmm)",
    "attention (scaled_dot_product_attention, forward and backward)",
    "casts (autocast's and the islands': to, copy_, their backward)",
    "LayerNorm, log-softmax, loss",
    "GELU",
    "optimizer (AdamW on float32 weights)",
    "the rest (adds, embedding, views, gradient accumulation, autograd)",
)


def _group(op: str, chain: list[str]) -> str:
    """The group of one profiled op, from its name and its ancestors' (innermost first)."""
    top = chain[-1] if chain else op
    if any(name.startswith("Optimizer.") for name in (op, *chain)):
        return GROUPS[5]
    if "scaled_dot_product" in top or "ScaledDotProduct" in top:
        return GROUPS[1]
    if op in ("aten::mm", "aten::addmm", "aten::bmm") or (chain and chain[0] == "aten::addmm"):
        return GROUPS[0]  # addmm's copy of the bias into its output is the GEMM's too
    if top in ("aten::to", "autograd::engine::evaluate_function: ToCopyBackward0") or op in (
        "aten::copy_",
        "aten::_to_copy",
    ):
        return GROUPS[2]
    if any(k in top for k in ("layer_norm", "LayerNorm", "cross_entropy", "LogSoftmax", "Nll")):
        return GROUPS[3]
    if "gelu" in top.lower():
        return GROUPS[4]
    return GROUPS[6]


def grouped_profile(call: Callable[[], None], calls: int = 3) -> dict[str, float]:
    """Self CPU ms per call of `call`, grouped as `GROUPS` says."""
    call()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call()
    ms: dict[str, float] = defaultdict(float)
    for event in prof.events():
        chain, up = [], event.cpu_parent
        while up is not None:
            chain.append(up.name)
            up = up.cpu_parent
        ms[_group(event.name, chain)] += event.self_cpu_time_total / 1e3 / calls
    return {group: ms[group] for group in GROUPS}


def profile_rows(f32: dict[str, float], mixed: dict[str, float]) -> list[str]:
    """Markdown rows: each group's ms per step in float32 and bf16-mixed, and the speed-up."""
    rows = [
        f"| {g} | {f32[g]:.1f} | {mixed[g]:.1f} | {100 * mixed[g] / sum(mixed.values()):.0f}% | "
        + (f"{f32[g] / mixed[g]:.2f}x |" if min(f32[g], mixed[g]) >= 0.05 else "- |")
        for g in GROUPS
    ]
    total32, total = sum(f32.values()), sum(mixed.values())
    return [*rows, f"| total | {total32:.1f} | {total:.1f} | 100% | {total32 / total:.2f}x |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--lm-repeats", type=int, default=8)
    parser.add_argument("--cnn-repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write a markdown result file here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    calls = {
        "attention float32": attention(torch.float32),
        "attention bfloat16": attention(torch.bfloat16),
        "attention unfused": attention_unfused(),
        "matmul float32": matmul(torch.float32),
        "matmul bfloat16": matmul(torch.bfloat16),
    }
    load = os.getloadavg()
    ms, _ = take_turns(calls, args.repeats)
    rows = [
        "| op | float32 ms | bfloat16 ms | bfloat16 speed-up |",
        "|---|---:|---:|---:|",
    ]
    for op in ("attention", "matmul"):
        f32, bf16 = ms[f"{op} float32"], ms[f"{op} bfloat16"]
        rows.append(f"| {op} | {f32:.2f} | {bf16:.2f} | {f32 / bf16:.2f}x |")
        if op == "attention":
            unfused = ms["attention unfused"]
            rows.append(
                "| attention, unfused in bfloat16 (bf16 matmuls, float32 softmax; "
                f"against the fused float32 kernel) | {f32:.2f} | {unfused:.2f} | "
                f"{f32 / unfused:.2f}x |"
            )
    steps, fastest = take_turns(
        {
            "float32": lm_step(None),
            "bf16 autocast (torch, no mixprec)": lm_step(None, autocast=True),
            "bf16-mixed (mixprec, attention as the device decides)": lm_step(
                PolicyMap("bf16-mixed")
            ),
            "bf16-mixed, float32_attention=False": lm_step(
                PolicyMap("bf16-mixed", float32_attention=False)
            ),
        },
        args.lm_repeats,
    )
    lm_rows = [
        "| char LM step | ms | speed-up vs float32 | fastest ms | speed-up, fastest |",
        "|---|---:|---:|---:|---:|",
    ]
    lm_rows += [
        f"| {k} | {v:.0f} | {steps['float32'] / v:.2f}x | {fastest[k]:.0f} | "
        f"{fastest['float32'] / fastest[k]:.2f}x |"
        for k, v in steps.items()
    ]
    islands = explain(charlm.CharGPT(block=128, dim=256, layers=4), "bf16-mixed")
    where = ", ".join(islands.float32_attention) or "no module (bf16 attention is fast here)"
    profiled = profile_rows(
        grouped_profile(lm_step(None)), grouped_profile(lm_step(PolicyMap("bf16-mixed")))
    )
    cnn, cnn_fastest = take_turns(
        {
            f"{policy}{', channels_last' if last else ''}": cnn_step(policy, last)
            for policy in ("32-true", "bf16-mixed")
            for last in (False, True)
        },
        args.cnn_repeats,
    )
    cnn_rows = [
        "| blog CNN step | ms | speed-up vs float32 | fastest ms | speed-up, fastest |",
        "|---|---:|---:|---:|---:|",
    ]
    cnn_rows += [
        f"| {k} | {v:.0f} | {cnn['32-true'] / v:.2f}x | {cnn_fastest[k]:.0f} | "
        f"{cnn_fastest['32-true'] / cnn_fastest[k]:.2f}x |"
        for k, v in cnn.items()
    ]
    text = "\n".join(
        [
            "# CPU attention in bfloat16 against float32",
            "",
            f"Command: `python benchmarks/attention_dtype.py --repeats {args.repeats} "
            f"--lm-repeats {args.lm_repeats} --cnn-repeats {args.cnn_repeats} --threads "
            f"{args.threads}`",
            f"Device: {detect('cpu').describe()}; torch {torch.__version__}; "
            f"load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}",
            "",
            "Median ms of forward + backward (attention: batch 32, 4 heads, 128 tokens, head "
            "size 64, causal: torch's fused kernel, and unfused in bfloat16) and of one "
            "4096x256x1024 matmul, the five taking turns.",
            "",
            *rows,
            "",
            "The char LM's training step (examples/charlm.py, d 256, 4 layers, batch 32 x 128, "
            f"AdamW), the four taking turns. mixprec's bf16-mixed runs attention in float32 "
            f"in: {where}.",
            "",
            *lm_rows,
            "",
            "Where the step's time goes, float32 beside mixprec's bf16-mixed (torch.profiler, "
            "self CPU time per step, mean of 3 steps, grouped by op and by the op or optimizer "
            "step it runs under; the profiler's own cost included):",
            "",
            "| group | float32 ms | bf16-mixed ms | bf16-mixed share | speed-up |",
            "|---|---:|---:|---:|---:|",
            *profiled,
            "",
            "The seed blog's CNN (`mixprec bench`'s default model: conv 7x7/2, conv 11x11/2, "
            "BatchNorm, pooling, dense, softmax; batch 16 of 3x128x128, Adam) through mixprec's "
            "Precision, in torch's default (contiguous) and in channels_last memory format, "
            "the four taking turns:",
            "",
            *cnn_rows,
            "",
        ]
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
