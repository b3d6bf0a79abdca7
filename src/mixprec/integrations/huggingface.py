"""mixprec inside Hugging Face ``transformers.Trainer`` and ``accelerate.Accelerator``.

- ``PrecisionMonitorCallback``: mixprec's ``PrecisionMonitor`` as a ``TrainerCallback``;
  per-layer amax/underflow of every n-th step go to the Trainer's log history (and, given
  the trainer, through ``trainer.log`` to its reporting integrations) and to a JSON-lines file.
- ``MixprecTrainer``: ``transformers.Trainer`` training under a mixprec policy or
  ``PolicyMap`` with mixprec's loss scaling. The HF loop stays as it is; five methods adapt it.
- ``prepare``: set a model and optimizer up once for a hand-written Accelerate loop, which
  then stays as it is: its ``accelerator.backward(loss)`` is the precision's backward.

Both doors run the backward as every mixprec loop does: the accelerator's ``backward`` is
routed through ``Precision.backward_context`` (the loss scaled; under a "true" policy the
compute dtype as torch's default, as in the forward, so activation-checkpointed blocks
recompute what they computed there), around Accelerate's own (its division by the
accumulation steps, DDP); after the last backward of an optimizer step it runs
``Precision.before_step``, the formats' per-step work (float8's delayed amax histories
shared across the ranks). Why a subclass and not just ``optimizers=(wrapped, scheduler)``:
in ``Trainer.training_step`` gradient clipping (``max_grad_norm``, 1.0 by default) runs right
after the last backward, on whatever the gradients hold; and the scheduler is gated on
``accelerator.optimizer_step_was_skipped``, which knows only optimizers Accelerate wrapped
(a ``LossScaleOptimizer`` is not a ``torch.optim.Optimizer``, so ``prepare`` passes it
through unwrapped). ``MixprecTrainer`` unscales after the last micro-batch so that HF clips
true gradients, and steps the scheduler only when the optimizer stepped; the loss it logs
is the unscaled one.

Importing this module imports ``transformers`` (and ``accelerate`` on first use of
``prepare``); ``import mixprec`` imports neither.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from mixprec.doctor.monitor import PrecisionMonitor
from mixprec.errors import SlowPrecisionError
from mixprec.files import write_atomically
from mixprec.optim import LossScaleOptimizer, SkipAwareScheduler
from mixprec.optim.scaling import LossScaler
from mixprec.policy.map import config_in_words, resumable_config
from mixprec.precision import BackwardOutsideAutocast, Precision

__all__ = [
    "MixprecTrainer",
    "PrecisionMonitorCallback",
    "prepare",
]


# -- the monitor ------------------------------------------------------------------------------


class PrecisionMonitorCallback(transformers.TrainerCallback):
    """Run a ``PrecisionMonitor`` inside ``transformers.Trainer``.

    Hooks go in at the step's first micro-batch (``on_step_begin``) on every
    ``every_n_steps``-th optimizer step only; the numbers are read after the last backward
    (``on_pre_optimizer_step``), checked with the monitor's thresholds (a
    ``PrecisionWarning`` naming the layer), and written at ``on_step_end`` under the HF step
    number: ``precision/<layer>/amax``, ``/underflow``, ``/grad_amax``, ``/grad_underflow``,
    and the loss scale and skipped steps when the optimizer is a ``LossScaleOptimizer``.

    Args:
        every_n_steps: monitor one optimizer step in this many (step 0 included).
        path: also append one JSON line per monitored step to this file; ``None``: the
            Trainer's ``output_dir``/``precision_monitor.jsonl``; ``False``: no file.
        trainer: log through ``trainer.log`` (the log history and every ``report_to``
            integration: TensorBoard, W&B...). A callback cannot reach the Trainer that runs
            it, so without this the rows go to ``state.log_history`` only.
        monitor: a configured ``PrecisionMonitor`` (thresholds, history) instead of one
            built from ``every_n_steps`` and ``monitor_options``.
        monitor_options: passed to ``PrecisionMonitor`` (``headroom``, ``horizon_steps``...).
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        *,
        path: str | Path | None | bool = None,
        trainer: transformers.Trainer | None = None,
        monitor: PrecisionMonitor | None = None,
        **monitor_options: Any,
    ) -> None:
        if monitor is not None and monitor_options:
            raise ValueError(
                "pass either a PrecisionMonitor or its options, not both: "
                f"{sorted(monitor_options)}"
            )
        if not (path is None or path is False or isinstance(path, (str, os.PathLike))):
            raise TypeError(
                "path is a file path (str or os.PathLike), None (precision_monitor.jsonl in "
                f"the Trainer's output_dir) or False (no file), got {path!r}"
            )
        if monitor is not None and not isinstance(monitor, PrecisionMonitor):
            raise TypeError(
                f"monitor is a mixprec.PrecisionMonitor (or None: one built from "
                f"every_n_steps), got {type(monitor).__name__}"
            )
        if trainer is not None and not isinstance(trainer, transformers.Trainer):
            raise TypeError(
                f"trainer is the transformers.Trainer to log through (or None), got "
                f"{type(trainer).__name__}"
            )
        self.monitor = monitor or PrecisionMonitor(every_n_steps, **monitor_options)
        self.trainer = trainer
        self._path = path
        self.path: Path | None = None
        self._rows: dict[str, float] = {}
        self._said_nothing_low = False

    @property
    def warnings(self) -> list[str]:
        """The warnings raised so far, each naming its layer."""
        return self.monitor.warnings

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if not isinstance(model, nn.Module):
            raise TypeError("PrecisionMonitorCallback needs the Trainer's model (got none)")
        self.monitor.attach(model)
        if self._path is False:
            self.path = None
        else:
            self.path = Path(self._path or Path(args.output_dir) / "precision_monitor.jsonl")
            if state.is_world_process_zero:
                self.path.parent.mkdir(parents=True, exist_ok=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.start_step(state.global_step)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if not self.monitor.should_monitor(step):
            return
        self._rows = self.monitor.end_step(step, scaler=_scaler_of(kwargs.get("optimizer")))
        if not self._said_nothing_low and not any(k.endswith("/amax") for k in self._rows):
            self._said_nothing_low = True
            why = (
                ": Hugging Face's fp16=True does not lower a CPU run to float16, it trains "
                "in float32"
                if args.fp16 and torch.device(args.device).type == "cpu"
                else ""
            )
            warnings.warn(
                f"PrecisionMonitorCallback: step {step} ran no layer output in a 16- or 8-bit "
                f"dtype, so there is nothing to monitor{why}. Train in a low precision (e.g. "
                "MixprecTrainer with precision='bf16-mixed', or bf16=True) to watch it",
                stacklevel=2,
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rows, self._rows = self._rows, {}
        if not rows or not state.is_world_process_zero:
            return
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": state.global_step, **_json_safe(rows)}) + "\n")
        if self.trainer is not None:
            self.trainer.log(dict(rows))  # adds "epoch" and "step" like every HF log row
        else:
            state.log_history.append({**rows, "step": state.global_step})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.detach()


def _scaler_of(optimizer: Any) -> LossScaler | None:
    return optimizer.scaler if isinstance(optimizer, LossScaleOptimizer) else None


def _json_safe(row: dict[str, float]) -> dict[str, float | str]:
    """inf/NaN as strings: JSON has no literal for them."""
    return {k: v if math.isfinite(v) else str(v) for k, v in row.items()}


# -- transformers.Trainer ---------------------------------------------------------------------


_ROUTE = "_mixprec_route"
PRECISION_FILE = "mixprec_precision.json"  # a MixprecTrainer checkpoint's policy


class _Route:
    """What an accelerator was routed to: its precision (read at each call) and the
    wrappers ``prepare`` set up on it."""

    def __init__(self, precision: Callable[[], Precision]) -> None:
        self.precision = precision
        self.optimizers: list[LossScaleOptimizer] = []
        self.models: list[nn.Module] = []  # set up by `prepare` (also as Accelerate returned)
        self.prepare: Callable[..., Any] | None = None  # Accelerate's own, where guarded

    def live(self) -> list[LossScaleOptimizer]:
        """The wrappers still set up (not retired by a later ``setup``)."""
        current = self.precision().optimizers
        return [o for o in self.optimizers if any(o is c for c in current)]


def _route_backward(accelerator: Any, precision: Callable[[], Precision]) -> _Route:
    """Make ``accelerator.backward(loss)`` enter the precision's backward context
    (``Precision.backward_context``) around Accelerate's own backward, which receives the
    scaled loss, and after the last backward of an optimizer step (``sync_gradients``) run
    ``Precision.before_step`` (float8's amax histories shared across the ranks). `precision`
    is read at each call (the Trainer sets its own up after HF built the accelerator).
    Routed once per accelerator: a later call returns the first route."""
    route = accelerator.__dict__.get(_ROUTE)
    if route is not None:
        return route
    route = _Route(precision)
    plain = accelerator.backward

    def backward(loss: torch.Tensor, **kwargs: Any) -> Any:
        current = precision()
        with current.backward_context(loss) as scaled:
            result = plain(scaled, **kwargs)
        if accelerator.sync_gradients:
            current.before_step()
        return result

    accelerator.backward = backward
    setattr(accelerator, _ROUTE, route)
    return route


def tie_quantized_weights(model: nn.Module) -> dict[str, str]:
    """Declare the buffers that quantized layers share as tied weights, the way transformers
    declares them, and return the ``{target: source}`` pairs added.

    A tied embedding and output head quantized together hold one int8/int4 copy (``qweight``
    and its scales); their float ``weight`` entries in the model's tie mapping are gone.
    Undeclared, the shared buffers make ``save_pretrained`` fail (safetensors refuses
    aliased tensors). Declared, the copy under the first name (the embedding's) is saved,
    the others are left out (``_keys_to_ignore_on_save``, so loading a checkpoint back
    re-ties them, without a missing-keys warning), and ``tie_weights`` ties the buffers
    instead of looking for the float weights. Ties to a weight quantization replaced are
    dropped (or, for float weights still sharing a Parameter, moved to one of them), so
    ``tie_weights`` and ``save_pretrained`` work when one side alone was quantized. Models
    that are not a ``PreTrainedModel``, or hold no quantized layer, are left as they are.
    """
    if not isinstance(model, transformers.PreTrainedModel):
        return {}
    names: dict[int, list[str]] = {}
    quantized_paths = set()
    for path, module in model.named_modules(remove_duplicate=False):
        if isinstance(getattr(module, "quantization_mode", None), str):
            quantized_paths.add(path)
            for key, buf in module.named_buffers(recurse=False):
                names.setdefault(id(buf), []).append(f"{path}.{key}" if path else key)
    added = {t: ns[0] for ns in names.values() if len(set(ns)) > 1 for t in dict.fromkeys(ns[1:])}
    if not quantized_paths:
        return {}
    holders: dict[int, list[str]] = {}  # the float Parameters left, by every name holding one
    for name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(name)

    def gone(name: str) -> bool:  # a float weight that quantization replaced
        path, _, key = name.rpartition(".")
        return (
            path in quantized_paths
            and key == "weight"
            and not hasattr(model.get_submodule(path), "weight")
        )

    def kept(mapping: dict[str, str] | None) -> dict[str, str]:
        """The ties left: none to or from a replaced weight, except that float weights
        which still share a Parameter (T5's two embedding tables, once the shared one they
        were tied to is quantized) are tied to the first of them that holds it."""
        out = {}
        for target, source in (mapping or {}).items():
            if gone(target):
                continue
            if gone(source):
                try:
                    names = holders.get(id(model.get_parameter(target)), [])
                except AttributeError:
                    continue
                if not names or names[0] == target:
                    continue
                source = names[0]
            out[target] = source
        return out

    # (tie_weights recomputes its mapping from the declared one by default)
    tied = getattr(model, "_tied_weights_keys", None)
    if isinstance(tied, (list, tuple, set)):  # transformers 4: the tied targets' names
        model._tied_weights_keys = [n for n in tied if not gone(n)] + list(added)
    elif tied is not None or added:  # transformers 5: {target: source}, resolved beside it
        model._tied_weights_keys = {**kept(tied), **added}
    if "all_tied_weights_keys" in model.__dict__:
        model.all_tied_weights_keys = {**kept(model.all_tied_weights_keys), **added}
    if added:
        model._keys_to_ignore_on_save = set(model._keys_to_ignore_on_save or ()) | set(added)
    return added


_ACCELERATE_ENV = "ACCELERATE_MIXED_PRECISION"


def _refuse_hf_precision(training_args: transformers.TrainingArguments | None) -> None:
    """Refuse every HF setting that casts on its own, on top of or instead of the mixprec
    precision: one place owns the precision, so even a setting that agrees with the policy
    (``bf16=True`` with ``"bf16-mixed"``) is refused rather than silently stacked."""
    if training_args is not None:
        for flag in ("fp16", "bf16"):
            if getattr(training_args, flag):
                extra = (
                    " and its GradScaler (scaling on top of mixprec's)" if flag == "fp16" else ""
                )
                raise ValueError(
                    f"TrainingArguments({flag}=True) turns on HF's own autocast{extra}, which "
                    "would run on top of the mixprec policy, even one that agrees with it: "
                    "MixprecTrainer owns the precision. Set TrainingArguments(fp16=False, "
                    "bf16=False) and choose the precision with MixprecTrainer(precision=...)"
                )
        for flag, dtype in (("fp16_full_eval", "float16"), ("bf16_full_eval", "bfloat16")):
            if getattr(training_args, flag):
                raise ValueError(
                    f"TrainingArguments({flag}=True) casts the whole model to {dtype} when "
                    "evaluate() or predict() runs outside train(), and leaves it so: the "
                    "policy's float32 layers and float32 weights would be lost. Drop it: "
                    "evaluation runs under the MixprecTrainer's precision"
                )
    env = os.environ.get(_ACCELERATE_ENV, "no")
    # transformers 5 records the Accelerator's precision in the arguments (taken from the
    # environment); transformers 4 builds its Accelerator from the environment
    chosen = getattr(training_args, "mixed_precision", env)
    if chosen != "no":
        raise ValueError(
            f"HF's Trainer would build its Accelerator with mixed_precision={chosen!r}, taken "
            f"from {_ACCELERATE_ENV}={env!r} in the environment (which `accelerate launch "
            "--mixed_precision` and `accelerate config` set), and autocast on top of the "
            f"mixprec policy: launch with --mixed_precision no or unset {_ACCELERATE_ENV}; "
            "MixprecTrainer(precision=...) chooses the precision"
        )


class MixprecTrainer(transformers.Trainer):
    """``transformers.Trainer`` under a mixprec precision: the model converted by the policy
    (per-layer rules, float32 islands), the optimizer wrapped in a ``LossScaleOptimizer``,
    mixprec's loss scaling (float16), and a scheduler that does not advance on skipped steps.

    ``precision`` is a ``mixprec.Precision`` or any spec it takes (``"bf16-mixed"``, a
    ``PolicyMap``). Everything else is ``transformers.Trainer``'s, without HF's own precision
    settings (HF's autocast would run on top of the policy): ``fp16``, ``bf16``,
    ``fp16_full_eval``, ``bf16_full_eval`` and an ``ACCELERATE_MIXED_PRECISION`` other than
    ``"no"`` in the environment are refused, even where they agree with the policy. An
    optimizer passed in
    ``optimizers=(optimizer, scheduler)`` is wrapped too; build its scheduler on the plain
    optimizer. To combine with another Trainer subclass: ``class T(MixprecTrainer, SFTTrainer)``.

    HF clips ``model.parameters()`` through the accelerator, whose clipping is the
    precision's here: float32 master weights are clipped where they hold the gradients,
    and gradients no optimizer set up here steps (still multiplied by the loss scale) are
    refused by name.
    """

    def __init__(self, *args: Any, precision: Precision | Any, **kwargs: Any) -> None:
        # checked before HF builds its Accelerator (Accelerate refuses to change the
        # precision of the process's AcceleratorState once set)
        _refuse_hf_precision(kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        if self.model is None:
            raise ValueError("MixprecTrainer needs model=... (model_init is not supported)")
        self.precision = precision if isinstance(precision, Precision) else Precision(precision)
        try:
            if self.optimizer is not None:
                self.model, self.optimizer = self.precision.setup(self.model, self.optimizer)
            else:
                self.model = self.precision.setup(self.model)
        except SlowPrecisionError as error:
            raise SlowPrecisionError(_trainer_hint(str(error), precision)) from None
        tie_quantized_weights(self.model)
        self.model_wrapped = self.model
        self._unscaled = False

    def create_optimizer(self, model: nn.Module | None = None) -> Any:
        """HF's optimizer (or the one given), wrapped in the precision's LossScaleOptimizer."""
        optimizer = super().create_optimizer(model)
        if not isinstance(optimizer, LossScaleOptimizer):
            _, optimizer = self.precision.setup(self.model, optimizer)
            self.optimizer = optimizer
        if self.args.max_grad_norm > 0 and self.precision.scaler.enabled:
            stepped = {
                id(optimizer.model_param(p)) for g in optimizer.param_groups for p in g["params"]
            }
            left = [
                name
                for name, p in self.model.named_parameters()
                if p.requires_grad and id(p) not in stepped
            ]
            if left:
                raise ValueError(
                    f"{', '.join(left[:5])}{' ...' if len(left) > 5 else ''} require gradients "
                    "that the optimizer does not step: HF clips model.parameters(), where "
                    "their gradients stay multiplied by the loss scale and would clip the "
                    "others to nothing. Freeze them (requires_grad_(False)), give the "
                    "optimizer all trained parameters, or set max_grad_norm=0"
                )
        return optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """HF's scheduler built on the plain optimizer, stepped only when the optimizer
        stepped (``ReduceLROnPlateau`` and ``GreedyLR`` follow their metric and are left as
        they are: HF steps them after evaluation)."""
        if self.lr_scheduler is None and optimizer is None:
            optimizer = self.optimizer.optimizer
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if not isinstance(scheduler, (SkipAwareScheduler, *_metric_driven())):
            self.lr_scheduler = SkipAwareScheduler(scheduler, self.optimizer)
        return self.lr_scheduler

    def create_accelerator_and_postprocess(self) -> None:
        """HF's accelerator, whose ``backward`` (the one in ``training_step``) runs in the
        precision's backward context: the loss scaled, the compute dtype of a "true" policy
        as torch's default."""
        super().create_accelerator_and_postprocess()
        _route_backward(self.accelerator, lambda: self.precision)
        # HF clips (and measures the norm it logs) with the accelerator's clip over
        # model.parameters(): the precision's, which clips float32 masters where they hold
        # the gradients and refuses gradients no optimizer here unscales (still multiplied
        # by the loss scale, they would dominate the norm and clip the others to nothing)
        self.accelerator.clip_grad_norm_ = self._clip_grad_norm_
        self.accelerator.clip_grad_value_ = self._clip_grad_value_

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """HF's context, with a compiled model's backward traced outside autocast
        (`BackwardOutsideAutocast`), where ``training_step`` runs it, so a float32 rule's
        backward runs in float32 as in eager (graph breaks had left it the model's bfloat16
        autocast). No autocast is added: the converted model's own region runs it and hands
        its outputs back in float32, so a custom loss and evaluation see what they did."""
        stack = contextlib.ExitStack()
        stack.enter_context(super().compute_loss_context_manager())
        stack.enter_context(BackwardOutsideAutocast())
        return stack

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """HF's optimizer and scheduler files, and the policy they belong to (a resume
        checks it: the loss scaler, masters and optimizer state are that policy's)."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            policy = {"policy": self.precision.policy.to_config()}
            write_atomically(Path(output_dir) / PRECISION_FILE, json.dumps(policy, indent=1))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """HF's resume, refused first where the checkpoint was saved under another policy
        (checkpoints written before the policy was kept are taken as they are)."""
        path = Path(resume_from_checkpoint) / PRECISION_FILE
        if path.is_file():
            saved = json.loads(path.read_text())["policy"]
            if resumable_config(saved) != resumable_config(self.precision.policy.to_config()):
                raise ValueError(
                    f"{resume_from_checkpoint} was saved under {config_in_words(saved)}, "
                    f"this run's precision is {self.precision.policy!r}: MixprecTrainer "
                    "resumes a run in the precision that saved it (its loss scaler, masters "
                    "and optimizer state are that precision's). To go on in another "
                    "precision, load the checkpoint's weights "
                    "(AutoModel.from_pretrained(checkpoint)) and train without "
                    "resume_from_checkpoint"
                )
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _clip_grad_norm_(self, params: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        # HF gives model.parameters() (its names lost: the model's are said in errors); with
        # max_grad_norm=0 it still measures the norm it logs (max_norm inf): the gradients
        # the optimizer steps
        if math.isinf(max_norm):
            return self.precision.clip_grad_norm_(self.optimizer, max_norm, norm_type)
        return self.precision.clip_grad_norm_(self.model, max_norm, norm_type)

    def _clip_grad_value_(self, params: Any, clip_value: float) -> None:
        self.precision.clip_grad_value_(params, clip_value)

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """HF's step; after the last micro-batch of an optimizer step, the gradients are
        unscaled (and checked for inf/NaN) so that HF's clipping and grad-norm log see true
        values. The first micro-batch after a step clears the masters' old gradients (HF
        zeroes only the model's)."""
        if self._unscaled:
            self.optimizer.zero_grad()
            self._unscaled = False
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:
            self.optimizer.unscale_()
            self._unscaled = True
        return loss


def _metric_driven() -> tuple[type, ...]:
    """The schedulers HF steps with a metric after evaluation, recognized by type."""
    kinds: tuple[type, ...] = (torch.optim.lr_scheduler.ReduceLROnPlateau,)
    try:
        from transformers.optimization import GreedyLR
    except ImportError:  # (transformers without it)
        return kinds
    return (*kinds, GreedyLR)


def _trainer_hint(message: str, precision: Any) -> str:
    """The SlowPrecisionError's hint, told the way MixprecTrainer takes it."""
    spec = repr(precision) if isinstance(precision, str) else "..."
    how = f"pass MixprecTrainer(precision=Precision({spec}, allow_slow=True))"
    general = "pass allow_slow=True (Precision), allow_slow_precision=True (Trainer)"
    if general in message:
        return message.replace(general, how)
    return f"{message} (MixprecTrainer: {how})"


# -- accelerate -------------------------------------------------------------------------------


def prepare(
    accelerator: Any,
    precision: Precision,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *objects: Any,
) -> tuple[Any, ...]:
    """Set ``model`` and ``optimizer`` up under ``precision`` and ``accelerator`` (built with
    ``mixed_precision="no"``) once; returns ``(model, optimizer, *objects)`` prepared.

    The model is moved to the accelerator's device, converted by the policy and the
    optimizer wrapped (``precision.setup``), then everything goes through
    ``accelerator.prepare``. Schedulers built on the plain optimizer come back as
    Accelerate's schedulers that do not advance on a skipped step (so do those given to
    Accelerate itself, before or after), and the wrapped optimizer (its state, scaler and
    master weights) is registered for ``accelerator.save_state``. A model the accelerator
    compiled traces its backward outside autocast, as eager runs it. The accelerator's
    ``backward`` becomes the precision's (``Precision.backward_context`` around
    Accelerate's own: the loss scaled, the compute dtype of a "true" policy as torch's
    default), so the loop keeps its ``accelerator.backward(loss)``; it clips with
    ``precision.clip_grad_norm_`` or the accelerator's ``clip_grad_norm_`` /
    ``clip_grad_value_`` (which, for this accelerator, are the precision's: they unscale
    first); ``accelerator.unscale_gradients`` is the precision's ``unscale_``, and
    ``accelerator.optimizer_step_was_skipped`` tells a skipped step of the optimizers set up
    here. With gradient accumulation the optimizer's ``step`` and ``zero_grad`` do nothing
    until ``accelerator.sync_gradients``, as Accelerate's own optimizer's.

    Several models on one accelerator: call ``prepare`` once per model with its optimizer,
    all with the same ``precision`` (another Precision is refused: the accelerator's
    backward scales by one scaler).
    """
    from accelerate.scheduler import AcceleratedScheduler

    if accelerator.mixed_precision != "no":
        raise ValueError(
            f"Accelerator(mixed_precision={accelerator.mixed_precision!r}) casts on its own "
            "(and on CPU 'fp16' silently trains in float32): build it with "
            "mixed_precision='no' and let the mixprec precision choose (an Accelerator built "
            f"without mixed_precision= takes {_ACCELERATE_ENV} from the environment, which "
            "`accelerate launch --mixed_precision` and `accelerate config` set)"
        )
    if not isinstance(precision, Precision):
        raise TypeError(
            f"precision must be a mixprec.Precision, got {type(precision).__name__}: "
            "mixprec.Precision('bf16-mixed') or Precision(policy_map)"
        )
    for obj in objects:
        if isinstance(obj, (nn.Module, torch.optim.Optimizer, LossScaleOptimizer)):
            raise ValueError(
                f"prepare() sets up one model and its optimizer; a {type(obj).__name__} among "
                "the other objects would go through accelerator.prepare unconverted by the "
                "policy, its gradients left multiplied by the loss scale: prepare each model "
                "with its optimizer through this function (prepare(accelerator, precision, "
                "model_b, optimizer_b)), with the same Precision"
            )
    route = accelerator.__dict__.get(_ROUTE)
    if route is not None and route.precision() is not precision:
        raise ValueError(
            "this accelerator was prepared with another Precision: its backward scales the "
            "loss by one Precision's scaler, so a second one's gradients would stay scaled. "
            "Prepare every model on an accelerator through one Precision (pass the same "
            "Precision to each prepare() call, one per model and its optimizer)"
        )
    precision.resolve(accelerator.device)
    if route is None and precision.scaler.enabled:
        # prepared before: their gradients would be multiplied by the scale from now on
        earlier = [*getattr(accelerator, "_models", []), *getattr(accelerator, "_optimizers", [])]
        for obj in earlier:
            _refuse_unscaled(obj, precision, "before")
    model = model.to(accelerator.device)  # masters are made on the parameters' device
    model, wrapped = precision.setup(model, optimizer)
    own = route.prepare if route is not None and route.prepare is not None else None
    if route is not None:
        route.models.append(model)  # (Accelerate's prepare calls the guarded prepare_model)
    prepared = (own or accelerator.prepare)(model, wrapped, *objects)
    for scheduler in prepared[2:]:
        if isinstance(scheduler, AcceleratedScheduler):
            if getattr(scheduler.scheduler, "optimizer", None) is not optimizer:
                raise ValueError(
                    "a scheduler passed to prepare() was built on another optimizer: build it "
                    "on the optimizer given here (before wrapping)"
                )
    if _compiled(prepared[0]):
        _BackwardOutsideAutocast().register(prepared[0])
    accelerator.register_for_checkpointing(wrapped)
    # as Accelerate's own optimizer: step and zero_grad wait for the window's last backward
    wrapped.step_gate = lambda: accelerator.sync_gradients
    if route is None:
        route = _route_backward(accelerator, lambda: precision)
        _route_accelerator(accelerator, precision, route)
    if not any(wrapped is o for o in route.optimizers):
        route.optimizers.append(wrapped)
    route.models += [model, prepared[0]]  # (given again: the model is not refused)
    _follow_wrappers(accelerator, precision, route)
    return tuple(prepared)


def _follow_wrappers(accelerator: Any, precision: Precision, route: _Route) -> None:
    """Point each of the accelerator's schedulers built on an optimizer wrapped here (the
    one given to `prepare`, or what ``setup`` converted it into), prepared with it or on
    its own, before or after, at its wrapper: Accelerate knows no ``LossScaleOptimizer``,
    so a scheduler prepared alone read no optimizer's skip and advanced on skipped steps."""
    from accelerate.scheduler import AcceleratedScheduler

    for scheduler in getattr(accelerator, "_schedulers", ()):
        if not isinstance(scheduler, AcceleratedScheduler):
            continue
        optimizer = getattr(scheduler.scheduler, "optimizer", None)
        wrapper = precision._wrapper_of(optimizer) if optimizer is not None else None
        if wrapper is not None and any(wrapper is o for o in route.live()):
            scheduler.optimizers = [wrapper]  # its skip check reads step_was_skipped


def _compiled(model: nn.Module) -> bool:
    """Whether `model` or a module in it is compiled (``torch.compile``, as Accelerate's
    dynamo plugin compiles, or ``Module.compile``)."""
    return any(
        isinstance(m, torch._dynamo.eval_frame.OptimizedModule) or "_compiled_call_impl" in vars(m)
        for m in model.modules()
    )


class _BackwardOutsideAutocast:
    """Forward hooks that make torch.compile trace a compiled model's backward outside
    autocast while the model's forward runs, as eager runs it: an Accelerate loop calls
    ``accelerator.backward`` after the forward, outside autocast. Torch's default traces
    it in the autocast around each compiled graph, which after a graph break inside the
    model is its region's, so a float32 rule's backward ran in bfloat16. Hooks on the model
    the loop calls run outside its compiled code. Each thread keeps its own (a forward is
    not re-entered: one left open by an interrupt, which runs no hook, is closed at the
    thread's next forward)."""

    def __init__(self) -> None:
        self.open = threading.local()

    def register(self, model: nn.Module) -> None:
        """Hook `model` (a torch without the setting traces its backward as it does)."""
        from torch._functorch import config

        if hasattr(config, "backward_pass_autocast"):
            model.register_forward_pre_hook(self.enter)
            model.register_forward_hook(self.leave, always_call=True)

    def enter(self, module: nn.Module, args: Any) -> None:
        """Before the forward: torch traces backwards outside autocast until `leave`."""
        if torch.compiler.is_compiling():
            return
        self.leave(module, args, None)
        self.open.context = BackwardOutsideAutocast()
        self.open.context.__enter__()

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        """After the forward (also one that raised): the setting as it was before."""
        context = getattr(self.open, "context", None)
        if context is not None and not torch.compiler.is_compiling():
            self.open.context = None
            context.__exit__(None, None, None)


def _route_accelerator(accelerator: Any, precision: Precision, route: _Route) -> None:
    """Accelerate's own clipping and ``unscale_gradients`` unscale only its GradScaler's
    gradients: on mixprec's they left the scaled ones. This accelerator's go through the
    precision, which unscales first (and clips float32 masters where they hold the
    gradients); its ``optimizer_step_was_skipped`` also reads the wrappers set up here."""
    from accelerate.optimizer import AcceleratedOptimizer

    accelerator.clip_grad_norm_ = precision.clip_grad_norm_
    accelerator.clip_grad_value_ = precision.clip_grad_value_
    route.prepare = accelerator.prepare
    # this accelerator's backward scales every loss: a model trained or an optimizer stepped
    # past the precision would step gradients multiplied by the loss scale
    for name in ("prepare", "prepare_model", "prepare_optimizer", "prepare_scheduler"):
        method = getattr(accelerator, name)
        setattr(accelerator, name, _guarded(method, accelerator, precision, route))

    def unscale_gradients(optimizer: Any = None) -> None:
        if optimizer is None:
            precision.unscale_(*route.live())
            return
        for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            if isinstance(opt, LossScaleOptimizer) or precision._wrapper_of(opt) is not None:
                precision.unscale_(opt)
            # (another optimizer: nothing scaled its gradients, mixed_precision="no")

    accelerator.unscale_gradients = unscale_gradients
    accelerator.__class__ = _skip_aware(type(accelerator))


def _guarded(
    prepare: Callable[..., Any], accelerator: Any, precision: Precision, route: _Route
) -> Callable:
    """Accelerate's ``prepare`` (or ``prepare_model``, ``prepare_optimizer``,
    ``prepare_scheduler``) refusing what would train on gradients the routed backward scaled
    (`_refuse_unscaled`), and pointing the schedulers of wrapped optimizers at their wrappers
    (`_follow_wrappers`)."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        for obj in (*args, *kwargs.values()):
            if not any(obj is m for m in route.models):
                _refuse_unscaled(obj, precision, "after")
        prepared = prepare(*args, **kwargs)
        _follow_wrappers(accelerator, precision, route)
        return prepared

    return guarded


def _refuse_unscaled(obj: Any, precision: Precision, when: str) -> None:
    """Refuse ``obj`` given to Accelerate directly, ``when`` ("before", "after") mixprec's
    ``prepare`` routed the accelerator's backward through a loss-scaling ``precision``: a
    model with trainable parameters or a torch optimizer would train on gradients still
    multiplied by the scale."""
    from accelerate.optimizer import AcceleratedOptimizer

    inner = obj.optimizer if isinstance(obj, AcceleratedOptimizer) else obj
    trained = isinstance(obj, nn.Module) and any(p.requires_grad for p in obj.parameters())
    if not precision.scaler.enabled or not (trained or isinstance(inner, torch.optim.Optimizer)):
        return
    raise ValueError(
        f"a {type(inner).__name__} given to accelerator.prepare directly, {when} mixprec's "
        f"prepare() made this accelerator's backward multiply every loss by the loss scale "
        f"(a {precision.policy.name} Precision), would train on gradients still multiplied "
        "by it. Set up each trained model with its optimizer through mixprec's "
        "prepare(accelerator, precision, model, optimizer), with the same Precision; a "
        "model that is not trained (a teacher, a reference) goes through accelerator.prepare "
        "once its parameters are frozen (model.requires_grad_(False))"
    )


_SKIP_AWARE: dict[type, type] = {}


def _skip_aware(cls: type) -> type:
    """``cls`` with an ``optimizer_step_was_skipped`` (a property, so not settable on the
    instance) that also reads the wrappers ``prepare`` set up on the accelerator."""
    if getattr(cls, "_mixprec_skip_aware", False):
        return cls
    if cls not in _SKIP_AWARE:

        def optimizer_step_was_skipped(self: Any) -> bool:
            if super(sub, self).optimizer_step_was_skipped:
                return True
            route = self.__dict__.get(_ROUTE)
            return route is not None and any(o.step_was_skipped for o in route.live())

        sub = type(
            cls.__name__,
            (cls,),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "_mixprec_skip_aware": True,
                "optimizer_step_was_skipped": property(
                    optimizer_step_was_skipped, doc=cls.optimizer_step_was_skipped.__doc__
                ),
            },
        )
        _SKIP_AWARE[cls] = sub
    return _SKIP_AWARE[cls]
