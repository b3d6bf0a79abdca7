"""What the Trainer reads back from the device per step: nothing but the values it logs every
``log_every_n_steps`` steps, with its default loggers, a drawing progress bar and
checkpointing on; and what monitors still see at validation and epoch ends.

A read-back is counted where torch's dispatcher sees one (``aten::_local_scalar_dense``:
``.item()``, ``float()``, ``bool()`` of a tensor) and where torch's function layer sees a
tensor copied out as a whole (``.tolist()``, ``.numpy()``, ``.cpu()``, which the dispatcher
does not see on a CPU tensor). On a GPU each is a device-to-host copy and a synchronization.
"""

from __future__ import annotations

import csv
import io

import pytest
import torch
import torch.nn.functional as F
from nets import mlp
from rich.console import Console
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from mixprec import Precision
from mixprec.trainer import (
    Callback,
    EarlyStopping,
    ModelCheckpoint,
    RichProgressBar,
    Trainer,
)

_COPIES_OUT = {"tolist", "numpy", "cpu"}


class ScalarReads(TorchDispatchMode):
    """Counts ``aten::_local_scalar_dense`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class WholeReads(TorchFunctionMode):
    """Counts ``Tensor.tolist`` / ``.numpy`` / ``.cpu`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _COPIES_OUT:
            self.count += 1
        return func(*args, **(kwargs or {}))


class Counting:
    """Both counters, entered together; `total` is every read-back so far."""

    def __init__(self) -> None:
        self.scalars, self.wholes = ScalarReads(), WholeReads()

    def __enter__(self) -> Counting:
        self.wholes.__enter__()
        self.scalars.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.scalars.__exit__(*exc)
        self.wholes.__exit__(*exc)

    @property
    def total(self) -> int:
        return self.scalars.count + self.wholes.count


class PerBatch(Callback):
    """The read-backs counted so far at each training batch's start, and each batch's loss
    (kept as a tensor: read only after the fit)."""

    def __init__(self, counting: Counting) -> None:
        self.counting = counting
        self.marks: list[int] = []
        self.losses: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, model, batch, batch_idx):
        self.marks.append(self.counting.total)

    def on_train_batch_end(self, trainer, model, outputs, batch, batch_idx):
        self.losses.append(outputs.detach().clone())


def data(batches: int, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * 8, 32, generator=g)
    y = torch.randint(0, 10, (batches * 8,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def sgd(params):
    # SGD: torch's Adam reads its step counts with .item() (host tensors on a GPU, but
    # counted on a CPU), which would hide what is measured here
    return torch.optim.SGD(params, lr=0.1)


def precision_reads_per_step(spec: str, steps: int) -> list[int]:
    """What `Precision`'s own step (backward, step, zero_grad) reads back, step by step."""
    precision = Precision(spec, allow_slow=True)
    model = mlp(32, 32, 10)
    model, opt = precision.setup(model, sgd(model.parameters()))
    reads = []
    with Counting() as counting:
        for x, y in data(steps):
            before = counting.total
            precision.backward(F.cross_entropy(model(x), y))
            precision.step(opt)
            opt.zero_grad(set_to_none=True)
            reads.append(counting.total - before)
    return reads


@pytest.mark.parametrize("spec", ["bf16-mixed", "16-mixed", "32-true"])
def test_the_trainer_reads_back_only_every_log_every_n_steps(tmp_path, spec):
    # before: every step's values were read back when the bar redrew (each value on its
    # own), and in batches of 25 rows otherwise
    steps, every = 20, 10
    own = precision_reads_per_step(spec, steps)
    assert own == [own[0]] * steps and own[0] <= (1 if spec == "16-mixed" else 0)

    counting = Counting()
    per_batch = PerBatch(counting)
    screen = io.StringIO()
    bar = RichProgressBar(
        console=Console(file=screen, force_terminal=True, width=200, color_system=None),
        refresh_seconds=0.0,  # redraw the metrics at every batch
    )
    trainer = Trainer(
        precision=spec,
        max_steps=steps + 1,  # one epoch of 24 batches: no epoch end inside the steps counted
        log_every_n_steps=every,
        callbacks=[per_batch, bar],
        default_root_dir=tmp_path,
        allow_slow_precision=True,
    )
    assert trainer.loggers and trainer.checkpoint_callback is not None  # the defaults
    with counting:
        trainer.fit(mlp(32, 32, 10), data(24), loss_fn=F.cross_entropy, optimizer=sgd)

    marks = per_batch.marks
    added = [b - a - own[0] for a, b in zip(marks, marks[1:], strict=False)][:steps]
    # one read of the whole row (loss, lr, loss scale...) at steps 10 and 20, nothing else
    assert added == [1 if (i + 1) % every == 0 else 0 for i in range(steps)]

    losses = [loss.item() for loss in per_batch.losses]
    rows = list(csv.DictReader(open(trainer.run_dir / "metrics.csv")))
    step_rows = [r for r in rows if r["loss"]]
    assert [(int(r["step"]), float(r["loss"])) for r in step_rows] == [
        (10, losses[9]),
        (20, losses[19]),
    ]
    assert all(float(r["samples_per_sec"]) > 0 for r in step_rows)
    # the bar showed the value read back at step 20 until the end
    assert f"loss {losses[19]:.4g}" in screen.getvalue()
    # the checkpoint at the stop read the last step's values
    assert trainer.callback_metrics["loss"] == losses[20]


class Seen(Callback):
    """The training loss monitors see at each validation and epoch end."""

    def __init__(self) -> None:
        self.at_validation: list[float] = []
        self.at_epoch_end: list[float] = []

    def on_validation_end(self, trainer, model):
        self.at_validation.append(trainer.callback_metrics["loss"])

    def on_train_epoch_end(self, trainer, model):
        self.at_epoch_end.append(trainer.callback_metrics["loss"])


def test_monitors_see_the_latest_step_values_between_logged_steps(tmp_path):
    counting = Counting()
    per_batch, seen = PerBatch(counting), Seen()
    ckpt = ModelCheckpoint(monitor="loss", save_top_k=-1, filename="{epoch}-{loss:.9f}")
    early = EarlyStopping(monitor="loss", patience=100)
    trainer = Trainer(
        precision="bf16-mixed",
        max_epochs=3,
        val_check_interval=2,
        log_every_n_steps=50,  # never reached: every value is read at a validation or epoch end
        callbacks=[per_batch, seen, ckpt, early],
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        allow_slow_precision=True,
    )
    trainer.fit(mlp(32, 32, 10), data(5), data(2, seed=1), loss_fn=F.cross_entropy, optimizer=sgd)
    losses = [loss.item() for loss in per_batch.losses]  # 5 batches an epoch
    # validations after batches 2 and 4 and at the epoch's end (batch 5)
    validated = [losses[e * 5 + i] for e in range(3) for i in (1, 3, 4)]
    assert seen.at_validation == validated
    assert seen.at_epoch_end == [losses[4], losses[9], losses[14]]
    assert sorted(ckpt.best_k_models.values()) == sorted(seen.at_epoch_end)
    assert ckpt.best_model_score == min(seen.at_epoch_end)
    assert early.best_score == min(validated)
    rows = list(csv.DictReader(open(trainer.run_dir / "metrics.csv")))
    assert rows and not any("loss" in r for r in rows)  # no step was due for logging


@pytest.mark.parametrize("value", [0, -1, 2.5, True, None, "50"])
def test_log_every_n_steps_takes_a_positive_int(value):
    with pytest.raises(ValueError, match=r"log_every_n_steps must be an int >= 1.*got"):
        Trainer(log_every_n_steps=value, logger=False)
