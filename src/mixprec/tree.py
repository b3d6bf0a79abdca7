"""One walker for nested batches and outputs: map or list the tensors inside them.

Casting outputs, converting inputs, moving batches to a device and probing outputs all
walk the same shapes: tuples, namedtuples, lists, dicts (`defaultdict`, `OrderedDict`,
subclasses whose `__init__` takes other arguments), other mappings (`ChainMap`, `UserDict`,
`ModelOutput`-style ordered mappings) and dataclasses (including `init=False` fields).
Containers are rebuilt without calling their `__init__`, so every attribute and field
survives; a container none of whose tensors changed is returned as it is.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import ChainMap, defaultdict
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")

__all__ = ["iter_tensors", "map_tensors", "shallow_copy"]


def shallow_copy(obj: Any) -> Any:
    """A shallow copy of ``obj`` made without its ``__init__`` (which may need other
    arguments: a dataclass that is also an ``OrderedDict``, whose copy calls ``cls()``)."""
    try:
        return copy.copy(obj)
    except TypeError:
        cls = type(obj)
        new = cls.__new__(cls)
        if hasattr(obj, "__dict__"):
            new.__dict__.update(obj.__dict__)
        if isinstance(obj, defaultdict):  # (held in C, not in `__dict__`)
            new.default_factory = obj.default_factory
        return new


def _tuple_like(obj: tuple, items: list[Any]) -> tuple:
    """A tuple subclass rebuilt with new items: through its constructor when that takes a
    sequence (torch.return_types), else without `__init__`, attributes copied."""
    cls = type(obj)
    try:
        new = cls(items)
    except TypeError:
        new = tuple.__new__(cls, items)
    if hasattr(obj, "__dict__"):
        new.__dict__.update(obj.__dict__)
    return new


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


class _Mapper:
    """One `map_tensors` call: `memo` keeps a tensor or container seen twice shared.

    Under torch.compile the memo is `traced`, a list of (original, mapped) tensors compared
    with `is`: `id()` of an input would make the compiled graph guard on that very object and
    recompile for every new batch, and without a memo a tensor passed twice (attention's
    ``query is key``) would come out as two tensors, taking the callee down another path
    than eagerly."""

    def __init__(self, fn: Callable[[Tensor], Any]) -> None:
        self.fn = fn
        self.memo: dict[int, tuple[Any, Any]] | None = None if torch.compiler.is_compiling() else {}
        self.traced: list[tuple[Tensor, Any]] = []

    def __call__(self, obj: Any) -> Any:
        is_tensor = isinstance(obj, Tensor)
        if not is_tensor and not (
            isinstance(obj, (tuple, list, Mapping)) or _is_dataclass_instance(obj)
        ):
            return obj
        if self.memo is None:
            return self._by_identity(obj) if is_tensor else self._rebuild(obj)
        seen = self.memo.get(id(obj))
        if seen is not None:
            return seen[1]
        new = self.fn(obj) if is_tensor else self._rebuild(obj)
        self.memo[id(obj)] = (obj, new)  # keeps `obj` alive so its id stays unique
        return new

    def _by_identity(self, t: Tensor) -> Any:
        """Tensor `t` mapped under torch.compile: what it was mapped to before if it was seen
        (compared with `is`, no `id()`: no guard on the object), else mapped now. Tensors
        only: dynamo cannot trace `is` between two tuples, and a container seen twice is
        rebuilt twice (its tensors still shared)."""
        for old, new in self.traced:
            if old is t:
                return new
        new = self.fn(t)
        self.traced.append((t, new))
        return new

    def _rebuild(self, obj: Any) -> Any:
        if isinstance(obj, (tuple, list)):
            items = [self(x) for x in obj]
            if all(a is b for a, b in zip(items, obj, strict=True)):
                return self._fields(obj, fresh=False)
            cls = type(obj)
            if isinstance(obj, tuple):
                if hasattr(obj, "_fields") and hasattr(cls, "_make"):
                    new: Any = cls._make(items)  # a namedtuple
                elif cls is tuple:
                    return tuple(items)
                else:
                    new = _tuple_like(obj, items)
            elif cls is list:
                return items
            else:
                new = shallow_copy(obj)
                new[:] = items
            return self._fields(new, fresh=True)
        if isinstance(obj, Mapping):
            new = self._mapping(obj)
            if not _is_dataclass_instance(new):
                return new  # (dynamo before torch 2.12 cannot trace `dict is not dict`)
            return self._fields(new, fresh=new is not obj)
        return self._fields(obj, fresh=False)

    def _mapping(self, obj: Mapping[Any, Any]) -> Any:
        if isinstance(obj, ChainMap):
            maps = [self(m) for m in obj.maps]
            if all(a is b for a, b in zip(maps, obj.maps, strict=True)):
                return obj
            new = shallow_copy(obj)
            new.maps = maps
            return new
        values = {k: self(v) for k, v in obj.items()}
        if all(values[k] is v for k, v in obj.items()):
            return obj
        if type(obj) is dict:
            return values
        if isinstance(obj, MutableMapping):
            new = shallow_copy(obj)
            for k, v in values.items():
                new[k] = v
            return new
        try:
            return type(obj)(values)
        except TypeError as err:
            raise TypeError(
                f"cannot rebuild the read-only mapping {type(obj).__name__} with new tensors "
                f"({err}); return a dict, a dataclass or a MutableMapping instead"
            ) from None

    def _fields(self, obj: Any, *, fresh: bool) -> Any:
        """Map every field of a dataclass (`init=False` ones too); `fresh` says `obj` was
        built by this call (a dataclass that is also a sequence or mapping) and may be
        changed in place, else a copy is changed."""
        if not _is_dataclass_instance(obj):
            return obj
        changed = {}
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):
                old = getattr(obj, f.name)
                new = self(old)
                if new is not old:
                    changed[f.name] = new
        if not changed:
            return obj
        target = obj if fresh else shallow_copy(obj)
        for name, value in changed.items():
            object.__setattr__(target, name, value)
        return target


def map_tensors(fn: Callable[[Tensor], Any], tree: T) -> T:
    """`tree` with `fn(t)` in place of every tensor `t`; containers keep their types, and a
    tensor or container found twice is mapped once (what was shared stays shared)."""
    if isinstance(tree, Tensor):
        return fn(tree)
    return _Mapper(fn)(tree)


def iter_tensors(tree: Any) -> Iterator[Tensor]:
    """Every tensor in `tree`, depth first, in the order the containers list them."""
    seen: set[int] = set()

    def walk(obj: Any) -> Iterator[Tensor]:
        if isinstance(obj, Tensor):
            yield obj
            return
        if not isinstance(obj, (tuple, list, Mapping)) and not _is_dataclass_instance(obj):
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (tuple, list)):
            for x in obj:
                yield from walk(x)
        elif isinstance(obj, Mapping):
            for x in obj.values():
                yield from walk(x)
        if _is_dataclass_instance(obj):
            # a ModelOutput-style mapping holds its items as fields too: list them once
            items = [id(v) for v in obj.values()] if isinstance(obj, Mapping) else []
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name, None)
                if id(value) not in items:
                    yield from walk(value)

    return walk(tree)
