"""One-file checkpoints of Trainer(strategy="ddp"): every rank's own random generators and
training-epoch sums go into the file when every rank saves it (ModelCheckpoint), so a
mid-epoch resume is bit-identical to not stopping on every rank, replicas seeded apart
included, and the resumed epoch's means are the whole epoch's.

One group of two processes runs the distributed part (joined by the Trainer as a
torchrun-launched one would be)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from spawning import WORLD, run_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainers import SILENT

from mixprec.trainer import Callback, ModelCheckpoint, Trainer, TrainingModule

pytestmark = pytest.mark.slow


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    return TensorDataset(x, torch.randint(0, 3, (64,), generator=g))


class ApartDropoutNet(TrainingModule):
    """Dropout drawn from generators each rank seeds apart (replicas of a data-parallel
    run that should not drop the same units); the loss logged per rank, without
    sync_dist, as an epoch mean."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 3))

    def on_fit_start(self) -> None:
        torch.manual_seed(100 + self.trainer.global_rank)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class Record(Callback):
    """Each rank's weights at the fit's end and the epoch means it logged."""

    def __init__(self, path: Path) -> None:
        self.path, self.means = path, {}

    def on_train_epoch_end(self, trainer, model):
        self.means[trainer.current_epoch] = float(trainer.callback_metrics["train_loss"])

    def on_fit_end(self, trainer, model):
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        ranks = (trainer.global_rank, trainer.local_rank)  # (Lightning's names)
        torch.save({"weights": weights, "means": self.means, "ranks": ranks}, self.path)


def _fit(root: Path, max_steps: int, callbacks: list, **fit: Any) -> None:
    trainer = Trainer(strategy="ddp", devices=WORLD, max_steps=max_steps, callbacks=callbacks,
                      seed=0, default_root_dir=root, **SILENT)  # fmt: skip
    trainer.fit(ApartDropoutNet(), DataLoader(data(), batch_size=8, shuffle=True), **fit)


def _worker(rank: int, out: str) -> None:
    d = Path(out)
    _fit(d, 8, [Record(d / f"straight{rank}.pt")])  # two epochs of 4 batches per rank

    def every_3() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=d / "half", every_n_train_steps=3, save_top_k=-1)

    _fit(d, 3, [every_3()])  # saved mid-epoch 0, after batch 3 of 4
    resumed = Record(d / f"resumed{rank}.pt")
    _fit(d, 8, [every_3(), resumed], ckpt_path=d / "half" / "epoch=0-step=3.ckpt")


def test_a_mid_epoch_resume_restores_each_ranks_generators_and_epoch_sums(tmp_path):
    """Found by a review: the one file rank 0 writes held rank 0's generators and no epoch
    sums, so after a resume rank 1 drew rank 0's dropout masks (its weights left the run
    that never stopped) and the resumed epoch's mean covered only the batches after the
    resume. ModelCheckpoint's saves, which every rank makes, now gather each rank's."""
    run_ranks(_worker, str(tmp_path), nprocs=WORLD)
    for rank in range(WORLD):
        straight = torch.load(tmp_path / f"straight{rank}.pt")
        resumed = torch.load(tmp_path / f"resumed{rank}.pt")
        for name, value in straight["weights"].items():
            assert torch.equal(value, resumed["weights"][name]), (rank, name)
        assert straight["means"] == resumed["means"], rank
        assert straight["ranks"] == resumed["ranks"] == (rank, rank)
    # (the ranks' replicas are one model: DDP averages their gradients)
    zero, one = (torch.load(tmp_path / f"straight{r}.pt")["weights"] for r in range(WORLD))
    assert all(torch.equal(v, one[k]) for k, v in zero.items())


def _after_fit(rank: int, port: int, out: str) -> None:
    """A rank of a torchrun-style launch whose process group the Trainer makes (and ends
    with its fit), saving with every_rank=True after the fit."""
    import os
    import warnings

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")  # fmt: skip
    torch.set_num_threads(1)
    trainer = Trainer(strategy="ddp", devices=2, max_steps=2, enable_checkpointing=False,
                      default_root_dir=out, **SILENT)  # fmt: skip
    trainer.fit(ApartDropoutNet(), DataLoader(data(), batch_size=8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.save_checkpoint(Path(out) / "after.ckpt", every_rank=True)
    said = [str(w.message) for w in caught if "every_rank=True) after the fit" in str(w.message)]
    Path(out, f"said{rank}").write_text("\n".join(said))


def test_every_rank_after_a_fit_whose_group_is_gone_writes_rank_zeros_and_says_so(tmp_path):
    """Found by a review: after a fit that made its own process group (ended with the fit),
    ``save_checkpoint(path, every_rank=True)`` failed in the gather; rank 0 now writes its
    own states, with a warning saying so."""
    import torch.multiprocessing as mp

    from mixprec.trainer.strategy import free_port

    mp.start_processes(_after_fit, args=(free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn")  # fmt: skip
    saved = torch.load(tmp_path / "after.ckpt", weights_only=True)
    assert "ranks" not in saved and saved["loop"]["global_step"] == 2
    assert all((tmp_path / f"said{r}").read_text() for r in range(2))
