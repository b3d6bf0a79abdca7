"""Policy parsing, equality, config round-trips, global policy and scopes."""

import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mixprec
from mixprec import Policy, PolicySpecError
from mixprec.policy.names import POLICY_NAMES

f64, f32, f16, bf16 = torch.float64, torch.float32, torch.float16, torch.bfloat16

EXPECTED = {
    # Lightning names and aliases
    "16-mixed": (f32, f16, f32),
    "bf16-mixed": (f32, bf16, f32),
    "16-true": (f16, f16, f16),
    "bf16-true": (bf16, bf16, bf16),
    "32-true": (f32, f32, f32),
    "64-true": (f64, f64, f64),
    16: (f32, f16, f32),
    "16": (f32, f16, f32),
    32: (f32, f32, f32),
    "32": (f32, f32, f32),
    64: (f64, f64, f64),
    "64": (f64, f64, f64),
    "bf16": (f32, bf16, f32),
    # Keras names
    "mixed_float16": (f32, f16, f32),
    "mixed_bfloat16": (f32, bf16, f32),
    "float32": (f32, f32, f32),
    "float16": (f16, f16, f16),
    "bfloat16": (bf16, bf16, bf16),
    "float64": (f64, f64, f64),
    # jmp specs
    "params=float32,compute=bfloat16,output=float32": (f32, bf16, f32),
    "p=f32,c=bf16,o=f32": (f32, bf16, f32),
    "p=f32,c=f16,o=f16": (f32, f16, f16),
    "params=full,compute=half,output=full": (f32, f16, f32),
    # torch dtypes
    torch.bfloat16: (bf16, bf16, bf16),
    torch.float32: (f32, f32, f32),
}


@pytest.mark.parametrize("spec", list(EXPECTED), ids=[str(s) for s in EXPECTED])
def test_every_name_parses_to_its_dtypes(spec):
    p = Policy(spec)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == EXPECTED[spec]
    assert p.variable_dtype == p.param_dtype


def test_spellings_of_one_policy_are_equal_and_share_a_name():
    a, b, c = Policy("bf16-mixed"), Policy("mixed_bfloat16"), Policy("p=f32,c=bf16,o=f32")
    assert a == b == c and hash(a) == hash(b) == hash(c)
    assert {a, b, c} == {a}
    assert str(a) == str(b) == "bf16-mixed"
    assert repr(c) == "Policy('bf16-mixed')"
    assert Policy("mixed_float16") == Policy(16) == Policy("16-mixed")


def test_uncommon_policy_gets_a_jmp_style_name():
    p = Policy(param_dtype="float32", compute_dtype="bfloat16", output_dtype="float16")
    assert p.name == "params=float32,compute=bfloat16,output=float16"
    assert Policy(p.name) == p


@pytest.mark.parametrize(
    ("spec", "dtypes"),
    [
        ("p=f16,c=bf16", (f16, bf16, bf16)),
        ("p=bf16,c=f16", (bf16, f16, f16)),
        ("p=bf16,c=f32", (bf16, f32, f32)),
        ("p=f16,c=f32,o=f16", (f16, f32, f16)),
        ("p=f32,c=f64", (f32, f64, f64)),
        ("p=f64,c=f32", (f64, f32, f32)),
        ("p=f64,c=bf16", (f64, bf16, bf16)),
    ],
)
def test_jmp_policies_autocast_cannot_give_cast_their_params(spec, dtypes):
    """They were refused ("p=f16,c=bf16" raised) though jmp runs them: the params are cast to
    the compute dtype for each forward (tests/policy/test_policy_cast.py trains them)."""
    p = Policy(spec)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == dtypes
    assert p.casts_params and not p.is_mixed
    assert p.buffer_dtype == p.compute_dtype  # running statistics live where they are computed
    assert Policy(p.name) == p


def test_keyword_form_and_defaults():
    assert Policy(param_dtype=f32, compute_dtype=bf16) == Policy("bf16-mixed")
    assert Policy(variable_dtype="f16") == Policy("16-true")
    assert Policy("bf16-mixed", output_dtype="bfloat16").output_dtype == bf16
    with pytest.raises(PolicySpecError, match="not both"):
        Policy(param_dtype=f32, variable_dtype=f32)


def test_flags():
    assert Policy("16-mixed").needs_loss_scaling and Policy("16-true").needs_loss_scaling
    assert not Policy("bf16-mixed").needs_loss_scaling
    assert not Policy("32-true").needs_loss_scaling
    assert Policy("bf16-mixed").is_mixed and not Policy("bf16-true").is_mixed
    assert Policy("p=f16,c=bf16").needs_loss_scaling and Policy("p=bf16,c=f16").needs_loss_scaling
    assert Policy("p=f32,c=f32,o=f16").needs_loss_scaling
    assert Policy("p=f32,c=bf16,o=f16").needs_loss_scaling


@pytest.mark.parametrize("spec", ["p=f32,c=f32,o=f16", "p=f32,c=bf16,o=f16"])
def test_a_float16_output_gets_a_loss_scale_and_keeps_small_gradients(spec):
    """A policy whose only float16 is its output took no loss scale: the gradient reaching
    that output is float16 too (its cast's backward), and a loss whose gradients there are
    under 6e-8 trained the layer with zeros, silently (a mean over 262,144 outputs)."""
    import mixprec

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1024)
    precision = mixprec.Precision(spec, allow_slow=True)
    model, _ = precision.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    out = model(torch.randn(256, 16))
    assert out.dtype == torch.float16 and precision.scaler.kind == "dynamic"
    precision.backward(1e-3 * torch.nn.functional.mse_loss(out.float(), torch.zeros(256, 1024)))
    assert (model.weight.grad != 0).float().mean() > 0.99
    for name in POLICY_NAMES:  # autocast or one dtype: nothing to cast
        assert not Policy(name).casts_params
        assert Policy(name).buffer_dtype == Policy(name).param_dtype


@pytest.mark.parametrize("spec", [*POLICY_NAMES, "p=f16,c=bf16", torch.float64])
def test_a_float_policy_quantizes_nothing_as_keras_says_with_none(spec):
    """Policy("mixed_float16").quantization_mode raised AttributeError; Keras's float policies
    answer None, and code tells quantized layers apart that way."""
    assert Policy(spec).quantization_mode is None
    assert Policy("int8_from_mixed_bfloat16").quantization_mode == "int8"


def test_immutable():
    p = Policy("bf16-mixed")
    with pytest.raises(AttributeError):
        p.compute_dtype = f32  # type: ignore[misc]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("fp16", r"unknown precision 'fp16' \(did you mean '16-mixed'"),
        ("half", "did you mean"),
        ("bf17-mixed", "unknown precision 'bf17-mixed'.*accepted: .*'bf16-mixed'"),
        ("", "unknown precision ''"),
        (8, "unknown precision 8"),
        (True, "must be a string, int, torch.dtype or Policy, not bool"),
        (1.5, "not float"),
        ("p=f32,c=f99", "unknown dtype 'f99'.*accepted"),
        ("p=f32,x=f16", "unknown key 'x'"),
        ("p=f32,p=f16", "given twice"),
        ("p=f32,c", "malformed part 'c'"),
        ("p=f32,c=", "malformed part"),
        (torch.int8, "int8 is not a floating dtype"),
        ("uint8", "uint8 is not a floating dtype"),
        ("torch.int32", "int32 is not a floating dtype"),
        ("p=f32,c=int8", "int8 is not a floating dtype"),
        ("complex64", "complex64 is not a floating dtype"),
        ("p=f32,c=float8_e4m3fn", "float8 tensors need per-tensor scales"),
        # before: accepted, and apply stored every weight as an unsigned power of two
        ("float8_e8m0fnu", "float8_e8m0fnu is not a policy dtype"),
        (torch.float8_e8m0fnu, "param dtype float8_e8m0fnu refused: a policy's dtypes are"),
        ("p=f32,c=float8_e8m0fnu", "compute dtype float8_e8m0fnu refused.*'mxfp8_from_"),
        (torch.float4_e2m1fn_x2, "param dtype float4_e2m1fn_x2 refused"),
        ("mixed", "did you mean 'bf16-mixed' or '16-mixed'"),
    ],
)
def test_bad_specs_say_what_is_wrong_and_what_is_accepted(spec, message):
    with pytest.raises(PolicySpecError, match=message):
        Policy(spec)


def test_unknown_name_lists_every_accepted_name():
    with pytest.raises(ValueError) as err:
        Policy("turbo")
    for name in POLICY_NAMES:
        assert repr(name) in str(err.value)


# jmp's own strings (jmp/_src/policy.py and its tests) and what jmp's get_policy makes of
# them: params default to float32, compute follows params, output follows compute.
JMP = {
    "c=f16": (f32, f16, f16),
    "c=bf16": (f32, bf16, bf16),
    "c=float16": (f32, f16, f16),
    "c=bfloat16": (f32, bf16, bf16),
    "c=float32": (f32, f32, f32),
    "p=f16,c=f16": (f16, f16, f16),
    "p=f16,c=f16,o=f32": (f16, f16, f32),
    "c=float16,o=full": (f32, f16, f32),
    "c=bfloat16,o=full": (f32, bf16, f32),
    "c=half,o=full": (f32, f16, f32),
    "params=float32,compute=bfloat16": (f32, bf16, bf16),
    "params=float32,compute=float16,output=float32": (f32, f16, f32),
    "p=f64": (f64, f64, f64),
    "o=bf16": (f32, f32, bf16),
}


@pytest.mark.parametrize("spec", list(JMP))
def test_jmp_specs_mean_what_they_mean_in_jmp(spec):
    p = Policy(spec)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == JMP[spec]


@given(
    st.sampled_from([None, "f32", "f16", "bf16", "f64", "full", "half", "bfloat16"]),
    st.sampled_from([None, "f32", "f16", "bf16", "f64", "full", "half", "float16"]),
    st.sampled_from([None, "f32", "f16", "bf16", "f64", "full", "half", "float32"]),
    st.booleans(),
)
def test_jmp_defaults_chain_params_to_compute_to_output(p, c, o, long_keys):
    keys = ("params", "compute", "output") if long_keys else ("p", "c", "o")
    parts = [f"{k}={v}" for k, v in zip(keys, (p, c, o), strict=True) if v is not None]
    if not parts:
        return
    dtype = mixprec.dtypes.to_dtype
    param = dtype(p) if p else f32
    compute = dtype(c) if c else param
    output = dtype(o) if o else compute
    got = Policy(",".join(parts))
    assert (got.param_dtype, got.compute_dtype, got.output_dtype) == (param, compute, output)


def test_where_lightning_and_jmp_disagree_lightning_wins_or_the_name_is_refused():
    # Lightning: "bf16" is bf16-mixed (jmp would put every role in bfloat16)
    assert Policy("bf16") == Policy("bf16-mixed")
    # jmp's bare short names are ambiguous next to Lightning's "16": spelled out instead
    for name, hint in [
        ("f16", "'16-true'"),
        ("half", "'16-true'"),
        ("f32", "'32-true'"),
        ("full", "'32-true'"),
        ("f64", "'64-true'"),
    ]:
        with pytest.raises(PolicySpecError, match=f"did you mean {hint}"):
            Policy(name)


def test_auto_is_a_spec_no_policy_resolves_on_its_own():
    for coerce in (Policy, mixprec.policy.as_policy, mixprec.PolicyMap):
        with pytest.raises(PolicySpecError, match=r"resolve_policy\('auto', device\)"):
            coerce("auto")


def test_as_policy_takes_a_config_like_keras_get():
    for spec in ("bf16-mixed", "p=f32,c=bf16,o=f16", "64-true"):
        policy = Policy(spec)
        assert mixprec.policy.as_policy(policy.to_config()) == policy
    assert mixprec.policy.as_policy(None) == mixprec.global_policy()


DTYPES = st.sampled_from(["float64", "float32", "float16", "bfloat16", "f32", "half", "bf16"])


@given(DTYPES, DTYPES, DTYPES)
def test_name_round_trip_is_stable(param, compute, output):
    p = Policy(param_dtype=param, compute_dtype=compute, output_dtype=output)
    again = Policy(p.name)
    assert again == p and again.name == p.name
    assert Policy.from_config(p.to_config()) == p
    assert Policy(Policy(again.name).name) == p


def test_from_config_rejects_unknown_keys():
    with pytest.raises(PolicySpecError, match="unknown policy config keys.*expected param_dtype"):
        Policy.from_config({"param_dtype": "float32", "colour": "red"})


def test_from_config_given_a_name_says_to_use_the_constructor():
    with pytest.raises(PolicySpecError, match=r"not str 'bf16-mixed'.*Policy\('bf16-mixed'\)"):
        Policy.from_config("bf16-mixed")  # type: ignore[arg-type]
    with pytest.raises(PolicySpecError, match="PolicyMap config.*PolicyMap.from_config"):
        Policy.from_config(mixprec.PolicyMap("bf16-mixed").to_config())


def test_global_policy_and_scope_restore_also_on_error():
    assert mixprec.global_policy() == Policy("32-true")
    mixprec.set_global_policy("mixed_bfloat16")
    try:
        assert mixprec.global_policy() == Policy("bf16-mixed")
        with pytest.raises(RuntimeError):
            with mixprec.policy_scope("16-mixed") as p:
                assert mixprec.global_policy() == p == Policy("16-mixed")
                with mixprec.policy_scope("64"):
                    assert mixprec.global_policy() == Policy("64-true")
                assert mixprec.global_policy() == Policy("16-mixed")
                raise RuntimeError("boom")
        assert mixprec.global_policy() == Policy("bf16-mixed")
    finally:
        mixprec.set_global_policy("32-true")


def test_policy_scope_is_per_thread():
    inside = threading.Event()
    release = threading.Event()
    seen = {}

    def worker():
        with mixprec.policy_scope("bf16-true"):
            seen["worker"] = mixprec.global_policy()
            inside.set()
            release.wait(5)

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(5)
    seen["main"] = mixprec.global_policy()
    release.set()
    t.join()
    assert seen == {"worker": Policy("bf16-true"), "main": Policy("32-true")}


def test_policies_pickle():
    import pickle

    p = Policy("p=f32,c=bf16,o=bf16")
    assert pickle.loads(pickle.dumps(p)) == p


def test_setting_the_global_policy_to_none_is_refused_by_name():
    before = mixprec.global_policy()
    with pytest.raises(PolicySpecError, match=r"set_global_policy needs a policy, not None"):
        mixprec.set_global_policy(None)
    with pytest.raises(PolicySpecError, match=r"policy_scope needs a policy, not None"):
        with mixprec.policy_scope(None):
            pass
    assert mixprec.global_policy() is before


# --- a spec is parsed once, into a frozen value; Policy(...) is a factory ---------------------


def test_a_spec_is_parsed_once_into_a_frozen_value_the_policy_holds():
    import dataclasses

    from mixprec.formats.float8 import Float8Config
    from mixprec.policy import QuantizedPolicy
    from mixprec.policy.names import FloatSpec, QuantizedSpec, parse_spec
    from mixprec.quantize.float8 import FLOAT8
    from mixprec.quantize.int4 import INT4, Int4Config

    assert parse_spec("mixed_bfloat16") == FloatSpec(f32, bf16, f32)
    spec = parse_spec("int4/64_from_bf16-mixed")
    assert spec == QuantizedSpec(INT4, Int4Config(64), FloatSpec(f32, bf16, f32))
    assert spec.name == "int4/64_from_mixed_bfloat16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.config = Int4Config(32)
    delayed = parse_spec("transformer-engine")
    assert delayed.format is FLOAT8 and delayed.config == Float8Config("delayed")
    p = Policy("int4/64_from_bf16-mixed")
    assert type(p) is QuantizedPolicy and p.format is INT4 and p.config == Int4Config(64)
    with pytest.raises(PolicySpecError, match="param dtype int8 is not a floating dtype"):
        FloatSpec(torch.int8, f32, f32)


def test_calling_policy_is_a_factory_and_its_signature_says_what_it_takes():
    import inspect

    from mixprec.policy import QuantizedPolicy, as_policy

    assert "__new__" not in vars(Policy) and "__init__" not in vars(Policy)
    q = Policy("int8_from_bf16-mixed")
    assert type(q) is QuantizedPolicy and q == as_policy("int8_from_bf16-mixed")
    assert Policy(q) == q and type(Policy("bf16-mixed")) is Policy
    params = list(inspect.signature(Policy).parameters)
    assert params == ["spec", "param_dtype", "compute_dtype", "output_dtype", "variable_dtype"]
    assert list(inspect.signature(QuantizedPolicy).parameters) == ["mode", "source", "options"]
