"""LoRA adapters on quantized layers: ``y = quantized(x) + B(A(x)) * alpha / rank``.

The quantized weight stays frozen (it is a buffer); A and B are float parameters in the dtype
of the layer's scales, one of them zeros so an enabled adapter changes nothing until it
trains. Linear: A Kaiming-uniform, B zeros. Embedding (as peft): A (rank, num_embeddings)
zeros, B (embedding_dim, rank) normal, and A's row lookup is ``F.embedding(idx, A.T)``.
`merge_lora` folds the weight-shaped ``lora_delta()`` into the weight (exactly: codes times
scales in float32, not rounded to 16-bit scales first) and quantizes again.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__: list[str] = []


class LoraMixin:
    """Adapters for a quantized Linear that has ``float32_weight()``, ``requantize(w)``,
    ``weight_scale``, ``bias``, ``in_features`` and ``out_features``."""

    lora_rank: int = 0
    lora_alpha: float = 0.0

    def _lora_init(self, rank: int) -> tuple[Tensor, Tensor]:
        """Initial A (rank, in) and B (out, rank)."""
        scale = self.weight_scale  # type: ignore[attr-defined]
        a = torch.empty(rank, self.in_features, dtype=scale.dtype, device=scale.device)  # type: ignore[attr-defined]
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        b = torch.zeros(self.out_features, rank, dtype=scale.dtype, device=scale.device)  # type: ignore[attr-defined]
        return a, b

    def _lora_down(self, x: Tensor) -> Tensor:
        """A applied to the layer's input, cast to A's dtype as peft does (outside autocast
        a bfloat16 or float64 input met float32 adapters and F.linear refused the mix)."""
        return F.linear(x.to(self.lora_A.dtype), self.lora_A)

    def lora_delta(self) -> Tensor:
        """The adapters as a float32 change of the weight (its shape)."""
        return (self.lora_B.float() @ self.lora_A.float()) * (self.lora_alpha / self.lora_rank)

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
        a, b = self._lora_init(rank)
        self.lora_A, self.lora_B = nn.Parameter(a), nn.Parameter(b)
        self.lora_rank, self.lora_alpha = rank, float(rank if alpha is None else alpha)
        if getattr(self, "bias", None) is not None:
            self._bias_requires_grad = self.bias.requires_grad  # type: ignore[attr-defined]
            self.bias.requires_grad_(False)  # type: ignore[attr-defined]
        return [self.lora_A, self.lora_B]

    def add_lora(self, x: Tensor, out: Tensor) -> Tensor:
        """`out` plus the adapters' contribution for input `x` (`out` as is without them)."""
        if not self.lora_rank:
            return out
        delta = F.linear(self._lora_down(x), self.lora_B)
        return out + (delta * (self.lora_alpha / self.lora_rank)).to(out.dtype)

    def merge_lora(self) -> None:
        """Fold the adapters into the weight, quantize it again and drop them; the bias gets
        back the requires_grad it had before `enable_lora` (a frozen bias stays frozen)."""
        if not self.lora_rank:
            raise ValueError("LoRA is not enabled on this layer; nothing to merge")
        with torch.no_grad():
            # the weight exactly (not rounded to 16-bit scales' dtype, off the codes' grid)
            weight = self.float32_weight()  # type: ignore[attr-defined]
            self.requantize(weight + self.lora_delta())  # type: ignore[attr-defined]
        self.lora_A = self.lora_B = None
        self.lora_rank, self.lora_alpha = 0, 0.0
        if getattr(self, "bias", None) is not None:
            self.bias.requires_grad_(self._bias_requires_grad)  # type: ignore[attr-defined]

    def lora_repr(self) -> str:
        return f", lora_rank={self.lora_rank}" if self.lora_rank else ""


class LoraEmbeddingMixin(LoraMixin):
    """Adapters for a quantized Embedding (``num_embeddings``, ``embedding_dim``,
    ``padding_idx`` instead of Linear's sizes; no bias). The padding row's A column starts
    at zero and gets no gradient, so the padding row stays what the quantized table says."""

    def _lora_init(self, rank: int) -> tuple[Tensor, Tensor]:
        scale = self.weight_scale  # type: ignore[attr-defined]
        a = torch.zeros(rank, self.num_embeddings, dtype=scale.dtype, device=scale.device)  # type: ignore[attr-defined]
        b = torch.randn(self.embedding_dim, rank, dtype=scale.dtype, device=scale.device)  # type: ignore[attr-defined]
        return a, b

    def _lora_down(self, x: Tensor) -> Tensor:
        return F.embedding(x, self.lora_A.t(), self.padding_idx)  # type: ignore[attr-defined]

    def lora_delta(self) -> Tensor:
        return super().lora_delta().t()
