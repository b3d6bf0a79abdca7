"""Batches and data loaders as the Trainer needs them: on the device, sharded over processes,
and able to restart in the middle of an epoch.

A ``DataLoader`` is rebuilt (same dataset, workers, collate function...) when it needs a
``DistributedSampler`` or has to skip the batches a resumed run already consumed; skipping
happens on the batch sampler, so skipped batches are never loaded.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
)

from mixprec.errors import caller_level
from mixprec.tree import iter_tensors, map_tensors

__all__: list[str] = []


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a nested batch (any structure `mixprec.tree` walks: tuples,
    lists, dicts, namedtuples, dataclasses, mappings) to ``device``."""
    if type(batch) in (tuple, list):  # the common batch: checked without walking it
        for t in batch:
            if type(t) is not torch.Tensor or t.device != device:
                break
        else:
            return batch
    return map_tensors(
        lambda t: t if t.device == device else t.to(device, non_blocking=t.is_pinned()), batch
    )


def batch_size_of(batch: Any) -> int:
    """The leading dimension of the first tensor found in ``batch`` (1 if there is none)."""
    if type(batch) in (tuple, list) and batch and type(batch[0]) is torch.Tensor:
        first: torch.Tensor | None = batch[0]
    else:
        first = next(iter_tensors(batch), None)
    if first is None:
        return 1
    return first.shape[0] if first.ndim else 1


def num_batches(loader: Iterable[Any], limit: int | float | None, what: str) -> int | None:
    """How many batches of ``loader`` one epoch uses, given a ``limit_*_batches`` value.

    None means the loader has no length (then the epoch ends when it is exhausted, and a
    fractional limit is refused, but for 1.0, all of it, and 0.0, none, as Lightning takes
    them).
    """
    try:
        total: int | None = len(loader)  # type: ignore[arg-type]
    except TypeError:
        total = None
    if limit is None:
        return total
    if isinstance(limit, float):
        if total is None and limit in (0.0, 1.0):
            return None if limit else 0
        if total is None:
            raise ValueError(
                f"limit_{what}_batches={limit} is a fraction, but the {what} data has no len(); "
                "pass an int number of batches"
            )
        return max(1, math.floor(total * limit)) if limit > 0 else 0
    return limit if total is None else min(total, limit)


class SkipBatches(Sampler[list[int]]):
    """The batches of ``batch_sampler`` from the ``skip``-th on (indices only; no data).

    ``then`` runs once the skipped batches are drawn, before the first kept one: a resumed
    run restores its random generators there, after the sampler drew its shuffling seed from
    the epoch's starting state and before any sample of the kept batches is loaded.
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        skip: int,
        then: Callable[[], None] | None = None,
    ) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip
        self.then = then

    def __iter__(self) -> Iterator[list[int]]:
        it = iter(self.batch_sampler)
        for _ in range(self.skip):
            next(it, None)
        if self.then is not None:
            self.then()
        yield from it

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)  # type: ignore[arg-type]


# what a rebuilt DataLoader keeps of the one it replaces (all but how it batches)
_LOADER_OPTIONS = (
    "num_workers collate_fn pin_memory timeout worker_init_fn multiprocessing_context "
    "generator prefetch_factor persistent_workers pin_memory_device"
).split()


def _rebuild(loader: DataLoader, batch_sampler: Iterable[list[int]]) -> DataLoader:
    """`loader` with another batch sampler, its other options as they were; a subclass
    stays its class (a shallow copy given the sampler, as its own __init__ would take other
    arguments; DataLoader refuses the attribute after __init__, not in ``__dict__``)."""
    if type(loader) is DataLoader:
        options = {name: getattr(loader, name) for name in _LOADER_OPTIONS}
        return DataLoader(loader.dataset, batch_sampler=batch_sampler, **options)
    copied = copy.copy(loader)  # (its batch_size and drop_last kept: its own code reads them)
    inner = getattr(batch_sampler, "sampler", None)
    copied.__dict__.update(
        batch_sampler=batch_sampler,
        _iterator=None,  # (a persistent worker pool over the old order)
        **({"sampler": inner} if inner is not None else {}),
    )
    return copied


def _check_map_style(loader: Any, why: str) -> DataLoader:
    if not isinstance(loader, DataLoader):
        raise TypeError(f"{why} needs a torch.utils.data.DataLoader, got {type(loader).__name__}")
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(
            f"{why} needs a map-style dataset; an IterableDataset must shard itself "
            "(use torch.utils.data.get_worker_info and torch.distributed.get_rank())"
        )
    if loader.batch_sampler is None:
        raise TypeError(f"{why} needs a DataLoader with a batch_size (automatic batching)")
    return loader


def distributed(
    loader: Any, rank: int, world_size: int, seed: int, *, evaluation: bool = False
) -> DataLoader:
    """``loader`` with its sampler replaced by a ``DistributedSampler`` for this rank.

    Shuffling is kept if the loader shuffled (its order then comes from ``seed`` and the
    epoch); a loader that already has a DistributedSampler is returned as is.
    """
    loader = _check_map_style(loader, "strategy='ddp' (to insert a DistributedSampler)")
    if any(isinstance(s, DistributedSampler) for s in _samplers(loader)):
        return loader
    batch_sampler = loader.batch_sampler
    if type(batch_sampler) is not BatchSampler:
        raise TypeError(
            f"cannot shard a DataLoader with a custom batch_sampler "
            f"({type(batch_sampler).__name__}) automatically; give it a DistributedSampler "
            "yourself"
        )
    sampler = DistributedSampler(
        loader.dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=isinstance(loader.sampler, RandomSampler),
        seed=seed,
        drop_last=batch_sampler.drop_last,
    )
    extra = sampler.total_size - len(loader.dataset)  # type: ignore[arg-type]
    if evaluation and extra > 0 and rank == 0:
        warnings.warn(
            f"evaluation data of {len(loader.dataset)} samples over {world_size} processes: "  # type: ignore[arg-type]
            f"the DistributedSampler repeats {extra} of them to give each process as many, "
            "so epoch metrics count those twice; make the dataset a multiple of the process "
            "count, or evaluate in one process, for exact metrics",
            UserWarning,
            stacklevel=caller_level(),
        )
    return _rebuild(
        loader, BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)
    )


def _samplers(loader: Any) -> list[Any]:
    batch_sampler = getattr(loader, "batch_sampler", None)
    found = (
        getattr(loader, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
    )
    return list({id(s): s for s in found if s is not None}.values())


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell a DistributedSampler (or any sampler with ``set_epoch``) the epoch, for its order."""
    for sampler in _samplers(loader):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)


def _generators_by_owner(loader: Any) -> dict[str, torch.Generator]:
    found: dict[str, torch.Generator] = {}
    owners = (
        ("generator= on the DataLoader", loader),
        ("a generator on its sampler", _sampler_of(loader)),
        # (a batch sampler drawing its batches itself, as a bucketing one does)
        ("a generator on its batch sampler", getattr(loader, "batch_sampler", None)),
    )
    for name, owner in owners:
        gen = getattr(owner, "generator", None)
        if isinstance(gen, torch.Generator) and all(g is not gen for g in found.values()):
            found[name] = gen
    return found


def _sampler_of(loader: Any) -> Any:
    """The sampler ordering ``loader``'s samples: its batch sampler's (a DataLoader built with
    ``batch_sampler=``, as `distributed` builds one, keeps an unused SequentialSampler as its
    ``sampler``), else its own."""
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return inner if inner is not None else getattr(loader, "sampler", None)


def generators(loader: Any) -> list[torch.Generator]:
    """The torch generators deciding ``loader``'s order (its own and its sampler's)."""
    return list(_generators_by_owner(loader).values())


def order_of(loader: Any) -> dict[str, Any]:
    """What decides ``loader``'s batch order: the types of its sampler and batch sampler and
    the torch generators they draw from, by owner. A mid-epoch checkpoint keeps it: its
    epoch's order replays only through a loader that orders batches the same way."""
    sampler, batch_sampler = _sampler_of(loader), getattr(loader, "batch_sampler", None)
    return {
        "sampler": type(sampler).__name__ if sampler is not None else None,
        "batch_sampler": type(batch_sampler).__name__ if batch_sampler is not None else None,
        "generators": list(_generators_by_owner(loader)),
    }


def describe_order(order: dict[str, Any]) -> str:
    """`order_of`'s result in words, for an error message."""
    sampler, batch_sampler = order.get("sampler"), order.get("batch_sampler")
    how = sampler or "no sampler"
    if batch_sampler is not None:
        how += f" (in a {batch_sampler})"
    gens = order["generators"]
    return how + (f" with {' and '.join(gens)}" if gens else " without a generator of its own")


def iterate_from(
    loader: Iterable[Any],
    skip: int,
    then: Callable[[], None] | None = None,
    start: Callable[[Any], None] | None = None,
    first: Callable[[Any], None] | None = None,
) -> Iterator[Any]:
    """An iterator over ``loader`` starting at batch ``skip``; ``then`` runs after the
    skipped batches and before the first kept one is loaded (see `SkipBatches`); ``start``
    is given the loader iterated before it is (`then` not run yet), to start its workers.

    A DataLoader over a map-style dataset skips on its batch sampler (nothing is loaded);
    anything else, a DataLoader subclass too (rebuilt, it would lose what its class does),
    is iterated and the first ``skip`` batches are dropped, the first of them given to
    ``first`` (to check it is the batch expected).
    """
    if type(loader) is DataLoader and loader.batch_sampler is not None:
        if not isinstance(loader.dataset, IterableDataset):
            skipping = SkipBatches(loader.batch_sampler, skip)
            rebuilt = _rebuild(loader, skipping)
            if start is not None:
                start(rebuilt)
            skipping.then = then
            return iter(rebuilt)
    if start is not None:
        start(loader)
    it = iter(loader)
    for i in range(skip):
        batch = next(it, None)
        if i == 0 and first is not None and batch is not None:
            first(batch)
    if then is not None:
        then()
    return it


def loader_batch_size(loader: Any) -> int | None:
    """The batch size a DataLoader was built with (None when it has none or is not one)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    size = getattr(batch_sampler, "batch_size", None) or getattr(loader, "batch_size", None)
    return size if isinstance(size, int) else None


def loader_samples(loader: Any) -> list[int] | None:
    """How many samples a map-style DataLoader's order is drawn over: its dataset's length
    and its sampler's (a permutation of the one, as many draws as the other); None where it
    has no such length (not a DataLoader, an IterableDataset, a dataset without len)."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    try:
        return [len(loader.dataset), len(_sampler_of(loader))]  # type: ignore[arg-type]
    except TypeError:
        return None


def why_empty(data: Any, epoch: int = 0) -> str:
    """Why ``data`` gives no batch, and what to do about it (for an error message)."""
    if iter(data) is data:  # an iterator (a generator, map(...)): one pass only
        if not epoch:
            return f"it is an iterator ({type(data).__name__}) that yielded nothing"
        return (
            f"it is a one-shot iterator ({type(data).__name__}), used up by epoch "
            f"{epoch - 1}; pass data that can be iterated again every epoch (a list, a "
            "DataLoader), or stop within one epoch with max_steps"
        )
    if isinstance(data, DataLoader):
        dataset = data.dataset
        if isinstance(dataset, IterableDataset):
            return f"its IterableDataset ({type(dataset).__name__}) yielded no sample"
        size, batch = len(dataset), loader_batch_size(data)  # type: ignore[arg-type]
        if size == 0:
            return f"its dataset ({type(dataset).__name__}) is empty"
        drop_last = getattr(data.batch_sampler, "drop_last", False)
        if drop_last and batch is not None and size < batch:
            return (
                f"drop_last=True drops the only batch: the dataset has {size} samples, fewer "
                f"than batch_size={batch}; lower batch_size or set drop_last=False"
            )
    return f"it ({type(data).__name__}) yielded nothing"
