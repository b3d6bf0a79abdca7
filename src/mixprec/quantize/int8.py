"""int8 weights with dynamic int8 activations (W8A8), as Keras's int8 mode.

Weights: one scale per output channel (per row), abs-max, ``q = round(w / scale)`` in
[-127, 127] with ``scale = max|w_row| / 127``; Keras stores the reciprocal ``127 / max|w|``,
the values are the same. Activations: one scale per token (row of the flattened input),
computed from the tensor at run time. The matmul runs on int8 x int8 -> int32
(`torch._int_mm`) and the int32 sums are dequantized with both scales; a reduction longer
than `ACC_MAX_K` (133144 features), whose int32 sums could overflow, runs in chunks added in
int64.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.quantize.lora import LoraEmbeddingMixin, LoraMixin

__all__ = [
    "ACC_MAX_K",
    "Int8Embedding",
    "Int8Linear",
    "QMAX",
    "check_finite",
    "check_input",
    "int8_linear",
    "int_matmul",
    "output_dtype",
    "quantize_rows",
    "quantize_tokens",
    "storable_scale",
]

QMAX = 127


def check_finite(w: Tensor, name: str) -> None:
    """Raise ValueError if the weight `w` holds an inf or NaN: quantizing would turn it into
    finite codes (a NaN row's scale used to become 1 and its values 0), hiding it for good.
    A meta tensor has no values to check (its layout can be quantized, then loaded)."""
    if w.is_meta:
        return
    bad = ~torch.isfinite(w.detach())
    if bad.any():
        rows = bad.reshape(bad.shape[0], -1).any(dim=-1).nonzero().flatten().tolist()
        shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
        raise ValueError(
            f"cannot quantize {name}: it holds {int(bad.sum())} inf/NaN value(s), in rows "
            f"{shown}. Quantized codes are finite, so they would silently stand for a "
            "broken weight; quantize finite weights (a diverged or corrupt checkpoint?)"
        )


def storable_scale(scale: Tensor, dtype: torch.dtype, name: str) -> Tensor:
    """The float32 `scale` rounded up to a value `dtype` holds exactly (unchanged for float32
    and float64), so codes computed with it are the codes of the scale the layer stores.

    Scales are stored in the weight's dtype. Rounded to nearest, a float16 scale below 3e-8
    became 0 (a row of tiny weights came back as zeros) and a bfloat16 one up to 0.2% off;
    rounded up, codes stay in range and within half a stored step of the weight. A scale
    beyond `dtype`'s range is refused, naming the weight `name`."""
    if torch.finfo(dtype).bits >= 32:
        return scale
    stored = scale.to(dtype)
    up = torch.nextafter(stored, torch.full_like(stored, torch.inf))
    stored = torch.where(stored.float() < scale, up, stored)
    if not scale.is_meta and torch.isinf(stored).any():
        raise ValueError(
            f"cannot quantize {name}: its largest scale {scale.max().item():.3g} exceeds "
            f"{dtype}'s range; quantize it with scales in float32 or bfloat16"
        )
    return stored.float()


def _quantize_rows(
    x: Tensor, dtype: torch.dtype = torch.float32, name: str = "the tensor"
) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8 of a 2-D tensor, with scales `dtype` holds exactly (as float32;
    see `storable_scale`). A row holding an inf or NaN gets codes 0 and scale NaN, so
    whatever is computed from it comes out NaN."""
    x32 = x.detach().to(torch.float32)
    amax = x32.abs().amax(dim=-1, keepdim=True)  # NaN or inf for a non-finite row
    finite = torch.isfinite(amax)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    scale = storable_scale(torch.where(finite, scale, torch.nan), dtype, name)
    # only a NaN scale's row divides to NaN: its codes become 0, in place (activations pass
    # here on every forward)
    q = torch.round(x32 / scale).clamp_(-QMAX, QMAX).nan_to_num_(0.0).to(torch.int8)
    return q, scale.squeeze(-1)


def quantize_rows(
    w: Tensor, name: str = "the weight", dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8 of a weight: ``(q, scale)`` with ``w ~= q * scale[:, None]``,
    ``q`` in [-127, 127] and ``|w - q * scale| <= scale / 2``; an all-zero row gets scale 1.
    `scale` is float32 holding values of `dtype` (the scales' storage dtype, by default
    `w`'s). A weight holding inf or NaN is refused (`check_finite`; `name` says which in the
    error)."""
    check_finite(w, name)
    return _quantize_rows(w, w.dtype if dtype is None else dtype, name)


# The longest reduction whose int32 sums cannot overflow: each product of two codes is at
# most 127 * 127 in magnitude, so 133144 of them stay within 2**31 - 1.
ACC_MAX_K = (2**31 - 1) // (QMAX * QMAX)


def int_matmul(a: Tensor, b: Tensor, *, max_k: int = ACC_MAX_K) -> Tensor:
    """``a @ b.T`` for int8 ``a`` [M, K] and ``b`` [N, K] (codes in [-127, 127]), exactly.

    `torch._int_mm` on CPU (K > 1: with K == 1 it returns garbage) and on CUDA where it can
    run (M > 16, K and N multiples of 8); elsewhere the same sums in float64, which holds
    them exactly (each is at most 127 * 127 * K, far below 2**53). The result is int32
    [M, N] when ``K <= max_k``; a longer reduction would overflow the int32 accumulator
    (Linear(140000, n) at full scale summed to a negative number), so it is cut into chunks
    of at most `max_k` columns whose int32 sums are added in int64, and the result is
    int64. `max_k` is for tests.
    """
    m, k = a.shape
    n = b.shape[0]
    if k > max_k:
        acc = torch.zeros(m, n, dtype=torch.int64, device=a.device)
        for ac, bc in zip(a.split(max_k, dim=1), b.split(max_k, dim=1), strict=True):
            acc += int_matmul(ac, bc, max_k=max_k)
        return acc
    # torch 2.13's CPU _int_mm returns uninitialised memory for K == 1
    cpu = a.device.type == "cpu" and k > 1
    if cpu or (a.device.type == "cuda" and m > 16 and k % 8 == 0 and n % 8 == 0):
        return torch._int_mm(a, b.t())
    return (a.double() @ b.double().t()).to(torch.int32)


def quantize_tokens(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token (per-row of ``x`` flattened to 2-D) int8 quantization of activations; a token
    holding an inf or NaN gets scale NaN, so its output row is NaN (as a float Linear's would
    be non-finite), where loss scalers and NaN checks see it."""
    return _quantize_rows(x.reshape(-1, x.shape[-1]))


def int8_linear(x: Tensor, qweight: Tensor, weight_scale: Tensor) -> Tensor:
    """The int8 matmul of `Int8Linear` without bias, as float32 of shape (*x.shape[:-1], N):
    ``int_matmul(qx, qweight) * x_scale[:, None] * weight_scale[None, :]``."""
    qx, x_scale = quantize_tokens(x)
    acc = int_matmul(qx, qweight)
    out = acc.to(torch.float32) * x_scale[:, None] * weight_scale.to(torch.float32)[None, :]
    return out.reshape(*x.shape[:-1], qweight.shape[0])


class _Int8Matmul(torch.autograd.Function):
    """Forward: `int8_linear`. Backward: the input gets ``grad @ dequantized weight`` (the
    activation rounding passes gradients straight through); the int8 weight gets none."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, qweight: Tensor, weight_scale: Tensor) -> Tensor:
        ctx.save_for_backward(qweight, weight_scale)
        ctx.x_dtype = x.dtype
        return int8_linear(x, qweight, weight_scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        qweight, weight_scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        w = qweight.to(torch.float32) * weight_scale.to(torch.float32)[:, None]
        return (grad.to(torch.float32) @ w).to(ctx.x_dtype), None, None


def check_input(layer: nn.Module, x: Tensor) -> None:
    """Raise ValueError unless `x` is a floating tensor whose last dim is the quantized
    Linear `layer`'s in_features: an integer or bool input came out as integers, and a wrong
    width or a 0-d input failed deep inside the matmul."""
    if x.dim() == 0 or x.shape[-1] != layer.in_features or not x.is_floating_point():
        raise ValueError(
            f"{type(layer).__name__}({layer.in_features}, {layer.out_features}) needs a "
            f"floating input whose last dim is {layer.in_features}, got {x.dtype} of shape "
            f"{tuple(x.shape)}"
        )


def output_dtype(x: Tensor) -> torch.dtype:
    """What an nn.Linear would return here: the autocast dtype inside autocast, else x's."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class Int8Linear(LoraMixin, nn.Module):
    """A Linear with int8 weights (per output channel) and per-token int8 activations.

    The int8 weight and its scales are buffers (no gradient); the bias trains. Scales are
    floating buffers, so a policy stores them in its param dtype like any weight.
    """

    float_type = nn.Linear

    quantization_mode = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._init_lora()

    @classmethod
    def from_float(
        cls, linear: nn.Linear, quantized: tuple[Tensor, ...] | None = None
    ) -> Int8Linear:
        """Quantize `linear` (or take ``(qweight, weight_scale)`` already made from its
        weight, so tied weights share one int8 copy)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        q, scale = quantized if quantized is not None else quantize_rows(linear.weight)
        layer.qweight, layer.weight_scale = q, scale.to(linear.weight.dtype)
        layer.bias = linear.bias  # the same Parameter: an optimizer holding it keeps working
        return layer.to(linear.weight.device)

    def dequantized_weight(self) -> Tensor:
        """``qweight * weight_scale`` in the scales' dtype (LoRA adapters not included)."""
        return self.qweight.to(self.weight_scale.dtype) * self.weight_scale[:, None]

    def requantize(self, weight: Tensor) -> None:
        """Replace the int8 weight by the quantization of the float `weight`."""
        q, scale = quantize_rows(weight, dtype=self.weight_scale.dtype)
        self.qweight, self.weight_scale = q, scale.to(self.weight_scale.dtype)

    def forward(self, x: Tensor) -> Tensor:
        check_input(self, x)
        out = _Int8Matmul.apply(x, self.qweight, self.weight_scale)
        if self.bias is not None:
            out = out + self.bias.to(torch.float32)
        out = out.to(output_dtype(x))
        return self.add_lora(x, out)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}{self.lora_repr()}"
        )


class Int8Embedding(LoraEmbeddingMixin, nn.Module):
    """An Embedding with int8 rows (one scale per row): each lookup is dequantized."""

    float_type = nn.Embedding

    quantization_mode = "int8"

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        shape = (num_embeddings, embedding_dim)
        self.register_buffer("qweight", torch.zeros(shape, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(num_embeddings))
        self._init_lora()

    @classmethod
    def from_float(
        cls, embedding: nn.Embedding, quantized: tuple[Tensor, ...] | None = None
    ) -> Int8Embedding:
        """Quantize `embedding` (or take ``(qweight, weight_scale)`` of its weight)."""
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx)
        q, scale = quantized if quantized is not None else quantize_rows(embedding.weight)
        layer.qweight, layer.weight_scale = q, scale.to(embedding.weight.dtype)
        return layer.to(embedding.weight.device)

    def dequantized_weight(self) -> Tensor:
        """``qweight * weight_scale`` in the scales' dtype."""
        return self.qweight.to(self.weight_scale.dtype) * self.weight_scale[:, None]

    def requantize(self, weight: Tensor) -> None:
        """Replace the int8 rows by the quantization of the float `weight`."""
        q, scale = quantize_rows(weight, dtype=self.weight_scale.dtype)
        self.qweight, self.weight_scale = q, scale.to(self.weight_scale.dtype)

    def forward(self, idx: Tensor) -> Tensor:
        rows = F.embedding(idx, self.qweight).to(self.weight_scale.dtype)
        return self.add_lora(idx, rows * F.embedding(idx, self.weight_scale[:, None]))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}{self.lora_repr()}"
