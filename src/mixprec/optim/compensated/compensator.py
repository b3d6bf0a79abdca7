"""`Compensator`: steps a torch AdamW, Adam or SGD with compensated updates of its 16-bit
parameters, from the optimizer's own groups and state, inside its step hooks. Parameters are
gathered into kernel calls (large ones alone and in place, small ones from one packed copy,
kept between steps as scratch), each call run compiled or eagerly
(`mixprec.optim.compensated.kernels`)."""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Mapping
from operator import is_
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from mixprec.aliasing import overlapping
from mixprec.eager import uncompiled
from mixprec.optim.compensated.kernels import KERNELS, compiled_step, on_memory
from mixprec.optim.compensated.rules import check_optimizer
from mixprec.optim.engine import (
    COMPENSATED_DTYPES,
    COMPILE_MIN_ELEMENTS,
    CompileGate,
    StepCounts,
    call_key,
    check_compensation,
    check_seed,
)

__all__ = ["COMPILE_MIN_ELEMENTS", "SMALL", "Compensator"]

# parameters with fewer elements (or not contiguous) are stepped together from one packed
# copy: one kernel call for all of them instead of one each (a compiled call's fixed cost
# is about what copying a tensor of this size in and out costs on a CPU)
SMALL = 1 << 17
# elements per kernel call (element indices stay int32); a larger tensor takes several
# calls, each with its own key
CALL_MAX = 1 << 30
# a packed copy of at most this many elements is kept for the next steps (`Compensator._pack`),
# at most this many of them
PACK_KEPT = 1 << 18
PACKS_KEPT = 4
# elements per slice on the eager path: on a CPU its float32 temporaries stay cache-sized; on
# an accelerator slices are large, so that the ~40 kernel launches per slice are few
EAGER_CHUNK = 1 << 16
EAGER_CHUNK_ACCELERATOR = 1 << 22


_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})


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
        # packed alone, its memory shared with another parameter's (`Compensator._add`)
        self.own = False


class _Pack:
    """A packed copy of a call's small parameters: one flat tensor per column (the
    weights, gradients, states), the pieces of it shaped as each row's tensors, and the
    flat tensors as the kernel takes them (int32 for bfloat16 pairs). Pairs of an odd
    number of elements take one more, stepped and dropped (each element's step reads its
    own values only)."""

    def __init__(self, columns: list[tuple], pairs: bool) -> None:
        sizes = [t.numel() for t in columns[0]]
        total = sum(sizes) + (sum(sizes) % 2 if pairs else 0)
        flats = [None if col[0] is None else col[0].new_zeros(total) for col in columns]
        pieces = [
            None if flat is None else [
                piece.view(t.shape)
                for piece, t in zip(flat[: sum(sizes)].split(sizes), col, strict=True)
            ]
            for col, flat in zip(columns, flats, strict=True)
        ]  # fmt: skip
        # every piece, in the order of the columns' tensors (what a step copies in), and
        # those of the columns a step writes (all but the gradients': what it copies out)
        self.into = [piece for column in pieces if column for piece in column]
        self.out = [
            piece for j, column in enumerate(pieces) if j != 1 and column for piece in column
        ]
        width = 2 if pairs else 1  # elements per kernel element
        self.lanes = [
            None if flat is None else on_memory(flat, 0, (total // width,), pairs) for flat in flats
        ]
        # where the weights lay when `overlaps` last looked (and what it found)
        self.places: list[tuple[int, tuple[int, ...]]] = []
        self.overlap = False

    def overlaps(self, weights: tuple[torch.Tensor, ...]) -> bool:
        """Whether two of ``weights`` (the rows' first column) share memory; read again
        only where a weight moved (its address or strides) since the last step asked."""
        places = [(t.data_ptr(), t.stride()) for t in weights]
        if places != self.places:
            self.places, self.overlap = places, bool(overlapping(list(weights)))
        return self.overlap


# the state tensors of an Adam row, in the order a plan checks them
_ADAM_STATE = ("exp_avg", "exp_avg_sq", "compensation")


class _Planned:
    """One call of a `_Plan`: the call (its step and scalars renewed at each step), the
    groups its rows come from (their scalars must still agree), and what a step hands the
    kernel besides the gradients, which are new at every step (the step's own are let go:
    a plan keeps no gradient alive)."""

    def __init__(self, call: _Call, groups: list[dict], pack: _Pack | None) -> None:
        self.call = call
        self.groups = groups
        first = call.rows[0][1]
        # what `_add` files a packed call by, besides its scalars: a fresh filing joins two
        # packed calls whose scalars became equal
        self.key = (tuple(None if t is None else t.dtype for t in first), first[0].device)
        if call.own:  # (never joined with another: its memory is shared)
            self.key += (call.rows[0][0],)
        for _, tensors in call.rows:
            tensors[1] = None
        rows = [tensors for _, tensors in call.rows]
        columns = list(zip(*rows, strict=True))
        self.columns = columns  # (a fresh pack's shapes: the gradients' column is None)
        self.pack = pack  # packed: the kept pack (None: one made at each step, as `_pack`)
        # packed: the copy in is the weights, the gradients, the states; the copy out all
        # but the gradients
        self.weights = list(columns[0])
        self.states = [t for col in columns[2:] if col[0] is not None for t in col]
        self.out = [
            t for j, col in enumerate(columns) if j != 1 and col[0] is not None for t in col
        ]
        width = 2 if call.pairs else 1
        self.flat = (
            None
            if call.packed
            else [
                None if t is None else on_memory(t, 0, (t.numel() // width,), call.pairs)
                for t in rows[0]
            ]
        )


class _Plan:
    """A step's filing (`Compensator._update`) kept for the next steps of the same
    optimizer while what it was made from holds: the same groups holding the same
    parameters, a gradient where there was one (of the same dtype, dense), the same state
    dicts and state tensors on the same memory, the weights on the same memory in the same
    dtypes, shapes and strides, and one step count for all. A step then renews the
    gradients and the scalars, copies, runs and copies back, without filing again: a small
    model's step is its Python, and filing costs about thirty calls a parameter. Anything
    else (a load, a parameter added or unfrozen, a weight moved, a state replaced, counts
    apart, groups whose scalars parted) files afresh. Adam and AdamW only, without complex
    parameters or weights sharing memory."""

    def __init__(self, optimizer: torch.optim.Optimizer, work: list[tuple], calls: list) -> None:
        self.state = optimizer.state
        self.groups = [(g, list(g["params"])) for g in optimizer.param_groups]
        self.all = [p for _, params in self.groups for p in params]
        self.without = [p.grad is None for p in self.all]
        self.params = [p for _, _, p, _ in work]
        self.states = [state for *_, state in work]
        # the optimizer's state dict, keys and values (compared by identity: a lookup by
        # tensor costs a Python call a parameter)
        self.keys, self.values = list(self.state), list(self.state.values())
        self.grads = [p.grad.dtype for p in self.params]
        self.held = [state.get(name) for state in self.states for name in _ADAM_STATE]
        # the weights and states: where and how they lie (a state given a transposed view
        # of its memory through `.data` keeps its address)
        self.places = _places(self.params + [t for t in self.held if t is not None])
        self.calls = calls
        self.compensated = sum(planned.call.numel for planned in calls if planned.call.kind)

    def gradients(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor] | None:
        """The parameters' gradients where the plan still describes ``optimizer``, else None."""
        if optimizer.state is not self.state or len(optimizer.param_groups) != len(self.groups):
            return None
        for group, (planned, params) in zip(optimizer.param_groups, self.groups, strict=True):
            now = group["params"]
            if group is not planned or len(now) != len(params) or not all(map(is_, now, params)):
                return None
        if [p.grad is None for p in self.all] != self.without:
            return None
        grads = [p.grad for p in self.params]
        if [g.dtype for g in grads] != self.grads or any([g.is_sparse for g in grads]):
            return None
        state = self.state
        if len(state) != len(self.keys) or not (
            all(map(is_, state, self.keys)) and all(map(is_, state.values(), self.values))
        ):
            return None
        held = [state.get(name) for state in self.states for name in _ADAM_STATE]
        if not all(map(is_, held, self.held)):
            return None
        watched = self.params + [t for t in held if t is not None]
        return grads if _places(watched) == self.places else None


def _places(tensors: list[torch.Tensor]) -> tuple[list, ...]:
    """Where and how each tensor lies, as a filing reads it: its address, dtype, size and
    strides (which with the size give the shape; cheaper to read than ``shape``)."""
    return (
        [t.data_ptr() for t in tensors],
        [t.dtype for t in tensors],
        [t.numel() for t in tensors],
        [t.stride() for t in tensors],
    )


def _alone(row: list[torch.Tensor | None], pairs: bool, any_size: bool = False) -> bool:
    """Whether these tensors (a weight and its states) can be stepped alone, in place:
    large (unless `any_size`), contiguous, and as bfloat16 pairs of an even size from even
    offsets."""
    first = row[0]
    assert first is not None
    if not any_size and (first.numel() < SMALL or (pairs and first.numel() % 2)):
        return False
    return all(
        t is None or (t.is_contiguous() and not (pairs and t.storage_offset() % 2)) for t in row
    )


def _in_line(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient as a weight stepped alone reads it: contiguous from an even offset (a
    copy of it where it is not; the step only reads it)."""
    return None if grad is None else grad.clone(memory_format=torch.contiguous_format)


def _twice(work: list[tuple]) -> str:
    """What a step refuses when a parameter is listed twice in a group."""
    seen: dict[int, int] = {}
    for _, i, p, _ in work:
        if id(p) in seen:
            return (
                f"the parameter at positions {seen[id(p)]} and {i} of the optimizer's groups "
                "is the same tensor: torch's optimizer steps it twice (and warns that this "
                "will become an error); a compensated step refuses it: list each parameter once"
            )
        seen[id(p)] = i
    raise AssertionError("no parameter is listed twice")


def _hooked(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step of ``optimizer`` has step hooks to run (its own or torch's global
    ones), which torch's step wrapper runs (`torch.optim.Optimizer.profile_hook_step`); a
    torch without one of the hook tables is taken as hooked."""
    tables = (
        getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
        getattr(torch_optimizer, "_global_optimizer_post_hooks", None),
        getattr(optimizer, "_optimizer_step_pre_hooks", None),
        getattr(optimizer, "_optimizer_step_post_hooks", None),
    )
    return any(table is None or len(table) for table in tables)


# a profiler record of a step under torch's name, as torch's wrapper makes (a profiler on
# any thread sees it), at a twentieth of its cost; torch's own record where torch lacks it.
# (An execution trace observer running without a profiler records ops only: not this name.)
_record = getattr(
    torch._C._profiler, "_RecordFunctionFast", torch.autograd.profiler.record_function
)


def _drawn_seed() -> int:
    """A seed from torch's global generator; in a process group of several ranks, rank 0's
    (a broadcast): replicas whose generators were seeded apart would otherwise round their
    weights apart, and DDP never brings them back together."""
    seed = torch.randint(0, 2**62, (1,))
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        seed = seed.to(device)
        dist.broadcast(seed, src=0)
    return int(seed.item())


class Compensator:
    """Steps a torch AdamW/Adam/SGD with compensated updates of its 16-bit parameters.

    Args:
        kind: ``"kahan"`` or ``"stochastic"``.
        seed: seeds the stochastic rounding; None draws one from torch's global generator
            (so ``torch.manual_seed`` makes a run reproducible), rank 0's in a process group
            (every rank builds its Compensator: the seed is broadcast, so DDP's replicas,
            seeded apart for their dropout, round alike). The rounding of a step
            depends on the seed and the optimizer's step counts only, and the seed is in
            ``state_dict``: a resumed run is bit-identical.
        compile: ``None`` compiles the step with torch.compile when it covers
            ``COMPILE_MIN_ELEMENTS`` or more 16-bit elements on a device that can build
            (a Linux CPU with a C++ compiler, CUDA with Triton); ``True`` compiles every
            call of two or more elements; ``False`` runs the same math eagerly. The results
            are the same on a CPU (`mixprec.optim.compensated.kernels`).
    """

    def __init__(self, kind: str, seed: int | None = None, compile: bool | None = None) -> None:
        if check_compensation(kind) is None:
            raise ValueError("a Compensator needs compensation='kahan' or 'stochastic'")
        # the engine's gate: the same one the low-bit optimizers take
        self._gate = CompileGate(
            compile,
            "compensated step",
            "Compensator(..., compile=False) skips the attempt",
            COMPILE_MIN_ELEMENTS,
        )
        self.kind = kind
        self.seed = _drawn_seed() if seed is None else check_seed(seed)
        self.compile = compile
        # the step counts of the states it steps, advanced together (the engine's)
        self._counts = StepCounts()
        # the packed copies kept for the next steps (`_pack`), the most recent last
        self._packs: dict[tuple, _Pack] = {}
        # the optimizers whose loads keep float32 moments (`attach`)
        self._attached: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        # each optimizer's last filing, for the next steps (`_Plan`)
        self._plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Plan] = (
            weakref.WeakKeyDictionary()
        )
        self._warned_narrow = False

    def __getstate__(self) -> dict[str, Any]:
        """Without the packed copies (scratch of the original's tensors) and plans."""
        return {**self.__dict__, "_packs": {}, "_attached": None, "_plans": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.pop("_written", None)  # (the record of writes one pickled before kept)
        self._packs = {}
        # (a copy's optimizers are others; torch's pickle drops their hooks)
        self._attached = weakref.WeakSet()
        self._plans = weakref.WeakKeyDictionary()
        self.__dict__.setdefault("_warned_narrow", False)
        if getattr(self, "_counts", None) is None:  # (one pickled before counts were kept)
            self._counts = StepCounts()

    check_optimizer = staticmethod(check_optimizer)

    def compiles(self, optimizer: torch.optim.Optimizer, device: torch.device | str) -> bool:
        """Whether a step of every parameter of ``optimizer`` on ``device`` runs compiled
        (its first such step builds the kernel: seconds, once per process): the gate's
        answer for its 16-bit elements, the ones a compensation steps."""
        compensated = sum(
            p.numel()
            for group in optimizer.param_groups
            for p in group["params"]
            if p.requires_grad and p.dtype in COMPENSATED_DTYPES
        )
        return compensated > 0 and self._gate.wants(torch.device(device), compensated)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook ``optimizer``'s ``load_state_dict`` so that a state loaded into it keeps the
        float32 Adam moments of its float16 parameters as they were saved: torch's load casts
        them to float16, where a second moment under float16's range (gradients below about
        2.4e-4) becomes 0 and the next update divides by ``eps``. `step` attaches each
        optimizer it steps (an in-process rollback is kept); call it before loading a saved
        state into an optimizer this Compensator has not stepped yet (a resumed run)."""
        if optimizer in self._attached:
            return
        self._attached.add(optimizer)
        loading: list[Mapping[str, Any]] = []

        def before(opt: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
            loading[:] = [state]  # (one load at a time; a failed one's is replaced)

        def after(opt: torch.optim.Optimizer) -> None:
            if loading:
                _keep_float32_moments(opt, loading.pop())

        optimizer.register_load_state_dict_pre_hook(before)
        optimizer.register_load_state_dict_post_hook(after)

    @uncompiled
    def step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any] | None = None,
        *,
        attach: bool = True,
    ) -> Any:
        """One step of ``optimizer``'s algorithm on every parameter with a gradient (outside
        any enclosing torch.compile: it compiles its own kernels), in place of
        ``optimizer.step(closure)``: the optimizer's step pre- and post-hooks and torch's
        global ones run around it as around torch's step (pre-hooks may replace the
        arguments), and ``closure``, if given, is called once with gradients enabled before
        the update; its loss is returned (None without one). ``attach``: `attach` the
        optimizer on its first step (a `LossScaleOptimizer`, whose loads keep the saved
        dtypes by rules of its own, passes False)."""
        self.check_optimizer(optimizer)
        if attach and optimizer not in self._attached:
            self.attach(optimizer)
        if closure is None and not _hooked(optimizer):
            # torch's wrapper without its hook loops: its profiler record (torch's name, for
            # every observer), the update, its profiler entry point
            with _record(f"Optimizer.step#{type(optimizer).__name__}.step"):
                with torch.no_grad():
                    self._update(optimizer)
                optimizer._optimizer_step_code()  # type: ignore[attr-defined]
            return None
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
        """Update every parameter with a gradient (under no_grad): as the last step's
        plan has it where it still holds (`_Plan`), else filed afresh (and planned)."""
        plan = self._plans.get(optimizer)
        if plan is not None and self._replay(plan, optimizer):
            optimizer._opt_called = True  # type: ignore[attr-defined]
            return
        self._plans.pop(optimizer, None)
        calls: dict[tuple, _Call] = {}
        adam = isinstance(optimizer, torch.optim.Adam)
        decoupled = isinstance(optimizer, torch.optim.AdamW)
        work = []
        index = 0  # each parameter's position in the optimizer: part of its random key
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params, start=index):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("compensated updates do not support sparse gradients")
                work.append((group, i, p, self._prepared(optimizer.state[p], p, adam)))
            index += len(params)
        if len({id(p) for _, _, p, _ in work}) < len(work):
            raise ValueError(_twice(work))
        # distinct parameters over the same memory (a view of a weight listed beside it):
        # each steps from a call of its own, the calls in the parameters' order, as torch
        # steps them (largest first, a large weight stepped before a view listed ahead of it)
        shared = {id(work[i][2]) for i in overlapping([p for _, _, p, _ in work])}
        steps: list[int] = []
        if work:
            # every step count on by one and read back in a fixed number of calls, whatever
            # the number of parameters (torch's Adam counts each parameter's own steps: one
            # that had no gradient for a while is behind the others, with its own bias
            # correction)
            steps = self._counts.advance([state for *_, state in work])
        # (Adam's scalars depend on the group and the step only: made once per pair)
        made: dict[tuple[int, int], tuple[list[float], str | None]] = {}
        for (group, i, p, state), step in zip(work, steps, strict=True):
            own = id(p) in shared
            if adam:
                scalars = made.get((id(group), step))
                if scalars is None:
                    scalars = made[id(group), step] = self._adam_scalars(group, step, decoupled)
                self._add_adam(calls, i, p, state, step, scalars, own)
            else:
                self._add_sgd(calls, group, i, p, state, step, own)
        compensated = sum(call.numel for call in calls.values() if call.kind)
        scalars: dict[tuple, torch.Tensor] = {}
        # the largest first: a compiled step's first call sets its threading by its size
        # (with parameters sharing memory, in the parameters' order)
        if shared:
            ordered = sorted(calls.values(), key=lambda call: call.rows[0][0])
        else:
            ordered = sorted(calls.values(), key=lambda call: -call.numel)
        for call in ordered:
            self._run(call, compensated, scalars)
        # lr schedulers check that the optimizer stepped before them
        optimizer._opt_called = True  # type: ignore[attr-defined]
        plan = self._plan(optimizer, work, ordered, steps)
        if plan is not None:
            self._plans[optimizer] = plan

    def _plan(
        self,
        optimizer: torch.optim.Optimizer,
        work: list[tuple],
        calls: list[_Call],
        steps: list[int],
    ) -> _Plan | None:
        """The plan of a step filed as ``calls`` (`_Plan`), where it can have one."""
        if not work or not isinstance(optimizer, torch.optim.Adam) or len(set(steps)) != 1:
            return None
        if any(p.is_complex() for _, _, p, _ in work):
            return None  # (stepped as real views, made afresh at each step)
        group_of = {index: group for group, index, _, _ in work}
        planned = []
        for call in calls:
            rows = [tensors for _, tensors in call.rows]
            if any(t is not None and t.shape != row[0].shape for row in rows for t in row):
                return None  # (a state in another shape than its weight: `_run`'s own pack)
            pack = None
            if call.packed:
                columns = list(zip(*rows, strict=True))
                if len(rows) > 1 and overlapping(list(columns[0])):
                    return None  # (stepped one by one: `_run`)
                if call.numel <= PACK_KEPT:
                    pack = self._pack(call, columns)
            groups = list({id(g): g for g in (group_of[i] for i, _ in call.rows)}.values())
            planned.append(_Planned(call, groups, pack))
        return _Plan(optimizer, work, planned)

    def _replay(self, plan: _Plan, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` as ``plan`` has it; False (nothing done) where the plan no
        longer describes it."""
        grads = plan.gradients(optimizer)
        if grads is None:
            return False
        of = dict(zip(map(id, plan.params), grads, strict=True))
        mine = [[of[id(w)] for w in planned.weights] for planned in plan.calls]
        steps = self._counts.advance(plan.states)
        step = steps[0]
        decoupled = isinstance(optimizer, torch.optim.AdamW)
        made: dict[int, tuple[list[float], str | None]] = {}
        for planned in plan.calls:
            for g in planned.groups:
                if id(g) not in made:
                    made[id(g)] = self._adam_scalars(g, step, decoupled)
        packed = [
            (tuple(made[id(planned.groups[0])][0]), made[id(planned.groups[0])][1], planned.key)
            for planned in plan.calls
            if planned.call.packed
        ]
        apart = len(set(packed)) < len(packed)  # (calls filed apart whose scalars met)
        for planned in plan.calls:
            ours = [made[id(g)] for g in planned.groups]
            if (
                apart
                or steps.count(step) != len(steps)
                or any(other != ours[0] for other in ours)
                or ours[0][1] != planned.call.decay
            ):  # (counts apart, or groups filed together whose scalars parted)
                self._counts.undo(plan.states)
                return False
        scalars: dict[tuple, torch.Tensor] = {}
        for planned, grads_in in zip(plan.calls, mine, strict=True):
            call = planned.call
            call.step, call.scalars = step, made[id(planned.groups[0])][0]
            p = planned.weights[0]
            dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            known = (tuple(call.scalars), dtype, p.device)
            if known not in scalars:
                scalars[known] = torch.tensor(call.scalars, dtype=dtype, device=p.device)
            if call.packed:
                pack = planned.pack
                if pack is None:
                    first, _, *rest = planned.columns
                    pack = _Pack([first, tuple(grads_in), *rest], call.pairs)
                torch._foreach_copy_(pack.into, planned.weights + grads_in + planned.states)
                self._kernel(call, pack.lanes, scalars[known], call.rows[0][0], plan.compensated)
                torch._foreach_copy_(planned.out, pack.out)
            else:
                flat = list(planned.flat)
                g = grads_in[0]
                if not _alone([g], call.pairs, any_size=True):  # (as `_add`: a copy in line)
                    g = _in_line(g)
                flat[1] = on_memory(g, 0, (g.numel() // (2 if call.pairs else 1),), call.pairs)
                self._kernel(call, flat, scalars[known], call.rows[0][0], plan.compensated)
                torch.autograd.graph.increment_version(planned.out)
        return True

    def _kind(self, p: torch.Tensor) -> str | None:
        return self.kind if p.dtype in COMPENSATED_DTYPES else None

    def _prepared(self, state: dict, p: torch.Tensor, adam: bool) -> dict:
        """``p``'s state, made on its first step as torch's Adam or SGD makes it (and a
        step count for SGD, which torch keeps none of: the random key reads it), but for
        Adam's moments of a float16 parameter, which are float32: float16 holds no square
        of a gradient under 2.4e-4 (it is 0, and the update divides the first moment by
        ``eps``: a weight moved by ~1e3 in a step). Float16 moments made elsewhere (torch's
        own steps before, a state loaded into an optimizer not `attach`-ed, which torch's
        load casts to the parameter's dtype) are widened at the step, with a warning: what
        float16 could not hold is lost."""
        if adam and "step" not in state:
            wide = torch.float32 if p.dtype == torch.float16 else p.dtype
            state["step"] = torch.tensor(0.0, dtype=torch.float32)  # (not the default dtype)
            for name in ("exp_avg", "exp_avg_sq"):
                state[name] = torch.zeros_like(p, dtype=wide, memory_format=torch.preserve_format)
        elif (
            adam
            and p.dtype == torch.float16
            and torch.float16
            in (
                state["exp_avg"].dtype,
                state["exp_avg_sq"].dtype,
            )
        ):
            for name in ("exp_avg", "exp_avg_sq"):
                state[name] = state[name].float()
            if not self._warned_narrow:
                self._warned_narrow = True
                warnings.warn(
                    "a float16 parameter's Adam moments were float16 (made by torch's own "
                    "step, or cast by torch's load_state_dict): they go on in float32, but "
                    "second moments under float16's range were lost as 0. To resume a "
                    "compensated run, call compensator.attach(optimizer) before "
                    "optimizer.load_state_dict(...): the saved float32 moments are kept",
                    stacklevel=5,
                )
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)  # (not the default dtype)
        return state

    @staticmethod
    def _adam_scalars(group: dict, step: int, decoupled: bool) -> tuple[list[float], str | None]:
        """Adam's scalars (as ``kernels._adam`` takes them) and the decay's form, for
        ``group`` at ``step``."""
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        wd = group["weight_decay"]
        # (a group's own flag, as torch's Adam and AdamW read it; the class's without one)
        decoupled = bool(group.get("decoupled_weight_decay", decoupled))
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
        return scalars, decay

    def _add_adam(
        self,
        calls: dict,
        index: int,
        p: torch.Tensor,
        state: dict,
        step: int,
        scalars: tuple[list[float], str | None],
        own: bool = False,
    ) -> None:
        kind = self._kind(p)
        buffer = self._buffer(state, p) if kind == "kahan" else None
        row = [p, p.grad, state["exp_avg"], state["exp_avg_sq"], buffer]
        self._add(calls, "adam", kind, scalars[0], step, index, row, scalars[1], own)

    def _add_sgd(
        self,
        calls: dict,
        group: dict,
        index: int,
        p: torch.Tensor,
        state: dict,
        step: int,
        own: bool = False,
    ) -> None:
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
        self._add(calls, "sgd", kind, scalars, step, index, row, decay, own)

    @staticmethod
    def _buffer(state: dict, p: torch.Tensor) -> torch.Tensor:
        """``p``'s Kahan buffer, made at its first step. Each step keeps only the entries that
        can be its weight's last rounding error (`engine.settled`): a weight written since by
        something else (pruned, loaded) does not take the old weight's error."""
        buffer = state.get("compensation")
        if buffer is None:
            buffer = state["compensation"] = torch.zeros_like(
                p, memory_format=torch.preserve_format
            )
        return buffer

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
        own: bool = False,
    ) -> None:
        """File the parameter's ``row`` under a call: alone if large and contiguous (and,
        stepped as bfloat16 pairs, of an even size from an even offset), else with the
        small ones of the same scalars, decay form, step, device and dtypes; ``own``: in a
        call of its own whatever its size (its memory shared with another parameter)."""
        if kind != "kahan":
            row = row[:-1]  # no Kahan buffer
        # (set and count tests: this runs for every parameter at every step)
        layout = tuple([None if t is None else t.dtype for t in row])
        if not _COMPLEX.isdisjoint(layout):
            # a complex tensor steps as its real and imaginary parts, as torch's Adam and
            # SGD step it (read as real, its imaginary part was dropped)
            row = [t if t is None or not t.is_complex() else torch.view_as_real(t) for t in row]
            layout = tuple([None if t is None else t.dtype for t in row])
        pairs = kind is not None and layout.count(torch.bfloat16) + layout.count(None) == len(row)
        # stepped alone or packed by the weight and its states: never by the gradient's
        # layout (DDP's bucket views give it other offsets from one step to the next, and the
        # random keys would follow); a gradient out of line for it steps from a copy
        alone = _alone([row[0], *row[2:]], pairs)
        if alone and not _alone(row[1:2], pairs, any_size=True):
            row = [row[0], _in_line(row[1]), *row[2:]]
        # (the decay's form too: a decoupled decay's scalar may equal another group's L2 one)
        key = (index if alone or own else None, algorithm, kind, step, tuple(scalars), decay)
        key += (layout,)
        key += (row[0].device,)
        if key not in calls:
            calls[key] = _Call(algorithm, kind, scalars, step, decay, not alone, pairs)
            calls[key].own = own and not alone
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
                None if t is None else on_memory(t, 0, (t.numel() // width,), call.pairs)
                for t in rows[0]
            ]
            self._kernel(call, flat, s, call.rows[0][0], compensated)
            # written through other tensors on their memory: autograd's in-place checks
            # (a graph saved before the step, backpropagated after it) must see the writes
            torch.autograd.graph.increment_version(
                [t for j, t in enumerate(rows[0]) if t is not None and j != 1]
            )
            return
        columns = list(zip(*rows, strict=True))
        pack = self._pack(call, columns)
        if len(rows) > 1 and pack.overlaps(columns[0]):
            # distinct parameters on one memory (a tied weight and its transpose): a packed
            # copy reads them all before writing any, so one's update would overwrite the
            # other's; each steps from a pack of its own, in turn, as torch steps them
            for index, row in call.rows:
                one = _Call(
                    call.algorithm, call.kind, call.scalars, call.step, call.decay, True, call.pairs
                )
                one.rows.append((index, row))
                one.numel = row[0].numel()  # type: ignore[union-attr]
                self._run(one, compensated, scalars)
            return
        # in: every column's tensors onto the pack's pieces, one copy for all
        src = [t for col in columns if col[0] is not None for t in col]
        torch._foreach_copy_(pack.into, src)
        self._kernel(call, pack.lanes, s, call.rows[0][0], compensated)
        # out: the results back onto the weights and states (the gradient is only read)
        dst = [t for j, col in enumerate(columns) if j != 1 and col[0] is not None for t in col]
        torch._foreach_copy_(dst, pack.out)

    def _pack(self, call: _Call, columns: list[tuple]) -> _Pack:
        """The packed copy for ``columns`` (one tuple of tensors per row position): kept
        between steps for the same tensors' shapes and dtypes when it is small (a step of a
        small model is its calls' Python cost: slicing a fresh copy cost more than the
        copies), else made for this step."""
        # (by every tensor's shape, the states' too: a state of its weight's size in another
        # shape, (8,) beside a (1, 8) weight, copies into the weight-shaped piece by
        # broadcasting, and its copy out, after the weights were written, would fail)
        key = (call.pairs, columns[0][0].device)
        key += tuple(None if col[0] is None else col[0].dtype for col in columns)
        key += tuple(t.shape for col in columns if col[0] is not None for t in col)
        packs = self._packs
        pack = packs.pop(key, None)
        if pack is None:
            pack = _Pack(columns, call.pairs)
            if call.numel > PACK_KEPT:
                return pack
        packs[key] = pack  # the most recent last
        while len(packs) > PACKS_KEPT:
            packs.pop(next(iter(packs)))
        return pack

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
        compiled = call.kind is not None and self._gate.wants(p.device, compensated)
        kernel = KERNELS[call.algorithm, call.kind]
        width = 2 if call.pairs else 1  # elements per kernel element
        most = CALL_MAX // width
        eager_scalars: list[float] | None = None  # the same values as Python floats
        for part, begin in enumerate(range(0, p.numel(), most)):
            n = min(most, p.numel() - begin)
            piece = flat
            if p.numel() > most:
                piece = [None if t is None else on_memory(t, begin, (n,)) for t in flat]
            key = call_key(self.seed, call.step, index, part)
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

    def _compiled_call(
        self,
        call: _Call,
        tensors: list[torch.Tensor | None],
        scalars: torch.Tensor,
        key: torch.Tensor,
    ) -> bool:
        """Run the compiled step; False (with one warning, and eager steps from then on) if
        ``compile=None`` chose to compile and the build failed before anything ran."""
        step = compiled_step(call.algorithm, call.kind)
        eager = KERNELS[call.algorithm, call.kind]
        return self._gate.run(step, *tensors, scalars, key, call.decay, eager=eager, stacklevel=4)[
            1
        ]

    def state_dict(self) -> dict[str, Any]:
        """The kind and the seed (the rounding's only state besides the step counts, which
        the optimizer's state holds)."""
        return {"kind": self.kind, "seed": self.seed}

    def check_state_dict(self, state: Any) -> None:
        """Raise, changing nothing, what `load_state_dict` refuses in ``state``: not a dict,
        another kind (a run changes it by starting anew), no seed, or a seed that is not an
        int (`LossScaleOptimizer.check_state_dict` asks it before loading anything)."""
        if not isinstance(state, Mapping):
            raise TypeError(
                f"a compensation state is a dict (from Compensator.state_dict()), got "
                f"{type(state).__name__}"
            )
        if state.get("kind") != self.kind:
            raise ValueError(
                f"the checkpoint was trained with compensation {state.get('kind')!r}, this "
                f"optimizer uses {self.kind!r}"
            )
        if "seed" not in state:
            raise ValueError(
                f"this compensation state has no 'seed' (keys {sorted(state)}): pass the "
                f"dict Compensator.state_dict() returned"
            )
        check_seed(state["seed"])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict``, refused as `check_state_dict` says. Other keys
        (random-generator states, which some saved states hold) are ignored: the rounding
        draws from no generator."""
        self.check_state_dict(state)
        self.seed = check_seed(state["seed"])


def _keep_float32_moments(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    """After torch's ``load_state_dict`` of ``saved`` into ``optimizer``: the float16
    parameters' Adam moments saved in float32 (as a compensated step keeps them) back in
    float32, where the load cast them to float16 (`Compensator.attach`)."""
    index = [i for group in saved["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p, key in zip(params, index, strict=True):
        loaded = optimizer.state.get(p) if p.dtype == torch.float16 else None
        if not loaded:
            continue
        for name in ("exp_avg", "exp_avg_sq"):
            value = saved["state"].get(key, {}).get(name)
            now = loaded.get(name)
            if (
                torch.is_tensor(value)
                and value.dtype == torch.float32
                and torch.is_tensor(now)
                and now.dtype == torch.float16
            ):
                loaded[name] = value.to(now.device, copy=True)
