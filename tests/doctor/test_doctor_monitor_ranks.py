"""The PrecisionMonitor over several processes: each rank judges the step the model took."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawning import run_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec import PrecisionMonitor
from mixprec.trainer import Callback, Trainer, TrainingModule

pytestmark = pytest.mark.slow


def _monitored_step(rank: int, across: bool, scale: float, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16, bias=False), nn.Linear(16, 1, bias=False))
    monitor = PrecisionMonitor(every_n_steps=1, across_ranks=across).attach(model)
    x = torch.randn(8, 4)
    if rank == 1:  # (only this rank's activations leave the dtype's range)
        x = x * scale
    monitor.start_step(0)
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=dtype):
        warnings.simplefilter("ignore")
        model(x).float().sum().backward()
        monitor.end_step(0)
    last = {name: samples[-1] for name, samples in monitor.history.items()}
    return {name: (s.underflow, s.amax) for name, s in last.items()}


def _overflow_step(rank: int) -> float:
    """Layer 0's amax, combined, where rank 1's float16 output overflows to +inf (no NaN:
    positive inputs and weights)."""
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    nn.init.ones_(model[0].weight)
    monitor = PrecisionMonitor(every_n_steps=1, across_ranks=True).attach(model)
    x = torch.full((2, 4), 30000.0 if rank == 1 else 1.0)
    monitor.start_step(0)
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.float16):
        warnings.simplefilter("ignore")
        model(x)
        monitor.end_step(0)
    return monitor.history["0"][-1].amax


def _worker(rank: int) -> None:
    alone = _monitored_step(rank, False, 1e-39, torch.bfloat16)
    combined = _monitored_step(rank, True, 1e-39, torch.bfloat16)
    overflow = _overflow_step(rank)
    seen: list = [None, None]
    dist.all_gather_object(seen, (alone, combined, overflow))
    (alone0, combined0, over0), (alone1, combined1, over1) = seen
    assert {u for u, _ in alone0.values()} == {0.0} and {u for u, _ in alone1.values()} == {1.0}
    assert combined0 == combined1 and all(0.4 < u < 0.6 for u, _ in combined0.values())
    # an overflow to inf on one rank stays inf on both (not float32's largest number)
    assert over0 == over1 == math.inf


def test_a_monitor_across_ranks_judges_every_ranks_values():
    """Under DDP and FSDP each rank's monitor saw its own share of the batch, and rank 0's
    (the one that logs and hands its state back) said nothing of a rank whose activations
    all underflowed."""
    run_ranks(_worker)


class _Rank1Underflows(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(nn.Linear(4, 16, bias=False), nn.Linear(16, 1, bias=False))

    def forward(self, x):
        return self.blocks(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.strategy.global_rank == 1:
            x = x * 1e-39
        return F.mse_loss(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _OwnAcrossRanks(Callback):
    """A callback of the user's with an ``across_ranks`` of its own, read-only."""

    @property
    def across_ranks(self) -> None:
        return None


def test_a_trainer_starting_its_processes_combines_its_monitors_ranks(tmp_path):
    """(And leaves other callbacks' attributes alone: one with a read-only ``across_ranks``
    failed the fit.)"""
    monitor = PrecisionMonitor(every_n_steps=1)
    trainer = Trainer(
        precision="bf16-mixed", strategy="ddp_fork", devices=2, max_steps=1, seed=0,
        allow_slow_precision=True, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, default_root_dir=tmp_path,
        callbacks=[monitor, _OwnAcrossRanks()],
    )  # fmt: skip
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Rank1Underflows(), DataLoader(data, batch_size=4))
    assert monitor.across_ranks is None  # (the caller's own: the processes' copies chose)
    assert all(0.4 < samples[-1].underflow < 0.6 for samples in monitor.history.values())
