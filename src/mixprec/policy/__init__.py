"""Precision policies: which dtype a layer stores its parameters in, computes in, and outputs.

A `Policy` is an immutable, hashable value and compares equal whatever spelling made it:
"bf16-mixed", "mixed_bfloat16" and "params=float32,compute=bfloat16,output=float32" are one
policy. A `QuantizedPolicy` is a plain value too: a registered format (`mixprec.formats`),
its config and the float policy the rest follows; which layers it quantizes is
`mixprec.quantize`'s business. The spellings are parsed and named in `mixprec.policy.names`,
once per spec, into a frozen `FloatSpec` or `QuantizedSpec` that the policy holds.
`as_policy` is the one factory that turns a spec, config or policy into either kind, and
calling `Policy(spec)` is that factory too (see `Policy`). The global policy is
process-wide; `policy_scope` overrides it for the current thread only.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from mixprec.dtypes import dtype_name, to_dtype
from mixprec.errors import PolicySpecError
from mixprec.formats.float8 import Float8Config
from mixprec.formats.microscaling import MicroscalingConfig
from mixprec.formats.registry import Format, format_named, formats
from mixprec.policy.names import (
    FloatSpec,
    QuantizedSpec,
    accepted,
    accepted_quantized,
    is_auto,
    names_quantized,
    parse_float,
    parse_quantized,
    unregistered,
)

# is_auto is the grammar's (policy.names); it is listed here too for the code that takes specs
# and policies from this module (hardware, precision)
__all__ = [
    "APPLIED_STATE",
    "REGION_MARK",
    "Policy",
    "QuantizedPolicy",
    "as_policy",
    "global_policy",
    "is_auto",
    "is_quantized",
    "policy_scope",
    "set_global_policy",
]

f32 = torch.float32


class _PolicyFactory(type):
    """The metaclass of policies: calling a policy class is its factory. The arguments are
    parsed once, by the class called (`Policy._parse`, `QuantizedPolicy._parse`), into a
    frozen spec, and the policy that spec names is built from it: `Policy(spec)` gives a
    `QuantizedPolicy` for a quantized spec, as `as_policy(spec)` does."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        spec = cls._parse(*args, **kwargs)
        return _built(cls, spec)

    @property
    def __signature__(cls) -> inspect.Signature:
        """What `inspect.signature` and help() show for a policy class: its `_parse`'s
        arguments, not this method's."""
        return inspect.signature(cls._parse).replace(return_annotation=cls.__name__)


def _built(cls: type, spec: FloatSpec | QuantizedSpec) -> Policy:
    """The policy `spec` names: of class `cls` where it is of the spec's kind (a subclass
    called by its own name), else `QuantizedPolicy` or `Policy`."""
    kind = QuantizedPolicy if isinstance(spec, QuantizedSpec) else Policy
    policy = object.__new__(cls if issubclass(cls, kind) else kind)
    policy._set(spec)
    return policy


class Policy(metaclass=_PolicyFactory):
    """An immutable precision policy: param (variable) dtype, compute dtype, output dtype.

    `Policy(spec)` is a factory: it parses the spec once and builds what it names, as
    `as_policy(spec)` does. A quantized spec ("int8_from_mixed_bfloat16",
    "transformer-engine") or policy gives a `QuantizedPolicy`, which is a Policy; every
    other spec a float Policy. `Policy(param_dtype=..., compute_dtype=...)` builds one from
    dtypes (compute and output follow params where not given).

    Args:
        spec: a name ("bf16-mixed", "mixed_bfloat16", "int8_from_bf16-mixed"), an int (16,
            32, 64), a torch.dtype, a jmp spec ("p=f32,c=bf16,o=f32") or a Policy.
        param_dtype: the dtype parameters are stored in, in place of the spec's
            (`variable_dtype` is Keras's name for it).
        compute_dtype: the dtype matmuls and convolutions run in.
        output_dtype: the dtype floating outputs are cast to.

    >>> Policy("bf16-mixed") == Policy("mixed_bfloat16") == Policy("p=f32,c=bf16,o=f32")
    True
    >>> type(Policy("int8_from_mixed_bfloat16")).__name__
    'QuantizedPolicy'
    """

    __slots__ = ("_param", "_compute", "_output", "_spec")

    @classmethod
    def _parse(
        cls,
        spec: str | int | torch.dtype | Policy | None = None,
        *,
        param_dtype: str | torch.dtype | None = None,
        compute_dtype: str | torch.dtype | None = None,
        output_dtype: str | torch.dtype | None = None,
        variable_dtype: str | torch.dtype | None = None,
    ) -> FloatSpec | QuantizedSpec:
        """The spec `Policy(...)` builds from: a quantized spec as it names one, else the
        float dtypes of `spec` with those given as keywords in their place."""
        if variable_dtype is not None:
            if param_dtype is not None:
                raise PolicySpecError("give param_dtype or its alias variable_dtype, not both")
            param_dtype = variable_dtype
        dtypes = {"param_dtype": param_dtype, "compute_dtype": compute_dtype}
        dtypes["output_dtype"] = output_dtype
        if isinstance(spec, QuantizedPolicy) and all(v is None for v in dtypes.values()):
            return spec._spec
        if isinstance(spec, QuantizedPolicy) or names_quantized(spec):
            name = spec.name if isinstance(spec, QuantizedPolicy) else spec
            return parse_quantized(name, options=dtypes)  # type: ignore[arg-type]
        if spec is not None:
            if isinstance(spec, Policy):
                param, compute, output = spec.param_dtype, spec.compute_dtype, spec.output_dtype
            else:
                param, compute, output = parse_float(spec)
        elif param_dtype is None and compute_dtype is None and output_dtype is None:
            raise PolicySpecError("Policy needs a spec or dtypes; " + accepted())
        else:
            param = f32
            compute = output = None
        if param_dtype is not None:
            param = to_dtype(param_dtype)
        compute = to_dtype(compute_dtype) if compute_dtype is not None else compute or param
        output = to_dtype(output_dtype) if output_dtype is not None else output or param
        return FloatSpec(param, compute, output)

    def _set(self, spec: FloatSpec | QuantizedSpec) -> None:
        float_spec = spec.source if isinstance(spec, QuantizedSpec) else spec
        object.__setattr__(self, "_param", float_spec.param)
        object.__setattr__(self, "_compute", float_spec.compute)
        object.__setattr__(self, "_output", float_spec.output)
        object.__setattr__(self, "_spec", spec)

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
        """True for float32 params computing in float16 or bfloat16 (Lightning's "*-mixed",
        Keras's "mixed_*"): the layer runs under torch.autocast, whose op lists keep some ops
        (losses, reductions) in float32."""
        return self._param == f32 and self._compute in (torch.float16, torch.bfloat16)

    @property
    def casts_params(self) -> bool:
        """True for params stored in one dtype and computed in another that autocast cannot
        give (float16 params computing in bfloat16, bfloat16 in float32, float32 in
        float64...): each forward computes on copies of the params cast to the compute dtype,
        as jmp's `cast_to_compute` does, and gradients come back in the param dtype."""
        return self._param != self._compute and not self.is_mixed

    @property
    def buffer_dtype(self) -> torch.dtype:
        """Dtype floating buffers (running statistics) are stored in: the param dtype, but
        the compute dtype for a policy that `casts_params`, whose forward reads and updates
        them in place in the dtype it computes in."""
        return self._compute if self.casts_params else self._param

    @property
    def quantization_mode(self) -> str | None:
        """None: a float policy quantizes nothing (`QuantizedPolicy` names its mode), as
        Keras's `DTypePolicy.quantization_mode` is None."""
        return None

    @property
    def needs_loss_scaling(self) -> bool:
        """Float16 gradients underflow without a loss scale; bfloat16 and wider do not. A
        float16 output takes its gradient in float16 too (the backward of its cast), where
        one under 6e-8 is 0, whatever the dtypes inside the layer."""
        return torch.float16 in (self._compute, self._param, self._output)

    @property
    def name(self) -> str:
        """Canonical name: Lightning's spelling where one exists, else a jmp-style spec."""
        return self._spec.name

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
        if "quantization_mode" in config:
            return QuantizedPolicy.from_config(config)
        unknown = set(config) - {"param_dtype", "compute_dtype", "output_dtype"}
        if unknown:  # (types too: a dict of rules given where a policy goes)
            keys = sorted(getattr(k, "__qualname__", None) or repr(k) for k in unknown)
            raise PolicySpecError(
                f"unknown policy config keys {', '.join(keys)}; expected param_dtype, "
                "compute_dtype, output_dtype (what to_config() returns). Rules by layer path "
                "or type go in a PolicyMap: PolicyMap('bf16-mixed', {'head': 'float32'})"
            )
        if not config:
            raise PolicySpecError("an empty policy config; expected what to_config() returns")
        dtypes = {}
        for key, value in config.items():
            if not isinstance(value, (str, torch.dtype)):
                shown = "null" if value is None else f"{type(value).__name__} {value!r}"
                raise PolicySpecError(
                    f"policy config key {key!r} is {shown}; it takes a dtype name "
                    "(float32, bfloat16, float16, float64, ...), or leave the key out"
                )
            try:
                dtypes[key] = to_dtype(value)
            except PolicySpecError as err:
                raise PolicySpecError(f"policy config key {key!r}: {err}") from None
        return cls(**dtypes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        return type(self) is type(other) and self._spec == other._spec

    def __hash__(self) -> int:
        return hash(self._spec)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Policy({self.name!r})"


def is_quantized(spec: Any) -> bool:
    """True for a quantized policy, a spec spelled '<mode>_from_<float policy>', or one of
    Lightning's Transformer Engine flags ("transformer-engine", "transformer-engine-float16")."""
    return isinstance(spec, QuantizedPolicy) or names_quantized(spec)


class QuantizedPolicy(Policy):
    """A float policy whose Linear (and, for int8/int4, Embedding) layers hold quantized
    weights: Keras's `QuantizedDTypePolicy` / `QuantizedFloat8DTypePolicy`. A plain value:
    a registered format (`mixprec.formats`: int8, int4, float8, mxfp8, ...), its config
    (int4 group size, float8 recipe, block format) and the source float policy;
    `mixprec.quantize.rules` says which layers it quantizes and why it skips the others.

    Args:
        mode: a registered format's name with its options after a '/' ("int4/64",
            "float8/delayed:16", "mxfp8/floor"), a whole quantized name
            ("int8_from_bf16-mixed"), or a QuantizedPolicy to copy.
        source: the float policy everything else follows (unless `mode` names it).
        options: the format's keyword options: int4's ``group_size``, float8's ``recipe``
            and ``amax_history_length``.

    The param, compute and output dtypes are those of the source float policy: layers the
    mode cannot quantize (norms, small layers) run in it, and quantized layers compute
    around their integer/float8 matmul in it.

    >>> QuantizedPolicy("int4/64_from_bf16-mixed").name
    'int4/64_from_mixed_bfloat16'
    >>> QuantizedPolicy("int8", "mixed_bfloat16") == Policy("int8_from_mixed_bfloat16")
    True
    """

    __slots__ = ("_source",)

    @classmethod
    def _parse(  # type: ignore[override]
        cls,
        mode: str | QuantizedPolicy,
        source: str | int | torch.dtype | Policy | None = None,
        **options: Any,
    ) -> QuantizedSpec:
        """The spec `QuantizedPolicy(...)` builds from."""
        if isinstance(mode, QuantizedPolicy):
            if source is not None or any(v is not None for v in options.values()):
                raise PolicySpecError("QuantizedPolicy(policy) copies it; give nothing else")
            return mode._spec
        if not isinstance(mode, str):
            raise PolicySpecError(
                f"quantization mode must be a string, not {type(mode).__name__}. "
                + accepted_quantized()
            )
        if isinstance(source, QuantizedPolicy):
            raise PolicySpecError(
                f"the source of a quantized policy is a float policy, not the quantized "
                f"{source.name!r}"
            )
        if isinstance(source, Policy):
            source = source._spec
        return parse_quantized(mode, source, options)

    def _set(self, spec: FloatSpec | QuantizedSpec) -> None:
        super()._set(spec)
        object.__setattr__(self, "_source", _built(Policy, spec.source))  # type: ignore[union-attr]

    @property
    def mode(self) -> str:
        """The name of its format: "int8", "int4", "float8", "mxfp8", ..."""
        return self._spec.format.name

    quantization_mode = mode

    @property
    def format(self) -> Format:
        """The registered format (`mixprec.formats`) its layers are quantized in."""
        return self._spec.format

    @property
    def config(self) -> Any:
        """The format's options: `Int4Config`, `Float8Config`, `MicroscalingConfig`, ..."""
        return self._spec.config

    @property
    def source(self) -> Policy:
        """The float policy everything but the quantized weights follows."""
        return self._source

    @property
    def group_size(self) -> int | None:
        """int4: input features per scale/zero point (-1: one group per output channel)."""
        return getattr(self._spec.config, "group_size", None)

    @property
    def recipe(self) -> str | None:
        """float8: how scales are chosen (tensorwise, rowwise, rowwise_with_gw_hp, delayed)."""
        float8 = self.float8_config
        return None if float8 is None else float8.recipe

    @property
    def amax_history_length(self) -> int | None:
        """float8 `delayed` recipe: how many steps of abs-max the scale looks back over."""
        float8 = self.float8_config
        return float8.amax_history_length if float8 is not None and float8.delayed else None

    @property
    def float8_config(self) -> Float8Config | None:
        """float8: the recipe and amax history length as the float8 layers take them."""
        config = self._spec.config
        return config if isinstance(config, Float8Config) else None

    @property
    def microscaling_config(self) -> MicroscalingConfig | None:
        """mxfp8/mxfp6/mxfp4/nvfp4: the block format and its recipe options."""
        config = self._spec.config
        return config if isinstance(config, MicroscalingConfig) else None

    @property
    def name(self) -> str:
        """Keras's spelling; options only where they differ from the defaults."""
        return self._spec.name

    def to_config(self) -> dict[str, Any]:  # type: ignore[override]
        """A JSON-friendly dict that `from_config` (of this class or `Policy`) turns back."""
        spec = self._spec
        return {
            "quantization_mode": spec.format.name,
            "source": self._source.to_config(),
            **spec.format.to_dict(spec.config),
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> QuantizedPolicy:  # type: ignore[override]
        """Inverse of `to_config`."""
        if not isinstance(config, Mapping) or not {"quantization_mode", "source"} <= set(config):
            raise PolicySpecError(
                "QuantizedPolicy.from_config takes the dict to_config() returns (keys "
                f"quantization_mode, source, and the mode's options), got {config!r}"
            )
        holds: dict[str, str] = {}
        for f in formats():
            for key, what in f.config_keys.items():
                holds.setdefault(key, what)
        keys = {"quantization_mode", "source", *holds}
        unknown = set(config) - keys
        mode = config["quantization_mode"]
        if unknown and isinstance(mode, str) and format_named(mode) is None:
            raise PolicySpecError(unregistered(mode, f" (config keys {sorted(unknown)})"))
        if unknown:
            raise PolicySpecError(
                f"unknown quantized policy config keys {sorted(unknown)}; expected "
                f"{', '.join(sorted(keys))}"
            )
        for key, value in config.items():
            if value is None:
                takes = {
                    "quantization_mode": f"a mode ({', '.join(f.name for f in formats())})",
                    "source": "a float policy: a name such as 'bf16-mixed' or a to_config() dict",
                }.get(key, "a value, or leave the option out for its default")
                raise PolicySpecError(
                    f"quantized policy config key {key!r} is null; it takes {takes}"
                )
        fmt = format_named(mode) if isinstance(mode, str) else None
        stored = {k: v for k, v in config.items() if k in holds}
        for key, value in stored.items():
            if fmt is not None and key not in fmt.config_keys:
                owners = ", ".join(f.name for f in formats() if key in f.config_keys)
                raise PolicySpecError(
                    f"quantized policy config key {key!r} is {value!r}: it holds "
                    f"{holds[key]} ({owners}), as to_config() writes them"
                )
        try:
            source = as_policy(config["source"])
        except PolicySpecError as err:
            raise PolicySpecError(f"quantized policy config key 'source': {err}") from None
        if not isinstance(mode, str) or isinstance(source, QuantizedPolicy):
            return cls(mode, source)  # refused, saying why
        return _built(cls, parse_quantized(mode, source._spec, stored=stored))  # type: ignore[return-value]

    def __reduce__(self) -> tuple[Any, ...]:
        return (QuantizedPolicy.from_config, (self.to_config(),))

    def __repr__(self) -> str:
        return f"QuantizedPolicy({self.name!r})"


def as_policy(spec: Any = None) -> Policy:
    """The one factory of policies: a spec (name, int, dtype, jmp spec, quantized name), a
    Policy (as it is) or a `to_config()` dict (as Keras's `dtype_policies.get` takes them) as
    a `QuantizedPolicy` where it names one, else a `Policy`; None means the current global
    policy."""
    if spec is None:
        return global_policy()
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, Mapping):
        return Policy.from_config(spec)
    return Policy(spec)


def _given(spec: Any, where: str) -> Policy:
    """`as_policy` for a policy that must be given: None is refused, not the global one."""
    if spec is None:
        raise PolicySpecError(f"{where} needs a policy, not None; " + accepted())
    return as_policy(spec)


# where `mixprec.apply` keeps what it did on the root module (its `AppliedState`)
APPLIED_STATE = "_mixprec_state"
# the attribute a module's region (the forward `apply` stores on the instance) carries, so
# that tools swapping layers (quantize, dequantize) can tell it from other patched forwards
REGION_MARK = "_mixprec_region"

_lock = threading.Lock()
_global = Policy("32-true")
_scoped = threading.local()


def global_policy() -> Policy:
    """The policy in force: this thread's innermost `policy_scope`, else the global one."""
    stack = getattr(_scoped, "stack", None)
    return stack[-1] if stack else _global


def set_global_policy(policy: str | int | torch.dtype | Policy) -> None:
    """Set the process-wide default policy (float32 until set); quantized policies too."""
    global _global
    new = _given(policy, "set_global_policy")
    with _lock:
        _global = new


@contextmanager
def policy_scope(policy: str | int | torch.dtype | Policy) -> Iterator[Policy]:
    """Use `policy` as the global policy inside the block, in this thread only."""
    new = _given(policy, "policy_scope")
    stack = getattr(_scoped, "stack", None)
    if stack is None:
        stack = _scoped.stack = []
    stack.append(new)
    try:
        yield new
    finally:
        stack.pop()
