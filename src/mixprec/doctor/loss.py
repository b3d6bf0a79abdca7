"""The loss of one batch, for each kind of model the doctor takes that computes its own loss
(a plain module with a ``loss_fn`` goes through `mixprec.step.plain_loss`, as in the Trainer):

- a Hugging Face ``PreTrainedModel``: the batch is a dict of keyword arguments (with
  ``labels``) and the output's ``.loss`` is the loss;
- a model with ``training_step(batch, batch_idx)`` (a mixprec ``TrainingModule``, a Lightning
  ``LightningModule``): its result, a loss or a dict with ``"loss"``; ``self.log`` calls are
  dropped (no trainer to take them);
- any other model returns the loss (or a dict with ``"loss"``) from ``model(batch)``.

Hugging Face and Lightning are recognised without importing them: a model of theirs can only
exist once its package is loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from mixprec.doctor.probe import floating_tensors

__all__ = ["as_loss", "batch_loss", "check_outputs", "is_hugging_face_model"]


def batch_loss(model: nn.Module, batch: Any) -> Tensor:
    """The scalar loss of a model that computes its own (see the module's docstring; a plain
    module with a ``loss_fn`` goes through `mixprec.step.plain_loss`)."""
    if is_hugging_face_model(model):
        return _hugging_face_loss(model, batch)
    step = getattr(model, "training_step", None)
    if step is None:
        try:
            out = model(batch)
        except TypeError as err:  # (inputs, target) given to a model that takes inputs
            if not isinstance(batch, tuple | list):
                raise
            raise TypeError(
                f"no loss_fn was given, so {type(model).__name__} was called on the whole "
                f"batch (a {type(batch).__name__} of {len(batch)}) to return its own loss, "
                f"and failed: {err}. For a model that returns outputs, pass loss_fn=... "
                "(e.g. torch.nn.functional.cross_entropy) with batches of (inputs, target)"
            ) from err
        return as_loss(out, "the model (no loss_fn given)")
    if getattr(model, "automatic_optimization", True) is False:
        raise TypeError(
            f"{type(model).__name__} uses Lightning's manual optimization: its training_step "
            "steps its own optimizers instead of returning a loss. Diagnose the network "
            "inside it with loss_fn=... and a batch of (inputs, target)"
        )
    # self.log has no trainer to go to here: drop its calls (the doctor runs on a copy)
    for name in ("log", "log_dict"):
        if callable(getattr(model, name, None)):
            setattr(model, name, _ignore)
    return as_loss(step(batch, 0), "training_step")


def check_outputs(outputs: Any) -> None:
    """Refuse outputs no loss can reach the weights through (no floating tensor in them)."""
    if not floating_tensors(outputs):
        raise TypeError(
            f"the model's output holds no floating tensor ({_kinds(outputs)}): no "
            "loss computed from it can reach the weights; return logits or "
            "scores, not argmax/indices"
        )


def is_hugging_face_model(model: nn.Module) -> bool:
    """Whether `model` is a ``transformers.PreTrainedModel`` (without importing transformers)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def _hugging_face_loss(model: nn.Module, batch: Any) -> Tensor:
    name = type(model).__name__
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"{name} is a Hugging Face model: its batch is a dict of keyword arguments with "
            f"labels (input_ids=..., labels=...), got {type(batch).__name__}"
        )
    outputs = model(**batch)
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if loss is None:
        raise TypeError(
            f"{name} returned no loss for a batch with keys {sorted(batch)}: put the targets "
            "in the batch under 'labels' (for a causal LM, labels=input_ids)"
        )
    return as_loss(loss, f"{name}'s output")


def as_loss(result: Any, where: str) -> Tensor:
    """`result` (a tensor, or a dict with "loss") as a 0-dim loss; TypeError naming `where`
    otherwise."""
    if isinstance(result, dict):
        if "loss" not in result:
            raise TypeError(f"{where} returned a dict without a 'loss' key: {sorted(result)}")
        result = result["loss"]
    if not isinstance(result, Tensor) or result.numel() != 1 or not result.is_floating_point():
        got = tuple(result.shape) if isinstance(result, Tensor) else type(result).__name__
        raise TypeError(
            f"{where} must give a scalar floating loss tensor (or a dict with 'loss'), got {got};"
            " pass loss_fn=... with a batch of (inputs, targets)"
        )
    return result.reshape(())


def _kinds(outputs: Any) -> str:
    """What a model returned, for an error: the dtype of a tensor, else the type's name."""
    if isinstance(outputs, Tensor):
        return f"a {str(outputs.dtype).removeprefix('torch.')} tensor"
    return type(outputs).__name__


def _ignore(*args: Any, **kwargs: Any) -> None:
    """Stands in for `self.log` during a diagnosis."""
