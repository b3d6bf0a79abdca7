"""The Trainer inside processes that are already one group: a script's own
``init_process_group`` (as under srun, without torchrun's variables) is joined, not launched
again; a single-device Trainer in one of several processes is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawning import WORLD, run_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainers import SILENT

from mixprec.trainer import Trainer


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def _joined(rank: int, out: str) -> None:
    """A rank in a group its script initialised, without torchrun's variables (removed
    here: `run_ranks` sets them)."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    trainer = Trainer(strategy="ddp", devices=WORLD, max_steps=3, enable_checkpointing=False,
                      default_root_dir=out, **SILENT)  # fmt: skip
    trainer.fit(model, DataLoader(data(), batch_size=4), loss_fn=F.mse_loss)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    every = [torch.empty_like(weights) for _ in range(WORLD)]
    dist.all_gather(every, weights)
    seen = (trainer.world_size, trainer.global_rank, trainer.local_rank)
    torch.save({"seen": seen, "weights": every, "pid": os.getpid()}, Path(out) / f"r{rank}.pt")


@pytest.mark.slow
def test_a_group_the_script_initialised_is_joined_not_launched_again(tmp_path):
    """Found by a review: each rank of a group initialised by hand launched a DDP run of its
    own (four processes, two trainings, each rank its run's rank 0)."""
    run_ranks(_joined, str(tmp_path), nprocs=WORLD)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"r{rank}.pt")
        assert got["seen"] == (WORLD, rank, rank)
        assert torch.equal(got["weights"][0], got["weights"][1])  # (one run's replicas)


def test_one_device_in_one_of_several_processes_is_refused(monkeypatch, tmp_path):
    """Found by a review: under torchrun with the default devices each process trained the
    same run and wrote the same checkpoints; in an initialised group the loss scale's
    overflow flag waited on the others' collectives (a hang when their step counts
    differed)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = nn.Linear(4, 1)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(max_steps=2, default_root_dir=tmp_path, **SILENT)
    with pytest.raises(ValueError, match="one of 2 in a process group.*strategy='ddp' or 'fsdp'"):
        trainer.fit(model, DataLoader(data(), batch_size=4), loss_fn=F.mse_loss)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    # (an evaluation or a prediction on one process, as after a DDP fit, runs: found by a
    # review, the refusal first covered them too)
    one = Trainer(default_root_dir=tmp_path, **SILENT)
    assert len(one.predict(model, DataLoader(data().tensors[0], batch_size=8))) == 4
    one.validate(model, DataLoader(data(), batch_size=8), loss_fn=F.mse_loss)
    monkeypatch.setenv("WORLD_SIZE", "1")
    Trainer(max_steps=1, default_root_dir=tmp_path, **SILENT).fit(
        model, DataLoader(data(), batch_size=4), loss_fn=F.mse_loss
    )
