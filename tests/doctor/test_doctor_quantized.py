"""The doctor under quantized policies: a layer whose activations have a few huge channels
loses its signal when quantized (the scale follows the outliers); the doctor names it and
recommends the float policy it was quantized from, and leaves healthy quantized models be."""

import pytest
import torch
from torch import nn

import mixprec
from mixprec.doctor import diagnose
from mixprec.doctor.verdicts import BROKEN, QUANTIZED_TOLERANCE
from mixprec.quantize.float8 import Float8Linear


class Outliers(nn.Module):
    """Multiplies the first channels by a huge factor, like the outlier features of LLMs."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, :4] * self.factor, x[:, 4:]], dim=1)


def _planted(width: int, factor: float) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, width),
        nn.ReLU(),
        nn.Linear(width, width),
        Outliers(factor),
        nn.Linear(width, width),  # the victim: its input's scale is set by 4 channels
        nn.ReLU(),
        nn.Linear(width, 16),
    )
    with torch.no_grad():
        model[4].weight[:, :4] = 0  # the outlier channels carry no signal: the rest does
    return model


def _batch(width: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(32, 64), torch.randn(32, 16)


@pytest.mark.filterwarnings("ignore:precision .* is slow")
def test_float8_outliers_break_the_layer_after_them_and_its_float_policy_fixes_it():
    # 2048 wide: torchao's size rule lets tensorwise float8 convert these layers
    model = _planted(2048, 1e6)
    d = diagnose(model, _batch(), nn.functional.mse_loss, "float8_from_float32")
    (finding,) = d.findings
    assert finding.name == "4" and finding.type == "Float8Linear"
    assert finding.verdict == BROKEN and finding.kind == "quantization"
    assert "float8_from_float32" in finding.reason and finding.sqnr_db < 6
    assert d.default_tolerance == QUANTIZED_TOLERANCE and not d.passes()
    fix = d.recommend()
    assert fix.policy.rules == {"4": mixprec.Policy("float32")}
    assert fix.verified.passes() and not fix.verified.findings
    # the fix really runs layer 4 in float, the others still in float8
    mixprec.apply(model, fix.policy, warn=False)
    assert type(model[4]) is nn.Linear and isinstance(model[2], Float8Linear)


@pytest.mark.filterwarnings("ignore:precision .* is slow")
def test_int8_per_token_activations_lose_the_small_channels_next_to_outliers():
    model = _planted(64, 1e4)  # int8 quantizes layers of any size from 16 inputs
    d = diagnose(model, _batch(), nn.functional.mse_loss, "int8_from_float32")
    names = [f.name for f in d.findings]
    assert names == ["4"] and d.findings[0].kind == "quantization"
    assert "int8_from_float32" in d.findings[0].reason
    assert d.recommend().policy.rules == {"4": mixprec.Policy("float32")}


@pytest.mark.filterwarnings("ignore:precision .* is slow")
def test_a_healthy_model_passes_under_float8_at_the_quantized_tolerance():
    model = _planted(2048, 1.0)  # no outliers
    d = diagnose(model, _batch(), nn.functional.mse_loss, "float8_from_float32")
    assert not d.findings and d.passes()
    assert d.grad_rel_error > 0  # it really ran in float8


def test_the_bench_times_quantized_policies_without_the_no_low_precision_paragraph(tmp_path):
    import json

    from mixprec.cli import main

    out = tmp_path / "bench"
    cmd = ["bench", "--model", "mlp", "--precision"]
    # (float8 trains its weights, as the bench times; int8's codes never train: refused)
    cmd += ["32-true", "float8_from_float32", "--batch-sizes", "4", "--steps", "2"]
    cmd += ["--warmup", "0", "--threads", "1", "--allow-slow", "--out", str(out)]
    assert main(cmd) == 0
    rows = json.loads((out / "results.json").read_text())["results"]
    fp8 = next(r for r in rows if r["config"]["spec"] == "float8_from_float32")
    assert fp8["result"]["status"] == "ok" and len(fp8["result"]["mixprec"]["step_ms"]) == 2
    text = (out / "report.md").read_text()
    assert "float8_from_float32" in text and "why no mixed precision" not in text.lower()


@pytest.mark.filterwarnings("ignore:precision .* is slow")
def test_an_int8_layers_frozen_weight_is_not_judged_for_vanishing_updates():
    """Found by a review: with an lr, the vanishing-update check walked the original model's
    parameters in the policy's 16-bit param dtype, so an int8 layer (`int8_from_bf16-true`)
    was judged by a float32 weight it never trains (its weight is frozen int8 codes, only its
    bias trains): "92% of its parameter updates round away ... it stops learning", and
    recommend un-quantized both layers. Only what the converted model trains is judged, in
    the dtype it is stored in."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    with torch.no_grad():
        for i in (0, 2):
            model[i].weight.mul_(64)
            model[i].bias.zero_()
    batch = (torch.randn(16, 64), torch.randint(0, 2, (16,)))
    d = diagnose(model, batch, nn.functional.cross_entropy, "int8_from_bf16-true", lr=1e-3)
    assert d.modules["0"].vanishing == 0.0 and d.modules["2"].vanishing == 0.0
    assert not d.findings
