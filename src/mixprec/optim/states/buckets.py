"""Multi-tensor steps: the parameters of one step that share a group's hyperparameters, a
state format, a dtype and a compensation updated together, so that a step's Python and
dispatch cost does not grow with the number of parameters.

Two kinds of bucket:

- float32 moments of float32 parameters: torch's ``_foreach`` ops over the lists of
  parameters, gradients and moments (no copies), the math of `kernels.adam_update` and
  `kernels.sgd_update` in a fixed number of calls;
- any other (low-bit moments, 16-bit parameters, Kahan buffers, stochastic rounding): the
  parameters, gradients and buffers copied into one flat tensor each, every parameter
  zero-padded to whole blocks so that its codes and scales, concatenated, line up; one
  update (compiled or eager) over the flat tensors; the results copied back with one
  ``_foreach_copy_`` per kind of tensor.

A flat update covers at most `FLAT_MAX` elements (a bucket of more takes several), so
that the float32 it holds meanwhile (the copies, the moments decoded) stays small (a few
MB); a parameter larger than that, or alone in its part, is updated in place by its own
call: copying it would cost more than the call it saves. A step's calls grow with its
elements over `FLAT_MAX`, not with its number of parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = []

# the most elements (padded to whole blocks) one flat update covers; a parameter of more
# is updated by its own call (no copy)
FLAT_MAX = 1 << 17


def gather(tensors: Sequence[torch.Tensor], pads: Sequence[int]) -> torch.Tensor:
    """The flat tensors ``tensors`` concatenated, each followed by ``pads[i]`` zeros."""
    most = max(pads, default=0)
    if not most:
        return torch.cat(list(tensors))
    zeros = tensors[0].new_zeros(most)
    pieces: list[torch.Tensor] = []
    for t, pad in zip(tensors, pads, strict=True):
        pieces.append(t)
        if pad:
            pieces.append(zeros[:pad])
    return torch.cat(pieces)


def scatter(flat: torch.Tensor, targets: Sequence[torch.Tensor], pads: Sequence[int]) -> None:
    """Copy ``flat`` (as `gather` made it from ``targets`` and ``pads``) back into the flat
    ``targets``, padding left out: one split and one ``_foreach_copy_``."""
    sizes: list[int] = []
    for t, pad in zip(targets, pads, strict=True):
        sizes.append(t.numel())
        if pad:
            sizes.append(pad)
    pieces = flat.split(sizes)
    kept: list[torch.Tensor] = []
    i = 0
    for pad in pads:
        kept.append(pieces[i])
        i += 2 if pad else 1
    torch._foreach_copy_(list(targets), kept)


def foreach_adam(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    hp: Sequence[float],
    decoupled: bool,
) -> None:
    """Adam/AdamW on float32 ``params`` with float32 moments, in place; ``hp`` as
    `kernels.adam_update` takes it, in Python floats."""
    lr, beta1, beta2, eps, wd, step_size, inv_sqrt_bc2 = hp
    if not decoupled and wd:
        grads = torch._foreach_add(grads, params, alpha=wd)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_mul_(denom, inv_sqrt_bc2)
    torch._foreach_add_(denom, eps)
    if decoupled and wd:
        torch._foreach_mul_(params, 1 - lr * wd)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -step_size)


def foreach_sgd(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    buffers: list[torch.Tensor] | None,
    hp: Sequence[float],
    nesterov: bool,
) -> None:
    """SGD on float32 ``params`` with float32 momentum ``buffers`` (None without momentum),
    in place; ``hp`` as `kernels.sgd_update` takes it, in Python floats."""
    lr, keep, gain, wd, momentum = hp
    d = torch._foreach_add(grads, params, alpha=wd) if wd else grads
    if buffers is not None:
        torch._foreach_mul_(buffers, keep)
        torch._foreach_add_(buffers, d, alpha=gain)
        d = torch._foreach_add(d, buffers, alpha=momentum) if nesterov else buffers
    torch._foreach_add_(params, d, alpha=-lr)
