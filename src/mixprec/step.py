"""One training step of a model under a `Precision`: the context its forward runs in, where
the loss is computed, the scaled backward (``Precision.backward_context``), and the seeding
that makes two runs of a step draw alike. The Trainer, the doctor, both bench runs and the
search compute their losses here, so a loss measured by one is the loss the others train on:
`batch_loss` is the one checked loss of a batch, and `as_loss` the one check of what a loss
function or a training step returned.

A plain module with a ``loss_fn`` (the batch ``(inputs..., target)``): the batch is converted
by ``Precision.convert_input`` (floating tensors, the target included, to the compute dtype of
a "true" policy; unchanged under a mixed one). Under a mixed policy the forward **and**
``loss_fn`` run inside the precision's autocast, as in a hand-written ``torch.autocast`` loop:
the model's region sees its own autocast already on and adds nothing, so a step dispatches
the same ops in the same dtypes as that loop (torch's losses are on autocast's float32 lists,
on CPU and CUDA), but for the float32 islands the policy adds (norms and softmax-type layers
in float32, docs/conversion.md, where CPU autocast runs a layer norm in float16 under
``16-mixed``; ``float32_islands=False`` leaves them to autocast). Under a "true" policy the
model's region casts and hands the outputs back in the output dtype, and ``loss_fn`` runs on
them. Code that calls into the model from
outside (a ``training_step``, a module compiled in place under a "true" policy, where the
region's switch of torch's default dtype would be a graph boundary) runs in
``Precision.forward_context()`` too, which is all a region would have done around it.

A model that computes its own loss (`own_loss`): a Hugging Face ``PreTrainedModel`` is called
with the batch (a dict with ``labels``) as keyword arguments, its output's ``.loss`` the loss;
a model with ``training_step(batch, batch_idx)`` (a mixprec ``TrainingModule``, a Lightning
``LightningModule``) returns a loss or a dict with ``"loss"``, its ``self.log`` calls dropped
(no trainer takes them); any other model returns one from ``model(batch)``. Hugging Face and
Lightning are recognised without importing them: a model of theirs can only exist once its
package is loaded.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.errors import LossTypeError
from mixprec.precision import ForwardAutocast, Precision
from mixprec.tree import iter_tensors, map_tensors

__all__ = [
    "as_loss",
    "backward",
    "batch_loss",
    "fresh",
    "plain_loss",
    "seeded",
    "split_batch",
    "step_context",
]


def compiled_in_place(model: nn.Module) -> bool:
    """Whether `model` was compiled with ``nn.Module.compile`` (``Trainer(compile=...)``)."""
    return "_compiled_call_impl" in model.__dict__


def step_context(
    precision: Precision, model: nn.Module, *, user_code: bool = False
) -> AbstractContextManager[Any]:
    """The context a step of `model` and its loss run in (see the module's docstring): the
    precision's forward context under a mixed policy, when `user_code` calls into the model
    (a training step) or when the model is compiled in place under a "true" policy; else
    none, the model's region doing it all."""
    mixed = precision.mixed
    if mixed:  # (`forward_context` of a mixed policy, fewer calls: a compiled model's only)
        autocast = precision.autocast()
        return ForwardAutocast(autocast) if compiled_in_place(model) else autocast
    if user_code or mixed is None or compiled_in_place(model):
        return precision.forward_context()  # (None: no policy yet, which it refuses)
    return contextlib.nullcontext()


def split_batch(batch: Any, who: str = "a plain module") -> tuple[list[Any], Any]:
    """``(inputs, target)`` of a ``(inputs..., target)`` batch; a ``TypeError`` otherwise."""
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        got = type(batch).__name__
        if isinstance(batch, (tuple, list)):
            got += f" of length {len(batch)}"
        raise TypeError(f"{who}'s batches must be (inputs..., target) tuples or lists, got {got}")
    *inputs, target = batch
    return inputs, target


def plain_loss(
    precision: Precision,
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[..., Any],
    *,
    check_outputs: Callable[[Any], None] | None = None,
    converted: bool = False,
) -> Any:
    """``loss_fn(model(*inputs), target)`` for a ``(inputs..., target)`` batch, computed as
    every step in mixprec computes it (see the module's docstring): the batch converted for
    the policy, the forward and the loss in the step's context.

    Returns what `loss_fn` returned (callers check it is a loss); `check_outputs`, if given,
    sees the model's outputs first (the doctor refuses outputs no loss can reach);
    `converted`: the caller already converted the batch (the Trainer does, before its hooks
    see it), so it is not walked again."""
    inputs, target = split_batch(batch if converted else precision.convert_input(batch))
    with step_context(precision, model):
        outputs = model(*inputs)
        if check_outputs is not None:
            check_outputs(outputs)
        return loss_fn(outputs, target)


def batch_loss(
    precision: Precision,
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[..., Any] | None,
    *,
    converted: bool = False,
) -> Tensor:
    """The checked loss of one batch, a 0-dim floating tensor, computed as every step in
    mixprec computes it (see the module's docstring): with a `loss_fn`, a plain module's
    forward and the loss (`plain_loss`; outputs no loss can reach the weights through are
    refused, `check_outputs`); without one, the loss of a model that computes its own
    (`own_loss`) in the precision's forward context. `converted`: the caller converted the
    batch already. The Trainer (a plain module's step), the doctor and the search take their
    losses here."""
    if loss_fn is not None:
        out = plain_loss(
            precision, model, batch, loss_fn, check_outputs=check_outputs, converted=converted
        )
        return as_loss(out, "loss_fn")
    if not converted:
        batch = precision.convert_input(batch)
    with step_context(precision, model, user_code=True):
        return own_loss(model, batch)


def fresh(batch: Any) -> Any:
    """``batch`` with every tensor cloned, for a run repeated on one batch (the doctor's
    precisions, the search's plans): a model writing into its inputs (an in-place first
    activation, ``x.div_(255)``) would give each later run another batch, and change the
    caller's."""
    return map_tensors(lambda t: t.clone(), batch)


def check_outputs(outputs: Any) -> None:
    """Refuse outputs no loss can reach the weights through (no floating tensor in them)."""
    if type(outputs) is Tensor and outputs.dtype.is_floating_point:
        return  # the common case, without a walk (attributes: no call)
    if not any(t.is_floating_point() for t in iter_tensors(outputs)):
        got = (
            f"a {str(outputs.dtype).removeprefix('torch.')} tensor"
            if isinstance(outputs, Tensor)
            else type(outputs).__name__
        )
        raise LossTypeError(
            f"the model's output holds no floating tensor ({got}): no loss computed from it "
            "can reach the weights; return logits or scores, not argmax/indices"
        )


def own_loss(model: nn.Module, batch: Any) -> Tensor:
    """The scalar loss of a model that computes its own (see the module's docstring; a plain
    module with a ``loss_fn`` goes through `plain_loss`)."""
    if is_hugging_face_model(model):
        return _hugging_face_loss(model, batch)
    step = getattr(model, "training_step", None)
    if step is None:
        try:
            out = model(batch)
        except TypeError as err:  # (inputs, target) given to a model that takes inputs
            if not isinstance(batch, tuple | list):
                raise
            raise TypeError(  # (the model's own error, reworded: not a check of ours)
                f"no loss_fn was given, so {type(model).__name__} was called on the whole "
                f"batch (a {type(batch).__name__} of {len(batch)}) to return its own loss, "
                f"and failed: {err}. For a model that returns outputs, pass loss_fn=... "
                "(e.g. torch.nn.functional.cross_entropy) with batches of (inputs, target)"
            ) from err
        return as_loss(
            out, "the model (no loss_fn given; pass loss_fn=... for one returning outputs)"
        )
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
        raise LossTypeError(
            f"{name} returned no loss for a batch with keys {sorted(batch)}: put the targets "
            "in the batch under 'labels' (for a causal LM, labels=input_ids)"
        )
    return as_loss(loss, f"{name}'s output")


def as_loss(result: Any, where: str) -> Tensor:
    """`result` (a tensor, or a dict with "loss") as a 0-dim floating loss; a
    `LossTypeError` (a TypeError) naming `where` (who returned it), what it gave and the
    fix otherwise. The one check of a loss in mixprec: `batch_loss`'s, and the Trainer's of
    what a training step returned (after reading None as "skip the batch")."""
    if type(result) is Tensor and result.ndim == 0 and result.dtype.is_floating_point:
        return result  # the common case, without a call (a step's time on a small model)
    loss = result
    if isinstance(result, dict):
        if "loss" not in result:
            raise LossTypeError(f"{where} returned a dict without a 'loss' key: {sorted(result)}")
        loss = result["loss"]
    if not isinstance(loss, Tensor) or not loss.is_floating_point():
        got = f"a {loss.dtype} tensor" if isinstance(loss, Tensor) else type(loss).__name__
        raise LossTypeError(
            f"{where} must return the loss as a one-element floating tensor (or a dict with "
            f"'loss'), got {got}"
        )
    if loss.numel() != 1:
        raise LossTypeError(
            f"{where} must return the loss as a single number, got a tensor of shape "
            f"{tuple(loss.shape)}: reduce it (e.g. .mean() or reduction='mean')"
        )
    return loss if loss.dim() == 0 else loss.reshape(())


def _ignore(*args: Any, **kwargs: Any) -> None:
    """Stands in for `self.log` where no trainer takes its values."""


def backward(precision: Precision, loss: Tensor, *, accumulate: int = 1) -> None:
    """The scaled backward of `loss` (``Precision.backward``, inside its one backward
    context), divided by `accumulate` micro-batches of a window."""
    precision.backward(loss / accumulate if accumulate > 1 else loss)


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run a block with the RNG of the CPU (and of `device` if it is a GPU) seeded to
    `seed`, restoring their states afterwards: the doctor's runs and the search's plans
    draw the same dropout masks and samples on the same batch."""
    cpu_state = torch.get_rng_state()
    gpu = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gpu = torch.cuda.default_generators[index]
    gpu_state = gpu.get_state() if gpu is not None else None
    torch.default_generator.manual_seed(seed)  # torch.manual_seed also seeds every GPU
    if gpu is not None:
        gpu.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if gpu is not None:
            gpu.set_state(gpu_state)
