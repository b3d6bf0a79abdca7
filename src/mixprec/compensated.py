"""Compensated optimizer steps for 16-bit parameters kept without float32 master weights.

A bfloat16 weight has 8 significant bits: an update smaller than 2^-9..2^-8 of the weight
(half the spacing of bfloat16 numbers there) rounds away, so plain ``bf16-true`` training
stalls once updates get small. Two fixes keep the memory of pure 16-bit training (no
float32 copy of the weights):

- ``"kahan"``: each parameter gets a 16-bit compensation buffer holding what the last
  rounding lost; it is added back into the next update (Kahan summation). About 10 bytes
  per parameter with AdamW in bfloat16 (weight, gradient, two moments, buffer) against
  16-20 for mixed precision with float32 masters.
- ``"stochastic"``: the float32 result is rounded up or down at random, with probability
  proportional to the distance, so updates survive on average; no buffer (8 bytes/param).

``Compensator.step(optimizer, closure=None)`` replaces ``optimizer.step(closure)`` for
``torch.optim.AdamW``, ``Adam`` and ``SGD`` (momentum, dampening, nesterov, weight decay,
maximize; ``amsgrad``, ``capturable``, ``differentiable`` and subclasses overriding ``step``
are refused), inside the optimizer's step hooks and torch's global ones as torch's step
runs: it reads the optimizer's own parameter groups (so learning-rate schedulers keep
working) and keeps its state in the optimizer's ``state`` under torch's keys (``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``, ``step``) plus ``"compensation"`` for the Kahan buffer,
all in the parameter's 16-bit dtype. The math runs in float32 (float64 for float64
parameters). Adam's second moment and the Kahan buffer are written back with stochastic
rounding in both modes: with beta2 = 0.999 each increment of the second moment is below half
a bfloat16 step, and rounding it to nearest freezes it; the buffer's own rounding errors,
always rounded to nearest, add up the same way. Measured over 1,000 AdamW updates of 1e-4 of
each weight (tests/test_compensated.py): all state rounded to nearest, Kahan ends up to 2.3
bfloat16 steps from float64; with these two stochastic, within 0.8 (seeds 0-5; 0.9 at most
over 150). The first moment and SGD's momentum (increments of 10% and more) round to
nearest. State a user keeps in float32 beside 16-bit weights (moments, the buffer) is stored
as computed, in full float32: only 16-bit tensors are rounded.

One step is one pass: each parameter's whole update (moments, step, Kahan buffer, both
stochastic roundings) is one elementwise function of its 16-bit tensors (``_adam``,
``_sgd``), run by ``torch.compile`` as one fused kernel that reads and writes the 16-bit
tensors once (18 bytes per parameter for AdamW with Kahan), with no float32 copy of them.
Parameters below ``SMALL`` elements (biases, norms) are stepped together from one packed
copy, so a step makes a few kernel calls, not one per tensor.

bfloat16 tensors are stepped as int32 pairs (``_Lanes``): each int32 holds two bfloat16
values, each read as a float32 by moving it into the high half (a bfloat16 is the upper
half of a float32) and written back from the high half of its result's float32 bits
(rounded to nearest or stochastically by integer arithmetic on those bits). The kernel
then sees 32-bit types only: inductor's C++ kernels work 16 of them at a time, with
native vector conversions. A 16-bit tensor makes them work 32 at a time, as two vectors,
for which ATen has no int/float conversion and inductor no bit view: each became a scalar
loop, and the kernel took 2.9 times as long (5.9 ms against 2.1 for 2M elements, one
thread, Zen 4, CPU time). A parameter of an odd size or at an odd offset (no int32 view) is stepped
from the packed copy, padded to an even size.

The random bits: element i of a call takes the two 16-bit halves of ``_hash(i + key)``,
a bijection of the 32-bit values (Wellons' lowbias32: xorshifts and two multiplications
by odd constants), with a 32-bit ``key`` hashed from (seed, step count, parameter index,
part). With a uniform key each element's 32-bit value is uniform, so its two halves are
exactly uniform and independent of each other and (independent keys) of other steps' (one
rounds the second moment, one the buffer or the weight); the state is the seed and the
optimizer's step counts, so a resumed run is bit-identical. Compiled, the bits are integer
arithmetic on the element's index inside the kernel (two vector multiplications per
element). Stochastic rounding to bfloat16 adds the noise to the 16 bits a bfloat16 drops
and truncates (a NaN's low bits are zero in the step: made from bfloat16 values and
float32 scalars, it cannot carry into the sign); to float16 it is float32 arithmetic (the
spacing of float16 numbers at ``|x|`` from Rump's unit-in-the-first-place trick,
``floor``, a comparison, the sign put back).

The same functions run eagerly (on slices of ``EAGER_CHUNK`` elements on a CPU) where
nothing is compiled, and give bit-identical results on a CPU (tests/test_compensated.py
compares the two): every operation is correctly rounded in both (inductor compiles without
floating-point contraction, and keeps the 16-bit round trips with
``emulate_precision_casts``); eager float32 ``sqrt`` on a CPU is not correctly rounded
(about one result in six is one unit off), so the eager path takes it in float64. On CUDA,
Triton may fuse a multiply and an add, so the compiled and the eager step can differ in the
last bit there (each is right; not measured here). ``Compensator(compile=None)`` compiles
when a step covers ``COMPILE_MIN_ELEMENTS`` or more 16-bit elements on a Linux CPU with a
C++ compiler on the PATH or on a CUDA device with Triton; ``True`` always, ``False`` never.
A build that fails under ``None`` warns once and the steps run eagerly.

Which roundings are stochastic, measured (1,000 AdamW updates of 1e-4, 256 weights, seeds
0-5, largest distance from float64 in bfloat16 steps): both (as here) 0.68-0.75; the buffer
to nearest 0.71-0.91; the second moment to nearest 2.40 (it freezes: optimi's 2.25). (The
last two with the earlier random bits, 16-bit permutations, whose "both" gave 0.62-0.73:
over 150 seeds the two kinds of bits give the same distances, mean 0.73 and at most 0.90.)

Cost, measured side by side (``python benchmarks/kernels.py --only AdamW --threads 1``
and ``benchmarks/compensated.py``, benchmarks/results/compensated.md; 2.1M bfloat16
parameters, AdamW, one thread, AMD Zen 4 with avx512_bf16, on a host shared with other
jobs, load average 4-5 on 2 cores, medians): the compiled Kahan step takes 3.5 ms against
5.4 ms for torch-optimi's ``AdamW(kahan_sum=True)`` and 5.9 ms for torch's plain bfloat16
``AdamW(foreach=True)`` (0.65x and 0.60x; fastest calls 3.3, 5.2 and 4.1 ms); the step of
16-bit tensors before the pairs took 11.6 ms in the run just before (1.26x and 1.18x).
Measured in CPU time of the stepping thread (which waiting for the busy cores does not
inflate) the step takes 2.8 ms, 85% of it the fused kernel: 2.0 ms for 2.1M elements,
about the pass over memory (the same kernel with all roundings to nearest and no random
bits took 2.1 ms in the 16-bit layout); torch.compile's guards take about 16 us a call, 4
calls a step. The eager fallback takes 28 ms of thread time (21-22 before, alternating
runs: the random bits are ~14 integer operations per 64K slice where a window of a table
was read), a float64 square root among ~55 tensor operations per slice. The first step
builds the kernel: 23 s with an empty inductor cache on the loaded host, 7 s from the
cache (the 16-bit layout's: 22 s and 4-6 s; the pairs trace the arithmetic twice, once per
half).

Why our own kernel rather than a dependency on torch-optimi: the bytes are the same (10 per
parameter with AdamW and Kahan). optimi rounds its bfloat16 second moment to nearest, and
over 1,000 AdamW updates of 1e-4 its Kahan weights end 2.25 bfloat16 steps from float64
(they move 13.0 steps where float64 moves 14.6), ours 0.7-0.8 (seeds 0-5). And optimi
replaces the optimizer class, while a user's scheduler, ``Precision.setup`` and checkpoints
hold the torch optimizer: stepping the torch optimizer's own groups and state keeps them
working, lets a checkpoint resume with or without compensation, and adds no dependency.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import shutil
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "COMPENSATED_DTYPES",
    "COMPENSATIONS",
    "Compensator",
    "check_compensation",
    "stochastic_round_",
]

log = logging.getLogger(__name__)

COMPENSATIONS: tuple[str, ...] = ("kahan", "stochastic")
# parameter dtypes whose updates are compensated (others step plainly in their own dtype)
COMPENSATED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
SUPPORTED = (torch.optim.Adam, torch.optim.SGD)  # AdamW is an Adam subclass
# the steps the compensated step stands in for (unwrapped from torch's hook wrapper): a
# subclass that overrides ``step`` is refused
_TORCH_STEPS = (inspect.unwrap(torch.optim.Adam.step), inspect.unwrap(torch.optim.SGD.step))
# optimizer flags the compensated step cannot honour: (flag, why, what to do instead)
_REFUSED_FLAGS = (
    (
        "amsgrad",
        "the step keeps no maximum of the second moment",
        "use master_weights=True: torch's own AMSGrad step on float32 masters",
    ),
    (
        "capturable",
        "the step reads each parameter's step count on the host, which a CUDA graph cannot capture",
        "use master_weights=True: torch's own step on float32 masters",
    ),
    (
        "differentiable",
        "the step runs under no_grad and writes its 16-bit results in place, so no "
        "gradient flows through it",
        "use master_weights=True: torch's own step on float32 masters",
    ),
)
# compile=None compiles a step covering at least this many 16-bit elements (the first
# step's compile, seconds, then pays back within a few hundred steps)
COMPILE_MIN_ELEMENTS = 1 << 18
# parameters with fewer elements (or not contiguous) are stepped together from one packed
# copy: one kernel call for all of them instead of one each
SMALL = 1 << 16
# elements per kernel call (element indices stay int32); a larger tensor takes several
# calls, each with its own key
CALL_MAX = 1 << 30
# elements per slice on the eager path: on a CPU its float32 temporaries stay cache-sized; on
# an accelerator slices are large, so that the ~40 kernel launches per slice are few
EAGER_CHUNK = 1 << 16
EAGER_CHUNK_ACCELERATOR = 1 << 22
# the odd multipliers of ``_hash`` (0x7FEB352D and 0x846CA68B as int32)
_MIX = (0x7FEB352D, 0x846CA68B - (1 << 32))
# the float32 bits of a bfloat16: the high half
_HIGH = -(1 << 16)
_MASK64 = (1 << 64) - 1


def check_compensation(value: Any) -> str | None:
    """``value`` if it names a compensation (or is None); a ``ValueError`` saying what is
    accepted otherwise."""
    if value is None or value in COMPENSATIONS:
        return value
    raise ValueError(
        f"compensation must be 'kahan', 'stochastic' or None, got {value!r}: 'kahan' keeps a "
        f"16-bit buffer of the rounding error per parameter, 'stochastic' rounds at random"
    )


def stochastic_round_(
    dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None
) -> None:
    """Write ``src`` into the 16-bit ``dst``, rounding up or down at random with probability
    proportional to the distance, so the result equals ``src`` on average (the rounding of
    the compensated steps, with 16 random bits per element drawn from ``generator``)."""
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
    int/float conversions and bit views fall back to scalar loops: 2.9 times slower).
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


_KERNELS: dict[tuple[str, str | None], Callable[..., None]] = {
    ("adam", "kahan"): _adam_kahan,
    ("adam", "stochastic"): _adam_stochastic,
    ("adam", None): _adam_plain,
    ("sgd", "kahan"): _sgd_kahan,
    ("sgd", "stochastic"): _sgd_stochastic,
    ("sgd", None): _sgd_plain,
}
_COMPILED: dict[tuple[str, str | None], Callable[..., None]] = {}


def _compiled(algorithm: str, kind: str | None) -> Callable[..., None]:
    """The torch.compile'd step of ``algorithm`` and ``kind`` (built on first use; shapes
    dynamic, so one build per dtype serves every size from 2 elements)."""
    if (algorithm, kind) not in _COMPILED:
        log.info(
            "compiling the compensated %s step (%s): the first call builds it", algorithm, kind
        )
        _COMPILED[algorithm, kind] = torch.compile(
            _KERNELS[algorithm, kind],
            dynamic=True,
            fullgraph=True,
            # keep the 16-bit round trips (Kahan's rounded weight) and eager's division
            options={"emulate_precision_casts": True, "eager_numerics.division_rounding": True},
        )
    return _COMPILED[algorithm, kind]


@functools.cache
def _can_compile(device: str) -> bool:
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


def _key(seed: int, *words: int) -> int:
    """A signed 32-bit value hashed from ``seed`` and ``words`` (a call's noise offset)."""
    h = _splitmix(seed & _MASK64)
    for word in words:
        h = _splitmix(h ^ (word & _MASK64))
    h &= 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def _on_memory(
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


class _Call:
    """One kernel call's worth of parameters: their tensors (one list per parameter, the
    same structure for all), the scalars and where the random key comes from."""

    def __init__(
        self,
        algorithm: str,
        kind: str | None,
        scalars: list[float],
        step: int,
        decay: str | None,
        packed: bool,
        pairs: bool,
    ):
        self.algorithm = algorithm
        # bfloat16 tensors stepped as int32 pairs (``_Lanes``): a compensated step whose
        # tensors are all bfloat16
        self.pairs = pairs
        # the weight decay's form: None, "decoupled" or "l2" (separate builds: each skips
        # the terms of the others, so a weight without decay steps as torch steps it)
        self.decay = decay
        self.packed = packed  # stepped from one packed copy (else one large tensor in place)
        self.kind = kind
        self.scalars = scalars
        self.step = step
        self.rows: list[tuple[int, list[torch.Tensor | None]]] = []  # (parameter index, tensors)
        self.numel = 0


class Compensator:
    """Steps a torch AdamW/Adam/SGD with compensated updates of its 16-bit parameters.

    Args:
        kind: ``"kahan"`` or ``"stochastic"``.
        seed: seeds the stochastic rounding; None draws one from torch's global generator
            (so ``torch.manual_seed`` makes a run reproducible). The rounding of a step
            depends on the seed and the optimizer's step counts only, and the seed is in
            ``state_dict``: a resumed run is bit-identical.
        compile: ``None`` compiles the step with torch.compile when it covers
            ``COMPILE_MIN_ELEMENTS`` or more 16-bit elements on a device that can build
            (a Linux CPU with a C++ compiler, CUDA with Triton); ``True`` compiles every
            call of two or more elements; ``False`` runs the same math eagerly. The results
            are the same on a CPU (see the module docstring).
    """

    def __init__(self, kind: str, seed: int | None = None, compile: bool | None = None) -> None:
        if check_compensation(kind) is None:
            raise ValueError("a Compensator needs compensation='kahan' or 'stochastic'")
        if compile is not None and not isinstance(compile, bool):
            raise TypeError(f"compile must be None, True or False, got {compile!r}")
        self.kind = kind
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.seed = seed
        self.compile = compile
        self._compile_failed: str | None = None

    @staticmethod
    def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
        """Raise ``TypeError``/``ValueError`` unless ``optimizer`` can be compensated: a torch
        AdamW, Adam or SGD (or a subclass keeping torch's ``step``) without ``amsgrad``,
        ``capturable`` or ``differentiable`` in any group. ``foreach`` and ``fused`` pick
        torch's implementation of the same math, which the compensated kernel replaces."""
        name = type(optimizer).__name__
        if not isinstance(optimizer, SUPPORTED):
            raise TypeError(
                f"compensated updates support torch.optim.AdamW, Adam and SGD, got "
                f"{name}; use master_weights=True for other optimizers"
            )
        if inspect.unwrap(type(optimizer).step) not in _TORCH_STEPS:
            raise TypeError(
                f"{type(optimizer).__qualname__} overrides step(): a compensated step runs "
                f"torch's {'SGD' if isinstance(optimizer, torch.optim.SGD) else 'Adam'} "
                f"algorithm in its place, so the override would never run. Use "
                f"master_weights=True (the optimizer's own step on float32 masters), or "
                f"compensate torch.optim.AdamW, Adam or SGD itself"
            )
        for group in optimizer.param_groups:
            for flag, why, instead in _REFUSED_FLAGS:
                if group.get(flag):
                    raise ValueError(
                        f"compensated updates do not support {name}({flag}=True): {why}. "
                        f"Build the optimizer with {flag}=False, or {instead}"
                    )

    @torch.compiler.disable
    def step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None
    ) -> Any:
        """One step of ``optimizer``'s algorithm on every parameter with a gradient (outside
        any enclosing torch.compile: it compiles its own kernels), in place of
        ``optimizer.step(closure)``: the optimizer's step pre- and post-hooks and torch's
        global ones run around it as around torch's step (pre-hooks may replace the
        arguments), and ``closure``, if given, is called once with gradients enabled before
        the update; its loss is returned (None without one)."""
        self.check_optimizer(optimizer)
        hooked = torch.optim.Optimizer.profile_hook_step(self._step)
        return hooked(optimizer) if closure is None else hooked(optimizer, closure)

    def _step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None
    ) -> Any:
        """The step inside torch's hooks (arguments as torch's ``step`` takes them)."""
        self.check_optimizer(optimizer)  # a pre-hook may have changed the groups
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._update(optimizer)
        return loss

    def _update(self, optimizer: torch.optim.Optimizer) -> None:
        """Update every parameter with a gradient (under no_grad)."""
        calls: dict[tuple, _Call] = {}
        index = 0  # each parameter's position in the optimizer: part of its random key
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params, start=index):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("compensated updates do not support sparse gradients")
                if isinstance(optimizer, torch.optim.Adam):
                    self._add_adam(calls, optimizer, group, i, p)
                else:
                    self._add_sgd(calls, optimizer, group, i, p)
            index += len(params)
        compensated = sum(call.numel for call in calls.values() if call.kind)
        scalars: dict[tuple, torch.Tensor] = {}
        # the largest first: a compiled step's first call sets its threading by its size
        for call in sorted(calls.values(), key=lambda call: -call.numel):
            self._run(call, compensated, scalars)
        # lr schedulers check that the optimizer stepped before them
        optimizer._opt_called = True  # type: ignore[attr-defined]

    def _kind(self, p: torch.Tensor) -> str | None:
        return self.kind if p.dtype in COMPENSATED_DTYPES else None

    def _add_adam(
        self, calls: dict, optimizer: Any, group: dict, index: int, p: torch.Tensor
    ) -> None:
        state = optimizer.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        kind = self._kind(p)
        buffer = self._buffer(state, p) if kind == "kahan" else None
        state["step"] += 1
        # torch's Adam counts each parameter's own steps: one that had no gradient for a
        # while is behind the others and has its own bias correction
        step = int(state["step"].item())
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        wd = group["weight_decay"]
        decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get(
            "decoupled_weight_decay", False
        )
        sign = -1.0 if group.get("maximize") else 1.0
        scalars = [
            beta1,
            (1 - beta1) * sign,
            beta2,
            1 - beta2,
            1 / math.sqrt(1 - beta2**step),
            group["eps"],
            -lr / (1 - beta1**step),
        ]
        decay = None
        if wd:
            decay = "decoupled" if decoupled else "l2"
            scalars.append(-lr * wd if decoupled else wd * sign)
        row = [p, p.grad, state["exp_avg"], state["exp_avg_sq"], buffer]
        self._add(calls, "adam", kind, scalars, step, index, row, decay)

    def _add_sgd(
        self, calls: dict, optimizer: Any, group: dict, index: int, p: torch.Tensor
    ) -> None:
        state = optimizer.state[p]
        state.setdefault("step", torch.tensor(0.0))
        state["step"] += 1
        kind = self._kind(p)
        buffer = self._buffer(state, p) if kind == "kahan" else None
        momentum, dampening = group["momentum"], group["dampening"]
        first = bool(momentum) and state.get("momentum_buffer") is None
        if first:  # torch starts the buffer at the gradient: 0 * 0 + 1 * gradient
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        nesterov = group["nesterov"]
        scalars = [
            -1.0 if group.get("maximize") else 1.0,
            0.0 if first else momentum,
            1.0 if first else 1 - dampening,
            1.0 if nesterov else 0.0,
            momentum if nesterov else 1.0,
            -float(group["lr"]),
        ]
        decay = None
        if group["weight_decay"]:
            decay = "l2"
            scalars.append(group["weight_decay"])
        row = [p, p.grad, state["momentum_buffer"] if momentum else None, buffer]
        self._add(calls, "sgd", kind, scalars, int(state["step"].item()), index, row, decay)

    @staticmethod
    def _buffer(state: dict, p: torch.Tensor) -> torch.Tensor:
        if "compensation" not in state:
            state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["compensation"]

    @staticmethod
    def _add(
        calls: dict,
        algorithm: str,
        kind: str | None,
        scalars: list[float],
        step: int,
        index: int,
        row: list[torch.Tensor | None],
        decay: str | None,
    ) -> None:
        """File the parameter's ``row`` under a call: alone if large and contiguous (and,
        stepped as bfloat16 pairs, of an even size from an even offset), else with the
        small ones of the same group, step, device and dtypes."""
        if kind != "kahan":
            row = row[:-1]  # no Kahan buffer
        # a complex tensor steps as its real and imaginary parts, as torch's Adam and SGD
        # step it (read as real, its imaginary part was dropped)
        row = [t if t is None or not t.is_complex() else torch.view_as_real(t) for t in row]
        pairs = kind is not None and all(t is None or t.dtype == torch.bfloat16 for t in row)
        alone = row[0].numel() >= SMALL and all(
            t is None or (t.is_contiguous() and not (pairs and t.storage_offset() % 2)) for t in row
        )
        alone = alone and not (pairs and row[0].numel() % 2)
        layout = tuple(None if t is None else t.dtype for t in row)
        key = (index if alone else None, algorithm, kind, step, tuple(scalars), layout)
        key += (str(row[0].device),)
        if key not in calls:
            calls[key] = _Call(algorithm, kind, scalars, step, decay, not alone, pairs)
        calls[key].rows.append((index, row))
        calls[key].numel += row[0].numel()  # type: ignore[union-attr]

    def _run(self, call: _Call, compensated: int, scalars: dict[tuple, torch.Tensor]) -> None:
        """Step ``call``'s parameters: one packed copy for several, in place for one large.
        ``scalars``: the scalar tensors made so far this step, shared by equal calls."""
        rows = [tensors for _, tensors in call.rows]
        p = rows[0][0]
        assert p is not None
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        known = (tuple(call.scalars), dtype, p.device)
        if known not in scalars:
            scalars[known] = torch.tensor(call.scalars, dtype=dtype, device=p.device)
        s = scalars[known]
        width = 2 if call.pairs else 1  # elements per kernel element
        if not call.packed:
            flat = [
                None if t is None else _on_memory(t, 0, (t.numel() // width,), call.pairs)
                for t in rows[0]
            ]
            self._kernel(call, flat, s, call.rows[0][0], compensated)
            return
        columns = list(zip(*rows, strict=True))
        # (under no_grad: the parameters' copies track nothing; 1-D tensors need no view;
        # pairs of an odd number of elements take one more, a zero, stepped and dropped)
        odd = call.pairs and sum(t.numel() for t in columns[0]) % 2
        packed = [
            None
            if col[0] is None
            else torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in col] +
                           ([col[0].new_zeros(1)] if odd else []))
            for col in columns
        ]  # fmt: skip
        self._kernel(
            call,
            [None if t is None else _on_memory(t, 0, (t.numel() // width,), call.pairs)
             for t in packed],
            s,
            call.rows[0][0],
            compensated,
        )  # fmt: skip
        sizes = [t.numel() for t in columns[0]]
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for j, (col, flat) in enumerate(zip(columns, packed, strict=True)):
            if j == 1 or flat is None:  # the gradient is only read
                continue
            dst += col
            src += [
                piece if t.dim() == 1 else piece.view(t.shape)
                for piece, t in zip(flat[: sum(sizes)].split(sizes), col, strict=True)
            ]
        torch._foreach_copy_(dst, src)

    def _kernel(
        self,
        call: _Call,
        flat: list[torch.Tensor | None],
        scalars: torch.Tensor,
        index: int,
        compensated: int,
    ) -> None:
        """Run the step of ``call`` on its flat tensors (int32 for bfloat16 pairs), in
        parts of at most ``CALL_MAX`` elements, each keyed by (seed, step, parameter index,
        part): compiled, one call per part; eagerly, in slices of at most ``EAGER_CHUNK``
        elements on a CPU, of ``EAGER_CHUNK_ACCELERATOR`` elsewhere."""
        p = flat[0]
        assert p is not None
        compiled = call.kind is not None and self._compiles(p.device, compensated)
        kernel = _KERNELS[call.algorithm, call.kind]
        width = 2 if call.pairs else 1  # elements per kernel element
        most = CALL_MAX // width
        eager_scalars: list[float] | None = None  # the same values as Python floats
        for part, begin in enumerate(range(0, p.numel(), most)):
            n = min(most, p.numel() - begin)
            piece = flat
            if p.numel() > most:
                piece = [None if t is None else _on_memory(t, begin, (n,)) for t in flat]
            key = _key(self.seed, call.step, index, part)
            if compiled and n >= 2:
                key_tensor = torch.tensor(key, dtype=torch.int32, device=p.device)
                if self._compiled_call(call, piece, scalars, key_tensor):
                    continue
            if eager_scalars is None:
                eager_scalars = scalars.tolist()
            size = (EAGER_CHUNK if p.device.type == "cpu" else EAGER_CHUNK_ACCELERATOR) // width
            for start in range(0, n, size):
                chunk = [None if t is None else t[start : start + size] for t in piece]
                kernel(*chunk, eager_scalars, key, call.decay, start * width)

    def _compiles(self, device: torch.device, compensated: int) -> bool:
        if self._compile_failed is not None:
            return False
        if self.compile is None:
            return compensated >= COMPILE_MIN_ELEMENTS and _can_compile(device.type)
        return self.compile

    def _compiled_call(
        self,
        call: _Call,
        tensors: list[torch.Tensor | None],
        scalars: torch.Tensor,
        key: torch.Tensor,
    ) -> bool:
        """Run the compiled step; False (with one warning, and eager steps from then on) if
        ``compile=None`` chose to compile and the build failed before anything ran."""
        from torch._dynamo.exc import BackendCompilerFailed

        try:
            _compiled(call.algorithm, call.kind)(*tensors, scalars, key, call.decay)
        except BackendCompilerFailed as error:
            if self.compile is not None:
                raise
            self._compile_failed = str(error).splitlines()[0]
            warnings.warn(
                f"the compensated step could not be compiled ({self._compile_failed}); it "
                f"runs eagerly from now on: the same results, slower. Compensator(..., "
                f"compile=False) skips the attempt",
                stacklevel=4,
            )
            return False
        return True

    def state_dict(self) -> dict[str, Any]:
        """The kind and the seed (the rounding's only state besides the step counts, which
        the optimizer's state holds)."""
        return {"kind": self.kind, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict``; the kind must match (a run changes it by starting anew).
        Checkpoints of earlier versions also hold random-generator states, which this
        version's rounding does not use."""
        if state.get("kind") != self.kind:
            raise ValueError(
                f"the checkpoint was trained with compensation {state.get('kind')!r}, this "
                f"optimizer uses {self.kind!r}"
            )
        self.seed = int(state["seed"])
