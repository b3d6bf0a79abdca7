"""The PrecisionMonitor over several processes: each rank judges the step the model took."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.distributed as dist
from spawning import run_ranks
from torch import nn

from mixprec import PrecisionMonitor

pytestmark = pytest.mark.slow


def _monitored_step(rank: int, across: bool) -> dict[str, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16, bias=False), nn.Linear(16, 1, bias=False))
    monitor = PrecisionMonitor(every_n_steps=1, across_ranks=across).attach(model)
    x = torch.randn(8, 4)
    if rank == 1:  # (only this rank's activations underflow bfloat16)
        x = x * 1e-39
    monitor.start_step(0)
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("ignore")
        model(x).float().sum().backward()
        monitor.end_step(0)
    return {name: samples[-1].underflow for name, samples in monitor.history.items()}


def _worker(rank: int) -> None:
    alone = _monitored_step(rank, across=False)
    combined = _monitored_step(rank, across=True)
    seen: list = [None, None]
    dist.all_gather_object(seen, (alone, combined))
    (alone0, combined0), (alone1, combined1) = seen
    assert set(alone0.values()) == {0.0} and set(alone1.values()) == {1.0}
    assert combined0 == combined1 and all(0.4 < u < 0.6 for u in combined0.values())


def test_a_monitor_across_ranks_judges_every_ranks_values():
    """Under DDP and FSDP each rank's monitor saw its own share of the batch, and rank 0's
    (the one that logs and hands its state back) said nothing of a rank whose activations
    all underflowed."""
    run_ranks(_worker)


def test_a_trainer_running_several_processes_combines_the_ranks():
    monitor = PrecisionMonitor()
    monitor.on_fit_start(types.SimpleNamespace(world_size=2), nn.Linear(2, 2))
    assert monitor.across_ranks
    monitor.on_fit_start(types.SimpleNamespace(world_size=1), nn.Linear(2, 2))
    assert not monitor.across_ranks
