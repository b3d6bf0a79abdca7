"""Adam, AdamW and SGD keeping their moments in low-bit state formats.

Each parameter's moments are kept in the format its group's ``"states"`` key names (the
optimizer's ``states=`` by default): ``"float32"``, ``"int8"``, ``"int4"``, ``"float8"`` or
a registered one (`mixprec.optim.states.formats`). Parameters with fewer than ``min_size``
elements, and those ``keep_float32`` picks, keep float32 moments. The format a parameter
got is recorded in its state (``"format"``), so a checkpoint restores the same layout; a
state recorded in another format than the parameter takes now (a checkpoint of another
format, a group whose ``"states"`` changed) is decoded and stored in the new one, on load
or at the next step.
A complex parameter is stepped as its real pairs, as torch's optimizers step it.

State keys: torch's (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, float32, the
parameter's shape) for float32 moments, so that such a state loads into torch's optimizers
and back; ``<moment>_codes`` and ``<moment>_scales`` for low-bit ones; ``step`` as torch
keeps it; ``compensation`` for the Kahan buffer of a 16-bit parameter.

A parameter sharded by FSDP2 (a DTensor) is stepped on its local shard: the blocks are cut
within the shard. Its states are DTensors sharded along their only dimension over the
parameter's mesh, every rank's codes padded to the same number of blocks (the largest
shard's), so that `torch.distributed.checkpoint` saves and loads each rank's part.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from numbers import Real
from operator import is_
from typing import Any, NamedTuple

import torch

from mixprec.aliasing import memory_of, overlapping
from mixprec.eager import uncompiled
from mixprec.optim.engine import (
    COMPENSATED_DTYPES,
    COMPILE_MIN_ELEMENTS,
    CompileGate,
    StepCounts,
    call_key,
    check_compensation,
    check_seed,
    wrap32,
)
from mixprec.optim.states import buckets as buckets_
from mixprec.optim.states import codecs, kernels, native
from mixprec.optim.states.checkpoint import UNSUPPORTED_FLAGS, StateCheckpoint, refuse_flags
from mixprec.optim.states.formats import (
    StateFormat,
    code_tables,
    parse_state_format,
)
from mixprec.optim.states.moments import (
    MOMENTS,
    PLAIN,
    elements_of,
    local_part,
    real_view,
    shard_offset,
    zero_moment,
)

__all__ = [
    "COMPILE_MIN_ELEMENTS",
    "MIN_SIZE",
    "AdamW4bit",
    "AdamW8bit",
    "AdamWFp8",
    "LowBitAdam",
    "LowBitAdamW",
    "LowBitOptimizer",
    "LowBitSGD",
    "fitted_format",
    "state_bytes",
]

# parameters with fewer elements keep float32 moments (their bytes are few, their scales
# would be many)
MIN_SIZE = 4096
# elements per call of a low-bit update, which holds its moments in float32 meanwhile: on
# an accelerator few calls; on a CPU, where the compiled update runs as loops over the
# elements that hand float32 buffers on to each other, few enough that those buffers stay in
# the core's cache rather than making trips to memory (the update is otherwise memory-bound)
CHUNK = 1 << 22
CPU_CHUNK = 1 << 18
_FLOAT32 = StateFormat("float32")


def _items(x: Any) -> tuple[Any, ...]:
    """The items of ``x`` (a tuple, list, array or tensor of hyperparameters); none for a
    string or a value that is not a collection."""
    if isinstance(x, str | bytes):
        return ()
    try:
        return tuple(x)
    except TypeError:
        return ()


def _is_real(x: Any) -> bool:
    """Whether ``x`` is a real number (not a bool) or a one-element tensor of one, as a
    hyperparameter must be."""
    if torch.is_tensor(x):
        return x.numel() == 1 and not x.is_complex() and x.dtype != torch.bool
    return isinstance(x, Real) and not isinstance(x, bool)


def _scalar(x: Any) -> Any:
    """A one-element tensor hyperparameter as a 0-dim one (torch's fused steps take numbers
    and 0-dim tensors only; torch's own optimizers take either shape)."""
    return x.reshape(()) if torch.is_tensor(x) and x.dim() else x


def fitted_format(fmt: StateFormat, p: torch.Tensor) -> StateFormat:
    """The format ``p``'s moments take in ``fmt``: its block no larger than ``p``'s elements
    rounded up to the kind's default block (a block past the parameter would only store
    padding)."""
    if not fmt.quantized:
        return fmt
    return _fit(fmt, elements_of(p), codecs.generation())


@functools.lru_cache(maxsize=1024)
def _fit(fmt: StateFormat, elements: int, generation: int) -> StateFormat:
    """`fitted_format` of a parameter of ``elements``, remembered (per registry
    ``generation``): a step asks for each parameter's."""
    default = fmt.codec.default_block
    most = max(-(-elements // default), 1) * default
    return fmt if fmt.block <= most else StateFormat(fmt.kind, most)  # type: ignore[operator]


def _scalar_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of the hyperparameters ``p``'s update reads: its working dtype (float64
    for a float64 parameter or a complex128 one's real pairs, whose update computes in
    float64: float32 values would round the learning rate and the betas, about 5e-8 of
    each, where torch's optimizers take them in double), else float32."""
    return torch.float64 if real_view(p).dtype == torch.float64 else torch.float32


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in their logical order as one flat tensor: a view of a contiguous
    ``t``, else a copy (to be copied back)."""
    return t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)


def _copy_back(flat: torch.Tensor, t: torch.Tensor) -> None:
    """Copy ``flat`` (`_flat` of ``t``) into ``t`` unless it is a view of it."""
    if flat.data_ptr() != t.data_ptr():
        t.copy_(flat.view(t.shape))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as bytes when it holds one-byte floating codes (float8, which
    concatenation and ``_foreach_copy_`` may not take), else ``t``."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.dtype.itemsize == 1 else t


class _Float8Codes:
    """A float8 tensor as a pickle holds it: its bytes, viewed back as float8 on loading
    (torch's own pickle of a float8 tensor stores it, but cannot load it)."""

    def __init__(self, codes: torch.Tensor) -> None:
        self.codes = codes

    @staticmethod
    def of(value: Any) -> Any:
        """``value``, or its stand-in if it is a float8 tensor (a plain one)."""
        float8 = type(value) is torch.Tensor and value.dtype.itemsize == 1
        return _Float8Codes(value) if float8 and value.dtype.is_floating_point else value

    def __reduce__(self) -> tuple:
        return _float8_view, (self.codes.view(torch.uint8), str(self.codes.dtype))


def _own_memory(value: Any) -> Any:
    """``value``, or a copy of it where it is a tensor viewing more memory than its own
    elements (a slice of a joined moment)."""
    if (
        type(value) is torch.Tensor
        and value.untyped_storage().nbytes() > value.numel() * value.element_size()
    ):
        return value.clone()
    return value


def _float8_view(codes: torch.Tensor, dtype: str) -> torch.Tensor:
    """The bytes ``codes`` as the float8 dtype named ``dtype`` (``"torch.float8_e4m3fn"``)."""
    return codes.view(getattr(torch, dtype.removeprefix("torch.")))


class _Hyper(NamedTuple):
    """A parameter's hyperparameters at a step: what besides its group tells parameters
    sharing them apart (``tag``), the kernel's values, the fused step's floats (None: the
    values), the flags the kernel specializes on (``statics``) and every setting the plan
    depends on (``form``: the statics and any other, as whether SGD has momentum)."""

    tag: tuple
    values: list[float]
    floats: list[float] | None
    statics: tuple
    form: tuple


@dataclasses.dataclass
class _Planned:
    """One parameter's update this step: its state, its format, its moments' flat views
    (codes and scales, or a float32 moment and None), the code tables, the hyperparameters
    (a float32 tensor for the kernel, and floats for the fused step of float32 moments) and
    the algorithm's flags."""

    p: torch.Tensor
    state: dict[str, Any]
    fmt: StateFormat
    moments: list[tuple[torch.Tensor | None, torch.Tensor | None]]
    tables: tuple[torch.Tensor, ...]
    hp: torch.Tensor
    values: tuple[float, ...]
    statics: tuple
    form: tuple
    device: torch.device
    index: int = 0  # the parameter's position in the optimizer
    step: int = 0  # its step count this step


@dataclasses.dataclass
class _Joined:
    """A bucket's per-parameter state joined into flat tensors: per moment, what the update
    reads (the flat codes as bytes and the flat scales, or a flat float32 moment and None);
    the Kahan buffers' flat tensor (each parameter's padded to whole blocks as the
    parameters are), if any; per parameter, the tensors put in its state (by key) as
    slices of those, so that a state replaced since is seen by identity, and their
    addresses, so that one given other memory through ``.data`` is seen too; and the
    padding each parameter was joined with (the Kahan buffer's layout)."""

    flats: list[tuple[torch.Tensor | None, torch.Tensor | None]]
    buf: torch.Tensor | None
    held: list[dict[str, torch.Tensor]]
    states: list[dict[str, Any]]
    pads: list[int]
    tensors: list[torch.Tensor] = dataclasses.field(default_factory=list)
    addresses: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.tensors = [t for held in self.held for t in held.values()]
        self.addresses = list(map(torch.Tensor.data_ptr, self.tensors))

    def current(self, states: list[dict[str, Any]], pads: list[int]) -> bool:
        """Whether every state of ``states`` (the bucket's parameters' now: a loaded state
        dict makes new ones) still holds the slices put in it, on their memory, and the
        parameters are padded as when joined (a format changed since pads them otherwise:
        the Kahan buffer, the one tensor a format change keeps, lies as the old padding
        put it); if so they are the ones `release` acts on from now."""
        if pads != self.pads:
            return False
        for state, held in zip(states, self.held, strict=True):
            if not all(map(is_, map(state.get, held), held.values())):
                return False
        if list(map(torch.Tensor.data_ptr, self.tensors)) != self.addresses:
            return False
        self.states = states
        return True

    def release(self) -> bool:
        """Give each state still holding slices of these tensors copies of its own, so
        that the joined tensors are freed (a parameter left out of its bucket since, as a
        frozen one, would otherwise keep its whole bucket's moments alive); whether any
        state was given one."""
        gave = False
        for state, held in zip(self.states, self.held, strict=True):
            for key, t in held.items():
                if state.get(key) is t:
                    state[key] = t.clone()
                    gave = True
        return gave


def _slices(whole: torch.Tensor, olds: list[torch.Tensor], pads: list[int]) -> list[torch.Tensor]:
    """The tensors of ``olds``' shapes and dtypes that are the consecutive slices of the
    flat ``whole`` `buckets.gather` made from them with ``pads`` (a complex one from its
    real pairs, float8 codes from their bytes)."""
    out, at = [], 0
    for old, pad in zip(olds, pads, strict=True):
        n = old.numel() * (2 if old.is_complex() else 1)
        piece = whole[at : at + n]
        out.append(
            torch.view_as_complex(piece.view(*old.shape, 2))
            if old.is_complex()
            else piece.view(old.shape).view(old.dtype)
        )
        at += n + pad
    return out


def _parts(bucket: list[_Planned]) -> list[list[_Planned]]:
    """``bucket`` in runs of parameters of at most ``FLAT_MAX`` elements together (blocks
    padded): each flat update holds its copies and float32 moments for no more elements
    than one parameter's update in place may."""
    parts: list[list[_Planned]] = [[]]
    size = 0
    for planned in bucket:
        fmt, n = planned.fmt, real_view(planned.p).numel()
        n = fmt.padded(n)
        if parts[-1] and size + n > buckets_.FLAT_MAX:
            parts.append([])
            size = 0
        parts[-1].append(planned)
        size += n
    return parts


def _mark(p: torch.Tensor, state: dict[str, Any], viewed: bool) -> tuple:
    """What a parameter's plan and its place in the step's runs were read from, beyond its
    group's hyperparameters: (the state and every value in it, compared by identity; facts
    compared by value: the parameter's and its gradient's dtypes, its shape, layout, device
    and type, the state's keys; where the plan holds views of the state's tensors
    (``viewed``: not a flat run's, whose joined tensors `_Joined.current` checks), those
    tensors and their addresses: one given other memory through ``.data``, as a snippet
    moving a state to a device does, is the same object, and the views would be stale)."""
    tensors = tuple(v for v in state.values() if isinstance(v, torch.Tensor)) if viewed else ()
    addresses = list(map(torch.Tensor.data_ptr, tensors))
    return state, tuple(state.values()), _facts(p, state), tensors, addresses


def _facts(p: torch.Tensor, state: dict[str, Any]) -> tuple:
    """`_mark`'s facts of ``p`` (with a gradient) and its ``state``; ``p``'s memory among
    them: a ``.data`` swap that puts it over another parameter's memory changes which
    parameters a plan must step apart (`LowBitOptimizer._lay_out`)."""
    g = p.grad.dtype  # type: ignore[union-attr]
    return (p.dtype, g, p.shape, p.is_contiguous(), p.device, type(p), tuple(state), p.data_ptr())


@dataclasses.dataclass
class _Layout:
    """A step's plan, kept for the next step: the parameters stepped (group, parameter and
    position), each one's `_Planned` update and the runs that carry them out (``"one"``: a
    parameter stepped alone; ``"fused"``: float32 moments in torch's fused call;
    ``"flat"``: one flat update, with its compensation). A step of the same parameters
    whose `_mark`s are unchanged (no state replaced, converted or made; no dtype, shape,
    layout or device changed) takes the same runs with its own hyperparameters and step
    counts, planning nothing: the plan is a function of what the marks record and of the
    groups' hyperparameters, which are read again (a changed flag plans again)."""

    work: list[tuple[dict[str, Any], torch.Tensor]]
    indices: list[int]
    compensation: str | None
    planned: list[_Planned]
    runs: list[tuple[str, list[_Planned], str | None]]
    total: int
    # each run's bucket (what a bucket key holds but the hyperparameters, and its number), or
    # None for a parameter stepped on its own
    origins: list[tuple | None] = dataclasses.field(default_factory=list)
    marks: list[tuple] = dataclasses.field(default_factory=list)
    # what the states' formats were chosen from (`LowBitOptimizer._format_settings`)
    settings: tuple | None = None

    def fits(
        self,
        work: list[tuple[dict[str, Any], torch.Tensor]],
        indices: list[int],
        states: list[dict[str, Any]],
        compensation: str | None,
    ) -> bool:
        """Whether a step of ``work`` (at ``indices``, with ``states`` prepared) is planned
        as this one was."""
        if (
            compensation != self.compensation
            or indices != self.indices
            or len(self.marks) != len(work)
        ):
            return False
        for (group, p), (old_group, old_p), state, mark in zip(
            work, self.work, states, self.marks, strict=True
        ):
            old_state, values, facts, viewed, addresses = mark
            if group is not old_group or p is not old_p or state is not old_state:
                return False
            if len(state) != len(values) or not all(map(is_, state.values(), values)):
                return False
            if _facts(p, state) != facts:
                return False
            if viewed and list(map(torch.Tensor.data_ptr, viewed)) != addresses:
                return False
        return True


class LowBitOptimizer(StateCheckpoint):
    """What the low-bit optimizers share: formats per parameter, the states' layout, the
    compiled or eager step, compensation of 16-bit parameters, checkpoints."""

    algorithm = "adam"
    # whether `_hyper` reads a parameter's state (else its answer is its group's and step's)
    hyper_reads_state = True
    # the torch optimizer this one was converted from, which a caller may still hold and a
    # scheduler may be built on (`mixprec.optim.conversion.hand_over`): each step counts as
    # its step too, for torch's check that a scheduler steps after its optimizer
    stands_for: torch.optim.Optimizer | None = None

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        states: str | StateFormat,
        block_size: int | None,
        min_size: int,
        keep_float32: Callable[[torch.Tensor], bool] | None,
        compensation: str | None,
        compile: bool | None,
        seed: int,
        formats: Mapping[torch.Tensor, str | StateFormat] | None = None,
    ) -> None:
        fmt = parse_state_format(states)
        if block_size is not None:
            if not fmt.quantized:
                raise ValueError("block_size is for low-bit states; float32 states have none")
            spelled = isinstance(states, str) and "block" in states
            if fmt.block != block_size and (spelled or fmt.block != fmt.codec.default_block):
                raise ValueError(
                    f"states={states if spelled else str(fmt)!r} and block_size={block_size} "
                    f"name two block sizes: "
                    f"give the block in one of them"
                )
            fmt = StateFormat(fmt.kind, block_size)
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
            raise ValueError(f"min_size must be an integer >= 0, got {min_size!r}")
        if keep_float32 is not None and not callable(keep_float32):
            raise TypeError(
                f"keep_float32 must be a function of a parameter returning a bool, got "
                f"{type(keep_float32).__name__}"
            )
        # the engine's gate: the one the compensated steps of torch's optimizers take
        self._gate = CompileGate(
            compile,
            "low-bit optimizer step",
            "Pass compile=False to skip the attempt",
            COMPILE_MIN_ELEMENTS,
        )
        self.min_size = min_size
        self.keep_float32 = keep_float32
        # formats of single parameters, consulted before their group's
        self.formats = {p: parse_state_format(f) for p, f in (formats or {}).items()}
        self.compensation = check_compensation(compensation)
        self.compile = compile
        # the random bits of stochastic rounding and of the Kahan buffer's rounding: the
        # engine's, keyed by the seed, each parameter's step count and index
        self.seed = check_seed(seed)
        # the low-bit moments of each bucket of parameters stepped together, as flat
        # tensors whose slices are those parameters' states (`_joined`)
        self._flats: dict[tuple[int, ...], _Joined] = {}
        self._counts = StepCounts()
        # the last step's plan, taken again by a step of the same parameters (`_Layout`)
        self._layout: _Layout | None = None
        defaults["states"] = str(fmt)
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        """Everything the optimizer holds. torch's keeps the defaults, the state and the
        groups only, where its optimizers keep their settings; these keep theirs (formats,
        ``min_size``, the compile gate, the seed...) in attributes, which a copy or a
        pickle would otherwise lose, failing at its first step. Not the plan (it holds this
        step's objects) nor the joined moments: each state's slices go as copies of their
        own (a pickle writes a view with all of the memory under it, so every slice of a
        joined moment carried the whole moment: a bucket's states took its size times its
        parameter count), and the copy joins them again. Float8 codes go as their bytes
        (`_Float8Codes`): torch loads no pickled float8 tensor."""
        state = collections.defaultdict(dict)
        for p, held in self.state.items():
            state[p] = {k: _Float8Codes.of(_own_memory(v)) for k, v in held.items()}
        return {**self.__dict__, "state": state, "_layout": None, "_flats": {}}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, with the group's ``"states"`` (if any) checked and written canonically;
        a group asking for what these optimizers do not do (``maximize``, ``amsgrad``,
        ``capturable``, ``differentiable``) or listing a parameter twice is refused."""
        asked = [f"{k} ({why})" for k, why in UNSUPPORTED_FLAGS.items() if param_group.get(k)]
        if asked:
            raise ValueError(
                f"a parameter group of {type(self).__name__} sets {', '.join(asked)}: leave "
                f"it out, or step these parameters with the torch optimizer"
            )
        params = param_group.get("params")
        if params is not None and not torch.is_tensor(params) and not isinstance(params, set):
            # (an iterator, as ``itertools.chain`` of two modules' parameters, read once: as
            # the list torch makes of it, and checked as a list is)
            params = param_group["params"] = list(params)
            seen: set[int] = set()
            for entry in params:
                # (a (name, parameter) pair, as ``named_parameters()`` gives: its parameter;
                # a tied weight listed under both names with ``remove_duplicate=False``)
                p = entry[1] if isinstance(entry, tuple) and len(entry) >= 2 else entry
                if torch.is_tensor(p) and id(p) in seen:
                    raise ValueError(
                        f"a parameter group of {type(self).__name__} lists a parameter of shape "
                        f"{list(p.shape)} twice: it would count two steps and take one "
                        f"(torch deprecates this too); list each parameter once"
                    )
                seen.add(id(p))
        if "states" in param_group:
            param_group["states"] = str(parse_state_format(param_group["states"]))
        super().add_param_group(param_group)

    # -- formats -----------------------------------------------------------------------------

    def format_of(self, p: torch.Tensor, group: Mapping[str, Any]) -> StateFormat:
        """The format ``p``'s moments take: float32 when small or picked by
        ``keep_float32``, else its own in ``formats``, else its group's ``"states"``; a block
        larger than ``p`` is cut to ``p``'s elements rounded up to the kind's default block
        (no more bytes than the default block takes). A state recorded in another format is
        converted to this one at ``p``'s next step or on load."""
        # (a DTensor's whole size: every rank of a sharded parameter takes the same format)
        if p.numel() < self.min_size or (self.keep_float32 and self.keep_float32(p)):
            return _FLOAT32
        own = self.formats.get(p) if self.formats else None
        return fitted_format(own or parse_state_format(group["states"]), p)

    def _format_settings(self) -> tuple | None:
        """What `format_of` reads beyond a parameter's shape, to be compared from step to
        step: the groups' formats, ``min_size`` and the formats' registry; None where it
        calls on more (a ``keep_float32`` function, formats of single parameters), whose
        answers only asking again can tell."""
        if self.keep_float32 is not None or self.formats:
            return None
        groups = tuple(group.get("states") for group in self.param_groups)
        return groups, self.min_size, codecs.generation()

    def compiles(self, device: torch.device | str) -> bool:
        """Whether a step of every parameter on ``device`` runs its update compiled (its
        first such step builds it: seconds, once per process and signature): the gate's
        answer for the step's elements, where any parameter takes the compiled update (as
        `_lay_out` routes them: all but float32 ones with float32 moments, which take
        torch's fused or ``_foreach`` ops unless stepped alone from a copy or, off a CPU,
        past `buckets.FLAT_MAX`)."""
        params = [(g, p) for g in self.param_groups for p in g["params"] if p.requires_grad]
        on_cpu = torch.device(device).type == "cpu"

        def compiled(group: Mapping[str, Any], p: torch.Tensor) -> bool:
            real = real_view(p)
            fused = not self.format_of(p, group).quantized and real.dtype == torch.float32
            own = local_part(p) is not p or not real.is_contiguous()
            return not fused or own or (real.numel() > buckets_.FLAT_MAX and not on_cpu)

        total = sum(local_part(p).numel() for _, p in params)
        return any(compiled(g, p) for g, p in params) and self._gate.wants(
            torch.device(device), total
        )

    def _prepared(self, p: torch.Tensor, group: Mapping[str, Any]) -> dict[str, Any]:
        """``p``'s state ready for a step: made on its first, converted when its format is
        no longer the one ``format_of`` gives (its group's ``"states"`` changed)."""
        state = self.state[p]
        if "format" not in state:
            fmt = self.format_of(p, group)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["format"] = str(fmt)
            if self.algorithm == "adam":  # (SGD's buffer starts at its first momentum step)
                for name, _ in MOMENTS["adam"]:
                    state.update(zero_moment(name, p, fmt))
        elif (held := parse_state_format(state["format"])) is not (
            want := self.format_of(p, group)
        ) and held != want:
            self._refuse_resized(p, state, None)  # (a size that changed the block)
            self.adopt(p, state, group)
        if self.compensation == "kahan" and p.dtype in COMPENSATED_DTYPES:
            # (made at the first step as a 16-bit parameter: also one that became 16-bit
            # since, as a model cast after float32 steps is)
            buf = state.get("compensation")
            if buf is None or buf.dtype != p.dtype or buf.shape != p.shape:
                state["compensation"] = torch.zeros_like(p)
        return state

    def _refuse_resized(self, p: torch.Tensor, state: dict[str, Any], index: int | None) -> None:
        """Refuse a parameter whose data was replaced by a tensor of another size since its
        state was made: its moments no longer hold its elements (low-bit ones stepped
        silently with the old blocks, or failed on a bare size check; torch's fused kernel
        reads past float32 ones). Raised before any parameter is updated."""
        if type(p) not in PLAIN or "format" not in state:  # (a DTensor's shards: its own)
            return
        fmt = parse_state_format(state["format"])
        for name, _ in MOMENTS[self.algorithm]:
            if fmt.quantized:
                scales = state.get(f"{name}_scales")
                held = None if scales is None else scales.numel() * fmt.block  # type: ignore[operator]
                want = fmt.blocks(elements_of(p)) * fmt.block  # type: ignore[operator]
            else:
                moment = state.get(name)
                held, want = (None if moment is None else moment.numel()), p.numel()
            if held is not None and held != want:
                where = "a parameter" if index is None else f"parameter {index}"
                raise RuntimeError(
                    f"{where} (shape {list(p.shape)}) no longer has the size of its optimizer "
                    f"state ({held} elements in {fmt}): its data was replaced after its first "
                    f"step; nothing was updated: build the optimizer after resizing parameters"
                )

    # -- the step ----------------------------------------------------------------------------

    @uncompiled
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter with a gradient; ``closure`` re-evaluates the loss
        first (its value is returned). Every gradient is checked before any parameter is
        updated. Runs outside any enclosing ``torch.compile`` (a compiled training step):
        the step compiles its own kernels, and its planning reads tensors' addresses."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.stands_for is not None:
            self.stands_for._opt_called = True  # type: ignore[attr-defined]
        work = []
        indices = []  # each parameter's position in the optimizer: part of its random key
        params = [(group, p) for group in self.param_groups for p in group["params"]]
        for index, (group, p) in enumerate(params):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients (parameter "
                    f"{index}, shape {list(p.shape)}; nothing was updated): build the embedding "
                    f"with sparse=False, or step its parameters with torch.optim.SparseAdam"
                )
            work.append((group, p))
            indices.append(index)
        if not work:
            return loss
        for i, group in enumerate(self.param_groups):  # (a flag set on a group since)
            asked = [f"{k} ({why})" for k, why in UNSUPPORTED_FLAGS.items() if group.get(k)]
            if asked:
                raise ValueError(
                    f"parameter group {i} of {type(self).__name__} sets {', '.join(asked)}; "
                    f"nothing was updated: set it back to False, or step these parameters "
                    f"with the torch optimizer"
                )
        layout = getattr(self, "_layout", None)
        settings = self._format_settings()
        # a step the last plan fits, with the settings formats are chosen from unchanged,
        # finds every state prepared (`_prepared` would change nothing): it is not asked
        fitted = False
        if layout is not None and settings is not None and layout.settings == settings:
            states = [self.state[p] for _, p in work]
            fitted = layout.fits(work, indices, states, self.compensation)
        if not fitted:
            states = [self._prepared(p, group) for group, p in work]
        # every step count on by one and read back in a fixed number of calls
        if getattr(self, "_counts", None) is None:  # (an optimizer pickled before counts)
            self._counts = StepCounts()
        steps = self._counts.advance(states)
        try:
            reused = (
                layout is not None
                and (fitted or layout.fits(work, indices, states, self.compensation))
                and self._refresh(layout, states, steps)
            )
            if not reused:
                layout = self._lay_out(work, indices, states, steps)
                layout.settings = settings
                # what the plan was made from (for plain tensors: a DTensor's local parts
                # are read again every step)
                if all(type(p) in PLAIN for _, p in work):
                    flat = {
                        id(b) for way, members, _ in layout.runs if way == "flat" for b in members
                    }
                    layout.marks = [
                        _mark(p, s, id(planned) not in flat)
                        for (_, p), s, planned in zip(work, states, layout.planned, strict=True)
                    ]
        except Exception:  # (refused before any update: nothing was stepped, counts neither)
            self._counts.undo(states)
            raise
        assert layout is not None
        self._layout = None  # (until the step has run: one that raised plans again)
        kept = self._execute(layout)
        # taken again only while the states hold what the plan read: a step that joined
        # or released states (their tensors replaced) has the next one planned afresh
        self._layout = layout if kept and layout.marks else None
        return loss

    def _lay_out(
        self,
        work: list[tuple[dict[str, Any], torch.Tensor]],
        indices: list[int],
        states: list[dict[str, Any]],
        steps: list[int],
    ) -> _Layout:
        """Plan a step: each parameter's update (`_plan`) and the runs that carry them out,
        parameters that share a format, a dtype, a compensation and hyperparameters
        bucketed together (`buckets`)."""
        total = sum(local_part(p).numel() for _, p in work)
        scalars: dict[tuple, tuple[torch.Tensor, tuple[float, ...]]] = {}
        buckets: dict[tuple, list[_Planned]] = {}
        runs: list[tuple[str, list[_Planned], str | None]] = []
        origins: list[tuple | None] = []
        every: list[_Planned] = []
        # every parameter checked before any is planned (an SGD buffer is made at its plan)
        for (_, p), index, state in zip(work, indices, states, strict=True):
            self._refuse_resized(p, state, index)
        # distinct parameters over the same memory: a flat run reads them all before writing
        # any, so one's update would overwrite the other's; each steps on its own, in turn,
        # as torch's optimizers step them (whatever its way: the runs of buckets go after
        # those of single parameters, which would step a later one first)
        shared = {id(work[i][1]) for i in overlapping([local_part(p) for _, p in work])}
        for (group, p), index, state, step in zip(work, indices, states, steps, strict=True):
            planned = self._plan(p, group, state, step, scalars)
            planned.index, planned.step = index, step
            every.append(planned)
            real = real_view(p)
            if real.numel() == 0:
                continue
            compensation = self.compensation if p.dtype in COMPENSATED_DTYPES else None
            way = (
                "fused"
                if not planned.fmt.quantized
                and real.dtype == torch.float32
                and real_view(p.grad).dtype == torch.float32
                else "flat"
            )
            own = (
                local_part(p) is not p
                or not real.is_contiguous()  # (a copy to step)
                or id(p) in shared
            )
            # float32 moments of a float32 parameter step in the fused call on a CPU, where
            # torch's fused kernel outruns a call of our own at any size; elsewhere, as the
            # flat updates, a parameter too large to be worth a copy steps on its own
            alone = real.numel() > buckets_.FLAT_MAX and (way, real.device.type) != ("fused", "cpu")
            if own or alone:
                # (a float32 one over another's memory, whole and contiguous: torch's fused
                # step on its own, as torch's fused call steps it, one tensor after another)
                fused = way == "fused" and id(p) in shared and local_part(p) is p
                fused = fused and real.is_contiguous()
                runs.append(
                    ("fused", [planned], None) if fused else ("one", [planned], compensation)
                )
                origins.append(None)
                continue
            # (complex apart: a complex moment's piece of a joined float32 run is read back
            # as complex, which needs an even offset, where an odd-sized real one ahead of
            # it left an odd one)
            base = (way, planned.fmt, real.dtype, real.device, compensation, p.is_complex())
            base += tuple(planned.statics)
            buckets.setdefault((base, id(planned.hp)), []).append(planned)
        for number, ((base, _), bucket) in enumerate(buckets.items()):
            parts = [bucket] if base[0] == "fused" else _parts(bucket)
            for part in parts:
                # (one alone: in place, no copies to make)
                way = base[0] if base[0] == "fused" or len(part) > 1 else "one"
                runs.append((way, part, None if way == "fused" else base[4]))
                origins.append((base, number))
        return _Layout(work, indices, self.compensation, every, runs, total, origins=origins)

    def _refresh(self, layout: _Layout, states: list[dict[str, Any]], steps: list[int]) -> bool:
        """Give ``layout``'s planned updates this step's counts and hyperparameters; False
        (nothing to run: plan again) where that changes the plan: a flag of a group
        changed, a state must be made (SGD's buffer at its first step with momentum), or
        parameters stepped together no longer share their hyperparameters."""
        scalars: dict[tuple, tuple[torch.Tensor, tuple[float, ...]]] = {}
        # (an algorithm whose hyperparameters read no state: one answer per group and step)
        answers: dict[tuple, tuple[_Hyper, tuple[torch.Tensor, tuple[float, ...]]]] = {}
        for planned, (group, _), state, step in zip(
            layout.planned, layout.work, states, steps, strict=True
        ):
            where = (planned.device, planned.hp.dtype)
            shared = None if self.hyper_reads_state else (id(group), step, *where)
            answer = answers.get(shared) if shared is not None else None
            if answer is None:
                got = self._hyper(group, state, step)
                if got is None:
                    return False
                key = (id(group), *got.tag, *where)
                made = self._hyperparameters(scalars, key, got.values, *where, got.floats)
                answer = (got, made)
                if shared is not None:
                    answers[shared] = answer
            if answer[0].form != planned.form:
                return False
            planned.hp, planned.values = answer[1]
            planned.step = step
        if not all(all(b.hp is members[0].hp for b in members) for _, members, _ in layout.runs):
            return False
        # nor where buckets the plan kept apart now share them: a fresh plan would join them,
        # and the random bits of a compensation follow a bucket's layout (a parameter whose
        # first SGD step came later than its neighbours' was kept apart for good)
        seen: dict[tuple, int] = {}
        for (_, members, _), origin in zip(layout.runs, layout.origins, strict=True):
            if origin is not None:
                base, number = origin
                if seen.setdefault((base, id(members[0].hp)), number) != number:
                    return False
        return True

    def _execute(self, layout: _Layout) -> bool:
        """Run ``layout``'s runs; the joined moments of buckets not stepped are released.
        Whether every state kept its tensors (none joined or released)."""
        joined, self._flats = getattr(self, "_flats", {}), {}
        for way, members, compensation in layout.runs:
            if way == "one":
                self._run(members[0], layout.total)
            elif way == "fused":
                self._run_fused(members)
            else:
                self._run_flat(members, compensation, layout.total, joined)
        # (an entry not the previous step's was joined now: states given its slices)
        kept = all(joined.get(key) is entry for key, entry in self._flats.items())
        for key, entry in joined.items():  # (the previous step's, not used in this one)
            if self._flats.get(key) is not entry and entry.release():
                kept = False
        return kept

    def _plan(
        self,
        p: torch.Tensor,
        group: dict[str, Any],
        state: dict[str, Any],
        step: int,
        scalars: dict[tuple, tuple[torch.Tensor, tuple[float, ...]]],
    ) -> _Planned:
        """What ``p``'s update reads (each algorithm's own), its ``state`` prepared and at
        ``step``; ``scalars``: the hyperparameters made so far this step (a tensor and its
        floats), shared by equal groups and steps."""
        raise NotImplementedError(f"{type(self).__name__} defines no update")

    def _hyper(self, group: dict[str, Any], state: dict[str, Any], step: int) -> _Hyper | None:
        """A parameter's hyperparameters at ``step`` (each algorithm's own); None when
        ``state`` must be planned again first."""
        raise NotImplementedError(f"{type(self).__name__} defines no update")

    def _hyperparameters(
        self,
        scalars: dict,
        key: tuple,
        values: list[float],
        device: torch.device,
        dtype: torch.dtype,
        floats: list[float] | None = None,
    ) -> tuple[torch.Tensor, tuple[float, ...]]:
        """(``values`` as the update's tensor of ``dtype`` (`_scalar_dtype`), ``floats``
        (``values`` by default) for the fused step), made once per ``key`` in a step."""
        if key not in scalars:
            tensor = torch.tensor(values, dtype=dtype, device=device)
            scalars[key] = (tensor, tuple(values if floats is None else floats))
        return scalars[key]

    def _update(
        self,
        flat: torch.Tensor,
        grad: torch.Tensor,
        moments: list[tuple[torch.Tensor | None, torch.Tensor | None]],
        buf: torch.Tensor | None,
        planned: _Planned,
        compensation: str | None,
        compiled: bool,
        key: int,
    ) -> None:
        """Update the flat ``flat`` (its moments, its Kahan buffer ``buf``) in place: the
        whole blocks in calls of at most ``CHUNK`` elements (``CPU_CHUNK`` on a CPU), the
        last partial block (if any) from zero-padded copies. ``key``: the random bits of
        ``flat``'s first element (`call_key`); a piece from element ``begin`` takes
        ``key + begin``, so each element draws what it would in one call."""
        fmt, n = planned.fmt, flat.numel()
        cut = n - n % fmt.block if fmt.quantized else n  # type: ignore[operator]
        if fmt.quantized:
            # a shard's codes and scales are padded to the largest shard's blocks (FSDP2):
            # this one's own blocks only, or a shard of whole blocks, stepped in one piece,
            # met moments of another length
            blocks = -(-n // fmt.block)  # type: ignore[operator]
            moments = [
                (
                    None if t is None else t[: fmt.code_count(blocks * fmt.block)],  # type: ignore[operator]
                    None if sc is None else sc[:blocks],
                )
                if sc is not None and sc.shape[0] > blocks
                else (t, sc)
                for t, sc in moments
            ]
        pieces = []
        # a low-bit update holds its moments in float32 while it runs: in parts of at most
        # CHUNK elements (or one block), so that this stays small beside a large parameter
        most = CPU_CHUNK if flat.device.type == "cpu" else CHUNK
        step = max(most - most % fmt.block, fmt.block) if fmt.quantized else cut  # type: ignore[operator]
        if cut == n and n <= step:  # (one piece: the tensors as they are)
            pieces.append((flat, grad, moments, buf, 0))
        for begin in range(0, cut if not pieces else 0, step):
            end = min(cut, begin + step)
            states = [
                (
                    None if t is None
                    else t[fmt.code_count(begin) : fmt.code_count(end)] if fmt.quantized else t,
                    None if s is None else s[begin // fmt.block : end // fmt.block],
                )  # type: ignore[operator]
                for t, s in moments
            ]  # fmt: skip
            piece_buf = None if buf is None else buf[begin:end]
            pieces.append((flat[begin:end], grad[begin:end], states, piece_buf, begin))
        if cut < n:  # the last block, padded
            size = fmt.block
            blocks = cut // size  # type: ignore[operator]
            codes = fmt.code_count(cut)
            states = [
                (
                    None if t is None else t[codes : codes + fmt.code_count(size)],
                    None if s is None else s[blocks : blocks + 1],
                )  # type: ignore[operator]
                for t, s in moments
            ]
            pad = [flat.new_zeros(size), grad.new_zeros(size)]
            pad[0][: n - cut] = flat[cut:]
            pad[1][: n - cut] = grad[cut:]
            tail_buf = None
            if buf is not None:
                tail_buf = buf.new_zeros(size)
                tail_buf[: n - cut] = buf[cut:]
            pieces.append((pad[0], pad[1], states, tail_buf, cut))
        small_native = not compiled and self._gate.compile is None and self.algorithm == "adam"
        for piece_p, piece_g, states, piece_buf, begin in pieces:
            piece_key: torch.Tensor | int = 0  # (no random bits without a compensation)
            if compensation is not None:
                piece_key = wrap32(key + begin)
                if compiled:
                    piece_key = torch.tensor(piece_key, dtype=torch.int32, device=flat.device)
            args = (piece_p, piece_g, *(t for pair in states for t in pair))
            args += (planned.tables, piece_buf, planned.hp, piece_key, fmt.kind, fmt.block)
            args += (*planned.statics, compensation)
            if compiled and self._compiled(args):
                continue
            # under compile=None a step too small to compile still takes the C kernel (built
            # once, in a second, where a compiled update's build takes many)
            if small_native and native.adam(args):
                continue
            kernels.eager(self.algorithm)(*args)
        if cut < n:
            flat[cut:] = pieces[-1][0][: n - cut]
            if buf is not None:
                buf[cut:] = pieces[-1][3][: n - cut]  # type: ignore[index]

    def _run(self, planned: _Planned, total: int) -> None:
        """Update one parameter from its flat views (a copy of a non-contiguous one, as a
        transposed or channels-last weight and its Kahan buffer are, copied back after). A
        complex parameter is stepped as its real pairs, as torch's optimizers step it."""
        p = planned.p
        real = real_view(p)
        compensation = self.compensation if p.dtype in COMPENSATED_DTYPES else None
        flat = _flat(real)
        grad = real_view(p.grad).reshape(-1)
        kept = planned.state.get("compensation") if compensation == "kahan" else None
        kept = None if kept is None else local_part(kept)
        buf = None if kept is None else _flat(kept)
        compiled = self._gate.wants(real.device, total)
        # (random bits only for a compensation; a shard's from its place in the whole)
        key = 0
        if compensation is not None:
            key = call_key(self.seed, planned.step, planned.index) + shard_offset(p)
        self._update(flat, grad, planned.moments, buf, planned, compensation, compiled, key)
        _copy_back(flat, real)
        if kept is not None:
            _copy_back(buf, kept)  # type: ignore[arg-type]

    def _run_fused(self, bucket: list[_Planned]) -> None:
        """Update float32 parameters with float32 moments by torch's fused or ``_foreach``
        ops (`buckets.fused_adam`, `buckets.fused_sgd`)."""
        params = [real_view(b.p).view(-1) for b in bucket]
        # (contiguous: torch's fused kernel reads a strided gradient, as ``g[:, ::2]``, as
        # if its elements were consecutive)
        grads = [real_view(b.p.grad).contiguous().view(-1) for b in bucket]
        moments = [[m for m, _ in b.moments] for b in bucket]
        first = bucket[0]
        if self.algorithm == "adam":
            exp_avgs, exp_avg_sqs = ([m[i] for m in moments] for i in (0, 1))
            steps = [b.state["step"] for b in bucket]
            buckets_.fused_adam(
                params, grads, exp_avgs, exp_avg_sqs, steps, first.values, *first.statics
            )
        else:
            buffers = None if moments[0][0] is None else [m[0] for m in moments]
            buckets_.fused_sgd(params, grads, buffers, first.values, *first.statics)
        # torch's fused CPU kernels write in place without telling autograd: its in-place
        # checks (a graph saved before the step, backpropagated after it) must see the writes
        torch.autograd.graph.increment_version([b.p for b in bucket])

    def _run_flat(
        self,
        bucket: list[_Planned],
        compensation: str | None,
        total: int,
        joined: dict[tuple[int, ...], _Joined],
    ) -> None:
        """Update a bucket of parameters as one flat tensor: each parameter and gradient
        zero-padded to whole blocks and concatenated; one update; the parameters copied
        back. The moments and Kahan buffers are kept joined from step to step (`_joined`)."""
        fmt = bucket[0].fmt
        params = [real_view(b.p).view(-1) for b in bucket]
        pads = [-t.numel() % fmt.block if fmt.quantized else 0 for t in params]  # type: ignore[operator]
        flat = buckets_.gather(params, pads)
        grad = buckets_.gather([real_view(b.p.grad).reshape(-1) for b in bucket], pads)
        entry = self._joined(bucket, pads, compensation, joined)
        compiled = self._gate.wants(flat.device, total)
        # the random bits of the bucket's elements, from its first parameter's key on (only
        # for a compensation)
        key = 0 if compensation is None else call_key(self.seed, bucket[0].step, bucket[0].index)
        buf = entry.buf if compensation == "kahan" else None
        self._update(flat, grad, entry.flats, buf, bucket[0], compensation, compiled, key)
        buckets_.scatter(flat, params, pads)

    def _joined(
        self,
        bucket: list[_Planned],
        pads: list[int],
        compensation: str | None,
        joined: dict[tuple[int, ...], _Joined],
    ) -> _Joined:
        """``bucket``'s moments (and Kahan buffers) as flat tensors. They are joined on the
        first step of this set of parameters, or when a state was replaced since (a
        checkpoint loaded, a format changed), and each parameter's state then holds slices
        of them: later steps update the states in place, with no copies. ``joined``: the
        previous step's; the entry used moves on to this step's."""
        key = tuple(id(b.p) for b in bucket)
        entry = joined.get(key)
        # (the moments the plan steps: SGD's buffer stays out while the momentum is 0)
        planned = [m[0] is not None for m in bucket[0].moments]
        if (
            entry is None
            or (compensation == "kahan") != (entry.buf is not None)
            or [f[0] is not None for f in entry.flats] != planned
            or not entry.current([b.state for b in bucket], pads)
        ):
            entry = self._join(bucket, pads, compensation)
        self._flats[key] = entry
        return entry

    def _join(self, bucket: list[_Planned], pads: list[int], compensation: str | None) -> _Joined:
        """Concatenate ``bucket``'s moments and Kahan buffers and point each parameter's
        state at its slices (so a state dict holds views of one tensor per moment, as
        `torch.save` stores once and `torch.distributed.checkpoint` copies apart)."""
        fmt = bucket[0].fmt
        states = [b.state for b in bucket]
        held: list[dict[str, torch.Tensor]] = [{} for _ in bucket]
        flats: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        none = [0] * len(bucket)
        for (name, _), moment in zip(MOMENTS[self.algorithm], bucket[0].moments, strict=True):
            if moment[0] is None:  # (SGD without momentum: a buffer kept, not stepped)
                flats.append((None, None))
                continue
            keys = [f"{name}_codes", f"{name}_scales"] if fmt.quantized else [name]
            pair: list[torch.Tensor | None] = []
            for k in keys:
                olds = [state[k] for state in states]
                # flat codes (as bytes: float8 ones too) and scales; or float32 moments of
                # the parameters' shapes (a complex one as its real pairs)
                parts = [_bits(t) if fmt.quantized else real_view(t).reshape(-1) for t in olds]
                whole = buckets_.gather(parts, none)
                pair.append(whole.view(olds[0].dtype) if fmt.quantized else whole)
                for state, mine, new in zip(states, held, _slices(whole, olds, none), strict=True):
                    state[k] = mine[k] = new
            flats.append((pair[0], pair[1] if len(pair) > 1 else None))
        buf = None
        if compensation == "kahan":
            olds = [state["compensation"] for state in states]
            buf = buckets_.gather([t.reshape(-1) for t in olds], pads)
            for state, mine, new in zip(states, held, _slices(buf, olds, pads), strict=True):
                state["compensation"] = mine["compensation"] = new
        return _Joined(flats, buf, held, states, list(pads))

    def _compiled(self, args: tuple) -> bool:
        """Run the compiled update (True); False, with one warning and eager steps from
        then on, if ``compile=None`` chose to compile and the build failed (the engine's
        `CompileGate`)."""
        return self._gate.run(kernels.run_compiled, self.algorithm, args, stacklevel=5)[1]


class LowBitAdamW(LowBitOptimizer):
    """AdamW (decoupled weight decay) with its two moments in a low-bit format. A group
    holding torch's ``"decoupled_weight_decay"`` key (as a group converted from torch's
    Adam or AdamW does) takes its decay's form from it, as torch's optimizers do.

    Args:
        params: parameters or parameter groups; a group's ``"states"`` key overrides the
            format for its parameters (``{"params": ..., "states": "float32"}``).
        lr, betas, eps, weight_decay: as torch's AdamW.
        states: the moments' format: ``"int8"`` (default), ``"int4"``, ``"float8"``
            (``"fp8"``), ``"float32"`` or a registered one, optionally with ``/block=N``;
            or a `StateFormat`.
        block_size: the block size of ``states`` (the kind's default when None).
        min_size: parameters with fewer elements keep float32 moments.
        keep_float32: a function of a parameter; True keeps its moments in float32.
        compensation: for bfloat16/float16 parameters updated in place: ``"kahan"`` (a
            16-bit buffer per parameter of what rounding lost) or ``"stochastic"``
            (stochastic rounding); None rounds to nearest.
        compile: ``True`` runs each update through ``torch.compile``; ``False`` eagerly
            (the same math); ``None`` compiles when a step covers ``COMPILE_MIN_ELEMENTS``
            elements on a device that can build (a Linux CPU with a C++ compiler, CUDA with
            Triton), and falls back to eager, warning once, if the build fails.
        seed: keys the random bits of stochastic rounding and of the Kahan buffer's
            rounding (the engine's, `mixprec.optim.engine`; saved in `state_dict`).
        formats: single parameters' formats (parameter -> spec), before their group's;
            ``min_size`` and ``keep_float32`` still keep theirs float32.
        foreach, fused: taken and ignored, so that code written for torch's AdamW runs
            (the step is one call per group and format); ``amsgrad``, ``maximize``,
            ``capturable``, ``differentiable``: refused.
    """

    decoupled = True
    hyper_reads_state = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        states: str | StateFormat = "int8",
        block_size: int | None = None,
        min_size: int = MIN_SIZE,
        keep_float32: Callable[[torch.Tensor], bool] | None = None,
        compensation: str | None = None,
        compile: bool | None = None,
        seed: int = 0,
        formats: Mapping[torch.Tensor, str | StateFormat] | None = None,
        foreach: bool | None = None,
        fused: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        flags = dict(maximize=maximize, capturable=capturable, differentiable=differentiable)
        refuse_flags(type(self).__name__, flags)
        if amsgrad:
            raise ValueError(
                f"{type(self).__name__} does not support amsgrad (it keeps no maximum of the "
                f"second moment): use torch.optim.AdamW(amsgrad=True)"
            )
        if not 0.0 <= float(lr):
            raise ValueError(f"invalid learning rate: {lr}")
        if not (_is_real(eps) and 0.0 <= eps):
            raise ValueError(f"invalid eps {eps!r}: a number >= 0")
        if not (
            len(pair := _items(betas)) == 2 and all(_is_real(b) and 0.0 <= b < 1.0 for b in pair)
        ):
            raise ValueError(f"invalid betas {betas!r}: two numbers, each in [0, 1)")
        if not 0.0 <= weight_decay:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(
            params,
            defaults,
            states=states,
            block_size=block_size,
            min_size=min_size,
            keep_float32=keep_float32,
            compensation=compensation,
            compile=compile,
            seed=seed,
            formats=formats,
        )

    def _plan(
        self,
        p: torch.Tensor,
        group: dict[str, Any],
        state: dict[str, Any],
        step: int,
        scalars: dict,
    ) -> _Planned:
        fmt = parse_state_format(state["format"])
        local = local_part(p)
        got = self._hyper(group, state, step)
        where = (local.device, _scalar_dtype(p))
        key = (id(group), *got.tag, *where)
        hp, floats = self._hyperparameters(scalars, key, got.values, *where)
        moments: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        tables: tuple[torch.Tensor, ...] = ()
        for name, signed in MOMENTS["adam"]:
            if fmt.quantized:
                moments.append(
                    (local_part(state[f"{name}_codes"]), local_part(state[f"{name}_scales"]))
                )
                tables += code_tables(fmt, signed, local.device)
            else:
                moments.append((real_view(state[name]).view(-1), None))
        return _Planned(
            p, state, fmt, moments, tables, hp, floats, got.statics, got.form, local.device
        )

    def _hyper(self, group: dict[str, Any], state: dict[str, Any], step: int) -> _Hyper:
        lr = float(group["lr"])
        beta1, beta2 = map(_scalar, group["betas"])
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        eps, decay = _scalar(group["eps"]), _scalar(group["weight_decay"])
        values = [lr, beta1, beta2, eps, decay, lr / bc1, bc2**-0.5]
        values += [1 - beta1, 1 - beta2]  # (in double: `kernels.adam_update` says why)
        # (a group's own decoupled_weight_decay, as torch's Adam and AdamW keep it and
        # from_optimizer carries it over, chooses its decay's form; the class's without one)
        decoupled = bool(group.get("decoupled_weight_decay", self.decoupled))
        return _Hyper((step, lr), values, None, (decoupled,), (decoupled,))


class LowBitAdam(LowBitAdamW):
    """Adam (weight decay as L2: added to the gradient) with low-bit moments; the arguments
    of `LowBitAdamW`, ``weight_decay`` defaulting to 0, and torch's Adam's
    ``decoupled_weight_decay`` (True: AdamW's decay)."""

    decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        decoupled_weight_decay: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
        if decoupled_weight_decay:  # (as torch's Adam takes it: AdamW's decay, in every group)
            self.defaults["decoupled_weight_decay"] = True
            for group in self.param_groups:
                group.setdefault("decoupled_weight_decay", True)


class LowBitSGD(LowBitOptimizer):
    """SGD with momentum (dampening, nesterov, L2 weight decay as torch's SGD) with its
    momentum buffer in a low-bit format; ``states``, ``block_size``, ``min_size``,
    ``keep_float32``, ``compensation``, ``compile``, ``seed``, ``formats`` and torch's flags
    (``foreach``, ``fused``, ``maximize``, ``differentiable``) as `LowBitAdamW`'s."""

    algorithm = "sgd"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        states: str | StateFormat = "int8",
        block_size: int | None = None,
        min_size: int = MIN_SIZE,
        keep_float32: Callable[[torch.Tensor], bool] | None = None,
        compensation: str | None = None,
        compile: bool | None = None,
        seed: int = 0,
        formats: Mapping[torch.Tensor, str | StateFormat] | None = None,
        foreach: bool | None = None,
        fused: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
    ) -> None:
        refuse_flags(type(self).__name__, dict(maximize=maximize, differentiable=differentiable))
        if not 0.0 <= float(lr):
            raise ValueError(f"invalid learning rate: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"invalid momentum: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov momentum requires a momentum and zero dampening")
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov,
        )  # fmt: skip
        super().__init__(
            params,
            defaults,
            states=states,
            block_size=block_size,
            min_size=min_size,
            keep_float32=keep_float32,
            compensation=compensation,
            compile=compile,
            seed=seed,
            formats=formats,
        )

    def _plan(
        self,
        p: torch.Tensor,
        group: dict[str, Any],
        state: dict[str, Any],
        step: int,
        scalars: dict,
    ) -> _Planned:
        fmt = parse_state_format(state["format"])
        got = self._values(group, state)
        if got.tag[0]:  # (first: the buffer starts as the gradient)
            state.update(zero_moment("momentum_buffer", p, fmt))
        local = local_part(p)
        where = (local.device, _scalar_dtype(p))
        key = (id(group), *got.tag, *where)
        hp, floats = self._hyperparameters(scalars, key, got.values, *where, got.floats)
        tables: tuple[torch.Tensor, ...] = ()
        if not group["momentum"]:
            moment: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        elif fmt.quantized:
            codes, scales = state["momentum_buffer_codes"], state["momentum_buffer_scales"]
            moment = (local_part(codes), local_part(scales))
            tables = code_tables(fmt, True, local.device)
        else:
            moment = (real_view(state["momentum_buffer"]).view(-1), None)
        return _Planned(
            p, state, fmt, [moment], tables, hp, floats, got.statics, got.form, local.device
        )

    def _values(self, group: dict[str, Any], state: dict[str, Any]) -> _Hyper:
        """`_hyper`'s answer whether or not ``state`` has its buffer yet."""
        momentum, dampening = _scalar(group["momentum"]), _scalar(group["dampening"])
        decay = _scalar(group["weight_decay"])
        # as torch's SGD: the buffer starts as the gradient at the first step with momentum
        # (the first step, or a later one when the momentum is raised from 0)
        first = bool(momentum) and not {"momentum_buffer", "momentum_buffer_codes"} & set(state)
        lr = float(group["lr"])
        keep, gain = (0.0, 1.0) if first else (momentum, 1 - dampening)
        values = [lr, keep, gain, decay, momentum]
        # (the fused step's floats: lr, momentum, dampening, weight decay, first)
        floats = [lr, momentum, dampening, decay, float(first)]
        nesterov = bool(group["nesterov"])
        return _Hyper((first, lr), values, floats, (nesterov,), (nesterov, bool(momentum)))

    def _hyper(self, group: dict[str, Any], state: dict[str, Any], step: int) -> _Hyper | None:
        got = self._values(group, state)
        return None if got.tag[0] else got  # (a buffer to make: plan again)


class AdamW8bit(LowBitAdamW):
    """`LowBitAdamW` with int8 moments (block 256)."""

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("states", "int8")
        super().__init__(params, *args, **kwargs)


class AdamW4bit(LowBitAdamW):
    """`LowBitAdamW` with int4 moments (block 128)."""

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("states", "int4")
        super().__init__(params, *args, **kwargs)


class AdamWFp8(LowBitAdamW):
    """`LowBitAdamW` with float8 e4m3 moments (block 256)."""

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("states", "float8")
        super().__init__(params, *args, **kwargs)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the per-parameter state ``optimizer`` holds: the memory of every tensor in
    its ``state`` but the step counts (moments, codes, scales, Kahan buffers), each storage
    once, whole: states stepped together hold slices of one joined buffer, padded to whole
    blocks, and the padding is held too. A DTensor counts its local part. Works for torch's
    optimizers too, and on the meta device (sizing a model's states without memory)."""
    total, seen = 0, set()
    for state in optimizer.state.values():
        for name, value in state.items():
            if name != "step" and torch.is_tensor(value):
                local = local_part(value)
                storage = local.untyped_storage()
                # (by its address in its memory: `aliasing.memory_of` tells the meta
                # device's storages apart, all at address 0)
                key = (memory_of(local), storage.data_ptr())
                if key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
    return total
