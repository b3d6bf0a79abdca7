"""`PrecisionMonitor`: watch per-layer ranges during training and warn before they break.

Every `every_n_steps` optimizer steps, forward hooks measure each layer's output held in a
low-precision dtype (float16, bfloat16, float8): its amax and the fraction of nonzero values
below the dtype's smallest normal; tensor hooks do the same for the gradient flowing back
into it. On other steps no hook is installed, so they cost nothing. The numbers stay on the
device until the step ends, then come back in one transfer per device.

Warnings (a `PrecisionWarning` and a log record, each naming the layer) are raised once per
layer and kind when a layer's amax comes within `headroom` of its dtype's max, when its
growth over recent samples projects it past the max within `horizon_steps`, when it is
already inf/NaN, when its outputs or gradients are all zero where its last sample's were not
(flushed to zero: the underflow fraction counts nonzero values only), and when the loss scaler
keeps skipping steps.

Pass it to the Trainer's ``callbacks=`` (it defines the Trainer hooks it needs and does not
import the Trainer: the Trainer calls the hooks an object has), or use it in any loop::

    monitor = PrecisionMonitor(every_n_steps=50).attach(model)
    for step, (x, y) in enumerate(data):
        monitor.start_step(step)
        ...forward, backward, optimizer step...
        monitor.end_step(step, scaler=precision.scaler)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mixprec.doctor.probe import floating_tensors
from mixprec.doctor.verdicts import HEADROOM, UNDERFLOW_AT_RISK
from mixprec.dtypes import LOW_PRECISION_FLOATS, format_info
from mixprec.optim.scaling import LossScaler

if TYPE_CHECKING:
    from mixprec.trainer.trainer import Trainer

__all__ = ["LayerSample", "PrecisionMonitor", "PrecisionWarning"]

log = logging.getLogger("mixprec")


class PrecisionWarning(RuntimeWarning):
    """A layer's values are heading outside what its dtype can hold, or the scaler keeps
    skipping steps."""


@dataclass(frozen=True)
class LayerSample:
    """One layer's numbers at one monitored step (gradient fields are NaN before backward
    reached the layer or when its output needs no gradient). `underflow` is the fraction of
    the nonzero values below the dtype's smallest normal; `flushed`: every value is 0 where
    the layer's last sample had a nonzero one (or was flushed itself), which `underflow`
    (0.0 then) cannot show. `grad_*` the same for the gradient."""

    step: int
    dtype: str
    amax: float
    underflow: float
    grad_amax: float
    grad_underflow: float
    flushed: bool = False  # (defaults: a checkpoint's rows from before they were kept)
    grad_flushed: bool = False


class PrecisionMonitor:
    """Track per-layer amax and underflow every `every_n_steps` steps and warn early.

    Forwards between `pause` and `unpause` do not count (as a Trainer callback: a
    validation inside a step's accumulation window). As a Trainer callback its history and
    warnings are part of the run's state: a checkpoint keeps them, and a run in other
    processes (``ddp_fork``, ``ddp``) hands rank 0's back to this object.

    Args:
        every_n_steps: monitor one step in this many (step 0 included).
        headroom: warn when a layer's amax exceeds its dtype's max divided by this.
        horizon_steps: warn when the amax trend (a log-linear fit over the last samples)
            reaches the dtype's max within this many steps.
        skip_patience: warn when the scaler skipped this many steps in a row, or at least
            half the steps since the last monitored one (and at least this many).
        underflow_warn: warn when this fraction of a layer's nonzero outputs or gradients
            falls below the dtype's smallest normal.
        history: samples kept per layer.
        log_fn: called with ``({name: value}, step)`` on each monitored step; as a Trainer
            callback the default sends them to the trainer's loggers.
        across_ranks: combine every process's numbers at each monitored step (the largest
            amax, the underflow over all ranks' values), so each rank judges the step the
            model took rather than its own share of the batch. A collective of the default
            process group: give the monitor to every rank, monitoring the same steps (a
            monitor on rank 0 alone would wait for the others for ever). None (the default):
            each rank's own numbers, except in the processes a mixprec Trainer starts itself
            (``ddp``, ``ddp_fork``, ``fsdp``), which all hold it and combine theirs.
    """

    across_ranks: bool | None = None  # (a monitor pickled before it was kept)
    _loaded = False  # load_state_dict gave the state the next fit resumes from

    def __init__(
        self,
        every_n_steps: int = 50,
        *,
        headroom: float = HEADROOM,
        horizon_steps: int | None = None,
        skip_patience: int = 3,
        underflow_warn: float = UNDERFLOW_AT_RISK,
        history: int = 32,
        log_fn: Callable[[dict[str, float], int], None] | None = None,
        across_ranks: bool | None = None,
    ) -> None:
        for name, value, least in (
            ("every_n_steps", every_n_steps, 1),
            ("skip_patience", skip_patience, 1),
            ("history", history, 1),
            ("horizon_steps", 0 if horizon_steps is None else horizon_steps, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, Integral) or value < least:
                raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
        if not headroom >= 1:
            raise ValueError(f"headroom must be >= 1 (a factor below the max), got {headroom}")
        if not 0 < underflow_warn <= 1:
            raise ValueError(f"underflow_warn must be a fraction in (0, 1], got {underflow_warn}")
        self.every_n_steps = every_n_steps
        self.headroom = headroom
        self.horizon_steps = horizon_steps if horizon_steps is not None else 10 * every_n_steps
        self.skip_patience = skip_patience
        self.underflow_warn = underflow_warn
        self.log_fn = log_fn
        self.across_ranks = across_ranks
        self.history: dict[str, deque[LayerSample]] = {}
        self.warnings: list[str] = []
        self._maxlen = history
        self._model: nn.Module | None = None
        self._names: dict[int, str] = {}
        self._handles: list[Any] = []
        self._pending: dict[str, list[tuple[torch.dtype, list[Tensor]]]] = {}
        self._grads: dict[str, list[Tensor]] = {}
        # in the order layers finish, each output as (layer, layer whose sample holds it, its
        # position here): a parent handing on its last child's output has no sample of its
        # own; and for each, 1 where that call's inputs were finite and it is not (judged per
        # call: a loop's call after the one that overflowed takes its inf)
        self._finished: list[tuple[str, str, int]] = []
        self._inputs: dict[tuple[str, str, int], Tensor] = {}
        # each output sampled: the layer whose sample it is, its version then (an output
        # changed in place since is sampled again where it is handed on) and its amax
        self._owners: dict[int, tuple[str, int, Tensor]] = {}
        self._seen: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        self._armed_step: int | None = None
        self._done_step: int | None = None
        self._warned: set[tuple[str, str]] = set()
        self._last_scaler: tuple[int, int] | None = None
        self._paused = False

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a ``ddp`` run's processes get a copy) without the step in progress."""
        state = dict(self.__dict__)
        state["_seen"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._seen = weakref.WeakValueDictionary()

    @property
    def state_key(self) -> str:
        """Where a Trainer checkpoint keeps this monitor's state: its settings tell two
        monitors of one run apart."""
        return (  # (numbers as numbers: headroom=4 and 4.0 are one key)
            f"PrecisionMonitor{{every_n_steps={self.every_n_steps}, "
            f"headroom={float(self.headroom):g}, horizon_steps={self.horizon_steps}, "
            f"skip_patience={self.skip_patience}, "
            f"underflow_warn={float(self.underflow_warn):g}}}"
        )

    def state_dict(self) -> dict[str, Any]:
        """The history and the warnings given, in plain values (a checkpoint's)."""
        return {
            "history": {
                name: [dataclasses.astuple(s) for s in samples]
                for name, samples in self.history.items()
            },
            "warnings": list(self.warnings),
            "warned": sorted(self._warned),
            "last_scaler": self._last_scaler,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict`'s values (as a Trainer callback: the next fit, a
        resume, goes on from them rather than starting afresh)."""
        self.history = {
            name: deque((LayerSample(*row) for row in rows), maxlen=self._maxlen)
            for name, rows in state["history"].items()
        }
        self.warnings = list(state["warnings"])
        self._warned = {tuple(w) for w in state["warned"]}  # type: ignore[misc]
        last = state["last_scaler"]
        self._last_scaler = tuple(last) if last is not None else None  # type: ignore[assignment]
        self._loaded = True

    def reset(self) -> None:
        """Forget the history, the warnings given and the scaler's counts: a new run (a
        Trainer's next fit that does not resume) judges its own steps and warns again."""
        self.history, self.warnings = {}, []
        self._warned, self._last_scaler, self._done_step = set(), None, None

    # -- the standalone interface ------------------------------------------------------------

    def attach(self, model: nn.Module) -> PrecisionMonitor:
        """Watch `model` (after `mixprec.apply` or `Precision.setup`); returns self. The
        history and warnings stay (see `reset`)."""
        self.detach()
        self._model = model
        self._names = {id(m): name for name, m in model.named_modules()}
        self._paused = False  # (a validation that raised never unpaused)
        self._done_step = None  # (a new fit counts from its own steps)
        return self

    def detach(self) -> None:
        """Stop watching: remove any installed hook."""
        self._disarm()
        self._model = None

    def pause(self) -> None:
        """Leave out the forwards from here to `unpause` (an evaluation run between the
        micro-batches of a monitored step: its values are not the step's)."""
        self._paused = True

    def unpause(self) -> None:
        """Count forwards again (after `pause`)."""
        self._paused = False

    def should_monitor(self, step: int) -> bool:
        """Whether `step` is one of the monitored steps."""
        return step % self.every_n_steps == 0

    def start_step(self, step: int) -> bool:
        """Install the hooks if `step` is monitored (call before the forward); returns
        whether it is. An earlier step whose `end_step` never came (it raised) is dropped."""
        if self._model is None:
            raise RuntimeError("PrecisionMonitor.start_step before attach(model)")
        if self._armed_step == step:
            return True
        self._disarm()  # a monitored step that never reached end_step stops here
        if not self.should_monitor(step) or self._done_step == step:
            return False
        self._armed_step = step
        for module in self._model.modules():
            self._handles.append(module.register_forward_hook(self._forward_hook))
        return True

    def end_step(self, step: int, scaler: LossScaler | None = None) -> dict[str, float]:
        """Collect the monitored step's numbers (after backward), check them and the scaler,
        warn, log; returns the logged metrics (empty on unmonitored steps)."""
        if self._armed_step is None or self._armed_step != step:
            return {}
        forward = [(n, d, stats) for n, entries in self._pending.items() for d, stats in entries]
        grads, inputs = list(self._grads.items()), list(self._inputs.items())
        finished = list(self._finished)
        self._disarm()
        self._done_step = step
        if self.across_ranks and dist.is_initialized() and dist.get_world_size() > 1:
            names, grad_names, input_names, values, finished = _across_ranks(
                forward, grads, inputs, finished
            )
        else:
            names = [(name, d) for name, d, _ in forward]
            grad_names, input_names = [n for n, _ in grads], [n for n, _ in inputs]
            tensors = [t for *_, stats in forward for t in stats]
            tensors += [t for _, stats in grads for t in stats] + [t for _, t in inputs]
            values = _to_host(tensors)
        inputs = dict(zip(input_names, values[len(values) - len(input_names) :], strict=True))
        samples = self._samples(step, names, grad_names, values[: len(values) - len(input_names)])
        metrics: dict[str, float] = {}
        # inf/NaN propagate downstream: only the layer that made them is named, the first (in
        # the order layers finish) with a call whose output is not finite and whose inputs
        # were (a child finishes before its parent: one fed its parent's inf passes it on),
        # else the first
        bad = [e for e in finished if e[1] in samples and not math.isfinite(samples[e[1]].amax)]
        culprit = next((e for e in bad if inputs.get(e, 0.0) > 0), bad[0] if bad else None)
        for name, sample in samples.items():
            sample = samples[name] = self._flag_flushed(name, sample)
            self.history.setdefault(name, deque(maxlen=self._maxlen)).append(sample)
            metrics.update(_sample_metrics(name, sample))
            if math.isfinite(sample.amax):
                self._check_layer(name, sample)
        if culprit is not None:
            self._check_layer(culprit[0], samples[culprit[1]])
        if scaler is not None:
            metrics.update(self._check_scaler(step, scaler, samples))
        if self.log_fn is not None and metrics:
            self.log_fn(metrics, step)
        return metrics

    # -- hooks -------------------------------------------------------------------------------

    def _forward_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._paused:  # (a validation inside the step's accumulation window)
            return
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            self._hook_recomputed(self._names.get(id(module), "?") or "<root>", output)
            return
        try:
            name = self._names.get(id(module), "?") or "<root>"
            inputs = _inputs_amax(args)
            for t in floating_tensors(output):
                if t.dtype in LOW_PRECISION_FLOATS and t.numel():
                    self._record_output(name, t, inputs)
        except BaseException:
            self._abandon_step()
            raise

    def _hook_recomputed(self, name: str, output: Any) -> None:
        """A forward recomputed in the backward (`checkpoint`, `selective`, a reentrant
        checkpoint): its values were sampled when it first ran, and an op added here breaks
        torch's selective checkpoint, which replays exactly the forward's ops; only a
        gradient hook, for the outputs of a reentrant checkpoint's recomputation, whose
        gradients flow through them (its first run, without grad, took none)."""
        for t in floating_tensors(output):
            if t.dtype in LOW_PRECISION_FLOATS and t.numel() and t.requires_grad:
                if id(t) not in self._seen:  # (a child's output handed on: the child's)
                    self._seen[id(t)] = t
                    hook = self._grad_hook(name, format_info(t.dtype))
                    self._handles.append(t.register_hook(hook))

    def _record_output(self, name: str, t: Tensor, inputs: Tensor | None) -> None:
        """Sample the output `t` of a call of layer `name` (`inputs`: that call's largest
        input magnitude), unless it is a child's output handed on unchanged (one changed in
        place since its sample, a residual ``out += x``, is sampled again: the old sample no
        longer says what this layer gives); note whether this call made inf/NaN."""
        owner = self._owners.get(id(t))
        version = _version(t)
        if id(t) in self._seen and owner is not None and owner[1] == version:
            self._note_call((name, owner[0], len(self._finished)), owner[2], inputs)
            return
        self._seen[id(t)] = t
        info = format_info(t.dtype)
        stats = _range_stats(t, info)
        self._owners[id(t)] = (name, version, stats[0])
        self._note_call((name, name, len(self._finished)), stats[0], inputs)
        self._pending.setdefault(name, []).append((t.dtype, stats))
        if t.requires_grad:  # (registered now: the gradient of this version of `t`)
            self._handles.append(t.register_hook(self._grad_hook(name, info)))

    def _note_call(self, entry: tuple[str, str, int], amax: Tensor, inputs: Tensor | None) -> None:
        """Note output `entry` of a call, with amax `amax`: 1 where it is not finite and the
        call's inputs (largest magnitude `inputs`; None: none) were, on the device."""
        self._finished.append(entry)
        made = ~torch.isfinite(amax)
        if inputs is not None:
            made &= torch.isfinite(inputs.to(amax.device))
        self._inputs[entry] = made.float()

    def _grad_hook(self, name: str, info: Any) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if not grad.numel():
                return
            try:
                amax, under, nonzero = _range_stats(grad, info)
            except BaseException:
                self._abandon_step()
                raise
            old = self._grads.get(name)
            if old is None:
                self._grads[name] = [amax, under, nonzero]
            else:  # several outputs or calls: combine
                self._grads[name] = [torch.maximum(old[0], amax), old[1] + under, old[2] + nonzero]

        return hook

    def _abandon_step(self) -> None:
        """Remove every hook, measuring having raised: the step fails, and hooks left on
        the user's model would measure each later forward (the step is not retried)."""
        self._done_step = self._armed_step
        self._disarm()

    def _disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()
        self._grads.clear()
        self._inputs.clear()
        self._finished.clear()
        self._owners.clear()
        self._seen.clear()
        self._armed_step = None

    # -- analysis ----------------------------------------------------------------------------

    def _samples(
        self,
        step: int,
        names: list[tuple[str, torch.dtype]],
        grad_names: list[str],
        values: list[float],
    ) -> dict[str, LayerSample]:
        merged: dict[str, list[Any]] = {}
        i = 0
        for name, dtype in names:
            amax, under, nonzero = values[i : i + 3]
            i += 3
            m = merged.setdefault(name, [dtype, 0.0, 0.0, 0.0])
            # (a NaN from any call of the layer stays: a later finite call does not hide it)
            if not math.isnan(m[1]):
                m[1] = amax if math.isnan(amax) else max(m[1], amax)
            m[2] += under
            m[3] += nonzero
        grads: dict[str, tuple[float, float]] = {}
        for name in grad_names:
            amax, under, nonzero = values[i : i + 3]
            i += 3
            grads[name] = (amax, under / nonzero if nonzero else 0.0)
        out = {}
        for name, (dtype, amax, under, nonzero) in merged.items():
            g_amax, g_under = grads.get(name, (math.nan, math.nan))
            out[name] = LayerSample(
                step=step,
                dtype=format_info(dtype).name,
                amax=amax,
                underflow=under / nonzero if nonzero else 0.0,
                grad_amax=g_amax,
                grad_underflow=g_under,
            )
        return out

    def _warn(self, name: str, kind: str, message: str) -> None:
        if (name, kind) in self._warned:
            return
        self._warned.add((name, kind))
        self.warnings.append(message)
        log.warning(message)
        warnings.warn(message, PrecisionWarning, stacklevel=4)

    def _check_layer(self, name: str, s: LayerSample) -> None:
        info = format_info(s.dtype)
        if not math.isfinite(s.amax):
            self._warn(
                name,
                "nonfinite",
                f"layer {name} produced inf/NaN in {s.dtype} at step {s.step}; run "
                "`mixprec doctor` on this batch to find where it starts",
            )
            return
        if s.amax > info.max / self.headroom:
            self._warn(
                name,
                "near-max",
                f"layer {name} reaches {s.amax:.3g} at step {s.step}, within "
                f"{self.headroom:g}x of {s.dtype} max {info.max:g}: it will overflow soon",
            )
        else:
            eta = self._projected_overflow(name, info.max)
            if eta is not None and eta - s.step <= self.horizon_steps:
                self._warn(
                    name,
                    "trend",
                    f"layer {name} amax grew to {s.amax:.3g} by step {s.step}; at this rate "
                    f"it passes {s.dtype} max {info.max:g} around step {eta}",
                )
        if s.underflow >= self.underflow_warn:
            self._warn(
                name,
                "underflow",
                f"layer {name}: {s.underflow:.0%} of its nonzero outputs are below {s.dtype}'s "
                f"smallest normal {info.smallest_normal:.2g} at step {s.step}",
            )
        if not math.isnan(s.grad_underflow) and s.grad_underflow >= self.underflow_warn:
            self._warn(
                name,
                "grad-underflow",
                f"layer {name}: {s.grad_underflow:.0%} of the (scaled) gradients reaching it "
                f"are below {s.dtype}'s smallest normal at step {s.step}: raise the loss scale",
            )
        self._check_flushed(name, s, info)

    def _check_flushed(self, name: str, s: LayerSample, info: Any) -> None:
        """Warn of outputs or gradients all zero where the layer's last sample had nonzero
        ones: flushed below the dtype's smallest subnormal (or cut off), which the underflow
        fraction, over nonzero values only, cannot show."""
        if s.flushed:
            self._warn(
                name,
                "flushed",
                f"layer {name}: all its outputs are 0 at step {s.step}, nonzero before: "
                f"flushed to zero below {s.dtype}'s smallest subnormal "
                f"{info.smallest_subnormal:.2g}, or cut off",
            )
        if s.grad_flushed:
            self._warn(
                name,
                "grad-flushed",
                f"layer {name}: all the (scaled) gradients reaching it are 0 at step {s.step}, "
                f"nonzero before: flushed to zero below {s.dtype}'s smallest subnormal "
                f"{info.smallest_subnormal:.2g}, or cut off: raise the loss scale",
            )

    def _flag_flushed(self, name: str, s: LayerSample) -> LayerSample:
        """`s` with `flushed` / `grad_flushed` set where its values are all zero and the
        layer's last sample (with a gradient, for `grad_flushed`) had nonzero ones or was
        flushed itself (a layer zero from its first sample, a zero-initialized branch, is
        not flushed)."""
        past = self.history.get(name, ())
        last = past[-1] if past else None
        flushed = s.amax == 0 and last is not None and (last.amax != 0 or last.flushed)
        grad = next((p for p in reversed(past) if not math.isnan(p.grad_amax)), None)
        grad_flushed = (
            s.grad_amax == 0 and grad is not None and (grad.grad_amax != 0 or grad.grad_flushed)
        )
        if not (flushed or grad_flushed):
            return s
        return dataclasses.replace(s, flushed=flushed, grad_flushed=grad_flushed)

    def _projected_overflow(self, name: str, limit: float) -> int | None:
        """Step at which a least-squares line through log2(amax) of the last samples crosses
        log2(limit); None without a rising trend (fewer than 3 samples, or flat)."""
        samples = [s for s in self.history.get(name, ()) if s.amax > 0 and math.isfinite(s.amax)]
        samples = samples[-8:]
        if len(samples) < 3:
            return None
        xs = [float(s.step) for s in samples]
        ys = [math.log2(s.amax) for s in samples]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx == 0:
            return None
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        if slope <= 0:
            return None
        return int(xs[-1] + (math.log2(limit) - ys[-1]) / slope)

    def _check_scaler(
        self, step: int, scaler: LossScaler, samples: dict[str, LayerSample]
    ) -> dict[str, float]:
        stats = scaler.stats()
        window_steps, window_skips = stats.steps, stats.skipped_steps
        if self._last_scaler is not None:
            window_steps -= self._last_scaler[0]
            window_skips -= self._last_scaler[1]
        self._last_scaler = (stats.steps, stats.skipped_steps)
        skipping = stats.consecutive_skips >= self.skip_patience or (
            window_skips >= self.skip_patience and window_skips * 2 >= window_steps
        )
        if not skipping:
            self._warned.discard(("<scaler>", "skipping"))  # a new episode warns again
        else:
            suspects = sorted(
                samples.items(),
                key=lambda kv: -_fill(kv[1]),
            )[:3]
            shown = ", ".join(
                f"{name} ({'inf/NaN' if not math.isfinite(s.amax) else f'amax {s.amax:.3g}'})"
                for name, s in suspects
            )
            self._warn(
                "<scaler>",
                "skipping",
                f"the loss scaler keeps skipping steps: {window_skips} of the last "
                f"{window_steps} ({stats.consecutive_skips} in a row), scale now "
                f"{stats.scale:g}; layers closest to their dtype's max: {shown or 'none seen'}",
            )
        return {
            "precision/loss_scale": stats.scale,
            "precision/skipped_steps": float(stats.skipped_steps),
        }

    # -- Trainer hooks (as mixprec.trainer.Callback names them) ------------------------------

    def in_launched_processes(self) -> None:
        """Called by a mixprec Trainer in each process it starts (``ddp``, ``ddp_fork``,
        ``fsdp``), every one holding a copy of this monitor: left to choose (None), it
        combines the ranks' numbers."""
        if self.across_ranks is None:
            self.across_ranks = True
        # (a state handed back from an earlier run's processes is not one to resume from: a
        # resume in this process loads its own before on_fit_start)
        self._loaded = False

    def on_fit_start(self, trainer: Trainer, model: nn.Module) -> None:
        # a fit resumed from a checkpoint that held this monitor's state (loaded just before
        # this hook) goes on from it; any other fit, a Trainer's second included, starts
        # afresh (its steps count from 0 again, its scaler is new)
        if not (self._loaded and trainer.ckpt_path is not None):
            self.reset()
        self._loaded = False
        self.attach(model)

    def on_train_batch_start(
        self, trainer: Trainer, model: nn.Module, batch: Any, batch_idx: int
    ) -> None:
        self.start_step(trainer.global_step)

    def on_before_optimizer_step(self, trainer: Trainer, model: nn.Module, optimizer: Any) -> None:
        # every micro-batch of the step has run forward and backward; validation (whose
        # forwards must not count) comes later
        step = self._armed_step
        if step is None:
            return
        precision = trainer.precision
        metrics = self.end_step(step, scaler=precision.scaler if precision is not None else None)
        if metrics and self.log_fn is None and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step + 1)  # the trainer logs step s as s + 1

    def on_validation_start(self, trainer: Trainer, model: nn.Module) -> None:
        self.pause()  # (a validation may fall between a monitored step's micro-batches)

    def on_validation_end(self, trainer: Trainer, model: nn.Module) -> None:
        self.unpause()

    def on_fit_end(self, trainer: Trainer, model: nn.Module) -> None:
        self.detach()

    def on_exception(self, trainer: Trainer, model: nn.Module, exception: BaseException) -> None:
        # a failed fit never reaches on_fit_end: the hooks must not stay on the user's model,
        # nor the pause of a validation that raised on the monitor
        self.detach()
        self.unpause()


def _across_ranks(
    forward: list[tuple[str, torch.dtype, list[Tensor]]],
    grads: list[tuple[str, list[Tensor]]],
    inputs: list[tuple[Any, Tensor]],
    finished: list[Any],
) -> tuple[list[tuple[str, torch.dtype]], list[str], list[Any], list[float], list[Any]]:
    """A monitored step's numbers over every rank of the default group, laid out as one
    rank's are (`PrecisionMonitor.end_step`): the names each rank recorded, in rank order;
    for each, the largest amax (NaN where a rank's was) and the summed counts; one object
    gather and two all-reduces on the stats' device."""
    mine = ([(n, d) for n, d, _ in forward], [n for n, _ in grads], [n for n, _ in inputs])
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (*mine, finished))
    keys = [list(dict.fromkeys(k for rank in everyone for k in rank[i])) for i in range(4)]
    if not any(keys[:3]):  # (nothing recorded anywhere: every rank knows, none reduces)
        return [], [], [], [], keys[3]
    device = torch.device("cpu")  # (gloo reduces host tensors; NCCL the current GPU's)
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    # per entry: amax (NaN as -inf, flagged), then the counts; absent entries add nothing
    sizes = (3, 3, 1)
    rows = [torch.zeros(len(k), n, device=device) for k, n in zip(keys, sizes, strict=False)]
    for row in rows:
        row[:, 0] = -math.inf
    local = (
        [((n, d), stats) for n, d, stats in forward],
        grads,
        [(n, [t]) for n, t in inputs],
    )
    for row, key_list, entries in zip(rows, keys, local, strict=False):
        at = {k: i for i, k in enumerate(key_list)}
        for key, stats in entries:
            i = at[key]
            amax = stats[0].float().to(device)
            row[i, 0] = torch.maximum(row[i, 0], amax)  # (NaN kept: several calls)
            for j, t in enumerate(stats[1:], start=1):
                row[i, j] += t.float().to(device)
    amaxes = torch.cat([row[:, 0] for row in rows])
    nan = amaxes.isnan().float()
    counts = torch.cat([nan, *(row[:, 1:].reshape(-1) for row in rows)])
    dist.all_reduce(amaxes.masked_fill_(amaxes.isnan(), -math.inf), op=dist.ReduceOp.MAX)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    flagged = amaxes.numel()
    amaxes = torch.where(counts[:flagged] > 0, math.nan, amaxes).cpu().tolist()
    rest = counts[flagged:].cpu().tolist()
    values: list[float] = []
    k = j = 0
    for row in rows:
        for _ in range(row.shape[0]):
            extra = row.shape[1] - 1
            values += [amaxes[k], *rest[j : j + extra]]
            k, j = k + 1, j + extra
    return keys[0], keys[1], keys[2], values, keys[3]


def _to_host(tensors: list[Tensor]) -> list[float]:
    """The values of the 0-d `tensors`, in order, as floats: stacked on their own device
    and copied to the host once per device (one copy per scalar makes a device sync each)."""
    at: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        at.setdefault(t.device, []).append(i)
    values = [0.0] * len(tensors)
    for where in at.values():
        host = torch.stack([tensors[i].float() for i in where]).cpu().tolist()
        for i, v in zip(where, host, strict=True):
            values[i] = v
    return values


def _sample_metrics(name: str, s: LayerSample) -> dict[str, float]:
    """The logged numbers of layer `name`'s sample (the flushed flags, as 1.0, only where
    they hold)."""
    out = {f"precision/{name}/amax": s.amax, f"precision/{name}/underflow": s.underflow}
    if not math.isnan(s.grad_amax):
        out[f"precision/{name}/grad_amax"] = s.grad_amax
        out[f"precision/{name}/grad_underflow"] = s.grad_underflow
    if s.flushed:
        out[f"precision/{name}/flushed"] = 1.0
    if s.grad_flushed:
        out[f"precision/{name}/grad_flushed"] = 1.0
    return out


def _version(t: Tensor) -> int:
    """`t`'s in-place version counter (inference tensors keep none: -1). (Not asked while
    compiling: ``is_inference`` breaks the traced hook's graph, and the tensors a broken
    graph hands on are new objects, sampled again.)"""
    if not torch.compiler.is_compiling() and t.is_inference():
        return -1
    return t._version


def _inputs_amax(args: Any) -> Tensor | None:
    """The largest magnitude of a call's floating inputs (inf/NaN when one holds any); None
    when it has none."""
    sizes = [_amax(t) for t in floating_tensors(args) if t.numel()]
    if not sizes:
        return None
    return torch.stack(sizes).amax() if len(sizes) > 1 else sizes[0]


def _amax(t: Tensor) -> Tensor:
    """Largest magnitude of `t` in float32, on its device (inf/NaN when it holds any)."""
    t = t.detach()
    if t.dtype not in _NORM_OK:
        t = t.float()  # float8 has no abs/max kernels on every device
    return t.abs().amax().float()


def _range_stats(t: Tensor, info: Any) -> tuple[Tensor, Tensor, Tensor]:
    """(amax, values below the smallest normal, nonzero values) of `t`, on its device.
    amax is inf/NaN when `t` holds any."""
    t = t.detach()
    if t.dtype not in _NORM_OK:
        t = t.float()  # float8 has no abs/min/max kernels on every device
    lo, hi = torch.aminmax(t)  # NaN and inf propagate
    amax = torch.maximum(lo.abs(), hi.abs())
    a = t.abs()
    nonzero = torch.count_nonzero(a)
    under = torch.count_nonzero(a < info.smallest_normal) - (a.numel() - nonzero)
    return amax, under, nonzero


_NORM_OK = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fill(s: LayerSample) -> float:
    """How full a layer's range is: amax / dtype max (inf for inf/NaN)."""
    if not math.isfinite(s.amax):
        return math.inf
    return s.amax / format_info(s.dtype).max
