"""How much each (layer, format) hurts the loss, and what it costs in time.

One float32 forward and backward per batch records, for every searched layer, its inputs,
its output ``y`` and the loss's gradient ``g`` at that output. A candidate (the layer
converted to a format) is then run on the same inputs alone, and its output error
``d = y_f - y`` scored two ways:

- ``taylor = sum(g * d)``: the first-order change of the loss;
- ``fisher = M/2 * sum_t (g_t . d_t)^2`` over the M rows of the output (its last dimension
  the features: the tokens of a sequence model, the samples of an MLP): the second-order
  change with the Hessian replaced by the empirical Fisher of a loss that averages over
  rows (a row's own gradient is ``M g_t``), non-negative, as the Fisher-weighted error of
  HAWQ-style and auto-quantize methods. Rows, not sequences: a batch of 16 sequences gives
  an empirical Fisher of rank 16, blind to almost every direction a quantization error
  takes, and far below the loss change it predicts (docs/doctor.md gives the figures).

A candidate whose output is not finite where float32's is (it overflows) scores both terms
``inf``: the solver never gives the layer that format.

The damage the solver minimises is the Fisher term (averaged over batches): the
first-order term of a trained model is noise whose sign the next batch does not keep. The
report predicts a plan's loss change as the sum of both over its layers, and checks it
against the loss the plan measures: layers interact, so the sum is a guide the verification
corrects.

Time: each candidate's forward (and backward under training costs) on the first batch's
inputs, ``reps`` times, candidates of a layer taking turns, the median kept.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from mixprec.errors import LossTypeError
from mixprec.plan.units import Unit

__all__: list[str] = []


@dataclass
class Calls:
    """What one searched layer saw in one reference step: per call, its inputs, its output
    and the gradient of the loss at the output."""

    args: list[tuple[Any, ...]] = field(default_factory=list)
    kwargs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    grads: list[Tensor | None] = field(default_factory=list)


@dataclass
class Scores:
    """A (unit, format)'s damage summed over the unit's layers, averaged over batches."""

    fisher: float = 0.0
    taylor: float = 0.0
    batches: int = 0

    def add(self, fisher: float, taylor: float) -> None:
        self.fisher += fisher
        self.taylor += taylor

    def end_batch(self) -> None:
        self.batches += 1

    @property
    def damage(self) -> float:
        return self.fisher / max(self.batches, 1)

    @property
    def first_order(self) -> float:
        return self.taylor / max(self.batches, 1)


def _kept(value: Any) -> Any:
    """A copy the model cannot change later (an in-place residual add, ``ReLU(inplace=True)``
    on a layer's output would otherwise change what was recorded)."""
    return value.detach().clone() if isinstance(value, Tensor) else value


class _Readers(TorchFunctionMode):
    """Notes the searched layers whose parameters an operation outside the layer reads (a
    head computed as ``F.linear(h, embedding.weight)``): swapping such a layer for a
    quantized one would leave that reader without its weight, and one stored in another dtype
    than the baseline's would hand it a weight its code does not take."""

    def __init__(self, owners: dict[int, set[str]]) -> None:
        super().__init__()
        self.owners = owners
        self.inside: list[str] = []
        self.outside: dict[str, str] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        for a in (*args, *(kwargs or {}).values()):
            paths = self.owners.get(id(a)) if isinstance(a, nn.Parameter) else None
            # read by one of its layers (tied layers share it): fine
            if paths and not paths.intersection(self.inside[-1:]):
                where = f"inside {self.inside[-1]}" if self.inside else "outside any layer"
                for path in sorted(paths):
                    self.outside.setdefault(path, f"{getattr(func, '__name__', func)} {where}")
        return func(*args, **(kwargs or {}))


def record(
    model: nn.Module, paths: Iterable[str], step: Callable[[], Tensor]
) -> tuple[float, dict[str, Calls], dict[str, str]]:
    """Run ``step()`` (a forward returning the loss) and its backward on `model`, recording
    what the layers at `paths` saw; returns the loss, the calls per path, and the layers
    whose parameters something outside them reads (path -> the operation that does).

    A layer whose output needs no gradient (frozen, on inputs that need none) has its output
    replaced by a copy of a leaf that does, so the loss's gradient reaches it and its damage
    is scored (a copy, not the leaf: the model may change it in place, ``ReLU(inplace=True)``).
    So does one the forward runs with gradients off (``torch.no_grad()``, inference mode: a
    frozen teacher), its copy made with them on: the ops after it that run with gradients
    carry the loss's gradient to it. When none reaches such a layer (the ops after it run
    without too), its damage cannot be scored: `ValueError` naming it, not a damage of 0."""
    modules = dict(model.named_modules())
    calls = {path: Calls() for path in paths}
    owners: dict[int, set[str]] = {}
    for path in calls:
        for p in modules[path].parameters(recurse=False):
            owners.setdefault(id(p), set()).add(path)
    readers = _Readers(owners)
    handles = []
    off: dict[str, int] = {}  # path -> its first call run with gradients off

    def hook_for(path: str) -> Callable[..., Any]:
        def enter(module: nn.Module, args: tuple) -> None:
            readers.inside.append(path)

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            readers.inside.pop()
            if not isinstance(output, Tensor) or not output.is_floating_point():
                raise TypeError(
                    f"{path} returned {type(output).__name__}: the search scores layers "
                    "that return one floating tensor"
                )
            c = calls[path]
            i = len(c.outputs)
            if not torch.is_grad_enabled():
                off.setdefault(path, i)
            # (an inference tensor, too, copied into one autograd can record)
            with torch.inference_mode(False), torch.enable_grad():
                if not output.requires_grad:
                    output = output.detach().clone().requires_grad_().clone()
                c.args.append(tuple(_kept(a) for a in args))
                c.kwargs.append({k: _kept(v) for k, v in kwargs.items()})
                c.outputs.append(_kept(output))
                c.grads.append(None)

                def keep(grad: Tensor) -> None:
                    c.grads[i] = grad.detach()

                output.register_hook(keep)
            return output

        return enter, hook

    try:
        for path in calls:
            enter, hook = hook_for(path)
            handles.append(modules[path].register_forward_pre_hook(enter))
            handles.append(modules[path].register_forward_hook(hook, with_kwargs=True))
        with readers:
            loss = step()
        if not loss.requires_grad:
            raise LossTypeError(
                "the loss does not require grad: is the model frozen or run under no_grad?"
            )
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    for path, c in calls.items():
        if not c.outputs:
            raise ValueError(
                f"{path} was not called in the model's forward: a search scores the layers a "
                "step runs"
            )
    for path, first in off.items():
        if any(g is None for g in calls[path].grads[first:]):
            raise ValueError(
                f"{path} ran with gradients off (under torch.no_grad() or inference mode in "
                "the model's forward) and no gradient of the loss reached its output: the ops "
                "after it ran without gradients too, so the search cannot score what a format "
                "does to it. Run the ops between it and the loss with gradients on (only the "
                "frozen layers under no_grad), or give the model its output in the batch"
            )
    return float(loss.detach()), calls, readers.outside


def score(holder: nn.ModuleList, unit: Unit, calls: dict[str, Calls], scores: Scores) -> None:
    """Add one batch's damage of a candidate (`holder`, from `units.candidate`) to `scores`."""
    with torch.no_grad():
        for layer, path in zip(holder, unit.paths, strict=True):
            c = calls[path]
            for args, kwargs, y, g in zip(c.args, c.kwargs, c.outputs, c.grads, strict=True):
                if g is None:  # the output did not reach the loss
                    continue
                out, y = layer(*args, **kwargs).float(), y.float()
                if bool((torch.isfinite(y) & ~torch.isfinite(out)).any()):
                    # the format overflows here (float16 past 65504): the loss goes with
                    # it, however small the gradient there (0 * inf would score NaN)
                    scores.add(math.inf, math.inf)
                    continue
                # float32 elementwise (an output's float32 difference is exact to its last
                # bit), sums per sample in float64
                d = out - y
                rows = (g.float() * d).reshape(-1, d.shape[-1] if d.dim() else 1)
                gd = rows.sum(dim=1, dtype=torch.float64)
                m = gd.numel()
                scores.add(float(m / 2 * (gd**2).sum()), float(gd.sum()))
    scores.end_batch()


def _timed(holder: nn.ModuleList, unit: Unit, calls: dict[str, Calls], training: bool) -> float:
    start = time.perf_counter()
    for layer, path in zip(holder, unit.paths, strict=True):
        c = calls[path]
        for args, kwargs, g in zip(c.args, c.kwargs, c.grads, strict=True):
            if training:
                args = tuple(
                    a.detach().requires_grad_()
                    if isinstance(a, Tensor) and a.is_floating_point()
                    else a
                    for a in args
                )
                out = layer(*args, **kwargs)
                if out.requires_grad:
                    out.backward(torch.ones_like(out) if g is None else g.to(out.dtype))
            else:
                with torch.no_grad():
                    layer(*args, **kwargs)
    return time.perf_counter() - start


def time_candidates(
    holders: list[nn.ModuleList],
    unit: Unit,
    calls: dict[str, Calls],
    training: bool,
    reps: int,
) -> list[float]:
    """Median seconds of each candidate's step of this unit's layers on `calls`' inputs
    (forward; and backward under `training`), the candidates taking turns, one untimed
    round first (caches, packed weights)."""
    times: list[list[float]] = [[] for _ in holders]
    for rep in range(reps + 1):
        for i, holder in enumerate(holders):
            t = _timed(holder, unit, calls, training)
            if rep:
                times[i].append(t)
    for holder in holders:
        holder.zero_grad(set_to_none=True)
    return [statistics.median(t) for t in times]
