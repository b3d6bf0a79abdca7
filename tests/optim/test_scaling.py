"""Loss scalers: exact parity with torch.amp.GradScaler, backoff/growth, hysteresis, bounds,
divergence, state round-trips, and real float16 gradients."""

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nets import mlp

from mixprec.optim import LossScaleOptimizer
from mixprec.optim.scaling import (
    DynamicLossScaler,
    LossScaleDivergedError,
    NoLossScaler,
    StaticLossScaler,
    as_loss_scaler,
)

INF, NAN = float("inf"), float("nan")


def _flag(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _trajectory(scaler: DynamicLossScaler, overflows: list[bool]) -> list[float]:
    out = []
    for o in overflows:
        scaler.update(_flag(float(o)), o)
        out.append(scaler.loss_scale)
    return out


@pytest.mark.parametrize(
    ("growth_interval", "steps", "make_opt"),
    [
        (3, 400, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)),
        (2000, 2300, lambda p: torch.optim.Adam(p, lr=1e-3)),
    ],
)
def test_matches_torch_grad_scaler_exactly(growth_interval, steps, make_opt):
    """Same gradients, injected inf/NaN: identical scale and parameters after every step."""
    ref_model, our_model = mlp(4, 8, 1), mlp(4, 8, 1)
    ref_opt, our_opt = make_opt(ref_model.parameters()), make_opt(our_model.parameters())
    ref = torch.amp.GradScaler("cpu", growth_interval=growth_interval)
    ours = LossScaleOptimizer(
        our_opt,
        DynamicLossScaler(growth_interval=growth_interval, min_scale=0.0, max_scale=math.inf),
    )
    gen = torch.Generator().manual_seed(1)
    skipped = 0
    for step in range(steps):
        x = torch.randn(16, 4, generator=gen)
        y = torch.randn(16, 1, generator=gen)
        inject = {7: INF, 8: NAN, 9: -INF}.get(step % 50)
        for model, backward in (
            (ref_model, lambda loss: ref.scale(loss).backward()),
            (our_model, ours.backward),
        ):
            loss = torch.nn.functional.mse_loss(model(x), y)
            backward(loss)
            if inject is not None:
                model[0].weight.grad[0, step % 4] = inject
        ref.step(ref_opt)
        ref.update()
        stepped = ours.step()
        skipped += not stepped
        assert ours.loss_scale == ref.get_scale(), f"scale differs at step {step}"
        for a, b in zip(ref_model.parameters(), our_model.parameters(), strict=True):
            assert torch.equal(a, b), f"parameters differ at step {step}"
        ref_opt.zero_grad()
        ours.zero_grad()
    assert skipped >= 3 * (steps // 50)
    # the short interval drives the scale up to float32's limit, where growth stops
    # before producing inf and the scaled loss itself overflows: natural overflows too
    assert ours.scaler.stats().skipped_steps == skipped


def test_backoff_and_growth_exact_values():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    assert _trajectory(s, [True, False, False, False, False, True, True]) == [
        512.0, 512.0, 512.0, 1024.0, 1024.0, 512.0, 256.0,
    ]  # fmt: skip
    st = s.stats()
    assert (st.steps, st.skipped_steps, st.consecutive_skips, st.last_overflow_step) == (7, 3, 2, 6)


def test_hysteresis_spends_credits_then_backs_off_and_refills_on_growth():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=2, hysteresis=3)
    traj = _trajectory(s, [True, True, True, True, False, False, True, True, True])
    # two credits spent without change, the third overflow halves, then every overflow
    # halves until the scale grows (after 2 clean steps), which refills the 3 credits
    assert traj == [1024.0, 1024.0, 512.0, 256.0, 256.0, 512.0, 512.0, 512.0, 256.0]


class _BranchFree(DynamicLossScaler):
    """Always takes the on-device path that serves hysteresis > 1."""

    def _update_scale(self, found_inf, overflow):
        self._update_with_hysteresis(found_inf)
        self._scale.clamp_(self.min_scale, self.max_scale)


@pytest.mark.parametrize("growth, backoff", [(2.0, 0.5), (1.1, 0.9), (3.0, 0.3)])
def test_branch_free_update_equals_torch_update_at_hysteresis_one(growth, backoff):
    """Bit for bit, with factors float32 cannot hold too: each product in float64, rounded
    once, as torch's kernel (the factor rounded to float32 first gave 3.3000002 for 3 *
    1.1 where torch gives 3.2999999)."""
    overflows = [i % 7 == 0 or i % 11 == 0 for i in range(400)]
    kwargs = dict(init_scale=2.0**100, growth_interval=3, min_scale=0.0, max_scale=math.inf)
    kwargs.update(growth_factor=growth, backoff_factor=backoff)
    assert _trajectory(_BranchFree(**kwargs), overflows) == _trajectory(
        DynamicLossScaler(**kwargs), overflows
    )


def test_min_and_max_bounds():
    s = DynamicLossScaler(init_scale=4.0, min_scale=2.0, max_scale=8.0, growth_interval=1)
    assert _trajectory(s, [False, False, False, True, True, True]) == [8.0, 8.0, 8.0, 4.0, 2.0, 2.0]


def test_growth_never_reaches_float32_inf():
    s = DynamicLossScaler(init_scale=2.0**126, growth_interval=1, max_scale=math.inf)
    assert _trajectory(s, [False, False, False]) == [2.0**127, 2.0**127, 2.0**127]


def test_divergence_error_at_min_scale():
    s = DynamicLossScaler(init_scale=8.0, min_scale=2.0, max_skips_at_min_scale=3)
    _trajectory(s, [True, True])  # 8 -> 4 -> 2: now at the floor
    _trajectory(s, [True, True])  # two overflows at the floor: still allowed
    with pytest.raises(LossScaleDivergedError, match="mixprec doctor") as err:
        s.update(_flag(1.0), True)
    assert "3 consecutive steps" in str(err.value)
    # a clean step at the floor resets the count
    s2 = DynamicLossScaler(init_scale=2.0, min_scale=2.0, max_skips_at_min_scale=2)
    _trajectory(s2, [True, False, True, False, True])


@pytest.mark.parametrize("hysteresis", [1, 2])
@pytest.mark.parametrize("min_scale", [0.1, 1 / 3, 1e-3])
def test_divergence_is_detected_at_a_min_scale_float32_cannot_hold(min_scale, hysteresis):
    """The scale rests on min_scale rounded to float32 (0.1 -> 0.10000000149), which the
    float64 comparison never took for the floor: it skipped forever instead of raising."""
    s = DynamicLossScaler(1.0, hysteresis=hysteresis, min_scale=min_scale)
    with pytest.raises(LossScaleDivergedError):
        _trajectory(s, [True] * 100)
    assert s.loss_scale == float(torch.tensor(min_scale, dtype=torch.float32))


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_update_takes_a_flag_of_any_dtype_and_refuses_others_before_counting(hysteresis):
    """A bool/float64/int flag raised inside torch's update kernel (hysteresis=1) after the
    step had been counted; a flag of shape (1,) broke the hysteresis update the same way."""
    for flag in (torch.tensor(True), torch.tensor(1.0, dtype=torch.float64), torch.tensor(3)):
        s = DynamicLossScaler(8.0, hysteresis=hysteresis)
        s.update(flag)
        assert s.stats().skipped_steps == 1
        assert s.loss_scale == (4.0 if hysteresis == 1 else 8.0)  # hysteresis 2: a credit spent
    s = DynamicLossScaler(8.0, hysteresis=hysteresis)
    s.update(torch.tensor([0.0]))
    assert s.stats().steps == 1 and s._growth_tracker.item() == 1
    for bad, error in ((torch.tensor([1.0, 0.0]), ValueError), (1.0, TypeError)):
        with pytest.raises(error, match="found_inf must be a one-element tensor"):
            s.update(bad)
        assert s.stats().steps == 1  # nothing counted


def test_static_scaler_never_moves_and_diverges_after_n_skips():
    s = StaticLossScaler(128.0, max_skips_at_min_scale=4)
    assert _trajectory(s, [False] * 5 + [True] * 3) == [128.0] * 8
    with pytest.raises(LossScaleDivergedError):
        s.update(_flag(1.0), True)


def test_static_divergence_says_to_lower_the_scale_not_that_lowering_cannot_help():
    """A static scale too large overflows every step, and a smaller one fixes it; the error
    said "A smaller scale cannot help", the dynamic scaler's reason at its floor."""
    s = StaticLossScaler(2.0**20, max_skips_at_min_scale=2)
    with pytest.raises(LossScaleDivergedError) as err:
        _trajectory(s, [True, True])
    message = str(err.value)
    assert "static loss scale 1.04858e+06" in message and "scaler='dynamic'" in message
    assert "cannot help" not in message and "mixprec doctor" in message


def test_no_loss_scaler_is_identity():
    s = NoLossScaler()
    loss = torch.tensor(3.0)
    g = torch.tensor([INF, 1.0])
    assert s.scale(loss) is loss
    assert s.unscale_([g]).item() == 0.0 and g[0].item() == INF
    s.update(_flag(0.0))
    assert (s.loss_scale, s.stats().steps, s.enabled) == (1.0, 1, False)


def test_unscale_real_float16_bfloat16_float32_grads_in_one_call():
    s = StaticLossScaler(1024.0)
    fp16 = torch.tensor([1024.0, 2048.0], dtype=torch.float16)
    bf16 = torch.tensor([512.0], dtype=torch.bfloat16)
    fp32 = torch.tensor([3072.0])
    found = s.unscale_([fp16, bf16, fp32])
    assert found.item() == 0.0 and found.dtype == torch.float32 and found.dim() == 0
    assert fp16.tolist() == [1.0, 2.0] and bf16.item() == 0.5 and fp32.item() == 3.0
    # float16 overflow: 60000 * 2 does not fit in float16 and becomes inf
    big = torch.tensor([60000.0], dtype=torch.float16) * 2
    assert s.unscale_([fp32, big]).item() > 0


def test_sparse_gradients_are_unscaled_through_their_values():
    s = StaticLossScaler(4.0)
    g = torch.sparse_coo_tensor([[0, 2]], [8.0, 4.0], (3,), check_invariants=True)
    assert s.unscale_([g]).item() == 0.0
    assert g.to_dense().tolist() == [2.0, 0.0, 1.0]


def test_fp16_underflow_survives_with_scaling():
    """d(loss)/dw = 1e-4 * 1e-4 flushes to zero in float16; scaled it survives."""

    def grad_of_w(scaler):
        w = torch.ones(4, dtype=torch.float16, requires_grad=True)
        x = torch.full((4,), 1e-4, dtype=torch.float16)
        loss = (w * x).sum() * torch.tensor(1e-4, dtype=torch.float16)
        scaler.scale(loss).backward()
        grad = w.grad.float()  # unscale in float32, as master weights do
        scaler.unscale_([grad])
        return grad

    assert torch.count_nonzero(grad_of_w(NoLossScaler())) == 0
    # the seed gradient of a float16 loss is the scale itself, so keep it below 65504
    survived = grad_of_w(DynamicLossScaler(init_scale=2.0**14))
    torch.testing.assert_close(survived, torch.full((4,), 1e-8), rtol=2e-3, atol=0)


def test_state_dict_round_trip_before_first_step_and_mid_run():
    fresh = DynamicLossScaler(init_scale=256.0, growth_interval=5, hysteresis=2)
    restored = DynamicLossScaler()
    with pytest.warns(UserWarning, match=r"growth_interval 5 \(built with 2000\), hysteresis 2"):
        restored.load_state_dict(fresh.state_dict())
    assert restored.loss_scale == 256.0 and restored.hysteresis == 2

    overflows = [False, True, True, False, False, True, False]
    a = DynamicLossScaler(init_scale=256.0, growth_interval=3, hysteresis=2)
    _trajectory(a, overflows[:4])
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert _trajectory(a, overflows[4:] * 3) == _trajectory(b, overflows[4:] * 3)
    assert a.stats() == b.stats()


def test_a_static_scaler_keeps_the_scale_it_was_built_with_and_says_so():
    """A static scale is a setting: a run resumed with the scale lowered (as
    `LossScaleDivergedError` advises) trained on at the checkpoint's, unsaid. The built one
    is kept, the counters are the checkpoint's, and a warning names both scales."""
    saved = StaticLossScaler(1024.0)
    _trajectory(saved, [False, True, False])
    lowered = StaticLossScaler(8.0)
    with pytest.warns(UserWarning, match="built with, 8, is kept over the checkpoint's 1024"):
        lowered.load_state_dict(saved.state_dict())
    counters = {k: v for k, v in saved.state_dict().items() if k != "scale"}
    assert lowered.loss_scale == 8.0
    assert {k: v for k, v in lowered.state_dict().items() if k != "scale"} == counters
    same = StaticLossScaler(1024.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the settings it was built with: nothing to say)
        same.load_state_dict(saved.state_dict())


def test_loading_another_kind_of_state_is_refused():
    with pytest.raises(ValueError, match="'static'"):
        DynamicLossScaler().load_state_dict(StaticLossScaler(8.0).state_dict())


def test_as_loss_scaler_choices():
    assert isinstance(as_loss_scaler(None, needs_scaling=True), DynamicLossScaler)
    assert isinstance(as_loss_scaler(None, needs_scaling=False), NoLossScaler)
    assert as_loss_scaler(64, needs_scaling=False).loss_scale == 64.0
    assert isinstance(as_loss_scaler("none", needs_scaling=True), NoLossScaler)
    s = DynamicLossScaler()
    assert as_loss_scaler(s, needs_scaling=False) is s
    with pytest.raises(ValueError, match="unknown loss scaler"):
        as_loss_scaler("fast", needs_scaling=True)
    with pytest.raises(ValueError):
        DynamicLossScaler(init_scale=0.5, min_scale=1.0)


def test_a_scaler_of_another_type_is_refused_with_what_is_accepted():
    """The refusal named only the type; it now lists the accepted values and says how a
    torch.amp.GradScaler's state carries over."""
    with pytest.raises(TypeError, match="'dynamic', 'none', a number .* a LossScaler instance"):
        as_loss_scaler([1.0], needs_scaling=True)
    with pytest.raises(TypeError, match="load its state_dict"):
        as_loss_scaler(torch.amp.GradScaler("cpu"), needs_scaling=True)


class _AlwaysClamped(DynamicLossScaler):
    """The update as it was before the host mirror: the kernel, then a clamp every step."""

    def _update_scale(self, found_inf, overflow):
        torch._amp_update_scale_(
            self._scale,
            self._growth_tracker,
            found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )
        self._scale.clamp_(self.min_scale, self.max_scale)

    def _at_floor(self):
        return bool(self._scale <= self._scale.new_tensor(self.min_scale))


@given(
    overflows=st.lists(st.booleans(), min_size=1, max_size=60),
    init=st.sampled_from([1.0, 3.0, 1000.0, 2.0**16, 1e30]),
    growth=st.sampled_from([2.0, 1.5, 1.1, 3.0]),
    backoff=st.sampled_from([0.5, 0.25, 0.9, 0.3]),
    interval=st.integers(1, 4),
    bounds=st.sampled_from([(0.0, math.inf), (1.0, 2.0**24), (0.1, 7.0e3), (3.0, 1e30)]),
    reload_at=st.integers(0, 60),
)
@settings(max_examples=60, deadline=None)
def test_the_host_mirror_follows_the_device_scale_exactly(
    overflows, init, growth, backoff, interval, bounds, reload_at
):
    """The scale the host mirrors (for the floor and the bounds, so that a clean step reads
    nothing) is the device's, bit for bit, through odd factors, bounds and a reload of the
    state half-way; the clamp runs only where a bound binds yet the scales never differ."""
    low, high = bounds
    init = min(max(init, low), high)
    kwargs = dict(
        init_scale=init,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
        min_scale=low,
        max_scale=high,
        max_skips_at_min_scale=10**6,
    )
    ours, ref = DynamicLossScaler(**kwargs), _AlwaysClamped(**kwargs)
    for i, o in enumerate(overflows):
        if i == reload_at:
            state = ours.state_dict()
            ours = DynamicLossScaler(**kwargs)
            ours.load_state_dict(state)
        ours.update(_flag(float(o)), o)
        ref.update(_flag(float(o)), o)
        assert ours._mirror() == (ref.loss_scale, int(ref._growth_tracker))
        assert ours.loss_scale == ref.loss_scale
        assert ours._at_floor() == ref._at_floor()


def test_a_step_without_backward_neither_counts_nor_grows_the_scale():
    """A step with no backward since the last one (no gradient at all) counted as a clean
    step: three of them grew the scale eightfold at growth_interval=1. It is a step of
    nothing now, the scaler left alone; gradients kept from before (the zeros of
    zero_grad(set_to_none=False)) are refused saying so."""
    import mixprec
    from mixprec.optim.scaling import DynamicLossScaler

    model = torch.nn.Linear(4, 2)
    precision = mixprec.Precision(
        "16-mixed", allow_slow=True, scaler=DynamicLossScaler(init_scale=2.0**8, growth_interval=1)
    )
    model, optimizer = precision.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        precision.step(optimizer)
    assert precision.scaler.loss_scale == 2.0**8 and precision.scaler.stats().steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with precision.forward_context():
        loss = model(torch.randn(3, 4)).float().sum()
    precision.backward(loss)
    precision.step(optimizer)
    assert precision.scaler.loss_scale == 2.0**9  # a real step still grows it
    optimizer.zero_grad(set_to_none=False)
    with pytest.raises(RuntimeError, match="no backward ran through it since the last step"):
        precision.step(optimizer)
