"""Loss scalers against torch.amp.GradScaler (issue 16): nested outputs, resuming from its
state dict, and argument/state validation."""

import math

import pytest
import torch
import torch.nn.functional as F
from nets import mlp

from mixprec.optim.scaling import DynamicLossScaler, NoLossScaler, StaticLossScaler, as_loss_scaler


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)) for _ in range(n)]


def test_scale_accepts_nested_outputs_like_grad_scaler():
    ours, ref = DynamicLossScaler(2.0), torch.amp.GradScaler("cpu", init_scale=2.0)
    outputs = (torch.ones(1), [torch.full((2,), 3.0)])
    scaled, expected = ours.scale(outputs), ref.scale(outputs)
    assert type(scaled) is tuple and type(scaled[1]) is list
    assert torch.equal(scaled[0], expected[0]) and torch.equal(scaled[1][0], expected[1][0])
    scaled_dict = ours.scale({"a": torch.ones(2), "b": [torch.ones(1)]})
    assert torch.equal(scaled_dict["a"], torch.full((2,), 2.0))
    assert torch.equal(scaled_dict["b"][0], torch.full((1,), 2.0))
    assert ours.scaled_since_update
    assert NoLossScaler().scale(outputs) is outputs
    with pytest.raises(TypeError, match="tensor or lists, tuples or dicts"):
        ours.scale("loss")


def test_resume_from_a_torch_grad_scaler_checkpoint():
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(_batches(7)):
        ref.scale(F.mse_loss(model(x), y)).backward()
        if step == 1:
            model[0].bias.grad[0] = math.nan
        ref.step(opt)
        ref.update()
        opt.zero_grad()
    saved = ref.state_dict()
    assert (saved["scale"], saved["_growth_tracker"]) == (1024.0, 1)  # 512 then grown once

    ours = DynamicLossScaler(min_scale=0.0, max_scale=math.inf)  # other settings: replaced
    ours.load_state_dict(saved)
    assert (ours.loss_scale, ours.growth_interval, ours.growth_factor) == (1024.0, 4, 2.0)
    for flag in [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]:  # continue both, same flags
        ref_flag = torch.tensor(flag)
        torch._amp_update_scale_(
            ref._scale, ref._growth_tracker, ref_flag, 2.0, 0.5, ref._growth_interval
        )
        ours.update(torch.tensor(flag))
        assert ours.loss_scale == ref.get_scale()
    assert ours.state_dict()["growth_tracker"] == ref.state_dict()["_growth_tracker"]


def test_a_grad_scaler_scale_past_the_bounds_loads_at_the_nearest_bound():
    """GradScaler grows without bound: a scale past max_scale loaded as it was, its first
    step ran past the bound and a checkpoint saved then was refused by the same loader."""
    grown = torch.amp.GradScaler("cpu", init_scale=2.0**26).state_dict()
    ours = DynamicLossScaler()  # (max_scale 2**24)
    ours.load_state_dict(grown)
    assert ours.loss_scale == ours.max_scale == 2.0**24
    DynamicLossScaler().load_state_dict(ours.state_dict())
    low = DynamicLossScaler(min_scale=4.0)
    low.load_state_dict(torch.amp.GradScaler("cpu", init_scale=0.5).state_dict())
    assert low.loss_scale == 4.0


def test_states_from_a_disabled_or_foreign_scaler_are_refused_clearly():
    disabled = torch.amp.GradScaler("cpu", enabled=False).state_dict()
    assert disabled == {}
    with pytest.raises(ValueError, match="disabled torch.amp.GradScaler"):
        DynamicLossScaler().load_state_dict(disabled)
    NoLossScaler().load_state_dict(disabled)  # nothing to restore, nothing lost
    torch_state = torch.amp.GradScaler("cpu").state_dict()
    with pytest.raises(ValueError, match="loads into a DynamicLossScaler"):
        StaticLossScaler(8.0).load_state_dict(torch_state)
    with pytest.raises(ValueError, match="not a loss scaler state"):
        DynamicLossScaler().load_state_dict({"lr": 0.1})
    with pytest.raises(ValueError, match="missing"):
        DynamicLossScaler().load_state_dict({"kind": "dynamic", "scale": 2.0})
    with pytest.raises(TypeError, match="is a dict"):
        DynamicLossScaler().load_state_dict([1.0])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"growth_interval": 1.5}, TypeError, "growth_interval must be an integer"),
        ({"growth_interval": True}, TypeError, "growth_interval must be an integer"),
        ({"growth_interval": 0}, ValueError, "growth_interval must be >= 1"),
        ({"hysteresis": 2.0}, TypeError, "hysteresis must be an integer"),
        ({"max_skips_at_min_scale": 0}, ValueError, "max_skips_at_min_scale must be >= 1"),
        ({"growth_factor": "2"}, TypeError, "growth_factor must be a real number"),
        ({"growth_factor": math.inf}, ValueError, "finite number > 1"),
        ({"growth_factor": math.nan}, ValueError, "finite number > 1"),
        ({"backoff_factor": 1.0}, ValueError, r"in \(0, 1\)"),
        ({"init_scale": math.nan}, ValueError, "positive finite"),
        ({"init_scale": None}, TypeError, "init_scale must be a real number"),
        ({"min_scale": -1.0}, ValueError, "0 <= min_scale"),
    ],
)
def test_scaler_arguments_are_validated(kwargs, error, match):
    with pytest.raises(error, match=match):
        DynamicLossScaler(**kwargs)


def test_integral_arguments_of_other_int_types_are_accepted():
    import numpy as np

    scaler = DynamicLossScaler(growth_interval=np.int64(3), hysteresis=2)
    assert scaler.growth_interval == 3 and type(scaler.growth_interval) is int


def test_a_tensor_initial_scale_is_taken_as_torch_grad_scaler_and_jmp_take_it():
    """DynamicLossScaler(torch.tensor(2.0**15)) raised TypeError: torch.amp.GradScaler and jmp
    take a tensor scale. The scale state stays a float32 0-d tensor on the tensor's device."""
    reference = torch.amp.GradScaler("cpu", init_scale=torch.tensor(2.0**15), growth_interval=2)
    scaler = DynamicLossScaler(torch.tensor(2.0**15), growth_interval=2, min_scale=0.0)
    assert scaler.loss_scale == reference.get_scale() == 32768.0
    assert scaler.scale_tensor.dtype == torch.float32 and scaler.scale_tensor.shape == ()
    assert scaler.device == torch.device("cpu") and scaler.init_scale == 32768.0
    assert type(scaler.state_dict()["init_scale"]) is float  # a checkpoint holds no tensor
    for overflow in (True, False, False, True):
        scaler.update(torch.tensor(float(overflow)), overflow)
    assert scaler.loss_scale == 16384.0  # halved, grown after 2 clean steps, halved again
    # one element of any floating dtype, with or without autograd history
    wide = DynamicLossScaler(torch.tensor([1024.0], dtype=torch.float64, requires_grad=True))
    assert wide.loss_scale == 1024.0 and wide.scale_tensor.dtype == torch.float32
    static = StaticLossScaler(torch.tensor(8.0, dtype=torch.bfloat16))
    assert static.loss_scale == 8.0 and static.scale_tensor.dtype == torch.float32
    chosen = as_loss_scaler(torch.tensor(64.0), needs_scaling=True)
    assert type(chosen) is StaticLossScaler and chosen.loss_scale == 64.0


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (torch.tensor([2.0, 4.0]), ValueError, r"one value: a 0-d or one-element tensor.*\(2,\)"),
        (torch.tensor(1024), TypeError, "floating tensor of one element, got a torch.int64"),
        (torch.tensor(math.inf), ValueError, "positive finite number.*got inf"),
        (torch.tensor(math.nan), ValueError, "positive finite number.*got nan"),
        (torch.tensor(0.0), ValueError, "positive finite number.*got 0.0"),
        (torch.tensor(-8.0), ValueError, "positive finite number.*got -8.0"),
        # finite in float64, inf in the float32 the scale is kept in
        (torch.tensor(1e39, dtype=torch.float64), ValueError, "float32.*got 1e\\+39"),
        (1e39, ValueError, "float32.*got 1e\\+39"),
    ],
)
def test_a_bad_initial_scale_is_refused_by_every_scaler(value, error, match):
    with pytest.raises(error, match=match):
        DynamicLossScaler(value, min_scale=0.0, max_scale=math.inf)
    with pytest.raises(error, match=match):
        StaticLossScaler(value)


@pytest.mark.parametrize(
    ("make", "change", "message"),
    [
        (lambda: StaticLossScaler(1024.0), {"scale": 0.0}, "scale must be a positive finite"),
        (lambda: DynamicLossScaler(), {"scale": -4.0}, "scale must be a positive finite"),
        (lambda: DynamicLossScaler(), {"scale": math.inf}, "scale must be a positive finite"),
        (lambda: DynamicLossScaler(), {"growth_factor": -2.0}, "growth_factor must be"),
        (lambda: DynamicLossScaler(), {"backoff_factor": 3.0}, "backoff_factor must be in"),
        (lambda: DynamicLossScaler(), {"growth_interval": 0}, "growth_interval"),
        (lambda: DynamicLossScaler(), {"hysteresis": 0}, "hysteresis"),
        (lambda: DynamicLossScaler(), {"scale": 2.0**30}, "scale 1073741824.0 is outside"),
        (lambda: DynamicLossScaler(), {"steps": -1}, "steps must be an int >= 0"),
    ],
)
def test_a_saved_scaler_state_is_checked_as_the_constructor_checks(make, change, message):
    """Before: a mixprec scaler state loaded whatever it held: a static scale of 0 skipped
    every step and then advised lowering the scale, a backoff factor of 3 grew the scale on
    every overflow."""
    scaler = make()
    with pytest.raises(
        ValueError, match="invalid '(static|dynamic)' loss scaler state: " + message
    ):
        scaler.load_state_dict({**make().state_dict(), **change})
    assert scaler.state_dict() == make().state_dict()  # (nothing loaded)


def test_a_torch_grad_scaler_state_with_an_infinite_scale_is_refused():
    state = torch.amp.GradScaler("cpu").state_dict()
    with pytest.raises(ValueError, match="invalid torch.amp.GradScaler state"):
        DynamicLossScaler().load_state_dict({**state, "scale": math.inf})


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("growth_tracker", -5, "growth_tracker must be an int >= 0"),
        ("credits", 1.5, "credits must be an int >= 0"),
        ("credits", 3, r"credits must be at most hysteresis \(2\)"),
        ("last_overflow_step", "a", "last_overflow_step must be None or an int >= 0"),
    ],
)
def test_a_saved_state_with_a_bad_counter_is_refused_and_changes_nothing(key, value, message):
    """A negative or past-the-interval growth tracker, a fractional credit count or a
    non-int overflow step loaded silently (the tracker past the interval froze growth)."""
    saved = DynamicLossScaler(8.0, growth_interval=4, hysteresis=2).state_dict()
    scaler = DynamicLossScaler(2.0)
    with pytest.raises(ValueError, match=message):
        scaler.load_state_dict({**saved, key: value})
    assert scaler.state_dict() == DynamicLossScaler(2.0).state_dict()


@pytest.mark.parametrize("ours", [True, False])
def test_a_saved_tracker_past_its_interval_grows_at_the_next_clean_step(ours):
    """torch's update grows only when the tracker reaches the interval exactly: a state
    whose tracker is past it (its interval lowered mid-run, here or in a GradScaler) was
    taken as it was, and the scale never grew again. It is taken as the interval less one,
    with a warning: the next clean step grows."""
    if ours:
        state = {**DynamicLossScaler(8.0, growth_interval=3).state_dict(), "growth_tracker": 7}
    else:
        state = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3).state_dict()
        state["_growth_tracker"] = 7
    scaler = DynamicLossScaler(growth_interval=3)
    with pytest.warns(UserWarning, match=r"growth tracker \(7\) is past its growth_interval"):
        scaler.load_state_dict(state)
    assert scaler.state_dict()["growth_tracker"] == 2
    scaler.update(torch.tensor(0.0), False)
    assert scaler.loss_scale == 16.0


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_lowering_the_growth_interval_past_the_clean_run_grows_at_the_next_clean_step(hysteresis):
    """With the interval lowered below the clean steps already counted, torch's update never
    grew again while the host's copy grew every step, and the clamps and the divergence check
    read that copy: the scale fell below min_scale. Now both grow at the next clean step."""
    scaler = DynamicLossScaler(8.0, growth_interval=10, hysteresis=hysteresis, min_scale=4.0)
    clean, bad = torch.tensor(0.0), torch.tensor(1.0)
    for _ in range(6):
        scaler.update(clean, False)
    scaler.growth_interval = 3
    assert scaler.state_dict()["growth_tracker"] == 2
    scaler.update(clean, False)
    assert scaler.loss_scale == 16.0 and scaler.state_dict()["growth_tracker"] == 0
    for _ in range(4 * hysteresis):
        scaler.update(bad, True)
    assert scaler.loss_scale == 4.0 and scaler._at_floor()


def test_a_scaler_pickled_while_its_settings_were_attributes_unpickles():
    """The settings became properties over ``_<name>``: a scaler pickled before (its interval
    in ``growth_interval``, its bounds in ``max_scale``...) failed at its first update with
    AttributeError."""
    state = dict(DynamicLossScaler(8.0, growth_interval=5, max_scale=64.0).__dict__)
    for name in ("growth_interval", "init_scale", "growth_factor", "backoff_factor"):
        state[name] = state.pop(f"_{name}")
    for name in ("hysteresis", "min_scale", "max_scale"):
        state[name] = state.pop(f"_{name}")
    old = DynamicLossScaler.__new__(DynamicLossScaler)
    old.__setstate__(state)
    assert old.growth_interval == 5 and old.max_scale == 64.0 and old.init_scale == 8.0
    for _ in range(5):
        old.update(torch.tensor(0.0), False)
    assert old.loss_scale == 16.0
