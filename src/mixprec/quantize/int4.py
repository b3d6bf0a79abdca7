"""int4 weight-only quantization (W4A16), as Keras's int4 mode with groups.

Each output channel's input features are cut into groups (default 128; -1: one group per
channel; a short last group is padded with zeros). A group gets an asymmetric 4-bit grid
spanning ``[min(w, 0), max(w, 0)]``: ``scale = (hi - lo) / 15``, ``zero = round(-lo / scale)``,
``q = clamp(round(w / scale) + zero, 0, 15)``, ``w ~= (q - zero) * scale``, so zero is exact
and ``|w - dequantized| <= scale / 2``. Values are packed two per byte (low nibble first).
The weight is dequantized to the compute dtype before each matmul.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.quantize.int8 import check_finite, check_input, output_dtype, storable_scale
from mixprec.quantize.lora import LoraEmbeddingMixin, LoraMixin

__all__ = [
    "Int4Embedding",
    "Int4Linear",
    "QMAX",
    "dequantize_groups",
    "groups_of",
    "pack",
    "quantize_groups",
    "unpack",
]

QMAX = 15


def groups_of(features: int, group_size: int) -> tuple[int, int]:
    """(number of groups, features per group) for a row of `features` values: a group never
    exceeds the row."""
    size = features if group_size == -1 else min(group_size, features)
    return math.ceil(features / size), size


def pack(q: Tensor) -> Tensor:
    """uint8 values in [0, 15] along the last dim, two per byte (an odd count gets a zero)."""
    if q.shape[-1] % 2:
        q = F.pad(q, (0, 1))
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack(packed: Tensor, count: int) -> Tensor:
    """Inverse of `pack`: the first `count` 4-bit values along the last dim, as uint8."""
    out = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return out.flatten(-2)[..., :count]


def quantize_groups(
    w: Tensor, group_size: int, name: str = "the weight", dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(packed, scale, zero)`` of a 2-D weight: packed uint8 [rows, ceil(padded / 2)],
    float32 scale (holding values of `dtype`, the scales' storage dtype, by default `w`'s:
    see `storable_scale`) and uint8 zero point per [rows, groups]. A weight holding inf or
    NaN is refused (`check_finite`; `name` says which in the error)."""
    check_finite(w, name)
    rows, features = w.shape
    n, size = groups_of(features, group_size)
    w32 = F.pad(w.detach().to(torch.float32), (0, n * size - features)).view(rows, n, size)
    lo = w32.amin(dim=-1).clamp(max=0)
    hi = w32.amax(dim=-1).clamp(min=0)
    scale = (hi - lo) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = storable_scale(scale, w.dtype if dtype is None else dtype, name)
    zero = torch.round(-lo / scale).clamp_(0, QMAX)
    q = (torch.round(w32 / scale[..., None]) + zero[..., None]).clamp_(0, QMAX)
    return pack(q.to(torch.uint8).view(rows, n * size)), scale, zero.to(torch.uint8)


def dequantize_groups(
    packed: Tensor, scale: Tensor, zero: Tensor, features: int, group_size: int
) -> Tensor:
    """The float weight (in `scale`'s dtype) of `quantize_groups`' output; works on any
    leading dims (a gather of rows)."""
    n, size = groups_of(features, group_size)
    q = unpack(packed, n * size).view(*packed.shape[:-1], n, size)
    w = (q.to(scale.dtype) - zero.to(scale.dtype)[..., None]) * scale[..., None]
    return w.flatten(-2)[..., :features]


class _Int4Weight(nn.Module):
    """Buffers and (de)quantization shared by the int4 Linear and Embedding."""

    quantization_mode = "int4"

    def _init_weight(self, rows: int, features: int, group_size: int) -> None:
        self.group_size, self.features = group_size, features
        n, size = groups_of(features, group_size)
        packed = torch.zeros(rows, math.ceil(n * size / 2), dtype=torch.uint8)
        self.register_buffer("qweight", packed)
        self.register_buffer("weight_scale", torch.ones(rows, n))
        self.register_buffer("weight_zero", torch.zeros(rows, n, dtype=torch.uint8))

    def _take(self, quantized: tuple[Tensor, ...], dtype: torch.dtype) -> None:
        packed, scale, zero = quantized
        self.qweight, self.weight_scale, self.weight_zero = packed, scale.to(dtype), zero

    def requantize(self, weight: Tensor) -> None:
        """Replace the int4 weight by the quantization of the float `weight`."""
        dtype = self.weight_scale.dtype
        self._take(quantize_groups(weight, self.group_size, dtype=dtype), dtype)

    def dequantized_weight(self) -> Tensor:
        """The float weight the int4 values stand for, in the scales' dtype."""
        return dequantize_groups(
            self.qweight, self.weight_scale, self.weight_zero, self.features, self.group_size
        )


class Int4Linear(LoraMixin, _Int4Weight):
    """A Linear with grouped int4 weights, dequantized before each matmul; the bias trains."""

    float_type = nn.Linear

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, group_size: int = 128
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._init_weight(out_features, in_features, group_size)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._init_lora()

    @classmethod
    def from_float(
        cls, linear: nn.Linear, group_size: int, quantized: tuple[Tensor, ...] | None = None
    ) -> Int4Linear:
        """Quantize `linear` (or take ``(packed, scale, zero)`` already made from its weight,
        so tied weights share one int4 copy)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size)
        layer._take(quantized or quantize_groups(linear.weight, group_size), linear.weight.dtype)
        layer.bias = linear.bias  # the same Parameter: an optimizer holding it keeps working
        return layer.to(linear.weight.device)

    def forward(self, x: Tensor) -> Tensor:
        check_input(self, x)
        # in the compute dtype (autocast's, else the input's): outside autocast a float32
        # weight would meet a 16-bit input (FSDP2 casts inputs, not these buffers)
        dtype = output_dtype(x)
        bias = None if self.bias is None else self.bias.to(dtype)
        return self.add_lora(x, F.linear(x, self.dequantized_weight().to(dtype), bias))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, group_size={self.group_size}{self.lora_repr()}"
        )


class Int4Embedding(LoraEmbeddingMixin, _Int4Weight):
    """An Embedding with grouped int4 rows; only the rows looked up are dequantized."""

    float_type = nn.Embedding

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        group_size: int = 128,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self._init_weight(num_embeddings, embedding_dim, group_size)
        self._init_lora()

    @classmethod
    def from_float(
        cls, embedding: nn.Embedding, group_size: int, quantized: tuple[Tensor, ...] | None = None
    ) -> Int4Embedding:
        """Quantize `embedding` (or take ``(packed, scale, zero)`` of its weight)."""
        layer = cls(
            embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx, group_size
        )
        layer._take(
            quantized or quantize_groups(embedding.weight, group_size), embedding.weight.dtype
        )
        return layer.to(embedding.weight.device)

    def forward(self, idx: Tensor) -> Tensor:
        # F.embedding, not indexing: an id outside [0, num_embeddings) raises IndexError as
        # nn.Embedding's does (indexing took -1 as the last row), and only integer ids pass
        rows = dequantize_groups(
            F.embedding(idx, self.qweight),
            F.embedding(idx, self.weight_scale),
            F.embedding(idx, self.weight_zero),
            self.embedding_dim,
            self.group_size,
        )
        return self.add_lora(idx, rows)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, "
            f"group_size={self.group_size}{self.lora_repr()}"
        )
