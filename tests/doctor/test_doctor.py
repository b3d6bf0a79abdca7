"""The doctor on models with planted float16 faults: each found by name, nothing healthy
flagged, and the recommended policy verified by training."""

import json
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from devices import AVX2_CPU, ZEN4
from nets import overflow_model
from torch import nn

import mixprec
from mixprec import Policy, PolicyMap, PolicySpecError, PrecisionError, hardware
from mixprec.cli import main
from mixprec.doctor import AT_RISK, BROKEN, OK, diagnose
from mixprec.doctor.diagnosis import ReferenceRunError
from mixprec.doctor.probe import Comparisons, RefTensor, Scratch
from mixprec.doctor.verdicts import FindingKind
from mixprec.errors import LossTypeError
from mixprec.optim.scaling import LossScaleDivergedError
from mixprec.precision import Precision
from mixprec.trainer import TrainingModule

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.filterwarnings("ignore:precision .* is slow")


class NaiveSoftmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.exp() / x.exp().sum(-1, keepdim=True)


class ExpNet(nn.Module):
    """Scores up to 20: exp(20) = 4.9e8 overflows float16 inside `attn`."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.scores = nn.Linear(16, 8)
        self.attn = NaiveSoftmax()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.scores(torch.relu(self.inp(x)))))


def exp_model() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = ExpNet()
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    with torch.no_grad():
        peak = model.scores(torch.relu(model.inp(x))).max()
        model.scores.weight.mul_(20.0 / peak)
        model.scores.bias.mul_(20.0 / peak)
    return model, (x, y)


class Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        self.aux = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.head(h), self.aux(h)


def branch_loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    main_out, aux_out = out
    return F.cross_entropy(main_out, y) + 1e-6 * F.cross_entropy(aux_out, y)


class Healthy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 16))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.embed(x))
        return self.head(self.norm(h + self.mlp(h)).mean(1))


def healthy_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def names(d, verdict=None):
    return [m.name for m in d.findings if verdict is None or m.verdict == verdict]


# -- planted faults --------------------------------------------------------------------------


def test_linear_overflowing_float16_is_blamed_and_nothing_downstream():
    model, batch = overflow_model(1e5)
    d = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
    assert names(d) == ["proj"]
    proj = d.modules["proj"]
    assert proj.verdict == BROKEN and proj.origin
    assert proj.reason.startswith("output reaches 1.0e5 > float16 max 65504")
    assert proj.amax == pytest.approx(1e5, rel=1e-5)
    assert proj.nonfinite > 0 and 0 < proj.overflow < 1
    assert math.isinf(proj.rel_error) and proj.sqnr_db == -math.inf
    # inf/NaN flow on through norm and head, which are not blamed
    for name in ("norm", "head"):
        assert d.modules[name].verdict == OK and d.modules[name].nonfinite > 0
        assert d.modules[name].note == "inf/NaN from upstream"
    assert d.modules[""].verdict == OK and d.modules[""].note == "contains proj (broken)"
    for name in ("inp", "act"):
        assert d.modules[name].nonfinite == 0 and d.modules[name].rel_error < 1e-2
    assert math.isnan(d.target_loss) and math.isfinite(d.loss)
    assert not d.passes()


def test_the_same_model_is_fine_in_bfloat16():
    model, batch = overflow_model(1e5)
    d = diagnose(model, batch, F.cross_entropy, precision="bf16-mixed")
    assert d.findings == [] and d.passes()
    assert d.loss_scale == 1.0 and d.recommended_loss_scale == 1.0


def test_activations_near_the_max_are_at_risk():
    model, batch = overflow_model(3e4)  # fits float16, within 4x of its max
    d = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
    assert names(d) == ["proj"] and d.modules["proj"].verdict == AT_RISK
    assert d.modules["proj"].reason == "output reaches 3.0e4, within 4x of float16 max 65504"
    assert d.passes()  # at risk, not broken: the run is still within tolerance


def test_exp_without_max_subtraction_is_blamed():
    model, batch = exp_model()
    d = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
    assert names(d) == ["attn"]
    attn = d.modules["attn"]
    assert attn.verdict == BROKEN and attn.input_nonfinite == 0 and attn.nonfinite > 0
    assert "inf/NaN although its inputs are finite" in attn.reason
    assert attn.amax <= 1.0  # the reference output is a softmax: the overflow is inside
    assert d.modules["scores"].verdict == OK and d.modules["scores"].amax < 65504 / 4
    fix = d.recommend()
    # a bf16-mixed region takes its float16 input as float32, where exp runs: it repairs
    # it, keeping bfloat16 matmuls (autocast alone leaves exp in its input's dtype); where
    # bfloat16 is slow, float32
    assert fix.policy == PolicyMap("16-mixed", {"attn": _demo_fix()})


def test_branch_gradients_underflow_without_loss_scaling():
    torch.manual_seed(0)
    model, batch = Branch(), (torch.randn(16, 8), torch.randint(0, 4, (16,)))
    d = diagnose(model, batch, branch_loss, precision="16-mixed", loss_scale=1.0)
    assert names(d) == ["aux"]
    aux = d.modules["aux"]
    assert aux.verdict in (AT_RISK, BROKEN)
    assert aux.param_grad_underflow > 0.9
    assert "at loss scale 1" in aux.reason
    assert f"loss scale {int(d.recommended_loss_scale)} keeps them" in aux.reason
    assert d.params["aux.weight"].underflow > 0.9 and d.params["head.weight"].underflow < 0.05
    # with the scale a dynamic scaler settles at, nothing underflows
    scaled = diagnose(model, batch, branch_loss, precision="16-mixed")
    assert scaled.loss_scale == 2.0**16 > scaled.recommended_loss_scale > 1
    assert scaled.findings == [] and scaled.params["aux.weight"].underflow < 0.05


def _cancelling(between: list[nn.Module]) -> nn.Sequential:
    """Layer 0 adds an offset of 300 that the next Linear cancels (``between`` them, modules
    passing it on): in bfloat16 layer 0's output is rounded in steps of 2 around 300, which
    becomes the next Linear's whole signal."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), *between, nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    with torch.no_grad():
        model[0].bias.add_(300.0)
        model[1 + len(between)].bias.sub_(300.0 * model[1 + len(between)].weight.sum(1))
    return model


@pytest.mark.parametrize("between", [[], [nn.ReLU()]], ids=["linear", "through a ReLU"])
def test_recommend_moves_the_layer_feeding_one_broken_in_float32(between):
    """The second Linear broken in bf16-mixed stays broken in float32, its input rounded by
    layer 0: recommend gave up ('no per-module policy'); it moves the module its input came
    from (through a ReLU, which passes the rounding on: moving it does nothing)."""
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
    d = diagnose(_cancelling(between), batch, F.cross_entropy, precision="bf16-mixed")
    broken = str(1 + len(between))
    assert names(d) == [broken]
    fix = d.recommend()
    assert fix.policy == PolicyMap("bf16-mixed", {broken: "32-true", "0": "32-true"})
    assert any("its input comes from 0 -> 32-true: the run passes" in line for line in fix.log)
    assert len(fix.log) == 2 and fix.verified.passes(fix.tolerance)


def test_recommend_takes_a_layer_moved_to_bfloat16_on_to_float32_for_the_one_it_feeds():
    """Layer 0 overflows float16 (bias 3000): bfloat16 fixes that range finding, yet the
    LayerNorm after it, broken by bfloat16's rounding of 3000, stays broken in float32.
    Moving layer 0 on to float32 fixes it, but layer 0 no longer had a range finding, so
    the bfloat16 step it stood on was not among its steps: recommend gave up."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.LayerNorm(64), nn.Linear(64, 4))
    with torch.no_grad():
        model[0].bias.fill_(3000.0)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g))
    with hardware.assume(ZEN4):  # (bfloat16 the first fix of a range finding)
        d = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
        assert names(d) == ["0", "1"] and d.modules["0"].kind == FindingKind.RANGE
        fix = d.recommend()
    assert fix.policy == PolicyMap("16-mixed", {"0": "32-true"})
    assert fix.log[0].startswith("0 -> bf16-mixed") and fix.verified.passes(fix.tolerance)
    assert any("its input comes from 0 -> 32-true: the run passes" in line for line in fix.log)


class _KeyBias(nn.Module):
    """Attention's scores from a query and a key with a bias: the bias adds the same value
    to a query's every score, which softmax drops, so its true gradient is zero and
    float32's is rounding noise (about 1e-9 here, against the weight's 1e-1)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.key, self.head = nn.Linear(8, 8), nn.Linear(2, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.key(x[..., :2]).transpose(-1, -2)
        return self.head(scores.softmax(-1) @ x).mean(1)


def test_a_gradient_at_float32_noise_is_not_counted_as_underflowing():
    """A clean BERT was 'at risk' in 16-mixed: its key bias's noise (its true gradient is
    zero) underflows float16 and lifted the key's share of underflowing gradients past
    10%. Noise beside the module's largest gradient is left out; the parameter's own
    report still shows it."""
    torch.manual_seed(0)
    batch = (torch.randn(4, 6, 8), torch.randint(0, 4, (4,)))
    d = diagnose(_KeyBias(), batch, F.cross_entropy, precision="16-mixed")
    assert d.params["key.bias"].underflow > 0.25  # (over the module's 10%, left out)
    assert d.params["key.bias"].grad_amax < 1e-6 * d.params["key.weight"].grad_amax
    assert d.modules["key"].param_grad_underflow == 0.0 and d.findings == []


class _Amplify(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * 1e9


def test_an_output_flushed_whole_is_broken_not_at_risk():
    """A layer whose whole output flushes to zero keeps no signal (SQNR 0 dB): the range rule
    came first and capped it at "at risk", where a layer under 6 dB is broken (docs), so a
    fix could leave it as it was and pass its re-check."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), _Amplify(), nn.Linear(32, 4)
    )
    with torch.no_grad():
        model[2].weight.mul_(1e-9)
        model[2].bias.mul_(1e-9)
    batch = (torch.randn(16, 8), torch.randint(0, 4, (16,)))
    d = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
    tiny = d.modules["2"]
    assert tiny.verdict == BROKEN and tiny.rel_error >= 0.5
    assert "smallest normal" in tiny.reason and "little signal" in tiny.reason


class Shift(nn.Module):
    """(x + offset) - offset: float16 spacing at 2048 is 2 (at 512, 0.5), so unit-sized
    values lose most (some) of their precision."""

    def __init__(self, offset: float = 2048.0) -> None:
        super().__init__()
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.offset) - self.offset


@pytest.mark.parametrize(
    ("offset", "verdict"),
    [(512.0, AT_RISK), (2048.0, BROKEN)],
    ids=["sqnr-14dB-at-risk", "sqnr-3dB-broken"],
)
def test_precision_loss_is_flagged_and_fixed_in_float32(offset, verdict):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Shift(offset), nn.ReLU(), nn.Linear(16, 4))
    batch = (torch.randn(16, 8), torch.randint(0, 4, (16,)))
    d = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
    assert names(d) == ["1"]
    shift = d.modules["1"]
    assert shift.verdict == verdict and shift.kind == "precision"
    # below 6 dB SQNR (relative error 0.5) a layer is broken, quantized or not
    assert (shift.sqnr_db < 6) == (verdict == BROKEN) and shift.rel_error > 0.1
    assert d.modules["0"].rel_error < 1e-2
    assert "its error against the reference grows to" in shift.reason
    assert shift.reason.endswith("it carries little signal") == (verdict == BROKEN)
    assert d.modules["2"].verdict == OK  # the error it passes on is not ReLU's fault
    assert not d.passes()  # either way the gradient is far off (0.44 and 1.0)
    assert d.recommend().policy == PolicyMap("16-mixed", {"1": "32-true"})


class _BoostGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1000.0


class GradBoost(nn.Module):
    """Identity forward, gradient x 1000 backward (a gradient-scaling layer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BoostGrad.apply(x)


def test_backward_overflow_is_blamed_where_it_starts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), GradBoost(), nn.ReLU(), nn.Linear(16, 4))
    batch = (torch.randn(16, 8), torch.randint(0, 4, (16,)))
    d = diagnose(model, batch, F.cross_entropy, precision="16-mixed", loss_scale=2.0**16)
    assert all(m.nonfinite == 0 for m in d.modules.values())  # the forward is fine
    assert names(d) == ["1"]
    boost = d.modules["1"]
    assert boost.grad_nonfinite == 0 and boost.input_grad_nonfinite > 0
    assert boost.reason.startswith("its backward produces inf/NaN gradients at loss scale 65536")
    assert f"a loss scale of at most {int(d.recommended_loss_scale)} fits" in boost.reason
    assert d.modules["0"].verdict == OK and d.modules["0"].param_grad_nonfinite > 0
    # at the scale a dynamic scaler settles at, the backward is finite
    assert diagnose(model, batch, F.cross_entropy, precision="16-mixed").findings == []


def _tanh_stack(loss_factor: float):
    """Linear/Tanh layers whose loss is cross-entropy x `loss_factor`: its float32 gradient
    of the logits reaches about 12.6 x the loss scale (1e3 / 64 x (1 - p))."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )
    batch = (torch.randn(64, 16), torch.randint(0, 4, (64,)))
    return model, batch, lambda out, y: F.cross_entropy(out, y) * loss_factor


def test_gradient_overflowing_between_the_loss_and_the_last_layer_is_blamed_and_scaled_down():
    model, batch, loss_fn = _tanh_stack(1e3)
    logits = model(batch[0]).detach().requires_grad_()
    loss_fn(logits, batch[1]).backward()
    peak = logits.grad.abs().max().item()  # the gradient that arrives at the last Linear
    assert f"{peak:.3g}" == "12.6" and f"{peak * 65536:.2g}" == "8.2e+05"
    assert 2.0 ** math.floor(math.log2(65504 / peak)) == 4096  # the largest scale it fits
    d = diagnose(model, batch, loss_fn, precision="16-mixed", loss_scale=65536)
    assert all(m.nonfinite == 0 for m in d.modules.values())  # the forward is fine
    assert not d.finite and d.grad_rel_error == math.inf
    # inf first appears where the float32 loss gradient is cast to the float16 logits' one,
    # outside any module's backward: the module that receives it is blamed
    assert names(d) == ["4"]
    last = d.modules["4"]
    assert last.verdict == BROKEN and last.kind == "scale" and last.grad_nonfinite > 0
    headroom = int(d.recommended_loss_scale)
    assert headroom == 128
    assert last.reason == (
        "its output gradient is already inf/NaN as it arrives, at loss scale 65536: it "
        "overflows float16 outside any module's backward, where a float32 gradient (e.g. the "
        "loss's) is cast to float16 (largest in the reference 12.6, x 65536 = 8.2e5 > float16 "
        "max 65504); loss scale 4096 is the largest that keeps it finite, 128 leaves every "
        "gradient 8x headroom"
    )
    assert d.modules[""].verdict == OK and d.modules["3"].verdict == OK
    assert not d.passes()
    # the loss scale is the problem, not a layer's dtype: the fix keeps the policy
    fix = d.recommend()
    assert fix.policy == PolicyMap("16-mixed") and fix.loss_scale == headroom
    assert fix.log == (f"loss scale 65536 -> {headroom}, for 4's gradients: the run passes",)
    assert fix.verified.loss_scale == headroom and fix.verified.passes()
    assert f"DynamicLossScaler(init_scale={headroom})" in fix.scaler_advice()
    # at 4096 that gradient fits float16 (the weight gradient summed over the batch, made in
    # the Linear's own backward, still does not); at 8192 it does not
    at = {s: diagnose(model, batch, loss_fn, loss_scale=s).modules["4"] for s in (4096, 8192)}
    assert at[4096].grad_nonfinite == 0 and at[8192].grad_nonfinite > 0
    assert at[4096].reason.startswith("its backward produces inf/NaN gradients at loss scale")
    assert at[8192].reason.startswith("its output gradient is already inf/NaN as it arrives")


def test_a_float16_loss_holds_the_loss_scale_to_32768():
    model, batch, loss_fn = _tanh_stack(1.0)
    # under 16-true the loss itself is float16: its gradient, the scale, must fit float16
    d = diagnose(model, batch, loss_fn, precision="16-true")
    assert d.loss_scale == d.recommended_loss_scale == 32768 and d.passes()
    over = diagnose(model, batch, loss_fn, precision="16-true", loss_scale=65536)
    assert names(over) == ["4"] and over.modules["4"].kind == "scale"
    assert over.modules["4"].reason.endswith(
        "at loss scale 65536: the loss is float16, and its gradient, the loss scale itself, "
        "is beyond float16 max 65504; loss scale 32768 fits, or compute the loss in float32"
    )
    fix = over.recommend()
    assert fix.policy == PolicyMap("16-true") and fix.loss_scale == 32768
    # a float32 loss (16-mixed casts the output to float32) has no such limit
    mixed = diagnose(model, batch, loss_fn, precision="16-mixed")
    assert mixed.loss_scale == 65536 and mixed.passes()


class OverflowingLoss(TrainingModule):
    """training_step computes its loss in the float16 outputs' dtype, where it overflows:
    every module is fine, the loss is not (and the root is never called)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.net(x) * 1e5).square().mean()


def test_a_loss_overflowing_outside_every_module_is_the_models_finding():
    batch = (torch.randn(16, 8), torch.randint(0, 4, (16,)))
    d = diagnose(OverflowingLoss(), batch, precision="16-true")
    assert math.isinf(d.target_loss) and all(m.nonfinite == 0 for m in d.modules.values())
    assert names(d) == [""]
    root = d.modules[""]
    assert root.type == "OverflowingLoss" and root.calls == 0 and root.verdict == BROKEN
    assert root.reason.startswith(
        "the loss is inf/NaN although every module's output is finite: it overflows float16 "
        "outside the modules"
    )
    assert "1 broken" in d.summary() and not d.passes()
    with pytest.raises(PrecisionError, match="no per-module policy changes what happens outside"):
        d.recommend()


def test_a_loss_underflowing_float16_is_the_models_finding():
    """Under 16-true a loss of 1e-9 reads 0 in float16: the report named two layers at risk
    and the model ok, and `recommend` then said no module was at risk or broken."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    batch = (torch.randn(32, 8), torch.randn(32, 4))

    def tiny(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, y) * 1e-9

    d = diagnose(model, batch, tiny, precision="16-true")
    assert d.target_loss == 0 and d.loss > 0
    root = d.modules[""]
    assert (root.verdict, root.kind) == (BROKEN, FindingKind.LOSS)
    assert root.reason.startswith("the loss is 0 where the reference's is 1.1e-9, which float16")
    assert "loss_fn(output.float(), target)" in root.reason
    with pytest.raises(PrecisionError, match="the loss is 0 .*no per-module policy changes"):
        d.recommend()
    # the fix the finding names: the same loss from float32 outputs
    fixed = diagnose(model, batch, lambda out, y: tiny(out.float(), y), precision="16-true")
    assert fixed.modules[""].verdict == OK and fixed.target_loss > 0


def test_recommend_tries_the_module_the_loss_reads_when_none_is_at_risk():
    """A confident classifier: float32's cross-entropy is 1.2e-7, bf16-mixed's is 0 from
    bfloat16 logits, and no module is at risk. `recommend` said the error builds up over
    many layers; the last layer in float32 fixes it."""
    model = nn.Sequential(nn.Linear(2, 2, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2))
    batch = (torch.tensor([[13.234081268310547, -3.3967647552490234]]), torch.tensor([0]))
    d = diagnose(model, batch, F.cross_entropy, precision="bf16-mixed")
    assert d.target_loss == 0 and d.loss > 0 and not d.findings
    fix = d.recommend()
    assert fix.policy.rules == {"0": Policy("32-true")} and fix.verified.passes()
    assert fix.log[0].startswith("no module at risk, yet not within tolerance: 0 (a last layer")


class AuxAfter(nn.Module):
    """A classifier whose auxiliary head, unused by the loss, runs after it; then dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.cls, self.aux = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)
        self.drop = nn.Dropout(0.0)
        with torch.no_grad():
            self.cls.weight.copy_(torch.eye(2))
            self.aux.weight.copy_(torch.eye(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.cls(x)
        self.aux(x)
        return self.drop(logits)


def test_recommends_fallback_skips_layers_without_parameters_and_tries_the_last_few():
    """It tried only the module that ran last: a trailing Dropout (no fix there) or an
    auxiliary head the loss does not read, and then gave up; layers without parameters
    are passed over now, and the last few layers are tried in turn."""
    batch = (torch.tensor([[13.234081268310547, -3.3967647552490234]]), torch.tensor([0]))
    d = diagnose(AuxAfter(), batch, F.cross_entropy, precision="bf16-mixed")
    assert d.target_loss == 0 and not d.findings
    fix = d.recommend()
    assert fix.policy.rules == {"cls": Policy("32-true")}
    assert [line.split(" (a last layer")[0][-3:] for line in fix.log] == ["aux", "cls"]


def test_recommend_stopping_with_no_module_left_at_risk_names_its_moves():
    """It said "no module is at risk or broken" beside a report naming one, which it had
    moved already."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    model = nn.Sequential(*layers, Shift(32.0), nn.Linear(16, 4))  # bfloat16: steps of 0.25
    batch = (torch.randn(32, 16), torch.randint(0, 4, (32,)))
    d = diagnose(model, batch, F.cross_entropy, precision="bf16-true")
    assert names(d) == ["8"] and d.modules["8"].verdict == AT_RISK
    with pytest.raises(PrecisionError) as stopped:
        d.recommend(1e-3)
    assert str(stopped.value).startswith("bf16-true after moving 8 to params=float32,")
    assert "although no module is left at risk or broken" in str(stopped.value)


def test_error_built_up_over_the_layers_is_no_finding_of_the_model_itself(monkeypatch):
    """Found by a review: the model itself (whose inputs, the batch, hold no error) was
    flagged at risk for the error its layers built up, and recommend "fixed" it with
    {'': '32-true'}: the whole model in float32, no layer quantized. Now nothing is flagged,
    the last three layers with parameters are tried, and recommend says the error builds
    up over many layers."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)
    )
    x = torch.randn(64, 64)
    with torch.no_grad():
        model[2].weight[:, :3] *= 1e4  # a few huge input channels set layer 2's int4 scale
    batch = (x, torch.randint(0, 8, (64,)))
    d = diagnose(model, batch, F.cross_entropy, precision="int4_from_float32")
    root = d.modules[""]
    assert root.rel_error > 0.1 and root.input_rel_error == 0 and root.verdict == OK
    assert not d.findings
    tried: list[list[str]] = []
    real = mixprec.doctor.diagnosis.Diagnosis._tried

    def spy(self, chosen, scale):
        tried.append(list(chosen))
        return real(self, chosen, scale)

    monkeypatch.setattr(mixprec.doctor.diagnosis.Diagnosis, "_tried", spy)
    with pytest.raises(PrecisionError, match="so there is no layer to move: the error builds up"):
        d.recommend(tolerance=0.05)
    assert tried == [["4"], ["2"], ["0"]]  # the last layers, latest first; never the model


def test_a_sparse_embedding_gradient_is_compared_like_a_dense_one():
    """Embedding(sparse=True) gives a sparse gradient: diagnose stopped with 'reshape is not
    implemented for sparse tensors'."""

    class Bag(nn.Module):
        def __init__(self, sparse: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(50, 8, sparse=sparse)
            self.out = nn.Linear(8, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(ids).mean(1))

    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 50, (16, 5), generator=g), torch.randint(0, 4, (16,), generator=g))
    sparse = diagnose(Bag(True), batch, F.cross_entropy, precision="16-mixed")
    dense = diagnose(Bag(False), batch, F.cross_entropy, precision="16-mixed")
    assert sparse.params["emb.weight"].rel_error == dense.params["emb.weight"].rel_error < 1e-2
    assert sparse.grad_rel_error == dense.grad_rel_error and sparse.passes()


def test_a_batch_beyond_float16_under_a_true_policy_is_named_as_the_inputs():
    """16-true converts the batch to float16 before the model: a 1e5 input is inf before any
    module runs. It was reported as 'the loss is inf/NaN although every module's output is
    finite', while every module's output was inf/NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.mul_(1e-3)  # finite in float16 once the input is
    x = torch.randn(16, 8)
    x[0, 0] = 1e5
    d = diagnose(model, (x, torch.randint(0, 4, (16,))), F.cross_entropy, precision="16-true")
    assert names(d) == [""] and d.modules["0"].nonfinite > 0
    assert d.modules[""].reason.startswith(
        "the model's inputs already hold 1 inf/NaN values, finite in the reference, where they "
        "reach 1.0e5 > float16 max 65504: the policy converts the batch to float16"
    )
    with pytest.raises(PrecisionError, match="or use a mixed policy.*outside the modules"):
        d.recommend()
    # under a mixed policy the first layer casts it, and is blamed (its fix: float32)
    mixed = diagnose(model, (x, torch.randint(0, 4, (16,))), F.cross_entropy)
    assert names(mixed) == ["0"] and "its input reaches 1.0e5" in mixed.modules["0"].reason


class ScaledBetween(nn.Module):
    """Multiplies a float16 output by 30 in its own forward, between two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.big, self.ln = nn.Linear(16, 32), nn.Linear(32, 32), nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)
        with torch.no_grad():
            self.big.weight.mul_(3000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.big(self.a(x)) * 30))


def test_an_overflow_in_code_between_modules_is_not_blamed_on_the_batch():
    """Under 16-mixed, `x * 30` in the model's own forward overflowed float16 before `ln`:
    the model's finding said the policy converts the batch to float16 and advised a mixed
    policy, which it was."""
    torch.manual_seed(0)
    batch = (torch.randn(8, 16) * 10, torch.randint(0, 4, (8,)))
    d = diagnose(ScaledBetween(), batch, F.cross_entropy, precision="16-mixed")
    reason = d.modules[""].reason
    assert reason.startswith("ln's inputs already hold")
    assert "in code between them (the forward that computes ln's inputs" in reason
    assert "converts the batch" not in reason and "use a mixed policy" not in reason


def test_float64_target_and_reference():
    model, batch, loss_fn = _tanh_stack(1.0)
    for precision, reference in (("64-true", "32-true"), ("32-true", "64-true")):
        d = diagnose(model, batch, loss_fn, precision=precision, reference=reference)
        assert d.findings == [] and d.passes() and d.grad_rel_error < 1e-5
    assert d.modules["4"].dtype == "float32" and d.loss_scale == 1.0


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_healthy_model_has_no_finding(precision):
    torch.manual_seed(0)
    model = Healthy()
    d = diagnose(model, healthy_batch(), F.cross_entropy, precision=precision)
    assert d.findings == []
    assert all(m.verdict == OK and m.nonfinite == 0 for m in d.modules.values())
    assert d.passes()
    assert d.recommend().policy == PolicyMap(precision)
    assert "no finding" in str(d)


@pytest.mark.parametrize(
    ("cpu", "expected"),
    [
        (ZEN4, "bf16-mixed"),
        (AVX2_CPU, "32-true"),
    ],
    ids=["bf16-fast", "avx2-only"],
)
def test_recommended_policy_verifies_and_prints_as_code(cpu, expected):
    model, batch = overflow_model(1e5)
    with hardware.assume(cpu):  # bfloat16 is the first fix only where it runs well
        d = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
        fix = d.recommend()
    assert fix.policy == PolicyMap("16-mixed", {"proj": expected})
    assert eval(fix.to_code(), {"mixprec": mixprec}) == fix.policy
    assert fix.verified.passes() and fix.verified.findings == [] and fix.tolerance == 0.1
    assert d.findings and d.modules["proj"].verdict == BROKEN  # recommend changed nothing
    again = diagnose(model, batch, F.cross_entropy, precision=fix.policy)
    assert again.passes() and again.loss_rel_error < 1e-2
    with pytest.raises(ValueError, match="tolerance"):
        d.recommend(tolerance=0)
    for bad in (math.nan, -1.0):  # passes said False, as if the run had failed
        with pytest.raises(ValueError, match="tolerance must be a positive relative error"):
            again.passes(bad)


def test_true_float16_overflow_cannot_be_fixed_per_layer_and_says_why():
    model, batch = overflow_model(1e5)
    d = diagnose(model, batch, F.cross_entropy, precision="16-true")
    assert names(d) == ["proj"]
    with pytest.raises(PrecisionError, match="try a mixed policy"):
        d.recommend()


def _demo_fix() -> str:
    """The rule the doctor gives the demo's softmax here: bf16-mixed unless bfloat16 is
    rated slow on this CPU (it then skips it), else float32."""
    slow = mixprec.hardware.support_matrix(mixprec.hardware.detect("cpu"))["bf16-mixed"]
    return "32-true" if slow.status == "slow" else "bf16-mixed"


def test_two_faults_are_fixed_one_after_the_other():
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from doctor_demo import make
    finally:
        sys.path.remove(str(ROOT / "examples"))
    model, batch, loss_fn = make()
    d = diagnose(model, batch, loss_fn)
    # only the first fault shows: the second one's inputs are already inf/NaN
    assert names(d) == ["inp"]
    fix = d.recommend()
    rules = fix.policy.rules
    assert set(rules) == {"inp", "pool.softmax"}
    # (bf16-mixed where bfloat16 is not slow: its region takes the float16 input as float32,
    # where the exp runs; float32 where it is, an AVX2 CPU)
    assert rules["pool.softmax"] == mixprec.Policy(_demo_fix())
    assert fix.verified.passes()
    assert any("pool.softmax" in line for line in fix.log)


def test_the_terminal_never_calls_a_layer_with_inf_nan_ok_and_says_a_rerun_may_find_more(
    tmp_path, capsys, monkeypatch
):
    """The demo's table: every module after `inp` holds inf/NaN; none is shown as plain "ok",
    and the run says why `pool.softmax` shows up only in the run with `inp` fixed, which the
    recommendation makes and names it in."""
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "rep"
    assert main(["doctor", str(ROOT / "examples/doctor_demo.py:make"), "--out", str(out)]) == 1
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("│")]
    softmax = next(r for r in rows if r.startswith("│ pool.softmax "))
    assert softmax.rstrip().endswith("inf/NaN from upstream │")
    for row in rows:
        cells = [c.strip() for c in row.strip("│").split("│")]
        if cells[4] != "0":  # the inf/nan column
            assert cells[-1] != "ok", row
    assert "8 module(s) after inp hold the inf/NaN it made" in " ".join(text.split())
    assert "run again, pool.softmax (NaiveSoftmax) is broken: 121 of 2048 outputs" in " ".join(
        text.split()
    )
    assert "out dtype" in text  # the dtype column is the layer's output's, and says so
    report = (out / "report.md").read_text()
    assert "| module | type | out dtype |" in report
    assert "| norm | LayerNorm | float32 |" in report
    norm = next(line for line in report.splitlines() if line.startswith("| norm |"))
    assert norm.count("inf/NaN from upstream") == 1 and "| ok |" not in norm
    assert "8 module(s) after inp hold the inf/NaN it made" in report


def test_modules_before_a_broken_one_hold_its_nan_in_their_gradients_not_from_upstream():
    """The doctor page's example: the modules before the broken softmax compute finite
    outputs and only receive NaN gradients from it, so they are shown as holding inf/NaN
    gradients from downstream (the first layer has no upstream), and the note counts them
    apart from the one after it."""
    from mixprec.doctor.report import hidden_downstream, verdict_text

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), NaiveSoftmax(), nn.Linear(8, 2)
    )
    with torch.no_grad():
        model[2].weight.mul_(20.0)
    batch = (torch.randn(64, 8), torch.randint(0, 2, (64,)))
    d = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
    assert names(d) == ["3"]
    shown = {name: verdict_text(m) for name, m in d.modules.items()}
    assert shown["4"] == "inf/NaN from upstream"
    for name in ("0", "1", "2"):
        assert d.modules[name].nonfinite == 0 and d.modules[name].grad_nonfinite
        assert shown[name] == "inf/NaN gradients from downstream"
    assert hidden_downstream(d).startswith(
        "1 module(s) after 3 hold the inf/NaN it made; 3 module(s) before 3 hold it in their "
        "gradients, so whether"
    )


def test_the_slow_precision_warning_points_at_the_users_line():
    """Raised deep inside the doctor (a copy of the model converted in `running`), the
    warning names the caller's file and line, as `apply`'s does."""
    model, batch = overflow_model(10.0)
    with hardware.assume(ZEN4), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        diagnose(model, batch, F.cross_entropy, precision="16-mixed")
        line = sys._getframe().f_lineno - 1
        mixprec.apply(nn.Linear(2, 2), "16-mixed")
    slow = [w for w in caught if w.category is mixprec.SlowPrecisionWarning]
    assert len(slow) >= 2
    assert {(w.filename, w.lineno) for w in slow[:-1]} == {(__file__, line)}
    assert (slow[-1].filename, slow[-1].lineno) == (__file__, line + 2)


class _BigInside(nn.Module):
    """Embedding ids, a softmax, a Linear whose outputs reach 1e5 (past float16's range),
    a tanh called as a function, a head: nested one level, as ``net``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.big = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.big(self.emb(ids).mean(1).softmax(-1))))


def test_a_parent_moved_after_its_child_is_not_shadowed_by_the_childs_rule():
    """``net.big`` went to bf16-mixed first; the remaining error showed at its parent
    ``net``, moved to float32, but the child's own rule outranked the parent's, so nothing
    changed and recommend raised "no per-module policy" (its numbers printed twice), where
    a one-rule fix passes. The child's narrower rule now gives way to the parent's."""
    torch.manual_seed(3)
    model = nn.Sequential()
    model.add_module("net", _BigInside())
    with torch.no_grad():
        model.net.big.weight.mul_(1e6)
    batch = (torch.randint(0, 50, (8, 5)), torch.randint(0, 3, (8,)))
    with hardware.assume(ZEN4):  # (bfloat16 the first fix, as on a CPU that runs it well)
        d = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
        assert [f.name for f in d.findings][:1] == ["net.big"]
        fix = d.recommend()
    assert fix.verified.passes(fix.tolerance)
    assert fix.policy.rules  # one module moved (and no child rule shadowing it)
    for key in fix.policy.rules:
        assert not any(o != key and o.startswith(f"{key}.") for o in fix.policy.rules)


class _TimesFour(nn.Module):
    """A residual block multiplying its input by 4."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(16) * 3)
            self.fc.bias.zero_()

    def forward(self, x):
        return x + self.fc(x)


def test_a_layer_past_the_max_behind_an_overflow_upstream_is_not_said_to_be_within_it():
    """A layer whose output reaches 3.0e5, behind one that overflowed first, read "at risk:
    output reaches 3.0e5, within 4x of float16 max 65504" (4.6x past it)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_TimesFour() for _ in range(8)], nn.LayerNorm(16), nn.Linear(16, 2))
    batch = (torch.randn(8, 16) * 2, torch.randint(0, 2, (8,)))
    d = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
    last = next(f for f in d.findings if f.name == "7.fc")
    assert last.verdict == AT_RISK
    assert "past float16 max 65504" in last.reason and "within" not in last.reason


class _SharedTwice(nn.Module):
    """One overflowing Linear registered at two paths (``self.b = self.a``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = self.a
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_a_module_at_two_paths_is_moved_at_both():
    """The rule went to the first path alone; the map then resolved the one module two ways
    and recommend raised "reachable at 'a' and 'b'" about a rule the user never wrote."""
    torch.manual_seed(0)
    model = _SharedTwice()
    with torch.no_grad():
        model.a.weight.mul_(1e5)
    batch = (torch.randn(16, 8), torch.randint(0, 2, (16,)))
    with hardware.assume(ZEN4):
        fix = diagnose(model, batch, F.cross_entropy, precision="16-mixed").recommend()
    assert fix.policy == PolicyMap("16-mixed", {"a": "bf16-mixed", "b": "bf16-mixed"})
    assert fix.verified.passes(fix.tolerance)


def test_float16_training_nan_fixed_by_recommended_policy():
    """Plain 16-mixed never takes a step (NaN); the recommended map trains like float32."""

    def train(policy) -> float:
        model, (x, y) = overflow_model(1e5)
        precision = Precision(policy, allow_slow=True)
        model, opt = precision.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        loss = torch.tensor(math.nan)
        for _ in range(25):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            precision.backward(loss)
            precision.step(opt)
        return float(loss.detach())

    model, batch = overflow_model(1e5)
    fix = diagnose(model, batch, F.cross_entropy, precision="16-mixed").recommend()
    reference = train("32-true")
    try:
        plain = train("16-mixed")
    except LossScaleDivergedError:
        plain = math.nan
    fixed = train(fix.policy)
    assert math.isnan(plain)
    assert math.isfinite(fixed)
    assert fixed == pytest.approx(reference, rel=0.05)
    assert reference < 1.0  # it did learn (cross-entropy of 4 classes starts near 1.4)


@pytest.mark.parametrize("scale", [1.0, 1024.0])
def test_large_and_small_tensors_are_measured_alike(monkeypatch, scale):
    """Large tensors are measured one by one, small ones batched: both give the same row."""
    g = torch.Generator().manual_seed(0)
    r = torch.randn(3000, generator=g) * 1e-3
    r[::10] = 0.0
    r[5] = 7e4  # beyond float16's max
    r[7] = 1e-10  # below float16's smallest normal, also when scaled by 1024
    target = (r * scale).to(torch.float16)  # overflows to inf at 5, rounds elsewhere
    reference = RefTensor(r, Scratch())
    rows = {}
    for small in (1 << 20, 0):
        monkeypatch.setattr(Comparisons, "SMALL", small)
        c = Comparisons()
        c.add("x", target, reference, torch.float16, scale, flushed=True)
        rows[small] = c.compute()["x"]._asdict()
    batched, single = rows[1 << 20], rows[0]
    assert batched["numel"] == single["numel"] == 3000
    assert batched["nonzero"] == single["nonzero"] == 2700
    assert batched["amax"] == single["amax"] == pytest.approx(7e4)
    assert batched["overflow"] == single["overflow"] == 1
    assert batched["nonfinite"] == single["nonfinite"] == 1
    assert batched["underflow"] == single["underflow"] > 0
    assert batched["flushed"] == single["flushed"]
    assert batched["amin"] == single["amin"]
    assert batched["ref_sq"] == pytest.approx(single["ref_sq"], rel=1e-5)
    assert math.isinf(batched["err_sq"]) or math.isnan(batched["err_sq"])


class CausalMask(nn.Module):
    """Scores with the future masked to -inf, as attention code writes them before softmax."""

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        n = scores.shape[-1]
        return scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))


class MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(16, 32)
        self.mask = CausalMask()
        self.soft = nn.Softmax(-1)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, -1)
        p = self.soft(self.mask(q @ k.transpose(-1, -2) / 4))
        return self.out((p @ x).mean(1))


@pytest.mark.parametrize("small", [1 << 20, 0])
def test_inf_the_reference_holds_too_is_no_finding(monkeypatch, small):
    """A mask's -inf is in the float32 run as well: the module writing it was called broken
    ('output reaches inf > float16 max') and the run failed, whatever the precision."""
    monkeypatch.setattr(Comparisons, "SMALL", small)  # batched, then one by one
    torch.manual_seed(0)
    batch = (torch.randn(8, 6, 16), torch.randint(0, 4, (8,)))
    d = diagnose(MaskedAttention(), batch, F.cross_entropy, precision="16-mixed")
    assert d.modules["mask"].nonfinite == 0 and d.modules["mask"].rel_error < 1e-2
    assert d.modules["mask"].amax < 100  # the finite scores', not inf
    assert not d.findings and d.passes()
    # where the target holds something else than the reference's -inf, it still counts
    r = torch.tensor([1.0, -math.inf, -math.inf, 2.0] * 1024)
    nan, finite = r.clone(), r.clone()
    nan[1], finite[6] = math.nan, 5.0
    c = Comparisons()
    for tag, target in (("same", r), ("nan", nan), ("finite", finite)):
        c.add(tag, target, RefTensor(r, Scratch()), torch.float16)
    rows = c.compute()
    assert rows["same"].nonfinite == 0 and rows["same"].err_sq == 0 and rows["same"].amax == 2
    assert rows["nan"].nonfinite == 1 and rows["nan"].rel_error == math.inf
    assert rows["finite"].nonfinite == 0 and rows["finite"].err_sq == 25.0


class _MinMaskedScores(nn.Module):
    """Causal scores masked with their own dtype's lowest value, as Hugging Face writes it:
    float32's in the reference, float16's in the target."""

    def forward(self, q, k):
        s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        causal = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
        return s.masked_fill(causal, torch.finfo(s.dtype).min)


class _MinMaskedAttention(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.scores = _MinMaskedScores()
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        p = torch.softmax(self.scores(self.q(x), self.k(x)), -1)
        return self.head((p @ self.v(x)).mean(1))


@pytest.mark.parametrize("small", [1 << 20, 0])
def test_a_mask_filled_with_its_dtypes_lowest_value_is_no_finding(monkeypatch, small):
    """Found by a review: a mask of torch.finfo(dtype).min was 'at risk: output reaches
    3.4e38, past float16 max 65504 (its inputs are inf/NaN from upstream already...)' beside
    finite inputs and no inf/NaN, and its error went unmeasured: float32's squares of 3.4e38
    overflowed (rel err and SQNR NaN). The fill stands for an infinity, in either dtype."""
    monkeypatch.setattr(Comparisons, "SMALL", small)  # batched, then one by one
    torch.manual_seed(0)
    batch = (torch.randn(4, 24, 16), torch.randint(0, 4, (4,)))
    d = diagnose(_MinMaskedAttention(), batch, F.cross_entropy, precision="16-mixed")
    scores = d.modules["scores"]
    assert scores.amax < 100 and scores.nonfinite == 0  # the scores', not the fill's
    assert 0 < scores.rel_error < 1e-2 and 40 < scores.sqnr_db < math.inf
    assert not d.findings and d.passes()


def test_values_at_a_dtypes_largest_finite_magnitude_are_compared_as_mask_fills():
    """A reference value at its dtype's finite extreme agrees with the target's own dtype's
    extreme of the same sign (float64's too, which a float32 snapshot cannot hold), or a
    value of that sign in its top binade or beyond, not with anything else; and finite
    values too large for float32's sum of squares are measured (in float64), not NaN."""
    lo32, lo16 = torch.finfo(torch.float32).min, torch.finfo(torch.float16).min
    r = torch.tensor([1.0, lo32, -lo32, 2.0] * 1024)
    same, other, inf, flipped = (r.to(torch.float16) if i == 2 else r.clone() for i in range(4))
    same[1::4], same[2::4] = lo16, -lo16
    other[1::4], other[2::4] = lo16, -lo16
    other[0] = 3.0
    flipped[1::4], flipped[2::4] = -lo16, lo16
    r64 = r.double()
    r64[1::4], r64[2::4] = torch.finfo(torch.float64).min, torch.finfo(torch.float64).max
    for small in (1 << 20, 0):
        c = Comparisons()
        c.SMALL = small
        for tag, target in (("same", same.half()), ("other", other.half()), ("inf", inf)):
            c.add(tag, target, RefTensor(r, Scratch()), torch.float16)
        c.add("flipped", flipped.half(), RefTensor(r, Scratch()), torch.float16)
        c.add("float64", same.half(), RefTensor(r64, Scratch()), torch.float16)
        c.add("itself", r, RefTensor(r, Scratch()), torch.float16)
        binade, below = same.clone(), same.clone()
        binade[1::4], binade[2::4] = -32768.0, 40000.0
        below[1::4] = -30000.0
        c.add("binade", binade.half(), RefTensor(r, Scratch()), torch.float16)
        c.add("below", below.half(), RefTensor(r, Scratch()), torch.float16)
        rows = c.compute()
        for tag in ("same", "float64", "itself"):
            assert rows[tag].err_sq == 0 and rows[tag].nonfinite == 0, tag
            assert rows[tag].amax == 2 and rows[tag].ref_sq == pytest.approx(5 * 1024)
        assert rows["other"].err_sq == 4.0 and rows["other"].nonfinite == 0
        # float32's fill cast to float16: infinities of its sign, the same mask (as is a
        # value in float16's top binade, a fill plus a score), not a smaller one
        assert rows["inf"].nonfinite == 0 and rows["inf"].err_sq == 0
        assert rows["binade"].err_sq == 0 and rows["below"].err_sq > 1e9
        assert math.isinf(rows["flipped"].err_sq) or rows["flipped"].err_sq > 1e9
        big = torch.full((5000 if small == 0 else 100,), 1e20)
        c.add("big", big * (1 + 1e-3), RefTensor(big, Scratch()), torch.float32)
        row = c.compute()["big"]
        assert row.rel_error == pytest.approx(1e-3, rel=1e-3) and row.sqnr_db == pytest.approx(
            60, rel=1e-3
        )


# -- the user's model and inputs -------------------------------------------------------------


def test_users_model_is_left_exactly_as_it_was():
    model, batch = overflow_model(1e5)
    mixprec.apply(model, "bf16-mixed")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    rng = torch.get_rng_state()
    model.train()
    d = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
    d.recommend()
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training
    assert mixprec.convert.applied_policy(model) == PolicyMap("bf16-mixed")
    for name, m in model.named_modules():
        assert m.__dict__.get("forward") is forwards[name]
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
    for k, v in model.state_dict().items():
        assert v.dtype == dtypes[k] and torch.equal(v, before[k])
    assert all(p.grad is None for p in model.parameters())


def test_recommend_refuses_a_model_changed_since_the_diagnosis():
    model, batch = overflow_model(1e5)
    d = diagnose(model, batch, F.cross_entropy)
    with torch.no_grad():
        model.proj.weight.mul_(0.5)
    with pytest.raises(ValueError, match="the model changed since it was diagnosed"):
        d.recommend()


class Classifier(TrainingModule):
    """training_step calls the submodules directly and logs: the doctor must still run it
    in the policy's region and drop the log calls."""

    def __init__(self) -> None:
        super().__init__()
        self.net, _ = overflow_model(1e5)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net.head(self.net.norm(self.net.proj(self.net.inp(x)))), y)
        self.log("train_loss", loss)
        return {"loss": loss}


def test_training_module_is_diagnosed_through_training_step():
    model = Classifier()
    _, batch = overflow_model(1e5)
    d = diagnose(model, batch, precision="16-mixed")
    assert names(d) == ["net.proj"]


def test_module_called_twice_is_aggregated():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(8, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.shared(torch.tanh(self.shared(x))))

    torch.manual_seed(0)
    d = diagnose(Twice(), (torch.randn(4, 8), torch.randint(0, 2, (4,))), F.cross_entropy)
    assert d.modules["shared"].calls == 2 and d.modules["shared"].numel == 64
    assert d.findings == []


def test_loss_scale_recommendation_is_exact():
    model = nn.Linear(4, 1, bias=False)
    nn.init.ones_(model.weight)
    batch = (torch.ones(2, 4), torch.zeros(2))

    def loss_fn(out, _):
        return 1000.0 * out.sum()

    d = diagnose(model, batch, loss_fn, precision="16-mixed")
    # largest gradient: d loss / d weight = 1000 * 2 = 2000; 65504 / (8 * 2000) = 4.09 -> 4;
    # a dynamic scaler runs it at 32, where it fits: 65504 / 2000 = 32.75
    assert d.params["weight"].grad_amax == 2000.0
    assert d.recommended_loss_scale == 4.0 and d.loss_scale == 32.0
    assert diagnose(model, batch, loss_fn, precision="16-mixed", loss_scale=64).loss_scale == 64
    scaler = mixprec.StaticLossScaler(8.0)
    assert diagnose(model, batch, loss_fn, loss_scale=scaler).loss_scale == 8.0


def test_bad_inputs_say_what_is_accepted():
    model, (x, y) = overflow_model(1e5)
    with pytest.raises(TypeError, match="nn.Module"):
        diagnose(lambda t: t, (x, y), F.cross_entropy)
    with pytest.raises(TypeError, match=r"\(inputs\.\.\., target\)"):
        diagnose(model, x, F.cross_entropy)
    with pytest.raises(TypeError, match="pass loss_fn"):
        diagnose(model, x)
    with pytest.raises(ValueError, match="reference run .* non-finite loss"):
        diagnose(model, (torch.full_like(x, math.inf), y), F.cross_entropy)
    with pytest.raises(ValueError, match="loss_scale must be a positive"):
        diagnose(model, (x, y), F.cross_entropy, loss_scale=0)
    with pytest.raises(PolicySpecError, match="unknown precision"):
        diagnose(model, (x, y), F.cross_entropy, precision="fp17")
    # each refused before any run, saying what is accepted
    with pytest.raises(TypeError, match="loss_fn must be callable as loss_fn.*got str"):
        diagnose(model, (x, y), "cross_entropy")
    with pytest.raises(TypeError, match="seed must be an int, got float"):
        diagnose(model, (x, y), F.cross_entropy, seed=1.5)
    seeded = diagnose(model, (x, y), F.cross_entropy, precision="bf16-mixed", seed=np.int64(3))
    assert seeded.loss == diagnose(model, (x, y), F.cross_entropy, seed=3).loss  # was TypeError
    with pytest.raises(TypeError, match="loss_scale must be a positive number, a LossScaler"):
        diagnose(model, (x, y), F.cross_entropy, loss_scale="big")
    lazy = nn.Sequential(nn.Flatten(), nn.LazyLinear(4))
    with pytest.raises(ValueError, match=r"uninitialized \(lazy\).*1.weight, 1.bias.*run it once"):
        diagnose(lazy, (x, y), F.cross_entropy)
    lazy(x)  # now it has its shapes
    assert diagnose(lazy, (x, y), F.cross_entropy, precision="bf16-mixed").passes()


# -- report and command line ------------------------------------------------------------------


def test_report_is_written_with_plots(tmp_path):
    model, batch = overflow_model(1e5)
    d = diagnose(model, batch, F.cross_entropy)
    without = d.save(tmp_path / "plain").read_text()
    assert "## Recommended policy" not in without
    path = d.save(tmp_path / "report", d.recommend())
    text = path.read_text()
    assert "**broken** `proj` (Linear): output reaches 1.0e5 > float16 max 65504" in text
    assert "## Recommended policy" in text and "'proj':" in text
    assert "With the recommended policy:" in text
    for png in ("error.png", "range.png"):
        data = (path.parent / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert f"]({png})" in text


def test_the_report_is_written_atomically(tmp_path, monkeypatch):
    """report.md was written with write_text, and the plots by matplotlib straight to their
    paths, where policy.json is written whole or not at all (a reader, or a run stopped
    halfway, could see half of one)."""
    from matplotlib.figure import Figure

    model, batch = overflow_model(1e5)
    d = diagnose(model, batch, F.cross_entropy)
    fix = d.recommend()

    def not_atomic(self, *args, **kwargs):
        raise AssertionError(f"{self} written with write_text, not atomically")

    savefig = Figure.savefig

    def to_memory_only(self, where, *args, **kwargs):
        assert not isinstance(where, str | Path), f"{where} written by savefig, not atomically"
        return savefig(self, where, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", not_atomic)
    monkeypatch.setattr(Figure, "savefig", to_memory_only)
    path = d.save(tmp_path / "report", fix)
    assert path.read_text().startswith("# mixprec doctor report")
    assert (tmp_path / "report" / "policy.json").exists()
    for png in ("error.png", "range.png"):
        assert (tmp_path / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_doctor_on_the_example(tmp_path, capsys):
    out = tmp_path / "rep"
    code = main(["doctor", str(ROOT / "examples/doctor_demo.py:make"), "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 1  # broken layers found
    assert "inp" in text and "output reaches" in text and "mixprec.PolicyMap(" in text
    assert f"'pool.softmax': '{_demo_fix()}'" in text
    assert (out / "report.md").is_file() and (out / "error.png").is_file()
    # the recommended policy, written as policy.json, passes when checked again
    policy = json.loads((out / "policy.json").read_text())
    assert {"path": "pool.softmax", "policy": Policy(_demo_fix()).to_config()} in policy["rules"]
    again = ["doctor", str(ROOT / "examples/doctor_demo.py:make"), "--no-report"]
    assert main([*again, "--precision", str(out / "policy.json")]) == 0
    assert "0 broken" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{not json")
    assert main([*again, "--precision", str(tmp_path / "bad.json")]) == 2
    assert "cannot read the policy file" in capsys.readouterr().err


def test_cli_doctor_clean_model_and_bad_factory(tmp_path, capsys):
    factory = tmp_path / "clean.py"
    factory.write_text(
        "import torch, torch.nn.functional as F\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Linear(4, 2), (torch.randn(8, 4), torch.randint(0, 2, (8,))), "
        "F.cross_entropy\n"
    )
    assert main(["doctor", f"{factory}:make", "--precision", "bf16-mixed", "--no-report"]) == 0
    assert "no finding" in capsys.readouterr().out
    assert main(["doctor", str(factory), "--no-report"]) == 2
    assert "expected FILE.py:FACTORY" in capsys.readouterr().err
    assert main(["doctor", f"{factory}:nothing", "--no-report"]) == 2
    assert "has no callable 'nothing'" in capsys.readouterr().err
    # --out with --no-report wrote nothing where it was told to write
    assert main(["doctor", f"{factory}:make", "--no-report", "--out", str(tmp_path / "r")]) == 2
    assert "give one of them" in capsys.readouterr().err
    # a dict with a misspelt key is refused by name, not run without it
    factory.write_text(
        factory.read_text()
        + "def misspelt():\n"
        + "    model, batch, loss_fn = make()\n"
        + "    return {'model': model, 'batch': batch, 'loss': loss_fn}\n"
        + "def no_model():\n"
        + "    return {'batch': make()[1]}\n"
    )
    assert main(["doctor", f"{factory}:misspelt", "--no-report"]) == 2
    assert "the factory's dict has unknown keys ['loss']" in capsys.readouterr().err
    assert main(["doctor", f"{factory}:no_model", "--no-report"]) == 2
    assert "the factory's dict has no 'model'" in capsys.readouterr().err


CLI_FAULTS = """
import torch, torch.nn.functional as F
from torch import nn


class HandLN(nn.Module):  # a hand-written LayerNorm: its variance squares values near 1e3
    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5)


def handln():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), HandLN(), nn.Linear(32, 4))
    with torch.no_grad():
        model[0].weight.mul_(100.0)
    return model, (torch.randn(32, 16) * 3, torch.randint(0, 4, (32,))), F.cross_entropy


def near_max():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    x = torch.randn(16, 8)
    with torch.no_grad():
        model[0].weight.mul_(3e4 / model[0](x).abs().max())
        model[0].bias.zero_()
    return model, (x, torch.randint(0, 4, (16,))), F.cross_entropy


def grad_overflow():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    batch = (torch.randn(64, 16), torch.randint(0, 4, (64,)))
    return model, batch, lambda out, y: F.cross_entropy(out, y) * 1e3


class Fails(nn.Module):
    def forward(self, x):
        raise RuntimeError("the model's own bug")


def fails():
    return Fails(), (torch.randn(2, 2), torch.zeros(2)), F.mse_loss


class TypeBug(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 3)

    def forward(self, x):
        return self.l(x) + len(x, 1)  # a TypeError in the user's own forward


def type_bug():
    return TypeBug(), (torch.randn(8, 4), torch.randint(0, 3, (8,))), F.cross_entropy


def loss_bug():  # 8 outputs, 5 targets: a ValueError in the loss
    model = nn.Sequential(nn.Linear(4, 3))
    return model, (torch.randn(8, 4), torch.randint(0, 3, (5,))), F.cross_entropy


def frozen():  # no parameter trains: the loss does not require grad
    model = nn.Sequential(nn.Linear(4, 3)).requires_grad_(False)
    return model, (torch.randn(8, 4), torch.randint(0, 3, (8,))), F.cross_entropy


def inf_loss():
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    return nn.Linear(4, 3), batch, lambda out, y: F.cross_entropy(out, y) * float("inf")


def flush():  # a loss of 1e-11: float16 gradients flush to zero below loss scale 2**24
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )
    batch = (torch.randn(64, 8), torch.randn(64, 1))
    return model, batch, lambda out, y: ((out.float() - y) ** 2).mean() * 1e-11
"""


@pytest.fixture
def cli_faults(tmp_path: Path) -> Path:
    path = tmp_path / "cli_faults.py"
    path.write_text(CLI_FAULTS)
    return path


def _doctor(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["doctor", *args, "--no-report"])
    out, err = capsys.readouterr()
    return code, " ".join(out.split()), " ".join(err.split())


def test_cli_doctor_exit_status_is_whether_the_run_passes(cli_faults, capsys):
    # a layer that loses its signal inside (SQNR 0.3 dB): broken, and the run fails (1)
    code, out, _ = _doctor(capsys, f"{cli_faults}:handln")
    assert code == 1 and "1 broken, 0 at risk" in out and "it carries little signal" in out
    # at risk but within tolerance: exit 0, and no rule to recommend
    code, out, _ = _doctor(capsys, f"{cli_faults}:near_max")
    assert code == 0 and "0 broken, 1 at risk" in out
    assert "no rule needed: the run is within tolerance 0.1 as it is" in out
    assert "fixing" not in out and "mixprec.PolicyMap(" not in out
    # a backward overflow at the loss scale asked for: exit 1, the fix is a smaller scale
    code, out, _ = _doctor(capsys, f"{cli_faults}:grad_overflow", "--loss-scale", "65536")
    assert code == 1 and "broken 2 (Linear): its output gradient is already inf/NaN" in out
    assert "recommended policy: 16-mixed as it is (no rule needed)" in out
    assert "train at loss scale 64: mixprec.Precision(policy, scaler=mixprec." in out
    assert "DynamicLossScaler(init_scale=64))" in out
    # the same run at the loss scale a dynamic scaler settles at passes
    assert _doctor(capsys, f"{cli_faults}:grad_overflow")[0] == 0
    # float64 targets run (their gradients were once measured with a float32 norm)
    assert _doctor(capsys, f"{cli_faults}:near_max", "--precision", "64-true")[0] == 0


def test_cli_without_matplotlib_stops_before_the_runs(cli_faults, tmp_path, capsys, monkeypatch):
    """The report's plots need matplotlib: without it the doctor ran the diagnosis and the
    search for a fix, then stopped with an ImportError (exit 3) and wrote no policy.json."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    code = main(["doctor", f"{cli_faults}:fails", "--out", str(tmp_path / "rep")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "need matplotlib, which is not installed" in err and "--no-report" in err
    assert "the model's own bug" not in err  # the model never ran


def test_cli_an_error_inside_the_run_exits_3_with_its_traceback(cli_faults, capsys):
    code, _, err = _doctor(capsys, f"{cli_faults}:fails")
    assert code == 3
    assert "Traceback (most recent call last)" in err
    assert err.endswith("mixprec doctor: stopped by an error: RuntimeError: the model's own bug")


@pytest.mark.parametrize("factory", ["type_bug", "loss_bug"])
def test_cli_a_type_or_value_error_of_the_users_model_or_loss_exits_3(cli_faults, capsys, factory):
    """Found by a review: a TypeError in the user's forward or a ValueError from their loss
    was "bad arguments" (exit 2), one line and no traceback, where docs/doctor.md says 3 and
    the traceback; the diagnosis and the search alike. Bad arguments are still 2."""
    expected = {
        "type_bug": "TypeError: len() takes exactly one argument (2 given)",
        "loss_bug": "ValueError: Expected input batch_size (8) to match target batch_size (5).",
    }[factory]
    for extra in ((), ("--search", "--memory", "0.5", "--baseline", "32-true")):
        code, _, err = _doctor(capsys, f"{cli_faults}:{factory}", *extra)
        assert code == 3 and "Traceback (most recent call last)" in err, extra
        assert err.endswith(f"stopped by an error: {expected}"), extra
    # mixprec's own checks of what it is given, before the model runs: 2, one line
    for args in (("--precision", "no-such-precision"), ("--search", "--baseline", "32-true")):
        code, _, err = _doctor(capsys, f"{cli_faults}:type_bug", *args)
        assert code == 2 and "Traceback" not in err, args
    # mixprec's refusal of a reference run whose float32 loss is not finite: 2, as before
    code, _, err = _doctor(capsys, f"{cli_faults}:inf_loss")
    assert code == 2 and "already gives a non-finite loss" in err and "Traceback" not in err


def test_cli_a_loss_scale_fix_is_said_and_checked_with_its_scale(
    cli_faults, tmp_path, capsys, monkeypatch
):
    """Found by a review: with a loss scale as the whole fix, policy.json held the diagnosed
    policy unchanged (diagnosing again with it failed as before), the CLI pointed at it as
    the fix, and the scale was printed as 1.67772e+07 and as 16777216. (A console wide
    enough for the command's path: a long temporary folder must not wrap it mid-word.)"""
    monkeypatch.setenv("COLUMNS", "400")
    out = tmp_path / "rep"
    code = main(["doctor", f"{cli_faults}:flush", "--out", str(out)])
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 1 and "1.67772e+07" not in printed
    assert not (out / "policy.json").exists()  # (it would only repeat 16-mixed)
    assert "The fix is loss scale 16777216 alone, with 16-mixed as it is" in printed
    assert "no policy.json: the fix is --loss-scale 16777216 alone)" in printed
    check = f"mixprec doctor {cli_faults}:flush --precision 16-mixed --loss-scale 16777216"
    assert f"check the fix again: {check} --no-report" in printed
    report = (out / "report.md").read_text()
    assert "**The fix is loss scale 16777216 alone" in report and f"{check} --no-report" in report
    assert "1.67772e+07" not in report and "loss scale 16777216 (recommended" in report
    assert main(check.split()[1:] + ["--no-report"]) == 0  # the command shown passes
    capsys.readouterr()


def test_a_report_says_a_policy_fix_needs_its_loss_scale_too():
    """With rules and a loss scale, policy.json holds the rules only: the report says the
    scale is needed too, and shows the check command it is given."""
    model, batch, loss_fn = _tanh_stack(1.0)
    d = diagnose(model, batch, loss_fn, precision="16-mixed")
    policy = PolicyMap("16-mixed", {"0": "32-true"})
    fix = mixprec.doctor.Recommendation(policy, d, ("0 -> 32-true: ...",), 0.1, 2.0**20)
    check = "mixprec doctor f.py:make --precision out/policy.json --loss-scale 1048576"
    report = d.to_markdown(recommendation=fix, check=check)
    assert (
        "**The fix also needs loss scale 1048576, which policy.json (a policy) does not hold; "
        "check it with --loss-scale 1048576, and train at that scale.**"
    ) in report
    assert f"```bash\n{check}\n```" in report


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_diagnose_on_cuda():
    model, batch = overflow_model(1e5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = diagnose(model, batch, F.cross_entropy, device="cuda")
    assert d.device.type == "cuda" and names(d) == ["proj"]
    assert next(model.parameters()).device.type == "cpu"


def test_an_integer_model_output_and_a_missing_gpu_are_named():
    class Argmax(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x).argmax(-1)

    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    with pytest.raises(TypeError, match="no floating tensor \\(a int64 tensor\\).*argmax"):
        diagnose(Argmax(), batch, lambda out, y: (out == y).float().mean())
    if not torch.cuda.is_available():
        with pytest.raises(PrecisionError, match="sees no CUDA GPU"):
            diagnose(nn.Linear(4, 3), batch, F.cross_entropy, device="cuda")


def _big_first_layer() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Layer "0" has weights around 300: in bfloat16 a unit in the last place there is 2, so
    an Adam step of 0.01 rounds away; layer "1" (weights around 0.3) keeps its steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.mul_(1000.0)
        model[0].bias.mul_(1000.0)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g))


def test_vanishing_updates_of_16_bit_weights_are_named_and_fixed():
    model, batch = _big_first_layer()
    d = diagnose(model, batch, F.cross_entropy, precision="bf16-true", lr=1e-2)
    big, small = d.modules["0"], d.modules["1"]
    assert big.vanishing > 0.95 and small.vanishing < 0.1  # a few of layer 0's are near 0
    assert big.verdict == BROKEN and big.kind == "precision"
    assert f"{big.vanishing:.0%} of its parameter updates round away" in big.reason
    assert "lr 0.01 (adam steps): it stops learning" in big.reason
    assert small.verdict == OK
    fix = d.recommend()
    # float32 weights and math for layer 0, handing bfloat16 on to the rest as before
    assert fix.policy == PolicyMap("bf16-true", {"0": "p=f32,c=f32,o=bf16"})
    assert fix.verified.modules["0"].vanishing == 0.0 and fix.verified.passes()


def test_no_vanishing_check_without_lr_or_with_float32_weights():
    model, batch = _big_first_layer()
    assert (
        diagnose(model, batch, F.cross_entropy, precision="bf16-true").modules["0"].vanishing == 0
    )
    mixed = diagnose(model, batch, F.cross_entropy, precision="bf16-mixed", lr=1e-2)
    assert all(m.vanishing == 0 for m in mixed.modules.values())


def test_vanishing_fraction_is_exact_rounding():
    from mixprec.doctor.verdicts import vanishing_fraction

    w = torch.tensor([256.0, 256.0, 1.0, 0.0])
    step = torch.tensor(
        [0.9, 1.1, 0.0004, 0.0]
    )  # ulp at 256: bf16 2, fp16 0.25; at 1: 2**-7, 2**-10
    assert vanishing_fraction(w, step, torch.bfloat16) == 2 / 3
    assert vanishing_fraction(w, step, torch.float16) == 1 / 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "lr must be a positive finite number"),
        ({"lr": 1.0, "optimizer": "lion"}, "one of adam, sgd"),
        ({"lr": True}, "lr must be a positive finite number"),
    ],
)
def test_vanishing_check_bad_input(kwargs, message):
    model, batch = _big_first_layer()
    with pytest.raises(ValueError, match=message):
        diagnose(model, batch, F.cross_entropy, precision="bf16-true", **kwargs)


def test_vanishing_check_takes_any_real_lr():
    """numpy's float32 (a learning rate read from a config array) was refused as 'must be a
    positive finite number'."""
    model, batch = _big_first_layer()
    d = diagnose(model, batch, F.cross_entropy, precision="bf16-true", lr=np.float32(1e-2))
    assert type(d.update.lr) is float and d.modules["0"].vanishing > 0.95


def test_cli_doctor_reports_vanishing_updates(tmp_path, capsys):
    factory = tmp_path / "big.py"
    factory.write_text(
        "import torch, torch.nn.functional as F\n"
        "from torch import nn\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))\n"
        "    with torch.no_grad():\n"
        "        model[0].weight.mul_(1000.0)\n"
        "        model[0].bias.mul_(1000.0)\n"
        "    return model, (torch.randn(16, 8), torch.randint(0, 2, (16,))), F.cross_entropy\n"
    )
    args = ["doctor", f"{factory}:make", "--precision", "bf16-true", "--lr", "0.01"]
    assert main([*args, "--no-report"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "round away" in out and "'0': " in out


def test_a_batch_of_inputs_and_target_without_loss_fn_says_loss_fn_is_missing():
    """Without loss_fn the model is called on the whole batch to return its own loss; a plain
    Sequential given (inputs, target) failed inside F.linear ('must be Tensor, not tuple')."""
    model = nn.Sequential(nn.Linear(8, 4))
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    with pytest.raises(TypeError, match=r"no loss_fn was given.*tuple of 2.*pass loss_fn=") as err:
        mixprec.diagnose(model, batch)
    assert "must be Tensor, not tuple" in str(err.value)


def test_cli_doctor_says_why_a_run_with_no_finding_misses_the_tolerance(tmp_path, capsys):
    """An error built up over layers, none at risk, misses a tight tolerance: the command
    exits 1 and says why (it said only "no finding: every module is ok")."""
    factory = tmp_path / "deep.py"
    factory.write_text(
        "import torch, torch.nn.functional as F\n"
        "from torch import nn\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))\n"
        "    return model, (torch.randn(32, 16), torch.randint(0, 4, (32,))), "
        "F.cross_entropy\n"
    )
    args = ["doctor", f"{factory}:make", "--precision", "bf16-mixed", "--no-report"]
    assert main([*args, "--tolerance", "1e-9"]) == 1
    captured = capsys.readouterr()
    assert "no finding" in captured.out
    assert "not within tolerance 1e-09" in captured.err + captured.out


def test_recommend_keeps_the_maps_activation_and_state_rules():
    """The policy `recommend` verifies and writes is the user's with rules added: it dropped
    the map's activation and optimizer-state rules (a search's own plan came back without
    them, and the fix was verified on another setup)."""
    model, batch = overflow_model()
    given = PolicyMap("16-mixed", activations={"inp": "checkpoint"}, states="int8")
    fix = diagnose(model, batch, F.cross_entropy, precision=given).recommend()
    assert fix.log and "proj" in str(fix.policy.rules)
    for policy in (fix.policy, fix.verified.precision):
        assert policy.activations == given.activations and policy.states == given.states


@pytest.mark.parametrize("key", ["a(", "x[1", "a+", "a|b"])
def test_recommend_escapes_a_module_name_that_is_no_regex_of_itself(key):
    """A ModuleDict key that is no valid pattern (``"a("``) crashed `recommend` with
    ``re.error``; one that is a pattern not matching itself (``"a+"``) gave a rule that
    missed its own layer."""

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.heads = nn.ModuleDict({key: nn.Linear(16, 16), "ok": nn.Linear(16, 16)})
            self.norm = nn.LayerNorm(16)
            self.out = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            return self.out(self.norm(self.heads[key](h)) + self.heads["ok"](h))

    torch.manual_seed(0)
    model = Heads()
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    with torch.no_grad():
        model.heads[key].weight.mul_(1e5 / model.heads[key](model.inp(x)).abs().max())
    diagnosis = diagnose(model, (x, y), F.cross_entropy, precision="16-mixed")
    assert f"heads.{key}" in [f.name for f in diagnosis.findings]
    fix = diagnosis.recommend()
    resolved = fix.policy.resolve(model)
    assert resolved[f"heads.{key}"].policy != resolved["heads.ok"].policy
    assert fix.verified.passes(fix.tolerance)


def test_recommend_keeps_an_exact_path_rule_beside_the_users_regex_rules():
    """A path that is no regex of itself (``"blocks.big+1"``) was escaped into a regex rule,
    which then matched the module beside the user's own regex rule of the same rank: the
    recommendation was refused ("matched by 2 regex rules"). A key equal to the path is
    the module's exact rule, which wins."""

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleDict({"big+1": nn.Linear(4, 4), "out": nn.Linear(4, 1)})
            with torch.no_grad():
                self.blocks["big+1"].weight.mul_(3e4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks["out"](self.blocks["big+1"](x) / 1e4)

    torch.manual_seed(0)
    x, y = torch.randn(8, 4) * 10, torch.randn(8, 1)
    user = mixprec.PolicyMap("16-mixed", {r"blocks\..*": "16-mixed"})
    diagnosis = diagnose(Blocks(), (x, y), F.mse_loss, precision=user)
    assert "blocks.big+1" in [f.name for f in diagnosis.findings]
    fix = diagnosis.recommend()
    assert fix.policy.rules["blocks.big+1"] != fix.policy.rules[r"blocks\..*"]
    assert fix.verified.passes(fix.tolerance)


class ScaledInPlace(nn.Module):
    """Scales its input in place (``x.div_(255)``, as image pipelines do)."""

    def forward(self, x):
        return x.div_(255.0)


def test_a_model_writing_into_its_batch_is_diagnosed_on_the_batch_as_given():
    """Each precision's run took the caller's batch itself: the in-place scale divided it
    again for every run, so 32-true against 32-true differed (gradients 0.7 apart, "not
    within tolerance... the error builds up over many layers") and the caller's batch
    ended divided by 255 twice. Each run now takes a copy."""
    torch.manual_seed(0)
    model = nn.Sequential(ScaledInPlace(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.rand(16, 8) * 255, torch.randint(0, 2, (16,))
    given = x.clone()
    report = diagnose(model, (x, y), F.cross_entropy, precision="32-true")
    assert report.passes() and not report.findings
    assert torch.equal(x, given)


class _Magnitude(nn.Module):
    def forward(self, x):
        return torch.sqrt(x * x)  # NaN gradient at 0, in any dtype


def test_gradients_already_not_finite_in_the_reference_are_refused_not_blamed():
    """Found by a review: a model whose float32 gradients are NaN with a finite loss (sqrt
    at 0) had the module reported broken in bf16-mixed, and in 32-true against 32-true too,
    and the recommendation said to train in the reference precision, which has them too.
    Refused now, as a non-finite reference loss is."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _Magnitude(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight[0].zero_()
        model[0].bias[0] = 0.0
    batch = (torch.randn(16, 4), torch.randint(0, 2, (16,)))
    for precision in ("bf16-mixed", "32-true"):
        with pytest.raises(ValueError, match=r"reference run .* inf/NaN gradients .*0\.weight"):
            diagnose(model, batch, F.cross_entropy, precision=precision)


class _ScaledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * 8.0  # the block's own multiply overflows float16


def test_a_block_broken_by_its_own_code_is_blamed_over_a_child_only_at_risk():
    """Found by a review: a block whose own multiply overflowed float16 was cleared because
    its child was at risk ("contains 1.fc (at risk)"); the blame went outside the modules and
    the recommendation said no per-module policy helps. The block stays broken now, and
    moving it fixes the run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _ScaledBlock(), nn.Linear(8, 2))
    with torch.no_grad():
        model[1].fc.weight.mul_(20000.0)  # its output about 2e4: at risk in float16, finite
    batch = (torch.randn(32, 8), torch.randint(0, 2, (32,)))
    found = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
    assert found.modules["1.fc"].verdict == "at risk"
    assert found.modules["1"].verdict == "broken"
    fix = found.recommend()
    assert [r["path"] for r in fix.policy.to_config()["rules"]][0] == "1"
    assert fix.verified.passes()


def test_float16_weights_with_masters_are_not_said_to_lose_their_updates():
    """Found by a review: under 16-true the vanishing check counted float16 weights' updates
    as rounding away, where `Precision("16-true")` steps them through float32 masters (which
    keep every update); the recommendation moved layers to float32 for nothing. The check
    follows `master_weights` as Precision takes it: None and True keep float16's updates,
    False loses them (as bfloat16 without masters, unless True)."""
    model, batch = _big_first_layer()
    f16 = diagnose(model, batch, F.cross_entropy, precision="16-true", lr=1e-2)
    assert f16.modules["0"].vanishing == 0.0 and f16.modules["0"].verdict == OK
    bare = diagnose(model, batch, F.cross_entropy, "16-true", lr=1e-2, master_weights=False)
    assert bare.modules["0"].vanishing > 0.9 and bare.modules["0"].verdict == BROKEN
    kept = diagnose(model, batch, F.cross_entropy, "bf16-true", lr=1e-2, master_weights=True)
    assert kept.modules["0"].vanishing == 0.0
    with pytest.raises(TypeError, match="master_weights must be None, True or False, got 0"):
        diagnose(model, batch, F.cross_entropy, "16-true", lr=1e-2, master_weights=0)


def test_compensated_16_bit_weights_are_not_said_to_lose_their_updates(tmp_path, capsys):
    """bfloat16 weights stepped with Kahan or stochastic rounding (Precision's
    ``compensation=``) keep what rounds away: the vanishing check flagged them as it flags
    plain bfloat16 weights, and the recommendation moved layers to float32 for nothing.
    ``diagnose(compensation=...)`` and the CLI's ``--compensation`` and
    ``--master-weights`` follow Precision's flags."""
    model, batch = _big_first_layer()
    plain = diagnose(model, batch, F.cross_entropy, "bf16-true", lr=1e-2)
    assert plain.modules["0"].vanishing > 0.9 and plain.modules["0"].verdict == BROKEN
    for kind in ("kahan", "stochastic"):
        kept = diagnose(model, batch, F.cross_entropy, "bf16-true", lr=1e-2, compensation=kind)
        assert kept.modules["0"].vanishing == 0.0 and kept.modules["0"].verdict == OK
    with pytest.raises(ValueError, match="compensation must be 'kahan', 'stochastic' or None"):
        diagnose(model, batch, F.cross_entropy, "bf16-true", compensation="Kahan")
    with pytest.raises(ValueError, match="two answers to one problem"):  # (as Precision says)
        diagnose(
            model, batch, F.cross_entropy, "bf16-true", master_weights=True, compensation="kahan"
        )

    factory = tmp_path / "big.py"
    factory.write_text(
        "import torch, torch.nn.functional as F\n"
        "from torch import nn\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))\n"
        "    with torch.no_grad():\n"
        "        model[0].weight.mul_(1000.0)\n"
        "        model[0].bias.mul_(1000.0)\n"
        "    g = torch.Generator().manual_seed(1)\n"
        "    batch = (torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g))\n"
        "    return model, batch, F.cross_entropy\n"
    )
    args = ["doctor", f"{factory}:make", "--precision", "bf16-true", "--lr", "0.01"]
    args += ["--no-report", "--no-recommend"]
    assert main(args) == 1
    assert "round away" in capsys.readouterr().out
    assert main([*args, "--compensation", "kahan"]) == 0
    assert "round away" not in capsys.readouterr().out
    assert main([*args, "--master-weights", "true"]) == 0
    with pytest.raises(SystemExit) as exc:
        main([*args, "--master-weights", "maybe"])
    assert exc.value.code == 2 and "invalid choice: 'maybe'" in capsys.readouterr().err
    # (a review: accepted where nothing reads them, or where Precision refuses them)
    bare = ["doctor", f"{factory}:make", "--no-report"]
    assert main([*bare, "--compensation", "kahan"]) == 2
    assert "--compensation says how --lr's steps are kept; give --lr too" in capsys.readouterr().err
    assert main([*bare, "--search", "--master-weights", "false"]) == 2
    assert "--master-weights is not an option of --search" in capsys.readouterr().err
    assert main([*args, "--master-weights", "true", "--compensation", "kahan"]) == 2
    assert "two answers to one problem" in capsys.readouterr().err


def test_why_no_policy_was_recommended_is_in_the_report(tmp_path, capsys):
    """When `recommend` finds no policy (a loss overflowing float16 outside every module),
    the CLI said why on the terminal only: report.md, what a user keeps and shares, had no
    word of it. Its "Recommended policy" section now says why."""
    factory = tmp_path / "overflowing.py"
    factory.write_text(
        "import torch\n"
        "from torch import nn\n"
        "from mixprec.trainer import TrainingModule\n"
        "class Overflowing(TrainingModule):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        torch.manual_seed(0)\n"
        "        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))\n"
        "    def training_step(self, batch, batch_idx):\n"
        "        return (self.net(batch[0]) * 1e5).square().mean()\n"
        "def make():\n"
        "    return Overflowing(), (torch.randn(32, 8), torch.randn(32, 4))\n"
    )
    out = tmp_path / "report"
    assert main(["doctor", f"{factory}:make", "--precision", "16-mixed", "--out", str(out)]) == 1
    assert "no recommendation:" in capsys.readouterr().err
    report = (out / "report.md").read_text()
    section = report.split("## Recommended policy", 1)[1]
    assert section.lstrip().startswith("No recommendation: ")
    assert "no per-module policy changes what happens outside" in section
    # ("<root>" outside backticks is an HTML tag to markdown: written "(root)")
    assert "<root>" not in section.split("\n## ")[0]
    assert not (out / "policy.json").exists()


class _SharedActBlock(nn.Module):
    def __init__(self, act: nn.Module, k: float) -> None:
        super().__init__()
        self.fc, self.act, self.k = nn.Linear(8, 8), act, k

    def forward(self, x):
        return self.act(self.fc(x) * self.k)


class _SharedAct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        act = nn.ReLU()  # one instance, in both blocks
        self.b0, self.b1 = _SharedActBlock(act, 1e5), _SharedActBlock(act, 1e-5)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.b1(self.b0(x)))


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid = nn.Embedding(16, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.mid(self.emb(ids)))


class _TiedHead(nn.Module):
    """Reads its (tied) weight and overflows float16 inside its own forward, its output (a
    softmax) in range."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim))

    def forward(self, x):
        return torch.softmax((x @ self.weight.t()) * 5e4, -1)


class _TiedSoftmaxLM(nn.Module):
    def __init__(self, held_by_root: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.head = _TiedHead(64, 32)
        if held_by_root:  # the model itself holds the weight: moving it is moving everything
            self.weight = self.emb.weight
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)))


def _tied_nll(p, y):
    return F.nll_loss(torch.log(p.float() + 1e-4).flatten(0, 1), y.flatten())


def test_recommend_moves_a_module_with_its_shared_submodules_and_tied_weights():
    """Found by a review: docs/doctor.md says a moved module takes its submodules' other
    paths and the modules holding its tied weights with it, but recommend refused ("b0
    cannot move alone ... reachable at", "head cannot move alone ... try a mixed policy")
    where moving them together passes."""
    torch.manual_seed(0)
    batch = (torch.randn(16, 8), torch.randint(0, 2, (16,)))
    model = _SharedAct()
    with hardware.assume(ZEN4):
        fix = diagnose(model, batch, F.cross_entropy, precision="16-mixed").recommend()
    # b0's ReLU is b1's too: its other path moves with b0 (b1's own layer is a fix of its own)
    assert fix.policy.rules["b0"] == fix.policy.rules["b1.act"] == Policy("bf16-mixed")
    assert fix.log[0].startswith("b0 -> bf16-mixed (with b1.act, the same module as b0.act): ")
    assert fix.verified.passes(fix.tolerance)
    resolved = fix.policy.resolve(model)  # (one module, one policy: explain takes it too)
    assert resolved["b0.act"].policy == resolved["b1.act"].policy == Policy("bf16-mixed")
    assert "b1.act" in str(mixprec.explain(model, fix.policy))
    # a head tied to the embedding, moved to float32 weights under 16-true: the embedding
    # stores the same weight, so it moves with the head
    torch.manual_seed(0)
    model, ids = _TiedSoftmaxLM(), torch.randint(0, 64, (8, 12))
    with hardware.assume(ZEN4):
        found = diagnose(model, (ids, ids), _tied_nll, precision="16-true")
        assert [f.name for f in found.findings] == ["head"]
        fix = found.recommend()
    moved = Policy(param_dtype="float32", compute_dtype="bfloat16", output_dtype="float16")
    assert fix.policy == PolicyMap("16-true", {"head": moved, "emb": moved})
    assert fix.log == (
        f"head -> {moved.name} (with emb, whose emb.weight is head.weight): the run passes",
    )
    assert diagnose(model, (ids, ids), _tied_nll, precision=fix.policy).passes()
    mixprec.explain(model, fix.policy)  # (refused a map storing the weight two ways)
    # under a mixed policy the head's weight stays float32 either way: it moves alone
    with hardware.assume(ZEN4):
        fix = diagnose(model, (ids, ids), _tied_nll, precision="16-mixed").recommend()
    assert fix.policy == PolicyMap("16-mixed", {"head": "bf16-mixed"})


def test_a_weight_the_model_itself_holds_keeps_the_module_from_moving_alone():
    """Moving the model itself with a head whose weight it holds would move everything: the
    move is refused and said so, without the 'true' policy's hint (a mixed policy would not
    share the weight any less)."""
    torch.manual_seed(0)
    model, ids = _TiedSoftmaxLM(held_by_root=True), torch.randint(0, 64, (8, 12))
    found = diagnose(model, (ids, ids), _tied_nll, precision="16-true")
    with pytest.raises(PrecisionError) as refused:
        found.recommend()
    said = str(refused.value)
    # (the embedding, holding it too, moves with the head; the model itself does not)
    assert "head cannot move alone (parameter emb.weight is shared with 'weight'" in said
    assert "try a mixed policy" not in said


# -- found by a review: blame, the reference, refusals -----------------------------------------


class _Lossy(nn.Module):  # (x + 2000) - 2000 keeps about one unit of x in float16
    def forward(self, x):
        return (x + 2000.0) - 2000.0


class _MaskedAttention(nn.Module):  # healthy: attention with an additive mask, and a residual
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, h, mask):
        q, k, v = self.qkv(h).chunk(3, -1)
        return h + self.o(torch.softmax(q @ k.transpose(-1, -2) / 4.0 + mask, -1) @ v)


class _MaskedNet(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp, self.lossy, self.head = nn.Linear(8, d), _Lossy(), nn.Linear(d, 3)
        self.blocks = nn.ModuleList(_MaskedAttention(d) for _ in range(2))

    def forward(self, x, keep):
        mask = (1.0 - keep)[:, None, :] * -10000.0  # Hugging Face's additive mask: exact
        h = self.lossy(self.inp(x))
        for block in self.blocks:
            h = block(h, mask)
        return self.head(h.mean(1))


class _Tiny(nn.Module):  # its output is below float16's smallest normal
    def forward(self, x):
        return x * 1e-6


class _Gate(nn.Module):  # healthy: passes h on where a wide, normal-range gate allows
    def forward(self, h, gate):
        return h * (gate[:, : h.shape[1]] > -10).to(h.dtype)


class _GatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.tiny, self.gate = nn.Linear(8, 16), _Tiny(), _Gate()
        self.head = nn.Linear(16, 3)

    def forward(self, x, g):
        return self.head(self.gate(self.tiny(self.inp(x)), g.to(self.inp.weight.dtype)) * 1e6)


def test_an_exact_input_beside_one_carrying_error_does_not_move_the_blame_downstream():
    """Found by a review: a module's input error and underflow were pooled over its input
    tensors, so a large exact one (an additive attention mask of -1e4) swamped the hidden
    state's 0.48 error ("grows to 0.48 here (inputs 0.00023)"), and every healthy block
    after the real culprit was blamed too; likewise a gate whose float16 input underflows
    whole was blamed, pooled with a wider normal input (20%). Pooled over the inputs that
    carry any error (or underflow) now."""
    torch.manual_seed(0)
    keep = torch.ones(4, 12)
    keep[:, 9:] = 0
    batch = (torch.randn(4, 12, 8), keep, torch.randint(0, 3, (4,)))
    found = diagnose(_MaskedNet(), batch, F.cross_entropy, precision="16-mixed")
    assert names(found) == ["lossy"]
    lossy, first = found.modules["lossy"], found.modules["blocks.0"]
    assert lossy.rel_error > 0.4 and first.input_rel_error == lossy.rel_error
    torch.manual_seed(0)
    batch = (torch.randn(16, 8), torch.randn(16, 64), torch.randint(0, 3, (16,)))
    found = diagnose(_GatedNet(), batch, F.cross_entropy, precision="16-true")
    assert names(found) == ["tiny"]
    assert found.modules["gate"].input_underflow == 1.0


class _MildSide(nn.Module):  # a side path keeping ~6% error in float16, a hundredth of h
    def forward(self, y):
        return ((y + 200.0) - 200.0) * 0.01


class _LossyWithSide(nn.Module):  # the culprit: loses about half of h in float16
    def forward(self, h, t):
        return (h + 2000.0) - 2000.0 + t


class _SideNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.side, self.mild = nn.Linear(8, 16), nn.Linear(8, 16), _MildSide()
        self.lossy, self.head = _LossyWithSide(), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.lossy(self.inp(x), self.mild(self.side(x))))


def test_a_small_side_input_carrying_error_does_not_hide_the_culprit_beside_it():
    """Found by the review of the fix above: a module's input error taken as its worst input
    tensor's let a side input a hundredth of the hidden state's size, with 6% error of its
    own, raise the bar: the culprit losing half of h was not flagged, and recommend found
    no layer to move (16-true) or moved an unrelated one (16-mixed)."""
    for precision in ("16-true", "16-mixed"):
        torch.manual_seed(0)
        batch = (torch.randn(16, 8), torch.randint(0, 3, (16,)))
        found = diagnose(_SideNet(), batch, F.cross_entropy, precision=precision)
        assert "lossy" in names(found), precision
        assert found.modules["lossy"].input_rel_error < 0.01
        assert "lossy" in found.recommend().policy.rules, precision


class _SqrtAtZero(nn.Module):  # d/dx sqrt(x*x - x*x) at 0 is inf * 0: NaN in any precision
    def forward(self, x):
        return x + torch.sqrt(x[:, :1] * x[:, :1] - x[:, :1] * x[:, :1])


def test_a_float64_reference_with_nan_gradients_is_refused_too():
    """Found by a review: a 64-true reference's NaN gradients (finite loss) were not checked,
    as if float64's could only be its overflow past float32, so the target was blamed
    ("its backward produces inf/NaN") and recommend raised; 32-true was refused. Both are."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), _SqrtAtZero(), nn.Linear(16, 3))
    batch = (torch.randn(16, 8), torch.randint(0, 3, (16,)))
    for reference in ("32-true", "64-true"):
        with pytest.raises(ReferenceRunError, match=r"already gives inf/NaN gradients .*0\.weight"):
            diagnose(model, batch, F.cross_entropy, precision="bf16-mixed", reference=reference)


class _Block(nn.Module):
    def __init__(self, softmax: nn.Module, k: float) -> None:
        super().__init__()
        self.lin, self.sm, self.k = nn.Linear(16, 16), softmax, k

    def forward(self, x):
        return self.sm(self.lin(x) * self.k)


class _SharedSoftmaxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        softmax = NaiveSoftmax()  # one module at b1.sm and b2.sm
        self.b1, self.b2, self.head = _Block(softmax, 1.0), _Block(softmax, 40.0), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.b2(self.b1(x)))


def test_a_block_holding_a_shared_module_at_another_path_is_not_blamed():
    """Found by a review: a softmax shared by two blocks (named b1.sm by its first path)
    overflowing in b2's call was blamed, and so was b2, which only contains it (as b2.sm):
    containment was read from the path names alone."""
    torch.manual_seed(0)
    model = _SharedSoftmaxNet()
    batch = (torch.randn(16, 16), torch.randint(0, 3, (16,)))
    found = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
    assert names(found) == ["b1.sm"]
    assert found.modules["b1.sm"].aliases == ("b2.sm",)
    assert found.modules["b2"].note == "contains b1.sm (broken), here as b2.sm"


def test_cli_a_frozen_model_is_refused_in_one_line(cli_faults, capsys):
    """Found by a review: "the loss does not require grad" was a plain ValueError raised
    after the model ran, so the CLI took it for the model's own error (exit 3, with a
    traceback) where it is mixprec's refusal (exit 2, one line)."""
    code, _, err = _doctor(capsys, f"{cli_faults}:frozen")
    assert code == 2 and "the loss does not require grad" in err and "Traceback" not in err
    model = nn.Sequential(nn.Linear(4, 3)).requires_grad_(False)
    with pytest.raises(LossTypeError, match="the loss does not require grad"):
        diagnose(model, (torch.randn(8, 4), torch.randint(0, 3, (8,))), F.cross_entropy)


class _Cancel(nn.Module):  # (h + 1000) - 1000: float16 keeps h to 0.5 here, its signal lost
    def forward(self, h):
        return (h + 1000.0) - 1000.0


class _CancelLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.c, self.head = nn.Linear(16, 16), _Cancel(), nn.Linear(16, 2)

    def forward(self, x):
        h = self.pre(x)
        for _ in range(4):
            h = self.c(h)
        return self.head(h)


class _Recurrence(nn.Module):  # grows 1.5x a call, to 3.4e4 after 24 calls
    def __init__(self) -> None:
        super().__init__()
        self.cell, self.head = nn.Linear(16, 16, bias=False), nn.Linear(16, 2)
        with torch.no_grad():
            self.cell.weight.copy_(torch.eye(16) * 1.5)

    def forward(self, x):
        for _ in range(24):
            x = self.cell(x)
        return self.head(x / 65536)


def test_a_module_called_in_a_loop_is_judged_by_each_calls_own_inputs():
    """Found by a review: a module called several times (a loop, a recurrence) had its input
    error and range pooled over all its calls, its own earlier outputs included, so it was
    judged against the error and range it made itself: a looped op losing its signal in
    float16 was not flagged (recommend moved `pre`), nor a recurrence growing to 3.4e4,
    both flagged as a chain of distinct modules. Each call is judged by its own inputs."""
    torch.manual_seed(1)
    model = _CancelLoop()
    torch.manual_seed(0)
    batch = (torch.randn(32, 16) * 0.3, torch.randint(0, 2, (32,)))
    found = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
    assert names(found) == ["c"] and found.modules["c"].verdict == BROKEN
    assert found.modules["c"].reason.startswith("in call 1 of 4, its error")
    assert list(found.recommend().policy.rules) == ["c"]
    torch.manual_seed(1)
    model = _Recurrence()
    torch.manual_seed(0)
    batch = (torch.randn(8, 16).clamp(-2, 2), torch.randint(0, 2, (8,)))
    found = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
    assert names(found) == ["cell"] and found.modules["cell"].verdict == AT_RISK
    assert found.modules["cell"].reason.startswith("in call 23 of 24, output reaches 2.2e4")


class _AddMinMask(nn.Module):  # Hugging Face's additive mask: finfo(dtype).min plus the score
    def __init__(self, shift: float) -> None:
        super().__init__()
        self.shift = shift

    def forward(self, s):
        n = s.shape[-1]
        mask = torch.triu(torch.full((n, n), torch.finfo(s.dtype).min, dtype=s.dtype), 1)
        return (s.abs() + self.shift if self.shift else s) + mask


class _AddMinMaskAttention(nn.Module):
    def __init__(self, shift: float) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)
        self.mask, self.o = _AddMinMask(shift), nn.Linear(16, 2)

    def forward(self, x):
        p = self.mask(self.q(x) @ self.k(x).transpose(-1, -2)).softmax(-1)
        return self.o((p @ x).mean(1))


@pytest.mark.parametrize("length", [8, 40])  # measured batched, and alone (over 4096 values)
@pytest.mark.parametrize("shift", [0.0, 20.0])  # scores of either sign, or positive ones
def test_an_additive_lowest_value_mask_is_the_same_mask_in_float16(length, shift):
    """Found by a review: a mask of torch.finfo(dtype).min added to the scores holds
    float32's min in the reference (the score rounds away), but float16's min plus the score
    in the target: -inf below a negative score, -65472 above a positive one. Neither was
    taken for the same mask: "mask broken: 9 of 256 outputs are inf/NaN" (or a relative
    error of 1.8e3) with a loss error of 3e-4, and recommend raised. A target value of the
    same sign in its dtype's top binade or beyond stands for the same infinity."""
    torch.manual_seed(0)
    model = _AddMinMaskAttention(shift)
    with torch.no_grad():
        model.q.weight.mul_(3)
        model.k.weight.mul_(3)
    batch = (torch.randn(4, length, 16), torch.randint(0, 2, (4,)))
    d = diagnose(model, batch, F.cross_entropy, precision="16-true")
    mask = d.modules["mask"]
    assert mask.nonfinite == 0 and mask.rel_error < 1e-2 and not d.findings
    assert d.recommend().policy.rules == {}


class _Magnify(nn.Module):  # (x / k) * k: its backward multiplies the gradient by k first
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x):
        return (x / self.k) * self.k


class _TinyBranch(nn.Module):  # a confident wrong head beside a branch scaled by 3e-12
    def __init__(self) -> None:
        super().__init__()
        self.a, self.tiny = nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x):
        return self.a(x) + self.tiny(x) * 3e-12


def test_the_default_loss_scale_is_where_a_dynamic_scaler_runs_the_batch():
    """Found by a review: the default loss scale, documented as where a dynamic scaler
    starting at 2^16 settles, was min(2^16, recommended), the recommended one keeping 8x
    headroom: a batch a DynamicLossScaler steps at 65536 without an overflow was judged at
    8192, "tiny: 100% of its parameter gradients flush to zero ... broken", and recommend
    moved it to float32. The default is now 2^16 halved until the gradients are finite."""
    torch.manual_seed(0)
    model = _TinyBranch()
    x, y = torch.randn(2, 8).clamp(-0.5, 0.5), torch.tensor([0, 1])
    with torch.no_grad():
        model.a.weight.copy_(torch.tensor([[-4.0] * 8, [4.0] * 8]) * torch.sign(x[0]))
    d = diagnose(model, (x, y), F.cross_entropy, precision="16-mixed")
    assert (d.loss_scale, d.recommended_loss_scale) == (65536, 8192)
    assert d.modules["tiny"].verdict != BROKEN and d.modules["tiny"].param_grad_flushed < 0.5
    # a dynamic scaler steps this batch at 65536: no overflow, no back-off
    precision = Precision("16-mixed", allow_slow=True)
    trained, opt = precision.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    precision.backward(F.cross_entropy(trained(x), y))
    assert precision.step() and precision.scaler.loss_scale == 65536
    # a backward whose float16 gradient overflows inside a module (x 64 there) at 1024, the
    # largest scale the reference's gradients (39.1) fit: run again at 512, as a scaler would
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), _Magnify(64.0), nn.Linear(16, 2))
    batch = (torch.randn(16, 8), torch.randint(0, 2, (16,)))
    d = diagnose(model, batch, lambda o, y: F.cross_entropy(o, y) * 100, precision="16-mixed")
    assert (d.loss_scale, d.recommended_loss_scale) == (512, 128) and d.finite
    assert not d.findings


def test_an_error_made_only_in_the_backward_is_said_to_be_there():
    """Found by a review: a block whose saved activations are lossy (an fp8 activation rule)
    errs only in the backward: every output agrees, the gradients of the parameters before it
    are 0.4-0.8 off. recommend said "the error builds up over many layers", though the
    per-parameter gradient errors point at the block. It now says the forward agrees, names
    the parameters with the largest gradient errors, and where the error enters."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), NaiveSoftmax(), nn.Linear(8, 2)
    )
    with torch.no_grad():
        model[2].weight.mul_(20.0)
    batch = (torch.randn(64, 8), torch.randint(0, 2, (64,)))
    policy = PolicyMap("32-true", activations={"3": "fp8"})
    d = diagnose(model, batch, F.cross_entropy, precision=policy)
    assert d.loss_rel_error == 0 and d.grad_rel_error > 0.1 and not d.findings
    with pytest.raises(PrecisionError) as caught:
        d.recommend()
    message = str(caught.value)
    assert "builds up over many layers" not in message
    assert "every module's output agrees with the reference" in message
    assert "0.bias (0.53)" in message and "2.weight (0.41)" in message
    assert "enters the backward after 4 and before 2: in 3" in message
    assert "activation rules" in message, message


class _FullRowMask(nn.Module):  # finfo.min on row 0 (a padded query) and half of the others
    def forward(self, x):
        m = torch.zeros_like(x)
        m[..., 0, :] = torch.finfo(x.dtype).min
        m[..., 1:, : x.shape[-1] // 2] = torch.finfo(x.dtype).min
        return x + m


@pytest.mark.parametrize("rows", [6, 600])  # measured batched, and alone (over 4096 values)
@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_a_mask_overflowing_a_whole_row_is_blamed_not_the_softmax_after_it(rows, precision):
    """Found by a diff review: a float16 mask of finfo.min plus scores below -16 is -inf,
    which the fix above takes for the same mask. In a padded query's fully masked row the
    softmax then makes NaN (the reference's row is finite), and the Softmax was "broken: 8
    of 48 outputs are inf/NaN although its inputs are finite" (recommend moved the Linear
    before the mask). Inputs are finite only without the infinities a mask's fill became;
    where those make the NaN, the module that made them is named, as before."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    with torch.no_grad():
        lin.bias.fill_(-40.0)
        lin.weight.mul_(0.1)
    model = nn.Sequential(lin, _FullRowMask(), nn.Softmax(-1), nn.Linear(8, 2))
    batch = (torch.randn(rows, 8), torch.randint(0, 2, (rows,)))
    d = diagnose(model, batch, F.cross_entropy, precision=precision)
    mask, softmax = d.modules["1"], d.modules["2"]
    assert [m.display_name for m in d.findings] == ["1"]
    assert mask.verdict == BROKEN and mask.nonfinite == 8 + (rows - 1) * 4
    assert "although its inputs are finite" in mask.reason
    assert softmax.verdict == OK and softmax.nonfinite == 8
    if precision == "16-mixed":
        assert d.recommend().policy.rules == {"1": Policy("32-true")}


class _Sqrt(nn.Module):
    def forward(self, x):
        return x.sqrt()


def test_an_infinite_reference_activation_gradient_picks_a_loss_scale():
    """Found by a diff review: sqrt at ReLU's exact zeros gives the reference an inf
    activation gradient (ReLU's backward zeroes it: the parameters' are finite), and the
    default loss scale's start took log2 of the largest gradient's room: "ValueError: math
    domain error". No scale keeps inf finite: it starts at the recommended one, 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), _Sqrt(), nn.Linear(4, 2))
    batch = (torch.randn(8, 4), torch.randint(0, 2, (8,)))
    d = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
    assert (d.loss_scale, d.recommended_loss_scale) == (1, 1)
    assert math.isfinite(d.target_loss)


class _MagnifyBackward(torch.autograd.Function):  # identity; its backward is (g * k) / k
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return (g * ctx.k) / ctx.k, None


class _AmpBackward(nn.Module):
    def forward(self, x):
        return _MagnifyBackward.apply(x, 16.0)


class _OverflowInside(nn.Module):
    def forward(self, x):
        return (x * 1e6) / 1e6


def test_a_fix_a_dynamic_scaler_needs_no_more_is_not_said_to_need_a_loss_scale(tmp_path):
    """Found by a diff review: with a forward overflow no loss scale helps, so the run stays
    at 65536; recommend fixed the module that overflowed, but ran its trials at 65536
    without the halving a dynamic scaler does, where 1's backward overflows float16: "the
    fix also needs --loss-scale 16384". Trials at the default scale now choose it as the
    first run does; an explicit scale stays fixed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _AmpBackward(), _OverflowInside(), nn.Linear(8, 2))
    torch.manual_seed(5)
    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    d = diagnose(model, batch, F.cross_entropy, precision="16-mixed")
    assert d.loss_scale == 65536 and [m.display_name for m in d.findings] == ["2"]
    fix = d.recommend()
    assert fix.policy.rules == {"2": Policy("32-true")} and fix.loss_scale is None
    assert fix.verified.finite and fix.verified.loss_scale < 65536
    fixed = diagnose(model, batch, F.cross_entropy, precision="16-mixed", loss_scale=65536)
    assert fixed.recommend().loss_scale == 16384


def test_a_forward_that_rounds_is_not_said_to_make_its_error_only_in_the_backward():
    """Found by a diff review: the backward-only message took a forward within 0.1 of the
    reference for one that agrees: a 14-layer bfloat16 ReLU MLP (module errors below
    0.004, a gradient error of 0.2, both passes rounding in bfloat16) was said to make its
    error "in the backward, which no layer's forward precision changes". It is said only
    where the forward equals the reference within the reference dtype's own rounding."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(14):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(16, 2))
    batch = (torch.randn(32, 16), torch.randint(0, 2, (32,)))
    d = diagnose(model, batch, F.cross_entropy, precision="bf16-true")
    assert not d.findings and d.loss_rel_error < 0.1
    assert all(m.rel_error < 0.1 for m in d.modules.values())
    with pytest.raises(PrecisionError) as caught:
        d.recommend(tolerance=d.grad_rel_error / 2)
    message = str(caught.value)
    assert "the error builds up over many layers" in message
    assert "made in the backward" not in message
