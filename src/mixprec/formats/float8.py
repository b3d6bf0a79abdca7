"""Float8 recipe facts, written once: the recipe names, the default amax history length,
the size rule and the validators, in one frozen value (as torchao's ``Float8LinearConfig``).

The policy grammar reads them to parse ``"float8/<recipe>[:<history>]_from_..."`` and the
float8 layers (`mixprec.quantize.float8`) to build and skip layers, so a quantized policy and
a ``convert_to_float8`` call accept the same recipes and skip the same layers for size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mixprec.errors import PolicySpecError
from mixprec.formats.registry import whole_number

__all__ = ["Float8Config"]


@dataclass(frozen=True)
class Float8Config:
    """How a float8 Linear scales its tensors: the `recipe` and, for ``"delayed"``, how many
    steps of abs-max its scales look back over (`amax_history_length`; the other recipes
    ignore it).

    `RECIPES` names them; `mixprec.quantize.float8` says how each scales and computes.

    >>> Float8Config("delayed", 16).amax_history_length
    16
    """

    RECIPES: ClassVar[tuple[str, ...]] = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed")
    DEFAULT_RECIPE: ClassVar[str] = "tensorwise"
    ROWWISE_RECIPES: ClassVar[tuple[str, ...]] = ("rowwise", "rowwise_with_gw_hp")
    # Keras's float8 policy and Transformer Engine's DelayedScaling both keep 1024 steps
    DEFAULT_AMAX_HISTORY_LENGTH: ClassVar[int] = 1024
    # torchao's rule: below this size a tensorwise/delayed float8 matmul does not win back
    # its casts; and float8 matmuls (`torch._scaled_mm`) need dims that are multiples of 16
    SMALL_IN_FEATURES: ClassVar[int] = 4096
    SMALL_OUT_FEATURES: ClassVar[int] = 1024
    ALIGNMENT: ClassVar[int] = 16

    recipe: str = DEFAULT_RECIPE
    amax_history_length: int = DEFAULT_AMAX_HISTORY_LENGTH

    def __post_init__(self) -> None:
        self.check_recipe(self.recipe)
        self.check_history_length(self.amax_history_length)

    @classmethod
    def check_recipe(cls, recipe: Any) -> str:
        """The recipe name, or PolicySpecError listing the accepted ones."""
        if not isinstance(recipe, str) or recipe not in cls.RECIPES:
            raise PolicySpecError(
                f"unknown float8 recipe {recipe!r}; accepted: "
                f"{', '.join(repr(r) for r in cls.RECIPES)}"
            )
        return recipe

    @classmethod
    def check_history_length(cls, length: Any) -> int:
        """A positive int amax history length, or PolicySpecError."""
        if not whole_number(length, 1):
            raise PolicySpecError(
                f"amax_history_length must be a positive int (Keras's default is "
                f"{cls.DEFAULT_AMAX_HISTORY_LENGTH}), got {length!r}"
            )
        return length

    @property
    def rowwise(self) -> bool:
        """Per-row scales (``"rowwise"``, ``"rowwise_with_gw_hp"``)."""
        return self.recipe in self.ROWWISE_RECIPES

    @property
    def delayed(self) -> bool:
        """Scales from an amax history (``"delayed"``), kept in buffers that checkpoint."""
        return self.recipe == "delayed"

    def shape_reason(self, in_features: int, out_features: int) -> str | None:
        """Why a Linear of this shape cannot run a real float8 matmul (None: it can)."""
        if in_features % self.ALIGNMENT or out_features % self.ALIGNMENT:
            return (
                f"in_features={in_features}, out_features={out_features} (float8 matmuls "
                f"need both to be multiples of {self.ALIGNMENT})"
            )
        return None

    def gain_reason(self, in_features: int, out_features: int) -> str | None:
        """Why a Linear of this shape is too small for this recipe to gain from float8
        (torchao's rule; rowwise recipes always gain), or None."""
        if self.rowwise or not (
            in_features <= self.SMALL_IN_FEATURES and out_features <= self.SMALL_OUT_FEATURES
        ):
            return None
        return (
            f"too small to gain: in_features={in_features} <= {self.SMALL_IN_FEATURES} and "
            f"out_features={out_features} <= {self.SMALL_OUT_FEATURES} (torchao's rule for "
            f"{self.recipe})"
        )
