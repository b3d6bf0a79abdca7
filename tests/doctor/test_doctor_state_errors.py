"""The doctor's measure of optimizer states (`mixprec.doctor.state_errors`): the error of the
update ``m / (sqrt(v) + eps)`` the moments read back give, which a second moment read back
as 0 makes huge, where each moment's own relative error stays tiny."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mixprec.doctor import StateError, StateErrors
from mixprec.doctor.state_errors import moment_errors, update_error
from mixprec.optim.states import StateFormat, code_map, dequantize, moment_error, quantize
from mixprec.optim.states.formats import code_tables, nearest_code

BETA2 = 0.999


def _outlier_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs whose first feature is 1000x the others: each row of a Linear's weight gets
    gradients 1000x apart, second moments 1e6 apart."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        x = torch.randn(32, 256, generator=g)
        x[:, 0] *= 1000
        batches.append((x, torch.randn(32, 64, generator=g)))
    return batches


def _adamw_moments(model: nn.Module, batches: list, steps: int = 3) -> dict:
    """The float32 AdamW state of ``model.weight`` after ``steps`` steps on ``batches``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(steps):
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return opt.state[model.weight]


def _read_back_with_zeros(v: torch.Tensor) -> torch.Tensor:
    """``v`` stored as int8 stored it before it kept roots, and read back: the nearest code
    of each element over its 256-block's largest, so an element below 1.6e-7 of it reads
    back as 0."""
    blocks = v.reshape(-1, 256)
    absmax = blocks.amax(dim=1, keepdim=True)
    tables = code_tables(StateFormat("int8"), False, torch.device("cpu"))
    codes = nearest_code(blocks / absmax, "int8", False, tables).long()
    return (code_map("int8", False)[codes] * absmax).view_as(v)


def test_second_moments_read_back_as_zero_make_the_update_error_huge_and_the_layer_hurt():
    """The outlier layer's moments through a codec that reads most of ``v`` back as 0: the
    relative error of ``v`` itself is below 1e-6 (the old measure called the layer fine),
    the update's is millions of times the threshold, and the report names the layer."""
    torch.manual_seed(0)
    state = _adamw_moments(nn.Linear(256, 64), _outlier_batches())
    m, v = state["exp_avg"], state["exp_avg_sq"]
    v_read = _read_back_with_zeros(v)
    zeroed = int(((v > 0) & (v_read == 0)).sum())
    assert zeroed > 15_000  # of 16,384
    assert float((v_read - v).norm() / v.norm()) < 1e-6
    correction = 1 - BETA2**3
    error = update_error(m, v, m, v_read, bias_correction2=correction)
    assert error > 1e6
    assert update_error(m, v, m, v, bias_correction2=correction) == 0.0

    report = StateErrors([StateError("0.weight", "int8", 0.0, 1e-7, error, zeroed)], 0.1, 3)
    assert [r.param for r in report.hurting] == ["0.weight"]
    assert report.states_rules() == {"0": "float32"}
    assert f"{zeroed} positive v read back as 0" in str(report) and "HURT" in str(report)


def test_the_update_error_weighs_every_element_alike():
    """A moment's relative error is dominated by its largest elements; the update's by
    none: one element in a thousand whose ``v`` reads back 100x too small (its update 10x
    too large) is 9 / sqrt(1000) of the update's norm, 28%, where ``v``'s own relative
    error is 1e-14."""
    m = torch.ones(1000)
    v = torch.ones(1000)
    v[0] = 1e-12  # its update: 1 / (1e-6 + eps), a thousand times the others'
    m[0] = 1e-6
    v_read = v.clone()
    v_read[0] = 1e-14  # read back 100x too small: its update 10x too large
    error = update_error(m, v, m, v_read, eps=1e-12)
    assert error == pytest.approx(9 / (1000**0.5), rel=1e-3)
    assert float((v_read - v).norm() / v.norm()) < 1e-12
    assert update_error(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3)) == 0.0
    assert update_error(torch.ones(1), torch.ones(1), torch.zeros(1), torch.ones(1)) == 1.0


@pytest.mark.parametrize("eps, correction", [(0.0, 1.0), (1e-8, 0.0), (1e-8, 1.5)])
def test_update_error_refuses_eps_and_bias_corrections_it_cannot_divide_by(eps, correction):
    one = torch.ones(2)
    with pytest.raises(ValueError, match="eps > 0 and 0 < bias_correction2 <= 1"):
        update_error(one, one, one, one, eps=eps, bias_correction2=correction)


def test_moment_errors_report_the_update_error_of_each_format_and_no_zeros():
    """``moment_errors`` measures the moments torch's AdamW holds after the same steps:
    each format's update error is ``update_error`` of those moments stored and read back,
    and no positive ``v`` of the outlier layer reads back as 0 in any format."""
    batches = _outlier_batches()
    torch.manual_seed(0)
    model = nn.Linear(256, 64)
    errors = moment_errors(model, batches, nn.functional.mse_loss, ["int8", "int4", "fp8"])
    state = _adamw_moments(model, batches)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    for fmt in ("int8", "int4", "float8"):  # ("fp8" is spelled float8)
        row = errors["weight"][fmt]
        assert (row.param, row.format, row.zeroed) == ("weight", fmt, 0)
        m_read = dequantize(*quantize(m, fmt), fmt, m.shape)
        v_read = dequantize(*quantize(v, fmt, signed=False), fmt, v.shape, signed=False)
        expected = update_error(m, v, m_read, v_read, bias_correction2=1 - BETA2**3)
        assert row.update == pytest.approx(expected, rel=1e-5)
    assert errors["weight"]["float8"].update < 0.1
    float32 = moment_errors(model, batches, nn.functional.mse_loss, ["float32"])["weight"]
    assert (float32["float32"].update, float32["float32"].zeroed) == (0.0, 0)


def test_moment_errors_are_seeded_and_leave_the_callers_generator_alone():
    """The steps run with dropout off and the generator seeded (`seed`): the errors moved
    with the caller's seed (the search's state formats with them) and the caller's
    generator was advanced."""
    from torch.nn import functional as F

    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.ReLU(), nn.Linear(64, 4))
    batch = (torch.randn(32, 16), torch.randint(0, 4, (32,)))
    results = []
    for caller in (1, 2):
        torch.manual_seed(caller)
        state = torch.get_rng_state()
        errors = moment_errors(model, [batch], F.cross_entropy, ["int4"], steps=2)
        assert torch.equal(torch.get_rng_state(), state)
        results.append({name: e["int4"].update for name, e in errors.items()})
    assert results[0] == results[1]
    assert model.training and model[1].training


class _Imaginary(nn.Module):
    """A complex weight whose loss reads only its imaginary part: gradients and moments are
    purely imaginary (their real halves 0)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(64, 64, dtype=torch.complex64))

    def forward(self, x):
        return (x.to(torch.complex64) @ self.weight).imag


def test_complex_moments_are_measured_over_both_halves():
    """``exp_avg.float()`` kept the real half only (0 here: every error read 0) and torch
    warned that casting complex values to real discards the imaginary part. Measured as
    AdamW steps them, over ``view_as_real``'s real and imaginary parts."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g))]
    model = _Imaginary()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (torch's "discards the imaginary part" included)
        row = moment_errors(model, batches, nn.functional.mse_loss, ["int8"])["weight"]["int8"]
    state = _adamw_moments(model, batches)
    m, v = torch.view_as_real(state["exp_avg"]), torch.view_as_real(state["exp_avg_sq"])
    assert not m[..., 0].any() and m[..., 1].abs().amin() > 0  # (imaginary only)
    m_read = dequantize(*quantize(m, "int8"), "int8", m.shape)
    v_read = dequantize(*quantize(v, "int8", signed=False), "int8", v.shape, signed=False)
    expected = update_error(m, v, m_read, v_read, bias_correction2=1 - BETA2**3)
    assert expected > 0 and row.update == pytest.approx(expected, rel=1e-5)
    assert row.first == pytest.approx(moment_error(m, "int8", signed=True), rel=1e-5)
