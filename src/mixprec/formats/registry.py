"""The registry of quantized formats: each format (int8, int4, float8, mxfp8, ...) is one
`Format` object, registered once, that the rest of mixprec reads.

A format says, in one place: how its policy names spell it and its options
("int4/64_from_bf16-mixed", "float8/delayed:16", "mxfp8/floor") and how its config prints back
canonically; its config (a frozen value); which layers it leaves float and why; the layer it swaps
in for a float one and the float layer it gives back (`Format.to_float`); the work its layers need
once per optimizer step (`Format.before_step`: float8's delayed scaling shares its amax histories
across the ranks; `Precision.before_step` runs it at every door); the bytes its weights take; and
how well a device runs it. The policy grammar (`mixprec.policy.names`), `QuantizedPolicy`,
`mixprec.quantize`, `mixprec.hardware` and the format search (`mixprec.plan`) ask the registry,
never a mode by name, so adding a format is one subclass of `Format` in the format's own module and
one `register` call (the builtin ones are declared beside their layers in `mixprec.quantize`'s
modules and registered, in order, by `mixprec.quantize.BUILTIN_FORMATS`).

The format's rating is a `Support`: a `Status` and the reason for it, as the hardware
support matrix rates dtypes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from mixprec.errors import PolicySpecError

if TYPE_CHECKING:
    from mixprec.device import DeviceInfo

__all__ = [
    "Format",
    "Ranked",
    "Status",
    "StepWork",
    "Support",
    "agree",
    "before_step",
    "format_named",
    "formats",
    "register",
    "step_work",
    "unregister",
]


class Ranked(str, Enum):
    """Words in order: a member prints as its value, and `rank` is its place in the list."""

    def __str__(self) -> str:
        return self.value

    @property
    def rank(self) -> int:
        """The member's place, 0 for the first listed."""
        return list(type(self)).index(self)


class Status(Ranked):
    """How well a device runs a precision, best first (rank 0): the worst dtype of a
    policy decides its support."""

    FAST = "fast"
    SUPPORTED = "supported"
    SLOW = "slow"
    REFUSED = "refused"


@dataclass(frozen=True)
class Support:
    """One cell of the support matrix: a status and the reason for it."""

    status: Status
    reason: str


class Format:
    """One quantized format. Subclass it, set the class attributes, override the methods
    the format needs, and `register` an instance.

    Attributes:
        name: the mode as policy names spell it ("int8"); lower case, no '/' or '_from_'.
        accepted: how names may spell it and its options, for error messages.
        embeddings: whether it also quantizes Embedding layers and Hugging Face ``Conv1D``
            (as the Linear it computes); otherwise plain Linear layers only.
        keeps_weight: whether its layer keeps the float weight Parameter (and trains it);
            False for layers holding codes instead, whose tie to a float layer ends.
        keywords: the options it takes as keywords (``QuantizedPolicy("int4", src,
            group_size=64)``, ``quantize(model, "int4", group_size=64)``).
        config_keys: the option keys its `to_dict` writes into a policy config, each with
            what it holds (for messages).
        search: the spellings a default format search tries ("int4/32", "int4/128").
        fast_on: the hardware on which it is fast, for the message of a slow precision.
        info_row: whether ``mixprec info`` rates it in a row of its own (a format whose
            speed depends on the device), over a float32 source.
        undo: the call that makes its layers float again, for messages.
    """

    name: str = ""
    accepted: ClassVar[str] = ""
    embeddings: ClassVar[bool] = False
    keeps_weight: ClassVar[bool] = True
    keywords: ClassVar[tuple[str, ...]] = ()
    config_keys: ClassVar[Mapping[str, str]] = {}
    search: ClassVar[tuple[str, ...]] = ()
    fast_on: ClassVar[str | None] = None
    info_row: ClassVar[bool] = False
    undo: ClassVar[str] = "mixprec.quantize.dequantize(model)"

    def parse(self, options: str | None, keywords: Mapping[str, Any], name: str) -> Any:
        """The config that the option text after '/' (None: no '/') and the keyword options
        (only this format's `keywords`, None for those not given) spell, defaults filled in;
        PolicySpecError naming what is wrong and what is accepted otherwise. `name` is the
        spec as written, for messages. The default takes no option at all."""
        if options is not None:
            raise PolicySpecError(f"{self.name} takes no option ({name!r}). {self.accepted}")
        return None

    def spell(self, config: Any) -> str:
        """The canonical spelling of the format and `config`: the name, and after '/' the
        options that differ from the defaults ("int4/64")."""
        return self.name

    def describe(self, config: Any) -> str:
        """What a layer quantized with `config` becomes, in words ("int4 (groups of 64)")."""
        return self.spell(config)

    def to_dict(self, config: Any) -> dict[str, Any]:
        """The option keys of a policy config (`QuantizedPolicy.to_config`) for `config`.
        The default: for a format whose `config_keys` has "options", the options its
        canonical name spells after '/' under that key (none for the defaults)."""
        _, slash, options = self.spell(config).partition("/")
        return {"options": options} if slash and "options" in self.config_keys else {}

    def from_dict(self, values: Mapping[str, Any], name: str) -> Any:
        """The config that `to_dict`'s keys spell (`QuantizedPolicy.from_config`): the
        default parses "options" as the text after '/' and the rest as `keywords`."""
        options = values.get("options")
        if options is not None and not isinstance(options, str):
            raise PolicySpecError(
                f"quantized policy config key 'options' is {options!r}: it holds "
                f"{self.config_keys['options']}, as to_config() writes them"
            )
        return self.parse(options, {k: values.get(k) for k in self.keywords}, name)

    def source_reason(self, compute_dtype: torch.dtype) -> str | None:
        """Why this format refuses a source float policy computing in `compute_dtype`
        (None: it takes it)."""
        return None

    def skip(self, config: Any, module: nn.Module) -> str | None:
        """Why it leaves `module` float, beyond the rules every format shares (the layer
        type, too few features): a shape its matmuls cannot take, a layer too small to
        gain. None: it quantizes it."""
        return None

    def swap(
        self,
        module: nn.Module,
        config: Any,
        *,
        path: str,
        storage: torch.dtype,
        tie: tuple[Any, ...],
        memo: dict[Any, Any],
    ) -> nn.Module:
        """The quantized layer for the float `module` at `path` (an ``nn.Linear``, or an
        ``nn.Embedding`` if `embeddings`). `storage` is the dtype its scales will be kept
        in; `memo` lives for one quantization, so that modules sharing a weight (equal
        `tie`) can share one quantized copy of it. The default: `build` the layer, from the
        codes `quantize_weight` makes once per tie for a format whose layers hold codes
        (not `keeps_weight`)."""
        return self.build(
            module,
            config,
            self._codes(module, config, path=path, storage=storage, tie=tie, memo=memo),
        )

    def _codes(
        self,
        module: nn.Module,
        config: Any,
        *,
        path: str,
        storage: torch.dtype,
        tie: tuple[Any, ...],
        memo: dict[Any, Any],
    ) -> Any:
        """`swap`'s codes of `module`'s weight: made once per tie (None where the format
        `keeps_weight`)."""
        if self.keeps_weight:
            return None
        key = (tie, self.name, config, storage)
        if key not in memo:
            memo[key] = self.quantize_weight(module.weight, config, f"{path}.weight", storage)
        return memo[key]

    def quantize_weight(
        self, weight: torch.Tensor, config: Any, name: str, storage: torch.dtype
    ) -> Any:
        """The codes of the float `weight` (`name` in messages), scales kept in `storage`,
        that `build` takes: for a format whose layers hold codes, not the weight."""
        raise NotImplementedError(f"format {self.name!r} makes no codes of a weight")

    def build(self, module: nn.Module, config: Any, codes: Any) -> nn.Module:
        """The quantized layer for the float `module`, from `codes` (`quantize_weight`'s,
        shared by tied modules; None for a format that `keeps_weight`)."""
        raise NotImplementedError(f"format {self.name!r} has no layer to swap in")

    def to_float(self, layer: nn.Module, memo: dict[int, Any]) -> nn.Module:
        """The float layer standing for `layer`, one of this format's (`quantize.dequantize`
        swaps it in). `memo` lives for one dequantization, so that layers sharing a quantized
        weight get one float weight back. The default asks the layer (its ``to_float()``),
        for a layer that keeps its float parameters."""
        to_float = getattr(layer, "to_float", None)
        if not callable(to_float):
            raise TypeError(
                f"format {self.name!r} gives no float layer back for {type(layer).__name__}: "
                "give the layer a to_float() method or override Format.to_float"
            )
        return to_float()

    def step_layers(self, model: nn.Module) -> list[nn.Module]:
        """The layers of `model` that need this format's `before_step` work (none by
        default). Asked once, when a model is set up (`Precision.setup`), so that a step
        walks no modules."""
        return []

    def before_step(self, layers: Sequence[nn.Module], group: Any) -> None:
        """The work `layers` (from `step_layers`) need once per optimizer step, after its
        backward passes and before it, among the processes of `group` (a torch.distributed
        process group; None: the default one, if any). The default does nothing."""

    def layer_config(self, layer: nn.Module) -> Any:
        """The config a layer already quantized in this format was built with (None: no
        options to compare)."""
        return None

    def weight_bytes(self, config: Any, module: nn.Module, storage: torch.dtype) -> int:
        """Bytes the quantized layer holds for `module`'s weight (codes, scales, zero
        points; the float weight itself for a format that `keeps_weight`), its bias left
        out, with scales in `storage`."""
        return module.weight.numel() * storage.itemsize

    def rate(self, info: DeviceInfo) -> Support | None:
        """How well `info`'s device runs the format's matmuls (None: as well as its
        dtypes, with nothing of its own to say)."""
        return None

    def rate_policy(
        self, info: DeviceInfo, config: Any, compute_dtype: torch.dtype
    ) -> Support | None:
        """`rate` for one configuration of the format under a policy computing in
        ``compute_dtype``; a format whose kernels depend on them overrides it."""
        return self.rate(info)

    def __repr__(self) -> str:
        return f"<format {self.name}>"


# every registered format by name, in the order registered (the builtin ones first)
_FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    """Add `fmt` to the registry (its name must be free) and return it."""
    if not isinstance(fmt, Format):
        raise TypeError(f"register takes a Format instance, not {type(fmt).__name__}")
    name = fmt.name
    if not isinstance(name, str):
        raise TypeError(
            f"a format's name is a string, the mode as policy names spell it ('int8'), got "
            f"{type(name).__name__} {name!r} from {type(fmt).__name__}.name"
        )
    if (
        not name
        or name != name.lower()
        or any(c.isspace() for c in name)
        or "/" in name
        or "_from_" in name
    ):
        raise ValueError(
            f"a format name is lower case, without blanks, '/' or '_from_', got {name!r}"
        )
    if name in _FORMATS:
        raise ValueError(f"a format named {name!r} is registered already")
    _FORMATS[name] = fmt
    return fmt


def unregister(name: str) -> Format:
    """Remove the format `name` from the registry and return it."""
    if name not in _FORMATS:
        raise KeyError(f"no format named {name!r} is registered")
    return _FORMATS.pop(name)


def formats() -> tuple[Format, ...]:
    """The registered formats, in the order they were registered."""
    return tuple(_FORMATS.values())


def format_named(name: str) -> Format | None:
    """The registered format called `name`, or None."""
    return _FORMATS.get(name)


# what a model set up needs before each optimizer step: each format with such work, and its
# layers in that model
StepWork = tuple[tuple[Format, tuple[nn.Module, ...]], ...]


def step_work(model: nn.Module) -> StepWork:
    """The registered formats whose layers in `model` need work before each optimizer step,
    each with those layers (`Format.step_layers`); empty for most models."""
    found = ((fmt, tuple(fmt.step_layers(model))) for fmt in _FORMATS.values())
    return tuple((fmt, layers) for fmt, layers in found if layers)


def before_step(work: StepWork, group: Any = None) -> None:
    """Run the per-step work `step_work` found (`Format.before_step`), among the processes
    of `group` (None: the default group, if any)."""
    for fmt, layers in work:
        fmt.before_step(layers, group)


def whole_number(value: object, least: int) -> bool:
    """Whether `value` is an int (a bool is not a number here) of at least `least`: the
    check behind a format's count options."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def agree(what: str, spelled: Any, given: Any, name: str) -> Any:
    """An option spelled in the name and given as a keyword: the one given (they must be
    equal when both are)."""
    if spelled is not None and given is not None and spelled != given:
        raise PolicySpecError(f"{name!r} says {what} {spelled!r} but {given!r} was passed")
    return given if given is not None else spelled
