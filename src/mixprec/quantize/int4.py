"""int4 weight-only quantization (W4A16), as Keras's int4 mode with groups.

Each output channel's input features are cut into groups (default 128; -1: one group per
channel; a short last group is padded with zeros). A group gets an asymmetric 4-bit grid
spanning ``[min(w, 0), max(w, 0)]``: ``scale = (hi - lo) / 15``, ``zero = round(-lo / scale)``,
``q = clamp(round(w / scale) + zero, 0, 15)``, ``w ~= (q - zero) * scale``, so zero is exact
and ``|w - dequantized| <= scale / 2``. Values are packed two per byte (low nibble first);
these codes, scales and zero points are the layer's state (``state_dict``, checkpoints).

The matmul: float32 and bfloat16 inputs go through torch's packed int4 kernel (W4A16, as
torchao's int4 weight-only layouts: ``aten._weight_int4pack_mm_for_cpu`` on CPUs with AVX2 or
AVX-512 and on Arm, the tinygemm ``aten._weight_int4pack_mm`` on CUDA GPUs of compute
capability 8.0+), for groups of 32, 64, 128 or 256. The kernel reads the weight 4 bits at a
time from a copy packed for it on first use (as many bytes again as the codes; made again
when the buffers change) and computes with bfloat16 activations: a float32 input is rounded
to bfloat16, products accumulate in float32 and the output is rounded to bfloat16 (then
returned in the input's dtype, the bias added there). Its weight is ``(q - 8) * scale +
offset`` with scale and ``offset = (8 - zero) * scale`` in bfloat16, within 1/32 of a step of
the stored one. Other group sizes, float16/float64 inputs and devices without the kernel
dequantize the weight to the compute dtype before each matmul, as before; `Int4Linear.kernel`
says which a layer takes and why.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.errors import PolicySpecError
from mixprec.formats.registry import Format, agree
from mixprec.policy.names import spelled_int
from mixprec.quantize.int8 import (
    Prepacked,
    ScaledCodes,
    check_finite,
    check_input,
    float_layer,
    output_dtype,
    storable_scale,
)
from mixprec.quantize.lora import LoraEmbeddingMixin, LoraMixin
from mixprec.quantize.rules import rows_and_features, swapped_in

__all__ = [
    "Int4Config",
    "Int4Embedding",
    "Int4Linear",
]

QMAX = 15
# The group sizes torch's packed int4 kernels take (CPU and CUDA alike).
KERNEL_GROUP_SIZES = (32, 64, 128, 256)
# The input dtypes that go through the kernel (computed with bfloat16 activations).
KERNEL_INPUT_DTYPES = (torch.float32, torch.bfloat16)


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
    span = hi - lo
    # (a span past float32's largest, as -2e38 .. 2e38, taken in two parts: inf otherwise)
    scale = torch.where(torch.isinf(span), hi / QMAX - lo / QMAX, span / QMAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # the codes reach from the zero point as far as the group's weights reach from 0, one
    # step more for the rounding of the zero point: not the whole 15 steps both ways
    reach = (torch.maximum(-lo, hi) / scale).ceil().add_(1).clamp_(max=QMAX)
    scale = storable_scale(scale, w.dtype if dtype is None else dtype, name, reach)
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


def kernel_for(device: torch.device, size: int) -> tuple[str, str | None]:
    """(torch's packed int4 kernel for `device`, None) when it can multiply groups of `size`
    input features there, else (what the layer does instead, why)."""
    dequant = "dequantize the weight, then F.linear"
    if size not in KERNEL_GROUP_SIZES:
        sizes = ", ".join(map(str, KERNEL_GROUP_SIZES))
        return dequant, f"groups of {size}: the packed int4 kernels take groups of {sizes}"
    if device.type == "cpu":
        capability = torch.backends.cpu.get_cpu_capability()
        # ATen's int4 kernel is vectorised for AVX2/AVX-512 and Arm NEON; a plain build's
        # scalar loop is far slower than a float32 matmul
        if capability in ("AVX2", "AVX512") or platform.machine().lower() in ("aarch64", "arm64"):
            return "aten._weight_int4pack_mm_for_cpu", None
        return dequant, f"ATen CPU capability {capability}: no vectorised int4 kernel"
    if device.type == "cuda":
        if torch.version.hip is not None:
            return dequant, "ROCm: the tinygemm int4 kernel is built for NVIDIA GPUs"
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return "aten._weight_int4pack_mm", None
        return dequant, f"compute capability {major}.{minor}: tinygemm needs 8.0+"
    return dequant, f"no packed int4 kernel on {device.type}"


class PackedInt4(NamedTuple):
    """A weight prepacked for torch's int4 kernel: the packed codes, the kernel's
    ``[groups, rows, 2]`` bfloat16 scales and offsets, and the padded input width the kernel
    multiplies (rows and input features padded as the kernel needs)."""

    codes: Tensor
    scales_and_zeros: Tensor
    features: int


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_for_kernel(
    packed: Tensor, scale: Tensor, zero: Tensor, features: int, group_size: int
) -> PackedInt4:
    """`quantize_groups`' output repacked for torch's int4 kernel on `packed`'s device.

    The kernel dequantizes ``(q - 8) * s + o`` per group: with ``s = scale`` and
    ``o = (8 - zero) * scale`` (computed in float32, then both rounded to bfloat16) that is
    ``(q - zero) * scale`` up to that rounding. Padded rows and groups get scale and offset
    0 (their products vanish; the input is padded with zeros too)."""
    rows = packed.shape[0]
    n, size = groups_of(features, group_size)
    cuda = packed.device.type == "cuda"
    # CPU: rows in blocks of 16; CUDA tinygemm: rows in blocks of 8, input features in
    # blocks of 1024 (torchao pads the same way for inner_k_tiles 8)
    rows_to = _round_up(rows, 8 if cuda else 16)
    width = _round_up(n * size, 1024) if cuda else n * size
    codes = unpack(packed, n * size).to(torch.int32)
    codes = F.pad(codes, (0, width - n * size, 0, rows_to - rows))
    s32, z32 = scale.to(torch.float32), zero.to(torch.float32)
    offsets = (8 - z32) * s32
    pairs = torch.stack((s32, offsets), dim=-1).to(torch.bfloat16)  # [rows, n, 2]
    pairs = F.pad(pairs, (0, 0, 0, width // size - n, 0, rows_to - rows))
    scales_and_zeros = pairs.transpose(0, 1).contiguous()  # [groups, rows, 2]
    if cuda:  # tinygemm reads two codes per byte, the even column in the high nibble
        pairs_u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        kernel_codes = torch.ops.aten._convert_weight_to_int4pack(pairs_u8, 8)
    else:
        kernel_codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return PackedInt4(kernel_codes, scales_and_zeros, width)


def kernel_matmul(x: Tensor, weight: PackedInt4, rows: int, size: int) -> Tensor:
    """``x @ W.T`` for a 2-D `x` by torch's int4 kernel on `weight` (`pack_for_kernel`), in
    bfloat16 [M, rows]: `x` rounded to bfloat16 and zero-padded to the packed width."""
    xb = x.to(torch.bfloat16)
    if weight.features > x.shape[-1]:
        xb = F.pad(xb, (0, weight.features - x.shape[-1]))
    xb = xb.contiguous()
    if x.device.type == "cuda":
        out = torch.ops.aten._weight_int4pack_mm(xb, weight.codes, size, weight.scales_and_zeros)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            xb, weight.codes, size, weight.scales_and_zeros
        )
    return out[:, :rows]


def kernel_linear(
    x: Tensor, weight: PackedInt4, rows: int, size: int, dtype: torch.dtype
) -> Tensor:
    """`kernel_matmul` for `x` of any leading dims, returned in `dtype`."""
    out = kernel_matmul(x.reshape(-1, x.shape[-1]), weight, rows, size).to(dtype)
    return out.reshape(*x.shape[:-1], rows)


class _Int4Matmul(torch.autograd.Function):
    """Forward: `kernel_linear`. Backward: the input gets ``grad @ W`` with the stored
    (dequantized) weight in the gradient's dtype, as F.linear with that weight gives it; the
    int4 buffers get none."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        buffers: tuple[Tensor, Tensor, Tensor],
        weight: PackedInt4,
        group_size: int,
        dtype: torch.dtype,
    ) -> Tensor:
        ctx.save_for_backward(*buffers)
        ctx.features, ctx.group_size = x.shape[-1], group_size
        size = groups_of(x.shape[-1], group_size)[1]
        return kernel_linear(x, weight, buffers[0].shape[0], size, dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        w = dequantize_groups(*ctx.saved_tensors, ctx.features, ctx.group_size)
        return grad @ w.to(grad.dtype), None, None, None, None


class _Int4Weight(ScaledCodes, Prepacked, nn.Module):
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
        self.drop_prepacked()

    def take_groups(self, weight: Tensor, quantized: tuple[Tensor, ...] | None) -> None:
        """Hold the int4 groups of the float `weight` (scales in its dtype), or `quantized`
        (``(packed, scale, zero)`` already made from it, the scales kept in their dtype:
        the format makes them in the dtype they are stored in)."""
        if quantized is not None:
            self._take(quantized, quantized[1].dtype)
            return
        self._take(quantize_groups(weight, self.group_size), weight.dtype)

    def quantized_buffers(self, weight: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
        packed, scale, zero = quantize_groups(weight, self.group_size, dtype=dtype)
        return {"qweight": packed, "weight_scale": scale.to(dtype), "weight_zero": zero}

    def weight_from(self, buffers: Mapping[str, Tensor]) -> Tensor:
        return dequantize_groups(
            buffers["qweight"],
            buffers["weight_scale"],
            buffers["weight_zero"],
            self.features,
            self.group_size,
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
        layer.take_groups(linear.weight, quantized)
        layer.bias = linear.bias  # the same Parameter: an optimizer holding it keeps working
        return swapped_in(linear, layer.to(linear.weight.device))

    @property
    def kernel_group(self) -> int:
        """The features per group the kernel multiplies (the group size, or the row)."""
        return groups_of(self.in_features, self.group_size)[1]

    @property
    def kernel(self) -> str:
        """The matmul this layer runs on its device, and why that one."""
        name, why_not = kernel_for(self.qweight.device, self.kernel_group)
        if why_not is not None:
            return f"{name} ({why_not})"
        return (
            f"{name} for float32/bfloat16 inputs, computed with bfloat16 activations (float16 "
            "and float64 inputs: dequantize the weight, then F.linear)"
        )

    def forward(self, x: Tensor) -> Tensor:
        check_input(self, x)
        # in the compute dtype (autocast's, else the input's): outside autocast a float32
        # weight would meet a 16-bit input (FSDP2 casts inputs, not these buffers)
        dtype = output_dtype(x)
        bias = None if self.bias is None else self.bias.to(dtype)
        # torch.compile traces the dequantized matmul: the packed copy lives outside the
        # module's buffers
        if (
            dtype in KERNEL_INPUT_DTYPES
            and x.numel()
            and not torch.compiler.is_compiling()
            and kernel_for(x.device, self.kernel_group)[1] is None
        ):
            weight = self.prepacked(
                (self.qweight, self.weight_scale, self.weight_zero),
                lambda: pack_for_kernel(
                    self.qweight, self.weight_scale, self.weight_zero, self.features,
                    self.group_size,
                ),
            )  # fmt: skip
            if torch.is_grad_enabled() and x.requires_grad:
                buffers = (self.qweight, self.weight_scale, self.weight_zero)
                out = _Int4Matmul.apply(x, buffers, weight, self.group_size, dtype)
            else:  # no graph to record: skip the autograd.Function's cost
                out = kernel_linear(x, weight, self.out_features, self.kernel_group, dtype)
            out = out if bias is None else out + bias
        else:
            out = F.linear(x.to(dtype), self.dequantized_weight().to(dtype), bias)
        return self.add_lora(x, out)

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
        layer.take_groups(embedding.weight, quantized)
        return swapped_in(embedding, layer.to(embedding.weight.device))

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


# --- the int4 format ---------------------------------------------------------------------

DEFAULT_GROUP_SIZE = 128
PER_CHANNEL = -1  # the group size of one group per output channel


@dataclass(frozen=True)
class Int4Config:
    """int4's option: the input features that share one scale and zero point
    (`PER_CHANNEL`: a whole row)."""

    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        size = self.group_size
        if isinstance(size, bool) or not isinstance(size, int):
            raise PolicySpecError(f"int4 group size must be an int, not {size!r}")
        if size != PER_CHANNEL and size < 2:
            raise PolicySpecError(
                f"int4 group size {size}: use a size >= 2 ({DEFAULT_GROUP_SIZE} is the "
                "default) or -1 for one group per output channel"
            )


class Int4Format(Format):
    """int4: grouped weights with a zero point, packed two per byte (Linear, Embedding and
    Hugging Face Conv1D layers); the option is the group size ("int4/64", "int4/-1")."""

    name = "int4"
    accepted = (
        f"'int4' (groups of {DEFAULT_GROUP_SIZE}), 'int4/<group size>' ('int4/-1', or "
        "Keras's older 'int4/None': per channel)"
    )
    embeddings = True
    keeps_weight = False
    keywords = ("group_size",)
    config_keys = {"group_size": "the int4 group size"}
    search = ("int4/32", "int4/128")

    def parse(self, options: str | None, keywords: Mapping[str, Any], name: str) -> Int4Config:
        spelled = None
        if options == "none":  # Keras's older spelling of per-channel int4 ("int4/None_from_...")
            spelled = PER_CHANNEL
        elif options is not None:
            spelled = spelled_int(options, "int4 group size", name)
        size = agree("group size", spelled, keywords.get("group_size"), name)
        try:
            return Int4Config(DEFAULT_GROUP_SIZE if size is None else size)
        except PolicySpecError as err:
            raise PolicySpecError(f"in {name!r}: {err}") from None

    def spell(self, config: Int4Config) -> str:
        size = config.group_size
        return "int4" if size == DEFAULT_GROUP_SIZE else f"int4/{size}"

    def describe(self, config: Int4Config) -> str:
        if config.group_size == PER_CHANNEL:
            return "int4 (per channel)"
        return f"int4 (groups of {config.group_size})"

    def to_dict(self, config: Int4Config) -> dict[str, Any]:
        return {"group_size": config.group_size}

    def quantize_weight(
        self, weight: Tensor, config: Int4Config, name: str, storage: torch.dtype
    ) -> tuple[Tensor, ...]:
        packed, scale, zero = quantize_groups(weight, config.group_size, name, storage)
        return packed, scale.to(storage), zero

    def build(self, module: nn.Module, config: Int4Config, codes: tuple[Tensor, ...]) -> nn.Module:
        layer = Int4Linear if isinstance(module, nn.Linear) else Int4Embedding
        return layer.from_float(module, config.group_size, codes)

    def layer_config(self, layer: nn.Module) -> Int4Config:
        return Int4Config(layer.group_size)

    def to_float(self, layer: nn.Module, memo: dict[int, Any]) -> nn.Module:
        return float_layer(layer, memo)

    def weight_bytes(self, config: Int4Config, module: nn.Module, storage: torch.dtype) -> int:
        rows, features = rows_and_features(module)
        n, size = groups_of(features, config.group_size)
        return rows * math.ceil(n * size / 2) + rows * n * (storage.itemsize + 1)


INT4 = Int4Format()
