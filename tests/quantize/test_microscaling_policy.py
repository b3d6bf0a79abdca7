"""Block-scaled policies go where a policy goes: the name grammar (options, canonical names,
errors), configs and pickling, `mixprec.quantize`, PolicyMap rules under `apply`, `explain`,
the hardware check (emulated everywhere: slow, refused without the allow flag), `Precision`
and the Trainer's precision flag, all reaching `MicroscalingLinear`."""

from __future__ import annotations

import pickle

import pytest
import torch
from devices import AVX2_CPU, H100
from torch import nn

import mixprec
from mixprec import hardware
from mixprec.errors import PolicySpecError
from mixprec.formats.microscaling import MicroscalingConfig
from mixprec.hardware import DeviceInfo
from mixprec.policy import Policy, QuantizedPolicy
from mixprec.quantize.microscaling import MicroscalingLinear, microscaling_support
from mixprec.trainer import Trainer, TrainingModule

B200 = DeviceInfo("cuda", "B200", 0, capability=(10, 0))


def _model() -> nn.Sequential:
    # 64 -> 64 fills 32-element blocks; 64 -> 24 does not (24 outputs); 24 -> 8 is too small
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 24), nn.Linear(24, 8))


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("mxfp8_from_bf16-mixed", "mxfp8_from_mixed_bfloat16"),
        ("MXFP8/rceil:32_from_float32", "mxfp8_from_float32"),
        ("mxfp8/64:floor_from_float32", "mxfp8/floor:64_from_float32"),
        ("mxfp8/e5m2_from_bf16-true", "mxfp8/e5m2_from_bfloat16"),
        ("mxfp6_from_float32", "mxfp6_from_float32"),
        ("mxfp6/e3m2:floor_from_float32", "mxfp6/e3m2:floor_from_float32"),
        ("mxfp4_from_16-mixed", "mxfp4_from_mixed_float16"),
        ("nvfp4/sr:rht:2d_from_bf16-mixed", "nvfp4/2d:rht:sr_from_mixed_bfloat16"),
        ("nvfp4/fwd-rht_from_float32", "nvfp4/fwd-rht_from_float32"),
    ],
)
def test_names_parse_to_canonical_names_configs_and_pickles(spec, name):
    policy = Policy(spec)
    assert isinstance(policy, QuantizedPolicy)
    assert policy.name == name
    assert Policy(name) == policy and hash(Policy(name)) == hash(policy)
    assert Policy.from_config(policy.to_config()) == policy
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert QuantizedPolicy(policy) == policy


def test_the_options_reach_the_config():
    config = Policy("mxfp8/floor:64_from_float32").microscaling_config
    assert config == MicroscalingConfig("mxfp8", "e4m3", "floor", 64)
    nv = Policy("nvfp4/2d:rht:sr_from_bf16-mixed").microscaling_config
    assert (nv.two_d, nv.rht, nv.forward_rht, nv.stochastic_gradients) == (True, True, False, True)
    assert nv.block_size == 16 and nv.rounding is None
    assert Policy("mxfp8_from_float32").microscaling_config.rounding == "rceil"
    assert Policy("mxfp8_from_float32") != Policy("mxfp8/floor_from_float32")
    assert Policy("mxfp8/floor_from_float32").to_config()["options"] == "floor"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("mxfp8/e2m1_from_float32", "mxfp8 elements are e4m3 or e5m2, not 'e2m1'"),
        ("nvfp4/floor_from_float32", "the scale rounding 'floor' belongs to the MX modes"),
        ("mxfp4/2d_from_float32", "nvfp4's recipe options, not mxfp4's"),
        ("mxfp8/floor:rceil_from_float32", "rounding given twice"),
        ("mxfp8/fast_from_float32", "unknown mxfp8 option 'fast'"),
        ("nvfp4/32_from_float32", "nvfp4 blocks are 16 elements by definition"),
        ("mxfp8/1_from_float32", "block size must be an int >= 2"),
        ("nvfp4/2d:fwd-rht_from_float32", "'2d' and 'fwd-rht' do not combine"),
        ("nvfp4/fwd-rht:rht:2d_from_float32", "'2d' and 'fwd-rht' do not combine"),
        ("mxfp8/_from_float32", "nothing after '/'"),
        ("mxfp8", "names a quantization mode, not a policy"),
        ("nvfp4_from_mxfp8_from_float32", "the source of a quantized policy is a float policy"),
    ],
)
def test_bad_names_say_what_is_accepted(spec, message):
    with pytest.raises(PolicySpecError, match=message):
        Policy(spec)


def test_bad_configs_are_refused():
    with pytest.raises(PolicySpecError, match="options of a microscaling mode"):
        Policy.from_config({"quantization_mode": "int8", "source": "float32", "options": "x"})
    with pytest.raises(PolicySpecError, match="takes no group_size"):
        mixprec.quantize(_model(), "mxfp8", group_size=32)
    # every option is honoured or the combination refused: the forward ignored '2d' here
    with pytest.raises(PolicySpecError, match="'2d' and 'fwd-rht' do not combine"):
        MicroscalingConfig("nvfp4", two_d=True, forward_rht=True)
    with pytest.raises(PolicySpecError, match="use 'nvfp4/2d' or 'nvfp4/fwd-rht'"):
        MicroscalingLinear(32, 32, config="nvfp4/2d:fwd-rht")
    with pytest.raises(PolicySpecError, match="'2d' and 'fwd-rht' do not combine"):
        mixprec.quantize(_model(), "nvfp4/fwd-rht:2d")


@pytest.mark.parametrize("size", ["３２", "٣٢", "²"])
def test_block_sizes_are_ascii_digits(size):
    # '３２' and '٣٢' were read as 32 by int(); '²' escaped as int()'s bare ValueError
    message = "is not written in ASCII digits 0-9"
    with pytest.raises(PolicySpecError, match=message):
        MicroscalingConfig.parse("mxfp8", size)
    with pytest.raises(PolicySpecError, match=message):
        Policy(f"mxfp8/floor:{size}_from_float32")
    with pytest.raises(PolicySpecError, match=message):
        MicroscalingLinear(64, 64, config=f"mxfp8/{size}")
    assert MicroscalingConfig.parse("mxfp8", "64").block_size == 64


def test_a_slash_or_colon_with_no_option_is_refused():
    # MicroscalingLinear took 'mxfp8/' for plain mxfp8; parse said "unknown option ''"
    with pytest.raises(PolicySpecError, match="nothing after '/'"):
        MicroscalingLinear(32, 32, config="mxfp8/")
    with pytest.raises(PolicySpecError, match="nothing after '/'"):
        MicroscalingConfig.parse("nvfp4", "")
    for options in ("floor:", ":floor", "2d::rht"):
        mode = "nvfp4" if "2d" in options else "mxfp8"
        with pytest.raises(PolicySpecError, match=f"empty {mode} option in '{options}'"):
            MicroscalingConfig.parse(mode, options)
    assert MicroscalingLinear(32, 32, config="mxfp8").config == MicroscalingConfig("mxfp8")


def test_quantize_swaps_the_layers_that_fill_blocks_and_says_why_not_for_the_rest():
    model = _model()
    weight = model[0].weight
    result = mixprec.quantize(model, "mxfp8/floor")
    assert result.quantized == {"0": "mxfp8 (e4m3, blocks of 32, floor scales)"}
    assert "out_features=24 is not a multiple of the block size 32" in result.skipped["2"]
    assert "too small: 24 input features" not in result.skipped["3"]
    assert isinstance(model[0], MicroscalingLinear) and model[0].weight is weight
    assert type(model[2]) is nn.Linear
    # the same options again leave it alone; other options are refused with the way back
    assert mixprec.quantize(model, "mxfp8/floor").quantized == {}
    with pytest.raises(ValueError, match=r"already quantized to mxfp8 \(e4m3, blocks of 32, floor"):
        mixprec.quantize(model, "mxfp8")
    mixprec.quantize.dequantize(model)
    assert type(model[0]) is nn.Linear and model[0].weight is weight


def test_nvfp4_blocks_of_16_fit_where_mx_blocks_of_32_do_not():
    model = nn.Sequential(nn.Linear(48, 48))
    assert mixprec.quantize(model, "nvfp4/2d").quantized == {
        "0": "nvfp4 (e2m1, blocks of 16, e4m3 scales, 2d)"
    }


def test_a_rule_in_a_policy_map_applies_and_explains():
    model = _model()
    pmap = mixprec.PolicyMap("32-true", {"0": "mxfp8/floor_from_float32"})
    report = mixprec.explain(model, pmap)
    assert report.quantization["0"] == "mxfp8"
    mixprec.apply(model, pmap, warn=False)  # emulated (slow): known here
    assert isinstance(model[0], MicroscalingLinear)
    assert model[0].config == MicroscalingConfig("mxfp8", rounding="floor")
    out = model(torch.randn(4, 64))
    assert out.shape == (4, 8) and torch.isfinite(out).all()


def test_the_hardware_check_calls_block_scaled_policies_emulated_everywhere():
    for info in (AVX2_CPU, H100, B200):
        support = hardware.policy_support(Policy("mxfp8_from_bf16-mixed"), info)
        assert support.status == hardware.SLOW, info
        assert support.reason.startswith("mxfp8: ")
    assert "mixprec has no kernel path" in microscaling_support(B200).reason
    with hardware.assume(AVX2_CPU), pytest.raises(mixprec.SlowPrecisionError) as err:
        mixprec.Precision("nvfp4_from_float32").setup(_model())
    assert "block-scaled (MX, NVFP4) matmuls are emulated" in str(err.value)


def test_precision_under_bf16_mixed_runs_the_layers_in_autocast():
    model = _model()
    precision = mixprec.Precision("mxfp8_from_bf16-mixed", allow_slow=True)
    model = precision.setup(model)
    assert isinstance(model[0], MicroscalingLinear)
    with precision.forward_context():
        hidden = model[0](torch.randn(4, 64))
    assert hidden.dtype == torch.bfloat16
    assert model(torch.randn(4, 64)).dtype == torch.float32


def test_the_trainer_trains_under_a_block_scaled_precision_string(tmp_path):
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
    data = [(torch.randn(8, 64), torch.randn(8, 8)) for _ in range(3)]
    model = Net()
    trainer = Trainer(
        precision="nvfp4/2d:rht:sr_from_bf16-mixed",
        max_steps=3,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        allow_slow_precision=True,
    )
    before = model.net[0].weight.detach().clone()
    trainer.fit(model, data)
    assert trainer.global_step == 3
    assert isinstance(model.net[0], MicroscalingLinear)
    assert model.net[0].config.spelled() == "nvfp4/2d:rht:sr"
    assert not torch.equal(model.net[0].weight.detach(), before)


def test_the_bench_plan_says_block_scaled_precisions_are_emulated():
    from mixprec.bench.suite import BenchOptions, plan

    opts = BenchOptions(model="mlp", precisions=["32-true", "mxfp8_from_bf16-mixed"], device="cpu")
    with hardware.assume(AVX2_CPU):
        with pytest.raises(ValueError, match="--allow-slow"):
            plan(opts)
        opts.allow_slow = True
        support = plan(opts).support["mxfp8_from_mixed_bfloat16"]
    assert support.startswith("slow") and "emulated in float32" in support


def test_the_doctor_names_the_format_of_a_quantized_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    batch = (torch.randn(32, 64), torch.randn(32, 32))
    with hardware.assume(AVX2_CPU), pytest.warns(UserWarning, match="emulated in float32"):
        diagnosis = mixprec.diagnose(
            model, batch, nn.functional.mse_loss, precision="nvfp4/2d_from_float32"
        )
    assert diagnosis.modules["0"].quantized == "nvfp4/2d_from_float32"
    assert diagnosis.modules["0"].type == "MicroscalingLinear"


def test_a_policy_file_keeps_the_block_options(tmp_path):
    pmap = mixprec.PolicyMap(
        "bf16-mixed", {"0": "nvfp4/2d:sr_from_bf16-mixed", "2": "mxfp8/floor_from_float32"}
    )
    path = tmp_path / "policy.json"
    pmap.save(path)
    assert '"options": "2d:sr"' in path.read_text()
    loaded = mixprec.PolicyMap.load(path)
    assert loaded == pmap
    assert loaded.to_code() == pmap.to_code()
