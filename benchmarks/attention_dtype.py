"""CPU attention in bfloat16 against float32, beside a matmul of the char LM's size.

Issue 24 item 4 asks where a bf16-mixed training step spends the time a bf16 GEMM does not
explain. On the char LM (examples/charlm.py) torch.profiler puts a quarter of the step in
`scaled_dot_product_attention` (CPU flash attention), which autocast runs in bfloat16. This
script times that attention (forward and backward, the char LM's shape: batch 32, 4 heads,
128 tokens, head size 64, causal) in float32 and in bfloat16, and a 4096x256x1024 matmul in
both, the variants taking turns, medians::

    python benchmarks/attention_dtype.py [--repeats 20] [--threads 1] [--out PATH.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mixprec.hardware import detect


def attention(dtype: torch.dtype) -> Callable[[], None]:
    """Forward and backward of causal attention of the char LM's shape in `dtype`."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(32, 4, 128, 64, generator=g).to(dtype).requires_grad_() for _ in range(3)
    )

    def call() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return call


def matmul(dtype: torch.dtype) -> Callable[[], None]:
    """One 4096x256 by 256x1024 matmul (the char LM's MLP at batch 32 x 128) in `dtype`."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4096, 256, generator=g).to(dtype), torch.randn(256, 1024).to(dtype)
    return lambda: a @ b


def medians(calls: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median ms of each call, the calls taking turns after two warm-up calls each."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write a markdown result file here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    calls = {
        "attention float32": attention(torch.float32),
        "attention bfloat16": attention(torch.bfloat16),
        "matmul float32": matmul(torch.float32),
        "matmul bfloat16": matmul(torch.bfloat16),
    }
    load = os.getloadavg()
    ms = medians(calls, args.repeats)
    rows = [
        "| op | float32 ms | bfloat16 ms | bfloat16 speed-up |",
        "|---|---:|---:|---:|",
    ]
    for op in ("attention", "matmul"):
        f32, bf16 = ms[f"{op} float32"], ms[f"{op} bfloat16"]
        rows.append(f"| {op} | {f32:.2f} | {bf16:.2f} | {f32 / bf16:.2f}x |")
    text = "\n".join(
        [
            "# CPU attention in bfloat16 against float32",
            "",
            f"Command: `python benchmarks/attention_dtype.py --repeats {args.repeats} "
            f"--threads {args.threads}`",
            f"Device: {detect('cpu').describe()}; torch {torch.__version__}; "
            f"load average before {load[0]:.2f}",
            "",
            "Median ms of forward + backward (attention: batch 32, 4 heads, 128 tokens, head "
            "size 64, causal) and of one 4096x256x1024 matmul, the four taking turns.",
            "",
            *rows,
            "",
        ]
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
