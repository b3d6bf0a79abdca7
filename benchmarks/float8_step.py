"""Forward + backward time of one Linear in float32 and as a Float8Linear per recipe.

On a CPU the float8 matmuls are emulated (quantize, dequantize to float32, float32 matmul),
so this measures what float8 costs there, not a speed-up; on a CUDA GPU of SM 8.9+ it times
the real `torch._scaled_mm` path.

    PYTHONPATH=src python benchmarks/float8_step.py --tokens 2048 --features 512 --device cpu
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch import nn

from mixprec.formats.float8 import Float8Config
from mixprec.hardware import detect
from mixprec.quantize.float8 import Float8Linear


def one_step_ms(module: nn.Module, x: torch.Tensor, autocast: bool) -> float:
    """Milliseconds of one forward + backward."""
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = module(x)
    out.float().sum().backward()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return 1000 * (time.perf_counter() - start)


def interleaved_ms(modules: dict[str, nn.Module], x, reps: int, autocast: bool) -> dict[str, float]:
    """Median step time of each module, the modules taking turns step by step (so a busy
    neighbour on a shared host slows all of them alike), after two warm-up rounds."""
    times: dict[str, list[float]] = {name: [] for name in modules}
    for i in range(reps + 2):
        for name, module in modules.items():
            ms = one_step_ms(module, x, autocast)
            if i >= 2:
                times[name].append(ms)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16-autocast", action="store_true", help="around every run")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    linear = nn.Linear(args.features, args.features, device=device)
    x = torch.randn(args.tokens, args.features, device=device, requires_grad=True)
    print(
        f"host: {detect(device).describe()}; torch {torch.__version__}; "
        f"python {platform.python_version()}"
    )
    print(
        f"Linear({args.features}, {args.features}) on {args.tokens} tokens, fwd+bwd, "
        f"median of {args.reps}, taking turns{', bf16 autocast' if args.bf16_autocast else ''}"
    )
    print("| layer | ms/step | vs float32 Linear |\n|---|---|---|")
    modules = {"nn.Linear": linear}
    modules.update(
        {f"Float8Linear {r}": Float8Linear.from_float(linear, r) for r in Float8Config.RECIPES}
    )
    times = interleaved_ms(modules, x, args.reps, args.bf16_autocast)
    for name, ms in times.items():
        print(f"| {name} | {ms:.1f} | {ms / times['nn.Linear']:.2f}x |")


if __name__ == "__main__":
    main()
