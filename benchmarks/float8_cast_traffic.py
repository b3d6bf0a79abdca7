"""Bytes the float8 casts of one training step move, op by op against compiled (no GPU needed).

The step is benchmarks/gpu/float8_mlp.py's: 4 Linear layers (d=4096 <-> hidden 16384, 8192
tokens) under bf16 autocast, tensorwise; each layer casts its input (float32 for the first
layer, bfloat16 after), its float32 weight and its bfloat16 output gradient: 12 casts. Each
cast (`tensor_scale`, `to_float8`, the inverse scale) runs on `meta` tensors under a
dispatch mode that adds up, per aten op, the bytes of its tensor inputs and outputs (scalars
left out): the memory traffic of the op-by-op casts. Compiled, a cast reads its tensor twice
(abs-max, then the cast) and writes one byte per element.

    PYTHONPATH=src python benchmarks/float8_cast_traffic.py
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mixprec.quantize import float8 as f8

FREE = ("detach", "view", "t", "alias", "expand")  # no data moved


class Traffic(TorchDispatchMode):
    """Adds up each op's tensor bytes in and out, and counts the ops."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in FREE:
            return out
        self.ops += 1
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        new = [o for o in outs if not any(o is i for i in ins)]  # a no-op cast returns its input
        self.bytes += sum(t.numel() * t.element_size() for t in ins + new if t.numel() > 1)
        return out


def mlp_casts(tokens: int = 8192, dim: int = 4096, hidden: int = 16384):
    """(shape, dtype, fp8 dtype) of each cast of one forward + backward."""
    layers = [
        (dim, hidden, torch.float32),
        (hidden, dim, torch.bfloat16),
        (dim, hidden, torch.bfloat16),
        (hidden, dim, torch.bfloat16),
    ]
    casts = []
    for n_in, n_out, x_dtype in layers:
        casts += [
            ((tokens, n_in), x_dtype, f8.E4M3),
            ((n_out, n_in), torch.float32, f8.E4M3),
            ((tokens, n_out), torch.bfloat16, f8.E5M2),
        ]
    return casts


def main() -> int:
    eager = ops = compiled = 0
    for shape, dtype, fp8 in mlp_casts():
        x = torch.empty(shape, dtype=dtype, device="meta")
        with Traffic() as traffic:
            scale = f8.tensor_scale(x, fp8)
            f8.to_float8(x, scale, fp8)
            scale.reciprocal()
        eager += traffic.bytes
        ops += traffic.ops
        compiled += 2 * x.numel() * x.element_size() + x.numel()
    print("| casts of one step | aten ops | GB moved |\n|---|---:|---:|")
    print(f"| op by op | {ops} | {eager / 1e9:.1f} |")
    kernels = 2 * len(mlp_casts())
    print(f"| compiled: abs-max, then cast | {kernels} + the scales | {compiled / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
