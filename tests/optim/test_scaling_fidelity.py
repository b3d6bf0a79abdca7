"""Fidelity with torch.amp.GradScaler (issue 16): the same steps give the same parameters and
scales, bit for bit, in the cases where mixprec used to differ."""

import math

import pytest
import torch
import torch.nn.functional as F
from nets import mlp
from torch import nn

from mixprec import Precision
from mixprec.optim import LossScaleOptimizer, joint_step
from mixprec.optim.scaling import DynamicLossScaler


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)) for _ in range(n)]


def _torch_like(init_scale: float = 2.0**10, growth_interval: int = 3) -> DynamicLossScaler:
    """A DynamicLossScaler set to follow torch.amp.GradScaler exactly."""
    return DynamicLossScaler(
        init_scale, growth_interval=growth_interval, min_scale=0.0, max_scale=math.inf
    )


def _two_optimizers(model: nn.Sequential) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    return (
        torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9),
        torch.optim.Adam(model[2].parameters(), lr=0.01),
    )


# which layer's gradient overflows at which step (shared backward, two optimizers)
_POISON = {2: 2, 5: 0, 6: 2, 9: 0, 10: 2}


@pytest.mark.parametrize("via", ["precision", "joint_step"])
def test_shared_backward_skips_only_the_overflowing_optimizer_like_grad_scaler(via):
    ref_model, our_model = mlp(), mlp()
    ref_a, ref_b = _two_optimizers(ref_model)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    precision = Precision("32-true", scaler=_torch_like())
    our_model, a, b = precision.setup(our_model, *_two_optimizers(our_model))
    for step, (x, y) in enumerate(_batches(14)):
        ref.scale(F.mse_loss(ref_model(x), y)).backward()
        precision.backward(F.mse_loss(our_model(x), y))
        if step in _POISON:
            ref_model[_POISON[step]].weight.grad[0, 0] = math.inf
            our_model[_POISON[step]].weight.grad[0, 0] = math.inf
        ref.step(ref_a)
        ref.step(ref_b)
        ref.update()
        stepped = precision.step(a, b) if via == "precision" else joint_step(a, b)
        assert stepped is (step not in _POISON)
        assert a.step_was_skipped is (_POISON.get(step) == 0)
        assert b.step_was_skipped is (_POISON.get(step) == 2)
        assert precision.scaler.loss_scale == ref.get_scale()
        for p, q in zip(ref_model.parameters(), our_model.parameters(), strict=True):
            assert torch.equal(p, q)
        for opt in (ref_a, ref_b, a, b):
            opt.zero_grad()
    assert precision.scaler.stats().steps == 14
    assert precision.scaler.stats().skipped_steps == len(_POISON)


def test_several_losses_scaled_together_backpropagate_like_grad_scaler():
    ref_model, our_model = mlp(), mlp()
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = LossScaleOptimizer(torch.optim.SGD(our_model.parameters(), lr=0.1), _torch_like(2.0**8))
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    for model, scale in ((ref_model, ref.scale), (our_model, opt.scaler.scale)):
        out = model(x)
        torch.autograd.backward(scale([F.mse_loss(out, y), out.square().mean()]))
    ref.step(ref_opt)
    ref.update()
    assert opt.step()
    for p, q in zip(ref_model.parameters(), our_model.parameters(), strict=True):
        assert torch.equal(p, q)


class _AmpAwareSGD(torch.optim.Optimizer):
    """A custom optimizer of the `_step_supports_amp_scaling` kind that reads the attributes
    torch.amp sets (as fused optimizers do) and does plain SGD."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr: float):
        super().__init__(params, {"lr": lr})
        self.seen: list[tuple[object, float]] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.seen.append((self.grad_scale, float(self.found_inf)))
        if self.found_inf:
            return
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad if self.grad_scale is None else p.grad / self.grad_scale
                p.add_(grad, alpha=-group["lr"])


@pytest.mark.parametrize("manual_unscale", [True, False])
def test_amp_aware_optimizer_sees_grad_scale_and_found_inf_like_torch(manual_unscale):
    """torch.amp's protocol both ways: after a manual unscale `grad_scale` is None; without
    one the gradients stay scaled and the optimizer gets the scale to divide by itself."""
    ref_model, our_model = mlp(), mlp()
    ref_opt = _AmpAwareSGD(ref_model.parameters(), lr=0.1)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**6)
    ours = LossScaleOptimizer(_AmpAwareSGD(our_model.parameters(), lr=0.1), _torch_like(2.0**6))
    for step, (x, y) in enumerate(_batches(4)):
        ref.scale(F.mse_loss(ref_model(x), y)).backward()
        ours.backward(F.mse_loss(our_model(x), y))
        if step == 1:
            ref_model[2].bias.grad[1] = math.inf
            our_model[2].bias.grad[1] = math.inf
        if manual_unscale:
            ref.unscale_(ref_opt)
            ours.unscale_()
        ref.step(ref_opt)
        ref.update()
        assert ours.step() is (step != 1)
        for opt in (ref_opt, ours.optimizer):
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
            opt.zero_grad()
        for p, q in zip(ref_model.parameters(), our_model.parameters(), strict=True):
            assert torch.equal(p, q)

    def seen(opt: _AmpAwareSGD) -> list[tuple[float | None, float]]:
        return [(None if g is None else float(g), f) for g, f in opt.seen]

    scales = [None] * 4 if manual_unscale else [64.0, 64.0, 32.0, 32.0]
    expected = list(zip(scales, [0.0, 1.0, 0.0, 0.0], strict=True))
    assert seen(ours.optimizer) == seen(ref_opt) == expected


def test_fused_optimizers_skip_one_by_one_on_device_like_grad_scaler():
    """Two fused AdamW (they skip inside their kernel, the flag read after the step)."""

    def adams(model: nn.Sequential) -> list[torch.optim.Optimizer]:
        return [torch.optim.AdamW(model[i].parameters(), lr=1e-2, fused=True) for i in (0, 2)]

    ref_model, our_model = mlp(), mlp()
    ref_opts = adams(ref_model)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    scaler = _torch_like()
    ours = [LossScaleOptimizer(opt, scaler) for opt in adams(our_model)]
    for step, (x, y) in enumerate(_batches(12)):
        ref.scale(F.mse_loss(ref_model(x), y)).backward()
        scaler.scale(F.mse_loss(our_model(x), y)).backward()
        if step in _POISON:
            ref_model[_POISON[step]].bias.grad[0] = math.nan
            our_model[_POISON[step]].bias.grad[0] = math.nan
        for opt in ref_opts:
            ref.step(opt)
        ref.update()
        assert joint_step(*ours) is (step not in _POISON)
        assert [o.step_was_skipped for o in ours] == [_POISON.get(step) == i for i in (0, 2)]
        assert scaler.loss_scale == ref.get_scale()
        for p, q in zip(ref_model.parameters(), our_model.parameters(), strict=True):
            assert torch.equal(p, q)
        for opt in [*ref_opts, *ours]:
            opt.zero_grad()
