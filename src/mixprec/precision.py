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

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from mixprec.convert import apply, cast_floating, default_dtype, needs_default_dtype
from mixprec.hardware import check, default_device, device_of, resolve_policy
from mixprec.optim import LossScaleOptimizer, joint_step
from mixprec.policy import is_auto
from mixprec.policy_map import PolicyMap, as_map
from mixprec.scaling import LossScaler, as_loss_scaler

__all__ = ["Precision"]

ParamsLike = nn.Module | LossScaleOptimizer | torch.Tensor | Iterable[torch.Tensor]


class Precision:
    """Training precision for a hand-written loop.

    Args:
        spec: any policy spec (``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``, ``"32-true"``,
            Keras and jmp names, a dtype, ``"auto"``), a ``Policy`` or a ``PolicyMap``.
        device: where training runs, for the hardware check, ``"auto"`` and ``autocast``
            (default: the model's device at ``setup``). The model is not moved. ``"auto"``
            without a device is resolved at ``setup``, and ``policy`` and ``scaler`` exist
            from then on.
        allow_slow: accept a precision that works here but is far slower than float32
            (float16 on most CPUs), e.g. to study its numerics.
        scaler: ``None`` picks dynamic loss scaling when the policy uses float16 and none
            otherwise; or ``"dynamic"``, ``"none"``, a number (static scale), a ``LossScaler``.
        master_weights: passed to each ``LossScaleOptimizer``: ``None`` keeps float32
            masters for float16 parameters, ``True`` also for bfloat16 ones, ``False`` never.
    """

    def __init__(
        self,
        spec: Any = "32-true",
        *,
        device: torch.device | str | None = None,
        allow_slow: bool = False,
        scaler: LossScaler | str | float | None = None,
        master_weights: bool | None = None,
    ) -> None:
        self.device = torch.device(device) if device is not None else None
        self.allow_slow = allow_slow
        self.master_weights = master_weights
        self.optimizers: list[LossScaleOptimizer] = []
        self._owner: dict[torch.Tensor, LossScaleOptimizer] = {}
        self._master_of: dict[torch.Tensor, torch.Tensor] = {}
        self._spec = spec
        self._scaler_spec = scaler
        self._policy: PolicyMap | None = None
        self._scaler: LossScaler | None = None
        if not is_auto(spec) or self.device is not None:
            self._resolve(self.device)

    def _resolve(self, device: torch.device | None) -> None:
        # "auto" means the fastest stable precision on *this* device: known from the
        # constructor's device or, at setup, the model's
        if is_auto(self._spec):
            assert device is not None
            self._policy = resolve_policy(self._spec, device)
        else:
            self._policy = as_map(self._spec)
        self._scaler = as_loss_scaler(
            self._scaler_spec, needs_scaling=self._policy.needs_loss_scaling
        )

    @staticmethod
    def _unresolved() -> RuntimeError:
        return RuntimeError(
            "Precision('auto') picks its policy and scaler at setup(), from the model's "
            "device; call setup() first, or pass device=..."
        )

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

    def setup(
        self, model: nn.Module, *optimizers: torch.optim.Optimizer | LossScaleOptimizer
    ) -> Any:
        """Check the policy on the device, convert ``model`` in place and wrap ``optimizers``.

        Returns ``model`` alone, or ``(model, *wrapped_optimizers)`` when optimizers are
        given. All wrapped optimizers share this precision's one scaler. Build the optimizers
        from the model's parameters before calling this (conversion keeps the parameter
        objects); raises ``mixprec.PrecisionError`` when the device refuses the policy or
        runs it far slower than float32 without ``allow_slow``.
        """
        if self.device is None:
            self.device = device_of(model)
        if self._policy is None:
            self._resolve(self.device)
        check(self.policy, self.device, allow_slow=self.allow_slow)
        apply(model, self.policy, warn=False)
        self.scaler.to(self.device)
        wrapped = [self._wrap(opt) for opt in optimizers]
        return (model, *wrapped) if wrapped else model

    def _wrap(self, optimizer: torch.optim.Optimizer | LossScaleOptimizer) -> LossScaleOptimizer:
        if isinstance(optimizer, LossScaleOptimizer):
            if optimizer.scaler is not self.scaler:
                raise ValueError(
                    "this LossScaleOptimizer has its own scaler; pass the plain optimizer to "
                    "setup(), or build Precision(scaler=optimizer.scaler)"
                )
            lso = optimizer
        else:
            lso = LossScaleOptimizer(optimizer, self.scaler, master_weights=self.master_weights)
        if lso not in self.optimizers:
            self.optimizers.append(lso)
            for group in lso.param_groups:
                self._owner.update(dict.fromkeys(group["params"], lso))
            self._owner.update(dict.fromkeys(lso.master_params, lso))
            self._master_of.update(lso.master_params)
        return lso

    # -- the step ---------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate ``loss`` scaled by the current loss scale."""
        for opt in self.optimizers:
            opt.check_can_backward()
        self.scaler.scale(loss).backward(**kwargs)

    def unscale_(self, *optimizers: LossScaleOptimizer) -> None:
        """Unscale the gradients of ``optimizers`` (default: all set up); idempotent per step."""
        for opt in optimizers or self.optimizers:
            opt.unscale_()

    def clip_grad_norm_(
        self,
        params: ParamsLike,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Unscale, then clip the gradients of ``params`` (a model, an optimizer from
        ``setup``, or tensors) to total norm ``max_norm``; returns the norm before clipping.

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

    def step(self, *optimizers: LossScaleOptimizer) -> bool:
        """Step ``optimizers`` (default: all set up) as one iteration: unscale, check, step
        or skip together, update the scale once. Returns True when they stepped."""
        return joint_step(*(optimizers or self.optimizers))

    # -- code outside the model -------------------------------------------------------------

    def autocast(self) -> AbstractContextManager[Any]:
        """A context running code outside the model (a loss, a metric) in the compute dtype
        of a mixed policy; does nothing for a "true" policy."""
        policy = self.policy.default
        device = self.device or default_device()
        return torch.autocast(device.type, dtype=policy.compute_dtype, enabled=policy.is_mixed)

    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """The context a forward and its loss run in: ``autocast`` for a mixed policy; for a
        "true" policy torch's default dtype set to the compute dtype (restored on exit), so
        tensors created without a dtype (``torch.ones(n, 3)``) match the weights."""
        policy = self.policy.default
        if policy.is_mixed:
            with self.autocast():
                yield
        elif needs_default_dtype(policy.compute_dtype):
            with default_dtype(policy.compute_dtype):
                yield
        else:
            yield

    def convert_input(self, batch: Any) -> Any:
        """Cast the floating tensors of ``batch`` (any nesting `mixprec.tree` walks) to the
        compute dtype of a "true" policy; under a mixed policy autocast does the casting, so
        the batch is returned unchanged."""
        policy = self.policy.default
        if policy.is_mixed:
            return batch
        return cast_floating(batch, policy.compute_dtype)

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The policy's config and the scaler's state (optimizers save their own)."""
        return {"policy": self.policy.to_config(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scaler saved by ``state_dict``."""
        self.scaler.load_state_dict(state["scaler"])

    def __repr__(self) -> str:
        if self._policy is None:
            return f"Precision('auto', device={self.device})"
        return f"Precision({self.policy.name!r}, scaler={self.scaler!r}, device={self.device})"

    # -- internals --------------------------------------------------------------------------

    def _unscaled_grad_holders(self, params: ParamsLike) -> list[torch.Tensor]:
        if isinstance(params, LossScaleOptimizer):
            params.unscale_()
            return params.params_with_grads()
        if isinstance(params, nn.Module):
            tensors = list(params.parameters())
        elif isinstance(params, torch.Tensor):
            tensors = [params]
        else:
            tensors = list(params)
        owners = {self._owner[t] for t in tensors if t in self._owner}
        for opt in owners:
            opt.unscale_()
        return [self._master_of.get(t, t) for t in tensors]
