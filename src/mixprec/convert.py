"""`apply` and `remove`: the only code that changes a module's dtypes or its forward.

Parameters and floating buffers go to each module's param dtype. The root module's forward
runs in the policy's compute region (autocast for mixed policies, a cast of floating inputs
for "true" ones) and casts floating outputs to the output dtype. Below the root, a module
gets a region of its own only where its policy computes differently from its parent's, so a
uniform policy costs one region. State-dict keys and shapes never change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.errors import PolicySpecError
from mixprec.hardware import device_of, warn_if_unsupported
from mixprec.policy import Policy
from mixprec.policy_map import PolicyMap, as_map

_STATE = "_mixprec_state"


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor in a nested tuple/list/dict/dataclass to `dtype`."""
    if isinstance(obj, Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)):
        items = [cast_floating(x, dtype) for x in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*items)
        return type(obj)(items)
    if isinstance(obj, dict):
        return type(obj)({k: cast_floating(v, dtype) for k, v in obj.items()})
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: cast_floating(getattr(obj, f.name), dtype)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj


def _device_type(args: tuple[Any, ...], kwargs: dict[str, Any], module: nn.Module) -> str:
    for x in args:
        if isinstance(x, Tensor):
            return x.device.type
    for x in kwargs.values():
        if isinstance(x, Tensor):
            return x.device.type
    return device_of(module).type


class _Region:
    """Stands in for one module's `forward`: enters its compute region, casts outputs.

    Stored in the module's `__dict__` under "forward", so `module(...)` and hooks behave
    as before; holds the module itself (not a bound method) so pickling and deepcopy work.
    """

    def __init__(
        self,
        module: nn.Module,
        policy: Policy,
        *,
        parent: Policy | None,
        original: Any,
    ) -> None:
        self.module = module
        self.autocast = policy.is_mixed
        self.compute_dtype = policy.compute_dtype
        # Inside a "true" parent nothing casts between siblings, so a region hands its
        # result back in the parent's compute dtype; elsewhere in its own output dtype.
        if parent is not None and not parent.is_mixed:
            self.output_dtype = parent.compute_dtype
        else:
            self.output_dtype = policy.output_dtype
        # Below the root a "true"/island region must switch off an enclosing autocast.
        self.disable_autocast = not policy.is_mixed and parent is not None
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if self.original is None:
            # the class's function with the module as an argument, never a bound method:
            # torch.compile rebuilds bound methods as `module.forward`, which is this region
            args = (module, *args)
            forward = type(module).forward
        else:
            forward = self.original
        if self.autocast:
            with torch.autocast(_device_type(args, kwargs, module), dtype=self.compute_dtype):
                out = forward(*args, **kwargs)
        else:
            args = cast_floating(args, self.compute_dtype)
            kwargs = cast_floating(kwargs, self.compute_dtype)
            if self.disable_autocast:
                with torch.autocast(_device_type(args, kwargs, module), enabled=False):
                    out = forward(*args, **kwargs)
            else:
                out = forward(*args, **kwargs)
        return cast_floating(out, self.output_dtype)


@dataclass
class AppliedState:
    """What `apply` left on the root module: the map used and the dtypes it replaced."""

    policy: PolicyMap
    original_dtypes: dict[str, torch.dtype]


def _region_key(p: Policy) -> tuple[bool, torch.dtype, torch.dtype]:
    return (p.is_mixed, p.compute_dtype, p.output_dtype)


def _strip_regions(model: nn.Module) -> None:
    for module in model.modules():
        region = module.__dict__.get("forward")
        if isinstance(region, _Region):
            if region.original is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = region.original


def _set_dtype(
    module: nn.Module, dtype: torch.dtype, owners: dict[int, tuple[str, Any]], name: str
) -> None:
    for kind, store in (("parameter", module._parameters), ("buffer", module._buffers)):
        for key, t in store.items():
            if t is None or not t.is_floating_point():
                continue
            seen = owners.get(id(t))
            if seen is not None and seen[1] != dtype:
                raise PolicySpecError(
                    f"{kind} {name + '.' if name else ''}{key} is shared with {seen[0]!r}, but "
                    f"the policy stores it as {dtype} here and {seen[1]} there; give both "
                    "modules the same param dtype"
                )
            owners[id(t)] = (f"{name}.{key}" if name else key, dtype)
            if t.dtype == dtype:
                continue
            if kind == "parameter":
                t.data = t.data.to(dtype)
                if t.grad is not None:
                    t.grad = t.grad.to(dtype)
            else:
                store[key] = t.to(dtype)


def apply(model: nn.Module, policy: Any = None, *, warn: bool = True) -> nn.Module:
    """Convert `model` in place to `policy` (a spec, Policy or PolicyMap; None: the global
    policy) and return it. Re-applying replaces the previous policy cleanly.

    Warns when the policy is slow or refused on the model's device (`warn=False` for
    callers that already checked it, such as `Precision.setup`)."""
    pmap = as_map(policy)
    if warn:
        warn_if_unsupported(pmap, device_of(model))
    state: AppliedState | None = model.__dict__.get(_STATE)
    if state is None:
        original = {
            n: t.dtype
            for n, t in model.state_dict(keep_vars=True).items()
            if isinstance(t, Tensor) and t.is_floating_point()
        }
    else:
        original = state.original_dtypes
        _strip_regions(model)
    resolved = pmap.resolve(model)
    owners: dict[int, tuple[str, Any]] = {}
    for name, module in model.named_modules():
        _set_dtype(module, resolved[name].policy.param_dtype, owners, name)
    for name, module in model.named_modules():
        policy_here = resolved[name].policy
        parent = resolved[name.rpartition(".")[0]].policy if name else None
        if parent is not None and _region_key(parent) == _region_key(policy_here):
            continue
        module.__dict__["forward"] = _Region(
            module, policy_here, parent=parent, original=module.__dict__.get("forward")
        )
    model.__dict__[_STATE] = AppliedState(pmap, original)
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo `apply`: plain forwards again and the dtypes the model had before."""
    state: AppliedState | None = model.__dict__.pop(_STATE, None)
    if state is None:
        return model
    _strip_regions(model)
    tensors = model.state_dict(keep_vars=True)
    for name, dtype in state.original_dtypes.items():
        t = tensors.get(name)
        if t is None or t.dtype == dtype:
            continue
        owner_name, _, key = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if key in owner._parameters:
            t.data = t.data.to(dtype)
            if t.grad is not None:
                t.grad = t.grad.to(dtype)
        else:
            owner._buffers[key] = t.to(dtype)
    return model


def applied_policy(model: nn.Module) -> PolicyMap | None:
    """The policy map `apply` used on `model`, or None if it is a plain module."""
    state: AppliedState | None = model.__dict__.get(_STATE)
    return state.policy if state is not None else None
