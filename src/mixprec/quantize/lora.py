"""LoRA adapters on quantized Linear layers: ``y = quantized(x) + B(A(x)) * alpha / rank``.

The quantized weight stays frozen (it is a buffer); A (Kaiming-uniform) and B (zeros, so an
enabled adapter changes nothing until it trains) are float parameters in the dtype of the
layer's scales. `merge` folds ``B @ A * alpha / rank`` into the weight and quantizes again.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LoraMixin:
    """Adapters for a quantized Linear that has ``dequantized_weight()``, ``requantize(w)``,
    ``weight_scale``, ``bias``, ``in_features`` and ``out_features``."""

    lora_rank: int = 0
    lora_alpha: float = 0.0

    def _init_lora(self) -> None:
        self.register_parameter("lora_A", None)  # type: ignore[attr-defined]
        self.register_parameter("lora_B", None)  # type: ignore[attr-defined]

    def enable_lora(self, rank: int, alpha: float | None = None) -> list[nn.Parameter]:
        """Add trainable adapters of `rank` (alpha defaults to rank: scale 1) and freeze
        the bias, so the adapters are this layer's only trainable tensors; returns them."""
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRA rank must be a positive int, got {rank!r}")
        if self.lora_rank:
            raise ValueError(
                f"LoRA is already enabled (rank {self.lora_rank}) on this layer; merge_lora first"
            )
        scale = self.weight_scale  # type: ignore[attr-defined]
        a = torch.empty(rank, self.in_features, dtype=scale.dtype, device=scale.device)  # type: ignore[attr-defined]
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        b = torch.zeros(self.out_features, rank, dtype=scale.dtype, device=scale.device)  # type: ignore[attr-defined]
        self.lora_A, self.lora_B = nn.Parameter(a), nn.Parameter(b)
        self.lora_rank, self.lora_alpha = rank, float(rank if alpha is None else alpha)
        if self.bias is not None:  # type: ignore[attr-defined]
            self.bias.requires_grad_(False)  # type: ignore[attr-defined]
        return [self.lora_A, self.lora_B]

    def add_lora(self, x: Tensor, out: Tensor) -> Tensor:
        """`out` plus the adapters' contribution for input `x` (`out` as is without them)."""
        if not self.lora_rank:
            return out
        delta = F.linear(F.linear(x, self.lora_A), self.lora_B)
        return out + (delta * (self.lora_alpha / self.lora_rank)).to(out.dtype)

    def merge_lora(self) -> None:
        """Fold the adapters into the weight, quantize it again and drop them; the bias
        trains again."""
        if not self.lora_rank:
            raise ValueError("LoRA is not enabled on this layer; nothing to merge")
        with torch.no_grad():
            delta = (self.lora_B.float() @ self.lora_A.float()) * (self.lora_alpha / self.lora_rank)
            self.requantize(self.dequantized_weight().float() + delta)  # type: ignore[attr-defined]
        self.lora_A = self.lora_B = None
        self.lora_rank, self.lora_alpha = 0, 0.0
        if self.bias is not None:  # type: ignore[attr-defined]
            self.bias.requires_grad_(True)  # type: ignore[attr-defined]

    def lora_repr(self) -> str:
        return f", lora_rank={self.lora_rank}" if self.lora_rank else ""
