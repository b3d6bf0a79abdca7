"""The hand-written CPU kernels of the commonest low-bit step, Adam/AdamW on float32
parameters and gradients with int8, int4 or float8 moments and no compensation, and of the
float8 codec of a tensor stored once, the ``fp8`` storage of saved activations (`native.c`).

Where it applies it stands in for the compiled update (`kernels.run_compiled`): the same
arithmetic as the eager update, one pass a block while the block sits in L1, where inductor's
build reads the code tables element by element and pays dynamo's call (benchmarks/results/
states_step.md has the times). It is built with the host's C compiler on first use, as
inductor builds its kernels, for the instruction sets torch's own kernels use
(`torch.backends.cpu.get_cpu_capability`), cached beside mixprec's other caches
(``MIXPREC_CACHE_DIR``), and called through ``ctypes``. Under ``compile=None`` it also steps
what is too small to compile. Where it cannot be built (no compiler, no OpenMP, a cache that
cannot be written), or with ``MIXPREC_NATIVE=0``, the compiled (or eager) update runs as before.
The codec's kernels (`fp8_encode`, `fp8_decode`) code float32 and bfloat16 tensors bit for bit
as the states' codec does, a block in L1 at a time, without dynamo's guards before each call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from mixprec.device.gemm_ratio import cache_path
from mixprec.optim.states.codecs import (
    _E4M3_VALUES,
    Float8Codec,
    Int4Codec,
    Int8Codec,
    StateCodec,
    _Decades,
    state_codec,
)

__all__ = ["NATIVE_ENV", "adam", "fp8_decode", "fp8_encode", "library"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
# set to 0 to run the compiled update instead
NATIVE_ENV = "MIXPREC_NATIVE"
# the codecs the kernel decodes and encodes, by the number it knows each by
_BITS: dict[type, int] = {Int8Codec: 8, Int4Codec: 4, Float8Codec: 0}
_LIBRARY: list[ctypes.CDLL | None] = []
_DECADES: dict[tuple[type, bool], torch.Tensor] = {}


def _flags() -> list[str]:
    """The compiler's flags: IEEE arithmetic as the eager update's (no fused multiply-add
    where it rounds twice, no fast math), vectorized for the instruction sets torch's kernels
    use in this process (capped by ``ATEN_CPU_CAPABILITY``, as on an AVX2-only CPU)."""
    isa = {
        "AVX512": ["-march=native", "-mprefer-vector-width=512"],
        "AVX2": ["-mavx2", "-mfma"],
    }.get(torch.backends.cpu.get_cpu_capability(), [])
    if platform.machine() not in ("x86_64", "AMD64"):
        isa = ["-mcpu=native"] if platform.machine() in ("aarch64", "arm64") else []
    # torch's lerp is one fused multiply-add where its kernels are vectorized (not on an x86
    # CPU capped to no vector extension, where it rounds twice)
    fused = int(bool(isa))
    base = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
    return [*base, *isa, f"-DMIXPREC_FUSED_LERP={fused}", "-fopenmp", "-shared", "-fPIC"]


def _host() -> str:
    """What the build depends on besides the source and flags: the CPU (``-march=native``)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [x for x in info.splitlines() if x.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "\n".join([platform.machine(), *lines])


def _build() -> ctypes.CDLL | None:
    """The kernel's library: loaded from the cache, or compiled into it (written under a
    temporary name, then renamed, so a concurrent process reads a whole file or none)."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.info("no C compiler: the low-bit update runs compiled by torch instead")
        return None
    flags = _flags()
    digest = hashlib.sha256(
        "\0".join([SOURCE.read_text(), compiler, *flags, _host()]).encode()
    ).hexdigest()[:20]
    folder = cache_path().parent / "native"
    path = folder / f"lowbit-{digest}.so"
    try:
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            handle, temp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(handle)
            done = subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", temp], capture_output=True, text=True
            )
            if done.returncode != 0:
                os.unlink(temp)
                raise OSError(done.stderr.strip().splitlines()[-1:] or done.returncode)
            os.replace(temp, path)
        library = ctypes.CDLL(str(path))
    except OSError as error:  # (no cache folder, a compiler that fails, a library not loaded)
        log.info("the low-bit kernel did not build (%s): the update runs as before", error)
        return None
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.mixprec_adam.argtypes = [pointer] * 11 + [i64, i32, i32, i32, i32]
    library.mixprec_adam.restype = None
    library.mixprec_max_block.restype = i32
    # the largest block its stack scratch takes (asked once: the codec checks each save)
    library.max_block = library.mixprec_max_block()
    library.mixprec_fp8_encode.argtypes = [pointer, i32, i64, pointer, i64, pointer, pointer]
    library.mixprec_fp8_encode.argtypes += [i32, i32]
    library.mixprec_fp8_encode.restype = None
    library.mixprec_fp8_decode.argtypes = [pointer, pointer, i64, i32, pointer, i64, pointer]
    library.mixprec_fp8_decode.argtypes += [i32, i32]
    library.mixprec_fp8_decode.restype = None
    return library


def library() -> ctypes.CDLL | None:
    """The built kernel, or None where it is switched off or cannot be built (once a process)."""
    if not _LIBRARY:
        off = os.environ.get(NATIVE_ENV, "1") == "0"
        _LIBRARY.append(None if off else _build())
    return _LIBRARY[0]


def _decades(codec: StateCodec, signed: bool) -> torch.Tensor:
    """The float32 constants of a dynamic map's nearest code (int8's, int4's first moment's)
    in `native.c`'s ``decades_t`` layout: the values the eager update's comparisons and
    products round them to."""
    key = (type(codec), signed)
    if key not in _DECADES:
        maps = codec._D  # type: ignore[attr-defined]
        d: _Decades = maps[signed] if isinstance(maps, dict) else maps
        padded = [list(x) + [0.0] * (8 - len(x)) for x in (d.slopes, d.offsets, d.uppers)]
        values = [*padded[0], *padded[1], *padded[2], d.end_slope, d.end_offset, d.zero]
        values += [d.zero_positive, d.one, float(d.last)]
        _DECADES[key] = torch.tensor(values, dtype=torch.float32)
    return _DECADES[key]


def adam(args: tuple) -> bool:
    """Run `kernels.adam_update`'s ``args`` through the kernel and return True, or return
    False (nothing ran) where it does not apply: not a CPU tensor, not float32 parameters and
    gradients, not int8, int4 or float8 moments, a compensation, a strided tensor, or a block
    past the kernel's stack scratch."""
    p, g, m, m_scales, v, v_scales, tables, buf, hp, _key, kind, block, decoupled, comp = args
    codec = state_codec(kind)
    bits = _BITS.get(type(codec))
    if (
        bits is None
        or comp is not None
        or p.device.type != "cpu"
        or p.dtype != torch.float32
        or g.dtype != torch.float32
        or hp.dtype != torch.float32
    ):
        return False
    lib = library()
    if lib is None or block > lib.max_block:
        return False
    if not all(t.is_contiguous() for t in (p, g, m, m_scales, v, v_scales, hp)):
        return False
    if bits == 0:  # (float8: the codes are e4m3 bytes, read as values; no decades read)
        tables, codec = (_E4M3_VALUES, _E4M3_VALUES), state_codec("int8")
    # (int4's second map is linear: its decades are not read)
    first, second = _decades(codec, True), _decades(codec, bits == 4)
    ptr = torch.Tensor.data_ptr
    lib.mixprec_adam(
        ptr(p), ptr(g), ptr(m), ptr(m_scales), ptr(v), ptr(v_scales),
        ptr(tables[0]), ptr(tables[1]), ptr(hp), ptr(first), ptr(second),
        p.numel() // block, block, bits, int(decoupled), torch.get_num_threads(),
    )  # fmt: skip
    # (written through pointers: autograd's in-place checks must still see the write)
    torch.autograd.graph.increment_version(p)
    return True


# the dtypes the codec's kernels read and write, by the number `native.c` knows each by
_CODEC_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _codec_library(device: torch.device, dtype: torch.dtype, block: int) -> ctypes.CDLL | None:
    """The kernel's library where its codec takes a `dtype` tensor on `device` in blocks of
    `block`, else None."""
    if device.type != "cpu" or dtype not in _CODEC_DTYPES:
        return None
    lib = library()
    return lib if lib is not None and block <= lib.max_block else None


def fp8_encode(
    flat: torch.Tensor, block: int, means: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`formats.quantize` of the flat contiguous CPU tensor `flat` in the signed float8
    format of `block` elements a block: (e4m3 codes of whole blocks, float32 scales), or None
    where the kernel does not take it (not a float32 or bfloat16 CPU tensor, switched off or
    not built). With `means` (float32, one a row of a multiple of `block` elements), of
    ``flat``'s rows less their means in float32, a row of a mean not finite as zeros."""
    _check_block(block)
    lib = _codec_library(flat.device, flat.dtype, block)
    row = _row(flat.numel(), block, means)
    if lib is None or row is None or not flat.is_contiguous():
        return None
    blocks = -(-flat.numel() // block)
    codes = torch.empty(blocks * block, dtype=torch.uint8)
    scales = torch.empty(blocks, dtype=torch.float32)
    lib.mixprec_fp8_encode(
        flat.data_ptr(), _CODEC_DTYPES[flat.dtype], flat.numel(),
        None if means is None else means.data_ptr(), row, codes.data_ptr(), scales.data_ptr(),
        block, torch.get_num_threads(),
    )  # fmt: skip
    return codes.view(torch.float8_e4m3fn), scales


def fp8_decode(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    dtype: torch.dtype,
    block: int,
    means: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """`formats.dequantize` of `fp8_encode`'s codes and scales (blocks of `block`) to
    `numel` elements, cast to `dtype` (flat), each row's mean added in float32 before the
    cast where `means` is given; or None where the kernel does not take it (as `fp8_encode`,
    or codes and scales not contiguous CPU tensors). Codes and scales too few for `numel`
    elements raise: the kernel would read past them."""
    _check_block(block)
    if numel < 0:
        raise ValueError(f"numel must be at least 0, got {numel}")
    lib = _codec_library(codes.device, dtype, block)
    row = _row(numel, block, means)
    if (
        lib is None
        or row is None
        or scales.device.type != "cpu"
        or not (codes.is_contiguous() and scales.is_contiguous())
    ):
        return None
    blocks = -(-numel // block)
    if codes.element_size() != 1 or scales.dtype != torch.float32:
        raise ValueError(
            f"fp8_decode takes one-byte codes and float32 scales, got {codes.dtype} codes and "
            f"{scales.dtype} scales"
        )
    if codes.numel() < blocks * block or scales.numel() < blocks:
        raise ValueError(
            f"{numel} elements in blocks of {block} take {blocks * block} codes and {blocks} "
            f"scales, got {codes.numel()} codes and {scales.numel()} scales"
        )
    out = torch.empty(numel, dtype=dtype)
    lib.mixprec_fp8_decode(
        codes.data_ptr(), scales.data_ptr(), numel, block,
        None if means is None else means.data_ptr(), row, out.data_ptr(),
        _CODEC_DTYPES[dtype], torch.get_num_threads(),
    )  # fmt: skip
    return out


def _check_block(block: int) -> None:
    if block < 1:
        raise ValueError(f"the codec's block must be at least 1 element, got {block}")


def _row(numel: int, block: int, means: torch.Tensor | None) -> int | None:
    """The elements of a row `means` holds one float32 mean each of (0 without means), or
    None where the kernel cannot take them: rows of a length that is not a whole number of
    blocks (a block would span two means), or means that are not a contiguous float32
    CPU tensor."""
    if means is None:
        return 0
    if means.dtype != torch.float32 or means.device.type != "cpu" or not means.is_contiguous():
        return None
    if not means.numel() or numel % means.numel():
        return None
    row = numel // means.numel()
    return row if row % block == 0 else None
