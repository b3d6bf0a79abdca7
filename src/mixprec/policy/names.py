"""The policy name grammar: the names people already type, parsed, and policies named back.

Float policies: Lightning's names ("bf16-mixed", "16-true", 16, ...), Keras's
("mixed_bfloat16", "float32", ...), torch dtypes, and jmp specs
("params=float32,compute=bfloat16,output=float32", keys p/c/o). Quantized policies: Keras's
"<mode>_from_<float policy>", the mode any registered format (`mixprec.formats`) with the
options it spells after a '/' ("int4/64_from_float32", "float8/delayed:16_from_bf16-mixed",
"mxfp8/floor_from_bf16-mixed"), and Lightning's "transformer-engine" flags.

No policy objects here: a spec is parsed once (`parse_spec`) into a frozen `FloatSpec` or
`QuantizedSpec` (or a clear error saying what is accepted), and `mixprec.policy` builds the
values from them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.dtypes import DTYPE_NAMES, FLOAT8_DTYPES, dtype_name, is_float8, to_dtype
from mixprec.errors import PolicySpecError
from mixprec.formats.registry import Format, format_named, formats

__all__ = [
    "POLICY_NAMES",
    "accepted_quantized",
    "is_auto",
    "spelled_int",
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

# Keras's name of each canonical policy (also the source part of a quantized policy's name)
_KERAS_NAMES: dict[str, str] = {
    "16-mixed": "mixed_float16",
    "bf16-mixed": "mixed_bfloat16",
    "32-true": "float32",
    "64-true": "float64",
    "16-true": "float16",
    "bf16-true": "bfloat16",
}
# Every other accepted whole-policy name, mapped to a canonical one: Lightning's aliases and
# Keras's names.
_ALIASES: dict[str, str] = {
    "16": "16-mixed",
    "bf16": "bf16-mixed",
    "32": "32-true",
    "64": "64-true",
    **{keras: name for name, keras in _KERAS_NAMES.items()},
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


def accepted() -> str:
    """What a policy spec may be, for error messages."""
    return (
        f"accepted: one of {', '.join(repr(n) for n in POLICY_NAMES)}; the ints 16, 32, 64; "
        "a torch.dtype; or a jmp spec like 'params=float32,compute=bfloat16,output=float32' "
        f"(keys p/c/o, dtypes {', '.join(DTYPE_NAMES)}); 'auto' where a device is known; "
        f"or a quantized policy '<mode>_from_<float policy>' (modes {_modes()}), "
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
                + accepted()
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


def parse_float(spec: Any) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(param, compute, output) of a float policy spec: a name, an int, a torch.dtype or a jmp
    spec; anything else (quantized names included) is a PolicySpecError saying why."""
    if isinstance(spec, torch.dtype):
        return spec, spec, spec
    if isinstance(spec, int) and not isinstance(spec, bool):
        if str(spec) in _ALIASES:
            return _NAMED[_ALIASES[str(spec)]]
        raise PolicySpecError(f"unknown precision {spec!r}; " + accepted())
    if not isinstance(spec, str):
        where = (
            "; a PolicyMap holds several policies: pass it where maps are accepted "
            "(apply, explain, Precision, Trainer)"
            if type(spec).__name__ == "PolicyMap"
            else ""
        )
        raise PolicySpecError(
            f"a policy spec must be a string, int, torch.dtype or Policy, not "
            f"{type(spec).__name__}{where}; " + accepted()
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
            f"unknown precision {spec!r} (did you mean {_HINTS[bare]}?); " + accepted()
        )
    if _bare_quantized(bare):
        raise PolicySpecError(
            f"precision {spec!r} refused: {bare} names a quantization mode, "
            "not a policy; say which float policy the rest of the layer follows. "
            + accepted_quantized()
        )
    if bare in DTYPE_NAMES and bare == dtype_name(to_dtype(bare)):
        # a full dtype name ("float16", "torch.bfloat16", float8 names): every role in it
        dtype = to_dtype(bare)
        return dtype, dtype, dtype
    dtype = getattr(torch, bare, None)
    if isinstance(dtype, torch.dtype):  # an integer or complex dtype: refused with the reason
        what = "not a floating dtype" if not dtype.is_floating_point else "not a policy dtype"
        raise PolicySpecError(
            f"precision {spec!r} refused: {dtype_name(dtype)} is {what}; "
            + accepted()
            + ". "
            + accepted_quantized()
        )
    if key.endswith(".json"):
        raise PolicySpecError(
            f"precision {spec!r} names a policy file (a PolicyMap): this takes one policy. "
            "Read it with PolicyMap.load, or pass the path where maps are accepted (apply, "
            "explain, Precision, the Trainer, the CLI's --precision)"
        )
    if os.path.isfile(spec):
        raise PolicySpecError(
            f"unknown precision {spec!r}, which is a file: a path is read as a policy file "
            f"only when its name ends in '.json' (e.g. {spec + '.json'!r}); " + accepted()
        )
    raise PolicySpecError(f"unknown precision {spec!r}; " + accepted())


def float_name(param: torch.dtype, compute: torch.dtype, output: torch.dtype) -> str:
    """Canonical name of a float policy: Lightning's spelling where one exists, else a
    jmp-style spec."""
    dtypes = (param, compute, output)
    if dtypes in _BY_DTYPES:
        return _BY_DTYPES[dtypes]
    return f"params={dtype_name(param)},compute={dtype_name(compute)},output={dtype_name(output)}"


# ---- quantized policies: "<mode>_from_<float policy>", as Keras spells them ----

_QUANTIZED_SEP = "_from_"
# Lightning's Transformer Engine flags, as Lightning runs them: weights and compute in
# bfloat16 (float16), float8 matmuls scaled from a 1024-step amax history (Transformer Engine's
# DelayedScaling defaults: e4m3 forward, e5m2 gradients), outputs back in float32
LIGHTNING_FLOAT8: dict[str, str] = {
    "transformer-engine": "float8/delayed_from_params=bfloat16,compute=bfloat16,output=float32",
    "transformer-engine-float16": (
        "float8/delayed_from_params=float16,compute=float16,output=float32"
    ),
}
# the keywords a policy constructor takes for the float dtypes, which a quantized policy
# takes from its source instead
_DTYPE_KEYWORDS = ("param_dtype", "compute_dtype", "output_dtype", "variable_dtype")


def _modes() -> str:
    return ", ".join(f.name for f in formats())


def unregistered(mode: str, where: str = "") -> str:
    """What to say of a quantization `mode` (named `where`) no registered format is
    called: the formats that are, and that a format declared elsewhere is registered before
    a name or a policy file naming it is read."""
    return (
        f"unknown quantization mode {mode!r}{where}: no format of that name is registered; "
        f"modes are {_modes()}. A format declared outside mixprec must be registered "
        f"(mixprec.formats.register) before a policy naming it is parsed or loaded"
    )


def _bare_quantized(name: str) -> bool:
    """A bare mode or float8 storage name ("int8", "mxfp8", "float8_e4m3fn"), which names a
    quantization, not a policy."""
    return format_named(name) is not None or name in {dtype_name(d) for d in FLOAT8_DTYPES}


def accepted_quantized() -> str:
    """What a quantized policy spec may be, for error messages."""
    spelled = ", ".join(dict.fromkeys(f.accepted for f in formats()))
    return (
        f"Quantized policies are '<mode>_from_<float policy>' with mode one of {spelled}; and "
        "any float policy name after '_from_' (e.g. 'int8_from_float32', "
        "'int4/64_from_mixed_bfloat16', 'float8/rowwise_from_bf16-mixed')"
    )


def spelled_int(text: str, what: str, name: str) -> int:
    """The int that the option `text` of the quantized spec `name` spells in ASCII digits
    (a leading minus allowed), or PolicySpecError saying that `what` is not one and what
    is accepted (`int` alone would take blanks, '+', '1_6' and other scripts' digits, so a
    name would not be one spelling per policy)."""
    if not re.fullmatch(r"-?[0-9]+", text):
        raise PolicySpecError(
            f"{what} {text!r} in {name!r} is not an integer in digits 0-9. " + accepted_quantized()
        )
    return int(text)


def names_quantized(spec: Any) -> bool:
    """True for a string spelled '<mode>_from_<float policy>' or one of Lightning's
    Transformer Engine flags ("transformer-engine", "transformer-engine-float16")."""
    if not isinstance(spec, str):
        return False
    name = spec.strip().lower()
    return _QUANTIZED_SEP in name or name in LIGHTNING_FLOAT8


# the dtypes a float policy stores, computes and outputs in
_POLICY_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FloatSpec:
    """A float policy as parsed: the dtypes parameters are stored in, computed in and
    output in, checked once (floating, and no float8, which needs scales a cast cannot
    give)."""

    param: torch.dtype
    compute: torch.dtype
    output: torch.dtype

    def __post_init__(self) -> None:
        roles = (("param", self.param), ("compute", self.compute), ("output", self.output))
        for role, dtype in roles:
            if not dtype.is_floating_point:
                raise PolicySpecError(
                    f"{role} dtype {dtype_name(dtype)} is not a floating dtype; a policy's "
                    "dtypes are float64, float32, float16 or bfloat16"
                )
            if is_float8(dtype):
                raise PolicySpecError(
                    f"{role} dtype {dtype_name(dtype)} refused: float8 tensors need per-tensor "
                    "scales (a float8 recipe with scaled matmuls), which a plain cast policy "
                    "cannot give; use float16/bfloat16 here"
                )
            if dtype not in _POLICY_DTYPES:  # (scale-only and packed formats: float8_e8m0fnu,
                raise PolicySpecError(  # float4_e2m1fn_x2)
                    f"{role} dtype {dtype_name(dtype)} refused: a policy's dtypes are float64, "
                    "float32, float16 or bfloat16 (block-scaled formats are quantized "
                    "policies, e.g. 'mxfp8_from_bf16-mixed', 'nvfp4_from_bf16-mixed')"
                )

    @property
    def name(self) -> str:
        """Canonical name: Lightning's spelling where one exists, else a jmp-style spec."""
        return float_name(self.param, self.compute, self.output)


@dataclass(frozen=True)
class QuantizedSpec:
    """A quantized policy as parsed: its registered format, the format's config (options
    checked, defaults filled in) and the float policy everything else follows."""

    format: Format
    config: Any
    source: FloatSpec

    @property
    def name(self) -> str:
        """Keras's spelling: the format with the options that differ from its defaults,
        '_from_', and the source's Keras name where it has one."""
        source = self.source.name
        spelled = self.format.spell(self.config)
        return f"{spelled}{_QUANTIZED_SEP}{_KERAS_NAMES.get(source, source)}"


def parse_float_spec(spec: Any) -> FloatSpec:
    """The float policy a spec names (`parse_float`), as a checked `FloatSpec`."""
    return FloatSpec(*parse_float(spec))


def parse_quantized(
    spec: str,
    source: Any = None,
    options: Mapping[str, Any] | None = None,
    *,
    stored: Mapping[str, Any] | None = None,
) -> QuantizedSpec:
    """Parse a quantized spelling once: 'int4/64_from_float32', 'float8/delayed:16' with
    its `source` given apart, or Lightning's flags as the names they stand for. `options`
    are keyword options (``group_size=64``), which must belong to the format and agree with
    what the name spells; `source` is a float spec or `FloatSpec`. `stored` holds the
    option keys of a policy config instead (`Format.from_dict`)."""
    options = {k: v for k, v in (options or {}).items() if v is not None}
    dtypes = sorted(k for k in options if k in _DTYPE_KEYWORDS)
    if dtypes:
        raise PolicySpecError(
            f"a quantized policy takes its dtypes from its source float policy, not "
            f"{', '.join(dtypes)}; give the source instead, e.g. "
            "QuantizedPolicy('int8', 'p=f32,c=bf16,o=f32')"
        )
    name = spec.strip().lower()
    name = LIGHTNING_FLOAT8.get(name, name)
    mode_text, sep, source_text = name.partition(_QUANTIZED_SEP)
    if sep and not source_text:
        raise PolicySpecError(
            f"no float policy after '_from_' in {spec!r}. " + accepted_quantized()
        )
    mode, slash, option = mode_text.partition("/")
    fmt = format_named(mode)
    if fmt is None:
        raise PolicySpecError(unregistered(mode, f" in {spec!r}") + ". " + accepted_quantized())
    if slash and not option:
        raise PolicySpecError(f"nothing after '/' in {spec!r}. " + accepted_quantized())
    if sep:
        if source is not None:
            raise PolicySpecError(
                f"{spec!r} names its source already; do not also pass source={source!r}"
            )
        source = source_text
    if source is None:
        bare = spec.strip().lower()
        raise PolicySpecError(
            f"QuantizedPolicy({spec!r}) needs its source float policy, e.g. "
            f"QuantizedPolicy({bare!r}, 'mixed_bfloat16') or '{bare}_from_mixed_bfloat16'"
        )
    if names_quantized(source):
        raise PolicySpecError(
            f"the source of a quantized policy is a float policy, not the quantized {source!r}"
        )
    try:
        float_spec = source if isinstance(source, FloatSpec) else parse_float_spec(source)
    except PolicySpecError as err:
        raise PolicySpecError(f"in quantized policy {spec!r}: {err}") from None
    refused = fmt.source_reason(float_spec.compute)
    if refused is not None:
        raise PolicySpecError(f"{spec!r} refused: {refused}")
    for key in sorted(options):
        if key in fmt.keywords:
            continue
        owner = next((f for f in formats() if key in f.keywords), None)
        if owner is None:
            raise PolicySpecError(
                f"unknown option {key}={options[key]!r} for {fmt.name} ({spec!r}); "
                + accepted_quantized()
            )
        many = len(owner.keywords) > 1
        raise PolicySpecError(
            f"{' and '.join(owner.keywords)} {'are' if many else 'is an'} {owner.name} "
            f"option{'s' if many else ''}, not {fmt.name}'s ({spec!r})"
        )
    if stored is not None:
        config = fmt.from_dict(stored, spec)
    else:
        keywords = {k: options.get(k) for k in fmt.keywords}
        config = fmt.parse(option if slash else None, keywords, spec)
    return QuantizedSpec(fmt, config, float_spec)


def parse_spec(spec: Any) -> FloatSpec | QuantizedSpec:
    """What a policy spec names, parsed once: a `QuantizedSpec` for a quantized spelling
    (`names_quantized`), else a `FloatSpec`."""
    if names_quantized(spec):
        return parse_quantized(spec)
    return parse_float_spec(spec)
