"""Bad inputs end quickly with an error that names the problem and the fix: empty epochs,
data that changed under a mid-epoch checkpoint, damaged or foreign checkpoints, misuse.

Cases that used to hang run under a deadline, so a regression fails instead of hanging.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from nets import mlp
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, TensorDataset
from trainers import QUIET

from mixprec.trainer import ModelCheckpoint, Trainer, TrainingModule, resume
from mixprec.trainer import checkpoint as ckpt_io
from mixprec.trainer.checkpoint import CheckpointError
from mixprec.trainer.loop import EmptyEpochError


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a thread; fail the test if it has not returned after ``seconds``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as err:  # handed to the test thread
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds} s (it used to hang here)")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def data(n: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class NoSamples(IterableDataset):
    def __iter__(self):
        return iter(())


EMPTY = {
    "empty dataset": (lambda: DataLoader(data(0), batch_size=4), "dataset .* is empty"),
    "drop_last": (
        lambda: DataLoader(data(3), batch_size=4, drop_last=True),
        "drop_last=True drops the only batch: the dataset has 3 samples, fewer than batch_size=4",
    ),
    "empty iterable": (lambda: DataLoader(NoSamples(), batch_size=4), "yielded no sample"),
}


@pytest.mark.parametrize("stop", [dict(max_steps=5), dict(max_epochs=3)], ids=str)
@pytest.mark.parametrize("case", list(EMPTY))
def test_an_epoch_without_batches_is_an_error_not_a_hang(tmp_path, case, stop):
    make_loader, why = EMPTY[case]
    trainer = Trainer(default_root_dir=tmp_path, enable_progress_bar=False, logger=False, **stop)
    with pytest.raises(EmptyEpochError, match=f"no batch.*{why}"):
        within(30, lambda: trainer.fit(mlp(4, 8, 1), make_loader(), loss_fn=F.mse_loss))
    assert not (tmp_path / "checkpoints").exists()  # no empty-epoch checkpoints either


def test_limit_train_batches_zero_is_refused_when_the_trainer_is_built():
    with pytest.raises(ValueError, match="limit_train_batches=0 leaves no batch.*validate"):
        Trainer(limit_train_batches=0, max_steps=3, **QUIET)


def test_a_one_shot_generator_says_it_was_used_up():
    batches = ((x, y) for x, y in DataLoader(data(8), batch_size=4))
    trainer = Trainer(max_epochs=2, **QUIET)
    with pytest.raises(EmptyEpochError, match="epoch 1: it is a one-shot iterator.*epoch 0"):
        within(30, lambda: trainer.fit(mlp(4, 8, 1), batches, loss_fn=F.mse_loss))
    assert trainer.global_step == 2  # the first epoch trained


def checkpoint_at_step_3(tmp_path: Path, batch_size: int = 4) -> Path:
    """A mid-epoch checkpoint after 3 of 4 batches."""
    trainer = Trainer(max_steps=3, seed=0, **QUIET)
    trainer.fit(mlp(4, 8, 1), DataLoader(data(16), batch_size=batch_size), loss_fn=F.mse_loss)
    return trainer.save_checkpoint(tmp_path / "mid.ckpt")


def test_resuming_mid_epoch_with_fewer_batches_is_an_error_not_a_hang(tmp_path):
    path = checkpoint_at_step_3(tmp_path)
    trainer = Trainer(max_steps=6, seed=0, **QUIET)
    model = mlp(4, 8, 1, seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match="at batch 3 of 4 of epoch 0.*has 2 batches"):
        within(
            30,
            lambda: trainer.fit(
                model, DataLoader(data(8), batch_size=4), loss_fn=F.mse_loss, ckpt_path=path
            ),
        )
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_resuming_mid_epoch_with_another_batch_size_is_refused(tmp_path):
    path = checkpoint_at_step_3(tmp_path)
    trainer = Trainer(max_steps=6, seed=0, **QUIET)
    loader = DataLoader(data(32), batch_size=8)  # 4 batches again, but of 8 samples
    with pytest.raises(CheckpointError, match="3 batches of 4 samples.*hold 8.*repeat or skip"):
        trainer.fit(mlp(4, 8, 1, seed=1), loader, loss_fn=F.mse_loss, ckpt_path=path)


def test_resuming_mid_epoch_over_a_list_of_batches_of_another_size_is_refused(tmp_path):
    """A list of batches has no batch size of its own: the checkpoint keeps its epoch's
    first batch's, and a resume whose batches hold more samples is refused (skipping 3 of
    them would skip samples never trained) before any step; the same list resumes."""

    def batches(size: int) -> list[tuple[Tensor, Tensor]]:
        return [(x, y) for x, y in DataLoader(data(4 * size), batch_size=size)]

    trainer, saved = Trainer(max_steps=3, seed=0, **QUIET), mlp(4, 8, 1)
    trainer.fit(saved, batches(4), loss_fn=F.mse_loss)
    path = trainer.save_checkpoint(tmp_path / "mid.ckpt")
    model = mlp(4, 8, 1, seed=1)
    resumed = Trainer(max_steps=6, seed=0, **QUIET)
    with pytest.raises(CheckpointError, match="first held 4 samples.*holds 8.*repeat or skip"):
        resumed.fit(model, batches(8), loss_fn=F.mse_loss, ckpt_path=path)
    assert resumed.global_step == 3  # no step taken: the weights are the checkpoint's
    pairs = zip(saved.parameters(), model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    again = Trainer(max_steps=6, seed=0, **QUIET)
    again.fit(mlp(4, 8, 1, seed=1), batches(4), loss_fn=F.mse_loss, ckpt_path=path)
    assert again.global_step == 6


def test_resuming_mid_epoch_with_another_number_of_samples_is_refused(tmp_path):
    """15 samples in batches of 4 are 4 batches, as 16 are: the batch count and size held,
    and a shuffled order over other samples repeated some and skipped others."""
    path = checkpoint_at_step_3(tmp_path)
    trainer = Trainer(max_steps=6, seed=0, **QUIET)
    loader = DataLoader(data(15), batch_size=4)
    with pytest.raises(CheckpointError, match="data of 16 samples; this run's has 15 samples"):
        trainer.fit(mlp(4, 8, 1, seed=1), loader, loss_fn=F.mse_loss, ckpt_path=path)


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "saved, resumed, was, now",
    [
        (  # gained generator=
            dict(shuffle=True),
            dict(shuffle=True, generator=seeded()),
            "RandomSampler (in a BatchSampler) without a generator of its own",
            "RandomSampler (in a BatchSampler) with generator= on the DataLoader",
        ),
        (  # lost it
            dict(shuffle=True, generator=seeded()),
            dict(shuffle=True),
            "RandomSampler (in a BatchSampler) with generator= on the DataLoader",
            "RandomSampler (in a BatchSampler) without a generator of its own",
        ),
        (  # a sampler with a generator of its own beside the loader's
            dict(shuffle=True, generator=seeded()),
            dict(sampler=RandomSampler(data(16), generator=seeded(1)), generator=seeded()),
            "RandomSampler (in a BatchSampler) with generator= on the DataLoader",
            "RandomSampler (in a BatchSampler) with generator= on the DataLoader and a generator "
            "on its sampler",
        ),
        (  # shuffled at the save, not now
            dict(shuffle=True),
            dict(shuffle=False),
            "RandomSampler (in a BatchSampler)",
            "SequentialSampler (in a BatchSampler)",
        ),
    ],
    ids=["gained-generator", "lost-generator", "sampler-generator", "unshuffled"],
)
def test_resuming_mid_epoch_with_a_loader_ordered_otherwise_names_the_difference(
    tmp_path, saved, resumed, was, now
):
    """Before: a raw ``zip() argument 2 is shorter than argument 1`` from the loop, or (the
    shuffling gone) a resume that silently trained on other samples than the skipped ones."""
    trainer = Trainer(max_steps=3, seed=0, **QUIET)
    trainer.fit(mlp(4, 8, 1), DataLoader(data(16), batch_size=4, **saved), loss_fn=F.mse_loss)
    path = trainer.save_checkpoint(tmp_path / "mid.ckpt")

    model = mlp(4, 8, 1, seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    loader = DataLoader(data(16), batch_size=4, **resumed)
    again = Trainer(max_steps=6, seed=0, **QUIET)
    with pytest.raises(CheckpointError) as caught:
        again.fit(model, loader, loss_fn=F.mse_loss, ckpt_path=path)
    message = str(caught.value)
    assert f"{path} was saved after 3 batches of epoch 0, with a DataLoader ordered by " in message
    assert (
        f"ordered by {was}" in message and f"this run's DataLoader is ordered by {now}" in message
    )
    assert "resume with the DataLoader built as at the save" in message
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    # the loader built as at the save resumes, its epoch replayed from the saved states
    again.fit(
        model, DataLoader(data(16), batch_size=4, **saved), loss_fn=F.mse_loss, ckpt_path=path
    )
    assert again.global_step == 6


def test_a_checkpoint_written_before_the_order_was_kept_compares_generator_counts(tmp_path):
    trainer = Trainer(max_steps=3, seed=0, **QUIET)
    trainer.fit(mlp(4, 8, 1), DataLoader(data(16), batch_size=4, shuffle=True), loss_fn=F.mse_loss)
    state = resume.checkpoint_state(trainer._current)
    del state["loop"]["order"]
    path = ckpt_io.atomic_save(state, tmp_path / "older.ckpt")
    loader = DataLoader(data(16), batch_size=4, shuffle=True, generator=seeded())
    with pytest.raises(CheckpointError, match="ordered by 0 torch generator.*ordered by 1 torch"):
        Trainer(max_steps=6, **QUIET).fit(
            mlp(4, 8, 1, seed=1), loader, loss_fn=F.mse_loss, ckpt_path=path
        )


def test_a_loader_ordered_otherwise_resumes_from_a_save_on_the_epochs_last_batch(tmp_path):
    """Nothing of that epoch is replayed: the next one is drawn from the new loader."""
    trainer = Trainer(max_steps=4, seed=0, **QUIET)
    trainer.fit(mlp(4, 8, 1), DataLoader(data(16), batch_size=4, shuffle=True), loss_fn=F.mse_loss)
    path = trainer.save_checkpoint(tmp_path / "end.ckpt")
    loader = DataLoader(data(16), batch_size=4, shuffle=True, generator=seeded())
    again = Trainer(max_steps=6, seed=0, **QUIET)
    again.fit(mlp(4, 8, 1, seed=1), loader, loss_fn=F.mse_loss, ckpt_path=path)
    assert (again.current_epoch, again.global_step) == (1, 6)


class SkipsSome(TrainingModule):
    """training_step returns None for the batches in ``skip``."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.net = mlp(4, 8, 1)
        self.skip = skip

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if batch_idx in self.skip:
            return None
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_training_step_returning_none_skips_the_batch_as_in_lightning():
    batches = list(DataLoader(data(16), batch_size=4))
    skipping = SkipsSome({1})
    trainer = Trainer(max_epochs=1, **QUIET)
    trainer.fit(skipping, batches)
    assert trainer.global_step == 3  # no optimizer step for the skipped batch
    reference = SkipsSome(set())
    Trainer(max_epochs=1, **QUIET).fit(reference, [b for i, b in enumerate(batches) if i != 1])
    for a, b in zip(skipping.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_epoch_where_every_batch_is_skipped_is_an_error():
    trainer = Trainer(max_steps=5, **QUIET)
    with pytest.raises(EmptyEpochError, match="returned None for all 4 batches"):
        within(30, lambda: trainer.fit(SkipsSome({0, 1, 2, 3}), DataLoader(data(16), 4)))


def test_a_non_scalar_loss_names_its_shape_and_the_fix():
    trainer = Trainer(max_steps=1, **QUIET)
    with pytest.raises(
        TypeError,
        match=r"loss_fn must return the loss as a single number.*"
        r"shape \(4, 1\).*\.mean\(\)",
    ):
        trainer.fit(
            mlp(4, 8, 1), DataLoader(data(), batch_size=4), loss_fn=lambda o, t: (o - t) ** 2
        )


def test_fit_without_training_data_says_so():
    with pytest.raises(ValueError, match="fit needs training data: train_dataloaders is None"):
        Trainer(max_steps=1, **QUIET).fit(mlp(4, 8, 1), None, loss_fn=F.mse_loss)


# -- checkpoints that are not what they seem ----------------------------------------------------


@pytest.fixture
def good_checkpoint(tmp_path) -> Path:
    return checkpoint_at_step_3(tmp_path)


def damaged(tmp_path: Path, good: Path) -> dict[str, Path]:
    raw = good.read_bytes()
    files = {
        "truncated": raw[: len(raw) // 2],
        "garbage": os.urandom(4096),
        "empty": b"",
        "text": b"epoch=3 loss=0.25\n",
    }
    out = {}
    for name, content in files.items():
        out[name] = tmp_path / f"{name}.ckpt"
        out[name].write_bytes(content)
    out["whole model"] = tmp_path / "model.ckpt"
    torch.save(mlp(4, 8, 1), out["whole model"])
    return out


def test_damaged_or_foreign_files_give_one_clear_error(tmp_path, good_checkpoint):
    for name, path in damaged(tmp_path, good_checkpoint).items():
        with pytest.raises(CheckpointError, match="not a readable mixprec checkpoint") as err:
            ckpt_io.load(path)
        assert str(path) in str(err.value), name
        if name == "whole model":
            assert "torch.save(model)" in str(err.value)
            assert "weights_only" not in str(err.value)
    trainer = Trainer(max_steps=4, **QUIET)
    with pytest.raises(CheckpointError, match="not a readable mixprec checkpoint"):
        trainer.fit(
            mlp(4, 8, 1),
            DataLoader(data(), batch_size=4),
            loss_fn=F.mse_loss,
            ckpt_path=tmp_path / "truncated.ckpt",
        )


def test_a_checkpoint_of_another_architecture_leaves_the_model_untouched(good_checkpoint):
    wider = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.Linear(1, 1))
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    trainer = Trainer(max_steps=5, **QUIET)
    with pytest.raises(
        CheckpointError, match="another model.*missing in the checkpoint: 3.weight, 3.bias"
    ):
        trainer.fit(
            wider, DataLoader(data(), batch_size=4), loss_fn=F.mse_loss, ckpt_path=good_checkpoint
        )
    assert all(torch.equal(before[k], v) for k, v in wider.state_dict().items())
    other = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1))
    with pytest.raises(CheckpointError, match=r"shapes differ.*0.weight \(8, 4\) vs \(5, 4\)"):
        trainer.validate(
            other, DataLoader(data(), batch_size=4), loss_fn=F.mse_loss, ckpt_path=good_checkpoint
        )


def test_an_adamw_checkpoint_into_sgd_names_both(good_checkpoint):
    model = mlp(4, 8, 1, seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(max_steps=5, **QUIET)
    with pytest.raises(CheckpointError, match="optimizer 0 as AdamW; this run's is SGD"):
        trainer.fit(
            model,
            DataLoader(data(), batch_size=4),
            loss_fn=F.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            ckpt_path=good_checkpoint,
        )
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# -- misuse found at the start of fit, not after an epoch ---------------------------------------


class Counts(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(4, 8, 1)
        self.steps = 0

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return F.mse_loss(self(batch[0]), batch[1])


def test_a_root_dir_under_a_file_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    model = Counts()
    trainer = Trainer(max_epochs=1, default_root_dir=blocker / "runs", enable_progress_bar=False)
    with pytest.raises(NotADirectoryError, match="default_root_dir .* is a file"):
        trainer.fit(model, DataLoader(data(), batch_size=4))
    assert model.steps == 0


def test_a_root_dir_nothing_is_written_to_is_not_checked(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    trainer = Trainer(
        max_epochs=1,
        default_root_dir=blocker / "unused",
        logger=False,
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck")],
    )
    trainer.fit(Counts(), DataLoader(data(), batch_size=4))
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["epoch=0-step=4.ckpt"]


def test_validation_data_without_validation_step_fails_before_training():
    model = Counts()
    with pytest.raises(ValueError, match="defines no validation_step"):
        Trainer(max_epochs=1, **QUIET).fit(model, DataLoader(data(), 4), DataLoader(data(), 4))
    assert model.steps == 0


def test_a_list_of_dataloaders_is_refused_before_training():
    # before: each DataLoader was taken for a batch, failing inside validation_step
    model, loader = Counts(), DataLoader(data(), 4)
    trainer = Trainer(max_epochs=1, **QUIET)
    with pytest.raises(ValueError, match="val_dataloaders is a list holding DataLoaders.*one"):
        trainer.fit(model, loader, [loader, loader])
    with pytest.raises(ValueError, match="train_dataloaders is a tuple holding DataLoaders"):
        trainer.fit(model, (loader, loader))
    with pytest.raises(ValueError, match="dataloaders is a list holding DataLoaders"):
        trainer.validate(model, [loader])
    assert model.steps == 0
    trainer.fit(model, [next(iter(loader))])  # a list of batches is fine
    assert model.steps == 1


def test_an_optimizer_of_another_models_parameters_is_warned_about():
    # before: the fit ran and left the model unchanged, without a word
    model, other = mlp(4, 8, 1, seed=0), mlp(4, 8, 1, seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(max_epochs=1, **QUIET)
    with pytest.warns(UserWarning, match=r"optimizer 0 \(SGD\) holds none of the parameters"):
        trainer.fit(
            model,
            DataLoader(data(), 4),
            loss_fn=F.mse_loss,
            optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
        )
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class Hooked(Counts):
    """Records the Lightning module hooks the Trainer calls, and defines two it does not."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    test_step = validation_step

    def on_after_backward(self):
        raise AssertionError("never called")

    def setup(self, stage):
        raise AssertionError("never called")


HOOKS = [
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_validation_start",  # the epoch's validation, after its last (here: only) batch
    "on_validation_epoch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
    "on_test_start",
    "on_test_epoch_start",
    "on_test_batch_end",
    "on_test_epoch_end",
    "on_test_end",
]
for _name in HOOKS:
    setattr(Hooked, _name, lambda self, *args, _name=_name: self.calls.append(_name))


def test_module_hooks_run_and_the_lightning_ones_that_do_not_are_named():
    model = Hooked()
    trainer = Trainer(max_epochs=1, **QUIET)
    one = DataLoader(data(4), 4)
    with pytest.warns(UserWarning, match="never calls.*: on_after_backward, setup"):
        trainer.fit(model, one, one)
    trainer.test(model, one)
    assert model.calls == HOOKS


def test_two_identical_model_checkpoints_are_refused_when_built(tmp_path):
    with pytest.raises(ValueError, match="same state key 'ModelCheckpoint"):
        Trainer(callbacks=[ModelCheckpoint(monitor="x"), ModelCheckpoint(monitor="x")])


def test_save_checkpoint_before_fit_says_when_it_works(tmp_path):
    with pytest.raises(RuntimeError, match="during or after Trainer.fit"):
        Trainer(**QUIET).save_checkpoint(tmp_path / "x.ckpt")


# -- nothing written before is lost ------------------------------------------------------------


def fit_logged(root: Path, epochs: int) -> Trainer:
    trainer = Trainer(max_epochs=epochs, default_root_dir=root, enable_progress_bar=False)
    trainer.fit(Counts(), DataLoader(data(16), batch_size=4))
    return trainer


def test_resuming_with_a_new_trainer_keeps_the_checkpoint_it_resumed_from(tmp_path):
    first = fit_logged(tmp_path, 1)
    resumed_from = Path(first.checkpoint_callback.best_model_path)
    assert resumed_from.parent == tmp_path / "logs" / "version_0" / "checkpoints"
    trainer = Trainer(max_epochs=3, default_root_dir=tmp_path, enable_progress_bar=False)
    trainer.fit(Counts(), DataLoader(data(16), batch_size=4), ckpt_path=resumed_from)
    assert resumed_from.is_file()  # the earlier run's file is not "stale" to this run
    ckpts = sorted(p.name for p in (tmp_path / "logs" / "version_1" / "checkpoints").iterdir())
    assert ckpts == ["epoch=2-step=12.ckpt"]  # this run's own top-1 still rotates


def test_resuming_into_the_same_directory_never_deletes_the_resumed_checkpoint(tmp_path):
    ckdir = tmp_path / "ck"
    first = Trainer(
        max_epochs=1,
        callbacks=[ModelCheckpoint(dirpath=ckdir)],
        logger=False,
        enable_progress_bar=False,
    )
    first.fit(Counts(), DataLoader(data(16), batch_size=4))
    start = ckdir / "epoch=0-step=4.ckpt"
    trainer = Trainer(
        max_epochs=3,
        callbacks=[ModelCheckpoint(dirpath=ckdir)],
        logger=False,
        enable_progress_bar=False,
    )
    trainer.fit(Counts(), DataLoader(data(16), batch_size=4), ckpt_path=start)
    assert sorted(p.name for p in ckdir.iterdir()) == [
        "epoch=0-step=4.ckpt",
        "epoch=2-step=12.ckpt",
    ]


def test_a_csv_logger_given_an_existing_version_appends_instead_of_overwriting(tmp_path):
    from mixprec.trainer import CSVLogger

    first = Trainer(
        max_epochs=1,
        logger=CSVLogger(tmp_path, version=0),
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    first.fit(Counts(), DataLoader(data(16), batch_size=4))
    path = tmp_path / "logs" / "version_0" / "metrics.csv"
    before = path.read_text().splitlines()
    assert len(before) == 5  # header + 4 steps
    again = Trainer(
        max_epochs=1,
        logger=CSVLogger(tmp_path, version=0),
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    again.fit(Counts(), DataLoader(data(8), batch_size=4))
    after = path.read_text().splitlines()
    assert after[: len(before)] == before and len(after) == len(before) + 2


def test_two_default_trainers_built_together_get_separate_versions(tmp_path):
    kwargs = dict(max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False)
    a = Trainer(log_every_n_steps=1, **kwargs)
    b = Trainer(log_every_n_steps=1, **kwargs)
    a.fit(Counts(), DataLoader(data(16), batch_size=4))
    b.fit(Counts(), DataLoader(data(8), batch_size=4))
    assert (a.run_dir.name, b.run_dir.name) == ("version_0", "version_1")
    rows = [len((t.run_dir / "metrics.csv").read_text().splitlines()) for t in (a, b)]
    assert rows == [5, 3]


# -- saving: interrupted, disk full, stray files, permissions -----------------------------------

SAVE_SCRIPT = """
import resource, signal, sys, torch
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a program run from a shell
from mixprec.trainer import checkpoint as ckpt_io
path = sys.argv[1]
ckpt_io.atomic_save({{"format": "old"}}, path)
{setup}
state = {{"w%d" % i: torch.ones(2_000_000) for i in range(24)}}
print("saving", flush=True)
ckpt_io.atomic_save(state, path)
print("saved", flush=True)
"""


# Ctrl-C arrives while the checkpoint is being written: sent from inside torch.save, so it
# lands mid-save however loaded the machine is
CTRL_C_IN_SAVE = """
import os
_save = torch.save
def _interrupted_save(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    return _save(*args, **kwargs)
torch.save = _interrupted_save
"""


def run_save(tmp_path: Path, setup: str = "") -> tuple[int, str]:
    import subprocess
    import sys

    script = SAVE_SCRIPT.format(setup=setup)
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "run.ckpt")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "saving"
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def test_ctrl_c_during_a_save_ends_as_a_clean_keyboard_interrupt(tmp_path):
    import signal

    code, err = run_save(tmp_path, setup=CTRL_C_IN_SAVE)
    assert code == -signal.SIGINT, err[-2000:]
    assert err.strip().splitlines()[-1] == "KeyboardInterrupt", err[-2000:]
    assert "inline_container" not in err and "RuntimeError" not in err
    state = torch.load(tmp_path / "run.ckpt", weights_only=True)  # old or new, never half
    assert state == {"format": "old"} or len(state) == 24
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_full_disk_says_so_and_names_the_file(tmp_path):
    limit = "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n" + (
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))"
    )
    code, err = run_save(tmp_path, setup=limit)
    last = err.strip().splitlines()[-1]
    assert code == 1 and last.startswith("OSError: [Errno 27]"), err[-2000:]
    assert f"cannot write the checkpoint {tmp_path / 'run.ckpt'}: disk full or file too" in last
    assert "inline_container" not in err
    assert torch.load(tmp_path / "run.ckpt", weights_only=True) == {"format": "old"}
    assert not list(tmp_path.glob(".*.tmp"))


def test_stale_temporary_files_of_killed_saves_are_removed_by_the_next_save(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(done.stdout)
    host = ckpt_io._HOST
    stale = tmp_path / f".a.ckpt.{host}.{dead}.0badc0de.tmp"
    running = tmp_path / f".b.ckpt.{host}.{os.getppid()}.00c0ffee.tmp"  # a live process's
    elsewhere = tmp_path / f".c.ckpt.otherhost.{dead}.0feeb1e0.tmp"  # maybe running there
    for f in (stale, running, elsewhere):
        f.write_bytes(b"partial")
    ckpt_io.atomic_save({"x": 1}, tmp_path / "new.ckpt")
    assert not stale.exists() and running.exists() and elsewhere.exists()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_checkpoints_get_the_permissions_the_umask_gives_any_file(tmp_path, umask):
    old = os.umask(umask)
    try:
        path = ckpt_io.atomic_save({"x": 1}, tmp_path / "x.ckpt")
        ckpt_io.atomic_link(path, tmp_path / "last.ckpt")
        plain = tmp_path / "plain.txt"
        plain.write_text("x")
    finally:
        os.umask(old)
    expected = plain.stat().st_mode & 0o777
    assert expected == 0o666 & ~umask
    assert (path.stat().st_mode & 0o777) == expected
    assert ((tmp_path / "last.ckpt").stat().st_mode & 0o777) == expected


FAILING_THIRD_SAVE = """
import json, resource, signal, sys
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from mixprec.trainer import Callback, ModelCheckpoint, Trainer

class FullDiskAfterStep7(Callback):
    def on_train_batch_end(self, trainer, model, outputs, batch, batch_idx):
        if trainer.global_step == 7:  # files can no longer grow: the save at step 9 fails
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))

torch.manual_seed(0)
x = torch.randn(64, 4)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
cb = ModelCheckpoint(dirpath=sys.argv[1], save_top_k=1, save_last=True, every_n_train_steps=3)
trainer = Trainer(max_steps=9, callbacks=[cb, FullDiskAfterStep7()], logger=False,
                  enable_progress_bar=False)
try:
    trainer.fit(model, DataLoader(TensorDataset(x, x[:, :1]), batch_size=4), loss_fn=F.mse_loss)
except OSError as err:
    print(json.dumps({"error": str(err), "best": cb.best_model_path, "saved": cb._saved}))
"""


def test_a_checkpoint_that_fails_to_write_leaves_the_records_naming_files_that_exist(tmp_path):
    """The records went first: a third save that failed (the disk full) left best_model_path
    on the file never written, and the second save out of the list save_top_k cleans (a
    later ckpt_path="best" failed on a missing file)."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", FAILING_THIRD_SAVE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "cannot write the checkpoint" in out["error"] and "step=9" in out["error"]
    second = str(tmp_path / "epoch=0-step=6.ckpt")
    assert out["best"] == second and out["saved"] == [second]
    assert ckpt_io.load(tmp_path / "last.ckpt")["loop"]["global_step"] == 6
    assert ckpt_io.load(second)["loop"]["global_step"] == 6
    assert not (tmp_path / "epoch=0-step=9.ckpt").exists()


def test_gradients_the_model_holds_when_the_fit_starts_are_not_added_to_its_first_step():
    """A plain loop's last backward left .grad on the model, and the fit's first window
    added it to its own: the first step moved by both. The fit clears them first, as a
    window's start does in Lightning."""
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    stale, clean = mlp(4, 8, 1), mlp(4, 8, 1)
    F.mse_loss(stale(x * 3), y * 5).backward()  # (an earlier stage's last backward)
    for model in (stale, clean):
        trainer = Trainer(max_steps=1, **QUIET)
        trainer.fit(
            model,
            DataLoader(TensorDataset(x, y), batch_size=4),
            loss_fn=F.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )
    pairs = zip(stale.parameters(), clean.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
