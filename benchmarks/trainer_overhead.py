"""What the Trainer costs over a hand-written loop through `mixprec.Precision`.

The same model, data, optimizer and precision train for the same number of steps three
ways, interleaved round by round (this machine is shared and noisy, so only side-by-side
numbers mean much):

- hand: a minimal loop (`Precision.setup`, `backward`, `step`, `zero_grad`);
- Trainer, bare: ``logger=False``, no checkpoint, no progress bar;
- Trainer, defaults: CSV and TensorBoard logging every 50 steps and a checkpoint at the end.

Two figures per way: the training loop's time per step (from the first batch to the end of
the last step: what grows with the run) and the one-off cost around it (setup, logger
files, the final checkpoint). Medians over rounds.

    python benchmarks/trainer_overhead.py [--rounds 7] [--steps 100] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec
from mixprec.precision import Precision
from mixprec.trainer import Callback, Trainer


def mlp(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10)
    )


def loader(steps: int, batch: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, 256, generator=g)
    y = torch.randint(0, 10, (steps * batch,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)


def hand(model: nn.Module, data: DataLoader, spec: str) -> float:
    """Train one epoch by hand; return the loop's seconds."""
    precision = Precision(spec)
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    t0 = time.perf_counter()
    for x, y in data:
        precision.backward(F.cross_entropy(model(x), y))
        precision.step(opt)
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


class LoopTimer(Callback):
    """Seconds from the start of the epoch to its end (before the checkpoint is written)."""

    def on_train_epoch_start(self, trainer, model):
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer, model):
        self.seconds = time.perf_counter() - self.start


def trainer(model: nn.Module, data: DataLoader, spec: str, defaults: bool) -> float:
    """Train one epoch with the Trainer; return the loop's seconds."""
    timer = LoopTimer()
    with tempfile.TemporaryDirectory() as root:
        t = Trainer(
            precision=spec,
            max_epochs=1,
            callbacks=[timer],
            logger=defaults,
            enable_checkpointing=defaults,
            enable_progress_bar=False,
            default_root_dir=root,
        )
        t.fit(
            model,
            data,
            loss_fn=F.cross_entropy,
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        )
    return timer.seconds


WAYS = ("hand", "bare", "defaults")


def measure(spec: str, width: int, batch: int, steps: int, rounds: int) -> dict[str, float]:
    """Median loop and whole-run seconds of each way; rounds interleaved, order rotating."""
    torch.manual_seed(0)
    base = mlp(width)
    data = loader(steps, batch)
    times: dict[str, list[float]] = {f"{w}_{k}": [] for w in WAYS for k in ("loop", "all")}
    for r in range(rounds + 1):  # round 0 warms up (imports, allocator, thread pools)
        for way in WAYS[r % 3 :] + WAYS[: r % 3]:
            model = copy.deepcopy(base)
            t0 = time.perf_counter()
            if way == "hand":
                loop = hand(model, data, spec)
            else:
                loop = trainer(model, data, spec, defaults=way == "defaults")
            if r:
                times[f"{way}_all"].append(time.perf_counter() - t0)
                times[f"{way}_loop"].append(loop)
    return {k: statistics.median(v) for k, v in times.items()}


CONFIGS = (
    ("32-true", 1024, 128),
    ("bf16-mixed", 1024, 128),
    ("32-true", 256, 64),
    ("bf16-mixed", 256, 64),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default=None, help="write a markdown result file here")
    args = parser.parse_args(argv)
    rows = []
    for spec, width, batch in CONFIGS:
        t = measure(spec, width, batch, args.steps, args.rounds)
        params = sum(p.numel() for p in mlp(width).parameters())
        ms = {w: t[f"{w}_loop"] / args.steps * 1e3 for w in WAYS}
        fixed = {w: (t[f"{w}_all"] - t[f"{w}_loop"]) * 1e3 for w in WAYS}
        rows.append(
            f"| {spec} | MLP 256-{width}-{width}-10 ({params / 1e6:.2f}M), batch {batch} "
            f"| {ms['hand']:.2f} | {ms['bare']:.2f} ({ms['bare'] / ms['hand'] - 1:+.1%}) "
            f"| {ms['defaults']:.2f} ({ms['defaults'] / ms['hand'] - 1:+.1%}) "
            f"| {fixed['hand']:.0f} / {fixed['bare']:.0f} / {fixed['defaults']:.0f} |"
        )
        print(rows[-1], flush=True)
    lines = [
        "# Trainer overhead over a hand-written `mixprec.Precision` loop",
        "",
        f"Command: `python benchmarks/trainer_overhead.py --rounds {args.rounds} --steps "
        f"{args.steps}`",
        f"Device: {mixprec.hardware.detect('cpu').describe()}; torch {torch.__version__}",
        "",
        "| precision | model | hand loop ms/step | Trainer bare ms/step | Trainer defaults "
        "ms/step | one-off ms: hand / bare / defaults |",
        "|---|---|---:|---:|---:|---:|",
        *rows,
        "",
        f"Each run trains one epoch of {args.steps} steps (AdamW, cross-entropy, shuffled "
        "DataLoader) from the same initial weights. ms/step is the training loop's time "
        "(first batch to last step, data loading included) divided by the steps; the "
        "percentage is the Trainer's extra time per step over the hand loop (negative values "
        "are noise). One-off is the rest of the run: setup, logger files, and for "
        "'defaults' the end-of-epoch checkpoint (written atomically with fsync). "
        f"Medians of {args.rounds} rounds; in each round the three ways run back to back in "
        "a rotating order. 'Bare' is `Trainer(logger=False, enable_checkpointing=False, "
        "enable_progress_bar=False)`; 'defaults' has the CSV and TensorBoard loggers (loss, "
        "lr, samples/s and peak memory every 50 steps) and the ModelCheckpoint.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
