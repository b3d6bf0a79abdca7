"""``Precision``: one object that binds a policy, a loss scaler and a device for any loop.

::

    precision = mixprec.Precision("bf16-mixed")
    model, optimizer = precision.setup(model, optimizer)
    for x, y in data:
        optimizer.zero_grad()
        precision.backward(loss_fn(model(x), y))
        precision.clip_grad_norm_(model, 1.0)     # optional; unscales first
        precision.step(optimizer)                 # False when an overflow skipped the step

The Trainer, the benchmark and the doctor all go through this class, so it adds nothing per
step beyond what the scaler needs: a scaled backward, one fused unscale/check, one read of
the overflow flag, and the step.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from mixprec.activations import ActivationsSpec, as_rules, check_device, installed
from mixprec.activations import wrapped as wrapped_activations
from mixprec.convert import (
    apply,
    cast_floating,
    default_dtype,
    needs_default_dtype,
    warn_unmatched,
)
from mixprec.eager import backward_outside_autocast
from mixprec.errors import caller_level
from mixprec.formats.registry import StepWork, before_step, step_work
from mixprec.hardware import (
    DeviceInfo,
    Support,
    check,
    default_device,
    detect,
    device_of,
    parse_device,
    resolve_policy,
)
from mixprec.optim import (
    LossScaleOptimizer,
    backward_context,
    backward_dtype,
    convert_for,
    joint_step,
    scale_for_backward,
    warn_if_foreign,
)
from mixprec.optim.compensated import check_compensation
from mixprec.optim.scaling import LossScaler, as_loss_scaler
from mixprec.optim.states import LowBitOptimizer, parse_state_format
from mixprec.policy import is_auto
from mixprec.policy.map import PolicyMap, as_map

__all__ = ["BackwardOutsideAutocast", "Precision"]

ParamsLike = (
    nn.Module | LossScaleOptimizer | torch.optim.Optimizer | torch.Tensor | Iterable[torch.Tensor]
)


# the parameter names of mixprec's LoRA adapters (`mixprec.quantize.enable_lora`)
_ADAPTERS = frozenset({"lora_A", "lora_B"})


class BackwardOutsideAutocast:
    """While entered (outside compiled code), torch.compile traces a compiled model's
    backward outside autocast, as eager runs it: for a forward whose backward runs after it
    (`ForwardAutocast` adds the autocast; a caller whose model's own region runs it, as a
    converted model's root does, enters this alone). Restored on exit, whatever raised; an
    object entered again while entered restores each entry's setting on its own exit."""

    __slots__ = ("entered",)

    def __init__(self) -> None:
        self.entered = _Entries()  # (of `Callable[[], None] | None`, per thread)

    def __enter__(self) -> None:
        compiling = torch.compiler.is_compiling()
        self.entered.stack.append(None if compiling else backward_outside_autocast())

    def __exit__(self, *exc: Any) -> None:
        restore = self.entered.stack.pop()
        if restore is not None:
            restore()


class _Entries(threading.local):
    """A context's entries still open, per thread: one object (a decorator) entered by two
    threads at once pairs each exit with its own thread's entry. Copied and pickled empty
    (what is entered is a thread's, not the object's)."""

    def __init__(self) -> None:
        self.stack: list[Any] = []

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Entries, ())


class ForwardAutocast(contextlib.ContextDecorator):
    """`Precision.forward_context`'s autocast for a forward whose backward runs after it,
    outside autocast: while it is entered (outside compiled code), torch.compile traces a
    compiled model's backward outside autocast, as eager runs it. Under torch's default
    (``torch._functorch.config.backward_pass_autocast`` "same_as_forward") the backward was
    traced in this autocast, and a float32 region's backward ran in bfloat16: gradients
    other than eager's. Code compiled whole, context included, traces it inside its graph,
    where nothing surrounds it; the setting is the user's again on exit. Decorates a
    function as torch.autocast does. Entered again while entered (a nested ``with``, a
    function it decorates calling itself), each entry has its own autocast and setting to
    restore: a torch.autocast entered twice restored, on its outer exit, the inner's state."""

    __slots__ = ("autocast", "entered")

    def __init__(self, autocast: torch.autocast) -> None:
        self.autocast = autocast
        # (per entry, per thread: its autocast, a copy of `autocast`, and what restores the
        # setting; torch.autocast keeps its entry's state on itself)
        self.entered = _Entries()

    def __enter__(self) -> Any:
        autocast = copy.copy(self.autocast)
        restore = None if torch.compiler.is_compiling() else backward_outside_autocast()
        self.entered.stack.append((autocast, restore))
        try:
            return autocast.__enter__()
        except BaseException:
            self.entered.stack.pop()
            if restore is not None:
                restore()
            raise

    def __exit__(self, *exc: Any) -> Any:
        autocast, restore = self.entered.stack.pop()
        try:
            return autocast.__exit__(*exc)
        finally:
            if restore is not None:
                restore()


class ForwardDefaultDtype(contextlib.ContextDecorator):
    """`Precision.forward_context` of a "true" policy: torch's default dtype set to the
    compute dtype while entered (`default_dtype`), restored on exit. It may be entered again
    and again, as an autocast object may (``ctx = precision.forward_context()`` built once,
    ``with ctx:`` every step, the way loops written for torch.amp keep theirs), and decorate
    a function."""

    __slots__ = ("dtype", "entered")

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.entered: list[AbstractContextManager[None]] = []

    def __enter__(self) -> None:
        block = default_dtype(self.dtype)
        block.__enter__()
        self.entered.append(block)

    def __exit__(self, *exc: Any) -> Any:
        return self.entered.pop().__exit__(*exc)


class _Unchanged(contextlib.nullcontext, contextlib.ContextDecorator):
    """`Precision.forward_context` where nothing changes (a float32 policy): entered or
    decorating a function, as the other policies' contexts are."""


class Precision:
    """Training precision for a hand-written loop (docs/precision.md).

    Args:
        spec: any policy spec (``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``, ``"32-true"``,
            Keras and jmp names, a dtype, ``"auto"``), a ``Policy`` or a ``PolicyMap``.
        device: where training runs, for the hardware check, ``"auto"`` and ``autocast``
            (default: the model's device at ``setup``). The model is not moved.
        allow_slow: accept a precision that works here but is far slower than float32
            (float16 on most CPUs), e.g. to study its numerics.
        scaler: ``None`` picks dynamic loss scaling when the policy uses float16 and none
            otherwise; or ``"dynamic"``, ``"none"``, a number (static scale), a ``LossScaler``.
        master_weights: passed to each ``LossScaleOptimizer``: ``None`` keeps float32
            masters for float16 parameters, ``True`` also for bfloat16 ones, ``False`` never.
        compensation: ``"kahan"`` or ``"stochastic"``: under a 16-bit ``*-true`` policy, step
            AdamW/Adam/SGD with compensated updates of the 16-bit weights instead of float32
            masters (docs/pure-bf16.md). ``None``: no change. Excludes ``master_weights=True``.
        device_info: a described device (``mixprec.hardware.DeviceInfo``) to check the policy
            against and resolve ``"auto"`` for, instead of detecting the device at ``setup``.
        optimizer_states: ``"int8"``, ``"int4"``, ``"float8"`` or ``"float32"``: ``setup``
            converts each torch AdamW, Adam or SGD into a `mixprec.optim.states` optimizer,
            per parameter as `PolicyMap.state_formats` says; use the ones it returns
            (docs/states.md). ``None`` converts only when the map has ``states``.
        activations: how layers keep the tensors saved for the backward: one option of
            `mixprec.activations` for all or {module path regex or type: option}; it becomes
            the policy map's ``activations`` (docs/activations.md). ``None`` leaves them to it.

    Life cycle: built (policy and scaler known at once unless the spec is ``"auto"``), then
    `resolve` once for the device (``setup`` does it when nothing did), then ``setup`` and the
    steps. `reset` begins another run (the Trainer's), without checking the hardware again.
    """

    def __init__(
        self,
        spec: Any = "32-true",
        *,
        device: torch.device | str | None = None,
        allow_slow: bool = False,
        scaler: LossScaler | str | float | None = None,
        master_weights: bool | None = None,
        device_info: DeviceInfo | None = None,
        compensation: str | None = None,
        optimizer_states: str | None = None,
        activations: ActivationsSpec | None = None,
    ) -> None:
        if not isinstance(allow_slow, bool):
            raise TypeError(f"allow_slow must be True or False, got {allow_slow!r}")
        if not (master_weights is None or isinstance(master_weights, bool)):  # (not 1 or 0)
            raise TypeError(f"master_weights must be None, True or False, got {master_weights!r}")
        check_compensation(compensation)
        if compensation is not None and master_weights:
            raise ValueError(
                "compensation and master_weights=True are two answers to one problem: float32 "
                "masters already keep small updates; choose one"
            )
        if device_info is not None and not isinstance(device_info, DeviceInfo):
            raise TypeError(
                f"device_info must be a mixprec.hardware.DeviceInfo, "
                f"got {type(device_info).__name__}"
            )
        self.device = parse_device(device) if device is not None else None
        self.device_info = device_info
        self.allow_slow = allow_slow
        self.master_weights = master_weights
        self.compensation = compensation
        self.optimizer_states = (
            str(parse_state_format(optimizer_states)) if optimizer_states is not None else None
        )
        self.activations = as_rules(activations)
        self.optimizers: list[LossScaleOptimizer] = []
        # (the optimizer given to setup, the low-bit one it was converted into)
        self._converted: list[tuple[torch.optim.Optimizer, LowBitOptimizer]] = []
        # each model set up -> the per-step work of its formats' layers (`before_step`)
        self._step_work: weakref.WeakKeyDictionary[nn.Module, StepWork] = (
            weakref.WeakKeyDictionary()
        )
        self._spec = spec
        self._scaler_spec = scaler
        self._policy: PolicyMap | None = None
        self._scaler: LossScaler | None = None
        self._resolved: tuple[DeviceInfo, Support] | None = None  # the device checked
        # whether the default policy autocasts (None: no policy chosen yet), and its compute
        # dtype: set with the policy, read by every step (attributes, where the policy's
        # properties are calls)
        self.mixed: bool | None = None
        self._compute_dtype = torch.float32
        if not is_auto(spec):
            self._choose(None)
        elif device_info is not None or self.device is not None:
            self._choose(device_info or self.device)

    def _choose(self, device: DeviceInfo | torch.device | None) -> None:
        """The policy and the scaler; "auto" means the fastest stable precision on
        ``device``, known from the constructor or at `resolve`."""
        if is_auto(self._spec):
            assert device is not None
            self._policy = resolve_policy(self._spec, device)
        else:
            self._policy = as_map(self._spec)
        self._policy.state_default(self.optimizer_states)  # refuses two formats given
        if self.activations is not None:
            self._policy = self._policy.with_activations(self.activations)
        self._scaler = as_loss_scaler(
            self._scaler_spec, needs_scaling=self._policy.needs_loss_scaling
        )
        self.mixed = self._policy.default.is_mixed
        self._compute_dtype = self._policy.default.compute_dtype

    def resolve(self, device: torch.device | str | None = None) -> Support:
        """Settle this precision for the device it runs on, once: ``"auto"`` becomes the
        fastest stable policy there (and the scaler follows), and the device is checked:
        ``mixprec.PrecisionError`` when it refuses the policy, ``mixprec.SlowPrecisionError``
        when it runs it far slower than float32 and ``allow_slow`` is off. Returns how the
        device supports the policy (status and reason).

        The device judged is ``device_info`` when one was given, else ``device`` (default:
        the constructor's, else the best available one) as `mixprec.hardware.detect` sees
        it. ``setup`` calls this when nothing did; later calls for the same device return
        the same answer without checking again, and one for another device raises
        ``ValueError``: one Precision runs on one kind of device.
        """
        info = self.device_info or detect(device if device is not None else self.device)
        if self._resolved is not None:
            judged, support = self._resolved
            if info != judged:
                raise ValueError(
                    f"this Precision was resolved for {judged.describe()}; it cannot be "
                    f"resolved again for {info.describe()}: build one Precision per device"
                )
            return support
        if self._policy is None:
            self._choose(info)
        support = check(self.policy, allow_slow=self.allow_slow, info=info)
        self._resolved = (info, support)
        return support

    @property
    def resolved_for(self) -> DeviceInfo | None:
        """The device `resolve` checked the policy against; None until it ran."""
        return self._resolved[0] if self._resolved is not None else None

    def reset(self, scaler: bool = True) -> None:
        """Begin another run with this precision: forget the models and optimizers set up so
        far and (``scaler``) start the scaler afresh (`LossScaler.reset`: its initial scale,
        no steps), so every run starts alike. Its settings stay as they are now, those set
        through its attributes since building included (a checkpoint's, loaded since, give
        way to those before it); the policy and the hardware check stay as `resolve` left
        them. The Trainer calls this before each fit (a resume then loads the checkpoint's
        scaler state over it), validate, test and predict (``scaler=False``: the scaler
        stays as the last fit left it)."""
        self.optimizers = []
        self._converted = []
        self._step_work.clear()
        if self._scaler is not None and scaler:
            self._scaler.reset()

    @staticmethod
    def _unresolved() -> RuntimeError:
        return RuntimeError(
            "Precision('auto') picks its policy and scaler at setup(), from the model's "
            "device; call setup() or resolve(device) first, or pass device=..."
        )

    @property
    def has_policy(self) -> bool:
        """Whether the policy is chosen: from the start, but for ``"auto"`` without a device
        only once `resolve` (or ``setup``) picked it; until then `policy` raises."""
        return self._policy is not None

    @property
    def policy(self) -> PolicyMap:
        """The policy map in force (a plain policy is a map with no rules)."""
        if self._policy is None:
            raise self._unresolved()
        return self._policy

    @property
    def scaler(self) -> LossScaler:
        """The one loss scaler every optimizer set up here shares."""
        if self._scaler is None:
            raise self._unresolved()
        return self._scaler

    # -- setup ------------------------------------------------------------------------------

    @contextmanager
    def init_module(self) -> Iterator[None]:
        """Build a model directly in its storage dtype: parameters created inside this
        context get the policy's param dtype (``bfloat16`` under ``"bf16-true"``, float32
        under mixed policies) instead of being created in float32 and cast at ``setup``.
        Nothing built is known to be for which layer, or to be a parameter or a buffer, so
        where the map stores tensors in several dtypes (a float32 head in a ``"bf16-true"``
        model; buffers in the compute dtype under ``"p=bf16,c=f32"``) it builds in one that
        holds them all (`torch.promote_types`), no wider than a build outside it would be
        (float32 for ``"p=f32,c=f64"``'s buffers): a tensor built narrower, then cast up at
        ``setup``, kept its rounding for good (a buffer computed at init, positions off by
        2), while one built wider is narrowed at ``setup`` as one built outside is. The
        default dtype is restored on exit, also when construction raises."""
        previous = torch.get_default_dtype()
        policies = list(self.policy.policies())
        params = _promoted([p.param_dtype for p in policies]) or torch.float32
        both = _promoted([params] + [p.buffer_dtype for p in policies]) or params
        outside = torch.promote_types(params, previous)
        within = torch.finfo(both).bits <= torch.finfo(outside).bits
        chosen = both if within else outside
        torch.set_default_dtype(chosen)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    def setup(
        self,
        model: nn.Module,
        *optimizers: torch.optim.Optimizer | LossScaleOptimizer,
        convert: bool = True,
    ) -> Any:
        """Resolve and check the policy for the device (`resolve`, unless it ran), convert
        ``model`` in place and wrap ``optimizers``.

        ``convert=False`` leaves the model's dtypes and forward alone, for a model sharded by
        `mixprec.sharding.shard` (FSDP2 casts per unit, and the policy was checked there;
        the activation options, if any, must be on it already, as `shard` puts them).

        Returns ``model`` alone, or ``(model, *wrapped_optimizers)`` when optimizers are
        given. All wrapped optimizers share this precision's one scaler. Build the optimizers
        from the model's parameters before calling this (conversion keeps the parameter
        objects); raises ``mixprec.PrecisionError`` when the device refuses the policy or
        runs it far slower than float32 without ``allow_slow``.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"setup() takes the model (an nn.Module) first, got {type(model).__name__}"
            )
        for i, opt in enumerate(optimizers):
            if not isinstance(opt, (torch.optim.Optimizer, LossScaleOptimizer)):
                raise TypeError(
                    f"setup() argument {i + 2} must be a torch.optim.Optimizer built from the "
                    f"model's parameters, got {type(opt).__name__}"
                )
        warn_if_foreign(model, optimizers)
        if self.device is None:
            self.device = device_of(model)
        if self._resolved is None:
            self.resolve()
        if self.policy.activations is not None:
            if not convert and not installed(model, self.policy.activation_choices(model)):
                carried = wrapped_activations(model) or "none"
                raise ValueError(
                    "activation options are put on the model by setup's conversion, or by "
                    "mixprec.shard under this precision's policy; with convert=False the "
                    f"model must carry them already, and it carries {carried}: shard it with "
                    "mixprec.shard(model, precision.policy), or leave activations out of "
                    "this precision"
                )
            check_device(self.policy.activations.options, self.device.type)
        if convert:
            before = dict(model.named_parameters())
            apply(model, self.policy, warn=False)  # the device was checked by `resolve`
            warn_unmatched(self.policy, model)
            _warn_replaced(before, model, optimizers)
        work = step_work(model)  # its layers now are the ones its steps run
        if work:
            self._step_work[model] = work
        else:
            self._step_work.pop(model, None)
        self.scaler.to(self.device)
        if optimizers and (self.optimizer_states is not None or self.policy.states is not None):
            self.policy.warn_unmatched_states(model)
            optimizers = tuple(self._low_bit(opt, model) for opt in optimizers)
        wrapped = [self._wrap(opt, model) for opt in optimizers]
        if wrapped:
            self._warn_untrained_adapters(model)
        return (model, *wrapped) if wrapped else model

    def _warn_untrained_adapters(self, model: nn.Module) -> None:
        """Warn when LoRA adapters of the model are in no optimizer set up here: enabled
        after the optimizer was built, they never train, and `enable_lora` froze the biases
        that trained before (the loss stays where it was, with no word)."""
        held = {
            id(w.model_param(p))
            for w in self.optimizers
            for g in w.param_groups
            for p in g["params"]
        }
        missed = [
            name
            for name, p in model.named_parameters()
            if p.requires_grad and name.rpartition(".")[2] in _ADAPTERS and id(p) not in held
        ]
        if missed:
            warnings.warn(
                f"{len(missed)} LoRA adapter tensor(s) ({missed[0]}, ...) are in no optimizer "
                "set up with this model: they will not train. Build the optimizer after "
                "enable_lora, from its returned tensors (or model.parameters())",
                stacklevel=caller_level(),
            )

    def _low_bit(self, optimizer: Any, model: nn.Module) -> Any:
        """``optimizer`` with its states in the formats this precision gives each parameter,
        as the optimizer side converts it (`mixprec.optim.convert_for`: a low-bit optimizer,
        or a wrapper from an earlier ``setup``, as it is; one keeping another format than
        the one given is refused, as a map's is); a conversion is remembered (`converted`)."""
        known = self.converted(optimizer)
        if known is not None:
            return known
        converted = convert_for(
            self.policy,
            optimizer,
            model,
            optimizer_states=self.optimizer_states,
            compensation=self.compensation,
            wrappers=self.optimizers,
        )
        if converted is not optimizer:
            self._converted.append((optimizer, converted))
        return converted

    def converted(self, optimizer: torch.optim.Optimizer) -> LowBitOptimizer | None:
        """The low-bit optimizer ``setup`` converted ``optimizer`` into (``optimizer_states``
        or the map's ``states``), None when it converted none. A scheduler built on
        ``optimizer`` drives this one's groups already (``setup`` gave them to
        ``optimizer``); one re-pointed here (``scheduler.optimizer = ...``) names it too."""
        return next((new for old, new in self._converted if old is optimizer), None)

    def _wrap(
        self, optimizer: torch.optim.Optimizer | LossScaleOptimizer, model: nn.Module
    ) -> LossScaleOptimizer:
        """The wrapper of ``optimizer``: the one made by an earlier ``setup`` (setting up
        twice is harmless), else a new one sharing this precision's scaler. A wrapper given
        as such is taken with its own scaler and compensation: refused where they differ."""
        if isinstance(optimizer, LossScaleOptimizer):
            if optimizer.scaler is not self.scaler:
                raise ValueError(
                    "this LossScaleOptimizer has its own scaler; pass the plain optimizer to "
                    "setup(), or build Precision(scaler=optimizer.scaler)"
                )
            # (its own, or that of the low-bit optimizer it wraps, which compensates itself)
            kept = optimizer.compensation
            if kept is None and isinstance(optimizer.optimizer, LowBitOptimizer):
                kept = optimizer.optimizer.compensation
            if self.compensation is not None and kept != self.compensation:
                raise ValueError(
                    f"this precision's compensation={self.compensation!r}, but the "
                    f"LossScaleOptimizer given steps with compensation={kept!r}, which setup "
                    f"takes as it is: pass the plain optimizer to setup() (wrapped with this "
                    f"precision's compensation), or build the LossScaleOptimizer with "
                    f"compensation={self.compensation!r}"
                )
            lso = optimizer
        else:
            lso = self._wrapper_of(optimizer) or LossScaleOptimizer(
                optimizer,
                self.scaler,
                master_weights=self.master_weights,
                model=model,
                # a converted optimizer compensates its own 16-bit updates
                compensation=None
                if any(new is optimizer for _, new in self._converted)
                else self.compensation,
            )
        if lso not in self.optimizers:
            self._retire_overlapping(lso)
            self.optimizers.append(lso)
        return lso

    def _retire_overlapping(self, new: LossScaleOptimizer) -> None:
        """Drop (warning) the wrappers set up before that step parameters ``new`` steps: a
        notebook cell run twice, or a training stage with a new optimizer, left the old one
        live, so that ``step()`` and ``unscale_()`` of all stepped the shared gradients twice
        (an update twice as large, or unscaled twice: no update)."""
        mine = {id(new.model_param(p)) for g in new.param_groups for p in g["params"]}
        for old in list(self.optimizers):
            theirs = {id(old.model_param(p)) for g in old.param_groups for p in g["params"]}
            if mine & theirs:
                self.optimizers.remove(old)
                warnings.warn(
                    f"setup() got a new {type(new.optimizer).__name__} over parameters the "
                    f"{type(old.optimizer).__name__} set up before steps: that one is retired "
                    "(step() and unscale_() of all no longer take it). To start a new run "
                    "afresh, scaler included, call precision.reset() first",
                    stacklevel=caller_level(),
                )

    def _wrapper_of(self, optimizer: torch.optim.Optimizer) -> LossScaleOptimizer | None:
        inner = self.converted(optimizer) or optimizer
        return next((w for w in self.optimizers if w.optimizer is inner), None)

    # -- the step ---------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate ``loss`` scaled by the current loss scale, in `backward_context`;
        ``kwargs`` go to ``Tensor.backward``. The context's steps are taken inline (no
        generator) since this runs every step."""
        scaler = self._scaler
        if scaler is None:
            raise self._unresolved()
        scaled = scale_for_backward(loss, scaler, self.optimizers)
        dtype = None if self.mixed else backward_dtype(self.policy.default)
        if dtype is None:
            scaled.backward(**kwargs)
        else:
            with default_dtype(dtype):
                scaled.backward(**kwargs)

    def backward_context(self, loss: torch.Tensor) -> AbstractContextManager[torch.Tensor]:
        """The one context every backward under this precision runs in, yielding ``loss``
        times the current scale to backpropagate inside it (``mixprec.optim.backward_context``):
        the optimizers set up here refuse a backward after their unscale, and under a "true"
        policy the compute dtype is torch's default, as in the forward, so that an
        activation-checkpointed block recomputes what it computed there. `backward`, the
        Trainer, the doctor, the bench, the search and the Lightning, Hugging Face and
        Accelerate integrations all enter it, the last three around their host's backward
        call (``with precision.backward_context(loss) as scaled: host_backward(scaled)``)."""
        return backward_context(loss, self.scaler, self.optimizers, self.policy.default)

    def unscale_(self, *optimizers: LossScaleOptimizer | torch.optim.Optimizer) -> None:
        """Unscale the gradients of ``optimizers`` (default: all set up); idempotent per step."""
        for opt in [self._as_wrapper(o) for o in optimizers] or self.optimizers:
            opt.unscale_()

    def clip_grad_norm_(
        self,
        params: ParamsLike,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Unscale, then clip the gradients of ``params`` (a model, an optimizer from
        ``setup`` or the one passed to it, or tensors) to total norm ``max_norm``; returns the
        norm before clipping.

        Float16 parameters with float32 masters are clipped through their masters, which
        hold the unscaled gradients the optimizer will use.
        """
        return nn.utils.clip_grad_norm_(
            self._unscaled_grad_holders(params),
            max_norm,
            norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite,
        )

    def clip_grad_value_(self, params: ParamsLike, clip_value: float) -> None:
        """Unscale, then clamp every gradient of ``params`` to ``[-clip_value, clip_value]``."""
        nn.utils.clip_grad_value_(self._unscaled_grad_holders(params), clip_value)

    def step(
        self,
        *optimizers: LossScaleOptimizer | torch.optim.Optimizer,
        closure: Callable[[], Any] | None = None,
    ) -> bool:
        """Step ``optimizers`` (default: all set up) as one iteration: unscale, check each
        optimizer's gradients, step those without inf/NaN and skip the others (as
        ``torch.amp.GradScaler``), update the scale once. Returns True when all stepped.

        An optimizer passed to ``setup`` may be given in place of its wrapper. ``closure``
        is for one LBFGS-style optimizer, without loss scaling. `before_step` runs first
        (inside the closure, after each of its evaluations, when there is one).
        """
        # (the dictionary under the weak one: its own length costs three Python calls a step)
        if self._step_work.data:
            if closure is None:
                self.before_step()
            else:
                closure = self._then_before_step(closure)
        if closure is None and not optimizers and len(self.optimizers) == 1:
            return self.optimizers[0].step()  # the Trainer's call, `precision.step()`
        if (
            closure is None
            and len(optimizers) == 1
            and isinstance(optimizers[0], LossScaleOptimizer)
            and optimizers[0].scaler is self._scaler
        ):  # the common call, `precision.step(optimizer)`, without the lists below
            return optimizers[0].step()
        wrapped = [self._as_wrapper(opt) for opt in optimizers] or self.optimizers
        if not wrapped:
            raise ValueError(
                "no optimizer to step: pass optimizers to setup(model, optimizer) first"
            )
        if closure is not None:
            if len(wrapped) != 1:
                raise ValueError("a closure steps one optimizer: name it, step(opt, closure=f)")
            return wrapped[0].step(closure)
        if len(wrapped) == 1:
            return wrapped[0].step()
        return joint_step(*wrapped)

    def before_step(self) -> None:
        """The work the quantized layers of the models set up here need between the backward
        passes of an optimizer step and the step (`mixprec.formats.Format.before_step`: under
        several processes, float8's delayed scaling makes each amax history the max over the
        ranks, so every rank scales the next step alike). The one door every loop enters, as
        it enters `backward_context`: `step` runs it, and so do the Trainer (through `step`),
        the Lightning plugin and the Hugging Face and Accelerate integrations; a loop that
        steps its optimizers without `step` calls it before stepping. Nothing to do (the
        common case) costs nothing."""
        for work in self._step_work.values():
            before_step(work)

    def _then_before_step(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """`closure`, then `before_step`: an optimizer evaluating the loss inside its step
        runs the backward there."""

        def evaluated() -> Any:
            result = closure()
            self.before_step()
            return result

        return evaluated

    def _as_wrapper(self, optimizer: Any) -> LossScaleOptimizer:
        if isinstance(optimizer, LossScaleOptimizer):
            if optimizer.scaler is not self.scaler:
                # (its scaler did not scale this precision's losses: stepped, it would apply
                # gradients still multiplied by this one's scale)
                raise ValueError(
                    "this LossScaleOptimizer has its own scaler, not this Precision's, which "
                    "scaled the loss: step the optimizer setup() returned (pass the plain "
                    "optimizer to setup), or call the LossScaleOptimizer's own step()"
                )
            return optimizer
        if isinstance(optimizer, torch.optim.Optimizer):
            lso = self._wrapper_of(optimizer)
            if lso is not None:
                return lso
            raise ValueError(
                f"this {type(optimizer).__name__} was not set up by this Precision: "
                f"model, optimizer = precision.setup(model, optimizer) first"
            )
        raise TypeError(
            f"step() takes the optimizers returned by setup(), got {type(optimizer).__name__}"
        )

    # -- code outside the model -------------------------------------------------------------

    def autocast(self, *, cache_enabled: bool = True) -> AbstractContextManager[Any]:
        """A context running code outside the model (a loss, a metric) in the compute dtype
        of a mixed policy; does nothing for a "true" policy. ``cache_enabled=False`` drops
        autocast's cache of weight casts, for a context that an optimizer step runs inside
        (the cached copies would serve the old weights to a later forward)."""
        if self._policy is None:
            raise self._unresolved()
        return torch.autocast(
            (self.device or default_device()).type,
            dtype=self._compute_dtype,
            enabled=self.mixed,
            cache_enabled=cache_enabled,
        )

    def forward_context(
        self, *, cache_enabled: bool = True, backward_after: bool = True
    ) -> AbstractContextManager[Any]:
        """The context a forward and its loss run in: ``autocast`` for a mixed policy
        (``cache_enabled`` as `autocast` takes it); for a "true" policy torch's default dtype
        set to the compute dtype (restored on exit), so tensors created without a dtype
        (``torch.ones(n, 3)``) match the weights.

        ``backward_after``: the backward runs after the context, outside autocast (as
        `backward` and the Trainer run it): a model compiled under the context then traces
        its backward outside autocast too, as eager runs it (`ForwardAutocast`). False for a
        backward run inside it (Lightning's manual optimization): torch's own tracing."""
        if self.mixed:  # (every step enters this)
            autocast = self.autocast(cache_enabled=cache_enabled)
            # (traced, as code compiled whole with the context inside it: the plain
            # autocast, which dynamo traces into the graph; `ForwardAutocast`, which it
            # cannot, broke the graph there and left its backward traced in autocast)
            if backward_after and not torch.compiler.is_compiling():
                return ForwardAutocast(autocast)
            return autocast
        if needs_default_dtype(self.policy.default.compute_dtype):
            if torch.compiler.is_compiling():  # (traced as it always was)
                return default_dtype(self._compute_dtype)
            return ForwardDefaultDtype(self._compute_dtype)
        return _Unchanged()

    def convert_input(self, batch: Any) -> Any:
        """Cast the floating tensors of ``batch`` (any nesting `mixprec.tree` walks) to the
        compute dtype of a "true" policy; under a mixed policy autocast does the casting, so
        the batch is returned unchanged."""
        if self._policy is None:
            raise self._unresolved()
        return batch if self.mixed else cast_floating(batch, self._compute_dtype)

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The policy's config and the scaler's state (optimizers save their own)."""
        return {"policy": self.policy.to_config(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the scaler saved by ``state_dict``."""
        if not isinstance(state, Mapping) or "scaler" not in state:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"not a Precision state (got {keys}); pass the dict from "
                f"Precision.state_dict(). A loss scaler's state (also torch.amp.GradScaler's) "
                f"goes to precision.scaler.load_state_dict(...)"
            )
        self.scaler.load_state_dict(state["scaler"])

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the models set up (a pickle of the models holds other objects):
        the copy finds their per-step work again when it sets them up."""
        state = self.__dict__.copy()
        state["_step_work"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._step_work = weakref.WeakKeyDictionary()
        # (one pickled before the policy's flags were attributes of their own)
        self.__dict__.pop("_mixed", None)
        policy = self.__dict__.get("_policy")
        if "mixed" not in self.__dict__:
            self.mixed = None if policy is None else policy.default.is_mixed
            self._compute_dtype = torch.float32 if policy is None else policy.default.compute_dtype

    def __repr__(self) -> str:
        if self._policy is None:
            return f"Precision('auto', device={self.device})"
        states = f", optimizer_states={self.optimizer_states!r}" if self.optimizer_states else ""
        return (
            f"Precision({self.policy.name!r}, scaler={self.scaler!r}, device={self.device}{states})"
        )

    # -- internals --------------------------------------------------------------------------

    def _unscaled_grad_holders(self, params: ParamsLike) -> list[torch.Tensor]:
        """Unscale the optimizers owning ``params``, then return the tensors holding their
        gradients (masters in place of low-precision parameters). Looked up afresh on each
        call, so groups added and parameters unfrozen after ``setup`` are covered."""
        if isinstance(params, torch.optim.Optimizer):  # (the plain one set up, as step takes)
            params = self._as_wrapper(params)
        if isinstance(params, LossScaleOptimizer):
            params.unscale_()
            return params.params_with_grads()
        if isinstance(params, nn.Module):
            named = list(params.named_parameters())
        elif isinstance(params, torch.Tensor):
            named = [("tensor 0", params)]
        else:
            named = [(f"tensor {i}", t) for i, t in enumerate(params)]
        tensors = [t for _, t in named]
        owner: dict[torch.Tensor, LossScaleOptimizer] = {}
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    owner[opt.model_param(p)] = owner[p] = opt
        # a gradient no optimizer here unscales is still multiplied by the loss scale: in a
        # norm beside unscaled ones it would dominate it and clip the rest to almost nothing
        scaled = [n for n, t in named if t not in owner and t.grad is not None]
        if scaled and self.scaler.enabled:
            raise ValueError(
                f"{', '.join(scaled[:5])}{' ...' if len(scaled) > 5 else ''} hold gradients "
                "that no optimizer set up by this Precision steps, so they are still "
                "multiplied by the loss scale and nothing unscales them: clip the "
                "optimizers' parameters (precision.clip_grad_norm_(optimizer, ...)), or set "
                "up the optimizer holding these too"
            )
        for opt in {owner[t] for t in tensors if t in owner}:
            opt.unscale_()
        master_of = {p: m for opt in self.optimizers for p, m in opt.master_params.items()}
        return [master_of.get(t, t) for t in tensors]


def _promoted(dtypes: Iterable[torch.dtype]) -> torch.dtype | None:
    """The dtype `torch.promote_types` gives the floating ``dtypes`` (None: there are none):
    one holding each of them exactly (float32 for bfloat16 and float16)."""
    out = None
    for dtype in dtypes:
        if dtype.is_floating_point:
            out = dtype if out is None else torch.promote_types(out, dtype)
    return out


def _warn_replaced(
    before: dict[str, nn.Parameter], model: nn.Module, optimizers: Iterable[Any]
) -> None:
    """Warn when an optimizer built before `setup` holds parameters its conversion replaced
    (float weights of layers a quantized policy swapped): the optimizer keeps them alive and
    steps them, and they no longer reach the model."""
    kept = {id(p) for p in model.parameters()}
    gone = {id(p): name for name, p in before.items() if id(p) not in kept}
    held = [
        gone[id(p)]
        for opt in optimizers
        for group in opt.param_groups
        for p in group["params"]
        if id(p) in gone
    ]
    if held:
        warnings.warn(
            f"the optimizer holds {len(held)} parameter(s) that the conversion replaced "
            f"({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}): the quantized layers "
            "keep codes, not these weights, so the optimizer steps tensors the model no "
            "longer uses and keeps them in memory. Build the optimizer after setup, from "
            "model.parameters()",
            stacklevel=3,
        )
