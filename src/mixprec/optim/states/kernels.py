"""The updates of the low-bit optimizers: one elementwise function per algorithm that
decodes moments, updates them and the parameters in float32, and encodes them again, all on
a flat tensor cut into blocks (no Python loop over blocks): one parameter's, or a bucket's
parameters concatenated (`mixprec.optim.states.buckets`).

The same function runs eagerly or compiled by ``torch.compile`` (shapes dynamic, so one
build serves every parameter size; the hyperparameters arrive in one float32 tensor, so a
learning-rate schedule changes values, not the compiled code). The format, the decay and
the compensation are Python constants the build specializes on.

Parameters are updated in float32 (float64 ones in float64) and written back by the
engine's write-back (`mixprec.optim.engine.write_back`, the one the compensated steps of
torch's optimizers take): rounded to nearest, Kahan-compensated (``"kahan"``: a buffer in
the parameter's dtype holds what the last rounding lost and is added to the next update) or
stochastically rounded (``"stochastic"``), with the engine's random bits (``key``: a
signed 32-bit value hashed from the seed, the step count and the parameter's index,
`call_key`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from mixprec.optim.engine import Lanes, can_compile, write_back
from mixprec.optim.states import native
from mixprec.optim.states.formats import StateFormat, decode, encode

__all__ = ["can_compile"]

log = logging.getLogger(__name__)

# the builds one update function may hold (formats x dtypes x compensations x size classes)
RECOMPILE_LIMIT = 64


def _load(
    state: torch.Tensor,
    scales: torch.Tensor | None,
    tables: tuple[torch.Tensor, ...],
    fmt: StateFormat,
    signed: bool,
) -> torch.Tensor:
    """A moment in float32: (blocks, block) for a low-bit format, flat for float32."""
    if scales is None:
        return state
    return decode(state, scales, fmt, signed, tables)


def _store(
    value: torch.Tensor,
    state: torch.Tensor,
    scales: torch.Tensor | None,
    fmt: StateFormat,
    signed: bool,
    tables: tuple[torch.Tensor, ...],
) -> None:
    if scales is None:
        state.copy_(value)
        return
    codes, new_scales = encode(value, fmt, signed, tables)
    # stored block by block, as the moment was computed: one loop nest for the block's
    # reduction, its codes and the parameter's update (a flat store would be a loop of its
    # own, fed by float32 copies of the moment and its codes)
    blocks = value.shape[0]
    state.view(blocks, -1).copy_(codes.view(blocks, -1))
    scales.copy_(new_scales)


def _write(
    p: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    buf: torch.Tensor | None,
    key: torch.Tensor | int,
    compensation: str | None,
) -> None:
    """Write ``w + u`` (the float32 weight and its update) into ``p`` by the engine's
    write-back: as ``compensation`` says, with ``buf`` the Kahan buffer and ``key`` the
    random bits of the call's first element."""
    lanes = Lanes(p, 0, key)
    noise = None if compensation is None else lanes.noise(0)[1]
    c = None if buf is None else buf.to(torch.float32)
    lanes.store([p, buf], [write_back(lanes, p, w, u, c, noise, compensation)])


def _same_sizes(
    fmt: StateFormat, p: torch.Tensor, others: tuple[torch.Tensor | None, ...], *moments
) -> None:
    """Tell the compiler that the flat tensors of one update have the sizes ``p``'s implies
    (each is marked dynamic on its own, so each size would otherwise be a symbol of its
    own, and loops over different symbols are never fused into one); eagerly, a check."""
    n = p.shape[0]
    for t in others:
        if t is not None:
            torch._check(t.shape[0] == n)
    for codes, scales in moments:
        if scales is not None:
            torch._check(codes.shape[0] == fmt.codec.code_count(n))
            torch._check(scales.shape[0] * fmt.block == n)


def _blocks(x: torch.Tensor | None, fmt: StateFormat) -> torch.Tensor | None:
    """A flat tensor as (blocks, block) for a low-bit format, so that the moments' blocks,
    the parameter and its gradient share one iteration space (one fused loop); as it is
    for float32."""
    if x is None or not fmt.quantized:
        return x
    return x.view(-1, fmt.block)  # type: ignore[arg-type]


def _working_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype an update computes in: float32, or float64 for a float64 parameter (a
    complex128 one's real pairs), which float32 arithmetic would round at every step."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def adam_update(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    m_scales: torch.Tensor | None,
    v: torch.Tensor,
    v_scales: torch.Tensor | None,
    tables: tuple[torch.Tensor, ...],
    buf: torch.Tensor | None,
    hp: torch.Tensor,
    key: torch.Tensor | int,
    kind: str,
    block: int | None,
    decoupled: bool,
    compensation: str | None,
) -> None:
    """One Adam/AdamW update of the flat parameter ``p`` (a whole number of blocks for a
    low-bit format) with the flat gradient ``g``; the moments in the format ``kind`` and
    ``block`` name (codes and scales, or float32 with no scales); ``tables``: the first
    moment's `code_tables`, then the second's; ``hp``: float32 (lr, beta1, beta2, eps,
    weight_decay, lr / (1 - beta1^step), (1 - beta2^step)^-1/2, 1 - beta1, 1 - beta2: the
    last two from the betas in double, as torch's AdamW takes them, since 1 - beta2 taken from
    float32 beta2 is off by up to 1e-3 of itself for beta2 = 0.99999). Decoupled weight decay
    (AdamW) or L2 added to the gradient (Adam). ``p`` is written in place by the engine's
    write-back (``compensation``, with the Kahan buffer ``buf`` and the random bits of
    ``key``: a one-element int32 tensor compiled, an int eagerly)."""
    fmt = StateFormat(kind, block)
    lr, beta1, beta2, eps, wd, step_size, inv_sqrt_bc2, gain1, gain2 = hp.unbind()
    _same_sizes(fmt, p, (g, buf), (m, m_scales), (v, v_scales))
    p, g, buf = _blocks(p, fmt), _blocks(g, fmt), _blocks(buf, fmt)
    work = _working_dtype(p)
    p32 = p.to(work)
    g32 = g.to(work)
    if not decoupled:
        g32 = g32 + wd * p32
    m1 = torch.lerp(_load(m, m_scales, tables[:1], fmt, True).to(work), g32, gain1)
    m2 = _load(v, v_scales, tables[1:], fmt, False).to(work) * beta2 + gain2 * g32 * g32
    _store(m1, m, m_scales, fmt, True, tables[:1])
    _store(m2, v, v_scales, fmt, False, tables[1:])
    u = -(step_size * m1 / (m2.sqrt() * inv_sqrt_bc2 + eps))
    if decoupled:
        u = u - (lr * wd) * p32
    _write(p, p32, u, buf, key, compensation)


def sgd_update(
    p: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor | None,
    b_scales: torch.Tensor | None,
    tables: tuple[torch.Tensor, ...],
    buf: torch.Tensor | None,
    hp: torch.Tensor,
    key: torch.Tensor | int,
    kind: str,
    block: int | None,
    nesterov: bool,
    compensation: str | None,
) -> None:
    """One SGD update of the flat ``p``, with momentum buffer ``b`` (None without momentum)
    in the format ``kind`` and ``block`` name; ``hp``: float32 (lr, keep, gain,
    weight_decay, momentum), ``keep`` and ``gain`` 0 and 1 on the first step, so that the
    buffer starts as the gradient, as torch's does."""
    fmt = StateFormat(kind, block)
    lr, keep, gain, wd, momentum = hp.unbind()
    _same_sizes(fmt, p, (g, buf), (b, b_scales))
    p, g, buf = _blocks(p, fmt), _blocks(g, fmt), _blocks(buf, fmt)
    work = _working_dtype(p)
    p32 = p.to(work)
    d = g.to(work) + wd * p32
    if b is not None:
        mom = _load(b, b_scales, tables, fmt, True).to(work) * keep + gain * d
        _store(mom, b, b_scales, fmt, True, tables)
        d = d + momentum * mom if nesterov else mom
    _write(p, p32, -lr * d, buf, key, compensation)


_KERNELS: dict[str, Callable[..., None]] = {
    "adam": adam_update,
    "sgd": sgd_update,
}
_COMPILED: dict[str, Callable[..., None]] = {}
# the dynamo settings of every compiled call (`run_compiled` says why)
_SETTINGS = dict(recompile_limit=RECOMPILE_LIMIT, automatic_dynamic_shapes=False)
_PATCHER: list[Callable[[], Callable[[], None]]] = []


def _apply_settings() -> Callable[[], None]:
    """Set `_SETTINGS` and return the function restoring them: dynamo's low-overhead patcher
    (a third of a context manager's cost) where the installed torch has it, made at the
    first compiled call (importing dynamo takes about a second, which a process that never
    compiles, as the bench's and the planner's measuring ones, does not pay)."""
    if not _PATCHER:
        config = torch._dynamo.config
        if hasattr(config, "_make_closure_patcher"):
            _PATCHER.append(config._make_closure_patcher(**_SETTINGS))
        else:  # pragma: no cover - torch without it

            def patcher() -> Callable[[], None]:
                patch = config.patch(**_SETTINGS)
                patch.__enter__()
                return lambda: patch.__exit__(None, None, None)

            _PATCHER.append(patcher)
    return _PATCHER[0]()


def _options() -> dict[str, Any]:
    """The inductor settings of the compiled updates. Inductor on a CPU stores a pointwise
    expression of more than 50 operations that is read twice to a buffer of its own; a
    dynamic map's nearest code is one, and storing it costs a float32 write and read an
    element more than computing it where it is read. So that threshold is raised to 100 where
    the installed inductor has it (a version without it has one threshold for every device,
    left as it is)."""
    from torch._inductor import config

    # 16-bit round trips kept (Kahan's rounded weight) and float32 division rounded as
    # eager's (Triton's own division is approximate)
    options: dict[str, Any] = {"emulate_precision_casts": True}
    if hasattr(getattr(config, "eager_numerics", None), "division_rounding"):
        options["eager_numerics.division_rounding"] = True
    if hasattr(config, "realize_cpu_opcount_threshold"):
        options["realize_cpu_opcount_threshold"] = 100
    return options


def compiled(algorithm: str) -> Callable[..., None]:
    """The torch.compile'd update of ``algorithm`` (``"adam"`` or ``"sgd"``), built on
    first use; `run_compiled` calls it with dynamic sizes (one build per format, dtype and
    compensation)."""
    if algorithm not in _COMPILED:
        log.info("compiling the low-bit %s update: the first call builds it", algorithm)
        _COMPILED[algorithm] = torch.compile(
            _KERNELS[algorithm], fullgraph=True, options=_options()
        )
    return _COMPILED[algorithm]


def run_compiled(algorithm: str, args: tuple) -> None:
    """Call the compiled update of ``algorithm`` on ``args`` (those of `adam_update` or
    `sgd_update`), the first dimension of every tensor but the tables and ``hp`` marked
    dynamic: one build serves every size, while the block stays a constant of the code."""
    if algorithm == "adam" and native.adam(args):  # the hand-written kernel, where it applies
        return None
    for t in args[:-6]:  # not hp, the key and the constants after them
        if torch.is_tensor(t):
            torch._dynamo.maybe_mark_dynamic(t, 0)
    # each format, dtype, compensation and size class (one block, several) is a build of
    # the one function: more than torch's default of 8 builds per function in a model that
    # mixes formats, past which the update would silently run uncompiled. And no automatic
    # dynamic shapes: a second block size would make the block a symbol in every later build
    # (vector loops of unknown length, several times slower), where each is a constant
    restore = _apply_settings()
    try:
        return compiled(algorithm)(*args)
    finally:
        restore()


def eager(algorithm: str) -> Callable[..., None]:
    """The update of ``algorithm`` run op by op (the compiled one's math)."""
    return _KERNELS[algorithm]
