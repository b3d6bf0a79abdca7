"""The policy name grammar: the names people already type, parsed, and policies named back.

Float policies: Lightning's names ("bf16-mixed", "16-true", 16, ...), Keras's
("mixed_bfloat16", "float32", ...), torch dtypes, and jmp specs
("params=float32,compute=bfloat16,output=float32", keys p/c/o). Quantized policies: Keras's
"<mode>_from_<float policy>" with mixprec's options ("int4/64_from_float32",
"float8/delayed:16_from_bf16-mixed"), the block-scaled formats ("mxfp8/floor_from_bf16-mixed",
"nvfp4/2d:rht:sr_from_bf16-mixed") and Lightning's "transformer-engine" flags.

No policy objects here: this module turns specs into dtypes and options (or a clear error
saying what is accepted), and `mixprec.policy` builds the values from them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.dtypes import DTYPE_NAMES, FLOAT8_DTYPES, dtype_name, to_dtype
from mixprec.errors import PolicySpecError
from mixprec.float8_config import Float8Config
from mixprec.microscaling_config import MicroscalingConfig

__all__ = [
    "AUTO",
    "DEFAULT_GROUP_SIZE",
    "LIGHTNING_FLOAT8",
    "PER_CHANNEL",
    "POLICY_NAMES",
    "QUANTIZATION_MODES",
    "QuantizedName",
    "accepted",
    "accepted_quantized",
    "float_name",
    "is_auto",
    "names_quantized",
    "parse_float",
    "parse_quantized",
    "quantized_name",
    "quantized_options",
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


def accepted() -> str:
    """What a policy spec may be, for error messages."""
    return (
        f"accepted: one of {', '.join(repr(n) for n in POLICY_NAMES)}; the ints 16, 32, 64; "
        "a torch.dtype; or a jmp spec like 'params=float32,compute=bfloat16,output=float32' "
        f"(keys p/c/o, dtypes {', '.join(DTYPE_NAMES)}); 'auto' where a device is known; "
        "or a quantized policy '<mode>_from_<float policy>' (modes int8, int4, float8, "
        "mxfp8, mxfp6, mxfp4, nvfp4), "
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
    if bare in _BARE_QUANTIZED:
        raise PolicySpecError(
            f"precision {spec!r} refused: {_BARE_QUANTIZED[bare]} names a quantization mode, "
            "not a policy; say which float policy the rest of the layer follows. "
            + accepted_quantized()
        )
    if bare in DTYPE_NAMES and bare == dtype_name(to_dtype(bare)):
        # a full dtype name ("float16", "torch.bfloat16", float8 names): every role in it
        dtype = to_dtype(bare)
        return dtype, dtype, dtype
    dtype = getattr(torch, bare, None)
    if isinstance(dtype, torch.dtype):  # an integer or complex dtype: refused with the reason
        raise PolicySpecError(
            f"precision {spec!r} refused: {dtype_name(dtype)} is not a floating dtype; "
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
QUANTIZATION_MODES: tuple[str, ...] = ("int8", "int4", "float8", *MicroscalingConfig.MODES)
DEFAULT_GROUP_SIZE = 128
PER_CHANNEL = -1  # int4 group size: one group per output channel
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
    **{m: m for m in MicroscalingConfig.MODES},
    **{dtype_name(d): dtype_name(d) for d in FLOAT8_DTYPES},
}


def accepted_quantized() -> str:
    """What a quantized policy spec may be, for error messages."""
    return (
        "Quantized policies are '<mode>_from_<float policy>' with mode one of 'int8', "
        f"'int4' (groups of {DEFAULT_GROUP_SIZE}), 'int4/<group size>' ('int4/-1', or "
        "Keras's older 'int4/None': per channel), 'float8' (tensorwise), 'float8/<recipe>' "
        f"(recipes {', '.join(Float8Config.RECIPES)}; 'float8/delayed:<amax history length>'), "
        "the block-scaled "
        + MicroscalingConfig.accepted()
        + "; and any float policy name after '_from_' (e.g. 'int8_from_float32', "
        "'int4/64_from_mixed_bfloat16', 'float8/rowwise_from_bf16-mixed')"
    )


def names_quantized(spec: Any) -> bool:
    """True for a string spelled '<mode>_from_<float policy>' or one of Lightning's
    Transformer Engine flags ("transformer-engine", "transformer-engine-float16")."""
    if not isinstance(spec, str):
        return False
    name = spec.strip().lower()
    return _QUANTIZED_SEP in name or name in LIGHTNING_FLOAT8


@dataclass(frozen=True)
class QuantizedName:
    """What a quantized spelling says: the mode, the options it spells (None where it
    spells none; a microscaling mode's option text as written, parsed by
    `MicroscalingConfig.parse`) and the float policy after '_from_' (None for a bare mode
    such as "int4/64", whose source is given apart)."""

    mode: str
    group_size: int | None = None
    recipe: str | None = None
    amax_history_length: int | None = None
    source: str | None = None
    options: str | None = None


def parse_quantized(spec: str) -> QuantizedName:
    """'int4/64_from_float32' -> QuantizedName("int4", 64, source="float32");
    'float8/delayed:16' -> QuantizedName("float8", recipe="delayed", amax_history_length=16);
    Lightning's flags as the names they stand for."""
    name = spec.strip().lower()
    name = LIGHTNING_FLOAT8.get(name, name)
    mode_text, sep, source = name.partition(_QUANTIZED_SEP)
    if sep and not source:
        raise PolicySpecError(
            f"no float policy after '_from_' in {spec!r}. " + accepted_quantized()
        )
    mode, slash, option = mode_text.partition("/")
    found = QuantizedName(mode, source=source if sep else None)
    if mode not in QUANTIZATION_MODES:
        raise PolicySpecError(
            f"unknown quantization mode {mode!r} in {spec!r}; modes are "
            f"{', '.join(QUANTIZATION_MODES)}. " + accepted_quantized()
        )
    if slash and not option:
        raise PolicySpecError(f"nothing after '/' in {spec!r}. " + accepted_quantized())
    if not slash:
        return found
    if mode in MicroscalingConfig.MODES:
        return QuantizedName(mode, source=found.source, options=option)
    if mode == "int8":
        raise PolicySpecError(
            f"int8 takes no option ({spec!r}): its scales are per output channel. "
            + accepted_quantized()
        )
    if mode == "int4":
        if option == "none":  # Keras's older spelling of per-channel int4 ("int4/None_from_...")
            return QuantizedName(mode, PER_CHANNEL, source=found.source)
        try:
            return QuantizedName(mode, int(option), source=found.source)
        except ValueError:
            raise PolicySpecError(
                f"int4 group size {option!r} in {spec!r} is not an integer. " + accepted_quantized()
            ) from None
    recipe, colon, history = option.partition(":")
    if not colon:
        return QuantizedName(mode, recipe=recipe, source=found.source)
    try:
        length = int(history)
    except ValueError:
        raise PolicySpecError(
            f"amax history length {history!r} in {spec!r} is not an integer. "
            + accepted_quantized()
        ) from None
    return QuantizedName(mode, recipe=recipe, amax_history_length=length, source=found.source)


def _merge(what: str, parsed: Any, given: Any, name: str) -> Any:
    if parsed is not None and given is not None and parsed != given:
        raise PolicySpecError(f"{name!r} says {what} {parsed!r} but {given!r} was passed")
    return given if given is not None else parsed


def quantized_options(
    parsed: QuantizedName,
    compute_dtype: torch.dtype,
    group_size: int | None,
    recipe: str | None,
    amax_history_length: int | None,
    name: str,
) -> tuple[int | None, Float8Config | None, MicroscalingConfig | None]:
    """The options of `parsed`'s mode over a source computing in `compute_dtype`: what the
    name spells merged with the keywords given (which must agree), defaults filled in;
    (int4 group size, float8 config, microscaling config), None for what the mode does not
    take. Errors for options the mode does not take and for values out of range."""
    mode = parsed.mode
    group_size = _merge("group size", parsed.group_size, group_size, name)
    recipe = _merge("recipe", parsed.recipe, recipe, name)
    history = _merge("amax_history_length", parsed.amax_history_length, amax_history_length, name)
    if mode == "int8" and compute_dtype == torch.float16:
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
        return group_size, None, None
    if mode in MicroscalingConfig.MODES:
        return None, None, MicroscalingConfig.parse(mode, parsed.options, name)
    if mode != "float8":
        return None, None, None
    recipe = Float8Config.DEFAULT_RECIPE if recipe is None else recipe
    try:
        Float8Config.check_recipe(recipe)
    except PolicySpecError as err:
        raise PolicySpecError(f"in {name!r}: {err}. " + accepted_quantized()) from None
    if history is None:
        return None, Float8Config(recipe), None
    if recipe != "delayed":
        raise PolicySpecError(
            f"amax_history_length belongs to the 'delayed' float8 recipe, not {recipe!r} ({name!r})"
        )
    try:
        return None, Float8Config(recipe, history), None
    except PolicySpecError as err:
        raise PolicySpecError(f"in {name!r}: {err}") from None


def quantized_name(
    mode: str,
    group_size: int | None,
    float8: Float8Config | None,
    source_name: str,
    microscaling: MicroscalingConfig | None = None,
) -> str:
    """Keras's spelling of a quantized policy over the float policy `source_name`; options
    only where they differ from the defaults."""
    spelled = mode if microscaling is None else microscaling.spelled()
    if mode == "int4" and group_size != DEFAULT_GROUP_SIZE:
        spelled = f"int4/{group_size}"
    if float8 is not None and float8.recipe != Float8Config.DEFAULT_RECIPE:
        spelled = f"float8/{float8.recipe}"
        history = float8.amax_history_length
        if float8.delayed and history != Float8Config.DEFAULT_AMAX_HISTORY_LENGTH:
            spelled += f":{history}"
    return f"{spelled}{_QUANTIZED_SEP}{_KERAS_NAMES.get(source_name, source_name)}"
