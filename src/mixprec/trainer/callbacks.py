"""Callbacks: code that runs at fixed points of the Trainer's loops.

The hooks, in the order one epoch calls them::

    on_fit_start
    on_train_start
      on_train_epoch_start
        on_train_batch_start
          (forward, backward for each micro-batch; at the end of an accumulation window:)
          on_before_optimizer_step      gradients unscaled, not yet clipped
        [validation when due: on_validation_start, on_validation_batch_end..., on_validation_end]
        on_train_batch_end              after that batch's validation, if one was due
        [data of unknown length at its end: the step of a shorter last window, validation]
      on_train_epoch_end                epoch schedulers without a monitor stepped, then
                                        the module's hook, the training epoch's metrics
                                        logged, schedulers with a monitor stepped, then the
                                        callbacks' hook
      on_train_end                      training stopped (at an epoch's end, or inside one)
    on_fit_end

The validation at the end of an epoch is the one after its last batch. A stop (early
stopping, ``trainer.should_stop``) takes effect at the end of an accumulation window; a fit
stopped inside an epoch (by it or ``max_steps``) leaves the epoch unfinished: no
``on_train_epoch_end``, and its checkpoints resume inside the epoch.

A `TrainingModule` may define these hooks too (all but ``on_exception``, without the trainer
and model arguments, as in Lightning), and ``on_validation_epoch_start/_end``,
``on_test_epoch_start/_end``; its own run before the callbacks'. Here too: `ModelCheckpoint`,
`EarlyStopping`, `RunEstimate` (how long a long run will take).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
import shutil
import statistics
import string
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.trainer.interrupt import ctrl_c_deferred

if TYPE_CHECKING:
    from mixprec.trainer.trainer import Trainer

__all__ = [
    "Callback",
    "EarlyStopping",
    "RUN_STATE",
    "ModelCheckpoint",
    "RunEstimate",
]

log = logging.getLogger("mixprec")

# the run state of rank r in a sharded checkpoint (a directory: `mixprec.trainer.sharded`)
RUN_STATE = "trainer-rank{}.pt"


class Callback:
    """Base class: override the hooks you need; each receives the trainer and the model."""

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint (unique among the run's callbacks)."""
        return type(self).__qualname__

    def on_fit_start(self, trainer: Trainer, model: nn.Module) -> None:
        """Training is about to start (model set up, checkpoint restored if any)."""

    def on_fit_end(self, trainer: Trainer, model: nn.Module) -> None:
        """Training finished (also after an early stop)."""

    def on_train_start(self, trainer: Trainer, model: nn.Module) -> None:
        """Training is about to start its first (or resumed) epoch."""

    def on_train_epoch_start(self, trainer: Trainer, model: nn.Module) -> None:
        """A training epoch starts."""

    def on_train_epoch_end(self, trainer: Trainer, model: nn.Module) -> None:
        """A training epoch ended, its validation and epoch-interval schedulers done and its
        training metrics (``on_epoch=True``) in ``trainer.callback_metrics``."""

    def on_train_end(self, trainer: Trainer, model: nn.Module) -> None:
        """Training stopped, at an epoch's end or (``max_steps``, a stop request) inside one,
        where ``trainer.batches_done`` is then the epoch's batches done."""

    def on_train_batch_start(
        self, trainer: Trainer, model: nn.Module, batch: Any, batch_idx: int
    ) -> None:
        """A training batch is about to go through the model."""

    def on_train_batch_end(
        self, trainer: Trainer, model: nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """A training batch is done (``outputs`` is what training_step returned)."""

    def on_before_optimizer_step(self, trainer: Trainer, model: nn.Module, optimizer: Any) -> None:
        """Gradients are accumulated and unscaled, not clipped yet; the step comes next."""

    def on_validation_start(self, trainer: Trainer, model: nn.Module) -> None:
        """A validation pass starts."""

    def on_validation_batch_end(
        self, trainer: Trainer, model: nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """A validation batch is done."""

    def on_validation_end(self, trainer: Trainer, model: nn.Module) -> None:
        """A validation pass ended; its epoch metrics are in ``trainer.callback_metrics``."""

    def on_test_start(self, trainer: Trainer, model: nn.Module) -> None:
        """A test pass starts."""

    def on_test_batch_end(
        self, trainer: Trainer, model: nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """A test batch is done."""

    def on_test_end(self, trainer: Trainer, model: nn.Module) -> None:
        """A test pass ended."""

    def on_exception(self, trainer: Trainer, model: nn.Module, exception: BaseException) -> None:
        """The run is failing with ``exception`` (re-raised after the callbacks ran)."""

    def state_dict(self) -> dict[str, Any]:
        """What to keep in a checkpoint to resume this callback."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""


HOOKS = frozenset(name for name in vars(Callback) if name.startswith("on_"))


def check_callback(obj: Any) -> None:
    """Refuse what the Trainer cannot call back. It takes a `Callback`, or any object whose
    ``on_*`` methods are all Callback hooks (at least one), such as the doctor's
    `PrecisionMonitor`, which does not import the Trainer; it calls the hooks an object has
    and keeps the state of those that have one (`keeps_state`). A `Callback` defining
    ``on_*`` methods that are no hooks of this Trainer (Lightning's ``on_after_backward``...)
    is warned: their code would never run."""
    kind = type(obj)
    hooks = {n for n in dir(kind) if n.startswith("on_") and callable(getattr(kind, n))}
    if isinstance(obj, Callback):
        if hooks - HOOKS:
            warnings.warn(
                f"{kind.__qualname__} defines methods this Trainer never calls, so their code "
                f"will not run: {', '.join(sorted(hooks - HOOKS))} (the hooks: "
                f"{', '.join(sorted(HOOKS))})",
                stacklevel=4,
            )
        return
    if not hooks or hooks - HOOKS:
        name = kind.__qualname__
        name = name if kind.__module__ == "builtins" else f"{kind.__module__}.{name}"
        wrong = f"whose {', '.join(sorted(hooks - HOOKS))} are not" if hooks else "which has none"
        raise ValueError(
            "callbacks must be Callback instances or objects whose on_* methods are all "
            f"Callback hooks, got {name}, {wrong} (the hooks: {', '.join(sorted(HOOKS))})"
        )


def listens(cb: Any, name: str) -> bool:
    """Whether `cb` has hook `name` of its own (the Trainer calls only those)."""
    base = getattr(Callback, name)
    return getattr(type(cb), name, base) is not base


def keeps_state(cb: Any) -> bool:
    """Whether a checkpoint keeps `cb`'s state: a Callback with its own `state_dict`, or
    another hook object with both ``state_dict`` and ``load_state_dict`` (the doctor's
    `PrecisionMonitor`)."""
    if isinstance(cb, Callback):
        return type(cb).state_dict is not Callback.state_dict
    return callable(getattr(cb, "state_dict", None)) and callable(
        getattr(cb, "load_state_dict", None)
    )


def state_key(cb: Any) -> str:
    """Where a checkpoint keeps `cb`'s state: its `Callback.state_key`, or for another hook
    object its own ``state_key`` if it has one, else its class name."""
    return getattr(cb, "state_key", None) or type(cb).__qualname__


_MODES = ("min", "max")


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")


def _monitored(trainer: Trainer, monitor: str, who: str) -> float:
    """The value of ``monitor``, averaged over the processes (every callback hook runs on
    every rank): a value logged without ``sync_dist`` is each rank's own, and decisions taken
    on it (a stop, a checkpoint ranked, a collective sharded save) must agree. A KeyError on
    every rank where no rank logged it."""
    value = agreed(trainer.strategy, trainer.callback_metrics.get(monitor))
    if value is None:
        shown = ", ".join(sorted(trainer.callback_metrics)) or "none yet"
        raise KeyError(
            f"{who} monitors {monitor!r}, which was not logged; logged metrics: {shown}. "
            "Log it with self.log(...) in training_step/validation_step, or fix the name"
        )
    return value


def agreed(strategy: Any, value: float | None) -> float | None:
    """``value`` averaged over the processes of ``strategy`` that have one (None: a process
    that did not log it), None where none has: every rank gets the same answer, and takes
    the same branch after it (a rank branching alone would leave the others waiting)."""
    if strategy.world_size == 1:
        return value
    here = torch.tensor([0.0 if value is None else float(value), float(value is not None)])
    total, count = (strategy.mean(here.double()) * strategy.world_size).tolist()
    return None if count == 0 else total / count


# the folder of a checkpoint directory that takes the checkpoints a resumed fit supersedes
SUPERSEDED = "superseded"


def _free_name(path: Path) -> Path:
    """``path``, or with ``-1``, ``-2``... before its suffix where that name is taken."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


class ModelCheckpoint(Callback):
    """Save checkpoints: every epoch (or every N optimizer steps), the best ``save_top_k`` by
    a monitored metric, and optionally ``last.ckpt``; and once more when a fit stops inside
    an epoch (``max_steps``, early stopping), unless it just saved that step.

    A ``monitor`` not logged yet in this fit (``val_loss`` before the first validation) gets
    one warning, and those saves rank nothing (only ``last.ckpt`` is written); once a
    validation has run without it, a save raises ``KeyError``.

    A Ctrl-C during a save is held back until the save is complete: the new file written,
    ``last.ckpt`` pointing at it, the checkpoints beyond ``save_top_k`` removed; then the
    ``KeyboardInterrupt`` comes (a second Ctrl-C interrupts at once).

    Args:
        dirpath: directory for the files (default: ``<run dir>/checkpoints``); with
            ``monitor``, resolved, it keys the state a checkpoint keeps (`state_key`).
        filename: a ``str.format`` template over ``epoch``, ``step`` and logged metrics,
            e.g. ``"{epoch}-{val_loss:.3f}"`` (default ``"epoch={epoch}-step={step}"``); a
            metric not logged yet is ``nan`` there (warned once a fit).
        monitor: metric deciding which checkpoints are best; None keeps the latest ones.
        mode: ``"min"`` or ``"max"``: whether a lower or a higher ``monitor`` is better.
        save_top_k: how many checkpoints to keep (-1: all, 0: none but ``last.ckpt``).
        save_last: also keep ``last.ckpt``, always the most recent save.
        every_n_epochs: save at the end of every N-th epoch.
        every_n_train_steps: save every N optimizer steps instead of at epoch ends.
    """

    _default_dir = False  # dirpath is the run directory's, taken at each fit's start

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool = False,
        every_n_epochs: int = 1,
        every_n_train_steps: int | None = None,
    ) -> None:
        _check_mode(mode)
        if save_top_k < -1:
            raise ValueError(f"save_top_k must be -1 (keep all), 0 or more, got {save_top_k}")
        if every_n_epochs < 1 or (every_n_train_steps is not None and every_n_train_steps < 1):
            raise ValueError("every_n_epochs and every_n_train_steps must be positive")
        if save_last and save_top_k != 0 and filename is not None and _names_last(filename):
            raise ValueError(_LAST_NAME_TAKEN.format(filename=filename))
        self.dirpath = Path(dirpath) if dirpath is not None else None
        # from the arguments, not from the run directory chosen later: the key must be the
        # same when a resumed run restores the state (before on_fit_start); the directory
        # resolved, so that "ck", "ck/" and its absolute path are one key
        self._resolved = self.dirpath.resolve() if self.dirpath is not None else None
        self._key = _KEY.format(monitor=monitor, dirpath=self._resolved)
        self.filename = filename or "epoch={epoch}-step={step}"
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.every_n_epochs = every_n_epochs
        self.every_n_train_steps = every_n_train_steps
        self.best_k_models: dict[str, float] = {}
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        self._saved: list[str] = []
        self._restored_from: Path | None = None  # the directory a restored state describes
        self._step_saved = -1  # the step last saved, or the one this fit started from
        self._validated = False  # a validation ran in this fit
        self._validated_at: int | None = None  # the step whose weights it last measured
        self._restored_validation: int | None = None  # that step, as a loaded state gave it
        self._loaded = False  # a state was loaded for the fit about to start (a resume)
        self._warned = False  # about a monitor not logged yet
        self._unfilled: set[str] = set()  # filename fields warned as not logged yet

    @property
    def state_key(self) -> str:
        return self._key

    def _own_key(self, keys: list[str]) -> str | None:
        """Which of a checkpoint's state ``keys`` is this callback's: its own, or one of the
        same monitor whose directory resolves to this one's here (a key written before keys
        were resolved: "ck/", or "ck" where this one is absolute)."""
        if self._key in keys:
            return self._key
        for key in keys:
            parts = _key_parts(key)
            if parts is None or parts[0] != f"{self.monitor}":
                continue
            if _resolves_to(parts[1], self._resolved):
                return key
        return None

    def on_fit_start(self, trainer: Trainer, model: nn.Module) -> None:
        if self.dirpath is None or self._default_dir:  # (a new fit's run directory is new)
            self.dirpath = trainer.run_dir / "checkpoints"
            self._default_dir = True
        restored = self._restored_from
        if restored is not None and restored.resolve() != self.dirpath.resolve():
            # the files a resumed run recorded belong to that run: never rank or delete them
            log.info(
                "ModelCheckpoint: resumed from a run that saved into %s; this run saves into "
                "%s and leaves the earlier files alone (best so far: %s)",
                self._restored_from,
                self.dirpath,
                self.best_model_path or "none",
            )
            self.best_k_models, self._saved, self.last_model_path = {}, [], ""
        elif self._restored_from is not None:
            self._remove_unrecorded(trainer)
        elif not self._loaded:
            # a new fit (a Trainer's second, or one resumed from a checkpoint without this
            # state): the files an earlier fit ranked are its own; never rank or delete them
            self.best_k_models, self._saved, self.last_model_path = {}, [], ""
            self.best_model_path, self.best_model_score = "", None
        self._restored_from = None
        self._step_saved = trainer.global_step  # a resumed state needs no new save
        self._validated = self._warned = False
        self._unfilled = set()
        self._validated_at = self._restored_validation if self._loaded else None
        self._restored_validation, self._loaded = None, False

    def on_validation_end(self, trainer: Trainer, model: nn.Module) -> None:
        if trainer.stage == "fit":
            self._validated = True
            self._validated_at = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, model: nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = self.every_n_train_steps
        if n is not None and trainer.stepped_this_batch and trainer.global_step % n == 0:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: Trainer, model: nn.Module) -> None:
        n = self.every_n_train_steps
        if n is None:
            due = (trainer.current_epoch + 1) % self.every_n_epochs == 0
        else:  # a due step taken after the last batch (data of unknown length)
            due = trainer.global_step % n == 0 and trainer.global_step != self._step_saved
        if due:
            self._save(trainer)

    def on_train_end(self, trainer: Trainer, model: nn.Module) -> None:
        # stopped inside an epoch: its end, and the save there, never come. With a monitor
        # ranked only when a validation measured these weights (an early stop right after
        # it); else only last.ckpt is written, for a resume: the last validation's value
        # belongs to weights steps older
        if trainer.global_step == self._step_saved:
            return
        if trainer.batches_done:
            # (no validation in this fit: the monitor is a training value of this step)
            measured = self._validated_at in (None, trainer.global_step)
            self._save(trainer, ranked=self.monitor is None or measured)
        elif self.save_last:  # (an epoch's end off the every_n_train_steps schedule)
            self._save(trainer, ranked=False)

    def _directory(self) -> Path:
        if self.dirpath is None:
            raise RuntimeError(
                "ModelCheckpoint saves during Trainer.fit only (its directory is chosen when "
                "the fit starts)"
            )
        return self.dirpath

    def _path_for(self, trainer: Trainer) -> Path:
        directory = self._directory()
        metrics = trainer.callback_metrics
        # (a name with "/" fills its field as written and with "_" for it)
        fields: dict[str, Any] = {k.replace("/", "_"): v for k, v in metrics.items()}
        fields.update(metrics)
        fields.update(epoch=trainer.current_epoch, step=trainer.global_step)
        # a metric not logged yet (val_loss at a step save before the first validation) is
        # NaN, warned once a fit: a save that dies on its name would end the fit there
        for field in _template_fields(self.filename):
            if field in fields:
                continue
            fields[field] = _Unlogged()
            if field not in self._unfilled and trainer.is_global_zero:
                warnings.warn(
                    f"ModelCheckpoint filename {self.filename!r}: {field!r} is not logged "
                    f"(logged: {', '.join(sorted(trainer.callback_metrics)) or 'nothing'}); "
                    "filled with nan until it is: a validation metric before the first "
                    "validation, or a name misspelled",
                    stacklevel=2,
                )
            self._unfilled.add(field)
        try:
            name = self.filename.format(**fields)
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"ModelCheckpoint filename {self.filename!r} cannot be filled: {err}; "
                f"available fields: {', '.join(sorted(fields))}"
            ) from None
        if self.save_last and _names_last(name):  # (a template filled as "last")
            raise ValueError(_LAST_NAME_TAKEN.format(filename=self.filename))
        path = directory / f"{name}.ckpt"
        version = 1
        while str(path) in self._saved or (path.exists() and str(path) not in self.best_k_models):
            path = directory / f"{name}-v{version}.ckpt"
            version += 1
        # rank 0's name on every rank: a value each logged for itself (without sync_dist)
        # fills the template otherwise on each, and every rank records the file (the best,
        # the top k) or writes its shards into it (a sharded save)
        return trainer.strategy.broadcast(path)

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _score(self, trainer: Trainer, monitor: str) -> float | None:
        """The value of ``monitor``; None (warned once) while it was never logged in this
        fit and no validation ran."""
        metrics = trainer.callback_metrics
        value = agreed(trainer.strategy, metrics.get(monitor))  # (on every rank: a collective)
        if value is None and not self._validated:
            if not self._warned and trainer.is_global_zero:
                warnings.warn(
                    f"ModelCheckpoint monitors {monitor!r}, which was not logged yet in "
                    f"this fit (logged: {', '.join(sorted(metrics)) or 'nothing'}); until it "
                    "is, checkpoints are not ranked and only last.ckpt is written (with "
                    "save_last=True). Once a validation has run without it, saving raises",
                    stacklevel=2,
                )
            self._warned = True
            return None
        score = value if value is not None else _monitored(trainer, monitor, "ModelCheckpoint")
        if math.isnan(score):
            score = math.inf if self.mode == "min" else -math.inf
        return score

    def _save(self, trainer: Trainer, ranked: bool = True) -> None:
        # A Ctrl-C waits until the new file is written, last.ckpt points at it and the
        # checkpoints it displaced are gone: interrupted after the write alone, the directory
        # would keep a file no record names (beyond save_top_k) and a last.ckpt a step behind
        with ctrl_c_deferred():
            self._write(trainer, ranked)

    def _write(self, trainer: Trainer, ranked: bool = True) -> None:
        """Save this step: a top-k file when `ranked` and its score (or, unmonitored, its
        recency) earns one, and last.ckpt with ``save_last``."""
        score = self._score(trainer, self.monitor) if self.monitor is not None and ranked else None
        keep = 0 if (self.monitor is not None and score is None) or not ranked else self.save_top_k
        worst = None
        if keep != 0 and score is not None and 0 < keep <= len(self.best_k_models):
            worst = max(
                self.best_k_models,
                key=lambda p: (
                    self.best_k_models[p] if self.mode == "min" else -self.best_k_models[p]
                ),
            )
            if not self._better(score, self.best_k_models[worst]):
                keep = 0  # not among the best: only last.ckpt, if asked
        # the bookkeeping first, so that the checkpoint written holds it (it is the best one,
        # the last one...); files are removed only once the new one is safely written, and a
        # write that fails (a full disk) puts the records back: none names a file never made
        before = (
            list(self._saved),
            dict(self.best_k_models),
            self.best_model_path,
            self.best_model_score,
            self.last_model_path,
        )
        path: Path | None = None
        stale: list[str] = []
        if keep != 0:
            path = self._path_for(trainer)
            self._saved.append(str(path))
            if score is not None:
                self.best_k_models[str(path)] = score
                if worst is not None:
                    stale.append(worst)
                    del self.best_k_models[worst]
                best = min if self.mode == "min" else max
                self.best_model_path = best(self.best_k_models, key=self.best_k_models.__getitem__)
                self.best_model_score = self.best_k_models[self.best_model_path]
            else:
                self.best_model_path = str(path)
                while keep > 0 and len(self._saved) > keep:
                    stale.append(self._saved[0])
                    self._saved.pop(0)
        last = self._directory() / "last.ckpt"
        if self.save_last:
            self.last_model_path = str(last)
        target = path if path is not None else last if self.save_last else None
        try:
            if target is not None:
                trainer.save_checkpoint(target, every_rank=True)
        except BaseException:
            (
                self._saved,
                self.best_k_models,
                self.best_model_path,
                self.best_model_score,
                self.last_model_path,
            ) = before
            raise
        if path is not None and self.save_last:
            trainer.link_checkpoint(path, last)
        if target is not None:
            self._step_saved = trainer.global_step
        for old in stale:
            self._remove(trainer, old)

    def _remove_unrecorded(self, trainer: Trainer) -> None:
        """Settle this directory for a resumed fit. A checkpoint written after the one this
        fit resumes from, at the step it resumes from, whose record of this callback names
        it, is this callback's own save of that step (another ModelCheckpoint's file, such as
        ``last.ckpt``'s, was written first and holds this callback's record from before it):
        its record is taken. Then the checkpoints written later, at later steps, that the
        record does not name are moved into ``SUPERSEDED`` (never deleted: a run resumed
        from an earlier checkpoint on purpose, or a process killed between a save's file and
        its record, left them). They hold steps this fit takes again; left in place,
        ``save_top_k`` would never remove them and their names would push new saves to
        ``-v1``. Another callback's file of the resumed step is left alone."""
        resumed = trainer.ckpt_path
        if resumed is None or not Path(resumed).exists() or self.dirpath is None:
            return
        since, step = Path(resumed).stat().st_mtime, trainer.global_step
        newer = sorted(
            (
                entry
                for entry in self.dirpath.glob("*.ckpt")
                if entry.name != "last.ckpt"
                and not _same_file(entry, Path(resumed))
                and entry.stat().st_mtime > since
            ),
            key=lambda entry: entry.stat().st_mtime,
        )
        saved = {entry: _saved_at(entry) for entry in newer}
        for entry, found in saved.items():
            if found is not None and found[0] <= step:
                key = self._own_key(list(found[1]))
                state = found[1][key] if key is not None else None
                names = [*state["saved"], *state["best_k_models"]] if state else []
                if entry.resolve() in {Path(name).resolve() for name in names}:
                    self.load_state_dict(state)  # (the latest such save's, last)
        recorded = {str(Path(p).resolve()) for p in [*self._saved, *self.best_k_models] if p}
        unknown = [
            entry
            for entry in newer
            if str(entry.resolve()) not in recorded
            and (saved[entry] is None or saved[entry][0] > step)
        ]
        if not unknown or not trainer.is_global_zero:
            return
        aside = self.dirpath / SUPERSEDED
        warnings.warn(
            f"ModelCheckpoint: moving {', '.join(e.name for e in unknown)} from "
            f"{self.dirpath} to {aside}: written after the checkpoint this fit resumes from, "
            "which does not record them (a run resumed from an earlier checkpoint, or killed "
            "mid-save); this fit takes those steps again",
            stacklevel=2,
        )
        aside.mkdir(exist_ok=True)
        for entry in unknown:
            os.replace(entry, _free_name(aside / entry.name))

    def _remove(self, trainer: Trainer, path: str) -> None:
        if path in self._saved:
            self._saved.remove(path)
        target = Path(path)
        # never the checkpoint this fit resumed from, nor a file outside this callback's
        # directory (another run's); one in a sub-directory of it (filename="run/{epoch}")
        # is this callback's
        resumed = trainer.ckpt_path is not None and _same_file(target, trainer.ckpt_path)
        if resumed or self.dirpath is None or not _inside(target, self.dirpath):
            return
        if not trainer.is_global_zero:
            return
        if target.is_dir():  # sharded: renamed out of sight first, never left half-deleted
            aside = target.with_name(f".{target.name}.{os.getpid()}.removed")
            os.replace(target, aside)
            shutil.rmtree(aside)
        else:
            target.unlink(missing_ok=True)
        _remove_empty_parents(target, self.dirpath)

    def state_dict(self) -> dict[str, Any]:
        return {
            "best_k_models": dict(self.best_k_models),
            "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score,
            "last_model_path": self.last_model_path,
            "saved": list(self._saved),
            # resolved: a fit resumed in another working directory tells it from its own
            "dirpath": str(self.dirpath.resolve()) if self.dirpath is not None else None,
            "validated_at": self._validated_at,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_k_models = dict(state["best_k_models"])
        self.best_model_path = state["best_model_path"]
        self.best_model_score = state["best_model_score"]
        self.last_model_path = state["last_model_path"]
        self._saved = list(state["saved"])
        recorded = [*self._saved, *self.best_k_models, self.best_model_path]
        known = state.get("dirpath") or next((str(Path(p).parent) for p in recorded if p), None)
        self._restored_from = Path(known) if known else None
        # (the step a validation last measured: a resumed fit's monitor value is that one's;
        # a state saved before it was kept measured none that can be told: -1, no step)
        self._restored_validation = state.get("validated_at", -1)
        self._loaded = True


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


class RunEstimate(Callback):
    """Says once a fit, a few batches in, how long its training will take: the median time
    of `batches` training batches after the first (which pays for warm-up and compilation),
    times the batches left to ``max_steps`` / ``max_epochs``. Validation and checkpoints are
    not counted. Rank 0 writes the line to stderr, or hands it to `log`.

    A run in a precision slow on the machine (``--allow-slow``) or simply bigger than it
    looked announces its hours at the start, not after them.
    """

    def __init__(self, batches: int = 2, log: Callable[[str], None] | None = None) -> None:
        if not (isinstance(batches, int) and batches >= 1):
            raise ValueError(f"batches must be an int >= 1, got {batches!r}")
        self.batches = batches
        self.log = log
        self.message: str | None = None
        self._times: list[float] = []
        self._start = 0

    def on_train_start(self, trainer: Trainer, model: nn.Module) -> None:
        # each fit gets its own estimate (a Trainer's next fit may be a longer one)
        self._times, self.message = [], None
        self._start = trainer.global_step * trainer.accumulate_grad_batches  # a resumed fit

    def on_train_batch_end(
        self, trainer: Trainer, model: nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.message is not None or len(self._times) > self.batches:
            return
        self._times.append(time.perf_counter())
        if len(self._times) <= self.batches:
            return
        per_batch = statistics.median(b - a for a, b in itertools.pairwise(self._times))
        left = self._batches_left(trainer, self._start + len(self._times))
        if left is None:
            total = "the data has no length: the total is unknown"
        else:
            total = f"{left:,} batches to go: about {_duration(per_batch * left)}"
        self.message = (
            f"estimate: {per_batch:.3g} s a training batch here (median of {self.batches} "
            f"after the first); {total}, validation not included"
        )
        if trainer.is_global_zero:
            if self.log is not None:
                self.log(self.message)
            else:
                print(self.message, file=sys.stderr, flush=True)

    @staticmethod
    def _batches_left(trainer: Trainer, done: int) -> int | None:
        acc = trainer.accumulate_grad_batches
        per_epoch = trainer.num_training_batches
        limits = []
        if trainer.max_steps is not None:
            limits.append(trainer.max_steps * acc)
        if trainer.max_epochs is not None and per_epoch is not None:
            limits.append(trainer.max_epochs * per_epoch)
        if not limits:
            return None
        return max(0, min(limits) - done)


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved by ``min_delta`` for ``patience``
    validation passes in a row, or as soon as it is inf/NaN (``check_finite``). A fit without
    validation is checked at each training epoch's end instead (a metric logged with
    ``on_epoch=True``), as Lightning does."""

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        mode: str = "min",
        check_finite: bool = True,
    ) -> None:
        _check_mode(mode)
        if patience < 1:
            raise ValueError(f"patience must be at least 1, got {patience}")
        self.monitor = monitor
        self.min_delta = abs(min_delta)
        self.patience = patience
        self.mode = mode
        self.check_finite = check_finite
        self.best_score = math.inf if mode == "min" else -math.inf
        self.wait_count = 0
        self.stopped_epoch: int | None = None
        self.reason = ""
        self._validated = False  # whether this fit has validated yet
        self._validated_at: int | None = None  # the step of the fit's last validation
        self._restored_validation: int | None = None  # that step, as a loaded state gave it
        self._resumed_validation: int | None = None  # a resumed fit's, until its epoch end
        self._loaded = False  # a state was loaded for the fit about to start (a resume)

    @property
    def state_key(self) -> str:
        return f"EarlyStopping[monitor={self.monitor}]"

    def on_fit_start(self, trainer: Trainer, model: nn.Module) -> None:
        # a fit resumed from a checkpoint holding this state goes on as the saved one did
        resumed = self._restored_validation if self._loaded else None
        if not self._loaded:  # a new fit (a Trainer's second, or resumed without this state)
            self.best_score, self.wait_count = (math.inf if self.mode == "min" else -math.inf), 0
            self.stopped_epoch, self.reason = None, ""
        self._loaded = False
        self._validated, self._validated_at = False, resumed
        self._resumed_validation, self._restored_validation = resumed, None

    def on_validation_end(self, trainer: Trainer, model: nn.Module) -> None:
        if trainer.stage != "fit":
            return
        self._validated, self._validated_at = True, trainer.global_step
        self._check(trainer, "validation passes")

    def on_train_epoch_end(self, trainer: Trainer, model: nn.Module) -> None:
        # Validation, where the fit has some, ran before: the epoch's last batch's. A fit
        # resumed from a save on that batch, made after its validation, has only the
        # epoch's end left: that validation checked it (no step taken since)
        resumed, self._resumed_validation = self._resumed_validation, None
        if not self._validated and resumed != trainer.global_step:
            self._check(trainer, "epochs")

    def _check(self, trainer: Trainer, passes: str) -> None:
        score = _monitored(trainer, self.monitor, "EarlyStopping")
        if self.check_finite and not math.isfinite(score):
            self._stop(trainer, f"{self.monitor} = {score} is not finite")
            return
        improved = (
            score < self.best_score - self.min_delta
            if self.mode == "min"
            else score > self.best_score + self.min_delta
        )
        if improved:
            self.best_score = score
            self.wait_count = 0
            return
        self.wait_count += 1
        if self.wait_count >= self.patience:
            self._stop(
                trainer,
                f"{self.monitor} did not improve on {self.best_score:.6g} by more than "
                f"{self.min_delta:g} in {self.patience} {passes}",
            )

    def _stop(self, trainer: Trainer, reason: str) -> None:
        trainer.should_stop = True
        self.stopped_epoch = trainer.current_epoch
        self.reason = reason
        if trainer.is_global_zero:
            log.info(
                "early stopping at epoch %d, step %d: %s",
                trainer.current_epoch,
                trainer.global_step,
                reason,
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "best_score": self.best_score,
            "wait_count": self.wait_count,
            "validated_at": self._validated_at,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_score = state["best_score"]
        self.wait_count = state["wait_count"]
        self._restored_validation = state.get("validated_at")
        self._loaded = True


def _saved_at(path: Path) -> tuple[int, dict[str, Any]] | None:
    """The step a checkpoint was saved at and its callbacks' states (a sharded one's from
    rank 0's run state); None for what does not read as a checkpoint."""
    if path.is_dir():
        path = path / RUN_STATE.format(0)
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(state["loop"]["global_step"]), dict(state.get("callbacks", {}))
    except Exception:  # (anything unreadable is judged by its time alone, as before)
        return None


def _template_fields(template: str) -> list[str]:
    """The names of the keyword fields of a ``str.format`` template, in order
    (``"{val_loss:.3f}"``: ``val_loss``); one that does not parse has none (formatting it
    says why)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError:
        return []
    names = [re.split(r"[.\[]", field, maxsplit=1)[0] for _, field, _, _ in parsed if field]
    return [name for name in dict.fromkeys(names) if name and not name.isdigit()]


class _Unlogged(float):
    """A filename field whose metric is not logged yet: NaN, formatted with the field's
    spec where that takes a float (``nan``, `` nan``), else plain ``nan`` (``{x:d}``)."""

    def __new__(cls) -> _Unlogged:
        return super().__new__(cls, math.nan)

    def __format__(self, spec: str) -> str:
        try:
            return float.__format__(self, spec)
        except ValueError:
            return "nan"


_KEY = "ModelCheckpoint[monitor={monitor},dirpath={dirpath}]"


def _key_parts(key: str) -> tuple[str, str] | None:
    """The monitor and the directory in a ModelCheckpoint's state key (None: another's)."""
    head = _KEY[: _KEY.index("{")]
    if not (key.startswith(head) and key.endswith("]")):
        return None
    monitor, sep, dirpath = key[len(head) : -1].partition(",dirpath=")
    return (monitor, dirpath) if sep else None


def _resolves_to(dirpath: str, resolved: Path | None) -> bool:
    """Whether a key's ``dirpath`` is ``resolved`` (None: the run's default directory)."""
    if dirpath == "None" or resolved is None:
        return dirpath == "None" and resolved is None
    return Path(dirpath).resolve() == resolved


_LAST_NAME_TAKEN = (
    "ModelCheckpoint(filename={filename!r}, save_last=True) names its top-k checkpoints "
    "last.ckpt, the name of the save_last copy: each save would replace the other, and "
    "save_top_k would delete last.ckpt between saves. Give another filename (the default is "
    "'epoch={{epoch}}-step={{step}}'), or leave save_last out"
)


def _names_last(name: str) -> bool:
    """Whether a checkpoint named ``name`` (``.ckpt`` added) is the save_last copy,
    ``last.ckpt`` in the same directory."""
    return Path(f"{name}.ckpt") == Path("last.ckpt")


def _inside(path: Path, directory: Path) -> bool:
    """Whether ``path`` lies in ``directory`` or any sub-directory of it."""
    path, directory = path.resolve(), directory.resolve()
    return path != directory and path.is_relative_to(directory)


def _remove_empty_parents(path: Path, directory: Path) -> None:
    """Remove the directories between ``path`` and ``directory`` that are left empty (a
    ``filename="{epoch}/model"`` makes one per save)."""
    top = directory.resolve()
    for parent in path.parents:
        if parent.resolve() == top or not _inside(parent, top):
            return
        try:
            parent.rmdir()
        except OSError:  # (not empty: other checkpoints, or the user's files)
            return


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def callback_states(callbacks: list[Callback]) -> dict[str, Any]:
    """The non-empty states of ``callbacks`` keyed by `state_key` (unique)."""
    out: dict[str, Any] = {}
    for cb in callbacks:
        state = cb.state_dict() if keeps_state(cb) else {}
        if not state:
            continue
        key = state_key(cb)
        if key in out:
            raise ValueError(
                f"two callbacks share the state key {key!r}; give them distinct settings "
                "(e.g. another dirpath or monitor) so a checkpoint can tell them apart"
            )
        out[key] = state
    return out


def load_callback_states(
    callbacks: list[Callback], states: dict[str, Any], *, resume: bool = True
) -> None:
    """Give each of ``callbacks`` its state from what `callback_states` returned (a
    `ModelCheckpoint` also one under a key spelled otherwise: `_state_owners`); a state no
    callback takes is warned of (on a resume). ``resume=False``: the states a fit in
    launched processes ended with, handed back to the callbacks the caller holds to be
    read (``best_model_path``...), not resumed from: the Trainer's next fit starts them
    afresh, as after a fit in this process."""
    owners = _state_owners(callbacks, states)
    for cb, key in owners:
        cb.load_state_dict(states[key])
        if resume:
            continue
        if isinstance(cb, ModelCheckpoint):
            if cb.dirpath is None or cb._default_dir:  # (the run's: a next fit, its own)
                cb.dirpath, cb._default_dir = cb._restored_from, True
            cb._restored_from = None
        if isinstance(cb, (ModelCheckpoint, EarlyStopping)):
            cb._loaded, cb._restored_validation = False, None
    left = sorted(set(states) - {key for _, key in owners})
    # (skipped without a word, a resumed ModelCheckpoint would forget its files; said once,
    # by rank 0)
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if left and resume and rank == 0:
        warnings.warn(
            f"the checkpoint holds callback states that no callback of this run takes: "
            f"{', '.join(left)}; they are left out (callbacks: "
            f"{', '.join(state_key(cb) for cb in callbacks if keeps_state(cb)) or 'none'})",
            stacklevel=3,
        )


def _state_owners(callbacks: list[Callback], states: dict[str, Any]) -> list[tuple[Any, str]]:
    """Which of ``callbacks`` takes which key of ``states``: each its own key. A
    `ModelCheckpoint` without one takes a key of its monitor whose directory resolves to
    its own ("ck/" for "ck": `ModelCheckpoint._own_key`), else the only one of its monitor
    where it is the only one of that monitor left: its directory moved (a relative one from
    another working directory, the run moved); as in Lightning, whose keys hold no
    directory, it goes on with the best checkpoint, and leaves the files there alone."""
    owners = [(cb, state_key(cb)) for cb in callbacks if keeps_state(cb)]
    taken = [(cb, key) for cb, key in owners if key in states]
    waiting = [cb for cb, key in owners if key not in states and isinstance(cb, ModelCheckpoint)]
    for cb in list(waiting):
        key = cb._own_key(sorted(set(states) - {k for _, k in taken}))
        if key is not None:
            taken.append((cb, key))
            waiting.remove(cb)
    used = {k for _, k in taken}
    free = {k: parts for k in states if k not in used and (parts := _key_parts(k))}
    for cb in waiting:
        mine = [k for k, (monitor, _) in free.items() if monitor == f"{cb.monitor}"]
        rivals = [c for c in waiting if c.monitor == cb.monitor]
        if len(mine) == 1 and rivals == [cb]:
            taken.append((cb, mine[0]))
    return taken
