"""`Trainer`: the fit loop with a precision flag, for a `TrainingModule` or a plain module.

Everything about precision goes through one `mixprec.Precision`; the Trainer decides when each
piece runs. Here: the flags, the entry points, launching processes, and `_run`, which sets a
model up on its device into the run object the loops use and move on. Elsewhere: the loops
and the run object (`loop`, read `fit_loop`), checkpoint contents and restore (`resume`),
checkpoint files (`checkpoint`), logged values and the summary (`metrics`), devices and
DDP (`strategy`), the checked settings (`config`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mixprec.convert import apply
from mixprec.optim import LossScaleOptimizer
from mixprec.precision import Precision
from mixprec.trainer import checkpoint as ckpt_io
from mixprec.trainer import resume, sharded
from mixprec.trainer.callbacks import (
    Callback,
    ModelCheckpoint,
    callback_states,
    listens,
    load_callback_states,
)
from mixprec.trainer.config import (
    TrainerConfig,
    check_fit_inputs,
    check_model,
    check_one_loader,
    choose_precision,
    compile_model,
    determinism,
    make_callbacks,
    seed_everything,
)
from mixprec.trainer.data import num_batches, why_empty
from mixprec.trainer.loggers import Logger, make_loggers
from mixprec.trainer.loop import (
    EmptyEpochError,
    FitRun,
    Progress,
    Run,
    StepRunner,
    fit_loop,
    predict_loop,
    run_eval,
)
from mixprec.trainer.metrics import (
    MetricStore,
    StepLog,
    memory_row,
    reset_peak_memory,
    shown_in_progress,
    summary_rows,
)
from mixprec.trainer.module import attach, detach
from mixprec.trainer.optimizers import (
    check_closure_fit,
    configured_optimizers,
    repoint_converted,
    scheduler_entry,
)
from mixprec.trainer.strategy import DDP, FSDP, ProcessGroupStrategy, Strategy, make_strategy

__all__ = ["Trainer"]


class Trainer:
    """Trains, validates, tests and predicts with one precision flag (docs/trainer.md has
    each flag in full).

    Args:
        precision: any spec ``mixprec.Policy`` takes (``"bf16-mixed"``, ``"auto"``, ...), a
            Policy, a PolicyMap, or a configured ``mixprec.Precision`` the runs use as it is.
        accelerator, devices: ``"auto"``, ``"cpu"``, ``"cuda"``/``"gpu"``, ``"mps"``; a
            count, a list of GPU indices or ``"auto"``.
        strategy: "auto", "single_device", "ddp", "ddp_fork", "fsdp"; DDP(...), FSDP(...).
        max_epochs, max_steps: when to stop (both None: 1000 epochs, as in Lightning).
        accumulate_grad_batches, gradient_clip_val, gradient_clip_algorithm: micro-batches
            per optimizer step; clipping of the unscaled gradients ("norm" or "value").
        val_check_interval, limit_train_batches, limit_val_batches: a fraction of an epoch
            or a number of batches.
        log_every_n_steps: log the training values of every N-th optimizer step.
        callbacks, logger: Callbacks (or objects with their hooks); True (CSV, TensorBoard
            when installed), False, a Logger or a list.
        enable_progress_bar, enable_checkpointing, default_root_dir: a rich bar on a
            terminal; a latest-epoch ``ModelCheckpoint``; where logs and checkpoints go.
        seed, deterministic: seeded at each run's start; deterministic algorithms.
        allow_slow_precision: accept a precision far slower than float32 here.
        compile: ``True`` or ``torch.compile``'s keywords: compiled in place after conversion.
        optimizer_states, activations: `mixprec.Precision`'s (``"int8"``...; ``"fp8"`` or
            {module path regex or type: option}).

    Raises ``ValueError`` for a flag outside what is accepted, ``mixprec.PolicySpecError``
    for an unknown precision, ``mixprec.PrecisionError`` / ``SlowPrecisionError`` when the
    accelerator refuses it or runs it far slower than float32 (without
    ``allow_slow_precision``). The checked settings are in ``trainer.config``.
    """

    _fitted = False  # (a Trainer pickled before it was kept: `_launch`)
    _fit_masters: tuple[nn.Module, dict[str, Tensor]] | None = None  # (likewise)
    _fit_run: FitRun | None = None  # (likewise)
    _fit_replaced: str | None = None  # (likewise)
    _fit_released: str | None = None  # (likewise)

    def __init__(
        self,
        precision: Any = "32-true",
        accelerator: str = "auto",
        devices: int | str | list[int] = 1,
        strategy: str | DDP | FSDP = "auto",
        max_epochs: int | None = None,
        max_steps: int | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        val_check_interval: float | int = 1.0,
        limit_train_batches: float | int | None = None,
        limit_val_batches: float | int | None = None,
        log_every_n_steps: int = 50,
        callbacks: Callback | list[Callback] | None = None,
        logger: bool | Logger | list[Logger] = True,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        default_root_dir: str | os.PathLike[str] | None = None,
        seed: int | None = None,
        deterministic: bool = False,
        allow_slow_precision: bool = False,
        compile: bool | dict[str, Any] = False,
        optimizer_states: str | None = None,
        activations: Any = None,
    ) -> None:
        template = precision if isinstance(precision, Precision) else None
        self.config = TrainerConfig(
            max_epochs=max_epochs,
            max_steps=max_steps,
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val,
            gradient_clip_algorithm=gradient_clip_algorithm,
            val_check_interval=val_check_interval,
            limit_train_batches=limit_train_batches,
            limit_val_batches=limit_val_batches,
            log_every_n_steps=log_every_n_steps,
            seed=seed,
            deterministic=deterministic,
            allow_slow_precision=allow_slow_precision or bool(template and template.allow_slow),
            default_root_dir=Path(default_root_dir or os.getcwd()),
            compile=compile,
        )
        self.strategy = make_strategy(accelerator, devices, strategy)
        self._precision, self.support, self.device_description = choose_precision(
            precision, self.strategy.device, allow_slow_precision, optimizer_states, activations
        )
        self.policy = self._precision.policy
        settings = getattr(self.strategy, "settings", None)
        if (
            isinstance(settings, FSDP)
            and settings.reduce_dtype == torch.float16
            and not self._precision.scaler.enabled
        ):  # (said here, not in each launched process, in the Trainer's own terms)
            raise ValueError(
                f"FSDP(reduce_dtype=torch.float16) sums gradients in float16, where they "
                f"overflow past 65504 and flush to zero under 6e-8, and precision "
                f"{self.policy.name!r} scales no loss to keep them in range nor checks them: "
                "reduce in torch.float32 (the default) or torch.bfloat16, or train with "
                "precision='16-mixed'"
            )
        self.loggers = make_loggers(logger, self.config.default_root_dir)
        self.callbacks = make_callbacks(callbacks, enable_progress_bar, enable_checkpointing)

        self.stage: str | None = None  # "fit", "validate", "test" or "predict" while one runs
        self.model: nn.Module | None = None  # the model of the current or last run
        self.ckpt_path: Path | None = None  # the checkpoint the current or last fit resumed
        # what each run moves on: progress (kept across fit calls, restored from
        # checkpoints), the values self.log records, the rows for the loggers
        self._progress = Progress()
        self._metrics = MetricStore()
        self._log = StepLog(self.loggers, self.strategy, self.config.log_every_n_steps)
        self._current: Run | None = None  # the current or last run in this process
        # the current or last fit's run in this process, kept through later evaluations
        # (what `optimizers` and `save_checkpoint` read); how one replaced its model's weights
        self._fit_run: FitRun | None = None
        self._fit_replaced: str | None = None
        self._fit_released: str | None = None  # how an evaluation let its optimizers go
        # the last fit's, as it ended (here, or in the processes a DDP launch started)
        self._summary: dict[str, str] = {}
        self._gathered: dict[str, Tensor] | None = None  # a sharded run's weights, on rank 0
        # the last fit's model and float32 masters by name (in this process or those the
        # Trainer launched): a later validate, test or predict of that model keeps them,
        # unless it loads a checkpoint into it
        self._fit_masters = None
        self._fit_loss_fn: Any = None
        self._fitted = False  # a fit was started (the next, unless it resumes, is a new run)
        self._uncompile: Callable[[], None] | None = None  # hands the run's model back eager

    def __getattr__(self, name: str) -> Any:
        # the settings, read as trainer.max_epochs, trainer.accumulate_grad_batches, ...
        config = self.__dict__.get("config")
        if config is not None and name in TrainerConfig.__dataclass_fields__:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(
            model=None,
            _current=None,
            _fit_run=None,
            _fit_loss_fn=None,
            _gathered=None,
            _fit_masters=None,
            _uncompile=None,
        )
        return state

    # -- what callbacks and users read --------------------------------------------------------

    @property
    def current_epoch(self) -> int:
        """The epoch being run (0-based); after a fit, the epochs it finished."""
        return self._progress.current_epoch

    @property
    def global_step(self) -> int:
        """Optimizer steps so far, taken or skipped for overflow."""
        return self._progress.global_step

    @property
    def batches_done(self) -> int:
        """Training batches of the current epoch done."""
        return self._progress.batches_done

    @property
    def should_stop(self) -> bool:
        """Whether training stops, at the end of the current accumulation window; set it to
        ask for that (EarlyStopping does)."""
        return self._progress.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._progress.should_stop = value

    @property
    def stepped_this_batch(self) -> bool:
        """Whether the current training batch ended with an optimizer step."""
        return self._progress.stepped_this_batch

    @property
    def num_eval_batches(self) -> int | None:
        """Batches of the current (or last) validation or test pass; None when the data has
        no length."""
        return self._progress.num_eval_batches

    @property
    def is_global_zero(self) -> bool:
        """Whether this process logs, draws progress and writes checkpoints."""
        return self.strategy.is_global_zero

    @property
    def world_size(self) -> int:
        """Number of processes training together."""
        return self.strategy.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank among all (0 in a one-process run), as Lightning names it."""
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (under ``"cuda"``, its device is the
        ``devices`` entry at this position)."""
        return self.strategy.local_rank

    @property
    def run_dir(self) -> Path:
        """This run's directory: the first logger's, else ``default_root_dir``."""
        return self.loggers[0].log_dir if self.loggers else self.config.default_root_dir

    @property
    def precision(self) -> Precision | None:
        """The `Precision` of the current or last run in this process."""
        return self._current.precision if self._current is not None else None

    @property
    def optimizers(self) -> list[LossScaleOptimizer]:
        """The wrapped optimizers of the current or last fit (on an accelerator, until an
        evaluation starts: it frees their states' device memory)."""
        return self._fit_run.optimizers if self._fit_run is not None else []

    @property
    def lr_schedulers(self) -> list[Any]:
        """The learning-rate schedulers of the current or last fit."""
        run = self._fit_run
        return [s.scheduler for s in run.schedulers] if run is not None else []

    @property
    def num_training_batches(self) -> int | None:
        """Batches per training epoch of the current or last fit (None when the data has
        no length)."""
        run = self._fit_run
        return run.num_training_batches if run is not None else None

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first ModelCheckpoint callback, if any."""
        return next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)

    @property
    def callback_metrics(self) -> dict[str, float]:
        """The latest value of every logged metric (what callbacks monitor)."""
        return self._log.read()

    @property
    def logged_metrics(self) -> dict[str, float]:
        """The latest value of every metric sent to the loggers."""
        return self._log.logged_metrics

    def log_metrics(self, metrics: dict[str, Tensor | float], step: int | None = None) -> None:
        """Send ``metrics`` to the loggers (rank 0) at ``step`` (default: the current one),
        in order with the Trainer's own rows; for callbacks that compute their own values.
        Tensors are read when the batch of rows is written, not now."""
        self._log.add(self.global_step if step is None else step, dict(metrics))

    def progress_metrics(self) -> dict[str, float]:
        """What the progress bar shows now: loss, loss scale, skipped steps, lr, samples/s,
        and the values logged with ``prog_bar=True``, as last read back (reading nothing)."""
        return shown_in_progress(self._log.callback_metrics, self._metrics.prog_bar)

    def summary(self) -> dict[str, str]:
        """A one-screen account of the last fit: precision, progress, scaler, speed, memory
        (after a later validate, test or predict, as the fit ended; before any fit, the
        last run's)."""
        run = self._current
        if not isinstance(run, FitRun) and (run is None or self._summary):
            # the run happened in launched processes, or was an evaluation after a fit
            return dict(self._summary)
        head = {
            "precision": f"{self.policy.name} ({self.support.status}: {self.support.reason})",
            "device": f"{self.device_description} x {self.world_size} ({self.strategy.name})",
            "epochs / steps": f"{self.current_epoch} / {self.global_step}",
        }
        if self.config.compile is not None:
            shown = ", ".join(f"{k}={v!r}" for k, v in self.config.compile.items())
            head["compiled"] = f"torch.compile({shown})"
        scaler = run.precision.scaler
        cb = self.checkpoint_callback
        return summary_rows(
            head,
            scaler.stats() if scaler.enabled else None,
            self._log.throughput(),
            memory_row(self._log.memory, self.strategy.device),
            self.callback_metrics,
            cb.best_model_path if cb is not None else "",
        )

    # -- the public entry points --------------------------------------------------------------

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
        with lr 1e-3). An optimizer whose step needs a closure (LBFGS) gets one running the
        batch's training step and backward, as in Lightning.
        """
        check_model(model, loss_fn)
        check_fit_inputs(self, model, train_dataloaders, val_dataloaders)
        if self.strategy.sharded and isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"strategy={self.strategy.name!r} builds the optimizer after sharding the model "
                f"(FSDP replaces the parameters, so this {type(optimizer).__name__} would never "
                "train it): pass a factory, e.g. optimizer=functools.partial(torch.optim.AdamW, "
                "lr=1e-3), or build it in configure_optimizers"
            )
        self._fit_loss_fn = loss_fn  # validate/test reuse it for this model
        kwargs = dict(train=train_dataloaders, val=val_dataloaders, loss_fn=loss_fn)
        self._launch("fit", model, dict(kwargs, optimizer=optimizer, ckpt_path=ckpt_path))

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
        """Return the outputs of ``predict_step`` (or of the module) for each batch.

        It runs in one process, the outputs in order: under ``"ddp"``/``"fsdp"`` with
        ``devices=1`` too (a process group of one), not with more processes."""
        if isinstance(self.strategy, ProcessGroupStrategy) and len(self.strategy.device_ids) > 1:
            raise ValueError(_predict_refusal(self.strategy, len(self.strategy.device_ids)))
        model = _model_for(model, self.model, dataloaders, "predict")
        return self._launch("predict", model, dict(loader=dataloaders, ckpt_path=ckpt_path))

    def save_checkpoint(self, path: str | os.PathLike[str], *, every_rank: bool = False) -> Path:
        """Write everything needed to resume at this point (rank 0 writes; atomic).

        Under ``strategy="fsdp"`` every process calls it (ModelCheckpoint does) and the
        checkpoint is a directory of shards (`mixprec.trainer.sharded`), atomic as a whole.
        Under ``"ddp"``, ``every_rank=True`` says every process calls it (a collective, as
        ModelCheckpoint's saves are): each one's random generators and training-epoch sums
        go into the file, so that a mid-epoch resume is the run that never stopped on every
        rank; called on rank 0 alone (the default), the file holds rank 0's. After the fit (a
        validate or test too) it holds what it held as the fit ended."""
        run = self._fit_run
        if run is None and self._fit_released is not None:
            raise RuntimeError(
                f"save_checkpoint after the fit: {self._fit_released}; save during or right "
                "after the fit (ModelCheckpoint does)"
            )
        if run is None:
            raise RuntimeError(
                "save_checkpoint needs a model being trained: call it during or after "
                "Trainer.fit (in this process)"
            )
        if self._fit_replaced is not None:
            raise RuntimeError(
                f"save_checkpoint after the fit: {self._fit_replaced}, so its weights are no "
                "longer those its optimizers and progress go with; save during or right after "
                "the fit (ModelCheckpoint does)"
            )
        if run.stepping:
            raise RuntimeError(
                "cannot checkpoint while an optimizer step is taken (from its backward to its "
                "end: in on_before_optimizer_step, or an LBFGS closure's training_step): its "
                "gradients and random generator states are not saved, so a resume would take "
                "another step; save once the step is done, e.g. in on_train_batch_end"
            )
        if run.in_window:
            raise RuntimeError(
                "cannot checkpoint in the middle of a gradient accumulation window: the "
                "accumulated gradients are not saved; save after an optimizer step"
            )
        path = Path(path)
        self._flush_logs()
        if self.strategy.sharded:
            sharded.save(run, path)
        else:
            ranks = None
            if every_rank and self.world_size > 1:
                if not dist.is_initialized():  # (after a fit whose process group is gone)
                    warnings.warn(
                        "save_checkpoint(every_rank=True) after the fit: its process group "
                        "is gone, so the file holds rank 0's generators and no epoch sums "
                        "(save during the fit, as ModelCheckpoint does, for every rank's)",
                        stacklevel=2,
                    )
                else:
                    ranks = self.strategy.gather(resume.rank_state(run))
            if self.is_global_zero:
                ckpt_io.atomic_save(resume.checkpoint_state(run, ranks), path)
        return path

    def _flush_logs(self) -> None:
        """Hand the rows logged so far to the loggers and push them to disk, before a
        checkpoint is written: a fit resumed from it logs only the steps after it again, so
        rows still buffered when the process is killed (SIGKILL, a preemption) would be
        lost for good."""
        self._log.flush()
        for lg in self.loggers:
            lg.flush()

    def link_checkpoint(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        """Make ``dst`` an atomic copy of the checkpoint ``src`` (rank 0 copies; a sharded
        one's every rank calls this, as ModelCheckpoint does)."""
        if Path(src).is_dir():
            sharded.copy(self.strategy, src, dst)
        elif self.is_global_zero:
            ckpt_io.atomic_link(src, dst)

    def save_full_state_dict(self, path: str | os.PathLike[str]) -> Path:
        """Write the model's whole state with floating tensors in float32, for inference:
        a plain ``{name: tensor}`` file (atomic; ``torch.load(path, weights_only=True)``,
        then ``model.load_state_dict``) loadable into the unsharded, unconverted model.

        Inside a run (a callback) every process calls it: a sharded model is gathered and
        rank 0 writes. After a fit it writes the weights the fit ended with (under torchrun
        with ``"fsdp"``, those gathered on rank 0 when the fit ended), also after a validate,
        test or predict of its model that loaded no checkpoint. Float32 masters are used
        where the fit kept them; "true" 16-bit weights are cast (exact)."""
        path = Path(path)
        run = self._current
        if self.stage is None and self._gathered is not None:
            weights = self._gathered  # the process group is gone
        elif run is not None:  # in this process, during or after a run
            weights = self.strategy.full_state_dict(run.model)
            own = isinstance(run, FitRun)  # (a later run: the fit's, while its model)
            weights.update(_masters(run) if own else self._masters_of(run.model))
        elif self.model is not None:  # trained in processes the Trainer launched
            weights = dict(self.model.state_dict())
            weights.update(self._masters_of(self.model))
        else:
            raise RuntimeError("save_full_state_dict needs a model: call it during or after fit")
        if self.is_global_zero:
            full = {
                k: v.detach().cpu().float() if v.is_floating_point() else v.detach().cpu()
                for k, v in weights.items()
            }
            ckpt_io.atomic_save(full, path)
        return path

    def _masters_of(self, model: nn.Module) -> dict[str, Tensor]:
        """The last fit's float32 masters by name, where ``model`` is that fit's."""
        kept = self._fit_masters
        return kept[1] if kept is not None and kept[0] is model else {}

    # -- launching ----------------------------------------------------------------------------

    def _evaluate(
        self, stage: str, model: Any, dataloaders: Any, loss_fn: Any, ckpt_path: Any
    ) -> list[dict[str, float]]:
        model = _model_for(model, self.model, dataloaders, stage)
        if loss_fn is None and model is self.model:
            loss_fn = self._fit_loss_fn  # the plain module's loss from the last fit
        check_model(model, loss_fn)
        kwargs = dict(loader=dataloaders, loss_fn=loss_fn, ckpt_path=ckpt_path)
        return self._launch(stage, model, kwargs)

    def _launch(self, stage: str, model: nn.Module, kwargs: dict[str, Any]) -> Any:
        kwargs["ckpt_path"] = ckpt_io.resolve_path(
            kwargs["ckpt_path"], self.checkpoint_callback, lambda: self.run_dir
        )
        if kwargs["ckpt_path"] is not None:  # one a killed save left aside
            ckpt_io.recover_aside(kwargs["ckpt_path"])
        if stage == "fit":
            if self._fitted and kwargs["ckpt_path"] is None:  # a new run, not a resume
                for lg in self.loggers:
                    lg.new_run()
            self._fitted = True
        elif kwargs["ckpt_path"] is not None:
            if self._masters_of(model):
                self._fit_masters = None  # the checkpoint's weights replace the fit's
            if self._fit_run is not None and self._fit_run.model is model:
                self._fit_replaced = f"{stage} loaded {kwargs['ckpt_path']} into the fit's model"
        if isinstance(self.strategy, ProcessGroupStrategy) and self.strategy.launches_processes:
            return self._launch_processes(self.strategy, stage, model, kwargs)
        return self._run(stage, model, kwargs)

    def _launch_processes(
        self, strategy: ProcessGroupStrategy, stage: str, model: nn.Module, kwargs: dict[str, Any]
    ) -> Any:
        """Run ``stage`` in the processes ``strategy`` launches; rank 0 sends back the model's
        weights and the trainer's progress, which land on the objects the caller holds."""
        for lg in self.loggers:
            lg.version  # noqa: B018 (fix the run directory before the children start)
        out = strategy.launch(_run_launched, self, stage, model, kwargs)
        # the weights land in the model as it was given, converted as the run's (sharded:
        # with its quantized layers only)
        if not strategy.sharded:
            apply(model, self.policy, warn=False)
        else:
            from mixprec.sharding import quantize_for

            quantize_for(model, self.policy)
        model.load_state_dict(out["model"])
        if stage == "fit":  # (an evaluation's processes have no masters)
            self._fit_masters = (model, out["masters"])
        self._progress = out["progress"]
        self._log.callback_metrics = out["callback_metrics"]
        self._log.logged_metrics = out["logged_metrics"]
        load_callback_states(self.callbacks, out["callbacks"], resume=False)
        self.model, self._current = model, None
        if stage == "fit":  # (trained in other processes: nothing of it to save here)
            self._fit_run = None
        if stage == "fit" or not self._fitted:  # (an evaluation's, before any fit)
            self._summary = out["summary"]
        return out["result"]

    def _run(self, stage: str, model: nn.Module, kwargs: dict[str, Any]) -> Any:
        """Run one stage in this process: seed, join the process group, set up, loop."""
        if stage != "fit" and self._fit_run is not None:
            # (before this run reseeds the generators and clears the metrics the last fit's
            # checkpoint reads: a save after it is the save right after the fit)
            resume.keep_run_state(self._fit_run)
        self.stage, self.model = stage, model
        self._gathered = None
        self._metrics.clear()
        self._log.reset_run()
        if self.config.seed is not None:
            seed_everything(self.config.seed)
        with determinism(self.config.deterministic):
            self.strategy.setup(stage)
            device = self.strategy.device
            if stage != "fit" and self._fit_run is not None and device.type != "cpu":
                # (the fit's optimizer states would hold the accelerator's memory through
                # the evaluation and after it, as they did not before it was kept)
                self._fit_run = None
                self._fit_released = f"{stage} freed its optimizers' {device.type} memory"
            reset_peak_memory(device)
            failed = True
            try:
                self.strategy.agree_on_version(self.loggers)
                attach(model, self, self._metrics)
                if stage == "fit":
                    result = self._fit(model, **kwargs)
                else:
                    result = self._run_eval_stage(stage, model, **kwargs)
                if self.strategy.sharded:  # while the process group is there
                    self._gathered = self.strategy.full_state_dict(model)
                failed = False
                return result
            except BaseException as exc:
                for cb in self.callbacks:
                    if listens(cb, "on_exception"):
                        cb.on_exception(self, model, exc)
                raise
            finally:
                self._log.flush()
                detach(model)
                if self._uncompile is not None:
                    self._uncompile()
                    self._uncompile = None
                for lg in self.loggers:
                    lg.finalize()
                self.stage = None
                if isinstance(self._current, FitRun):
                    self._current.release_wrapper()  # it holds the process group
                    # (its masters, not the run: later runs replace it, and the optimizers'
                    # states need not stay alive)
                    self._fit_masters = (self._current.model, _masters(self._current))
                self.strategy.teardown(failed)  # no waiting for the others after an error

    def _setup(
        self, model: nn.Module, loss_fn: Any, optimizer: Any = None, fit: bool = False
    ) -> tuple[Precision, StepRunner, list[LossScaleOptimizer], list[dict[str, Any]]]:
        """Device, then sharding (FSDP), then the optimizers (``fit``: built after sharding,
        which replaces the parameters), then precision (conversion unless sharded, optimizer
        wrapping), then compilation (``compile=``): in that order; DDP wraps the result.
        Returns the scheduler configs too."""
        device = self.strategy.device
        model.to(device)
        precision = self._precision
        # each run starts with no optimizers; a fit from the scaler as configured, and an
        # evaluation, which steps no optimizer, with the scaler as the last fit left it
        # (that fit's optimizers, whose checkpoint holds it, share it)
        precision.reset(scaler=fit)
        is_sharded = self.strategy.shard(model, precision)
        optimizers, scheduler_configs = configured_optimizers(model, optimizer) if fit else ([], [])
        made = [opt(model) if callable(opt) else opt for opt in optimizers]
        self.strategy.check_optimizers(model, made)
        wrapped = precision.setup(model, *made, convert=not is_sharded)
        repoint_converted(scheduler_configs, precision)
        if self.config.compile is not None and self._uncompile is None:
            self._uncompile = compile_model(model, self.config.compile)
        opts = list(wrapped[1:]) if made else []
        return precision, StepRunner(model, precision, loss_fn), opts, scheduler_configs

    def _fit(
        self,
        model: nn.Module,
        train: Iterable[Any],
        val: Iterable[Any] | None,
        loss_fn: Any,
        optimizer: Any,
        ckpt_path: Path | None,
    ) -> dict[str, Any]:
        precision, runner, opts, scheduler_configs = self._setup(model, loss_fn, optimizer, True)
        wrapped = self.strategy.wrap(runner)
        seed = self.config.seed if self.config.seed is not None else 0
        train_loader = self.strategy.prepare_loader(train, seed)
        run = FitRun(
            **self._run_parts(model, precision, runner),
            # without a DDP wrapper, skip nn.Module's call machinery on every step
            wrapped=wrapped,
            step=runner.forward if wrapped is runner else wrapped,
            optimizers=opts,
            schedulers=[scheduler_entry(c, opts) for c in scheduler_configs],
            train_loader=train_loader,
            train_data=train,
            val_loader=(
                self.strategy.prepare_loader(val, seed, evaluation=True)
                if val is not None
                else None
            ),
            num_training_batches=num_batches(
                train_loader, self.config.limit_train_batches, "train"
            ),
        )
        run.closure = check_closure_fit(
            opts, precision.scaler.enabled, self.config.accumulate_grad_batches, self.strategy.name
        )
        self._current = self._fit_run = run
        self._fit_replaced = self._fit_released = None
        counts = {"training": run.num_training_batches}
        if run.val_loader is not None and self.strategy.sharded:  # (see `_check_same_batches`)
            limit = self.config.limit_val_batches
            counts["validation"] = _known_batches(run.val_loader, limit, "val")
        steps = self.config.max_steps  # (a run that ends before any rank's data does)
        needed = steps * self.config.accumulate_grad_batches if steps is not None else None
        _check_same_batches(self.strategy, counts, needed)
        if run.num_training_batches == 0:
            raise EmptyEpochError(f"the training data has no batch: {why_empty(train)}")
        interval, n = self.config.val_check_interval, run.num_training_batches
        if isinstance(interval, int) and n is not None and interval > n and val is not None:
            raise ValueError(  # (it would validate once an epoch, at its end, silently)
                f"val_check_interval={interval} batches is more than an epoch's "
                f"{n} training batches: give at most {n}, or a fraction of an epoch "
                "(1.0: at each epoch's end)"
            )
        progress = self._progress
        progress.current_epoch = progress.global_step = progress.batches_done = 0
        progress.should_stop = False
        self.ckpt_path = ckpt_path
        if ckpt_path is not None and ckpt_path.is_dir():
            sharded.restore(run, ckpt_path)
        elif ckpt_path is not None:
            resume.restore(run, ckpt_io.load(ckpt_path), ckpt_path)
        run.skipped_steps = precision.scaler.stats().skipped_steps
        run.hook("on_fit_start")
        fit_loop(run)
        run.hook("on_fit_end")
        self._summary = self.summary()
        return {"summary": self._summary}

    def _run_eval_stage(
        self,
        stage: str,
        model: nn.Module,
        loader: Iterable[Any],
        ckpt_path: Path | None,
        loss_fn: Any = None,
    ) -> Any:
        if stage == "predict" and self.strategy.world_size > 1:  # (devices=1 on each machine)
            raise ValueError(_predict_refusal(self.strategy, self.strategy.world_size))
        precision, runner, _, _ = self._setup(model, loss_fn)
        run = Run(**self._run_parts(model, precision, runner))
        self._current = run
        if ckpt_path is not None and ckpt_path.is_dir():
            sharded.load_weights(run, ckpt_path)
        elif ckpt_path is not None:
            resume.load_weights(run, ckpt_io.load(ckpt_path), ckpt_path)
        if stage == "predict":
            return predict_loop(run, loader)
        loader = self.strategy.prepare_loader(loader, self.config.seed or 0, evaluation=True)
        if self.strategy.sharded:  # (see `_check_same_batches`)
            kind = "validation" if stage == "validate" else "test"
            limit = self.config.limit_val_batches if stage == "validate" else None
            _check_same_batches(self.strategy, {kind: _known_batches(loader, limit, "val")})
        if stage == "validate":
            return [run_eval(run, "validation", loader, self.config.limit_val_batches)]
        return [run_eval(run, "test", loader, None)]

    def _run_parts(
        self, model: nn.Module, precision: Precision, runner: StepRunner
    ) -> dict[str, Any]:
        """What every run object holds: the model set up, and this Trainer's progress and
        stores, which the run moves on."""
        return dict(
            trainer=self,
            config=self.config,
            strategy=self.strategy,
            model=model,
            precision=precision,
            runner=runner,
            progress=self._progress,
            metrics=self._metrics,
            log=self._log,
            device=self.strategy.device,
            cast_batches=not precision.policy.default.is_mixed,
        )


def _run_launched(
    trainer: Trainer, stage: str, model: nn.Module, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """A launched process's whole job: run, and report what the parent needs (rank 0's is
    kept): the result, the summary, the model's weights, progress and callback states."""
    for cb in trainer.callbacks:
        # (every process holds a copy of each callback: one that can combine the ranks'
        # numbers, a PrecisionMonitor, is told so)
        told = getattr(cb, "in_launched_processes", None)
        if callable(told):
            told()
    result = trainer._run(stage, model, kwargs)
    weights = trainer._gathered  # a sharded model's whole state, gathered before teardown
    masters = {}
    if weights is None:
        weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        masters = {k: v.detach().cpu() for k, v in _masters(trainer._current).items()}
    if stage == "fit":
        result, summary = None, result["summary"]
    else:
        summary = trainer.summary()
    return {
        "result": result,
        "summary": summary,
        "model": weights,
        "masters": masters,
        "progress": trainer._progress,
        "callback_metrics": trainer.callback_metrics,
        "logged_metrics": trainer.logged_metrics,
        "callbacks": callback_states(trainer.callbacks),
    }


def _masters(run: Run | None) -> dict[str, Tensor]:
    """The float32 masters a fit kept (16-true), by parameter name (of the model's
    parameters: an optimizer may step others); none for another run."""
    if not isinstance(run, FitRun):
        return {}
    names = {p: n for n, p in run.model.named_parameters()}
    return {
        names[p]: m for opt in run.optimizers for p, m in opt.master_params.items() if p in names
    }


def _model_for(model: nn.Module | None, last: nn.Module | None, data: Any, stage: str) -> nn.Module:
    chosen = model if model is not None else last
    if chosen is None:
        raise ValueError(f"{stage} needs a model (none was given and no fit ran before)")
    if data is None:
        raise ValueError(f"{stage} needs dataloaders")
    check_one_loader(data, "dataloaders")
    return chosen


def _known_batches(loader: Iterable[Any], limit: int | float | None, what: str) -> int | None:
    """The batches a pass over ``loader`` runs, None where its length is unknown or its
    limit cannot apply (the pass itself says why)."""
    try:
        return num_batches(loader, limit, what)
    except ValueError:
        return None


# what each kind of pass's batch count is capped with
_LIMITS = {"training": "limit_train_batches", "validation": "limit_val_batches"}


def _check_same_batches(
    strategy: Strategy, counts: dict[str, int | None], training_needed: int | None = None
) -> None:
    """Raise, on every rank alike, when the ranks would run different numbers of batches of
    a pass whose every batch runs collectives: a training batch's gradient reduction, any
    forward of a sharded model (FSDP's gathers). The ranks done first would leave the others
    waiting until the process group's timeout (30 minutes by default). One gather; a pass
    some rank cannot count (data without a length) is not checked, nor training that ends
    (``training_needed`` batches: max_steps) before the shortest rank's epoch does. (DDP's
    evaluation runs no collective per batch: uneven ranks there keep exact epoch means.)"""
    if strategy.world_size == 1:
        return
    ranks = strategy.gather(counts)
    for kind in counts:
        seen = [r[kind] for r in ranks]
        if None in seen or len(set(seen)) == 1:
            continue
        # (past the end of none: a rank whose epoch ends there runs its epoch's end alone)
        if kind == "training" and training_needed is not None and min(seen) > training_needed:
            continue
        each = ", ".join(f"rank {i}: {n}" for i, n in enumerate(seen))
        cap = _LIMITS.get(kind)
        raise ValueError(
            f"the {strategy.world_size} processes have different numbers of {kind} batches "
            f"({each}), and each batch runs collectives that wait for every process "
            f"(strategy={strategy.name!r}): the run would hang until the process group's "
            "timeout. Give every rank's loader the same length (a DistributedSampler gives "
            "each as many samples; a batch sampler over it must not drop or merge batches on "
            "some ranks only)" + (f", or cap the pass with {cap}={min(seen)}" if cap else "")
        )


def _predict_refusal(strategy: Strategy, processes: int) -> str:
    return (
        f"predict runs on one device, in one process (its outputs in order), and this "
        f"Trainer runs {processes} processes (strategy={strategy.name!r}): predict with "
        "Trainer(strategy='auto', devices=1), which loads file and sharded checkpoints "
        "alike (ckpt_path=...)"
    )
