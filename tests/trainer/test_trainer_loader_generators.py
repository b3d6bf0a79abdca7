"""A DataLoader ordered by a generator of its own (``generator=``, or a ``RandomSampler``'s)
or by numpy's or Python's global one (a hand-written sampler):
a checkpoint keeps that generator's state, so a resumed fit draws the next epochs' orders as
a fit that never stopped does, at an epoch's end as in its middle."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, Sampler, TensorDataset
from trainers import SILENT

from mixprec.trainer import Trainer, TrainingModule
from mixprec.trainer import checkpoint as ckpt_io


class Net(TrainingModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def _own_generator() -> DataLoader:
    return DataLoader(
        _data(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5)
    )


def _sampler_generator() -> DataLoader:
    data = _data()
    return DataLoader(
        data, batch_size=8, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(5))
    )


class _GlobalShuffle(Sampler):
    """A sampler shuffling with numpy's or Python's global generator, as hand-written ones
    often do: a resume inside an epoch replayed torch's generators alone, so the rest of
    the epoch came in another order (samples seen twice, others skipped)."""

    def __init__(self, n: int, lib: str) -> None:
        self.n, self.lib = n, lib

    def __iter__(self):
        if self.lib == "numpy":
            return iter(np.random.permutation(self.n).tolist())
        order = list(range(self.n))
        random.shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return self.n


class _Buckets(Sampler):
    """A batch sampler drawing its batches with a generator of its own (a bucketing one):
    the checkpoint kept no state of it, so a resumed fit replayed the first epoch's order."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size
        self.generator = torch.Generator().manual_seed(7)

    def __iter__(self):
        order = torch.randperm(self.n, generator=self.generator).tolist()
        return iter([order[i : i + self.size] for i in range(0, self.n, self.size)])

    def __len__(self) -> int:
        return -(-self.n // self.size)


LOADERS = {
    "DataLoader(generator=)": _own_generator,
    "RandomSampler(generator=)": _sampler_generator,
    "numpy sampler": lambda: DataLoader(_data(), batch_size=8, sampler=_GlobalShuffle(48, "numpy")),
    "random sampler": lambda: DataLoader(
        _data(), batch_size=8, sampler=_GlobalShuffle(48, "python")
    ),
    "batch sampler(generator)": lambda: DataLoader(_data(), batch_sampler=_Buckets(48, 8)),
    # (a resumed process's new loader drew its workers' seed before its first order: every
    # order after the resume was shifted by one draw)
    "persistent workers": lambda: DataLoader(
        _data(), batch_size=8, shuffle=True, num_workers=1, persistent_workers=True
    ),
}


def _fit(loader: Callable[[], DataLoader], ckpt_path: Path | None = None, **stop) -> Trainer:
    """A fit of a fresh loader built as the first was (its generator seeded anew, as a
    resumed script builds it), 6 batches an epoch."""
    t = Trainer(seed=0, deterministic=True, enable_checkpointing=False, **SILENT, **stop)
    data = loader()
    t.fit(Net(0 if ckpt_path is None else 1), data, ckpt_path=ckpt_path)
    # (persistent workers collected with the Trainer in one cycle wait 5 s each to join:
    # stopped here, while the loader is whole)
    workers = getattr(data, "_iterator", None)
    if workers is not None:
        workers._shutdown_workers()
    return t


def _same_weights(a: Trainer, b: Trainer) -> None:
    for (name, x), y in zip(
        a.model.state_dict().items(), b.model.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("loader", LOADERS.values(), ids=LOADERS)
@pytest.mark.parametrize(
    "stop",
    [dict(max_epochs=1), dict(max_steps=6), dict(max_steps=9), dict(max_steps=3)],
    ids=["epoch-end", "epoch-last-batch", "mid-epoch-1", "mid-epoch-0"],
)
def test_a_resumed_fit_draws_the_loaders_next_orders_as_an_uninterrupted_one(
    tmp_path, loader, stop
):
    straight = _fit(loader, max_epochs=2)
    path = _fit(loader, **stop).save_checkpoint(tmp_path / "stop.ckpt")
    resumed = _fit(loader, path, max_epochs=2)
    assert resumed.global_step == straight.global_step == 12
    _same_weights(straight, resumed)


def test_the_checkpoint_holds_the_loaders_generator_as_it_is_at_the_save(tmp_path):
    loader = _own_generator()
    t = Trainer(max_epochs=1, seed=0, enable_checkpointing=False, **SILENT)
    t.fit(Net(0), loader)
    state = ckpt_io.load(t.save_checkpoint(tmp_path / "x.ckpt"))
    (saved,) = state["loop"]["loader_rng"]
    assert torch.equal(saved, loader.generator.get_state())
    assert not torch.equal(saved, torch.Generator().manual_seed(5).get_state())
