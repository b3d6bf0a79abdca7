"""`MicroscalingLinear` on any CPU: each GEMM's operands quantized along the dimension it
reduces (checked against products of `quantize_mx` / `quantize_nvfp4` round trips, the
packed-code path, not the layer's own), the bias kept and trained, NVFP4's recipe options
(16x16 weight tiles reused by the backward, the Hadamard transform of the weight-gradient
inputs, stochastic rounding of gradients), autocast dtypes and non-finite gradients.

The reference and the layer multiply the same float32 matrices in the same layout, so
results are compared exactly; the GPU path does not exist (block-scaled GEMMs need NVIDIA
Blackwell), and `test_cuda.py`-style tests are not needed: every device emulates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mixprec
from mixprec.dtypes import default_dtype
from mixprec.formats.microscaling import MicroscalingConfig
from mixprec.quantize.block_formats import fake_quantize, quantize_mx, quantize_nvfp4
from mixprec.quantize.microscaling import MicroscalingLinear, hadamard_16

SRC = str(Path(__file__).resolve().parents[2] / "src")


def mx(t: torch.Tensor, element: str = "e4m3", rounding: str = "rceil") -> torch.Tensor:
    return quantize_mx(t.detach().float(), element, 32, rounding).dequantize()


def nv(t: torch.Tensor, two_d: bool = False) -> torch.Tensor:
    return quantize_nvfp4(t.detach().float(), two_d=two_d).dequantize()


def pad_tokens(t: torch.Tensor, multiple: int = 32) -> torch.Tensor:
    return F.pad(t, (0, -t.shape[-1] % multiple))


def layer_and_grads(spec: str, tokens: int = 40, seed: int = 0):
    torch.manual_seed(seed)
    linear = nn.Linear(64, 32)
    layer = MicroscalingLinear.from_float(linear, spec)
    x = torch.randn(tokens, 64, requires_grad=True)
    out = layer(x)
    g = torch.randn_like(out)
    out.backward(g)
    return linear, x, out, g


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mxfp8_forward_and_both_gradients_quantize_along_the_reduced_dim(rounding):
    spec = "mxfp8" if rounding == "rceil" else "mxfp8/floor"
    linear, x, out, g = layer_and_grads(spec)
    w, b = linear.weight.detach(), linear.bias.detach()
    assert torch.equal(out.detach(), mx(x, rounding=rounding) @ mx(w, rounding=rounding).t() + b)
    # input gradient: g @ W reduces over the 32 outputs: g by rows, W by columns
    expected_gx = mx(g, rounding=rounding) @ mx(w.t(), rounding=rounding).t()
    assert torch.equal(x.grad, expected_gx)
    # weight gradient: g^T @ x reduces over the 40 tokens, zero-padded to 64
    gt, xt = pad_tokens(g.t()), pad_tokens(x.detach().t())
    expected_gw = mx(gt, rounding=rounding) @ mx(xt, rounding=rounding).t()
    assert torch.equal(linear.weight.grad, expected_gw)


def test_the_bias_is_kept_and_trains():
    """torchao's MXFP8 training path dropped the Linear's bias; here it is added after the
    block-scaled matmul and gets its gradient."""
    linear, x, out, g = layer_and_grads("mxfp8")
    no_bias = MicroscalingLinear.from_float(nn.Linear(64, 32, bias=False), "mxfp8")
    no_bias.weight = linear.weight
    assert torch.equal(out.detach(), no_bias(x).detach() + linear.bias.detach())
    assert torch.equal(linear.bias.grad, g.sum(0))


def test_mxfp6_and_mxfp4_layers_use_their_element_formats():
    for spec, element in (("mxfp6/e3m2", "e3m2"), ("mxfp4", "e2m1")):
        linear, x, out, _ = layer_and_grads(spec)
        w, b = linear.weight.detach(), linear.bias.detach()
        assert torch.equal(out.detach(), mx(x, element) @ mx(w, element).t() + b)


def test_nvfp4_forward_and_gradients_in_1x16_blocks():
    linear, x, out, g = layer_and_grads("nvfp4", tokens=24)
    w, b = linear.weight.detach(), linear.bias.detach()
    assert torch.equal(out.detach(), nv(x) @ nv(w).t() + b)
    assert torch.equal(x.grad, nv(g) @ nv(w.t()).t())
    gt, xt = pad_tokens(g.t(), 16), pad_tokens(x.detach().t(), 16)
    assert torch.equal(linear.weight.grad, nv(gt) @ nv(xt).t())


def test_nvfp4_2d_weight_tiles_serve_the_forward_and_the_input_gradient():
    linear, x, out, g = layer_and_grads("nvfp4/2d", tokens=16)
    w, b = linear.weight.detach(), linear.bias.detach()
    w_tiles = nv(w, two_d=True)
    assert torch.equal(out.detach(), nv(x) @ w_tiles.t() + b)
    assert torch.equal(x.grad, nv(g) @ w_tiles)


def test_nvfp4_rht_transforms_the_weight_gradient_inputs_along_the_tokens():
    linear, x, out, g = layer_and_grads("nvfp4/rht", tokens=16)
    q = hadamard_16()
    assert torch.allclose(q @ q.t(), torch.eye(16), atol=1e-6)  # orthogonal
    gt, xt = g.t() @ q, x.detach().t() @ q  # 16 tokens: one Hadamard block
    assert torch.equal(linear.weight.grad, nv(gt) @ nv(xt).t())
    # the transform leaves the exact product alone: close to the unrotated float one
    exact = g.t() @ x.detach()
    assert (linear.weight.grad - exact).norm() / exact.norm() < 0.2


def test_nvfp4_forward_rht_rotates_both_forward_operands():
    linear, x, out, _ = layer_and_grads("nvfp4/fwd-rht", tokens=16)
    w, b = linear.weight.detach(), linear.bias.detach()

    def rot(t):
        return (t.reshape(t.shape[0], -1, 16) @ hadamard_16()).reshape(t.shape)

    assert torch.equal(out.detach(), nv(rot(x.detach())) @ nv(rot(w)).t() + b)


@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4/2d:rht:sr", "mxfp8"])
def test_a_batch_of_no_tokens_runs_forward_and_backward(spec):
    # NVFP4's tensor amax was torch's amax() of an empty tensor: a RuntimeError
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    layer = MicroscalingLinear.from_float(linear, spec)
    x = torch.zeros(0, 64, requires_grad=True)
    out = layer(x)
    assert out.shape == (0, 32)
    out.sum().backward()
    assert x.grad.shape == (0, 64)
    assert torch.equal(linear.weight.grad, torch.zeros(32, 64))
    mode, _, options = spec.partition("/")
    config = MicroscalingConfig.parse(mode, options or None)
    assert fake_quantize(torch.zeros(3, 0), config).shape == (3, 0)
    assert nv(torch.zeros(0, 16)).shape == (0, 16)


def test_changing_the_hadamard_matrix_handed_out_changes_no_transform():
    _, _, before, _ = layer_and_grads("nvfp4/fwd-rht", tokens=16)
    q = hadamard_16()
    expected = q.clone()
    q.zero_()  # was the cached matrix itself: every later transform became 0
    assert torch.equal(hadamard_16(), expected)
    _, _, after, _ = layer_and_grads("nvfp4/fwd-rht", tokens=16)
    assert torch.equal(after, before)


def test_stochastic_rounding_of_gradients_follows_the_seed():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x, g = torch.randn(16, 64), torch.randn(16, 32)

    def grad_x(spec, seed):
        layer = MicroscalingLinear.from_float(linear, spec)
        xi = x.clone().requires_grad_()
        out = layer(xi)
        torch.manual_seed(seed)
        out.backward(g)
        return xi.grad

    a, b, c = grad_x("nvfp4/sr", 1), grad_x("nvfp4/sr", 1), grad_x("nvfp4/sr", 2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # round to nearest: the gradient of `test_nvfp4_forward_and_gradients_in_1x16_blocks`
    assert torch.equal(grad_x("nvfp4", 1), grad_x("nvfp4", 2))
    assert torch.equal(grad_x("nvfp4", 1), nv(g) @ nv(linear.weight.t()).t())


def test_under_bf16_autocast_the_output_and_gradients_take_the_right_dtypes():
    torch.manual_seed(0)
    layer = MicroscalingLinear.from_float(nn.Linear(64, 32), "mxfp8")
    x = torch.randn(8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("spec", ["mxfp8", "nvfp4"])
def test_a_float64_input_inside_autocast_gives_float64_as_nn_linear_does(spec):
    """Found by a review: inside bfloat16 autocast, a float64 input came out in bfloat16,
    where nn.Linear returns float64 (autocast leaves float64 alone)."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32).double()
    layer = MicroscalingLinear.from_float(linear, spec)
    x = torch.randn(8, 64, dtype=torch.float64)
    outside = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x).dtype == torch.float64
        inside = layer(x)
    assert inside.dtype == torch.float64 and torch.equal(inside, outside)


def test_a_non_finite_gradient_stays_non_finite_for_the_loss_scaler():
    torch.manual_seed(0)
    layer = MicroscalingLinear.from_float(nn.Linear(64, 32), "mxfp8")
    x = torch.randn(8, 64, requires_grad=True)
    g = torch.ones(8, 32)
    g[0, 0] = float("inf")
    layer(x).backward(g)
    assert not torch.isfinite(x.grad).all() and not torch.isfinite(layer.weight.grad).all()


@pytest.mark.parametrize("spec", ["mxfp8/floor", "nvfp4/2d:rht:sr"])
def test_a_small_mlp_trains(spec):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    mixprec.quantize(model, spec)
    assert all(isinstance(m, MicroscalingLinear) for m in (model[0], model[2]))
    x, y = torch.randn(32, 32), torch.randn(32, 32)
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(15):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_layers_that_do_not_fill_blocks_and_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="in_features=48 is not a multiple of the block size 32"):
        MicroscalingLinear(48, 64, config="mxfp8")
    with pytest.raises(TypeError, match="MicroscalingConfig or a mode name"):
        MicroscalingLinear(64, 64, config=8)
    layer = MicroscalingLinear(64, 32, config=MicroscalingConfig("nvfp4", two_d=True))
    with pytest.raises(ValueError, match="last dim is 64"):
        layer(torch.randn(4, 32))
    assert "format='nvfp4/2d'" in repr(layer)


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_a_gradient_penalty_on_the_input_gradient_raises(mode):
    """A WGAN-GP critic with only its head block-scaled: the penalty's gradient starts from
    ``out.sum()``, so the head's backward received a gradient needing no graph, and the
    penalty added exactly nothing to the head's weight gradient (1.23 in float32) without a
    word. Differentiating through the head's backward now raises, naming the layer."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 32))
    mixprec.quantize(critic, mode, filter="2")
    assert isinstance(critic[2], MicroscalingLinear)
    x = torch.randn(8, 64, requires_grad=True)
    (g,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
    penalty = 10 * (g.norm(dim=1) - 1).pow(2).mean()
    with pytest.raises(RuntimeError, match="MicroscalingLinear has no second derivative"):
        penalty.backward()


@pytest.mark.parametrize("config", ["mxfp8", "nvfp4"])
def test_a_second_derivative_raises_instead_of_missing_terms(config):
    """A gradient penalty through a MicroscalingLinear went through its backward's block
    rounding, which passes no gradient: the weight's gradient lacked those terms without a
    word. First-order gradients taken with create_graph=True are unchanged."""
    torch.manual_seed(0)
    layer = MicroscalingLinear.from_float(nn.Linear(32, 32), config=config)
    x = torch.randn(4, 32, requires_grad=True)
    (plain,) = torch.autograd.grad(layer(x).pow(2).sum(), x)
    (penalty,) = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
    assert torch.equal(penalty, plain)
    with pytest.raises(RuntimeError, match="has no second derivative"):
        penalty.pow(2).sum().backward()


@pytest.mark.parametrize("config", ["nvfp4/sr", "nvfp4/2d:rht:sr"])
def test_stochastic_rounding_and_the_hadamard_transform_compile_to_one_graph(config):
    """``torch.compile(fullgraph=True)`` failed inside dynamo: for stochastic rounding on the
    check of the noise's values (data-dependent), for the Hadamard transform on the random
    generator its first call created and the cache it filled. Compiled whole, forward and
    backward equal eager's bit for bit from the same seed."""
    torch.manual_seed(0)
    layer = MicroscalingLinear.from_float(nn.Linear(32, 32), config=config)
    x = torch.randn(16, 32)

    def run(module):
        torch.manual_seed(1)
        xx = x.clone().requires_grad_(True)
        out = module(xx)
        out.pow(2).sum().backward()
        grads = (xx.grad, layer.weight.grad.clone(), layer.bias.grad.clone())
        layer.zero_grad(set_to_none=True)
        return out.detach(), grads

    eager = run(layer)
    compiled = run(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    assert torch.equal(eager[0], compiled[0])
    for a, b in zip(eager[1], compiled[1], strict=True):
        assert torch.equal(a, b)


def test_activation_checkpointing_gives_the_plain_gradients():
    """The backward reads its saved tensors once: non-reentrant checkpointing refuses a
    second unpack."""
    torch.manual_seed(0)
    layer = MicroscalingLinear.from_float(nn.Linear(32, 32), config="mxfp8")
    x = torch.randn(8, 32, requires_grad=True)
    layer(x).pow(2).sum().backward()
    plain = (x.grad.clone(), layer.weight.grad.clone())
    x.grad, layer.weight.grad = None, None
    out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    out.pow(2).sum().backward()
    assert torch.equal(x.grad, plain[0]) and torch.equal(layer.weight.grad, plain[1])


IMPORTED_UNDER_FLOAT64 = """
import json
import torch
torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
import mixprec
torch.set_default_dtype(torch.float32)
from torch import nn
from mixprec.quantize.microscaling import MicroscalingLinear, hadamard_16
ran = {}
for spec in ("nvfp4/fwd-rht", "nvfp4/rht"):
    torch.manual_seed(0)
    layer = MicroscalingLinear.from_float(nn.Linear(32, 32), config=spec)
    x = torch.randn(16, 32, requires_grad=True)
    layer(x).sum().backward()
    ran[spec] = bool(torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all())
print(json.dumps({"dtype": str(hadamard_16().dtype), "ran": ran}))
"""


@pytest.mark.slow
def test_the_hadamard_matrix_is_float32_when_mixprec_is_imported_under_float64():
    """Found by a review: the random Hadamard matrix, built at import with
    ``torch.ones(1, 1)``, took torch's default dtype then: mixprec imported under float64
    (common in scientific code) made it float64, and every ``nvfp4/fwd-rht`` and
    ``nvfp4/rht`` layer raised (float32 blocks times a float64 matrix). Float32 always."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", IMPORTED_UNDER_FLOAT64],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"dtype": "torch.float32", "ran": {"nvfp4/fwd-rht": True, "nvfp4/rht": True}}


@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4/fwd-rht", "nvfp4/2d:rht:sr"])
def test_an_nvfp4_layer_gives_the_same_numbers_whatever_the_default_dtype(spec):
    """Found by a review: under '64-true' (which sets torch's default dtype to float64 in
    the forward and backward) an nvfp4 layer's tensor scales were computed in float64 and
    its outputs differed from the same layer's outside it (9 of 20 seeds); its stochastic
    rounding drew float64 noise. The same numbers, bit for bit, under any default."""

    def run(default: torch.dtype) -> list[torch.Tensor]:
        grads = []
        for seed in range(3):
            torch.manual_seed(seed)
            linear = nn.Linear(64, 32).double()
            layer = MicroscalingLinear.from_float(linear, spec)
            x = torch.randn(16, 64, dtype=torch.float64, requires_grad=True)
            with default_dtype(default):
                out = layer(x)
                out.backward(torch.ones_like(out))
            grads += [out.detach(), x.grad, linear.weight.grad]
        return grads

    want = run(torch.float32)
    for default in (torch.float64, torch.bfloat16, torch.float16):
        for got, expected in zip(run(default), want, strict=True):
            assert got.dtype == torch.float64 and torch.equal(got, expected), default
