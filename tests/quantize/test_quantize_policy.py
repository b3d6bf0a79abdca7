"""Quantized policies: Keras's '<mode>_from_<float policy>' names, canonical names, round
trips, refusals; and the policy side: global policy, PolicyMap rules, apply, explain,
hardware ratings."""

from __future__ import annotations

import copy
import json
import pickle
import warnings

import pytest
import torch
from devices import AVX2_CPU, H100, ZEN4
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec import hardware
from mixprec.device import cap_cpu_flags
from mixprec.errors import PolicySpecError, SlowPrecisionError
from mixprec.policy import Policy, QuantizedPolicy, as_policy
from mixprec.policy.names import POLICY_NAMES
from mixprec.quantize import Int4Embedding, Int4Linear, Int8Linear
from mixprec.quantize.int8 import int8_support
from mixprec.quantize.rules import skip_reason

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16

# accepted name -> (canonical name, mode, group size, recipe, amax history, source)
ACCEPTED = {
    "int8_from_float32": ("int8_from_float32", "int8", None, None, None, "32-true"),
    "int8_from_mixed_bfloat16": (
        "int8_from_mixed_bfloat16",
        "int8",
        None,
        None,
        None,
        "bf16-mixed",
    ),
    "int8_from_bfloat16": ("int8_from_bfloat16", "int8", None, None, None, "bf16-true"),
    "int8_from_bf16-mixed": ("int8_from_mixed_bfloat16", "int8", None, None, None, "bf16-mixed"),
    "int8_from_32-true": ("int8_from_float32", "int8", None, None, None, "32-true"),
    "INT8_FROM_Mixed_BFloat16": (
        "int8_from_mixed_bfloat16",
        "int8",
        None,
        None,
        None,
        "bf16-mixed",
    ),
    "int8_from_p=f32,c=bf16,o=bf16": (
        "int8_from_params=float32,compute=bfloat16,output=bfloat16",
        "int8",
        None,
        None,
        None,
        "params=float32,compute=bfloat16,output=bfloat16",
    ),
    "int4_from_float32": ("int4_from_float32", "int4", 128, None, None, "32-true"),
    "int4/128_from_float32": ("int4_from_float32", "int4", 128, None, None, "32-true"),
    "int4/64_from_mixed_bfloat16": (
        "int4/64_from_mixed_bfloat16",
        "int4",
        64,
        None,
        None,
        "bf16-mixed",
    ),
    "int4/-1_from_float32": ("int4/-1_from_float32", "int4", -1, None, None, "32-true"),
    # Keras's older name of per-channel int4 (its block size None), as older checkpoints hold it
    "int4/None_from_float32": ("int4/-1_from_float32", "int4", -1, None, None, "32-true"),
    "int4/none_from_mixed_bfloat16": (
        "int4/-1_from_mixed_bfloat16",
        "int4",
        -1,
        None,
        None,
        "bf16-mixed",
    ),
    # a jmp source autocast cannot give: float16 params computing in bfloat16
    "int8_from_p=f16,c=bf16": (
        "int8_from_params=float16,compute=bfloat16,output=bfloat16",
        "int8",
        None,
        None,
        None,
        "params=float16,compute=bfloat16,output=bfloat16",
    ),
    # Lightning's Transformer Engine flags: weights and compute in bfloat16 (float16), float8
    # with delayed scales over 1024 steps, outputs in float32
    "transformer-engine": (
        "float8/delayed_from_params=bfloat16,compute=bfloat16,output=float32",
        "float8",
        None,
        "delayed",
        1024,
        "params=bfloat16,compute=bfloat16,output=float32",
    ),
    "Transformer-Engine-Float16": (
        "float8/delayed_from_params=float16,compute=float16,output=float32",
        "float8",
        None,
        "delayed",
        1024,
        "params=float16,compute=float16,output=float32",
    ),
    "int4_from_mixed_float16": ("int4_from_mixed_float16", "int4", 128, None, None, "16-mixed"),
    "float8_from_mixed_bfloat16": (
        "float8_from_mixed_bfloat16",
        "float8",
        None,
        "tensorwise",
        None,
        "bf16-mixed",
    ),
    "float8/tensorwise_from_float32": (
        "float8_from_float32",
        "float8",
        None,
        "tensorwise",
        None,
        "32-true",
    ),
    "float8/rowwise_from_bf16-mixed": (
        "float8/rowwise_from_mixed_bfloat16",
        "float8",
        None,
        "rowwise",
        None,
        "bf16-mixed",
    ),
    "float8/rowwise_with_gw_hp_from_mixed_bfloat16": (
        "float8/rowwise_with_gw_hp_from_mixed_bfloat16",
        "float8",
        None,
        "rowwise_with_gw_hp",
        None,
        "bf16-mixed",
    ),
    "float8/delayed_from_mixed_bfloat16": (
        "float8/delayed_from_mixed_bfloat16",
        "float8",
        None,
        "delayed",
        1024,
        "bf16-mixed",
    ),
    "float8/delayed:16_from_mixed_bfloat16": (
        "float8/delayed:16_from_mixed_bfloat16",
        "float8",
        None,
        "delayed",
        16,
        "bf16-mixed",
    ),
    "float8/delayed:1024_from_bf16": (
        "float8/delayed_from_mixed_bfloat16",
        "float8",
        None,
        "delayed",
        1024,
        "bf16-mixed",
    ),
}


@pytest.mark.parametrize("spec", ACCEPTED)
def test_every_accepted_name_parses_and_round_trips(spec):
    name, mode, group, recipe, history, source = ACCEPTED[spec]
    p = Policy(spec)
    assert type(p) is QuantizedPolicy and p == QuantizedPolicy(spec) == as_policy(spec)
    assert (p.name, p.mode, p.group_size, p.recipe, p.amax_history_length) == (
        name,
        mode,
        group,
        recipe,
        history,
    )
    assert p.quantization_mode == mode and p.source == Policy(source)
    src = Policy(source)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (
        src.param_dtype,
        src.compute_dtype,
        src.output_dtype,
    )
    assert str(p) == name and repr(p) == f"QuantizedPolicy({name!r})"
    config = json.loads(json.dumps(p.to_config()))
    for again in (
        Policy(name),
        Policy.from_config(config),
        QuantizedPolicy.from_config(config),
        as_policy(config),
        pickle.loads(pickle.dumps(p)),
        copy.deepcopy(p),
        Policy(p),
        QuantizedPolicy(p),
    ):
        assert again == p and hash(again) == hash(p) and type(again) is QuantizedPolicy


def test_keyword_options_equal_the_spelled_ones():
    assert QuantizedPolicy("int4", "float32", group_size=64) == Policy("int4/64_from_float32")
    assert QuantizedPolicy("float8", "bf16-mixed", recipe="delayed", amax_history_length=16) == (
        Policy("float8/delayed:16_from_mixed_bfloat16")
    )
    assert QuantizedPolicy("int8", Policy("bf16-mixed")) == Policy("int8_from_mixed_bfloat16")


def test_a_quantized_policy_differs_from_its_source_and_from_other_options():
    distinct = [
        Policy("float32"),
        Policy("int8_from_float32"),
        Policy("int4_from_float32"),
        Policy("int4/64_from_float32"),
        Policy("int4/-1_from_float32"),
        Policy("float8_from_float32"),
        Policy("float8/rowwise_from_float32"),
        Policy("float8/delayed_from_float32"),
        Policy("float8/delayed:8_from_float32"),
        Policy("int8_from_mixed_bfloat16"),
    ]
    assert len(set(distinct)) == len(distinct)
    for a in distinct:
        assert sum(a == b for b in distinct) == 1


@given(st.sampled_from(sorted(ACCEPTED)), st.sampled_from(["32-true", "bf16-mixed", "bf16-true"]))
def test_any_accepted_mode_over_any_source_round_trips(spec, source):
    mode = ACCEPTED[spec][0].partition("_from_")[0]  # of the canonical name: Lightning's flags
    p = Policy(f"{mode}_from_{source}")
    assert Policy(p.name) == p == Policy.from_config(p.to_config())
    assert p.source == Policy(source)


REFUSED = {
    "int8": "int8 names a quantization mode, not a policy.*'int8_from_float32'",
    "int4": "int4 names a quantization mode.*'int4/<group size>'",
    "float8": "float8 names a quantization mode.*'float8/<recipe>'",
    "float8_e4m3fn": "float8_e4m3fn names a quantization mode.*Quantized policies are",
    "float8_e5m2": "float8_e5m2 names a quantization mode",
    "torch.float8_e4m3fn": "names a quantization mode",
    "uint8": "uint8 is not a floating dtype.*Quantized policies are",
    "int8_from_mixed_float16": "int8 with a float16 compute dtype.*'int8_from_mixed_bfloat16'",
    "int8_from_float16": "int8 with a float16 compute dtype",
    "int8_from_16-mixed": "int8 with a float16 compute dtype",
    "int2_from_float32": "unknown quantization mode 'int2'.*modes are int8, int4, float8",
    "fp8_from_float32": "unknown quantization mode 'fp8'",
    "int8/128_from_float32": "int8 takes no option",
    "int4/0_from_float32": "group size 0.*-1 for one group per output channel",
    "int4/1_from_float32": "group size 1",
    "int4/-2_from_float32": "group size -2",
    "int4/abc_from_float32": "group size 'abc'.*not an integer",
    # before: int() took these as 16 and 64 (one policy, several names)
    "int4/1_6_from_float32": "group size '1_6'.*not an integer in digits 0-9",
    "int4/+64_from_float32": "group size '\\+64'.*not an integer in digits 0-9",
    "int4/\uff16\uff14_from_float32": "not an integer in digits 0-9",
    "float8/delayed:1_6_from_float32": "amax history length '1_6'",
    "int4/_from_float32": "nothing after '/'",
    "float8/fast_from_float32": "unknown float8 recipe 'fast'.*tensorwise, rowwise, rowwise_",
    "float8/rowwise:16_from_float32": "belongs to the 'delayed' float8 recipe",
    "float8/delayed:0_from_float32": "positive int",
    "float8/delayed:x_from_float32": "amax history length 'x'",
    "int8_from_": "no float policy after '_from_'",
    "int8_from_auto": "'auto' names no policy",
    "int8_from_fp16": "did you mean",
    "int8_from_int8_from_float32": "the source of a quantized policy is a float policy",
    "int8_from_turbo": "unknown precision 'turbo'",
}


@pytest.mark.parametrize("spec", REFUSED)
def test_refused_names_say_what_is_wrong_and_what_is_accepted(spec):
    with pytest.raises(PolicySpecError, match=REFUSED[spec]):
        Policy(spec)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: QuantizedPolicy("int8"), "needs its source float policy"),
        (lambda: QuantizedPolicy("int8_from_float32", "bf16-mixed"), "names its source already"),
        (lambda: QuantizedPolicy("int8", "float32", group_size=64), "group_size is an int4 option"),
        (lambda: QuantizedPolicy("int4", "float32", recipe="rowwise"), "float8 options"),
        (lambda: QuantizedPolicy("int4/64", "float32", group_size=32), "says group size 64"),
        (
            lambda: QuantizedPolicy("float8", "float32", amax_history_length=8),
            "belongs to the 'delayed'",
        ),
        (lambda: QuantizedPolicy("int4", "float32", group_size=True), "must be an int"),
        (lambda: QuantizedPolicy(8, "float32"), "must be a string, not int"),
        (lambda: Policy("int8_from_float32", compute_dtype="bf16"), "from its source float policy"),
        (lambda: QuantizedPolicy.from_config({"source": {}}), "keys quantization_mode, source"),
        (
            lambda: Policy.from_config(
                {"quantization_mode": "int8", "source": {"param_dtype": "float32"}, "x": 1}
            ),
            r"unknown quantized policy config keys \['x'\]",
        ),
    ],
)
def test_bad_constructor_calls(call, message):
    with pytest.raises(PolicySpecError, match=message):
        call()


def test_global_policy_and_scope_take_a_quantized_policy():
    mixprec.set_global_policy("int8_from_mixed_bfloat16")
    assert mixprec.global_policy() == QuantizedPolicy("int8", "bf16-mixed")
    with mixprec.policy_scope("int4/32_from_float32") as p:
        assert mixprec.global_policy() is p and p.group_size == 32


def _model() -> nn.Module:
    return nn.ModuleDict(
        {
            "emb": nn.Embedding(40, 32),
            "body": nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32)),
            "head": nn.Linear(32, 40),
            "tiny": nn.Linear(8, 32),
        }
    )


def test_explain_says_which_layers_a_rule_quantizes_and_which_it_skips_and_why():
    pmap = mixprec.PolicyMap(
        "32-true",
        {"body": "int8_from_float32", "head": "int4/16_from_float32", "tiny": "int8_from_float32"},
    )
    e = mixprec.explain(_model(), pmap)
    assert e.quantized == ["body.0", "head"]
    assert e.quantization["body.0"] == "int8" and e.quantization["head"] == "int4"
    assert e.skipped == {
        "body.2": "unsupported type LayerNorm: int8 quantizes Linear, Embedding and "
        "Hugging Face's Conv1D",
        "tiny": "too small: 8 input features (fewer than 16 save little and lose the most "
        "accuracy)",
    }
    assert e["body.0"] == Policy("int8_from_float32") and e["emb"] == Policy("32-true")
    text = str(e)
    assert "quantized" in text and "skipped: too small" in text


def test_a_map_without_quantized_rules_explains_as_before():
    e = mixprec.explain(_model(), "bf16-mixed")
    assert e.quantization == {} and "quantized" not in str(e).split("\n")[2]


def test_a_float8_rule_skips_embeddings_odd_dims_and_what_torchao_finds_too_small():
    model = nn.Sequential(nn.Embedding(40, 32), nn.Linear(32, 48), nn.Linear(48, 40))
    e = mixprec.explain(model, "float8/rowwise_from_mixed_bfloat16")
    assert e.quantized == ["1"]
    assert e.skipped["0"].startswith("unsupported type Embedding: float8 quantizes Linear")
    assert e.skipped["2"].startswith("too small for float8 matmuls: in_features=48, out_")
    e = mixprec.explain(model, "float8_from_mixed_bfloat16")  # tensorwise
    assert e.quantized == [] and e.skipped["1"].startswith("too small to gain: in_features=32")
    wide = nn.Sequential(nn.Linear(16, 2048))
    assert mixprec.explain(wide, "float8/delayed_from_mixed_bfloat16").quantized == ["0"]


def test_multihead_attention_out_proj_is_never_swapped():
    mha = nn.MultiheadAttention(32, 4)
    e = mixprec.explain(mha, "int8_from_float32")
    assert "nn.MultiheadAttention" in e.skipped["out_proj"]


def test_apply_quantizes_what_the_rules_say_and_the_rest_follows_the_float_policy():
    model = _model()
    pmap = mixprec.PolicyMap(
        "bf16-mixed", {"head": "int8_from_mixed_bfloat16", nn.Embedding: "int4/16_from_float32"}
    )
    mixprec.apply(model, pmap, warn=False)
    assert type(model["head"]) is Int8Linear and type(model["emb"]) is Int4Embedding
    assert type(model["body"][0]) is nn.Linear and type(model["tiny"]) is nn.Linear
    h = model["body"](model["emb"](torch.randint(0, 40, (2, 3))))
    assert h.dtype == f32  # root output dtype of bf16-mixed
    out = model["head"](h)
    assert out.dtype == f32
    # the type rule still names the swapped embedding; re-applying changes nothing
    assert mixprec.explain(model, pmap).quantization["emb"] == "int4"
    mixprec.apply(model, pmap, warn=False)
    assert type(model["emb"]) is Int4Embedding
    # remove restores forwards and dtypes; quantized layers stay quantized
    mixprec.remove(model)
    assert type(model["head"]) is Int8Linear and "forward" not in model["head"].__dict__


def test_int8_under_a_mixed_source_computes_around_the_int_matmul_in_bfloat16():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
    mixprec.apply(
        model, mixprec.PolicyMap("32-true", {"1": "int8_from_mixed_bfloat16"}), warn=False
    )
    region = model[1].__dict__["forward"]  # the layer's own compute region: bf16 autocast
    assert type(model[1]) is Int8Linear and region.autocast and region.compute_dtype == bf16
    assert model(torch.randn(3, 32)).dtype == f32
    with torch.autocast("cpu", dtype=bf16):  # inside it the layer answers as nn.Linear would
        assert Int8Linear.forward(model[1], torch.randn(3, 32)).dtype == bf16


def test_a_quantized_global_policy_quantizes_on_apply():
    model = nn.Sequential(nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 4))
    mixprec.set_global_policy("int4/-1_from_float32")
    mixprec.apply(model)
    assert type(model[0]) is Int4Linear and model[0].group_size == -1
    assert type(model[2]) is nn.Linear  # 8 input features: too small


def test_policy_maps_with_quantized_rules_round_trip():
    pmap = mixprec.PolicyMap(
        "int8_from_mixed_bfloat16",
        {"head": "float8/delayed:16_from_mixed_bfloat16", nn.Embedding: "int4/64_from_float32"},
    )
    assert mixprec.PolicyMap.from_config(json.loads(json.dumps(pmap.to_config()))) == pmap
    rebuilt = eval(pmap.to_code(), {"mixprec": mixprec, "torch": torch})
    assert rebuilt == pmap and rebuilt.rules["head"].amax_history_length == 16
    assert pmap.name == "int8_from_mixed_bfloat16 + 2 rule(s)"


A100 = hardware.DeviceInfo("cuda", "A100", 0, capability=(8, 0))
B200 = hardware.DeviceInfo("cuda", "NVIDIA B200", 0, capability=(10, 0))


@pytest.mark.parametrize(
    "spec, info, status",
    [
        # without VNNI int8 sums run in float32 matmuls: memory saved, not time (no error)
        ("int8_from_float32", AVX2_CPU, hardware.SUPPORTED),
        ("int8_from_float32", ZEN4, hardware.FAST),
        ("int4_from_float32", AVX2_CPU, hardware.FAST),
        ("int8_from_mixed_bfloat16", AVX2_CPU, hardware.SLOW),  # the bf16 source is slow there
        ("int8_from_mixed_bfloat16", H100, hardware.FAST),
        ("float8_from_mixed_bfloat16", H100, hardware.FAST),
        ("float8_from_mixed_bfloat16", A100, hardware.SLOW),
        ("float8_from_float32", AVX2_CPU, hardware.SLOW),
        ("transformer-engine", H100, hardware.FAST),
        ("transformer-engine-float16", H100, hardware.FAST),
        ("transformer-engine", A100, hardware.SLOW),  # float8 needs compute capability 8.9+
        ("transformer-engine", AVX2_CPU, hardware.SLOW),
        # torch's row-wise float8 kernels: a bfloat16 output on 8.9/9.0 only (else emulated)
        ("float8/rowwise_from_bf16-mixed", H100, hardware.FAST),
        ("float8/rowwise_from_float32", H100, hardware.SLOW),
        ("float8/rowwise_with_gw_hp_from_16-mixed", H100, hardware.SLOW),
        ("float8/rowwise_from_bf16-mixed", B200, hardware.SLOW),
        ("float8_from_bf16-mixed", B200, hardware.FAST),
    ],
)
def test_hardware_rates_quantized_policies_honestly(spec, info, status):
    """(Row-wise float8 was rated fast on every GPU of 8.9+ and any compute dtype, where
    it runs emulated but on Ada/Hopper with a bfloat16 output.)"""
    assert hardware.policy_support(spec, info).status == status


def test_float8_off_sm89_is_refused_as_slow_naming_where_it_is_fast():
    with pytest.raises(SlowPrecisionError, match=r"float8 tensor cores.*compute capability 8.9\+"):
        hardware.check("float8_from_mixed_bfloat16", info=A100)
    with hardware.assume(AVX2_CPU):
        with pytest.raises(SlowPrecisionError, match="emulated"):
            hardware.check(mixprec.PolicyMap("32-true", {"head": "float8_from_float32"}), "cpu")
        assert hardware.check("float8_from_float32", "cpu", allow_slow=True).status == hardware.SLOW
        support = hardware.check("int8_from_float32", "cpu")  # no error, said plainly
        assert support.status == hardware.SUPPORTED and "no VNNI" in support.reason


def test_keras_older_int4_none_name_quantizes_per_channel():
    """'int4/None_from_float32' (Keras's int4 without a block size) was refused; it is
    per-channel int4, one group per output row, named 'int4/-1_...' from then on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 8))
    explained = mixprec.explain(model, "int4/None_from_float32")
    assert explained.quantized == ["0"] and explained["0"].name == "int4/-1_from_float32"
    mixprec.quantize(model, "int4/None_from_float32")
    assert isinstance(model[0], Int4Linear) and model[0].group_size == -1
    assert model[0].weight_scale.shape == (8, 1)  # one scale per output channel


def test_policy_of_a_spec_builds_what_as_policy_builds():
    """`as_policy` is the one factory; `Policy(spec)` follows the same rule: a quantized spec
    gives a QuantizedPolicy, any other spec a float Policy."""
    specs = [*POLICY_NAMES, 16, torch.bfloat16, "p=f16,c=bf16", "transformer-engine"]
    for spec in [*specs, *ACCEPTED]:
        made = as_policy(spec)
        assert type(Policy(spec)) is type(made) and Policy(spec) == made
        assert isinstance(made, QuantizedPolicy) == mixprec.policy.is_quantized(spec)
    assert type(as_policy(Policy("int8_from_float32").to_config())) is QuantizedPolicy


def test_the_layer_rules_are_the_quantize_packages_and_the_policy_a_plain_value():
    """Which layers a quantized policy quantizes was a method of the policy; the rules live
    in `mixprec.quantize.rules`, which `explain`, `apply` and `quantize` all read."""
    policy = Policy("int8_from_float32")
    assert not hasattr(policy, "skip_reason")
    assert skip_reason(policy, nn.Linear(32, 32)) is None
    assert skip_reason(policy, nn.LayerNorm(32)) == (
        "unsupported type LayerNorm: int8 quantizes Linear, Embedding and Hugging Face's Conv1D"
    )
    model = _model()
    explained = mixprec.explain(model, policy).skipped
    assert explained == {
        path: skip_reason(policy, module)
        for path, module in model.named_modules()
        if skip_reason(policy, module) is not None and list(module.parameters(recurse=False))
    }


def test_capping_onednn_below_vnni_rates_int8_as_saving_memory_only():
    flags = frozenset({"avx2", "avx512bw", "avx512_vnni", "avx512_bf16"})
    kept, note = cap_cpu_flags(flags, {"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert "avx512_vnni" not in kept and note
    kept, _ = cap_cpu_flags(flags, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"})
    assert "avx512_vnni" in kept and "avx512_bf16" not in kept
    capped = hardware.DeviceInfo("cpu", "capped", cpu_flags=kept - {"avx512_vnni"})
    assert int8_support(capped).status == hardware.SUPPORTED
    # an Arm CPU reports none of the x86 flags: not judged by them
    arm = hardware.DeviceInfo("cpu", "Arm", cpu_flags=frozenset({"asimd"}))
    assert int8_support(arm).status == hardware.FAST


def test_a_cpu_described_without_flags_is_not_rated_fast_at_int8():
    """A CPU described with no flags was rated "fast" at int8 (taken for a non-x86 one)
    while its bfloat16 was rated as an x86's without AVX-512: nothing unlisted is assumed
    now, so int8 saves memory there, as on an x86 without VNNI."""
    bare = hardware.DeviceInfo("cpu", "AMD EPYC 7R32 (AVX2 only)")
    assert int8_support(bare).status == hardware.SUPPORTED
    assert "no VNNI" in int8_support(bare).reason
    assert hardware.policy_support("bf16-mixed", bare).status == hardware.SLOW
    # a host whose flags could not be read (an Arm one's, by an older torch) is not "bare"
    unread = hardware.DeviceInfo("cpu", "Arm", unknown_flags=frozenset({"bf16"}))
    assert int8_support(unread).status == hardware.FAST


def test_quantize_takes_a_modes_options_in_its_name_as_a_policy_does():
    """'mxfp8/floor' was taken but 'int4/64' and 'float8/delayed:16' were 'unknown modes':
    every mode takes its options after '/' as in a policy name, keywords beside them refused."""
    from mixprec.quantize.float8 import Float8Linear

    model = nn.Sequential(nn.Linear(256, 256))
    mixprec.quantize(model, "int4/64")
    assert isinstance(model[0], Int4Linear) and model[0].group_size == 64
    model = nn.Sequential(nn.Linear(256, 256))
    result = mixprec.quantize(model, "float8/rowwise")
    assert isinstance(model[0], Float8Linear) and result.quantized == {"0": "float8 (rowwise)"}
    with pytest.raises(PolicySpecError, match="names its options already"):
        mixprec.quantize(nn.Sequential(nn.Linear(256, 256)), "int4/64", group_size=32)
    with pytest.raises(PolicySpecError, match="unknown float8 recipe 'bogus'"):
        mixprec.quantize(nn.Sequential(nn.Linear(256, 256)), "float8/bogus")


def test_setup_with_an_optimizer_built_first_warns_of_the_replaced_weights():
    """Precision("int8_from_float32").setup(model, optimizer) with the optimizer built on the
    float model kept the two replaced float weights in it (stepped, held in memory, reaching
    nothing) without a word. It warns naming them; an optimizer built after does not."""
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.warns(UserWarning, match=r"holds 2 parameter\(s\) that the conversion replaced "
                      r"\(0.weight, 2.weight\)") as caught:  # fmt: skip
        mixprec.Precision("int8_from_float32").setup(model, opt)
    assert caught[0].filename == __file__
    again = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixprec.Precision("int8_from_float32").setup(again)


def test_quantize_and_dequantize_refuse_a_model_apply_converted():
    """Before: both swapped layers of an applied model and dropped their regions: a float32
    rule's layer then computed in bfloat16 under the root's autocast while `explain` still
    listed 32-true (and a quantized rule's layer lost its region on dequantize)."""
    from collections import OrderedDict

    from mixprec.quantize import dequantize, quantize

    def fresh() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(OrderedDict(body=nn.Linear(32, 32), head=nn.Linear(32, 32)))

    model = mixprec.apply(fresh(), mixprec.PolicyMap("bf16-mixed", {"head": "float32"}))
    for call in (lambda m: quantize(m, "int8"), dequantize):
        for target in (model, model.head):  # (a region below the root too)
            with pytest.raises(ValueError, match="before apply, or mixprec.remove"):
                call(target)
    assert type(model.head) is nn.Linear and "forward" in model.head.__dict__
    # removed, quantized, applied again: what the message says works
    mixprec.remove(model)
    quantize(model, "int8")
    mixprec.apply(model, mixprec.PolicyMap("bf16-mixed", {"head": "float32"}))
    assert model.head.quantization_mode == "int8"
