"""`Precision.init_module` (build a model in its storage dtype), `device_info` (check
against a described device instead of the host) and the life cycle (`resolve` once, `setup`,
`reset` for another run): the same outcome on every host."""

import pytest
import torch
from devices import AVX2_CPU, H100, ZEN4
from nets import mlp
from torch import nn

from mixprec import Precision, SlowPrecisionError
from mixprec.hardware import assume
from mixprec.optim.scaling import DynamicLossScaler

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32


def test_init_module_builds_in_the_storage_dtype_and_restores_the_default():
    with Precision("bf16-true").init_module():
        assert nn.Linear(2, 2).weight.dtype == bf16
    assert torch.get_default_dtype() == f32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with Precision("bf16-mixed").init_module():
            assert nn.Linear(2, 2).weight.dtype == f32
        assert torch.get_default_dtype() == torch.float64
        with pytest.raises(RuntimeError, match="boom"), Precision("16-true").init_module():
            assert torch.get_default_dtype() == f16
            raise RuntimeError("boom")
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(previous)


def test_precision_checks_against_a_described_device():
    assert Precision("auto", device_info=H100).policy.name == "bf16-mixed"
    assert Precision("auto", device_info=AVX2_CPU).policy.name == "32-true"
    with pytest.raises(SlowPrecisionError, match=AVX2_CPU.name):
        Precision("bf16-mixed", device_info=AVX2_CPU).setup(mlp())
    model = Precision("16-mixed", device_info=H100).setup(mlp())  # fast on an H100
    assert isinstance(model, nn.Module)
    with pytest.raises(TypeError, match="DeviceInfo"):
        Precision("32-true", device_info="h100")


def test_resolve_checks_the_device_once_and_setup_does_not_check_again():
    # before: there was no resolve, and each setup checked the device again (the Lightning
    # plugin sets up twice: the module, then the optimizers)
    precision = Precision("auto")
    assert precision.resolved_for is None
    assert "_owner" not in vars(precision)  # a field nothing read
    with assume(ZEN4):
        support = precision.resolve("cpu")
        assert precision.resolve("cpu") is support  # asked again: the same answer
    assert support.status == "fast" and precision.resolved_for == ZEN4
    assert precision.policy.name == "bf16-mixed"  # "auto" picked for the device judged
    model = mlp()
    with assume(AVX2_CPU):  # bfloat16 far slower here: setup does not judge again
        precision.setup(model)
        model, opt = precision.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(ValueError, match=r"resolved for cpu \(AMD Zen 4.*cpu \(AVX2-only"):
            precision.resolve("cpu")
    assert precision.resolved_for == ZEN4


def test_reset_begins_another_run_from_the_configured_scaler():
    precision = Precision("16-mixed", scaler=DynamicLossScaler(init_scale=2.0**10), allow_slow=True)
    scaler, configured = precision.scaler, precision.scaler.state_dict()
    model = mlp()
    model, opt = precision.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with precision.forward_context():
        loss = model(torch.ones(3, 4)).float().square().mean()
    precision.backward(loss)
    assert precision.step(opt) and scaler.stats().steps == 1
    judged = precision.resolved_for
    precision.reset()
    assert precision.scaler is scaler and scaler.state_dict() == configured
    assert precision.resolved_for is judged  # the device is not judged again
    with pytest.raises(ValueError, match="no optimizer to step"):
        precision.step()  # the last run's optimizers are forgotten


def test_a_step_context_of_an_unresolved_auto_precision_is_refused():
    """Found by a review: with the policy's mixed flag read as an attribute, an "auto"
    Precision not yet resolved entered a plain module's step context silently, autocast off
    (the policy's property had refused it)."""
    from mixprec.step import step_context

    precision = Precision("auto")
    with pytest.raises(RuntimeError, match="auto"):
        step_context(precision, torch.nn.Linear(2, 2))


def test_a_precision_pickled_before_its_flags_were_attributes_steps_after_loading():
    """One pickled before `mixed` was an attribute (it held `_mixed`) lacked it when loaded."""
    import pickle

    precision = Precision("bf16-mixed", allow_slow=True)
    old = precision.__getstate__()
    old["_mixed"] = old.pop("mixed")
    del old["_compute_dtype"]
    loaded = Precision.__new__(Precision)
    loaded.__setstate__(pickle.loads(pickle.dumps(old)))
    assert loaded.mixed is True and loaded.forward_context() is not None


def test_init_module_under_a_map_builds_in_its_widest_param_dtype():
    """Under ``PolicyMap("bf16-true", {"1": "32-true"})`` the float32 layer was built in
    bfloat16 (the default's dtype) and cast up at setup: its weights kept bfloat16's
    rounding for good, and a buffer computed at init an error of up to 2. Built in the
    widest of the map's param dtypes, it is float32 as a model built outside the context."""
    import mixprec

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("pos", torch.arange(1000) * 1.0)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), Positions())

    plain = build()
    precision = mixprec.Precision(
        mixprec.PolicyMap("bf16-true", {"1": "32-true", "0": "bf16-true"}), allow_slow=True
    )
    with precision.init_module():
        built = build()
    assert torch.equal(built[1].pos, plain[1].pos) and built[1].pos.dtype == torch.float32
    model = precision.setup(built)
    assert model[0].weight.dtype == torch.bfloat16 and model[1].pos.dtype == torch.float32
    assert torch.equal(model[1].pos, plain[1].pos)
    with mixprec.Precision(
        "bf16-true", allow_slow=True
    ).init_module():  # (one dtype: built in it, as before)
        assert torch.get_default_dtype() == torch.bfloat16


@pytest.mark.parametrize("spec", ["p=bf16,c=f32", "p=f16,c=bf16", "p=f32,c=f64"])
def test_init_module_builds_buffers_as_they_come_out_built_outside(spec):
    """Found by a review: under a policy storing buffers wider than its params (one that
    casts params, ``p=bf16,c=f32``), `init_module` built them in the param dtype: a buffer
    computed at init (positions 0..999) ended float32 with bfloat16's rounding (errors up
    to 2). Built in a dtype holding both, as far as a build outside would go (float32 for
    ``p=f32,c=f64``), buffers and parameters come out as built outside and set up."""
    import mixprec

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("pos", torch.arange(1000) * 1.0)
            self.register_buffer("third", torch.tensor(1.0) / 3)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return Positions()

    precision = mixprec.Precision(spec, allow_slow=True)
    with precision.init_module():
        built = build()
    model, outside = precision.setup(built), precision.setup(build())
    policy = precision.policy.default
    assert model.pos.dtype == policy.buffer_dtype and model.lin.weight.dtype == policy.param_dtype
    mine = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, tensor in [*outside.named_parameters(), *outside.named_buffers()]:
        assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), name
    assert torch.equal(model.pos, torch.arange(1000, dtype=policy.buffer_dtype))
