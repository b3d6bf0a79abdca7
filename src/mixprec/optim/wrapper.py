"""``LossScaleOptimizer``: loss scaling and float32 master weights around any torch optimizer.

Wrap your optimizer (as in Keras)::

    opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters()), model=model)
    for x, y in data:
        opt.zero_grad()
        opt.backward(loss_fn(model(x), y))   # scaled backward
        opt.unscale_()                       # optional: before clipping or inspecting grads
        torch.nn.utils.clip_grad_norm_(opt.params_with_grads(), 1.0)
        opt.step()                           # unscale, check, step or skip, update the scale
        scheduler_step(scheduler, opt)       # the LR schedule does not advance on a skip

Several optimizers can share one scaler: each ``step()`` ends one scaler iteration, and
``joint_step(opt_a, opt_b)`` steps optimizers fed by one backward together (as with
``torch.amp.GradScaler``, each skips only if its own gradients overflowed, and the scale is
updated once); stepping those one by one raises. docs/precision.md tells loss scaling in full.

Float16 trainable parameters get float32 master copies (``mixprec.optim.masters.MasterWeights``):
the wrapped optimizer is re-pointed at the masters, gradients are moved into them (so
``zero_grad`` on the wrapped optimizer clears everything) and unscaled in float32, the
optimizer updates the masters, and the float16 parameters are refreshed from them after
each taken step: pure float16 trains, where ``torch.amp.GradScaler`` refuses its gradients.

Each step goes READY -> UNSCALED (``unscale_``) -> STEPPED (``OptState``); ``joint_step``
drives it through public methods (``unscale_``, ``found_inf``, ``take_step``, ``end_step``).
The backward runs in `backward_context`, which every scaled backward in mixprec enters
(docs/precision.md, "One backward"). ``state_dict``, ``load_state_dict`` and
``load_state_dict_across_precisions`` live in `mixprec.optim.checkpoint`, the class's base.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from mixprec.activations import warn_if_root_unused
from mixprec.convert import applied_policy, default_dtype, needs_default_dtype
from mixprec.errors import PrecisionError
from mixprec.optim.checkpoint import OptimizerCheckpoint
from mixprec.optim.compensated import COMPENSATED_DTYPES, Compensator, check_compensation
from mixprec.optim.masters import MASTER_DTYPES, MasterWeights, master_weights_by_name
from mixprec.optim.scaling import LossScaler, as_loss_scaler, is_scaled
from mixprec.optim.states import LowBitOptimizer
from mixprec.policy import Policy

__all__ = [
    "LossScaleOptimizer",
    "OptState",
    "SkipAwareScheduler",
    "backward_context",
    "backward_dtype",
    "check_sharded_masters",
    "follow_steps",
    "joint_step",
    "master_weights_by_name",
    "scale_for_backward",
    "scheduler_step",
    "trained_params",
]

# optimizer -> (its latest wrapper, that wrapper's masters): a new wrapper of the same
# optimizer takes the masters over and retires the old wrapper
_WRAPPERS: weakref.WeakKeyDictionary[
    torch.optim.Optimizer, tuple[weakref.ref[LossScaleOptimizer], MasterWeights]
] = weakref.WeakKeyDictionary()


class OptState(enum.Enum):
    """Where a ``LossScaleOptimizer`` is in its step, as ``torch.amp.grad_scaler.OptState``."""

    READY = "ready"  # gradients as backward left them (scaled)
    UNSCALED = "unscaled"  # unscale_ ran: gradients divided by the scale, found_inf set
    STEPPED = "stepped"  # the step was taken or skipped; zero_grad or unscale_ starts anew


class LossScaleOptimizer(OptimizerCheckpoint):
    """Wrap ``optimizer`` so that its step is loss-scaled and, if needed, uses master weights.

    Args:
        optimizer: any ``torch.optim.Optimizer``; fused ones (``fused=True`` Adam, AdamW, SGD,
            flagged ``_step_supports_amp_scaling``) get the overflow flag and skip inside
            their kernel, so no host sync precedes their step. An optimizer has one live
            wrapper: wrapping it again (a second ``Precision``, a re-run notebook cell) hands
            its masters to the new wrapper and retires the old one, whose ``step`` then
            raises instead of stepping the optimizer a second time.
        scaler: ``None`` or ``"dynamic"`` (a new ``DynamicLossScaler``), a number (a static
            scale), ``"none"``, or a ``LossScaler``, possibly shared with other optimizers.
        master_weights: ``None`` keeps float32 masters for trainable float16 parameters;
            ``True`` also for bfloat16 ones; ``False`` never (float16 gradients are then
            unscaled in float16, where small values can flush to zero).
        model: the module the parameters belong to; its parameter names are saved in
            ``state_dict`` (``Precision.setup`` passes it), so that ``master_weights_by_name``
            can restore the masters by name, and ``backward`` runs in the compute dtype of
            the policy ``mixprec.apply`` converted it to (`backward_context`). Without it,
            the names an optimizer built from ``model.named_parameters()`` keeps are used,
            and the backward runs in torch's default dtype as it is.
        compensation: ``"kahan"`` or ``"stochastic"`` steps a torch AdamW, Adam or SGD with
            compensated updates of its bfloat16/float16 parameters instead of float32
            masters (``mixprec.optim.compensated``); ``None`` (default) steps the optimizer as it
            is. It excludes ``master_weights=True`` and needs 16-bit trainable parameters.
            Without it and without masters, 16-bit trainable parameters get one
            ``UserWarning``: their small updates round away.

    Parameters sharded by FSDP2 (DTensors) take neither masters nor compensation: a wrapper
    that would give them some is refused up front (`check_sharded_masters`).
    """

    _checks_buffers = True  # (a wrapper pickled before the attribute: checked, `_fused`)
    _buffers_made: tuple | None = None

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: LossScaler | str | float | None = None,
        *,
        master_weights: bool | None = None,
        model: nn.Module | None = None,
        compensation: str | None = None,
    ) -> None:
        _check_wrappable(optimizer, master_weights, model)
        self._compensator = _compensator_for(optimizer, compensation, master_weights)
        _check_sharded_params(optimizer, _trainable(optimizer), master_weights, compensation)
        # a compensation stands in for float32 masters: the wrapper's, or by default a
        # low-bit optimizer's own (it compensates its 16-bit updates itself)
        own = getattr(optimizer, "compensation", None) if master_weights is None else None
        if compensation is not None or own is not None:
            master_weights = False
        self.optimizer = optimizer
        self.scaler = as_loss_scaler(scaler, needs_scaling=True)
        self.model = model
        # None, or whether a ``step``/``zero_grad`` call now ends an accumulation window: a
        # host loop calling them on every micro-batch (Accelerate's) makes them wait for it
        self.step_gate: Callable[[], bool] | None = None
        self._first_backward = True
        self._master_weights = master_weights
        self._masters = MasterWeights(MASTER_DTYPES[master_weights])
        self._retired = False
        self._take_over_from_previous_wrapper()
        self._masters.add(optimizer)
        if compensation is None:
            _warn_uncompensated(optimizer, self._masters.dtypes)
        else:
            self._keep_saved_dtypes_on_direct_loads()
        # the steps taken since the optimizer's state was last loaded (None: never): what a
        # scheduler loaded from the same checkpoint missed before its first gated step. A
        # load (through this wrapper or directly, as Lightning restores optimizers) gives
        # the torch optimizer a new state dict: the one seen last tells
        self._taken_since_load: int | None = None
        self._seen_state = optimizer.state
        # a compensated step runs our code, not a fused kernel that could skip by itself
        self._fused_kernel = self._compensator is None and bool(
            getattr(optimizer, "_step_supports_amp_scaling", False)
        )
        # (`_fused`: for fused SGD, what the state and groups were when every momentum buffer
        # was last found made; None: not found, or not checked since)
        self._checks_buffers = isinstance(optimizer, torch.optim.SGD)
        self._buffers_made: tuple | None = None
        step_args = inspect.signature(optimizer.step).parameters
        closure = step_args.get("closure")
        self._needs_closure = closure is not None and closure.default is inspect.Parameter.empty
        self._stage = OptState.READY
        self._found_inf: torch.Tensor | None = None  # set while UNSCALED or CHECKED
        self._gradless = False  # whether the gradients unscaled or checked were none at all
        # the scaler's update count when it was set: another optimizer's step() updating the
        # shared scaler since means this one's gradients were unscaled by an older scale
        self._found_at = 0
        # the scale a fused optimizer divides by in its kernel, while CHECKED
        self._grad_scale: torch.Tensor | None = None
        self.step_was_skipped = False
        # the schedulers counting this optimizer's steps, as of `_FOLLOWERS_VERSION`
        self._followers_at, self._followers = _FOLLOWERS_VERSION, _followers(self.optimizer)
        first = next(iter(self._all_params()), None)
        if first is not None and self.scaler.device != first.device:
            self.scaler.to(first.device)

    @property
    def steps_taken_since_load(self) -> int | None:
        """The steps taken since the wrapped optimizer's state was last loaded (None: it
        never was): what a scheduler loaded from the same checkpoint missed before its first
        gated step (`scheduler_step`)."""
        if self.optimizer.state is not self._seen_state:
            return 0  # (loaded since the last step)
        return self._taken_since_load

    def __getstate__(self) -> dict[str, Any]:
        """A copy or a pickle looks its schedulers up again (they are not its to carry)."""
        state = dict(self.__dict__)
        state["_followers_at"], state["_followers"] = -1, ()
        return state

    def _take_over_from_previous_wrapper(self) -> None:
        """Become the optimizer's one live wrapper: an earlier wrapper of it is retired and
        its masters are taken over."""
        previous = _WRAPPERS.get(self.optimizer)
        if previous is not None:
            old = previous[0]()
            if old is not None:
                old._retired = True
            self._masters.take_over(previous[1])
        _WRAPPERS[self.optimizer] = (weakref.ref(self), self._masters)

    # -- passthrough ------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (holding the masters, if any)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state. With float32 masters it is keyed by
        the masters; a model parameter given as a key reads and writes its master's state
        (`MasterKeyedState`), where torch's dict would make an empty entry for it that its
        ``state_dict`` cannot save."""
        if not self._masters:
            return self.optimizer.state
        return MasterKeyedState(
            self.optimizer.state, self._masters.master_of, self.optimizer.param_groups
        )

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's default hyperparameters."""
        return self.optimizer.defaults

    @property
    def loss_scale(self) -> float:
        """The current loss scale (a host sync)."""
        return self.scaler.loss_scale

    @property
    def compensation(self) -> str | None:
        """``"kahan"``, ``"stochastic"`` or None: how this wrapper updates 16-bit parameters
        (None too where the low-bit optimizer it wraps compensates them itself: its own
        ``compensation``, which ``state_dict`` records as this one's)."""
        return self._compensator.kind if self._compensator is not None else None

    @property
    def retired(self) -> bool:
        """Whether a newer wrapper of the same optimizer took over (a second ``setup`` or
        ``LossScaleOptimizer`` of it): a retired wrapper refuses to step."""
        return self._retired

    def compiles(self, device: torch.device | str) -> bool:
        """Whether this optimizer's step on ``device`` runs a compiled kernel of mixprec's
        (a compensated step, or a low-bit optimizer's update), which its first step builds:
        seconds, once per process."""
        if self._compensator is not None:
            return self._compensator.compiles(self.optimizer, device)
        return isinstance(self.optimizer, LowBitOptimizer) and self.optimizer.compiles(device)

    @property
    def master_params(self) -> Mapping[torch.Tensor, torch.Tensor]:
        """Model parameter -> its float32 master, for parameters that have one (as of the
        last step or `state_dict`, which take writes into the parameters first)."""
        return self._masters.master_of

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer, with masters where needed.

        A group added on the wrapped optimizer directly gets its masters at the next step.
        """
        params = group.get("params")
        if params is not None and not isinstance(params, (torch.Tensor, list, tuple, set)):
            group = {**group, "params": list(params)}  # a generator: read once, here
            params = group["params"]
        given = [params] if isinstance(params, torch.Tensor) else list(params or ())
        trainable = [p for p in given if isinstance(p, torch.Tensor) and p.requires_grad]
        _check_sharded_params(self.optimizer, trainable, self._master_weights, self.compensation)
        # (torch's own check cannot see a parameter its groups hold as a float32 master)
        held = {id(self.model_param(q)) for q in self._all_params()}
        again = [p for p in given if id(p) in held]
        if again:
            raise ValueError(
                f"some parameters appear in more than one parameter group: "
                f"{len(again)} of the new group's are stepped already (as torch.optim refuses "
                f"for its own groups); nothing was added"
            )
        self.optimizer.add_param_group(group)
        self._masters.add(self.optimizer)

    def params_with_grads(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates that hold a gradient (masters in place of
        low-precision parameters): what to clip or inspect after ``unscale_``."""
        return [p for p in self._all_params() if p.grad is not None]

    @property
    def train(self) -> Callable[[], None]:
        """The wrapped optimizer's ``train()``: a schedule-free optimizer (``schedulefree``)
        moves the weights it steps to its training point. Absent where the wrapped optimizer
        has none (``hasattr`` says so, as trainers check); see `_mode_switch`."""
        return self._mode_switch("train")

    @property
    def eval(self) -> Callable[[], None]:
        """The wrapped optimizer's ``eval()``: a schedule-free optimizer moves the weights it
        steps to its evaluation point. Absent where the wrapped optimizer has none."""
        return self._mode_switch("eval")

    def _mode_switch(self, name: str) -> Callable[[], None]:
        """The wrapped optimizer's `name` method, run on the float32 masters where they are
        kept (first taking writes into the model, as a step does), then copied into the
        model's parameters: the model computes with the switched weights."""
        switch = getattr(self.optimizer, name, None)
        if not callable(switch):
            raise AttributeError(
                f"{type(self.optimizer).__name__} has no {name}() for LossScaleOptimizer to "
                "forward (a schedule-free optimizer has)"
            )

        def call() -> None:
            # (HF calls train() every micro-batch: in that mode already, a schedule-free
            # optimizer's groups say so, and nothing moves or is copied)
            modes = [g.get("train_mode") for g in self.optimizer.param_groups]
            if modes and all(m is (name == "train") for m in modes):
                return
            self._masters.follow_edits()
            switch()
            self._masters.copy_to_model()

        return call

    # -- the step ---------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate the scaled loss in `backward_context` (the compute dtype of the
        converted ``model``'s policy, when one was given); ``kwargs`` go to
        ``Tensor.backward``."""
        with self.backward_context(loss) as scaled:
            scaled.backward(**kwargs)

    def backward_context(
        self, loss: torch.Tensor
    ) -> contextlib.AbstractContextManager[torch.Tensor]:
        """`backward_context` for this optimizer alone, under the policy ``mixprec.apply``
        gave ``model`` (none without a model, or for a model it did not convert); yields
        the scaled loss, for a loop that calls the backward itself."""
        policy = applied_policy(self.model) if self.model is not None else None
        return backward_context(
            loss, self.scaler, (self,), policy.default if policy is not None else None
        )

    def check_can_backward(self) -> None:
        """Raise if this step's gradients were already unscaled: new scaled gradients added
        to unscaled ones would be wrong (accumulate first, unscale once before the step)."""
        if self._stage is OptState.UNSCALED:
            raise RuntimeError(
                "backward() after unscale_() in the same step: gradients would mix scaled and "
                "unscaled values. With gradient accumulation, unscale (or clip) only after "
                "the last micro-batch's backward."
            )
        if self._first_backward:  # (an activation option on a model whose forward never ran)
            self._first_backward = False
            if self.model is not None:
                warn_if_root_unused(self.model)
        if self._found_inf is not None:  # (`check_`: its flag would miss these gradients)
            raise RuntimeError(
                "backward() after check_() in the same step: the overflow flag it found "
                "would not see this backward's gradients (a fused step would apply an inf). "
                "With gradient accumulation, check only after the last micro-batch's backward."
            )

    def unscale_(self) -> None:
        """Divide this step's gradients by the loss scale, in place; idempotent until ``step``.

        Call it before clipping or inspecting gradients; ``step`` calls it when needed.
        """
        self.check_can_step()
        if self._stage is not OptState.UNSCALED:
            self._found_inf = self._unscale()
            self._found_at = self.scaler._steps
            self._grad_scale = None
            self._stage = OptState.UNSCALED

    @property
    def found_no_gradient(self) -> bool:
        """Whether this step's gradients, as ``unscale_`` or ``check_`` found them, were none
        at all (a ``zero_grad`` between backward and step, a loss reaching none of them)."""
        return self._gradless

    def check_unscaled_since_update(self) -> None:
        """Refuse a step whose gradients were unscaled (or checked) before another
        optimizer's step updated the scaler they share: one backward fed both, so they must
        step together, or this overflow would miss that update and the scale would move
        once per optimizer."""
        if self._found_inf is not None and self._found_at != self.scaler._steps:
            raise RuntimeError(
                f"{type(self.optimizer).__name__}'s gradients were unscaled (by unscale_() or "
                "a clip) before another optimizer's step() updated the scaler they share: its "
                "overflow would not count toward that update, and the scale would move once "
                "per optimizer. When one backward feeds several optimizers, step them "
                "together: mixprec.optim.joint_step(opt_a, opt_b) or precision.step(opt_a, "
                "opt_b)."
            )

    def check_(self) -> None:
        """Find this step's overflow flag without unscaling: for a fused optimizer, which
        divides by the scale inside its kernel (torch.amp's ``grad_scale`` protocol, as
        ``GradScaler`` drives one when nothing unscaled first). ``unscale_`` after it still
        unscales. ``joint_step`` calls it."""
        self.check_can_step()
        if self._stage is not OptState.UNSCALED and self._found_inf is None:
            grads = self._gather_grads()
            self._check_scaled_since_update(grads)
            self._found_inf = self.scaler.check_(grads)
            self._found_at = self.scaler._steps
            self._grad_scale = self.scaler.scale_tensor if self.scaler.enabled else None

    def step(self, closure: Callable[[], Any] | None = None) -> bool:
        """Unscale if needed, then take the step or skip it on inf/NaN, then update the scale.

        Returns True when the parameters were updated. Ends the scaler's iteration: when one
        backward feeds several optimizers sharing this scaler, use ``joint_step`` instead.
        ``closure`` (for LBFGS-style optimizers that re-evaluate the loss) is supported
        without loss scaling only: such a step cannot be skipped half-way. With
        ``compensation`` it is the compensated step, as without a closure.
        """
        if self._retired:
            self.check_can_step()  # raises
        if self.step_gate is not None and not self.step_gate():
            return False  # (a micro-batch inside the host's accumulation window)
        if closure is not None:
            return self._closure_step(closure)
        if self._needs_closure:
            raise TypeError(
                f"{type(self.optimizer).__name__}.step() needs a closure that re-evaluates the "
                f"loss: call step(closure) (precision.step(optimizer, closure=closure))"
            )
        scaler = self.scaler
        if not scaler.enabled:  # `_step_together`'s first case, `take_step(None)` inline
            self._masters.sync(self.optimizer)
            if self._compensator is not None:
                self._compensator.step(self.optimizer, attach=False)
            else:
                self.optimizer.step()
            self.end_step(True)
            scaler.update(scaler.unscale_([]), False)
            return True
        return _step_together((self,))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the wrapped optimizer's tensors and of the model's
        low-precision parameters; a step's ``unscale_`` is forgotten with them. Nothing
        inside an accumulation window its ``step_gate`` keeps."""
        if self.step_gate is not None and not self.step_gate():
            return
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._stage = OptState.READY
        self._found_inf = None
        self._grad_scale = None
        self._masters.zero_model_grads(set_to_none)

    def zero_model_grads(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the model's low-precision parameters (those its float32
        masters stand for) alone: for an integration whose trainer clears the wrapped
        optimizer's itself."""
        self._masters.zero_model_grads(set_to_none)

    # -- the step's parts, for joint_step and integrations (a loop calls step) ---------------

    @property
    def stage(self) -> OptState:
        """Where this optimizer is in its step: ``READY`` (after ``zero_grad``),
        ``UNSCALED`` (after ``unscale_``), ``STEPPED`` (after the step, taken or skipped)."""
        return self._stage

    @property
    def found_inf(self) -> torch.Tensor | None:
        """This step's overflow flag (a 0-dim float32 tensor, positive if a gradient was
        inf/NaN) once ``unscale_`` ran; None before."""
        return self._found_inf

    @property
    def skips_in_kernel(self) -> bool:
        """Whether the wrapped optimizer is fused and skips an overflowed step inside its
        kernel (flagged ``_step_supports_amp_scaling``): its step may be queued before the
        overflow flag is read."""
        return self._fused

    @property
    def _fused(self) -> bool:
        """Whether this step may skip inside the fused kernel. Not fused SGD's first step
        with momentum: it makes the momentum buffers (``torch.empty_like``) before its
        kernel, which a skip leaves unwritten, and every later step read that garbage
        (16-mixed's first steps overflow at the initial scale). Once every buffer is made,
        or without momentum, the kernel skips as the others do. Checked again when the state
        was replaced or emptied (a load, ``state.clear()``), a group added, or a momentum set
        (not per entry, which would cost a look-up per parameter a step: a parameter's entry
        emptied by hand, ``state[p] = {}``, goes unseen)."""
        if not self._fused_kernel or not self._checks_buffers:
            return self._fused_kernel
        groups = self.optimizer.param_groups
        state = self.optimizer.state
        seen = (id(state), len(state), [g.get("momentum") for g in groups])
        if seen == self._buffers_made:
            return True
        made = all(
            not g.get("momentum")
            or all(state.get(p, {}).get("momentum_buffer") is not None for p in g["params"])
            for g in groups
        )
        self._buffers_made = seen if made else None
        return made

    @property
    def needs_closure(self) -> bool:
        """Whether the wrapped optimizer's ``step`` requires a closure (LBFGS-style)."""
        return self._needs_closure

    def check_can_step(self) -> None:
        """Raise if a newer wrapper of the same optimizer retired this one."""
        if self._retired:
            raise RuntimeError(
                f"this LossScaleOptimizer was replaced by a newer wrapper of the same "
                f"{type(self.optimizer).__name__} (setup() by another Precision, or a second "
                f"LossScaleOptimizer): step the newer one, or the optimizer would be stepped "
                f"twice per iteration"
            )

    def take_step(self, found_inf: torch.Tensor | None) -> None:
        """Step the wrapped optimizer now, unchecked: the caller decided to. ``found_inf`` is
        the step's overflow flag after ``unscale_`` (handed to a fused optimizer, which skips
        by itself on it), or None for a step without loss scaling: the gradients are then
        moved into the masters first. ``end_step`` follows."""
        if found_inf is None:
            self._masters.sync(self.optimizer)
        else:  # (weights written since the unscale moved the gradients: a clip's neighbour)
            self._masters.follow_edits()
        if self._compensator is not None:
            self._compensator.step(self.optimizer, attach=False)
            return
        if not self._fused or found_inf is None:
            self.optimizer.step()
            return
        # torch.amp's protocol for optimizers flagged _step_supports_amp_scaling, as
        # GradScaler follows it: `found_inf` set, and `grad_scale` a fresh tensor of the
        # scale (times one the user set) when the gradients are still scaled (`check_`: the
        # kernel divides them), else the user's or None (after `unscale_`); both removed
        # after the step.
        opt = self.optimizer
        own = getattr(opt, "grad_scale", None)
        if self._grad_scale is not None:
            own = self._grad_scale * (1 if own is None else own)
        opt.grad_scale = own  # type: ignore[attr-defined]
        opt.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            opt.step()
        finally:
            del opt.grad_scale  # type: ignore[attr-defined]
            del opt.found_inf  # type: ignore[attr-defined]

    def end_step(self, stepped: bool) -> None:
        """End this step, taken (``stepped``: the model's parameters follow their masters) or
        skipped (``step_was_skipped``)."""
        self._masters.end_step(stepped)
        self.step_was_skipped = not stepped
        if self._followers_at != _FOLLOWERS_VERSION:  # (no call in a step otherwise)
            self._followers_at, self._followers = _FOLLOWERS_VERSION, _followers(self.optimizer)
        for scheduler in self._followers:  # each counts the step, taken or skipped
            state = scheduler.__dict__
            state[TAKEN_SINCE] = (state.get(TAKEN_SINCE) or 0) + stepped
        if self.optimizer.state is not self._seen_state:  # (loaded since the last step)
            self._seen_state, self._taken_since_load = self.optimizer.state, 0
        if self._taken_since_load is not None:
            self._taken_since_load += stepped
        self._stage = OptState.STEPPED
        self._found_inf = None
        self._grad_scale = None

    def __repr__(self) -> str:
        return (
            f"LossScaleOptimizer({type(self.optimizer).__name__}, scaler={self.scaler!r}, "
            f"master_weights={len(self._masters)}, compensation={self.compensation!r})"
        )

    # -- internals --------------------------------------------------------------------------

    def _gather_grads(self) -> list[torch.Tensor]:
        """The masters' ``sync``, then every gradient the optimizer will use, in one pass
        over the parameters in the common case."""
        masters = self._masters
        if masters:
            masters.move_grads()
        grads = self._grads()
        if grads is None:
            masters.sync(self.optimizer)
            grads = self._grads()
            assert grads is not None
        return grads

    def _grads(self) -> list[torch.Tensor] | None:
        """The gradients of the tensors in ``param_groups``; None if one of them is of a
        dtype that should have a master (one pass over the parameters either way)."""
        master_dtypes = self._masters.dtypes
        grads = []
        for p in self._all_params():
            g = p.grad
            if g is None:
                continue
            if p.dtype in master_dtypes:
                return None
            if g.is_sparse and g.dtype == torch.float16 and not g.is_coalesced():
                # Duplicate indices are summed by the optimizer; check the sums instead.
                g = p.grad = g.coalesce()
            grads.append(g)
        return grads

    def _unscale(self) -> torch.Tensor:
        grads = self._gather_grads()
        self._check_scaled_since_update(grads)
        return self.scaler.unscale_(grads)

    def _check_scaled_since_update(self, grads: list[torch.Tensor]) -> None:
        self._gradless = not grads
        if grads and self.scaler.enabled and not self.scaler.scaled_since_update:
            raise RuntimeError(
                "these gradients were not produced through this scaler since its last update: "
                "no backward ran through it since the last step (gradients left from before, "
                "such as the zeros zero_grad(set_to_none=False) keeps, are not this step's: "
                "call backward via Precision.backward or LossScaleOptimizer.backward first), "
                "or the shared scaler was already updated by another optimizer's step(). When "
                "one backward feeds several optimizers, step them together: "
                "mixprec.optim.joint_step(opt_a, opt_b) or precision.step(opt_a, opt_b)."
            )

    def _closure_step(self, closure: Callable[[], Any]) -> bool:
        if self.scaler.enabled:
            raise RuntimeError(
                f"step(closure) of {type(self.optimizer).__name__} under loss scaling: the "
                f"optimizer evaluates the closure inside its step (LBFGS several times), where "
                f"an overflow found in the closure's gradients can no longer skip it, as torch's "
                f"GradScaler refuses it too. Without a closure, call backward and step(); or "
                f"train without loss scaling: a bfloat16 or float32 precision ('bf16-mixed', "
                f"'32-true') or scaler='none'"
            )

        self._masters.follow_edits()  # (before the first evaluation copies masters over)

        def evaluate() -> Any:
            self._masters.copy_to_model()  # the optimizer moved the masters: the model follows
            with torch.enable_grad():
                loss = closure()
            self._masters.sync(self.optimizer)
            return loss

        if self._compensator is not None:
            self._compensator.step(self.optimizer, evaluate, attach=False)
        else:
            self.optimizer.step(evaluate)
        self.end_step(True)
        self.scaler.update(self.scaler.unscale_([]), False)
        return True


def _trainable(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]


def _check_wrappable(optimizer: Any, master_weights: bool | None, model: nn.Module | None) -> None:
    """Refuse what `LossScaleOptimizer` cannot wrap or be told, naming what it takes."""
    if isinstance(optimizer, LossScaleOptimizer):
        raise TypeError("this optimizer is already wrapped in a LossScaleOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"LossScaleOptimizer wraps a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}; build one from the model's parameters first, "
            f"e.g. torch.optim.AdamW(model.parameters())"
        )
    if master_weights not in MASTER_DTYPES:
        raise TypeError(f"master_weights must be None, True or False, got {master_weights!r}")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")


def _compensator_for(
    optimizer: torch.optim.Optimizer, compensation: str | None, master_weights: bool | None
) -> Compensator | None:
    """The `Compensator` stepping `optimizer` under `compensation` (None without), after
    checking that the optimizer and its parameters take it."""
    check_compensation(compensation)
    if compensation is None:
        return None
    if master_weights:
        raise ValueError(
            "compensation and master_weights=True are two answers to one problem: "
            "float32 masters already keep small updates; choose one"
        )
    if isinstance(optimizer, LowBitOptimizer):
        raise TypeError(
            f"{type(optimizer).__name__} compensates its own 16-bit updates: build it with "
            f"compensation={compensation!r} ({type(optimizer).__name__}(..., "
            f"compensation={compensation!r})) and leave compensation out here, or pass a "
            "torch AdamW, Adam or SGD with optimizer_states=... (converted with this "
            "compensation)"
        )
    Compensator.check_optimizer(optimizer)
    if not any(p.dtype in COMPENSATED_DTYPES for p in _trainable(optimizer)):
        dtypes = sorted({str(p.dtype) for p in _trainable(optimizer)})
        raise ValueError(
            f"compensation={compensation!r} is for bfloat16/float16 parameters, but "
            f"this optimizer's trainable parameters are {dtypes}: use a '*-true' "
            f"16-bit policy ('bf16-true'), or drop compensation"
        )
    return Compensator(compensation)


@contextmanager
def backward_context(
    loss: torch.Tensor,
    scaler: LossScaler,
    optimizers: Iterable[LossScaleOptimizer],
    policy: Policy | None,
) -> Iterator[torch.Tensor]:
    """The one context a scaled backward runs in; yields ``loss`` times the scale, to
    backpropagate inside it. ``Precision.backward_context`` (the Trainer, the doctor, the
    bench, the search and the Lightning, Hugging Face and Accelerate integrations go
    through it) and ``LossScaleOptimizer.backward_context`` enter it.

    - `optimizers` refuse a backward once this step's gradients were unscaled (scaled and
      unscaled gradients would add up; float32 masters receive theirs at the unscale);
    - under a "true" `policy` torch's default dtype is its compute dtype, as it was in the
      forward: an activation-checkpointed block recomputes its forward inside the backward,
      and a tensor it creates without a dtype must come out as it did the first time (float32
      and attention islands re-enter their own regions when recomputed). A mixed policy
      needs nothing: checkpointing restores the forward's autocast itself.
    """
    scaled = scale_for_backward(loss, scaler, optimizers)
    dtype = backward_dtype(policy)
    if dtype is not None:
        with default_dtype(dtype):
            yield scaled
    else:
        yield scaled


def scale_for_backward(
    loss: torch.Tensor, scaler: LossScaler, optimizers: Iterable[LossScaleOptimizer]
) -> torch.Tensor:
    """`backward_context`'s checks, then ``loss`` times the scale: what a backward that needs
    no context of its own (`Precision.backward` under a mixed policy) runs before it."""
    if is_scaled(loss):
        raise ValueError(
            "the loss given to the backward is already multiplied by the loss scale "
            "(scaler.scale(loss)), or computed from such a loss (scaler.scale(loss) / "
            "accumulation_steps, scaler.scale(loss) * weight): pass the loss itself, divided "
            "or weighted first (loss / accumulation_steps), the backward scales it once"
        )
    for opt in optimizers:
        opt.check_can_backward()
    return scaler.scale(loss)


def backward_dtype(policy: Policy | None) -> torch.dtype | None:
    """The default dtype `backward_context` sets for a backward under ``policy``: a "true"
    policy's compute dtype where torch's default differs; None where nothing is set."""
    if policy is not None and not policy.is_mixed and needs_default_dtype(policy.compute_dtype):
        return policy.compute_dtype
    return None


def _sharded(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters that are DTensors (sharded by FSDP2)."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:  # never imported: no DTensor exists (and none is imported for this)
        return []
    return [p for p in params if isinstance(p, module.DTensor)]


def check_sharded_masters(
    stored: Iterable[torch.dtype],
    *,
    master_weights: bool | None,
    compensation: str | None,
    setup: str,
) -> None:
    """Raise `PrecisionError` if parameters sharded by FSDP2 and stored in `stored` dtypes
    would get float32 master weights (`master_weights` as `LossScaleOptimizer` takes it: by
    default for float16) or compensation buffers: neither works on DTensors (the first taken
    step fails deep inside torch), and a ``*-mixed`` policy gives the same training with
    float32 shards as the masters. `setup` names the refused set-up in the message.

    `LossScaleOptimizer` (on DTensor parameters), `mixprec.sharding.shard` and the Trainer's
    ``strategy="fsdp"`` all refuse through this one check, with one reason."""
    kinds = set(stored)
    masters = kinds & set(MASTER_DTYPES[master_weights])
    if not masters and compensation is None:
        return
    kept = "compensation buffers" if compensation is not None else "float32 master weights"
    shown = masters or kinds & set(COMPENSATED_DTYPES)
    dtypes = "/".join(sorted(str(d).removeprefix("torch.") for d in shown)) or "16-bit"
    raise PrecisionError(
        f"{setup} with master_weights={master_weights}, compensation={compensation!r} would "
        f"keep {kept} beside {dtypes} parameters sharded by FSDP2 (DTensors), which mixprec "
        f"does not support: its masters and compensation do not work on DTensors (the first "
        f"step would fail). Use a '*-mixed' policy ('16-mixed' rather than '16-true', "
        f"'bf16-mixed' rather than 'bf16-true'): its sharded parameters are float32, they are "
        f"the masters, and FSDP2 computes in 16 bits. To step the 16-bit weights themselves, "
        f"pass master_weights=False and no compensation (Precision, LossScaleOptimizer and "
        f"shard take master_weights)"
    )


def _check_sharded_params(
    optimizer: torch.optim.Optimizer,
    trainable: list[torch.Tensor],
    master_weights: bool | None,
    compensation: str | None,
) -> None:
    """`check_sharded_masters` for the DTensors among an optimizer's trainable parameters."""
    sharded = _sharded(trainable)
    if sharded:
        check_sharded_masters(
            {p.dtype for p in sharded},
            master_weights=master_weights,
            compensation=compensation,
            setup=f"LossScaleOptimizer({type(optimizer).__name__})",
        )


def _warn_uncompensated(
    optimizer: torch.optim.Optimizer, master_dtypes: tuple[torch.dtype, ...]
) -> None:
    """One ``UserWarning`` when 16-bit trainable parameters are stepped in place, uncompensated:
    an update below 2^-9 (bfloat16) or 2^-12 (float16) of a weight rounds away. A low-bit
    states optimizer built with its own ``compensation=`` compensates them itself."""
    if isinstance(optimizer, LowBitOptimizer) and optimizer.compensation is not None:
        return
    plain = {
        str(p.dtype).removeprefix("torch.")
        for p in _trainable(optimizer)
        if p.dtype in COMPENSATED_DTYPES and p.dtype not in master_dtypes
    }
    if plain:
        sharded = bool(_sharded(_trainable(optimizer)))
        name = type(optimizer).__name__
        # (master weights are not offered for sharded 16-bit weights)
        masters = "" if sharded else ", or pass master_weights=True to Precision"
        if isinstance(optimizer, LowBitOptimizer) and optimizer.stands_for is not None:
            # (converted from the torch optimizer given: Precision converts it with one)
            fix = "Pass compensation='kahan' (or 'stochastic') to Precision" + (
                "" if sharded else ", or master_weights=True"
            )
        elif isinstance(optimizer, LowBitOptimizer):
            # (it compensates its own updates, sharded too: Precision refuses to add one)
            fix = (
                f"Build it with compensation='kahan' (or 'stochastic'): {name}(..., "
                f"compensation='kahan'){masters}{'' if sharded else ' / LossScaleOptimizer'}"
            )
        elif sharded:
            fix = (
                "Sharded with FSDP, train a *-mixed policy instead: FSDP keeps float32 sharded "
                "masters and computes in 16 bits (compensation and master_weights are not "
                "offered for sharded 16-bit weights)"
            )
        else:
            fix = (
                "Pass compensation='kahan' (or 'stochastic') to Precision / "
                "LossScaleOptimizer, or master_weights=True"
            )
        warnings.warn(
            f"{name} updates {'/'.join(sorted(plain))} parameters in place "
            f"without float32 master weights: updates much smaller than a weight round away "
            f"and training stalls. {fix}",
            UserWarning,
            stacklevel=3,
        )


def joint_step(*optimizers: LossScaleOptimizer) -> bool:
    """Step several wrapped optimizers that share one scaler as one iteration.

    As ``torch.amp.GradScaler`` does: every optimizer's gradients are unscaled and checked
    on their own (the flags are all-reduced across ranks), each optimizer steps unless its
    own gradients overflowed, and the scale is updated once, backing off if any overflowed.
    Returns True when every optimizer stepped; ``step_was_skipped`` tells each one. Inside
    an accumulation window their ``step_gate`` keeps (Accelerate's), nothing is stepped
    and False is returned, as each one's ``step`` does.
    """
    if not optimizers:
        raise ValueError("joint_step() needs at least one LossScaleOptimizer")
    for opt in optimizers:
        if not isinstance(opt, LossScaleOptimizer):
            raise TypeError(
                f"joint_step() takes LossScaleOptimizers, got {type(opt).__name__}: step "
                f"the optimizers returned by precision.setup() or wrap them first"
            )
        opt.check_can_step()
    if len(set(map(id, optimizers))) != len(optimizers):
        raise ValueError("an optimizer was passed twice: it would be stepped twice")
    scaler = optimizers[0].scaler
    if any(opt.scaler is not scaler for opt in optimizers):
        raise ValueError("joint_step() needs optimizers that share one scaler")
    # inside a host's accumulation window (`step_gate`), as one optimizer's `step`: no step
    held = [opt.step_gate is not None and not opt.step_gate() for opt in optimizers]
    if any(held):
        if not all(held):
            raise ValueError(
                "joint_step() got optimizers of which some are inside an accumulation window "
                "(their step_gate holds them: Accelerate's sync_gradients is False) and some "
                "are not: step them together at the end of one window, or step each on its own"
            )
        return False
    return _step_together(optimizers)


def _step_together(optimizers: tuple[LossScaleOptimizer, ...]) -> bool:
    """`joint_step` once its arguments are checked (a single optimizer's `step` checks its
    own)."""
    scaler = optimizers[0].scaler
    if not scaler.enabled:
        for opt in optimizers:
            opt.take_step(None)
            opt.end_step(True)
        scaler.update(scaler.unscale_([]), False)
        return True
    for opt in optimizers:
        opt.check_unscaled_since_update()
    for opt in optimizers:
        # a fused optimizer divides by the scale in its kernel unless unscale_ came first
        if opt.skips_in_kernel and opt.stage is not OptState.UNSCALED:
            opt.check_()
        else:
            opt.unscale_()
    if not scaler.scaled_since_update:
        # no backward through the scaler since its update, so no gradient (one would have
        # been refused above): a step of nothing, skipped, so that neither the scale nor a
        # gated scheduler moves (torch's GradScaler refuses it)
        for opt in optimizers:
            opt.end_step(False)
        return False
    _refuse_gradless(optimizers)
    flags: list[torch.Tensor] = [opt.found_inf for opt in optimizers]  # type: ignore[misc]
    # one optimizer: its 0-dim flag as it is, so a step dispatches what GradScaler's does
    found = scaler.synchronize(flags[0] if len(flags) == 1 else torch.stack(flags))
    per_opt = [found] if len(flags) == 1 else list(found.unbind())
    # Fused optimizers skip by themselves on device, so with only those the flags are read
    # after their step is queued; otherwise they are read first (the one host sync).
    fused_only = all([opt.skips_in_kernel for opt in optimizers])
    overflow = None if fused_only else _read_flags(found)
    for i, opt in enumerate(optimizers):
        if overflow is None or not overflow[i]:
            opt.take_step(per_opt[i])
    if overflow is None:
        overflow = _read_flags(found)
    for opt, bad in zip(optimizers, overflow, strict=True):
        opt.end_step(not bad)
    combined = found.amax() if len(flags) > 1 else flags[0]
    scaler.update(combined, any(overflow))  # type: ignore[arg-type]
    return not any(overflow)


def _refuse_gradless(optimizers: tuple[LossScaleOptimizer, ...]) -> None:
    """Refuse a step in which no optimizer has a single gradient after a backward through
    the scaler (a ``zero_grad`` between backward and step, a loss that reaches none of their
    parameters): it would count as a clean step, grow the scale and advance gated schedulers
    with no weight moved. torch.amp.GradScaler refuses a step of such an optimizer too; in a
    step together, one without gradients beside one with them is taken (a GAN's
    alternating losses, the Trainer stepping every optimizer), as before."""
    if all(opt.found_no_gradient for opt in optimizers):
        names = ", ".join(type(opt.optimizer).__name__ for opt in optimizers)
        raise RuntimeError(
            f"{names} {'has' if len(optimizers) == 1 else 'have'} no gradient to step, "
            "though a backward ran through the loss scaler since its last update: was "
            "zero_grad() called between backward and step, or does the loss reach none of "
            "the parameters? (torch.amp.GradScaler refuses such a step too: it would count "
            "as a clean step and grow the scale with no weight moved)"
        )


def _read_flags(found: torch.Tensor) -> list[bool]:
    """The overflow flags on the host: one read (``.item()`` of a single flag, as GradScaler)."""
    if found.dim() == 0:
        return [found.item() > 0]
    return [f > 0 for f in found.tolist()]


class MasterKeyedState(MutableMapping):
    """An optimizer's state (``state``, keyed by the tensors it steps) seen through
    ``master_of``: a model parameter with a float32 master stands for its master. Iterating
    gives the optimizer's own keys.

    Reads (``get``, ``in``) never make an entry. Indexing a tensor the optimizer holds
    (one of ``groups``, or a parameter whose master is) makes an empty one where it has none,
    as torch's defaultdict; a tensor it does not hold (a frozen layer's) is a KeyError: an
    entry for it would make torch's ``state_dict`` fail. ``setdefault`` stores its default
    as a dict's does."""

    def __init__(
        self,
        state: Any,
        master_of: Mapping[torch.Tensor, torch.Tensor],
        groups: list[dict[str, Any]] | None = None,
    ) -> None:
        self._state = state
        self._master_of = master_of
        self._groups = groups

    def _key(self, p: Any) -> Any:
        return self._master_of.get(p, p) if isinstance(p, torch.Tensor) else p

    def _holds(self, key: Any) -> bool:
        if not isinstance(key, torch.Tensor) or self._groups is None:
            return True  # (a non-tensor key torch's state_dict saves as it is)
        return any(q is key for g in self._groups for q in g["params"])

    def __getitem__(self, p: Any) -> Any:
        key = self._key(p)
        if key not in self._state and not self._holds(key):
            raise KeyError(
                f"a {p.dtype} tensor of shape {tuple(p.shape)} this optimizer does not step "
                "(a frozen layer's?): it has no state; .get(p) reads without making one"
            )
        return self._state[key]

    def get(self, p: Any, default: Any = None) -> Any:
        key = self._key(p)
        return self._state[key] if key in self._state else default

    def setdefault(self, p: Any, default: Any = None) -> Any:
        key = self._key(p)
        if key not in self._state:
            self._state[key] = default
        return self._state[key]

    def __setitem__(self, p: Any, value: Any) -> None:
        self._state[self._key(p)] = value

    def __delitem__(self, p: Any) -> None:
        del self._state[self._key(p)]

    def __contains__(self, p: object) -> bool:
        return self._key(p) in self._state

    def __iter__(self) -> Iterator[Any]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


# where a followed scheduler counts the steps its optimizer took since its last gated step
# (None: since before it was followed, unknown): in the scheduler's own __dict__, which a
# torch scheduler's state_dict holds, so a checkpoint resumes the count with the scheduler
TAKEN_SINCE = "_mixprec_taken_since"
# the schedulers following each optimizer, keyed by the torch optimizer they were given
_FOLLOWERS: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()
_FOLLOWERS_VERSION = 0  # raised at each new follower: wrappers then look theirs up again


def trained_params(optimizer: Any) -> list[torch.Tensor]:
    """The model parameters ``optimizer`` (torch's, or a wrapper) trains: those its groups
    hold, each master weight mapped back to its parameter (a wrapper keeping float32
    masters puts them in the groups)."""
    live = _live_wrapper(optimizer)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    return [live.model_param(p) for p in held] if isinstance(live, LossScaleOptimizer) else held


def _live_wrapper(optimizer: Any) -> Any:
    """The LossScaleOptimizer stepping ``optimizer`` (itself when it is one), else it."""
    if isinstance(optimizer, LossScaleOptimizer):
        return optimizer
    # the plain optimizer a wrapper steps (Precision.step accepts either); a torch optimizer
    # converted into a low-bit one (optimizer_states=) stands for that one
    optimizer = getattr(optimizer, "_converted_into", optimizer)
    live = _WRAPPERS.get(optimizer)
    return live[0]() if live is not None else optimizer


def follow_steps(scheduler: Any, optimizer: Any) -> None:
    """Count the steps ``optimizer`` (a LossScaleOptimizer, or the torch optimizer one wraps
    or will wrap) takes for ``scheduler`` from now on, so that its next gated step advances
    if one was taken since (`scheduler_step`), also for a scheduler stepped every few steps
    whose first window ends on a skip. `scheduler_step` starts following at its first call,
    which itself asks only about the last step."""
    state = getattr(scheduler, "__dict__", None)
    if state is None:  # (a scheduler without one: gated by the last step only)
        return
    state.setdefault(TAKEN_SINCE, None)
    global _FOLLOWERS_VERSION
    key = optimizer.optimizer if isinstance(optimizer, LossScaleOptimizer) else optimizer
    with contextlib.suppress(TypeError):  # (an optimizer that takes no weak reference)
        followers = _FOLLOWERS.setdefault(key, weakref.WeakSet())
        if scheduler not in followers:
            followers.add(scheduler)
            _FOLLOWERS_VERSION += 1


def _followers(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """The schedulers following ``optimizer`` (the one a wrapper steps): given it, or the
    torch optimizer converted into it (one followed under both is counted once)."""
    return tuple(
        dict.fromkeys(
            scheduler
            for key, schedulers in list(_FOLLOWERS.items())
            if key is optimizer or getattr(key, "_converted_into", None) is optimizer
            for scheduler in schedulers
        )
    )


def scheduler_step(scheduler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> bool:
    """Advance ``scheduler`` unless every step ``optimizer`` (a LossScaleOptimizer, or the
    optimizer one wraps) made since the scheduler's last gated step was skipped: once per
    taken step for a scheduler stepped after each, and also for one stepped every few
    steps or once an epoch (a skip in the window does not cost it the window's advance).
    Where the steps since are unknown (its first gated step, unless `follow_steps` started
    the count earlier), the last step decides, as it does before any step (not skipped).
    The count is kept in the scheduler's state, so a checkpoint resumes it: a scheduler
    loaded so adds to it, at its first gated step, the steps taken since the optimizer's
    state was loaded (from the same checkpoint), or, where the optimizer's was not, the last
    step (`follow_steps` after the load counts every step since instead).

    torch's schedulers cannot tell a skipped step from a taken one; without this gate a run
    with many overflows moves through its learning-rate schedule too fast. ``args`` and
    ``kwargs`` go to ``scheduler.step`` (e.g. a metric for ReduceLROnPlateau). Returns whether
    the scheduler advanced.
    """
    lso = _live_wrapper(optimizer)
    if isinstance(lso, LossScaleOptimizer):
        state = getattr(scheduler, "__dict__", {})
        taken = state.get(TAKEN_SINCE)
        if taken is not None and scheduler not in _followers(lso.optimizer):
            # a count loaded (a resumed or copied scheduler) that no step since has added to:
            # the steps taken since the optimizer's state was loaded (a resume, from the same
            # checkpoint), else the last step, the one known since
            since = lso.steps_taken_since_load
            taken += (not lso.step_was_skipped) if since is None else since
        follow_steps(scheduler, lso)
        advance = not lso.step_was_skipped if taken is None else taken > 0
        if TAKEN_SINCE in state:
            state[TAKEN_SINCE] = 0
        if not advance:
            return False
    scheduler.step(*args, **kwargs)
    return True


class SkipAwareScheduler:
    """An LR scheduler that does not advance when its ``LossScaleOptimizer`` skipped every
    step since its last step (`scheduler_step`, counting from when it is wrapped: its first
    step before any optimizer step advances, as torch's does), for trainers that step
    schedulers themselves (Lightning, Hugging Face).

    Attributes (``optimizer``, ``get_last_lr``, ``last_epoch``) are the wrapped scheduler's,
    and so is the state saved in checkpoints (they load without mixprec); the scheduler itself
    is ``.scheduler``.
    """

    def __init__(self, scheduler: Any, optimizer: LossScaleOptimizer) -> None:
        self.scheduler = scheduler
        self.loss_scale_optimizer = optimizer
        follow_steps(scheduler, optimizer)

    def step(self, *args: Any, **kwargs: Any) -> bool:
        """Advance unless the optimizer skipped every step since the last (`scheduler_step`);
        returns whether it did."""
        return scheduler_step(self.scheduler, self.loss_scale_optimizer, *args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the wrapped scheduler's state."""
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"SkipAwareScheduler({self.scheduler!r})"
