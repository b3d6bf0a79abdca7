"""A DataLoader subclass keeps its class: a mid-epoch resume iterates it (dropping the
batches already trained on) instead of rebuilding a plain DataLoader, and DDP, which would
have to rebuild it to insert its sampler, asks for a DistributedSampler instead."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from trainers import SILENT

from mixprec.trainer import Callback, ModelCheckpoint, Trainer
from mixprec.trainer.data import distributed


class ScaledLoader(DataLoader):
    """Scales its batches in ``__iter__``, as a loader normalising or augmenting does, and
    yields full batches only (its own code reading its batch_size)."""

    def __iter__(self):
        for x, y in super().__iter__():
            if len(x) == self.batch_size:
                yield x * 100.0, y * 100.0


class Largest(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int, float]] = []

    def on_train_batch_start(self, trainer, model, batch, batch_idx):
        self.seen.append((trainer.current_epoch, batch_idx, float(batch[0].abs().max())))


def loader() -> ScaledLoader:
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
    return ScaledLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)


def _fit(root, callbacks, ckpt_path=None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(6, 1)
    trainer = Trainer(max_epochs=2, seed=0, default_root_dir=root, callbacks=callbacks, **SILENT)
    trainer.fit(model, loader(), loss_fn=F.mse_loss, ckpt_path=ckpt_path,
                optimizer=lambda p: torch.optim.SGD(p, lr=1e-5))  # fmt: skip
    return model


def test_a_mid_epoch_resume_keeps_the_loaders_class(tmp_path):
    """Found by a review: the resumed epoch's batches came from a plain DataLoader rebuilt
    from the subclass's options (unscaled, max |x| 3.4 where the run had 341.1)."""
    straight = Largest()
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1,
                            filename="{step}")  # fmt: skip
    ref = _fit(tmp_path, [straight, saves])
    resumed = Largest()
    model = _fit(tmp_path, [resumed], ckpt_path=tmp_path / "2.ckpt")
    assert resumed.seen == straight.seen[2:]
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters(), strict=True))


def test_ddp_shards_a_loader_subclass_keeping_its_class():
    """Rebuilt with a DistributedSampler, the subclass became a plain DataLoader for the
    whole run (its __iter__ gone: other data, no warning); a first fix refused subclasses,
    which a launched run cannot give a DistributedSampler of its own. The copy keeps the
    class and its options, and each rank gets its half; one given its own DistributedSampler
    is used as it is."""
    whole = loader()
    halves = [distributed(whole, rank, 2, 0) for rank in range(2)]
    seen = []
    for half in halves:
        assert type(half) is ScaledLoader and len(half) == 2
        assert isinstance(half.sampler, DistributedSampler)
        seen += [x for x, _ in half]
    assert all(x.abs().max() > 10 for x in seen)  # (scaled by the subclass's __iter__)
    rows, original = torch.cat(seen) / 100.0, whole.dataset.tensors[0]
    by_first = rows[rows[:, 0].argsort()]  # (each sample once over the two ranks)
    torch.testing.assert_close(by_first, original[original[:, 0].argsort()])
    assert len(whole) == 4 and whole.sampler is not halves[0].sampler  # (the original kept)
    data = whole.dataset
    own = ScaledLoader(data, batch_size=4, sampler=DistributedSampler(data, 2, 0, seed=0))
    assert distributed(own, 0, 2, 0) is own
