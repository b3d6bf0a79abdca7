"""Loss scalers: small state machines over tensors that keep float16 gradients in range.

A loss scaler multiplies the loss before ``backward`` so that small gradients do not flush
to zero in float16, then divides the gradients back ("unscales") and reports whether any of
them overflowed to inf/NaN. The optimizer step is skipped on overflow and the scale adapts.

The scalers know nothing about modules or optimizers: they work on lists of gradient
tensors. The scale lives on the device as a float32 tensor; unscaling and the overflow
check are one fused pass per (device, dtype) group, and updating the scale is an on-device
operation, so the only host synchronization in a step is the caller reading the overflow
flag to decide whether to skip.
"""

from __future__ import annotations

import math
import struct
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "DynamicLossScaler",
    "LossScaleDivergedError",
    "LossScaler",
    "LossScalerStats",
    "NoLossScaler",
    "StaticLossScaler",
    "as_loss_scaler",
    "is_scaled",
]


Outputs = TypeVar("Outputs")

# the largest float32: a floor above it leaves no finite scale
_FLOAT32_MAX = torch.finfo(torch.float32).max
# the keys of torch.amp.GradScaler.state_dict() (an enabled scaler)
_TORCH_GRAD_SCALER_KEYS = frozenset(
    {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
)


class LossScaleDivergedError(RuntimeError):
    """Raised when gradients keep overflowing although the loss scale cannot go any lower."""


def _real(name: str, value: Any) -> float:
    """``value`` as a float, refusing bools, strings and other non-numbers by name."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def _initial_scale(name: str, value: Any) -> tuple[float, torch.device]:
    """A loss scale given as a real number or, as torch.amp.GradScaler and jmp take it, a
    floating tensor of one element: its value (read once, here) and the device the scale state
    then lives on (the tensor's; the CPU for a number). The state is float32, so the value
    must be positive and finite in float32."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(
                f"{name} must be a real number or a floating tensor of one element, got a "
                f"{value.dtype} tensor {value!r}"
            )
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be one value: a 0-d or one-element tensor, got shape "
                f"{tuple(value.shape)}"
            )
        scale, device = float(value.detach().reshape(())), value.device
    else:
        scale, device = _real(name, value), torch.device("cpu")
    as_float32 = float(torch.tensor(scale, dtype=torch.float32))
    if not 0.0 < as_float32 < math.inf:
        raise ValueError(
            f"{name} must be a positive finite number, also as the float32 the scale is kept "
            f"in (at most {torch.finfo(torch.float32).max:g}), got {scale}"
        )
    return scale, device


def _float32(value: float) -> float:
    """`value` rounded to the nearest float32 (infinite past its range), as a Python float."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _count(name: str, value: Any, accepted: str = "", below: int | None = None) -> int:
    """``value`` if it is an int >= 0 (and < ``below``); a ValueError naming ``accepted``
    (what else the key may hold) otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be {accepted}an int >= 0, got {value!r}")
    if below is not None and value >= below:
        raise ValueError(f"{name} must be below {below}, got {value}")
    return value


def _within_interval(tracker: int, interval: int) -> int:
    """A saved growth tracker kept below its interval, warning where it was not (a state
    saved after the interval was lowered mid-run: torch's update grows only when the
    tracker reaches the interval exactly, so it would never grow again): the scale then
    grows at the next clean step, as a lowered interval does here."""
    if tracker < interval:
        return tracker
    warnings.warn(
        f"the loss scaler state's growth tracker ({tracker}) is past its growth_interval "
        f"({interval}): taken as {interval - 1}, so the scale grows at the next clean step "
        f"(as saved it would never grow again)",
        stacklevel=4,
    )
    return interval - 1


def _positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1; a float such as 1.5 is refused rather than truncated."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _scale_outputs(outputs: Any, scale: torch.Tensor) -> Any:
    """Multiply every tensor in ``outputs`` (a tensor, or lists/tuples/dicts of them) by
    ``scale``, keeping the container types, as torch.amp.GradScaler.scale does."""
    if isinstance(outputs, torch.Tensor):
        scaled = outputs * scale.to(outputs.device, non_blocking=True)
        mark = _Mark()
        _live_marks.add(weakref.ref(mark, _live_marks.discard))
        scaled._mixprec_scaled = mark  # type: ignore[attr-defined]
        if scaled.grad_fn is not None:  # marks the graph too: arithmetic on `scaled` keeps it
            scaled.grad_fn.metadata[_SCALED_MARK] = mark
        return scaled
    if isinstance(outputs, Mapping):
        return type(outputs)({k: _scale_outputs(v, scale) for k, v in outputs.items()})
    if isinstance(outputs, tuple) and hasattr(outputs, "_fields"):  # a namedtuple
        return type(outputs)(*(_scale_outputs(v, scale) for v in outputs))
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(_scale_outputs(v, scale) for v in outputs)
    raise TypeError(
        f"scale() takes a tensor or lists, tuples or dicts of tensors, got {type(outputs).__name__}"
    )


# the key of the mark ``scale`` leaves in its product's autograd node (``Node.metadata``)
_SCALED_MARK = "mixprec_scaled"
# how far `is_scaled` looks back through the autograd graph from a loss: operations, nodes
SCALED_SEARCH_DEPTH = 4
SCALED_SEARCH_NODES = 256


class _Mark:
    """What ``scale`` leaves on its product and in that product's autograd node. Only the
    tensor and the node hold it, so it lives as long as either can be reached from a loss."""

    __slots__ = ("__weakref__",)


# weak references to the marks alive, each dropped as its mark dies: while there are none, no
# loss can be scaled and `is_scaled` answers without walking a graph (every step of an
# unscaled run, and a scaled run's step once the last step's scaled loss and graph are gone)
_live_marks: set[weakref.ref[_Mark]] = set()


def is_scaled(loss: torch.Tensor) -> bool:
    """Whether `loss` came out of a scaler's ``scale``, or was computed from such a tensor in
    at most `SCALED_SEARCH_DEPTH` autograd operations (``scaler.scale(loss) / accumulation``,
    ``scaler.scale(loss) * weight``, a sum of scaled losses), looking at no more than
    `SCALED_SEARCH_NODES` nodes. A backward that scales its loss refuses one, since scaling
    twice leaves gradients the scale times too large after the one unscale (an Adam step
    hides most of that, so it would pass unnoticed).

    ``scale`` marks its product's autograd node; the arithmetic after it makes new tensors,
    but their graph leads back to that node. Anything not a tensor is never scaled (a
    stand-in object whose attributes are all truthy included). While no mark is alive
    nothing is walked: a step without loss scaling pays for no graph search."""
    if not _live_marks or not isinstance(loss, torch.Tensor):
        return False
    if type(getattr(loss, "_mixprec_scaled", None)) is _Mark:
        return True
    level = [loss.grad_fn] if loss.grad_fn is not None else []
    seen: set[Any] = set()  # the nodes themselves: held, so that none is looked at twice
    for _ in range(SCALED_SEARCH_DEPTH + 1):
        following = []
        for node in level:
            if node in seen or len(seen) >= SCALED_SEARCH_NODES:
                continue
            seen.add(node)
            if type(node.metadata.get(_SCALED_MARK)) is _Mark:
                return True
            for n, _ in node.next_functions:
                if n is not None:
                    following.append(n)
        level = following
    return False


def _check_keys(state: Mapping[str, Any], keys: Sequence[str], what: str) -> None:
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(
            f"not a {what} state: missing {missing}; pass the dict returned by state_dict() "
            f"of the scaler the checkpoint was saved with"
        )


@dataclass(frozen=True)
class LossScalerStats:
    """A snapshot of a scaler's counters.

    ``steps`` counts calls to ``update`` (one per optimizer step, taken or skipped),
    ``last_overflow_step`` is the 0-based index of the latest skipped step (None if none).
    """

    scale: float
    steps: int
    skipped_steps: int
    consecutive_skips: int
    last_overflow_step: int | None


class LossScaler:
    """Common machinery of all scalers: scaling, fused unscale/check, counters, state.

    Subclasses decide how the scale moves (``_update_scale``) and whether it is at its floor
    (``_at_floor``). The typical step is::

        scaler.scale(loss).backward()
        found_inf = scaler.synchronize(scaler.unscale_(grads))
        overflow = bool(found_inf.item())      # the one host sync
        if not overflow:
            optimizer.step()
        scaler.update(found_inf, overflow)

    ``synchronize`` all-reduces the flag (max) over ``process_group`` when
    ``torch.distributed`` is initialized with more than one rank, so every rank skips together.
    """

    enabled: bool = True
    kind: str = "base"
    # what `state_dict` saves beside the kind and the scale: each key and the attribute that
    # holds it, which `load_state_dict` sets back
    _SAVED: ClassVar[dict[str, str]] = {
        "steps": "_steps",
        "skipped_steps": "_skipped",
        "consecutive_skips": "_consecutive",
        "skips_at_min_scale": "_skips_at_floor",
        "last_overflow_step": "_last_overflow",
        "max_skips_at_min_scale": "_max_skips",  # (set as saved: a load checks it first)
    }

    def __init__(
        self,
        scale: float | torch.Tensor,
        *,
        max_skips_at_min_scale: int = 10,
        process_group: Any = None,
    ) -> None:
        value, device = _initial_scale("loss scale", scale)
        self.max_skips_at_min_scale = max_skips_at_min_scale
        self.process_group = process_group
        self._scale = torch.full((), value, dtype=torch.float32, device=device)
        self._steps = 0
        self._skipped = 0
        self._consecutive = 0
        self._skips_at_floor = 0
        self._last_overflow: int | None = None
        self._scaled_since_update = False
        # whether the scale is still the one the run starts from (no update, no load since
        # building or `reset`): only then does a new ``init_scale`` move it
        self._at_start = True
        # the settings in force before a checkpoint's replaced them (`load_state_dict`): the
        # run it resumes trains on with the checkpoint's, and `reset` puts these back
        self._configured: dict[str, Any] | None = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (a scaler pickled while its settings were plain attributes)
        if "max_skips_at_min_scale" in state:
            state["_max_skips"] = state.pop("max_skips_at_min_scale")
        self.__dict__.update(state)

    @property
    def max_skips_at_min_scale(self) -> int:
        """Overflowing steps in a row at the scale's floor before `LossScaleDivergedError`
        (an int >= 1, checked when set)."""
        return self._max_skips

    @max_skips_at_min_scale.setter
    def max_skips_at_min_scale(self, value: int) -> None:
        self._max_skips = _positive_int("max_skips_at_min_scale", value)

    # -- device placement -------------------------------------------------------------------

    def to(self, device: torch.device | str) -> LossScaler:
        """Move the scale (and any other state tensors) to ``device``; returns self."""
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    @property
    def device(self) -> torch.device:
        """Device holding the scale tensor."""
        return self._scale.device

    # -- the hot path -----------------------------------------------------------------------

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The current scale as a float32 0-dim tensor on ``device`` (no host sync)."""
        return self._scale

    @property
    def loss_scale(self) -> float:
        """The current scale as a Python float (a host sync)."""
        return float(self._scale.item())

    @property
    def scaled_since_update(self) -> bool:
        """Whether ``scale`` was called since the last ``update``.

        Gradients produced before an ``update`` were scaled by the previous scale; unscaling
        them with the new one would silently corrupt them, so optimizers check this.
        """
        return self._scaled_since_update

    def scale(self, outputs: Outputs) -> Outputs:
        """Return ``outputs`` multiplied by the current scale; call ``backward`` on the result.

        ``outputs`` is a loss tensor, or lists, tuples or dicts of them (several losses
        backpropagated together), returned in the same structure.
        """
        scaled = _scale_outputs(outputs, self._scale)
        self._scaled_since_update = True
        return scaled

    def unscale_(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """Divide ``grads`` in place by the scale; return the overflow flag.

        The flag is a float32 0-dim tensor on ``device``: 0.0 if every gradient is finite,
        positive otherwise. Gradients may live on several devices and dtypes; a sparse
        gradient is unscaled through its values, a complex one through its real and
        imaginary parts (``torch.view_as_real``; torch's fused kernel, which
        ``torch.amp.GradScaler`` calls too, refuses complex dtypes).
        """
        # Reciprocal in float64 then rounded, as torch.amp.GradScaler does, so that both
        # multiply the gradients by the very same float32 number (MPS has no float64).
        if self._scale.device.type == "mps":
            inv = self._scale.reciprocal()
        else:
            inv = self._scale.double().reciprocal().float()
        return self._check_and_scale(grads, inv)

    def check_(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """The overflow flag of ``grads`` without unscaling them: for a fused optimizer that
        divides by the scale inside its own kernel (``grad_scale``), as
        ``torch.amp.GradScaler`` drives one."""
        one = torch.full((), 1.0, dtype=torch.float32, device=self._scale.device)
        return self._check_and_scale(grads, one)

    def synchronize(self, found_inf: torch.Tensor) -> torch.Tensor:
        """All-reduce ``found_inf`` (max) across ranks when running distributed; in place."""
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size(self.process_group) > 1:
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.process_group)
        return found_inf

    def update(self, found_inf: torch.Tensor, overflow: bool | None = None) -> None:
        """Advance one step: count it, move the scale on device, detect divergence.

        ``overflow`` is ``bool(found_inf)`` when the caller already read it (pass it: reading
        it here would be a second host sync). Raises ``LossScaleDivergedError`` when the step
        overflowed ``max_skips_at_min_scale`` times in a row with the scale at its floor.
        A flag of another dtype (bool, float64, int) counts as the float32 one.
        """
        if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1:
            error = ValueError if isinstance(found_inf, torch.Tensor) else TypeError
            raise error(
                f"found_inf must be a one-element tensor, the overflow flag unscale_ returns "
                f"(positive: a gradient was inf/NaN), got {found_inf!r}"
            )
        # checked and converted before anything is counted: the update kernels take float32
        flag = found_inf.to(self._scale.device, torch.float32)
        if flag.dim():
            flag = flag.reshape(())
        if overflow is None:
            overflow = bool(flag.item())
        if overflow:
            self._skips_at_floor = self._skips_at_floor + 1 if self._at_floor() else 0
            self._skipped += 1
            self._consecutive += 1
            self._last_overflow = self._steps
        else:
            self._consecutive = 0
            self._skips_at_floor = 0
        self._steps += 1
        self._scaled_since_update = False
        self._at_start = False
        self._update_scale(flag, overflow)
        if self._skips_at_floor >= self.max_skips_at_min_scale:
            raise LossScaleDivergedError(self._divergence_message())

    # -- statistics and state ---------------------------------------------------------------

    def stats(self) -> LossScalerStats:
        """Current scale and step counters (reading the scale is a host sync)."""
        return LossScalerStats(
            scale=self.loss_scale,
            steps=self._steps,
            skipped_steps=self._skipped,
            consecutive_skips=self._consecutive,
            last_overflow_step=self._last_overflow,
        )

    def reset(self) -> None:
        """Start afresh, as a scaler built with the settings it has now: the scale back
        to its start (a dynamic scaler's ``init_scale``), counters, growth tracker and
        credits to zero or full. The settings, set at building or since, are kept.
        `Precision.reset` calls this before each Trainer run."""
        configured = getattr(self, "_configured", None)
        if configured is not None:  # (the run a checkpoint's settings went with is over)
            for attr, value in configured.items():
                setattr(self, attr, value)
            self._configured = None
        self._steps = self._skipped = self._consecutive = self._skips_at_floor = 0
        self._last_overflow = None
        self._scaled_since_update = False
        self._at_start = True

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly, valid before the first step too."""
        saved = {key: getattr(self, attr) for key, attr in self._SAVED.items()}
        return {"kind": self.kind, "scale": self.loss_scale, **saved}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state saved by ``state_dict`` of a scaler of the same kind.

        A dynamic scaler also takes the state of a ``torch.amp.GradScaler``.
        """
        self.check_state_dict(state)
        self._at_start = False  # (a resumed run's scale: a new init_scale waits for a reset)
        if getattr(self, "_configured", None) is None:
            counters = ("steps", "skipped_steps", "consecutive_skips", "skips_at_min_scale")
            self._configured = {
                attr: getattr(self, attr)
                for key, attr in self._SAVED.items()
                if key not in (*counters, "last_overflow_step")
            }
        if "kind" not in state:
            self._load_foreign_state(state)
            return
        _warn_settings_replaced(self, state)
        self._scale.fill_(self._loaded_scale(state))
        for key, attr in self._SAVED.items():
            setattr(self, attr, state[key])

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raise, changing nothing, what `load_state_dict` refuses in ``state``: another kind,
        missing keys, settings or counters the constructor would refuse, a torch.amp.GradScaler
        state this kind cannot take."""
        if not isinstance(state, Mapping):
            raise TypeError(f"a loss scaler state is a dict, got {type(state).__name__}")
        if "kind" not in state:
            self._check_foreign_state(state)
            return
        if state["kind"] != self.kind:
            raise ValueError(
                f"cannot load a {state['kind']!r} loss scaler state into a {self.kind!r} "
                f"scaler; build the scaler the checkpoint was saved with"
            )
        _check_keys(state, self._state_keys(), f"{self.kind!r} loss scaler")
        try:  # (the settings and scale as the constructor checks them, and counters >= 0)
            self._check_saved(state)
        except (TypeError, ValueError) as err:
            raise ValueError(f"invalid {self.kind!r} loss scaler state: {err}") from None

    # settings a saved state holds, which loading it restores (as torch.amp.GradScaler
    # restores its own): a scaler built with others is told so (`_warn_settings_replaced`)
    _SETTINGS: ClassVar[tuple[str, ...]] = ("max_skips_at_min_scale",)

    def _loaded_scale(self, state: Mapping[str, Any]) -> float:
        """The scale a loaded state leaves: the saved one."""
        return float(state["scale"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self.loss_scale:g}, steps={self._steps})"

    def _state_keys(self) -> list[str]:
        return ["scale", *self._SAVED]

    def _check_saved(self, state: Mapping[str, Any]) -> None:
        """Raise what the constructor would for a saved state's scale and settings, and for
        a counter that is not an int >= 0."""
        _initial_scale("scale", state["scale"])
        _positive_int("max_skips_at_min_scale", state["max_skips_at_min_scale"])
        for key in ("steps", "skipped_steps", "consecutive_skips", "skips_at_min_scale"):
            _count(key, state[key])
        if state["last_overflow_step"] is not None:
            _count("last_overflow_step", state["last_overflow_step"], "None or ")

    def _load_foreign_state(self, state: Mapping[str, Any]) -> None:
        """Load a state without a ``kind`` that `_check_foreign_state` took (nothing to load
        here: only a disabled GradScaler's empty state is taken, by `NoLossScaler`)."""

    def _check_foreign_state(self, state: Mapping[str, Any]) -> None:
        """A state without a ``kind``: from torch.amp.GradScaler, or not a scaler's at all."""
        if not state:
            raise ValueError(
                "this loss scaler state is empty: it was saved by a disabled "
                "torch.amp.GradScaler(enabled=False) and holds no scale to resume. Start the "
                "scaler fresh (skip load_state_dict), or train without loss scaling "
                "(scaler='none')"
            )
        if _TORCH_GRAD_SCALER_KEYS <= state.keys():
            raise ValueError(
                f"this is a torch.amp.GradScaler state (a dynamic scale); it loads into a "
                f"DynamicLossScaler, not a {type(self).__name__}: use scaler='dynamic'"
            )
        raise ValueError(
            f"not a loss scaler state (keys {sorted(state)}); pass the dict returned by "
            f"state_dict() of a mixprec scaler or of a torch.amp.GradScaler"
        )

    # -- subclass hooks ---------------------------------------------------------------------

    def _update_scale(self, found_inf: torch.Tensor, overflow: bool) -> None:
        """Move the scale on device given this step's flag and its value on the host (a
        static scale does not move)."""

    def _at_floor(self) -> bool:
        """Whether the scale cannot be lowered any further (always, for a static scale)."""
        return True

    def _divergence_message(self) -> str:
        return (
            f"training diverged: gradients were inf/NaN on {self._skips_at_floor} consecutive "
            f"steps with the loss scale at its minimum ({self.loss_scale:g}); "
            f"{self._skipped} of {self._steps} steps were skipped. A smaller scale cannot help: "
            f"the forward or backward pass itself produces inf/NaN. Run `mixprec doctor` to "
            f"find the layer, or train with bfloat16 ('bf16-mixed'), which needs no loss scaling."
        )

    # -- internals --------------------------------------------------------------------------

    def _check_and_scale(self, grads: Sequence[torch.Tensor], inv: torch.Tensor) -> torch.Tensor:
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads:
            if grad.is_sparse:
                grad = grad._values()
            if grad.is_complex():  # torch's kernel takes real dtypes: the same memory, as pairs
                grad = torch.view_as_real(grad)
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        flags: dict[torch.device, torch.Tensor] = {found_inf.device: found_inf}
        scales: dict[torch.device, torch.Tensor] = {inv.device: inv}
        for (device, _), tensors in groups.items():
            flag = flags.get(device)
            if flag is None:
                flag = flags[device] = torch.zeros((), dtype=torch.float32, device=device)
            scale = scales.get(device)
            if scale is None:
                scale = scales[device] = inv.to(device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, scale)
        for device, flag in flags.items():
            if device != found_inf.device:
                found_inf += flag.to(found_inf.device)
        return found_inf


class NoLossScaler(LossScaler):
    """No scaling and no overflow check, for bfloat16, float32 and float64 training.

    ``scale`` returns the loss unchanged; ``unscale_`` leaves the gradients alone and
    reports no overflow, so every step is taken, exactly as in plain PyTorch.
    """

    enabled = False
    kind = "none"

    def __init__(self) -> None:
        super().__init__(1.0)
        self._no_overflow = torch.zeros((), dtype=torch.float32)

    def scale(self, outputs: Outputs) -> Outputs:
        """Return ``outputs`` unchanged."""
        return outputs

    def unscale_(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """Leave ``grads`` alone; report no overflow (nothing is checked)."""
        return self._no_overflow

    def check_(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """Report no overflow (nothing is checked)."""
        return self._no_overflow

    def synchronize(self, found_inf: torch.Tensor) -> torch.Tensor:
        """Nothing to agree on: no rank ever overflows."""
        return found_inf

    def update(self, found_inf: torch.Tensor, overflow: bool | None = None) -> None:
        """Count the step."""
        self._steps += 1
        self._at_start = False

    def _check_foreign_state(self, state: Mapping[str, Any]) -> None:
        # a disabled torch.amp.GradScaler saves {}: no scaling, nothing to restore
        if state:
            super()._check_foreign_state(state)

    @property
    def loss_scale(self) -> float:
        """Always 1.0."""
        return 1.0


class StaticLossScaler(LossScaler):
    """A fixed loss scale: overflowing steps are skipped, the scale never moves.

    Since the scale cannot go lower, ``max_skips_at_min_scale`` consecutive overflows raise
    ``LossScaleDivergedError``.
    """

    kind = "static"

    def _loaded_scale(self, state: Mapping[str, Any]) -> float:
        """The scale this scaler was built with: a static scale is a setting, not a state,
        and a run resumed with another (lowered after `LossScaleDivergedError`) trains at the
        one it asked for (`_warn_settings_replaced` says so)."""
        return self.loss_scale

    def _divergence_message(self) -> str:
        # a fixed scale chosen too large overflows every step: lowering it may well help
        return (
            f"training diverged: gradients were inf/NaN on {self._skips_at_floor} consecutive "
            f"steps under the static loss scale {self.loss_scale:g}, which never moves; "
            f"{self._skipped} of {self._steps} steps were skipped. Lower the scale (a run "
            f"resumed from a checkpoint takes the one it is built with), or let it "
            f"adapt: scaler='dynamic'. If they overflow at a small scale too, the forward or "
            f"backward pass itself produces inf/NaN: run `mixprec doctor` to find the layer, "
            f"or train with bfloat16 ('bf16-mixed'), which needs no loss scaling."
        )


class DynamicLossScaler(LossScaler):
    """A scale that backs off on overflow and grows after ``growth_interval`` clean steps.

    Args:
        init_scale: starting scale (torch and DeepSpeed use 2**16, Keras 2**15): a number,
            or a floating tensor of one element (the scale state then lives on its device).
        growth_factor: multiplier after ``growth_interval`` consecutive clean steps (> 1).
        backoff_factor: multiplier when the scale backs off (in (0, 1)).
        growth_interval: clean steps in a row needed to grow.
        hysteresis: overflow credits, as in DeepSpeed/Megatron. Each overflow spends one; the
            scale backs off only once they are spent, and they refill when the scale grows.
            1 means "back off on every overflow" (torch.amp.GradScaler's behaviour).
        min_scale, max_scale: bounds the scale is clamped to. With ``hysteresis=1``,
            ``min_scale=0`` and ``max_scale=inf`` the scale follows torch.amp.GradScaler
            exactly; growth never produces an infinite scale.
        max_skips_at_min_scale: overflowing steps in a row at ``min_scale`` before
            ``LossScaleDivergedError`` is raised.
        process_group: group the overflow flag is all-reduced over (default: the world).
    """

    kind = "dynamic"
    _SETTINGS = (
        *LossScaler._SETTINGS,
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "hysteresis",
        "min_scale",
        "max_scale",
    )
    # its settings too, each under its own name
    _SAVED: ClassVar[dict[str, str]] = {
        **LossScaler._SAVED,
        **{
            name: f"_{name}"  # (set as saved: a loaded state is checked whole first)
            for name in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
            + ("hysteresis", "min_scale", "max_scale")
        },
    }

    def __init__(
        self,
        init_scale: float | torch.Tensor = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        *,
        max_skips_at_min_scale: int = 10,
        process_group: Any = None,
    ) -> None:
        init, _ = _initial_scale("init_scale", init_scale)
        super().__init__(
            init_scale, max_skips_at_min_scale=max_skips_at_min_scale, process_group=process_group
        )
        growth_factor = _real("growth_factor", growth_factor)
        backoff_factor = _real("backoff_factor", backoff_factor)
        min_scale = _real("min_scale", min_scale)
        max_scale = _real("max_scale", max_scale)
        if not 1.0 < growth_factor < math.inf:
            raise ValueError(f"growth_factor must be a finite number > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if not 0.0 <= min_scale <= init <= max_scale:
            raise ValueError(
                f"need 0 <= min_scale <= init_scale <= max_scale, "
                f"got {min_scale}, {init}, {max_scale}"
            )
        self._init_scale = init
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        device = self._scale.device
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_interval = growth_interval
        self._hysteresis = _positive_int("hysteresis", hysteresis)
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._credits = torch.full((), self._hysteresis, dtype=torch.int32, device=device)
        # (scale, growth tracker) as the host knows them; None: to be read from the device
        self._host: tuple[float, int] | None = (_float32(init), 0)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (a scaler pickled while its settings were plain attributes)
        for name in ("growth_interval", "init_scale", "growth_factor", "backoff_factor") + (
            "hysteresis",
            "min_scale",
            "max_scale",
        ):
            if name in state:
                state[f"_{name}"] = state.pop(name)
        super().__setstate__(state)

    # The settings, each checked when set after building (as a load's warning invites), so
    # that what the scaler then saves loads again: the bounds take the scale, and the
    # initial scale, into them; fewer hysteresis credits take the unspent ones down.

    @property
    def init_scale(self) -> float:
        """The scale training starts from (within ``[min_scale, max_scale]``). Set before
        the first ``scale`` (of a scaler just built or `reset`), the next step uses it; set
        once a loss was scaled, a step taken or a state loaded, the running scale is kept
        (the gradients and the run were made with it) and the next `reset` starts from the
        new one (`Precision.reset`: the Trainer's next run)."""
        return self._init_scale

    @init_scale.setter
    def init_scale(self, value: float) -> None:
        init, _ = _initial_scale("init_scale", value)
        if not self._min_scale <= init <= self._max_scale:
            raise ValueError(
                f"init_scale must be within [min_scale, max_scale] = "
                f"[{self._min_scale}, {self._max_scale}], got {init}"
            )
        self._init_scale = init
        if getattr(self, "_at_start", False) and not self._scaled_since_update:
            self.reset()  # (nothing ran yet: the scale, and its host mirror, start there)

    @property
    def growth_factor(self) -> float:
        """Multiplier when the scale grows (> 1)."""
        return self._growth_factor

    @growth_factor.setter
    def growth_factor(self, value: float) -> None:
        value = _real("growth_factor", value)
        if not 1.0 < value < math.inf:
            raise ValueError(f"growth_factor must be a finite number > 1, got {value}")
        self._growth_factor = value

    @property
    def backoff_factor(self) -> float:
        """Multiplier when the scale backs off (in (0, 1))."""
        return self._backoff_factor

    @backoff_factor.setter
    def backoff_factor(self, value: float) -> None:
        value = _real("backoff_factor", value)
        if not 0.0 < value < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {value}")
        self._backoff_factor = value

    @property
    def hysteresis(self) -> int:
        """Overflow credits; set lower, the unspent credits are capped at the new number."""
        return self._hysteresis

    @hysteresis.setter
    def hysteresis(self, value: int) -> None:
        self._hysteresis = _positive_int("hysteresis", value)
        self._credits.clamp_(max=self._hysteresis)

    @property
    def min_scale(self) -> float:
        """The scale's floor; set above the scale (or the initial scale), raises them to it."""
        return self._min_scale

    @min_scale.setter
    def min_scale(self, value: float) -> None:
        self._set_bounds(_real("min_scale", value), self._max_scale)

    @property
    def max_scale(self) -> float:
        """The scale's ceiling; set below the scale (or the initial scale), lowers them to it."""
        return self._max_scale

    @max_scale.setter
    def max_scale(self, value: float) -> None:
        self._set_bounds(self._min_scale, _real("max_scale", value))

    def _set_bounds(self, low: float, high: float) -> None:
        # (as the constructor: the scale between them must be positive and finite in float32)
        if not 0.0 <= low <= high or low > _FLOAT32_MAX or _float32(high) == 0.0:
            raise ValueError(
                f"need 0 <= min_scale <= max_scale, min_scale finite and max_scale above 0 "
                f"in float32 (the scale lies between them), got {low}, {high}"
            )
        self._min_scale, self._max_scale = low, high
        self._init_scale = min(max(self._init_scale, low), high)
        self._scale.clamp_(_float32(low), _float32(high))  # (as an update would)
        if self._host is not None:
            scale = min(max(self._host[0], _float32(low)), _float32(high))
            self._host = (scale, self._host[1])

    @property
    def growth_interval(self) -> int:
        """Clean steps in a row needed to grow. Set lower than the clean steps already
        counted, the scale grows at the next clean step (the count is kept below the
        interval: torch's update grows only when it reaches the interval exactly, so a count
        past it would never grow again)."""
        return self._growth_interval

    @growth_interval.setter
    def growth_interval(self, value: int) -> None:
        self._growth_interval = _positive_int("growth_interval", value)
        self._growth_tracker.clamp_(max=self._growth_interval - 1)
        host = getattr(self, "_host", None)
        if host is not None:
            self._host = (host[0], min(host[1], self._growth_interval - 1))

    def _update_scale(self, found_inf: torch.Tensor, overflow: bool) -> None:
        if self.hysteresis > 1:
            self._update_with_hysteresis(found_inf)
            self._scale.clamp_(_float32(self.min_scale), _float32(self.max_scale))
            return
        scale, clean_run = self._mirror()
        torch._amp_update_scale_(
            self._scale,
            self._growth_tracker,
            found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )
        # The kernel's step mirrored on the host, in its arithmetic (a float32 scale times
        # a float64 factor, rounded to float32), so that neither the bounds nor the floor
        # need a read of the device: a step dispatches exactly what GradScaler.update does,
        # plus a clamp on the rare step that crosses a bound.
        if overflow:
            scale, clean_run = _float32(scale * self.backoff_factor), 0
        elif clean_run + 1 == self.growth_interval:  # (the count stays below it)
            grown = _float32(scale * self.growth_factor)
            scale, clean_run = (grown if math.isfinite(grown) else scale), 0
        else:
            clean_run += 1
        low, high = _float32(self.min_scale), _float32(self.max_scale)
        if not low <= scale <= high:
            self._scale.clamp_(_float32(self.min_scale), _float32(self.max_scale))
            scale = min(max(scale, low), high)
        self._host = (scale, clean_run)

    def _mirror(self) -> tuple[float, int]:
        """The scale and growth tracker as the host knows them; read once after a load."""
        if self._host is None:
            self._host = (float(self._scale.item()), int(self._growth_tracker.item()))
        return self._host

    def _update_with_hysteresis(self, found_inf: torch.Tensor) -> None:
        # The same transition as _amp_update_scale_ plus a credit counter, written as
        # branch-free tensor ops so that nothing is read back to the host.
        overflow = found_inf > 0
        credits = torch.where(overflow, self._credits - 1, self._credits)
        back_off = overflow & (credits <= 0)
        clean_run = torch.where(overflow, 0, self._growth_tracker + 1)
        grow = clean_run >= self.growth_interval
        # (each product in float64 and rounded once, as torch's kernel multiplies the
        # float32 scale by the double factor: a factor rounded to float32 first lands the
        # scale one rounding away, 3.3000002 for 3.0 * 1.1; MPS has no float64)
        wide = self._scale if self._scale.device.type == "mps" else self._scale.double()
        grown = (wide * self.growth_factor).to(self._scale.dtype)
        grown = torch.where(torch.isfinite(grown), grown, self._scale)
        new_scale = torch.where(
            back_off,
            (wide * self.backoff_factor).to(self._scale.dtype),
            torch.where(grow, grown, self._scale),
        )
        self._scale.copy_(new_scale)
        self._growth_tracker.copy_(torch.where(grow, 0, clean_run))
        self._credits.copy_(torch.where(grow, self.hysteresis, credits.clamp(min=0)))
        self._host = None  # (not mirrored: read from the device if hysteresis becomes 1)

    def _at_floor(self) -> bool:
        # the clamp holds the scale at min_scale rounded to float32 (0.1 -> 0.10000000149):
        # compare with that, or a scale resting on such a floor never counts as there
        if self.hysteresis > 1:
            return bool(self._scale <= self._scale.new_tensor(self.min_scale))
        return self._mirror()[0] <= _float32(self.min_scale)

    def reset(self) -> None:
        """Start afresh (see `LossScaler.reset`) at ``init_scale``, keeping the settings."""
        super().reset()
        self._scale.fill_(self._init_scale)
        self._growth_tracker.zero_()
        self._credits.fill_(self._hysteresis)
        self._host = (_float32(self._init_scale), 0)

    def state_dict(self) -> dict[str, Any]:
        """Scale, growth tracker, hysteresis credits, counters and settings."""
        state = super().state_dict()
        state.update(
            growth_tracker=int(self._growth_tracker.item()), credits=int(self._credits.item())
        )
        return state

    def _state_keys(self) -> list[str]:
        return [*super()._state_keys(), "growth_tracker", "credits"]

    def _check_saved(self, state: Mapping[str, Any]) -> None:
        super()._check_saved(state)
        keys = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
        keys += ("hysteresis", "min_scale", "max_scale", "max_skips_at_min_scale")
        DynamicLossScaler(**{k: state[k] for k in keys})  # (the constructor's checks)
        _count("growth_tracker", state["growth_tracker"])
        _count("credits", state["credits"])
        if state["credits"] > state["hysteresis"]:
            raise ValueError(
                f"credits must be at most hysteresis ({state['hysteresis']}), "
                f"got {state['credits']}"
            )
        scale = _float32(float(state["scale"]))
        if not _float32(state["min_scale"]) <= scale <= _float32(state["max_scale"]):
            raise ValueError(
                f"scale {state['scale']} is outside [min_scale, max_scale] = "
                f"[{state['min_scale']}, {state['max_scale']}]"
            )

    def _check_foreign_state(self, state: Mapping[str, Any]) -> None:
        if state and _TORCH_GRAD_SCALER_KEYS <= state.keys():
            self._grad_scaler_values(state)
        else:
            super()._check_foreign_state(state)

    @staticmethod
    def _grad_scaler_values(state: Mapping[str, Any]) -> tuple[float, float, float, int, int]:
        """A ``torch.amp.GradScaler`` state's scale, factors, interval and growth tracker,
        checked."""
        scale = _real("scale", state["scale"])
        growth_factor = _real("growth_factor", state["growth_factor"])
        backoff_factor = _real("backoff_factor", state["backoff_factor"])
        growth_interval = _positive_int("growth_interval", state["growth_interval"])
        if (
            not 0 < scale < math.inf
            or not 1.0 < growth_factor < math.inf
            or not 0.0 < backoff_factor < 1.0
        ):
            raise ValueError(f"invalid torch.amp.GradScaler state: {dict(state)}")
        try:
            tracker = _count("_growth_tracker", state["_growth_tracker"])
        except ValueError as err:
            raise ValueError(f"invalid torch.amp.GradScaler state: {err}") from None
        return scale, growth_factor, backoff_factor, growth_interval, tracker

    def _load_foreign_state(self, state: Mapping[str, Any]) -> None:
        """Resume from ``torch.amp.GradScaler.state_dict()``: its scale, growth tracker,
        factors and interval. It has no hysteresis, bounds or counters: this scaler keeps its
        own hysteresis and bounds (a scale outside them, which GradScaler's unbounded growth
        reaches, is taken to the nearest, as an update would: its own state then saves and
        loads again), refills its credits and starts its counters at zero."""
        scale, growth_factor, backoff_factor, growth_interval, tracker = self._grad_scaler_values(
            state
        )
        tracker = _within_interval(tracker, growth_interval)
        scale = min(max(_float32(scale), _float32(self.min_scale)), _float32(self.max_scale))
        self._scale.fill_(scale)
        self.growth_interval = growth_interval
        self._growth_tracker.fill_(tracker)
        self._host = (_float32(scale), tracker)
        self._credits.fill_(self.hysteresis)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self._steps = self._skipped = self._consecutive = self._skips_at_floor = 0
        self._last_overflow = None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the scale, counters and settings saved by ``state_dict``, or the state of
        a ``torch.amp.GradScaler`` (see ``_load_foreign_state``)."""
        self._host = None  # read from the device at the next update, unless known below
        super().load_state_dict(state)
        if "kind" not in state:
            return
        tracker = _within_interval(state["growth_tracker"], self.growth_interval)
        self._growth_tracker.fill_(tracker)
        self._host = (_float32(float(state["scale"])), tracker)
        self._credits.fill_(state["credits"])


def _warn_settings_replaced(scaler: LossScaler, state: Mapping[str, Any]) -> None:
    """Warn where a saved state's settings (`LossScaler._SETTINGS`) differ from those
    `scaler` was built with, which loading replaces, and where a static scale differs from
    the one built, which is kept: a run resumed with new settings would otherwise train on
    with the old ones unsaid."""
    replaced = [
        f"{key} {state[key]!r} (built with {getattr(scaler, key)!r})"
        for key in scaler._SETTINGS
        if state[key] != getattr(scaler, key)
    ]
    notes = []
    if replaced:
        notes.append(
            f"the checkpoint's {', '.join(replaced)} {'is' if len(replaced) == 1 else 'are'} "
            "restored, as torch.amp.GradScaler restores its own: set the attribute on the "
            "scaler after loading to train on with another"
        )
    if scaler.kind == "static" and float(state["scale"]) != scaler.loss_scale:
        notes.append(
            f"the static scale it was built with, {scaler.loss_scale:g}, is kept over the "
            f"checkpoint's {float(state['scale']):g}"
        )
    if notes:
        warnings.warn(
            f"loading a {scaler.kind!r} loss scaler state: {'; '.join(notes)}", stacklevel=4
        )


def as_loss_scaler(
    spec: LossScaler | str | float | torch.Tensor | None, *, needs_scaling: bool
) -> LossScaler:
    """Build a scaler from a user's choice.

    ``None`` picks a ``DynamicLossScaler`` when ``needs_scaling`` (float16 in the policy) and a
    ``NoLossScaler`` otherwise. ``"dynamic"`` and ``"none"`` name those two, a number (or a
    one-element floating tensor) is a fixed scale (``StaticLossScaler``), and a scaler
    instance is used as given.
    """
    if isinstance(spec, LossScaler):
        return spec
    if spec is None:
        return DynamicLossScaler() if needs_scaling else NoLossScaler()
    if isinstance(spec, str):
        if spec == "dynamic":
            return DynamicLossScaler()
        if spec == "none":
            return NoLossScaler()
        raise ValueError(
            f"unknown loss scaler {spec!r}: use 'dynamic', 'none', a number (static scale) "
            f"or a LossScaler instance"
        )
    if isinstance(spec, torch.Tensor) or (isinstance(spec, Real) and not isinstance(spec, bool)):
        return StaticLossScaler(spec)
    hint = ""
    if isinstance(spec, torch.amp.GradScaler):
        hint = (
            "; for a torch.amp.GradScaler use scaler='dynamic' and load its state_dict() "
            "into the DynamicLossScaler"
        )
    raise TypeError(
        f"cannot make a loss scaler from {type(spec).__name__}: {spec!r}; use None, "
        f"'dynamic', 'none', a number or one-element floating tensor (a static scale), or "
        f"a LossScaler instance{hint}"
    )
