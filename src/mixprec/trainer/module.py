"""`TrainingModule`: an ``nn.Module`` that also says how to train, validate and test itself.

The hooks and their names are Lightning's, so a LightningModule's body moves over unchanged:
``training_step`` returns the loss (or a dict with ``"loss"``), ``configure_optimizers``
returns an optimizer or optimizers with schedulers, and ``self.log`` records a metric.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from mixprec.trainer.metrics import MetricStore
    from mixprec.trainer.trainer import Trainer

__all__ = [
    "TrainingModule",
]


# the hooks a TrainingModule may define, called by the Trainer before the callbacks' own
MODULE_HOOKS = frozenset(
    {
        "on_fit_start",
        "on_fit_end",
        "on_train_start",
        "on_train_end",
        "on_train_epoch_start",
        "on_train_epoch_end",
        "on_train_batch_start",
        "on_train_batch_end",
        "on_before_optimizer_step",
        "on_validation_start",
        "on_validation_batch_end",
        "on_validation_end",
        "on_test_start",
        "on_test_batch_end",
        "on_test_end",
    }
)

# LightningModule hooks the Trainer never calls: a module defining one is warned at fit time
NOT_CALLED = (
    "on_before_backward",
    "on_after_backward",
    "on_before_zero_grad",
    "on_validation_batch_start",
    "on_test_batch_start",
    "on_validation_model_eval",
    "on_validation_model_train",
    "on_validation_model_zero_grad",
    "on_test_model_eval",
    "on_test_model_train",
    "on_predict_start",
    "on_predict_end",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_predict_model_eval",
    "on_before_batch_transfer",
    "on_after_batch_transfer",
    "transfer_batch_to_device",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "prepare_data",
    "setup",
    "teardown",
    "configure_model",
    "configure_sharded_model",
    "configure_callbacks",
    "configure_gradient_clipping",
    "lr_scheduler_step",
    "optimizer_step",
    "optimizer_zero_grad",
    "backward",
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
    "training_epoch_end",  # Lightning 1.x
    "validation_epoch_end",
    "test_epoch_end",
)


def hooks_not_called(model: nn.Module) -> list[str]:
    """The LightningModule hooks ``model`` defines that the Trainer never calls."""
    return [name for name in NOT_CALLED if callable(getattr(type(model), name, None))]


# what a run attaches to a TrainingModule, in its __dict__ (never a submodule or a parameter)
_TRAINER, _METRICS = "_trainer", "_mixprec_metrics"


def attach(model: nn.Module, trainer: Trainer, metrics: MetricStore) -> None:
    """Give a TrainingModule the Trainer running it (``self.trainer``) and the store its
    `TrainingModule.log` records into, until `detach`; a plain module is left as it is."""
    if isinstance(model, TrainingModule):
        model.__dict__.update({_TRAINER: trainer, _METRICS: metrics})


def detach(model: nn.Module) -> None:
    """Undo `attach` (the run is over)."""
    for key in (_TRAINER, _METRICS):
        model.__dict__.pop(key, None)


def _attached(module: TrainingModule, key: str) -> Any:
    found = module.__dict__.get(key)
    if found is None:
        raise RuntimeError(
            f"{type(module).__name__} is not attached to a Trainer: trainer-dependent calls "
            "(self.log, self.trainer, self.global_step) work inside Trainer.fit/validate/test"
        )
    return found


class TrainingModule(nn.Module):
    """Subclass it, write ``forward`` and ``training_step``; the rest has defaults."""

    @property
    def trainer(self) -> Trainer:
        """The Trainer running this module (only while it runs)."""
        return _attached(self, _TRAINER)

    def __getstate__(self) -> dict[str, Any]:
        # the Trainer is not part of the model: pickling (spawned ddp) leaves it behind
        state = dict(self.__dict__)
        for key in (_TRAINER, _METRICS):
            state.pop(key, None)
        return state

    @property
    def current_epoch(self) -> int:
        """Epoch being run (0-based)."""
        return self.trainer.current_epoch

    @property
    def global_step(self) -> int:
        """Optimizer steps taken or skipped so far."""
        return self.trainer.global_step

    def log(
        self,
        name: str,
        value: Tensor | float,
        *,
        prog_bar: bool = False,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        sync_dist: bool = False,
        batch_size: int | Tensor | None = None,
    ) -> None:
        """Record a metric for the loggers, the progress bar (``prog_bar``) and callbacks.

        ``value``: a real number (a Python or numpy number, a one-element tensor or array).
        Defaults as in Lightning: in ``training_step`` a value is logged per step; in
        validation/test steps its mean over the epoch is logged once, weighted by
        ``batch_size`` (by default the batch's: the leading size of its first tensor; a
        count of tokens as a one-element tensor too, never written into).
        With both ``on_step`` and ``on_epoch`` the names get ``_step`` and ``_epoch``
        suffixes. Epoch means are averaged over processes under ddp; ``sync_dist`` also
        averages per-step values (a collective on every step).
        """
        _attached(self, _METRICS).log(
            name,
            value,
            prog_bar=prog_bar,
            on_step=on_step,
            on_epoch=on_epoch,
            sync_dist=sync_dist,
            batch_size=batch_size,
        )

    def log_dict(self, metrics: dict[str, Tensor | float], **kwargs: Any) -> None:
        """`log` each item of ``metrics`` with the same options."""
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    # -- the steps ----------------------------------------------------------------------------

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | dict[str, Any]:
        """Return the loss of one batch (a scalar tensor, or a dict holding ``"loss"``)."""
        raise TypeError(
            f"{type(self).__name__} must define training_step(batch, batch_idx) returning the "
            "loss; for a plain nn.Module pass loss_fn= to Trainer.fit instead"
        )

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """Compute and `log` validation metrics for one batch."""
        raise TypeError(
            f"validation data was given but {type(self).__name__} defines no validation_step"
        )

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        """Compute and `log` test metrics for one batch."""
        raise TypeError(f"test data was given but {type(self).__name__} defines no test_step")

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """Return predictions for one batch; by default ``self(batch)`` (or ``self(batch[0])``
        when the batch is an ``(inputs, targets)`` pair)."""
        if isinstance(batch, (tuple, list)):
            return self(batch[0])
        return self(batch)

    def configure_optimizers(self) -> Any:
        """Return what to optimize with, in any form Lightning accepts:

        - an optimizer, or a list/tuple of optimizers;
        - ``([optimizers], [schedulers])``;
        - a dict ``{"optimizer": opt, "lr_scheduler": sched_or_config}`` or a list of them,
          where a scheduler config is ``{"scheduler": s, "interval": "epoch" | "step",
          "frequency": 1, "monitor": "val_loss", "strict": True, "name": None}``
          (``strict: False``: a monitored value not logged warns and leaves the step out,
          instead of raising; ``name`` is said in that message).

        The default is ``torch.optim.AdamW(self.parameters(), lr=1e-3)``.
        """
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    # -- hooks (all optional) -------------------------------------------------------------------

    def on_fit_start(self) -> None:
        """Called once the model is on its device, converted and wrapped, before training."""

    def on_fit_end(self) -> None:
        """Called after the last epoch or step."""

    def on_train_start(self) -> None:
        """Called before the first training epoch (after on_fit_start)."""

    def on_train_epoch_start(self) -> None:
        """Called before the first batch of each training epoch; what it logs is for the
        epoch."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Called before a training batch goes through the model."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Called after a training batch (its step and validation, if due, done)."""

    def on_train_epoch_end(self) -> None:
        """Called after each training epoch (after its validation, if any); what it logs is
        for the epoch, reduced with the epoch's other training metrics before the callbacks'
        ``on_train_epoch_end`` (ModelCheckpoint and plateau schedulers can monitor it)."""

    def on_train_end(self) -> None:
        """Called when training stops, at an epoch's end or inside one, before on_fit_end."""

    def on_validation_start(self) -> None:
        """Called before each validation pass."""

    def on_validation_epoch_start(self) -> None:
        """Called before the first batch of each validation pass."""

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Called after each validation batch."""

    def on_validation_epoch_end(self) -> None:
        """Called after each validation pass, while its metrics can still be logged."""

    def on_validation_end(self) -> None:
        """Called after each validation pass, its metrics logged."""

    def on_test_start(self) -> None:
        """Called before the test pass."""

    def on_test_epoch_start(self) -> None:
        """Called before the first test batch."""

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Called after each test batch."""

    def on_test_epoch_end(self) -> None:
        """Called after the test batches, while test metrics can still be logged."""

    def on_test_end(self) -> None:
        """Called after the test pass, its metrics logged."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Called once per optimizer step with the accumulated gradients already unscaled
        and not yet clipped (as in Lightning 2), e.g. to log gradient norms."""
