"""The fp8 activation codec's kernels alone: encode and decode time of one saved tensor by
dtype and size, torch.compile'd and hand-written (`mixprec.optim.states.native`, what a CPU
runs where it builds), beside a plain copy of it; then the ``bf16`` storage's encode (what
``fp8`` gives attention's float32 saves) of a contiguous tensor and of attention's heads cut
from a joined projection (a strided view), as on a CPU.

Each kernel runs on the same tensor (in cache after the first call) 50 times after 3 warm-up
calls, one thread; the lower quartile, in microseconds. What a step pays is more (the
tensor comes from memory), but the ratio between versions and dtypes shows here.

    PYTHONPATH=src python benchmarks/activation_codec.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from mixprec.activations import codecs
from mixprec.optim.states import native


def lower_quartile_us(fn: Callable[[], object], calls: int = 50) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[calls // 4] * 1e6


def main() -> None:
    torch.set_num_threads(1)
    encode = codecs._compiled("encode_blocks")
    decode = codecs._compiled("decode_blocks")
    block = codecs.FP8.block
    columns = "compiled encode us | decode us | hand-written encode us | decode us | copy us"
    print(f"| elements | dtype | {columns} |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for numel in (1 << 18, 1 << 20):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(numel).to(dtype)
            blocks = x.view(-1, block)
            codes, scales = encode(blocks)
            enc = lower_quartile_us(lambda b=blocks: encode(b))
            dec = lower_quartile_us(lambda c=codes, s=scales, d=dtype: decode(c, s, d))
            if native.fp8_encode(x, block) is None:
                hand = "- | -"  # (not built here: no C compiler, or MIXPREC_NATIVE=0)
            else:
                henc = lower_quartile_us(lambda t=x: native.fp8_encode(t, block))
                hdec = lower_quartile_us(
                    lambda c=codes, s=scales, n=numel, d=dtype: native.fp8_decode(c, s, n, d, block)
                )
                hand = f"{henc:.0f} | {hdec:.0f}"
            copy = lower_quartile_us(lambda t=x: t.clone())
            name = str(dtype).removeprefix("torch.")
            print(f"| {numel} | {name} | {enc:.0f} | {dec:.0f} | {hand} | {copy:.0f} |")
    print()
    print("| float32 saved tensor [8, 4, 128, 64] | bf16 encode us |")
    print("|---|---:|")
    joined = torch.randn(8, 128, 3, 4, 64)
    for name, t in (
        ("contiguous", torch.randn(8, 4, 128, 64)),
        ("a head view of a joined projection", joined[:, :, 0].transpose(1, 2)),
    ):
        us = lower_quartile_us(lambda t=t: codecs.ToBfloat16().encode(t), calls=300)
        print(f"| {name} | {us:.0f} |")


if __name__ == "__main__":
    main()
