"""What ``self.log`` records: per-step values and per-epoch means, kept as device tensors.

Values stay tensors until a logger or the progress bar needs numbers, so logging a metric in
``training_step`` adds no host synchronization of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

_Sums = dict[str, list[Any]]  # name -> [sum tensor, weight]


def _scalar(name: str, value: Tensor | float) -> Tensor:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"self.log({name!r}, ...) needs a single number, got a tensor of shape "
                f"{tuple(value.shape)}; reduce it first (e.g. .mean())"
            )
        return value.detach().reshape(())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"self.log({name!r}, ...) needs a number or a one-element tensor, "
            f"got {type(value).__name__}"
        )
    return torch.tensor(float(value), dtype=torch.float64)


class MetricStore:
    """Accumulates logged values; `take_step` and `take_epoch` hand out their means."""

    def __init__(self) -> None:
        self.training = True
        self.prog_bar: set[str] = set()
        self._step: _Sums = {}
        self._epoch: _Sums = {}
        self._synced: set[str] = set()

    def log(
        self,
        name: str,
        value: Tensor | float,
        *,
        prog_bar: bool = False,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        sync_dist: bool = False,
        batch_size: int | None = None,
    ) -> None:
        """Record ``value``; see `TrainingModule.log` for the meaning of the options."""
        on_step = self.training if on_step is None else on_step
        on_epoch = (not self.training) if on_epoch is None else on_epoch
        if not (on_step or on_epoch):
            raise ValueError(f"self.log({name!r}): on_step and on_epoch are both False")
        v = _scalar(name, value)
        both = on_step and on_epoch
        step_name = f"{name}_step" if both else name
        epoch_name = f"{name}_epoch" if both else name
        if on_step:
            self._add(self._step, step_name, v, 1)
            if sync_dist:
                self._synced.add(step_name)
        if on_epoch:
            weight = batch_size or 1
            self._add(self._epoch, epoch_name, v * weight, weight)
        if prog_bar:
            self.prog_bar.update({step_name, epoch_name} if both else {name})

    @staticmethod
    def _add(store: _Sums, name: str, value: Tensor, weight: float) -> None:
        slot = store.get(name)
        if slot is None:
            store[name] = [value.clone(), weight]
        else:
            slot[0] = slot[0] + value.to(slot[0].device)
            slot[1] += weight

    def take_step(self, mean: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
        """Means of the values logged since the last call (``sync_dist`` ones averaged over
        processes by ``mean``), as tensors (reading them is left to whoever needs numbers),
        then forget them."""
        out = {}
        for name, (total, count) in self._step.items():
            value = total / count  # type: ignore[operator]
            out[name] = mean(value) if name in self._synced else value
        self._step.clear()
        return out

    def take_epoch(self, mean: Callable[[Tensor], Tensor]) -> dict[str, float]:
        """Weighted means of the epoch values, averaged over processes, then forget them."""
        if not self._epoch:
            return {}
        names = sorted(self._epoch)
        totals = torch.stack([torch.as_tensor(self._epoch[n][0]).double().cpu() for n in names])
        weights = torch.tensor([float(self._epoch[n][1]) for n in names], dtype=torch.float64)
        # a ratio of means over processes is the ratio of sums: the weighted mean of all
        reduced = mean(torch.stack([totals, weights]))
        self._epoch.clear()
        return {n: float(t / w) for n, t, w in zip(names, reduced[0], reduced[1], strict=True)}

    def clear(self) -> None:
        """Forget everything logged (between runs)."""
        self._step.clear()
        self._epoch.clear()
        self._synced.clear()
        self.prog_bar.clear()
