"""Lightning with mixprec's precision plugin vs Lightning's own precision, side by side.

The same LightningModule (an MLP, AdamW, cross-entropy), initial weights and batches train
one epoch per run in a Lightning ``Trainer``, two ways per precision:

- Lightning: ``pl.Trainer(precision=spec)`` (its ``MixedPrecision`` / default plugin);
- mixprec: ``pl.Trainer(plugins=[MixprecPrecision(spec, allow_slow=True)])``.

The two ways alternate round by round (the order flips each round) in one process; this
machine is shared and noisy, so only these paired numbers mean much. Reported: the median
iteration time of each way, their ratio and its range over rounds, and how far the two loss
curves are apart. torch runs on ``--threads`` threads (default 1: with other
jobs on the cores, more threads spin against each other).

    python benchmarks/lightning_overhead.py [--rounds 15] [--steps 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import logging
import statistics
import sys
import time
import warnings

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec
from mixprec.integrations.lightning import MixprecPrecision


class LitMLP(pl.LightningModule):
    """An MLP classifier; keeps each step's loss."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.detach().float())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepTimer(pl.Callback):
    """Seconds of each training iteration: from one batch's start to the next one's (data
    loading, forward, backward, optimizer and scheduler steps, Lightning's bookkeeping), and
    for the last one to the epoch's end."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        self.marks.append(time.perf_counter())

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.marks.append(time.perf_counter())

    def steps(self, skip: int) -> list[float]:
        """Per-iteration seconds, without the first ``skip`` (allocator, caches warming)."""
        return [b - a for a, b in itertools.pairwise(self.marks)][skip:]


def mlp(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10)
    )


def loader(steps: int, batch: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, 64, generator=g)
    y = torch.randint(0, 10, (steps * batch,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def run(way: str, spec: str, base: nn.Module, data: DataLoader) -> tuple[list[float], list[float]]:
    """One epoch; returns (seconds of each iteration but the first two, the losses)."""
    model, timer = LitMLP(copy.deepcopy(base)), StepTimer()
    flags = (
        {"precision": spec}
        if way == "lightning"
        else {"plugins": [MixprecPrecision(spec, allow_slow=True)]}
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        **flags,
    )
    trainer.fit(model, data)
    return timer.steps(skip=2), torch.stack(model.losses).tolist()


WAYS = ("lightning", "mixprec")


def measure(spec: str, width: int, batch: int, steps: int, rounds: int) -> dict[str, float]:
    """Median iteration time of each way over all rounds, the median ratio and the range of
    the per-round ratios, and how far apart the loss curves are."""
    torch.manual_seed(0)
    base, data = mlp(width), loader(steps, batch)
    seconds: dict[str, list[float]] = {w: [] for w in WAYS}
    ratios: list[float] = []
    gaps: list[float] = []
    finals: dict[str, float] = {}
    for r in range(rounds + 1):  # round 0 warms up
        order = WAYS if r % 2 else WAYS[::-1]
        out = {way: run(way, spec, base, data) for way in order}
        if not r:
            continue
        for way in WAYS:
            seconds[way] += out[way][0]
        ratios.append(statistics.median(out["mixprec"][0]) / statistics.median(out["lightning"][0]))
        curves = [out[w][1] for w in WAYS]
        gaps.append(max(abs(a - b) for a, b in zip(*curves, strict=True)))
        finals = {w: out[w][1][-1] for w in WAYS}
    lightning, ours = (statistics.median(seconds[w]) for w in WAYS)
    return {
        "lightning_ms": lightning * 1e3,
        "mixprec_ms": ours * 1e3,
        "ratio": ours / lightning,
        "ratio_lo": min(ratios),
        "ratio_hi": max(ratios),
        "max_loss_gap": max(gaps),
        "lightning_final": finals["lightning"],
        "mixprec_final": finals["mixprec"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write a markdown result file here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    rows = []
    for spec in ("bf16-mixed", "32-true"):
        t = measure(spec, args.width, args.batch, args.steps, args.rounds)
        rows.append(
            f"| {spec} | {t['lightning_ms']:.2f} | {t['mixprec_ms']:.2f} "
            f"| {t['ratio'] - 1:+.1%} ({t['ratio_lo'] - 1:+.1%} to {t['ratio_hi'] - 1:+.1%}) "
            f"| {t['lightning_final']:.6f} / {t['mixprec_final']:.6f} | {t['max_loss_gap']:.2g} |"
        )
        print(rows[-1], flush=True)
    params = sum(p.numel() for p in mlp(args.width).parameters())
    lines = [
        "# Lightning with `MixprecPrecision` vs Lightning's own precision",
        "",
        f"Command: `python benchmarks/lightning_overhead.py --rounds {args.rounds} --steps "
        f"{args.steps} --width {args.width} --batch {args.batch} --threads {args.threads}`",
        f"Device: {mixprec.hardware.detect('cpu').describe()}, torch on {args.threads} "
        f"thread(s); torch {torch.__version__}, pytorch-lightning {pl.__version__}",
        "",
        "| precision | Lightning `precision=` ms/step | `MixprecPrecision` ms/step | plugin time "
        "vs Lightning (per-round range) | final loss: Lightning / plugin | max loss gap |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Model: MLP 64-{args.width}-{args.width}-10 ({params / 1e6:.2f}M parameters), batch "
        f"{args.batch}, AdamW, cross-entropy, one epoch of {args.steps} steps per run from the "
        "same initial weights over the same batches. ms/step is the median time of one "
        "training iteration (batch start to the next batch's start: data loading, forward, "
        "backward, optimizer and scheduler steps, Lightning's bookkeeping) over all runs, "
        "without each run's first two iterations; the percentage compares those medians, "
        "and the range is that of the same ratio computed per round. Both ways run once per "
        f"round, {args.rounds} rounds after one warm-up round, the order flipping each round. "
        "'max loss gap' is the largest difference between the two runs' losses at the same "
        "step, over all steps and rounds. On this CPU bfloat16 matmuls are much slower than "
        "float32 (no AMX/AVX512-BF16): `allow_slow=True` lets the plugin run them; Lightning "
        "runs them without asking.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
