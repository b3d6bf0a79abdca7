"""float8 training against bf16-mixed on an MLP, eager and compiled (a GPU benchmark).

Four Linear layers, d=4096 <-> hidden 16384 (up, GELU, down, up, GELU, down), 8192 tokens a
step, float32 weights; a step is forward + backward under bf16 autocast (no optimizer), as
the first H200 run measured it. Variants, in this order (the most wanted first, since a
budget may stop the run):

- ``bf16-mixed``: plain Linear layers, eager;
- ``float8``: `convert_to_float8` (tensorwise), eager: the casts run as compiled kernels
  (`mixprec.quantize.float8_casts`, compiled on first use);
- ``float8 op-by-op casts``: the same with `set_compiled_casts(())`, each cast op by op;
- ``float8 compiled``: the float8 model under ``torch.compile``;
- ``bf16-mixed compiled``: the plain model under ``torch.compile``.

Each variant warms up (compiling there), then times steps, CUDA synchronised around each;
its row goes to OUT/float8_mlp.md and OUT/float8_mlp.jsonl as soon as it is measured, so a
run stopped by its budget keeps every finished row.

    PYTHONPATH=src python benchmarks/gpu/float8_mlp.py --out OUT
    PYTHONPATH=src python benchmarks/gpu/float8_mlp.py --device cpu --tiny --out OUT  # smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from mixprec.quantize.float8 import convert_to_float8
from mixprec.quantize.float8_casts import set_compiled_casts

VARIANTS = (
    "bf16-mixed",
    "float8",
    "float8 op-by-op casts",
    "float8 compiled",
    "bf16-mixed compiled",
)


def make_mlp(dim: int, hidden: int, device: torch.device) -> nn.Sequential:
    """up, GELU, down, up, GELU, down: four Linear layers in float32."""
    return nn.Sequential(
        nn.Linear(dim, hidden),
        nn.GELU(),
        nn.Linear(hidden, dim),
        nn.Linear(dim, hidden),
        nn.GELU(),
        nn.Linear(hidden, dim),
    ).to(device)


def build(variant: str, base: nn.Module, skip_small: bool) -> tuple[nn.Module, tuple[str, ...]]:
    """The variant's model (a copy of `base`) and the devices whose casts run compiled."""
    model = copy.deepcopy(base)
    compiled_casts: tuple[str, ...] = ("cuda",)
    if variant.startswith("float8"):
        model = convert_to_float8(model, skip_small=skip_small)
        if variant == "float8 op-by-op casts":
            compiled_casts = ()
    if variant.endswith("compiled"):
        model = torch.compile(model)
    return model, compiled_casts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(model: nn.Module, x: torch.Tensor) -> None:
    """Forward and backward under bf16 autocast; the gradients are dropped after."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = model(x)
    out.float().square().mean().backward()
    for p in model.parameters():
        p.grad = None


def measure(
    run: Callable[[], None], device: torch.device, warmup: int, steps: int
) -> dict[str, object]:
    """Seconds of the first step (compilation included), then ms of each timed step."""
    _sync(device)
    t0 = time.perf_counter()
    run()
    _sync(device)
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        run()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {"first_step_s": first, "step_ms": times, "peak_mib": peak}


def table(rows: list[dict[str, object]], header: list[str]) -> str:
    """The markdown report of the rows so far."""
    base = next((r for r in rows if r["variant"] == "bf16-mixed"), None)
    lines = [
        *header,
        "",
        "| variant | ms/step median | min-max | vs bf16-mixed eager | TFLOP/s | first step s "
        "| peak MiB |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = r["ms"]
        ratio = f"{base['ms'] / ms:.2f}x" if base is not None else "-"
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:,.0f}"
        lines.append(
            f"| {r['variant']} | {ms:.2f} | {min(r['step_ms']):.2f}-{max(r['step_ms']):.2f} "
            f"| {ratio} | {r['tflops']:.1f} | {r['first_step_s']:.1f} | {peak} |"
        )
    lines += [
        "",
        "vs bf16-mixed eager: its median / this median (above 1.00x: faster). "
        "TFLOP/s: 6 x weights x tokens per step (forward + backward matmuls).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=16384)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument(
        "--tiny",
        action="store_true",
        help="d=64, hidden 128, 32 tokens, 2 steps, float8 layers despite their size",
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.dim, args.hidden, args.tokens, args.warmup, args.steps = 64, 128, 32, 1, 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here; use --device cpu --tiny for a smoke test", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    args.out.mkdir(parents=True, exist_ok=True)
    md, jsonl = args.out / "float8_mlp.md", args.out / "float8_mlp.jsonl"
    jsonl.write_text("")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = [
        "# float8 (tensorwise) against bf16-mixed: an MLP of 4 Linear layers",
        "",
        f"{name}, torch {torch.__version__}; d={args.dim}, hidden {args.hidden}, "
        f"{args.tokens} tokens, forward + backward under bf16 autocast, float32 weights; "
        f"{args.steps} timed steps after {args.warmup} warm-up (the first compiles), median.",
        "",
        f"Command: `python benchmarks/gpu/float8_mlp.py {shlex.join(argv or sys.argv[1:])}`",
    ]
    torch.manual_seed(0)
    base = make_mlp(args.dim, args.hidden, device)
    x = torch.randn(args.tokens, args.dim, device=device)
    weights = sum(m.weight.numel() for m in base if isinstance(m, nn.Linear))
    rows: list[dict[str, object]] = []
    for variant in args.variants:
        model, casts = build(variant, base, skip_small=not args.tiny)
        previous = set_compiled_casts(casts)
        try:
            result = measure(lambda m=model: step(m, x), device, args.warmup, args.steps)
        finally:
            set_compiled_casts(previous)
        ms = statistics.median(result["step_ms"])
        row = {"variant": variant, "ms": ms, "tflops": 6 * weights * args.tokens / ms / 1e9}
        row.update(result)
        rows.append(row)
        with jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        md.write_text(table(rows, header))
        first = result["first_step_s"]
        print(f"{variant}: {ms:.2f} ms/step (first step {first:.1f} s)", flush=True)
        del model
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
