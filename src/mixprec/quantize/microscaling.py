"""Block-scaled training: `MicroscalingLinear`, a Linear whose matmuls run in a block-scaled
format (mxfp8, mxfp6, mxfp4, nvfp4), emulated on every device (quantize, dequantize, float32
matmul) with the reference quantizers of `mixprec.quantize.block_formats`, and the formats'
`MicroscalingFormat`, registered once per mode.

Every GEMM's two operands are quantized in blocks along the dimension the GEMM reduces, as
torchao's MX training and Transformer Engine do: forward ``x @ W^T`` along the input
features, input gradient ``g @ W`` along the outputs, weight gradient ``g^T @ x`` along the
tokens (zero-padded to whole blocks: zeros change neither a block's amax nor the sum). All
three tensors use the mode's element format: the MXFP8 recipe (Mishra et al. 2025) keeps E4M3
for gradients too, since a 32-element block's own scale covers the range E5M2 used to buy.
NVFP4's recipe options (2D weight tiles reused by the backward, a random Hadamard transform of
the weight-gradient GEMM's inputs, stochastic rounding of the output gradient) are
`MicroscalingConfig`'s. The bias is added after the matmul in the output dtype, never
quantized, and trains (torchao's MXFP8 training path dropped it). There is no real
block-scaled GEMM path: these matmuls need NVIDIA Blackwell (SM 10.0+) kernels, so every
device emulates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mixprec.formats.microscaling import MicroscalingConfig
from mixprec.formats.registry import Format, Status, Support
from mixprec.quantize.block_formats import fake_quantize
from mixprec.quantize.first_order import first_order
from mixprec.quantize.int8 import output_dtype
from mixprec.quantize.rules import SwappedLinear

if TYPE_CHECKING:
    from mixprec.device import DeviceInfo

__all__ = [
    "MicroscalingLinear",
]

# --- the random Hadamard transform ----------------------------------------------------------

_RHT_SEED = 0x5EED


def _build_hadamard() -> Tensor:
    # float32 whatever torch's default dtype at import (float64 in much scientific code)
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(_RHT_SEED)
    signs = torch.randint(0, 2, (16,), generator=gen).float() * 2 - 1
    return signs[:, None] * h / 4


_HADAMARD_CPU = _build_hadamard()


def hadamard_16(device: torch.device | str = "cpu") -> Tensor:
    """The 16x16 random Hadamard matrix ``diag(s) @ H16 / 4`` (Sylvester's H16, signs `s`
    drawn once from a fixed seed): orthogonal, so ``(a @ Q) @ (b @ Q)^T == a @ b^T``. A new
    copy each call: changing it changes no later transform."""
    return _hadamard_16(torch.device(device)).clone()


def _hadamard_16(device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """`hadamard_16`'s matrix on `device` in `dtype` (its values, +-1/4, are exact in any
    float dtype), never handed out: `_HADAMARD_CPU`, made at import (a compiled graph then
    creates no random generator and mutates no cache), moved (16x16 values) where the
    transform runs."""
    return _HADAMARD_CPU.to(device, dtype)


def _rht(x: Tensor) -> Tensor:
    """x (float32, last dim a multiple of 16) with each 16 consecutive values of its last dim
    multiplied by `hadamard_16` (in x's dtype: a matmul takes one dtype)."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    return (blocks @ _hadamard_16(x.device, x.dtype)).reshape(x.shape)


def _pad_last(x: Tensor, multiple: int) -> Tensor:
    extra = -x.shape[-1] % multiple
    return torch.nn.functional.pad(x, (0, extra)) if extra else x


# --- training -------------------------------------------------------------------------------


class _BlockScaledMatmul(torch.autograd.Function):
    """``x @ weight.T`` with every GEMM's operands block-quantized along its reduced dim
    (forward, input gradient, weight gradient), emulated in float32; no bias."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, config: MicroscalingConfig, out_dtype: torch.dtype
    ) -> Tensor:
        ctx.config, ctx.out_dtype = config, out_dtype
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        with torch.autocast(x.device.type, enabled=False):
            x32, w32 = x.float(), weight.float()
            two_d = config.mode == "nvfp4" and config.two_d
            qw = fake_quantize(w32, config, two_d=two_d)
            if config.forward_rht:
                out = fake_quantize(_rht(x32), config) @ fake_quantize(_rht(w32), config).t()
            else:
                out = fake_quantize(x32, config) @ qw.t()
            ctx.save_for_backward(x, weight, qw if two_d else None)
            return out if out_dtype == torch.float32 else out.to(out_dtype)

    # the block rounding of the gradient and the operands passes no gradient, so a second
    # backward would miss its terms: `first_order` makes it raise
    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors  # read once: activation checkpointing unpacks them once
        compute = partial(_BlockScaledMatmul.gradients, ctx, g, saved)
        return first_order("MicroscalingLinear", compute, saved[1], g)

    @staticmethod
    def gradients(ctx: Any, g: Tensor, saved: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
        """The backward's math on the `saved` tensors, without a graph."""
        config, out_dtype = ctx.config, ctx.out_dtype
        x, weight, qw_2d = saved
        grad_x = grad_w = None
        sr = config.mode == "nvfp4" and config.stochastic_gradients
        with torch.autocast(g.device.type, enabled=False):
            g32 = g.float()
            if ctx.needs_input_grad[0]:  # reduces over the outputs
                qw = qw_2d if qw_2d is not None else fake_quantize(weight.float().t(), config).t()
                grad_x = (fake_quantize(g32, config, stochastic=sr) @ qw).to(out_dtype)
            if ctx.needs_input_grad[1]:  # reduces over the tokens, padded to whole blocks
                multiple = math.lcm(config.block_size, 16)
                gt = _pad_last(g32.t(), multiple)
                xt = _pad_last(x.float().t(), multiple)
                if config.mode == "nvfp4" and config.rht:
                    gt, xt = _rht(gt), _rht(xt)
                qg = fake_quantize(gt, config, stochastic=sr)
                grad_w = (qg @ fake_quantize(xt, config).t()).to(out_dtype)
        return (
            None if grad_x is None else grad_x.to(ctx.x_dtype),
            None if grad_w is None else grad_w.to(ctx.w_dtype),
            None,
            None,
        )


class MicroscalingLinear(SwappedLinear):
    """An `nn.Linear` whose matmuls run in a block-scaled format (the keyword ``config``: a
    `MicroscalingConfig` or a mode name such as ``"mxfp8/floor"``), emulated: see the module
    docstring for what each GEMM quantizes.

    The output comes out in the compute dtype (autocast's inside `torch.autocast`, else the
    input's; a float64 input stays float64, as autocast leaves it); the bias is added in it,
    never quantized. Gradients are cast to the input's and the weight's dtypes. The weight
    and bias are the Linear's own parameters, so state-dict keys are a Linear's.
    """

    def _setup(self, config: MicroscalingConfig | str = "mxfp8") -> None:
        if isinstance(config, str):
            mode, slash, options = config.partition("/")
            config = MicroscalingConfig.parse(mode, options if slash else None)
        if not isinstance(config, MicroscalingConfig):
            raise TypeError(
                f"config must be a MicroscalingConfig or a mode name such as 'mxfp8/floor', "
                f"got {type(config).__name__}"
            )
        reason = config.shape_reason(self.in_features, self.out_features)
        if reason is not None:
            raise ValueError(f"{config.describe()} cannot quantize this Linear: {reason}")
        self.config = config
        self.quantization_mode = config.mode

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features or not x.is_floating_point():
            raise ValueError(
                f"MicroscalingLinear({self.in_features}, {self.out_features}) needs a floating "
                f"input whose last dim is {self.in_features}, got {x.dtype} of shape "
                f"{tuple(x.shape)}"
            )
        out = _BlockScaledMatmul.apply(
            x.reshape(-1, self.in_features), self.weight, self.config, output_dtype(x)
        )
        out = out.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.config.spelled()!r}"


# --- the block-scaled formats ------------------------------------------------------------

MICROSCALING_FAST_ON = (
    "no device through mixprec yet: its block-scaled (MX, NVFP4) matmuls are emulated "
    "everywhere; the hardware that runs them is NVIDIA Blackwell (compute capability 10.0+)"
)


def microscaling_support(info: DeviceInfo) -> Support:
    """How `info`'s device runs block-scaled (mxfp8/mxfp6/mxfp4/nvfp4) matmuls: emulated
    (quantize, dequantize, float32 matmul) on every device, since mixprec has no kernel path
    for them (they need NVIDIA Blackwell's block-scaled tensor cores)."""
    if info.type == "cuda":
        major, minor = info.capability or (0, 0)
        where = (
            "this GPU has block-scaled tensor cores, but mixprec has no kernel path for them"
            if major >= 10
            else f"compute capability {major}.{minor} has no block-scaled tensor cores"
        )
        return Support(Status.SLOW, f"block-scaled matmuls are emulated in float32 ({where})")
    return Support(
        Status.SLOW,
        f"no block-scaled matmul hardware on {info.type}: emulated in float32 (quantize, "
        "dequantize, float32 matmul), slower than float32",
    )


class MicroscalingFormat(Format):
    """One block-scaled format (mxfp8, mxfp6, mxfp4, nvfp4) on Linear layers
    (`MicroscalingLinear`, emulated); its options are `MicroscalingConfig`'s, after a '/'
    ("mxfp8/floor", "nvfp4/2d:rht:sr")."""

    accepted = "the block-scaled " + MicroscalingConfig.accepted()
    config_keys = {"options": "the ':'-separated options of a microscaling mode"}
    fast_on = MICROSCALING_FAST_ON

    def __init__(self, mode: str) -> None:
        self.name = MicroscalingConfig(mode).mode

    def parse(
        self, options: str | None, keywords: Mapping[str, Any], name: str
    ) -> MicroscalingConfig:
        return MicroscalingConfig.parse(self.name, options, name)

    def spell(self, config: MicroscalingConfig) -> str:
        return config.spelled()

    def describe(self, config: MicroscalingConfig) -> str:
        return config.describe()

    def skip(self, config: MicroscalingConfig, module: nn.Module) -> str | None:
        shape = config.shape_reason(module.in_features, module.out_features)
        return None if shape is None else f"does not fill whole blocks: {shape}"

    def build(self, module: nn.Module, config: MicroscalingConfig, codes: None) -> nn.Module:
        return MicroscalingLinear.from_float(module, config=config)

    def layer_config(self, layer: nn.Module) -> MicroscalingConfig:
        return layer.config

    def rate(self, info: DeviceInfo) -> Support:
        return microscaling_support(info)


MICROSCALING_FORMATS = tuple(MicroscalingFormat(mode) for mode in MicroscalingConfig.MODES)
