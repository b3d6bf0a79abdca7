"""Measuring plans by running them: loss, bytes and step time of a model converted to a
policy, and a short training run; what the search's report states instead of predictions."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.convert import apply
from mixprec.optim.states import StateFormat
from mixprec.plan.units import Unit, compensated, state_bytes
from mixprec.policy.map import PolicyMap
from mixprec.precision import Precision
from mixprec.step import backward, batch_loss, fresh, seeded

__all__: list[str] = []


@dataclass
class Measured:
    """A plan as it ran: mean loss over the evaluation batches, bytes of the searched layers
    and of the whole model, median seconds of one step; under a search's ``batch_size``, the
    bytes its blocks save at that batch, measured in the plan's own dtypes and options, and
    the seconds its blocks' options count (`activation_choice`); the elements of its
    trainable parameters (int8/int4 weights are frozen; None: not counted)."""

    loss: float
    unit_bytes: int
    model_bytes: int
    seconds: float | None  # None: not timed
    activation_bytes: int = 0
    activation_seconds: float = 0.0
    # under a budget in bytes, what the plan holds beyond the fixed bytes the baseline
    # counted: its unsearched layers and the activations saved outside its blocks, in the
    # plan's own dtypes (float32's are larger), less the baseline's
    extra_bytes: int = 0
    trainable: int | None = None


@dataclass
class Trained:
    """A short training run: the loss of each step and the evaluation loss after it."""

    losses: list[float]
    eval_loss: float


def convert(model: nn.Module, policy: PolicyMap) -> nn.Module:
    """A fresh deep copy of `model` converted to `policy`, dropout off (every plan must see
    the same network)."""
    converted = copy.deepcopy(model)
    apply(converted, policy, warn=False)
    return converted.eval()


def eval_loss(
    model: nn.Module,
    precision: Precision,
    batches: Sequence[Any],
    loss_fn: Any,
    *,
    seed: int,
    device: torch.device,
) -> float:
    """The mean loss over `batches`, each run with the RNG seeded to `seed` as the search's
    reference run is: a model that draws random numbers in its forward (a VAE's sample)
    draws the same ones in every plan, and the caller's RNG state is left as it was."""
    losses = []
    with torch.no_grad():
        for b in batches:
            with seeded(seed, device):
                losses.append(float(batch_loss(precision, model, fresh(b), loss_fn).detach()))
    return sum(losses) / len(losses)


def _step(
    model: nn.Module, precision: Precision, batch: Any, loss_fn: Any, training: bool
) -> Callable[[], None]:
    # one copy for the plan's timed steps, made outside them: a model writing into its input
    # changes this copy alone (the values a timed step sees do not matter, the caller's do)
    own = fresh(batch)

    def run() -> None:
        if training:
            loss = batch_loss(precision, model, own, loss_fn)
            if loss.requires_grad:  # a plan may freeze every layer (all quantized)
                backward(precision, loss)
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                batch_loss(precision, model, own, loss_fn)

    return run


def _unit_modules(model: nn.Module, units: Sequence[Unit]) -> nn.ModuleList:
    modules = dict(model.named_modules())
    return nn.ModuleList(modules[p] for u in units for p in u.paths)


def _state_formats(model: nn.Module, plan: PolicyMap) -> dict[int, StateFormat] | None:
    """The optimizer-state format of each parameter of a plan with ``states`` (by ``id``)."""
    if plan.states is None:
        return None
    named = dict(model.named_parameters())
    return {id(named[n]): fmt for n, (fmt, _) in plan.state_formats(model).items()}


def measure_plans(
    model: nn.Module,
    plans: dict[str, PolicyMap],
    units: Sequence[Unit],
    batches: Sequence[Any],
    loss_fn: Any,
    *,
    count: str,
    training: bool,
    reps: int,
    device: torch.device,
    timed: set[str],
    seed: int,
) -> dict[str, Measured]:
    """Each plan converted and run: its loss on `batches` (`eval_loss`, seeded), its bytes
    (as `count` counts them) and, for the plans in `timed`, the median time of one step on
    the first batch (forward, and backward when `training`), taking turns step by step after
    an untimed step each."""
    converted = {name: convert(model, plan) for name, plan in plans.items()}
    precisions = {name: Precision(plan, device=device) for name, plan in plans.items()}
    losses = {
        name: eval_loss(m, precisions[name], batches, loss_fn, seed=seed, device=device)
        for name, m in converted.items()
    }
    steps = {
        name: _step(m, precisions[name], batches[0], loss_fn, training)
        for name, m in converted.items()
        if name in timed
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    with seeded(seed, device):  # the caller's RNG state kept
        for rep in range(reps + 1):
            for name, run in steps.items():
                start = time.perf_counter()
                run()
                if rep:
                    times[name].append(time.perf_counter() - start)
    held = {name: held_bytes(m, plans[name], units, count) for name, m in converted.items()}
    return {
        name: Measured(
            loss=losses[name],
            unit_bytes=held[name][0],
            model_bytes=held[name][1],
            seconds=statistics.median(times[name]) if name in times else None,
            trainable=trainable_elements(converted[name]),
        )
        for name in converted
    }


def held_bytes(
    converted: nn.Module, plan: PolicyMap, units: Sequence[Unit], count: str
) -> tuple[int, int]:
    """The bytes (as `count` counts them) of the searched layers of `converted` (the model
    converted to `plan`) and of the whole of it, with the plan's optimizer-state formats;
    the layers' as the whole model's step (compensated or not) holds them."""
    formats, step = _state_formats(converted, plan), compensated(converted)
    return (
        state_bytes(_unit_modules(converted, units), count, formats, step),
        state_bytes(converted, count, formats, step),
    )


def _trainable(model: nn.Module) -> list[Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def trainable_elements(model: nn.Module) -> int:
    """The elements of `model`'s trainable parameters (a converted plan's: its int8/int4
    weights are frozen), each parameter once."""
    return sum(p.numel() for p in _trainable(model))


def train(
    model: nn.Module,
    policy: PolicyMap,
    batches: Sequence[Any],
    eval_batches: Sequence[Any],
    loss_fn: Any,
    *,
    steps: int,
    lr: float,
    device: torch.device,
    seed: int,
) -> Trained:
    """`steps` AdamW steps of a copy of `model` under `policy` (16-bit weights with Kahan
    compensation, float32 ones plainly; int8/int4 weights frozen), cycling over `batches`
    with a fixed seed; the loss of each step and the evaluation loss after."""
    # the same dropout masks in every plan's run; the caller's RNG state left as it was
    with seeded(seed, device):
        trained = copy.deepcopy(model).train()
        apply(trained, policy, warn=False)
        sixteen = any(p.dtype in (torch.bfloat16, torch.float16) for p in _trainable(trained))
        precision = Precision(
            policy, device=device, allow_slow=True, compensation="kahan" if sixteen else None
        )
        if not _trainable(trained):
            raise ValueError(
                "the plan leaves nothing to train (every trainable layer quantized, int8/int4 "
                "weights are frozen): train_steps needs a plan with trainable parameters"
            )
        optimizer = torch.optim.AdamW(_trainable(trained), lr=lr)
        trained, optimizer = precision.setup(trained, optimizer, convert=False)
        losses = []
        for i in range(steps):
            loss = batch_loss(precision, trained, fresh(batches[i % len(batches)]), loss_fn)
            backward(precision, loss)
            precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        trained.eval()
        return Trained(
            losses=losses,
            eval_loss=eval_loss(
                trained, precision, eval_batches, loss_fn, seed=seed, device=device
            ),
        )
