"""Microscaling (block-scaled) format facts, written once: the modes, their element formats,
block sizes, scale roundings and recipe options, in one frozen value.

The policy grammar reads it to parse ``"mxfp8/floor_from_bf16-mixed"`` or
``"nvfp4/2d:rht:sr_from_bf16-mixed"`` and the layers (`mixprec.quantize.microscaling`) to
build and skip layers, so a policy name and a ``quantize(model, "mxfp8")`` call accept the
same options and skip the same layers.

- ``mxfp8`` / ``mxfp6`` / ``mxfp4``: OCP Microscaling v1.0. Blocks of 32 elements (along the
  matmul's reduced dimension) share one E8M0 power-of-two scale. Elements: mxfp8 E4M3 (the
  default) or E5M2, mxfp6 E2M3 (default) or E3M2, mxfp4 E2M1. The scale exponent is
  ``floor(log2(amax)) - emax(element)`` in the spec ("floor"), which can push a block's
  largest values past the element's max (they saturate), or the smallest exponent that
  keeps amax representable, ``ceil(log2(amax / max(element)))`` ("rceil"), the rounding of
  NVIDIA's MXFP8 pretraining recipe (Mishra et al. 2025: the spec's rounding diverged on an
  8B model, rounding up matched bf16 over 15T tokens). "rceil" is the default here.
- ``nvfp4``: NVIDIA's NVFP4. E2M1 elements in blocks of 16 sharing an FP8 E4M3 scale, and one
  float32 scale per tensor from its amax. Recipe options of NVIDIA's NVFP4 pretraining
  (arXiv 2509.25149), all off by default: ``2d`` (weights in 16x16 blocks, so the forward and
  the backward see one quantized weight), ``rht`` (a random 16x16 Hadamard transform of the
  weight-gradient GEMM's inputs along the tokens), ``sr`` (stochastic rounding of the output
  gradient); and ``fwd-rht`` (the transform of the forward GEMM's inputs along the features,
  exact in real arithmetic since the transform is orthogonal, for inference studies;
  refused with ``2d``, whose one quantized weight the forward would not use).
  The paper's training recipe is ``"nvfp4/2d:rht:sr"``.

Options follow the mode after a ``/``, separated by ``:``, in any order: an element name, a
scale rounding, a block size (ASCII digits, MX modes only) and the NVFP4 flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mixprec.errors import PolicySpecError
from mixprec.formats.registry import whole_number

__all__ = ["MicroscalingConfig"]


@dataclass(frozen=True)
class MicroscalingConfig:
    """A block-scaled format and its recipe options (see the module docstring).

    Fields left None take the mode's defaults when built, so two configs meaning the same
    format compare equal.

    >>> MicroscalingConfig.parse("mxfp8", "floor:64").spelled()
    'mxfp8/floor:64'
    >>> MicroscalingConfig("nvfp4").block_size
    16
    """

    MODES: ClassVar[tuple[str, ...]] = ("mxfp8", "mxfp6", "mxfp4", "nvfp4")
    ELEMENTS: ClassVar[dict[str, tuple[str, ...]]] = {
        "mxfp8": ("e4m3", "e5m2"),
        "mxfp6": ("e2m3", "e3m2"),
        "mxfp4": ("e2m1",),
        "nvfp4": ("e2m1",),
    }
    ROUNDINGS: ClassVar[tuple[str, ...]] = ("rceil", "floor")
    DEFAULT_ROUNDING: ClassVar[str] = "rceil"
    MX_BLOCK_SIZE: ClassVar[int] = 32
    NVFP4_BLOCK_SIZE: ClassVar[int] = 16
    FLAGS: ClassVar[tuple[str, ...]] = ("2d", "rht", "fwd-rht", "sr")

    mode: str
    element: str | None = None
    rounding: str | None = None
    block_size: int | None = None
    two_d: bool = False
    rht: bool = False
    forward_rht: bool = False
    stochastic_gradients: bool = False

    def __post_init__(self) -> None:
        mode = self.mode
        if mode not in self.MODES:
            raise PolicySpecError(
                f"unknown microscaling mode {mode!r}; accepted: {', '.join(self.MODES)}"
            )
        elements = self.ELEMENTS[mode]
        element = elements[0] if self.element is None else self.element
        if element not in elements:
            raise PolicySpecError(f"{mode} elements are {' or '.join(elements)}, not {element!r}")
        nvfp4 = mode == "nvfp4"
        if nvfp4 and self.rounding is not None:
            raise PolicySpecError(
                f"nvfp4 block scales are E4M3 values rounded to nearest; the scale rounding "
                f"{self.rounding!r} belongs to the MX modes ({', '.join(self.MODES[:3])})"
            )
        rounding = None if nvfp4 else (self.rounding or self.DEFAULT_ROUNDING)
        if rounding is not None and rounding not in self.ROUNDINGS:
            raise PolicySpecError(
                f"unknown scale rounding {rounding!r}; accepted: 'rceil' (round the scale up "
                "so the block's amax fits, the training recipes' choice and the default) or "
                "'floor' (the OCP MX v1.0 spec's)"
            )
        if nvfp4 and self.block_size not in (None, self.NVFP4_BLOCK_SIZE):
            raise PolicySpecError(
                f"nvfp4 blocks are {self.NVFP4_BLOCK_SIZE} elements by definition, not "
                f"{self.block_size!r}"
            )
        size = self.block_size
        if size is None:
            size = self.NVFP4_BLOCK_SIZE if nvfp4 else self.MX_BLOCK_SIZE
        self.check_block_size(size)
        flags = (self.two_d, self.rht, self.forward_rht, self.stochastic_gradients)
        if not nvfp4 and any(flags):
            raise PolicySpecError(
                f"the options {', '.join(self.FLAGS)} are nvfp4's recipe options, not {mode}'s"
            )
        if self.two_d and self.forward_rht:
            raise PolicySpecError(
                "nvfp4 options '2d' and 'fwd-rht' do not combine: '2d' quantizes the weight "
                "once, in 16x16 tiles, for the forward and the backward to share, while "
                "'fwd-rht' quantizes a Hadamard-transformed weight for the forward alone; use "
                "'nvfp4/2d' or 'nvfp4/fwd-rht'"
            )
        object.__setattr__(self, "element", element)
        object.__setattr__(self, "rounding", rounding)
        object.__setattr__(self, "block_size", size)

    @staticmethod
    def check_block_size(size: object) -> int:
        """`size` if it is an MX block size (an int >= 2; bools are not sizes), else
        PolicySpecError saying so."""
        if not whole_number(size, 2):
            raise PolicySpecError(
                f"block size must be an int >= 2 (32 by the spec; the last dim must be a "
                f"multiple of it), got {size!r} ({type(size).__name__})"
            )
        return size

    @classmethod
    def accepted(cls) -> str:
        """What the options of a microscaling mode may be, for error messages."""
        return (
            "microscaling modes: 'mxfp8', 'mxfp6', 'mxfp4' (options after '/', ':'-separated: "
            "the element 'e4m3'/'e5m2' (mxfp8), 'e2m3'/'e3m2' (mxfp6); the scale rounding "
            "'rceil' (default) or 'floor'; a block size, 32 by default), and 'nvfp4' (options "
            "'2d', 'rht', 'fwd-rht', 'sr'), e.g. 'mxfp8/floor_from_bf16-mixed', "
            "'nvfp4/2d:rht:sr_from_bf16-mixed'"
        )

    @classmethod
    def parse(cls, mode: str, options: str | None, name: str = "") -> MicroscalingConfig:
        """The config a mode and its ``:``-separated option text spell (None: no options; ""
        is refused as a '/' with nothing after it); PolicySpecError naming the option and
        what is accepted otherwise. Block sizes are written in ASCII digits."""
        where = f" in {name!r}" if name else ""
        found: dict[str, Any] = {}

        def put(key: str, value: Any, token: str) -> None:
            if key in found:
                raise PolicySpecError(
                    f"{key.replace('_', ' ')} given twice{where} ({token!r}). " + cls.accepted()
                )
            found[key] = value

        flag_fields = dict(
            zip(cls.FLAGS, ("two_d", "rht", "forward_rht", "stochastic_gradients"), strict=True)
        )
        if options == "":
            raise PolicySpecError(
                f"nothing after '/'{where}: leave out the '/' for the defaults ({mode!r}) or "
                "name options after it. " + cls.accepted()
            )
        for token in options.split(":") if options is not None else ():
            if not token:
                raise PolicySpecError(
                    f"empty {mode} option in {options!r}{where}: options are separated by "
                    "single ':'s, none before the first or after the last. " + cls.accepted()
                )
            if token in cls.ROUNDINGS:
                put("rounding", token, token)
            elif token in flag_fields:
                put(flag_fields[token], True, token)
            elif any(token in e for e in cls.ELEMENTS.values()):
                put("element", token, token)
            elif token.isascii() and token.isdigit():
                put("block_size", int(token), token)
            elif token.isdigit():  # '３２' or '²': int() reads some of them
                raise PolicySpecError(
                    f"block size {token!r}{where} is not written in ASCII digits 0-9. "
                    + cls.accepted()
                )
            else:
                raise PolicySpecError(f"unknown {mode} option {token!r}{where}. " + cls.accepted())
        try:
            return cls(mode, **found)
        except PolicySpecError as err:
            raise PolicySpecError(f"{err}{where}") from None

    def spelled(self) -> str:
        """The mode and the options that differ from its defaults, as a policy name spells
        them ("mxfp8", "mxfp8/floor", "nvfp4/2d:rht:sr")."""
        tokens = []
        if self.element != self.ELEMENTS[self.mode][0]:
            tokens.append(self.element)
        if self.rounding is not None and self.rounding != self.DEFAULT_ROUNDING:
            tokens.append(self.rounding)
        if self.mode != "nvfp4" and self.block_size != self.MX_BLOCK_SIZE:
            tokens.append(str(self.block_size))
        for flag, on in zip(self.FLAGS, self._flags(), strict=True):
            if on:
                tokens.append(flag)
        return self.mode + ("/" + ":".join(tokens) if tokens else "")

    def _flags(self) -> tuple[bool, bool, bool, bool]:
        return (self.two_d, self.rht, self.forward_rht, self.stochastic_gradients)

    def describe(self) -> str:
        """The format in words: "mxfp8 (e4m3, blocks of 32, rceil scales)"."""
        if self.mode == "nvfp4":
            flags = [f for f, on in zip(self.FLAGS, self._flags(), strict=True) if on]
            extra = f", {', '.join(flags)}" if flags else ""
            return f"nvfp4 (e2m1, blocks of 16, e4m3 scales{extra})"
        return f"{self.mode} ({self.element}, blocks of {self.block_size}, {self.rounding} scales)"

    def shape_reason(self, in_features: int, out_features: int) -> str | None:
        """Why a Linear of this shape cannot be quantized in blocks (None: it can): its
        features (and, with 2D weight blocks or NVFP4's backward, its outputs) must fill
        whole blocks."""
        b = self.block_size
        if in_features % b:
            return f"in_features={in_features} is not a multiple of the block size {b}"
        if out_features % b:
            return (
                f"out_features={out_features} is not a multiple of the block size {b} (the "
                "input gradient's matmul reduces over the outputs, in blocks too)"
            )
        return None
