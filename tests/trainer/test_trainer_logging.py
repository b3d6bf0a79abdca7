"""What a user sees and keeps: the progress bar and summary, the CSV file and the TensorBoard
event file (read back with TensorBoard's own reader)."""

from __future__ import annotations

import csv
import importlib.util
import io
import math
import pickle
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec.trainer import (
    Callback,
    CSVLogger,
    EarlyStopping,
    Logger,
    ModelCheckpoint,
    RichProgressBar,
    RunEstimate,
    TensorBoardLogger,
    Trainer,
    TrainingModule,
)
from mixprec.trainer.metrics import MetricStore


def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


class Model(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("train_ce", loss, prog_bar=True)
        self.log("seen", float(len(batch[1])), on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]), prog_bar=True)


def fit(tmp_path, precision="32-true", **kwargs) -> Trainer:
    trainer = Trainer(
        precision=precision,
        max_epochs=2,
        default_root_dir=tmp_path,
        allow_slow_precision=True,
        **kwargs,
    )
    trainer.fit(Model(), DataLoader(data(), batch_size=16), DataLoader(data(32), batch_size=16))
    return trainer


def test_progress_bar_shows_the_run_and_a_summary_on_a_terminal(tmp_path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200, color_system=None)
    bar = RichProgressBar(console=console, refresh_seconds=0.0)
    trainer = fit(tmp_path, "16-mixed", callbacks=[bar], logger=False)
    text = out.getvalue()
    for expected in (
        "epoch 1/2",
        "epoch 2/2",
        "4/4",
        "eta",
        "loss ",
        "loss scale 65,536",
        "skipped 0",
        "lr 1.00e-03",
        "samples/s",
        "train_ce",
        "val_loss",
        "mixprec run summary",
        "16-mixed (",
        "65536 (0 skipped steps)",
        "epochs / steps",
        "2 / 8",
        "peak memory",
        "throughput",
    ):
        assert expected in text, expected
    assert not bar.active
    assert trainer.summary()["epochs / steps"] == "2 / 8"


def test_progress_bar_is_silent_when_not_a_terminal_or_disabled(tmp_path):
    out = io.StringIO()
    bar = RichProgressBar(console=Console(file=out))  # a file: not a terminal
    fit(tmp_path, callbacks=[bar], logger=False)
    assert out.getvalue() == "" and not bar.active
    trainer = Trainer(enable_progress_bar=False, logger=False)
    assert not any(isinstance(c, RichProgressBar) for c in trainer.callbacks)


def test_csv_and_tensorboard_hold_every_logged_value(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = fit(tmp_path, "16-mixed", enable_progress_bar=False, log_every_n_steps=1)
    run = tmp_path / "logs" / "version_0"
    assert trainer.run_dir == run
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    columns = rows[0].keys()
    for name in ("step", "loss", "lr", "loss_scale", "skipped_steps", "samples_per_sec"):
        assert name in columns
    for name in ("peak_memory_mib", "train_ce", "seen_step", "seen_epoch", "val_loss"):
        assert name in columns
    step_rows = [r for r in rows if r["loss"]]
    assert [int(r["step"]) for r in step_rows] == list(range(1, 9))
    assert all(
        float(r["loss_scale"]) == 65536.0 and float(r["skipped_steps"]) == 0 for r in step_rows
    )
    # throughput and peak memory: in every logged step row, over the steps since the last
    rated = [r for r in step_rows if r["samples_per_sec"]]
    assert [int(r["step"]) for r in rated] == list(range(1, 9))
    assert all(float(r["samples_per_sec"]) > 0 and float(r["peak_memory_mib"]) > 1 for r in rated)
    assert all(float(r["seen_step"]) == 16.0 for r in step_rows)
    val_rows = [r for r in rows if r.get("val_loss")]
    assert [int(r["step"]) for r in val_rows] == [4, 8]
    assert float(val_rows[-1]["val_loss"]) == pytest.approx(trainer.callback_metrics["val_loss"])

    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "loss",
        "lr",
        "loss_scale",
        "skipped_steps",
        "samples_per_sec",
        "peak_memory_mib",
    } <= tags
    assert {"train_ce", "seen_step", "seen_epoch", "val_loss"} <= tags
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == list(range(1, 9))
    for event, row in zip(loss, step_rows, strict=True):
        assert event.value == pytest.approx(float(row["loss"]), rel=1e-6)
    assert [e.step for e in events.Scalars("val_loss")] == [4, 8]


def test_a_second_run_gets_its_own_version_directory(tmp_path):
    fit(tmp_path, enable_progress_bar=False)
    trainer = fit(tmp_path, enable_progress_bar=False)
    assert trainer.run_dir.name == "version_1"
    assert (tmp_path / "logs" / "version_1" / "metrics.csv").is_file()
    assert (tmp_path / "logs" / "version_1" / "checkpoints" / "epoch=1-step=8.ckpt").is_file()


def test_csv_logger_widens_its_header_and_survives_pickling(tmp_path):
    logger = CSVLogger(tmp_path, name="x", flush_every=1)
    logger.log_metrics({"a": 1.0}, step=1)
    logger.log_metrics({"a": 2.0, "b": 3.0}, step=2)
    logger.log_metrics({"b": 4.0}, step=3)
    clone = pickle.loads(pickle.dumps(logger))  # file handles are not pickled
    logger.finalize()
    assert (tmp_path / "x" / "version_0" / "metrics.csv").read_text().splitlines() == [
        "step,a,b",
        "1,1.0,",
        "2,2.0,3.0",
        "3,,4.0",
    ]
    assert clone.path == logger.path
    pickle.dumps(TensorBoardLogger(tmp_path))


class StepCounter(Callback):
    """Logs its own value through the trainer, for the step about to be taken."""

    def on_before_optimizer_step(self, trainer, model, optimizer):
        step = trainer.global_step + 1
        trainer.log_metrics({"counted": torch.tensor(float(step))}, step)


def test_callbacks_log_through_the_trainer_in_step_order(tmp_path):
    trainer = fit(tmp_path, callbacks=[StepCounter()], enable_progress_bar=False)
    rows = list(csv.DictReader(open(trainer.run_dir / "metrics.csv")))
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(steps)
    counted = [(int(r["step"]), float(r["counted"])) for r in rows if r["counted"]]
    assert counted == [(s, float(s)) for s in range(1, 9)]
    assert trainer.callback_metrics["counted"] == 8.0


class EpochLogged(Model):
    """A training epoch metric (``on_epoch=True``), a value logged in ``on_train_epoch_end``
    and a plateau scheduler watching the epoch metric."""

    def __init__(self) -> None:
        super().__init__()
        self.accuracies: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        accuracy = (out.argmax(1) == y).float().mean()
        self.accuracies.append(accuracy.item())
        self.log("train_acc", accuracy, on_step=False, on_epoch=True)
        return F.cross_entropy(out, y)

    def on_train_epoch_end(self):
        self.log("epoch_seen", float(self.current_epoch))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", threshold=0.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "train_acc"}}


@pytest.mark.parametrize("validate", [False, True], ids=["no-val", "val"])
def test_training_epoch_metrics_are_logged_at_the_epoch_end_for_monitors(tmp_path, validate):
    # before: never logged without validation data (the monitors raised KeyError), else
    # taken by the next validation into its row; epoch_seen landed in the next step's row
    ckpt = ModelCheckpoint(monitor="train_acc", mode="max")
    trainer = Trainer(
        max_epochs=2, default_root_dir=tmp_path, enable_progress_bar=False, callbacks=[ckpt]
    )
    model = EpochLogged()
    val = DataLoader(data(32), batch_size=16) if validate else None
    trainer.fit(model, DataLoader(data(), batch_size=16), val)  # 4 steps an epoch

    means = [sum(model.accuracies[i : i + 4]) / 4 for i in (0, 4)]  # exact: sixteenths
    rows = list(csv.DictReader(open(trainer.run_dir / "metrics.csv")))
    epoch_rows = [r for r in rows if r["train_acc"]]
    assert [
        (int(r["step"]), float(r["train_acc"]), float(r["epoch_seen"])) for r in epoch_rows
    ] == [
        (4, means[0], 0.0),
        (8, means[1], 1.0),
    ]
    assert not any(r["epoch_seen"] for r in rows if r not in epoch_rows)
    assert [int(r["step"]) for r in rows if r.get("val_loss")] == ([4, 8] if validate else [])
    assert ckpt.best_model_score == max(means)
    assert ckpt.best_model_path.endswith(f"step={4 * (1 + means.index(max(means)))}.ckpt")
    assert trainer.lr_schedulers[0].best == max(means)


@pytest.mark.parametrize(
    ("limits", "left"),
    [({"max_epochs": 3}, 21), ({"max_steps": 6, "accumulate_grad_batches": 2}, 9)],
)
def test_run_estimate_says_early_how_long_the_training_will_take(limits, left, capsys):
    """8 batches an epoch; the estimate comes after 1 + 2 batches, once."""
    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), batch_size=8)
    said: list[str] = []
    estimate = RunEstimate(log=said.append)
    trainer = Trainer(callbacks=[estimate], logger=False, enable_checkpointing=False, **limits)
    trainer.fit(nn.Linear(4, 2), data, loss_fn=F.cross_entropy)
    assert said == [estimate.message]
    assert "s a training batch here (median of 2 after the first)" in said[0]
    assert f"; {left} batches to go: about " in said[0]
    assert said[0].endswith("validation not included")
    # without `log`, rank 0 says it on stderr
    trainer = Trainer(
        callbacks=[RunEstimate()], logger=False, enable_checkpointing=False, max_steps=4
    )
    trainer.fit(nn.Linear(4, 2), data, loss_fn=F.cross_entropy)
    assert "estimate: " in capsys.readouterr().err
    with pytest.raises(ValueError, match="batches must be an int >= 1"):
        RunEstimate(batches=0)


@pytest.mark.parametrize("same_loggers", [False, True])
def test_a_fit_resumed_into_its_logs_holds_each_step_once(tmp_path, same_loggers):
    """A run killed at step 6 after its checkpoint at step 4, resumed into the same
    version: the CSV file held steps 5 and 6 twice (its step column went back), and the
    event file did too. The rows past the resumed step are dropped (TensorBoard's purge for
    the event file): each step once, with the resumed run's values; also when the same
    logger objects go on in one process (rows held in memory), and a later stage's events
    purge nothing (the purge is written once)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)
    kept = [CSVLogger(tmp_path, version=0), TensorBoardLogger(tmp_path, version=0)]

    def trainer(steps: int, callbacks: list) -> Trainer:
        torch.manual_seed(0)
        loggers = kept if same_loggers else [type(lg)(tmp_path, version=0) for lg in kept]
        return Trainer(
            max_steps=steps,
            logger=loggers,
            callbacks=callbacks,
            log_every_n_steps=1,
            seed=0,
            enable_progress_bar=False,
        )

    saves = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=4, save_top_k=-1)
    trainer(6, [saves]).fit(nn.Linear(4, 1), loader, loss_fn=F.mse_loss)  # killed after 6
    resumed = trainer(8, [ModelCheckpoint(dirpath=tmp_path / "ck2")])
    resume = tmp_path / "ck" / "epoch=0-step=4.ckpt"
    resumed.fit(nn.Linear(4, 1), loader, loss_fn=F.mse_loss, ckpt_path=resume)
    resumed.validate(nn.Linear(4, 1), loader, loss_fn=F.mse_loss)  # (a writer after the fit's)
    run = tmp_path / "logs" / "version_0"
    rows = [r for r in csv.DictReader(open(run / "metrics.csv")) if r["loss"]]
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    events = EventAccumulator(str(run))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 9))
    logged = {e.step: e.value for e in events.Scalars("loss")}
    assert all(float(r["loss"]) == pytest.approx(logged[int(r["step"])]) for r in rows)


def test_a_new_event_file_sorts_after_those_already_in_its_directory(tmp_path):
    """TensorBoard reads a directory's event files in name order; a name holds the second
    and a per-process count, so a writer made in the same second as an earlier one, after
    the count went from 9 to 10, sorted first and a resumed fit's purge was read before the
    events it drops (seen when the resume test ran after ten other writers)."""
    import socket

    logger = TensorBoardLogger(tmp_path, version=0)
    logger.log_dir.mkdir(parents=True)
    # an earlier writer's file of this second whose name sorts after any this host makes
    planted = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}~.0"
    (logger.log_dir / planted).write_bytes(b"")
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.finalize()
    names = sorted(p.name for p in logger.log_dir.iterdir())
    assert len(names) == 2 and names[0] == planted


def test_metrics_csv_is_utf8_whatever_the_locale(tmp_path, monkeypatch):
    """The rewrite wrote UTF-8 while the appends and a resumed run's read took the locale's
    encoding: under a Latin-1 locale (as Windows' cp1252) a resumed run read "loss_µ" as
    another column and added it to the header at every resume."""
    import builtins

    from mixprec.trainer import loggers

    def latin_open(*args, **kwargs):  # open() as a Latin-1 locale has it
        if "b" not in (args[1] if len(args) > 1 else kwargs.get("mode", "r")):
            kwargs.setdefault("encoding", "latin-1")
        return builtins.open(*args, **kwargs)

    monkeypatch.setattr(loggers, "open", latin_open, raising=False)
    first = CSVLogger(tmp_path, version=0, flush_every=1)
    first.log_metrics({"loss_µ": 0.5}, 1)
    first.log_metrics({"loss_µ": 0.25}, 2)
    first.finalize()
    again = CSVLogger(tmp_path, version=0, flush_every=1)  # a resumed fit continues the file
    again.log_metrics({"loss_µ": 0.125}, 3)
    again.finalize()
    assert again.path.read_bytes() == "step,loss_µ\r\n1,0.5\r\n2,0.25\r\n3,0.125\r\n".encode()


class StepScheduled(Model):
    """A step-interval StepLR."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.4)
        step = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": step, "interval": "step"}}


def test_a_steps_row_holds_the_lr_it_used(tmp_path):
    """A step's row held the lr the scheduler set after it (steps 3, 6: the next step's)."""
    trainer = Trainer(
        max_epochs=2,
        default_root_dir=tmp_path,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(StepScheduled(), DataLoader(data(), batch_size=16))
    rows = list(csv.DictReader(open(trainer.run_dir / "metrics.csv")))
    lrs = {int(r["step"]): float(r["lr"]) for r in rows if r["lr"]}
    assert lrs == {s: 0.4 * 0.5 ** ((s - 1) // 3) for s in range(1, 9)}


def test_a_new_run_of_the_trainer_starts_without_the_last_runs_metrics(tmp_path):
    """callback_metrics were kept from one run to the next: a fit's monitor read the score
    of a validate() before it (the untrained model's) as its own, and ranked by it."""
    check = ModelCheckpoint(monitor="val_loss", every_n_train_steps=2, save_top_k=1)
    trainer = Trainer(
        max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False, callbacks=[check]
    )
    model = Model()
    trainer.validate(model, DataLoader(data(32), batch_size=16))
    assert "val_loss" in trainer.callback_metrics
    with pytest.warns(UserWarning, match="not logged yet"):
        trainer.fit(model, DataLoader(data(), batch_size=16))  # (no validation)
    assert check.best_k_models == {}


@pytest.mark.parametrize("hook", ["on_validation_end", "on_train_end"])
def test_a_value_logged_after_its_run_took_the_values_is_refused(tmp_path, hook):
    """A value logged in on_validation_end landed in the next validation's row, one in
    on_train_end nowhere: both are refused, naming the hook to log in instead."""

    class Late(Model):
        pass

    setattr(Late, hook, lambda self: self.log("late", 1.0))
    trainer = Trainer(max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False)
    with pytest.raises(
        ValueError, match=f"in {hook}: .* log it in on_(train|validation)_epoch_end"
    ):
        trainer.fit(Late(), DataLoader(data(), batch_size=16), DataLoader(data(32), batch_size=16))


class EpochRows(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.log("seen", float(len(batch[1])), on_step=True, on_epoch=True)
        return F.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _logged(root: Path) -> tuple[list[dict[str, float]], dict[str, list]]:
    """A run's CSV rows (timings left out) and its event file's loss, seen_epoch and
    val_loss scalars, as (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = root / "logs" / "version_0"
    timed = ("samples_per_sec", "peak_memory_mib")
    rows = [
        {k: float(v) for k, v in r.items() if v and k not in timed}
        for r in csv.DictReader(open(run / "metrics.csv"))
    ]
    events = EventAccumulator(str(run))
    events.Reload()
    tags = ("loss", "seen_epoch", "val_loss")
    return rows, {t: [(e.step, e.value) for e in events.Scalars(t)] for t in tags}


@pytest.mark.parametrize("same_loggers", [False, True])
def test_a_fit_resumed_from_an_epochs_last_batch_logs_its_epoch_row_once(tmp_path, same_loggers):
    """A save on an epoch's last batch (step 8 of 8) comes before the epoch's end, which a
    resume runs again: the epoch row of step 8 (``seen_epoch``), which the killed run had
    logged after the save, was kept and logged again, twice in the CSV file and the event
    file. The rows are now those of a run never stopped, each once, with the same values."""
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)  # 8 batches an epoch

    def fit(root, callbacks, loggers=None, **kwargs) -> None:
        torch.manual_seed(0)
        loggers = loggers or [CSVLogger(root, version=0), TensorBoardLogger(root, version=0)]
        trainer = Trainer(
            max_epochs=2,
            logger=loggers,
            callbacks=callbacks,
            log_every_n_steps=1,
            seed=0,
            enable_progress_bar=False,
        )
        trainer.fit(EpochRows(), loader, loader, **kwargs)

    def saves(root):
        return [ModelCheckpoint(dirpath=root / "ck", every_n_train_steps=8, save_top_k=-1)]

    kept = [CSVLogger(tmp_path / "a", version=0), TensorBoardLogger(tmp_path / "a", version=0)]
    fit(tmp_path / "a", saves(tmp_path / "a"), kept if same_loggers else None)  # killed after
    resume = tmp_path / "a" / "ck" / "epoch=0-step=8.ckpt"
    fit(tmp_path / "a", [], kept if same_loggers else None, ckpt_path=resume)
    fit(tmp_path / "b", saves(tmp_path / "b"))  # never stopped
    rows, events = _logged(tmp_path / "a")
    assert [r["step"] for r in rows if "seen_epoch" in r] == [8.0, 16.0]
    assert (rows, events) == _logged(tmp_path / "b")


@pytest.mark.parametrize("resume", ["step=1", "step=2", "epoch=0"])
def test_a_fit_resumed_inside_an_accumulation_window_logs_its_validations_once(tmp_path, resume):
    """With 2 micro-batches a step and a validation after each batch, the validation after
    a window's first batch is logged at the step before, after that step's checkpoint (one
    saved in on_train_batch_end, or at the epoch's end before the next epoch's first
    batch): resumed from it, the loggers kept that row and the resumed run logged it again,
    twice in the CSV file and the event file. The rows are now those of a run never
    stopped, from a save inside an epoch, on its last batch or at its end."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)  # 4 batches, 2 steps

    def fit(root, saves_to, ckpt_path=None) -> None:
        torch.manual_seed(0)
        saves = [
            ModelCheckpoint(
                saves_to / "steps", "step={step}", every_n_train_steps=1, save_top_k=-1
            ),
            ModelCheckpoint(saves_to / "epochs", "epoch={epoch}", save_top_k=-1),
        ]
        Trainer(
            max_epochs=2,
            accumulate_grad_batches=2,
            val_check_interval=1,
            logger=[CSVLogger(root, version=0), TensorBoardLogger(root, version=0)],
            callbacks=saves,
            log_every_n_steps=1,
            seed=0,
            enable_progress_bar=False,
        ).fit(EpochRows(), loader, loader, ckpt_path=ckpt_path)

    fit(tmp_path / "a", tmp_path / "ck")  # killed after its last step
    saved = tmp_path / "ck" / ("epochs" if resume.startswith("epoch") else "steps")
    fit(tmp_path / "a", tmp_path / "ck2", saved / f"{resume}.ckpt")
    fit(tmp_path / "b", tmp_path / "ck3")  # never stopped
    rows, events = _logged(tmp_path / "a")
    assert [r["step"] for r in rows if "val_loss" in r] == [0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0]
    assert (rows, events) == _logged(tmp_path / "b")


class EpochNumbers(Callback):
    """Logs the epoch at a step of its own choosing (the epoch's number) after each
    validation: rows at other steps than the training step's."""

    def on_validation_end(self, trainer, model):
        trainer.log_metrics({"epoch_number": float(trainer.current_epoch)}, step=0)


class Held(Logger):
    """A user's logger keeping what it is given; its resume_at is the base one, which drops
    nothing."""

    def __init__(self, save_dir) -> None:
        super().__init__(save_dir, version=0)
        self.rows: list[tuple[int, tuple[str, ...]]] = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, tuple(sorted(metrics))))


def test_a_resume_from_an_epochs_last_batch_keeps_rows_at_other_steps_and_other_loggers(
    tmp_path,
):
    """Found by a review of the fix above: a row a callback logged at a step of its own
    between the step's rows and the save made the checkpoint keep no row of the step, and
    the resume dropped the step's loss and val_loss rows; a logger of the user's, whose
    resume_at drops nothing, was handed the step's rows again (held twice). Now the rows are
    kept by step, and only loggers that drop rows past a resume are handed them again."""
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)  # 8 batches an epoch
    held = Held(tmp_path)

    def fit(root, callbacks, **kwargs) -> None:
        torch.manual_seed(0)
        trainer = Trainer(
            max_epochs=2,
            logger=[CSVLogger(root, version=0), held],
            callbacks=[EpochNumbers(), *callbacks],
            log_every_n_steps=1,
            seed=0,
            enable_progress_bar=False,
        )
        trainer.fit(EpochRows(), loader, loader, **kwargs)

    saves = [ModelCheckpoint(dirpath=tmp_path / "a" / "ck", every_n_train_steps=8, save_top_k=-1)]
    fit(tmp_path / "a", saves)
    first = list(held.rows)
    fit(tmp_path / "a", [], ckpt_path=tmp_path / "a" / "ck" / "epoch=0-step=8.ckpt")
    rows = list(csv.DictReader(open(tmp_path / "a" / "logs" / "version_0" / "metrics.csv")))
    assert [int(r["step"]) for r in rows if r["loss"]] == list(range(1, 17))
    assert [int(r["step"]) for r in rows if r["val_loss"]] == [8, 16]
    assert [int(r["step"]) for r in rows if r["seen_epoch"]] == [8, 16]
    # the user's logger: what the killed run gave it, then the resumed run's own rows only
    # (the epoch's end at step 8 again, as from any save before an epoch's end)
    again = held.rows[len(first) :]
    assert again[0] == (8, ("seen_epoch",)) and all(step > 8 or step == 0 for step, _ in again[1:])


def test_epoch_means_weigh_each_batch_by_its_size_when_no_batch_size_is_given(tmp_path):
    """A short last batch weighed as much as a full one in every epoch mean (val_loss here:
    batches of 4, 4 and 2, the last two outliers), unlike the plain-module path; now each
    value logged in a step weighs its batch's size, as in Lightning."""
    x = torch.zeros(10, 4)
    y = torch.zeros(10, 2)
    y[8:] = 10.0  # (the short last batch)
    trainer = Trainer(max_steps=1, default_root_dir=tmp_path, logger=False, seed=0)
    model = Model()
    model.validation_step = lambda batch, i: model.log(
        "val_loss", F.mse_loss(model(batch[0]), batch[1])
    )
    val = DataLoader(TensorDataset(x, y), batch_size=4)
    trainer.fit(model, DataLoader(data(8), batch_size=8), val)
    with torch.no_grad():
        expected = F.mse_loss(model(x), y).item()
    assert trainer.callback_metrics["val_loss"] == pytest.approx(expected, rel=1e-6)


class LogsItsOwnLoss(Model):
    def training_step(self, batch, batch_idx):
        data_term = F.cross_entropy(self(batch[0]), batch[1])
        self.log("loss", data_term)
        self.log("lr", 123.0)
        return data_term + 10.0  # (a regulariser the logged loss leaves out)


def test_a_loss_or_lr_the_step_logs_itself_keeps_its_value(tmp_path):
    """The Trainer's own loss and lr overwrote the names training_step logged: the loggers
    and monitors read the returned loss (data term + 10) where the data term was logged."""
    trainer = Trainer(max_steps=1, default_root_dir=tmp_path, log_every_n_steps=1, seed=0)
    trainer.fit(LogsItsOwnLoss(), DataLoader(data(16), batch_size=16))
    assert float(trainer.callback_metrics["loss"]) < 5.0
    assert float(trainer.callback_metrics["lr"]) == 123.0
    rows = list(csv.DictReader(io.StringIO(next(tmp_path.rglob("metrics.csv")).read_text())))
    assert float(rows[0]["loss"]) < 5.0 and float(rows[0]["lr"]) == 123.0


class Scored(Model):
    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = scores

    def validation_step(self, batch, batch_idx):
        self.log("v", self.scores[self.current_epoch])


def test_a_trainers_second_fit_ranks_and_waits_on_its_own_scores(tmp_path):
    """A second fit on the same Trainer (a new model, not resumed) kept the first fit's
    best score and patience: early stopping ended it after one epoch though every epoch
    improved, and the checkpoint callback kept the first fit's file as the best."""
    checkpoint = ModelCheckpoint(monitor="v", save_top_k=1)
    stopping = EarlyStopping("v", patience=2)
    trainer = Trainer(
        max_epochs=4, default_root_dir=tmp_path, logger=False, callbacks=[stopping, checkpoint]
    )
    loader = DataLoader(data(8), batch_size=4)
    trainer.fit(Scored([0.5, 0.1, 0.2, 0.3]), loader, loader)
    first = checkpoint.best_model_path
    trainer.fit(Scored([0.9, 0.8, 0.7, 0.6]), loader, loader)
    assert trainer.current_epoch == 4 and not stopping.reason
    assert checkpoint.best_model_score == pytest.approx(0.6)
    assert checkpoint.best_model_path != first and first.endswith("epoch=1-step=4.ckpt")
    assert Path(first).is_file()  # (the first fit's file is left alone)


class TensorLr(Model):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=torch.tensor(1.0))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5**k)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


class LrAtEpochEnd(Callback):
    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_epoch_end(self, trainer, model) -> None:
        self.seen.append(float(trainer.callback_metrics["lr"]))


def test_a_tensor_lr_reads_as_the_steps_used_it_after_an_epoch_scheduler_moved_it(tmp_path):
    """The latest step's row held the optimizer's lr tensor itself, which an epoch-interval
    scheduler then set in place: callbacks and the progress bar read the next epoch's lr."""
    seen = LrAtEpochEnd()
    trainer = Trainer(max_epochs=2, default_root_dir=tmp_path, logger=False, callbacks=[seen])
    trainer.fit(TensorLr(), DataLoader(data(8), batch_size=4))
    assert seen.seen == [1.0, 0.5]


class LogsAtBatchEnd(Model):
    def training_step(self, batch, batch_idx):
        self.log("in_step", float(batch_idx), on_step=False, on_epoch=True)
        return F.cross_entropy(self(batch[0]), batch[1])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("in_batch_end", float(batch_idx), on_step=False, on_epoch=True)


def test_a_value_logged_at_a_batch_end_after_a_validation_weighs_that_batch(tmp_path):
    """A validation inside a training batch left the batch size unset, so that batch's
    on_train_batch_end value weighed 1 sample where the others weighed 8."""
    trainer = Trainer(
        max_epochs=1, default_root_dir=tmp_path, logger=False, seed=0, val_check_interval=2
    )
    trainer.fit(LogsAtBatchEnd(), DataLoader(data(32), batch_size=8), DataLoader(data(8)))
    assert float(trainer.callback_metrics["in_step"]) == 1.5
    assert float(trainer.callback_metrics["in_batch_end"]) == 1.5


class LogsAtValidationBatchEnd(Model):
    def validation_step(self, batch, batch_idx):
        self.log("in_step", float(batch_idx), on_step=True, on_epoch=False)

    def on_validation_batch_end(self, outputs, batch, batch_idx):
        self.log("in_batch_end", float(batch_idx), on_step=True, on_epoch=False)


def test_a_value_logged_at_a_validation_batch_end_lands_in_that_batchs_row(tmp_path):
    """A validation batch's step values were taken before its on_validation_batch_end ran,
    so what that hook logged went out with the next batch's row (the last one's with the
    next validation's first)."""
    trainer = Trainer(max_epochs=2, default_root_dir=tmp_path, logger=CSVLogger(tmp_path))
    trainer.fit(
        LogsAtValidationBatchEnd(),
        DataLoader(data(8), batch_size=4),
        DataLoader(data(6), batch_size=2),
    )
    rows = list(csv.DictReader(open(trainer.run_dir / "metrics.csv")))
    pairs = [(r["in_step"], r["in_batch_end"]) for r in rows if r["in_step"] or r["in_batch_end"]]
    assert pairs == [("0.0", "0.0"), ("1.0", "1.0"), ("2.0", "2.0")] * 2
    # and the hook reads its own batch's values (Lightning's order), as before the fix
    model = LogsAtValidationBatchEnd()
    seen = []
    model.on_validation_batch_end = lambda outputs, batch, batch_idx: seen.append(
        (batch_idx, trainer.callback_metrics["in_step"], trainer.logged_metrics["in_step"])
    )
    trainer.validate(model, DataLoader(data(6), batch_size=2))
    assert seen == [(i, float(i), float(i)) for i in range(3)]


class LogsAtTrainBatchEnd(EpochRows):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("seen_batch", float(batch_idx))


class LossAtBatchEnd(Callback):
    """What callbacks read at each step's batch end: the step's loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, model, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["loss"])


def test_a_value_logged_at_a_training_batch_end_lands_in_that_steps_row(tmp_path):
    """The step's row was taken before on_train_batch_end ran: what the hook logged went
    out with the next step's row, the fit's last batch's never, and a checkpoint saved in
    that hook kept none of it (resumed from it, the value was gone). The row is now taken
    after the hook, as in Lightning (callbacks there still read the step's values), and a
    save in the hook keeps the row for the resumed run to log."""
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)  # 3 batches, 3 steps

    def fit(root, saves_to, ckpt_path=None) -> list[tuple[str, str]]:
        seen = LossAtBatchEnd()
        saves = ModelCheckpoint(saves_to, "{step}", every_n_train_steps=1, save_top_k=-1)
        trainer = Trainer(
            max_epochs=1,
            logger=CSVLogger(root, version=0),
            callbacks=[seen, saves],
            log_every_n_steps=1,
            enable_progress_bar=False,
        )
        trainer.fit(LogsAtTrainBatchEnd(), loader, ckpt_path=ckpt_path)
        rows = [r for r in csv.DictReader(open(trainer.run_dir / "metrics.csv")) if r["loss"]]
        assert seen.losses == [float(r["loss"]) for r in rows[-len(seen.losses) :]]
        return [(r["step"], r["seen_batch"]) for r in rows]

    rows = fit(tmp_path / "a", tmp_path / "ck")
    assert rows == [("1", "0.0"), ("2", "1.0"), ("3", "2.0")]
    assert fit(tmp_path / "a", tmp_path / "ck2", tmp_path / "ck" / "1.ckpt") == rows


def test_a_trainers_second_fit_is_a_run_of_its_own(tmp_path):
    """A second fit starts again from step 1: it logged into the first fit's version, over
    its steps (two rows of step 2 in one file, two curves in one TensorBoard run), and its
    checkpoints went beside the first fit's. A version chosen for the run moves on with
    the checkpoint directory; one given keeps its log; a resume stays in its run."""
    checkpoint = ModelCheckpoint()
    trainer = Trainer(max_epochs=1, default_root_dir=tmp_path, callbacks=[checkpoint])
    loader = DataLoader(data(8), batch_size=4)
    trainer.fit(Model(), loader)
    first, first_dir = trainer.run_dir, checkpoint.dirpath
    trainer.fit(Model(), loader)
    second = trainer.run_dir
    assert (first.name, second.name) == ("version_0", "version_1")
    assert checkpoint.dirpath == second / "checkpoints" != first_dir
    assert sorted(p.name for p in first_dir.iterdir()) == ["epoch=0-step=2.ckpt"]
    for run in (first, second):
        steps = [r["step"] for r in csv.DictReader(open(run / "metrics.csv"))]
        assert steps == sorted(steps, key=int) and len(set(steps)) == len(steps)
    trainer.fit(Model(), loader, ckpt_path=checkpoint.best_model_path)  # (a resume: same run)
    assert trainer.run_dir == second
    given = CSVLogger(tmp_path / "given", version=3)
    trainer = Trainer(max_epochs=1, default_root_dir=tmp_path, logger=given)
    trainer.fit(Model(), loader)
    trainer.fit(Model(), loader)
    assert trainer.run_dir.name == "version_3"
    assert [r["step"] for r in csv.DictReader(open(given.path))].count("2") == 2


def test_a_launched_fits_checkpoint_directory_is_the_run_it_saved_into(tmp_path):
    """Handed back from a second launched fit, a default directory kept the first fit's."""
    from mixprec.trainer.callbacks import callback_states, load_callback_states

    theirs = ModelCheckpoint()
    theirs.dirpath = tmp_path / "logs" / "version_1" / "checkpoints"
    mine = ModelCheckpoint()
    mine.dirpath, mine._default_dir = tmp_path / "logs" / "version_0" / "checkpoints", True
    load_callback_states([mine], callback_states([theirs]), resume=False)
    assert mine.dirpath == theirs.dirpath and mine._default_dir and not mine._loaded
    given = ModelCheckpoint(dirpath=tmp_path / "mine")
    load_callback_states([given], callback_states([theirs]), resume=False)
    assert given.dirpath == tmp_path / "mine"


def test_a_new_run_drops_the_rows_of_a_version_the_processes_agreed_on(tmp_path):
    """Under torchrun a logger's version is set by the processes' agreement, not chosen by
    it: a second fit's file got the first fit's rows written again."""
    logger = CSVLogger(tmp_path)
    logger.version = 0  # (as `agree_on_version` sets it)
    logger.log_metrics({"a": 1.0}, step=2)
    logger.new_run()
    logger.version = 1
    logger.log_metrics({"a": 2.0}, step=2)
    logger.finalize()
    rows = list(csv.DictReader(open(logger.path)))
    assert [r["a"] for r in rows] == ["2.0"]


def test_trainers_and_loggers_pickled_before_new_runs_were_kept_fit_again(tmp_path):
    trainer = Trainer(max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False)
    del trainer.__dict__["_fitted"]
    for lg in trainer.loggers:
        del lg.__dict__["_chosen"]
    trainer = pickle.loads(pickle.dumps(trainer))
    loader = DataLoader(data(8), batch_size=4)
    trainer.fit(Model(), loader)
    trainer.fit(Model(), loader)


def csv_steps(path: Path) -> list[int]:
    """The steps of the training step rows (those with a loss) in a metrics.csv on disk."""
    with open(path, newline="", encoding="utf-8") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("loss")]


def tensorboard_steps(run: Path) -> list[int]:
    """The steps of the ``loss`` scalars in a run directory's event files on disk."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    return [e.step for e in events.Scalars("loss")] if "loss" in events.Tags()["scalars"] else []


class SavesThenReads(Callback):
    """Saves a checkpoint at step ``at``, then reads what the loggers' files hold on disk."""

    def __init__(self, at: int, path: Path) -> None:
        self.at, self.path = at, path
        self.on_disk: tuple[list[int], list[int]] | None = None

    def on_train_batch_end(self, trainer, model, outputs, batch, batch_idx):
        if trainer.global_step == self.at and self.on_disk is None:
            trainer.save_checkpoint(self.path)
            run = trainer.run_dir
            self.on_disk = (csv_steps(run / "metrics.csv"), tensorboard_steps(run))


def test_the_logged_rows_are_on_disk_once_a_checkpoint_is_written(tmp_path):
    """A resume logs only the steps after its checkpoint: rows still buffered (CSVLogger
    flushed every 100 rows) were lost for good when the process was killed after the save
    (SIGKILL, a preemption). TensorBoard's, which its writer's thread writes soon, too."""
    seen = SavesThenReads(3, tmp_path / "at3.ckpt")
    loggers = [CSVLogger(tmp_path, version=0), TensorBoardLogger(tmp_path, version=0)]
    trainer = Trainer(
        max_epochs=1,
        logger=loggers,
        log_every_n_steps=1,
        callbacks=[seen],
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(Model(), DataLoader(data(), batch_size=16))
    # (step 3's own row comes after its batch's end, where the save is: the checkpoint holds it)
    assert seen.on_disk == ([1, 2], [1, 2])


KILLED_RUN = """
import os, signal, sys
import torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from mixprec.trainer import Callback, CSVLogger, ModelCheckpoint, Trainer

class Kill(Callback):
    def __init__(self, at):
        self.at = at

    def on_train_batch_end(self, trainer, model, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)

def fit(root, kill_at, ckpt_path=None):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x = torch.randn(48, 4, generator=torch.Generator().manual_seed(0))
    checkpoints = ModelCheckpoint(
        dirpath=os.path.join(root, "ck"), filename="{step}", every_n_train_steps=4, save_top_k=-1
    )
    trainer = Trainer(
        max_epochs=1, logger=CSVLogger(root, version=0), log_every_n_steps=1,
        callbacks=[Kill(kill_at), checkpoints], enable_progress_bar=False,
    )
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    trainer.fit(model, data, loss_fn=F.mse_loss, ckpt_path=ckpt_path)

if __name__ == "__main__":
    fit(sys.argv[1], int(sys.argv[2]))
"""


def test_a_run_killed_after_a_checkpoint_and_resumed_logs_every_step(tmp_path):
    """Killed at step 10 after the checkpoint of step 8, resumed from it: the CSV lacked
    steps 2 to 7, still buffered at the kill (the file held its first row alone)."""
    script = tmp_path / "killed_run.py"
    script.write_text(KILLED_RUN)
    child = subprocess.run([sys.executable, str(script), str(tmp_path), "10"], check=False)
    assert child.returncode == -signal.SIGKILL
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["4.ckpt", "8.ckpt"]
    spec = importlib.util.spec_from_file_location("killed_run", script)
    killed_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(killed_run)  # (the killed run's own code resumes it)
    killed_run.fit(str(tmp_path), kill_at=-1, ckpt_path=tmp_path / "ck" / "8.ckpt")
    assert csv_steps(tmp_path / "logs" / "version_0" / "metrics.csv") == list(range(1, 13))


class FailsItsFirstValidation(Model):
    """Its first validation_step raises ``error``; ``train_ce`` is a step value."""

    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.error: type[BaseException] | None = error

    def validation_step(self, batch, batch_idx):
        error, self.error = self.error, None
        if error is not None:
            raise error("in validation_step")
        super().validation_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("stage", "error"),
    [("validate", RuntimeError), ("fit", KeyboardInterrupt)],
    ids=["validate-raised", "ctrl-c-in-fit"],
)
def test_a_fit_after_an_evaluation_cut_short_logs_training_values_as_such(tmp_path, stage, error):
    """A validate that raised (or a Ctrl-C in a fit's validation) left the Trainer logging
    as in an evaluation: the next fit's training step values (train_ce) were summed into
    epoch values, missing from every step row."""
    held = Held(tmp_path)
    trainer = Trainer(
        max_epochs=2,
        logger=held,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    model = FailsItsFirstValidation(error)
    train, val = DataLoader(data(), batch_size=16), DataLoader(data(32), batch_size=16)
    with pytest.raises(error, match="in validation_step"):
        trainer.validate(model, val) if stage == "validate" else trainer.fit(model, train, val)
    held.rows.clear()
    trainer.fit(model, train, val)
    step_rows = [names for _, names in held.rows if "loss" in names]
    assert len(step_rows) == trainer.global_step == 8
    assert all("train_ce" in names for names in step_rows)
    assert not [names for _, names in held.rows if "train_ce" in names and "loss" not in names]


class WithTestStep(EpochRows):
    def test_step(self, batch, batch_idx):
        self.log("test_loss", F.mse_loss(self(batch[0]), batch[1]))


def _everything(run: Path) -> tuple[list[tuple], dict[str, list]]:
    """A run directory's CSV rows (timings left out), as a sorted multiset, and every
    scalar of its event files, as (step, value) by tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    timed = ("samples_per_sec", "peak_memory_mib")
    rows = sorted(
        tuple(sorted((k, float(v)) for k, v in r.items() if v and k not in timed))
        for r in csv.DictReader(open(run / "metrics.csv"))
    )
    events = EventAccumulator(str(run))
    events.Reload()
    tags = events.Tags()["scalars"]
    return rows, {t: [(e.step, e.value) for e in events.Scalars(t)] for t in tags if t not in timed}


class StopOnce(Callback):
    """Stops the fit at its first epoch's end (its state is no checkpoint's: a resumed fit
    in this process trains on)."""

    def __init__(self) -> None:
        self.stopped = False

    def on_train_epoch_end(self, trainer, model):
        if not self.stopped:
            trainer.should_stop = self.stopped = True


@pytest.mark.parametrize("resume", ["nothing-left", "new-trainer", "trains-on", "epoch-end"])
def test_a_resume_keeps_the_validate_and_test_rows_logged_after_its_checkpoint(tmp_path, resume):
    """Found by a review: the documented flow fit, validate(ckpt_path="best"), test,
    fit(ckpt_path="last") dropped the validate and test rows from metrics.csv and purged
    them from the event file: a resume dropped every row at its step but those its
    checkpoint held, and no checkpoint holds what a validate or test call logs after it.
    Now a resume that logs nothing (nothing left to train) leaves the logs alone, and one
    that logs hands those rows back to the loggers after its drop (only the rows the
    resumed fit logs again are dropped): a fit trained on from an early stop, or one
    resumed from a save on its last batch that runs that epoch's end again."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)  # 4 batches an epoch
    run = tmp_path / "logs" / "version_0"

    def trainer(callbacks) -> Trainer:
        loggers = [CSVLogger(tmp_path, version=0), TensorBoardLogger(tmp_path, version=0)]
        return Trainer(
            max_epochs=2 if resume == "trains-on" else 1,
            logger=loggers,
            callbacks=callbacks,
            log_every_n_steps=1,
            seed=0,
            enable_progress_bar=False,
        )

    if resume == "epoch-end":  # saved on the last batch, before the epoch's end
        saves = ModelCheckpoint(tmp_path / "ck", "{step}", every_n_train_steps=4, save_top_k=-1)
    else:
        saves = ModelCheckpoint(tmp_path / "ck", monitor="val_loss", save_last=True)
    first = trainer([saves, StopOnce()])
    model = WithTestStep()
    first.fit(model, loader, loader)
    first.validate(model, loader, ckpt_path=None if resume == "epoch-end" else "best")
    first.test(model, loader)
    before = _everything(run)
    rows, events = before
    assert [dict(r)["step"] for r in rows if "test_loss" in dict(r)] == [4.0]
    assert [step for step, _ in events["val_loss"]] == [4, 4]
    ckpt = tmp_path / "ck" / ("4.ckpt" if resume == "epoch-end" else "last.ckpt")
    again = trainer([]) if resume == "new-trainer" else first
    again.fit(model, loader, loader, ckpt_path=ckpt)
    rows, events = _everything(run)
    if resume == "trains-on":  # epoch 1 after them: steps 5 to 8, validated at 8
        assert sorted(dict(r)["step"] for r in rows if "loss" in dict(r)) == list(range(1, 9))
        assert events["val_loss"][:2] == before[1]["val_loss"]
        assert [step for step, _ in events["val_loss"]] == [4, 4, 8]
        assert events["test_loss"] == before[1]["test_loss"]
        assert set(before[0]) <= set(rows)
    else:  # the same rows, each once (from a last-batch save: its epoch's end again)
        assert (rows, events) == before


@pytest.mark.parametrize("log_every", [1, 2])
def test_a_resumed_steps_row_keeps_its_throughput_and_memory(tmp_path, log_every):
    """Found by a review: a save in on_train_batch_end holds the step's row, logged right
    after it, for the resumed run to log again; that row lacked samples_per_sec and
    peak_memory_mib (added when the row is logged), so the resumed log's row of the saved
    step had neither, in the CSV file and the event file. The checkpoint's row has them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)  # 8 batches, 8 steps

    def fit(steps: int, ckpt_path=None) -> None:
        saves = ModelCheckpoint(tmp_path / "ck", "{step}", every_n_train_steps=4, save_top_k=-1)
        Trainer(
            max_steps=steps,
            logger=[CSVLogger(tmp_path, version=0), TensorBoardLogger(tmp_path, version=0)],
            callbacks=[] if ckpt_path else [saves],
            log_every_n_steps=log_every,
            seed=0,
            enable_progress_bar=False,
        ).fit(nn.Linear(4, 1), loader, loss_fn=F.mse_loss, ckpt_path=ckpt_path)

    fit(6)  # killed after step 6
    fit(8, tmp_path / "ck" / "4.ckpt")
    run = tmp_path / "logs" / "version_0"
    logged = list(range(log_every, 9, log_every))
    rows = [r for r in csv.DictReader(open(run / "metrics.csv")) if r["loss"]]
    assert [int(r["step"]) for r in rows] == logged
    assert all(float(r["samples_per_sec"]) > 0 and float(r["peak_memory_mib"]) > 1 for r in rows)
    events = EventAccumulator(str(run))
    events.Reload()
    for tag in ("loss", "samples_per_sec", "peak_memory_mib"):
        assert [e.step for e in events.Scalars(tag)] == logged, tag


class LogsNoValidation(EpochRows):
    def validation_step(self, batch, batch_idx):
        pass


@pytest.mark.parametrize("empty", ["logs-nothing", "no-batches"])
def test_a_validation_that_logs_nothing_writes_no_row(tmp_path, empty):
    """Found by a review: a validation whose steps log nothing (or a validation loader
    without batches) wrote an empty row (``4,,,``) to metrics.csv and an empty summary to
    the event file at each validation."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    val = x[:0] if empty == "no-batches" else x
    trainer = Trainer(
        max_epochs=2,
        logger=[CSVLogger(tmp_path, version=0), TensorBoardLogger(tmp_path, version=0)],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    train = DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)
    trainer.fit(LogsNoValidation(), train, DataLoader(TensorDataset(val, val[:, :1]), batch_size=4))
    assert trainer.validate(LogsNoValidation(), DataLoader(TensorDataset(x, x[:, :1]))) == [{}]
    rows = list(csv.DictReader(open(trainer.run_dir / "metrics.csv")))
    assert len(rows) == 10  # 8 steps, 2 epoch rows (seen_epoch)
    assert all(any(v for k, v in r.items() if k != "step") for r in rows)
    summaries = [
        event.summary
        for path in sorted(trainer.run_dir.glob("events.out.tfevents.*"))
        for event in EventFileLoader(str(path)).Load()
        if event.HasField("summary")
    ]
    assert len(summaries) == 10 and all(s.value for s in summaries)


class PerToken(TrainingModule):
    """Logs a per-token value weighed by its batch's count of valid tokens (none in batch 1,
    whose value is then a guarded 0.0)."""

    def __init__(self, tokens: list[int], values: list[float]) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.tokens, self.values = tokens, values

    def validation_step(self, batch, batch_idx):
        count = self.tokens[batch_idx]
        self.log("tok_loss", torch.tensor(self.values[batch_idx]), batch_size=count)


def test_a_value_logged_with_batch_size_zero_weighs_nothing_in_the_epoch_mean():
    """Found by a review: ``self.log(..., batch_size=0)`` was read as no batch size given
    (``batch_size or inferred``): the value weighed as a full batch, and a per-token mean of
    values 2, 0, 4 over 8, 0 and 8 tokens was logged as 2.0, not 3.0. Lightning infers only
    when batch_size is None. An epoch whose values all weigh nothing logs NaN (the mean of
    no samples, as Lightning's); a negative batch_size is refused."""
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False)
    val = DataLoader(TensorDataset(torch.zeros(24, 4)), batch_size=8)
    out = trainer.validate(PerToken([8, 0, 8], [2.0, 0.0, 4.0]), val)
    assert out[0]["tok_loss"] == 3.0
    out = trainer.validate(PerToken([0, 0, 0], [1.0, 2.0, 3.0]), val)
    assert math.isnan(out[0]["tok_loss"])
    with pytest.raises(ValueError, match=r"batch_size=-1.*0 or more"):
        trainer.validate(PerToken([8, -1, 8], [2.0, 0.0, 4.0]), val)


class CountsAsTensors(TrainingModule):
    """Logs two values per validation batch with one tensor batch_size (as ``log_dict``
    passes it), the batch's count of valid tokens, 1, 2, 3, 4."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.counts: list[Tensor] = []

    def validation_step(self, batch, batch_idx):
        count = torch.tensor(batch_idx + 1)
        self.counts.append(count)
        value = torch.tensor(float(batch_idx))
        self.log_dict({"val_a": value, "val_b": value}, batch_size=count)


def test_a_tensor_batch_size_is_never_written_into():
    """Found by a review: a tensor ``batch_size`` was kept as the running weight itself and
    summed into in place: the caller's tensor changed, and every name logged with it (all
    of a ``log_dict``'s) shared that one weight, which grew once per name: the means of
    0, 1, 2, 3 over 1, 2, 3, 4 tokens were logged as 1.0526, not 2.0."""
    model = CountsAsTensors()
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False)
    val = DataLoader(TensorDataset(torch.zeros(16, 4)), batch_size=4)
    assert trainer.validate(model, val) == [{"val_a": 2.0, "val_b": 2.0}]
    assert [c.item() for c in model.counts] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"batch_size=.*one-element real tensor"):
        MetricStore().log("x", 1.0, on_epoch=True, batch_size=torch.tensor([2, 2]))


class LogsNumpy(TrainingModule):
    def __init__(self, value) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.value = value

    def validation_step(self, batch, batch_idx):
        import numpy as np  # (the test skips without it)

        self.log_dict(
            {
                "f32": np.float32(0.5 + batch_idx),
                "i64": np.int64(3 + batch_idx),
                "array": np.array([[0.25 * batch_idx]]),
            }
        )
        if self.value is not None:
            self.log("odd", self.value)


@pytest.mark.parametrize(
    "complex_value", [None, 1 + 2j, torch.tensor(1 + 2j), torch.tensor([1j]), "numpy"]
)
def test_numpy_numbers_are_logged_and_complex_ones_refused(complex_value):
    """Found by a review: ``self.log`` refused numpy's float32 and int64 scalars
    (``ValueError``: needs a number), and logged a complex tensor's real part, with torch's
    mere warning. Numpy scalars and one-element arrays are numbers; a complex value (a
    python complex, a complex tensor, a numpy complex) is refused, saying what is taken."""
    np = pytest.importorskip("numpy")
    if isinstance(complex_value, str):
        complex_value = np.complex64(1 + 2j)
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False)
    val = DataLoader(TensorDataset(torch.zeros(8, 4)), batch_size=4)  # batches 0, 1
    if complex_value is None:
        out = trainer.validate(LogsNumpy(None), val)
        assert out == [{"f32": 1.0, "i64": 3.5, "array": 0.125}]
        return
    with pytest.raises(ValueError, match=r"self.log\('odd'.*needs a real number.*complex"):
        trainer.validate(LogsNumpy(complex_value), val)


def test_run_estimate_says_it_again_at_each_fit():
    """Found by a review: `RunEstimate` reset its batch times at each fit but not the line
    it had said, so a Trainer's second fit (a longer one) got no estimate."""
    said: list[str] = []
    trainer = Trainer(
        max_epochs=1,
        callbacks=[RunEstimate(log=said.append)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    x = torch.zeros(64, 4)
    model = nn.Linear(4, 1)
    trainer.fit(
        model, DataLoader(TensorDataset(x[:32], x[:32, :1]), batch_size=4), loss_fn=F.mse_loss
    )
    trainer.fit(model, DataLoader(TensorDataset(x, x[:, :1]), batch_size=4), loss_fn=F.mse_loss)
    assert len(said) == 2
    assert "; 5 batches to go: about " in said[0] and "; 13 batches to go: about " in said[1]


def test_a_filename_field_not_logged_yet_is_filled_with_nan(tmp_path):
    """Found by a review: ``filename="{epoch}-{step}-{val_loss:.3f}"`` with
    ``every_n_train_steps=2`` and validation at epoch ends only raised ``ValueError`` at the
    first save (``val_loss`` not logged yet): the fit died at step 2. A field whose metric
    is not logged yet is filled with NaN (``nan`` where its format takes no float), with one
    warning naming it, and the save happens."""
    saves = ModelCheckpoint(
        tmp_path,
        filename="{epoch}-{step}-{val_loss:.3f}-{later:03d}",
        every_n_train_steps=2,
        save_top_k=-1,
    )
    trainer = Trainer(
        max_epochs=2,
        callbacks=[saves],
        logger=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    train = DataLoader(data(32), batch_size=8)  # 4 steps an epoch, validation at its end
    with pytest.warns(UserWarning) as caught:
        trainer.fit(Model(), train, DataLoader(data(16), batch_size=8))
    said = [str(w.message) for w in caught if "is not logged" in str(w.message)]
    assert len(said) == 2 and "'val_loss'" in said[0] and "'later'" in said[1]
    names = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    assert len(names) == 4 and names[0] == "0-2-nan-nan.ckpt"
    # the step-4 save comes after the epoch's validation: val_loss is logged from then on
    assert [n[:4] for n in names[1:]] == ["0-4-", "1-6-", "1-8-"]
    assert all(n.endswith("-nan.ckpt") and "-nan-" not in n for n in names[1:])


def test_a_filename_field_of_a_name_with_a_slash_is_filled_as_written(tmp_path):
    """Found by a diff review: a metric logged as ``val/loss`` filled ``{val_loss}`` only:
    ``{val/loss:.2f}`` was taken for a metric not logged yet and every file was named
    ``nan`` (before the nan fill, the first save raised)."""

    class Slashed(Model):
        def validation_step(self, batch, batch_idx):
            self.log("val/loss", F.cross_entropy(self(batch[0]), batch[1]))

    saves = ModelCheckpoint(tmp_path, filename="{epoch}-{val/loss:.2f}-{val_loss:.2f}")
    trainer = Trainer(
        max_epochs=1, callbacks=[saves], logger=False, enable_progress_bar=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(Slashed(), DataLoader(data(16), batch_size=8), DataLoader(data(16), batch_size=8))
    (name,) = [p.name for p in tmp_path.glob("*.ckpt")]
    shown = f"{float(trainer.callback_metrics['val/loss']):.2f}"
    assert name == f"0-{shown}-{shown}.ckpt"


class Scripted(TrainingModule):
    """Validation logs ``vl`` = 1, 5, 3, 4, ... by epoch: epoch 0's is the best."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[0][:, :1])

    def validation_step(self, batch, batch_idx):
        self.log("vl", [1.0, 5.0, 3.0, 4.0, 6.0, 7.0][self.trainer.current_epoch])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_checkpoint_directory_spelled_otherwise_resumes_its_state(tmp_path, monkeypatch):
    """Found by a review: ModelCheckpoint's state key held ``dirpath`` as spelled, so a
    fit resumed with "ck/" or the absolute path for "ck" skipped the saved state without a
    word: the best checkpoint (epoch 0) was forgotten, a worse one became "best" and the
    files were no longer tracked. The key holds the resolved directory; keys written
    before (as spelled) still load; a state no callback takes is warned of; a directory
    moved (another working directory) keeps the best checkpoint, as in Lightning."""
    from mixprec.trainer.callbacks import load_callback_states

    monkeypatch.chdir(tmp_path)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    train, val = DataLoader(TensorDataset(x), batch_size=4), DataLoader(TensorDataset(x[:4]))

    def fit(epochs: int, dirpath, ckpt_path=None) -> ModelCheckpoint:
        ckpt = ModelCheckpoint(dirpath, monitor="vl", save_top_k=1, save_last=True)
        Trainer(max_epochs=epochs, callbacks=[ckpt], logger=False, enable_progress_bar=False).fit(
            Scripted(), train, val, ckpt_path=ckpt_path
        )
        return ckpt

    first = fit(2, "ck")
    for epochs, spelled in [(3, "ck/"), (4, tmp_path / "ck"), (5, "./ck")]:
        ckpt = fit(epochs, spelled, "ck/last.ckpt")
        assert (ckpt.best_model_path, ckpt.best_model_score) == ("ck/epoch=0-step=2.ckpt", 1.0)
        assert sorted(p.name for p in Path("ck").glob("*")) == ["epoch=0-step=2.ckpt", "last.ckpt"]
        assert ckpt.state_key == first.state_key
    # a key as written before (the directory as spelled) is taken by the same directory
    state = first.state_dict()
    again = ModelCheckpoint("ck/", monitor="vl")
    load_callback_states([again], {"ModelCheckpoint[monitor=vl,dirpath=./ck]": state})
    assert again.best_model_path == "ck/epoch=0-step=2.ckpt"
    # a state no callback takes is said: here two of another directory (which is
    # elsewhere's is not known), and one of a callback the run has not
    states = {
        first.state_key: state,
        "ModelCheckpoint[monitor=vl,dirpath=/x]": state,
        "ModelCheckpoint[monitor=vl,dirpath=/y]": state,
        "EarlyStopping[monitor=vl]": {"best_score": 1.0},
    }
    elsewhere = ModelCheckpoint("other", monitor="vl")
    with pytest.warns(
        UserWarning, match=r"no callback of this run takes: EarlyStopping.*/x.*/y\];"
    ):
        load_callback_states([ModelCheckpoint("ck", monitor="vl"), elsewhere], states)
    assert elsewhere.best_model_path == ""
    # the only one of its monitor, in another directory (a relative one from another working
    # directory): it takes the state, keeps the best checkpoint and leaves the files alone
    monkeypatch.chdir(tmp_path / "ck")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moved = fit(5, "ck", tmp_path / "ck" / "last.ckpt")  # (nothing left to train)
    assert not [w for w in caught if "no callback of this run takes" in str(w.message)]
    assert moved.state_key != first.state_key
    assert (moved.best_model_path, moved.best_model_score) == ("ck/epoch=0-step=2.ckpt", 1.0)
    assert sorted(p.name for p in Path().glob("*")) == ["epoch=0-step=2.ckpt", "last.ckpt"]
