"""``LossScaleOptimizer``: loss scaling and float32 master weights around any torch optimizer.

Wrap your optimizer (as in Keras)::

    opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters()))
    for x, y in data:
        opt.zero_grad()
        opt.backward(loss_fn(model(x), y))   # scaled backward
        opt.unscale_()                       # optional: before clipping or inspecting grads
        torch.nn.utils.clip_grad_norm_(opt.params_with_grads(), 1.0)
        opt.step()                           # unscale, check, step or skip, update the scale
        scheduler_step(scheduler, opt)       # the LR schedule does not advance on a skip

Several optimizers can share one scaler. When each has its own backward (a GAN's
discriminator then generator), call each ``step()`` as usual: every step ends one scaler
iteration. When one backward feeds several optimizers, step them together with
``joint_step(opt_a, opt_b)``: all gradients are checked, all optimizers skip if any
gradient overflowed, and the scale is updated once. Stepping them one by one instead
raises an error rather than unscaling the second optimizer's gradients with a scale the
first one already changed.

Float16 trainable parameters get float32 master copies: the wrapped optimizer is re-pointed
at the masters, gradients are copied into them and unscaled in float32 (where small values
survive), the optimizer updates the masters, and the float16 parameters are refreshed from
them after each taken step. This makes pure float16 training work where
``torch.amp.GradScaler`` refuses float16 gradients.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from mixprec.scaling import LossScaler, as_loss_scaler

__all__ = ["LossScaleOptimizer", "joint_step", "scheduler_step"]

# which parameter dtypes get float32 masters, per value of `master_weights`
_MASTER_DTYPES: dict[bool | None, tuple[torch.dtype, ...]] = {
    None: (torch.float16,),
    True: (torch.float16, torch.bfloat16),
    False: (),
}


class LossScaleOptimizer:
    """Wrap ``optimizer`` so that its step is loss-scaled and, if needed, uses master weights.

    Args:
        optimizer: any ``torch.optim.Optimizer``; fused ones (``fused=True`` Adam, AdamW, SGD,
            flagged ``_step_supports_amp_scaling``) get the overflow flag and skip inside
            their kernel, so no host sync precedes their step.
        scaler: ``None`` or ``"dynamic"`` (a new ``DynamicLossScaler``), a number (a static
            scale), ``"none"``, or a ``LossScaler`` instance, possibly shared with other
            optimizers.
        master_weights: ``None`` keeps float32 masters for trainable float16 parameters;
            ``True`` also for bfloat16 ones; ``False`` never (float16 gradients are then
            unscaled in float16, where small values can flush to zero).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: LossScaler | str | float | None = None,
        *,
        master_weights: bool | None = None,
    ) -> None:
        if isinstance(optimizer, LossScaleOptimizer):
            raise TypeError("this optimizer is already wrapped in a LossScaleOptimizer")
        self.optimizer = optimizer
        self.scaler = as_loss_scaler(scaler, needs_scaling=True)
        self._master_dtypes = _MASTER_DTYPES[master_weights]
        self._model_params: list[torch.Tensor] = []
        self._masters: list[torch.Tensor] = []
        self._master_of: dict[torch.Tensor, torch.Tensor] = {}
        for group in optimizer.param_groups:
            self._add_masters(group)
        self._fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self._found_inf: torch.Tensor | None = None
        self.step_was_skipped = False
        first = next(iter(self._all_params()), None)
        if first is not None and self.scaler.device != first.device:
            self.scaler.to(first.device)

    # -- passthrough ------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (holding the masters, if any)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's default hyperparameters."""
        return self.optimizer.defaults

    @property
    def loss_scale(self) -> float:
        """The current loss scale (a host sync)."""
        return self.scaler.loss_scale

    @property
    def master_params(self) -> Mapping[torch.Tensor, torch.Tensor]:
        """Model parameter -> its float32 master, for parameters that have one."""
        return self._master_of

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer, with masters where needed."""
        self.optimizer.add_param_group(group)
        self._add_masters(self.optimizer.param_groups[-1])

    def params_with_grads(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates that hold a gradient (masters in place of
        low-precision parameters): what to clip or inspect after ``unscale_``."""
        return [p for p in self._all_params() if p.grad is not None]

    # -- the step ---------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate the scaled loss; ``kwargs`` go to ``Tensor.backward``."""
        self.check_can_backward()
        self.scaler.scale(loss).backward(**kwargs)

    def check_can_backward(self) -> None:
        """Raise if this step's gradients were already unscaled: new scaled gradients added
        to unscaled ones would be wrong (accumulate first, unscale once before the step)."""
        if self._found_inf is not None:
            raise RuntimeError(
                "backward() after unscale_() in the same step: gradients would mix scaled and "
                "unscaled values. With gradient accumulation, unscale (or clip) only after "
                "the last micro-batch's backward."
            )

    def unscale_(self) -> None:
        """Divide this step's gradients by the loss scale, in place; idempotent until ``step``.

        Call it before clipping or inspecting gradients; ``step`` calls it when needed.
        """
        if self._found_inf is None:
            self._found_inf = self._unscale()

    def step(self) -> bool:
        """Unscale if needed, then take the step or skip it on inf/NaN, then update the scale.

        Returns True when the parameters were updated. Ends the scaler's iteration: when one
        backward feeds several optimizers sharing this scaler, use ``joint_step`` instead.
        """
        return joint_step(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the wrapped optimizer's tensors and of the model's
        low-precision parameters; a step's ``unscale_`` is forgotten with them."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._found_inf = None
        if set_to_none:
            for p in self._model_params:
                p.grad = None
        else:
            grads = [p.grad for p in self._model_params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, the scaler's state and the float32 master weights."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "master_weights": [m.detach() for m in self._masters],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict``; the model's low-precision parameters are refreshed from
        the restored masters, so the run continues exactly where it was saved."""
        saved = state["master_weights"]
        if len(saved) != len(self._masters) or any(
            s.shape != m.shape for s, m in zip(saved, self._masters, strict=True)
        ):
            raise ValueError(
                f"checkpoint has {len(saved)} master weights that do not match this "
                f"optimizer's {len(self._masters)}; was it saved with the same model and policy?"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        if self._masters:
            with torch.no_grad():
                torch._foreach_copy_(
                    self._masters,
                    [s.to(m.device) for s, m in zip(saved, self._masters, strict=True)],
                )
                torch._foreach_copy_(self._model_params, self._masters)

    def __repr__(self) -> str:
        return (
            f"LossScaleOptimizer({type(self.optimizer).__name__}, scaler={self.scaler!r}, "
            f"master_weights={len(self._masters)})"
        )

    # -- internals --------------------------------------------------------------------------

    def _all_params(self) -> Iterator[torch.Tensor]:
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def _add_masters(self, group: dict[str, Any]) -> None:
        params = group["params"]
        for i, p in enumerate(params):
            if not (p.requires_grad and p.dtype in self._master_dtypes):
                continue
            master = torch.nn.Parameter(p.detach().to(torch.float32))
            params[i] = master
            if p in self.optimizer.state:
                self.optimizer.state[master] = {
                    k: v.to(torch.float32) if torch.is_tensor(v) and v.dtype == p.dtype else v
                    for k, v in self.optimizer.state.pop(p).items()
                }
            self._model_params.append(p)
            self._masters.append(master)
            self._master_of[p] = master

    def _copy_grads_to_masters(self) -> None:
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for p, m in zip(self._model_params, self._masters, strict=True):
            g = p.grad
            if g is None:
                m.grad = None
            elif m.grad is None or g.is_sparse or m.grad.is_sparse:
                m.grad = g.to(torch.float32)
            else:
                dst.append(m.grad)
                src.append(g)
        if dst:
            torch._foreach_copy_(dst, src)

    def _gather_grads(self) -> list[torch.Tensor]:
        if self._masters:
            self._copy_grads_to_masters()
        grads = []
        for p in self._all_params():
            g = p.grad
            if g is None:
                continue
            if g.is_sparse and g.dtype == torch.float16 and not g.is_coalesced():
                # Duplicate indices are summed by the optimizer; check the sums instead.
                g = p.grad = g.coalesce()
            grads.append(g)
        return grads

    def _unscale(self) -> torch.Tensor:
        grads = self._gather_grads()
        if grads and self.scaler.enabled and not self.scaler.scaled_since_update:
            raise RuntimeError(
                "these gradients were not produced through this scaler since its last update "
                "(call backward via LossScaleOptimizer.backward or Precision.backward), or the "
                "shared scaler was already updated by another optimizer's step(). When one "
                "backward feeds several optimizers, step them together: "
                "mixprec.optim.joint_step(opt_a, opt_b) or precision.step(opt_a, opt_b)."
            )
        return self.scaler.unscale_(grads)

    def _inner_step(self, found_inf: torch.Tensor) -> None:
        if not self._fused:
            self.optimizer.step()
            return
        # torch's protocol for fused optimizers: they read `found_inf` (and `grad_scale`,
        # left unset: the gradients are already unscaled) and leave everything untouched
        # when it is non-zero. Unscaling in our pass rather than in their kernel is the
        # cheaper split: a check-only pass plus an unscale inside the kernel costs more.
        self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf  # type: ignore[attr-defined]

    def _finish_step(self, stepped: bool) -> None:
        if stepped and self._masters:
            with torch.no_grad():
                torch._foreach_copy_(self._model_params, self._masters)
        self.step_was_skipped = not stepped
        self._found_inf = None


def joint_step(*optimizers: LossScaleOptimizer) -> bool:
    """Step several wrapped optimizers that share one scaler as one iteration.

    Every optimizer's gradients are unscaled and checked, the overflow flags are combined
    (and all-reduced across ranks), then either all optimizers step or all skip, and the
    scale is updated once. Returns True when they stepped.
    """
    if not optimizers:
        raise ValueError("joint_step() needs at least one LossScaleOptimizer")
    scaler = optimizers[0].scaler
    if any(opt.scaler is not scaler for opt in optimizers):
        raise ValueError("joint_step() needs optimizers that share one scaler")
    if not scaler.enabled:
        for opt in optimizers:
            if opt._masters:
                opt._copy_grads_to_masters()
            opt.optimizer.step()
            opt._finish_step(True)
        scaler.update(scaler.unscale_([]), False)
        return True
    for opt in optimizers:
        opt.unscale_()
    flags = [opt._found_inf for opt in optimizers]
    found_inf = flags[0] if len(flags) == 1 else torch.stack(flags).amax()
    found_inf = scaler.synchronize(found_inf)
    # Fused optimizers skip by themselves on device, so with only those the flag is read
    # after their step is queued; otherwise it is read first (the one host sync).
    overflow = None if all(opt._fused for opt in optimizers) else bool(found_inf.item())
    if not overflow:
        for opt in optimizers:
            opt._inner_step(found_inf)
    if overflow is None:
        overflow = bool(found_inf.item())
    for opt in optimizers:
        opt._finish_step(not overflow)
    scaler.update(found_inf, overflow)
    return not overflow


def scheduler_step(scheduler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> bool:
    """Advance ``scheduler`` unless ``optimizer`` (a LossScaleOptimizer) skipped its last step.

    torch's schedulers cannot tell a skipped step from a taken one; without this gate a run
    with many overflows moves through its learning-rate schedule too fast. ``args`` and
    ``kwargs`` go to ``scheduler.step`` (e.g. a metric for ReduceLROnPlateau). Returns whether
    the scheduler advanced.
    """
    if isinstance(optimizer, LossScaleOptimizer) and optimizer.step_was_skipped:
        return False
    scheduler.step(*args, **kwargs)
    return True
