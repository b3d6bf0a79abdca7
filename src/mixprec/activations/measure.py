"""What each layer keeps for the backward: `saved_bytes` runs one forward and adds up, per
module, the bytes its own ops leave saved (after the codec of its option stored them; for a
recomputed module the inputs checkpointing holds, and nothing below it; nothing for
``offload``, which holds them in host memory; ``selective``'s saved matmul outputs are held
by torch's checkpointing, out of this count's sight).
Parameters, buffers and the model's inputs are not counted: they are alive without the
graph; tensors without a history that only the graph holds (a frozen layer's output,
dropout's mask, max-pooling's indices) are, though the codecs keep them as they are. A
sparse or nested saved tensor is kept as it is and not counted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_leaves

from mixprec.activations.codecs import Keep, has_storage, is_activation, record_to

__all__ = ["saved_bytes", "saved_bytes_of"]


def saved_bytes(model: nn.Module, *args: Any, **kwargs: Any) -> dict[str, int]:
    """Bytes of activations saved for the backward by each module of `model`'s forward on
    `args` and `kwargs`, by path (a module's own ops: its children's are theirs), as the
    activation options `mixprec.apply` gave it store them. Each tensor is counted once, by the
    module whose op saved it first. The forward's graph is dropped afterwards."""
    return saved_bytes_of(model, lambda: model(*args, **kwargs))


def saved_bytes_of(model: nn.Module, run: Callable[[], Any], batch: Any = ()) -> dict[str, int]:
    """`saved_bytes` of whatever forward of `model` ``run()`` makes (a loss computed as a
    training step computes it: under a precision's autocast, with the loss function's own
    saved tensors counted at the root); ``batch``: the tensors the step reads besides the
    model's inputs (a loss's targets), alive without the graph as those are."""
    names = {id(m): name for name, m in model.named_modules()}
    out = dict.fromkeys(names.values(), 0)
    stack: list[str] = []
    seen: set[int] = set()
    # the storages alive without the graph: parameters, buffers and the model's inputs
    kept = (*model.parameters(), *model.buffers(), *tree_leaves(batch))
    alive = {_memory(t) for t in kept if torch.is_tensor(t)}

    def record(original: Tensor, stored: int, key: int) -> None:
        if key in seen:
            return
        # (a tensor without a history that is none of those lives through the graph alone:
        # a frozen layer's output, dropout's mask, max-pooling's indices)
        if not is_activation(original) and (
            original.grad_fn is not None or original.untyped_storage().data_ptr() in alive
        ):
            return
        seen.add(key)
        out[stack[-1] if stack else ""] += stored

    def inputs(module: nn.Module, args: Any, kwargs: Any) -> None:
        leaves = tree_leaves((args, kwargs))
        alive.update(_memory(t) for t in leaves if torch.is_tensor(t))

    def enter(module: nn.Module, args: Any) -> None:
        stack.append(names.get(id(module), stack[-1] if stack else ""))

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        stack.pop()

    handles = [model.register_forward_pre_hook(inputs, with_kwargs=True)]
    handles += [m.register_forward_pre_hook(enter) for m in model.modules()]
    handles += [m.register_forward_hook(leave, always_call=True) for m in model.modules()]
    outer = Keep()
    record_to(record)
    # the forward leaves the model and the generators as they were: its running statistics
    # (a BatchNorm's) and the random numbers dropout drew are put back
    buffers = [(b, b.clone()) for b in model.buffers()]
    devices = sorted({t.device.index or 0 for t in kept if torch.is_tensor(t) and t.is_cuda})
    try:
        with (
            torch.random.fork_rng(devices=devices),
            torch.enable_grad(),
            saved_tensors_hooks(outer.pack, outer.unpack),
        ):
            run()
    finally:
        record_to(None)
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for b, before in buffers:
                b.copy_(before)
    return out


def _memory(t: Tensor) -> int | None:
    """Where `t`'s elements live: its storage's address; None for a sparse or nested tensor,
    which has no storage to read (the codecs keep such a tensor as it is, uncounted)."""
    return t.untyped_storage().data_ptr() if has_storage(t) else None
