"""float8 policies go where a policy goes: `mixprec.quantize`, a PolicyMap rule under `apply`,
`explain`, and the Trainer's precision flag, all reaching `Float8Linear`."""

import pytest
import torch
from devices import AVX2_CPU, H100
from torch import nn

import mixprec
from mixprec.errors import PolicySpecError
from mixprec.formats.float8 import Float8Config
from mixprec.policy import Policy, QuantizedPolicy
from mixprec.quantize.float8 import Float8Linear, convert_to_float8
from mixprec.trainer import Trainer, TrainingModule


def _model() -> nn.Sequential:
    # 32 -> 2048 gains by torchao's size rule (out > 1024); 2048 -> 16 is too small to gain
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 2048), nn.ReLU(), nn.Linear(2048, 16))


def test_quantize_float8_swaps_the_layers_that_gain_and_says_why_not_for_the_rest():
    model = _model()
    result = mixprec.quantize(model, "float8")
    assert isinstance(model[0], Float8Linear) and model[0].recipe == "tensorwise"
    assert type(model[2]) is nn.Linear
    assert set(result.quantized) == {"0"} and "2" in result.skipped
    assert "1024" in result.skipped["2"] or "small" in result.skipped["2"]


def test_rowwise_recipe_from_the_policy_name_reaches_the_layer():
    model = _model()
    mixprec.quantize(model, mixprec.Policy("float8/rowwise_from_float32"))
    assert isinstance(model[0], Float8Linear) and model[0].recipe == "rowwise"
    # rowwise skips only dims that are not multiples of 16: both layers qualify
    assert isinstance(model[2], Float8Linear)


def test_delayed_policy_keeps_its_history_length():
    model = _model()
    mixprec.quantize(model, "float8/delayed:16_from_float32")
    layer = model[0]
    assert isinstance(layer, Float8Linear) and layer.recipe == "delayed"
    histories = [b for n, b in layer.named_buffers() if "history" in n]
    assert histories and all(h.shape[-1] == 16 for h in histories)


def test_a_float8_rule_in_a_policy_map_applies_and_explains():
    model = _model()
    policy = mixprec.PolicyMap("32-true", {"0": "float8_from_float32"})
    report = mixprec.explain(model, policy)
    assert "0" in report.quantized and "2" not in report.quantized
    mixprec.apply(model, policy, warn=False)  # emulated (slow) on a CPU: known here
    assert isinstance(model[0], Float8Linear) and type(model[2]) is nn.Linear
    x = torch.randn(8, 32)
    out = model(x)
    out.square().mean().backward()
    assert out.dtype == torch.float32 and model[0].weight.grad is not None
    # the float8 forward is close to, and not equal to, the float32 one
    ref = _model()
    err = (out - ref(x)).abs().max() / ref(x).abs().max()
    assert 0 < err < 0.1


def test_the_trainer_trains_under_a_float8_precision_string(tmp_path):
    class Net(TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(1)
    data = [(torch.randn(8, 32), torch.randn(8, 16)) for _ in range(4)]
    model = Net()
    trainer = Trainer(
        precision="float8_from_float32",
        max_steps=4,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        allow_slow_precision=True,
    )
    before = model.net[0].weight.detach().clone()
    trainer.fit(model, data)
    assert trainer.global_step == 4
    assert isinstance(model.net[0], Float8Linear)
    assert not torch.equal(model.net[0].weight.detach(), before)


def test_without_the_allow_flag_a_cpu_refuses_float8_as_emulated():
    from mixprec import hardware

    with hardware.assume(AVX2_CPU), pytest.raises(mixprec.SlowPrecisionError):
        mixprec.Precision("float8_from_float32").setup(_model())


def test_a_true_16_bit_policy_keeps_the_delayed_buffers_float32():
    """Under float16-true the scale 448 / amax overflowed to inf and every output became 0."""
    from mixprec.quantize.float8 import DELAYED_BUFFERS

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 1040, bias=False))
    precision = mixprec.Precision("float8/delayed:4_from_16-true", allow_slow=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = precision.setup(model, optimizer)
    layer = model[0]
    assert isinstance(layer, Float8Linear) and layer.weight.dtype == torch.float16
    for _ in range(3):
        with precision.forward_context():
            out = model(precision.convert_input(torch.randn(8, 32) * 1e-3))
        assert out.abs().min() > 0
        precision.backward(out.float().square().sum())
        precision.step(optimizer)
        optimizer.zero_grad()
    assert {getattr(layer, n).dtype for n in DELAYED_BUFFERS} == {torch.float32}
    assert layer.input_scale.item() > 65504  # what float16 cannot hold


def test_the_trainer_takes_lightnings_transformer_engine_flag(tmp_path):
    """Trainer(precision="transformer-engine") was refused with a did-you-mean; it is
    Lightning's float8 run: bfloat16 weights and compute, delayed float8 scales, float32
    outputs. The hardware check applies as to any float8 policy."""
    from mixprec import hardware
    from mixprec.trainer.config import resolve_precision

    policy, support = resolve_precision("transformer-engine", H100)
    assert policy == mixprec.PolicyMap(
        "float8/delayed_from_params=bfloat16,compute=bfloat16,output=float32"
    )
    assert support.status == hardware.FAST
    with pytest.raises(mixprec.SlowPrecisionError, match="float8"):
        resolve_precision("transformer-engine-float16", AVX2_CPU)

    class Net(TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self(x)
            assert out.dtype == torch.float32  # Lightning casts outputs back to float32
            return nn.functional.mse_loss(out, y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(1)
    data = [(torch.randn(8, 32), torch.randn(8, 16)) for _ in range(2)]
    model = Net()
    trainer = Trainer(
        precision="transformer-engine",
        max_steps=2,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        allow_slow_precision=True,  # float8 is emulated off an SM 8.9+ GPU
    )
    before = model.net[0].weight.detach().clone()
    trainer.fit(model, data)  # bfloat16 weights without masters, as under Lightning
    layer = model.net[0]
    assert isinstance(layer, Float8Linear) and layer.recipe == "delayed"
    assert layer.amax_history_length == 1024 and layer.weight.dtype == torch.bfloat16
    assert not torch.equal(layer.weight.detach(), before.to(torch.bfloat16))


def test_one_float8_config_serves_the_policy_grammar_and_the_layers():
    """The recipe facts were written twice (policy.py and quantize/float8.py); now a float8
    policy carries the `Float8Config` its layers are built with, and both refuse alike."""
    policy = QuantizedPolicy("float8", "bf16-mixed", recipe="delayed", amax_history_length=16)
    assert policy.float8_config == Float8Config("delayed", 16)
    assert Policy("float8_from_float32").float8_config == Float8Config()
    assert Policy("transformer-engine").float8_config == Float8Config("delayed", 1024)
    assert Policy("int4_from_float32").float8_config is None
    model = nn.Sequential(nn.Linear(16, 2048))
    mixprec.quantize(model, policy)
    layer = model[0]
    assert Float8Config(layer.recipe, layer.amax_history_length) == policy.float8_config
    for recipe in Float8Config.RECIPES:
        assert Policy(f"float8/{recipe}_from_float32").recipe == recipe
        assert Float8Linear(16, 16, recipe=recipe).recipe == recipe
    refusals = (
        lambda: Float8Config("axiswise"),
        lambda: Policy("float8/axiswise_from_float32"),
        lambda: Float8Linear(16, 16, recipe="axiswise"),
        lambda: convert_to_float8(nn.Sequential(nn.Linear(16, 16)), recipe="axiswise"),
    )
    for refuse in refusals:
        with pytest.raises(PolicySpecError, match="unknown float8 recipe 'axiswise'; accepted: "):
            refuse()
    with pytest.raises(PolicySpecError, match="amax_history_length must be a positive int"):
        Policy("float8/delayed:0_from_float32")
    with pytest.raises(PolicySpecError, match="amax_history_length must be a positive int"):
        Float8Linear(16, 16, recipe="delayed", amax_history_length=0)


@pytest.mark.parametrize("recipe", Float8Config.RECIPES)
def test_a_float8_policy_and_convert_to_float8_skip_the_same_layers_for_size(recipe):
    """One size rule: the layers a float8 policy leaves float for their size are the ones
    `convert_to_float8` leaves (odd dims for every recipe; small ones for tensorwise and
    delayed)."""
    shapes = [(32, 48), (48, 40), (16, 2048), (4096, 1024), (4096, 1040), (4112, 16)]
    model = nn.Sequential(*(nn.Linear(i, o, device="meta") for i, o in shapes))
    by_policy = mixprec.explain(model, f"float8/{recipe}_from_float32").skipped
    skipped: dict[str, str] = {}
    convert_to_float8(model, recipe=recipe, skipped=skipped)
    assert set(skipped) == set(by_policy)
    assert "1" in skipped and ("0" in skipped) == (recipe in ("tensorwise", "delayed"))


def test_an_empty_float8_recipe_is_refused_not_taken_for_tensorwise():
    """An empty recipe ('float8/:16', recipe='') fell back to tensorwise: silently for the
    keyword, and for the name with an error blaming a history length on 'tensorwise'."""
    for refuse in (
        lambda: Policy("float8/:16_from_float32"),
        lambda: QuantizedPolicy("float8", "float32", recipe=""),
        lambda: mixprec.quantize(nn.Sequential(nn.Linear(4096, 2048)), "float8", recipe=""),
    ):
        with pytest.raises(PolicySpecError, match="unknown float8 recipe ''; accepted: "):
            refuse()
