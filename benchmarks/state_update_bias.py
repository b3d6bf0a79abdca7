"""How far a low-bit state's AdamW update strays from float32 states', and to which side.

A vector of weights (one element's gradient mean drawn once from a normal, each step's
gradient that mean plus noise of half its size: no outliers) is stepped ``--steps`` times by
torch's ``AdamW`` and, on the same gradients, by `mixprec.optim.states.LowBitAdamW` in each
state format (``min_size=0``, so that every format stores the vector). The table gives the
summed magnitude of the weights' change against torch's and each element's ratio (median,
5% quantile): a ratio under 1 everywhere is a bias that shrinks updates, not noise.

    python benchmarks/state_update_bias.py [--elements 4096] [--steps 100] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

from mixprec.optim.states import LowBitAdamW


def measure(fmt: str, elements: int, steps: int, seed: int) -> tuple[float, float, float]:
    """(summed update over torch's, median and 5% quantile of each element's ratio)."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(elements, generator=gen)
    ref = torch.nn.Parameter(torch.zeros(elements))
    low = torch.nn.Parameter(torch.zeros(elements))
    torchs = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.0)
    ours = LowBitAdamW([low], lr=1e-3, weight_decay=0.0, states=fmt, min_size=0)
    for _ in range(steps):
        grad = mean + 0.5 * mean.abs() * torch.randn(elements, generator=gen)
        ref.grad, low.grad = grad.clone(), grad.clone()
        torchs.step()
        ours.step()
    ratio = low.detach() / ref.detach()
    total = (low.detach().abs().sum() / ref.detach().abs().sum()).item()
    return total, ratio.median().item(), ratio.quantile(0.05).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| states | summed update / torch's | median element ratio | 5% quantile |")
    print("|---|---:|---:|---:|")
    for fmt in ("int8", "float8", "int4"):
        total, median, low = measure(fmt, args.elements, args.steps, args.seed)
        print(f"| {fmt} | {total:.3f} | {median:.3f} | {low:.3f} |")


if __name__ == "__main__":
    main()
