"""Float8 numerics of `mixprec.quantize.float8` on any CPU: scales, casts, each recipe's
forward and backward against an explicit quantize-dequantize reference, delayed-scaling
histories, non-finite inputs, conversion of whole models and its skip reasons.

The references are written from the formulas (scale = finfo.max / max(amax, 1e-12), rounded
down to a power of 2 for rowwise; dequantize = float8 value * (1 / scale), the factor
`torch._scaled_mm` takes) with scales computed in Python. Quantized and dequantized operands
are then bit-identical to the module's, so reference and module multiply the same float32
matrices; only the summation order may differ (the BLAS picks a kernel per layout and per
CPU). Results are therefore compared within the reordering bound K * 2^-23 * (|A| @ |B|)
plus one ulp of the output dtype (a float32 value within that bound may round to the
neighbouring bfloat16). A wrong scale, cast, saturation or transpose moves results by the
float8 step (~6%), orders of magnitude beyond it.
"""

from __future__ import annotations

import copy
import math
import re
from functools import partial

import pytest
import torch
from torch import nn

import mixprec
from mixprec.errors import PolicySpecError
from mixprec.formats.float8 import Float8Config
from mixprec.quantize.float8 import (
    DELAYED_BUFFERS,
    E4M3,
    E5M2,
    Float8Linear,
    amax_to_scale,
    axis_scale,
    convert_from_float8,
    convert_to_float8,
    high_precision_matmul,
    scaled_matmul,
    skip_reason,
    tensor_scale,
    to_float8,
)

MAX = {E4M3: 448.0, E5M2: 57344.0}


def py_scale(amax: float, dtype: torch.dtype, power_of_2: bool = False) -> float:
    """The scale formula in Python floats (float32-rounded like torch's)."""
    scale = torch.tensor(MAX[dtype] / max(amax, 1e-12), dtype=torch.float32).item()
    if power_of_2:
        _, exponent = math.frexp(scale)  # scale = m * 2**exponent with 0.5 <= m < 1
        scale = 2.0 ** (exponent - 1)
    return scale


def scales(t: torch.Tensor, dtype: torch.dtype, dim: int | None) -> torch.Tensor:
    """Reference scales: one per tensor (dim None) or power-of-2 ones along `dim`."""
    if dim is None:
        return torch.tensor(py_scale(t.abs().max().item(), dtype))
    amax = t.abs().amax(dim=dim, keepdim=True)
    return amax.float().apply_(lambda a: py_scale(a, dtype, power_of_2=True))


def qdq(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Explicit quantize-dequantize in float32."""
    q = torch.clamp(t.float() * scale, -MAX[dtype], MAX[dtype]).to(dtype)
    return q.float() * (1.0 / scale)


def mm(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a @ b`` and the bound on any reordering of its float32 sums."""
    return a @ b, a.shape[1] * 2.0**-23 * (a.abs() @ b.abs())


def reference(recipe, x, w, b, g, out_dtype):
    """{name: (value, bound)} for y, grad_x, grad_w of a float8 linear, from the formulas."""
    x2 = x.reshape(-1, x.shape[-1])
    g2 = g.reshape(-1, g.shape[-1]).to(out_dtype).float()  # the gradient arrives rounded
    if recipe in ("tensorwise", "delayed"):
        xd, wd = qdq(x2, scales(x2, E4M3, None), E4M3), qdq(w, scales(w, E4M3, None), E4M3)
        gd = qdq(g2, scales(g2, E5M2, None), E5M2)
        gx, gw = mm(gd, wd), mm(gd.t(), xd)
    else:
        xd, wd = qdq(x2, scales(x2, E4M3, -1), E4M3), qdq(w, scales(w, E4M3, -1), E4M3)
        gx = mm(qdq(g2, scales(g2, E4M3, -1), E4M3), qdq(w, scales(w, E4M3, 0), E4M3))
        if recipe == "rowwise":
            gd_cols = qdq(g2, scales(g2, E4M3, 0), E4M3)
            gw = mm(gd_cols.t(), qdq(x2, scales(x2, E4M3, 0), E4M3))
        else:  # high precision: operands rounded to the compute dtype, float32 products
            gw = mm(g2.t(), x2.to(out_dtype).float())
    y, y_bound = mm(xd, wd.t())
    y = y.to(out_dtype) + b.to(out_dtype)
    shape = (*x.shape[:-1], w.shape[0])
    return {
        "y": (y.reshape(shape), y_bound.reshape(shape)),
        "grad_x": (gx[0].to(out_dtype).reshape(x.shape), gx[1].reshape(x.shape)),
        "grad_w": (gw[0].to(out_dtype), gw[1]),
    }


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    """Within the summation-order bound plus one ulp of `expected`'s dtype."""
    ulp = expected.float().abs() * torch.finfo(expected.dtype).eps
    diff = (actual.float() - expected.float()).abs()
    excess = diff - (bound + ulp)
    assert (excess <= 0).all(), f"off by {diff.max().item():.3g} (bound {bound.max().item():.3g})"


def run(module, x, g, autocast=False):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(x)
    y.backward(g.to(y.dtype))
    return y, x.grad, module.weight.grad, None if module.bias is None else module.bias.grad


# --- scales and casts ----------------------------------------------------------------------


def test_tensor_scale_is_format_max_over_amax():
    x = torch.tensor([[0.5, -3.0], [2.0, 1.0]])
    assert tensor_scale(x, E4M3).item() == pytest.approx(448.0 / 3.0, rel=1e-7)
    assert tensor_scale(x, E5M2).item() == pytest.approx(57344.0 / 3.0, rel=1e-7)
    assert tensor_scale(x, E4M3).dtype == torch.float32


def test_rowwise_scales_are_powers_of_two_per_row_and_column():
    x = torch.tensor([[1.0, -3.0, 0.25], [100.0, 7.0, 0.0]])
    rows, cols = axis_scale(x, E4M3, -1), axis_scale(x, E4M3, 0)
    assert rows.shape == (2, 1) and cols.shape == (1, 3)
    # 448 / 3 = 149.3 -> 128; 448 / 100 = 4.48 -> 4; 448 / 100, 448 / 7 = 64, 448 / .25 = 1792
    assert rows.flatten().tolist() == [128.0, 4.0]
    assert cols.flatten().tolist() == [4.0, 64.0, 1024.0]
    amax = x.abs().amax(dim=-1, keepdim=True)
    assert torch.all(amax * rows <= 448) and torch.all(amax * rows * 2 > 448)


def test_all_zero_tensor_gets_the_floor_not_a_division_by_zero():
    zeros = torch.zeros(4, 4)
    assert tensor_scale(zeros, E4M3).item() == pytest.approx(448.0 / 1e-12, rel=1e-6)
    assert torch.isfinite(axis_scale(zeros, E4M3, 0)).all()
    assert torch.equal(to_float8(zeros, tensor_scale(zeros, E4M3), E4M3).float(), zeros)


def test_cast_saturates_instead_of_overflowing():
    big = torch.tensor([1000.0, -1e6, 300.0])
    # e4m3fn has no infinity: an unclamped cast of 1000 is NaN; ours clamps to +-448
    assert to_float8(big, torch.tensor(1.0), E4M3).float().tolist() == [448.0, -448.0, 288.0]
    assert to_float8(big * 100, torch.tensor(1.0), E5M2).float().tolist() == [
        57344.0,
        -57344.0,
        28672.0,
    ]


def test_cast_makes_inf_and_nan_nan_whatever_the_scale():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e5, -2.0])
    for dtype in (E4M3, E5M2):
        out = to_float8(x, torch.tensor(1.0), dtype).float()
        # NaN, not +-max as torchao saturates an inf: a loss scaler must see the overflow
        assert torch.isnan(out[:3]).all(), dtype
        assert out[3:].tolist() == [MAX[dtype], -2.0]  # finite values still saturate


def test_non_finite_amax_gives_non_finite_scales():
    assert torch.isnan(amax_to_scale(torch.tensor(float("nan")), E4M3))
    assert amax_to_scale(torch.tensor(float("inf")), E4M3).item() == 0.0


# --- each recipe against the reference -----------------------------------------------------


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("shape", [(2, 3, 32, 48), (5, 1, 20, 12)], ids=["x16", "odd"])
@pytest.mark.parametrize("autocast", [False, True], ids=["f32", "bf16-autocast"])
def test_forward_and_backward_equal_the_reference(recipe, shape, autocast):
    torch.manual_seed(0)
    b0, b1, k, n = shape
    linear = nn.Linear(k, n)
    module = Float8Linear.from_float(linear, recipe)
    x, g = torch.randn(b0, b1, k) * 3, torch.randn(b0, b1, n) * 1e-3
    y, gx, gw, gb = run(module, x, g, autocast)
    out_dtype = torch.bfloat16 if autocast else torch.float32
    ref = reference(recipe, x, linear.weight.detach(), linear.bias.detach(), g, out_dtype)
    assert y.dtype == out_dtype and gx.dtype == torch.float32 and gw.dtype == torch.float32
    assert_matches(y, *ref["y"])
    assert_matches(gx, *ref["grad_x"])
    assert_matches(gw, *ref["grad_w"])
    # the bias is added in the compute dtype: its gradient is a sum of rounded gradients
    expected_gb = g.to(out_dtype).flatten(0, 1).float().sum(0).to(out_dtype)
    assert_matches(gb, expected_gb, torch.zeros(()))


def test_rowwise_with_gw_hp_computes_a_float64_weight_gradient_in_float64():
    """Found by a review: the recipe keeps the weight-gradient matmul in the compute dtype,
    but off CUDA it ran as a float32 matmul of the operands rounded to it: with a float64
    compute dtype (a float64 layer, '64-true') the weight gradient was g^T @ x rounded to
    float32 (1.5e-7 off). Float64 operands are multiplied in float64; 16-bit ones still sum
    in float32, as a 16-bit GEMM does."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32).double()
    module = Float8Linear.from_float(linear, "rowwise_with_gw_hp")
    x, g = torch.randn(16, 64, dtype=torch.float64), torch.randn(16, 32, dtype=torch.float64)
    _, _, gw, _ = run(module, x, g)
    exact = g.t() @ x
    bound = 16 * torch.finfo(torch.float64).eps * (g.t().abs() @ x.abs())
    assert gw.dtype == torch.float64 and ((gw - exact).abs() <= bound).all()
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    want = (a.to(torch.bfloat16).float() @ b.to(torch.bfloat16).float()).to(torch.bfloat16)
    assert torch.equal(high_precision_matmul(a, b, torch.bfloat16), want)


def test_float8_error_is_small_but_real():
    """Sanity of the whole thing against a float32 Linear: e4m3 carries 3 mantissa bits."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(16, 64)
    exact = linear(x)
    for recipe in Float8Config.RECIPES:
        y = Float8Linear.from_float(linear, recipe)(x)
        rel = ((y - exact).norm() / exact.norm()).item()
        assert 1e-4 < rel < 0.06, (recipe, rel)


def test_rowwise_uses_e4m3_for_gradients_and_tensorwise_e5m2():
    """A gradient element 1e-6 below the rest: e5m2 (subnormals down to 2^-16 of max/amax's
    scale) keeps it; e4m3's range is narrower, so rowwise flushes more of a wide gradient."""
    linear = nn.Linear(16, 16, bias=False)
    nn.init.eye_(linear.weight)
    x = torch.eye(16)
    g = torch.full((16, 16), 1e-6)
    g[:, 0] = 1.0
    grads = {}
    for recipe in ("tensorwise", "rowwise"):
        _, gx, _, _ = run(Float8Linear.from_float(linear, recipe), x, g)
        grads[recipe] = gx
    assert (grads["tensorwise"][:, 1:] != 0).all()  # 1e-6 * 57344 = 0.057 > 2^-16
    assert (grads["rowwise"][:, 1:] == 0).all()  # 1e-6 * 256 = 2.6e-4 < 2^-9, flushed


# --- delayed scaling -----------------------------------------------------------------------


def delayed_module(length=3, k=16, n=16):
    torch.manual_seed(0)
    return Float8Linear.from_float(nn.Linear(k, n), "delayed", length)


def test_delayed_buffers_are_keras_six_float32_variables():
    module = delayed_module(length=5)
    buffers = dict(module.named_buffers())
    assert list(buffers) == list(DELAYED_BUFFERS)
    assert all(b.dtype == torch.float32 for b in buffers.values())
    assert [tuple(buffers[n].shape) for n in DELAYED_BUFFERS] == [(), (5,)] * 3
    assert set(module.state_dict()) == {"weight", "bias", *DELAYED_BUFFERS}


def test_delayed_first_step_scales_dynamically_then_from_the_history_max():
    module = delayed_module(length=3)
    w = module.weight.detach().clone()
    amaxes = [2.0, 8.0, 1.0, 0.5, 0.25]
    torch.manual_seed(1)
    base = torch.rand(4, 16) * 0.2
    for step, amax in enumerate(amaxes):
        x = base.clone()
        x[0, 0] = amax
        g = torch.full((4, 16), 1e-3 * amax)
        seen = amaxes[:step] or [amax]  # first step: nothing recorded, its own amax
        window = seen[-3:]
        y, gx, _, _ = run(module, x, g)
        sx = torch.tensor(py_scale(max(window), E4M3))
        wd = qdq(w, scales(w, E4M3, None), E4M3)
        ry, bound = mm(qdq(x, sx, E4M3), wd.t())
        assert_matches(y, ry + module.bias.detach(), bound)
        sg = torch.tensor(py_scale(max(window) * 1e-3, E5M2))
        assert_matches(gx, *mm(qdq(g, sg, E5M2), wd))
        # the history rolls, newest first, and holds the last three amaxes
        recent = amaxes[: step + 1][::-1][:3]
        history = module.input_amax_history.tolist()
        assert history == pytest.approx(recent + [0.0] * (3 - len(recent)))
        # the stored scale is the one this step used (0 before anything was recorded)
        expected = py_scale(max(window), E4M3) if step else 0.0
        assert module.input_scale.item() == pytest.approx(expected, rel=1e-7)
        assert module.grad_output_amax_history[0].item() == pytest.approx(amax * 1e-3, rel=1e-6)
        assert module.weight_amax_history.tolist()[: step + 1] == pytest.approx(
            [w.abs().max().item()] * min(step + 1, 3)
        )
        module.zero_grad()


def test_delayed_records_only_when_training_with_gradients():
    module = delayed_module()
    x = torch.randn(4, 16)
    module.eval()
    module(x).sum().backward()
    assert module.input_scale.item() == 0.0 and not module.input_amax_history.any()
    module.train()
    with torch.no_grad():
        module(x)
    assert not module.input_amax_history.any()
    y = module(x)
    assert not module.input_amax_history.any()  # the backward pushes the amaxes
    y.sum().backward()
    assert module.input_amax_history[0].item() == x.abs().max().item()
    assert module.grad_output_amax_history[0].item() == 1.0
    module.weight.requires_grad_(False)  # no backward can run: pushed at once
    module(2 * x)
    amax = x.abs().max().item()
    assert module.input_amax_history[:2].tolist() == [2 * amax, amax]
    assert module.grad_output_amax_history[:2].tolist() == [1.0, 0.0]


def test_delayed_non_finite_amax_is_recorded_as_zero_and_the_output_stays_nan():
    module = delayed_module()
    run(module, torch.ones(2, 16), torch.ones(2, 16))
    x = torch.ones(2, 16)
    x[1, 3] = float("nan")
    y, _, _, _ = run(module, x, torch.ones(2, 16))
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()
    assert module.input_amax_history.tolist() == [0.0, 1.0, 0.0]
    module(torch.ones(2, 16))
    assert module.input_scale.item() == 448.0  # still from the history's max (1.0)


def test_delayed_inf_stays_non_finite_under_a_stored_scale():
    """With a finite scale from the history, an inf used to saturate to the format's max:
    finite output and gradients, an overflow the loss scaler never saw."""
    module = delayed_module()
    for _ in range(2):
        run(module, torch.randn(4, 16), torch.randn(4, 16))
    assert module.input_scale.item() > 0 and module.grad_output_scale.item() > 0
    x = torch.randn(4, 16)
    x[1, 2] = float("inf")
    y, _, _, _ = run(module, x, torch.randn(4, 16))
    assert not torch.isfinite(y[1]).any() and torch.isfinite(y[[0, 2, 3]]).all()
    g = torch.randn(4, 16)
    g[0, 0] = float("inf")
    _, gx, gw, _ = run(module, torch.randn(4, 16), g)
    assert not torch.isfinite(gx[0]).any() and not torch.isfinite(gw).all()


def test_delayed_buffers_stay_float32_through_module_casts():
    """In float16 a scale 448 / amax overflows once amax < 0.0068: the scale became inf and
    every output and gradient exactly 0."""
    module = delayed_module()
    with torch.no_grad():
        module.input_amax_history.copy_(torch.tensor([1e-9, 7e4, 3.3e-3]))  # not float16's
        module.input_scale.fill_(448 / 7e4)
    before = {n: getattr(module, n).clone() for n in DELAYED_BUFFERS}
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        module.to(dtype)
        assert module.weight.dtype == dtype
        for name, value in before.items():
            assert torch.equal(getattr(module, name), value), (dtype, name)  # bit for bit
    torch.manual_seed(0)  # the repro: small float16 activations
    module = Float8Linear.from_float(nn.Linear(16, 16, bias=False), "delayed", 3).half()
    for step in range(3):
        x = (torch.randn(8, 16) * 1e-3).half()
        y, _, gw, _ = run(module, x, torch.ones(8, 16))
        assert all(getattr(module, n).dtype == torch.float32 for n in DELAYED_BUFFERS)
        if step:  # from the amax pushed a step before: more than float16 can hold
            scale = amax_to_scale(module.input_amax_history[1], E4M3)
            assert module.input_scale.item() == scale.item() > 65504
        w = module.weight.detach().float()
        sx = module.input_scale if step else scales(x.float(), E4M3, None)
        ry, bound = mm(qdq(x.float(), sx, E4M3), qdq(w, scales(w, E4M3, None), E4M3).t())
        assert_matches(y, ry.half(), bound)
        assert y.abs().min() > 0 and gw.abs().min() > 0
    assert module.fixed_dtype_buffers == DELAYED_BUFFERS  # what shard and apply leave alone
    assert Float8Linear(16, 16).fixed_dtype_buffers == ()


def test_reset_parameters_after_to_empty_clears_the_delayed_buffers():
    """A model built on the meta device, then `to_empty` and `reset_parameters` (FSDP's
    recipe), kept whatever memory the buffers landed on: a stale amax of 1e30 in a history
    scaled the gradients to zero for a whole history. Now they are reset as when built."""
    module = Float8Linear(16, 16, device="meta", recipe="delayed", amax_history_length=4)
    module.to_empty(device="cpu")
    for name in DELAYED_BUFFERS:
        getattr(module, name).fill_(1e30)  # what stale memory may hold
    torch.manual_seed(0)
    module.reset_parameters()
    torch.manual_seed(0)
    fresh = Float8Linear(16, 16, recipe="delayed", amax_history_length=4)
    assert torch.equal(module.weight, fresh.weight)
    for name in DELAYED_BUFFERS:
        assert torch.equal(getattr(module, name), getattr(fresh, name)), name
    x, g = torch.randn(4, 16), torch.randn(4, 16)
    for a, b in zip(run(module, x, g), run(fresh, x, g), strict=True):
        assert torch.equal(a, b)


def test_delayed_all_zero_history_leaves_the_scale_unknown():
    module = delayed_module()
    module(torch.zeros(2, 16))
    assert module.input_scale.item() == 0.0  # not 448 / 1e-12: the next step scales itself
    x = torch.randn(2, 16)
    y = module(x)
    w = module.weight.detach()
    ref, bound = mm(qdq(x, scales(x, E4M3, None), E4M3), qdq(w, scales(w, E4M3, None), E4M3).t())
    assert_matches(y, ref + module.bias.detach(), bound)


# --- non-finite and zero inputs ------------------------------------------------------------


def test_nan_propagates_per_scaling_group():
    torch.manual_seed(0)
    linear = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    x[2, 5] = float("nan")
    tensorwise = Float8Linear.from_float(linear, "tensorwise")(x)
    assert torch.isnan(tensorwise).all()  # one scale for the whole tensor
    rowwise = Float8Linear.from_float(linear, "rowwise")(x)
    assert torch.isnan(rowwise[2]).all() and torch.isfinite(rowwise[[0, 1, 3]]).all()


def test_inf_input_makes_the_output_non_finite():
    linear = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    x[0, 0] = float("inf")
    for recipe in Float8Config.RECIPES:
        assert not torch.isfinite(Float8Linear.from_float(linear, recipe)(x)).all(), recipe


def test_zero_input_and_zero_gradient_stay_finite():
    for recipe in Float8Config.RECIPES:
        linear = nn.Linear(16, 16)
        module = Float8Linear.from_float(linear, recipe)
        y, gx, gw, _ = run(module, torch.zeros(3, 16), torch.zeros(3, 16))
        assert torch.equal(y, linear.bias.detach().expand(3, 16)), recipe
        assert torch.equal(gx, torch.zeros(3, 16)) and torch.equal(gw, torch.zeros(16, 16))


@pytest.mark.parametrize("recipe", Float8Config.RECIPES)
@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16)], ids=["no-rows", "no-tokens"])
def test_an_empty_batch_runs_as_in_nn_linear(recipe, shape):
    """amax of an empty tensor raised (tensorwise, delayed, rowwise's weight gradient); an
    empty batch now gives an empty output and zero weight gradients, as nn.Linear does, and
    records amax 0 (nothing seen) for the delayed input and output gradient."""
    linear = nn.Linear(16, 8)
    module = Float8Linear.from_float(copy.deepcopy(linear), recipe, 3)
    x = torch.randn(shape, requires_grad=True)
    y = module(x)
    y.sum().backward()
    assert y.shape == (*shape[:-1], 8) and x.grad.shape == shape
    assert torch.equal(module.weight.grad, torch.zeros(8, 16))
    assert torch.equal(module.bias.grad, torch.zeros(8))
    if recipe == "delayed":
        assert module.input_amax_history.tolist() == [0.0, 0.0, 0.0]
        assert module.grad_output_amax_history.tolist() == [0.0, 0.0, 0.0]
        assert module.weight_amax_history[0] == linear.weight.abs().max()


@pytest.mark.parametrize("recipe", Float8Config.RECIPES)
def test_a_gradient_penalty_on_the_input_gradient_raises(recipe):
    """A WGAN-GP critic with only its head in float8: the penalty's gradient starts from
    ``out.sum()``, so the head's backward received a gradient needing no graph, and the
    penalty added exactly nothing to the head's weight gradient without a word.
    Differentiating through the head's backward now raises, naming the layer."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 32))
    convert_to_float8(critic, recipe=recipe, filter="2", skip_small=False)
    assert isinstance(critic[2], Float8Linear)
    x = torch.randn(8, 64, requires_grad=True)
    (g,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
    penalty = 10 * (g.norm(dim=1) - 1).pow(2).mean()
    with pytest.raises(RuntimeError, match="Float8Linear has no second derivative"):
        penalty.backward()


@pytest.mark.parametrize("recipe", Float8Config.RECIPES)
def test_a_frozen_layer_in_a_gradient_penalty_is_exact(recipe):
    """A frozen Float8Linear fed a gradient needing no graph: its input gradient is constant
    in everything that trains, so there is no term to miss and the penalty runs."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(32, 32), nn.LeakyReLU(0.2), nn.Linear(32, 16))
    convert_to_float8(critic, recipe=recipe, filter="2", skip_small=False)
    critic[2].requires_grad_(False)
    x = torch.randn(4, 32, requires_grad=True)
    (g,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
    g.pow(2).sum().backward()
    assert critic[0].weight.grad is not None and critic[2].weight.grad is None


@pytest.mark.parametrize("recipe", Float8Config.RECIPES)
def test_a_second_derivative_raises_instead_of_missing_terms(recipe):
    """A gradient penalty through a Float8Linear backpropagated through its backward's
    float8 copies, detached from the weight: the weight's gradient lacked the term through
    them (140 where nn.Linear gives 237) without a word. First-order gradients taken with
    create_graph=True are unchanged."""
    torch.manual_seed(0)
    module = Float8Linear.from_float(nn.Linear(16, 16), recipe)
    x = torch.randn(3, 16, requires_grad=True)
    (plain,) = torch.autograd.grad(module(x).pow(2).sum(), x)
    (penalty,) = torch.autograd.grad(module(x).pow(2).sum(), x, create_graph=True)
    assert torch.equal(penalty, plain)
    with pytest.raises(RuntimeError, match="has no second derivative"):
        penalty.pow(2).sum().backward()


@pytest.mark.parametrize("recipe", Float8Config.RECIPES)
def test_backward_computes_only_the_gradients_autograd_needs(recipe):
    """A frozen weight (or an input without grad) skips its float8 matmul in backward; the
    gradient that is computed is the same as when both are."""
    torch.manual_seed(0)
    linear = nn.Linear(16, 16)
    x, g = torch.randn(4, 16), torch.randn(4, 16)
    _, gx_both, gw_both, _ = run(Float8Linear.from_float(copy.deepcopy(linear), recipe), x, g)
    for frozen in ("weight", "input"):
        module = Float8Linear.from_float(copy.deepcopy(linear), recipe)
        module.weight.requires_grad_(frozen != "weight")
        xi = x.clone().requires_grad_(frozen != "input")
        y = module(xi)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y.backward(g)
        assert [e.name for e in prof.events()].count("aten::mm") == 1, frozen
        if frozen == "weight":
            assert module.weight.grad is None and torch.equal(xi.grad, gx_both)
        else:
            assert xi.grad is None and torch.equal(module.weight.grad, gw_both)


# --- modules and conversion ----------------------------------------------------------------


def test_from_float_shares_parameters_and_keeps_state_dict_keys():
    linear = nn.Linear(16, 32)
    module = Float8Linear.from_float(linear)
    assert module.weight is linear.weight and module.bias is linear.bias
    assert module.state_dict().keys() == linear.state_dict().keys()
    back = module.to_float()
    assert type(back) is nn.Linear and back.weight is linear.weight
    assert "recipe='tensorwise'" in repr(module)
    assert module.quantization_mode == "float8"  # as mixprec.quantize's layers name their mode


def test_from_float_keeps_the_storage_dtype():
    linear = nn.Linear(16, 16).to(torch.bfloat16)
    module = Float8Linear.from_float(linear)
    x = torch.randn(2, 16, dtype=torch.bfloat16, requires_grad=True)
    y = module(x)
    y.sum().backward()
    assert module.weight.dtype == torch.bfloat16 and y.dtype == torch.bfloat16
    assert linear.weight.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16


def test_conversion_both_ways_keeps_kwargs_forward_hooks_and_backward_hooks():
    """The swap copied the forward hooks but not the flags saying which take kwargs (their
    call then raised TypeError), and dropped backward hooks silently."""
    model = nn.Sequential(nn.Linear(16, 16))
    seen: list[str] = []
    model[0].register_forward_pre_hook(lambda m, a, kw: seen.append("pre"), with_kwargs=True)
    model[0].register_forward_hook(lambda m, a, kw, o: seen.append("post"), with_kwargs=True)
    model[0].register_full_backward_pre_hook(lambda m, go: seen.append("backward pre"))
    model[0].register_full_backward_hook(lambda m, gi, go: seen.append("backward"))
    for convert in (partial(convert_to_float8, skip_small=False), convert_from_float8):
        convert(model)
        seen.clear()
        model(torch.randn(2, 16, requires_grad=True)).sum().backward()
        assert seen == ["pre", "post", "backward pre", "backward"], type(model[0])


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 32)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.attn = nn.MultiheadAttention(32, 2)
        self.odd = nn.Linear(32, 20)
        self.head = nn.Linear(32, 10, bias=False)
        self.head.weight = self.emb.weight


def test_convert_swaps_linears_and_reports_every_skip():
    net = TiedNet()
    params = {n: p for n, p in net.named_parameters()}
    skipped = {}
    assert convert_to_float8(net, skip_small=False, skipped=skipped) is net
    assert isinstance(net.body[0], Float8Linear) and isinstance(net.head, Float8Linear)
    assert skipped == {
        "attn.out_proj": (
            "NonDynamicallyQuantizableLinear is a subclass of nn.Linear; "
            "only plain nn.Linear is converted"
        ),
    }
    assert net.head.weight is net.emb.weight  # tied weights stay tied
    assert {n: p for n, p in net.named_parameters()} == params
    assert convert_from_float8(net) is net
    assert not any(isinstance(m, Float8Linear) for m in net.modules())
    assert type(net.body[0]) is nn.Linear and net.head.weight is net.emb.weight


def test_convert_returns_the_model_and_converts_a_bare_linear_as_torchao_does():
    """It returned the dict of skipped layers, so torchao's ``model = convert_to_float8(model)``
    replaced the model by a dict, and a bare Linear raised TypeError."""
    net = TiedNet()
    net = convert_to_float8(net, skip_small=False)
    assert isinstance(net, TiedNet) and isinstance(net.body[0], Float8Linear)
    torch.manual_seed(0)
    linear, x = nn.Linear(32, 32), torch.randn(4, 32)
    f8 = convert_to_float8(linear, skip_small=False, recipe="rowwise")
    assert type(f8) is Float8Linear and f8.recipe == "rowwise"
    assert f8.weight is linear.weight and f8.bias is linear.bias
    assert torch.equal(f8(x), Float8Linear.from_float(linear, "rowwise")(x))
    skipped = {}
    assert convert_to_float8(linear, skipped=skipped) is linear  # too small: left alone
    assert skipped[""].startswith("too small to gain: in_features=32")
    skipped = {}
    assert convert_to_float8(linear, skip_small=False, filter="body", skipped=skipped) is linear
    assert skipped == {"": "excluded by filter"}
    back = convert_from_float8(f8)
    assert type(back) is nn.Linear and back.weight is linear.weight


def test_a_root_linear_with_submodules_is_refused_not_stripped():
    """A root Linear holding submodules came back as a Float8Linear holding only weight and
    bias: its submodules were gone without a word. torchao refuses it; so does this. Left
    alone by the filter, the root keeps its submodules and they convert."""
    model = nn.Linear(32, 32)
    model.child = nn.Sequential(nn.Linear(32, 32))
    with pytest.raises(ValueError, match=r"root Linear that has submodules \(child\)"):
        convert_to_float8(model, skip_small=False)
    assert type(model.child[0]) is nn.Linear
    skipped = {}
    out = convert_to_float8(model, skip_small=False, filter=r"child\..*", skipped=skipped)
    assert out is model and type(model) is nn.Linear and skipped == {"": "excluded by filter"}
    assert isinstance(model.child[0], Float8Linear)
    assert set(model.state_dict()) == {"weight", "bias", "child.0.weight", "child.0.bias"}


def test_skip_small_follows_torchaos_rule():
    net, skipped = TiedNet(), {}
    convert_to_float8(net, skipped=skipped)
    assert "multiples of 16" in skipped["odd"]
    assert skipped["body.0"].startswith("too small to gain: in_features=32 <= 4096")
    assert not any(isinstance(m, Float8Linear) for m in net.modules())
    big = nn.Linear(4096 + 16, 16, device="meta")
    assert skip_reason(big) is None
    assert skip_reason(nn.Linear(4096, 1024, device="meta")).startswith("too small")
    assert skip_reason(nn.Linear(4096, 1024 + 16, device="meta")) is None
    assert skip_reason(nn.Linear(32, 32, device="meta"), "rowwise") is None
    assert skip_reason(nn.Linear(32, 20, device="meta"), "rowwise").startswith("in_features")
    assert skip_reason(nn.Linear(32, 20), skip_small=False) is None


def test_filter_by_regex_or_callable():
    net, skipped = TiedNet(), {}
    convert_to_float8(net, filter=r"body\.\d", skip_small=False, skipped=skipped)
    assert isinstance(net.body[2], Float8Linear) and type(net.head) is nn.Linear
    assert skipped["head"] == skipped["odd"] == "excluded by filter"
    net = TiedNet()
    convert_to_float8(net, filter=lambda path, m: m.out_features == 64, skip_small=False)
    assert [p for p, m in net.named_modules() if isinstance(m, Float8Linear)] == ["body.0"]
    skipped = {}
    convert_to_float8(net, skip_small=False, skipped=skipped)
    assert skipped["body.0"] == "already a Float8Linear"


def test_a_module_shared_at_two_paths_becomes_one_float8_module():
    shared = nn.Linear(16, 16)
    net = nn.Sequential(shared, nn.ReLU(), shared)
    convert_to_float8(net, skip_small=False, recipe="delayed", amax_history_length=2)
    assert net[0] is net[2] and isinstance(net[0], Float8Linear)


def test_a_linear_with_a_region_of_its_own_is_skipped():
    from mixprec.convert import apply
    from mixprec.policy.map import PolicyMap

    net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    apply(net, PolicyMap("bf16-mixed", {"1": "32-true"}), warn=False)
    skipped = {}
    convert_to_float8(net, skip_small=False, skipped=skipped)
    assert skipped == {
        "1": "its forward is replaced on the instance (a mixprec region?); convert before apply"
    }


class _ComputesWithChildWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.out = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.linear(x, self.proj.weight, self.proj.bias))


def test_a_linear_whose_parent_computes_with_its_weight_is_skipped():
    """convert_to_float8 swapped a Linear whose parent computes with its weight itself: the
    parent passed the Float8Linear by and the model computed in float, with nothing in
    `skipped`. It is skipped now, with the reason `explain` gives."""
    model = nn.Sequential(_ComputesWithChildWeight())
    said = mixprec.explain(model, "float8/rowwise_from_float32").skipped["0.proj"]
    skipped = {}
    convert_to_float8(model, recipe="rowwise", skip_small=False, skipped=skipped)
    assert type(model[0].proj) is nn.Linear and isinstance(model[0].out, Float8Linear)
    assert skipped == {"0.proj": said}
    assert "its parent _ComputesWithChildWeight computes with its weight" in said


def test_converting_back_a_model_apply_converted_is_refused():
    """It swapped the float8 layer for a plain Linear without its policy region (a float32
    result where the policy computes in bfloat16, off by 6e-3) while `explain` still
    listed float8."""
    from mixprec.convert import apply
    from mixprec.policy.map import PolicyMap

    net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    apply(net, PolicyMap("32-true", {"0": "float8/rowwise_from_bf16-mixed"}), warn=False)
    assert isinstance(net[0], Float8Linear)
    with pytest.raises(ValueError, match="convert_from_float8 swaps layers, and the model"):
        convert_from_float8(net)
    assert isinstance(net[0], Float8Linear)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_float8_layer_of_float64_weights_runs(recipe):
    """Accepted by `apply`, then every forward raised (the amax was asked for in float32
    from a float64 tensor, which torch refuses as a narrowing)."""
    import mixprec

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32))
    reference = nn.Sequential(nn.Linear(32, 32))
    reference.load_state_dict(net.state_dict())
    mixprec.apply(net, f"float8/{recipe}_from_64-true", warn=False)
    x = torch.randn(4, 32, dtype=torch.float64, requires_grad=True)
    out = net(x)
    out.sum().backward()
    expected = reference.double()(x.detach())
    assert out.dtype == x.grad.dtype == net[0].weight.grad.dtype == torch.float64
    # e4m3 keeps 3 mantissa bits: within a few percent of the float64 result
    assert (out - expected).abs().max() <= 0.1 * expected.abs().max()


def test_errors_say_what_is_accepted():
    with pytest.raises(PolicySpecError, match="accepted: 'tensorwise', 'rowwise'"):
        convert_to_float8(TiedNet(), recipe="axiswise")
    with pytest.raises(PolicySpecError, match="amax_history_length must be a positive int"):
        Float8Linear(16, 16, recipe="delayed", amax_history_length=0)
    with pytest.raises(TypeError, match="filter must be None, a callable"):
        convert_to_float8(TiedNet(), filter=3)
    with pytest.raises(TypeError, match="skipped must be a dict .* got list"):
        convert_to_float8(TiedNet(), skipped=[])
    with pytest.raises(ValueError, match=re.escape("needs a floating input whose last dim is 16")):
        Float8Linear(16, 16)(torch.randn(4, 8))
    with pytest.raises(ValueError, match=re.escape("16, got torch.float32 of shape ()")):
        Float8Linear(16, 16)(torch.tensor(1.0))  # was IndexError: tuple index out of range


def test_flags_take_only_true_or_false():
    """emulate and skip_small took any value by its truth: skip_small="False" skipped the
    small layers it was meant to convert, and emulate="no" emulated."""
    with pytest.raises(TypeError, match="emulate must be True or False, got 'no'"):
        Float8Linear(16, 16, emulate="no")
    with pytest.raises(TypeError, match="emulate must be True or False, got 1"):
        Float8Linear.from_float(nn.Linear(16, 16), emulate=1)
    with pytest.raises(TypeError, match="skip_small must be True or False, got 'False'"):
        convert_to_float8(TiedNet(), skip_small="False")
    with pytest.raises(TypeError, match="emulate must be True or False, got None"):
        convert_to_float8(TiedNet(), emulate=None)
    with pytest.raises(TypeError, match="skip_small must be True or False, got 0"):
        skip_reason(nn.Linear(16, 16), skip_small=0)


def test_convert_to_float8_and_quantize_take_and_refuse_filters_alike():
    """One filter function for every quantization: convert_to_float8 let a bad regex's
    re.error through where quantize named the filter."""
    calls = (
        lambda f: convert_to_float8(TiedNet(), filter=f),
        lambda f: mixprec.quantize(TiedNet(), "int8", filter=f),
    )
    for call in calls:
        with pytest.raises(PolicySpecError, match=r"filter '\(' is not a valid regex"):
            call("(")
        with pytest.raises(TypeError, match="filter must be None, a callable"):
            call(3)


def test_cpu_scaled_mm_gives_the_emulated_values():
    """Why the CPU path emulates: torch's CPU `_scaled_mm` computes the same dequantized
    float32 product. Its kernel (AMX, AVX2, ...) sums in an order of its own, so each
    element is the emulation's up to float32 rounding of the sum: at most one rounding per
    addition, of the sum of the products' magnitudes. Where every partial sum is exact (small
    integer codes, power-of-2 scales) both are bit-identical on every CPU."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 32), torch.randn(48, 32)
    sx, sw = tensor_scale(x, E4M3), tensor_scale(w, E4M3)
    x8, w8 = to_float8(x, sx, E4M3), to_float8(w, sw, E4M3)
    real = torch._scaled_mm(x8, w8.t(), sx.reciprocal(), sw.reciprocal(), out_dtype=torch.float32)
    emulated = Float8Linear.from_float(nn.Linear(32, 48, bias=False))
    emulated.weight.data = w
    magnitudes = (x8.float() / sx).abs() @ (w8.float() / sw).abs().t()
    bound = x.shape[1] * torch.finfo(torch.float32).eps * magnitudes
    assert ((real - emulated(x).detach()).abs() <= bound).all()

    # codes -16..16 (exact in e4m3), products up to 256, sums of 32 of them exact in float32
    a8 = torch.randint(-16, 17, (64, 32)).float().to(E4M3)
    b8 = torch.randint(-16, 17, (48, 32)).float().to(E4M3)
    a_inv, b_inv = torch.tensor(2.0**-5), torch.tensor(2.0**3)
    exact = torch._scaled_mm(a8, b8.t(), a_inv, b_inv, out_dtype=torch.float32)
    assert torch.equal(exact, scaled_matmul(a8, a_inv, b8.t(), b_inv, torch.float32, emulate=True))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_a_float64_input_inside_autocast_gives_float64_as_nn_linear_does(recipe):
    """Left open by a review (the int8, int4 and MX layers were fixed before): inside
    bfloat16 autocast, a float64 input came out of a Float8Linear in bfloat16, where
    nn.Linear returns float64 (autocast leaves float64 alone); its output equals the one
    outside autocast, and a float32 input still gives autocast's dtype."""
    torch.manual_seed(0)
    layer = Float8Linear(16, 8, recipe=recipe).double()
    x = torch.randn(4, 16, dtype=torch.float64)
    outside = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = layer(x)
        assert layer.float()(x.float()).dtype == torch.bfloat16
    assert inside.dtype == torch.float64 and torch.equal(inside, outside)
