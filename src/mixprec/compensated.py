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

``Compensator.step(optimizer)`` replaces ``optimizer.step()`` for ``torch.optim.AdamW``,
``Adam`` and ``SGD`` (momentum, dampening, nesterov, weight decay, maximize): it reads the
optimizer's own parameter groups (so learning-rate schedulers keep working) and keeps its
state in the optimizer's ``state`` under torch's keys (``exp_avg``, ``exp_avg_sq``,
``momentum_buffer``, ``step``) plus ``"compensation"`` for the Kahan buffer, all in the
parameter's 16-bit dtype. The math runs in float32 (float64 for float64 parameters).
Adam's second moment and the Kahan buffer are written back with stochastic rounding in both
modes: with beta2 = 0.999 each increment of the second moment is below half a bfloat16 step,
and rounding it to nearest freezes it; the buffer's own rounding errors, always rounded to
nearest, add up the same way. Measured over 1,000 AdamW updates of 1e-4 of each weight
(tests/test_compensated.py): all state rounded to nearest, Kahan ends up to 2.3 bfloat16 steps
from float64; with these two stochastic, within 0.64. The first moment and SGD's momentum
(increments of 10% and more) round to nearest.

The step runs in batches (2^18 elements per thread on a CPU): weights, gradients and
moments are copied into float32 scratch buffers kept from step to step (about 5.5 MiB per
CPU thread, never more than the group needs), computed on in place, and written back; the
random bits of a batch come from one generator call. Fresh full-size float32 copies cost more
in page faults than the arithmetic on a CPU, and a batch that fits the cache makes its ~25
passes there.

Why our own ``torch._foreach_*`` code rather than a dependency on torch-optimi (measured
side by side, ``python benchmarks/compensated.py``, benchmarks/results/compensated.md): the
bytes are the same (10 per parameter with AdamW and Kahan). optimi's step is faster here
(7.9 ms against 21.8 ms for 2.1M parameters on one thread of a quiet AVX2 CPU, 5.3 against
30.9 on two: it steps in bfloat16 in place, we copy to float32 and round the second moment
and the buffer stochastically), but it rounds its bfloat16 second moment to nearest, and
over 1,000 AdamW updates of 1e-4 its Kahan weights end 2.25 bfloat16 steps from float64
(they move 13.0 steps where float64 moves 14.6), ours 0.64-0.82 (seeds 0-5). And optimi
replaces the optimizer class, while a user's scheduler, ``Precision.setup`` and checkpoints
hold the torch optimizer: stepping the torch optimizer's own groups and state keeps them
working, lets a checkpoint resume with or without compensation, and adds no dependency.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "COMPENSATED_DTYPES",
    "COMPENSATIONS",
    "Compensator",
    "check_compensation",
    "stochastic_round_",
]

COMPENSATIONS: tuple[str, ...] = ("kahan", "stochastic")
# parameter dtypes whose updates are compensated (others step plainly in their own dtype)
COMPENSATED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
SUPPORTED = (torch.optim.Adam, torch.optim.SGD)  # AdamW is an Adam subclass
# elements per batch of a step (see ``Compensator._batches``): on the CPU 2^18 per thread (each
# thread's share of a float32 buffer stays cache-sized, and more threads launch no more
# kernels); on an accelerator large enough that the number of kernel launches stays small
CPU_BATCH_PER_THREAD = 1 << 18
BATCH_ELEMENTS = 1 << 22  # float32 scratch of about 80 MiB on the device


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
    """Write ``src`` (float32) into the 16-bit ``dst``, rounding up or down at random with
    probability proportional to the distance, so the result equals ``src`` on average.

    bfloat16 is the top half of float32: uniform random low 16 bits are added to the bit
    pattern and then cut off. float16 goes through its two neighbours (``nextafter``).
    """
    words = torch.empty((src.numel() + 3) // 4, dtype=torch.int64, device=src.device)
    (noise,) = _random_halves([src.numel()], words, generator)
    _round_(dst, src.to(torch.float32, copy=True), noise)


def _random_halves(
    sizes: list[int], words: torch.Tensor, generator: torch.Generator | None
) -> list[torch.Tensor]:
    """One tensor of ``n`` uniform int16 values per size, all cut from a single draw of 64-bit
    ``words`` (four values a word, ``sum((n + 3) // 4)`` of them): the CPU generator's cost is
    per draw and per call, and the full 64-bit range takes no modulo."""
    counts = [(n + 3) // 4 for n in sizes]
    words.random_(-(2**63), None, generator=generator)
    return [w.view(torch.int16)[:n] for w, n in zip(words.split(counts), sizes, strict=True)]


def _round_(dst: torch.Tensor, src: torch.Tensor, noise: torch.Tensor) -> None:
    """Stochastic rounding of the float32 ``src`` into ``dst`` with the int16 ``noise``
    (one per element); ``src`` is overwritten.

    bfloat16: ``src``'s bits plus a uniform value in [0, 65536) (the signed noise plus
    32768), in place on its int32 view, then its low 16 bits are cut off.
    """
    noise = noise.view(src.shape)
    if dst.dtype == torch.bfloat16:
        bits = src.view(torch.int32).add_(noise).add_(32768)
        dst.copy_(bits.bitwise_and_(-65536).view(torch.float32))
        return
    near = src.to(dst.dtype)
    toward = torch.where(src > near.float(), math.inf, -math.inf).to(dst.dtype)
    other = torch.nextafter(near, toward)
    gap = other.float() - near.float()
    p = torch.where(gap != 0, (src - near.float()) / gap, 0.0)
    dst.copy_(torch.where(noise.float() + 32768 < p * 65536, other, near))


def _math_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


class Compensator:
    """Steps a torch AdamW/Adam/SGD with compensated updates of its 16-bit parameters.

    Args:
        kind: ``"kahan"`` or ``"stochastic"``.
        seed: seeds the generator of the stochastic rounding; None draws one from torch's
            global generator (so ``torch.manual_seed`` makes a run reproducible). The
            generator's state is in ``state_dict``: a resumed run is bit-identical.
    """

    def __init__(self, kind: str, seed: int | None = None) -> None:
        if check_compensation(kind) is None:
            raise ValueError("a Compensator needs compensation='kahan' or 'stochastic'")
        self.kind = kind
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    @staticmethod
    def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
        """Raise ``TypeError``/``ValueError`` unless ``optimizer`` can be compensated."""
        if not isinstance(optimizer, SUPPORTED):
            raise TypeError(
                f"compensated updates support torch.optim.AdamW, Adam and SGD, got "
                f"{type(optimizer).__name__}; use master_weights=True for other optimizers"
            )
        for group in optimizer.param_groups:
            if group.get("amsgrad"):
                raise ValueError("compensated updates do not support Adam(amsgrad=True)")

    def generator(self, device: torch.device) -> torch.Generator:
        """The stochastic-rounding generator for ``device`` (created on first use)."""
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[key]

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One step of ``optimizer``'s algorithm on every parameter with a gradient."""
        self.check_optimizer(optimizer)
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise ValueError("compensated updates do not support sparse gradients")
            if isinstance(optimizer, torch.optim.Adam):
                self._adam(optimizer, group, params)
            else:
                self._sgd(optimizer, group, params)
        # lr schedulers check that the optimizer stepped before them
        optimizer._opt_called = True  # type: ignore[attr-defined]

    def _state(self, optimizer: torch.optim.Optimizer, p: torch.Tensor, *keys: str) -> dict:
        state = optimizer.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            for key in keys:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if self.kind == "kahan" and p.dtype in COMPENSATED_DTYPES and "compensation" not in state:
            state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        return state

    def _adam(self, optimizer: Any, group: dict, params: list[torch.Tensor]) -> None:
        decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get(
            "decoupled_weight_decay", False
        )
        # Bias correction is per parameter: torch's Adam counts each parameter's own steps,
        # and one that had no gradient for some steps is behind the others. Parameters with
        # equal counts (usually all of them) are batched together.
        by_step: dict[float, list[list[torch.Tensor]]] = {}
        for p in params:
            s = self._state(optimizer, p, "exp_avg", "exp_avg_sq")
            row = [p, p.grad, s["exp_avg"], s["exp_avg_sq"], *self._compensation(p, s)]
            by_step.setdefault(s["step"].item(), []).append(row)
        for step, rows in by_step.items():
            self._adam_rows(group, rows, step, decoupled)

    def _adam_rows(
        self, group: dict, rows: list[list[torch.Tensor]], step: float, decoupled: bool
    ) -> None:
        """Adam on `rows` (parameter, gradient, moments[, Kahan buffer]) whose parameters
        all took `step` steps, so they share one bias correction."""
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        bias1, bias2_sqrt = 1 - beta1**step, math.sqrt(1 - beta2**step)
        for batch, (g, w, m, v, d) in self._batches(rows, 5):
            p16, grad, exp_avg, exp_avg_sq, *comp = batch  # comp: [Kahan buffers] or []
            self._load_grads(group, g, grad, w, p16)
            if wd and not decoupled:
                torch._foreach_add_(g, w, alpha=wd)
            torch._foreach_copy_(m, exp_avg)
            torch._foreach_lerp_(m, g, 1 - beta1)
            torch._foreach_copy_(exp_avg, m)
            torch._foreach_copy_(v, exp_avg_sq)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, g, g, value=1 - beta2)
            for x, y in zip(v, d, strict=True):
                torch.sqrt(x, out=y)
            self._store(exp_avg_sq, v)
            torch._foreach_div_(d, bias2_sqrt)
            torch._foreach_add_(d, eps)
            torch._foreach_div_(m, d)  # m is now the update
            torch._foreach_mul_(m, -lr / bias1)
            if wd and decoupled:
                torch._foreach_add_(m, w, alpha=-lr * wd)
            self._apply(p16, w, m, comp[0] if comp else [], spare=d)

    def _sgd(self, optimizer: Any, group: dict, params: list[torch.Tensor]) -> None:
        lr, momentum, dampening = float(group["lr"]), group["momentum"], group["dampening"]
        wd, nesterov = group["weight_decay"], group["nesterov"]
        states = [self._state(optimizer, p) for p in params]
        first = [bool(momentum) and s.get("momentum_buffer") is None for s in states]
        for p, s, new in zip(params, states, first, strict=True):
            if new:  # torch starts the buffer at the gradient
                s["momentum_buffer"] = torch.empty_like(p)
        for start in (True, False):
            rows = [
                [p, p.grad, *self._compensation(p, s)]
                + ([s["momentum_buffer"]] if momentum else [])
                for p, s, new in zip(params, states, first, strict=True)
                if new == start
            ]
            for batch, (g, w, b, d) in self._batches(rows, 4):
                p16, grad, *rest = batch  # rest: [Kahan buffers] and [momentum buffers]
                comp = rest[0] if len(rest) > int(bool(momentum)) else []
                self._load_grads(group, g, grad, w, p16)
                if wd:
                    torch._foreach_add_(g, w, alpha=wd)
                if momentum:
                    if start:
                        torch._foreach_copy_(b, g)
                    else:
                        torch._foreach_copy_(b, rest[-1])
                        torch._foreach_mul_(b, momentum)
                        torch._foreach_add_(b, g, alpha=1 - dampening)
                    torch._foreach_copy_(rest[-1], b)
                    if nesterov:
                        torch._foreach_add_(g, b, alpha=momentum)
                    else:
                        g = b
                torch._foreach_mul_(g, -lr)  # g is now the update
                self._apply(p16, w, g, comp, spare=d)

    def _compensation(self, p: torch.Tensor, state: dict) -> list[torch.Tensor]:
        """``[state["compensation"]]`` for a Kahan-compensated 16-bit ``p``, else ``[]``."""
        kahan = self.kind == "kahan" and p.dtype in COMPENSATED_DTYPES
        return [state["compensation"]] if kahan else []

    @staticmethod
    def _load_grads(
        group: dict,
        g: list[torch.Tensor],
        grad: list[torch.Tensor],
        w: list[torch.Tensor],
        p: list[torch.Tensor],
    ) -> None:
        """Gradients (negated for ``maximize``) and weights into the math-dtype buffers."""
        torch._foreach_copy_(g, grad)
        if group.get("maximize"):
            torch._foreach_neg_(g)
        torch._foreach_copy_(w, p)

    def _batches(
        self, rows: list[list[torch.Tensor]], buffers: int
    ) -> Iterator[tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]]:
        """``rows`` (each the parameter and its same-shaped tensors) in batches of at most
        ``BATCH_ELEMENTS`` elements (``CPU_BATCH_PER_THREAD`` per thread on the CPU), by
        device, math dtype and 16-bit or not: each batch as its columns and ``buffers`` lists
        of scratch tensors shaped like its pieces.

        The scratch is kept from step to step: float32 copies of whole tensors cost more in
        page faults on a CPU than the arithmetic, and a batch that fits the cache makes its
        passes there. Contiguous tensors are cut into flat pieces; others go whole.
        """
        kinds: dict[tuple[str, torch.dtype, bool], list[list[torch.Tensor]]] = {}
        for row in rows:
            p = row[0]
            key = (str(p.device), _math_dtype(p), p.dtype in COMPENSATED_DTYPES)
            kinds.setdefault(key, []).append(row)
        for (device, dtype, _), same in kinds.items():
            size = BATCH_ELEMENTS
            if torch.device(device).type == "cpu":
                size = CPU_BATCH_PER_THREAD * torch.get_num_threads()
            pieces: list[list[torch.Tensor]] = []
            for row in same:
                if all(t.is_contiguous() for t in row):
                    flat = [t.view(-1) for t in row]
                    n = flat[0].numel()
                    pieces += [[f[i : i + size] for f in flat] for i in range(0, n, size)]
                else:
                    pieces.append(row)
            batch: list[list[torch.Tensor]] = []
            total = 0
            for piece in [*pieces, None]:
                n = 0 if piece is None else piece[0].numel()
                if batch and (piece is None or total + n > size):
                    yield self._columns(batch, total, buffers, device, dtype)
                    batch, total = [], 0
                if piece is not None:
                    batch.append(piece)
                    total += n

    def _columns(
        self,
        batch: list[list[torch.Tensor]],
        total: int,
        buffers: int,
        device: str,
        dtype: torch.dtype,
    ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        """The batch's columns and ``buffers`` scratch lists shaped like its pieces."""
        flat = self._scratch(device, dtype, buffers * total).view(buffers, total)
        sizes = [piece[0].numel() for piece in batch]
        scratch = [
            [s.view(piece[0].shape) for s, piece in zip(buf.split(sizes), batch, strict=True)]
            for buf in flat
        ]
        return [list(col) for col in zip(*batch, strict=True)], scratch

    def _scratch(self, device: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A reused 1-D buffer of ``numel`` elements (grown when a step needs more)."""
        buf = self._buffers.get((device, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[(device, dtype)] = buf
        return buf[:numel]

    def _store(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        """Write slowly changing state back: 16-bit tensors are rounded stochastically, so
        increments below half a 16-bit step still count (see the module docstring). ``src``
        may be overwritten."""
        if dst and dst[0].dtype in COMPENSATED_DTYPES:  # a batch is all 16-bit or none
            self._round_all(dst, src)
        else:
            torch._foreach_copy_(dst, src)

    def _round_all(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        """Stochastic rounding of each float32 ``src`` (overwritten) into its 16-bit ``dst``
        (one device), with one draw of random bits for them all."""
        if not dst:
            return
        device = dst[0].device
        sizes = [d.numel() for d in dst]
        words = self._scratch(str(device), torch.int64, sum((n + 3) // 4 for n in sizes))
        noise = _random_halves(sizes, words, self.generator(device))
        for d, s, r in zip(dst, src, noise, strict=True):
            _round_(d, s, r)

    def _apply(
        self,
        params: list[torch.Tensor],
        weights: list[torch.Tensor],
        update: list[torch.Tensor],
        comp: list[torch.Tensor],
        spare: list[torch.Tensor],
    ) -> None:
        """``params = weights + update``, compensated for the 16-bit ones (``comp`` holds
        their Kahan buffers); overwrites ``weights``, ``update`` and ``spare``."""
        if params[0].dtype not in COMPENSATED_DTYPES:  # a batch is all 16-bit or none
            torch._foreach_add_(weights, update)
            torch._foreach_copy_(params, weights)
        elif self.kind == "stochastic":
            torch._foreach_add_(weights, update)
            self._round_all(params, weights)
        else:
            torch._foreach_add_(update, comp)  # what earlier roundings lost
            for p, w, u, moved in zip(params, weights, update, spare, strict=True):
                torch.add(w, u, out=p)  # the float32 sum, rounded to nearest
                # the part of the update that made it into the parameter (exact)
                torch.sub(p, w, out=moved)
            torch._foreach_sub_(update, spare)
            self._round_all(comp, update)

    def state_dict(self) -> dict[str, Any]:
        """The kind, the seed and each device's stochastic-rounding generator state."""
        return {
            "kind": self.kind,
            "seed": self.seed,
            "generators": {k: g.get_state() for k, g in self._generators.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict``; the kind must match (a run changes it by starting anew)."""
        if state.get("kind") != self.kind:
            raise ValueError(
                f"the checkpoint was trained with compensation {state.get('kind')!r}, this "
                f"optimizer uses {self.kind!r}"
            )
        self.seed = int(state["seed"])
        self._generators = {}
        for key, saved in state["generators"].items():
            self.generator(torch.device(key)).set_state(saved)
