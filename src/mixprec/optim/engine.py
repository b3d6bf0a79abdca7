"""The step engine every optimizer of `mixprec.optim` shares: the low-bit optimizers
(`mixprec.optim.states`) and the compensated steps of torch's optimizers
(`mixprec.optim.compensated`) write their weights back, draw their random bits, decide to
compile and name the optimizers they stand in for here, once.

- **The weight write-back** (`write_back`): the new weight ``w + u`` of an update ``u``
  stored plainly (rounded to nearest by the store), Kahan-compensated (a buffer in the
  weight's dtype holds what the last rounding lost and is added to the next update; the
  buffer itself stored with stochastic rounding, so its own rounding errors do not add up)
  or stochastically rounded (up or down at random, with probability proportional to the
  distance). `Lanes` says how a kernel reads and writes its tensors: plain tensors of any
  dtype (the math in float32, float64 for float64), or bfloat16 pairs held in int32,
  rounded by integer arithmetic on their bits (so inductor's C++ kernels vectorize them).
- **The random bits** (`random_bits`, `call_key`): element ``i`` of a call takes the two 16-bit
  halves of ``hash32(i + key)``, a bijection of the 32-bit values, with ``key`` hashed from
  (seed, step count, parameter index, part). The state is the seed and the step counts, so
  a resumed run is bit-identical and no generator state is saved; inside a compiled kernel
  this is integer arithmetic on the index, fused into the step.
- **The compile gate** (`CompileGate`, `can_compile`, `COMPILE_MIN_ELEMENTS`):
  ``compile=None`` compiles a step covering ``COMPILE_MIN_ELEMENTS`` or more elements on a
  device that can build (a Linux CPU with a C++ compiler, CUDA with Triton), and falls back
  to eager, warning once, if the build fails; on a GPU it checks a kernel's first call
  against its eager form (`difference`: bit for bit, or within a tolerance it is given).
- **The step counts** (`StepCounts`): every parameter's count advanced and read back in
  two calls, whatever the number of parameters.
- **The optimizers stood in for** (`SUPPORTED_OPTIMIZERS`, `algorithm_of`): torch's
  AdamW, Adam and SGD.
- **The compensations** (`COMPENSATIONS`, `COMPENSATED_DTYPES`, `check_compensation`).
"""

from __future__ import annotations

import functools
import math
import shutil
import sys
import warnings
from collections.abc import Callable
from numbers import Integral
from operator import is_
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "COMPENSATED_DTYPES",
    "COMPENSATIONS",
    "CHECK_MAX_BYTES",
    "COMPILE_MIN_ELEMENTS",
    "SUPPORTED_OPTIMIZERS",
    "TRUSTED",
    "CompileGate",
    "Lanes",
    "StepCounts",
    "call_key",
    "can_compile",
    "check_compensation",
    "check_seed",
    "difference",
    "settled",
    "stochastic_round_",
    "wrap32",
    "write_back",
    "written_mark",
]

COMPENSATIONS: tuple[str, ...] = ("kahan", "stochastic")
# parameter dtypes whose updates are compensated (others step plainly in their own dtype)
COMPENSATED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
# compile=None compiles a step covering at least this many elements (the low-bit steps':
# all they update; the compensated ones': their 16-bit elements). The first step's build
# takes seconds, once per signature (algorithm, format, dtype, compensation), whatever the
# number of parameters; eagerly a step runs dozens of passes over its elements where the
# compiled one runs one, so at this size the build is paid back within a few thousand steps
# (docs/pure-bf16.md), and a larger model's sooner
COMPILE_MIN_ELEMENTS = 1 << 16
# the torch optimizers the compensated and the low-bit steps stand in for, and the algorithm
# each runs ("adam": Adam's moments, its weight decay decoupled for AdamW and for Adam with
# decoupled_weight_decay=True; "sgd": SGD with momentum)
SUPPORTED_OPTIMIZERS: dict[type[torch.optim.Optimizer], str] = {
    torch.optim.AdamW: "adam",
    torch.optim.Adam: "adam",
    torch.optim.SGD: "sgd",
}

# the odd multipliers of ``hash32`` (0x7FEB352D and 0x846CA68B as int32)
_MIX = (0x7FEB352D, 0x846CA68B - (1 << 32))
# the float32 bits of a bfloat16: the high half
_HIGH = -(1 << 16)
_SIGN = -(1 << 31)
# bfloat16's largest finite value and the float32 magnitude from which rounding to nearest
# gives infinity (halfway to 2^128, a tie rounding up to the even infinity), as float32 bits
_BF16_MAX_BITS = 0x7F7F0000
_BF16_OVERFLOW_BITS = 0x7F7F8000
# the same for float16: its largest value and where rounding to nearest overflows
_F16_MAX = 65504.0
_F16_OVERFLOW = 65520.0
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


def check_seed(seed: Any) -> int:
    """``seed`` as an int if it is an integer (a numpy one too: what keys the random bits,
    `call_key`); a ``TypeError`` naming what was given otherwise, rather than one at the
    first compensated step."""
    if isinstance(seed, bool) or not isinstance(seed, Integral):
        raise TypeError(f"seed must be an int, got {seed!r} ({type(seed).__name__})")
    return int(seed)


def algorithm_of(optimizer: torch.optim.Optimizer | type) -> str | None:
    """The algorithm (``"adam"`` or ``"sgd"``) of a supported torch optimizer (or class),
    a subclass included; None for any other."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    for base, algorithm in SUPPORTED_OPTIMIZERS.items():
        if issubclass(cls, base):
            return algorithm
    return None


def stochastic_round_(
    dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None
) -> None:
    """Write ``src`` into the 16-bit ``dst``, rounding up or down at random with probability
    proportional to the distance, so the result equals ``src`` on average (the rounding of
    the compensated steps, with 16 random bits per element drawn from ``generator``)."""
    if dst.dtype not in COMPENSATED_DTYPES:
        raise ValueError(
            f"stochastic_round_ rounds to bfloat16 or float16, got dst of dtype {dst.dtype}"
        )
    if src.shape != dst.shape:
        raise ValueError(
            f"stochastic_round_ writes src into dst of the same shape: got src of shape "
            f"{list(src.shape)} into dst of shape {list(dst.shape)}"
        )
    noise = torch.randint(
        0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=generator
    )
    dst.copy_(round_stochastic(src.to(torch.float32), noise, dst.dtype))


# -- the random bits and the roundings ---------------------------------------------------


def _lsr(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int32 ``x`` (torch's ``>>`` on int32 copies the sign bit)."""
    return (x >> shift) & ((1 << (32 - shift)) - 1)


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of the 32-bit values (int32, arithmetic modulo 2^32): xorshifts and two
    multiplications by odd constants (Wellons' "lowbias32", a well-mixing 32-bit hash)."""
    x = _mix(x)
    return x ^ _lsr(x, 16)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """``hash32`` but its last xorshift, which changes the low half only (``noise`` takes
    that half as ``x ^ (x >> 16)``, one operation fewer)."""
    x = x ^ _lsr(x, 16)
    x = x * _MIX[0]
    x = x ^ _lsr(x, 15)
    return x * _MIX[1]


def random_bits(
    n: int, start: int, key: torch.Tensor | int, device: torch.device, step: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two int32 tensors of ``n`` values in [0, 65536), for the elements ``start``,
    ``start + step``, ... of a call with ``key`` (a signed 32-bit offset: a one-element int32
    tensor compiled, an int eagerly): the low and the high half of ``hash32(i + key)``.

    With a uniform key, ``i + key`` is uniform over the 2^32 values for each element ``i``,
    so is its image under the bijection, and the two halves of a uniform 32-bit value are
    uniform and independent: each element's two values are exactly uniform, independent of
    each other and (independent keys) of other steps'; within a call no two elements share
    a 32-bit value. Compiled, this is integer arithmetic on the element's index, fused into
    the step."""
    i = torch.arange(start, start + n * step, step, dtype=torch.int32, device=device)
    x = _mix(i + key)
    return (x ^ (x >> 16)) & 0xFFFF, _lsr(x, 16)


def round_stochastic(x: torch.Tensor, noise: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) rounded to a neighbouring ``dtype`` (bfloat16/float16) value: away
    from zero when ``65535 - noise`` (``noise`` int32 in [0, 65536), from `random_bits`) is
    below 65536 times the fraction of the way there, else toward zero; in float32, exactly
    representable in ``dtype``. Unbiased to 2^-16 of a spacing (exactly for bfloat16);
    signed zeros and infinities pass unchanged, a NaN becomes a NaN (bfloat16: the quiet
    NaN).

    bfloat16 is the upper half of float32: ``stochastic_bits`` of the NaN-quieted ``x``
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
        return stochastic_bits(quiet, noise).view(torch.float32)
    magnitude = x.abs()
    q = magnitude * (2.0**-24 * (2.0**23 + 1))
    spacing = at_least((q - q * (1 - 2.0**-24)) * 2.0**14, 2.0**-24)
    t = magnitude / spacing
    low = t.floor()
    up = ((noise ^ 0xFFFF).float() < (t - low) * 65536).to(x.dtype)
    rounded = (low + up) * spacing
    # above float16's largest, up is infinity: kept for a value rounding to nearest would
    # overflow too (from 65520), else the largest (a weight at 65504 plus a small update)
    rounded = torch.where(magnitude < _F16_OVERFLOW, rounded.clamp_max(_F16_MAX), rounded)
    return rounded.copysign(x)


def stochastic_bits(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The float32 bits of ``x`` rounded stochastically to bfloat16 (int32, low half zero):
    ``noise`` added to the 16 bits a bfloat16 drops, and the sum truncated (a carry means
    those bits exceed ``65535 - noise``). A NaN whose low 16 bits are not zero may carry
    into the sign: ``round_stochastic`` quiets NaNs first; in the step every NaN is made by
    arithmetic on bfloat16 values and float32 scalars, whose low halves are zero."""
    bits = x.view(torch.int32)
    rounded = (bits + noise) & _HIGH
    # a carry out of bfloat16's largest exponent is infinity: kept for a value rounding to
    # nearest would overflow too, else the largest of its sign (NaNs are above both bounds)
    magnitude = bits & 0x7FFFFFFF
    capped = (rounded & 0x7FFFFFFF).clamp_max(_BF16_MAX_BITS) | (bits & _SIGN)
    return torch.where(magnitude < _BF16_OVERFLOW_BITS, capped, rounded)


def nearest_bits(x: torch.Tensor) -> torch.Tensor:
    """The float32 bits of ``x`` rounded to the nearest bfloat16, ties to even (int32, low
    half zero): torch's conversion for every number; NaNs as ``stochastic_bits``."""
    bits = x.view(torch.int32)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) & _HIGH


def nearest_value(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) rounded to the nearest ``dtype`` (bfloat16/float16) value, ties to
    even, as a float32: torch's conversion, made of integer and exact float operations. A
    compiled ``x.to(dtype).to(torch.float32)`` is not safe to rely on: some inductor
    versions drop a narrowing cast followed by a widening one as pointless, and the Kahan
    buffer (``u - (rounded - w)``) then loses what the rounding lost. bfloat16 by
    `nearest_bits`; float16 in spacings ``ufp(x) * 2^-10`` (``ufp`` the power of two at or
    below ``|x|``, read from the exponent bits), at least its subnormals' 2^-24, infinity
    from 65520 as torch's conversion gives it."""
    if dtype == torch.bfloat16:  # (NaNs quieted: a payload's carry would reach the sign)
        return nearest_bits(torch.where(x != x, math.nan, x)).view(torch.float32)
    magnitude = x.abs()
    ufp = (magnitude.view(torch.int32) & 0x7F800000).view(torch.float32)
    spacing = at_least(ufp * 2.0**-10, 2.0**-24)
    rounded = torch.round(magnitude / spacing) * spacing
    return torch.where(magnitude >= _F16_OVERFLOW, math.inf, rounded).copysign(x)


def at_least(x: torch.Tensor, bound: float) -> torch.Tensor:
    """``x`` where above ``bound``, else (NaN included) ``bound``: one ``where`` compiled;
    eagerly two cheaper operations with the same result (``torch.where`` is ten times
    slower than arithmetic on the eager CPU path)."""
    if torch.compiler.is_compiling():
        return torch.where(x > bound, x, bound)
    return x.nan_to_num(nan=bound).clamp_(min=bound)


# -- the write-back --------------------------------------------------------------------------


class Lanes:
    """How the step reads and writes its tensors. bfloat16 ones come as int32 pairs (each
    int32 holds two bfloat16 values, the even element in its low half) and are rounded by
    integer arithmetic on the float32 bits of the results (``nearest_bits``,
    ``stochastic_bits``). Compiled, each pair is read as two float32 tensors by moving
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
        self.shape = p.shape

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
        """The two random values (`random_bits`) of each element of the half ``half``,
        shaped as the tensors read (a plain tensor's shape, e.g. blocks of a low-bit step)."""
        if self.pairs:
            return random_bits(self.n, self.start + half, self.key, self.device, step=2)
        low, high = random_bits(self.n, self.start, self.key, self.device)
        if self.bits:
            return low, high
        return low.view(self.shape), high.view(self.shape)

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded to nearest: bits for bfloat16 pairs, else as is (the copy
        converts)."""
        return nearest_bits(x) if self.bits else x

    def value(self, rounded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The math-dtype value of ``nearest(x)`` once stored in ``dtype``: compiled,
        without a round trip of casts (`nearest_value` says why)."""
        if self.bits:
            return rounded.view(torch.float32)
        if (
            torch.compiler.is_compiling()
            and dtype in COMPENSATED_DTYPES
            and self.dtype == torch.float32
        ):
            return nearest_value(rounded, dtype)
        return rounded.to(dtype).to(self.dtype)

    def stochastic(self, x: torch.Tensor, noise: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x`` stochastically rounded for a tensor of ``dtype``: to its 16-bit grid, or
        as is for a float32/float64 one (state kept in float32 beside 16-bit weights stays
        float32 math; only 16-bit tensors are rounded)."""
        if self.bits:
            return stochastic_bits(x, noise)
        if dtype not in COMPENSATED_DTYPES:
            return x
        return round_stochastic(x, noise, dtype)

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


def write_back(
    lanes: Lanes,
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
        # what earlier roundings lost (bfloat16 pairs come as int32)
        u = u + settled(w, c, torch.bfloat16 if lanes.bits else p.dtype)
        new = lanes.nearest(w + u)
        # the part of the update that made it into the parameter is exact in float32
        buffer = u - (lanes.value(new, p.dtype) - w)
        # (the buffer is stored in the weight's dtype: ``c`` arrives in the math dtype)
        return [new, lanes.stochastic(buffer, noise, p.dtype)]
    if kind == "stochastic":
        assert noise is not None
        return [lanes.stochastic(w + u, noise, p.dtype), None]
    return [w + u, None]


class CompileGate:
    """Whether a step's kernels run compiled, and the fallback when a build fails.

    ``compile``: None compiles a step covering ``min_elements`` (`COMPILE_MIN_ELEMENTS` by
    default) or more elements on a device that can build (`can_compile`), True always,
    False never. A build that fails
    under None warns once (``what`` names the step, ``hint`` how to skip the attempt) and
    every later step runs eagerly: the same math, slower; under True it raises."""

    def __init__(
        self, compile: bool | None, what: str, hint: str, min_elements: int | None = None
    ) -> None:
        if compile not in (None, True, False):
            raise TypeError(f"compile must be None, True or False, got {compile!r}")
        self.compile = compile
        self.min_elements = COMPILE_MIN_ELEMENTS if min_elements is None else min_elements
        self.what = what
        self.hint = hint
        self.failed: str | None = None  # the first line of the failed build's error
        self.checked: set[tuple] = set()  # kinds of calls checked (`_kind`)

    def wants(self, device: torch.device, elements: int) -> bool:
        """Whether a step of ``elements`` on ``device`` runs compiled."""
        if self.failed is not None:
            return False
        if self.compile is None:
            return elements >= self.min_elements and can_compile(device.type)
        return self.compile

    def run(
        self,
        call: Callable[..., Any],
        *args: Any,
        eager: Callable[..., Any] | None = None,
        agree: Callable[[list[Any], list[Any]], str] | None = None,
        stacklevel: int = 3,
    ) -> tuple[Any, bool]:
        """(``call(*args)``, True), or (None, False) when the build failed under
        ``compile=None`` (warned once; nothing ran): the compiler failed, dynamo could not
        trace the function whole (a torch function mode of the caller's it cannot run), or
        it refused another build of the function in this process (its recompile limit,
        reached by many formats, dtypes and optimizers before this one).

        With ``eager`` (the same math op by op, where the compiled kernel is held to it bit
        for bit: the compensated step, the fp8 codec), the first call of each kind (the
        kernel, the device type, the dtypes of its tensors) on a device other than the CPU
        (where the test suite holds them so), of at most `CHECK_MAX_BYTES` of tensors, is
        checked: ``eager`` runs on copies of the arguments, and where any tensor or result
        differs (NaNs equal whatever their payload), the eager results are kept, a warning
        names the difference and later steps run eagerly (a compiler whose numerics drift
        from eager's would change a step silently otherwise). ``agree(got, expected)``, where
        given, judges the results (flat lists) in place of bit equality: how they differ
        beyond what the kernel allows, or '' (a lossy codec whose compiled division may be
        a last bit off eager's); the arguments are still held to eager's bit for bit."""
        from torch._dynamo.exc import BackendCompilerFailed, FailOnRecompileLimitHit, Unsupported

        try:
            if eager is not None and _unchecked(self.checked, call, args):
                return self._checked(call, eager, args, agree, stacklevel + 1), True
            return call(*args), True
        except (BackendCompilerFailed, FailOnRecompileLimitHit, Unsupported) as error:
            if self.compile is not None:
                raise
            self.failed = (
                "dynamo's limit of builds of one function in a process was reached"
                if isinstance(error, FailOnRecompileLimitHit)
                else str(error).splitlines()[0]
            )
            warnings.warn(
                f"the {self.what} could not be compiled ({self.failed}); it runs eagerly "
                f"from now on: the same math, slower. {self.hint}",
                stacklevel=stacklevel + 1,
            )
            return None, False

    def _checked(
        self,
        call: Callable[..., Any],
        eager: Callable[..., Any],
        args: tuple,
        agree: Callable[[list[Any], list[Any]], str] | None,
        stacklevel: int,
    ) -> Any:
        """`call` on ``args`` checked against `eager` on copies of them (see `run`). A call
        whose check would not fit in the device's memory runs unchecked (and the next call
        of its kind is checked instead)."""
        leaves, spec = tree_flatten(args)
        try:
            copies = _copies(leaves)
            expected = eager(*tree_unflatten(copies, spec))
        except torch.OutOfMemoryError:
            return call(*args)
        got = call(*args)
        self.checked.add(_kind(call, args))
        results, eager_results = tree_flatten(got)[0], tree_flatten(expected)[0]
        if agree is None:
            differ = difference([*leaves, *results], [*copies, *eager_results])
        else:
            differ = difference(leaves, copies) or agree(results, eager_results)
        if not differ:
            return got
        for a, b in zip(leaves, copies, strict=True):  # this step as eager computed it
            if isinstance(a, torch.Tensor):
                a.untyped_storage().copy_(b.untyped_storage())
        device = next(t.device for t in leaves if isinstance(t, torch.Tensor))
        self.failed = f"its compiled form differs from its eager form on {device.type}"
        warnings.warn(
            f"the {self.what} compiled on {device.type} differs from its eager form "
            f"({differ}); it runs eagerly from now on: the same math, slower. {self.hint}",
            stacklevel=stacklevel + 1,
        )
        return expected


# the largest call (bytes of its tensors) `CompileGate.run` checks against eager: a copy of
# the arguments and eager's temporaries (several times the tensors) are made for it
CHECK_MAX_BYTES = 1 << 26
# device types whose compiled kernels `CompileGate.run` does not check (the test suite does)
TRUSTED = ("cpu",)


def _kind(call: Callable[..., Any], args: tuple) -> tuple:
    """What one check of `CompileGate.run` covers: the kernel, the device type, the dtypes
    of its tensor arguments and its dtype and string arguments (a decode's output dtype, a
    step's form of decay): each a build of its own."""
    tensors = [t for t in args if isinstance(t, torch.Tensor)]
    flags = [a for a in args if isinstance(a, torch.dtype | str)]
    return (id(call), tensors[0].device.type, *(t.dtype for t in tensors), *flags)


def _unchecked(checked: set[tuple], call: Callable[..., Any], args: tuple) -> bool:
    """Whether a call on ``args`` is one `CompileGate.run` checks: on an untrusted device,
    of a kind not checked yet, of at most `CHECK_MAX_BYTES` of tensors. (Every step asks:
    its arguments are read as they are passed, the callers' being flat.)"""
    first = next((t for t in args if isinstance(t, torch.Tensor)), None)
    if first is None or first.device.type in TRUSTED or _kind(call, args) in checked:
        return False
    tensors = [t for t in args if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) <= CHECK_MAX_BYTES


def difference(
    got: list[Any],
    expected: list[Any],
    far: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    beyond: str = "",
) -> str:
    """How the leaves ``got`` differ from ``expected`` ('' where they are the same): their
    number, other values compared as values, tensors' shapes and dtypes, then their
    elements: ``far(a, b)`` (a flat mask of the elements that differ, for two tensors of
    one shape and dtype), by default their bytes (NaNs equal whatever their payload); the
    count of elements that differ is told with ``beyond`` after it."""
    if len(got) != len(expected):
        return "a different number of results"
    differ = 0
    for a, b in zip(got, expected, strict=True):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
                return f"{a!r} where eager gives {b!r}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return (
                f"a {a.dtype} {tuple(a.shape)} tensor where eager gives {b.dtype} {tuple(b.shape)}"
            )
        differ += int((far or _bytes_differ)(a.detach(), b.detach()).sum())
    return f"{differ} elements of its results{beyond}" if differ else ""


def _bytes_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The elements of ``a`` and ``b`` whose bytes differ, NaNs equal whatever their payload."""
    same = (_bytes(a) == _bytes(b)).view(-1, a.element_size()).all(dim=1)
    if a.is_floating_point() or a.is_complex():
        if a.element_size() == 1:  # (float8: compared through float32)
            a, b = a.float(), b.float()
        same |= (a.isnan() & b.isnan()).reshape(-1)
    return ~same


def _copies(leaves: list[Any]) -> list[Any]:
    """The leaves with every tensor copied, views of one storage staying views of one copy."""
    stores: dict[int, torch.UntypedStorage] = {}
    out = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        storage = leaf.untyped_storage()
        if storage.data_ptr() not in stores:
            stores[storage.data_ptr()] = storage.clone()
        copy = stores[storage.data_ptr()]
        view = leaf.new_empty(0).set_(copy, leaf.storage_offset(), leaf.shape, leaf.stride())
        out.append(view)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (NaN payloads and signed zeros compared as they are)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


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


class StepCounts:
    """The step counts (``state["step"]``) of the parameters an optimizer steps, advanced
    by one and read back together. On their first step together they are joined: each
    state's count becomes a 0-dim view of one float32 tensor (values kept), so that every
    later step of the same parameters adds to all of them in one call and reads them in
    one more, where a count per tensor costs two dispatches per parameter. A state whose
    count was replaced since (a checkpoint loaded) or a different set of parameters joins
    again; counts that are not 0-dim float32 CPU tensors (moved to an accelerator) are
    advanced as they are, in a fixed number of calls."""

    def __init__(self) -> None:
        self.whole: torch.Tensor | None = None
        self.held: list[torch.Tensor] = []
        self.addresses: list[int] = []  # the views' (a count given other memory: `advance`)

    def __getstate__(self) -> dict[str, Any]:
        """Not joined: a pickle stores each state's count apart from the tensor it is a view
        of, so that the copy's counts would stop advancing with it. They join again at the
        copy's next step."""
        return {"whole": None, "held": [], "addresses": []}

    def advance(self, states: list[dict[str, Any]]) -> list[int]:
        """Add one to each state's ``"step"`` and return the counts, in order. Counts
        joined before join again where a state's count was replaced, or given other memory
        through ``.data`` (the same object, no longer a view of the joined tensor)."""
        counts = [state["step"] for state in states]
        held = self.held
        if (
            len(held) != len(counts)
            or not all(map(is_, counts, held))
            or list(map(torch.Tensor.data_ptr, counts)) != self.addresses
        ):
            if not all(_joinable(c) for c in counts):
                return _advance_apart(states)
            self.whole = torch.stack(counts)
            self.held = list(self.whole.unbind())
            self.addresses = list(map(torch.Tensor.data_ptr, self.held))
            for state, view in zip(states, self.held, strict=True):
                state["step"] = view
        assert self.whole is not None
        last = [int(v) for v in self.whole.tolist()]
        if max(last) + 1 >= _FLOAT32_EXACT:  # (float64 counts are not joined)
            self.whole, self.held, self.addresses = None, [], []
            return _advance_apart(states)
        self.whole.add_(1.0)
        return [v + 1 for v in last]

    def undo(self, states: list[dict[str, Any]]) -> None:
        """Take back `advance` (a step refused before any update)."""
        torch._foreach_sub_([state["step"] for state in states], 1.0)


# float32 counts from which adding one would round (2^24): counts widen to float64 there
_FLOAT32_EXACT = 1 << 24


def _advance_apart(states: list[dict[str, Any]]) -> list[int]:
    """`StepCounts.advance` of counts not joined, in a fixed number of calls; a float32
    count about to pass 2^24 goes on in float64 first (from there adding one to a float32
    rounds back: every later step would take the same count, so the same random bits, and
    stochastic rounding would no longer be random); float64 counts are exact to 2^53; a
    16-bit count goes on in float32."""
    counts = torch.stack([state["step"].to("cpu", torch.float64) for state in states])
    last = [int(v) for v in counts.tolist()]
    for state, count in zip(states, last, strict=True):
        if count + 1 >= _FLOAT32_EXACT and state["step"].dtype != torch.float64:
            state["step"] = state["step"].to(torch.float64)
        elif state["step"].dtype not in (torch.float32, torch.float64):
            # (a 16-bit count, made in a 16-bit default dtype or loaded so, stops at 256:
            # 256 + 1 rounds back in bfloat16)
            state["step"] = state["step"].to(torch.float32)
    torch._foreach_add_([state["step"] for state in states], 1.0)
    return [v + 1 for v in last]


_F32_MAX = torch.finfo(torch.float32).max


def settled(w: torch.Tensor, c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The Kahan buffer ``c`` beside the weights ``w`` (both in the math dtype; ``dtype``
    the weights' 16-bit one) with 0 in the entries that cannot be the rounding error a step
    left there. A step leaves in each entry the error of its weight's new value: half the
    spacing of ``dtype``'s numbers where the weight and its entry together lie (the binade
    of ``w + c``: at a power of two an entry toward zero lies in the binade below, whose
    spacing is half), and one step of the buffer's own 16-bit grid more (where half a
    spacing is under the smallest subnormal, that subnormal): the sum is rounded to float32
    before the 16-bit grid (at a float32 tie the error passes half a spacing by half a
    float32 unit), and the buffer is rounded stochastically to its grid, up as well as
    down. An entry past that was left beside another weight: its weight was written since
    by something else (pruned to zero, loaded, written in place through ``.data``, which no
    version counter sees), and the old weight's error would move the new one. Each step
    applies it, so no write that moves a weight by more than the rounding error of its
    binade keeps its old entry; an entry whose weight kept its value (a clamp that clipped
    nothing, an EMA swapped in and back) keeps its error. A write to a nearby value (a
    state loaded whose weight lies in the old one's binade) cannot be told from a step's
    own, by value: its old entry, at most the half spacing a rounding of the write could
    add, is added once."""
    bits, tiny = (7, 2.0**-133) if dtype == torch.bfloat16 else (10, 2.0**-24)
    # the binade of |w + c| (the mask drops the sign; 0 where the sum is subnormal)
    binade = ((w + c).view(torch.int32) & 0x7F800000).view(torch.float32)
    half = binade * 2.0 ** -(bits + 1)
    # a step of the buffer's grid above half a spacing. Where half a spacing is under the
    # smallest subnormal the bound is that subnormal: half + tiny lies below the next grid
    # point, and ``c`` is on the grid (every buffer a step writes is stored in ``dtype``),
    # so the test is the same. (A buffer kept from a state saved in another dtype may lie
    # off the grid: there an entry a little over the smallest subnormal, beside a weight
    # in the lowest binades, is kept.)
    bound = half + (half * 2.0**-bits).clamp_min(tiny)
    # (written as what is kept: an entry of NaN, or of an infinity beside a weight whose
    # binade it makes infinite, is never a rounding error; a non-finite gradient applied
    # leaves one, and a weight loaded since would take it)
    return c.masked_fill(~(c.abs() <= bound.clamp_max(_F32_MAX)), 0.0)


def written_mark(p: torch.Tensor) -> tuple[int, int | None]:
    """What changes when ``p`` is written: its version counter (an in-place write) and, for
    a plain tensor, its memory (``p.data = ...``, which keeps the counter). A step records
    it after writing a weight, to tell the user's edits from its own at the next."""
    plain = type(p) in (torch.Tensor, torch.nn.Parameter)
    return p._version, p.data_ptr() if plain else None


def _joinable(count: Any) -> bool:
    """Whether a step count can join `StepCounts`' tensor: a 0-dim float32 CPU tensor."""
    return (
        type(count) is torch.Tensor
        and count.dim() == 0
        and count.dtype == torch.float32
        and count.device.type == "cpu"
        and not count.requires_grad
    )


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


def wrap32(x: int) -> int:
    """``x`` modulo 2^32 as a signed 32-bit value (a key moved by an element offset)."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x
