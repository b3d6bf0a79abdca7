"""Metrics of a run: what ``self.log`` records (`MetricStore`), the rows handed to the loggers
with the throughput (`StepLog`), and the end-of-run summary (`summary_rows`).

Values stay tensors until they are logged (every ``log_every_n_steps`` steps, at evaluation
and epoch ends) or a callback reads them, so logging a metric in ``training_step`` adds no
host synchronization per step; the progress bar shows what was read last.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from mixprec.optim import LossScaleOptimizer
from mixprec.optim.states import state_bytes

__all__: list[str] = []

_Sums = dict[str, list[Any]]  # name -> [sum tensor, weight]


_ACCEPTED = "a real number (an int, a float, a numpy scalar) or a one-element real tensor or array"


def _scalar(name: str, value: Tensor | float) -> Tensor:
    numpy = sys.modules.get("numpy")  # (only one imported can have made an array)
    if numpy is not None and isinstance(value, numpy.ndarray):
        if value.size != 1:
            raise ValueError(
                f"self.log({name!r}, ...) needs a single number, got an array of shape "
                f"{value.shape}; reduce it first (e.g. .mean())"
            )
        value = value.item()  # (a python number: judged as one below)
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"self.log({name!r}, ...) needs a single number, got a tensor of shape "
                f"{tuple(value.shape)}; reduce it first (e.g. .mean())"
            )
        if value.is_complex():  # (its cast would keep the real part, with a mere warning)
            raise ValueError(
                f"self.log({name!r}, ...) needs {_ACCEPTED}, got a {value.dtype} tensor; "
                "log its .real, .imag or .abs()"
            )
        # sums are kept in float64 (float32 on MPS, which has no float64): a bfloat16 loss
        # summed in its own dtype drifts, each batch's loss rounded to the ever wider
        # bfloat16 steps of the growing sum
        wide = torch.float32 if value.device.type == "mps" else torch.float64
        return value.detach().reshape(()).to(wide)
    # (numpy's float and int scalars are numbers.Real; its bools, like bool, are refused)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = "; log its .real, .imag or abs()" if isinstance(value, numbers.Complex) else ""
        raise ValueError(
            f"self.log({name!r}, ...) needs {_ACCEPTED}, got {type(value).__name__}{hint}"
        )
    return torch.tensor(float(value), dtype=torch.float64)


def _weight(name: str, batch_size: Tensor) -> Tensor:
    """A tensor ``batch_size`` as a weight, widened as the sums are (a count summed in
    bfloat16 drifts)."""
    if batch_size.numel() != 1 or batch_size.is_complex():
        raise ValueError(
            f"self.log({name!r}, ..., batch_size=...) needs a count: an int or a one-element "
            f"real tensor, got a {batch_size.dtype} tensor of shape {tuple(batch_size.shape)}"
        )
    wide = torch.float32 if batch_size.device.type == "mps" else torch.float64
    return batch_size.detach().reshape(()).to(wide)


class MetricStore:
    """Accumulates logged values; `take_step` and `take_epoch` hand out their means.

    Training and evaluation keep separate sums (``training`` says which is running), so a
    validation inside a training epoch never takes the training epoch's values, nor the
    other way round. In an epoch-level hook (`epoch_hook`) every value is an epoch value.
    """

    def __init__(self) -> None:
        self.training = True
        self.prog_bar: set[str] = set()
        self._hook: str | None = None  # the epoch-level hook running now, if any
        self._refusing: str | None = None  # a hook running now in which nothing is logged
        self._step: dict[bool, _Sums] = {True: {}, False: {}}
        self._epoch: dict[bool, _Sums] = {True: {}, False: {}}
        self._synced: set[str] = set()
        # training step means handed out by `take_step(keep=True)`, by name, while nothing
        # more was logged under that name (handed out again without computing or syncing)
        self._shown: dict[str, Tensor] = {}
        # the size of the batch being stepped (`batch_size_of`, set by the loops): a value
        # logged in its step without a batch_size weighs it in the epoch's mean, as
        # Lightning infers it (a short last batch weighs less)
        self.batch_size: int | None = None

    @contextlib.contextmanager
    def epoch_hook(self, name: str) -> Iterator[None]:
        """While hook ``name`` (``on_train_epoch_end``...) runs, values are logged for the
        epoch (as in Lightning: ``on_step=True`` is refused there)."""
        self._hook = name
        try:
            yield
        finally:
            self._hook = None

    @contextlib.contextmanager
    def refusing(self, name: str) -> Iterator[None]:
        """While hook ``name`` (``on_train_end``, ``on_validation_end``...) runs, `log`
        raises: its values would land in a later run's row, or nowhere (Lightning refuses
        them too)."""
        self._refusing = name
        try:
            yield
        finally:
            self._refusing = None

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
        """Record ``value``; see `TrainingModule.log` for the meaning of the options."""
        if self._refusing is not None:
            where = (
                "on_train_epoch_end"
                if self._refusing == "on_train_end"
                else (self._refusing.replace("_end", "_epoch_end"))
            )
            raise ValueError(
                f"self.log({name!r}, ...) in {self._refusing}: its values were taken already "
                f"(they would land in a later row, or nowhere); log it in {where}"
            )
        if self._hook is not None:
            if on_step or on_epoch is False:
                raise ValueError(
                    f"self.log({name!r}, ...) in {self._hook} logs a value for the epoch: "
                    "on_step=True and on_epoch=False are not accepted there (leave them out)"
                )
            on_step, on_epoch = False, True
        on_step = self.training if on_step is None else on_step
        on_epoch = (not self.training) if on_epoch is None else on_epoch
        if not (on_step or on_epoch):
            raise ValueError(f"self.log({name!r}): on_step and on_epoch are both False")
        # (a tensor's sign is not read: that would copy it back at every call)
        if isinstance(batch_size, numbers.Real) and batch_size < 0:
            raise ValueError(
                f"self.log({name!r}, ..., batch_size={batch_size}): a batch size is the count "
                "of samples the value stands for, 0 or more (0: it weighs nothing in the mean)"
            )
        v = _scalar(name, value)
        both = on_step and on_epoch
        step_name = f"{name}_step" if both else name
        epoch_name = f"{name}_epoch" if both else name
        if on_step:
            self._add(self._step[self.training], step_name, v, 1)
            if self.training:
                self._shown.pop(step_name, None)
            if sync_dist:
                self._synced.add(step_name)
        if on_epoch:
            # an explicit 0 weighs nothing (a batch without valid tokens); inferred only
            # where none is given, as in Lightning
            if isinstance(batch_size, Tensor):
                weight = _weight(name, batch_size)
            elif batch_size is not None:
                weight = batch_size
            elif self._hook is None and self.batch_size is not None:
                weight = self.batch_size
            else:
                weight = 1
            self._add(self._epoch[self.training], epoch_name, v * weight, weight)
        if prog_bar:
            self.prog_bar.update({step_name, epoch_name} if both else {name})

    @staticmethod
    def _add(store: _Sums, name: str, value: Tensor, weight: float | Tensor) -> None:
        # sums are new tensors, never written into: a value or a batch_size tensor the
        # caller logged stays theirs, and names logged with the same one sum on their own
        slot = store.get(name)
        if slot is None:
            store[name] = [value.clone(), weight.clone() if isinstance(weight, Tensor) else weight]
        else:
            slot[0] = slot[0] + value.to(slot[0].device)
            slot[1] = slot[1] + weight

    def take_step(self, mean: Callable[[Tensor], Tensor], keep: bool = False) -> dict[str, Tensor]:
        """Means of the values logged (in training, or in evaluation) since the last call
        (``sync_dist`` ones averaged over processes by ``mean``), as tensors (reading them is
        left to whoever needs numbers), then forget them; with ``keep`` (training), keep
        them for the next call, which hands them out with what is logged meanwhile (a
        training step's values, shown before its batch's end hooks log more)."""
        out: dict[str, Tensor] = {}
        store = self._step[self.training]
        if not store:
            return out
        shown = self._shown if self.training else {}
        for name, (total, count) in store.items():
            value = shown.get(name)
            if value is None:
                value = total / count  # type: ignore[operator]
                value = mean(value) if name in self._synced else value
            out[name] = value
        if keep and self.training:
            self._shown = dict(out)
        else:
            store.clear()
            shown.clear()
        return out

    def training_step_values(self) -> dict[str, Tensor]:
        """The means of the training step values logged and not taken yet, as
        `take_step(keep=True)` last handed them out, else this process's own (no collective:
        for a checkpoint, which rank 0 may save alone)."""
        return {
            name: self._shown.get(name, total / count)  # type: ignore[operator]
            for name, (total, count) in self._step[True].items()
        }

    def take_epoch(
        self,
        mean: Callable[[Tensor], Tensor],
        union: Callable[[list[str]], list[str]] = sorted,
    ) -> dict[str, float]:
        """Weighted means of the epoch values (of training, or of evaluation), averaged over
        processes, then forget them. Under several processes the names are first agreed
        (`union`): a name a process did not log weighs nothing there, so each value is the
        mean over the processes that logged it."""
        store = self._epoch[self.training]
        names = union(list(store))
        if not names:
            return {}
        zero = (torch.zeros((), dtype=torch.float64), 0.0)
        totals = torch.stack([torch.as_tensor(store.get(n, zero)[0]).double().cpu() for n in names])
        weights = torch.tensor([float(store.get(n, zero)[1]) for n in names], dtype=torch.float64)
        # a ratio of means over processes is the ratio of sums: the weighted mean of all
        reduced = mean(torch.stack([totals, weights]))
        store.clear()
        # (values that all weighed nothing, batch_size=0: the mean of no samples is NaN, as
        # in Lightning, rather than a name that vanishes from what monitors read)
        return {
            n: float(t / w) if w > 0 else math.nan
            for n, t, w in zip(names, reduced[0], reduced[1], strict=True)
        }

    def training_epoch_sums(self) -> dict[str, list[Any]]:
        """The training epoch's sums so far (name -> [weighted sum, weight]), for a checkpoint."""
        return {
            name: [total.detach().cpu(), weight]
            for name, (total, weight) in self._epoch[True].items()
        }

    def load_training_epoch_sums(self, sums: dict[str, list[Any]], device: torch.device) -> None:
        """Go on from the sums `training_epoch_sums` returned (a resumed epoch)."""
        self._epoch[True] = {
            name: [total.to(device), weight] for name, (total, weight) in sums.items()
        }

    def clear(self) -> None:
        """Forget everything logged, and start in training again (between runs: one cut
        short inside an evaluation, by an error or Ctrl-C, may have left it evaluating)."""
        for store in (*self._step.values(), *self._epoch.values()):
            store.clear()
        self._synced.clear()
        self._shown.clear()
        self.prog_bar.clear()
        self.training, self.batch_size = True, None
        self._hook = self._refusing = None


def reset_peak_memory(device: torch.device) -> None:
    """Start a run's peak-memory figure afresh, so earlier work in the process (another fit,
    a model built on the GPU) does not count. CUDA only: a process's peak resident memory
    on the CPU cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@dataclass(frozen=True)
class MemoryReadout:
    """The tensor memory of a fit's optimizer step (the second: the first also allocates the
    states and what libraries set up once), in bytes, and the parts of it a user can act on:
    the peak of live tensors, the weights (parameters and buffers), the gradients (one per
    trainable parameter), the optimizer states (float32 masters included) and the rest,
    activations and temporaries."""

    peak: int
    weights: int
    gradients: int
    optimizer_states: int

    @property
    def activations(self) -> int:
        """What the peak holds beyond weights, gradients and states: activations saved for
        the backward and the temporaries of the forward, backward and step."""
        return max(0, self.peak - self.weights - self.gradients - self.optimizer_states)


def _bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of `tensors`, each storage once (tied weights, views)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _state_bytes(optimizers: Sequence[LossScaleOptimizer]) -> int:
    return sum(
        state_bytes(opt.optimizer) + _bytes(opt.master_params.values()) for opt in optimizers
    )


def held_bytes(model: nn.Module, optimizers: Sequence[LossScaleOptimizer]) -> int:
    """The tensor bytes a training step finds alive when it starts: weights, the gradients
    accumulated so far, the optimizer states."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return (
        _bytes([*model.parameters(), *model.buffers()]) + _bytes(grads) + _state_bytes(optimizers)
    )


def memory_readout(
    peak: int, model: nn.Module, optimizers: Sequence[LossScaleOptimizer]
) -> MemoryReadout:
    """`peak` (a step's, measured) with its parts as they are after that step."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return MemoryReadout(
        peak=peak,
        weights=_bytes([*model.parameters(), *model.buffers()]),
        gradients=sum(p.numel() * p.element_size() for p in trainable),
        optimizer_states=_state_bytes(optimizers),
    )


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f} MiB"


def memory_row(memory: MemoryReadout | None, device: torch.device) -> str:
    """The summary's memory row: the peak of tensor memory at an optimizer step and its
    parts (the bench's measure), then the process's peak, labelled: resident memory on
    a CPU (Python, torch, libraries, data), allocated on a CUDA device over the fit."""
    whole = peak_memory_mib(device)
    process = (
        f"{whole:,.0f} MiB allocated on the device over the fit"
        if device.type == "cuda"
        else f"{whole:,.0f} MiB resident (the whole process)"
    )
    if memory is None:
        return process
    return (
        f"{_mib(memory.peak)} of tensors at a step (weights {_mib(memory.weights)}, "
        f"gradients {_mib(memory.gradients)}, optimizer states "
        f"{_mib(memory.optimizer_states)}, activations and temporaries "
        f"{_mib(memory.activations)}); {process}"
    )


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process: allocated on a CUDA device, resident (RSS) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux (bytes on macOS): the process's peak resident memory
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if os.uname().sysname == "Darwin" else rss / 2**10


class _Sink(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def resume_at(self, step: int) -> None: ...


class _Where(Protocol):
    device: torch.device
    world_size: int

    @property
    def is_global_zero(self) -> bool: ...


class StepLog:
    """Rows of values sent to the loggers, and the latest number of every metric.

    A training step's row (`step_row`) stays a set of device tensors: every
    ``every_n_steps``-th is read back (one host copy for the whole row) and logged, as
    Lightning's ``log_every_n_steps``; the others only replace the latest row, which is read
    when someone asks for ``callback_metrics`` (`read`: a callback, a monitor, a checkpoint's
    file name, the epoch's end). Rows given with `add` (evaluation, epoch values, rows a
    callback logs) all reach the loggers, read back with the next flush. The throughput of
    training between two logged step rows (validation time left out) goes into the later.

    ``callback_metrics`` holds the latest number of every name read so far, without
    reading anything (what the progress bar shows); ``logged_metrics`` the same for what
    reached the loggers (rank 0 writes; every rank keeps the numbers).
    """

    def __init__(self, loggers: Sequence[_Sink], where: _Where, every_n_steps: int = 50) -> None:
        self.loggers = loggers
        self.where = where
        self.every_n_steps = every_n_steps
        self.callback_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, float] = {}
        self.pending: list[tuple[int, dict[str, Tensor | float]]] = []
        self.latest: dict[str, Tensor | float] | None = None  # the last step's row, unread
        self.samples = 0  # training samples since the last logged step row
        self.fit_samples = 0
        self.fit_seconds = 0.0
        self._seconds = 0.0  # training time since the last logged step row, spans closed
        self._since: float | None = None  # when the open span of training time began
        self.memory: MemoryReadout | None = None  # the last measured optimizer step's
        self.measured_steps = 0  # optimizer steps of this fit measured so far
        self.step_peak = 0  # tensor bytes at the peak so far of the step being measured
        # the rows handed to the loggers since the last training step's row, by step
        self.step_rows: dict[int, list[dict[str, float]]] = {}
        # the rows a validate or test call handed to the loggers (while `evaluating`) since
        # the last fit that was not a resume: no fit logs them again, so a resume that drops
        # the rows past its step hands them back (`replay`)
        self.evaluations: list[tuple[int, dict[str, float]]] = []
        self.evaluating = False
        # a resume's drop and the rows it hands back, done at the first row the resumed fit
        # hands the loggers (`replay`)
        self._resume: tuple[int, list[tuple[int, dict[str, float]]]] | None = None

    def start_timing(self) -> None:
        """Training time counts from now (an epoch's start, after a validation)."""
        self._since = time.perf_counter()

    def stop_timing(self) -> None:
        """Training time stops counting (before a validation, at an epoch's end)."""
        if self._since is not None:
            self._seconds += time.perf_counter() - self._since
            self._since = None

    def reset_run(self) -> None:
        """Forget the rows, the throughput and the metrics of the previous run (a monitor
        in this one ranks only what this one logged, or its checkpoint held)."""
        self.callback_metrics.clear()
        self.logged_metrics.clear()
        self.pending.clear()
        self.latest = None
        self.samples, self.fit_samples, self.fit_seconds, self._seconds = 0, 0, 0.0, 0.0
        self._since = None
        self.memory, self.measured_steps, self.step_peak = None, 0, 0
        self.step_rows = {}
        self.evaluating, self._resume = False, None

    def step_row(self, step: int, row: dict[str, Tensor | float], force: bool = False) -> None:
        """The row of training step ``step``: logged now, with the throughput since the last
        logged row, if ``step`` is a multiple of ``every_n_steps`` or ``force``; else kept
        unread as the latest values."""
        if self.step_rows and (len(self.step_rows) > 1 or step not in self.step_rows):
            # (the rows of earlier steps are not kept)
            self.step_rows = {step: self.step_rows[step]} if step in self.step_rows else {}
        if step % self.every_n_steps and not force:
            self.latest = row
            return
        self.latest = None
        if self.samples:
            now = time.perf_counter()
            seconds = self._training_seconds(now)
            row.update(self.timing(now))
            self.fit_samples += self.samples
            self.fit_seconds += seconds
            self.samples, self._seconds = 0, 0.0
            if self._since is not None:
                self._since = now
        self.pending.append((step, row))
        self.flush()

    def _training_seconds(self, now: float) -> float:
        """Training time since the last logged step row (at least a nanosecond)."""
        seconds = self._seconds + (now - self._since if self._since is not None else 0.0)
        return max(seconds, 1e-9)

    def timing(self, now: float | None = None) -> dict[str, float]:
        """The throughput columns a step row logged now gets (`step_row`): samples per second
        since the last logged row and the peak memory; none without samples."""
        if not self.samples:
            return {}
        seconds = self._training_seconds(time.perf_counter() if now is None else now)
        return {
            "samples_per_sec": self.samples * self.where.world_size / seconds,
            "peak_memory_mib": peak_memory_mib(self.where.device),
        }

    def add(self, step: int, row: dict[str, Tensor | float], flush: bool = False) -> None:
        """Queue ``row`` for ``step`` for the loggers; read back now if asked, else with the
        next flush (at the latest ``every_n_steps`` rows later). An empty row is no row (a
        validation that logged nothing)."""
        if row:
            self.pending.append((step, row))
        if flush or len(self.pending) >= self.every_n_steps:
            self.flush()

    def show(self, row: dict[str, Tensor | float]) -> dict[str, float]:
        """``row`` read back and shown (``callback_metrics``, ``logged_metrics``) before it
        is handed to the loggers: an evaluation batch's values, which its batch-end hook
        reads and may add to before the row goes out (`add`)."""
        numbers = _read_back([row])[0]
        self.callback_metrics.update(numbers)
        self.logged_metrics.update(numbers)
        return numbers

    def flush(self) -> None:
        """Read back the queued rows and the latest step row, all values on a device in one
        copy, and hand the queued rows to the loggers."""
        rows = [row for _, row in self.pending]
        if self.latest is not None:
            rows.append(self.latest)
        if not rows:
            return
        numbers = _read_back(rows)
        latest = numbers.pop() if self.latest is not None else None
        pending, self.pending, self.latest = self.pending, [], None
        for (step, _), values in zip(pending, numbers, strict=True):
            self.callback_metrics.update(values)
            self._hand(step, values)
        if latest is not None:
            self.callback_metrics.update(latest)

    def rows_at(self, step: int) -> list[dict[str, float]]:
        """The rows handed to the loggers at training step ``step`` so far (a checkpoint
        keeps them: see `replay`)."""
        self.flush()
        return list(self.step_rows.get(step, []))

    def replay(self, step: int, rows: list[dict[str, float]]) -> None:
        """A fit resumes from a save at ``step``. A killed run may have logged rows at
        ``step`` after the save, most of which the resumed run logs again (a validation later
        in an accumulation window, an epoch's end run again). The loggers that drop what
        they held past a resumed step (``drops_resumed_rows``) drop their rows from ``step``
        on and are handed again the checkpoint's ``rows`` (those logged before the save, and
        after it those the resumed run does not log), then the rows of validate and test
        calls of this process there (`evaluations`: no fit logs them again), so that each
        row is held once; the others resume at ``step``. (Those rows stay out of the step's
        rows a later save holds: this process hands them back at each resume.) All that is
        done at the first row the resumed fit hands the loggers: one that logs nothing
        (nothing left to train) leaves the logs as they are."""
        kept = [(s, values) for s, values in self.evaluations if s >= step]
        for values in rows:
            self.logged_metrics.update(values)
            self.step_rows.setdefault(step, []).append(values)
        self._resume = (step, [(step, values) for values in rows] + kept)

    def forget_evaluations(self) -> None:
        """A fit that is no resume starts: its log owes nothing to the evaluations before."""
        self.evaluations = []

    def _resume_loggers(self) -> None:
        """The drop `replay` put off, and the rows it hands back, before the resumed fit's
        first row."""
        (step, rows), self._resume = self._resume or (0, []), None
        dropping = [lg for lg in self.loggers if getattr(lg, "drops_resumed_rows", False)]
        for lg in self.loggers:
            lg.resume_at(step - 1 if lg in dropping else step)
        if self.where.is_global_zero:
            for at, values in rows:
                for lg in dropping:
                    lg.log_metrics(values, at)

    def _hand(self, step: int, values: dict[str, float]) -> None:
        """Give a row read back to the loggers (rank 0's), noting it as logged."""
        self.logged_metrics.update(values)
        if self.loggers:
            if self._resume is not None:
                self._resume_loggers()
            self.step_rows.setdefault(step, []).append(values)
            if self.evaluating:
                self.evaluations.append((step, values))
            if self.where.is_global_zero:
                for lg in self.loggers:
                    lg.log_metrics(values, step)

    def read(self) -> dict[str, float]:
        """``callback_metrics``, the queued rows and the latest step row read back first
        (what callbacks and plateau schedulers monitor)."""
        self.flush()
        return self.callback_metrics

    def throughput(self) -> float | None:
        """Samples per second over all processes during the last fit (None before any)."""
        samples, seconds = self.fit_samples + self.samples, self.fit_seconds + self._seconds
        if seconds <= 0:
            return None
        return samples * self.where.world_size / seconds


def _read_back(rows: list[dict[str, Tensor | float]]) -> list[dict[str, float]]:
    """``rows`` as numbers: the tensors of each device stacked and copied to the host at
    once (one synchronization per device, not one per value)."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for row in rows:
        for value in row.values():
            if isinstance(value, Tensor):
                by_device.setdefault(value.device, []).append(value)
    read: dict[int, float] = {}
    for device, tensors in by_device.items():
        wide = torch.float32 if device.type == "mps" else torch.float64
        values = torch.stack([t.detach().reshape(()).to(wide) for t in tensors]).tolist()
        read.update(zip(map(id, tensors), values, strict=True))
    return [
        {k: read[id(v)] if isinstance(v, Tensor) else float(v) for k, v in row.items()}
        for row in rows
    ]


_PROGRESS_LABELS = {
    "loss": "loss",
    "loss_scale": "loss scale",
    "skipped_steps": "skipped",
    "lr": "lr",
    "samples_per_sec": "samples/s",
}


def shown_in_progress(metrics: dict[str, float], prog_bar: set[str]) -> dict[str, float]:
    """What the progress bar shows: loss, loss scale, skipped steps, lr, samples/s (under
    their labels), then the values logged with ``prog_bar=True``."""
    out = {label: metrics[name] for name, label in _PROGRESS_LABELS.items() if name in metrics}
    out.update({name: metrics[name] for name in sorted(prog_bar) if name in metrics})
    return out


_NOT_IN_SUMMARY = ("lr", "loss_scale", "skipped_steps", "samples_per_sec", "peak_memory_mib")


def summary_rows(
    head: dict[str, str],
    scaler_stats: Any,
    throughput: float | None,
    memory: str,
    metrics: dict[str, float],
    checkpoint: str,
) -> dict[str, str]:
    """The one-screen account of a fit: ``head`` (precision, device, progress), then the
    loss scale, throughput, peak memory (`memory_row`), the last value of each metric, the
    best checkpoint."""
    rows = dict(head)
    if scaler_stats is not None:
        rows["loss scale"] = f"{scaler_stats.scale:g} ({scaler_stats.skipped_steps} skipped steps)"
    if throughput is not None:
        rows["throughput"] = f"{throughput:,.1f} samples/s"
    rows["peak memory"] = memory
    for name in sorted(metrics):
        if name not in _NOT_IN_SUMMARY:
            rows[name] = f"{metrics[name]:.6g}"
    if checkpoint:
        rows["checkpoint"] = checkpoint
    return rows
