"""Running a model once in a precision, probed: the same batch, the same seed and a fresh
copy of the caller's (untouched) model every time, the loss computed as the Trainer does
(`mixprec.step.batch_loss`)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.convert import apply
from mixprec.doctor.probe import Probe, Recording, lowest_float, measure_param_grads
from mixprec.doctor.verdicts import UpdateModel
from mixprec.errors import LossTypeError
from mixprec.optim.scaling import StaticLossScaler
from mixprec.policy.map import PolicyMap
from mixprec.precision import Precision
from mixprec.step import backward, batch_loss, fresh, seeded

__all__: list[str] = []


def _fingerprint(model: nn.Module) -> list[tuple[Any, ...]]:
    """Identity, storage, dtype and in-place version of every parameter and buffer: any
    training step, conversion, move or load changes it."""
    return [
        (name, id(t), t.data_ptr(), t.dtype, t.device, t._version)
        for name, t in model.state_dict(keep_vars=True).items()
        if isinstance(t, Tensor)
    ]


@dataclass(eq=False, repr=False)
class Session:
    """Everything needed to run the model again in any precision on the same batch.

    Each run deep-copies `model`, which is the caller's own model (never changed here):
    a fingerprint taken at the start makes a later run refuse to go on if the caller has
    changed the model since.
    """

    model: nn.Module
    batch: Any
    loss_fn: Callable[..., Tensor] | None
    device: torch.device
    seed: int
    update: UpdateModel | None = None
    _fingerprint: list[tuple[Any, ...]] = field(init=False)

    def __post_init__(self) -> None:
        self._fingerprint = _fingerprint(self.model)

    def copy(self) -> nn.Module:
        """A fresh copy of the model as it was diagnosed."""
        if _fingerprint(self.model) != self._fingerprint:
            raise ValueError(
                "the model changed since it was diagnosed (a parameter or buffer was "
                "modified, converted, moved or replaced); call diagnose() again"
            )
        return copy.deepcopy(self.model)

    def run(self, policy: PolicyMap, reference: Recording | None, scale: float) -> Recording:
        """One forward and backward of a fresh copy under `policy`, probed."""
        model = self.copy()
        for module in model.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd):
                module.eval()  # both runs must see the same network
        # `apply`, not `Precision.setup`: a slow precision warns instead of raising here
        apply(model, policy)
        precision = Precision(policy, device=self.device, scaler=StaticLossScaler(scale))
        resolved = policy.resolve(model)
        params = list(model.named_parameters())
        limits = {
            name: lowest_float([p.dtype, resolved[name.rpartition(".")[0]].policy.compute_dtype])
            for name, p in params
        }
        probe = Probe(model, reference, grad_scale=scale)
        with seeded(self.seed, self.device), probe as rec:
            loss = batch_loss(precision, model, fresh(self.batch), self.loss_fn)
            if not loss.requires_grad:  # (mixprec's refusal, not the model's own error)
                raise LossTypeError(
                    "the loss does not require grad: is the model frozen or run under no_grad?"
                )
            backward(precision, loss)
        rec.loss = float(loss.detach().float())
        rec.loss_dtype = loss.dtype
        measure_param_grads(params, rec, reference, limits, scale)
        rec.param_limits = limits
        rec.trained = {name: p.dtype for name, p in params if p.requires_grad}
        rec.types = {name: type(m).__name__ for name, m in model.named_modules()}
        paths: dict[int, list[str]] = {}  # (the first is the name the probe gives it)
        for path, m in model.named_modules(remove_duplicate=False):
            paths.setdefault(id(m), []).append(path)
        rec.aliases = {p[0]: tuple(p[1:]) for p in paths.values() if len(p) > 1}
        rec.params_of = {
            name: [f"{name}.{k}" if name else k for k, v in m._parameters.items() if v is not None]
            for name, m in model.named_modules()
        }
        return rec


def grad_amax(ref: Recording) -> float:
    """Largest gradient magnitude the reference run saw (activations and parameters)."""
    peaks = [s.grad_amax for s in ref.slots.values() if s.grad_amax is not None]
    peaks += [g.value.abs().amax() for g in ref.param_grads.values() if g is not None]
    return float(torch.stack([p.to("cpu") for p in peaks]).amax()) if peaks else 0.0
