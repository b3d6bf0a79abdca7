"""What the device in hand supports, what is fast on it, and what "auto" means there.

The support matrix comes from hardware facts (CPU flags, CUDA compute capability, MPS) and,
on a CPU, from a short measured GEMM speed of bfloat16 and float16 against float32
(`gemm_ratio`): the flags are the prior and the explanation, the measurement the verdict. A
refused precision raises; one slower than float32 raises unless the caller allows it. Nothing
here ever switches a user to another precision silently.
"""

from __future__ import annotations

import os
import platform
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from torch import nn

from mixprec.dtypes import dtype_name
from mixprec.errors import (
    PrecisionError,
    SlowPrecisionError,
    SlowPrecisionWarning,
    caller_level,
)
from mixprec.formats.registry import Status, Support, format_named
from mixprec.hardware import gemm_ratio
from mixprec.policy import Policy, QuantizedPolicy, is_auto
from mixprec.policy.map import PolicyMap, as_map

# each format's rating lives with the format (`Format.rate`); the builtin ones are this
# module's names too, beside the dtypes' ratings
from mixprec.quantize.float8 import FLOAT8_FAST_ON, float8_support
from mixprec.quantize.int8 import int8_support
from mixprec.quantize.microscaling import microscaling_support

__all__ = [
    "ALLOW_SLOW_ENV",
    "DeviceInfo",
    "FAST",
    "FLOAT8_FAST_ON",
    "MATRIX_PRECISIONS",
    "REFUSED",
    "SLOW",
    "SLOW_BELOW",
    "SUPPORTED",
    "Status",
    "Support",
    "allow_slow_from_env",
    "assume",
    "cap_cpu_flags",
    "caps_in_effect",
    "check",
    "default_device",
    "detect",
    "device_of",
    "dtype_support",
    "fast_on",
    "int8_support",
    "float8_support",
    "microscaling_support",
    "parse_device",
    "policy_support",
    "remeasure",
    "resolve_auto",
    "resolve_policy",
    "slow_attention",
    "support_matrix",
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


@dataclass(frozen=True)
class DeviceInfo:
    """Facts about one device that decide which precisions are fast on it.

    Attributes:
        type: "cpu", "cuda" or "mps".
        name: the CPU model or GPU name.
        index: the CUDA device index (None elsewhere).
        cpu_flags: the CPU's instruction flags that matter here, after any ISA cap.
        capability: a CUDA GPU's compute capability, (major, minor).
        total_memory: a GPU's memory in bytes.
        torch_version: the torch the facts were gathered with.
        isa_cap: which ISA cap (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``) applied.
        gemm_ratios: on a CPU, the measured GEMM speed of "bfloat16" and "float16" against
            float32 (below 1: slower than float32); `detect` measures the host's (on one thread,
            cached per machine), a described CPU states them or, left None, is rated by its
            flags alone.
        gemm_note: how and when `gemm_ratios` were measured, shown by `mixprec info`.
    """

    type: str
    name: str
    index: int | None = None
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    capability: tuple[int, int] | None = None
    total_memory: int | None = None
    torch_version: str = torch.__version__
    isa_cap: str | None = None
    gemm_ratios: Mapping[str, float] | None = field(default=None, hash=False)
    gemm_note: str | None = field(default=None, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.gemm_ratios is None:
            return
        names = {dtype_name(d) for d in gemm_ratio.DTYPES}
        ratios = dict(self.gemm_ratios)
        bad = {
            k: v
            for k, v in ratios.items()
            if k not in names or not isinstance(v, float | int) or not 0 < v < float("inf")
        }
        if bad:
            raise ValueError(
                f"DeviceInfo.gemm_ratios: {bad} is not understood; it maps "
                f"{' and '.join(sorted(names))} to a positive speed against float32 "
                "(e.g. {'bfloat16': 0.42})"
            )
        object.__setattr__(self, "gemm_ratios", ratios)

    @property
    def device(self) -> torch.device:
        return (
            torch.device(self.type, self.index)
            if self.index is not None
            else torch.device(self.type)
        )

    def describe(self) -> str:
        if self.type == "cuda":
            cc = f"compute capability {self.capability[0]}.{self.capability[1]}"
            mem = f", {self.total_memory / 2**30:.0f} GiB" if self.total_memory else ""
            return f"{self.device} ({self.name}, {cc}{mem})"
        if self.type == "cpu":
            shown = sorted(self.cpu_flags & set(_CPU_FLAGS_OF_INTEREST))
            flags = ", ".join(shown) if shown else "no bf16/fp16 matrix extensions"
            cap = f"; {self.isa_cap}" if self.isa_cap else ""
            return f"cpu ({self.name}; {flags}{cap}; {_threads(torch.get_num_threads())})"
        return f"{self.device} ({self.name})"


def _threads(n: int) -> str:
    return "1 thread" if n == 1 else f"{n} threads"


_CPU_FLAGS_OF_INTEREST = (
    "avx512_bf16",
    "amx_bf16",
    "avx512_fp16",
    "amx_fp16",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "amx_int8",
)


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    if platform.machine() == "arm64" and platform.system() == "Darwin":
        return frozenset({"apple_silicon"})
    return frozenset()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# oneDNN's ISA levels, lowest first, and the CPU flags each level lets its kernels use
# (of those that decide bf16/fp16 speed); a level allows the flags of every level below it.
_ONEDNN_LEVELS: tuple[tuple[tuple[str, ...], frozenset[str]], ...] = (
    (("SSE41", "AVX", "AVX2"), frozenset()),
    (("AVX2_VNNI", "AVX2_VNNI_2"), frozenset({"avx_vnni"})),
    (("AVX512_CORE",), frozenset({"avx512bw"})),
    (("AVX512_CORE_VNNI",), frozenset({"avx512_vnni"})),
    (("AVX512_CORE_BF16",), frozenset({"avx512_bf16"})),
    (("AVX512_CORE_FP16", "AVX10_1_512"), frozenset({"avx512_fp16"})),
    (("AVX512_CORE_AMX", "AVX10_1_512_AMX"), frozenset({"amx_bf16", "amx_int8"})),
    (("AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "ALL", "DEFAULT"), frozenset({"amx_fp16"})),
)
# ATen's CPU capability levels and the flags its vectorised kernels may use at each
_ATEN_LEVELS: dict[str, frozenset[str]] = {
    "DEFAULT": frozenset(),
    "AVX2": frozenset(),
    "AVX512": frozenset(_CPU_FLAGS_OF_INTEREST),
}


def _onednn_allowed(level: str) -> frozenset[str] | None:
    allowed: set[str] = set()
    for names, flags in _ONEDNN_LEVELS:
        allowed |= flags
        if level in names:
            return frozenset(allowed)
    return None


def cap_cpu_flags(
    flags: frozenset[str], environ: Mapping[str, str]
) -> tuple[frozenset[str], str | None]:
    """The CPU flags left usable under the ISA caps users already set for torch's kernels
    (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``), and a note saying which cap applied.

    Capping to AVX2 on a CPU with AMX makes its bf16 kernels as slow as an AVX2 CPU's, so the
    support matrix follows the cap; an unknown value caps nothing and the note says so.
    """
    kept = set(flags)
    notes = []
    for var, allowed_of in (
        ("ONEDNN_MAX_CPU_ISA", _onednn_allowed),
        ("DNNL_MAX_CPU_ISA", _onednn_allowed),
        ("ATEN_CPU_CAPABILITY", _ATEN_LEVELS.get),
    ):
        value = environ.get(var, "").strip()
        if not value:
            continue
        allowed = allowed_of(value.upper())
        if allowed is None:
            notes.append(f"{var}={value} not understood, ignored")
            continue
        removed = kept & (set(_CPU_FLAGS_OF_INTEREST) - allowed)
        if removed:
            kept -= removed
            notes.append(f"capped by {var}={value}")
    return frozenset(kept), "; ".join(notes) or None


def default_device() -> torch.device:
    """The device a user most likely means: CUDA, then MPS, then CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def device_of(model: nn.Module) -> torch.device:
    """Device of a model's first parameter or buffer (cpu for an empty model)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


_ISA_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
# oneDNN reads its cap once, when the process creates its first primitive (a float32 matmul
# may), and torch does not say which it read: mixprec takes the variables as they were when it
# was imported, before it multiplied anything itself
_ONEDNN_AT_IMPORT = {var: os.environ.get(var) for var in _ISA_VARS[:2]}
_assumed: dict[str, DeviceInfo] = {}


def caps_in_effect(requested: Mapping[str, str]) -> dict[str, str]:
    """The ISA caps this process's kernels run under, as the variables would spell them:
    oneDNN's as they were when mixprec was imported, ATen's capability as torch reports it
    where `requested` sets one (ATen too reads its variable once). A cap set later in a
    process whose torch already multiplied is in `requested` and not here."""
    caps = {var: value for var, value in _ONEDNN_AT_IMPORT.items() if value}
    if requested.get("ATEN_CPU_CAPABILITY"):
        caps["ATEN_CPU_CAPABILITY"] = torch.backends.cpu.get_cpu_capability()
    return caps


@cache
def _detect(type_: str, index: int | None, caps: tuple[str | None, ...]) -> DeviceInfo:
    if type_ == "cuda":
        idx = index if index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        return DeviceInfo(
            "cuda",
            props.name,
            idx,
            capability=(props.major, props.minor),
            total_memory=props.total_memory,
        )
    if type_ == "mps":
        return DeviceInfo("mps", f"Apple GPU (macOS {platform.mac_ver()[0]})")
    if type_ == "cpu":
        return _host_cpu(caps, refresh=False)
    raise PrecisionError(f"unknown device type {type_!r}; mixprec knows cpu, cuda and mps")


def _host_cpu(caps: tuple[str | None, ...], refresh: bool) -> DeviceInfo:
    """The host CPU under the ISA caps `caps`, rated by its measured GEMM ratios: cached per
    CPU model and flags, cap and torch version."""
    env = {var: value for var, value in zip(_ISA_VARS, caps, strict=True) if value}
    flags, cap = cap_cpu_flags(_cpu_flags(), env)
    name = _cpu_name()
    key = {
        "cpu": name,
        "flags": sorted(flags),
        "isa_cap": cap,
        "torch": torch.__version__,
    }
    path = gemm_ratio.cache_path()
    in_effect, _ = cap_cpu_flags(_cpu_flags(), caps_in_effect(env))
    if in_effect == flags:
        measured = gemm_ratio.cached(key, refresh=refresh)
        note = f"{measured.note()}; cached in {path}"
    else:
        # this process's GEMMs run under another cap than the one asked for: measuring them
        # would store one cap's speed under the other's key
        measured = gemm_ratio.lookup(key)
        why = (
            "not measured in this process: its kernels run under another ISA cap than the "
            "one asked for (oneDNN and ATen read theirs once, at the first matmul; set the cap "
            "before the process starts)"
        )
        note = f"{measured.note()}; read from {path}; {why}" if measured else why
    return DeviceInfo(
        "cpu",
        name,
        cpu_flags=flags,
        isa_cap=cap,
        gemm_ratios=measured.ratios if measured else None,
        gemm_note=note,
    )


def remeasure() -> DeviceInfo:
    """Measure the host CPU's GEMM ratios again, replacing the cached ones (say, a measurement
    taken while other work held the cores), and return the CPU's `DeviceInfo` rated by them;
    `detect` answers it from then on."""
    _detect.cache_clear()
    caps = tuple(os.environ.get(v) for v in _ISA_VARS)
    _host_cpu(caps, refresh=True)
    return detect("cpu")


def parse_device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device; PrecisionError naming the accepted kinds otherwise."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise PrecisionError(
            f"unknown device {device!r}; mixprec runs on 'cpu', 'cuda', 'cuda:N' and 'mps'"
        ) from None


def detect(device: torch.device | str | None = None) -> DeviceInfo:
    """Facts about `device` (default: the best available one), or the `DeviceInfo` assumed
    for its type by `assume`."""
    device = parse_device(device) if device is not None else default_device()
    if device.type in _assumed:
        return _assumed[device.type]
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PrecisionError(
            f"device {str(device)!r}: this torch ({torch.__version__}) sees no CUDA GPU"
            + ("" if torch.version.cuda else " (it is a CPU-only build)")
            + "; use device='cpu', or install a CUDA build of torch on a machine with a GPU"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise PrecisionError(
            f"device 'mps': this torch ({torch.__version__}) sees no Apple GPU"
            + ("" if torch.backends.mps.is_built() else " (it is built without MPS)")
            + "; MPS needs Apple silicon and macOS 12.3+; use device='cpu'"
        )
    return _detect(device.type, device.index, tuple(os.environ.get(v) for v in _ISA_VARS))


@contextmanager
def assume(info: DeviceInfo) -> Iterator[DeviceInfo]:
    """Within the block, `detect` answers `info` for devices of its type: every hardware
    check (Precision, Trainer, bench, doctor, "auto") then judges that device, not the host.

    For tests and for asking "what would happen on an H100 / an AVX2 CPU"; the code still
    runs on the real device, and nothing is measured: a described CPU is rated by the
    `gemm_ratios` it states, or by its flags alone. Process-wide, so not for use from several
    threads at once.
    """
    before = _assumed.get(info.type)
    _assumed[info.type] = info
    try:
        yield info
    finally:
        if before is None:
            del _assumed[info.type]
        else:
            _assumed[info.type] = before


# a 16-bit GEMM measured below this fraction of float32's speed rates its dtype slow; one
# measured at FAST_FROM or more rates bfloat16 fast whatever the flags say
SLOW_BELOW = 0.8
FAST_FROM = 1.25


def _times(ratio: float) -> str:
    return f"{ratio:.2g}x"


def _rated(prior: Support, ratio: float | None, dtype: torch.dtype) -> Support:
    """A CPU dtype's support from its flags (`prior`) and its measured GEMM ratio: below
    `SLOW_BELOW` slow, whatever the flags; else the flags' rating, which for bfloat16 a ratio
    of `FAST_FROM` raises to fast and one of `SLOW_BELOW` raises to supported. float16 is never
    raised: its convolutions are slow on CPUs without amx_fp16 however fast its GEMM is. Where
    the measurement and the flags disagree the reason says so, never a speed its rating
    contradicts."""
    if ratio is None:
        return prior
    measured = f"its GEMMs measured {_times(ratio)} float32's speed here"
    if ratio < SLOW_BELOW:
        if prior.status == SLOW:
            return Support(SLOW, f"{measured}; {prior.reason}")
        return Support(SLOW, f"{measured}, slower than its flags predict ({prior.reason})")
    if dtype != torch.bfloat16:
        if prior.status == SLOW:
            return Support(SLOW, f"{measured}, but rated by its convolutions: {prior.reason}")
        return Support(prior.status, f"{prior.reason}; {measured}")
    if prior.status == FAST:
        return Support(FAST, f"{prior.reason}; {measured}")
    status, speed = (FAST, "") if ratio >= FAST_FROM else (SUPPORTED, ", about float32's")
    if prior.status == SLOW:
        return Support(status, f"{measured}{speed}, not what its flags predict ({prior.reason})")
    return Support(status, f"{measured}{speed}; {prior.reason}")


def _cpu_prior(dtype: torch.dtype, flags: frozenset[str]) -> Support:
    """What a CPU's flags predict for bfloat16 or float16, before any measurement."""
    if dtype == torch.bfloat16:
        if flags & {"amx_bf16", "avx512_bf16"}:
            have = "/".join(sorted(flags & {"amx_bf16", "avx512_bf16"}))
            return Support(FAST, f"bfloat16 matrix instructions ({have})")
        if "apple_silicon" in flags:
            return Support(SUPPORTED, "Apple silicon: bfloat16 at about float32 speed")
        if "avx512bw" in flags:
            return Support(
                SLOW,
                "no avx512_bf16/amx_bf16: converted to float32 in software with AVX-512, "
                "slower than float32",
            )
        return Support(SLOW, "no bf16 or avx512 instructions: emulated, slower than float32")
    if "amx_fp16" in flags:
        return Support(
            SUPPORTED,
            "float16 matrix instructions (amx_fp16); "
            "convolutions may still use slow float16 kernels",
        )
    if "avx512_fp16" in flags or "apple_silicon" in flags:
        return Support(
            SLOW,
            "float16 matmuls near float32 speed (avx512_fp16), but "
            "convolutions and most other float16 ops fall back to slow "
            "kernels (a CNN step measured ~100x slower than float32)",
        )
    return Support(
        SLOW,
        "no float16 hardware (no avx512_fp16/amx_fp16): converted in software, and float16 "
        "convolutions fall back to slow kernels",
    )


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
            return _rated(_cpu_prior(dtype, info.cpu_flags), ratios.get(dtype_name(dtype)), dtype)
    if info.type == "cuda":
        major, minor = info.capability or (0, 0)
        cc = f"compute capability {major}.{minor}"
        if dtype == torch.float32:
            if major >= 8:
                return Support(FAST, f"baseline ({cc}; TF32 tensor cores if enabled)")
            return Support(FAST, "baseline")
        if dtype == torch.float64:
            return Support(SUPPORTED, "runs; most GPUs have a low float64 rate")
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
            if torch.backends.mps.is_macos_or_newer(14, 0):
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
    16 bits."""
    if info.type != "cpu":
        return frozenset()
    tiles = {torch.bfloat16: "amx_bf16", torch.float16: "amx_fp16"}
    return frozenset(dtype for dtype, flag in tiles.items() if flag not in info.cpu_flags)


def policy_support(policy: Any, info: DeviceInfo) -> Support:
    """The worst support over every dtype a policy (or each policy of a map) uses, and for
    a quantized policy its format's own rating (`Format.rate`): float8 needs float8 matmul
    hardware (`float8_support`), block-scaled formats (mxfp8, mxfp6, mxfp4, nvfp4) are
    emulated everywhere (`microscaling_support`), int8 saves memory but not time on x86
    CPUs without VNNI (`int8_support`), and int4 runs anywhere.

    The reason is the map's default policy's unless another policy of the map is worse: a
    bf16-mixed map is fast because of bfloat16, not because of its float32 islands."""
    pmap = as_map(policy)
    others = sorted(pmap.policies() - {pmap.default}, key=lambda p: p.name)
    worst = Support(FAST, "")
    for p in [pmap.default, *others]:
        rated = p.format.rate(info) if isinstance(p, QuantizedPolicy) else None
        if rated is not None and (rated.status.rank > worst.status.rank or not worst.reason):
            worst = Support(rated.status, f"{p.mode}: {rated.reason}")
        # storage matters only if refused; speed is decided by the compute dtype
        for dtype in dict.fromkeys((p.compute_dtype, p.param_dtype, p.output_dtype)):
            s = dtype_support(dtype, info)
            if dtype != p.compute_dtype and s.status != REFUSED:
                continue
            if s.status.rank > worst.status.rank or not worst.reason:
                worst = Support(s.status, f"{dtype_name(dtype)}: {s.reason}")
    return worst


def support_matrix(info: DeviceInfo | None = None) -> dict[str, Support]:
    """Support of each common precision on the device (default: the best available)."""
    info = info or detect()
    return {name: policy_support(Policy(name), info) for name in MATRIX_PRECISIONS}


def resolve_auto(info: DeviceInfo) -> Policy:
    """The fastest precision that keeps training stable on the device `info` describes:
    bf16 mixed where bf16 is fast, float16 mixed (with loss scaling) where only float16 is,
    else float32."""
    for name in ("bf16-mixed", "16-mixed"):
        if policy_support(Policy(name), info).status == FAST:
            return Policy(name)
    return Policy("32-true")


ALLOW_SLOW_ENV = "MIXPREC_ALLOW_SLOW"

# Where each low-precision dtype has fast matmul/convolution hardware.
_FAST_ON: dict[torch.dtype, str] = {
    torch.bfloat16: (
        "NVIDIA GPUs of compute capability 8.0+ (A100, RTX 30xx, H100 and newer), "
        "CPUs with avx512_bf16 (AMD Zen 4+, Intel Cooper Lake) or amx_bf16 "
        "(Intel Sapphire Rapids+), Apple silicon (M2+)"
    ),
    torch.float16: (
        "NVIDIA GPUs of compute capability 7.0+ (V100, T4 and newer), Apple silicon; "
        "on CPUs only those with amx_fp16 (Intel Granite Rapids+), for matmuls"
    ),
}


def fast_on(dtype: torch.dtype) -> str | None:
    """The hardware on which `dtype` training is fast (None for float32/float64)."""
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
    policy = as_map(policy)
    s = policy_support(policy, info)
    name = policy.name
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
        where = where or fast_on(_slowest_dtype(policy, info))
        raise SlowPrecisionError(
            f"precision {name!r} runs on {info.describe()} but slower than float32 "
            f"({s.reason}). It is fast on {where}. To run it here anyway (e.g. to study its "
            "numerics on small tensors) pass allow_slow=True (Precision), "
            "allow_slow_precision=True (Trainer), --allow-slow (mixprec bench), or set "
            f"{ALLOW_SLOW_ENV}=1; or pick one that is fast here: {', '.join(fast)}"
        )
    return s


def _slowest_dtype(policy: Any, info: DeviceInfo) -> torch.dtype:
    dtypes = {p.compute_dtype for p in as_map(policy).policies()}
    return max(dtypes, key=lambda d: dtype_support(d, info).status.rank)


def warn_if_unsupported(policy: Any, device: torch.device | str | None = None) -> None:
    """Warn (never raise) when a policy is slow or refused here: for tools that convert or
    diagnose numerics in any precision, which can be studied anywhere.

    The warning names the policy of the map that is slow (the default one first), not the
    map: '16-mixed' with or without rules is one message, which Python's warning filters
    then show once per place. ``MIXPREC_ALLOW_SLOW=1`` silences it for a slow policy, as it
    lifts `check`'s error: whoever set it knows; a refused one is still said."""
    info = detect(device)
    s = policy_support(policy, info)
    if s.status == SLOW and allow_slow_from_env():
        return
    if s.status in (SLOW, REFUSED):
        pmap = as_map(policy)
        others = sorted(pmap.policies() - {pmap.default}, key=lambda p: p.name)
        # max keeps the first of equals: the default policy when it is as bad as any rule
        worst = max([pmap.default, *others], key=lambda p: policy_support(p, info).status.rank)
        warnings.warn(
            f"precision {worst.name!r} is {s.status} on {info.describe()}: {s.reason}",
            SlowPrecisionWarning,
            stacklevel=caller_level(),
        )
