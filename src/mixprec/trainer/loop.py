"""The loops: fit (epochs of batches, optimizer steps, validation when due), evaluation and
prediction. Read `fit_loop`, `train_epoch` and `train_batch` top to bottom: that is the whole
training algorithm.

Every loop works on a run object (`Run`, `FitRun`) that `Trainer._run` builds once the model
is on its device: its fields are set, so nothing here checks for a missing model or
optimizer. The run holds all the loops move on: the Trainer's progress counters (`Progress`,
which callbacks read as ``trainer.global_step``...), the stores ``self.log`` and the loggers'
rows go to, and the dispatch of hooks to the module and the callbacks.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from mixprec.memory import measured
from mixprec.optim import LossScaleOptimizer, scheduler_step
from mixprec.precision import Precision
from mixprec.step import as_loss, backward, batch_loss, split_batch, step_context
from mixprec.trainer.callbacks import Callback, agreed, listens
from mixprec.trainer.checkpoint import CheckpointError, rng_states, set_rng_states
from mixprec.trainer.data import (
    batch_size_of,
    generators,
    iterate_from,
    loader_batch_size,
    num_batches,
    set_epoch,
    to_device,
    why_empty,
)
from mixprec.trainer.metrics import MetricStore, StepLog, held_bytes, memory_readout
from mixprec.trainer.module import MODULE_HOOKS, TrainingModule
from mixprec.trainer.optimizers import Scheduler

if TYPE_CHECKING:
    from mixprec.trainer.config import TrainerConfig
    from mixprec.trainer.strategy import Strategy
    from mixprec.trainer.trainer import Trainer

__all__ = [
    "EmptyEpochError",
]


class StepRunner(nn.Module):
    """Runs one step of a kind ("training", "validation", ...) as a module's forward, so that
    DistributedDataParallel sees the training step as its forward (as Lightning does).

    A plain module's step is `mixprec.step.batch_loss`, as in the doctor and the search: the
    forward in the model's region, ``loss_fn`` outside it on the outputs, the loss checked.
    A TrainingModule's step runs in the precision's forward context (it may call submodules
    directly)."""

    def __init__(
        self, model: nn.Module, precision: Precision, loss_fn: Callable[..., Tensor] | None
    ) -> None:
        super().__init__()
        self.module = model
        # never submodules: not converted, not synced
        self.__dict__["precision"] = precision
        self.__dict__["loss_fn"] = loss_fn

    def forward(self, kind: str, batch: Any, batch_idx: int) -> Any:
        model, precision = self._modules["module"], self.precision
        if isinstance(model, TrainingModule):
            with step_context(precision, model, user_code=True):
                return getattr(model, f"{kind}_step")(batch, batch_idx)
        if kind != "predict":
            # the loops converted the batch before their hooks saw it
            return batch_loss(precision, model, batch, self.loss_fn, converted=True)
        with step_context(precision, model):
            return model(*predict_inputs(batch))


def predict_inputs(batch: Any) -> list[Any]:
    """A plain module's inputs in a prediction batch: a tensor; a list or tuple of one
    (``TensorDataset(x)`` yields ``[x]``); or ``(inputs..., target)``, whose target is not
    needed."""
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, (list, tuple)) and len(batch) == 1:
        return list(batch)
    if isinstance(batch, (list, tuple)) and len(batch) > 1:
        return split_batch(batch)[0]
    got = type(batch).__name__ + (" of length 0" if isinstance(batch, (list, tuple)) else "")
    raise TypeError(
        "predict with a plain module takes batches that are a tensor, a list or tuple of one "
        "([x], as TensorDataset(x) yields: model(x)), or a longer one whose last item is "
        f"left out ((x, y): model(x)); got {got}. For other batches, define predict_step in "
        "a TrainingModule"
    )


class EmptyEpochError(ValueError):
    """A training epoch had no batch to train on (the loop would never end)."""


class HookCalls(dict[tuple[str, bool, bool], list[Callable[..., None]]]):
    """What each hook of a run calls, by (name, module's, callbacks'): a hook's list is
    found by `find` at its first use and kept, so each later call is a dictionary lookup
    (hooks run per batch)."""

    def __init__(self, find: Callable[[str, bool, bool], list[Callable[..., None]]]) -> None:
        super().__init__()
        self.find = find

    def __missing__(self, key: tuple[str, bool, bool]) -> list[Callable[..., None]]:
        calls = self[key] = self.find(*key)
        return calls


@dataclass
class Progress:
    """Where the Trainer is (read as ``trainer.global_step``...): kept across its runs,
    restored from checkpoints, moved on by the loops."""

    current_epoch: int = 0
    global_step: int = 0  # optimizer steps, taken or skipped for overflow
    batches_done: int = 0  # batches of the current epoch done
    should_stop: bool = False  # a stop request (early stopping), taking effect at a window's end
    stepped_this_batch: bool = False  # whether the current training batch ended a step
    num_eval_batches: int | None = None  # batches of the current evaluation pass


@dataclass(eq=False)
class Run:
    """What one validate/test/predict call works with, set up on the device, and what it
    moves on: the progress counters, the metric stores, the hooks."""

    trainer: Trainer  # handed to the callbacks' hooks
    config: TrainerConfig  # the Trainer's checked settings
    strategy: Strategy  # where the run trains: the device, the processes
    model: nn.Module
    precision: Precision
    runner: StepRunner
    progress: Progress  # the Trainer's own
    metrics: MetricStore  # what ``self.log`` records in this run
    log: StepLog  # the rows for the loggers, and the latest value of every metric
    device: torch.device  # the strategy's, where batches go
    cast_batches: bool  # whether the precision converts batches (a "true" policy)
    # what each hook calls, found once per run at its first use (hooks run per batch)
    calls: HookCalls = field(init=False)

    def __post_init__(self) -> None:
        self.calls = HookCalls(self.listeners)

    @property
    def callbacks(self) -> list[Callback]:
        """The Trainer's callbacks (their states go into checkpoints)."""
        return self.trainer.callbacks

    @property
    def is_module(self) -> bool:
        """Whether the model is a TrainingModule (else a plain module with a loss_fn)."""
        return isinstance(self.model, TrainingModule)

    def hook(self, name: str, *args: Any) -> None:
        """Call hook ``name``: the module's, then the callbacks'."""
        for call in self.calls[name, True, True]:
            call(*args)

    def module_hook(self, name: str, *args: Any) -> None:
        """Call a TrainingModule's hook ``name``."""
        for call in self.listening(name, callbacks=False):
            call(*args)

    def callback_hook(self, name: str, *args: Any) -> None:
        """Call hook ``name`` of the callbacks that override it, with the trainer and model."""
        for call in self.listening(name, module=False):
            call(*args)

    def listening(
        self, name: str, module: bool = True, callbacks: bool = True
    ) -> list[Callable[..., None]]:
        """What hook ``name`` calls: a TrainingModule's own hook (not the no-op it
        inherits), then those of the callbacks that override it, bound to the trainer and
        model; found once per run, so that an absent hook costs a lookup."""
        return self.calls[name, module, callbacks]

    def listeners(self, name: str, module: bool, callbacks: bool) -> list[Callable[..., None]]:
        """`listening`'s list, found (once per run: `HookCalls`)."""
        calls = []
        model = self.model
        if module and isinstance(model, TrainingModule) and name in MODULE_HOOKS:
            own = getattr(model, name)
            if getattr(own, "__func__", None) is not getattr(TrainingModule, name):
                calls.append(own)
        if callbacks:
            calls += [
                functools.partial(getattr(cb, name), self.trainer, model)
                for cb in self.callbacks
                if listens(cb, name)
            ]
        return calls


@dataclass(eq=False, kw_only=True)
class FitRun(Run):
    """A fit: the run, its optimizers, schedulers and loaders, and the loop's own state."""

    wrapped: nn.Module  # what training steps run through (the DDP wrapper, or the runner)
    step: Callable[..., Any]  # the training step: the wrapper, or the runner's forward
    optimizers: list[LossScaleOptimizer]
    schedulers: list[Scheduler]
    train_loader: Iterable[Any]
    train_data: Iterable[Any]  # as the user gave it (for messages)
    val_loader: Iterable[Any] | None
    num_training_batches: int | None
    # generator states when this epoch's order was drawn (set by the epoch or a checkpoint)
    epoch_rng: dict[str, Any] = field(default_factory=dict)
    resume_rng: dict[str, Any] | None = None  # states to restore once resumed batches are skipped
    # the size of this epoch's first batch, for loaders that do not say theirs (a list, a
    # generator): a mid-epoch resume skips batches, and checks that it skips as many samples
    first_batch_size: int | None = None
    window_batches: int = 0  # micro-batches whose gradients are accumulated, not yet stepped
    window_size: int = 1  # what their losses were divided by (the window's planned length)
    skipped_steps: int = 0  # counted here: reading the scaler's stats is a host sync
    epoch_finished: bool = False
    window_losses: list[Tensor] = field(default_factory=list)
    trained_batches: int = 0  # batches of this epoch that returned a loss
    closure: bool = False  # its one optimizer evaluates the loss inside step (LBFGS)
    # from a window's last backward to the end of its step: no checkpoint then (its
    # gradients and generator states are not saved: `Trainer.save_checkpoint`)
    stepping: bool = False
    # the step's own values (loss, lr, scaler's) from its optimizer step until the end of
    # its batch, which takes its row (`log_step`)
    step_values: dict[str, Tensor | float] | None = None
    # its run state as it ended (`resume.keep_run_state`), once a later evaluation of the
    # Trainer would move what it is read from: a save after that is the save at the end
    ended: dict[str, Any] | None = None
    # the generator states a save now holds where they are not the current ones, but those
    # the run goes on from (`resume.rank_state`): in a validation, those it puts back after
    # it; in on_train_batch_start, those before its batch was fetched (a resume fetches it
    # again), and at an epoch's first batch the training loader's generators too
    held_rng: dict[str, Any] | None = None
    # the states before the batch being trained was fetched, kept where on_train_batch_start
    # is listened to (`train_epoch`)
    fetch_rng: dict[str, Any] | None = None

    @property
    def in_window(self) -> bool:
        """Whether gradients are accumulated and not yet stepped."""
        return self.window_batches > 0

    def release_wrapper(self) -> None:
        """Drop the DDP wrapper (it holds the process group) once the run is over."""
        self.wrapped, self.step = self.runner, self.runner.forward


# -- fit ------------------------------------------------------------------------------------

# the optimizer steps of a fit whose tensor memory is measured: the first allocates the
# states and whatever a library sets up once per process (a low-bit optimizer's code tables);
# the second is a step as every later one, and the summary's readout when the fit has it
MEASURED_STEPS = 2


def fit_loop(run: FitRun) -> None:
    """Epochs until a stop condition; an epoch cut by ``max_steps`` or a stop request is left
    unfinished (a checkpoint of it resumes mid-epoch). A run resumed from a save on an epoch's
    last batch first ends that epoch, as the run that saved it did. Gradients the model
    holds when the fit starts (a loop's last backward, an earlier stage) are cleared: the
    first window would add them to its own."""
    for opt in run.optimizers:
        opt.zero_grad(set_to_none=True)
    if run.trainer.ckpt_path is None:
        run.log.forget_evaluations()
    run.hook("on_train_start")
    if run.progress.batches_done == 0:  # resuming at an epoch boundary, or starting
        restore_resume_rng(run)
    while run.progress.batches_done == run.num_training_batches or not fit_done(run):
        train_epoch(run)
        if run.epoch_finished:
            end_epoch(run)
            if run.strategy.world_size > 1:  # (a stop decided at the epoch's end, all together)
                run.progress.should_stop = run.strategy.any(run.progress.should_stop)
    with run.metrics.refusing("on_train_end"):
        run.hook("on_train_end")


def fit_done(run: FitRun) -> bool:
    """Whether training should stop now (early stop, ``max_steps`` or ``max_epochs``)."""
    config = run.config
    if run.progress.should_stop:
        return True
    if config.max_steps is not None and run.progress.global_step >= config.max_steps:
        return True
    return config.max_epochs is not None and run.progress.current_epoch >= config.max_epochs


def start_workers(loader: Any) -> None:
    """Start the workers of a DataLoader that keeps them (``persistent_workers``) without
    moving a random generator. Starting them draws their seed, once for the loader's life;
    each epoch after draws only its order. A resumed process starts a new loader, whose
    first epoch would draw the workers' seed before its order, and every order after the
    resume would differ from the run that never stopped: started here in both runs, every
    epoch draws only its order, from the same states. (The workers' own seed, which their
    random augmentations draw from, still differs after a resume.)"""
    if not (
        isinstance(loader, DataLoader)
        and loader.persistent_workers
        and loader.num_workers > 0
        and loader._iterator is None
    ):
        return
    states = rng_states()
    own = [(g, g.get_state()) for g in generators(loader)]
    try:
        iter(loader)
    finally:
        set_rng_states(states)
        for g, state in own:
            g.set_state(state)


def restore_resume_rng(run: FitRun) -> None:
    """Put back the generator states saved with a checkpoint (once)."""
    if run.resume_rng is not None:
        set_rng_states(run.resume_rng)
        run.resume_rng = None


def _check_first_batch(run: FitRun, batch: Any) -> None:
    """A mid-epoch resume over a loader without a batch size of its own (a list, a
    generator) skips the batches done: refuse it where its batches now hold another number
    of samples than at the save (skipping as many batches would repeat or skip samples)."""
    saved, size = run.first_batch_size, batch_size_of(batch)
    if saved is not None and loader_batch_size(run.train_loader) is None and size != saved:
        raise CheckpointError(
            f"the checkpoint resumed was saved after {run.progress.batches_done} batches of "
            f"epoch {run.progress.current_epoch} whose first held {saved} samples; this run's "
            f"first batch holds {size}, so skipping {run.progress.batches_done} batches would "
            "repeat or skip samples: resume with the same data and batch size, or from a "
            "checkpoint saved at the end of an epoch"
        )


def train_epoch(run: FitRun) -> None:
    """One epoch, or its rest when resumed mid-epoch, or until a stop condition (taking effect
    at the end of an accumulation window)."""
    progress = run.progress
    if not run.model.training:  # (a model left in eval mode; submodules the user put in
        run.model.train()  # eval mode under a training model, a frozen backbone, stay so)
    with run.metrics.epoch_hook("on_train_epoch_start"):
        run.hook("on_train_epoch_start")
    n = run.num_training_batches
    if progress.batches_done == n:  # resumed from a save on the last batch: only its end is left
        restore_resume_rng(run)
        run.epoch_finished = True
        return
    loader = run.train_loader
    set_epoch(loader, progress.current_epoch)
    # The epoch's data order is drawn from the generators when iteration starts: their state
    # then is kept (and checkpointed) so that a run resumed mid-epoch replays the same order,
    # skips the batches already done, and goes on with the generators as they were at the save.
    if progress.batches_done == 0:
        start_workers(loader)
        run.epoch_rng = {
            # every generator a sampler may draw the order from: torch's, and numpy's and
            # Python's (a sampler shuffling with np.random or random.shuffle)
            "all": rng_states(),
            "torch": torch.get_rng_state(),
            "loader": [g.get_state() for g in generators(loader)],
            "rank": run.strategy.global_rank,  # (whose they are: a checkpoint may carry them)
        }
        batches = iter(loader)
        # (the states a save at the epoch's first batch resumes from: before its order)
        run.fetch_rng = {"rng": run.epoch_rng["all"], "loader": run.epoch_rng["loader"]}
    else:
        # (checkpoints before it kept torch's alone; a file saved by rank 0 alone holds its
        # states only, and a rank's own numpy or Python order is its own: those replay
        # torch's, as before)
        own = run.strategy.world_size == 1 or run.epoch_rng.get("rank") == run.strategy.global_rank
        if "all" in run.epoch_rng and own:
            set_rng_states(run.epoch_rng["all"])
        torch.set_rng_state(run.epoch_rng["torch"])
        for g, s in zip(generators(loader), run.epoch_rng["loader"], strict=True):
            g.set_state(s)
        batches = iterate_from(
            loader,
            progress.batches_done,
            functools.partial(_resumed, run),
            start_workers,
            first=functools.partial(_check_first_batch, run),
        )
    if run.calls["on_train_batch_start", True, True]:  # (a save there: `train_batch`)
        batches = _states_kept(run, batches)
    exhausted = run.epoch_finished = False
    run.log.start_timing()
    first = batch_idx = progress.batches_done
    run.trained_batches = 0
    strategy = run.strategy
    several = strategy.world_size > 1
    # (the epoch's count cannot reach max_epochs inside it: `fit_done` is the steps' and a
    # stop request's, read here as attributes, every batch)
    max_steps = run.config.max_steps if run.config.max_steps is not None else math.inf
    for batch in batches:  # (never fetched past n: the generators would move)
        run.metrics.batch_size = batch_size_of(batch)  # (what a logged value weighs)
        if batch_idx == 0:
            run.first_batch_size = run.metrics.batch_size
        if run.log.measured_steps < MEASURED_STEPS:
            measured_batch(run, batch, batch_idx)
        else:
            train_batch(run, batch, batch_idx)
        batch_idx += 1
        if several:
            progress.should_stop = strategy.any(progress.should_stop)  # all ranks together
        if not run.window_batches and (progress.should_stop or progress.global_step >= max_steps):
            # data without len() may have ended with this batch: then the epoch is over, as
            # it would be for sized data (its end validates and counts the epoch)
            exhausted = n is None and not run.strategy.any(not ran_out(batches))
            break
        if batch_idx == n:
            break
    else:
        exhausted = True
    if first == 0 and batch_idx == 0:  # an epoch without batches would repeat forever
        raise EmptyEpochError(
            f"the training data gave no batch in epoch {progress.current_epoch}: "
            f"{why_empty(run.train_data, progress.current_epoch)}"
        )
    finished = exhausted or batch_idx == n
    if first == 0 and finished and run.trained_batches == 0:
        raise EmptyEpochError(
            f"training_step returned None for all {batch_idx} batches of epoch "
            f"{progress.current_epoch}, so nothing was trained; return the loss for the batches "
            "to learn from"
        )
    if exhausted:
        end_of_data(run, batch_idx)
    run.log.stop_timing()
    run.epoch_finished = finished


def _resumed(run: FitRun) -> None:
    """A resumed epoch's batches done are skipped: the generators go on as at the save,
    from before the next batch is fetched."""
    restore_resume_rng(run)
    run.fetch_rng = {"rng": rng_states(), "loader": None}


def _states_kept(run: FitRun, batches: Iterator[Any]) -> Iterator[Any]:
    """``batches``, with the generator states before each is fetched kept in
    ``run.fetch_rng`` (its random augmentation draws from them): a save in
    ``on_train_batch_start`` holds them, and its resume fetches that batch again. The first
    batch's are kept already (its epoch's start, or where a resume skipped to)."""
    first = True
    while True:
        if not first:
            run.fetch_rng = {"rng": rng_states(), "loader": None}
        first = False
        try:
            batch = next(batches)
        except StopIteration:
            return
        yield batch


def ran_out(batches: Iterator[Any]) -> bool:
    """Whether the iterator is exhausted, looked up without moving the random generators (a
    checkpoint saved after the look resumes as if it had not been made); a batch it yields
    is dropped, so only call it when training stops."""
    with rng_unchanged():
        try:
            next(batches)
        except StopIteration:
            return True
    return False


def end_of_data(run: FitRun, batches: int) -> None:
    """The loader ran out after ``batches`` batches (its length was unknown, or shorter than
    it said): step a window it cut short, then validate unless the last batch just did."""
    stepped = run.in_window
    if stepped:
        optimizer_step(run)
        log_step(run)  # (no batch's end follows)
    if (
        run.val_loader is not None
        and run.config.limit_val_batches != 0
        and (stepped or not val_due(run, batches - 1))
    ):
        validate_during_fit(run, run.val_loader)


def train_batch(run: FitRun, batch: Any, batch_idx: int) -> None:
    """One batch: forward, scaled backward and, at the end of its accumulation window, the
    optimizer step (or the whole step of a closure optimizer); validation when due;
    ``on_train_batch_end``, then the step's row (`log_step`)."""
    batch = to_device(batch, run.device)
    if run.cast_batches:
        batch = run.precision.convert_input(batch)
    starts = run.calls["on_train_batch_start", True, True]
    if starts:
        # a save there holds the states before the batch was fetched (`_states_kept`)
        run.held_rng = run.fetch_rng
        try:
            for call in starts:
                call(batch, batch_idx)
        finally:
            run.held_rng = None
    run.progress.stepped_this_batch = False
    if run.closure:
        output = closure_step(run, batch, batch_idx)
    else:
        output = micro_batch(run, batch, batch_idx)
    run.progress.batches_done = batch_idx + 1
    if run.val_loader is not None and val_due(run, batch_idx):
        validate_during_fit(run, run.val_loader)
    for call in run.calls["on_train_batch_end", True, True]:
        call(output, batch, batch_idx)
    log_step(run)


def measured_batch(run: FitRun, batch: Any, batch_idx: int) -> None:
    """`train_batch` of a batch of the fit's first `MEASURED_STEPS` optimizer steps, its
    tensor memory measured (`mixprec.memory`: on a CPU the profiler's allocation events,
    which cost a second or two once per process; on CUDA the allocator's peak since the fit
    began); each step that has run gives the summary's readout. Not measured inside a
    profile of the user's."""
    device = run.strategy.device
    if device.type != "cuda" and torch.autograd._profiler_enabled():
        train_batch(run, batch, batch_idx)
        return
    held = held_bytes(run.model, run.optimizers)
    if device.type == "cuda":
        train_batch(run, batch, batch_idx)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        _, grown = measured(device, lambda: train_batch(run, batch, batch_idx))
        peak = held + grown
    log = run.log
    log.step_peak = max(log.step_peak, peak)
    if run.progress.stepped_this_batch:
        log.memory = memory_readout(log.step_peak, run.model, run.optimizers)
        log.measured_steps += 1
        log.step_peak = 0


def micro_batch(run: FitRun, batch: Any, batch_idx: int) -> Any:
    """Forward and scaled backward of one micro-batch, and the optimizer step at the end of
    its accumulation window; returns what the training step returned."""
    # forward and scaled backward; DDP all-reduces only on the window's last micro-batch
    k, n = run.config.accumulate_grad_batches, run.num_training_batches
    window_start = batch_idx - batch_idx % k
    window = k if n is None or n - window_start >= k else n - window_start
    last_in_window = batch_idx - window_start == window - 1
    run.window_batches += 1
    run.window_size = window
    if k > 1:
        with run.strategy.no_sync(run.wrapped, sync=last_in_window):
            output, loss = forward_backward(run, batch, batch_idx, window)
    else:  # a window of one always synchronizes
        output, loss = forward_backward(run, batch, batch_idx, window)
    if loss is not None:  # None: the batch is skipped, as in Lightning
        run.window_losses.append(loss)  # detached when read: no op per step
        run.trained_batches += 1
    run.log.samples += run.metrics.batch_size or 0  # (the batch's: `train_epoch`)

    if last_in_window:
        optimizer_step(run)
    return output


def closure_step(run: FitRun, batch: Any, batch_idx: int) -> Any:
    """The step of an optimizer that evaluates the loss inside ``step`` (LBFGS), as in
    Lightning: its closure runs the training step, the backward, then `before_step` (hooks,
    clipping), as often as the optimizer asks. The first evaluation's output and loss are
    the batch's. Under several processes the closure returns the loss averaged over them, so
    that every rank takes the same decisions and as many evaluations (each one all-reduces
    the gradients). `optimizers.check_closure_fit` refused what this cannot run."""
    opt = run.optimizers[0]
    first: list[Any] = []

    def closure() -> Tensor:
        opt.zero_grad(set_to_none=True)
        output = run.step("training", batch, batch_idx)
        loss = None if output is None else as_loss(output, "training_step")
        if loss is None:
            raise RuntimeError(
                f"training_step returned None for batch {batch_idx}, but "
                f"{type(opt.optimizer).__name__} evaluates the loss inside its step and "
                "needs one: return the loss for every batch"
            )
        backward(run.precision, loss)
        if not first:
            first.append(output)
            run.window_losses.append(loss.detach())
            run.trained_batches += 1
            run.log.samples += run.metrics.batch_size or 0  # (the batch's: `train_epoch`)
        before_step(run)
        return run.strategy.mean(loss) if run.strategy.world_size > 1 else loss.detach()

    run.stepping = True
    scaler = run.precision.scaler
    used = scaler.scale_tensor.clone() if scaler.enabled else None  # (`optimizer_step`)
    run.precision.step(opt, closure=closure)
    after_step(run, used)
    run.stepping = False
    return first[0]


def forward_backward(
    run: FitRun, batch: Any, batch_idx: int, window: int
) -> tuple[Any, Tensor | None]:
    """The training step and the scaled backward of its loss (divided by the ``window``'s
    micro-batches); returns what the step returned and the loss (None: skip the batch)."""
    output = run.step("training", batch, batch_idx)
    # a plain module's loss comes checked (`batch_loss`); a training step's None skips; a
    # 0-dim floating tensor, the common loss, is taken without a call
    if type(output) is Tensor and output.ndim == 0 and output.dtype.is_floating_point:
        loss: Tensor | None = output
    else:
        loss = None if output is None else as_loss(output, "training_step")
    if loss is not None:
        if window > 1:
            backward(run.precision, loss, accumulate=window)
        else:
            run.precision.backward(loss)
    elif run.strategy.world_size > 1:
        raise RuntimeError(
            f"training_step returned None for batch {batch_idx} on rank "
            f"{run.strategy.global_rank}: under DDP a skipped batch would leave the "
            "other processes waiting for its gradients; return a loss that contributes "
            "nothing instead (e.g. loss * 0.0)"
        )
    return output, loss


def optimizer_step(run: FitRun) -> None:
    """Unscale, hooks, clip, step or skip (all optimizers together), schedulers, log."""
    precision = run.precision
    batches, run.window_batches = run.window_batches, 0
    if not run.window_losses:  # every micro-batch of the window was skipped: nothing to step
        for opt in run.optimizers:
            opt.zero_grad(set_to_none=True)
        return
    run.stepping = True
    if batches != run.window_size:  # cut short: the data ended, or the run resumed inside it
        rescale_grads(run.optimizers, run.window_size / batches)
    clip = run.config.gradient_clip_val is not None
    if clip or run.calls["on_before_optimizer_step", True, True]:
        before_step(run)  # (else nothing reads the gradients before the step unscales them)
    # the scale this step runs at (the step updates the live one in place): its row's, as
    # its lr is the one it used (a copy on the device, nothing read back)
    scaler = precision.scaler
    used = scaler.scale_tensor.clone() if scaler.enabled else None
    if not precision.step():
        run.skipped_steps += 1
    after_step(run, used)
    run.stepping = False


def before_step(run: FitRun) -> None:
    """What comes between the backward and the step: the gradients unscaled,
    ``on_before_optimizer_step``, clipping. The formats' own work (float8's amax histories
    shared across the ranks) is `Precision.before_step`, which `Precision.step` runs."""
    precision, config = run.precision, run.config
    hooks = run.listening("on_before_optimizer_step")
    if not hooks and config.gradient_clip_val is None:
        return  # nothing reads the gradients before the step, which unscales them itself
    precision.unscale_()
    for opt in run.optimizers:
        for call in hooks:
            call(opt)
    if config.gradient_clip_val is not None:
        for opt in run.optimizers:
            if config.gradient_clip_algorithm == "norm":
                precision.clip_grad_norm_(opt, config.gradient_clip_val)
            else:
                precision.clip_grad_value_(opt, config.gradient_clip_val)


def after_step(run: FitRun, scale: Tensor | None = None) -> None:
    """Gradients cleared, the step counted, step-interval schedulers, the step's values
    (``scale``: the loss scale the step ran at; None when nothing is scaled)."""
    for opt in run.optimizers:
        opt.zero_grad(set_to_none=True)
    run.progress.global_step += 1
    run.progress.stepped_this_batch = True
    due = (
        [
            s
            for s in run.schedulers
            if s.interval == "step" and run.progress.global_step % s.frequency == 0
        ]
        if run.schedulers
        else ()
    )
    # the step's row carries the lr this step used, read before a scheduler moves it (a
    # tensor lr is set in place, by this step's schedulers or an epoch's: copied first)
    lr = run.optimizers[0].optimizer.param_groups[0]["lr"] if run.optimizers else 0.0
    if isinstance(lr, Tensor):
        lr = lr.clone()
    for s in due:
        if not s.monitor:
            scheduler_step(s.scheduler, s.optimizer)  # does not advance on a skipped step
    losses, run.window_losses = run.window_losses, []
    if len(losses) == 1:
        loss = losses[0]
    else:
        with torch.no_grad():
            loss = torch.stack(losses).mean()
    # the step's own values: with what self.log recorded so far, the latest values (what
    # callbacks and monitors read) until the batch's end hooks have run and `log_step`
    # takes its row
    own: dict[str, Tensor | float] = {"loss": loss, "lr": lr}
    if scale is not None:
        own["loss_scale"] = scale
        own["skipped_steps"] = float(run.skipped_steps)
    run.step_values = own
    # (a name the step logged itself keeps the step's value: self.log("loss", data_term))
    run.log.latest = {**own, **run.metrics.take_step(run.strategy.mean, keep=True)}
    for s in due:  # a monitored one reads this step's values, once they are shown
        if s.monitor:
            value = monitored_value(run, s)
            if value is not None:
                scheduler_step(s.scheduler, s.optimizer, value)


def rescale_grads(optimizers: list[LossScaleOptimizer], factor: float) -> None:
    """Multiply the accumulated gradients of what ``optimizers`` step by ``factor``: the
    losses of a window with fewer micro-batches than planned were divided by the planned
    count. Done to the still-scaled gradients (on the model's parameters, a loss module's
    too, before they move to any masters), so that the loss scaler's inf/NaN check sees what
    the optimizer will use."""
    params = {
        id(t): t
        for opt in optimizers
        for group in opt.param_groups
        for t in map(opt.model_param, group["params"])
    }
    with torch.no_grad():
        for p in params.values():
            if p.grad is not None:
                p.grad.mul_(factor)


def log_step(run: FitRun) -> None:
    """The row of the step this batch took, with what its end hooks logged (as in
    Lightning): every ``log_every_n_steps``-th step (and a step a stop request ends) reads
    it back and logs it, the others only keep it as the latest values. Its values stay
    tensors until then."""
    own, run.step_values = run.step_values, None
    if own is not None:
        row = {**own, **run.metrics.take_step(run.strategy.mean)}
        run.log.step_row(run.progress.global_step, row, force=run.progress.should_stop)


def rows_after_save(run: FitRun) -> list[dict[str, float]]:
    """The rows the run logs at its step right after a save now, which a run resumed from
    that save does not log: the step's row where its batch has not ended (a save in its
    validation or ``on_train_batch_end``) and the row is due (`StepLog.step_row`); at an
    epoch's end, the values still to be logged for it (those callbacks log in
    ``on_train_epoch_end``, which a checkpoint callback, the last, saves before). Read
    back, with this process's own values (no collective: a save may be rank 0's alone)."""
    rows: list[dict[str, Tensor | float]] = []
    progress = run.progress
    due = progress.global_step % run.log.every_n_steps == 0 or progress.should_stop
    if run.step_values is not None and due:
        # (with the throughput columns it gets when logged, as of now)
        rows.append({**run.step_values, **run.metrics.training_step_values(), **run.log.timing()})
    if run.epoch_finished:
        sums = run.metrics.training_epoch_sums()
        # (as `MetricStore.take_epoch` logs them: NaN where every value weighed nothing)
        rows.append(
            {name: total / weight if weight else math.nan for name, (total, weight) in sums.items()}
        )
    return [
        {k: float(v.detach() if isinstance(v, Tensor) else v) for k, v in row.items()}
        for row in rows
        if row
    ]


def val_due(run: FitRun, batch_idx: int) -> bool:
    """Whether a validation pass runs after training batch ``batch_idx``."""
    if run.config.limit_val_batches == 0:
        return False
    n = run.num_training_batches
    if n is not None and batch_idx + 1 == n:
        return True  # every epoch ends with a validation
    interval = run.config.val_check_interval
    if isinstance(interval, float):
        # (data without len() takes 1.0 alone: `config.check_fractions` refuses the others)
        if interval == 1.0 or n is None:
            return False
        interval = max(1, int(n * interval))
    return (batch_idx + 1) % interval == 0


def validate_during_fit(run: FitRun, loader: Iterable[Any]) -> None:
    """A validation pass inside fit; its time does not count as training time."""
    run.log.stop_timing()
    run_eval(run, "validation", loader, run.config.limit_val_batches)  # (modes put back)
    run.log.start_timing()


def end_epoch(run: FitRun) -> None:
    """The end of a training epoch, then the next one. In order: epoch-interval schedulers
    without a monitor; the module's ``on_train_epoch_end``; the training epoch's metrics
    (``on_epoch=True``) reduced and logged; schedulers with a monitor, which may watch them;
    the callbacks' ``on_train_epoch_end`` (checkpoints), which see them too."""
    step_epoch_schedulers(run, monitored=False)
    with run.metrics.epoch_hook("on_train_epoch_end"):
        run.module_hook("on_train_epoch_end")
        log_training_epoch(run)
        step_epoch_schedulers(run, monitored=True)
        run.callback_hook("on_train_epoch_end")
        log_training_epoch(run)  # what callbacks logged through the module
    for lg in run.trainer.loggers:
        lg.flush()
    run.progress.current_epoch += 1
    run.progress.batches_done = 0
    run.epoch_finished = False


def step_epoch_schedulers(run: FitRun, monitored: bool) -> None:
    """Step the epoch-interval schedulers due this epoch that have (or have no) monitor."""
    with warnings.catch_warnings():
        # the Trainer orders the steps itself: torch's warning that a scheduler stepped before
        # its optimizer only means that no step ran in this process (resumed at an epoch's end)
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before")
        for s in run.schedulers:
            due = s.interval == "epoch" and (run.progress.current_epoch + 1) % s.frequency == 0
            if due and bool(s.monitor) == monitored:
                # once per epoch trained, whatever its last step did: a step skipped for an
                # overflow holds back step-interval schedulers, not a whole epoch's
                value = monitored_value(run, s) if s.monitor else None
                if s.monitor and value is None:
                    continue
                s.scheduler.step(*([] if value is None else [value]))


def log_training_epoch(run: Run) -> None:
    """Reduce the values logged for the training epoch and log them (callbacks see them)."""
    metrics = run.metrics.take_epoch(run.strategy.mean, run.strategy.union)
    if metrics:
        run.log.add(run.progress.global_step, dict(metrics), flush=True)


def monitored_value(run: Run, s: Scheduler) -> float | None:
    """The value of the metric a plateau-type scheduler watches; None (warned) where it was
    not logged and the scheduler's config says ``strict: False``, as Lightning does."""
    metrics = run.log.read()
    # (each rank's own value, unless logged with sync_dist: the ranks' schedules must agree,
    # or their learning rates, and then their weights, drift apart; averaged over the ranks
    # that logged it, all ranks asking)
    value = agreed(run.strategy, metrics.get(s.monitor))
    if value is None:
        which = f"scheduler {s.name!r}" if s.name else "the scheduler"
        message = (
            f"{which} monitors {s.monitor!r}, which was not logged; logged: "
            f"{', '.join(sorted(metrics)) or 'nothing'}"
        )
        if s.strict:
            raise KeyError(message)
        warnings.warn(f"{message}: its step is left out ('strict': False)", stacklevel=2)
    return value


# -- evaluation and prediction ------------------------------------------------------------------


@contextlib.contextmanager
def rng_unchanged() -> Iterator[dict[str, Any]]:
    """Run a block (validation) without moving the random generators training draws from,
    so that how often one validates never changes the training run; yields their states."""
    states = rng_states()
    try:
        yield states
    finally:
        set_rng_states(states)


@contextlib.contextmanager
def modes_kept(model: nn.Module) -> Iterator[None]:
    """Put every module of `model` back in the train or eval mode it had (an evaluation
    sets them all to eval): a frozen backbone the user put in eval mode stays so through
    fit's validations, and `validate`, `test` and `predict` leave the modes as they found
    them, as Lightning does."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def run_eval(
    run: Run, kind: str, loader: Iterable[Any], limit: int | float | None
) -> dict[str, float]:
    """One validation or test pass; returns its epoch metrics (also logged). The metric
    store logs evaluation values meanwhile, and is put back however the pass ends (an
    error, Ctrl-C): left evaluating, a later fit of the Trainer would log its training
    values as evaluation epoch values."""
    what = "val" if kind == "validation" else "test"
    n = run.progress.num_eval_batches = num_batches(loader, limit, what)
    metrics_store = run.metrics
    # (a validation inside a training batch: its on_train_batch_end logs weigh that batch)
    training, training_batch = metrics_store.training, metrics_store.batch_size
    metrics_store.training = False
    if not isinstance(run, FitRun):  # a validate or test call: its rows are kept (`replay`)
        run.log.evaluating = True
    held = run.held_rng if isinstance(run, FitRun) else None
    try:
        with modes_kept(run.runner), rng_unchanged() as states, torch.no_grad():
            if isinstance(run, FitRun):  # a save in it holds those training goes on from
                run.held_rng = {"rng": states, "loader": None}
            run.runner.eval()
            return eval_pass(run, kind, loader, n)
    finally:
        metrics_store.training, metrics_store.batch_size = training, training_batch
        if isinstance(run, FitRun):
            run.held_rng = held


def eval_pass(run: Run, kind: str, loader: Iterable[Any], n: int | None) -> dict[str, float]:
    """`run_eval`'s pass over at most ``n`` batches (all when None), hooks and rows."""
    what = "val" if kind == "validation" else "test"
    model, metrics_store = run.model, run.metrics
    plain = not isinstance(model, TrainingModule)
    run.hook(f"on_{kind}_start")
    if isinstance(model, TrainingModule):
        with metrics_store.epoch_hook(f"on_{kind}_epoch_start"):
            getattr(model, f"on_{kind}_epoch_start")()
    for batch_idx, batch in enumerate(loader):
        if n is not None and batch_idx >= n:
            break
        batch = run.precision.convert_input(to_device(batch, run.strategy.device))
        metrics_store.batch_size = batch_size_of(batch)  # (what a logged value weighs)
        output = run.runner(kind, batch, batch_idx)
        if plain:
            metrics_store.log(f"{what}_loss", output)
        # the batch's values, shown to its batch-end hook, then handed to the loggers
        # in one row with what the hook logs
        shown = run.log.show(dict(metrics_store.take_step(run.strategy.mean)))
        run.hook(f"on_{kind}_batch_end", output, batch, batch_idx)
        row = {**shown, **metrics_store.take_step(run.strategy.mean)}
        if row:
            run.log.add(run.progress.global_step, row, flush=True)
    if isinstance(model, TrainingModule):
        with metrics_store.epoch_hook(f"on_{kind}_epoch_end"):
            getattr(model, f"on_{kind}_epoch_end")()
    metrics_store.batch_size = None
    metrics = metrics_store.take_epoch(run.strategy.mean, run.strategy.union)
    run.log.add(run.progress.global_step, dict(metrics), flush=True)
    with metrics_store.refusing(f"on_{kind}_end"):
        run.hook(f"on_{kind}_end")
    return metrics


def predict_loop(run: Run, loader: Iterable[Any]) -> list[Any]:
    """The outputs of ``predict_step`` (or of the module) for each batch, in order."""
    out = []
    with modes_kept(run.runner), torch.no_grad():
        run.runner.eval()
        for batch_idx, batch in enumerate(loader):
            batch = run.precision.convert_input(to_device(batch, run.strategy.device))
            out.append(run.runner("predict", batch, batch_idx))
    return out
