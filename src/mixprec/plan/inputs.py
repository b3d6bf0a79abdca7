"""A search's arguments, checked once: `SearchInputs` holds them in the form the phases use
(batches as lists, the device and its facts, the baseline policy, the formats to try, the
layers to search), each bad one refused with what was wrong and what is accepted."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.hardware import DeviceInfo, check, detect, device_of, parse_device
from mixprec.optim.states import StateFormat, parse_state_format
from mixprec.plan.budget import Budget
from mixprec.plan.units import COUNTS, Unit, default_formats, find_units, format_name
from mixprec.policy import Policy, QuantizedPolicy, as_policy
from mixprec.policy.map import PolicyMap

__all__: list[str] = []


@dataclass(frozen=True)
class SearchInputs:
    """What `search` was given, checked: the phases read it and change none of it."""

    model: nn.Module
    batches: list[Any]
    eval_batches: list[Any]
    train_batches: list[Any]
    held_out: bool
    loss_fn: Callable[..., Tensor] | None
    budget: Budget
    count: str
    states: list[str] | None
    tolerance: float
    retries: int
    train_steps: int
    lr: float
    reps: int
    device: torch.device
    info: DeviceInfo
    base: Policy
    policies: list[Policy]
    left_out: dict[str, str]
    units: list[Unit]
    seed: int
    batch_size: int | None = None  # activations counted and chosen at this batch

    @property
    def names(self) -> list[str]:
        """The formats tried, by policy name, in the order of `policies`."""
        return [p.name for p in self.policies]

    @property
    def training(self) -> bool:
        """Whether bytes and times are a training step's (gradients, optimizer state)."""
        return self.count == "training"


def search_inputs(
    model: Any,
    batches: Any,
    loss_fn: Callable[..., Tensor] | None,
    *,
    budget: Any,
    formats: Sequence[Any] | None,
    baseline: Any,
    count: str,
    states: str | StateFormat | Sequence[str | StateFormat] | None,
    eval_batches: Any,
    tolerance: Any,
    retries: Any,
    train_steps: Any,
    train_batches: Any,
    lr: Any,
    reps: Any,
    device: torch.device | str | None,
    device_info: DeviceInfo | None,
    allow_slow: bool,
    seed: Any,
    batch_size: Any = None,
) -> SearchInputs:
    """`search`'s arguments checked and put in the form its phases use."""
    _check_model(model)
    budget = Budget.of(budget)
    if count not in COUNTS:
        raise ValueError(f"count must be one of {', '.join(COUNTS)}, got {count!r}")
    if states is not None and count != "training":
        raise ValueError(
            f"states are optimizer-state formats, counted only under count='training' (got "
            f"count={count!r}); pass count='training' or leave states out"
        )
    state_list = _state_formats(states)
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if count != "training":
            raise ValueError(
                f"batch_size counts the activations a training step saves, under "
                f"count='training' only (got count={count!r}); pass count='training'"
            )
    _check_numbers(retries, train_steps, reps, tolerance, lr, seed)
    batches = _check_batches(batches, "batches")
    train_list = (
        batches if train_batches is None else _check_batches(train_batches, "train_batches")
    )
    held_out = eval_batches is not None
    eval_list = _check_batches(eval_batches, "eval_batches") if held_out else batches
    dev = parse_device(device) if device is not None else device_of(model)
    info = device_info or detect(dev)
    base = as_policy(baseline)
    if isinstance(base, QuantizedPolicy):
        raise ValueError(
            f"the baseline is the float precision a plan departs from (e.g. 'bf16-mixed'), "
            f"got the quantized {base.name!r}; put quantized formats in formats="
        )
    check(PolicyMap(base), allow_slow=allow_slow, info=info)
    policies, left_out = _formats(formats, base, info, allow_slow)
    units = find_units(model)
    if not units:
        if type(model) in (nn.Linear, nn.Embedding):  # (its own layer: not swappable in place)
            raise ValueError(
                f"the model is itself one {type(model).__name__}: a search chooses for the "
                "layers inside a model, swapping them in their parents; search it wrapped "
                "(nn.Sequential(layer))"
            )
        raise ValueError(
            f"{type(model).__name__} has no layer a search can choose for (Linear, Embedding "
            "or Hugging Face Conv1D with a floating weight)"
        )
    return SearchInputs(
        model=model,
        batches=batches,
        eval_batches=eval_list,
        train_batches=train_list,
        held_out=held_out,
        loss_fn=loss_fn,
        budget=budget,
        count=count,
        states=state_list,
        tolerance=tolerance,
        retries=retries,
        train_steps=train_steps,
        lr=lr,
        reps=reps,
        device=dev,
        info=info,
        base=base,
        policies=policies,
        left_out=left_out,
        units=units,
        seed=seed,
        batch_size=batch_size,
    )


def _state_formats(states: Any) -> list[str] | None:
    """``states`` as canonical format names: one format (``"int8"``, a `StateFormat`) is a
    list of one, not a sequence of characters."""
    if states is None:
        return None
    if isinstance(states, (str, StateFormat)):
        states = [states]
    if not isinstance(states, Iterable) or isinstance(states, Mapping):
        raise TypeError(
            f"states must be an optimizer-state format ('int8') or a list of them "
            f"(['int8', 'int4']), got {type(states).__name__}"
        )
    return [str(parse_state_format(s)) for s in states]


def check_finite(float32_loss: float, where: str) -> None:
    """A float32 loss that is not finite leaves nothing to score or compare plans against."""
    if not math.isfinite(float32_loss):
        raise ValueError(
            f"the model's float32 loss on {where} is {float32_loss}: a search scores and "
            "verifies plans against float32, which needs a finite loss (check the batches "
            "and the model)"
        )


def _check_model(model: Any) -> None:
    """A module with every weight loaded and finite: a search runs it and quantizes it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"search() takes an nn.Module, got {type(model).__name__}")
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        more = f" (and {len(meta) - 1} more)" if len(meta) > 1 else ""
        raise ValueError(
            f"{meta[0]}{more} is on the meta device, without values: a search runs the "
            "model, so give it one whose weights are loaded"
        )
    broken = [
        (n, int((~torch.isfinite(t)).sum()))
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if broken:
        more = f" (and {len(broken) - 1} more tensors)" if len(broken) > 1 else ""
        raise ValueError(
            f"the model's {broken[0][0]} holds {broken[0][1]} inf/NaN value(s){more}: a search "
            "runs the model against float32 and quantizes its weights, which needs them finite "
            "(a diverged or corrupt checkpoint?)"
        )


def _check_numbers(
    retries: Any, train_steps: Any, reps: Any, tolerance: Any, lr: Any, seed: Any
) -> None:
    for name, value, least in (
        ("retries", retries, 0),
        ("train_steps", train_steps, 0),
        ("reps", reps, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if isinstance(tolerance, bool) or not (
        isinstance(tolerance, (int, float)) and 0 <= tolerance < math.inf
    ):
        raise ValueError(f"tolerance must be a non-negative number, got {tolerance!r}")
    if isinstance(lr, bool) or not (isinstance(lr, (int, float)) and 0 < lr < math.inf):
        raise ValueError(f"lr must be a positive number (the training run's), got {lr!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")


def _check_batches(batches: Any, what: str) -> list[Any]:
    if isinstance(batches, (Tensor, Mapping)) or not isinstance(batches, Iterable):
        raise TypeError(
            f"{what} must be a list of batches (e.g. [batch] for one), got {type(batches).__name__}"
        )
    out = list(batches)
    if not out:
        spent = " (an iterator, used up already?)" if iter(batches) is batches else ""
        raise ValueError(f"{what} is empty{spent}: the search needs at least one batch")
    return out


def _formats(
    formats: Sequence[Any] | None,
    baseline: Policy,
    info: DeviceInfo,
    allow_slow: bool,
) -> tuple[list[Policy], dict[str, str]]:
    """The formats to try (each checked on the device), and those left out with why."""
    if formats is None:
        names, left_out = default_formats(baseline, info)
    else:
        if isinstance(formats, (str, Policy)):
            formats = [formats]
        names, left_out = [], {}
        for spec in formats:
            name = format_name(spec)
            check(PolicyMap(name), allow_slow=allow_slow, info=info)
            if name not in names:
                names.append(name)
        if baseline.name not in names:
            names.append(baseline.name)  # every layer can stay as the baseline has it
    return [as_policy(n) for n in names], left_out
