"""A rich progress bar per epoch and a one-screen summary when training ends.

The bar shows the batch count, the elapsed time and the ETA, and the figures a mixed-precision
run is judged by: loss, loss scale (when scaling), skipped steps, learning rate, samples/s.
It draws only on rank 0 and only when its console is a terminal; elsewhere (CI logs, files,
notebooks without a TTY) it stays silent, and the summary goes to the "mixprec" logger.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from torch import nn

from mixprec.trainer.callbacks import Callback

if TYPE_CHECKING:
    from mixprec.trainer.trainer import Trainer

__all__ = [
    "RichProgressBar",
]


def format_metrics(metrics: dict[str, float]) -> str:
    """``name value`` pairs, compact: 4 significant digits, scales and rates as integers."""
    parts = []
    for name, value in metrics.items():
        if name in ("loss scale", "skipped", "samples/s"):
            parts.append(f"{name} {value:,.0f}")
        elif name == "lr":
            parts.append(f"lr {value:.2e}")
        else:
            parts.append(f"{name} {value:.4g}")
    return " · ".join(parts)


def compiles_first_step(optimizer: Any, device: str) -> bool:
    """Whether `optimizer` (a `LossScaleOptimizer`, or a low-bit optimizer) compiles a kernel
    on its first step: a compensated step of 16-bit parameters or a low-bit update, with
    ``compile=True``, or ``compile=None`` (the default) where torch.compile works and the
    step is large enough for the engine's gate to choose compiling. That takes seconds,
    once per process, in a step that otherwise takes milliseconds."""
    compiles = getattr(optimizer, "compiles", None)
    return bool(compiles is not None and compiles(device))


# what the bar says while the first step may compile a kernel of the optimizer's step
COMPILING = "first step: the optimizer may be compiling its update (torch.compile, once)"

_BAR = 30
# width of everything but the metrics: description, bar, count, elapsed, eta, separators
_FIXED_WIDTH = 42 + _BAR


class RichProgressBar(Callback):
    """The Trainer's progress bar (added by ``enable_progress_bar=True``).

    Args:
        console: where to draw (default: a new ``rich.console.Console`` on stdout); the bar
            is off when ``console.is_terminal`` is false.
        refresh_seconds: how often the metrics text is redrawn. It shows the values last
            read back (every ``log_every_n_steps`` steps, at validation), never reading any
            itself but at an epoch's end.
    """

    def __init__(self, console: Console | None = None, refresh_seconds: float = 0.25) -> None:
        self.console = console
        self.refresh_seconds = refresh_seconds
        self._progress: Progress | None = None
        self._train: TaskID | None = None
        self._eval: TaskID | None = None
        self._last_refresh = 0.0
        self._stepped = False  # whether this fit's first training batch has ended

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_progress": None, "_train": None, "_eval": None}

    @property
    def active(self) -> bool:
        """Whether the bar is drawing now."""
        return self._progress is not None

    def _metrics_text(self, trainer: Trainer) -> str:
        # cut to the terminal's width, so that the bar and the ETA always stay visible
        room = max(20, self._console().width - _FIXED_WIDTH)
        text = format_metrics(trainer.progress_metrics())
        return text if len(text) <= room else text[: room - 1] + "…"

    def _console(self) -> Console:
        if self.console is None:
            self.console = Console()
        return self.console

    def _start(self, trainer: Trainer) -> None:
        if self._progress is not None or not trainer.is_global_zero:
            return
        console = self._console()
        if not console.is_terminal:
            return
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=_BAR),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=console,
            transient=False,
        )
        self._progress.start()

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        self._progress = self._train = self._eval = None

    def on_fit_start(self, trainer: Trainer, model: nn.Module) -> None:
        self._stepped = False
        self._start(trainer)

    def on_train_epoch_start(self, trainer: Trainer, model: nn.Module) -> None:
        if self._progress is None:
            return
        epochs = f"/{trainer.max_epochs}" if trainer.max_epochs is not None else ""
        self._train = self._progress.add_task(
            f"epoch {trainer.current_epoch + 1}{epochs}",
            total=trainer.num_training_batches,
            completed=trainer.batches_done,
            metrics="",
        )
        device = trainer.strategy.device.type
        if not self._stepped and any(
            compiles_first_step(opt, device) for opt in trainer.optimizers
        ):
            self._progress.update(self._train, metrics=COMPILING, refresh=True)

    def on_train_batch_end(
        self, trainer: Trainer, model: nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._progress is None or self._train is None:
            return
        now = time.monotonic()
        fields = {}
        if not self._stepped or now - self._last_refresh >= self.refresh_seconds:
            self._stepped = True
            self._last_refresh = now
            fields["metrics"] = self._metrics_text(trainer)
        self._progress.update(self._train, completed=batch_idx + 1, **fields)

    def on_train_epoch_end(self, trainer: Trainer, model: nn.Module) -> None:
        if self._progress is not None and self._train is not None:
            trainer.callback_metrics  # noqa: B018 (the epoch's last values, read back)
            metrics = self._metrics_text(trainer)
            self._progress.update(self._train, metrics=metrics, refresh=True)

    def _eval_start(self, trainer: Trainer, what: str) -> None:
        self._start(trainer)
        if self._progress is not None:
            self._eval = self._progress.add_task(what, total=trainer.num_eval_batches, metrics="")

    def _eval_batch(self) -> None:
        if self._progress is not None and self._eval is not None:
            self._progress.advance(self._eval)

    def _eval_end(self, trainer: Trainer) -> None:
        if self._progress is None or self._eval is None:
            return
        if trainer.stage == "fit":
            self._progress.remove_task(self._eval)
        else:
            metrics = {k: v for k, v in trainer.callback_metrics.items()}
            self._progress.update(self._eval, metrics=format_metrics(metrics), refresh=True)
            self._stop()
        self._eval = None

    def on_validation_start(self, trainer: Trainer, model: nn.Module) -> None:
        self._eval_start(trainer, "validate")

    def on_validation_batch_end(
        self, trainer: Trainer, model: nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._eval_batch()

    def on_validation_end(self, trainer: Trainer, model: nn.Module) -> None:
        self._eval_end(trainer)

    def on_test_start(self, trainer: Trainer, model: nn.Module) -> None:
        self._eval_start(trainer, "test")

    # a test pass's batches and end show as a validation pass's do
    on_test_batch_end = on_validation_batch_end
    on_test_end = on_validation_end

    def on_fit_end(self, trainer: Trainer, model: nn.Module) -> None:
        if self._progress is None:
            return
        self._stop()
        table = Table(title="mixprec run summary", show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for name, value in trainer.summary().items():
            table.add_row(name, value)
        self._console().print(table)

    def on_exception(self, trainer: Trainer, model: nn.Module, exception: BaseException) -> None:
        self._stop()
