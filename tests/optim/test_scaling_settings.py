"""A dynamic scaler's settings changed after it was built (as a resume's warning invites):
what it saves then loads back, and its scale keeps to the new bounds from the next step."""

import math
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec.optim.scaling import DynamicLossScaler, LossScaleDivergedError

CLEAN, INF = torch.tensor(0.0), torch.tensor(1.0)


def _loads_back(scaler: DynamicLossScaler) -> None:
    state = scaler.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (settings other than a fresh scaler's)
        DynamicLossScaler().load_state_dict(state)
        scaler.load_state_dict(state)


def test_a_lowered_max_scale_takes_the_scale_and_the_initial_scale_down_and_saves_loadably():
    scaler = DynamicLossScaler()  # init 2**16, max 2**24
    scaler.max_scale = 2.0**12
    assert scaler.loss_scale == 2.0**12 and scaler.init_scale == 2.0**12
    _loads_back(scaler)
    for _ in range(3):
        scaler.update(CLEAN, False)
    assert scaler.loss_scale == 2.0**12
    _loads_back(scaler)


def test_a_raised_min_scale_takes_the_scale_up():
    scaler = DynamicLossScaler(4.0, min_scale=1.0)
    scaler.min_scale = 16.0
    assert scaler.loss_scale == 16.0 and scaler.init_scale == 16.0
    scaler.update(INF, True)
    assert scaler.loss_scale == 16.0
    _loads_back(scaler)


def test_lowered_hysteresis_caps_the_unspent_credits():
    scaler = DynamicLossScaler(8.0, hysteresis=3)
    scaler.hysteresis = 1
    assert scaler.state_dict()["credits"] == 1
    _loads_back(scaler)


def test_hysteresis_lowered_to_one_keeps_the_bounds_and_the_floor():
    """The hysteresis update does not mirror the scale on the host; the first update without
    it reads the scale back (its bounds and floor were judged from the scale at build)."""
    scaler = DynamicLossScaler(16.0, growth_interval=1, hysteresis=2, max_scale=64.0)
    for _ in range(4):
        scaler.update(CLEAN, False)
    assert scaler.loss_scale == 64.0
    scaler.hysteresis = 1
    for _ in range(3):
        scaler.update(CLEAN, False)
        assert scaler.loss_scale == 64.0
    _loads_back(scaler)

    scaler = DynamicLossScaler(4.0, hysteresis=2, min_scale=1.0, max_skips_at_min_scale=3)
    for _ in range(4):  # a credit, then 4 -> 2 -> 1
        scaler.update(INF, True)
    assert scaler.loss_scale == 1.0
    scaler.hysteresis = 1
    skips = 0
    with pytest.raises(LossScaleDivergedError):
        for skips in range(1, 10):  # noqa: B007 (read after the raise)
            scaler.update(INF, True)
    assert skips == 2  # the overflow that reached the floor counted, then two more


@pytest.mark.parametrize(
    ("name", "value", "error", "match"),
    [
        ("growth_factor", 1.0, ValueError, "growth_factor must be a finite number > 1"),
        ("backoff_factor", 1.5, ValueError, r"backoff_factor must be in \(0, 1\)"),
        ("hysteresis", 0, ValueError, "hysteresis must be >= 1"),
        ("hysteresis", 1.5, TypeError, "hysteresis must be an integer"),
        ("min_scale", 2.0**30, ValueError, "need 0 <= min_scale <= max_scale"),
        ("max_scale", -1.0, ValueError, "need 0 <= min_scale <= max_scale"),
        ("init_scale", 2.0**30, ValueError, r"init_scale must be within \[min_scale"),
        ("max_skips_at_min_scale", 0, ValueError, "max_skips_at_min_scale must be >= 1"),
        ("max_skips_at_min_scale", "3", TypeError, "max_skips_at_min_scale must be an int"),
    ],
)
def test_a_setting_set_after_building_is_checked_as_the_constructor_checks(
    name, value, error, match
):
    scaler = DynamicLossScaler()
    before = scaler.state_dict()
    with pytest.raises(error, match=match):
        setattr(scaler, name, value)
    assert scaler.state_dict() == before


@pytest.mark.parametrize(
    ("low", "high"), [(0.0, 0.0), (0.0, 1e-50), (1e39, 1e39), (3.40282356e38, 3.5e38)]
)
def test_bounds_leaving_no_positive_finite_float32_scale_are_refused(low, high):
    """The scale is clamped between the bounds: 0 (1e-50 in float32) or inf saved a state
    no load takes."""
    scaler = DynamicLossScaler(min_scale=0.0, max_scale=math.inf)
    with pytest.raises(ValueError, match="need 0 <= min_scale <= max_scale"):
        scaler.max_scale, scaler.min_scale = high, low
    _loads_back(scaler)


def _set_up(spec_scaler):
    model = nn.Linear(4, 4)
    precision = mixprec.Precision("32-true", scaler=spec_scaler)
    model, opt = precision.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    precision.backward(model(torch.ones(1, 4)).sum())
    precision.step(opt)
    return precision, opt


def test_an_optimizers_check_state_dict_refuses_what_its_scaler_would():
    """check_state_dict is what a resume runs before it loads the weights: a scaler state the
    load then refuses must be refused here, changing nothing."""
    _, saved_opt = _set_up("dynamic")
    state = saved_opt.state_dict()
    _, opt = _set_up("dynamic")
    before = opt.state_dict()
    bad = {**state, "scaler": {**state["scaler"], "credits": 5}}
    with pytest.raises(ValueError, match="credits must be at most hysteresis"):
        opt.check_state_dict(bad)
    _, static_opt = _set_up(8.0)
    with pytest.raises(ValueError, match="cannot load a 'dynamic' loss scaler state into a"):
        static_opt.check_state_dict(state)
    opt.check_state_dict(state)
    assert opt.state_dict()["scaler"] == before["scaler"]
    opt.load_state_dict(state)


@pytest.mark.parametrize("spec", ["bf16-true", "16-true", "64-true", "bf16-mixed"])
def test_a_forward_context_built_once_is_entered_every_step(spec):
    """As loops written for torch.amp keep ``ctx = autocast(...)`` and enter it each step."""
    precision = mixprec.Precision(spec, allow_slow=True)
    model, opt = precision.setup(nn.Linear(4, 4), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    ctx = precision.forward_context()
    for _ in range(2):
        with ctx:
            out = model(torch.ones(2, 4))
            made = torch.ones(1)
        assert torch.get_default_dtype() == torch.float32
        if not precision.mixed:
            assert made.dtype == out.dtype == precision.policy.default.compute_dtype
    if not precision.mixed:  # (nested too; torch's autocast object is not, nor is the mixed one)
        with ctx, ctx:
            pass
    assert torch.get_default_dtype() == torch.float32
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("spec", ["32-true", "16-true"])
def test_a_group_holding_a_parameter_stepped_already_is_refused_as_torch_refuses_it(spec):
    """Under float32 masters the groups hold masters, so torch's own check could not see the
    parameter: the group was added and every later step raised."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    precision = mixprec.Precision(spec, allow_slow=True)
    model, opt = precision.setup(model, torch.optim.SGD(model[0].parameters(), lr=0.1))
    with pytest.raises(ValueError, match="appear in more than one parameter group"):
        opt.add_param_group({"params": list(model.parameters())})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": list(model[1].parameters())})
    x = torch.full((2, 4), 0.01, dtype=model[0].weight.dtype)
    precision.backward(model(x).float().sum())
    precision.step(opt)
    assert len(opt.param_groups) == 2


def test_clipping_takes_the_plain_optimizer_as_step_does():
    model = nn.Linear(4, 4)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = mixprec.Precision("32-true", scaler=4.0)
    model, opt = precision.setup(model, plain)
    precision.backward(model(torch.ones(1, 4)).sum())
    norm = precision.clip_grad_norm_(plain, 1.0)
    assert torch.isclose(norm, torch.tensor(20.0**0.5))  # unscaled: weight ones, bias ones
    assert precision.step(plain)


def test_a_true_policys_forward_context_decorates_a_function():
    """As the generator context it replaced did (`@precision.forward_context()`)."""
    precision = mixprec.Precision("bf16-true", allow_slow=True)
    precision.setup(nn.Linear(2, 2))

    @precision.forward_context()
    def made() -> torch.dtype:
        return torch.ones(1).dtype

    assert made() == made() == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32


def test_a_group_added_on_the_plain_optimizer_with_a_stepped_parameter_is_named_so():
    """Through the torch optimizer given to setup (whose groups hold masters), the next step
    called it tied memory ('b.weight = nn.Parameter(a.weight.data)')."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).half()
    plain = torch.optim.SGD(model[0].parameters(), lr=0.1)
    precision = mixprec.Precision("16-true", allow_slow=True)
    model, opt = precision.setup(model, plain)
    plain.add_param_group({"params": list(model.parameters())})
    precision.backward(model(torch.full((2, 4), 0.01, dtype=torch.float16)).float().sum())
    with pytest.raises(ValueError, match="appear in more than one parameter group"):
        precision.step(opt)


@pytest.mark.parametrize("spec", ["bf16-mixed", "32-true"])
def test_every_policys_forward_context_decorates_a_function(spec):
    """torch.autocast decorates; the mixed policies' context stopped doing so when it began
    to set how torch.compile traces the backward, and float32's never did."""
    precision = mixprec.Precision(spec, allow_slow=True)
    precision.setup(nn.Linear(2, 2))

    @precision.forward_context()
    def state() -> bool:
        return torch.is_autocast_enabled("cpu")

    assert state() == state() == precision.mixed
    assert not torch.is_autocast_enabled("cpu")


def test_an_initial_scale_set_before_the_first_step_is_the_scale_it_starts_from():
    """Found by a review: ``init_scale`` set after building changed what the scaler reported
    and saved, not its scale: ``scale(loss)`` still multiplied by 65536. Set before the first
    ``scale``, it is the scale the first step uses (bounds, floor and growth judged from
    it); set later, the running scale is kept and a `reset` starts from it."""
    scaler = DynamicLossScaler()
    scaler.init_scale = 256.0
    assert scaler.scale(torch.tensor(1.0)).item() == 256.0 and scaler.loss_scale == 256.0
    assert scaler.state_dict()["scale"] == 256.0
    scaler.init_scale = 512.0  # a loss was scaled by 256: its gradients unscale by 256
    assert scaler.loss_scale == 256.0
    scaler.update(CLEAN, False)
    scaler.init_scale = 1024.0
    assert scaler.loss_scale == 256.0 and scaler.init_scale == 1024.0
    scaler.reset()
    assert scaler.loss_scale == 1024.0 and scaler.stats().steps == 0

    at_floor = DynamicLossScaler(8.0, min_scale=1.0, max_skips_at_min_scale=1)
    at_floor.init_scale = 1.0
    with pytest.raises(LossScaleDivergedError):
        at_floor.update(INF, True)
    grows = DynamicLossScaler(8.0, growth_interval=1, max_scale=8.0)
    grows.init_scale = 2.0
    grows.update(CLEAN, False)
    grows.update(CLEAN, False)
    assert grows.loss_scale == 8.0 and grows.state_dict()["growth_tracker"] == 0
    loaded = DynamicLossScaler()
    loaded.load_state_dict(DynamicLossScaler().state_dict())
    loaded.init_scale = 4.0  # a loaded state is a resumed run's: its scale is kept
    assert loaded.loss_scale == 2.0**16


def test_a_reset_after_a_load_puts_back_the_settings_in_force_before_it():
    """Found by a diff review: a reset kept the settings a checkpoint had loaded, so a fresh
    fit after a resumed one on the same Trainer trained with the checkpoint's growth
    interval and bounds, not the ones it was configured with. A loaded checkpoint's settings
    go with the run it resumes; a reset puts back those in force before the load (the
    built ones, and those set since), and the next load's warning names them."""
    scaler = DynamicLossScaler(2.0**16)
    scaler.growth_interval = 50  # (set after building: configured)
    saved = DynamicLossScaler(256.0, backoff_factor=0.25, growth_interval=3, max_scale=4096.0)
    with pytest.warns(UserWarning, match=r"growth_interval 3 \(built with 50\)"):
        scaler.load_state_dict(saved.state_dict())
    assert (scaler.growth_interval, scaler.max_scale, scaler.init_scale) == (3, 4096.0, 256.0)
    scaler.reset()
    fresh = DynamicLossScaler(2.0**16, growth_interval=50)
    assert scaler.state_dict() == fresh.state_dict()
    with pytest.warns(UserWarning, match=r"growth_interval 3 \(built with 50\)"):
        scaler.load_state_dict(saved.state_dict())


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_reset_starts_the_scale_and_counters_afresh_with_the_settings_of_now(hysteresis):
    """Found by a review: a reset (``Precision.reset``, before each Trainer run) loaded the
    state the scaler was built with, replacing the settings set since. It now returns the
    scale, growth tracker, credits and counters to a fresh start at ``init_scale`` and
    keeps every setting as it is: the state of a scaler built with them."""
    scaler = DynamicLossScaler(8.0, growth_interval=2, hysteresis=hysteresis)
    for flag in (INF, INF, INF, CLEAN, CLEAN, CLEAN):
        scaler.update(flag, bool(flag))
    scaler.scale(torch.tensor(1.0))
    scaler.growth_interval, scaler.min_scale, scaler.backoff_factor = 3, 2.0, 0.25
    scaler.max_skips_at_min_scale = 4
    scaler.reset()
    built = DynamicLossScaler(8.0, 2.0, 0.25, 3, hysteresis, 2.0, max_skips_at_min_scale=4)
    assert scaler.state_dict() == built.state_dict() and not scaler.scaled_since_update
    for flag in (INF, CLEAN, CLEAN, CLEAN, INF):
        scaler.update(flag, bool(flag))
        built.update(flag, bool(flag))
        assert scaler.state_dict() == built.state_dict()
