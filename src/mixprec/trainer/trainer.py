"""`Trainer`: the fit loop with a precision flag, for a `TrainingModule` or a plain module.

Read `_fit_loop` and `_train_batch` top to bottom: that is the whole algorithm. Everything about
precision goes through one `mixprec.Precision` (conversion, autocast, loss scaling, unscaling,
skipping); the Trainer only decides when each piece runs:

    for each epoch:
        for each batch:
            forward + scaled backward (no DDP all-reduce until the last micro-batch)
            at the end of an accumulation window:
                unscale -> on_before_optimizer_step -> clip -> step or skip (all ranks agree)
                -> step-interval schedulers advance only if the step was taken -> log
            validate when due (random generators left as they were)
        validate at the end of the epoch -> epoch schedulers -> checkpoint callbacks
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import resource
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import mixprec
from mixprec.hardware import DeviceInfo, Support, check, detect, resolve_policy
from mixprec.optim import LossScaleOptimizer, scheduler_step
from mixprec.policy_map import PolicyMap
from mixprec.precision import Precision
from mixprec.trainer import checkpoint as ckpt_io
from mixprec.trainer.callbacks import Callback, ModelCheckpoint, callback_states
from mixprec.trainer.data import (
    batch_size_of,
    generators,
    iterate_from,
    num_batches,
    set_epoch,
    to_device,
)
from mixprec.trainer.loggers import (
    CSVLogger,
    Logger,
    TensorBoardLogger,
    next_version,
    tensorboard_available,
)
from mixprec.trainer.metrics import MetricStore
from mixprec.trainer.module import TrainingModule
from mixprec.trainer.optimizers import Scheduler, parse_optimizers, scheduler_entry
from mixprec.trainer.progress import RichProgressBar
from mixprec.trainer.strategy import (
    STRATEGIES,
    DDPStrategy,
    SingleDeviceStrategy,
    resolve_accelerator,
    resolve_devices,
)

log = logging.getLogger("mixprec")

# Logged values are kept as tensors and turned into numbers (a host sync on GPUs) and
# written out in batches of this many steps, or sooner when a callback or the bar reads them.
FLUSH_EVERY_N_STEPS = 25


def resolve_precision(
    precision: Any, info: DeviceInfo, allow_slow: bool = False
) -> tuple[PolicyMap, Support]:
    """The policy a ``precision`` flag means on the device ``info`` describes, and its support.

    ``"auto"`` picks the fastest stable precision for that device. Raises
    ``mixprec.PolicySpecError`` for an unknown spec, ``mixprec.PrecisionError`` when the
    device refuses the policy, ``mixprec.SlowPrecisionError`` when it runs far slower than
    float32 there and ``allow_slow`` is false. Never substitutes another precision.
    """
    policy = resolve_policy(precision, info)
    return policy, check(policy, allow_slow=allow_slow, info=info)


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's (if installed) and torch's generators (all devices)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


@contextlib.contextmanager
def _determinism(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    # cuBLAS needs this before its first call to be deterministic
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]


@contextlib.contextmanager
def _rng_unchanged() -> Iterator[None]:
    """Run a block (validation) without moving the random generators training draws from,
    so that how often one validates never changes the training run."""
    states = ckpt_io.rng_states()
    try:
        yield
    finally:
        ckpt_io.set_rng_states(states)


def _peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux (bytes on macOS): the process's peak resident memory
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if os.uname().sysname == "Darwin" else rss / 2**10


class _StepRunner(nn.Module):
    """Runs one step of a kind ("training", "validation", ...) as a module's forward, so that
    DistributedDataParallel sees the training step as its forward (as Lightning does)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., Tensor] | None) -> None:
        super().__init__()
        self.module = model
        self.__dict__["loss_fn"] = loss_fn  # never a submodule: not converted, not synced

    def forward(self, kind: str, batch: Any, batch_idx: int) -> Any:
        model = self.module
        if isinstance(model, TrainingModule):
            return getattr(model, f"{kind}_step")(batch, batch_idx)
        if kind == "predict" and isinstance(batch, Tensor):
            return model(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise TypeError(
                "a plain module's batches must be (inputs..., target) tuples or lists (for "
                f"predict also a bare input tensor), got {type(batch).__name__}; for other "
                "batches write a TrainingModule"
            )
        *inputs, target = batch
        out = model(*inputs)
        if kind == "predict":
            return out  # the target, if the batch has one, is not needed
        return self.loss_fn(out, target)


def _loss_of(output: Any) -> Tensor:
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError(
            "training_step must return the loss as a one-element tensor (or a dict with "
            f"'loss'), got {type(output).__name__}"
        )
    return loss if loss.dim() == 0 else loss.reshape(())


def _check_fraction_or_count(name: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    ok = (isinstance(value, float) and 0.0 <= value <= 1.0) or (
        isinstance(value, int) and not isinstance(value, bool) and value >= 0
    )
    if not ok:
        raise ValueError(
            f"{name} must be None, a fraction 0.0-1.0 of the batches, or a number of batches "
            f">= 0, got {value!r}"
        )


def _positive_int_or_none(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")


class Trainer:
    """Trains, validates, tests and predicts with one precision flag.

    Args:
        precision: any spec ``mixprec.Policy`` takes (``"32-true"``, ``"bf16-mixed"``,
            ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``, ``"64-true"``, Lightning aliases,
            Keras names, jmp specs, ``"auto"``), a Policy or a PolicyMap.
        accelerator: ``"auto"``, ``"cpu"``, ``"cuda"`` (or ``"gpu"``), ``"mps"``.
        devices: processes/GPUs to use (an int, a list of GPU indices, or ``"auto"``).
        strategy: ``"auto"`` (one device, or ``"ddp"`` when ``devices > 1``),
            ``"single_device"``, ``"ddp"`` (joins torchrun, else spawns the processes),
            ``"ddp_fork"`` (forks them: works with lambdas and notebooks; Linux, CPU).
        max_epochs, max_steps: when to stop (both None: 1000 epochs, as in Lightning).
            A step is one optimizer step, taken or skipped for overflow.
        accumulate_grad_batches: micro-batches per optimizer step.
        gradient_clip_val, gradient_clip_algorithm: clip the unscaled gradients by total
            ``"norm"`` or by ``"value"`` before each step.
        val_check_interval: validate every this fraction of an epoch (float) or every this
            many training batches (int), and always at the end of an epoch.
        limit_train_batches, limit_val_batches: a fraction or a number of batches per epoch.
        callbacks: a Callback or a list of them.
        logger: True (CSV, and TensorBoard when installed), False, a Logger or a list.
        enable_progress_bar: draw a rich progress bar when stdout is a terminal.
        enable_checkpointing: add a ``ModelCheckpoint`` (latest epoch) unless one is given.
        default_root_dir: where logs and checkpoints go (default: the working directory).
        seed: seed Python, numpy and torch at the start of each fit/validate/test/predict.
        deterministic: use deterministic algorithms (resumed runs are then bit-identical to
            uninterrupted ones on the same machine).
        allow_slow_precision: accept a precision that runs far slower than float32 on this
            device (float16 on CPUs without float16 hardware) instead of raising.

    Raises ``ValueError`` for a flag outside what is accepted (the message lists it),
    ``mixprec.PolicySpecError`` for an unknown precision, ``mixprec.PrecisionError`` when
    the accelerator refuses it and ``mixprec.SlowPrecisionError`` when it is far slower than
    float32 there (unless ``allow_slow_precision``).
    """

    def __init__(
        self,
        precision: Any = "32-true",
        accelerator: str = "auto",
        devices: int | str | list[int] = 1,
        strategy: str = "auto",
        max_epochs: int | None = None,
        max_steps: int | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        val_check_interval: float | int = 1.0,
        limit_train_batches: float | int | None = None,
        limit_val_batches: float | int | None = None,
        callbacks: Callback | list[Callback] | None = None,
        logger: bool | Logger | list[Logger] = True,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        default_root_dir: str | os.PathLike[str] | None = None,
        seed: int | None = None,
        deterministic: bool = False,
        allow_slow_precision: bool = False,
    ) -> None:
        _positive_int_or_none("max_epochs", max_epochs)
        _positive_int_or_none("max_steps", max_steps)
        _positive_int_or_none("accumulate_grad_batches", accumulate_grad_batches)
        if accumulate_grad_batches is None:
            raise ValueError("accumulate_grad_batches must be an int >= 1, got None")
        if gradient_clip_val is not None and not (
            isinstance(gradient_clip_val, (int, float)) and gradient_clip_val > 0
        ):
            raise ValueError(f"gradient_clip_val must be None or > 0, got {gradient_clip_val!r}")
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(
                "gradient_clip_algorithm must be 'norm' or 'value', got "
                f"{gradient_clip_algorithm!r}"
            )
        ok_interval = (
            isinstance(val_check_interval, float) and 0.0 < val_check_interval <= 1.0
        ) or (
            isinstance(val_check_interval, int)
            and not isinstance(val_check_interval, bool)
            and val_check_interval >= 1
        )
        if not ok_interval:
            raise ValueError(
                "val_check_interval must be a fraction of an epoch in (0.0, 1.0] or a number "
                f"of training batches >= 1, got {val_check_interval!r}"
            )
        _check_fraction_or_count("limit_train_batches", limit_train_batches)
        _check_fraction_or_count("limit_val_batches", limit_val_batches)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be None or an int, got {seed!r}")
        if not isinstance(strategy, str) or strategy not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {strategy!r}; accepted: {', '.join(map(repr, STRATEGIES))}"
            )

        accel = resolve_accelerator(accelerator)
        ids = resolve_devices(accel, devices)
        if strategy == "single_device" and len(ids) > 1:
            raise ValueError(f"strategy='single_device' needs devices=1, got {devices!r}")
        if strategy == "auto":
            strategy = "ddp" if len(ids) > 1 else "single_device"
        if strategy == "single_device":
            device = torch.device("cuda", ids[0]) if accel == "cuda" else torch.device(accel)
            self.strategy: SingleDeviceStrategy = SingleDeviceStrategy(device)
        else:
            method = "fork" if strategy == "ddp_fork" else "spawn"
            self.strategy = DDPStrategy(accel, ids, start_method=method)

        info = detect(self.strategy.device)
        self.policy, self.support = resolve_precision(precision, info, allow_slow_precision)
        self.allow_slow_precision = allow_slow_precision
        self.device_description = info.describe()
        scaling = "dynamic loss scaling" if self.policy.needs_loss_scaling else "no loss scaling"
        log.info(
            "precision %s on %s: %s (%s); %s",
            self.policy.name,
            self.device_description,
            self.support.status,
            self.support.reason,
            scaling,
        )

        if max_epochs is None and max_steps is None:
            max_epochs = 1000
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.val_check_interval = val_check_interval
        self.limit_train_batches = limit_train_batches
        self.limit_val_batches = limit_val_batches
        self.seed = seed
        self.deterministic = deterministic
        self.default_root_dir = Path(default_root_dir or os.getcwd())
        self.loggers = self._make_loggers(logger)
        self.callbacks = self._make_callbacks(callbacks, enable_progress_bar, enable_checkpointing)

        # progress of the run (kept across fit calls, restored from checkpoints)
        self.current_epoch = 0
        self.global_step = 0
        self.batches_done = 0
        self.should_stop = False
        self.stepped_this_batch = False
        self.stage: str | None = None
        self._callback_metrics: dict[str, float] = {}
        self._pending: list[tuple[int, dict[str, Tensor | float]]] = []
        self.logged_metrics: dict[str, float] = {}
        self.num_training_batches: int | None = None
        self.num_eval_batches: int | None = None
        self.model: nn.Module | None = None
        self.precision: Precision | None = None
        self._metrics = MetricStore()
        self._summary: dict[str, str] = {}
        self._fit_loss_fn: Any = None
        self._reset_run_state()

    # -- construction helpers ----------------------------------------------------------------------

    def _make_loggers(self, logger: Any) -> list[Logger]:
        if logger is False or logger is None:
            return []
        if logger is True:
            root = self.default_root_dir
            version = next_version(root / "logs")
            found: list[Logger] = [CSVLogger(root, version=version)]
            if tensorboard_available():
                found.append(TensorBoardLogger(root, version=version))
            return found
        items = list(logger) if isinstance(logger, (list, tuple)) else [logger]
        for item in items:
            if not isinstance(item, Logger):
                raise ValueError(
                    "logger must be True, False, a mixprec Logger (CSVLogger, TensorBoardLogger) "
                    f"or a list of them, got {type(item).__name__}"
                )
        return items

    def _make_callbacks(
        self, callbacks: Any, progress: bool, checkpointing: bool
    ) -> list[Callback]:
        items = (
            []
            if callbacks is None
            else list(callbacks)
            if isinstance(callbacks, (list, tuple))
            else [callbacks]
        )
        for item in items:
            if not isinstance(item, Callback):
                raise ValueError(f"callbacks must be Callback instances, got {type(item).__name__}")
        if progress and not any(isinstance(c, RichProgressBar) for c in items):
            items.append(RichProgressBar())
        if checkpointing and not any(isinstance(c, ModelCheckpoint) for c in items):
            items.append(ModelCheckpoint())
        if not checkpointing and any(isinstance(c, ModelCheckpoint) for c in items):
            raise ValueError("enable_checkpointing=False but a ModelCheckpoint callback was given")
        return items

    def _reset_run_state(self) -> None:
        self._listeners: dict[str, list[Callback]] = {}
        self._runner: nn.Module | None = None
        self._run_step: Callable[..., Any] | None = None
        self._raw_runner: _StepRunner | None = None
        self._optimizers: list[LossScaleOptimizer] = []
        self._schedulers: list[Scheduler] = []
        self._epoch_rng: dict[str, Any] | None = None
        self._resume_rng: dict[str, Any] | None = None
        self._in_window = False
        self._epoch_finished = False
        self._train_exhausted = False
        self._window_losses: list[Tensor] = []
        self._last_loss: Tensor | None = None
        self._samples = 0
        self._skipped_steps = 0
        self._fit_samples = 0
        self._fit_seconds = 0.0
        self._last_log_time = 0.0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("model", "precision", "_runner", "_raw_runner", "_run_step", "_last_loss"):
            state[key] = None
        state["_fit_loss_fn"], state["_listeners"] = None, {}
        state.pop("_train_loader", None)
        state.pop("_val_loader", None)
        state["_optimizers"], state["_schedulers"], state["_window_losses"] = [], [], []
        state["_pending"] = []
        return state

    # -- properties callbacks use ------------------------------------------------------------------

    @property
    def is_global_zero(self) -> bool:
        """Whether this process logs, draws progress and writes checkpoints."""
        return self.strategy.is_global_zero

    @property
    def world_size(self) -> int:
        """Number of processes training together."""
        return self.strategy.world_size

    @property
    def run_dir(self) -> Path:
        """This run's directory: the first logger's, else ``default_root_dir``."""
        return self.loggers[0].log_dir if self.loggers else self.default_root_dir

    @property
    def optimizers(self) -> list[LossScaleOptimizer]:
        """The wrapped optimizers of the current or last fit."""
        return self._optimizers

    @property
    def lr_schedulers(self) -> list[Any]:
        """The learning-rate schedulers of the current or last fit."""
        return [s.scheduler for s in self._schedulers]

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first ModelCheckpoint callback, if any."""
        return next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)

    # -- the public entry points -------------------------------------------------------------------

    def fit(
        self,
        model: nn.Module,
        train_dataloaders: Iterable[Any],
        val_dataloaders: Iterable[Any] | None = None,
        *,
        loss_fn: Callable[..., Tensor] | None = None,
        optimizer: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Train ``model``, resuming from ``ckpt_path`` if given (a path, "last" or "best").

        For a plain ``nn.Module`` give ``loss_fn(output, target)``; batches are then
        ``(inputs..., target)``. ``optimizer`` is an optimizer, a factory
        ``params -> optimizer``, or None (the module's ``configure_optimizers``, else AdamW
        with lr 1e-3).
        """
        self._check_model(model, loss_fn)
        self._fit_loss_fn = loss_fn  # validate/test reuse it for this model
        self._launch(
            "fit",
            model,
            dict(
                train=train_dataloaders,
                val=val_dataloaders,
                loss_fn=loss_fn,
                optimizer=optimizer,
                ckpt_path=self._ckpt_path(ckpt_path),
            ),
        )

    def validate(
        self,
        model: nn.Module | None = None,
        dataloaders: Iterable[Any] | None = None,
        *,
        loss_fn: Callable[..., Tensor] | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> list[dict[str, float]]:
        """Run one validation pass; return ``[metrics]`` (Lightning's shape)."""
        return self._evaluate("validate", model, dataloaders, loss_fn, ckpt_path)

    def test(
        self,
        model: nn.Module | None = None,
        dataloaders: Iterable[Any] | None = None,
        *,
        loss_fn: Callable[..., Tensor] | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> list[dict[str, float]]:
        """Run one test pass (``test_step``, or ``loss_fn`` for a plain module)."""
        return self._evaluate("test", model, dataloaders, loss_fn, ckpt_path)

    def predict(
        self,
        model: nn.Module | None = None,
        dataloaders: Iterable[Any] | None = None,
        *,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> list[Any]:
        """Return the outputs of ``predict_step`` (or of the module) for each batch."""
        if isinstance(self.strategy, DDPStrategy):
            raise ValueError(
                "predict runs on one device (outputs stay in order); use a Trainer with "
                "devices=1 for prediction"
            )
        model = self._eval_model(model, "predict")
        if dataloaders is None:
            raise ValueError("predict needs dataloaders")
        return self._launch(
            "predict", model, dict(loader=dataloaders, ckpt_path=self._ckpt_path(ckpt_path))
        )

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Write everything needed to resume at this point (rank 0 writes; atomic)."""
        if self._in_window:
            raise RuntimeError(
                "cannot checkpoint in the middle of a gradient accumulation window: the "
                "accumulated gradients are not saved; save after an optimizer step"
            )
        path = Path(path)
        if self.is_global_zero:
            ckpt_io.atomic_save(self._checkpoint_state(), path)
        return path

    def link_checkpoint(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        """Make ``dst`` an atomic copy of the checkpoint ``src`` (rank 0 only)."""
        if self.is_global_zero:
            ckpt_io.atomic_link(src, dst)

    # -- launching ---------------------------------------------------------------------------------

    def _check_model(self, model: Any, loss_fn: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(model, TrainingModule) and loss_fn is None:
            raise ValueError(
                f"{type(model).__name__} is a plain nn.Module: pass loss_fn=(output, target) -> "
                "loss to fit/validate/test, or subclass mixprec.TrainingModule"
            )

    def _eval_model(self, model: nn.Module | None, stage: str) -> nn.Module:
        model = model if model is not None else self.model
        if model is None:
            raise ValueError(f"{stage} needs a model (none was given and no fit ran before)")
        return model

    def _ckpt_path(self, ckpt_path: Any) -> Path | None:
        if ckpt_path in ("best", "last"):
            cb = self.checkpoint_callback
            found = (
                (cb.best_model_path if ckpt_path == "best" else cb.last_model_path) if cb else ""
            )
            if not found:
                raise ValueError(
                    f"ckpt_path={ckpt_path!r} but no ModelCheckpoint has saved a {ckpt_path} "
                    "checkpoint yet (for 'last' use ModelCheckpoint(save_last=True))"
                )
            return Path(found)
        return Path(ckpt_path) if ckpt_path is not None else None

    def _evaluate(
        self, stage: str, model: Any, dataloaders: Any, loss_fn: Any, ckpt_path: Any
    ) -> list[dict[str, float]]:
        model = self._eval_model(model, stage)
        if dataloaders is None:
            raise ValueError(f"{stage} needs dataloaders")
        if loss_fn is None and model is self.model:
            loss_fn = self._fit_loss_fn  # the plain module's loss from the last fit
        self._check_model(model, loss_fn)
        kwargs = dict(loader=dataloaders, loss_fn=loss_fn, ckpt_path=self._ckpt_path(ckpt_path))
        return self._launch(stage, model, kwargs)

    def _launch(self, stage: str, model: nn.Module, kwargs: dict[str, Any]) -> Any:
        if not self.strategy.launches_processes:
            return self._run(stage, model, kwargs)
        # Spawned processes: the run happens in the children; rank 0 sends back the model's
        # weights and the trainer's progress, which land on the objects the caller holds.
        for lg in self.loggers:
            lg.version  # noqa: B018 (fix the run directory before the children start)
        out = self.strategy.launch(_run_in_child, self, stage, model, kwargs)  # type: ignore[attr-defined]
        precision = Precision(self.policy, device="cpu", allow_slow=True)
        precision.setup(model)
        model.load_state_dict(out["model"])
        for key in (
            "current_epoch",
            "global_step",
            "batches_done",
            "callback_metrics",
            "logged_metrics",
            "should_stop",
        ):
            setattr(self, key, out["trainer"][key])
        self._load_callback_states(out["callbacks"])
        self.model = model
        self._summary = out["summary"]
        return out["result"]

    def _run(self, stage: str, model: nn.Module, kwargs: dict[str, Any]) -> Any:
        self.stage = stage
        self.model = model
        self._metrics.clear()
        self._reset_run_state()
        if self.seed is not None:
            seed_everything(self.seed)
        with _determinism(self.deterministic):
            self.strategy.setup()
            try:
                self._sync_run_dir()
                if isinstance(model, TrainingModule):
                    model.__dict__["_trainer"] = self
                try:
                    if stage == "fit":
                        return self._fit(model, **kwargs)
                    if stage == "predict":
                        return self._predict(model, **kwargs)
                    return self._eval_stage(stage, model, **kwargs)
                except BaseException as exc:
                    for cb in self.callbacks:
                        cb.on_exception(self, model, exc)
                    raise
                finally:
                    self._flush_logs()
                    model.__dict__.pop("_trainer", None)
                    for lg in self.loggers:
                        lg.finalize()
                    self.stage = None
            finally:
                # the DDP wrapper holds the process group: release it before the group goes
                self._runner = self._run_step = None
                self.strategy.teardown()

    def _sync_run_dir(self) -> None:
        # every rank must agree on where checkpoints go; rank 0's choice wins
        if self.world_size > 1 and self.loggers:
            import torch.distributed as dist

            versions = [self.loggers[0].version]
            dist.broadcast_object_list(versions, src=0)
            for lg in self.loggers:
                lg._version = versions[0]

    # -- setting a model up ------------------------------------------------------------------------

    def _setup_model(
        self, model: nn.Module, loss_fn: Any, optimizers: list[Any]
    ) -> list[LossScaleOptimizer]:
        """Device, precision (conversion, optimizer wrapping), then DDP: in that order."""
        device = self.strategy.device
        model.to(device)
        self.precision = Precision(self.policy, device=device, allow_slow=self.allow_slow_precision)
        wrapped = self.precision.setup(
            model, *[opt(model) if callable(opt) else opt for opt in optimizers]
        )
        self._raw_runner = _StepRunner(model, loss_fn)
        self._runner = (
            self.strategy.wrap(self._raw_runner) if self.stage == "fit" else self._raw_runner
        )
        # without a DDP wrapper, skip nn.Module's call machinery on every step
        unwrapped = self._runner is self._raw_runner
        self._run_step = self._raw_runner.forward if unwrapped else self._runner
        return list(wrapped[1:]) if optimizers else []

    def _configure_optimizers(
        self, model: nn.Module, optimizer: Any
    ) -> tuple[list[Any], list[dict[str, Any]]]:
        """Optimizers (or factories called after the model is on its device) and scheduler
        configs, from ``optimizer=`` or the module's ``configure_optimizers``."""
        if optimizer is not None:
            if isinstance(optimizer, torch.optim.Optimizer):
                return [optimizer], []
            if callable(optimizer):
                return [lambda m: optimizer(m.parameters())], []
            raise ValueError(
                "optimizer must be a torch.optim.Optimizer, a factory params -> optimizer, or "
                f"None, got {type(optimizer).__name__}"
            )
        if not isinstance(model, TrainingModule):
            log.info("no optimizer given: using AdamW(lr=1e-3)")
            return [lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)], []
        return parse_optimizers(model.configure_optimizers())

    # -- fit ---------------------------------------------------------------------------------------

    def _fit(
        self,
        model: nn.Module,
        train: Iterable[Any],
        val: Iterable[Any] | None,
        loss_fn: Any,
        optimizer: Any,
        ckpt_path: Path | None,
    ) -> dict[str, Any]:
        optimizers, scheduler_configs = self._configure_optimizers(model, optimizer)
        self._optimizers = self._setup_model(model, loss_fn, optimizers)
        self._schedulers = [scheduler_entry(c, self._optimizers) for c in scheduler_configs]
        seed = self.seed if self.seed is not None else 0
        self._train_loader = self.strategy.prepare_loader(train, seed)
        self._val_loader = self.strategy.prepare_loader(val, seed) if val is not None else None
        self.num_training_batches = num_batches(
            self._train_loader, self.limit_train_batches, "train"
        )
        self.current_epoch = self.global_step = self.batches_done = 0
        self.should_stop = False
        if ckpt_path is not None:
            self._restore(ckpt_io.load(ckpt_path), ckpt_path)
        self._skipped_steps = self.precision.scaler.stats().skipped_steps  # type: ignore[union-attr]
        self._hook("on_fit_start")
        self._fit_loop()
        self._hook("on_fit_end")
        return {"summary": self.summary()}

    def _restore_rng(self) -> None:
        if self._resume_rng is not None:
            ckpt_io.set_rng_states(self._resume_rng)
            self._resume_rng = None

    def _fit_loop(self) -> None:
        if self.batches_done == 0:  # resuming at an epoch boundary, or starting
            self._restore_rng()
        while not self._fit_done():
            self._train_epoch()
            if self._epoch_finished:
                self._end_epoch()

    def _fit_done(self) -> bool:
        if self.should_stop:
            return True
        if self.max_steps is not None and self.global_step >= self.max_steps:
            return True
        return self.max_epochs is not None and self.current_epoch >= self.max_epochs

    def _train_epoch(self) -> None:
        model = self.model
        assert model is not None and self._runner is not None
        self._runner.train()
        self._hook("on_train_epoch_start")
        set_epoch(self._train_loader, self.current_epoch)
        # The epoch's data order is drawn from the generators when iteration starts: their
        # state then is kept (and checkpointed) so that a run resumed mid-epoch replays the
        # same order, skips the batches already done, and goes on with the generators as they
        # were at the save.
        if self.batches_done == 0:
            self._epoch_rng = {
                "torch": torch.get_rng_state(),
                "loader": [g.get_state() for g in generators(self._train_loader)],
            }
            batches = iter(self._train_loader)
        else:
            assert self._epoch_rng is not None
            torch.set_rng_state(self._epoch_rng["torch"])
            for g, s in zip(generators(self._train_loader), self._epoch_rng["loader"], strict=True):
                g.set_state(s)
            batches = iterate_from(self._train_loader, self.batches_done, self._restore_rng)
        self._train_exhausted = self._epoch_finished = False
        self._samples, self._last_log_time = 0, time.perf_counter()
        n = self.num_training_batches
        batch_idx = self.batches_done
        while n is None or batch_idx < n:
            try:
                batch = next(batches)
            except StopIteration:
                self._train_exhausted = True
                break
            self._train_batch(batch, batch_idx)
            batch_idx += 1
            self.should_stop = self.strategy.any(self.should_stop)  # all ranks stop together
            if self._fit_done():
                break
        if self._in_window:  # an epoch of unknown length ended inside a window
            self._optimizer_step()
        self._epoch_finished = self._train_exhausted or batch_idx == n

    def _train_batch(self, batch: Any, batch_idx: int) -> None:
        assert self.precision is not None and self._runner is not None
        precision = self.precision
        batch = precision.convert_input(to_device(batch, self.strategy.device))
        self._hook("on_train_batch_start", batch, batch_idx)
        self.stepped_this_batch = False

        # forward and scaled backward; DDP all-reduces only on the window's last micro-batch
        k, n = self.accumulate_grad_batches, self.num_training_batches
        window_start = batch_idx - batch_idx % k
        window = k if n is None else min(k, n - window_start)
        last_in_window = batch_idx - window_start == window - 1
        self._in_window = True
        with self.strategy.no_sync(self._runner, sync=last_in_window):
            with self._step_context():
                output = self._run_step("training", batch, batch_idx)
                loss = _loss_of(output)
            precision.backward(loss / window if window > 1 else loss)
        self._window_losses.append(loss.detach())
        self._samples += batch_size_of(batch)

        if last_in_window:
            self._optimizer_step()
        self.batches_done = batch_idx + 1
        if self._val_due(batch_idx):
            self._validate_during_fit()
        self._hook("on_train_batch_end", output, batch, batch_idx)

    def _step_context(self) -> AbstractContextManager[Any]:
        """The compute region for a step: a TrainingModule's step may call submodules
        directly, so it runs in the precision's forward context; a plain module's forward enters
        its region by itself."""
        if isinstance(self.model, TrainingModule):
            return self.precision.forward_context()  # type: ignore[union-attr]
        return contextlib.nullcontext()

    def _optimizer_step(self) -> None:
        assert self.precision is not None
        precision = self.precision
        precision.unscale_()
        for opt in self._optimizers:
            self._hook("on_before_optimizer_step", opt)
        if self.gradient_clip_val is not None:
            for opt in self._optimizers:
                if self.gradient_clip_algorithm == "norm":
                    precision.clip_grad_norm_(opt, self.gradient_clip_val)
                else:
                    precision.clip_grad_value_(opt, self.gradient_clip_val)
        if not precision.step():
            self._skipped_steps += 1
        for opt in self._optimizers:
            opt.zero_grad(set_to_none=True)
        self._in_window = False
        self.global_step += 1
        self.stepped_this_batch = True
        for s in self._schedulers:
            if s.interval == "step" and self.global_step % s.frequency == 0:
                scheduler_step(s.scheduler, s.optimizer)  # does not advance on a skipped step
        losses = self._window_losses
        self._last_loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        self._window_losses = []
        self._log_step()

    def _log_step(self) -> None:
        """Record this step's values: what self.log recorded, the loss, lr, loss scale and
        skipped steps. They stay tensors (no host sync) until `_flush_logs`."""
        assert self._last_loss is not None and self.precision is not None
        row: dict[str, Tensor | float] = dict(self._metrics.take_step(self.strategy.mean))
        row["loss"] = self._last_loss
        row["lr"] = self._optimizers[0].param_groups[0]["lr"] if self._optimizers else 0.0
        if self.precision.scaler.enabled:
            row["loss_scale"] = self.precision.scaler.scale_tensor.clone()
            row["skipped_steps"] = float(self._skipped_steps)
        self._pending.append((self.global_step, row))
        if len(self._pending) >= FLUSH_EVERY_N_STEPS:
            self._flush_logs()

    def _flush_logs(self) -> None:
        """Turn the recorded values into numbers and hand them to the loggers, adding the
        throughput (training time since the last flush) and the peak memory to the last row."""
        if not self._pending:
            return
        if self._samples:
            now = time.perf_counter()
            seconds = max(now - self._last_log_time, 1e-9)
            last = self._pending[-1][1]
            last["samples_per_sec"] = self._samples * self.world_size / seconds
            last["peak_memory_mib"] = _peak_memory_mib(self.strategy.device)
            self._fit_samples += self._samples
            self._fit_seconds += seconds
            self._samples, self._last_log_time = 0, now
        pending, self._pending = self._pending, []
        for step, row in pending:
            numbers = {k: float(v) for k, v in row.items()}
            self._callback_metrics.update(numbers)
            self.logged_metrics.update(numbers)
            if self.is_global_zero:
                for lg in self.loggers:
                    lg.log_metrics(numbers, step)

    def log_metrics(self, metrics: dict[str, Tensor | float], step: int | None = None) -> None:
        """Send ``metrics`` to the loggers (rank 0) at ``step`` (default: the current one),
        in order with the Trainer's own rows; for callbacks that compute their own values.
        Tensors are read when the batch of rows is written, not now."""
        self._pending.append((self.global_step if step is None else step, dict(metrics)))

    def _emit(self, metrics: dict[str, Tensor | float]) -> None:
        """Log ``metrics`` at the current step, right away."""
        self._pending.append((self.global_step, dict(metrics)))
        self._flush_logs()

    @property
    def callback_metrics(self) -> dict[str, float]:
        """The latest value of every logged metric (what callbacks monitor)."""
        self._flush_logs()
        return self._callback_metrics

    @callback_metrics.setter
    def callback_metrics(self, value: dict[str, float]) -> None:
        self._callback_metrics = value

    def _val_due(self, batch_idx: int) -> bool:
        if self._val_loader is None or self.limit_val_batches == 0:
            return False
        n = self.num_training_batches
        if n is not None and batch_idx + 1 == n:
            return True  # every epoch ends with a validation
        interval = self.val_check_interval
        if isinstance(interval, float):
            if interval == 1.0 or n is None:
                return False
            interval = max(1, int(n * interval))
        return (batch_idx + 1) % interval == 0

    def _end_epoch(self) -> None:
        for lg in self.loggers:
            lg.flush()
        for s in self._schedulers:
            if s.interval == "epoch" and (self.current_epoch + 1) % s.frequency == 0:
                args = [self._monitored(s)] if s.monitor else []
                scheduler_step(s.scheduler, s.optimizer, *args)
        self._hook("on_train_epoch_end")
        self.current_epoch += 1
        self.batches_done = 0
        self._epoch_finished = False

    def _monitored(self, s: Scheduler) -> float:
        if s.monitor not in self.callback_metrics:
            raise KeyError(
                f"the scheduler monitors {s.monitor!r}, which was not logged; logged: "
                f"{', '.join(sorted(self.callback_metrics)) or 'nothing'}"
            )
        return self.callback_metrics[s.monitor]

    def _validate_during_fit(self) -> None:
        assert self._val_loader is not None
        self._flush_logs()  # the throughput so far, before validation time starts counting
        self._run_eval("validation", self._val_loader, self.limit_val_batches)
        self._runner.train()  # type: ignore[union-attr]
        self._last_log_time = time.perf_counter()  # throughput counts training time only

    # -- evaluation and prediction -----------------------------------------------------------------

    def _eval_stage(
        self,
        stage: str,
        model: nn.Module,
        loader: Iterable[Any],
        loss_fn: Any,
        ckpt_path: Path | None,
    ) -> list[dict[str, float]]:
        self._setup_model(model, loss_fn, [])
        if ckpt_path is not None:
            self._load_weights(ckpt_io.load(ckpt_path), ckpt_path)
        loader = self.strategy.prepare_loader(loader, self.seed or 0)
        kind = "validation" if stage == "validate" else "test"
        limit = self.limit_val_batches if stage == "validate" else None
        return [self._run_eval(kind, loader, limit)]

    def _run_eval(
        self, kind: str, loader: Iterable[Any], limit: int | float | None
    ) -> dict[str, float]:
        assert (
            self._raw_runner is not None and self.precision is not None and self.model is not None
        )
        what = "val" if kind == "validation" else "test"
        self.num_eval_batches = num_batches(loader, limit, what)
        runner, precision, model = self._raw_runner, self.precision, self.model
        plain = not isinstance(model, TrainingModule)
        runner.eval()
        self._metrics.training = False
        with _rng_unchanged(), torch.no_grad():
            self._hook(f"on_{kind}_start")
            for batch_idx, batch in enumerate(loader):
                if self.num_eval_batches is not None and batch_idx >= self.num_eval_batches:
                    break
                batch = precision.convert_input(to_device(batch, self.strategy.device))
                with self._step_context():
                    output = runner(kind, batch, batch_idx)
                if plain:
                    self._metrics.log(f"{what}_loss", output, batch_size=batch_size_of(batch))
                step_metrics = self._metrics.take_step(self.strategy.mean)
                if step_metrics:
                    self._emit(step_metrics)
                self._hook(f"on_{kind}_batch_end", output, batch, batch_idx)
            if kind == "validation" and isinstance(model, TrainingModule):
                model.on_validation_epoch_end()
            metrics = self._metrics.take_epoch(self.strategy.mean)
            self._emit(metrics)
            self._hook(f"on_{kind}_end")
        self._metrics.training = True
        return metrics

    def _predict(
        self, model: nn.Module, loader: Iterable[Any], ckpt_path: Path | None
    ) -> list[Any]:
        self._setup_model(model, None, [])
        if ckpt_path is not None:
            self._load_weights(ckpt_io.load(ckpt_path), ckpt_path)
        assert self._raw_runner is not None and self.precision is not None
        self._raw_runner.eval()
        out = []
        with torch.no_grad():
            for batch_idx, batch in enumerate(loader):
                batch = self.precision.convert_input(to_device(batch, self.strategy.device))
                with self._step_context():
                    out.append(self._raw_runner("predict", batch, batch_idx))
        return out

    # -- hooks, schedulers, summary ----------------------------------------------------------------

    def _hook(self, name: str, *args: Any) -> None:
        model = self.model
        if isinstance(model, TrainingModule) and name in _MODULE_HOOKS:
            getattr(model, name)(*args)
        listeners = self._listeners.get(name)
        if listeners is None:  # the callbacks that override this hook (it runs per batch)
            base = getattr(Callback, name)
            listeners = [cb for cb in self.callbacks if getattr(type(cb), name) is not base]
            self._listeners[name] = listeners
        for cb in listeners:
            getattr(cb, name)(self, model, *args)

    def progress_metrics(self) -> dict[str, float]:
        """What the progress bar shows now: loss, loss scale, skipped steps, lr, samples/s,
        and the values logged with ``prog_bar=True``."""
        metrics = self.callback_metrics
        shown = {
            "loss": "loss",
            "loss_scale": "loss scale",
            "skipped_steps": "skipped",
            "lr": "lr",
            "samples_per_sec": "samples/s",
        }
        out = {label: metrics[name] for name, label in shown.items() if name in metrics}
        out.update(
            {name: metrics[name] for name in sorted(self._metrics.prog_bar) if name in metrics}
        )
        return out

    def summary(self) -> dict[str, str]:
        """A one-screen account of the last fit: precision, progress, scaler, speed, memory."""
        if self.precision is None:  # the run happened in spawned processes
            return dict(self._summary)
        rows = {
            "precision": f"{self.policy.name} ({self.support.status}: {self.support.reason})",
            "device": f"{self.device_description} x {self.world_size} ({self.strategy.name})",
            "epochs / steps": f"{self.current_epoch} / {self.global_step}",
        }
        if self.precision is not None and self.precision.scaler.enabled:
            stats = self.precision.scaler.stats()
            rows["loss scale"] = f"{stats.scale:g} ({stats.skipped_steps} skipped steps)"
        if self._fit_seconds > 0:
            rate = self._fit_samples * self.world_size / self._fit_seconds
            rows["throughput"] = f"{rate:,.1f} samples/s"
        rows["peak memory"] = f"{_peak_memory_mib(self.strategy.device):,.0f} MiB"
        for name in sorted(self.callback_metrics):
            if name not in (
                "lr",
                "loss_scale",
                "skipped_steps",
                "samples_per_sec",
                "peak_memory_mib",
            ):
                rows[name] = f"{self.callback_metrics[name]:.6g}"
        cb = self.checkpoint_callback
        if cb is not None and cb.best_model_path:
            rows["checkpoint"] = cb.best_model_path
        return rows

    # -- checkpoints -------------------------------------------------------------------------------

    def _checkpoint_state(self) -> dict[str, Any]:
        assert self.model is not None and self.precision is not None
        at_epoch_end = self._epoch_finished
        return {
            "format": ckpt_io.FORMAT,
            "format_version": ckpt_io.FORMAT_VERSION,
            "mixprec_version": mixprec.__version__,
            "torch_version": str(torch.__version__),
            "policy_name": self.policy.name,
            "loop": {
                "epoch": self.current_epoch + 1 if at_epoch_end else self.current_epoch,
                "batch": 0 if at_epoch_end else self.batches_done,
                "global_step": self.global_step,
                "epoch_rng": None if at_epoch_end else self._epoch_rng,
            },
            "model": self.model.state_dict(),
            "optimizers": [opt.state_dict() for opt in self._optimizers],
            "schedulers": [s.scheduler.state_dict() for s in self._schedulers],
            "precision": self.precision.state_dict(),
            "callbacks": callback_states(self.callbacks),
            "rng": ckpt_io.rng_states(),
            "world_size": self.world_size,
        }

    def _load_weights(self, state: dict[str, Any], path: Path) -> bool:
        """Load the model weights; return whether the checkpoint's precision is this run's.

        Across precisions the float32 master weights (if the checkpoint has them) are used
        in place of the 16-bit parameters they shadow, and everything is cast to this run's
        dtypes.
        """
        assert self.model is not None and self.precision is not None
        saved_policy = state["precision"]["policy"]
        same = saved_policy == self.precision.policy.to_config()
        weights = dict(state["model"])
        if not same:
            log.info(
                "resuming %s, trained in precision %s, in %s: weights are cast to this run's "
                "dtypes%s",
                path,
                state.get("policy_name", "?"),
                self.policy.name,
                " (from the float32 master weights)"
                if any(o["master_weights"] for o in state["optimizers"])
                else "",
            )
            weights.update(self._saved_masters(state))
        self.model.load_state_dict(weights)
        return same

    def _saved_masters(self, state: dict[str, Any]) -> dict[str, Tensor]:
        """Parameter name -> the checkpoint's float32 master of it.

        A LossScaleOptimizer keeps masters, in order, for its float16 parameters; the
        checkpoint's model weights say which parameters those were.
        """
        names = {p: n for n, p in self.model.named_parameters()}  # type: ignore[union-attr]
        out: dict[str, Tensor] = {}
        for opt, saved in zip(self._optimizers, state["optimizers"], strict=False):
            masters = iter(saved["master_weights"])
            model_params = [p for g in opt.param_groups for p in g["params"]]
            by_master = {m: p for p, m in opt.master_params.items()}
            for p in model_params:
                name = names.get(by_master.get(p, p))
                if name is not None and state["model"][name].dtype == torch.float16:
                    master = next(masters, None)
                    if master is not None:
                        out[name] = master
        return out

    def _restore(self, state: dict[str, Any], path: Path) -> None:
        assert self.precision is not None
        same = self._load_weights(state, path)
        if len(state["optimizers"]) != len(self._optimizers) or len(state["schedulers"]) != len(
            self._schedulers
        ):
            raise ValueError(
                f"{path} has {len(state['optimizers'])} optimizers and {len(state['schedulers'])} "
                f"schedulers; this run configured {len(self._optimizers)} and "
                f"{len(self._schedulers)}: resume with the same configure_optimizers"
            )
        if not same:
            names = {p: n for n, p in self.model.named_parameters()}  # type: ignore[union-attr]
            full = {**self.model.state_dict(), **self._saved_masters(state)}  # type: ignore[union-attr]
        for opt, saved in zip(self._optimizers, state["optimizers"], strict=True):
            if same:
                opt.load_state_dict(saved)
                continue
            # across precisions: the inner optimizer's state (cast by torch to the new
            # parameter dtypes) and this run's masters refreshed from full-precision weights
            opt.optimizer.load_state_dict(saved["optimizer"])
            with torch.no_grad():
                for p, master in opt.master_params.items():
                    master.copy_(full[names[p]])
        for s, saved in zip(self._schedulers, state["schedulers"], strict=True):
            s.scheduler.load_state_dict(saved)
        scaler_state = state["precision"]["scaler"]
        if scaler_state.get("kind") == self.precision.scaler.kind:
            self.precision.load_state_dict(state["precision"])
        else:
            log.info(
                "%s had a %r loss scaler, this run uses %r: starting it fresh",
                path,
                scaler_state.get("kind"),
                self.precision.scaler.kind,
            )
        self._load_callback_states(state["callbacks"])
        loop = state["loop"]
        self.current_epoch, self.batches_done = loop["epoch"], loop["batch"]
        self.global_step = loop["global_step"]
        self._epoch_rng = loop["epoch_rng"]
        self._resume_rng = state["rng"]
        if state.get("world_size", 1) != self.world_size and self.batches_done:
            raise ValueError(
                f"{path} was saved mid-epoch with {state['world_size']} processes; resuming "
                f"mid-epoch needs the same number (this run has {self.world_size})"
            )
        log.info(
            "resumed from %s at epoch %d, batch %d, step %d",
            path,
            self.current_epoch,
            self.batches_done,
            self.global_step,
        )

    def _load_callback_states(self, states: dict[str, Any]) -> None:
        for cb in self.callbacks:
            if cb.state_key in states:
                cb.load_state_dict(states[cb.state_key])


_MODULE_HOOKS = {
    "on_fit_start",
    "on_fit_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_before_optimizer_step",
}


def _run_in_child(
    trainer: Trainer, stage: str, model: nn.Module, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """A spawned process's whole job: run, and (rank 0) report what the parent needs."""
    result = trainer._run(stage, model, kwargs)
    if stage == "fit":
        result, summary = None, result["summary"]
    else:
        summary = trainer.summary()
    return {
        "result": result,
        "summary": summary,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "trainer": {
            key: getattr(trainer, key)
            for key in (
                "current_epoch",
                "global_step",
                "batches_done",
                "callback_metrics",
                "logged_metrics",
                "should_stop",
            )
        },
        "callbacks": callback_states(trainer.callbacks),
    }
