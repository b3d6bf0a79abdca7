"""Float8 training for Linear layers: e4m3 forward tensors, e5m2 output gradients.

`Float8Linear` quantizes a Linear's input and weight to float8 before its matmul, and the
output gradient before the two backward matmuls, each with a scale that puts the tensor's
largest magnitude (amax) on the format's max:

    scale = finfo(fp8).max / max(amax, 1e-12)      quantize: clamp(x * scale, +-max).to(fp8)
                                                   dequantize: float32(x8) * (1 / scale)

Recipes (the facts come from torchao's and Keras's float8 training):

- ``"tensorwise"`` (default): one scale per tensor from its current amax; e4m3 forward,
  e5m2 output gradients.
- ``"rowwise"``: e4m3 everywhere (output gradients included), power-of-2 scales, one per row
  of a matmul's left operand and per column of its right operand along the reduced dimension.
- ``"rowwise_with_gw_hp"``: rowwise, but grad_weight = g^T @ x stays in the compute dtype.
- ``"delayed"`` (Keras's scheme): tensorwise, but each tensor's scale comes from the max of a
  rolling history of its amaxes (buffers, so they checkpoint). See `Float8Linear`.

Matmuls run through `torch._scaled_mm` on CUDA devices of compute capability 8.9+ where the
shapes allow it (reduced and output dims multiples of 16; rowwise also needs a bfloat16
output and an SM 8.9/9.0 GPU). Everywhere else they are emulated: dequantize to float32,
float32 matmul, round to the output dtype. torch's CPU `_scaled_mm` computes the same thing
(up to float32 rounding: its kernel sums in an order of its own, which differs by CPU) at the
same speed, so the explicit form is used: plain torch ops that compile and run on any device.

The casts' abs-max and saturating cast run as compiled kernels on CUDA, in eager models too
(`mixprec.quantize.float8_casts`; `set_compiled_casts` chooses the devices), bit-identical
to the op-by-op form.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mixprec.errors import PolicySpecError
from mixprec.formats.float8 import Float8Config
from mixprec.formats.registry import Format, Status, Support, agree
from mixprec.policy.names import accepted_quantized, spelled_int
from mixprec.quantize.first_order import first_order
from mixprec.quantize.float8_casts import abs_max, saturated_cast, set_compiled_casts
from mixprec.quantize.int8 import output_dtype
from mixprec.quantize.rules import (
    Filter,
    SwappedLinear,
    parent_computes_reason,
    path_filter,
    refuse_applied,
    reparametrized_reason,
    swap_modules,
    weights_read_by_parents,
)

if TYPE_CHECKING:
    from mixprec.device import DeviceInfo

__all__ = [
    "DELAYED_BUFFERS",
    "Float8Linear",
    "convert_from_float8",
    "convert_to_float8",
    "set_compiled_casts",
    "sync_amax_histories",
]

E4M3: torch.dtype = torch.float8_e4m3fn
E5M2: torch.dtype = torch.float8_e5m2
AMAX_FLOOR = 1e-12
# Delayed-scaling buffers, Keras's six variables per Dense: a scale and an amax history for
# the input, the weight and the output gradient.
DELAYED_BUFFERS: tuple[str, ...] = (
    "input_scale",
    "input_amax_history",
    "weight_scale",
    "weight_amax_history",
    "grad_output_scale",
    "grad_output_amax_history",
)

# --- scales, casts and matmuls ------------------------------------------------------------


def amax_to_scale(amax: Tensor, fp8_dtype: torch.dtype, *, power_of_2: bool = False) -> Tensor:
    """float32 ``finfo(fp8).max / max(amax, 1e-12)``, rounded down to a power of 2 if asked.

    The floor keeps an all-zero tensor finite (it quantizes to zeros); a NaN amax gives a NaN
    scale and an infinite one a zero scale, so a non-finite tensor stays non-finite after the
    round trip and a loss scaler still sees the overflow.
    """
    scale = torch.finfo(fp8_dtype).max / amax.float().clamp(min=AMAX_FLOOR)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def tensor_scale(x: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """One scale (a 0-dim float32 tensor) for the whole tensor, from its current amax."""
    return amax_to_scale(abs_max(x), fp8_dtype)


def axis_scale(x: Tensor, fp8_dtype: torch.dtype, dim: int) -> Tensor:
    """Power-of-2 scales along `dim` of a 2-D tensor (kept as a size-1 dim): ``dim=-1`` gives
    one per row, ``dim=0`` one per column."""
    return amax_to_scale(abs_max(x, dim), fp8_dtype, power_of_2=True)


def to_float8(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """``x * scale`` in float32, saturated to the format's range, cast to `fp8_dtype`.

    Only finite values saturate: an inf or NaN of `x` becomes NaN, so a tensor that
    overflowed stays non-finite whatever the scale, as `amax_to_scale` promises, and a loss
    scaler still sees it and skips the step. This differs from torchao on purpose: its
    ``to_fp8_saturated`` clamps before casting, so an inf becomes +-448 (e4m3) or +-57344
    (e5m2), a finite value a float16 loss scaler would never see overflow.
    """
    return saturated_cast(x, scale, fp8_dtype)


def real_scaled_mm_supported(a8: Tensor, b8: Tensor, out_dtype: torch.dtype, rowwise: bool) -> bool:
    """Whether ``a8 @ b8`` can run as a real float8 `torch._scaled_mm` on its device: CUDA of
    compute capability 8.9+, reduced and output dims multiples of 16; per-row scales also
    need a bfloat16 output and an Ada or Hopper GPU (8.9 or 9.0: torch's row-wise kernels
    are arch-specific, and newer GPUs gained them release by release)."""
    if not a8.is_cuda:
        return False
    capability = torch.cuda.get_device_capability(a8.device)
    if capability < (8, 9) or a8.shape[1] % 16 or b8.shape[1] % 16:
        return False
    return not rowwise or (out_dtype == torch.bfloat16 and capability in ((8, 9), (9, 0)))


def scaled_matmul(
    a8: Tensor,
    a_inv: Tensor,
    b8: Tensor,
    b_inv: Tensor,
    out_dtype: torch.dtype,
    *,
    emulate: bool = False,
) -> Tensor:
    """``(a8 * a_inv) @ (b8 * b_inv)`` in `out_dtype`: a8 is (M, K), b8 (K, N); the inverse
    scales are 0-dim (tensorwise) or (M, 1) and (1, N) (rowwise).

    `torch._scaled_mm` where `real_scaled_mm_supported` (it wants A row-major and B
    column-major, so both are laid out here) unless `emulate`; else float32 emulation.
    """
    rowwise = a_inv.dim() > 0
    if not emulate and real_scaled_mm_supported(a8, b8, out_dtype, rowwise):
        return torch._scaled_mm(
            a8.contiguous(),
            b8.t().contiguous().t(),
            a_inv.float(),
            b_inv.float(),
            out_dtype=out_dtype,
        )
    out = (a8.float() * a_inv) @ (b8.float() * b_inv)
    # no `.to` that returns `out` itself: torch.compile of torch 2.11 gives an autograd.Function
    # whose forward returns such a no-op cast a zero gradient (2.12 fixed it)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def high_precision_matmul(
    a: Tensor, b: Tensor, dtype: torch.dtype, *, emulate: bool = False
) -> Tensor:
    """``a @ b`` with both operands rounded to `dtype` and the result in `dtype`.

    On CUDA a native matmul in `dtype`; elsewhere (or with `emulate`) a matmul of the
    rounded operands in float32, or in `dtype` where it is wider (float64), rounded once:
    for 16-bit dtypes the same products with float32 accumulation, as a 16-bit GEMM
    computes them, without the CPU's slow 16-bit kernels.
    """
    if a.is_cuda and not emulate:
        return a.to(dtype) @ b.to(dtype)
    if dtype == torch.float64:  # (wider than float32: its own matmul)
        return a.to(dtype) @ b.to(dtype)
    return (a.to(dtype).float() @ b.to(dtype).float()).to(dtype)


def _delayed_scale(amax: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """The scale to quantize a tensor of this `amax` with under delayed scaling: the stored
    one (from the history of earlier steps), or before anything was recorded (stored scale
    0) the tensor's own."""
    return torch.where(scale > 0, scale.float(), amax_to_scale(amax, fp8_dtype))


def _push(amax: Tensor, history: Tensor) -> None:
    """Roll the history (newest first) and store `amax` in front; a non-finite amax is
    stored as 0, so one overflowing step cannot freeze the scale for a whole history."""
    seen = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    history.copy_(torch.cat([seen.reshape(1), history[:-1].float()]))


def _history_scale(history: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """The delayed scale from an amax history's max; 0 ("not known yet") while it holds
    only zeros."""
    top = history.float().max()
    return torch.where(top > 0, amax_to_scale(top, fp8_dtype), torch.zeros_like(top))


def _check_flag(name: str, value: Any) -> bool:
    """`value` if it is True or False; TypeError otherwise (a string such as "False" is
    truthy, and would silently mean the opposite)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _backward_running() -> bool:
    """Whether this thread is inside an autograd backward, where a module's forward runs only
    when activation checkpointing recomputes it. torch's own checkpoint code reads the same
    graph-task id; under torch.compile the traced forward is taken as a plain one."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class _Float8Matmul(torch.autograd.Function):
    """``x @ weight.T`` with float8 operands in both directions, per recipe (no bias).

    `record` (delayed only): None records nothing; "backward" pushes the input's and the
    weight's amaxes (taken in forward) and the output gradient's in backward; "forward"
    pushes the input's and the weight's at once, for a forward without a backward (nothing
    it reads requires grad). The stored scales are only read here.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        recipe: str,
        out_dtype: torch.dtype,
        emulate: bool,
        record: str | None,
        *delayed: Tensor,
    ) -> Tensor:
        ctx.recipe, ctx.out_dtype, ctx.emulate, ctx.record = recipe, out_dtype, emulate, record
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        with torch.autocast(x.device.type, enabled=False):
            if recipe in Float8Config.ROWWISE_RECIPES:
                sx, sw = axis_scale(x, E4M3, -1), axis_scale(weight, E4M3, -1)
                x8, w8 = to_float8(x, sx, E4M3), to_float8(weight, sw, E4M3)
                out = scaled_matmul(
                    x8, sx.reciprocal(), w8.t(), sw.reciprocal().t(), out_dtype, emulate=emulate
                )
                ctx.save_for_backward(x, weight)
                return out
            if recipe == "delayed":
                in_scale, in_hist, w_scale, w_hist, ctx.g_scale, ctx.g_hist = delayed
                amax_x, amax_w = abs_max(x), abs_max(weight)
                sx = _delayed_scale(amax_x, in_scale, E4M3)
                sw = _delayed_scale(amax_w, w_scale, E4M3)
                if record == "forward":
                    _push(amax_x, in_hist)
                    _push(amax_w, w_hist)
                ctx.pushes = (amax_x, in_hist), (amax_w, w_hist)
            else:
                sx, sw = tensor_scale(x, E4M3), tensor_scale(weight, E4M3)
            x8, w8 = to_float8(x, sx, E4M3), to_float8(weight, sw, E4M3)
            x_inv, w_inv = sx.reciprocal(), sw.reciprocal()
            out = scaled_matmul(x8, x_inv, w8.t(), w_inv, out_dtype, emulate=emulate)
            ctx.save_for_backward(x8, w8, x_inv, w_inv, weight)
            return out

    # the float8 operands are detached from x and the weight, so a second backward would miss
    # the terms through them: `first_order` makes it raise
    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors  # read once: activation checkpointing unpacks them once
        weight = saved[1 if ctx.recipe in Float8Config.ROWWISE_RECIPES else 4]
        compute = partial(_Float8Matmul.gradients, ctx, g, saved)
        return first_order("Float8Linear", compute, weight, g)

    @staticmethod
    def gradients(ctx: Any, g: Tensor, saved: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
        """The backward's math on the `saved` tensors, without a graph."""
        out_dtype, emulate = ctx.out_dtype, ctx.emulate
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = grad_w = None
        with torch.autocast(g.device.type, enabled=False):
            if ctx.recipe in Float8Config.ROWWISE_RECIPES:
                x, weight = saved
                if need_x:
                    sg, swc = axis_scale(g, E4M3, -1), axis_scale(weight, E4M3, 0)
                    grad_x = scaled_matmul(
                        to_float8(g, sg, E4M3),
                        sg.reciprocal(),
                        to_float8(weight, swc, E4M3),
                        swc.reciprocal(),
                        out_dtype,
                        emulate=emulate,
                    )
                if need_w and ctx.recipe == "rowwise_with_gw_hp":
                    grad_w = high_precision_matmul(g.t(), x, out_dtype, emulate=emulate)
                elif need_w:
                    sgc, sxc = axis_scale(g, E4M3, 0), axis_scale(x, E4M3, 0)
                    grad_w = scaled_matmul(
                        to_float8(g, sgc, E4M3).t(),
                        sgc.reciprocal().t(),
                        to_float8(x, sxc, E4M3),
                        sxc.reciprocal(),
                        out_dtype,
                        emulate=emulate,
                    )
            else:
                x8, w8, x_inv, w_inv, _ = saved
                if ctx.recipe == "delayed":
                    amax_g = abs_max(g)
                    sg = _delayed_scale(amax_g, ctx.g_scale, E5M2)
                    if ctx.record == "backward":
                        for amax, history in (*ctx.pushes, (amax_g, ctx.g_hist)):
                            _push(amax, history)
                else:
                    sg = tensor_scale(g, E5M2)
                g8, g_inv = to_float8(g, sg, E5M2), sg.reciprocal()
                if need_x:
                    grad_x = scaled_matmul(g8, g_inv, w8, w_inv, out_dtype, emulate=emulate)
                if need_w:
                    grad_w = scaled_matmul(g8.t(), g_inv, x8, x_inv, out_dtype, emulate=emulate)
        none = (None,) * (4 + (len(DELAYED_BUFFERS) if ctx.recipe == "delayed" else 0))
        return (
            None if grad_x is None else grad_x.to(ctx.x_dtype),
            None if grad_w is None else grad_w.to(ctx.w_dtype),
            *none,
        )


class Float8Linear(SwappedLinear):
    """An `nn.Linear` whose matmuls run in float8 (see the module docstring for the recipes).

    The output comes out in the compute dtype: autocast's dtype inside `torch.autocast`
    (bfloat16 under "bf16-mixed"), else the input's dtype; the bias is added in that dtype,
    never quantized. Gradients come out of the matmuls in the compute dtype and are cast to
    the input's and the weight's dtypes (float32 masters stay float32). The weight is the
    Linear's own parameter in its storage dtype, so state-dict keys are a Linear's; the
    "delayed" recipe adds six float32 buffers (`DELAYED_BUFFERS`), which checkpoint and stay
    float32 through ``.half()`` / ``.to(dtype)`` (see `fixed_dtype_buffers`).

    Delayed scaling: each forward sets the three stored scales from their amax histories'
    max, and quantizes the input and weight (its backward the output gradient) with them;
    that backward then pushes the three amaxes onto the histories, newest first. Unlike
    Keras (scales start at 1.0 and lag two steps), the first step scales dynamically (a
    stored scale of 0 means "none yet") and later steps use every amax up to the previous
    step. A forward that activation checkpointing (`torch.utils.checkpoint`, reentrant or
    not) recomputes inside a backward keeps the scales the original forward set, so it
    recomputes the same values, and each amax is pushed once, by the one backward that
    runs per step (twice for a graph backpropagated twice: docs/quantized.md). A
    training forward with gradients enabled but nothing requiring grad
    (so no backward) pushes the input and weight amaxes at once; eval and no-grad forwards
    push nothing. Under several processes `sync_amax_histories` (the format's
    `Format.before_step`, which `mixprec.Precision.before_step` runs before every optimizer
    step, at every door) makes the histories the max over the ranks; without it DDP ranks
    quantize with rank 0's (broadcast before each forward) and FSDP ranks with their own.

    Options (keywords of the constructor and `from_float`): ``recipe``,
    ``amax_history_length``, and ``emulate=True``, which forces the float32 emulation even
    where a real float8 matmul could run.
    """

    # what the quantized layers of `mixprec.quantize` say they are (explain, quantize)
    quantization_mode = "float8"

    def _setup(
        self,
        recipe: str = Float8Config.DEFAULT_RECIPE,
        amax_history_length: int = Float8Config.DEFAULT_AMAX_HISTORY_LENGTH,
        *,
        emulate: bool = False,
    ) -> None:
        config = Float8Config(recipe, amax_history_length)
        self.recipe, self.amax_history_length = config.recipe, config.amax_history_length
        self.emulate = _check_flag("emulate", emulate)
        if config.delayed:
            device = self.weight.device
            for name in DELAYED_BUFFERS:
                shape = (amax_history_length,) if name.endswith("history") else ()
                self.register_buffer(name, torch.zeros(shape, dtype=torch.float32, device=device))

    def reset_parameters(self) -> None:
        """nn.Linear's, and for the delayed recipe empty amax histories and unknown scales
        (zeros, as built), as BatchNorm resets its running statistics: a model built on the
        meta device gets them after ``to_empty`` (whose buffers hold stale memory)."""
        super().reset_parameters()
        with torch.no_grad():
            for name in DELAYED_BUFFERS:
                buffer = self._buffers.get(name)  # none yet while nn.Linear.__init__ runs
                if buffer is not None:
                    buffer.zero_()

    @property
    def fixed_dtype_buffers(self) -> tuple[str, ...]:
        """Floating buffers whose dtype no cast may change: the delayed scales and amax
        histories are float32 (in float16 a scale ``448 / amax`` overflows to inf once
        amax < 448 / 65504, quantizing everything to 0). `_apply` keeps them; code that
        assigns buffers itself (`mixprec.sharding.shard`) leaves these alone."""
        return DELAYED_BUFFERS if self.recipe == "delayed" else ()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Float8Linear:
        """nn.Module's, except that `fixed_dtype_buffers` only follow a change of device."""
        before = {name: self._buffers[name] for name in self.fixed_dtype_buffers}
        super()._apply(fn, recurse)
        for name, kept in before.items():
            after = self._buffers[name]
            if after is not None and after.dtype != kept.dtype:
                self._buffers[name] = kept.to(after.device)
        return self

    @torch.no_grad()
    def _refresh_scales(self) -> None:
        """Set each delayed scale from its amax history's max (0 while it is all zeros)."""
        for name, fp8 in (("input", E4M3), ("weight", E4M3), ("grad_output", E5M2)):
            history = getattr(self, f"{name}_amax_history")
            getattr(self, f"{name}_scale").copy_(_history_scale(history, fp8))

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features or not x.is_floating_point():
            raise ValueError(
                f"Float8Linear({self.in_features}, {self.out_features}) needs a floating input "
                f"whose last dim is {self.in_features}, got {x.dtype} of shape {tuple(x.shape)}"
            )
        out_dtype = output_dtype(x)  # (as nn.Linear: float64 stays float64 under autocast)
        record, delayed = None, []
        if self.recipe == "delayed":
            recomputed = _backward_running()
            if not recomputed:
                self._refresh_scales()
            if self.training and torch.is_grad_enabled():
                if x.requires_grad or self.weight.requires_grad:
                    record = "backward"
                elif not recomputed:
                    record = "forward"
            delayed = [getattr(self, n) for n in DELAYED_BUFFERS]
        out = _Float8Matmul.apply(
            x.reshape(-1, self.in_features),
            self.weight,
            self.recipe,
            out_dtype,
            self.emulate,
            record,
            *delayed,
        )
        out = out.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        extra = (
            f", amax_history_length={self.amax_history_length}" if self.recipe == "delayed" else ""
        )
        return f"{super().extra_repr()}, recipe={self.recipe!r}{extra}"


def delayed_layers(model: nn.Module) -> list[Float8Linear]:
    """The delayed-scaling float8 layers of `model`, each once."""
    return [m for m in model.modules() if isinstance(m, Float8Linear) and m.recipe == "delayed"]


def sync_amax_histories(model: nn.Module | Sequence[Float8Linear], group: Any = None) -> int:
    """Make every rank's delayed-scaling amax histories the elementwise max over the ranks
    (one all-reduce for all layers) and set the scales from them; returns how many layers.

    Every door into a step runs it on every rank after the backward passes of an optimizer step
    (`mixprec.Precision.before_step`; the output gradients' amaxes are recorded in backward); a loop
    stepping its optimizers without a `Precision` calls it there. Without it each rank scales from
    its own amaxes (FSDP2 leaves buffers alone) or from rank 0's (DDP broadcasts them before each
    forward), so a rank whose data runs larger saturates. With it the next step's scales come from
    the largest amax any rank saw, as one process on the whole batch would have. The histories must
    have been equal on the ranks before the step (they are from a common start: the same checkpoint,
    or DDP's first broadcast), so entry i means the same step everywhere. `model` may be the layers
    `delayed_layers` returns, to skip the module walk."""
    import torch.distributed as dist

    layers = delayed_layers(model) if isinstance(model, nn.Module) else model
    if not layers or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0
    histories = [
        getattr(m, f"{name}_amax_history")
        for m in layers
        for name in ("input", "weight", "grad_output")
    ]
    flat = torch.cat([h.float() for h in histories])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    with torch.no_grad():
        for h, new in zip(histories, flat.split([h.numel() for h in histories]), strict=True):
            h.copy_(new)
    for m in layers:
        m._refresh_scales()
    return len(layers)


# --- whole models ----------------------------------------------------------------------------


def skip_reason(
    linear: nn.Module, recipe: str = Float8Config.DEFAULT_RECIPE, *, skip_small: bool = True
) -> str | None:
    """Why `convert_to_float8` leaves this module alone, or None if it converts it.

    Only plain `nn.Linear` converts (a subclass may have a forward of its own, such as
    MultiheadAttention's out_proj, which never calls it), and not one reparametrized by
    torch.nn.utils's weight_norm, spectral_norm or pruning (whose hook the Float8Linear would
    break). With `skip_small` (the default)
    torchao's rule also applies: dims that are not multiples of 16 cannot run a real float8
    matmul, and a tensorwise/delayed layer with in_features <= 4096 and out_features <= 1024
    is too small to win back its casts (`Float8Config`'s rule, which quantized policies
    apply too). ``skip_small=False`` converts those too (they run emulated where
    `_scaled_mm` cannot): for tests, CPU studies and numerics checks.
    """
    config = Float8Config(recipe)
    _check_flag("skip_small", skip_small)
    if isinstance(linear, Float8Linear):
        return "already a Float8Linear"
    if type(linear) is not nn.Linear:
        kind = "a subclass of nn.Linear" if isinstance(linear, nn.Linear) else "not an nn.Linear"
        return f"{type(linear).__name__} is {kind}; only plain nn.Linear is converted"
    reparametrized = reparametrized_reason(linear)
    if reparametrized is not None:
        return reparametrized
    if not linear.weight.is_floating_point():
        return f"weight dtype {linear.weight.dtype} is not floating"
    if "forward" in linear.__dict__:
        return "its forward is replaced on the instance (a mixprec region?); convert before apply"
    if not skip_small:
        return None
    k, n = linear.in_features, linear.out_features
    shape = config.shape_reason(k, n)
    if shape is not None:
        return f"{shape}; skip_small=False converts it, emulated"
    gain = config.gain_reason(k, n)
    return None if gain is None else f"{gain}; skip_small=False converts it"


def convert_to_float8(
    model: nn.Module,
    *,
    recipe: str = Float8Config.DEFAULT_RECIPE,
    amax_history_length: int = Float8Config.DEFAULT_AMAX_HISTORY_LENGTH,
    filter: Filter = None,
    skip_small: bool = True,
    emulate: bool = False,
    skipped: dict[str, str] | None = None,
) -> nn.Module:
    """Swap the model's Linear layers for `Float8Linear` in place and return the model, as
    torchao's ``convert_to_float8_training``: ``model = convert_to_float8(model)``. A bare
    `nn.Linear` cannot be swapped in place: its `Float8Linear` is returned (or the Linear
    itself if it is skipped, its submodules converted); a root Linear with submodules that
    would be converted is refused, as torchao refuses it, since its `Float8Linear` would drop
    them.

    `filter` picks layers: a callable(path, module) -> bool or a regex that must fullmatch
    the path (the model's own path is ""). `skip_small` applies torchao's size rule (see
    `skip_reason`); pass False for small layers. `skipped`, a dict you pass, gets {path:
    reason} for each Linear-like module left alone (`skip_reason` says it for one module, and
    a Linear whose weight a module above it computes with itself is left too: it would pass
    the Float8Linear by, as `mixprec.explain` says).
    Parameters are shared with the new modules, so an optimizer built before keeps working.
    Convert before `mixprec.apply` (a Linear with a region is skipped). `emulate=True` makes
    the new modules emulate float8 even where real kernels run.
    """
    Float8Config(recipe, amax_history_length)  # refuses unknown recipes and bad lengths
    _check_flag("skip_small", skip_small)
    _check_flag("emulate", emulate)
    keep = path_filter(filter)
    if skipped is None:
        skipped = {}
    elif not isinstance(skipped, dict):
        raise TypeError(
            f"skipped must be a dict for convert_to_float8 to fill with {{path: reason}}, "
            f"got {type(skipped).__name__}"
        )
    read = weights_read_by_parents(model)

    def make(path: str, child: nn.Module) -> nn.Module | None:
        if not isinstance(child, nn.Linear):
            return None
        reason = skip_reason(child, recipe, skip_small=skip_small)
        if reason is None:
            reason = parent_computes_reason(Float8Format.name, read.get(id(child)))
        if reason is None and not keep(path, child):
            reason = "excluded by filter"
        if reason is not None:
            skipped[path] = reason
            return None
        return Float8Linear.from_float(
            child, recipe=recipe, amax_history_length=amax_history_length, emulate=emulate
        )

    if isinstance(model, nn.Linear):
        converted = make("", model)
        if converted is not None and model._modules:
            raise ValueError(
                f"convert_to_float8 cannot convert a root Linear that has submodules "
                f"({', '.join(model._modules)}): its Float8Linear would drop them. Convert "
                f"the model holding it, or exclude the root with filter (its path is '')"
            )
        if converted is not None:
            return converted
    swap_modules(model, make)  # a skipped root Linear's submodules still convert, as torchao's
    return model


def convert_from_float8(model: nn.Module) -> nn.Module:
    """Swap every `Float8Linear` back to an `nn.Linear` holding the same parameters, in
    place, and return the model (the delayed-scaling buffers are dropped); a bare
    `Float8Linear` gives its `to_float()`. A model `mixprec.apply` converted is refused, as
    `mixprec.quantize.dequantize` refuses it: the layers would leave their policy regions
    behind while `explain` still listed float8."""
    if isinstance(model, Float8Linear):
        return model.to_float()
    refuse_applied(model, "convert_from_float8")

    def make(path: str, child: nn.Module) -> nn.Module | None:
        return child.to_float() if isinstance(child, Float8Linear) else None

    swap_modules(model, make)
    return model


# --- the float8 format -------------------------------------------------------------------

FLOAT8_FAST_ON = "NVIDIA GPUs of compute capability 8.9+ (L4, L40, H100 and newer)"


def float8_support(info: DeviceInfo) -> Support:
    """How well `info`'s device runs float8 matmuls (`torch._scaled_mm`)."""
    if info.type == "cuda":
        major, minor = info.capability or (0, 0)
        if (major, minor) >= (8, 9):
            return Support(Status.FAST, f"float8 tensor cores (compute capability {major}.{minor})")
        return Support(
            Status.SLOW,
            f"no float8 tensor cores (compute capability {major}.{minor} < 8.9): float8 "
            "matmuls are emulated, slower than bfloat16",
        )
    return Support(
        Status.SLOW,
        f"no float8 matmul hardware on {info.type}: emulated (quantized, dequantized, then "
        "multiplied in float32), slower than float32",
    )


class Float8Format(Format):
    """float8 training numerics on Linear layers (`Float8Linear`); the option is the recipe
    ("float8/rowwise") and, for "delayed", the amax history length ("float8/delayed:16")."""

    name = "float8"
    accepted = (
        f"'float8' (tensorwise), 'float8/<recipe>' (recipes {', '.join(Float8Config.RECIPES)}; "
        "'float8/delayed:<amax history length>')"
    )
    keywords = ("recipe", "amax_history_length")
    config_keys = {
        "recipe": "a float8 recipe",
        "amax_history_length": "the amax history length of the delayed float8 recipe",
    }
    search = ("float8/tensorwise", "float8/rowwise")
    info_row = True
    fast_on = FLOAT8_FAST_ON
    undo = "mixprec.quantize.float8.convert_from_float8(model)"

    def parse(self, options: str | None, keywords: Mapping[str, Any], name: str) -> Float8Config:
        spelled_recipe = spelled_history = None
        if options is not None:
            spelled_recipe, colon, history = options.partition(":")
            if colon:
                spelled_history = spelled_int(history, "amax history length", name)
        recipe = agree("recipe", spelled_recipe, keywords.get("recipe"), name)
        given = keywords.get("amax_history_length")
        history = agree("amax_history_length", spelled_history, given, name)
        recipe = Float8Config.DEFAULT_RECIPE if recipe is None else recipe
        try:
            Float8Config.check_recipe(recipe)
        except PolicySpecError as err:
            raise PolicySpecError(f"in {name!r}: {err}. " + accepted_quantized()) from None
        if history is None:
            return Float8Config(recipe)
        if recipe != "delayed":
            raise PolicySpecError(
                f"amax_history_length belongs to the 'delayed' float8 recipe, not {recipe!r} "
                f"({name!r})"
            )
        try:
            return Float8Config(recipe, history)
        except PolicySpecError as err:
            raise PolicySpecError(f"in {name!r}: {err}") from None

    def spell(self, config: Float8Config) -> str:
        if config.recipe == Float8Config.DEFAULT_RECIPE:
            return "float8"
        history = config.amax_history_length
        if config.delayed and history != Float8Config.DEFAULT_AMAX_HISTORY_LENGTH:
            return f"float8/{config.recipe}:{history}"
        return f"float8/{config.recipe}"

    def describe(self, config: Float8Config) -> str:
        if config.delayed:
            return f"float8 (delayed, amax history of {config.amax_history_length})"
        return f"float8 ({config.recipe})"

    def to_dict(self, config: Float8Config) -> dict[str, Any]:
        if config.delayed:
            return {"recipe": config.recipe, "amax_history_length": config.amax_history_length}
        return {"recipe": config.recipe}

    def from_dict(self, values: Mapping[str, Any], name: str) -> Float8Config:
        recipe = values.get("recipe")
        if recipe is not None and not isinstance(recipe, str):
            raise PolicySpecError(
                f"quantized policy config key 'recipe' is {type(recipe).__name__} {recipe!r}; "
                f"it takes a recipe name ({', '.join(Float8Config.RECIPES)})"
            )
        return super().from_dict(values, name)

    def skip(self, config: Float8Config, module: nn.Module) -> str | None:
        shape = config.shape_reason(module.in_features, module.out_features)
        if shape is not None:
            return f"too small for float8 matmuls: {shape}"
        return config.gain_reason(module.in_features, module.out_features)

    def build(self, module: nn.Module, config: Float8Config, codes: None) -> nn.Module:
        return Float8Linear.from_float(
            module, recipe=config.recipe, amax_history_length=config.amax_history_length
        )

    def layer_config(self, layer: nn.Module) -> Float8Config:
        return Float8Config(layer.recipe, layer.amax_history_length)

    def step_layers(self, model: nn.Module) -> list[nn.Module]:
        return list(delayed_layers(model))

    def before_step(self, layers: Sequence[nn.Module], group: Any) -> None:
        sync_amax_histories(layers, group)  # type: ignore[arg-type]

    def weight_bytes(self, config: Float8Config, module: nn.Module, storage: torch.dtype) -> int:
        weight = module.weight.numel() * storage.itemsize
        if not config.delayed:
            return weight
        # three float32 amax histories and their three scales
        return weight + 3 * 4 * (config.amax_history_length + 1)

    def rate(self, info: DeviceInfo) -> Support:
        return float8_support(info)

    def rate_policy(
        self, info: DeviceInfo, config: Float8Config, compute_dtype: torch.dtype
    ) -> Support:
        """`float8_support`, except that torch's row-wise float8 kernels exist for a bfloat16
        output on Ada and Hopper GPUs only (`real_scaled_mm_supported`): elsewhere a
        row-wise recipe runs emulated."""
        rated = float8_support(info)
        if rated.status != Status.FAST or config.recipe not in Float8Config.ROWWISE_RECIPES:
            return rated
        major, minor = info.capability or (0, 0)
        if compute_dtype == torch.bfloat16 and (major, minor) in ((8, 9), (9, 0)):
            return rated
        return Support(
            Status.SLOW,
            f"{config.recipe} float8 runs emulated here: torch's row-wise float8 matmuls "
            f"need a bfloat16 compute dtype on compute capability 8.9 or 9.0 (this policy "
            f"computes in {str(compute_dtype).removeprefix('torch.')} on {major}.{minor})",
        )


FLOAT8 = Float8Format()
