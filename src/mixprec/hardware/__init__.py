"""How well the device in hand runs each precision, what is fast on it, and what "auto"
means there.

The ratings come from the device's facts (`mixprec.device`: CPU flags, CUDA compute
capability, MPS) and, on a CPU, from a short measured GEMM speed of bfloat16 and float16
against float32: the flags are the prior and the explanation, the measurement the verdict. A
quantized policy adds its format's own rating (`Format.rate`). A refused precision raises;
one slower than float32 raises unless the caller allows it. Nothing here ever switches a user
to another precision silently.

The public functions take any policy spec and convert it once (`as_map`); the functions they
call take the converted `PolicyMap`. `DeviceInfo`, `detect` and `assume` are
`mixprec.device`'s, offered here too, where the checks that read them are.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from mixprec.device import (
    DeviceInfo,
    assume,
    default_device,
    detect,
    device_of,
    parse_device,
    remeasure,
)
from mixprec.dtypes import dtype_name
from mixprec.errors import (
    PrecisionError,
    SlowPrecisionError,
    SlowPrecisionWarning,
    caller_level,
)
from mixprec.formats.registry import Status, Support, format_named
from mixprec.policy import Policy, QuantizedPolicy, is_auto
from mixprec.policy.map import PolicyMap, as_map

__all__ = [
    "ALLOW_SLOW_ENV",
    "DeviceInfo",
    "FAST",
    "REFUSED",
    "SLOW",
    "SLOW_BELOW",
    "SUPPORTED",
    "Support",
    "assume",
    "check",
    "default_device",
    "detect",
    "device_of",
    "dtype_support",
    "fast_on",
    "parse_device",
    "policy_support",
    "remeasure",
    "resolve_auto",
    "resolve_policy",
    "slow_attention",
    "support_matrix",
    "times_text",
    "warn_if_unsupported",
]


FAST, SUPPORTED, SLOW, REFUSED = Status.FAST, Status.SUPPORTED, Status.SLOW, Status.REFUSED

MATRIX_PRECISIONS: tuple[str, ...] = (
    "32-true",
    "64-true",
    "bf16-mixed",
    "bf16-true",
    "16-mixed",
    "16-true",
)


# a 16-bit GEMM measured below this fraction of float32's speed rates its dtype slow; one
# measured at FAST_FROM or more rates bfloat16 fast whatever the flags say
SLOW_BELOW = 0.8
FAST_FROM = 1.25


def times_text(ratio: float) -> str:
    """A GEMM ratio in two significant digits, or more where two would put it on the other
    side of a threshold of the ratings (`SLOW_BELOW`, 1, `FAST_FROM`) than the value it
    stands for (a ratio just under the slow threshold, rated slow, must not read as the
    threshold itself)."""
    for digits in (2, 3, 4):
        shown = float(f"{ratio:.{digits}g}")
        if all((shown < t) == (ratio < t) for t in (SLOW_BELOW, 1.0, FAST_FROM)):
            return f"{ratio:.{digits}g}x"
    return f"{ratio}x"


def _rated(prior: Support, ratio: float | None, dtype: torch.dtype) -> Support:
    """A CPU dtype's support from its flags (`prior`) and its measured GEMM ratio: below
    `SLOW_BELOW` slow, whatever the flags; else the flags' rating, which for bfloat16 a ratio
    of `FAST_FROM` raises to fast and one of `SLOW_BELOW` raises to supported (and one below
    1 lowers from fast to supported). float16 is never raised: its convolutions are slow on
    CPUs without amx_fp16 however fast its GEMM is. Where the measurement and the flags
    disagree the reason says so, never a speed its rating contradicts."""
    if ratio is None:
        return prior
    measured = f"its GEMMs measured {times_text(ratio)} float32's speed here"
    if ratio < SLOW_BELOW:
        if prior.status == SLOW:
            return Support(SLOW, f"{measured}; {prior.reason}")
        return Support(SLOW, f"{measured}, slower than its flags predict ({prior.reason})")
    if dtype != torch.bfloat16:
        if prior.status == SLOW:
            return Support(SLOW, f"{measured}, but rated by its convolutions: {prior.reason}")
        return Support(prior.status, f"{prior.reason}; {measured}")
    if prior.status == FAST:
        if ratio >= 1.0:
            return Support(FAST, f"{prior.reason}; {measured}")
        return Support(SUPPORTED, f"{measured}, not faster as its flags predict ({prior.reason})")
    status, speed = (FAST, "") if ratio >= FAST_FROM else (SUPPORTED, ", about float32's")
    if prior.status == SLOW:
        return Support(status, f"{measured}{speed}, not what its flags predict ({prior.reason})")
    return Support(status, f"{measured}{speed}; {prior.reason}")


def _cpu_prior(
    dtype: torch.dtype, flags: frozenset[str], unknown: frozenset[str] = frozenset()
) -> Support:
    """What a CPU's flags predict for bfloat16 or float16, before any measurement; a flag in
    `unknown` (`DeviceInfo.unknown_flags`) is said to be unknown, never absent."""
    if dtype == torch.bfloat16:
        if flags & {"amx_bf16", "avx512_bf16"}:
            have = "/".join(sorted(flags & {"amx_bf16", "avx512_bf16"}))
            return Support(FAST, f"bfloat16 matrix instructions ({have})")
        if "apple_silicon" in flags:
            return Support(SUPPORTED, "Apple silicon: bfloat16 at about float32 speed")
        if "bf16" in flags:  # (Arm's name: Neoverse V1/V2, Graviton3+)
            return Support(
                SUPPORTED,
                "Arm bfloat16 instructions (bf16): as fast as torch's kernels use them, "
                "which the measured ratio tells",
            )
        if unread := sorted(unknown & {"amx_bf16", "avx512_bf16", "bf16"}):
            return Support(
                SUPPORTED,
                f"flags unknown ({', '.join(unread)}): whether it has bfloat16 instructions "
                "could not be read; the measured ratio tells its speed",
            )
        if "avx512bw" in flags:
            return Support(
                SLOW,
                "no avx512_bf16/amx_bf16: converted to float32 in software with AVX-512, "
                "slower than float32",
            )
        if "avx512bw" in unknown:
            return Support(
                SLOW,
                "no avx512_bf16/amx_bf16 (flags unknown: avx512bw): converted to float32 in "
                "software, slower than float32",
            )
        return Support(SLOW, "no bf16 or avx512 instructions: emulated, slower than float32")
    if "amx_fp16" in flags:
        return Support(
            SUPPORTED,
            "float16 matrix instructions (amx_fp16); "
            "convolutions may still use slow float16 kernels",
        )
    if "avx512_fp16" in flags or "apple_silicon" in flags:
        which = "avx512_fp16" if "avx512_fp16" in flags else "Apple silicon's CPU"
        return Support(
            SLOW,
            f"float16 matmuls in hardware ({which}), but "
            "convolutions and most other float16 ops fall back to slow "
            "kernels (a CNN step measured ~100x slower than float32)",
        )
    if unread := sorted(unknown & {"amx_fp16", "avx512_fp16"}):
        return Support(
            SLOW,
            f"flags unknown ({', '.join(unread)}): float16 convolutions and most other float16 "
            "ops fall back to slow kernels on CPUs without amx_fp16",
        )
    return Support(
        SLOW,
        "no float16 hardware (no avx512_fp16/amx_fp16): converted in software, and float16 "
        "convolutions fall back to slow kernels",
    )


# the compute capabilities of NVIDIA's GPUs with float64 at half the float32 rate (P100, V100,
# A100, H100, B200); the others have few float64 units
_FAST_FLOAT64 = frozenset({(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)})


def dtype_support(dtype: torch.dtype, info: DeviceInfo) -> Support:
    """How well `info`'s device runs matmuls and convolutions in `dtype`: on a CPU, bfloat16
    and float16 as its flags predict and its measured GEMM ratio (`DeviceInfo.gemm_ratios`)
    confirms or overrules (below `SLOW_BELOW` x float32's speed: slow)."""
    if info.type == "cpu":
        if dtype == torch.float32:
            return Support(FAST, "baseline")
        if dtype == torch.float64:
            return Support(SUPPORTED, "runs at about half the float32 rate")
        if dtype in (torch.bfloat16, torch.float16):
            ratios = info.gemm_ratios or {}
            prior = _cpu_prior(dtype, info.cpu_flags, info.unknown_flags)
            return _rated(prior, ratios.get(dtype_name(dtype)), dtype)
    if info.type == "cuda":
        major, minor = info.capability or (0, 0)
        cc = f"compute capability {major}.{minor}"
        if dtype == torch.float32:
            if major >= 8:
                return Support(FAST, f"baseline ({cc}; TF32 tensor cores if enabled)")
            return Support(FAST, "baseline")
        if dtype == torch.float64:
            if info.capability in _FAST_FLOAT64:
                return Support(SUPPORTED, f"float64 units at half the float32 rate ({cc})")
            return Support(
                SLOW,
                f"runs at a small fraction of the float32 rate on {cc} (1/32 to 1/64 on "
                "GeForce/RTX, T4, A10, L4 GPUs); at half of it only on compute capability 6.0, "
                "7.0, 8.0, 9.0 and 10.0",
            )
        if dtype == torch.float16:
            if major >= 7:
                return Support(FAST, f"tensor cores ({cc} >= 7.0)")
            return Support(SUPPORTED, f"no tensor cores ({cc} < 7.0): saves memory, not time")
        if dtype == torch.bfloat16:
            if major >= 8:
                return Support(FAST, f"bf16 tensor cores ({cc} >= 8.0)")
            return Support(REFUSED, f"bfloat16 needs compute capability 8.0+, this GPU has {cc}")
    if info.type == "mps":
        if dtype == torch.float64:
            return Support(REFUSED, "MPS has no float64")
        if dtype == torch.bfloat16:
            if info.macos is None:
                return Support(SUPPORTED, "bfloat16 on macOS 14+ (a current macOS assumed)")
            if info.macos >= (14, 0):
                return Support(SUPPORTED, "bfloat16 on macOS 14+")
            return Support(REFUSED, "bfloat16 on MPS needs macOS 14 or newer")
        if dtype in (torch.float32, torch.float16):
            return Support(FAST, "native")
    return Support(REFUSED, f"{dtype_name(dtype)} training is not supported on {info.type}")


def slow_attention(info: DeviceInfo) -> frozenset[torch.dtype]:
    """The 16-bit dtypes in which `info`'s device runs attention (torch's
    `scaled_dot_product_attention`, forward and backward) slower than in float32, so a
    policy computing in them runs its attention in float32 (`PolicyMap.float32_attention`).

    CPUs without AMX: torch's CPU flash attention ran slower in bfloat16 and float16 than in
    float32 on an AMD Zen 4 with avx512_bf16 (benchmarks/attention_dtype.py; docs/policies.md
    gives the figures). CPUs with AMX tiles for the dtype (amx_bf16, amx_fp16) are left to
    the 16-bit kernel (not measured), as are GPUs, whose fused attention kernels are made for
    16 bits. A tile whose flag is unknown (`DeviceInfo.unknown_flags`) counts as absent:
    float32 attention is slower there at worst, never less accurate."""
    if info.type != "cpu":
        return frozenset()
    tiles = {torch.bfloat16: "amx_bf16", torch.float16: "amx_fp16"}
    return frozenset(dtype for dtype, flag in tiles.items() if flag not in info.cpu_flags)


def policy_support(policy: Any, info: DeviceInfo) -> Support:
    """The worst support over every dtype a policy (or each policy of a map) uses, and for
    a quantized policy its format's own rating (`Format.rate`).

    The reason is the map's default policy's unless another policy of the map is worse: a
    bf16-mixed map is fast because of bfloat16, not because of its float32 islands."""
    return _map_support(as_map(policy), info)


def _in_order(pmap: PolicyMap) -> list[Policy]:
    """The map's policies, its default first, then the others by name."""
    return [pmap.default, *sorted(pmap.policies() - {pmap.default}, key=lambda p: p.name)]


def _worse(worst: Support, status: Status, reason: str) -> Support:
    """`worst`, or the new rating where it is worse (the first of equals is kept)."""
    return Support(status, reason) if status.rank > worst.status.rank or not worst.reason else worst


def _one_support(policy: Policy, info: DeviceInfo) -> Support:
    """One policy's support: its format's rating first, then its dtypes' (storage matters
    only if refused; speed is decided by the compute dtype)."""
    worst = Support(FAST, "")
    rated = (
        policy.format.rate_policy(info, policy.config, policy.compute_dtype)
        if isinstance(policy, QuantizedPolicy)
        else None
    )
    if rated is not None:
        worst = _worse(worst, rated.status, f"{policy.mode}: {rated.reason}")
    for dtype in dict.fromkeys((policy.compute_dtype, policy.param_dtype, policy.output_dtype)):
        s = dtype_support(dtype, info)
        if dtype == policy.compute_dtype or s.status == REFUSED:
            worst = _worse(worst, s.status, f"{dtype_name(dtype)}: {s.reason}")
    return worst


def _map_support(pmap: PolicyMap, info: DeviceInfo) -> Support:
    worst = Support(FAST, "")
    for p in _in_order(pmap):
        s = _one_support(p, info)
        worst = _worse(worst, s.status, s.reason)
    return worst


def support_matrix(info: DeviceInfo | None = None) -> dict[str, Support]:
    """Support of each common precision on the device (default: the best available)."""
    info = info or detect()
    return {name: _one_support(Policy(name), info) for name in MATRIX_PRECISIONS}


def resolve_auto(info: DeviceInfo) -> Policy:
    """The fastest precision that keeps training stable on the device `info` describes:
    bf16 mixed where bf16 is fast, float16 mixed (with loss scaling) where only float16 is,
    else float32."""
    for name in ("bf16-mixed", "16-mixed"):
        if _one_support(Policy(name), info).status == FAST:
            return Policy(name)
    return Policy("32-true")


ALLOW_SLOW_ENV = "MIXPREC_ALLOW_SLOW"

# Where each low-precision dtype has fast matmul/convolution hardware.
_FAST_ON: dict[torch.dtype, str] = {
    torch.bfloat16: (
        "NVIDIA GPUs of compute capability 8.0+ (A100, RTX 30xx, H100 and newer), "
        "CPUs with avx512_bf16 (AMD Zen 4+, Intel Cooper Lake) or amx_bf16 "
        "(Intel Sapphire Rapids+)"
    ),
    torch.float16: (
        "NVIDIA GPUs of compute capability 7.0+ (V100, T4 and newer), Apple GPUs (MPS); "
        "no CPU (those with amx_fp16, Intel Granite Rapids+, run its matmuls at speed, "
        "its convolutions still slowly: supported, not fast)"
    ),
    torch.float64: (
        "NVIDIA GPUs of compute capability 6.0, 7.0, 8.0, 9.0 or 10.0 (P100, V100, A100, "
        "H100, B200), at half their float32 rate"
    ),
}


def fast_on(dtype: torch.dtype) -> str | None:
    """The hardware on which `dtype` training is fast (None for float32)."""
    return _FAST_ON.get(dtype)


def allow_slow_from_env() -> bool:
    """Whether ``MIXPREC_ALLOW_SLOW`` is set to a true value (1, true, yes, on)."""
    value = os.environ.get(ALLOW_SLOW_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise PrecisionError(
        f"{ALLOW_SLOW_ENV}={value!r} is not understood; use 1/true/yes/on or 0/false/no/off"
    )


def resolve_policy(spec: Any, device: torch.device | str | DeviceInfo) -> PolicyMap:
    """What `spec` means on `device` (a device or a `DeviceInfo` describing one), as a
    PolicyMap: "auto" becomes `resolve_auto` for that device; any other spec, Policy,
    config or PolicyMap is coerced as `as_map` does, whatever the device."""
    if is_auto(spec):
        info = device if isinstance(device, DeviceInfo) else detect(device)
        return PolicyMap(resolve_auto(info))
    return as_map(spec)


def check(
    policy: Any,
    device: torch.device | str | None = None,
    allow_slow: bool = False,
    info: DeviceInfo | None = None,
) -> Support:
    """Raise if `policy` is refused on the device, or rated slow there (on a CPU: its GEMMs
    measured below `SLOW_BELOW` x float32's speed) unless `allow_slow` (or
    ``MIXPREC_ALLOW_SLOW=1``); return the support (status and reason)."""
    info = info or detect(device)
    pmap = as_map(policy)
    s = _map_support(pmap, info)
    name = pmap.name
    if s.status == REFUSED:
        ok = [n for n, c in support_matrix(info).items() if c.status != REFUSED]
        raise PrecisionError(
            f"precision {name!r} is refused on {info.describe()}: {s.reason}. "
            f"Supported here: {', '.join(ok)}"
        )
    if s.status == SLOW and not (allow_slow or allow_slow_from_env()):
        fast = [n for n, c in support_matrix(info).items() if c.status == FAST]
        # a reason names what is slow first: a format (its hardware) or a dtype
        fmt = format_named(s.reason.partition(":")[0])
        where = fmt.fast_on if fmt is not None and fmt.fast_on else None
        where = where or fast_on(_slowest_dtype(pmap, info))
        raise SlowPrecisionError(
            f"precision {name!r} runs on {info.describe()} but slower than float32 "
            f"({s.reason}). It is fast on {where}. To run it here anyway (e.g. to study its "
            "numerics on small tensors) pass allow_slow=True (Precision), "
            "allow_slow_precision=True (Trainer), --allow-slow (mixprec bench), or set "
            f"{ALLOW_SLOW_ENV}=1; or pick one that is fast here: {', '.join(fast)}"
        )
    return s


def _slowest_dtype(pmap: PolicyMap, info: DeviceInfo) -> torch.dtype:
    dtypes = {p.compute_dtype for p in pmap.policies()}
    return max(dtypes, key=lambda d: dtype_support(d, info).status.rank)


def warn_if_unsupported(policy: Any, device: torch.device | str | None = None) -> None:
    """Warn (never raise) when a policy is slow or refused here: for tools that convert or
    diagnose numerics in any precision, which can be studied anywhere.

    The warning names the policy of the map that is slow (the default one first), not the
    map: '16-mixed' with or without rules is one message, which Python's warning filters
    then show once per place. ``MIXPREC_ALLOW_SLOW=1`` silences it for a slow policy, as it
    lifts `check`'s error: whoever set it knows; a refused one is still said. On the meta
    device (a model sized before its weights exist) it says that what depends on the device
    is decided when the policy is applied again where the model runs."""
    if device is not None and torch.device(device).type == "meta":
        warnings.warn(
            "applied to a model on the meta device: the float32 islands and attention paths "
            "that depend on the device follow none; apply the policy again once the weights "
            "are where the model runs (after model.to_empty(device=...))",
            UserWarning,
            stacklevel=caller_level(),
        )
        return
    info = detect(device)
    pmap = as_map(policy)
    s = _map_support(pmap, info)
    if s.status == SLOW and allow_slow_from_env():
        return
    if s.status in (SLOW, REFUSED):
        # max keeps the first of equals: the default policy when it is as bad as any rule
        worst = max(_in_order(pmap), key=lambda p: _one_support(p, info).status.rank)
        warnings.warn(
            f"precision {worst.name!r} is {s.status} on {info.describe()}: {s.reason}",
            SlowPrecisionWarning,
            stacklevel=caller_level(),
        )
