"""The recompute modes: a forward whose saved tensors are dropped and computed again in the
backward, with torch's non-reentrant checkpointing (``checkpoint``) or its selective
checkpointing (``selective``: the outputs of the matmuls, convolutions and attention saved,
the cheap ops between them recomputed).

The recomputation runs under the autocast state of the forward (torch restores it) and under
the default dtype the forward ran in (a "true" region's compute dtype, set by a region around
the recomputed layer that the backward does not re-enter), so tensors created without a dtype
come out alike; a layer with a region of its own re-enters it. RNG state is restored, so
dropout draws the same mask.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from mixprec.dtypes import default_dtype, needs_default_dtype
from mixprec.tree import iter_tensors, map_tensors, shallow_copy

__all__ = ["SAVED_OPS", "SelectivePolicy", "mark_region_cast", "recomputed"]

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

# ops whose outputs share their input's memory without being views of it (no shared version
# counter): `SelectivePolicy` saves them, so that a write into one is caught
_UNSAFE_SPLITS = frozenset([_aten.unsafe_split, _aten.unsafe_split_with_sizes])


class SelectivePolicy:
    """Save the output of a matmul, convolution or attention op; recompute the rest.

    Also saves the ``_unsafe_view`` that ``torch.matmul`` returns right over a saved
    product: it has a version counter of its own, so a write into it (``scores += bias``,
    as T5's attention does) escaped torch's mutation check, and the recomputation added the
    bias again on top of the kept product, silently. Saved, the write is caught. So are the
    pieces of an ``unsafe_split`` (``unsafe_chunk``), which share a product's memory under
    counters of their own: ``torch.gru_cell`` on a CPU adds into them in place. One policy
    serves one checkpointed call; the forward and its recomputation see the same op order."""

    def __init__(self) -> None:
        self._after_saved = {False: False, True: False}  # (by ctx.is_recompute)

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        packet = getattr(op, "overloadpacket", op)
        phase = bool(getattr(ctx, "is_recompute", False))
        follows, self._after_saved[phase] = self._after_saved[phase], packet in SAVED_OPS
        if (
            packet in SAVED_OPS
            or packet in _UNSAFE_SPLITS
            or (follows and packet is _aten._unsafe_view)
        ):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(SelectivePolicy())


def recomputed(
    forward: Callable[..., Any],
    mode: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    module: nn.Module | None = None,
) -> Any:
    """``forward(*args, **kwargs)`` (of `module`, where given) with its saved tensors
    dropped and recomputed in the backward; `mode` is ``"checkpoint"`` or ``"selective"``."""
    # every tensor of the arguments, given by keyword or nested in a tuple, list or dict (a
    # Hugging Face layer's ``position_embeddings=(cos, sin)``), goes to the checkpoint as a
    # positional argument, which it saves and checks: bound in a closure, one written in
    # place after the call was recomputed from its new values without torch's error
    # (a torch.Size is a leaf: rebuilt as a tuple it would lose its methods, ``numel()``)
    leaves, spec = tree_flatten((args, kwargs), is_leaf=lambda x: isinstance(x, torch.Size))
    where = tuple(i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor))
    # and those inside leaves torch's pytree does not open (a dataclass: `mixprec.tree`
    # walks it), each such leaf rebuilt around them in the recomputation from a shallow
    # copy of it as the call saw it (a top-level field the caller replaces since is not
    # recomputed; what a field's own containers hold is read as it is then)
    inner = tuple(
        (i, ts)
        for i, v in enumerate(leaves)
        if _may_hold_tensors(v) and (ts := tuple(iter_tensors(v)))
    )
    if inner:
        leaves = list(leaves)
        for i, _ in inner:
            leaves[i] = shallow_copy(leaves[i])
    run_leaves = _Leaves(leaves, spec, where, inner)
    run = functools.partial(
        _in_default_dtype, torch.get_default_dtype(), forward, (args, kwargs), run_leaves
    )
    if mode == "selective":
        run = functools.partial(_with_fresh_cast_cache, run)
    # (a region's casts are made again alike in a checkpoint's recomputation, which keeps
    # only the layer's inputs: only selective, whose record must see the same ops, keeps them)
    swapped, recast, weights = {}, {}, []
    if module is not None:
        swapped, recast, weights = _replaced_parameters(module, mode == "selective")
    if swapped:
        run = functools.partial(_with_swapped, module, swapped, run)
    if recast:
        run = functools.partial(_with_recast, module, recast, run)
    extra = {"context_fn": _selective_contexts} if mode == "selective" else {}
    # the weights go to the checkpoint after the arguments, unused, so that it saves them
    # and checks them as it checks the arguments: a weight written in place between the
    # forward and the backward (an optimizer step taken before it) fails the backward with
    # torch's error, as a stored layer's saved weight does, where the recomputation would
    # read the new values
    if weights:
        run = functools.partial(_without_last, len(weights), run)
    return checkpoint(run, *run_leaves.originals, *weights, use_reentrant=False, **extra)


def _without_last(count: int, run: Callable[..., Any], *tensors: Any) -> Any:
    """``run`` on ``tensors`` but the last ``count`` (the weights `recomputed` hands the
    checkpoint to be checked)."""
    return run(*tensors[: len(tensors) - count])


def _may_hold_tensors(obj: Any) -> bool:
    """Whether ``obj``, a leaf of torch's pytree, is a container `mixprec.tree` opens."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


class _Leaves:
    """The call's arguments as torch's pytree flattened them: the ``leaves``, their ``spec``,
    the positions of the tensors among them (``where``) and of the leaves holding tensors it
    does not see (``inner``: position and those tensors, in `iter_tensors` order)."""

    def __init__(
        self,
        leaves: list[Any],
        spec: TreeSpec,
        where: tuple[int, ...],
        inner: tuple[tuple[int, tuple[torch.Tensor, ...]], ...],
    ) -> None:
        self.leaves, self.spec, self.where, self.inner = leaves, spec, where, inner
        every = [leaves[i] for i in where] + [t for _, ts in inner for t in ts]
        # the tensors the checkpoint is given, in its order, each once: it hands each saved
        # one back as a tensor of its own, and a tensor passed twice must come back as one
        # (nn.MultiheadAttention projects ``query is key`` packed, else each apart: other
        # saves, which the checkpoint refuses); `slots`: each of `every`'s among them
        first: dict[int, int] = {}
        self.slots = [first.setdefault(id(t), len(first)) for t in every]
        self.originals = list({id(t): t for t in every}.values())

    def rebuilt(self, tensors: tuple[torch.Tensor, ...]) -> tuple[Any, Any]:
        """(args, kwargs) around ``tensors`` (the checkpoint's, in the order of `originals`)."""
        tensors = tuple(tensors[s] for s in self.slots)
        filled = list(self.leaves)
        for i, t in zip(self.where, tensors, strict=False):
            filled[i] = t
        rest = iter(tensors[len(self.where) :])
        for i, ts in self.inner:
            swap = {id(old): new for old, new in zip(ts, rest, strict=False)}
            filled[i] = map_tensors(lambda t, swap=swap: swap.get(id(t), t), self.leaves[i])
        return tree_unflatten(filled, self.spec)


def _in_default_dtype(
    dtype: torch.dtype,
    forward: Callable[..., Any],
    given: tuple[tuple[Any, ...], dict[str, Any]],
    leaves: _Leaves,
    *tensors: Any,
) -> Any:
    """``forward(*args, **kwargs)`` with `dtype` torch's default dtype, as it was when the
    forward first ran: the recomputation in the backward runs outside the regions around the
    layer, which set it then. `tensors` are the arguments' tensors (`_Leaves.originals`):
    the forward's call takes the arguments `given` as they are (a mutable container the
    layer changes is the caller's), the recomputation in the backward rebuilds them around
    the tensors the checkpoint saved (a container changed since is recomputed as the forward
    saw it)."""
    # (traced by torch.compile: one call, which the compiled backward recomputes)
    if all(t is o for t, o in zip(tensors, leaves.originals, strict=True)) and (
        torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1
    ):
        args, kwargs = given
    else:
        args, kwargs = leaves.rebuilt(tensors)
    if torch.get_default_dtype() == dtype and not needs_default_dtype(dtype):
        return forward(*args, **kwargs)
    with default_dtype(dtype):
        return forward(*args, **kwargs)


def _with_fresh_cast_cache(run: Callable[..., Any], *args: Any) -> Any:
    """``run(*args)`` from an empty autocast cache of weight casts: a weight an earlier
    layer cast (a layer called twice, tied weights) is cast again here, as the recomputation
    in the backward casts it, so the selective record holds the cast that the recomputation
    makes (torch fails the backward on a recomputed op missing from it). Within the layer
    the cache serves as before, in the forward and in the recomputation alike."""
    torch.clear_autocast_cache()
    return run(*args)


# the compute-dtype copies of parameters a "true" region swapped in for one forward (weak:
# gone with their forward's graph); a checkpoint's recomputation makes them again alike
# (by id: a weak set compares its members with ==, which a tensor answers elementwise)
_REGION_CASTS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


# what each of them was cast from (the parameter, or the tensor ``functional_call`` put in
# its place), by the copy's id: a checkpoint's recomputation casts that again
_CAST_SOURCES: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def mark_region_cast(t: torch.Tensor, source: torch.Tensor) -> None:
    """Mark `t` as a region's compute-dtype copy of `source`, a parameter or the tensor in
    its place (`mixprec.convert` makes them), which a checkpoint's recomputation need not be
    handed: it casts `source` alike (`_with_recast`). Not while torch.compile traces: a
    recomputation there is the compiled graph's own, and the weak references broke the graph
    at every copy, each recompiled by the copy's id."""
    if torch.compiler.is_compiling():
        return
    _REGION_CASTS[id(t)] = t
    _CAST_SOURCES[id(t)] = source


def _replaced_parameters(
    module: nn.Module, selective: bool
) -> tuple[
    dict[str, torch.Tensor], dict[str, tuple[torch.dtype, torch.Tensor]], list[torch.Tensor]
]:
    """The tensors in place of the parameters of `module` and below for this forward, by
    path, in one walk of its parameters: (those `_with_swapped` puts back, those
    `_with_recast` casts again, and every weight the recomputation reads, each once: a
    parameter, the tensor in its place, or what a region's copy was cast from).

    Put back: plain tensors where parameters were, put there by
    ``torch.func.functional_call`` (the recomputation in the backward runs outside its swap,
    on the module's own weights) and, for `selective`, by an enclosing "true" region (copies
    in its compute dtype: a policy storing bfloat16 and computing in float32;
    `mark_region_cast`). Cast again (a checkpoint, not `selective`): the region's copies,
    with their dtype and what they were cast from. A checkpoint keeps no copy, and a module
    reading a child's weight itself (``F.linear(x, self.proj.weight)``) is recomputed
    outside that region (and outside a ``functional_call``'s swap), where the module's
    stored weight is."""
    swapped: dict[str, torch.Tensor] = {}
    recast: dict[str, tuple[torch.dtype, torch.Tensor]] = {}
    weights: dict[int, torch.Tensor] = {}
    for prefix, m in module.named_modules():
        for key, t in m._parameters.items():
            if t is None:
                continue
            if isinstance(t, nn.Parameter):
                weights[id(t)] = t
                continue
            path = f"{prefix}.{key}" if prefix else key
            region = _REGION_CASTS.get(id(t)) is t
            source = _CAST_SOURCES.get(id(t)) if region else None
            read = t if source is None else source
            weights[id(read)] = read
            if not region or selective:
                swapped[path] = t
            elif source is not None:
                recast[path] = (t.dtype, source)
    return swapped, recast, list(weights.values())


def _with_recast(
    module: nn.Module,
    recast: dict[str, tuple[torch.dtype, torch.Tensor]],
    run: Callable[..., Any],
    *args: Any,
) -> Any:
    """``run(*args)`` with the parameters an enclosing region cast at the forward
    (`_replaced_parameters`) cast alike again, fresh, from what they were cast from, where the
    stored parameters are back (the recomputation in the backward); in the forward the
    region's copies are there. A region inside casts nothing already in its dtype, so each
    weight is cast once, as before."""
    owner, _, key = next(iter(recast)).rpartition(".")
    if not isinstance(
        (module.get_submodule(owner) if owner else module)._parameters[key], nn.Parameter
    ):
        return run(*args)
    fresh: dict[int, torch.Tensor] = {}  # (a weight tied under two paths: one copy)
    copies = {}
    for path, (dtype, source) in recast.items():
        if id(source) not in fresh:
            fresh[id(source)] = source.to(dtype)
        copies[path] = fresh[id(source)]
    with _reparametrize_module(module, copies):
        return run(*args)


def _with_swapped(
    module: nn.Module, swapped: dict[str, torch.Tensor], run: Callable[..., Any], *args: Any
) -> Any:
    """``run(*args)`` with the tensors swapped in for parameters at the forward
    (`_replaced_parameters`) in place again: the recomputation in the backward runs outside
    that swap. Without it a ``functional_call``'s block recomputed from the module's own
    weights, and the layer's own region cast the stored parameters anew, an op the
    selective record of the forward lacks (torch fails the backward on it)."""
    owner, _, key = next(iter(swapped)).rpartition(".")
    if (module.get_submodule(owner) if owner else module)._parameters[key] is swapped[
        next(iter(swapped))
    ]:
        return run(*args)  # (the forward: the region's copies are there)
    with _reparametrize_module(module, swapped):
        return run(*args)
