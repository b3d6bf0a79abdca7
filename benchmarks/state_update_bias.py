"""How far a low-bit state's AdamW update strays from float32 states', and to which side.

A vector of weights (one element's gradient mean drawn once from a normal, each step's
gradient that mean plus noise of half its size: no outliers) is stepped ``--steps`` times by
torch's ``AdamW`` and, on the same gradients, by `mixprec.optim.states.LowBitAdamW` in each
state format (``min_size=0``, so that every format stores the vector). The table gives the
summed magnitude of the weights' change against torch's and each element's ratio (median,
5% quantile): a ratio under 1 everywhere is a bias that shrinks updates, not noise.

``--candidates`` adds two int4 layouts registered here as state formats of their own (not
mixprec's): the second moment itself on int4's linear map (``int4-v``: int4 before
2026-12-06, and torchao's), and its root on the unsigned 4-bit dynamic map, a positive root
never coded 0 (``int4-roots-dynamic``).

    python benchmarks/state_update_bias.py [--elements 4096] [--steps 100] [--seed 0]
        [--candidates]
"""

from __future__ import annotations

import argparse

import torch

from mixprec.optim.states import LowBitAdamW
from mixprec.optim.states.codecs import (
    Int4Codec,
    _at_least_tiny,
    _decades,
    _read,
    _root_scaled,
    _scaled,
    dynamic_map,
    dynamic_nearest,
    pack4,
    register_state_format,
    unpack4,
)


class _Int4V(Int4Codec):
    """int4 as it stored the second moment before 2026-12-06 (and as torchao does): ``v``
    itself on the linear map 1/16 .. 1, the block's scale positive (which mixprec's int4
    still decodes as such)."""

    name = "int4-v"

    def encode(self, x, signed, table):  # type: ignore[no-untyped-def]
        if signed:
            return super().encode(x, signed, table)
        y, largest = _scaled(x)
        return pack4(self.nearest(y, False).reshape(-1).to(torch.uint8)), largest


class _Int4RootsDynamic(Int4Codec):
    """int4 with the second moment's root on the unsigned 4-bit dynamic map (3 exponent
    bits), a positive root coded at least as the map's smallest positive value."""

    name = "int4-roots-dynamic"
    _UNSIGNED = _decades(4, 3, False)

    def code_map(self, signed: bool) -> torch.Tensor:
        return torch.tensor(dynamic_map(4, signed, 3), dtype=torch.float32)

    def encode(self, x, signed, table):  # type: ignore[no-untyped-def]
        if signed:
            return super().encode(x, signed, table)
        y, root = _root_scaled(x)
        codes = dynamic_nearest(y, self._UNSIGNED, False)
        codes = torch.where(y > 0, codes.clamp_min(1), codes)
        return pack4(codes.reshape(-1).to(torch.uint8)), -root

    def decode(self, codes, scales, block, signed, table):  # type: ignore[no-untyped-def]
        if signed:
            return super().decode(codes, scales, block, signed, table)
        values = _read(table, unpack4(codes)).view(-1, block)
        magnitude = scales.abs()[:, None]
        stored = values * magnitude
        return _at_least_tiny(stored * stored, values, magnitude)


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
    parser.add_argument("--candidates", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    formats = ["int8", "float8", "int4"]
    if args.candidates:
        for codec in (_Int4V(), _Int4RootsDynamic()):
            register_state_format(codec)
            formats.append(codec.name)
    print("| states | summed update / torch's | median element ratio | 5% quantile |")
    print("|---|---:|---:|---:|")
    for fmt in formats:
        total, median, low = measure(fmt, args.elements, args.steps, args.seed)
        print(f"| {fmt} | {total:.3f} | {median:.3f} | {low:.3f} |")


if __name__ == "__main__":
    main()
