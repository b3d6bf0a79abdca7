"""mixprec inside a Lightning ``Trainer``: a precision plugin and a PrecisionMonitor callback.

::

    import pytorch_lightning as pl
    from mixprec import PolicyMap
    from mixprec.integrations.lightning import MixprecPrecision, PrecisionMonitorCallback

    plugin = MixprecPrecision(PolicyMap("bf16-mixed", {"head": "32-true"}))
    trainer = pl.Trainer(plugins=[plugin], callbacks=[PrecisionMonitorCallback(every_n_steps=50)])

The plugin is ``mixprec.Precision`` at each point Lightning hands it (docs/lightning.md):
``convert_module`` checks the policy on the strategy's device, raising rather than switching
precision as Lightning does (``16-mixed`` to ``bf16-mixed`` on CPU), and converts the module
before any DDP wrapping; ``connect`` wraps each optimizer in a ``LossScaleOptimizer`` sharing
the plugin's scaler and each step-interval LR scheduler in a ``SkipAwareScheduler`` (Lightning
steps its schedulers whether or not the optimizer stepped; an epoch's step follows the
epoch, whatever its last batch did); ``backward`` runs in
``Precision.backward_context``, the backward of every mixprec loop; ``optimizer_step`` runs
the closure and ``Precision.before_step``, unscales, runs Lightning's hooks and clipping on
the unscaled gradients, then steps or skips; ``state_dict`` holds the scaler and each
optimizer's masters and compensation state (and a low-bit optimizer's own state, which
Lightning does not hold), so a resumed run continues bit for bit. Each
method's docstring says the rest.

Lightning is an optional dependency (the ``lightning`` extra: ``pip install
'pytorch-lightning>=2.6,<2.7' 'torch==2.13.0'``): this module imports ``pytorch_lightning``;
``import mixprec`` and ``import mixprec.integrations`` do not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

try:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import BaseFinetuning
    from pytorch_lightning.core.optimizer import LightningOptimizer
    from pytorch_lightning.plugins.precision import Precision as LightningPrecision
    from pytorch_lightning.utilities.types import LRSchedulerConfig
except ImportError as err:  # pragma: no cover - the extra is installed wherever tests run
    raise ImportError(
        "mixprec.integrations.lightning needs pytorch-lightning 2.6: "
        "pip install 'pytorch-lightning>=2.6,<2.7' 'torch==2.13.0' (the lightning extra: -e "
        "'.[lightning]' in a clone)"
    ) from err

from mixprec.doctor.monitor import PrecisionMonitor
from mixprec.hardware import DeviceInfo, device_of
from mixprec.optim import LossScaleOptimizer, SkipAwareScheduler
from mixprec.optim.scaling import LossScaler
from mixprec.policy.map import PolicyMap, config_in_words, resumable_config
from mixprec.precision import Precision

__all__ = [
    "MixprecPrecision",
    "PrecisionMonitorCallback",
]


def _clears_model_grads_too(optimizer: torch.optim.Optimizer, lso: LossScaleOptimizer) -> None:
    """Make ``optimizer.zero_grad()`` (what Lightning calls: it keeps the torch optimizer)
    clear the model's 16-bit gradients too, where it steps float32 masters: it clears the
    masters' alone, so a backward's gradients left on the model (a GAN's generator loss
    reaching the discriminator, a skipped micro-batch) were added to the next step's."""
    own = optimizer.zero_grad  # (the class's, bound: the wrapper's own call goes there too)

    def zero_grad(set_to_none: bool = True) -> None:
        own(set_to_none=set_to_none)
        lso.zero_model_grads(set_to_none)

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]


def _toggles_model_params_too(module: nn.Module, wrappers: list[LossScaleOptimizer]) -> None:
    """Make the LightningModule's ``toggle_optimizer`` / ``untoggle_optimizer`` freeze and
    unfreeze the model's parameters where the optimizers step float32 masters: Lightning
    sets ``requires_grad`` on what the optimizers' groups hold, the masters, so a GAN's
    generator loss left gradients on the discriminator, which its next step added (0.12
    off after two steps). Each master takes its parameter's flag before the call (so that
    Lightning records and restores the user's: a layer frozen after setup stays frozen),
    each parameter its master's after it."""
    for name in ("toggle_optimizer", "untoggle_optimizer"):
        own = getattr(module, name, None)
        if own is None:
            continue

        def call(optimizer: Any, _own: Callable[[Any], None] = own) -> None:
            pairs = [pair for lso in wrappers for pair in lso.master_params.items()]
            for param, master in pairs:
                master.requires_grad_(param.requires_grad)
            _own(optimizer)
            for param, master in pairs:
                param.requires_grad_(master.requires_grad)

        object.__setattr__(module, name, call)


def _entered_device() -> torch.device | None:
    """The device of the innermost ``torch.device`` context entered (Lightning's strategy
    enters its root device around the plugin's init contexts), or None where none is, or
    it is ``meta`` (no device to judge a precision on)."""
    try:  # (private torch API: without it, the plugin asks for the device instead)
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._device import DeviceContext
    except ImportError:  # pragma: no cover - torch 2.13 has both
        return None
    # (the innermost one's device as entered: torch.get_default_device would allocate
    # on it to learn an index)
    entered = [m for m in _get_current_function_mode_stack() if isinstance(m, DeviceContext)]
    if not entered:
        return None
    device = torch.device(entered[-1].device)
    return None if device.type == "meta" else device


def _refuse_finetuning_callbacks(module: nn.Module) -> None:
    """Refuse Lightning's finetuning callbacks where the optimizers step float32 masters:
    they name the optimizers' parameters by the module's, which the masters are not (a
    ``KeyError`` at the first epoch)."""
    trainer = getattr(module, "_trainer", None)
    callbacks = getattr(trainer, "callbacks", [])
    found = [type(c).__name__ for c in callbacks if isinstance(c, BaseFinetuning)]
    if found:
        raise ValueError(
            f"{found[0]} with float32 master weights: Lightning's finetuning callbacks map the "
            "optimizer's parameters to the module's by name, and the optimizer steps the "
            "masters. Train this in a mixed policy ('bf16-mixed'), or in bf16-true with "
            "compensation='kahan' instead of masters"
        )


def _calling(zero_grad: Any) -> Any:
    """A ``zero_grad`` method that calls the torch optimizer's (which clears the model's
    gradients too, `_clears_model_grads_too`)."""

    def method(_self: Any, set_to_none: bool = True) -> None:
        zero_grad(set_to_none=set_to_none)

    return method


class MixprecPrecision(LightningPrecision):
    """A Lightning precision plugin running mixprec's policies and loss scaling.

    ``pl.Trainer(plugins=[MixprecPrecision("bf16-mixed")])``, without ``precision=``
    (Lightning refuses both; given inside a strategy instance, the plugin refuses a flag
    Lightning would ignore).

    Args:
        spec: any mixprec spec (``"bf16-mixed"``, ``"16-mixed"``, ``"16-true"``,
            ``"bf16-true"``, ``"32-true"``, Keras and jmp names, ``"auto"``), a ``Policy``, a
            ``PolicyMap`` (per-layer rules), or a ``mixprec.Precision`` (then the keyword
            arguments stay at their defaults: the Precision carries them).
        scaler, allow_slow, master_weights, compensation, device_info: as for
            ``mixprec.Precision``: ``allow_slow`` accepts a precision far slower than float32
            on the strategy's device (float16/bfloat16 on most CPUs), ``master_weights`` and
            ``compensation`` choose how 16-bit ``*-true`` weights are updated,
            ``device_info`` judges a described device instead of the real one.

    The mixprec ``Precision`` doing the work is ``.mixprec``; ``.precision`` is the policy's
    name in Lightning's vocabulary (``trainer.precision`` shows it).
    """

    def __init__(
        self,
        spec: Any = "32-true",
        *,
        scaler: LossScaler | str | float | None = None,
        allow_slow: bool = False,
        master_weights: bool | None = None,
        compensation: str | None = None,
        device_info: DeviceInfo | None = None,
    ) -> None:
        if isinstance(spec, Precision):
            given = {
                "scaler": scaler is not None,
                "allow_slow": allow_slow is not False,
                "master_weights": master_weights is not None,
                "compensation": compensation is not None,
                "device_info": device_info is not None,
            }
            extra = sorted(name for name, set_ in given.items() if set_)
            if extra:
                raise ValueError(
                    f"MixprecPrecision(mixprec.Precision(...)) takes its settings from that "
                    f"Precision; pass {', '.join(extra)} to mixprec.Precision instead"
                )
            self.mixprec = spec
        else:
            self.mixprec = Precision(
                spec,
                scaler=scaler,
                allow_slow=allow_slow,
                master_weights=master_weights,
                compensation=compensation,
                device_info=device_info,
            )
        self._module: nn.Module | None = None
        self._wrappers: dict[torch.optim.Optimizer, LossScaleOptimizer] = {}
        # the list of LightningOptimizers given their zero_grad (`_clear_through_...`)
        self._cleared_through: list[Any] | None = None
        # the device "auto" was resolved on at an init context (`_resolve_for_init`)
        self._auto_resolved_on: torch.device | None = None
        # "auto" is resolved at convert_module (or an init context before), on the
        # strategy's device
        name = self.mixprec.policy.default.name if self.mixprec.has_policy else "auto"
        self.precision = name  # type: ignore[assignment]

    @property
    def policy(self) -> PolicyMap:
        """The policy map in force."""
        return self.mixprec.policy

    @property
    def scaler(self) -> LossScaler:
        """The loss scaler all optimizers share."""
        return self.mixprec.scaler

    @property
    def optimizers(self) -> list[LossScaleOptimizer]:
        """The wrappers of the run's optimizers, in Lightning's order."""
        return list(self._wrappers.values())

    # -- setup ------------------------------------------------------------------------------

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Check the policy on the strategy's device (raising mixprec's ``PrecisionError``
        or ``SlowPrecisionError``), then convert ``module`` in place with ``mixprec.apply``."""
        _refuse_precision_flag(module, self)
        device = _strategy_device(module)
        picked = self._auto_resolved_on
        if picked is not None and picked.type != device.type:
            raise ValueError(
                f"MixprecPrecision('auto') picked its policy on {picked}, the device entered "
                f"around its init context, but Lightning trains on {device}: name the device, "
                f"MixprecPrecision(mixprec.Precision('auto', device={device.type!r}))"
            )
        if self.mixprec.device is None:
            self.mixprec.device = device
        elif self.mixprec.device.type != device.type:
            raise ValueError(
                f"the mixprec.Precision given to MixprecPrecision is for {self.mixprec.device}, "
                f"but Lightning trains on {device}: build it without device=, or with "
                f"device={device.type!r}"
            )
        self.mixprec.setup(module)
        self._module = module
        self.precision = self.mixprec.policy.default.name  # type: ignore[assignment]
        return module

    def connect(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Wrap the optimizers in ``LossScaleOptimizer``s (Lightning keeps the torch
        optimizers; the plugin steps them) and the schedulers in ``SkipAwareScheduler``s."""
        if self._module is None:
            raise RuntimeError(
                "MixprecPrecision.connect() before convert_module(): this strategy does not "
                "let a precision plugin convert the model (FSDP and DeepSpeed accept only "
                "their own plugins); use Lightning's default or DDP strategy"
            )
        wrapped = self.mixprec.setup(self._module, *optimizers) if optimizers else ()
        self._wrappers = dict(zip(optimizers, wrapped[1:], strict=True))
        mastered = [lso for lso in self._wrappers.values() if lso.master_params]
        for optimizer, lso in self._wrappers.items():
            if lso in mastered:
                _clears_model_grads_too(optimizer, lso)
        if mastered:
            _refuse_finetuning_callbacks(self._module)
            _toggles_model_params_too(self._module, mastered)
        return model, optimizers, [self._skip_aware(config) for config in lr_schedulers]

    def _skip_aware(self, config: Any) -> Any:
        scheduler = config.scheduler
        if isinstance(scheduler, SkipAwareScheduler):
            scheduler = scheduler.scheduler
        lso = self._wrappers.get(getattr(scheduler, "optimizer", None))  # type: ignore[arg-type]
        # Under automatic optimization an epoch-interval scheduler stays as it is (it steps
        # once per epoch trained, as mixprec's Trainer steps it). Under manual optimization
        # Lightning ignores the interval: the user steps the scheduler, usually after each
        # step, and a wrapped one advances when a step was taken since its last
        manual = self._module is not None and not getattr(
            self._module, "automatic_optimization", True
        )
        if lso is None or not isinstance(config, LRSchedulerConfig):
            return config
        if config.interval != "step" and not manual:
            return config
        return dataclasses.replace(config, scheduler=SkipAwareScheduler(scheduler, lso))

    def _wrapper(self, optimizer: Any) -> LossScaleOptimizer:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        lso = self._wrappers.get(optimizer)
        if lso is None:
            raise ValueError(
                f"this {type(optimizer).__name__} is not one of the optimizers "
                f"configure_optimizers() returned, which MixprecPrecision set up"
            )
        return lso

    # -- contexts ---------------------------------------------------------------------------

    def forward_context(self) -> AbstractContextManager[Any]:
        """mixprec's forward context: autocast for mixed policies, the compute dtype as
        torch's default for "true" ones. Lightning's train/val/test/predict step contexts
        all enter it. Its autocast keeps no cache of weight casts, as Lightning's own
        plugin's: under manual optimization the optimizer steps inside it, and a forward
        after the step would read the cached casts of the old weights. Under automatic
        optimization Lightning runs the backward after the context, outside autocast, and a
        compiled model traces its backward there too, as eager runs it (a float32 rule's
        backward in float32); a manual optimization's backward runs inside the context, and
        torch traces it as its setting says."""
        automatic = getattr(self._module, "automatic_optimization", True)
        return self.mixprec.forward_context(cache_enabled=False, backward_after=automatic)

    def module_init_context(self) -> AbstractContextManager[Any]:
        """Parameters created inside get the policy's param dtype (``Trainer.init_module``,
        ``configure_model``). Under ``"auto"`` the policy is picked here, before
        ``convert_module``, on the device the strategy entered for this context (its root
        device); a strategy entering none (or ``meta``) is refused, saying how to name it."""
        self._resolve_for_init()
        return self.mixprec.init_module()

    def tensor_init_context(self) -> AbstractContextManager[Any]:
        """As ``module_init_context``."""
        self._resolve_for_init()
        return self.mixprec.init_module()

    def _resolve_for_init(self) -> None:
        """Pick ``"auto"``'s policy on the device Lightning builds the model on: a plugin
        is not shown the strategy, but the strategy's ``tensor_init_context`` enters its
        root device (a ``torch.device`` context) before calling the plugin's."""
        if self.mixprec.has_policy:
            return
        device = _entered_device()
        if device is None:
            raise RuntimeError(
                "MixprecPrecision('auto') picks its policy on the device Lightning trains on, "
                "and this init context was entered without one (outside Trainer.init_module, "
                "or under a strategy that builds on 'meta' or enters no device): name the "
                "device, MixprecPrecision(mixprec.Precision('auto', device='cuda')), or the "
                "policy, MixprecPrecision('bf16-mixed')"
            )
        # (the device itself stays unset: convert_module takes the strategy's, whose index
        # a spawned DDP process may not share with this one's; it checks the type agrees.
        # The scaler is built on the CPU, as outside the context: setup moves it.)
        with torch.device("cpu"):
            self.mixprec.resolve(device)
        self._auto_resolved_on = device
        self.precision = self.mixprec.policy.default.name  # type: ignore[assignment]

    def convert_input(self, data: Any) -> Any:
        """Floating tensors of a batch to the compute dtype of a "true" policy."""
        return self.mixprec.convert_input(data)

    # -- the step ---------------------------------------------------------------------------

    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: Any,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """``LightningModule.backward`` of the scaled loss inside the precision's one backward
        context (``Precision.backward_context``: under a "true" policy the compute dtype as
        torch's default, as in the forward, for activation-checkpointed blocks). Lightning's
        ``on_before_backward`` hooks see the loss unscaled."""
        self._clear_through_lightning_optimizers(model)
        with self.mixprec.backward_context(tensor) as scaled:
            super().backward(scaled, model, optimizer, *args, **kwargs)

    def _clear_through_lightning_optimizers(self, model: Any) -> None:
        """Give the ``LightningOptimizer``s of optimizers stepping float32 masters the
        ``zero_grad`` that clears the model's gradients too (`_clears_model_grads_too`):
        Lightning makes them after `connect`, each of a class of its own whose ``zero_grad``
        is the torch optimizer's class's (what ``opt.zero_grad()`` calls in manual
        optimization). Once, at the first backward, when they exist."""
        strategy = getattr(getattr(model, "_trainer", None), "strategy", None)
        wrappers = getattr(strategy, "_lightning_optimizers", None)
        if not wrappers or wrappers is self._cleared_through:  # (a step's backward: done)
            return
        self._cleared_through = wrappers
        for wrapper in wrappers:
            lso = self._wrappers.get(getattr(wrapper, "optimizer", None))  # type: ignore[arg-type]
            if lso is None or not lso.master_params or "zero_grad" in type(wrapper).__dict__:
                continue
            type(wrapper).zero_grad = _calling(wrapper.optimizer.zero_grad)  # type: ignore[method-assign]

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure, then ``Precision.before_step`` (the formats' per-step work: float8's
        amax histories shared across the ranks), unscale, run the ``on_before_optimizer_step``
        hooks and clipping, then step or skip on inf/NaN and update the scale. Returns the
        closure's result."""
        if kwargs:
            raise TypeError(
                f"MixprecPrecision steps optimizers without arguments, got {sorted(kwargs)}"
            )
        lso = self._wrapper(optimizer)
        if lso.needs_closure:
            raise TypeError(
                f"{type(lso.optimizer).__name__} re-evaluates the loss inside step(), which a "
                f"loss-scaled step cannot skip half-way; MixprecPrecision steps optimizers that "
                f"take no closure (Adam, AdamW, SGD, ...)"
            )
        result = closure()
        if result is None and model.automatic_optimization:
            return None  # training_step returned None: Lightning skips the batch, no backward
        self.mixprec.before_step()  # the formats' work (float8's amax histories shared)
        lso.unscale_()
        self._after_closure(model, optimizer)  # Lightning's hooks, then clip_gradients
        lso.step()
        return result

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        """Clip the unscaled gradients (float32 masters' where they exist) by total norm."""
        self.mixprec.clip_grad_norm_(self._wrapper(optimizer), clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        """Clamp the unscaled gradients (float32 masters' where they exist)."""
        self.mixprec.clip_grad_value_(self._wrapper(optimizer), clip_val)

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The policy, the scaler, and per optimizer its float32 masters and compensation
        state; and the state of the optimizer that steps where it is not the one Lightning
        holds and saves (a low-bit optimizer converted from it, ``optimizer_states=``)."""
        optimizers = []
        for given, lso in self._wrappers.items():
            state = lso.state_dict()
            if lso.optimizer is given:  # (Lightning saves it)
                del state["optimizer"]
            optimizers.append(state)
        return {"precision": self.mixprec.state_dict(), "optimizers": optimizers}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint another precision plugin saved (Lightning restores this
        plugin's state only where the checkpoint holds it, so a foreign one went on
        silently, its scaler fresh). One without any plugin state, as Lightning's default
        32-true writes, resumes under a 32-true policy."""
        if type(self).__qualname__ in checkpoint or not self._fitting():
            return  # (an evaluation takes the weights only: any precision may evaluate them)
        others = sorted(k for k in checkpoint if k in _plugin_state_keys())
        plain = resumable_config(PolicyMap("32-true").to_config())
        if not others and resumable_config(self.mixprec.policy.to_config()) == plain:
            return
        saved_by = (
            f"another precision plugin ({', '.join(others)})"
            if others
            else "Lightning's default precision (32-true) or another plugin"
        )
        raise ValueError(
            f"the checkpoint holds no {type(self).__qualname__} state: it was saved by "
            f"{saved_by}, and this run's precision is {self.mixprec.policy!r}. "
            "MixprecPrecision resumes the runs it saved (its loss scaler, masters and "
            "optimizer state are that precision's). To go on under it, load the checkpoint's "
            "weights into the model (model.load_state_dict(torch.load(path)['state_dict'])) "
            "and fit without ckpt_path"
        )

    def _fitting(self) -> bool:
        """Whether the trainer this plugin serves is fitting (or none is known yet)."""
        trainer = getattr(getattr(self, "_module", None), "_trainer", None)
        return trainer is None or trainer.state.fn == "fit"

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the scaler, each optimizer's masters and a converted optimizer's state;
        Lightning restores the optimizers it holds afterwards. Lightning calls this for an
        evaluation from a checkpoint too (``trainer.test(ckpt_path=...)``), which takes the
        weights only: nothing is restored then, under any precision."""
        if not self._fitting():
            return
        if not isinstance(state_dict, Mapping) or not {"precision", "optimizers"} <= set(
            state_dict
        ):
            keys = sorted(state_dict) if isinstance(state_dict, Mapping) else state_dict
            raise ValueError(
                f"not a MixprecPrecision state (got {keys}): the checkpoint was saved by "
                f"another precision plugin"
            )
        saved_policy = state_dict["precision"].get("policy")
        # (compared as configs: rebuilding the saved map would import its type rules' classes,
        # which a class defined in a function or a script cannot be)
        if saved_policy is not None and resumable_config(saved_policy) != resumable_config(
            self.mixprec.policy.to_config()
        ):
            raise ValueError(
                f"the checkpoint was saved under {config_in_words(saved_policy)}, this run's "
                f"precision is {self.mixprec.policy!r}: MixprecPrecision resumes a run in the "
                "precision that saved it (its loss scaler, masters and optimizer state are "
                "that precision's). To go on in another precision, load the checkpoint's "
                "weights into the model (model.load_state_dict(torch.load(path)['state_dict'])) "
                "and fit without ckpt_path"
            )
        saved = state_dict["optimizers"]
        if saved and len(saved) != len(self._wrappers):
            raise ValueError(
                f"the checkpoint holds the mixprec state of {len(saved)} optimizers, this run "
                f"has {len(self._wrappers)}"
            )
        self.mixprec.load_state_dict(state_dict["precision"])
        for lso, state in zip(self._wrappers.values(), saved, strict=False):
            # (a converted optimizer's own state, saved here; else Lightning restores it)
            lso.load_state_dict({"optimizer": lso.optimizer.state_dict(), **state})

    def __repr__(self) -> str:
        return f"MixprecPrecision({self.mixprec!r})"


def _plugin_state_keys() -> set[str]:
    """The keys under which Lightning's own precision plugins save their state (their class
    names), and its older checkpoints' scaler key."""
    return {
        cls.__qualname__
        for cls in vars(pl.plugins.precision).values()
        if isinstance(cls, type) and issubclass(cls, LightningPrecision)
    } | {"native_amp_scaling_state"}


def _strategy_device(module: nn.Module) -> torch.device:
    """The device Lightning trains ``module`` on: the strategy's root device (the model may
    not be moved there yet), else the module's."""
    if isinstance(module, pl.LightningModule):
        try:
            return module.trainer.strategy.root_device
        except RuntimeError:  # not attached to a Trainer
            pass
    return device_of(module)


def _refuse_precision_flag(module: nn.Module, plugin: MixprecPrecision) -> None:
    """Refuse a ``precision=`` flag given beside a plugin that came in ``strategy=``.

    Lightning refuses ``precision=`` with ``plugins=[MixprecPrecision(...)]`` ("Choose
    one"), but a precision plugin inside a strategy instance
    (``DDPStrategy(precision_plugin=...)``) silently wins over the flag. Lightning records
    the flag as "32-true" when none is given, so only that value passes (it is also what an
    explicit ``precision="32-true"`` records, and cannot be told apart)."""
    trainer = getattr(module, "_trainer", None)  # a LightningModule's, None outside a Trainer
    if not isinstance(trainer, pl.Trainer):
        return
    flag = trainer._accelerator_connector._precision_flag
    if flag != "32-true":
        raise ValueError(
            f"Trainer(precision={flag!r}) would be ignored: the strategy's precision plugin "
            f"{plugin!r} sets the precision. Choose one: leave precision= out, or give the "
            "strategy no precision_plugin"
        )


class PrecisionMonitorCallback(pl.Callback):
    """mixprec's ``PrecisionMonitor`` as a Lightning callback: per-layer amax and underflow
    of low-precision outputs and gradients every ``every_n_steps`` optimizer steps, early
    warnings, and the numbers sent to the trainer's loggers (``logger.log_metrics``).

    Args:
        monitor: a configured ``PrecisionMonitor``; or leave it out and pass its keyword
            arguments (``every_n_steps``, ``headroom``, ``skip_patience``, ...) here.

    The loss scaler's numbers (scale, skipped steps) come along when the trainer runs a
    ``MixprecPrecision``. ``.warnings`` are the warnings raised (as on the Hugging Face
    callback); ``.monitor`` holds the history too.
    """

    def __init__(self, monitor: PrecisionMonitor | None = None, **kwargs: Any) -> None:
        if monitor is not None and kwargs:
            raise ValueError(
                f"pass either a PrecisionMonitor or its arguments, not both (got {sorted(kwargs)})"
            )
        if monitor is not None and not isinstance(monitor, PrecisionMonitor):
            raise TypeError(f"monitor must be a PrecisionMonitor, got {type(monitor).__name__}")
        self.monitor = monitor if monitor is not None else PrecisionMonitor(**kwargs)

    @property
    def warnings(self) -> list[str]:
        """The warnings raised so far, each naming its layer."""
        return self.monitor.warnings

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.monitor.attach(pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.monitor.start_step(trainer.global_step)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # every micro-batch of this step has run forward and backward
        step = trainer.global_step
        plugin = trainer.precision_plugin
        scaler = plugin.scaler if isinstance(plugin, MixprecPrecision) else None
        metrics = self.monitor.end_step(step, scaler=scaler)
        if metrics and self.monitor.log_fn is None and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.monitor.pause()  # (a validation may fall between a step's micro-batches)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.monitor.unpause()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.monitor.detach()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.monitor.detach()  # (and no pause left by a validation that raised)
        self.monitor.unpause()
