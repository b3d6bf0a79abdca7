"""CPU attention in bfloat16 against float32, beside a matmul of the char LM's size, and
the char LM's training step with its attention moved to float32 inside bf16 autocast.

Issue 24 item 4 asks where a bf16-mixed training step spends the time a bf16 GEMM does not
explain. On the char LM (examples/charlm.py) torch.profiler puts a quarter of the step in
`scaled_dot_product_attention` (CPU flash attention), which autocast runs in bfloat16. This
script times that attention (forward and backward, the char LM's shape: batch 32, 4 heads,
128 tokens, head size 64, causal) in float32 and in bfloat16, and a 4096x256x1024 matmul in
both, the variants taking turns, medians. Then it times the char LM's whole training step
(AdamW) in float32, under bf16 autocast, and under bf16 autocast with each attention call run
in float32 (a torch function mode that casts q, k, v up, runs attention outside autocast and
casts the result back), the three taking turns::

    python benchmarks/attention_dtype.py [--repeats 20] [--lm-repeats 8] [--threads 1]
        [--out PATH.md]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mixprec.hardware import detect

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import charlm  # noqa: E402
from kernels import take_turns  # noqa: E402  (the same turn-taking as the kernels table)

SDPA = F.scaled_dot_product_attention


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


class Float32Attention(TorchFunctionMode):
    """Runs `scaled_dot_product_attention` in float32 inside CPU autocast, its result cast
    back to autocast's dtype; every other call as it is."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func is SDPA and torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
            q, k, v = (t.float() for t in args[:3])
            with torch.autocast("cpu", enabled=False):
                return func(q, k, v, *args[3:], **kwargs).to(dtype)
        return func(*args, **kwargs)


def lm_step(autocast: bool, float32_attention: bool = False) -> Callable[[], None]:
    """One AdamW training step of examples/charlm.py's model (d 256, 4 layers, batch 32 x
    128 bytes) on a fixed batch, in float32 or under bf16 autocast."""
    torch.manual_seed(0)
    model = charlm.CharGPT(block=128, dim=256, layers=4)
    data = torch.randint(0, 256, (32, 129))
    x, y = data[:, :-1], data[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def call() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if float32_attention:
                with Float32Attention():
                    logits = model(x)
            else:
                logits = model(x)
        F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
        opt.step()
        opt.zero_grad()

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--lm-repeats", type=int, default=8)
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
    ms, _ = take_turns(calls, args.repeats)
    rows = [
        "| op | float32 ms | bfloat16 ms | bfloat16 speed-up |",
        "|---|---:|---:|---:|",
    ]
    for op in ("attention", "matmul"):
        f32, bf16 = ms[f"{op} float32"], ms[f"{op} bfloat16"]
        rows.append(f"| {op} | {f32:.2f} | {bf16:.2f} | {f32 / bf16:.2f}x |")
    steps, _ = take_turns(
        {
            "float32": lm_step(False),
            "bf16 autocast": lm_step(True),
            "bf16 autocast, attention in float32": lm_step(True, float32_attention=True),
        },
        args.lm_repeats,
    )
    lm_rows = ["| char LM step | ms | speed-up vs float32 |", "|---|---:|---:|"]
    lm_rows += [f"| {k} | {v:.0f} | {steps['float32'] / v:.2f}x |" for k, v in steps.items()]
    text = "\n".join(
        [
            "# CPU attention in bfloat16 against float32",
            "",
            f"Command: `python benchmarks/attention_dtype.py --repeats {args.repeats} "
            f"--lm-repeats {args.lm_repeats} --threads {args.threads}`",
            f"Device: {detect('cpu').describe()}; torch {torch.__version__}; "
            f"load average before {load[0]:.2f}",
            "",
            "Median ms of forward + backward (attention: batch 32, 4 heads, 128 tokens, head "
            "size 64, causal) and of one 4096x256x1024 matmul, the four taking turns.",
            "",
            *rows,
            "",
            "The char LM's training step (examples/charlm.py, d 256, 4 layers, batch 32 x 128, "
            "AdamW), the three taking turns:",
            "",
            *lm_rows,
            "",
        ]
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
