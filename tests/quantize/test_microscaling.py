"""Microscaling formats bit-exact against their definitions, on any CPU: the element
formats' values (E4M3/E5M2 against torch's float8 dtypes, FP6/FP4 enumerated by hand),
rounding (ties to even, subnormals, saturation, negative zero, stochastic), MX blocks with
E8M0 scales ('floor' per OCP MX v1.0 and 'rceil'), NVFP4's two-level scales (1x16 and 16x16
blocks), and blocks holding zeros, inf or NaN. Expected codes and values are worked out by
hand in the comments (or, for random blocks, by a reference written with Python floats and
torch's own float8 casts), never by the code under test.

torchao is not installed here (and is not a dependency), so there is no comparison against
its reference quantizers; these hand-computed blocks stand in for it.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mixprec.dtypes import default_dtype
from mixprec.formats.microscaling import MicroscalingConfig
from mixprec.quantize.block_formats import (
    E8M0_NAN,
    FORMATS,
    MXTensor,
    code_values,
    decode_elements,
    encode_elements,
    exp2_int,
    fake_quantize,
    pack_fp4,
    quantize_mx,
    quantize_nvfp4,
    round_by_definition,
    round_to_element,
    unpack_fp4,
)

nan, inf = math.nan, math.inf


def positives(values: list[float]) -> list[float]:
    return [*values, *(-v for v in values)]


# the non-negative values of each format, code 0 upwards, enumerated by hand
E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
E2M3 = [i / 8 for i in range(8)] + [b * (1 + i / 8) for b in (1, 2, 4) for i in range(8)]
E3M2 = [i / 16 for i in range(4)] + [2.0**e * (1 + i / 4) for e in range(-2, 5) for i in range(4)]


@pytest.mark.parametrize(("element", "expected"), [("e2m1", E2M1), ("e2m3", E2M3), ("e3m2", E3M2)])
def test_fp6_and_fp4_codes_hold_the_hand_enumerated_values(element, expected):
    assert code_values(element).tolist() == positives([float(v) for v in expected])
    assert FORMATS[element].max == expected[-1]


@pytest.mark.parametrize(
    ("element", "dtype"), [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)]
)
def test_fp8_codes_hold_the_values_of_torchs_float8_dtypes(element, dtype):
    torch_values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    ours = code_values(element)
    assert torch.equal(ours.isnan(), torch_values.isnan())
    assert torch.equal(ours.nan_to_num(7.0), torch_values.nan_to_num(7.0))


@pytest.mark.parametrize(
    ("element", "dtype"), [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)]
)
def test_rounding_to_fp8_matches_torchs_saturated_casts_over_all_binades(element, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * torch.exp2(
        torch.randint(-24, 20, (4096,), generator=gen).float()
    )
    top = FORMATS[element].max
    reference = x.clamp(-top, top).to(dtype)
    rounded = round_to_element(x, element)
    assert torch.equal(rounded, reference.float())
    assert torch.equal(round_by_definition(x, element), reference.float())
    assert torch.equal(encode_elements(rounded, element), reference.view(torch.uint8))


def test_rounding_ties_to_even_saturates_and_keeps_negative_zero():
    # e2m1 around its values 0, .5, 1, 1.5, 2, 3, 4, 6: each tie goes to the even mantissa
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -5.0, -0.0])
    got = round_to_element(x, "e2m1")
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -4.0, -0.0]
    assert torch.signbit(got[-1])
    assert encode_elements(got[-1:], "e2m1").tolist() == [0b1000]
    # e4m3 subnormals (ulp 2**-9): 2**-10 ties to 0, 3 * 2**-10 to 2**-8 (mantissa 2, even)
    sub = torch.tensor([2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-7 * 1.5])
    assert round_to_element(sub, "e4m3").tolist() == [2.0**-9, 0.0, 2.0**-8, 2.0**-7 * 1.5]
    assert round_by_definition(sub, "e4m3").tolist() == [2.0**-9, 0.0, 2.0**-8, 2.0**-7 * 1.5]
    assert encode_elements(round_to_element(sub, "e4m3"), "e4m3").tolist() == [1, 0, 2, 6]
    # e4m3: 464 ties between 448 and the NaN code's 480 and saturates; inf and NaN become NaN
    for rounder in (round_to_element, round_by_definition):
        out = rounder(torch.tensor([464.0, -1e6, inf, nan, -0.0]), "e4m3")
        assert out[:2].tolist() == [448.0, -448.0] and out[2:4].isnan().all()
        assert torch.signbit(out[4])


def test_stochastic_rounding_floors_value_plus_noise():
    # e2m1: 0.3 sits 0.6 of an ulp (0.5) above 0: floor(0.6 + noise) is 1 when noise >= 0.4
    x = torch.full((4,), 0.3)
    noise = torch.tensor([0.0, 0.39, 0.41, 0.99])
    assert round_to_element(x, "e2m1", noise=noise).tolist() == [0.0, 0.0, 0.5, 0.5]
    # -0.3: floor(-0.6 + noise) is 0 only when noise >= 0.6
    assert round_to_element(-x, "e2m1", noise=noise).tolist() == [-0.5, -0.5, -0.5, 0.0]
    mean = round_to_element(torch.full((20000,), 0.3), "e2m1", noise=torch.rand(20000)).mean()
    assert abs(mean.item() - 0.3) < 0.02  # unbiased (std of the mean ~0.0035)


def neighbours(v: float, element: str) -> tuple[float, float]:
    """The format's values just below and just above `v` (saturated to +-max), from the
    enumerated codes."""
    values = sorted({x for x in code_values(element).tolist() if math.isfinite(x)})
    v = min(max(v, values[0]), values[-1])
    return max(x for x in values if x <= v), min(x for x in values if x >= v)


@settings(max_examples=300, deadline=None)
@given(
    element=st.sampled_from(["e2m1", "e2m3", "e3m2", "e4m3", "e5m2"]),
    v=st.floats(-600.0, 600.0, width=32),
    noise=st.floats(0.0, 1.0, exclude_max=True, width=32),
)
@example(element="e2m1", v=2.0, noise=1 - 2**-24)  # torch.rand's largest value
@example(element="e4m3", v=-3.0, noise=1 - 2**-24)
@example(element="e2m1", v=1.25, noise=0.5)
def test_stochastic_rounding_gives_one_of_the_two_neighbours(element, v, noise):
    # floor(v / ulp + noise) in float32 rounded up to the next step for noise just under 1,
    # moving values the format holds (2.0 to 3.0 in e2m1)
    got = round_to_element(torch.tensor([v]), element, noise=torch.tensor([noise])).item()
    below, above = neighbours(v, element)
    assert got in (below, above)
    if below == above:
        assert got == v or abs(v) > FORMATS[element].max


@settings(max_examples=25, deadline=None)
@given(element=st.sampled_from(["e2m1", "e2m3", "e4m3"]), v=st.floats(-6.0, 6.0, width=32))
def test_stochastic_rounding_is_unbiased(element, v):
    n = 20000
    gen = torch.Generator().manual_seed(0)
    noise = torch.rand(n, generator=gen)
    got = round_to_element(torch.full((n,), v), element, noise=noise)
    below, above = neighbours(v, element)
    assert set(got.unique().tolist()) <= {below, above}
    # std of the mean <= (above - below) / 2 / sqrt(n); allow 5 of them
    assert abs(got.double().mean().item() - v) <= 5 * (above - below) / 2 / n**0.5 + 1e-9


@pytest.mark.parametrize("element", sorted(FORMATS))
def test_stochastic_rounding_keeps_the_sign_of_zero(element):
    """Found by a review: stochastic rounding gave +0.0 for -0.0 and for negative values
    rounded up to zero (``floor(v / ulp) + 1`` is -1.0 + 1.0, +0.0), where rounding to
    nearest and the module's casts keep the sign of zero."""
    tiny = code_values(element)[1].item()  # the format's smallest subnormal
    v = torch.tensor([-0.0, -0.2 * tiny, -0.9 * tiny, 0.0, 0.2 * tiny])
    noise = torch.tensor([0.5, 0.9, 0.95, 0.9, 0.1])
    for rounder in (round_to_element, round_by_definition):
        got = rounder(v, element, noise=noise)
        assert got.tolist() == [0.0] * 5, rounder.__name__
        assert torch.signbit(got).tolist() == [True, True, True, False, False], rounder.__name__


def test_stochastic_rounding_refuses_noise_it_cannot_use():
    x = torch.full((2,), 0.3)
    with pytest.raises(ValueError, match=r"noise values must lie in \[0, 1\)"):
        round_to_element(x, "e2m1", noise=torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match=r"noise must have the values' shape \(2,\)"):
        round_to_element(x, "e2m1", noise=torch.tensor([0.5]))
    with pytest.raises(ValueError, match="noise must be a floating tensor"):
        round_by_definition(x, "e4m3", noise=torch.tensor([0, 0]))


def test_exp2_int_is_exact_over_the_float32_range():
    e = torch.arange(-149, 128)
    assert exp2_int(e).tolist() == [2.0**k for k in range(-149, 128)]


def mx_hand(x, element, block, rounding):
    return quantize_mx(torch.tensor(x), element, block, rounding)


def test_mxfp8_block_whose_amax_is_past_the_max_saturates_under_floor_not_rceil():
    # amax 480 = 1.875 * 2**8: floor gives e = 8 - 8 = 0 (X = 1), and 480 saturates to 448;
    # rceil gives e = 1 (480 > 448 * 2**0), X = 2: 240, 0.5, -0, 1.5 are all exact
    x = [480.0, 1.0, -0.0, 3.0]
    floor = mx_hand(x, "e4m3", 4, "floor")
    assert floor.scales.tolist() == [127]
    assert floor.codes.tolist() == [0x7E, 0x38, 0x80, 0x44]  # 448, 1, -0, 3
    assert floor.dequantize().tolist() == [448.0, 1.0, -0.0, 3.0]
    rceil = mx_hand(x, "e4m3", 4, "rceil")
    assert rceil.scales.tolist() == [128]
    assert rceil.codes.tolist() == [0x77, 0x30, 0x80, 0x3C]  # 240, 0.5, -0, 1.5
    assert rceil.dequantize().tolist() == [480.0, 1.0, -0.0, 3.0]
    assert torch.signbit(rceil.dequantize()[2])


def test_mxfp8_block_whose_amax_is_a_power_of_two_scales_alike_under_both_roundings():
    # amax 8 = 2**3: e = 3 - 8 = -5 both ways (8 * 2**5 = 256 <= 448); 0.01 * 32 = 0.32
    # lies in [0.25, 0.5) where the ulp is 2**-5: 10.24 ulps -> 10 -> 0.3125
    for rounding in ("floor", "rceil"):
        q = mx_hand([8.0, 0.01, -2.0, 0.5], "e4m3", 4, rounding)
        assert q.scales.tolist() == [127 - 5]
        assert q.dequantize().tolist() == [8.0, 0.3125 / 32, -2.0, 0.5]


def test_mxfp8_subnormal_elements():
    # amax 1: e = -8, X = 2**-8. 3 * 2**-16 -> 3 * 2**-8 = 6 e4m3 subnormal ulps (code 6);
    # 2**-18 -> half an ulp: ties to 0; 3 * 2**-18 -> 1.5 ulps: ties to 2 (code 2)
    q = mx_hand([1.0, 3 * 2.0**-16, 2.0**-18, 3 * 2.0**-18], "e4m3", 4, "floor")
    assert q.scales.tolist() == [119]
    assert q.codes.tolist() == [0x78, 0x06, 0x00, 0x02]
    assert q.dequantize().tolist() == [1.0, 3 * 2.0**-16, 0.0, 2.0**-16]


def test_all_zero_inf_and_nan_blocks():
    x = [0.0] * 4 + [1.0, inf, 2.0, 3.0] + [nan, 1.0, 1.0, 1.0] + [4.0, 2.0, 1.0, 0.5]
    q = mx_hand(x, "e4m3", 4, "rceil")
    # the zero block takes the smallest scale 2**-127 (code 0); inf and NaN blocks the E8M0
    # NaN code with zero element codes; the last block is untouched (amax 4: e = -6)
    assert q.scales.tolist() == [0, E8M0_NAN, E8M0_NAN, 121]
    assert q.codes[4:12].tolist() == [0] * 8
    out = q.dequantize()
    assert out[:4].tolist() == [0.0] * 4
    assert out[4:12].isnan().all()
    assert out[12:].tolist() == [4.0, 2.0, 1.0, 0.5]


def test_mxfp4_block_floor_and_rceil_with_packed_codes():
    # amax 6.5: floor e = 2 - 2 = 0 (X = 1): 6.5 saturates to 6, 0.3 -> 0.5 (0.6 ulp)
    # rceil: 6.5 > 6, so e = 1 (X = 2): 3.25 -> 3, 0.5, 0.15 -> 0 (0.3 ulp), -1
    x = [6.5, 1.0, 0.3, -2.0]
    floor = mx_hand(x, "e2m1", 4, "floor")
    assert floor.codes.tolist() == [0b0111, 0b0010, 0b0001, 0b1100]
    assert floor.dequantize().tolist() == [6.0, 1.0, 0.5, -2.0]
    assert pack_fp4(floor.codes).tolist() == [0x27, 0xC1]
    assert torch.equal(unpack_fp4(pack_fp4(floor.codes)), floor.codes)
    rceil = mx_hand(x, "e2m1", 4, "rceil")
    assert rceil.scales.tolist() == [128]
    assert rceil.codes.tolist() == [0b0101, 0b0001, 0b0000, 0b1010]
    assert rceil.dequantize().tolist() == [6.0, 1.0, 0.0, -2.0]


def test_mxfp6_blocks_in_both_element_formats():
    x = [10.0, 0.1, -3.3, 0.0]
    # e2m3 (emax 2): e = 3 - 2 = 1, X = 2: 5 -> 5, 0.05 -> 0 (0.4 of the 1/8 ulp),
    # -1.65 -> -13/8 = -1.625
    assert mx_hand(x, "e2m3", 4, "floor").dequantize().tolist() == [10.0, 0.0, -3.25, 0.0]
    # e3m2 (emax 4): e = 3 - 4 = -1, X = 1/2: 20 -> 20, 0.2 -> 3/16 (subnormal ulp 1/16),
    # -6.6 -> -7
    q = mx_hand(x, "e3m2", 4, "floor")
    assert q.scales.tolist() == [126]
    assert q.dequantize().tolist() == [10.0, 0.09375, -3.5, 0.0]


def reference_mx(x: torch.Tensor, element: str, block: int, rounding: str) -> torch.Tensor:
    """Python floats for the scale, torch's float8 cast for the elements."""
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[element]
    top = torch.finfo(dtype).max
    emax = {"e4m3": 8, "e5m2": 15}[element]
    out = []
    for row in x.reshape(-1, block).tolist():
        amax = max(abs(v) for v in row)
        e = math.frexp(amax)[1] - 1 - emax
        if rounding == "rceil" and amax > top * 2.0**e:
            e += 1
        e = max(e, -127)
        scaled = torch.tensor([v / 2.0**e for v in row]).clamp(-top, top)
        out.append(scaled.to(dtype).float() * 2.0**e)
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_random_mxfp8_blocks_match_a_reference_from_python_floats(element, rounding):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=gen) * torch.exp2(
        torch.randint(-30, 30, (8, 1), generator=gen).float()
    )
    config = MicroscalingConfig("mxfp8", element, rounding)
    expected = reference_mx(x, element, 32, rounding)
    assert torch.equal(quantize_mx(x, element, 32, rounding).dequantize(), expected)
    assert torch.equal(fake_quantize(x, config), expected)


def test_nvfp4_two_level_scales_of_a_hand_computed_tensor():
    # tensor amax 10.5: s_enc = 2688 / 10.5 = 256, s_dec = 2**-8.
    # block 0, amax 10.5: 10.5 / 6 * 256 = 448 (E4M3 0x7E); elements / 1.75:
    #   6 (code 7), -3 (code 0b1101), 1 / 1.75 = 0.57 -> 0.5, 0.3 / 1.75 = 0.17 -> 0
    # block 1, amax 0.7: 0.7 / 6 * 256 = 29.87 -> E4M3 30 (1.875 * 2**4: code 0x5F);
    #   elements * 256 / 30: 0.7 -> 5.97 -> 6, 0.07 -> 0.597 -> 0.5
    x = torch.zeros(32)
    x[:4] = torch.tensor([10.5, -5.25, 1.0, 0.3])
    x[16:18] = torch.tensor([0.7, 0.07])
    q = quantize_nvfp4(x)
    assert q.tensor_scale.item() == 2.0**-8
    assert q.block_scales.tolist() == [0x7E, 0x5F]
    assert q.codes[:4].tolist() == [0b0111, 0b1101, 0b0001, 0b0000]
    assert q.codes[16:18].tolist() == [0b0111, 0b0001]
    expected = torch.zeros(32)
    expected[:4] = torch.tensor([10.5, -5.25, 0.875, 0.0])
    expected[16:18] = torch.tensor([6 * 30 / 256, 0.5 * 30 / 256])
    assert torch.equal(q.dequantize(), expected)
    assert torch.equal(fake_quantize(x, MicroscalingConfig("nvfp4")), expected)


def test_nvfp4_16x16_tiles_share_one_scale_where_rows_would_not():
    # the same values as above in a 16x32 matrix: tile (0, 0) holds 10.5 at (0, 0) and 1.0
    # at (15, 15), so 1.0 is quantized with the tile's scale 448: 0.5 * 1.75 = 0.875.
    # In a 1x16 block of its own row, 1.0 gets 1 / 6 * 256 = 42.7 -> E4M3 44 and
    # 1 * 256 / 44 = 5.8 -> 6: 6 * 44 / 256 = 1.03125.
    x = torch.zeros(16, 32)
    x[0, 0], x[15, 15], x[0, 16] = 10.5, 1.0, 0.7
    two_d = quantize_nvfp4(x, two_d=True)
    assert two_d.block_scales.tolist() == [[0x7E, 0x5F]]
    out = two_d.dequantize()
    assert (out[0, 0].item(), out[15, 15].item(), out[0, 16].item()) == (10.5, 0.875, 0.703125)
    assert quantize_nvfp4(x).dequantize()[15, 15].item() == 1.03125


def test_nvfp4_zero_tensor_and_non_finite_blocks():
    zero = quantize_nvfp4(torch.zeros(16))
    assert zero.tensor_scale.item() == 1.0 and zero.block_scales.tolist() == [0]
    assert zero.dequantize().tolist() == [0.0] * 16
    # an inf block takes the E4M3 NaN scale; the finite block is scaled from the finite amax
    x = torch.zeros(32)
    x[0], x[16] = inf, 10.5
    q = quantize_nvfp4(x)
    assert q.tensor_scale.item() == 2.0**-8
    assert q.block_scales.tolist() == [0x7F, 0x7E]
    out = q.dequantize()
    assert out[:16].isnan().all() and out[16].item() == 10.5


def test_nvfp4_tensor_scale_is_one_float32_division():
    """s_enc = 6 * 448 / amax in one correctly rounded float32 division, as the format
    defines it (it was the reciprocal of amax times 2688, a float32 ulp off for a quarter of
    amaxes: a lone 7.0 came back 6.9999995, float32's largest value as -inf)."""
    gen = torch.Generator().manual_seed(0)
    amaxes = torch.exp(torch.empty(200).uniform_(-80, 80, generator=gen))
    for amax in amaxes.tolist():
        x = torch.zeros(16)
        x[3] = amax
        expected = torch.tensor(1.0) / torch.tensor(2688.0 / amax, dtype=torch.float32)
        assert quantize_nvfp4(x).tensor_scale.item() == expected.item(), amax
    x = torch.zeros(16)
    x[0] = 7.0
    assert fake_quantize(x, MicroscalingConfig("nvfp4"))[0].item() == 7.0
    x[0] = -torch.finfo(torch.float32).max
    assert fake_quantize(x, MicroscalingConfig("nvfp4"))[0].item() == x[0].item()


@pytest.mark.parametrize("amax", [1e-30, 1e-35, 1e-37, 1e-38, 1e-39, 1e-40])
@pytest.mark.parametrize("two_d", [False, True])
def test_nvfp4_of_a_tiny_tensor_is_the_tensor_scaled_up_then_down(amax, two_d):
    """Found by a review: below an amax of about 1e-38, s_enc and the blocks' encode factors
    overflowed float32 and were clamped apart, so elements encoded with one factor decoded
    with another: 50-100% off, or all zeros. NVFP4's codes do not depend on the tensor's
    scale, so a tiny tensor decodes as the same tensor scaled up by an exact power of two
    does, scaled back (within float32's subnormal grid, where the values lie)."""
    torch.manual_seed(0)
    base = torch.randn(32, 32)
    x = base / base.abs().max() * amax
    config = MicroscalingConfig("nvfp4")
    got = fake_quantize(x, config, two_d=two_d).double()
    ref = fake_quantize(x * 2.0**100, config, two_d=two_d).double() * 2.0**-100
    assert (got - ref).abs().max() <= 0.02 * amax
    # (E2M1's largest half step is 1/6 of a block's largest value, its scale rounded in e4m3)
    assert (got - x.double()).abs().max() <= 0.25 * amax
    packed = quantize_nvfp4(x, two_d=two_d).dequantize().double()
    assert (packed - ref).abs().max() <= 0.02 * amax


@pytest.mark.parametrize(
    "value", [1e-40, 2.0**-149, -3e-39, 1e-38, 1e-37, 0.0, -0.0], ids=lambda v: f"{v:g}"
)
def test_nvfp4_of_a_tiny_tensor_is_finite(value):
    # amax 1e-40: s_enc clamps to float32's max, s_dec = 2.9e-39 and the encode factor
    # 1 / (scale_b * s_dec) overflowed to inf: elements inf, then NaN (quantize_nvfp4
    # refused to encode the NaN in e2m1)
    x = torch.full((16, 32), value)
    x[1::2] = 0.0
    config = MicroscalingConfig("nvfp4")
    outs = [
        fake_quantize(x, config),
        fake_quantize(x, config, two_d=True),
        fake_quantize(x, config, stochastic=True),
        quantize_nvfp4(x).dequantize(),
        quantize_nvfp4(x, two_d=True).dequantize(),
    ]
    for out in outs:
        assert torch.isfinite(out).all()
        assert (out[1::2] == 0).all()  # zeros stay zeros
        # each value comes back as one of the same sign, at most its own size in error
        assert ((out - x).abs() <= x.abs()).all()
        assert not (torch.sign(out) * torch.sign(x) < 0).any()


@pytest.mark.parametrize("element", sorted(FORMATS))
def test_every_code_encodes_back_to_itself(element):
    # each code's value (e5m2's +-inf included) encodes to that code; NaNs to the NaN code
    codes = torch.arange(2 ** FORMATS[element].bits)
    values = code_values(element)
    held = ~values.isnan()
    assert torch.equal(encode_elements(values[held], element), codes[held].to(torch.uint8))


@pytest.mark.parametrize(
    ("element", "value", "message"),
    [
        ("e4m3", inf, "e4m3 has no inf code"),
        ("e2m1", -inf, "e2m1 has no inf code"),
        # these were encoded as codes of other values: 6, 0, 448, -2**-12 and 0
        ("e2m1", 7.0, "not e2m1 values \\(first 7.0; e2m1 holds values on its grid up to \\+-6\\)"),
        ("e2m1", 0.3, "not e2m1 values"),
        ("e4m3", 464.0, "not e4m3 values"),
        ("e5m2", 1e6, "not e5m2 values"),
        ("e3m2", 2.0**-5, "not e3m2 values"),  # under the smallest subnormal, 2**-4
    ],
)
def test_encoding_refuses_values_the_format_does_not_hold(element, value, message):
    with pytest.raises(ValueError, match=message):
        encode_elements(torch.tensor([1.0, value]), element)


@pytest.mark.parametrize("size", [0, -32, 1, 32.0, True, "32"], ids=repr)
def test_block_sizes_that_are_not_ints_of_at_least_2_are_refused(size):
    # quantize_mx raised ZeroDivisionError (0), a reshape error (-32), TypeError (32.0,
    # '32'), and took True and 1 as blocks of one element
    message = r"block size must be an int >= 2 \(32 by the spec; the last dim must be a multiple"
    with pytest.raises(ValueError, match=message):
        quantize_mx(torch.ones(4, 64), "e4m3", size)
    with pytest.raises(ValueError, match=message):
        MicroscalingConfig("mxfp8", block_size=size)
    q = quantize_mx(torch.ones(4, 64))
    with pytest.raises(ValueError, match=message):
        MXTensor(q.codes, q.scales, "e4m3", size)
    with pytest.raises(ValueError, match="last dim that is a multiple of the block size 3"):
        quantize_mx(torch.ones(4, 64), "e4m3", 3)


def test_zeros_keep_their_sign_in_every_format():
    # NVFP4 gave +0.0 for the -0.0s of a block whose scale is 0 (an all-zero block, or one
    # far below the tensor's amax); the MX formats kept them
    x = torch.zeros(2, 32)
    x[0, ::2] = -0.0
    x[1, :16] = torch.tensor([1e-30, -1e-30] * 8)  # scale 0 beside the amax 1e10
    x[1, 16], x[1, 17] = 1e10, -0.0
    signs = torch.signbit(x)
    nvfp4 = MicroscalingConfig("nvfp4")
    outs = {
        "nvfp4": fake_quantize(x, nvfp4),
        "nvfp4 codes": quantize_nvfp4(x).dequantize(),
        "nvfp4 2d": fake_quantize(x.repeat(8, 1), nvfp4, two_d=True)[:2],
        "nvfp4 2d codes": quantize_nvfp4(x.repeat(8, 1), two_d=True).dequantize()[:2],
        "mxfp8": quantize_mx(x).dequantize(),
        "mxfp4": fake_quantize(x, MicroscalingConfig("mxfp4")),
    }
    for name, out in outs.items():
        assert torch.equal(torch.signbit(out), signs), name
        assert (out[0] == 0).all() and (out[1, :16] == 0).all(), name


def test_quantizers_refuse_complex_tensors_and_configs_that_are_not_configs():
    # x.float() kept the real part of a complex tensor, warning only; a str config
    # failed with AttributeError
    z = torch.ones(32, dtype=torch.complex64)
    with pytest.raises(TypeError, match="quantize_mx takes a real tensor"):
        quantize_mx(z)
    with pytest.raises(TypeError, match="quantize_nvfp4 takes a real tensor"):
        quantize_nvfp4(z)
    with pytest.raises(TypeError, match="got a torch.complex64 tensor"):
        fake_quantize(z, MicroscalingConfig("mxfp8"))
    with pytest.raises(TypeError, match="fake_quantize takes a MicroscalingConfig"):
        fake_quantize(torch.ones(32), "mxfp8")
    # integers are real: 0..16 are e4m3 values under the block's scale of 1 (amax 31)
    out = fake_quantize(torch.arange(32), MicroscalingConfig("mxfp8"))
    assert torch.equal(out[:17], torch.arange(17.0))


def test_codes_outside_the_format_are_refused_not_looked_up_or_masked():
    # a negative code indexed from the end (-1 as e2m1's code 15, -6.0), a float code was
    # truncated, pack_fp4 kept the low nibble of 8-bit codes, unpack_fp4 shifted int8 bytes
    # arithmetically
    with pytest.raises(ValueError, match=r"decode_elements \(e2m1\): codes must lie in \[0, 16\)"):
        decode_elements(torch.tensor([-1], dtype=torch.int8), "e2m1")
    with pytest.raises(ValueError, match="codes must lie in \\[0, 16\\).*got 3..200"):
        decode_elements(torch.tensor([3, 200], dtype=torch.uint8), "e2m1")
    with pytest.raises(ValueError, match="takes an integer tensor of codes"):
        decode_elements(torch.tensor([1.7]), "e4m3")
    with pytest.raises(ValueError, match="pack_fp4: codes must lie in \\[0, 16\\)"):
        pack_fp4(torch.tensor([0x7E, 1], dtype=torch.uint8))
    with pytest.raises(ValueError, match="unpack_fp4 takes the uint8 bytes"):
        unpack_fp4(torch.tensor([-1], dtype=torch.int8))
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)
    assert decode_elements(torch.tensor([255], dtype=torch.uint8), "e4m3").isnan().all()


def test_encoding_refuses_nan_where_the_format_has_no_nan_and_odd_shapes():
    with pytest.raises(ValueError, match="e2m1 has no NaN code"):
        encode_elements(torch.tensor([nan]), "e2m1")
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        quantize_mx(torch.zeros(3, 40))
    with pytest.raises(ValueError, match="unknown element format 'e4m4'"):
        quantize_mx(torch.zeros(32), "e4m4")
    with pytest.raises(ValueError, match="unknown scale rounding 'ceil'"):
        quantize_mx(torch.zeros(32), rounding="ceil")
    assert decode_elements(torch.tensor([0x7F], dtype=torch.uint8), "e4m3").isnan().all()
    with pytest.raises(ValueError, match="not mxfp8's"):
        fake_quantize(torch.zeros(32), MicroscalingConfig("mxfp8"), stochastic=True)


@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
def test_a_block_near_float32s_largest_decodes_finite_under_rceil(element):
    """rceil picks the exponent under which the block's largest fits the element's range;
    near float32's largest (3.4e38) the element rounds up (e4m3: 255.8 to 256) and 256 *
    2^120 is 2^128, past float32: finite values decoded to inf. Saturated to float32's
    largest."""
    x = torch.full((1, 32), 3.4e38)
    x[0, 1] = -3.4e38
    top = torch.finfo(torch.float32).max
    kind = "mxfp4" if element == "e2m1" else "mxfp8"
    config = MicroscalingConfig(kind, element, "rceil")
    for out in (quantize_mx(x, element).dequantize(), fake_quantize(x, config)):
        assert torch.isfinite(out).all()
        assert out[0, 0] == top and out[0, 1] == -top


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float16, torch.float64])
def test_nvfp4_stochastic_rounding_draws_float32_noise_whatever_the_default_dtype(default):
    """Found by a review: the noise was ``torch.rand(x.shape)`` in torch's default dtype,
    which mixprec sets to the compute dtype in a "true" policy's forward and backward:
    bfloat16 noise (8 bits) never rounds up a value less than 1/256 of a step above a grid
    point, so the mean was biased (4.006 came out 4.0). Float32 noise under any default:
    the same draws, and the same rounding, as under float32 from one seed."""
    config = MicroscalingConfig.parse("nvfp4", "sr")
    x = torch.full((1024, 16), 4.0 + 2.0**-8)  # 1/512 of a step (2 here) above 4
    x[:, 0] = 6.0  # each block's largest: block and tensor scales put it on e2m1's 6
    torch.manual_seed(1)
    want = fake_quantize(x, config, stochastic=True)
    with default_dtype(default):
        torch.manual_seed(1)
        got = fake_quantize(x, config, stochastic=True)
    assert torch.equal(got, want)
    # (4 and 6 times the tensor scale's float32 rounding: a hair off 4 and 6)
    ups = int((got[:, 1:] > 5).sum())  # 15360 / 512 = 30 expected
    assert 10 <= ups <= 60


@pytest.mark.parametrize("default", [torch.float16, torch.bfloat16, torch.float64])
def test_nvfp4_is_computed_in_float32_whatever_the_default_dtype(default):
    """Found by a review: the 2^64 factor that scales a tiny tensor up was
    ``torch.where(cond, 2.0**64, 1.0)``, in torch's default dtype (mixprec sets it in a
    "true" policy's forward and backward): float16 made it inf, and a tensor of amax below
    2^-64 quantized to all NaN; float64 made amax, s_enc and s_dec float64 (a float64
    tensor scale, most values a step off). Float32, as documented, under any default."""
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    config = MicroscalingConfig("nvfp4")
    tensors = [x, x * 1e-21, x * 1e-40]
    want = [fake_quantize(t, config) for t in tensors]
    want_packed = [quantize_nvfp4(t, two_d=True) for t in tensors]
    with default_dtype(default):
        got = [fake_quantize(t, config) for t in tensors]
        got_packed = [quantize_nvfp4(t, two_d=True) for t in tensors]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and torch.isfinite(g).all() and torch.equal(g, w)
    for g, w in zip(got_packed, want_packed, strict=True):
        assert g.tensor_scale.dtype == torch.float32
        assert torch.equal(g.tensor_scale, w.tensor_scale)
        assert torch.equal(g.codes, w.codes) and torch.equal(g.block_scales, w.block_scales)
