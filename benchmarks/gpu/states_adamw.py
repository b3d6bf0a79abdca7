"""Low-bit AdamW states on a GPU: mixprec's AdamW8bit, AdamW4bit and AdamWFp8 against torch's
fused AdamW and, where installed, torchao's and bitsandbytes' 8-bit AdamW.

Each optimizer steps its own copy of an MLP whose gradients are set once (random, seeded), so
every step does the same work. After warm-up steps (a compiled optimizer compiles in its
first), the optimizers take turns in rotating rounds, one step each per round, each step
timed between two device synchronisations; a row gives the median step, the median of its
per-round ratios against torch's fused AdamW, and the bytes of its state tensors against
torch's. Rows are written after each model, so a run stopped at its budget keeps what it
measured.

    python benchmarks/gpu/states_adamw.py [--device cuda] [--models mlp4m mlp100m]
        [--rounds 40] [--warmup 10] [--out DIR] [--tiny]

``--tiny`` runs a 64-wide MLP for a smoke test on a CPU (its numbers mean nothing there).
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from mixprec import AdamW4bit, AdamW8bit, AdamWFp8

# name -> (input width, hidden width, layers): the 4.2M MLP and a 100M one
MODELS = {"mlp4m": (1024, 2048, 2), "mlp100m": (4096, 4096, 6), "tiny": (64, 128, 2)}


def make_mlp(name: str, device: torch.device) -> nn.Sequential:
    width, hidden, layers = MODELS[name]
    torch.manual_seed(0)
    dims = [width] + [hidden] * (layers - 1) + [width]
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in zip(dims, dims[1:], strict=False)))
    model = model.to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    return model


def _torchao() -> Callable[..., torch.optim.Optimizer] | None:
    for where in ("torchao.optim", "torchao.prototype.low_bit_optim"):
        try:
            module = __import__(where, fromlist=["AdamW8bit"])
            return module.AdamW8bit
        except ImportError:
            continue
        except Exception as err:  # noqa: BLE001 - a build for another torch: said, left out
            print(f"torchao left out: {type(err).__name__}: {err}", flush=True)
            return None
    return None


def _bitsandbytes() -> Callable[..., torch.optim.Optimizer] | None:
    try:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit
    except ImportError:
        return None
    except Exception as err:  # noqa: BLE001 - no library for this CUDA: said, left out
        print(f"bitsandbytes left out: {type(err).__name__}: {err}", flush=True)
        return None


def optimizers(device: torch.device) -> dict[str, Callable[..., torch.optim.Optimizer]]:
    """The optimizers compared, torch's fused AdamW (the baseline) first; torchao's and
    bitsandbytes' only where installed (and, for bitsandbytes, on CUDA)."""
    fused = device.type == "cuda"
    out: dict[str, Callable[..., torch.optim.Optimizer]] = {
        "torch AdamW (fused)" if fused else "torch AdamW (foreach)": (
            lambda ps: torch.optim.AdamW(ps, fused=fused, foreach=not fused)
        ),
        "mixprec AdamW8bit": AdamW8bit,
        "mixprec AdamW4bit": AdamW4bit,
        "mixprec AdamWFp8": AdamWFp8,
    }
    ao = _torchao()
    if ao is not None:
        out["torchao AdamW8bit"] = ao
    bnb = _bitsandbytes()
    if bnb is not None and device.type == "cuda":
        out["bitsandbytes AdamW8bit"] = bnb
    return out


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (a tensor subclass by its storage)."""
    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                inner = getattr(value, "__tensor_flatten__", None)
                if inner is not None:
                    names, _ = inner()
                    total += sum(getattr(value, n).nbytes for n in names)
                else:
                    total += value.nbytes
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rounds(
    steppers: dict[str, tuple[torch.optim.Optimizer, float]],
    labels: list[str],
    times: dict[str, list[float]],
    rounds: int,
    device: torch.device,
) -> None:
    """Each optimizer one step a round, in an order rotating by round, synchronised."""
    for r in range(rounds):
        shift = r % len(labels)
        for label in labels[shift:] + labels[:shift]:
            opt = steppers[label][0]
            _sync(device)
            t0 = time.perf_counter()
            opt.step()
            _sync(device)
            times[label].append(time.perf_counter() - t0)


def time_model(
    name: str, device: torch.device, rounds: int, warmup: int
) -> list[dict[str, object]]:
    """One row per optimizer: its step times over rotating rounds, and its state bytes."""
    steppers = {}
    for label, make in optimizers(device).items():
        model = make_mlp(name, device)
        opt = make(list(model.parameters()))
        start = time.perf_counter()
        for _ in range(warmup):
            opt.step()
        _sync(device)
        steppers[label] = (opt, time.perf_counter() - start)
        print(f"{name}: {label} warmed up in {steppers[label][1]:.1f} s", flush=True)
    labels = list(steppers)
    times: dict[str, list[float]] = {k: [] for k in labels}
    # (warm-up steps past the compiling one: the first H200 run's steps ran twice as slow
    # for several rounds after 3; no collection pauses inside the rounds)
    gc.collect()
    gc.disable()
    try:
        _rounds(steppers, labels, times, rounds, device)
    finally:
        gc.enable()
    base = labels[0]
    rows = []
    for label in labels:
        ratios = [t / b for t, b in zip(times[label], times[base], strict=True)]
        rows.append(
            {
                "model": name,
                "optimizer": label,
                "params": sum(p.numel() for p in steppers[label][0].param_groups[0]["params"]),
                "ms": statistics.median(times[label]) * 1e3,
                "vs_baseline": statistics.median(ratios),
                "state_bytes": state_bytes(steppers[label][0]),
                "warmup_s": steppers[label][1],
                "step_ms": [t * 1e3 for t in times[label]],
            }
        )
    return rows


def table(rows: list[dict[str, object]]) -> str:
    base_bytes = {
        r["model"]: r["state_bytes"] for r in rows if r["optimizer"].startswith("torch AdamW")
    }
    lines = [
        "| model | optimizer | ms/step (median) | vs torch (median of paired rounds) "
        "| state MiB | vs torch's | warm-up s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['params'] / 1e6:.3g}M) | {r['optimizer']} | {r['ms']:.3f} "
            f"| {r['vs_baseline']:.2f}x | {r['state_bytes'] / 2**20:.1f} "
            f"| {r['state_bytes'] / base_bytes[r['model']]:.2f}x | {r['warmup_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", nargs="+", default=["mlp4m", "mlp100m"], choices=MODELS)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("states_adamw"))
    parser.add_argument("--tiny", action="store_true", help="a 64-wide MLP, 2 rounds")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: pass --device cpu (with --tiny for a smoke test)")
        return 2
    models, rounds = (["tiny"], 2) if args.tiny else (args.models, args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "benchmarks/gpu/states_adamw.py", *(argv or sys.argv[1:])])
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows: list[dict[str, object]] = []
    for name in models:
        rows += time_model(name, device, rounds, args.warmup)
        with open(args.out / "states_adamw.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        text = (
            f"# Low-bit AdamW states on {gpu} (torch {torch.__version__})\n\n"
            f"{rounds} rotating rounds after {args.warmup} warm-up steps; "
            f"`{command}`\n\n{table(rows)}\n"
        )
        (args.out / "states_adamw.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
