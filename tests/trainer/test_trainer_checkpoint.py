"""Checkpoints: resuming is bit-identical to not stopping (mid-epoch too), a save killed
half-way leaves the previous checkpoint loadable, and resuming in another precision works."""

from __future__ import annotations

import csv
import logging
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainers import SILENT

import mixprec
from mixprec.trainer import Callback, EarlyStopping, ModelCheckpoint, Trainer, TrainingModule
from mixprec.trainer import checkpoint as ckpt_io

# what a script run in a subprocess imports from: this folder (the test module) and the
# tests folder (the shared helpers)
SCRIPT_PATH = [str(Path(__file__).parent), str(Path(__file__).parents[1])]


class DropoutNet(TrainingModule):
    """Dropout (draws random numbers every step), a step-interval schedule, AdamW."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loaders() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    data = TensorDataset(x * 0.1, y)
    # 12 batches an epoch, shuffled from torch's global generator
    return DataLoader(data, batch_size=8, shuffle=True), DataLoader(data, batch_size=48)


def trainer(tmp: Path, spec: str, **kwargs) -> Trainer:
    return Trainer(
        precision=spec,
        seed=7,
        deterministic=True,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        val_check_interval=4,
        default_root_dir=tmp,
        allow_slow_precision=True,
        **SILENT,
        **kwargs,
    )


@pytest.mark.parametrize("spec", ["32-true", "bf16-mixed", "16-mixed", "16-true"])
@pytest.mark.parametrize("stop_at", [5, 12], ids=["mid-epoch", "epoch-end"])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, spec, stop_at):
    """6 steps per epoch; 16 steps straight vs stop_at steps, save, resume with a model
    initialised differently: every parameter, the lr and the loss scale match exactly."""
    train, val = loaders()
    straight = DropoutNet(seed=0)
    t_straight = trainer(tmp_path / "a", spec, max_steps=16)
    t_straight.fit(straight, train, val)

    first = DropoutNet(seed=0)
    t_first = trainer(tmp_path / "b", spec, max_steps=stop_at)
    t_first.fit(first, train, val)
    path = t_first.save_checkpoint(tmp_path / "half.ckpt")
    assert t_first.batches_done == (stop_at * 2) % 12 or stop_at == 12

    resumed = DropoutNet(seed=123)
    t_resumed = trainer(tmp_path / "c", spec, max_steps=16)
    t_resumed.fit(resumed, train, val, ckpt_path=path)

    assert t_resumed.global_step == t_straight.global_step == 16
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    opt_a, opt_b = t_straight.optimizers[0], t_resumed.optimizers[0]
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
    assert t_straight.precision.scaler.state_dict() == t_resumed.precision.scaler.state_dict()
    for sa, sb in zip(opt_a.state.values(), opt_b.state.values(), strict=True):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_resume_from_the_last_epoch_checkpoint_written_by_model_checkpoint(tmp_path):
    train, val = loaders()
    straight = DropoutNet(seed=0)
    trainer(tmp_path / "a", "bf16-mixed", max_epochs=3).fit(straight, train, val)
    cb = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True, save_top_k=0)
    resumed = trainer(tmp_path / "b", "bf16-mixed", max_epochs=2, callbacks=[cb])
    resumed.fit(DropoutNet(0), train, val)
    assert cb.last_model_path == str(tmp_path / "ck" / "last.ckpt")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["last.ckpt"]
    resumed = DropoutNet(seed=5)
    t = trainer(tmp_path / "c", "bf16-mixed", max_epochs=3)
    t.fit(resumed, train, val, ckpt_path=cb.last_model_path)
    assert (t.current_epoch, t.global_step) == (3, 18)
    assert all(
        torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters(), strict=True)
    )


def test_a_checkpoint_its_resumed_record_does_not_name_is_moved_aside_not_deleted(tmp_path):
    """A SIGKILL between a save's file and its record (last.ckpt still at the save before),
    or a resume from an earlier checkpoint, left a complete epoch=... file that the resumed
    run's save_top_k never removed, and whose name pushed the run's own save of that epoch
    to -v1. The resumed run moves what it does not know, written after the checkpoint it
    resumes from, into superseded/ (it was deleted: a checkpoint lost), and says so."""
    train, val = loaders()
    ck = tmp_path / "ck"
    cb = ModelCheckpoint(dirpath=ck, save_last=True, save_top_k=1)
    trainer(tmp_path / "a", "32-true", max_epochs=1, callbacks=[cb]).fit(DropoutNet(0), train, val)
    (first,) = [p for p in ck.iterdir() if p.name != "last.ckpt"]
    # the next epoch's save, killed before last.ckpt and the record moved on to it
    orphan = ck / "epoch=1-step=12.ckpt"
    state = torch.load(first, weights_only=True)
    state["loop"].update(epoch=2, global_step=12)
    torch.save(state, orphan)
    os.utime(orphan, (first.stat().st_mtime + 5, first.stat().st_mtime + 5))
    mine = ck / "notes.txt"  # not a checkpoint: never touched
    mine.write_text("kept")
    cb = ModelCheckpoint(dirpath=ck, save_last=True, save_top_k=1)
    t = trainer(tmp_path / "b", "32-true", max_epochs=3, callbacks=[cb])
    aside = r"moving epoch=1-step=12.ckpt from .* to .*superseded: written after"
    with pytest.warns(UserWarning, match=aside):
        t.fit(DropoutNet(0), train, val, ckpt_path=ck / "last.ckpt")
    assert sorted(p.name for p in ck.iterdir()) == [
        "epoch=2-step=18.ckpt",
        "last.ckpt",
        "notes.txt",
        "superseded",
    ]
    kept = ck / "superseded" / "epoch=1-step=12.ckpt"
    assert torch.load(kept, weights_only=True)["loop"]["global_step"] == 12


def test_checkpoint_contents(tmp_path):
    train, _ = loaders()
    t = trainer(tmp_path, "16-mixed", max_steps=3)
    t.fit(DropoutNet(0), train)
    state = ckpt_io.load(t.save_checkpoint(tmp_path / "x.ckpt"))
    assert state["mixprec_version"] == mixprec.__version__
    assert state["torch_version"] == str(torch.__version__)
    assert state["policy_name"] == "16-mixed"
    assert state["precision"]["policy"] == mixprec.PolicyMap("16-mixed").to_config()
    assert state["precision"]["scaler"]["kind"] == "dynamic"
    assert state["loop"] == {
        "epoch": 0,
        "batch": 6,
        "global_step": 3,
        "epoch_rng": state["loop"]["epoch_rng"],
        "epoch_batches": 12,
        "batch_size": 8,
        "first_batch_size": 8,
        "samples": [96, 96],  # (the dataset's and the sampler's: the order is drawn over them)
        "order": {"sampler": "RandomSampler", "batch_sampler": "BatchSampler", "generators": []},
        "loader_rng": [],
        "step_rows": [],  # (no logger: no row was logged)
    }
    assert state["optimizer_types"] == ["AdamW"]
    assert set(state["rng"]) >= {"python", "torch", "numpy"}
    assert len(state["optimizers"]) == 1 and len(state["schedulers"]) == 1
    assert not list(tmp_path.glob(".*.tmp"))  # no temp file left behind


def test_loading_something_else_raises_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        ckpt_io.load(tmp_path / "missing.ckpt")
    torch.save({"state_dict": {}}, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match="not a readable mixprec checkpoint"):
        ckpt_io.load(tmp_path / "other.ckpt")


def test_saving_inside_an_accumulation_window_is_refused(tmp_path):
    class SaveEarly(ModelCheckpoint):
        def on_train_batch_end(self, trainer, model, outputs, batch, batch_idx):
            trainer.save_checkpoint(tmp_path / "early.ckpt")

    train, _ = loaders()
    t = trainer(tmp_path, "32-true", max_steps=2, callbacks=[SaveEarly()])
    with pytest.raises(RuntimeError, match="middle of a gradient accumulation window"):
        t.fit(DropoutNet(0), train)


class SaveBeforeStep(Callback):
    """Saves in on_before_optimizer_step, between the backward and the step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_before_optimizer_step(self, trainer, model, optimizer):
        trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("accumulate, optimizer", [(1, "SGD"), (2, "SGD"), (1, "LBFGS")])
def test_saving_while_an_optimizer_step_is_taken_is_refused(tmp_path, accumulate, optimizer):
    """The window's count was reset before on_before_optimizer_step ran, so a save there
    was accepted and resumed wrong: the window's gradients were lost and taken again, and
    with one micro-batch a window the generators were saved after the forward (another
    dropout mask). It is refused, saying where to save instead."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)
    t = Trainer(
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        callbacks=[SaveBeforeStep(tmp_path / "x.ckpt")],
        default_root_dir=tmp_path,
        **SILENT,
    )
    with pytest.raises(RuntimeError, match="while an optimizer step is taken.*on_train_batch_end"):
        t.fit(
            nn.Linear(4, 1),
            loader,
            loss_fn=F.mse_loss,
            optimizer=lambda ps: getattr(torch.optim, optimizer)(ps, lr=0.1),
        )
    assert not (tmp_path / "x.ckpt").exists()


KILLED_SAVE = """
import sys, time, torch
from mixprec.trainer import Callback, Trainer
sys.path[:0] = {tests!r}
from test_trainer_checkpoint import DropoutNet, loaders

class SlowToPickle:
    def __reduce__(self):
        print("writing", flush=True)
        time.sleep(60)
        return (int, (0,))

class Payload(Callback):
    saves = 0
    def state_dict(self):
        return {{"slow": SlowToPickle()}} if self.saves else {{"plain": 1}}

payload = Payload()
t = Trainer(max_steps=2, logger=False, enable_progress_bar=False, callbacks=[payload],
            enable_checkpointing=False)
t.fit(DropoutNet(0), loaders()[0])
t.save_checkpoint({path!r})
print("saved", flush=True)
payload.saves = 1
t.save_checkpoint({path!r})
"""


def test_a_save_killed_halfway_leaves_the_previous_checkpoint_loadable(tmp_path):
    path = tmp_path / "run.ckpt"
    script = KILLED_SAVE.format(tests=SCRIPT_PATH, path=str(path))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "saved"
        good = path.read_bytes()
        assert proc.stdout.readline().strip() == "writing"  # now inside the second save
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert path.read_bytes() == good
    state = ckpt_io.load(path)
    assert state["loop"]["global_step"] == 2 and state["callbacks"] == {"Payload": {"plain": 1}}
    assert len(list(tmp_path.glob(".run.ckpt.*.tmp"))) == 1  # the abandoned temp file
    resumed = DropoutNet(seed=3)
    t = Trainer(max_steps=3, **SILENT, enable_checkpointing=False)
    t.fit(resumed, loaders()[0], ckpt_path=path)
    assert t.global_step == 3
    t.save_checkpoint(path)  # the next save into that directory removes the stray file
    assert not list(tmp_path.glob(".*.tmp"))


def test_resume_in_another_precision_uses_master_weights_and_says_so(tmp_path, caplog):
    train, _ = loaders()
    model = DropoutNet(0)
    t16 = trainer(tmp_path / "a", "16-true", max_steps=3)
    t16.fit(model, train)
    masters = [m.detach().clone() for m in t16.optimizers[0].master_params.values()]
    assert all(m.dtype == torch.float32 for m in masters)
    path = t16.save_checkpoint(tmp_path / "fp16.ckpt")

    resumed = DropoutNet(seed=9)
    with caplog.at_level(logging.INFO, logger="mixprec"):
        t32 = trainer(tmp_path / "b", "32-true", max_steps=3)
        t32.fit(resumed, train, ckpt_path=path)  # nothing left to train: only restores
    text = caplog.text
    assert "trained in precision 16-true, in 32-true" in text
    assert "float32 master weights" in text
    assert "'dynamic' loss scaler, this run uses 'none'" in text
    assert t32.global_step == 3
    # the float32 weights are the masters, not the float16 copies rounded back up
    for p, m in zip(resumed.parameters(), masters, strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, m)
    # and training goes on from there in the new precision
    t32b = trainer(tmp_path / "c", "bf16-mixed", max_steps=5)
    t32b.fit(resumed, train, ckpt_path=path)
    assert t32b.global_step == 5 and all(torch.isfinite(p).all() for p in resumed.parameters())


def test_model_checkpoint_state_is_in_its_own_checkpoint_and_comes_back(tmp_path):
    train, val = loaders()
    cb = ModelCheckpoint(monitor="val_loss", save_last=True)  # default dirpath: the run's
    trainer(tmp_path / "a", "32-true", max_epochs=2, callbacks=[cb]).fit(DropoutNet(0), train, val)
    saved = ckpt_io.load(cb.last_model_path)["callbacks"][cb.state_key]
    assert saved["best_model_path"] == cb.best_model_path  # the file knows what it is
    assert saved["last_model_path"] == cb.last_model_path

    again = ModelCheckpoint(monitor="val_loss", save_last=True)
    t = trainer(tmp_path / "b", "32-true", max_epochs=2, callbacks=[again])
    t.fit(DropoutNet(1), train, val, ckpt_path=cb.last_model_path)  # nothing left: only restores
    assert t.current_epoch == 2
    assert (again.best_model_path, again.best_model_score) == (
        cb.best_model_path,
        cb.best_model_score,
    )


def _resumed_in_float32_hold(tmp_path, train, path, weights: dict) -> Trainer:
    """Resume ``path`` in 32-true (nothing left to train: only restores) and check that
    the resumed model's weights are float32 and equal to ``weights`` (by name)."""
    resumed = DropoutNet(seed=9)
    t32 = trainer(tmp_path / "b", "32-true", max_steps=3)
    t32.fit(resumed, train, ckpt_path=path)
    for name, p in resumed.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, weights[name]), name
    return t32


def test_bfloat16_masters_are_used_when_resuming_in_another_precision(tmp_path):
    # before: masters were saved as a list and matched to parameters by float16 dtype, so
    # bfloat16 masters (master_weights=True) were dropped and the bf16 copies used instead
    train, _ = loaders()
    bf16 = mixprec.Precision("bf16-true", master_weights=True, allow_slow=True)
    model = DropoutNet(0)
    t = trainer(tmp_path / "a", bf16, max_steps=3)
    t.fit(model, train)
    masters = {
        n: t.optimizers[0].master_params[p].detach().clone() for n, p in model.named_parameters()
    }
    params = dict(model.named_parameters())
    assert any(not torch.equal(m, params[n].float()) for n, m in masters.items())
    path = t.save_checkpoint(tmp_path / "bf16.ckpt")

    _resumed_in_float32_hold(tmp_path, train, path, masters)


def test_a_kahan_checkpoint_resumes_in_another_precision_with_its_compensation(tmp_path):
    """bf16-true with Kahan compensation keeps, per weight, what the roundings lost: the
    value its steps track is weight + compensation. Resumed in 32-true the weights were
    the bfloat16 ones alone, and the saved buffers stayed in the optimizer's state (saved
    again, a later Kahan resume would have added them once more). The weights are the
    sums, and the buffers are dropped."""
    train, _ = loaders()
    kahan = mixprec.Precision("bf16-true", compensation="kahan", allow_slow=True)
    model = DropoutNet(0)
    t = trainer(tmp_path / "a", kahan, max_steps=3)
    t.fit(model, train)
    state = t.optimizers[0].optimizer.state
    params = dict(model.named_parameters())
    tracked = {n: p.float() + state[p]["compensation"].float() for n, p in params.items()}
    assert any(not torch.equal(tracked[n], p.float()) for n, p in params.items())
    path = t.save_checkpoint(tmp_path / "kahan.ckpt")

    t32 = _resumed_in_float32_hold(tmp_path, train, path, tracked)
    assert not any("compensation" in s for s in t32.optimizers[0].optimizer.state.values())


def test_a_float32_checkpoint_resumed_in_16_true_gives_masters_its_exact_weights(tmp_path):
    # before: the masters were built from the float16 model, i.e. the float32 weights
    # rounded to float16 and back, so the resumed run had silently lost their low bits
    train, _ = loaders()
    model = DropoutNet(0)
    t32 = trainer(tmp_path / "a", "32-true", max_steps=3)
    t32.fit(model, train)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    path = t32.save_checkpoint(tmp_path / "fp32.ckpt")

    resumed = DropoutNet(seed=9)
    t16 = trainer(tmp_path / "b", "16-true", max_steps=3)
    t16.fit(resumed, train, ckpt_path=path)  # nothing left to train: only restores
    masters = t16.optimizers[0].master_params
    for name, p in resumed.named_parameters():
        assert p.dtype == torch.float16 and torch.equal(p, weights[name].half()), name
        assert masters[p].dtype == torch.float32 and torch.equal(masters[p], weights[name]), name
    assert any(not torch.equal(w.half().float(), w) for w in weights.values())


class EpochScheduled(DropoutNet):
    """An epoch-interval StepLR and a ReduceLROnPlateau on val_loss, a training epoch metric,
    and optionally a float16 overflow (a skipped step) at one step."""

    def __init__(self, seed: int, overflow_at: int | None = None) -> None:
        super().__init__(seed)
        self.overflow_at = overflow_at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        if self.trainer.global_step == self.overflow_at:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        step = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return [opt], [step, {"scheduler": plateau, "monitor": "val_loss"}]


class Seen(Callback):
    """The epochs validated, and at each epoch end: epoch, training epoch loss, lr."""

    def __init__(self) -> None:
        self.validated: list[int] = []
        self.epoch_ends: list[tuple[int, float, float]] = []

    def on_validation_end(self, trainer, model):
        self.validated.append(trainer.current_epoch)

    def on_train_epoch_end(self, trainer, model):
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.epoch_ends.append((trainer.current_epoch, trainer.callback_metrics["train_loss"], lr))


def assert_same_run(a: Trainer, b: Trainer) -> None:
    """Weights, optimizer state, schedulers and loss scaler are bit for bit the same."""
    for (name, x), y in zip(
        a.model.state_dict().items(), b.model.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), name
    for sa, sb in zip(a.optimizers[0].state.values(), b.optimizers[0].state.values(), strict=True):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert [s.state_dict() for s in a.lr_schedulers] == [s.state_dict() for s in b.lr_schedulers]
    assert a.precision.scaler.state_dict() == b.precision.scaler.state_dict()
    assert a.global_step == b.global_step


@pytest.mark.parametrize(
    ("spec", "overflow_at"), [("32-true", None), ("16-mixed", 5)], ids=["32-true", "16-skip"]
)
def test_a_checkpoint_saved_on_an_epochs_last_batch_resumes_bit_identically(
    tmp_path, spec, overflow_at
):
    """every_n_train_steps=6 with 6 steps an epoch saves on each epoch's last batch, after
    its validation and before its end. Before: CheckpointError (batch 12 of 12). Now the
    resumed run only ends that epoch (schedulers, on_train_epoch_end), without validating
    it again. With "16-skip" the epoch's last step overflows: no scheduler advances then."""
    train, val = loaders()
    seen_straight = Seen()
    straight = trainer(tmp_path / "a", spec, max_epochs=3, callbacks=[seen_straight])
    straight.fit(EpochScheduled(0, overflow_at), train, val)

    cb = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=6, save_top_k=-1)
    trainer(tmp_path / "b", spec, max_epochs=1, callbacks=[cb]).fit(
        EpochScheduled(0, overflow_at), train, val
    )
    path = tmp_path / "ck" / "epoch=0-step=6.ckpt"
    loop = ckpt_io.load(path)["loop"]
    assert (loop["epoch"], loop["batch"], loop["global_step"]) == (0, 12, 6)

    seen = Seen()
    resumed = trainer(tmp_path / "c", spec, max_epochs=3, callbacks=[seen])
    resumed.fit(EpochScheduled(123, overflow_at), train, val, ckpt_path=path)
    assert_same_run(straight, resumed)
    assert seen_straight.validated == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # every 4 of 12 batches
    assert seen.validated == [1, 1, 1, 2, 2, 2]
    assert seen.epoch_ends == seen_straight.epoch_ends  # epoch 0's too, from its saved sums
    if overflow_at is not None:
        assert straight.precision.scaler.stats().skipped_steps == 1


class StopInside(Callback):
    """Asks to stop after batch ``at`` of epoch ``epoch``."""

    def __init__(self, epoch: int, at: int) -> None:
        self.epoch, self.at = epoch, at

    def on_train_batch_end(self, trainer, model, outputs, batch, batch_idx):
        if (trainer.current_epoch, batch_idx) == (self.epoch, self.at):
            trainer.should_stop = True


@pytest.mark.parametrize("how", ["max_steps", "stop-in-window"])
def test_a_fit_stopped_inside_an_epoch_saves_its_last_step_and_resumes_from_it(tmp_path, how):
    """6 steps an epoch. max_steps=8 stops at batch 4 of epoch 1; a stop asked after batch 2
    of epoch 1, inside a window, takes effect after batch 3 (step 8), once the window's step
    is taken. Before: last.ckpt held step 6, so ckpt_path="last" went back two steps (and the
    stop stepped half a window with its losses divided by 2)."""
    train, val = loaders()
    seen_straight = Seen()
    straight = trainer(tmp_path / "a", "32-true", max_steps=14, callbacks=[seen_straight])
    straight.fit(EpochScheduled(0), train, val)

    cb = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)  # the latest epoch
    stop = dict(max_steps=8) if how == "max_steps" else dict(callbacks=[cb, StopInside(1, 2)])
    first = trainer(tmp_path / "b", "32-true", **{"callbacks": [cb], **stop})
    first.fit(EpochScheduled(0), train, val)
    assert (first.global_step, first.current_epoch, first.batches_done) == (8, 1, 4)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "epoch=1-step=8.ckpt",
        "last.ckpt",
    ]
    assert cb.best_model_path == str(tmp_path / "ck" / "epoch=1-step=8.ckpt")
    loop = ckpt_io.load(cb.last_model_path)["loop"]
    assert (loop["epoch"], loop["batch"], loop["global_step"]) == (1, 4, 8)

    seen = Seen()
    resumed = trainer(tmp_path / "c", "32-true", max_steps=14, callbacks=[cb, seen])
    resumed.fit(EpochScheduled(7), train, val, ckpt_path="last")
    assert_same_run(straight, resumed)
    assert seen.epoch_ends == seen_straight.epoch_ends[1:]  # epoch 1 from its saved sums


def test_a_stop_on_a_step_already_saved_adds_no_checkpoint(tmp_path):
    train, _ = loaders()
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, save_last=True)
    trainer(tmp_path, "32-true", max_steps=8, callbacks=[cb]).fit(DropoutNet(0), train)
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == [
        "epoch=0-step=4.ckpt",
        "epoch=1-step=8.ckpt",
        "last.ckpt",
    ]


def test_early_stopping_inside_an_epoch_saves_the_step_it_stopped_at(tmp_path):
    class Frozen(DropoutNet):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)  # val_loss never improves

    train, val = loaders()
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss")
    stop = EarlyStopping("val_loss", patience=1)
    t = trainer(tmp_path, "32-true", max_epochs=5, callbacks=[cb, stop])
    t.fit(Frozen(0), train, val)  # validates every 4 batches: the second pass stops it
    assert (t.current_epoch, t.batches_done, t.global_step) == (0, 8, 4)
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["epoch=0-step=4.ckpt"]
    assert cb.best_model_score == t.callback_metrics["val_loss"]


def test_cuda_rng_states_of_more_gpus_than_here_restore_those_present(monkeypatch):
    """A checkpoint from an 8-GPU machine resumes on a 1-GPU one: GPU 0's state is restored,
    the others are left out rather than indexed past the generators there."""
    restored = []

    def set_state(state, device="cuda"):
        if device >= 1:
            raise IndexError("tuple index out of range")  # torch.cuda.default_generators[1]
        restored.append((device, state))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_state)
    gpu_states = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]
    ckpt_io.set_rng_states({**ckpt_io.rng_states(), "cuda": gpu_states})
    assert restored == [(0, gpu_states[0])]


CTRL_C_IN_SAVES = """
import collections, json, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a program run from a shell
import torch.nn.functional as F
from mixprec.trainer import Callback, ModelCheckpoint, Trainer
from mixprec.trainer import checkpoint as ckpt_io
sys.path[:0] = {tests!r}
from test_trainer_checkpoint import DropoutNet, loaders

class CtrlC:
    # pickled by torch.save while it writes the checkpoint: Ctrl-C lands in the write
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGINT)
        return (collections.OrderedDict, ())

class PressCtrlC(Callback):
    # its state, saved in every checkpoint, presses Ctrl-C while the one of step `at` is written
    def __init__(self, at):
        self.at, self.trainer = at, None
    def on_fit_start(self, trainer, model):
        self.trainer = trainer
    def state_dict(self):
        return {{"ctrl_c": CtrlC()}} if self.trainer.global_step == self.at else {{"at": self.at}}

class Logged(DropoutNet):
    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

directory = {directory!r}
last = os.path.join(directory, "last.ckpt")
# a sweep: interrupted in the save of step 3, resumed from last.ckpt, interrupted in the save
# of step 5, resumed and run to its end
for at, resume in ((3, None), (5, last), (None, last)):
    ckpt = ModelCheckpoint(dirpath=directory, monitor={monitor!r}, save_top_k=2, save_last=True,
                           every_n_train_steps=1)
    t = Trainer(max_steps=7, seed=7, logger=False, enable_progress_bar=False,
                callbacks=[ckpt, PressCtrlC(at)])
    try:
        t.fit(Logged(0), loaders()[0], ckpt_path=resume)
        how = "finished"
    except KeyboardInterrupt:
        how = "interrupted"
    state = ckpt_io.load(last)
    print(json.dumps(dict(how=how, step=t.global_step, files=sorted(os.listdir(directory)),
                          last_step=state["loop"]["global_step"],
                          recorded=state["callbacks"][ckpt.state_key])), flush=True)
"""


@pytest.mark.parametrize("monitor", [None, "train_loss"])
def test_ctrl_c_inside_a_model_checkpoint_save_leaves_it_complete_and_recorded(tmp_path, monitor):
    """Before: the interrupt came right after the file was written, so last.ckpt stayed a
    step behind and the checkpoint the new one displaced stayed on disk, recorded nowhere;
    each interrupted save left one file beyond save_top_k (and a resume wrote its step again
    as ``-v1``)."""
    import json

    directory = tmp_path / "ck"
    script = CTRL_C_IN_SAVES.format(
        tests=SCRIPT_PATH,
        directory=str(directory),
        monitor=monitor,
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["how"], r["step"]) for r in rounds] == [
        ("interrupted", 3),
        ("interrupted", 5),
        ("finished", 7),
    ]
    for r in rounds:
        assert r["last_step"] == r["step"]  # last.ckpt is the newest complete checkpoint
        kept = [f for f in r["files"] if f != "last.ckpt"]
        assert len(kept) <= 2 and not [f for f in kept if f.startswith(".")], r
        named = r["recorded"]["best_k_models"] if monitor else r["recorded"]["saved"]
        assert sorted(kept) == sorted(Path(p).name for p in named), r  # no file unrecorded
        assert Path(r["recorded"]["last_model_path"]).name == "last.ckpt"
    if monitor is None:  # the latest two
        assert rounds[0]["files"] == ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "last.ckpt"]
        assert rounds[2]["files"] == ["epoch=0-step=6.ckpt", "epoch=0-step=7.ckpt", "last.ckpt"]


def test_a_generator_in_a_batch_samplers_sampler_is_replayed_on_a_mid_epoch_resume(tmp_path):
    """A DataLoader built with batch_sampler= keeps an unused SequentialSampler as .sampler;
    the generator of the sampler really used was neither saved nor restored before, so a
    resume in epoch 1 replayed epoch 0's order."""
    from torch.utils.data import BatchSampler, RandomSampler

    data = loaders()[0].dataset

    def loader() -> DataLoader:
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(3))
        return DataLoader(data, batch_sampler=BatchSampler(sampler, 16, drop_last=False))

    def fit(steps: int, ckpt_path: Path | None = None) -> Trainer:
        t = Trainer(max_steps=steps, seed=0, enable_checkpointing=False, **SILENT)
        t.fit(DropoutNet(0), loader(), ckpt_path=ckpt_path)  # 6 batches an epoch
        return t

    straight = fit(10)
    path = fit(8).save_checkpoint(tmp_path / "mid.ckpt")  # epoch 1, batch 2
    resumed = fit(10, path)
    for (name, a), b in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_new_trainer_resumes_from_last_on_disk_and_says_what_it_lacks_for_best(tmp_path):
    """``ckpt_path="last"`` looked only at what this Trainer's ModelCheckpoint had saved, so
    a new Trainer resuming a crashed run failed with last.ckpt on disk; it takes that file.
    ``"best"`` cannot be known before a save: the error says to pass a path."""
    train, _ = loaders()
    kwargs = dict(logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    first = Trainer(max_epochs=1, callbacks=[ModelCheckpoint(save_last=True)], **kwargs)
    first.fit(DropoutNet(0), train)
    resumed = Trainer(max_epochs=2, callbacks=[ModelCheckpoint(save_last=True)], **kwargs)
    resumed.fit(DropoutNet(0), train, ckpt_path="last")
    assert resumed.ckpt_path == tmp_path / "checkpoints" / "last.ckpt"
    assert resumed.global_step == 2 * first.global_step
    fresh = Trainer(max_epochs=1, **kwargs)
    with pytest.raises(ValueError, match="saved no best checkpoint .a new Trainer.*pass the"):
        fresh.fit(DropoutNet(0), train, ckpt_path="best")


class Flat(TrainingModule):
    """A loss that never improves (lr 0): early stopping counts every check."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.layer(batch[0]), batch[1])
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _flat_data(n: int) -> DataLoader:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def test_early_stopping_resumed_from_a_save_on_an_epochs_last_batch_counts_its_check_once(
    tmp_path,
):
    """The save (every 4 steps, the epoch's 4 batches) came after the epoch's validation;
    the resumed fit, with only the epoch's end left, checked the epoch again at its end (a
    fit "without validation" to a flag reset at the start of each fit): it stopped an
    epoch early."""
    train, val = _flat_data(32), _flat_data(16)
    kwargs = dict(max_epochs=6, **SILENT)
    whole = EarlyStopping("val_loss", patience=2)
    straight = Trainer(default_root_dir=tmp_path / "a", callbacks=[whole], **kwargs)
    straight.fit(Flat(), train, val)
    saves = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=4, save_top_k=-1)
    first = Trainer(
        default_root_dir=tmp_path / "b",
        callbacks=[saves, EarlyStopping("val_loss", patience=2)],
        **{**kwargs, "max_epochs": 1},
    )
    first.fit(Flat(), train, val)
    resumed_stopping = EarlyStopping("val_loss", patience=2)
    resumed = Trainer(default_root_dir=tmp_path / "c", callbacks=[resumed_stopping], **kwargs)
    resumed.fit(Flat(), train, val, ckpt_path=tmp_path / "ck" / "epoch=0-step=4.ckpt")
    assert (resumed.global_step, resumed_stopping.stopped_epoch) == (12, 2)
    assert (straight.global_step, whole.stopped_epoch) == (12, 2)


def test_a_callback_listed_after_model_checkpoint_is_saved_as_it_left_the_epoch(tmp_path):
    """The epoch-end checkpoint was written before the callbacks listed after the
    ModelCheckpoint had their epoch's end: an EarlyStopping there counted an epoch the
    checkpoint missed, and the resumed fit stopped an epoch later. The checkpoints run last."""
    data = _flat_data(16)
    kwargs = dict(default_root_dir=tmp_path, **SILENT)

    def fit(epochs: int, directory: str, resume: bool = False) -> tuple[Trainer, EarlyStopping]:
        stopping = EarlyStopping("train_loss", patience=2)
        saves = ModelCheckpoint(dirpath=tmp_path / directory, save_last=True)
        trainer = Trainer(max_epochs=epochs, callbacks=[saves, stopping], **kwargs)
        assert trainer.callbacks[-1] is saves
        path = tmp_path / directory / "last.ckpt" if resume else None
        trainer.fit(Flat(), data, ckpt_path=path)
        return trainer, stopping

    straight, _ = fit(10, "a")
    _, first = fit(2, "b")
    saved = torch.load(tmp_path / "b" / "last.ckpt", weights_only=True)["callbacks"]
    assert saved["EarlyStopping[monitor=train_loss]"]["wait_count"] == first.wait_count == 1
    resumed, _ = fit(10, "b", resume=True)
    assert resumed.current_epoch == straight.current_epoch == 3


class EpochTag(Callback):
    """Logs a value through the module at each training epoch's end, as Lightning's
    callbacks may."""

    def on_train_epoch_end(self, trainer, model):
        model.log("tag", float(trainer.current_epoch))


def test_a_value_a_callback_logs_at_an_epochs_end_is_not_carried_past_a_resume(tmp_path):
    """The epoch-end checkpoint kept it among the training epoch's sums (it is logged right
    after the save): the resumed fit logged it again for the next epoch, a stale row."""
    data = _flat_data(16)

    def tags(logger, epochs: int, name: str, resume: bool = False) -> list[tuple[str, str]]:
        saves = ModelCheckpoint(dirpath=tmp_path / f"{name}-ck", save_last=True)
        path = tmp_path / f"{name}-ck" / "last.ckpt" if resume else None
        Trainer(
            max_epochs=epochs,
            logger=logger,
            callbacks=[EpochTag(), saves],
            seed=0,
            enable_progress_bar=False,
        ).fit(Flat(), data, ckpt_path=path)
        with open(logger.path) as f:
            return [(r["step"], r["tag"]) for r in csv.DictReader(f) if r.get("tag")]

    straight = tags(mixprec.trainer.CSVLogger(tmp_path / "a"), 3, "a")
    logger = mixprec.trainer.CSVLogger(tmp_path / "b")  # (one run's rows, resumed)
    tags(logger, 1, "b")
    resumed = tags(logger, 3, "b", resume=True)
    assert resumed == straight == [("2", "0.0"), ("4", "1.0"), ("6", "2.0")]


class Scored(Flat):
    """Validation logs a set score per epoch: epoch 2's is the best."""

    SCORES = (3.0, 2.0, 1.0, 5.0, 6.0)

    def validation_step(self, batch, batch_idx):
        self.log("m", self.SCORES[self.trainer.current_epoch])


def test_two_model_checkpoints_in_one_directory_keep_their_files_across_a_resume(tmp_path):
    """The first one's last.ckpt holds the second one's record from before its save of the
    same step: resumed from it, the second removed its own newest file as "written after
    the checkpoint" (its best, score 1.0) and named a file it had removed as its best. It
    takes the record its own file of that step holds; neither removes the other's files."""
    data, directory = _flat_data(8), tmp_path / "ck"

    def fit(epochs: int, resume: bool = False) -> ModelCheckpoint:
        best = ModelCheckpoint(dirpath=directory, monitor="m", filename="best-{epoch}")
        latest = ModelCheckpoint(dirpath=directory, save_last=True)
        Trainer(
            max_epochs=epochs, callbacks=[latest, best], default_root_dir=tmp_path, **SILENT
        ).fit(Scored(), data, data, ckpt_path=directory / "last.ckpt" if resume else None)
        return best

    assert Path(fit(3).best_model_path).name == "best-2.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing to remove)
        best = fit(5, resume=True)
    assert sorted(p.name for p in directory.iterdir()) == [
        "best-2.ckpt",
        "epoch=4-step=5.ckpt",
        "last.ckpt",
    ]
    assert (Path(best.best_model_path).name, best.best_model_score) == ("best-2.ckpt", 1.0)


def test_early_stopping_resumed_into_a_fit_without_validation_checks_each_epoch_end(tmp_path):
    """Restored from a fit that validated, its "validated" flag stayed set for the whole
    resumed fit, which had no validation: no epoch's end was ever checked and the fit ran
    all its epochs. Only the resumed save's own epoch end is covered by its validation."""
    train, val = _flat_data(32), _flat_data(16)
    saves = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=4, save_top_k=-1)
    first = [saves, EarlyStopping("val_loss", patience=1)]
    Trainer(max_epochs=1, callbacks=first, default_root_dir=tmp_path, **SILENT).fit(
        Flat(), train, val
    )
    # (the fit without validation reads the val_loss the checkpoint holds, which never
    # improves: each epoch's end it checks counts)
    stopping = EarlyStopping("val_loss", patience=1)
    resumed = Trainer(max_epochs=5, callbacks=[stopping], default_root_dir=tmp_path / "b", **SILENT)
    resumed.fit(Flat(), train, ckpt_path=tmp_path / "ck" / "epoch=0-step=4.ckpt")
    assert stopping.stopped_epoch == 1  # (epoch 0's end was checked at its validation)


def test_a_stop_inside_an_epoch_is_not_ranked_by_a_validation_of_older_weights(tmp_path):
    """The save a max_steps stop adds was ranked into top-k with the last validation's
    score, which measured the weights of steps before: it pushed out a validated file,
    and a resumed run ended with another top-k than an uninterrupted one."""
    scores = [0.7, 0.6, 0.9, 0.8]

    class Scripted(DropoutNet):
        def validation_step(self, batch, batch_idx):
            self.log("score", scores[self.current_epoch])

    def fit(root: Path, **kwargs) -> ModelCheckpoint:
        check = ModelCheckpoint(monitor="score", save_top_k=2, save_last=True)
        t = Trainer(default_root_dir=root, seed=0, callbacks=[check], **SILENT, **kwargs)
        t.fit(Scripted(0), *loaders())
        return check

    straight = fit(tmp_path / "a", max_epochs=4)
    cut = fit(tmp_path / "b", max_epochs=4, max_steps=26)  # 12 batches an epoch
    assert sorted(map(Path, cut.best_k_models)) == [
        tmp_path / "b" / "checkpoints" / "epoch=0-step=12.ckpt",
        tmp_path / "b" / "checkpoints" / "epoch=1-step=24.ckpt",
    ]
    check = ModelCheckpoint(monitor="score", save_top_k=2, save_last=True)
    resumed = Trainer(
        default_root_dir=tmp_path / "b", seed=0, max_epochs=4, callbacks=[check], **SILENT
    )
    resumed.fit(Scripted(0), *loaders(), ckpt_path="last")
    assert sorted(Path(p).name for p in check.best_k_models) == sorted(
        Path(p).name for p in straight.best_k_models
    )


def test_a_resumed_fit_ranks_no_weights_its_last_validation_did_not_measure(tmp_path):
    """A fit resumed after its last validation and stopped before the next one ranked its
    final weights by that validation's score (of weights steps older): the resumed run kept
    a file the uninterrupted one did not. The step a validation measured is resumed too."""
    train, val = loaders()  # (12 batches an epoch, windows of 2: a validation every 2 steps)

    def run(where: str, steps: int, ckpt: str | None = None) -> ModelCheckpoint:
        cb = ModelCheckpoint(dirpath=tmp_path / where, monitor="val_loss", save_top_k=3)
        cb.save_last = True
        t = trainer(tmp_path / where, "32-true", max_steps=steps, callbacks=[cb])
        t.fit(DropoutNet(0), train, val, ckpt_path=ckpt)
        return cb

    straight = run("straight", 3)
    assert not straight.best_k_models  # (step 3's weights: never validated)
    run("resumed", 2)  # (ends on a validated step: ranked)
    resumed = run("resumed", 3, str(tmp_path / "resumed" / "last.ckpt"))
    assert {Path(p).name for p in resumed.best_k_models} == {"epoch=0-step=2.ckpt"}


def test_a_checkpoint_from_before_the_validated_step_was_kept_ranks_no_unmeasured_weights(
    tmp_path,
):
    """A state saved before ModelCheckpoint kept the step a validation measured read as
    'no validation in this fit', and the final, never validated weights were ranked."""
    train, val = loaders()

    def run(steps: int, ckpt: str | None = None) -> ModelCheckpoint:
        cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=3, save_last=True)
        trainer(tmp_path, "32-true", max_steps=steps, callbacks=[cb]).fit(
            DropoutNet(0), train, val, ckpt_path=ckpt
        )
        return cb

    first = run(2)
    state = torch.load(first.last_model_path, weights_only=False)
    del state["callbacks"][first.state_key]["validated_at"]  # (as written before it was kept)
    torch.save(state, tmp_path / "old.ckpt")
    resumed = run(3, str(tmp_path / "old.ckpt"))
    assert {Path(p).name for p in resumed.best_k_models} == {"epoch=0-step=2.ckpt"}


def test_resume_with_another_kind_of_loss_scaler_starts_it_fresh(tmp_path, caplog):
    """A run saved under a static scale and resumed with the dynamic one (as the divergence
    error advises) raised in the optimizer's load, after the weights had been loaded: the
    model was the checkpoint's and the run had not started. The scaler starts fresh, as
    built, and the rest resumes as saved."""
    from mixprec import Precision

    train, _ = loaders()
    static = Precision("16-mixed", allow_slow=True, scaler=1024.0)
    first = trainer(tmp_path / "a", static, max_steps=2)
    first.fit(DropoutNet(0), train)
    path = first.save_checkpoint(tmp_path / "static.ckpt")
    saved = [p.detach().clone() for p in first.optimizers[0].master_params.values()]
    resumed = DropoutNet(seed=9)
    with caplog.at_level(logging.INFO, logger="mixprec"):
        dynamic = Precision("16-mixed", allow_slow=True)
        again = trainer(tmp_path / "b", dynamic, max_steps=2)
        again.fit(resumed, train, ckpt_path=path)  # nothing left to train: only restores
    assert "'static' loss scaler, this run uses 'dynamic': starting it fresh" in caplog.text
    assert again.global_step == 2
    assert again.precision.scaler.kind == "dynamic" and again.precision.scaler.loss_scale == 2.0**16
    masters = list(again.optimizers[0].master_params.values())
    assert all(torch.equal(m, s) for m, s in zip(masters, saved, strict=True))


class NumpyBest(Callback):
    """Keeps its best loss as a numpy.float64, which torch.load(weights_only=True) refuses."""

    def __init__(self) -> None:
        import numpy as np

        self.best = np.float64(np.inf)

    def on_train_epoch_end(self, trainer, model):
        import numpy as np

        self.best = min(self.best, np.float64(trainer.callback_metrics["train_loss"]))

    def state_dict(self):
        return {"history": [1.0, {"best": self.best}]}

    def load_state_dict(self, state):
        self.best = state["history"][1]["best"]


def test_a_callback_state_no_resume_could_read_is_refused_when_saved(tmp_path):
    """The save succeeded and every resume from it failed, saying the file held pickled
    objects, "e.g. a whole model saved with torch.save(model)"."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    trainer = Trainer(max_epochs=1, callbacks=[NumpyBest(), checkpoints], **SILENT)
    where = r"state_dict\(\)\['history'\]\[1\]\['best'\] of callback 'NumpyBest'"
    with pytest.raises(TypeError, match=rf"{where} is a numpy.float64, .*float\(x\)"):
        trainer.fit(Flat(), _flat_data(16))
    assert list((tmp_path / "ck").iterdir()) == []  # (its temporary file removed)
    assert checkpoints.last_model_path == checkpoints.best_model_path == ""


def test_a_checkpoint_torch_will_not_load_is_refused_saying_what_it_holds(tmp_path):
    """A checkpoint saved before such states were refused: the error named only "a whole
    model saved with torch.save(model)", not the type torch refused."""
    import numpy as np

    path = tmp_path / "old.ckpt"
    torch.save({"format": ckpt_io.FORMAT, "callbacks": {"Track": {"best": np.float64(1)}}}, path)
    with pytest.raises(ckpt_io.CheckpointError, match=r"Unsupported global: GLOBAL numpy\..*"):
        ckpt_io.load(path)


@pytest.mark.parametrize(
    ("filename", "left"),
    [("run/{epoch}", ["run", "run/2.ckpt"]), ("{epoch}/model", ["2", "2/model.ckpt"])],
)
def test_save_top_k_removes_its_older_checkpoints_in_a_sub_directory(tmp_path, filename, left):
    """A file not directly in dirpath was never removed: every epoch's stayed."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename=filename, save_top_k=1)
    trainer = Trainer(max_epochs=3, callbacks=[checkpoints], **SILENT)
    trainer.fit(Flat(), _flat_data(16))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == left
    assert checkpoints.best_model_path == str(tmp_path / left[1])


def test_a_top_k_filename_that_is_the_last_copys_name_is_refused():
    """filename="last" with save_last=True: save_top_k deleted last.ckpt between saves."""
    with pytest.raises(ValueError, match=r"filename='last', save_last=True\) names its top-k"):
        ModelCheckpoint(filename="last", save_last=True)
    ModelCheckpoint(filename="last")  # no last copy: a name like any other
    ModelCheckpoint(filename="last", save_last=True, save_top_k=0)  # and no top-k files


def test_a_checkpoint_linked_onto_itself_leaves_no_temporary_file(tmp_path):
    """Each such link left a stray .last.ckpt.<host>.<pid>.<token>.tmp hard link: renaming
    a file onto a hard link of itself does nothing."""
    path = ckpt_io.atomic_save({"x": torch.ones(2)}, tmp_path / "a.ckpt")
    os.link(path, tmp_path / "b.ckpt")
    for name in ("a.ckpt", "b.ckpt"):
        ckpt_io.atomic_link(path, tmp_path / name)
    tmp = ckpt_io.new_tmp(path)
    tmp.unlink()
    os.link(path, tmp)
    ckpt_io.install(tmp, tmp_path / "b.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt", "b.ckpt"]
    assert torch.equal(torch.load(tmp_path / "b.ckpt", weights_only=True)["x"], torch.ones(2))


class SetsAndSizes(Callback):
    """A state of values that are not plain numbers but that torch reads back."""

    def state_dict(self):
        return {"seen": {1, 2}, "shape": torch.Size([2, 3]), "dtype": torch.float16}

    def load_state_dict(self, state):
        self.loaded = state


def test_a_callback_state_torch_reads_back_saves_and_resumes(tmp_path):
    trainer = Trainer(
        max_epochs=1, callbacks=[SetsAndSizes()], **SILENT, enable_checkpointing=False
    )
    trainer.fit(Flat(), _flat_data(16))
    path = trainer.save_checkpoint(tmp_path / "sets.ckpt")
    resumed = SetsAndSizes()
    again = Trainer(max_epochs=2, callbacks=[resumed], **SILENT, enable_checkpointing=False)
    again.fit(Flat(), _flat_data(16), ckpt_path=path)
    assert resumed.loaded == {"seen": {1, 2}, "shape": torch.Size([2, 3]), "dtype": torch.float16}


def test_the_save_check_walks_a_shared_or_self_holding_state_once(tmp_path):
    """A review found the walk for values a safe load cannot read visited a container held
    twice every time (a list doubled 22 times: 2^23 visits, 8 s, for a file of 1 KB) and
    recursed forever on a list holding itself."""
    shared: list = [1]
    for _ in range(22):
        shared = [shared, shared]
    assert list(ckpt_io.unusual_parts({"state": shared})) == []
    looped: list = [1]
    looped.append(looped)
    assert list(ckpt_io.unusual_parts(looped)) == []
    ckpt_io.atomic_save({"state": shared}, tmp_path / "shared.ckpt")


def same_contents(a, b, where: str = "") -> None:
    """Assert two checkpoint states hold the same keys and values, tensors bit for bit."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same_contents(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same_contents(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def test_a_save_after_fit_and_validate_is_the_save_right_after_the_fit(tmp_path):
    """Found by a review: a validate or test after a fit made the Trainer forget the fit:
    ``optimizers`` and ``lr_schedulers`` were [], ``num_training_batches`` None, and
    save_checkpoint raised "call it during or after Trainer.fit", though called after one
    (the docstrings say "of the current or last fit"). The save now holds what a save right
    after the fit holds, bit for bit: the evaluation's reseeded generators, its metrics and
    its fresh loss scaler (16-mixed, one step skipped) are not the fit's. One that loaded a
    checkpoint into the fit's model is refused: its weights are no longer the fit's."""
    train, val = loaders()
    model = EpochScheduled(0, overflow_at=2)
    t = trainer(tmp_path / "a", "16-mixed", max_steps=5)
    t.fit(model, train, val)  # (stopped inside its epoch: the epoch's sums are saved)
    right = ckpt_io.load(t.save_checkpoint(tmp_path / "right.ckpt"))
    assert right["precision"]["scaler"]["scale"] != 65536.0  # (the skipped step halved it)
    t.validate(model, val)
    assert (len(t.optimizers), len(t.lr_schedulers), t.num_training_batches) == (1, 2, 12)
    after = ckpt_io.load(t.save_checkpoint(tmp_path / "after.ckpt"))
    same_contents(right, after)
    t.validate(model, val, ckpt_path=tmp_path / "right.ckpt")
    with pytest.raises(RuntimeError, match="validate loaded .*right.ckpt into the fit's model"):
        t.save_checkpoint(tmp_path / "refused.ckpt")


class Noisy(torch.utils.data.Dataset):
    """Random augmentation as a dataset's __getitem__ draws it (from torch's generator)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(96, 6, generator=g) * 0.1
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.randn(6), self.y[i]


def save_in(hook: str, epoch: int, batches_done: int, path: Path) -> Callback:
    """A callback saving ``path`` once, in ``hook`` of the fit at that point."""

    def save(self, trainer, model, *args):
        at = (trainer.current_epoch, trainer.batches_done) == (epoch, batches_done)
        if trainer.stage == "fit" and at and not path.exists():
            trainer.save_checkpoint(path)

    return type("SaveIn", (Callback,), {hook: save})()


@pytest.mark.parametrize(
    ("hook", "epoch", "batches_done"),
    [
        ("on_validation_end", 0, 4),
        ("on_validation_batch_end", 0, 8),
        ("on_validation_end", 0, 12),
        ("on_train_batch_start", 0, 4),
        ("on_train_batch_start", 1, 0),
    ],
)
def test_a_save_in_a_validation_or_at_a_batch_start_resumes_bit_identically(
    tmp_path, hook, epoch, batches_done
):
    """Found by a review: a checkpoint saved during a fit's validation held the random
    generators as the validation had moved them (its DataLoader draws a seed at each pass),
    while the run that never stopped goes on from those the validation restores: the
    resumed run's dropout differed. One saved in on_train_batch_start held them after its
    batch was fetched (a dataset's random augmentation drawn), and the resume fetches that
    batch again: it drew other noise. Each now holds the states the run goes on from."""
    train = DataLoader(Noisy(), batch_size=8, shuffle=True)
    val = DataLoader(Noisy(), batch_size=48, shuffle=True)
    path = tmp_path / "x.ckpt"
    straight = DropoutNet(seed=0)
    callback = save_in(hook, epoch, batches_done, path)
    trainer(tmp_path / "a", "32-true", max_epochs=2, callbacks=[callback]).fit(straight, train, val)
    assert path.exists()
    loop = ckpt_io.load(path)["loop"]
    assert (loop["epoch"], loop["batch"]) == (epoch, batches_done)
    resumed = DropoutNet(seed=123)
    t = trainer(tmp_path / "b", "32-true", max_epochs=2)
    t.fit(resumed, train, val, ckpt_path=path)
    assert t.global_step == 12
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
