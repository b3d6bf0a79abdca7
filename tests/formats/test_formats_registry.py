"""The registry of quantized formats (`mixprec.formats`): a format declared in one object is
parsed, named, applied, explained, rated, searched and weighed everywhere.

A toy format, declared and registered in this file alone, rounds a Linear's weights to a
grid of 1/`steps` ("toy" = eighths, "toy/16" = sixteenths) in each forward. Everything it
does here it does through the registry: no other file knows it."""

from __future__ import annotations

import ast
import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from devices import AVX2_CPU, H100
from torch import nn

import mixprec
from mixprec import hardware
from mixprec.errors import PolicySpecError, SlowPrecisionError
from mixprec.formats import Format, Status, Support, format_named, formats, register, unregister
from mixprec.plan import search
from mixprec.plan.units import candidate, default_formats, find_units, state_bytes
from mixprec.policy import Policy, QuantizedPolicy, as_policy
from mixprec.quantize.rules import linear_view


@dataclass(frozen=True)
class ToyConfig:
    steps: int = 8


class ToyLinear(nn.Linear):
    """A Linear computing with its weight rounded to multiples of 1 / steps; the float
    weight stays the parameter and trains (straight through the rounding)."""

    quantization_mode = "toy"
    float_type = nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rounded = w + (torch.round(w * self.steps) / self.steps - w).detach()
        return F.linear(x, rounded, self.bias)


class ToyFormat(Format):
    name = "toy"
    accepted = "'toy' (weights on a grid of eighths), 'toy/<steps per unit>'"
    config_keys = {"options": "the toy's steps per unit"}
    search = ("toy", "toy/4")
    fast_on = "CUDA GPUs (this toy's rounding is free there)"

    def parse(self, options: str | None, keywords: Mapping[str, Any], name: str) -> ToyConfig:
        if options is None:
            return ToyConfig()
        if not options.isdigit() or int(options) < 1:
            raise PolicySpecError(f"toy steps {options!r} in {name!r}: a positive int")
        return ToyConfig(int(options))

    def spell(self, config: ToyConfig) -> str:
        return "toy" if config.steps == 8 else f"toy/{config.steps}"

    def describe(self, config: ToyConfig) -> str:
        return f"toy (grid of 1/{config.steps})"

    def skip(self, config: ToyConfig, module: nn.Module) -> str | None:
        return None if module.out_features % 2 == 0 else "an odd number of outputs"

    def swap(self, module, config, *, path, storage, tie, memo) -> nn.Module:
        layer = ToyLinear.__new__(ToyLinear)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = module.in_features, module.out_features
        layer.weight, layer.bias = module.weight, module.bias
        layer.steps = config.steps
        return layer

    def layer_config(self, layer: nn.Module) -> ToyConfig:
        return ToyConfig(layer.steps)

    def rate(self, info: hardware.DeviceInfo) -> Support:
        if info.type == "cuda":
            return Support(Status.FAST, "rounds in the matmul's prologue")
        return Support(Status.SLOW, f"rounds in a separate pass on {info.type}")


TOY = ToyFormat()


@pytest.fixture
def toy() -> Iterator[ToyFormat]:
    register(TOY)
    try:
        yield TOY
    finally:
        unregister("toy")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5), nn.Linear(5, 32))


def test_a_registered_format_parses_and_names_itself_canonically(toy) -> None:
    p = Policy("toy_from_bf16-mixed")
    assert isinstance(p, QuantizedPolicy) and p.format is toy and p.config == ToyConfig(8)
    assert p.name == "toy_from_mixed_bfloat16" and p.compute_dtype == torch.bfloat16
    assert Policy("toy/8_from_bf16-mixed") == p  # the default step count is not spelled
    q = QuantizedPolicy("toy/16", "float32")
    assert q.name == "toy/16_from_float32" and Policy(q.name) == q
    assert QuantizedPolicy.from_config(q.to_config()) == q == pickle.loads(pickle.dumps(q))
    assert q.to_config() == {
        "quantization_mode": "toy",
        "source": {"param_dtype": "float32", "compute_dtype": "float32", "output_dtype": "float32"},
        "options": "16",
    }
    with pytest.raises(PolicySpecError, match="toy steps 'x' in 'toy/x_from_float32'"):
        Policy("toy/x_from_float32")
    with pytest.raises(PolicySpecError, match="group_size is an int4 option, not toy's"):
        QuantizedPolicy("toy", "float32", group_size=32)
    with pytest.raises(PolicySpecError, match=r"precision 'toy' refused: toy names a quantization"):
        Policy("toy")
    with pytest.raises(PolicySpecError, match="modes are int8, int4, float8, .*, toy.*'toy/<steps"):
        Policy("tiny_from_float32")


def test_quantize_and_apply_swap_in_its_layer_where_its_rules_allow(toy) -> None:
    model = _model()
    x = torch.randn(4, 32)
    result = mixprec.quantize(model, "toy/4")
    assert result.quantized == {"0": "toy (grid of 1/4)"}
    assert result.skipped == {
        "2": "an odd number of outputs",
        "3": "too small: 5 input features (fewer than 16 save little and lose the most accuracy)",
    }
    assert isinstance(model[0], ToyLinear) and model[0].steps == 4
    w = model[0].weight
    expected = F.linear(x, torch.round(w * 4) / 4, model[0].bias)
    assert torch.equal(model[0](x), expected)
    with pytest.raises(ValueError, match=r"already quantized to toy \(grid of 1/4\), not toy"):
        mixprec.quantize(model, "toy/8")

    applied = mixprec.apply(_model(), "toy_from_float32")
    assert isinstance(applied[0], ToyLinear) and applied[0].steps == 8


def test_explain_says_which_layers_it_quantizes_and_why_not_the_others(toy) -> None:
    explanation = mixprec.explain(_model(), "toy_from_float32")
    assert explanation.quantization == {
        "0": "toy",
        "2": "skipped: an odd number of outputs",
        "3": "skipped: too small: 5 input features (fewer than 16 save little and lose the "
        "most accuracy)",
    }


def test_hardware_rates_it_by_its_own_rating(toy) -> None:
    s = hardware.policy_support(Policy("toy_from_float32"), AVX2_CPU)
    assert s == Support(Status.SLOW, "toy: rounds in a separate pass on cpu")
    assert hardware.policy_support(Policy("toy_from_float32"), H100).status == Status.FAST
    with pytest.raises(SlowPrecisionError, match=r"It is fast on CUDA GPUs \(this toy's"):
        hardware.check("toy_from_float32", info=AVX2_CPU)
    assert hardware.check("toy_from_float32", info=AVX2_CPU, allow_slow=True) == s


def test_the_search_tries_it_and_weighs_it(toy) -> None:
    fast, left_out = default_formats(as_policy("32-true"), H100)
    assert fast[-2:] == ["toy_from_float32", "toy/4_from_float32"]
    _, left_out = default_formats(as_policy("32-true"), AVX2_CPU)
    assert left_out["toy_from_float32"] == "slow: toy: rounds in a separate pass on cpu"

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
    x = torch.randn(16, 32)
    report = search(
        model,
        [(x, torch.randn(16, 32))],
        F.mse_loss,
        budget={"memory": 1.0},
        formats=["toy/4_from_32-true"],
        baseline="32-true",
        device_info=H100,
        device="cpu",
        reps=1,
    )
    assert all("toy/4_from_float32" in row.options for row in report.rows)
    (unit, _) = find_units(model)
    holder = candidate(model, unit, as_policy("toy/4_from_32-true"))
    assert isinstance(holder[0], ToyLinear)
    # the toy keeps the float weight: its declared bytes are the weight's, as measured
    weight = toy.weight_bytes(ToyConfig(4), model[0], torch.float32)
    assert state_bytes(holder, "weights") == weight + 32 * 4 == (32 * 32 + 32) * 4


def test_unregistering_a_format_forgets_it() -> None:
    register(TOY)
    assert format_named("toy") is TOY and formats()[-1] is TOY
    with pytest.raises(ValueError, match="a format named 'toy' is registered already"):
        register(ToyFormat())
    assert unregister("toy") is TOY
    assert format_named("toy") is None
    with pytest.raises(PolicySpecError, match="unknown quantization mode 'toy'"):
        Policy("toy_from_float32")
    with pytest.raises(KeyError, match="no format named 'toy'"):
        unregister("toy")


@pytest.mark.parametrize(
    ("name", "error", "message"),
    [
        (3, TypeError, "a format's name is a string.*got int 3 from Unnamed.name"),
        (None, TypeError, "got NoneType None from Unnamed.name"),
        ("to y", ValueError, "without blanks.*got 'to y'"),
        ("Toy", ValueError, "lower case.*got 'Toy'"),
    ],
)
def test_a_format_name_that_is_no_policy_spelling_is_refused_saying_why(
    name, error, message
) -> None:
    unnamed = type("Unnamed", (ToyFormat,), {"name": name})()
    with pytest.raises(error, match=message):
        register(unnamed)
    assert unnamed not in formats()


class KeyedToyFormat(ToyFormat):
    """The toy, its steps written into a policy config under a key of its own."""

    name = "keyedtoy"
    accepted = "'keyedtoy', 'keyedtoy/<steps per unit>'"
    config_keys = {"steps": "the toy's steps per unit"}

    def to_dict(self, config: ToyConfig) -> dict[str, Any]:
        return {"steps": config.steps}

    def from_dict(self, values: Mapping[str, Any], name: str) -> ToyConfig:
        return ToyConfig(values["steps"])


def test_a_policy_file_naming_a_format_not_registered_says_so(tmp_path) -> None:
    """A policy file written while a format was registered, read where it is not: the
    error names the format and registering it, not its config keys."""
    register(KeyedToyFormat())
    register(TOY)
    try:
        policy = QuantizedPolicy("keyedtoy/16", "float32")
        assert QuantizedPolicy.from_config(policy.to_config()) == policy
        path = mixprec.PolicyMap(rules={"0": policy}).save(tmp_path / "policy.json")
        config, toy_config = policy.to_config(), QuantizedPolicy("toy/16", "float32").to_config()
    finally:
        unregister("keyedtoy")
        unregister("toy")
    unregistered = (
        r"unknown quantization mode '{}'.*no format of that name is registered; modes are "
        r"int8, int4, .*mixprec\.formats\.register"
    )
    with pytest.raises(PolicySpecError, match=unregistered.format("keyedtoy")):
        mixprec.PolicyMap.load(path)
    with pytest.raises(PolicySpecError, match=unregistered.format("keyedtoy")):
        QuantizedPolicy.from_config(config)
    with pytest.raises(PolicySpecError, match=unregistered.format("toy")):
        QuantizedPolicy.from_config(toy_config)  # its key "options" is a builtin one too


@pytest.mark.parametrize(
    "spec",
    ["int8", "int4/32", "int4/-1", "float8", "float8/delayed:16", "mxfp8", "mxfp4", "nvfp4"],
)
def test_the_bytes_a_format_declares_are_the_bytes_its_layer_holds(spec) -> None:
    linear = nn.Linear(64, 32)
    policy = QuantizedPolicy(spec, "float32")
    fmt, config = policy.format, policy.config
    expected = fmt.weight_bytes(config, linear, torch.float32)
    layer = fmt.swap(linear, config, path="0", storage=torch.float32, tie=(), memo={})
    assert layer.quantization_mode == fmt.name
    held = {id(t): t for t in (*layer.parameters(), *layer.buffers()) if t is not layer.bias}
    assert sum(t.numel() * t.element_size() for t in held.values()) == expected


@pytest.mark.parametrize("spec", ["int8", "int4/32"])
def test_the_bytes_declared_for_a_hugging_face_conv1d_are_the_bytes_it_holds(spec) -> None:
    """GPT-2's Conv1D stores its weight [in, out]: the declared bytes read it as [out, in]
    (int8 6656 bytes for 6800 held, int4 5376 for 4200)."""
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    conv = pytorch_utils.Conv1D(100, 64)  # (nf: out, nx: in)
    policy = QuantizedPolicy(spec, "float32")
    fmt, config = policy.format, policy.config
    expected = fmt.weight_bytes(config, conv, torch.float32)
    # (quantized as the Linear it stands for, as apply quantizes it)
    layer = fmt.swap(linear_view(conv), config, path="0", storage=torch.float32, tie=(), memo={})
    held = {id(t): t for t in (*layer.parameters(), *layer.buffers()) if t is not layer.bias}
    assert sum(t.numel() * t.element_size() for t in held.values()) == expected


def test_the_builtin_formats_are_registered_in_order() -> None:
    names = [f.name for f in formats()]
    assert names == ["int8", "int4", "float8", "mxfp8", "mxfp6", "mxfp4", "nvfp4"]
    assert [f.name for f in mixprec.quantize.BUILTIN_FORMATS] == names


# modules that own a format (its grammar, config, layer) and may name it
FORMAT_MODULES = {
    "formats",
    "int8.py",
    "int4.py",
    "float8.py",
    "microscaling.py",
    "block_formats.py",
}


# the optimizer-state formats (`mixprec.optim.states`) are another vocabulary, whose "int8" and
# "int4" name moments' codes, declared in their own module
STATE_FORMATS = "states/formats.py"


def test_no_module_outside_the_formats_compares_against_a_mode_name() -> None:
    """Code reads the registry: a comparison with a format's name (``mode == "int8"``,
    ``mode in ("mxfp8", ...)``) belongs in that format's own module."""
    src = Path(mixprec.__file__).parent
    names = {f.name for f in formats()}
    wrong = []
    for path in sorted(src.rglob("*.py")):
        if path.name in FORMAT_MODULES or path.parent.name in FORMAT_MODULES:
            continue
        if path.relative_to(src).as_posix() == STATE_FORMATS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            for side in sides:
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                    wrong.append(f"{path.relative_to(src)}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)
