"""What the Trainer costs over a hand-written `mixprec.Precision` loop on a GPU.

The blog's CNN trains one epoch from the same weights on the same pinned-memory DataLoader
three ways, in rotating order, round after round: by hand (`Precision.setup`, batches
copied with `non_blocking=True`, `backward`, `step`, `zero_grad`), with a bare Trainer
(`logger=False`, no checkpoint, no progress bar) and with the Trainer's defaults (CSV and
TensorBoard logging, a checkpoint at the end). The loop is timed from the first batch to the
last step, CUDA synchronised at both ends, so a hidden host sync per step in the Trainer
shows up as overhead. Medians over rounds; round 0 is a warm-up.

    PYTHONPATH=src python benchmarks/gpu/trainer_overhead.py --out OUT.md
    PYTHONPATH=src python benchmarks/gpu/trainer_overhead.py --device cpu --tiny   # smoke test
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec.bench.models import BlogCNN, probabilities_nll
from mixprec.precision import Precision
from mixprec.trainer import Callback, Trainer

WAYS = ("hand", "bare", "defaults")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_loader(steps: int, batch: int, image: int, pin: bool) -> DataLoader:
    """Synthetic images and labels, kept on the host as a real input pipeline would be."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(steps * batch, 3, image, image, generator=g)
    y = torch.randint(0, 10, (steps * batch,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, pin_memory=pin)


def hand(model: nn.Module, data: DataLoader, spec: str, device: torch.device) -> float:
    """One epoch by hand; returns the loop's seconds."""
    model.to(device)
    precision = Precision(spec, device=device, allow_slow=True)
    model, opt = precision.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    _sync(device)
    t0 = time.perf_counter()
    for x, y in data:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with precision.forward_context():  # the loss inside autocast, as the Trainer's step
            loss = probabilities_nll(model(x), y)
        precision.backward(loss)
        precision.step(opt)
        opt.zero_grad(set_to_none=True)
    _sync(device)
    return time.perf_counter() - t0


class LoopTimer(Callback):
    """Seconds from the start of the epoch to its end, the device synchronised at both."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0

    def on_train_epoch_start(self, trainer: Trainer, model: nn.Module) -> None:
        _sync(self.device)
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer: Trainer, model: nn.Module) -> None:
        _sync(self.device)
        self.seconds = time.perf_counter() - self.start


def _adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)  # type: ignore[arg-type]


def with_trainer(
    model: nn.Module, data: DataLoader, spec: str, device: torch.device, defaults: bool
) -> float:
    """One epoch with the Trainer; returns the loop's seconds."""
    timer = LoopTimer(device)
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            precision=spec,
            accelerator=device.type,
            max_epochs=1,
            callbacks=[timer],
            logger=defaults,
            enable_checkpointing=defaults,
            enable_progress_bar=False,
            default_root_dir=root,
            allow_slow_precision=True,
        )
        trainer.fit(model, data, loss_fn=probabilities_nll, optimizer=_adam)
    return timer.seconds


def measure(
    spec: str, data: DataLoader, device: torch.device, rounds: int
) -> dict[str, list[float]]:
    """Loop seconds of each way per round (round 0, the warm-up, left out)."""
    torch.manual_seed(0)
    base = BlogCNN()
    runs: dict[str, Callable[[nn.Module], float]] = {
        "hand": lambda m: hand(m, data, spec, device),
        "bare": lambda m: with_trainer(m, data, spec, device, defaults=False),
        "defaults": lambda m: with_trainer(m, data, spec, device, defaults=True),
    }
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(rounds + 1):
        for way in WAYS[r % 3 :] + WAYS[: r % 3]:
            seconds = runs[way](copy.deepcopy(base))
            if r:
                times[way].append(seconds)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", nargs="+", default=["bf16-mixed", "16-mixed"])
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=40, help="steps per epoch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="16x16 images, batch 4, 3 steps, 1 round")
    p.add_argument("--out", type=Path, help="write the markdown table here")
    args = p.parse_args(argv)
    if args.tiny:
        args.image_size, args.batch_size, args.steps, args.rounds = 16, 4, 3, 1
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here; use --device cpu --tiny for a smoke test", file=sys.stderr)
        return 2
    pin = device.type == "cuda"
    data = make_loader(args.steps, args.batch_size, args.image_size, pin)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [
        "# Trainer overhead over a hand-written `mixprec.Precision` loop",
        "",
        f"{name}, torch {torch.__version__}; blog CNN on {args.image_size}x{args.image_size} "
        f"images, batch {args.batch_size}, Adam, {args.steps} steps per epoch from a "
        f"{'pinned ' if pin else ''}DataLoader; medians of {args.rounds} rounds after a "
        "warm-up round.",
        "",
        "| precision | hand ms/step | Trainer bare ms/step | Trainer defaults ms/step |",
        "|---|---:|---:|---:|",
    ]
    for spec in args.precision:
        times = measure(spec, data, device, args.rounds)
        ms = {w: statistics.median(times[w]) / args.steps * 1e3 for w in WAYS}
        lines.append(
            f"| {spec} | {ms['hand']:.2f} | {ms['bare']:.2f} ({ms['bare'] / ms['hand'] - 1:+.1%}) "
            f"| {ms['defaults']:.2f} ({ms['defaults'] / ms['hand'] - 1:+.1%}) |"
        )
        print(lines[-1], flush=True)
        if args.out is not None:  # after each row, so a run stopped by its budget keeps it
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
