"""The recompute modes: a forward whose saved tensors are dropped and computed again in the
backward, with torch's non-reentrant checkpointing (``checkpoint``) or its selective
checkpointing (``selective``: the outputs of the matmuls, convolutions and attention saved,
the cheap ops between them recomputed).

The recomputation runs under the autocast state of the forward (torch restores it), and a
layer with a region of its own re-enters it. Under a "true" policy the default dtype is the
compute dtype in the backward as it was in the forward because every door's backward runs in
`mixprec.Precision.backward_context`, so tensors created without a dtype come out alike (a
plain ``loss.backward()`` outside it would recompute them in float32). RNG state is restored,
so dropout draws the same mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = ["SAVED_OPS", "recomputed", "selective_policy"]

_aten = torch.ops.aten
# the ops (overload packets) whose outputs `selective` saves: the expensive ones
SAVED_OPS: frozenset[Any] = frozenset(
    getattr(_aten, name)
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_int_mm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save the output of a matmul, convolution or attention op; recompute the rest."""
    if getattr(op, "overloadpacket", op) in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(selective_policy)


def recomputed(
    forward: Callable[..., Any], mode: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``forward(*args, **kwargs)`` with its saved tensors dropped and recomputed in the
    backward; `mode` is ``"checkpoint"`` or ``"selective"``."""
    run = functools.partial(forward, **kwargs)
    if mode == "selective":
        run = functools.partial(_with_fresh_cast_cache, run)
    extra = {"context_fn": _selective_contexts} if mode == "selective" else {}
    return checkpoint(run, *args, use_reentrant=False, **extra)


def _with_fresh_cast_cache(run: Callable[..., Any], *args: Any) -> Any:
    """``run(*args)`` from an empty autocast cache of weight casts: a weight an earlier
    layer cast (a layer called twice, tied weights) is cast again here, as the recomputation
    in the backward casts it, so the selective record holds the cast that the recomputation
    makes (torch fails the backward on a recomputed op missing from it). Within the layer
    the cache serves as before, in the forward and in the recomputation alike."""
    torch.clear_autocast_cache()
    return run(*args)
