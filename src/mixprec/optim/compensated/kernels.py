"""The elementwise math of a compensated step, one function for the compiled and the eager
path.

One step is one pass: each parameter's whole update (moments, step, Kahan buffer, both
stochastic roundings) is one elementwise function of its 16-bit tensors (``_adam``,
``_sgd``), the math in float32 (float64 for float64 parameters), run by ``torch.compile``
as one fused kernel that reads and writes the 16-bit tensors once. Adam's second moment and
the Kahan buffer are written back with stochastic rounding in both modes: each increment of
the second moment is below half a bfloat16 step at usual beta2, so rounding it to nearest
freezes it, and the buffer's own rounding errors add up the same way. The first moment and
SGD's momentum round to nearest. State kept in float32 beside 16-bit weights is stored as
computed: only 16-bit tensors are rounded.

bfloat16 tensors are stepped as int32 pairs (``_Lanes``): each value is read as a float32
by moving it into the high half, and written back from the high half of its result
(rounded by integer arithmetic on those bits), so the kernel sees 32-bit types only, which
inductor's C++ kernels vectorize with native conversions (16-bit lanes fall back to scalar
loops).

The random bits: element i of a call takes the two 16-bit halves of ``_hash(i + key)``, a
bijection of the 32-bit values, with ``key`` hashed from (seed, step count, parameter
index, part) (`call_key`): each element's two values are uniform and independent, and the
state is the seed and the step counts, so a resumed run is bit-identical.

The same functions run eagerly where nothing is compiled and give bit-identical results on
a CPU: every operation is correctly rounded in both (inductor compiles without
floating-point contraction and keeps the 16-bit round trips), and eager float32 ``sqrt``,
which is not, is taken in float64 (``_sqrt``). On CUDA, Triton may fuse a multiply and an
add, so the two can differ in the last bit there. Design notes and measured costs:
docs/pure-bf16.md.
"""

from __future__ import annotations

import functools
import logging
import math
import shutil
import sys
from collections.abc import Callable

import torch

from mixprec.optim.compensated.rules import COMPENSATED_DTYPES

__all__ = [
    "KERNELS",
    "call_key",
    "can_compile",
    "compiled_step",
    "on_memory",
    "stochastic_round_",
]

log = logging.getLogger(__name__)

# the odd multipliers of ``_hash`` (0x7FEB352D and 0x846CA68B as int32)
_MIX = (0x7FEB352D, 0x846CA68B - (1 << 32))
# the float32 bits of a bfloat16: the high half
_HIGH = -(1 << 16)
_MASK64 = (1 << 64) - 1


def stochastic_round_(
    dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None
) -> None:
    """Write ``src`` into the 16-bit ``dst``, rounding up or down at random with probability
    proportional to the distance, so the result equals ``src`` on average (the rounding of
    the compensated steps, with 16 random bits per element drawn from ``generator``)."""
    if src.shape != dst.shape:
        raise ValueError(
            f"stochastic_round_ writes src into dst of the same shape: got src of shape "
            f"{list(src.shape)} into dst of shape {list(dst.shape)}"
        )
    noise = torch.randint(
        0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=generator
    )
    dst.copy_(_round_stochastic(src.to(torch.float32), noise, dst.dtype))


# -- the elementwise step (one function for the compiled and the eager path) -----------------


def _lsr(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int32 ``x`` (torch's ``>>`` on int32 copies the sign bit)."""
    return (x >> shift) & ((1 << (32 - shift)) - 1)


def _hash(x: torch.Tensor) -> torch.Tensor:
    """A bijection of the 32-bit values (int32, arithmetic modulo 2^32): xorshifts and two
    multiplications by odd constants (Wellons' "lowbias32", a well-mixing 32-bit hash)."""
    x = _mix(x)
    return x ^ _lsr(x, 16)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """``_hash`` but its last xorshift, which changes the low half only (``_noise`` takes
    that half as ``x ^ (x >> 16)``, one operation fewer)."""
    x = x ^ _lsr(x, 16)
    x = x * _MIX[0]
    x = x ^ _lsr(x, 15)
    return x * _MIX[1]


def _noise(
    n: int, start: int, key: torch.Tensor | int, device: torch.device, step: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two int32 tensors of ``n`` values in [0, 65536), for the elements ``start``,
    ``start + step``, ... of a call with ``key`` (a signed 32-bit offset: a one-element int32
    tensor compiled, an int eagerly): the low and the high half of ``_hash(i + key)``.

    With a uniform key, ``i + key`` is uniform over the 2^32 values for each element ``i``,
    so is its image under the bijection, and the two halves of a uniform 32-bit value are
    uniform and independent: each element's two values are exactly uniform, independent of
    each other and (independent keys) of other steps'; within a call no two elements share
    a 32-bit value. Compiled, this is integer arithmetic on the element's index, fused into
    the step."""
    i = torch.arange(start, start + n * step, step, dtype=torch.int32, device=device)
    x = _mix(i + key)
    return (x ^ (x >> 16)) & 0xFFFF, _lsr(x, 16)


def _round_stochastic(x: torch.Tensor, noise: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) rounded to a neighbouring ``dtype`` (bfloat16/float16) value: away
    from zero when ``65535 - noise`` (``noise`` int32 in [0, 65536)) is below 65536 times
    the fraction of the way there, else toward zero; in float32, exactly representable in
    ``dtype``. Unbiased to 2^-16 of a spacing (exactly for bfloat16); signed zeros and
    infinities pass unchanged, a NaN becomes a NaN (bfloat16: the quiet NaN).

    bfloat16 is the upper half of float32: ``_stochastic_bits`` of the NaN-quieted ``x``
    (a quiet NaN's payload cannot carry into the sign). float16 takes the spacing of its
    numbers at ``x``, ``ufp(x) * 2^-10`` with ``ufp(x)`` the power of two at or below
    ``|x|``: Rump's ``q - (1 - 2^-24) q`` with ``q = (2^23 + 1) |x|``, taken of
    ``|x| * 2^-24`` so that no finite ``x`` overflows, and at least the spacing of float16's
    subnormals (also for infinities, whose ``q - q`` is NaN); then ``floor`` of ``|x|`` in
    spacings, a comparison, and the sign put back: the same rule in float arithmetic."""
    if dtype == torch.bfloat16:
        if torch.compiler.is_compiling():  # (inductor vectorizes this, not nan_to_num)
            quiet = torch.where(x != x, math.nan, x)
        else:
            quiet = x.nan_to_num(nan=math.nan, posinf=math.inf, neginf=-math.inf)
        return _stochastic_bits(quiet, noise).view(torch.float32)
    magnitude = x.abs()
    q = magnitude * (2.0**-24 * (2.0**23 + 1))
    spacing = _at_least((q - q * (1 - 2.0**-24)) * 2.0**14, 2.0**-24)
    t = magnitude / spacing
    low = t.floor()
    up = ((noise ^ 0xFFFF).float() < (t - low) * 65536).to(x.dtype)
    return ((low + up) * spacing).copysign(x)


def _stochastic_bits(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The float32 bits of ``x`` rounded stochastically to bfloat16 (int32, low half zero):
    ``noise`` added to the 16 bits a bfloat16 drops, and the sum truncated (a carry means
    those bits exceed ``65535 - noise``). A NaN whose low 16 bits are not zero may carry
    into the sign: ``_round_stochastic`` quiets NaNs first; in the step every NaN is made by
    arithmetic on bfloat16 values and float32 scalars, whose low halves are zero."""
    return (x.view(torch.int32) + noise) & _HIGH


def _nearest_bits(x: torch.Tensor) -> torch.Tensor:
    """The float32 bits of ``x`` rounded to the nearest bfloat16, ties to even (int32, low
    half zero): torch's conversion for every number; NaNs as ``_stochastic_bits``."""
    bits = x.view(torch.int32)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) & _HIGH


def _at_least(x: torch.Tensor, bound: float) -> torch.Tensor:
    """``x`` where above ``bound``, else (NaN included) ``bound``: one ``where`` compiled;
    eagerly two cheaper operations with the same result (``torch.where`` is ten times
    slower than arithmetic on the eager CPU path)."""
    if torch.compiler.is_compiling():
        return torch.where(x > bound, x, bound)
    return x.nan_to_num(nan=bound).clamp_(min=bound)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded square root: eager float32 ``sqrt`` on a CPU is not (inductor's is,
    and the float64 root rounded to float32 is)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling():
        return x.double().sqrt_().float()
    return x.sqrt()


class _Lanes:
    """How the step reads and writes its tensors. bfloat16 ones come as int32 pairs (each
    int32 holds two bfloat16 values, the even element in its low half) and are rounded by
    integer arithmetic on the float32 bits of the results (``_nearest_bits``,
    ``_stochastic_bits``). Compiled, each pair is read as two float32 tensors by moving
    each half into the high half, and written back from the high halves of the results:
    the step sees 32-bit types only, which inductor's C++ kernels vectorize 16 at a time
    with native conversions (a 16-bit tensor makes them work 32 elements at a time, where
    int/float conversions and bit views fall back to scalar loops, much slower).
    Eagerly the same values are read and written through a bfloat16 view of the whole slice
    (half the operations of two halves). Other tensors are read in the math dtype and
    their results converted on copy."""

    def __init__(self, p: torch.Tensor, start: int, key: torch.Tensor | int) -> None:
        self.bits = p.dtype == torch.int32  # bfloat16 pairs, rounded through their bits
        self.pairs = self.bits and torch.compiler.is_compiling()  # read as two halves
        self.dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        self.start, self.key, self.device = start, key, p.device
        self.n = 2 * p.numel() if self.bits and not self.pairs else p.numel()

    def halves(self, *tensors: torch.Tensor | None) -> list[list[torch.Tensor | None]]:
        """The tensors' values in the math dtype: one list, or for pairs compiled the even
        and the odd elements."""
        if self.pairs:
            return [
                [None if t is None else (t << 16 if half == 0 else t & _HIGH).view(torch.float32)
                 for t in tensors]
                for half in (0, 1)
            ]  # fmt: skip
        if self.bits:
            return [[None if t is None else t.view(torch.bfloat16).float() for t in tensors]]
        return [[None if t is None else t.to(self.dtype) for t in tensors]]

    def noise(self, half: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pairs:
            return _noise(self.n, self.start + half, self.key, self.device, step=2)
        return _noise(self.n, self.start, self.key, self.device)

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded to nearest: bits for bfloat16 pairs, else as is (the copy
        converts)."""
        return _nearest_bits(x) if self.bits else x

    def value(self, rounded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The math-dtype value of ``nearest(x)`` once stored in ``dtype``."""
        if self.bits:
            return rounded.view(torch.float32)
        return rounded.to(dtype).to(self.dtype)

    def stochastic(self, x: torch.Tensor, noise: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x`` stochastically rounded for a tensor of ``dtype``: to its 16-bit grid, or
        as is for a float32/float64 one (state kept in float32 beside 16-bit weights stays
        float32 math; only 16-bit tensors are rounded)."""
        if self.bits:
            return _stochastic_bits(x, noise)
        if dtype not in COMPENSATED_DTYPES:
            return x
        return _round_stochastic(x, noise, dtype)

    def store(self, targets: list[torch.Tensor | None], halves: list[list]) -> None:
        """Write each half's results (per target) into ``targets`` (None: nothing)."""
        for j, t in enumerate(targets):
            if t is None:
                continue
            if self.pairs:
                t.copy_(_lsr(halves[0][j], 16) | halves[1][j])
            elif self.bits:
                t.view(torch.int16).copy_(halves[0][j] >> 16)
            else:
                t.copy_(halves[0][j])


def _apply(
    lanes: _Lanes,
    p: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    c: torch.Tensor | None,
    noise: torch.Tensor | None,
    kind: str | None,
) -> list[torch.Tensor | None]:
    """The new weight ``w + u`` (and Kahan buffer): Kahan-compensated with the buffer
    ``c``, stochastically rounded, or (``kind`` None, a parameter stepped plainly) rounded
    to nearest; results for ``lanes.store``."""
    if kind == "kahan":
        assert c is not None and noise is not None
        u = u + c  # what earlier roundings lost
        new = lanes.nearest(w + u)
        # the part of the update that made it into the parameter is exact in float32
        buffer = u - (lanes.value(new, p.dtype) - w)
        return [new, lanes.stochastic(buffer, noise, c.dtype)]
    if kind == "stochastic":
        assert noise is not None
        return [lanes.stochastic(w + u, noise, p.dtype), None]
    return [w + u, None]


def _adam(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    c: torch.Tensor | None,
    s: torch.Tensor | list[float],
    key: torch.Tensor | int,
    kind: str | None,
    decay: str | None,
    start: int,
) -> None:
    """One Adam/AdamW step of the tensors (weight, gradient, moments, Kahan buffer or None;
    all of one shape, or bfloat16 pairs: ``_Lanes``), in place. ``s``: beta1, (1 - beta1)
    times the sign of the gradient (-1 to maximize), beta2, 1 - beta2, 1 / sqrt(1 -
    beta2^step), eps, -lr / (1 - beta1^step), then (``decay`` "decoupled") -lr times the
    weight decay or (``decay`` "l2") the weight decay times the sign; a tensor of the math
    dtype compiled, floats eagerly. ``key``, ``start``: the random bits (``_noise``) of
    the first element. Out of place only: an in-place operation on a temporary splits the
    compiled kernel in two."""
    lanes = _Lanes(p, start, key)
    results = []
    for half, (w, grad, m0, v0, c0) in enumerate(lanes.halves(p, g, m, v, c)):
        if decay == "l2":  # the sign applies to the gradient before the decay
            grad = grad + w * s[7]
        m_new = m0 * s[0] + grad * s[1]
        v_new = v0 * s[2] + grad * grad * s[3]
        u = m_new / (_sqrt(v_new) * s[4] + s[5]) * s[6]
        if decay == "decoupled":
            u = u + w * s[7]
        first, second = (None, None) if kind is None else lanes.noise(half)
        v_out = v_new if first is None else lanes.stochastic(v_new, first, v.dtype)
        results.append([lanes.nearest(m_new), v_out, *_apply(lanes, p, w, u, c0, second, kind)])
    lanes.store([m, v, p, c], results)


def _sgd(
    p: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor | None,
    c: torch.Tensor | None,
    s: torch.Tensor | list[float],
    key: torch.Tensor | int,
    kind: str | None,
    decay: str | None,
    start: int,
) -> None:
    """One SGD step of the tensors (weight, gradient, momentum buffer or None, Kahan buffer
    or None), in place. ``s``: the sign of the gradient, momentum (0 on the buffer's first
    step), 1 - dampening (1 on the first step), the coefficients of the gradient and of the
    buffer in the update (nesterov: 1 and momentum, else 0 and 1), -lr, and (``decay``
    "l2") the weight decay; as for ``_adam``."""
    lanes = _Lanes(p, start, key)
    results = []
    for half, (w, grad, b0, c0) in enumerate(lanes.halves(p, g, b, c)):
        grad = grad * s[0]
        if decay == "l2":
            grad = grad + w * s[6]
        b_out = None
        if b0 is not None:
            b_new = b0 * s[1] + grad * s[2]
            b_out = lanes.nearest(b_new)
            grad = grad * s[3] + b_new * s[4]
        noise = None if kind is None else lanes.noise(half)[0]
        results.append([b_out, *_apply(lanes, p, w, grad * s[5], c0, noise, kind)])
    lanes.store([b, p, c], results)


# one function (one code object, so one torch.compile cache) per algorithm and kind: the
# flat tensors, the scalars ``s``, the call's random ``key``, the weight decay's form (None,
# "decoupled" or "l2") and the first element's index in the call
_T = torch.Tensor
_S = torch.Tensor | list[float]
_K = torch.Tensor | int


def _adam_kahan(
    p: _T, g: _T, m: _T, v: _T, c: _T, s: _S, key: _K, decay: str | None, start: int = 0
) -> None:
    _adam(p, g, m, v, c, s, key, "kahan", decay, start)


def _adam_stochastic(
    p: _T, g: _T, m: _T, v: _T, s: _S, key: _K, decay: str | None, start: int = 0
) -> None:
    _adam(p, g, m, v, None, s, key, "stochastic", decay, start)


def _adam_plain(
    p: _T, g: _T, m: _T, v: _T, s: _S, key: _K, decay: str | None, start: int = 0
) -> None:
    _adam(p, g, m, v, None, s, key, None, decay, start)


def _sgd_kahan(
    p: _T, g: _T, b: _T | None, c: _T, s: _S, key: _K, decay: str | None, start: int = 0
) -> None:
    _sgd(p, g, b, c, s, key, "kahan", decay, start)


def _sgd_stochastic(
    p: _T, g: _T, b: _T | None, s: _S, key: _K, decay: str | None, start: int = 0
) -> None:
    _sgd(p, g, b, None, s, key, "stochastic", decay, start)


def _sgd_plain(
    p: _T, g: _T, b: _T | None, s: _S, key: _K, decay: str | None, start: int = 0
) -> None:
    _sgd(p, g, b, None, s, key, None, decay, start)


KERNELS: dict[tuple[str, str | None], Callable[..., None]] = {
    ("adam", "kahan"): _adam_kahan,
    ("adam", "stochastic"): _adam_stochastic,
    ("adam", None): _adam_plain,
    ("sgd", "kahan"): _sgd_kahan,
    ("sgd", "stochastic"): _sgd_stochastic,
    ("sgd", None): _sgd_plain,
}
_COMPILED: dict[tuple[str, str | None], Callable[..., None]] = {}


def compiled_step(algorithm: str, kind: str | None) -> Callable[..., None]:
    """The torch.compile'd step of ``algorithm`` and ``kind`` (built on first use; shapes
    dynamic, so one build per dtype serves every size from 2 elements)."""
    if (algorithm, kind) not in _COMPILED:
        log.info(
            "compiling the compensated %s step (%s): the first call builds it", algorithm, kind
        )
        _COMPILED[algorithm, kind] = torch.compile(
            KERNELS[algorithm, kind],
            dynamic=True,
            fullgraph=True,
            # keep the 16-bit round trips (Kahan's rounded weight) and eager's division
            options={"emulate_precision_casts": True, "eager_numerics.division_rounding": True},
        )
    return _COMPILED[algorithm, kind]


@functools.cache
def can_compile(device: str) -> bool:
    """Whether ``compile=None`` compiles on ``device``: a Linux CPU with a C++ compiler on
    the PATH, or CUDA with Triton."""
    if device == "cpu":
        return sys.platform.startswith("linux") and any(
            shutil.which(cxx) for cxx in ("c++", "g++", "clang++")
        )
    if device == "cuda":
        from torch.utils._triton import has_triton

        return has_triton()
    return False


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def call_key(seed: int, *words: int) -> int:
    """A signed 32-bit value hashed from ``seed`` and ``words`` (a call's noise offset)."""
    h = _splitmix(seed & _MASK64)
    for word in words:
        h = _splitmix(h ^ (word & _MASK64))
    h &= 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def on_memory(
    t: torch.Tensor, offset: int, shape: tuple[int, ...], pairs: bool = False
) -> torch.Tensor:
    """A contiguous tensor of ``shape`` on the memory of the contiguous ``t`` from element
    ``offset``, not a view of it: views and fresh tensors take separate torch.compile
    builds, and this keeps every compiled call's inputs fresh. ``pairs``: int32, each
    element two of ``t``'s bfloat16 ones (``offset`` counts pairs; the first is at an even
    element of the storage)."""
    dtype, start = t.dtype, t.storage_offset() + offset
    if pairs:
        dtype, start = torch.int32, t.storage_offset() // 2 + offset
    out = torch.empty(0, dtype=dtype, device=t.device)
    strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return out.set_(t.untyped_storage(), start, shape, strides)
