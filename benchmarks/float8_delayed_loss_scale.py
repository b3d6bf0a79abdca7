"""Delayed float8 scaling under a growing loss scale: the output gradient's scale comes from
the amax history, so on the step after the loss scale doubles the gradients run up to twice
the history's largest and the e5m2 cast saturates them (finite: a loss scaler sees nothing).

One `Float8Linear(16, 16)` with the delayed recipe (history 16), the same input and output
gradient each step, the gradient multiplied by a loss scale of 1024, 1024, 1024, then 2048,
2048: the input gradient's largest error against float32's, over its largest value.

    python benchmarks/float8_delayed_loss_scale.py
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.quantize.float8 import Float8Linear


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = Float8Linear.from_float(nn.Linear(16, 16), recipe="delayed", amax_history_length=16)
    x, g = torch.randn(4, 16), torch.randn(4, 16)
    print("| step | loss scale | input gradient's largest error / its largest value | finite |")
    print("|---:|---:|---:|---|")
    for step, scale in enumerate((1024.0, 1024.0, 1024.0, 2048.0, 2048.0), start=1):
        xx = x.clone().requires_grad_()
        layer(xx).backward(g * scale)
        exact = (g * scale) @ layer.weight.detach()
        error = float((xx.grad - exact).abs().max() / exact.abs().max())
        print(f"| {step} | {scale:.0f} | {error:.3f} | {bool(xx.grad.isfinite().all())} |")


if __name__ == "__main__":
    main()
