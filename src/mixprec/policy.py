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
from torch import nn

from mixprec.dtypes import DTYPE_NAMES, FLOAT8_DTYPES, dtype_name, is_float8, to_dtype
from mixprec.errors import PolicySpecError

__all__ = [
    "AUTO",
    "DEFAULT_AMAX_HISTORY_LENGTH",
    "DEFAULT_GROUP_SIZE",
    "FLOAT8_RECIPES",
    "FLOAT8_SMALL_IN_FEATURES",
    "FLOAT8_SMALL_OUT_FEATURES",
    "LIGHTNING_FLOAT8",
    "MIN_QUANTIZED_FEATURES",
    "PER_CHANNEL",
    "POLICY_NAMES",
    "Policy",
    "QUANTIZATION_MODES",
    "QuantizedPolicy",
    "as_policy",
    "global_policy",
    "is_auto",
    "is_quantized",
    "policy_scope",
    "set_global_policy",
]

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
    "fp8": "a float8 recipe: a quantized policy like 'float8_from_mixed_bfloat16'",
    "mixed": "'bf16-mixed' or '16-mixed' (say which 16-bit dtype)",
    "amp": "'bf16-mixed' or '16-mixed' (say which 16-bit dtype)",
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
        f"(keys p/c/o, dtypes {', '.join(DTYPE_NAMES)}); 'auto' where a device is known; "
        "or a quantized policy '<mode>_from_<float policy>' (modes int8, int4, float8), "
        "Lightning's 'transformer-engine' and 'transformer-engine-float16' among them"
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
    if bare in _BARE_QUANTIZED:
        raise PolicySpecError(
            f"precision {spec!r} refused: {_BARE_QUANTIZED[bare]} names a quantization mode, "
            "not a policy; say which float policy the rest of the layer follows. "
            + _accepted_quantized()
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
            + ". "
            + _accepted_quantized()
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

    def __new__(cls, spec: Any = None, *args: Any, **kwargs: Any) -> Policy:
        # a quantized name ("int8_from_mixed_bfloat16") or policy makes a QuantizedPolicy,
        # so every place that builds a Policy from a spec accepts quantized policies too
        if cls is Policy and (
            isinstance(spec, QuantizedPolicy) or (isinstance(spec, str) and is_quantized(spec))
        ):
            cls = QuantizedPolicy
        return object.__new__(cls)

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
        """True for float32 params computing in float16 or bfloat16 (Lightning's "*-mixed",
        Keras's "mixed_*"): the layer runs under torch.autocast, whose op lists keep some ops
        (losses, reductions) in float32."""
        return self._param == f32 and self._compute in (f16, bf16)

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
        if "quantization_mode" in config:
            return QuantizedPolicy.from_config(config)
        unknown = set(config) - {"param_dtype", "compute_dtype", "output_dtype"}
        if unknown:
            raise PolicySpecError(
                f"unknown policy config keys {sorted(unknown)}; expected param_dtype, "
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

    def _key(self) -> tuple[Any, ...]:
        return (self._param, self._compute, self._output)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        return type(self) is type(other) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Policy({self.name!r})"


# ---- quantized policies: "<mode>_from_<float policy>", as Keras spells them ----

_QUANTIZED_SEP = "_from_"
QUANTIZATION_MODES: tuple[str, ...] = ("int8", "int4", "float8")
FLOAT8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed")
DEFAULT_GROUP_SIZE = 128
PER_CHANNEL = -1  # int4 group size: one group per output channel
DEFAULT_AMAX_HISTORY_LENGTH = 1024
# A Linear/Embedding with fewer input features than this stays float: its weight is too small
# for the bytes saved to matter, and per-token int8 activations of so few features lose most.
MIN_QUANTIZED_FEATURES = 16
# Keras's name of each canonical float policy: the source part of a canonical quantized name
_KERAS_NAMES: dict[str, str] = {
    "32-true": "float32",
    "64-true": "float64",
    "bf16-mixed": "mixed_bfloat16",
    "16-mixed": "mixed_float16",
    "bf16-true": "bfloat16",
    "16-true": "float16",
}
# Lightning's Transformer Engine flags, as Lightning runs them: weights and compute in
# bfloat16 (float16), float8 matmuls scaled from a 1024-step amax history (Transformer Engine's
# DelayedScaling defaults: e4m3 forward, e5m2 gradients), outputs back in float32
LIGHTNING_FLOAT8: dict[str, str] = {
    "transformer-engine": "float8/delayed_from_params=bfloat16,compute=bfloat16,output=float32",
    "transformer-engine-float16": (
        "float8/delayed_from_params=float16,compute=float16,output=float32"
    ),
}
# Bare mode or storage names people reach for, refused with the accepted quantized forms
_BARE_QUANTIZED: dict[str, str] = {
    "int8": "int8",
    "int4": "int4",
    "float8": "float8",
    **{dtype_name(d): dtype_name(d) for d in FLOAT8_DTYPES},
}


def _accepted_quantized() -> str:
    return (
        "Quantized policies are '<mode>_from_<float policy>' with mode one of 'int8', "
        f"'int4' (groups of {DEFAULT_GROUP_SIZE}), 'int4/<group size>' ('int4/-1', or "
        "Keras's older 'int4/None': per channel), 'float8' (tensorwise), 'float8/<recipe>' "
        f"(recipes {', '.join(FLOAT8_RECIPES)}; 'float8/delayed:<amax history length>'), and any "
        "float policy name after '_from_' (e.g. 'int8_from_float32', "
        "'int4/64_from_mixed_bfloat16', 'float8/rowwise_from_bf16-mixed')"
    )


def is_quantized(spec: Any) -> bool:
    """True for a quantized policy, a spec spelled '<mode>_from_<float policy>', or one of
    Lightning's Transformer Engine flags ("transformer-engine", "transformer-engine-float16")."""
    if isinstance(spec, QuantizedPolicy):
        return True
    if not isinstance(spec, str):
        return False
    name = spec.strip().lower()
    return _QUANTIZED_SEP in name or name in LIGHTNING_FLOAT8


def _parse_mode(text: str, name: str) -> tuple[str, int | None, str | None, int | None]:
    """'int4/64' -> ("int4", 64, None, None); 'float8/delayed:16' -> ("float8", None,
    "delayed", 16); options not spelled are None (defaults come later)."""
    mode, sep, option = text.partition("/")
    if mode not in QUANTIZATION_MODES:
        raise PolicySpecError(
            f"unknown quantization mode {mode!r} in {name!r}; modes are "
            f"{', '.join(QUANTIZATION_MODES)}. " + _accepted_quantized()
        )
    if sep and not option:
        raise PolicySpecError(f"nothing after '/' in {name!r}. " + _accepted_quantized())
    if mode == "int8":
        if sep:
            raise PolicySpecError(
                f"int8 takes no option ({name!r}): its scales are per output channel. "
                + _accepted_quantized()
            )
        return mode, None, None, None
    if mode == "int4":
        if not sep:
            return mode, None, None, None
        if option == "none":  # Keras's older spelling of per-channel int4 ("int4/None_from_...")
            return mode, PER_CHANNEL, None, None
        try:
            return mode, int(option), None, None
        except ValueError:
            raise PolicySpecError(
                f"int4 group size {option!r} in {name!r} is not an integer. "
                + _accepted_quantized()
            ) from None
    if not sep:
        return mode, None, None, None
    recipe, colon, history = option.partition(":")
    if not colon:
        return mode, None, recipe, None
    try:
        return mode, None, recipe, int(history)
    except ValueError:
        raise PolicySpecError(
            f"amax history length {history!r} in {name!r} is not an integer. "
            + _accepted_quantized()
        ) from None


class QuantizedPolicy(Policy):
    """A float policy whose Linear (and, for int8/int4, Embedding) layers hold quantized
    weights: Keras's `QuantizedDTypePolicy` / `QuantizedFloat8DTypePolicy`.

    The param, compute and output dtypes are those of the source float policy: layers the
    mode cannot quantize (norms, small layers) run in it, and quantized layers compute
    around their integer/float8 matmul in it.

    >>> QuantizedPolicy("int4/64_from_bf16-mixed").name
    'int4/64_from_mixed_bfloat16'
    >>> QuantizedPolicy("int8", "mixed_bfloat16") == Policy("int8_from_mixed_bfloat16")
    True
    """

    __slots__ = ("_mode", "_source", "_group_size", "_recipe", "_history")

    def __init__(
        self,
        mode: str | QuantizedPolicy,
        source: str | int | torch.dtype | Policy | None = None,
        *,
        group_size: int | None = None,
        recipe: str | None = None,
        amax_history_length: int | None = None,
        **float_dtypes: Any,
    ) -> None:
        if float_dtypes:
            raise PolicySpecError(
                f"a quantized policy takes its dtypes from its source float policy, not "
                f"{', '.join(sorted(float_dtypes))}; give the source instead, e.g. "
                "QuantizedPolicy('int8', 'p=f32,c=bf16,o=f32')"
            )
        if isinstance(mode, QuantizedPolicy):
            if source is not None or group_size or recipe or amax_history_length:
                raise PolicySpecError("QuantizedPolicy(policy) copies it; give nothing else")
            source, group_size, recipe = mode.source, mode.group_size, mode.recipe
            amax_history_length = mode.amax_history_length
            mode = mode.mode
        if not isinstance(mode, str):
            raise PolicySpecError(
                f"quantization mode must be a string, not {type(mode).__name__}. "
                + _accepted_quantized()
            )
        name = mode.strip().lower()
        name = LIGHTNING_FLOAT8.get(name, name)
        mode_text, sep, source_text = name.partition(_QUANTIZED_SEP)
        if sep:
            if source is not None:
                raise PolicySpecError(
                    f"{mode!r} names its source already; do not also pass source={source!r}"
                )
            if not source_text:
                raise PolicySpecError(
                    f"no float policy after '_from_' in {mode!r}. " + _accepted_quantized()
                )
            source = source_text
        parsed_mode, parsed_group, parsed_recipe, parsed_history = _parse_mode(mode_text, mode)
        if source is None:
            raise PolicySpecError(
                f"QuantizedPolicy({mode!r}) needs its source float policy, e.g. "
                f"QuantizedPolicy({mode_text!r}, 'mixed_bfloat16') or "
                f"'{mode_text}_from_mixed_bfloat16'"
            )
        if is_quantized(source):
            raise PolicySpecError(
                f"the source of a quantized policy is a float policy, not the quantized "
                f"{source if isinstance(source, str) else source.name!r}"
            )
        try:
            float_policy = source if type(source) is Policy else Policy(source)
        except PolicySpecError as err:
            raise PolicySpecError(f"in quantized policy {mode!r}: {err}") from None
        group_size = _merge("group size", parsed_group, group_size, mode)
        recipe = _merge("recipe", parsed_recipe, recipe, mode)
        amax_history_length = _merge(
            "amax_history_length", parsed_history, amax_history_length, mode
        )
        group_size, recipe, amax_history_length = _check_options(
            parsed_mode, float_policy, group_size, recipe, amax_history_length, mode
        )
        Policy.__init__(
            self,
            param_dtype=float_policy.param_dtype,
            compute_dtype=float_policy.compute_dtype,
            output_dtype=float_policy.output_dtype,
        )
        object.__setattr__(self, "_mode", parsed_mode)
        object.__setattr__(self, "_source", float_policy)
        object.__setattr__(self, "_group_size", group_size)
        object.__setattr__(self, "_recipe", recipe)
        object.__setattr__(self, "_history", amax_history_length)

    @property
    def mode(self) -> str:
        """ "int8", "int4" or "float8"."""
        return self._mode

    quantization_mode = mode

    @property
    def source(self) -> Policy:
        """The float policy everything but the quantized weights follows."""
        return self._source

    @property
    def group_size(self) -> int | None:
        """int4: input features per scale/zero point (-1: one group per output channel)."""
        return self._group_size

    @property
    def recipe(self) -> str | None:
        """float8: how scales are chosen (tensorwise, rowwise, rowwise_with_gw_hp, delayed)."""
        return self._recipe

    @property
    def amax_history_length(self) -> int | None:
        """float8 `delayed` recipe: how many steps of abs-max the scale looks back over."""
        return self._history

    @property
    def name(self) -> str:
        """Keras's spelling; options only where they differ from the defaults."""
        mode = self._mode
        if mode == "int4" and self._group_size != DEFAULT_GROUP_SIZE:
            mode = f"int4/{self._group_size}"
        if mode == "float8" and self._recipe != "tensorwise":
            mode = f"float8/{self._recipe}"
            if self._history not in (None, DEFAULT_AMAX_HISTORY_LENGTH):
                mode += f":{self._history}"
        source = _KERAS_NAMES.get(self._source.name, self._source.name)
        return f"{mode}{_QUANTIZED_SEP}{source}"

    def to_config(self) -> dict[str, Any]:  # type: ignore[override]
        """A JSON-friendly dict that `from_config` (of this class or `Policy`) turns back."""
        config: dict[str, Any] = {
            "quantization_mode": self._mode,
            "source": self._source.to_config(),
        }
        if self._group_size is not None:
            config["group_size"] = self._group_size
        if self._recipe is not None:
            config["recipe"] = self._recipe
        if self._history is not None:
            config["amax_history_length"] = self._history
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> QuantizedPolicy:  # type: ignore[override]
        """Inverse of `to_config`."""
        keys = {"quantization_mode", "source", "group_size", "recipe", "amax_history_length"}
        if not isinstance(config, Mapping) or not {"quantization_mode", "source"} <= set(config):
            raise PolicySpecError(
                "QuantizedPolicy.from_config takes the dict to_config() returns (keys "
                f"quantization_mode, source, and the mode's options), got {config!r}"
            )
        unknown = set(config) - keys
        if unknown:
            raise PolicySpecError(
                f"unknown quantized policy config keys {sorted(unknown)}; expected "
                f"{', '.join(sorted(keys))}"
            )
        for key, value in config.items():
            if value is None:
                takes = {
                    "quantization_mode": f"a mode ({', '.join(QUANTIZATION_MODES)})",
                    "source": "a float policy: a name such as 'bf16-mixed' or a to_config() dict",
                }.get(key, "a value, or leave the option out for its default")
                raise PolicySpecError(
                    f"quantized policy config key {key!r} is null; it takes {takes}"
                )
        recipe = config.get("recipe")
        if recipe is not None and not isinstance(recipe, str):
            raise PolicySpecError(
                f"quantized policy config key 'recipe' is {type(recipe).__name__} {recipe!r}; "
                f"it takes a recipe name ({', '.join(FLOAT8_RECIPES)})"
            )
        try:
            source = as_policy(config["source"])
        except PolicySpecError as err:
            raise PolicySpecError(f"quantized policy config key 'source': {err}") from None
        return cls(
            config["quantization_mode"],
            source,
            group_size=config.get("group_size"),
            recipe=recipe,
            amax_history_length=config.get("amax_history_length"),
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (QuantizedPolicy.from_config, (self.to_config(),))

    def _key(self) -> tuple[Any, ...]:
        return (self._mode, self._group_size, self._recipe, self._history, self._source._key())

    def __repr__(self) -> str:
        return f"QuantizedPolicy({self.name!r})"

    def skip_reason(self, module: nn.Module) -> str | None:
        """Why this policy leaves `module` in its source float policy (None: it quantizes
        it, or it is already quantized in this mode)."""
        done = getattr(module, "quantization_mode", None)
        if isinstance(done, str):
            return None if done == self._mode else f"already quantized to {done}"
        kinds = "Linear" if self._mode == "float8" else "Linear and Embedding"
        if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
            return (
                "unsupported type: the output projection of nn.MultiheadAttention, whose "
                "forward reads its weight directly"
            )
        embedding = self._mode != "float8" and type(module) is nn.Embedding
        if embedding and (module.max_norm is not None or module.sparse):
            return (
                "unsupported option: an Embedding with max_norm or sparse=True changes its "
                "weight or gradient in ways a quantized table cannot"
            )
        if type(module) is nn.Linear or embedding:
            features = module.in_features if type(module) is nn.Linear else module.embedding_dim
            if features < MIN_QUANTIZED_FEATURES:
                return (
                    f"too small: {features} input features (fewer than "
                    f"{MIN_QUANTIZED_FEATURES} save little and lose the most accuracy)"
                )
            if self._mode == "float8":
                return _float8_size_reason(module.in_features, module.out_features, self._recipe)
            return None
        return f"unsupported type {type(module).__name__}: {self._mode} quantizes {kinds}"


# torchao's rule for which Linears float8 speeds up (mixprec.quantize.float8 applies it too)
FLOAT8_SMALL_IN_FEATURES, FLOAT8_SMALL_OUT_FEATURES = 4096, 1024


def _float8_size_reason(k: int, n: int, recipe: str | None) -> str | None:
    if k % 16 or n % 16:
        return (
            f"too small for float8 matmuls: in_features={k}, out_features={n} (both must be "
            "multiples of 16)"
        )
    if recipe in ("tensorwise", "delayed") and (
        k <= FLOAT8_SMALL_IN_FEATURES and n <= FLOAT8_SMALL_OUT_FEATURES
    ):
        return (
            f"too small to gain: in_features={k} <= {FLOAT8_SMALL_IN_FEATURES} and "
            f"out_features={n} <= {FLOAT8_SMALL_OUT_FEATURES} (torchao's rule for {recipe})"
        )
    return None


def _merge(what: str, parsed: Any, given: Any, name: str) -> Any:
    if parsed is not None and given is not None and parsed != given:
        raise PolicySpecError(f"{name!r} says {what} {parsed!r} but {given!r} was passed")
    return given if given is not None else parsed


def _check_options(
    mode: str,
    source: Policy,
    group_size: int | None,
    recipe: str | None,
    history: int | None,
    name: str,
) -> tuple[int | None, str | None, int | None]:
    """The options `mode` takes, with defaults filled in; errors for the others."""
    if mode == "int8" and source.compute_dtype == torch.float16:
        raise PolicySpecError(
            f"{name!r} refused: int8 with a float16 compute dtype loses too much (as in Keras); "
            "use a bfloat16 or float32 source, e.g. 'int8_from_mixed_bfloat16'"
        )
    if mode != "int4" and group_size is not None:
        raise PolicySpecError(f"group_size is an int4 option, not {mode}'s ({name!r})")
    if mode != "float8" and (recipe is not None or history is not None):
        raise PolicySpecError(
            f"recipe and amax_history_length are float8 options, not {mode}'s ({name!r})"
        )
    if mode == "int4":
        group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise PolicySpecError(f"int4 group size must be an int, not {group_size!r}")
        if group_size != PER_CHANNEL and group_size < 2:
            raise PolicySpecError(
                f"int4 group size {group_size} in {name!r}: use a size >= 2 (128 is the "
                "default) or -1 for one group per output channel"
            )
    if mode == "float8":
        recipe = recipe or "tensorwise"
        if recipe not in FLOAT8_RECIPES:
            raise PolicySpecError(
                f"unknown float8 recipe {recipe!r} in {name!r}; recipes are "
                f"{', '.join(FLOAT8_RECIPES)}"
            )
        if recipe == "delayed":
            history = DEFAULT_AMAX_HISTORY_LENGTH if history is None else history
            if isinstance(history, bool) or not isinstance(history, int) or history < 1:
                raise PolicySpecError(
                    f"amax_history_length must be a positive int, not {history!r} ({name!r})"
                )
        elif history is not None:
            raise PolicySpecError(
                f"amax_history_length belongs to the 'delayed' float8 recipe, not {recipe!r} "
                f"({name!r})"
            )
    return group_size, recipe, history


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
    """Set the process-wide default policy (float32 until set); quantized policies too."""
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
