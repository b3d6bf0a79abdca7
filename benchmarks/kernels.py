"""Quantized Linear kernels beside their anchors, on the machine in hand (issue 24).

Each row is a small named `Case`: one int8/int4 Linear of mixprec (`mixprec.quantize`) and
the anchors it is measured against in the same run (a float32 ``nn.Linear``; for int8,
``torch.ao.quantization.quantize_dynamic``, torch's own dynamic int8 Linear). The callables
of a row take turns call by call (``--repeats`` rounds after a warm-up, under
``torch.inference_mode``) and each reports its median. A row's targets compare those
medians; an anchor this torch lacks is reported missing, never skipped silently. The
kernel each mixprec layer runs is printed beside it (`Int8Linear.kernel`,
`Int4Linear.kernel`). Add a row by adding a `Case` to `CASES`.

    python benchmarks/kernels.py [--repeats 30] [--only int4] [--out PATH.md]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import mixprec
from mixprec.hardware import detect
from mixprec.quantize import Int4Linear, Int8Linear
from mixprec.quantize.int4 import kernel_matmul, pack_for_kernel
from mixprec.quantize.int8 import (
    int8_linear,
    int_matmul,
    onednn_prepack,
    onednn_product,
    quantize_tokens,
)

Call = Callable[[], object]


def float32_linear(linear: nn.Linear, x: torch.Tensor) -> Call:
    """The float32 Linear the quantized one came from."""
    return lambda: linear(x)


def ao_dynamic_int8(linear: nn.Linear, x: torch.Tensor) -> Call:
    """torch.ao's dynamic int8 Linear (per-tensor activations, fbgemm/oneDNN kernels)."""
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated, still the anchor
        warnings.simplefilter("ignore")
        model = torch.ao.quantization.quantize_dynamic(
            nn.Sequential(copy.deepcopy(linear)), {nn.Linear}, dtype=torch.qint8
        )
    return lambda: model(x)


ANCHORS: dict[str, Callable[[nn.Linear, torch.Tensor], Call]] = {
    "float32": float32_linear,
    "torch.ao dynamic int8": ao_dynamic_int8,
}


@dataclass(frozen=True)
class Target:
    """mixprec's median at most ``ratio`` times the anchor's (0.33: 3x faster)."""

    anchor: str
    ratio: float
    words: str


@dataclass(frozen=True)
class Case:
    """One row: a Linear(features -> outputs) quantized by `mode` on `tokens` tokens."""

    name: str
    mode: str
    features: int
    outputs: int
    tokens: int
    anchors: tuple[str, ...]
    targets: tuple[Target, ...] = ()


CASES: list[Case] = [
    Case(
        "int4 Linear 4096x4096, 1 token (decode)",
        "int4",
        4096,
        4096,
        1,
        ("float32",),
        (Target("float32", 1 / 3, ">= 3x faster than float32"),),
    ),
    Case(
        "int4 Linear 4096x4096, 256 tokens",
        "int4",
        4096,
        4096,
        256,
        ("float32",),
        (Target("float32", 1.0, "no slower than float32"),),
    ),
    Case(
        "int8 Linear 1024x1024, 128 tokens",
        "int8",
        1024,
        1024,
        128,
        ("torch.ao dynamic int8", "float32"),
        (
            Target("torch.ao dynamic int8", 1.1, "<= 1.1x torch.ao's time"),
            Target("float32", 1 / 1.5, ">= 1.5x faster than float32"),
        ),
    ),
    Case(
        "int8 Linear 4096x4096, 256 tokens",
        "int8",
        4096,
        4096,
        256,
        ("torch.ao dynamic int8", "float32"),
        (Target("torch.ao dynamic int8", 1.1, "<= 1.1x torch.ao's time"),),
    ),
    Case(
        "int8 Linear 4096x4096, 1 token (decode)",
        "int8",
        4096,
        4096,
        1,
        ("torch.ao dynamic int8", "float32"),
    ),
]


@dataclass
class Row:
    case: Case
    kernel: str
    medians: dict[str, float]  # "mixprec" and each anchor that ran, in ms
    fastest: dict[str, float]  # their fastest call, in ms
    missing: dict[str, str]  # anchor -> why it did not run
    parts: dict[str, float]  # the steps of mixprec's forward, each timed alone, in ms


def int8_parts(layer: Int8Linear, x: torch.Tensor) -> dict[str, Call]:
    """The steps of an int8 Linear's forward, each callable alone on the same data."""
    qx, x_scale = quantize_tokens(x)
    packed = layer.prepacked((layer.qweight,), lambda: onednn_prepack(layer.qweight))
    uses_onednn = layer.kernel.startswith("oneDNN")
    acc = int8_linear(x, layer.qweight, layer.weight_scale, packed if uses_onednn else None)
    scale = layer.weight_scale[None, :]

    def product() -> object:
        if uses_onednn:
            return onednn_product(qx.clone(), packed)  # it shifts its codes in place
        return int_matmul(qx, layer.qweight)

    return {
        "quantize activations (per token)": lambda: quantize_tokens(x),
        "int8 product": product,
        "scales and bias (in place)": lambda: (
            acc.mul_(x_scale[:, None]).mul_(scale).add_(layer.bias)
        ),
    }


def int4_parts(layer: Int4Linear, x: torch.Tensor) -> dict[str, Call]:
    """The steps of an int4 Linear's kernel forward, each callable alone."""
    packed = layer.prepacked(
        (layer.qweight, layer.weight_scale, layer.weight_zero),
        lambda: pack_for_kernel(
            layer.qweight, layer.weight_scale, layer.weight_zero, layer.features, layer.group_size
        ),
    )
    xb = x.to(torch.bfloat16)
    out = kernel_matmul(x, packed, layer.out_features, layer.kernel_group)
    return {
        "input to bfloat16": lambda: x.to(torch.bfloat16),
        "int4 kernel": lambda: kernel_matmul(xb, packed, layer.out_features, layer.kernel_group),
        "output to float32 and bias": lambda: out.to(torch.float32) + layer.bias,
    }


def take_turns(calls: dict[str, Call], repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median and fastest ms per call of each callable, the callables called in turn
    `repeats` times after two warm-up calls each."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e3)
    return (
        {name: statistics.median(ts) for name, ts in times.items()},
        {name: min(ts) for name, ts in times.items()},
    )


def run(case: Case, repeats: int) -> Row:
    torch.manual_seed(0)
    linear = nn.Linear(case.features, case.outputs)
    x = torch.randn(case.tokens, case.features)
    model = nn.Sequential(copy.deepcopy(linear))
    result = mixprec.quantize(model, case.mode)
    calls: dict[str, Call] = {"mixprec": lambda: model(x)}
    missing: dict[str, str] = {}
    for anchor in case.anchors:
        try:
            calls[anchor] = ANCHORS[anchor](linear, x)
            calls[anchor]()  # an engine this build lacks raises here
        except (AttributeError, RuntimeError) as err:
            calls.pop(anchor, None)
            missing[anchor] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    layer = model[0]
    with torch.inference_mode():
        medians, fastest = take_turns(calls, repeats)
        steps = {}
        if isinstance(layer, Int8Linear):
            steps = int8_parts(layer, x)
        elif layer.kernel.startswith("aten."):
            steps = int4_parts(layer, x)
        # the steps take turns with the whole forward, whose median the rest is taken from
        whole = {"whole forward": calls["mixprec"]}
        parts = take_turns({**whole, **steps}, repeats)[0] if steps else {}
    return Row(case, result.kernels["0"], medians, fastest, missing, parts)


def verdicts(row: Row) -> list[str]:
    """Each target of the row, met or missed, with the measured ratio."""
    out = []
    for target in row.case.targets:
        if target.anchor not in row.medians:
            out.append(f"{target.words}: not measured ({target.anchor} missing)")
            continue
        ratio = row.medians["mixprec"] / row.medians[target.anchor]
        met = "met" if ratio <= target.ratio else "MISSED"
        out.append(f"{target.words}: {met} ({ratio:.2f}x its time)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    load_before = os.getloadavg()
    start = time.perf_counter()
    rows = [run(case, args.repeats) for case in CASES if args.only in case.name]
    seconds = time.perf_counter() - start
    load_after = os.getloadavg()

    command = "python benchmarks/kernels.py " + " ".join(sys.argv[1:])
    lines = [
        "# Quantized Linear kernels beside their anchors",
        "",
        f"Command: `{command.strip()}`",
        f"Device: {detect('cpu').describe()}; torch {torch.__version__}",
        f"Host load average (1, 5, 15 min): {', '.join(f'{v:.2f}' for v in load_before)} "
        f"before, {', '.join(f'{v:.2f}' for v in load_after)} after ({seconds:.0f} s).",
        "",
        f"Median ms of {args.repeats} calls per callable, the callables of a row taking "
        "turns call by call, under torch.inference_mode; float32 inputs. Targets compare "
        "medians; the fastest call of each (in brackets) shows what a quiet host gives, as "
        "other processes' bursts stall the 2-thread OpenMP regions of every op.",
        "",
        "| case | mixprec ms | anchors: ms (mixprec / anchor) | targets |",
        "|---|---:|---|---|",
    ]
    for row in rows:
        mine, best = row.medians["mixprec"], row.fastest["mixprec"]
        anchors = [
            f"{name}: {row.medians[name]:.3f} ({mine / row.medians[name]:.2f}x) "
            f"[{row.fastest[name]:.3f}: {best / row.fastest[name]:.2f}x]"
            for name in row.case.anchors
            if name in row.medians
        ] + [f"{name}: missing ({why})" for name, why in row.missing.items()]
        lines.append(
            f"| {row.case.name} | {mine:.3f} [{best:.3f}] | {'; '.join(anchors)} | "
            f"{'; '.join(verdicts(row)) or '-'} |"
        )
    lines += ["", "Kernels mixprec ran (`layer.kernel`):", ""]
    lines += [f"- {row.case.name}: {row.kernel}" for row in rows]
    lines += [
        "",
        "Where mixprec's time goes: the steps of its forward, each called alone on the same "
        "data, taking turns with the whole forward (a second measurement of it); the rest is "
        "the layer's Python and dispatch (checks, the prepacked-copy lookup, reshapes) and "
        "what the steps cost more back to back. Median ms.",
        "",
        "| case | whole forward | steps | rest |",
        "|---|---:|---|---:|",
    ]
    for row in rows:
        if row.parts:
            whole = row.parts.pop("whole forward")
            steps = "; ".join(f"{name} {ms:.3f}" for name, ms in row.parts.items())
            rest = whole - sum(row.parts.values())
            lines.append(f"| {row.case.name} | {whole:.3f} | {steps} | {rest:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
