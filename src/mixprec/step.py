"""One training step of a model under a `Precision`: the context its forward runs in, where
the loss is computed, and the scaled backward. The Trainer, the doctor and both bench runs
compute their losses here, so a loss measured by one is the loss the others train on.

A plain module with a ``loss_fn`` (the batch ``(inputs..., target)``):

- the batch is converted as ``Precision.convert_input`` says (floating tensors, the target
  included, to the compute dtype of a "true" policy; unchanged under a mixed policy);
- under a mixed policy the forward **and** ``loss_fn`` run inside the precision's autocast,
  as in a hand-written ``torch.autocast`` loop: the model's region sees its own autocast
  already on and adds nothing, so the outputs reach the loss as autocast made them and a
  step dispatches the same ops in the same dtypes as that loop. torch's loss functions run
  in float32 there on CPU and CUDA alike (autocast's float32 lists name ``cross_entropy``,
  ``nll_loss``, ``mse_loss``... on CPU, and ``log_softmax``, ``nll_loss``, ``mse_loss``... on
  CUDA, which reads 16-bit logits in its float32 softmax kernel);
- under a "true" policy the forward enters the model's region, which casts and hands the
  outputs back in the output dtype, and ``loss_fn`` runs on them.

Code that calls into the model from outside (a ``training_step``, a compiled module under a
"true" policy, whose region's switch of torch's default dtype would be a graph boundary) runs
in ``Precision.forward_context()`` too, which is all a region would have done around it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from torch import Tensor, nn

from mixprec.precision import Precision

__all__ = ["backward", "compiled_in_place", "plain_loss", "split_batch", "step_context"]


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
    if user_code or precision.policy.default.is_mixed or compiled_in_place(model):
        return precision.forward_context()
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


def backward(precision: Precision, loss: Tensor, *, accumulate: int = 1) -> None:
    """The scaled backward of `loss`, divided by `accumulate` micro-batches of a window."""
    precision.backward(loss / accumulate if accumulate > 1 else loss)
