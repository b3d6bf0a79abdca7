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

bfloat16 tensors are stepped as int32 pairs (`mixprec.optim.engine.Lanes`): each value is
read as a float32 by moving it into the high half, and written back from the high half of
its result (rounded by integer arithmetic on those bits), so the kernel sees 32-bit types
only, which inductor's C++ kernels vectorize with native conversions (16-bit lanes fall
back to scalar loops). The weight's write-back (plain, Kahan or stochastic) and the random
bits are the engine's (`mixprec.optim.engine`), the low-bit optimizers' too: element i of
a call takes the two 16-bit halves of ``hash32(i + key)``, a bijection of the 32-bit
values, with ``key`` hashed from (seed, step count, parameter index, part) (`call_key`):
each element's two values are uniform and independent, and the state is the seed and the
step counts, so a resumed run is bit-identical.

The same functions run eagerly where nothing is compiled and give bit-identical results on
a CPU (inductor compiles without floating-point contraction; eager float32 ``sqrt``, not
correctly rounded, is taken in float64: ``_sqrt``). On CUDA, Triton may fuse a multiply and
an add, so the two can differ in the last bit. Design notes and costs: docs/pure-bf16.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from mixprec.optim.engine import Lanes, write_back

__all__ = []

log = logging.getLogger(__name__)


# -- the elementwise step (one function for the compiled and the eager path) -----------------


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded square root: eager float32 ``sqrt`` on a CPU is not (inductor's is,
    and the float64 root rounded to float32 is)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling():
        return x.double().sqrt_().float()
    return x.sqrt()


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
    all of one shape, or bfloat16 pairs: ``Lanes``), in place. ``s``: beta1, (1 - beta1)
    times the sign of the gradient (-1 to maximize), beta2, 1 - beta2, 1 / sqrt(1 -
    beta2^step), eps, -lr / (1 - beta1^step), then (``decay`` "decoupled") -lr times the
    weight decay or (``decay`` "l2") the weight decay times the sign; a tensor of the math
    dtype compiled, floats eagerly. ``key``, ``start``: the random bits (``random_bits``) of
    the first element. Out of place only: an in-place operation on a temporary splits the
    compiled kernel in two."""
    lanes = Lanes(p, start, key)
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
        results.append([lanes.nearest(m_new), v_out, *write_back(lanes, p, w, u, c0, second, kind)])
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
    lanes = Lanes(p, start, key)
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
        results.append([b_out, *write_back(lanes, p, w, grad * s[5], c0, noise, kind)])
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
