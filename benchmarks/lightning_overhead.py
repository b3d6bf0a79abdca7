"""Lightning with mixprec's precision plugin vs Lightning's own precision, side by side.

The same LightningModule (an MLP, AdamW, cross-entropy), initial weights and batches train
in a Lightning ``Trainer`` two ways per precision:

- Lightning: ``pl.Trainer(precision=spec)`` (its ``MixedPrecision`` / default plugin);
- mixprec: ``pl.Trainer(plugins=[MixprecPrecision(spec, allow_slow=True)])``.

This machine is shared and noisy (load far above its core count), so the two runs train in
lockstep: each in its own process, taking turns step by step (the order flips every step)
and timing each step on its own clock while the other one waits; both are pinned to the
same CPU (``--cpu``), so neither gets a quieter core. Whatever else runs on the machine then
disturbs both alike. One step is everything from the end of one batch to the
end of the next: data loading, ``convert_input``, hooks, forward, backward, optimizer and
scheduler steps, Lightning's bookkeeping. Reported per precision: the median step time of
each way over all rounds, their ratio and its range over rounds, and how far the two loss
curves are apart. torch runs on one thread per process; the clock is the process's main
thread CPU time by default (``--clock wall`` for the wall clock).

    python benchmarks/lightning_overhead.py [--rounds 3] [--steps 300] [--width 256]
        [--specs bf16-mixed 32-true] [--out FILE]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
import warnings
from multiprocessing.connection import Connection

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec
from mixprec.integrations.lightning import MixprecPrecision

CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
WAYS = ("lightning", "mixprec")


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


class TakeTurns(pl.Callback):
    """Waits for the parent's go before each step and reports the step's time after it."""

    def __init__(self, conn: Connection, clock: str) -> None:
        self.conn = conn
        self.clock = CLOCKS[clock]
        self.start = 0.0

    def _wait(self) -> None:
        self.conn.recv()
        self.start = self.clock()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._wait()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: object,
        batch: object,
        batch_idx: int,
    ) -> None:
        self.conn.send(self.clock() - self.start)
        self._wait()


def mlp(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10)
    )


def worker(
    way: str, spec: str, width: int, batch: int, steps: int, clock: str, cpu: int, conn
) -> None:
    """Train one epoch in lockstep with the other way; send back the losses at the end."""
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = LitMLP(mlp(width))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, 64, generator=g)
    y = torch.randint(0, 10, (steps * batch,), generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)
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
        callbacks=[TakeTurns(conn, clock)],
        **flags,
    )
    trainer.fit(model, data)
    conn.send(torch.stack(model.losses).tolist())


def one_round(args: argparse.Namespace, spec: str) -> dict[str, tuple[list[float], list[float]]]:
    """Both ways in lockstep for one epoch: {way: (step seconds, losses)}."""
    ctx = mp.get_context("spawn")
    conns, procs = {}, []
    for way in WAYS:
        here, there = ctx.Pipe()
        p = ctx.Process(
            target=worker,
            args=(way, spec, args.width, args.batch, args.steps, args.clock, args.cpu, there),
        )
        p.start()
        conns[way] = here
        procs.append(p)
    seconds: dict[str, list[float]] = {w: [] for w in WAYS}
    for step in range(args.steps):
        for way in WAYS if step % 2 else WAYS[::-1]:
            conns[way].send("go")
            seconds[way].append(conns[way].recv())
    for way in WAYS:
        conns[way].send("go")  # past the last step: let both finish
    out = {way: (seconds[way][2:], conns[way].recv()) for way in WAYS}
    for p in procs:
        p.join()
    return out


def measure(args: argparse.Namespace, spec: str) -> dict[str, float]:
    steps: dict[str, list[float]] = {w: [] for w in WAYS}
    ratios, gaps = [], []
    finals: dict[str, float] = {}
    for _ in range(args.rounds):
        out = one_round(args, spec)
        for way in WAYS:
            steps[way] += out[way][0]
        ratios.append(statistics.median(out["mixprec"][0]) / statistics.median(out["lightning"][0]))
        curves = [out[w][1] for w in WAYS]
        gaps.append(max(abs(a - b) for a, b in zip(*curves, strict=True)))
        finals = {w: out[w][1][-1] for w in WAYS}
    lightning, ours = (statistics.median(steps[w]) for w in WAYS)
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--specs", nargs="+", default=["bf16-mixed", "32-true"])
    parser.add_argument(
        "--cpu", type=int, default=0, help="the one CPU both runs are pinned to (-1: not pinned)"
    )
    parser.add_argument("--out", default=None, help="write a markdown result file here")
    args = parser.parse_args(argv)
    rows = []
    for spec in args.specs:
        t = measure(args, spec)
        rows.append(
            f"| {spec} | {t['lightning_ms']:.2f} | {t['mixprec_ms']:.2f} "
            f"| {t['ratio'] - 1:+.1%} ({t['ratio_lo'] - 1:+.1%} to {t['ratio_hi'] - 1:+.1%}) "
            f"| {t['lightning_final']:.6f} / {t['mixprec_final']:.6f} | {t['max_loss_gap']:.2g} |"
        )
        print(rows[-1], flush=True)
    params = sum(p.numel() for p in mlp(args.width).parameters())
    clock = "CPU time of each process's main thread" if args.clock == "cpu" else "wall clock"
    lines = [
        "# Lightning with `MixprecPrecision` vs Lightning's own precision",
        "",
        f"Command: `python benchmarks/lightning_overhead.py --rounds {args.rounds} --steps "
        f"{args.steps} --width {args.width} --batch {args.batch} --clock {args.clock} "
        f"--specs {' '.join(args.specs)} --cpu {args.cpu}`",
        f"Device: {mixprec.hardware.detect('cpu').describe()}, one torch thread per run"
        + (f", both runs pinned to CPU {args.cpu}; " if args.cpu >= 0 else "; ")
        + f"torch {torch.__version__}, pytorch-lightning {pl.__version__}",
        "",
        "| precision | Lightning `precision=` ms/step | `MixprecPrecision` ms/step | plugin vs "
        "Lightning (range over rounds) | final loss: Lightning / plugin | max loss gap |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Model: MLP 64-{args.width}-{args.width}-10 ({params / 1e6:.2f}M parameters), batch "
        f"{args.batch}, AdamW, cross-entropy, one epoch of {args.steps} steps from the same "
        "initial weights over the same batches. The two runs of a round train in lockstep in "
        "two processes, one step each in turn (the order flipping every step). ms/step is "
        f"the median step time ({clock}; end of one batch to the end of the next) over all "
        f"{args.rounds} rounds, without each run's first two steps; the percentage compares "
        "those medians, the range is the same ratio per round. 'max loss gap' is the largest "
        "difference between the two runs' losses at the same step, over all steps and rounds. "
        "On this CPU bfloat16 matmuls are much slower than float32 (no AMX/AVX512-BF16): "
        "`allow_slow=True` lets the plugin run them; Lightning runs them without asking.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
