"""LossScaleOptimizer on real float16 arithmetic: skipping, clipping, accumulation, several
optimizers, fused AdamW, the scheduler gate, master weights and exact resume."""

import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from nets import mlp
from torch import nn

import mixprec
from mixprec.optim import (
    LossScaleOptimizer,
    OptState,
    SkipAwareScheduler,
    follow_steps,
    joint_step,
    master_weights_by_name,
    scheduler_step,
)
from mixprec.optim.scaling import DynamicLossScaler, NoLossScaler, StaticLossScaler
from mixprec.optim.wrapper import TAKEN_SINCE

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32


def _batches(n: int, seed: int = 0, size: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 1, generator=gen)
    out = []
    for _ in range(n):
        x = torch.randn(size, 8, generator=gen)
        out.append((x, torch.tanh(x @ w) + 0.01 * torch.randn(size, 1, generator=gen)))
    return out


def _all_finite(tensors) -> bool:
    return all(torch.isfinite(t).all() for t in tensors)


def _adam_state_tensors(opt: LossScaleOptimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def test_overflowing_scale_skips_backs_off_and_never_corrupts():
    """A scale too large for float16 makes the fp16 backward overflow: steps are skipped,
    the scale halves each time, and no inf/NaN reaches a parameter or Adam's state."""
    model = mlp(8, 16, 1)
    opt = LossScaleOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        DynamicLossScaler(init_scale=2.0**24, max_scale=2.0**24, growth_interval=1000),
    )
    taken = []
    for x, y in _batches(30):
        with torch.autocast("cpu", dtype=f16):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        opt.backward(loss)
        taken.append(opt.step())
        assert opt.step_was_skipped is not taken[-1]
        assert _all_finite(model.parameters()) and _all_finite(_adam_state_tensors(opt))
        opt.zero_grad()
    skips = taken.count(False)
    assert skips >= 4 and taken[:skips] == [False] * skips and all(taken[skips:])
    assert opt.loss_scale == 2.0**24 / 2**skips
    assert opt.scaler.stats().skipped_steps == skips


def test_recovers_and_grows_after_growth_interval_clean_steps():
    model = mlp(8, 16, 1)
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), DynamicLossScaler(2.0**8, growth_interval=4)
    )
    scales = []
    for i, (x, y) in enumerate(_batches(10)):
        opt.backward(F.mse_loss(model(x), y))
        if i == 1:
            model[0].bias.grad[0] = math.inf
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scale)
    assert scales == [256.0, 128.0, 128.0, 128.0, 128.0, 256.0, 256.0, 256.0, 256.0, 512.0]


def test_clipping_after_unscale_equals_clipping_fp32_gradients():
    ref, ours = mlp(8, 16, 1), mlp(8, 16, 1)
    opt = LossScaleOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1), StaticLossScaler(2.0**12))
    x, y = _batches(1)[0]
    F.mse_loss(ref(x), y).backward()
    ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    opt.backward(F.mse_loss(ours(x), y))
    opt.unscale_()
    opt.unscale_()  # idempotent within a step
    our_norm = nn.utils.clip_grad_norm_(opt.params_with_grads(), 0.05)
    assert torch.equal(ref_norm, our_norm)  # power-of-two scaling is exact in float32
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    with pytest.raises(RuntimeError, match="after unscale_"):
        opt.backward(F.mse_loss(ours(x), y))
    opt.zero_grad()  # clears the gradients and the step's unscale with them
    opt.backward(F.mse_loss(ours(x), y))
    assert opt.step()


def test_gradient_accumulation_unscales_once_per_step():
    full, micro = mlp(8, 16, 1), mlp(8, 16, 1)
    ref_opt = torch.optim.SGD(full.parameters(), lr=0.1)
    opt = LossScaleOptimizer(torch.optim.SGD(micro.parameters(), lr=0.1))
    calls = []
    unscale = opt.scaler.unscale_
    opt.scaler.unscale_ = lambda grads: calls.append(1) or unscale(grads)
    for x, y in _batches(5, size=64):
        F.mse_loss(full(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
            opt.backward(F.mse_loss(micro(xs), ys) / 4)
        assert opt.step()
        opt.zero_grad()
    assert len(calls) == 5
    for a, b in zip(full.parameters(), micro.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_two_optimizers_share_one_scaler_and_skip_only_the_overflowing_one():
    model = mlp(8, 16, 1)
    scaler = DynamicLossScaler(init_scale=2.0**10)
    opt_a = LossScaleOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), scaler)
    opt_b = LossScaleOptimizer(torch.optim.Adam(model[2].parameters(), lr=0.1), scaler)
    before = copy.deepcopy(model.state_dict())
    (x, y), (x2, y2) = _batches(2)
    opt_a.backward(F.mse_loss(model(x), y))
    model[2].weight.grad[0, 0] = math.nan  # only optimizer b sees it
    assert joint_step(opt_a, opt_b) is False  # not every optimizer stepped
    assert not opt_a.step_was_skipped and opt_b.step_was_skipped
    after = model.state_dict()
    assert not torch.equal(before["0.weight"], after["0.weight"])
    assert torch.equal(before["2.weight"], after["2.weight"])
    assert (scaler.loss_scale, scaler.stats().steps) == (512.0, 1)  # one update, not two
    opt_a.zero_grad()
    opt_b.zero_grad()

    opt_a.backward(F.mse_loss(model(x2), y2))
    assert joint_step(opt_a, opt_b) is True
    assert not any(torch.equal(before[k], v) for k, v in model.state_dict().items())
    opt_a.zero_grad()
    opt_b.zero_grad()

    # stepping them one by one after one backward would unscale b with a changed scale
    opt_a.backward(F.mse_loss(model(x), y))
    opt_a.step()
    with pytest.raises(RuntimeError, match="joint_step"):
        opt_b.step()


def test_two_optimizers_unscaled_by_a_clip_and_stepped_one_by_one_are_refused():
    """One backward, both unscaled (a clip over the model), then a.step(), b.step(): b's
    stage was UNSCALED, so nothing noticed a's step had updated the shared scaler since, and
    the scale moved once per optimizer (growing twice as fast, b's overflow undone by a's
    growth). Refused as stepping one by one without the clip is."""
    model = mlp(8, 16, 1)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2)
    opt_a = LossScaleOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), scaler)
    opt_b = LossScaleOptimizer(torch.optim.SGD(model[2].parameters(), lr=0.1), scaler)
    (x, y), (x2, y2) = _batches(2)
    opt_a.backward(F.mse_loss(model(x), y))
    opt_a.unscale_()
    opt_b.unscale_()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = model[2].weight.detach().clone()
    assert opt_a.step()
    with pytest.raises(RuntimeError, match=r"unscaled .* before another optimizer's step"):
        opt_b.step()
    assert torch.equal(model[2].weight, before) and scaler.stats().steps == 1
    # together after the same clip: one update
    for opt in (opt_a, opt_b):
        opt.zero_grad()
    opt_a.backward(F.mse_loss(model(x2), y2))
    opt_a.unscale_()
    opt_b.unscale_()
    assert joint_step(opt_a, opt_b) and scaler.stats().steps == 2


def test_two_optimizers_with_their_own_backward_step_one_by_one():
    """GAN-style: each optimizer has its own backward; each step is one scaler iteration."""
    model = mlp(8, 16, 1)
    scaler = DynamicLossScaler(init_scale=2.0**10)
    opt_a = LossScaleOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), scaler)
    opt_b = LossScaleOptimizer(torch.optim.SGD(model[2].parameters(), lr=0.1), scaler)
    for x, y in _batches(3):
        for opt in (opt_a, opt_b):
            opt.zero_grad()
            opt.backward(F.mse_loss(model(x), y))
            assert opt.step()
    assert scaler.stats().steps == 6


@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_fused_adamw_matches_grad_scaler_exactly(explicit_unscale):
    ref_model, our_model = mlp(8, 16, 1), mlp(8, 16, 1)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    our_opt = torch.optim.AdamW(our_model.parameters(), lr=1e-2, fused=True)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    ours = LossScaleOptimizer(
        our_opt, DynamicLossScaler(2.0**10, growth_interval=3, min_scale=0, max_scale=math.inf)
    )
    for step, (x, y) in enumerate(_batches(40)):
        ref.scale(F.mse_loss(ref_model(x), y)).backward()
        ours.backward(F.mse_loss(our_model(x), y))
        if step % 9 == 4:
            ref_model[0].weight.grad[1, 1] = math.inf
            our_model[0].weight.grad[1, 1] = math.inf
        if explicit_unscale:
            ref.unscale_(ref_opt)
            ours.unscale_()
        ref.step(ref_opt)
        ref.update()
        assert ours.step() is (step % 9 != 4)
        assert ours.loss_scale == ref.get_scale()
        for a, b in zip(ref_model.parameters(), our_model.parameters(), strict=True):
            assert torch.equal(a, b)
        assert _all_finite(_adam_state_tensors(ours))
        ref_opt.zero_grad()
        ours.zero_grad()
    steps = {int(s["step"]) for s in our_opt.state.values()}
    assert steps == {40 - 4}  # the 4 skipped steps do not count in Adam's bias correction


def test_fused_sgd_with_momentum_skipping_its_first_step_trains_as_unfused_sgd():
    """Fused SGD makes its momentum buffers (uninitialised) before its kernel, which a skip
    leaves unwritten: a skipped first step (16-mixed's usual overflow) left garbage that
    every later step read, and the weights went to inf. It is skipped on the host."""
    models = [mlp(8, 16, 1), mlp(8, 16, 1)]
    opts = [
        LossScaleOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=f))
        for m, f in zip(models, (False, True), strict=True)
    ]
    for step, (x, y) in enumerate(_batches(6)):
        for model, opt in zip(models, opts, strict=True):
            opt.backward(F.mse_loss(model(x), y))
            if step == 0:
                model[0].weight.grad[0, 0] = math.inf  # (the first step overflows)
            assert opt.step() is (step != 0)
            opt.zero_grad()
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("reset", ["load", "clear", "momentum set"])
def test_fused_sgd_skipping_after_its_momentum_buffers_went_trains_as_unfused_sgd(reset):
    """Once every momentum buffer existed, fused SGD's skips went to its kernel for good:
    after a load of a state saved before the first step, a ``state.clear()``, or momentum
    set on a group that had none, the buffers were made again uninitialised by a skipped
    step (weights about 1e36 off)."""
    models = [mlp(8, 16, 1), mlp(8, 16, 1)]
    momentum = 0.0 if reset == "momentum set" else 0.9
    opts = [
        LossScaleOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum, fused=f))
        for m, f in zip(models, (False, True), strict=True)
    ]
    saved = [copy.deepcopy(opt.state_dict()) for opt in opts]
    for step, (x, y) in enumerate(_batches(8)):
        for model, opt, state in zip(models, opts, saved, strict=True):
            if step == 3:  # (two clean steps first: every buffer made)
                if reset == "load":
                    opt.load_state_dict(copy.deepcopy(state))
                elif reset == "clear":
                    opt.optimizer.state.clear()
                else:
                    opt.param_groups[0]["momentum"] = 0.9
                junk = [torch.full((16, 8), 1e30) for _ in range(20)]  # (freed memory dirty)
                del junk
            opt.backward(F.mse_loss(model(x), y))
            if step == 3:
                model[0].weight.grad[0, 0] = math.inf
            assert opt.step() is (step != 3)
            opt.zero_grad()
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        torch.testing.assert_close(a, b)


def test_scheduler_does_not_advance_on_skipped_steps():
    model = mlp(8, 16, 1)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), StaticLossScaler(8.0))
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
    advanced = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for i, (x, y) in enumerate(_batches(6)):
            opt.backward(F.mse_loss(model(x), y))
            if i in (0, 3):
                model[0].weight.grad.fill_(math.nan)
            opt.step()
            advanced.append(scheduler_step(sched, opt))
            opt.zero_grad()
    assert advanced == [False, True, True, False, True, True]
    assert opt.param_groups[0]["lr"] == 0.5**4


def test_scheduler_gate_also_takes_the_plain_optimizer_a_wrapper_steps():
    model = mlp(8, 16, 1)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    opt = LossScaleOptimizer(inner, StaticLossScaler(8.0))
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    advanced = []
    for i, (x, y) in enumerate(_batches(3)):
        opt.backward(F.mse_loss(model(x), y))
        if i == 1:
            model[0].weight.grad.fill_(math.inf)
        opt.step()
        advanced.append(scheduler_step(sched, inner))
        opt.zero_grad()
    assert advanced == [True, False, True]
    assert inner.param_groups[0]["lr"] == 0.25


def test_a_gated_scheduler_counts_the_taken_steps_since_its_last_step():
    """Stepped once a window, it advances when a step of the window was taken (it asked
    only about the window's last step); stepped before any optimizer step, it advances as
    torch's does; `follow_steps` on the plain optimizer before the wrapper exists counts."""
    model = mlp(8, 16, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    window = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    follow_steps(window, sgd)  # before setup, on the plain optimizer
    opt = LossScaleOptimizer(sgd, StaticLossScaler(8.0))
    at_start = SkipAwareScheduler(torch.optim.lr_scheduler.LambdaLR(sgd, lambda s: 1.0), opt)
    assert at_start.step()  # before any optimizer step: nothing was skipped
    advanced = []
    for i, (x, y) in enumerate(_batches(6)):
        opt.backward(F.mse_loss(model(x), y))
        if i in (1, 4, 5):  # the first window's last step; the whole second window
            model[0].weight.grad.fill_(math.inf)
        opt.step()
        opt.zero_grad()
        if i % 3 == 1 or i == 5:
            advanced.append(scheduler_step(window, opt))
    assert advanced == [True, True, False]  # steps (0, 1), (2, 3), (4, 5)
    state = window.state_dict()  # the count goes with the scheduler's state
    assert state[TAKEN_SINCE] == 0


def test_a_loaded_scheduler_counts_the_step_before_its_first_gated_step():
    """A scheduler loaded from a checkpoint (its count 0) is followed from its first gated
    step on: the step just before it, taken, counts (it held, one step behind for the rest
    of a resumed run); skipped, it does not."""

    def run(skip: set[int], resume_at: int | None) -> tuple[list[bool], float]:
        model = mlp(8, 16, 1)
        opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), StaticLossScaler(8.0))
        sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
        advanced = []
        for i, (x, y) in enumerate(_batches(5)):
            if i == resume_at:
                saved = sched.state_dict()
                sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
                sched.load_state_dict(saved)
            opt.backward(F.mse_loss(model(x), y))
            if i in skip:
                model[0].weight.grad.fill_(math.inf)
            opt.step()
            advanced.append(scheduler_step(sched, opt))
            opt.zero_grad()
        return advanced, opt.param_groups[0]["lr"]

    for skip in (set(), {2}, {3}):
        assert run(skip, 2) == run(skip, None)
    assert run({2}, 2)[0] == [True, True, False, True, True]


@pytest.mark.parametrize("resume_at", [1, 3, 4, 6, 7])
def test_a_scheduler_resumed_inside_its_window_counts_every_step_taken_since_the_load(resume_at):
    """A scheduler gated every three steps, resumed inside its window with the optimizer
    from the same checkpoint: its first gated step after the load added the last step only,
    so a window whose last step was skipped but an earlier one after the load was taken held
    (the learning rate one decay behind for the rest of the run; a user's loop as
    docs/precision.md writes it). The steps taken since the optimizer's state was loaded
    count: the resumed run advances as the uninterrupted one."""

    def run(resume: bool) -> tuple[list[bool], float]:
        torch.manual_seed(0)
        model = mlp(8, 16, 1)
        opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), StaticLossScaler(8.0))
        sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
        advanced = []
        for i, (x, y) in enumerate(_batches(9)):
            if resume and i == resume_at:  # (fresh objects, each loaded from a checkpoint)
                saved = {"opt": opt.state_dict(), "sched": sched.state_dict()}
                opt = LossScaleOptimizer(
                    torch.optim.SGD(model.parameters(), lr=1.0), StaticLossScaler(8.0)
                )
                sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
                opt.load_state_dict(saved["opt"])
                sched.load_state_dict(saved["sched"])
            opt.backward(F.mse_loss(model(x), y))
            if i in (5, 8):  # the windows (3, 4, 5) and (6, 7, 8) end on a skip
                model[0].weight.grad.fill_(math.inf)
            opt.step()
            opt.zero_grad()
            if i % 3 == 2:
                advanced.append(scheduler_step(sched, opt))
        return advanced, opt.param_groups[0]["lr"]

    assert run(False) == ([True, True, True], 0.125)
    assert run(True) == run(False)


def test_steps_taken_since_load_counts_from_a_load_through_the_wrapper_or_directly():
    """None before any load; a load through the wrapper or into its torch optimizer (as
    Lightning restores optimizers) starts the count at 0; taken steps add, skipped ones
    do not; a deep copy keeps counting its own."""
    model = mlp(8, 16, 1)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), StaticLossScaler(8.0))

    def step(skip: bool = False) -> None:
        x, y = _batches(1)[0]
        opt.backward(F.mse_loss(model(x), y))
        if skip:
            model[0].weight.grad.fill_(math.inf)
        opt.step()
        opt.zero_grad()

    step()
    assert opt.steps_taken_since_load is None
    opt.load_state_dict(opt.state_dict())
    assert opt.steps_taken_since_load == 0
    step(), step(skip=True), step()
    assert opt.steps_taken_since_load == 2
    opt.optimizer.load_state_dict(opt.optimizer.state_dict())
    assert opt.steps_taken_since_load == 0
    step()
    copied = copy.deepcopy(opt)
    assert copied.steps_taken_since_load == 1


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_without_any_gradient_after_a_scaled_backward_is_refused(fused):
    """zero_grad() between backward and step: the step returned True, grew the scale and
    advanced gated schedulers with no weight moved; torch.amp.GradScaler refuses it too."""
    model = mlp(8, 16, 1)
    opt = LossScaleOptimizer(
        torch.optim.AdamW(model.parameters(), fused=fused), DynamicLossScaler(growth_interval=1)
    )
    x, y = _batches(1)[0]
    opt.backward(F.mse_loss(model(x), y))
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="AdamW has no gradient to step.*zero_grad"):
        opt.step()
    assert opt.scaler.loss_scale == 2.0**16


def test_a_joint_step_takes_an_optimizer_without_gradients_beside_one_with_them():
    """A GAN's alternating losses stepped together (the Trainer steps every optimizer so):
    the optimizer the loss reached steps, the other is taken as before; none reached is
    refused."""
    a, b = mlp(8, 16, 1), mlp(8, 16, 1)
    scaler = DynamicLossScaler(growth_interval=1)
    opt_a = LossScaleOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), scaler)
    opt_b = LossScaleOptimizer(torch.optim.SGD(b.parameters(), lr=0.1), scaler)
    x, y = _batches(1)[0]
    before = [p.detach().clone() for p in b.parameters()]
    opt_a.backward(F.mse_loss(a(x), y))
    assert joint_step(opt_a, opt_b)
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before, strict=True))
    assert scaler.loss_scale == 2.0**17
    opt_a.backward(F.mse_loss(a(x), y))
    opt_a.zero_grad()
    with pytest.raises(RuntimeError, match="SGD, SGD have no gradient to step"):
        joint_step(opt_a, opt_b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_parameters_over_one_memory_are_refused_masters(dtype):
    """Two Parameters over one memory each had a float32 master, written back in turn: one
    update was lost (the weights moved by one parameter's step, not both)."""
    flat = torch.zeros(8, dtype=dtype)
    a, b = nn.Parameter(flat[:4]), nn.Parameter(flat.view(2, 4)[0])
    with pytest.raises(ValueError, match=r"over the same memory .* one update lost"):
        LossScaleOptimizer(torch.optim.SGD([a, b], lr=1.0), "none", master_weights=True)
    apart = nn.Parameter(flat[4:])  # (another part of the same buffer: its own memory)
    LossScaleOptimizer(torch.optim.SGD([a, apart], lr=1.0), "none", master_weights=True)


def test_a_parameter_unused_this_step_is_not_updated_by_last_steps_master_gradient():
    # the model's own zero_grad clears the float16 gradients, not the float32 masters'
    torch.manual_seed(0)
    a, b = nn.Linear(2, 2).to(f16), nn.Linear(2, 2).to(f16)
    opt = LossScaleOptimizer(torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1), 8.0)
    x = torch.ones(1, 2, dtype=f16)
    for use_b in (True, False):
        a.zero_grad(), b.zero_grad()
        before = b.weight.detach().clone()
        out = b(a(x)) if use_b else a(x)
        opt.backward(out.float().sum())
        opt.step()
        assert torch.equal(before, b.weight) is not use_b
    # zero_grad(set_to_none=False) on the wrapper keeps zero master gradients, as torch does
    opt.backward(b(a(x)).float().sum())
    opt.step()
    opt.zero_grad(set_to_none=False)
    opt.backward(a(x).float().sum())
    opt.step()
    assert torch.equal(opt.master_params[b.weight].grad, torch.zeros(2, 2))


def test_a_new_wrapper_of_the_same_optimizer_keeps_what_the_last_one_knew():
    """A second wrapper (`Precision.reset()` then `setup`, as the Trainer does per fit, or a
    notebook cell run again) takes over the masters but forgot the model's weights loaded
    since the last step (its first step wrote the old masters over them) and that the
    masters' gradients were the last step's (a parameter unused in its first step moved)."""
    torch.manual_seed(0)
    a, b = nn.Linear(2, 2).to(f16), nn.Linear(2, 2).to(f16)
    sgd = torch.optim.SGD([{"params": a.parameters()}, {"params": b.parameters()}], lr=0.1)
    first = LossScaleOptimizer(sgd, 8.0)
    x = torch.ones(1, 2, dtype=f16)
    first.backward(b(a(x)).float().sum())
    first.step()
    a.zero_grad(), b.zero_grad()  # the modules' own: the masters keep the step's gradients
    with torch.no_grad():
        a.weight.fill_(0.5)  # e.g. the best checkpoint loaded between two fits
    second = LossScaleOptimizer(sgd, 8.0)
    before = b.weight.detach().clone()
    sgd.param_groups[0]["lr"] = 0.0  # a keeps what was loaded
    second.backward(a(x).float().sum())  # b unused
    assert second.step()
    assert torch.equal(a.weight, torch.full((2, 2), 0.5, dtype=f16))
    assert torch.equal(b.weight, before)


def test_pure_float16_with_master_weights_trains_like_float32():
    *data, (x_eval, y_eval) = _batches(151, seed=3)
    ref = mlp(8, 16, 1, seed=1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    half = mlp(8, 16, 1, seed=1, dtype=f16)
    opt = LossScaleOptimizer(torch.optim.Adam(half.parameters(), lr=1e-2))
    assert all(p.dtype == f32 for p in opt.param_groups[0]["params"])  # masters
    assert all(p.dtype == f16 for p in half.parameters())
    for x, y in data:
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.backward(F.mse_loss(half(x.half()).float(), y))
        opt.step()
        opt.zero_grad()
    x, y = x_eval, y_eval
    with torch.no_grad():
        ref_loss = F.mse_loss(ref(x), y).item()
        half_loss = F.mse_loss(half(x.half()).float(), y).item()
        start = F.mse_loss(mlp(8, 16, 1, seed=1)(x), y).item()
    assert half_loss < start / 20
    assert half_loss == pytest.approx(ref_loss, rel=0.02)
    assert all(p.dtype == f16 for p in half.parameters())
    # torch's own scaler refuses this model
    plain = mlp(8, 16, 1, dtype=f16)
    torch_opt = torch.optim.Adam(plain.parameters())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(F.mse_loss(plain(x.half()).float(), y)).backward()
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.step(torch_opt)


def test_master_weights_keep_gradients_and_updates_float16_would_lose():
    w = nn.Parameter(torch.ones(4, dtype=f16))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=1e3), DynamicLossScaler(2.0**14))
    x = torch.full((4,), 1e-4, dtype=f16)
    opt.backward((w * x).sum() * torch.tensor(1e-4, dtype=f16))  # d/dw = 1e-8: fp16 flushes it
    opt.unscale_()
    master = opt.master_params[w]
    torch.testing.assert_close(master.grad, torch.full((4,), 1e-8), rtol=2e-3, atol=0)
    assert opt.step()
    assert torch.all(master < 1.0) and torch.all(w == 1.0)  # 1 - 1e-5 rounds to 1 in fp16


def test_bfloat16_master_weights_accumulate_small_updates():
    w = nn.Parameter(torch.ones(1, dtype=bf16))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=1e-3), NoLossScaler(), master_weights=True)
    plain_w = nn.Parameter(torch.ones(1, dtype=bf16))
    plain = torch.optim.SGD([plain_w], lr=1e-3)
    for _ in range(10):
        opt.backward(w.float().sum())
        opt.step()
        opt.zero_grad()
        plain_w.float().sum().backward()
        plain.step()
        plain.zero_grad()
    assert plain_w.item() == 1.0  # 1 - 1e-3 rounds back to 1 in bfloat16, every time
    assert opt.master_params[w].item() == pytest.approx(0.99, abs=1e-6)
    assert w.item() == torch.tensor(0.99).to(bf16).item()


def _fp16_run(model, opt, batches, inject_at=()):
    for i, (x, y) in enumerate(batches):
        opt.backward(F.mse_loss(model(x.half()).float(), y))
        if i in inject_at:
            model[0].weight.grad[0, 0] = math.inf
        opt.step()
        opt.zero_grad()


def _fp16_setup(seed):
    model = mlp(8, 16, 1, seed=seed, dtype=f16)
    scaler = DynamicLossScaler(2.0**12, growth_interval=3)
    return model, LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), scaler)


def test_save_and_restore_mid_run_continues_bit_identically():
    batches = _batches(12, seed=5)
    straight_model, straight = _fp16_setup(seed=0)
    _fp16_run(straight_model, straight, batches, inject_at=(2, 8))

    model, opt = _fp16_setup(seed=0)
    _fp16_run(model, opt, batches[:6], inject_at=(2,))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed_model, resumed = _fp16_setup(seed=42)  # different init, fresh scaler
    resumed_model.load_state_dict(ckpt["model"])
    resumed.load_state_dict(ckpt["opt"])
    _fp16_run(resumed_model, resumed, batches[6:], inject_at=(2,))

    for a, b in zip(straight_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(straight.master_params.values(), resumed.master_params.values(), strict=True):
        assert torch.equal(a, b)
    assert straight.scaler.stats() == resumed.scaler.stats()
    assert straight.scaler.state_dict() == resumed.scaler.state_dict()


@pytest.mark.parametrize("edit", ["load", "in place"])
def test_a_checkpoint_taken_after_a_write_to_the_model_keeps_the_write(edit):
    """Weights written after the last step (a model state loaded, an in-place edit) reach
    the masters at the next step; a checkpoint taken before it saved the masters stale, so a
    resume (model loaded, then the optimizer) copied the old masters over the written
    weights: the resumed run went 0.53 away from the uninterrupted one."""
    batches = _batches(10, seed=3)
    other = mlp(8, 16, 1, seed=7, dtype=f16).state_dict()

    def write(model):
        if edit == "load":
            model.load_state_dict(other)
        else:
            with torch.no_grad():
                model[0].weight.mul_(0.5)

    straight_model, straight = _fp16_setup(seed=0)
    _fp16_run(straight_model, straight, batches[:4])
    write(straight_model)
    buf = io.BytesIO()
    torch.save({"model": straight_model.state_dict(), "opt": straight.state_dict()}, buf)
    written = {k: v.clone() for k, v in straight_model.state_dict().items()}
    for weight in straight.master_params:
        assert torch.equal(straight.master_params[weight].to(f16), weight)
    _fp16_run(straight_model, straight, batches[4:])

    buf.seek(0)
    ckpt = torch.load(buf)
    resumed_model, resumed = _fp16_setup(seed=42)
    resumed_model.load_state_dict(ckpt["model"])
    resumed.load_state_dict(ckpt["opt"])
    for key, value in resumed_model.state_dict().items():
        assert torch.equal(value, written[key])
    _fp16_run(resumed_model, resumed, batches[4:])
    for a, b in zip(straight_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_dict_before_first_step_and_mismatched_masters():
    model, opt = _fp16_setup(seed=0)
    other_model, other = _fp16_setup(seed=1)
    other.load_state_dict(opt.state_dict())
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), other_model.parameters(), strict=True)
    )
    fp32_opt = LossScaleOptimizer(torch.optim.Adam(mlp(8, 16, 1).parameters()))
    with pytest.raises(ValueError, match="master weights"):
        fp32_opt.load_state_dict(opt.state_dict())


def test_a_step_goes_ready_unscaled_stepped_through_public_parts():
    """The per-step state is an OptState, as torch.amp's; the parts joint_step drives are
    public, and driving them by hand steps and skips exactly as step() does."""
    batches = _batches(3)
    ref_model, ref = _fp16_setup(seed=0)
    model, opt = _fp16_setup(seed=0)
    assert opt.stage is OptState.READY and opt.found_inf is None
    for i, (x, y) in enumerate(batches):
        ref.zero_grad()
        opt.zero_grad()
        assert opt.stage is OptState.READY
        ref.backward(F.mse_loss(ref_model(x.half()).float(), y))
        opt.backward(F.mse_loss(model(x.half()).float(), y))
        if i == 1:
            ref_model[0].bias.grad[0] = math.inf
            model[0].bias.grad[0] = math.inf
        assert ref.step() is (i != 1)
        opt.check_can_step()
        opt.unscale_()
        found = opt.found_inf
        assert opt.stage is OptState.UNSCALED and bool(found) is (i == 1)
        with pytest.raises(RuntimeError, match=r"backward\(\) after unscale_"):
            opt.backward(F.mse_loss(model(x.half()).float(), y))
        if not found:
            opt.take_step(found)
        opt.end_step(not found)
        opt.scaler.update(found)
        assert opt.stage is OptState.STEPPED and opt.found_inf is None
        assert opt.step_was_skipped is (i == 1)
        for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)
        assert ref.scaler.state_dict() == opt.scaler.state_dict()
    assert not opt.skips_in_kernel and not opt.needs_closure
    fused = LossScaleOptimizer(torch.optim.AdamW(mlp(8, 16, 1).parameters(), fused=True))
    assert fused.skips_in_kernel
    assert LossScaleOptimizer(torch.optim.LBFGS(mlp(8, 16, 1).parameters()), "none").needs_closure


def _two_groups(model: nn.Module) -> list[dict]:
    # groups in another order than the model's: masters are matched by name, not position
    return [{"params": list(model[2].parameters())}, {"params": list(model[0].parameters())}]


@pytest.mark.parametrize("saved_dtype", [bf16, f32])
def test_a_checkpoint_of_another_precision_restores_the_masters_by_name(saved_dtype):
    """A float16 run with float32 masters restores from bfloat16 parameters with float32
    masters (master_weights=True) or from float32 parameters: the optimizer's state, and as
    masters the full-precision weights by name (the saved masters, not the bfloat16 weights
    rounded back up); the model follows its masters and the scaler stays as it was."""
    model = mlp(8, 16, 1, dtype=saved_dtype)
    opt = LossScaleOptimizer(
        torch.optim.Adam(_two_groups(model), lr=1e-2), "none", master_weights=True, model=model
    )
    for x, y in _batches(3):
        opt.zero_grad()
        opt.backward(F.mse_loss(model(x.to(saved_dtype)).float(), y))
        assert opt.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=True)
    params = dict(model.named_parameters())
    full = {n: opt.master_params.get(p, p).detach().clone() for n, p in params.items()}
    exp_avg = {n: opt.state[opt.master_params.get(p, p)]["exp_avg"] for n, p in params.items()}

    new_model = mlp(8, 16, 1, seed=5, dtype=f16)
    new = LossScaleOptimizer(
        torch.optim.Adam(_two_groups(new_model), lr=1e-2),
        DynamicLossScaler(2.0**8),
        model=new_model,
    )
    if saved_dtype == f32:
        with pytest.raises(ValueError, match="load_state_dict_across_precisions"):
            new.load_state_dict(ckpt["opt"])
    weights = {**ckpt["model"], **master_weights_by_name(ckpt["opt"], ckpt["model"])}
    without = {k: v for k, v in weights.items() if k != "0.weight"}
    with pytest.raises(ValueError, match=r"parameter 2 \(0\.weight\) .* no entry"):
        new.load_state_dict_across_precisions(ckpt["opt"], without)
    assert not new.state  # nothing was loaded
    new.load_state_dict_across_precisions(ckpt["opt"], weights)
    for n, p in new_model.named_parameters():
        assert p.dtype == f16 and torch.equal(new.master_params[p], full[n])
        assert torch.equal(p, full[n].to(f16))
        assert torch.equal(new.state[new.master_params[p]]["exp_avg"], exp_avg[n])
    assert new.loss_scale == 2.0**8
    rounded = any(not torch.equal(m, ckpt["model"][n].float()) for n, m in full.items())
    assert rounded is (saved_dtype == bf16)


def test_zero_grad_clears_model_grads_and_add_param_group_makes_masters():
    model, opt = _fp16_setup(seed=0)
    x, y = _batches(1)[0]
    opt.backward(F.mse_loss(model(x.half()).float(), y))
    assert all(p.grad is not None for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    extra = nn.Parameter(torch.zeros(3, dtype=f16))
    opt.add_param_group({"params": [extra]})
    assert opt.master_params[extra].dtype == f32
    with pytest.raises(TypeError, match="already wrapped"):
        LossScaleOptimizer(opt)
    assert "master_weights=5" in repr(opt)


def test_a_schedule_free_optimizers_train_and_eval_switch_the_model_through_its_masters():
    """Found by a review: trainers call ``optimizer.train()`` / ``eval()`` where the
    optimizer has them (Hugging Face's, for schedule-free optimizers), and the wrapper had
    none, so the optimizer stayed in eval mode and refused to step. They are forwarded now,
    and the model's bfloat16 parameters take the switched float32 masters."""
    schedulefree = pytest.importorskip("schedulefree")
    torch.manual_seed(0)
    model = nn.Linear(8, 1).to(bf16)
    inner = schedulefree.SGDScheduleFree(model.parameters(), lr=0.1, warmup_steps=0)
    opt = LossScaleOptimizer(inner, scaler=1024.0, master_weights=True)
    opt.train()
    for x, y in _batches(3):
        opt.zero_grad()
        opt.backward(F.mse_loss(model(x.to(bf16)).float(), y))
        assert opt.step()
    trained = [p.detach().clone() for p in model.parameters()]
    for switch in (opt.eval, opt.train):
        switch()
        for p in model.parameters():
            assert torch.equal(p, opt.master_params[p].to(bf16))
    opt.eval()
    assert not any(torch.equal(p, t) for p, t in zip(model.parameters(), trained, strict=True))
    assert not hasattr(LossScaleOptimizer(torch.optim.SGD(nn.Linear(2, 1).parameters())), "eval")


def test_complex_parameters_are_unscaled_and_checked_through_their_real_and_imaginary_parts():
    """torch's fused unscale kernel (torch.amp.GradScaler's too) refuses complex dtypes: the
    step raised NotImplementedError from deep inside. Scaled by a power of two, the steps
    equal unscaled SGD's exactly, and an inf in an imaginary part skips the step."""

    def setup() -> tuple[list[nn.Parameter], torch.Tensor]:
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(4, dtype=torch.complex64))
        b = nn.Parameter(torch.randn(1))
        return [w, b], torch.randn(8, 4, dtype=torch.complex64)

    def loss_of(params: list[nn.Parameter], x: torch.Tensor) -> torch.Tensor:
        w, b = params
        return ((x @ w).abs() ** 2).mean() + (b * w.real.sum()).square().sum()

    ref, x = setup()
    sgd = torch.optim.SGD(ref, lr=0.01)
    params, _ = setup()
    opt = LossScaleOptimizer(torch.optim.SGD(params, lr=0.01), DynamicLossScaler(2.0**10))
    for _ in range(2):
        sgd.zero_grad()
        loss_of(ref, x).backward()
        sgd.step()
        opt.zero_grad()
        opt.backward(loss_of(params, x))
        assert opt.step()
        for p, r in zip(params, ref, strict=True):
            assert torch.equal(p, r)
    before = [p.detach().clone() for p in params]
    opt.zero_grad()
    opt.backward(loss_of(params, x))
    params[0].grad.imag[1] = math.inf
    assert not opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert opt.loss_scale == 2.0**9
    grad = torch.tensor([4 + 8j, -2 + 0.5j])
    assert DynamicLossScaler(4.0).unscale_([grad]).item() == 0
    assert torch.equal(grad, torch.tensor([1 + 2j, -0.5 + 0.125j]))


@pytest.mark.parametrize("write", ["load_state_dict", "init", "row", "data"])
def test_weights_written_after_wrapping_are_kept_by_the_next_step(write):
    """The masters were copied from the model once, at wrapping; weights written into the
    float16 model after that (pretrained weights loaded after setup, an init, a padding row
    zeroed) were undone by the next step, which copies the masters into the model. The
    masters now take what was written: the elements it changed, keeping the float32 bits
    of the others; a step of lr 0 leaves the written weights as they are."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(f16)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 8.0)
    x = torch.randn(5, 4, dtype=f16)
    opt.backward(model(x).float().sum())
    opt.step()  # the masters now hold float32 bits the float16 weights round away
    master = opt.master_params[model.weight]
    kept = master[1:].clone()
    with torch.no_grad():
        if write == "load_state_dict":
            model.load_state_dict({"weight": torch.ones(3, 4, dtype=f16), "bias": model.bias})
        elif write == "init":
            nn.init.constant_(model.weight, 1.0)
        elif write == "row":
            model.weight[0] = 0.0
        else:
            model.weight.data = torch.ones(3, 4, dtype=f16)
    written = model.weight.detach().clone()
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.zero_grad()
    opt.backward(model(x).float().sum())
    opt.step()
    assert torch.equal(model.weight, written)
    if write == "row":  # the other rows keep their float32 bits
        assert torch.equal(master[0], written[0].float()) and torch.equal(master[1:], kept)
    else:
        assert torch.equal(master, written.float())


def test_clipping_a_model_holding_gradients_no_optimizer_unscales_is_refused():
    """precision.clip_grad_norm_(model) unscaled only the optimizers' gradients; one held by
    a parameter no optimizer steps stayed multiplied by the loss scale and dominated the
    norm, clipping every other gradient to almost nothing, silently."""
    from mixprec import Precision

    precision = Precision("32-true", scaler=DynamicLossScaler(init_scale=2.0**16))
    model = mlp(8, 16, 1)
    model, opt = precision.setup(model, torch.optim.SGD(model[0].parameters(), lr=0.1))
    x, y = _batches(1)[0]
    precision.backward(F.mse_loss(model(x), y))
    with pytest.raises(ValueError, match=r"2\.weight, 2\.bias hold gradients .* loss scale"):
        precision.clip_grad_norm_(model, 1.0)
    norm = precision.clip_grad_norm_(opt, 1.0)  # the optimizer's own: unscaled, clipped
    assert torch.isfinite(norm) and norm < 2.0**10


@pytest.mark.parametrize(
    ("spec", "options"),
    [("16-true", {}), ("bf16-true", {"master_weights": True, "scaler": "dynamic"})],
)
def test_a_weight_written_after_the_unscale_is_kept_by_the_step(spec, options):
    """Before: a loss-scaled step with float32 masters took the masters as the unscale
    (or a clip) left them and copied them over the model: a weight written between the
    unscale and the step was undone (without a scaler the step kept it)."""
    torch.manual_seed(0)
    precision = mixprec.Precision(spec, allow_slow=True, **options)
    model = nn.Linear(4, 2)
    model, opt = precision.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    x = torch.randn(3, 4).to(model.weight.dtype)
    precision.backward(model(x).float().pow(2).mean())
    precision.unscale_()
    with torch.no_grad():
        model.weight.zero_()
    assert precision.step(opt)
    assert torch.equal(model.weight, torch.zeros_like(model.weight))


@pytest.mark.parametrize("fused", [False, True])
def test_a_backward_after_check_is_refused(fused):
    """Before: `check_()` in the middle of an accumulation kept its flag, so an inf in a
    later micro-batch went unseen and a fused step applied it (NaN weights, step() True)."""
    model = nn.Linear(2, 1)
    opt = mixprec.LossScaleOptimizer(torch.optim.Adam(model.parameters(), fused=fused), 8.0)
    opt.backward(model(torch.ones(1, 2)).sum())
    opt.check_()
    with pytest.raises(RuntimeError, match=r"backward\(\) after check_\(\) in the same step"):
        opt.backward(model(torch.ones(1, 2)).sum() * float("inf"))
    assert opt.step() and torch.isfinite(model.weight).all()  # (the first micro-batch's)


def test_a_checkpoint_saved_with_a_layer_frozen_loads_with_it_trainable():
    """Before: refused as "saved under another precision policy" (the checkpoint has no
    master for the frozen layer). A layer the saved optimizer never stepped takes its
    master from the model, as a master made now does; a stepped one without a saved master
    is still refused."""

    def make(frozen: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        model[0].requires_grad_(not frozen)
        precision = mixprec.Precision("16-true", allow_slow=True, scaler=16.0)
        model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))
        return model, opt, precision

    model, opt, precision = make(frozen=True)
    precision.backward(model(torch.ones(1, 2, dtype=torch.float16)).float().sum())
    precision.step(opt)
    saved = copy.deepcopy(opt.state_dict())
    thawed, opt2, _ = make(frozen=False)
    thawed.load_state_dict(model.state_dict())
    opt2.load_state_dict(saved)
    masters = opt2.optimizer.param_groups[0]["params"]
    for p, master in zip(thawed.parameters(), masters, strict=True):
        assert master.dtype == torch.float32 and torch.equal(master.half(), p)
    stepped = copy.deepcopy(saved)
    moments = {"exp_avg": torch.zeros(2, 2), "exp_avg_sq": torch.zeros(2, 2)}
    stepped["optimizer"]["state"][0] = {"step": torch.tensor(1.0), **moments}
    with pytest.raises(ValueError, match="master weights for parameters"):
        make(frozen=False)[1].load_state_dict(stepped)


def test_a_step_with_no_backward_since_the_last_update_is_a_skipped_step():
    """zero_grad() then step() with no backward at all: the step returned True, so a gated
    scheduler advanced with no weight moved (torch.amp.GradScaler refuses such a step). It is
    now skipped: False, step_was_skipped, the scheduler and the scale hold."""
    model = mlp(8, 16, 1)
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), "dynamic")
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
    x, y = _batches(1)[0]
    opt.backward(F.mse_loss(model(x), y))
    assert opt.step() and scheduler_step(sched, opt)
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    assert opt.step() is False and opt.step_was_skipped
    assert not scheduler_step(sched, opt)
    assert opt.optimizer.param_groups[0]["lr"] == 0.25
    assert opt.scaler.state_dict()["steps"] == 1 and opt.scaler.loss_scale == 2.0**16
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_reading_the_state_of_a_parameter_the_optimizer_does_not_hold_changes_nothing():
    """Found by a review: with float32 masters, ``opt.state.get(p, {})`` of a frozen layer's
    parameter indexed torch's defaultdict and made an empty entry for it, after which
    ``p in opt.state`` was True and ``state_dict()`` raised KeyError (torch saves no state
    for a tensor in none of its groups). A read now changes nothing, as on torch's own
    optimizer; ``setdefault`` stores its default (not an empty dict) as a dict does, and
    indexing a parameter the optimizer does not hold is a KeyError, not a new entry."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).half()
    model[0].requires_grad_(False)
    trained = list(model[1].parameters())
    opt = LossScaleOptimizer(torch.optim.AdamW(trained, lr=1e-2), scaler=128.0, model=model)
    opt.backward(model(torch.ones(3, 4, dtype=f16)).float().sum())
    assert opt.step()
    frozen = model[0].weight
    assert opt.state.get(frozen, "absent") == "absent" and opt.state.get(frozen) is None
    assert frozen not in opt.state and len(opt.optimizer.state) == 2
    with pytest.raises(KeyError):
        opt.state[frozen]
    assert len(opt.optimizer.state) == 2 and "state" in opt.state_dict()["optimizer"]
    assert int(opt.state.get(trained[0], {})["step"]) == 1
    assert opt.state.setdefault(trained[1], {"x": 1}) is opt.state[trained[1]]
    assert "exp_avg" in opt.state[trained[1]]
    extra = nn.Parameter(torch.zeros(2, dtype=f16))
    opt.add_param_group({"params": [extra]})
    assert opt.state.get(extra) is None and extra not in opt.state
    fresh = {"note": 1}
    assert opt.state.setdefault(extra, fresh) is fresh and opt.state[extra] is fresh
    assert opt.optimizer.state[opt.master_params[extra]] is fresh
