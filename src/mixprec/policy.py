"""Precision policies: which dtype a layer stores its parameters in, computes in, and outputs.

A `Policy` is immutable and compares equal whatever spelling made it: "bf16-mixed",
"mixed_bfloat16" and "params=float32,compute=bfloat16,output=float32" are one policy.
The global policy is process-wide; `policy_scope` overrides it for the current thread only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from mixprec.dtypes import DTYPE_NAMES, dtype_name, is_float8, to_dtype
from mixprec.errors import PolicySpecError

f64, f32, f16, bf16 = torch.float64, torch.float32, torch.float16, torch.bfloat16

# Canonical names (Lightning's spelling) of the common policies: (param, compute, output).
_NAMED: dict[str, tuple[torch.dtype, torch.dtype, torch.dtype]] = {
    "32-true": (f32, f32, f32),
    "64-true": (f64, f64, f64),
    "16-mixed": (f32, f16, f32),
    "bf16-mixed": (f32, bf16, f32),
    "16-true": (f16, f16, f16),
    "bf16-true": (bf16, bf16, bf16),
}
_BY_DTYPES = {v: k for k, v in _NAMED.items()}

# Every other accepted whole-policy name, mapped to a canonical one.
_ALIASES: dict[str, str] = {
    # Lightning aliases
    "16": "16-mixed",
    "bf16": "bf16-mixed",
    "32": "32-true",
    "64": "64-true",
    # Keras names
    "mixed_float16": "16-mixed",
    "mixed_bfloat16": "bf16-mixed",
    "float32": "32-true",
    "float64": "64-true",
    "float16": "16-true",
    "bfloat16": "bf16-true",
}
POLICY_NAMES: tuple[str, ...] = (*_NAMED, *_ALIASES)

# A spec value, not a policy: which policy it means depends on the device, so only code that
# knows the device resolves it (`mixprec.hardware.resolve_policy`).
AUTO = "auto"

# Spellings people reach for that we refuse on purpose, with what they probably meant.
# jmp reads a bare dtype as every role in it ("f16" = 16-true) while Lightning reads "16" as
# 16-mixed: the short names are ambiguous as whole policies, so they must be spelled out.
_HINTS: dict[str, str] = {
    "fp16": "'16-mixed' (float16 autocast, float32 weights) or '16-true'",
    "half": "'16-true' (everything in float16, as jmp reads it) or '16-mixed'",
    "f16": "'16-true' (everything in float16, as jmp reads it) or '16-mixed'",
    "fp32": "'32-true'",
    "f32": "'32-true'",
    "full": "'32-true'",
    "float": "'32-true'",
    "fp64": "'64-true'",
    "f64": "'64-true'",
    "double": "'64-true'",
    "bfloat16-mixed": "'bf16-mixed'",
    "mixed_bf16": "'bf16-mixed'",
    "mixed_fp16": "'16-mixed'",
    "fp8": "a float8 recipe; float8 is not a plain cast policy",
    "transformer-engine": "a float8 recipe; float8 is not a plain cast policy",
}

_JMP_KEYS: dict[str, str] = {
    "params": "param",
    "param": "param",
    "p": "param",
    "compute": "compute",
    "c": "compute",
    "output": "output",
    "o": "output",
}


def _accepted() -> str:
    return (
        f"accepted: one of {', '.join(repr(n) for n in POLICY_NAMES)}; the ints 16, 32, 64; "
        "a torch.dtype; or a jmp spec like 'params=float32,compute=bfloat16,output=float32' "
        f"(keys p/c/o, dtypes {', '.join(DTYPE_NAMES)}); 'auto' where a device is known"
    )


def is_auto(spec: Any) -> bool:
    """True for the spec "auto" (any case or surrounding blanks)."""
    return isinstance(spec, str) and spec.strip().lower() == AUTO


def _parse_jmp(spec: str) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """jmp's grammar: params default to float32, compute follows params, output follows
    compute ("c=bf16" is params float32, compute and output bfloat16)."""
    found: dict[str, torch.dtype] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or not value.strip():
            raise PolicySpecError(
                f"malformed part {part.strip()!r} in policy spec {spec!r}: expected key=dtype; "
                + _accepted()
            )
        if key not in _JMP_KEYS:
            raise PolicySpecError(
                f"unknown key {key!r} in policy spec {spec!r}; keys are "
                "params/p, compute/c, output/o"
            )
        slot = _JMP_KEYS[key]
        if slot in found:
            raise PolicySpecError(f"key {key!r} given twice in policy spec {spec!r}")
        try:
            found[slot] = to_dtype(value)
        except PolicySpecError as err:
            raise PolicySpecError(f"in policy spec {spec!r}: {err}") from None
    param = found.get("param", f32)
    compute = found.get("compute", param)
    return param, compute, found.get("output", compute)


def _parse(spec: Any) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    if isinstance(spec, Policy):
        return spec.param_dtype, spec.compute_dtype, spec.output_dtype
    if isinstance(spec, torch.dtype):
        return spec, spec, spec
    if isinstance(spec, int) and not isinstance(spec, bool):
        if str(spec) in _ALIASES:
            return _NAMED[_ALIASES[str(spec)]]
        raise PolicySpecError(f"unknown precision {spec!r}; " + _accepted())
    if not isinstance(spec, str):
        where = (
            "; a PolicyMap holds several policies: pass it where maps are accepted "
            "(apply, explain, Precision, Trainer)"
            if type(spec).__name__ == "PolicyMap"
            else ""
        )
        raise PolicySpecError(
            f"a policy spec must be a string, int, torch.dtype or Policy, not "
            f"{type(spec).__name__}{where}; " + _accepted()
        )
    key = spec.strip().lower()
    if key == AUTO:
        raise PolicySpecError(
            "'auto' names no policy by itself: it means the fastest stable precision of a "
            "device. Resolve it against the device with "
            "mixprec.hardware.resolve_policy('auto', device) (Precision, the Trainer, "
            "mixprec bench and mixprec doctor do this for you), or name a precision"
        )
    if "=" in key:
        return _parse_jmp(key)
    name = _ALIASES.get(key, key)
    if name in _NAMED:
        return _NAMED[name]
    bare = key.removeprefix("torch.")
    if bare in _HINTS:
        raise PolicySpecError(
            f"unknown precision {spec!r} (did you mean {_HINTS[bare]}?); " + _accepted()
        )
    if bare in DTYPE_NAMES and bare == dtype_name(to_dtype(bare)):
        # a full dtype name ("float16", "torch.bfloat16", float8 names): every role in it
        dtype = to_dtype(bare)
        return dtype, dtype, dtype
    dtype = getattr(torch, bare, None)
    if isinstance(dtype, torch.dtype):  # an integer or complex dtype: refused with the reason
        raise PolicySpecError(
            f"precision {spec!r} refused: {dtype_name(dtype)} is not a floating dtype; "
            + _accepted()
        )
    raise PolicySpecError(f"unknown precision {spec!r}; " + _accepted())


def _validate(param: torch.dtype, compute: torch.dtype, output: torch.dtype) -> None:
    for role, dtype in (("param", param), ("compute", compute), ("output", output)):
        if not dtype.is_floating_point:
            raise PolicySpecError(
                f"{role} dtype {dtype_name(dtype)} is not a floating dtype; a policy's dtypes are "
                "float64, float32, float16 or bfloat16"
            )
        if is_float8(dtype):
            raise PolicySpecError(
                f"{role} dtype {dtype_name(dtype)} refused: float8 tensors need per-tensor "
                "scales (a float8 recipe with scaled matmuls), which a plain cast policy "
                "cannot give; use float16/bfloat16 here"
            )


class Policy:
    """An immutable precision policy: param (variable) dtype, compute dtype, output dtype.

    >>> Policy("bf16-mixed") == Policy("mixed_bfloat16") == Policy("p=f32,c=bf16,o=f32")
    True
    """

    __slots__ = ("_param", "_compute", "_output")

    def __init__(
        self,
        spec: str | int | torch.dtype | Policy | None = None,
        *,
        param_dtype: str | torch.dtype | None = None,
        compute_dtype: str | torch.dtype | None = None,
        output_dtype: str | torch.dtype | None = None,
        variable_dtype: str | torch.dtype | None = None,
    ) -> None:
        if variable_dtype is not None:
            if param_dtype is not None:
                raise PolicySpecError("give param_dtype or its alias variable_dtype, not both")
            param_dtype = variable_dtype
        if spec is not None:
            param, compute, output = _parse(spec)
        elif param_dtype is None and compute_dtype is None and output_dtype is None:
            raise PolicySpecError("Policy needs a spec or dtypes; " + _accepted())
        else:
            param = f32
            compute = output = None
        if param_dtype is not None:
            param = to_dtype(param_dtype)
        compute = to_dtype(compute_dtype) if compute_dtype is not None else compute or param
        output = to_dtype(output_dtype) if output_dtype is not None else output or param
        _validate(param, compute, output)
        object.__setattr__(self, "_param", param)
        object.__setattr__(self, "_compute", compute)
        object.__setattr__(self, "_output", output)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Policy is immutable; build a new one")

    def __reduce__(self) -> tuple[Any, ...]:
        return (Policy.from_config, (self.to_config(),))

    @property
    def param_dtype(self) -> torch.dtype:
        """Dtype parameters and floating buffers are stored in."""
        return self._param

    variable_dtype = param_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype the layer's matmuls and convolutions run in."""
        return self._compute

    @property
    def output_dtype(self) -> torch.dtype:
        """Dtype floating outputs are cast to when they leave the layer."""
        return self._output

    @property
    def is_mixed(self) -> bool:
        """True when compute differs from storage: the layer runs under autocast."""
        return self._param != self._compute

    @property
    def needs_loss_scaling(self) -> bool:
        """Float16 gradients underflow without a loss scale; bfloat16 and wider do not."""
        return torch.float16 in (self._compute, self._param)

    @property
    def name(self) -> str:
        """Canonical name: Lightning's spelling where one exists, else a jmp-style spec."""
        dtypes = (self._param, self._compute, self._output)
        if dtypes in _BY_DTYPES:
            return _BY_DTYPES[dtypes]
        return (
            f"params={dtype_name(self._param)},compute={dtype_name(self._compute)},"
            f"output={dtype_name(self._output)}"
        )

    def to_config(self) -> dict[str, str]:
        """A JSON-friendly dict that `from_config` turns back into an equal policy."""
        return {
            "param_dtype": dtype_name(self._param),
            "compute_dtype": dtype_name(self._compute),
            "output_dtype": dtype_name(self._output),
        }

    @classmethod
    def from_config(cls, config: Mapping[str, str]) -> Policy:
        """Inverse of `to_config`."""
        if not isinstance(config, Mapping):
            raise PolicySpecError(
                f"from_config takes the dict to_config() returns (keys param_dtype, "
                f"compute_dtype, output_dtype), not {type(config).__name__} {config!r}; "
                f"for a name or dtype use Policy({config!r})"
            )
        if "default" in config:
            raise PolicySpecError(
                "this is a PolicyMap config (it has a 'default'): use PolicyMap.from_config"
            )
        unknown = set(config) - {"param_dtype", "compute_dtype", "output_dtype"}
        if unknown:
            raise PolicySpecError(
                f"unknown policy config keys {sorted(unknown)}; expected param_dtype, "
                "compute_dtype, output_dtype (what to_config() returns)"
            )
        if not config:
            raise PolicySpecError("an empty policy config; expected what to_config() returns")
        return cls(**config)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        return (self._param, self._compute, self._output) == (
            other._param,
            other._compute,
            other._output,
        )

    def __hash__(self) -> int:
        return hash((self._param, self._compute, self._output))

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Policy({self.name!r})"


def as_policy(spec: Any = None) -> Policy:
    """Coerce a spec, dtype, Policy or a `to_config()` dict (as Keras's
    `dtype_policies.get` does); None means the current global policy."""
    if spec is None:
        return global_policy()
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, Mapping):
        return Policy.from_config(spec)
    return Policy(spec)


_lock = threading.Lock()
_global = Policy("32-true")
_scoped = threading.local()


def global_policy() -> Policy:
    """The policy in force: this thread's innermost `policy_scope`, else the global one."""
    stack = getattr(_scoped, "stack", None)
    return stack[-1] if stack else _global


def set_global_policy(policy: str | int | torch.dtype | Policy) -> None:
    """Set the process-wide default policy (float32 until set)."""
    global _global
    new = Policy(policy)
    with _lock:
        _global = new


@contextmanager
def policy_scope(policy: str | int | torch.dtype | Policy) -> Iterator[Policy]:
    """Use `policy` as the global policy inside the block, in this thread only."""
    new = Policy(policy)
    stack = getattr(_scoped, "stack", None)
    if stack is None:
        stack = _scoped.stack = []
    stack.append(new)
    try:
        yield new
    finally:
        stack.pop()
