"""Multi-tensor steps: the parameters of one step that share a group's hyperparameters, a
state format, a dtype and a compensation updated together, so that a step's Python and
dispatch cost does not grow with the number of parameters.

Two kinds of bucket:

- float32 moments of contiguous float32 parameters: on a CPU torch's fused Adam, AdamW and
  SGD kernel over the lists of parameters, gradients and moments, whatever their sizes (one
  call, no copies; the step of ``torch.optim.AdamW(fused=True)`` bit for bit, and faster
  than a compiled update of our own); elsewhere its ``_foreach`` ops: the math of
  `kernels.adam_update` and `kernels.sgd_update` (up to the order of float32 operations) in
  a fixed number of calls;
- any other (low-bit moments, 16-bit parameters, Kahan buffers, stochastic rounding): the
  parameters, gradients and buffers copied into one flat tensor each, every parameter
  zero-padded to whole blocks so that its codes and scales, concatenated, line up; one
  update (compiled or eager) over the flat tensors; the parameters copied back with one
  ``split_with_sizes_copy`` (the moments and Kahan buffers stay joined between steps).

A flat update covers at most `FLAT_MAX` elements (a bucket of more takes several), so
that the float32 it holds meanwhile (the copies, the moments decoded) stays small (a few
MB); a parameter larger than that (but in the fused call), or alone in its part, is
updated in place by its own call: copying it would cost more than the call it saves. A
step's calls grow with its elements over `FLAT_MAX`, not with its number of parameters.
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
    ``targets``, the padding into a scratch tensor: one ``split_with_sizes_copy`` (a
    dispatch, where splitting into views and copying them take one a piece)."""
    sizes: list[int] = []
    outs: list[torch.Tensor] = []
    most = max(pads, default=0)
    scratch = flat.new_empty(most) if most else None
    for t, pad in zip(targets, pads, strict=True):
        sizes.append(t.numel())
        outs.append(t)
        if pad:
            sizes.append(pad)
            outs.append(scratch[:pad])  # type: ignore[index]
    torch.split_with_sizes_copy(flat, sizes, 0, out=outs)


def fused_adam(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    hp: Sequence[float],
    decoupled: bool,
) -> None:
    """Adam/AdamW on float32 ``params`` with float32 moments, in place; ``hp`` as
    `kernels.adam_update` takes it, in Python floats; ``steps``: the step counts (this
    step's). On a CPU by torch's fused kernel, one call for every tensor (its ``_foreach``
    ops are ten, a dispatch each); elsewhere, where that kernel wants its step counts on the
    device, by ``_foreach`` ops."""
    lr, beta1, beta2, eps, wd, step_size, inv_sqrt_bc2, gain1, gain2 = hp
    if params[0].device.type == "cpu":
        fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
        fused(
            params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
            weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip
        return
    if not decoupled and wd:
        grads = torch._foreach_add(grads, params, alpha=wd)
    torch._foreach_lerp_(exp_avgs, grads, gain1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, gain2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_mul_(denom, inv_sqrt_bc2)
    torch._foreach_add_(denom, eps)
    if decoupled and wd:
        torch._foreach_mul_(params, 1 - lr * wd)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -step_size)


def fused_sgd(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    buffers: list[torch.Tensor] | None,
    hp: Sequence[float],
    nesterov: bool,
) -> None:
    """SGD on float32 ``params`` with float32 momentum ``buffers`` (None without momentum),
    in place; ``hp``: (lr, momentum, dampening, weight_decay, first: 1.0 at the step that
    starts the buffers as the gradient, as torch's does). On a CPU by torch's fused kernel;
    elsewhere by ``_foreach`` ops."""
    lr, momentum, dampening, wd, first = hp
    if params[0].device.type == "cpu":
        torch._fused_sgd_(
            params, grads, [] if buffers is None else buffers, weight_decay=wd,
            momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov, maximize=False,
            is_first_step=bool(first) and buffers is not None,
        )  # fmt: skip
        return
    d = torch._foreach_add(grads, params, alpha=wd) if wd else grads
    if buffers is not None:
        keep, gain = (0.0, 1.0) if first else (momentum, 1 - dampening)
        torch._foreach_mul_(buffers, keep)
        torch._foreach_add_(buffers, d, alpha=gain)
        d = torch._foreach_add(d, buffers, alpha=momentum) if nesterov else buffers
    torch._foreach_add_(params, d, alpha=-lr)
