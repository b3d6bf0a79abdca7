"""The device in hand: what it is (`DeviceInfo`: type, name, CPU flags after any ISA cap,
compute capability, a CPU's measured GEMM ratios), `detect`ed or described (`assume`).

Facts only: how well a device runs a dtype, a policy or a format is rated above, by
`mixprec.hardware` and each format's `Format.rate`. A CPU's GEMM ratios are measured once per
configuration and cached (`gemm_ratio`); the ISA caps torch users set
(``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``) cap the flags.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache

import torch
from torch import nn

from mixprec.device import gemm_ratio
from mixprec.dtypes import dtype_name
from mixprec.errors import PrecisionError

__all__ = [
    "DeviceInfo",
    "assume",
    "assumed",
    "default_device",
    "detect",
    "device_of",
    "parse_device",
    "remeasure",
]


@dataclass(frozen=True)
class DeviceInfo:
    """Facts about one device that decide which precisions are fast on it.

    Attributes:
        type: "cpu", "cuda" or "mps".
        name: the CPU model or GPU name.
        index: the CUDA device index (None elsewhere).
        cpu_flags: the CPU's instruction flags that matter here, after any ISA cap, spelled
            as /proc/cpuinfo spells them (lower case, e.g. "avx512_bf16").
        capability: a CUDA GPU's compute capability, (major, minor).
        total_memory: a GPU's memory in bytes.
        torch_version: the torch the facts were gathered with.
        isa_cap: which ISA cap (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``) applied.
        gemm_ratios: on a CPU, the measured GEMM speed of "bfloat16" and "float16" against
            float32 (below 1: slower than float32); `detect` measures the host's (on one thread,
            cached per machine), a described CPU states them or, left None, is rated by its
            flags alone.
        gemm_note: how and when `gemm_ratios` were measured, shown by `mixprec info`.
        macos: on an Apple GPU ("mps"), the macOS version, (major, minor): `detect` reads
            the host's; a described one left None is taken as a current macOS (14+).
        unknown_flags: the flags of interest whose presence could not be read (a host whose
            /proc/cpuinfo lists no flags and whose torch cannot name them all): the ratings
            say "flags unknown" for them instead of claiming they are absent.
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
    macos: tuple[int, int] | None = None
    unknown_flags: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"DeviceInfo.type is 'cpu', 'cuda' or 'mps', got {self.type!r}")
        for name in ("capability", "macos"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, tuple)
                and len(value) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            ):
                raise ValueError(
                    f"DeviceInfo.{name} is a (major, minor) tuple of ints, e.g. (9, 0), got "
                    f"{value!r}"
                )
        if self.type == "cuda" and self.capability is None:
            raise ValueError("a cuda DeviceInfo needs its capability, e.g. (9, 0) for an H100")
        for name in ("cpu_flags", "unknown_flags"):
            _check_flags(name, getattr(self, name))
        if both := self.cpu_flags & self.unknown_flags:
            raise ValueError(f"DeviceInfo: {sorted(both)} cannot be both in cpu_flags and unknown")
        if self.gemm_ratios is None:
            return
        names = {dtype_name(d) for d in gemm_ratio.DTYPES}
        ratios = dict(self.gemm_ratios)
        bad = {
            k: v
            for k, v in ratios.items()
            if k not in names
            or not isinstance(v, float | int)
            or isinstance(v, bool)
            or not 0 < v < float("inf")
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
            shown = ", ".join(sorted(self.cpu_flags & set(_CPU_FLAGS_OF_INTEREST)))
            flags = shown or "no bf16/fp16 matrix extensions"
            if self.unknown_flags:
                unknown = f"flags unknown: {', '.join(sorted(self.unknown_flags))}"
                flags = f"{shown}; {unknown}" if shown else unknown
            cap = f"; {self.isa_cap}" if self.isa_cap else ""
            return f"cpu ({self.name}; {flags}{cap}; {_threads(torch.get_num_threads())})"
        return f"{self.device} ({self.name})"


def _check_flags(name: str, flags: object) -> None:
    """Refuse CPU flags not spelled as /proc/cpuinfo spells them: a described "AVX512_BF16"
    or "avx512-bf16" matched no flag mixprec reads, and the CPU was rated as lacking it."""
    if not isinstance(flags, frozenset) or not all(isinstance(f, str) for f in flags):
        raise ValueError(
            f"DeviceInfo.{name} is a frozenset of flag names as /proc/cpuinfo spells "
            f"them (lower case, e.g. frozenset({{'avx512_bf16'}})), got {flags!r}"
        )
    for flag in sorted(flags):
        expected = "_".join(flag.lower().replace("-", "_").split())
        if not flag or flag != expected:
            raise ValueError(
                f"DeviceInfo.{name}: {flag!r} is not spelled as /proc/cpuinfo spells flags "
                f"(lower case, '_' between words, no blanks or '-'): {expected!r}?"
            )


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


# the names platform.machine() gives an x86-64 CPU (Linux and macOS, Windows)
_X86_64_MACHINES = frozenset({"x86_64", "amd64"})
# torch's names (`torch.cpu.get_capabilities`) of the flags /proc/cpuinfo spells otherwise
_PROC_NAMES = {
    f"avx512_{part}": f"avx512{part}" for part in ("f", "cd", "dq", "bw", "vl", "ifma", "vbmi")
}


def _cpu_flags() -> tuple[frozenset[str], frozenset[str]]:
    """The host CPU's instruction flags, spelled as /proc/cpuinfo spells them, and the flags of
    interest whose presence could not be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                # (x86 names them "flags", Arm "Features": bf16, i8mm, sve...)
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split()), frozenset()
    except OSError:
        pass
    if platform.machine() == "arm64" and platform.system() == "Darwin":
        return frozenset({"apple_silicon"}), frozenset()
    return _torch_cpu_flags()


def _torch_cpu_flags() -> tuple[frozenset[str], frozenset[str]]:
    """The flags torch reads with CPUID where /proc/cpuinfo lists none (Windows, Intel Macs,
    sandboxes): all of them from `torch.cpu.get_capabilities`, or, from a torch without it,
    the few x86 flags its older probes read, the others of interest unknown. Taking "no
    flags read" for "none there" rated int8 fast on CPUs where it is slower than float32."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        found = {_PROC_NAMES.get(k, k) for k, v in capabilities().items() if v is True}
        return frozenset(found), frozenset()
    if platform.machine().lower() not in _X86_64_MACHINES:
        return frozenset(), frozenset({"bf16"})  # (Arm's, which the probes do not read)
    probes = {
        "avx2": torch.cpu._is_avx2_supported,
        "avx512f": torch.cpu._is_avx512_supported,
        "avx512_vnni": torch.cpu._is_vnni_supported,
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported,
        "amx_fp16": torch.cpu._is_amx_fp16_supported,
    }
    found = {"sse2"} | {flag for flag, probe in probes.items() if probe()}  # (x86-64's baseline)
    if torch.cpu._is_amx_tile_supported():
        found |= {"amx_bf16", "amx_int8"}  # (every CPU with AMX tiles has both)
    unknown = {"avx_vnni"} | ({"avx512bw", "avx512_fp16"} if "avx512f" in found else set())
    return frozenset(found), frozenset(unknown)


def _cpu_name() -> str:
    """The CPU's model name (x86), or its implementer and part numbers (Arm, whose
    /proc/cpuinfo has no model name: "arm 0x41:0xd40", a Neoverse V1): part of the key the
    GEMM ratios are cached under, so two CPUs must not share one."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    return value.strip()
                if key in ("CPU implementer", "CPU part") and key not in fields:
                    fields[key] = value.strip()
    except OSError:
        pass
    if len(fields) == 2:
        return f"{platform.machine()} {fields['CPU implementer']}:{fields['CPU part']}"
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
# the oneDNN levels that take avx_vnni's kernels
_AVX_VNNI_LEVELS = frozenset({"AVX2_VNNI", "AVX2_VNNI_2", "ALL", "DEFAULT"})
# ATen's CPU capability levels: they cap torch's own vectorised kernels (elementwise ops,
# reductions), not oneDNN's matrix multiplications and convolutions or the int8 kernels,
# which read the CPU themselves and which the flags above rate: no flag is taken away
_ATEN_LEVELS = ("default", "avx2", "avx512")


def _onednn_allowed(level: str) -> frozenset[str] | None:
    if level != level.strip():  # (oneDNN ignores " AVX2")
        return None
    allowed: set[str] = set()
    for names, flags in _ONEDNN_LEVELS:
        allowed |= flags
        if level.upper() in names:
            # (the AVX2 VNNI levels are a side branch: AVX512_CORE and its successors do not
            # take avx_vnni's kernels, only ALL does)
            if level.upper() not in _AVX_VNNI_LEVELS:
                allowed.discard("avx_vnni")
            return frozenset(allowed)
    return None


def _aten_allowed(level: str) -> frozenset[str] | None:
    # (ATen warns "ignoring invalid value" for any other spelling, "AVX2" included)
    return frozenset(_CPU_FLAGS_OF_INTEREST) if level in _ATEN_LEVELS else None


def cap_cpu_flags(
    flags: frozenset[str], environ: Mapping[str, str]
) -> tuple[frozenset[str], str | None]:
    """The CPU flags left usable under the ISA caps users already set for torch's kernels
    (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``), and a note saying which cap applied.

    Capping oneDNN to AVX2 on a CPU with AMX makes its bf16 kernels as slow as an AVX2 CPU's,
    so the support matrix follows the cap. ATen's capability caps torch's own elementwise
    kernels, not oneDNN's matrix multiplications (bfloat16 GEMMs run as fast under
    ``ATEN_CPU_CAPABILITY=avx2``): it takes no flag away, and the note says so.

    Each variable is read as its library reads it: oneDNN takes ``ONEDNN_MAX_CPU_ISA`` over
    ``DNNL_MAX_CPU_ISA`` and ignores a value with blanks around it; ATen takes only its
    lowercase names (``avx2``, ``avx512``, ``default``). A value its library ignores caps
    nothing here either, and the note says so.
    """
    kept = set(flags)
    notes = []
    for var, allowed_of in (
        ("ONEDNN_MAX_CPU_ISA", _onednn_allowed),
        ("DNNL_MAX_CPU_ISA", _onednn_allowed),
        ("ATEN_CPU_CAPABILITY", _aten_allowed),
    ):
        value = environ.get(var, "")
        if not value:
            continue
        if var == "DNNL_MAX_CPU_ISA" and environ.get("ONEDNN_MAX_CPU_ISA"):
            notes.append(f"{var}={value!r} ignored: ONEDNN_MAX_CPU_ISA is set (oneDNN's rule)")
            continue
        allowed = allowed_of(value)
        if allowed is None:
            notes.append(f"{var}={value!r} not understood (its library ignores it), ignored")
            continue
        removed = kept & (set(_CPU_FLAGS_OF_INTEREST) - allowed)
        if removed:
            kept -= removed
            notes.append(f"capped by {var}={value}")
        elif var == "ATEN_CPU_CAPABILITY" and value != "avx512":
            notes.append(
                f"{var}={value} caps torch's own kernels, not oneDNN's matrix "
                f"multiplications: no flag capped"
            )
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
    if requested.get("ATEN_CPU_CAPABILITY"):  # (torch says "AVX2"; the variable, "avx2")
        caps["ATEN_CPU_CAPABILITY"] = torch.backends.cpu.get_cpu_capability().lower()
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
        version = platform.mac_ver()[0]
        parts = [int(v) for v in version.split(".")[:2] if v.isdigit()] + [0, 0]
        macos = (parts[0], parts[1])
        if macos < (11, 0):  # (a Python built against an older SDK says 10.16 on macOS 11+)
            macos = (14, 0) if torch.backends.mps.is_macos_or_newer(14, 0) else (13, 0)
        return DeviceInfo("mps", f"Apple GPU (macOS {version})", macos=macos)
    if type_ == "cpu":
        return _host_cpu(caps, refresh=False)
    raise PrecisionError(f"unknown device type {type_!r}; mixprec knows cpu, cuda and mps")


def _host_cpu(caps: tuple[str | None, ...], refresh: bool) -> DeviceInfo:
    """The host CPU under the ISA caps `caps`, rated by its measured GEMM ratios: cached per
    CPU model and flags, cap, torch version and the measurement's method."""
    env = {var: value for var, value in zip(_ISA_VARS, caps, strict=True) if value}
    found, unknown = _cpu_flags()
    flags, cap = cap_cpu_flags(found, env)
    unknown, _ = cap_cpu_flags(unknown, env)  # (one the cap keeps kernels from is not there)
    name = _cpu_name()
    key = {
        "cpu": name,
        "flags": sorted(flags),
        "isa_cap": cap,
        "torch": torch.__version__,
        "method": gemm_ratio.METHOD,
    }
    path = gemm_ratio.cache_path()
    in_effect, _ = cap_cpu_flags(found, caps_in_effect(env))
    if in_effect == flags:
        measured, unstored = gemm_ratio.cached(key, refresh=refresh)
        where = f"cached in {path}" if unstored is None else f"not cached ({unstored})"
        note = f"{measured.note()}; {where}"
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
        unknown_flags=unknown,
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
    if device.type == "cuda" and device.index is not None:
        _check_cuda_index(device.index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise PrecisionError(
            f"device 'mps': this torch ({torch.__version__}) sees no Apple GPU"
            + ("" if torch.backends.mps.is_built() else " (it is built without MPS)")
            + "; MPS needs Apple silicon and macOS 12.3+; use device='cpu'"
        )
    return _detect(device.type, device.index, tuple(os.environ.get(v) for v in _ISA_VARS))


def _check_cuda_index(index: int) -> None:
    """Refuse a GPU index this process does not see: torch's own check is an assertion, which
    `mixprec info --device cuda:1` on a one-GPU machine printed as a traceback."""
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        visible = ", ".join(f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(count))
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        which = (
            "CUDA_VISIBLE_DEVICES is not set"
            if shown is None
            else f"CUDA_VISIBLE_DEVICES={shown!r} shows it only those, numbered from 0"
        )
        raise PrecisionError(
            f"device 'cuda:{index}': this process sees {count} CUDA GPU(s), {visible}; {which}"
        )


def assumed(device_type: str) -> bool:
    """Whether devices of ``device_type`` are described now (`assume`), not the host's: what
    is measured on the host then says nothing of them."""
    return device_type in _assumed


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
