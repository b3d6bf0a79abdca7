"""What the low-bit codes of a second moment may never do: decode a positive ``v`` as 0 (the
update ``m / (sqrt(v) + eps)`` becomes ``m / eps``) or far below itself. int8 keeps ``v``'s
square root, a positive root never coded 0; int4's map has no zero; fp8 keeps the root, the
smallest root as e4m3's smallest subnormal; and every format decodes a positive code to at
least float32's smallest normal number. States saved when int8 kept ``v`` itself decode as
they did."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec.optim.states import LowBitAdamW, StateFormat, code_map, dequantize, quantize
from mixprec.optim.states.formats import code_tables, nearest_code

CPU = torch.device("cpu")
TINY = torch.finfo(torch.float32).tiny  # the least a positive second moment decodes to


def _old_int8_second_moment(v: torch.Tensor, block: int = 256) -> tuple[torch.Tensor, ...]:
    """(codes, scales) of ``v`` as int8 stored it before it kept roots: the nearest code of
    each element over its block's largest value, a positive value below half the smallest
    positive code coded 0."""
    blocks = v.reshape(-1, block)
    absmax = blocks.amax(dim=1)
    tables = code_tables(StateFormat("int8", block), False, CPU)
    codes = nearest_code(blocks / absmax[:, None], "int8", False, tables)
    return codes.to(torch.uint8).reshape(-1), absmax


def _outlier_gradient() -> torch.Tensor:
    g = torch.full((4096,), 1e-4)
    g[::256] = 1.0
    return g


# -- the reproductions -----------------------------------------------------------------


def test_int8_adamw_does_not_step_m_over_eps_on_an_element_2500x_below_its_block():
    """One element in 256 takes gradient 1, the rest 1e-4 for 20 steps, then 0: the old
    int8 map decoded their ``v`` (1e-8 of the block's largest) as 0, so their next steps
    were ``m / eps`` (the weights reached 159). Now they follow torch's AdamW."""
    grads = [
        _outlier_gradient() if i < 20 else (_outlier_gradient() >= 1).float() for i in range(40)
    ]
    ours, ref = nn.Parameter(torch.zeros(4096)), nn.Parameter(torch.zeros(4096))
    opt = mixprec.AdamW8bit([ours], lr=1e-3, weight_decay=0, compile=False)
    torch_opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0)
    for grad in grads:
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        torch_opt.step()
        decoded = opt.to_float32_state_dict()["state"][0]["exp_avg_sq"]
        assert bool((decoded[torch_opt.state[ref]["exp_avg_sq"] > 0] > 0).all())
    moved, wanted = float(ours[1:256].detach().abs().max()), float(ref[1:256].detach().abs().max())
    assert wanted == pytest.approx(0.0286, abs=1e-3)
    assert moved < 0.1 and moved < 2 * wanted
    torch.testing.assert_close(ours[::256].detach(), ref[::256].detach(), rtol=1e-5, atol=0)


def test_int8_adamw_fits_a_teacher_with_one_outlier_input_feature_as_torch_does():
    """A Linear(256, 64) whose first input feature is 1000x the others ("massive
    activations"): each row's weights get gradients 1000x apart. The old int8 codes turned
    most of their steps into ``m / eps`` (final loss in the millions); now the loss ends
    within 1.5x of torch AdamW's."""

    def final_loss(make) -> float:
        torch.manual_seed(0)
        teacher, student = nn.Linear(256, 64), nn.Linear(256, 64)
        x = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
        x[:, 0] *= 1000
        with torch.no_grad():
            y = teacher(x)
        opt = make(student.parameters())
        for _ in range(100):
            loss = nn.functional.mse_loss(student(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return float(loss.detach())

    ref = final_loss(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0))
    ours = final_loss(lambda ps: mixprec.AdamW8bit(ps, lr=1e-2, weight_decay=0, compile=False))
    assert ref < 0.2  # it learned: from about 2e3
    assert ours < 1.5 * ref


# -- every format on adversarial blocks ----------------------------------------------------------


def _adversarial(kind: str, rows: int, block: int, seed: int) -> torch.Tensor:
    """Second moments (rows, block) of one kind: ``"outlier"`` (one element 1e30 times the
    rest), ``"span"`` (log-uniform over 1e-30 .. 1e30), ``"subnormal"`` (float32 subnormals,
    the smallest among them), ``"tiny"`` (a block whose largest is 1e-36 and the rest spread
    over the 60 decades below down to subnormals)."""
    g = torch.Generator().manual_seed(seed)
    exponents = torch.rand(rows, block, generator=g)
    if kind == "outlier":
        v = torch.full((rows, block), 1e-15) * (1 + exponents)
        v[:, 0] = 1e15
    elif kind == "span":
        v = torch.pow(10.0, 60 * exponents - 30)
    elif kind == "subnormal":
        v = TINY * exponents
        v[:, -1] = 2.0**-149
    else:
        v = torch.pow(10.0, -36 - 10 * exponents)
        v[:, 0] = 1e-36
    return v


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(["int8", "int4", "fp8"]),
    block=st.sampled_from([2, 64, 128, 256]),
    kind=st.sampled_from(["outlier", "span", "subnormal", "tiny"]),
    seed=st.integers(0, 2**16),
)
def test_no_positive_second_moment_decodes_as_zero_or_far_below_itself(fmt, block, kind, seed):
    """In every low-bit format and block size: a positive ``v`` decodes positive and to at
    least a quarter of itself (so the update ``m / sqrt(v)`` of an element whose gradient
    stopped grows at most 2x over float32's); a zero stays zero where the map has one."""
    fmt = StateFormat(fmt, block)
    v = _adversarial(kind, 3, block, seed)
    v[1, 1] = 0.0
    back = dequantize(*quantize(v, fmt, signed=False), fmt, v.shape, signed=False)
    positive = v > 0
    assert bool((back[positive] > 0).all())
    assert bool((back[positive] >= v[positive] / 4).all())
    if fmt.kind != "int4":  # int4's map has no zero: 1/16 .. 1
        assert float(back[1, 1]) == 0.0
    m, eps = v.sqrt(), 1e-8
    assert float((m / (back.sqrt() + eps)).max()) <= 2.0


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_the_smallest_subnormal_beside_a_tiny_largest_value_decodes_positive(fmt):
    """Blocks of two: float32's smallest subnormal 2^-149 beside a largest value from 1e-45
    to 1e-20. Its root decoded and squared can round below half that subnormal (92 such
    blocks of 5000 for int8, 10 for fp8), so a positive code decodes to at least float32's
    smallest normal number, 1.2e-38 (a ``v`` whose root, 1e-19, is far below ``eps``)."""
    fmt = StateFormat(fmt, 2)
    v = torch.stack([torch.logspace(-45, -20, 5000), torch.full((5000,), 2.0**-149)], dim=1)
    back = dequantize(*quantize(v, fmt, signed=False), fmt, v.shape, signed=False)
    assert bool((back[:, 1] >= v[:, 1]).all())
    assert float(back[:, 1].min()) == TINY


def test_int8_keeps_roots_and_codes_a_positive_root_below_its_smallest_code_as_that_code():
    """A block [1, 1e-20, 0, 0.25]: the roots [1, 1e-10, 0, 0.5]; 1e-10 is below half the
    map's smallest positive value (3.25e-7) yet takes its code, not 0. The scale is the
    largest root, negated: it marks codes of roots."""
    v = torch.tensor([1.0, 1e-20, 0.0, 0.25])
    codes, scales = quantize(v, StateFormat("int8", 4), signed=False)
    table = code_map("int8", False)
    assert codes.tolist()[:3] == [255, 1, 0] and float(table[int(codes[3])]) == pytest.approx(
        0.5, 1e-2
    )
    assert scales.tolist() == [-1.0]
    back = dequantize(codes, scales, StateFormat("int8", 4), (4,), signed=False)
    assert back[:3].tolist() == [1.0, float(table[1] * table[1]), 0.0]
    # a block of zeros: scale -0.0, decodes as zeros
    codes, scales = quantize(torch.zeros(4), StateFormat("int8", 4), signed=False)
    assert codes.tolist() == [0] * 4 and math.copysign(1, float(scales)) == -1
    assert dequantize(codes, scales, "int8/block=4", (4,), signed=False).tolist() == [0.0] * 4


def test_int4_keeps_roots_so_a_small_second_moment_is_not_lifted_to_a_sixteenth():
    """int4 stored ``v`` itself on its linear map 1/16 .. 1: every ``v`` under 1/32 of its
    block's largest decoded as 1/16 of it (a ``v`` at 1/100: 6.25x itself), and AdamW's
    summed update fell to 0.67 of float32 states' on ordinary gradients. It stores roots now
    (the scale the largest root, negated): the floor lifts a ``v`` under 1/1024 only, and a
    ``v`` at 1/100 decodes within 1.6x of itself."""
    fmt = StateFormat("int4", 8)
    v = torch.tensor([1.0, 0.01, 0.002, 0.25, 0.5, 1e-6, 0.0, 0.04])
    codes, scales = quantize(v, fmt, signed=False)
    assert scales.tolist() == [-1.0]
    back = dequantize(codes, scales, fmt, (8,), signed=False)
    ratio = back / v
    assert float(ratio[1]) < 1.6 and float(ratio[2]) < 2.0 and float(ratio[7]) < 1.6
    assert back[0] == 1.0 and back[3] == 0.25
    # under 1/1024 of the largest (0 too: the map has no zero): the floor, a sixteenth root
    assert back[5] == back[6] == 1 / 256

    g = torch.Generator().manual_seed(0)
    mean = torch.randn(1024, generator=g)
    ref, low = nn.Parameter(torch.zeros(1024)), nn.Parameter(torch.zeros(1024))
    torchs = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.0)
    ours = LowBitAdamW([low], lr=1e-3, weight_decay=0.0, states="int4", min_size=0)
    for _ in range(30):
        grad = mean + 0.5 * mean.abs() * torch.randn(1024, generator=g)
        ref.grad, low.grad = grad.clone(), grad.clone()
        torchs.step()
        ours.step()
    assert float(low.detach().abs().sum() / ref.detach().abs().sum()) > 0.8


@pytest.mark.parametrize("kind", ["int8", "int4", "float8"])
def test_quantize_refuses_a_negative_value_for_the_second_moments_map(kind):
    """``signed=False`` takes values >= 0: a negative one went through a square root to NaN
    and a NaN cast to a code (int4 decoded it as 1/256 of the block's largest, int8 as 1)."""
    with pytest.raises(ValueError, match=r"signed=False\) stores values >= 0.*got -1"):
        quantize(torch.tensor([-1.0, 2.0, 0.5]), kind, signed=False)
    codes, scales = quantize(torch.tensor([1.0, 2.0, 0.5, math.nan]), kind, signed=False)
    assert dequantize(codes, scales, kind, (4,), signed=False).isnan().all()  # (NaN: as before)


# -- states saved when int8 kept v itself ----------------------------------------------------


def test_int8_states_saved_before_roots_decode_as_they_did_and_step_on_as_roots():
    """A block with a positive scale holds codes of ``v`` itself (how int8 states were saved
    before): it decodes to the code's value times the scale, exactly as then; the next step
    stores the block as roots (a negative scale), its moment tracking torch's."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(64, 96, generator=g)
    grads = [torch.randn(64, 96, generator=g) for _ in range(4)]
    ref = nn.Parameter(start.clone())
    torch_opt = torch.optim.AdamW([ref], lr=1e-2)
    for grad in grads[:3]:
        ref.grad = grad.clone()
        torch_opt.step()
    ours = nn.Parameter(ref.detach().clone())
    saved = LowBitAdamW([ours], lr=1e-2, states="int8", min_size=0, compile=False)
    saved.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    old = saved.state_dict()
    v = torch_opt.state[ref]["exp_avg_sq"]
    codes, scales = _old_int8_second_moment(v)
    old["state"][0]["exp_avg_sq_codes"], old["state"][0]["exp_avg_sq_scales"] = codes, scales

    loaded = LowBitAdamW([ours], lr=1e-2, states="int8", min_size=0, compile=False)
    loaded.load_state_dict(old)
    decoded = loaded.to_float32_state_dict()["state"][0]["exp_avg_sq"]
    as_then = (code_map("int8", False)[codes.long()].view(-1, 256) * scales[:, None]).view(64, 96)
    assert torch.equal(decoded, as_then)
    assert float((decoded - v).norm() / v.norm()) < 0.01

    ours.grad, ref.grad = grads[3].clone(), grads[3].clone()
    loaded.step()
    torch_opt.step()
    assert bool((loaded.state[ours]["exp_avg_sq_scales"] < 0).all())
    stepped = loaded.to_float32_state_dict()["state"][0]["exp_avg_sq"]
    true = torch_opt.state[ref]["exp_avg_sq"]
    assert float((stepped - true).norm() / true.norm()) < 0.01
    assert float((ours - ref).detach().abs().max()) < 1e-3


@pytest.mark.parametrize(
    "kind, signed", [("int8", True), ("int4", True), ("int4", False), ("float8", True)]
)
def test_a_block_of_subnormal_values_is_coded_as_a_normal_one(kind, signed):
    """A block is divided by its scale as a multiply by the scale's reciprocal, which would
    be infinite for a scale below about 2^-128: such a block is scaled up first (exactly).
    A block of subnormal values takes the codes of the same block 2^140 times larger (float8,
    whose scale is itself subnormal: the values back within e4m3's error), never NaN or
    infinity; an all-zero block still decodes to zeros. (int8 and float8 store a second
    moment's square root, which is never subnormal.)"""
    g = torch.Generator().manual_seed(3)
    normal = torch.randint(1, 17, (512,), generator=g).float() / 16  # exact at 2^-140
    if signed:
        normal = normal * torch.where(torch.rand(512, generator=g) < 0.5, -1.0, 1.0)
    shift = 128 if kind == "float8" else 140  # (float8's scale is the block's max over 448)
    tiny = normal * 2.0**-shift
    back_up = tiny
    for _ in range(4):  # (2^shift itself overflows float32)
        back_up = back_up * 2.0 ** (shift // 4)
    assert 0 < float(tiny.abs().max()) < TINY and torch.equal(back_up, normal)  # (exact)
    codes, scales = quantize(tiny, kind, signed=signed)
    back = dequantize(codes, scales, kind, tiny.shape, signed=signed)
    assert torch.isfinite(back).all()
    if kind == "float8":
        bound = 2.0**-4 * float(tiny.abs().max()) + 2.0**-149
        assert float((back - tiny).abs().max()) <= bound
    else:
        assert torch.equal(codes, quantize(normal, kind, signed=signed)[0])
    zero = quantize(torch.zeros(512), kind, signed=signed)
    assert torch.equal(dequantize(*zero, kind, (512,), signed=signed), torch.zeros(512))


# -- the e4m3 codes as AVX2 CPUs compute them ---------------------------------------------------


def _e4m3_cases() -> torch.Tensor:
    """float32 values where a conversion to e4m3 can go wrong: both sides of every midpoint
    between neighbouring e4m3 values and the midpoints themselves (ties to even), a sweep of
    float32 bit patterns from 2^-12 to 1024, random magnitudes from 2^-30 to 2^10, zeros,
    the edge of 448 and past it, infinities and NaN; with both signs."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[~values.isnan()].unique()
    mids = (values[1:] + values[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    sweep = torch.arange(0x39800000, 0x44800000, 101, dtype=torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(0)
    drawn = torch.rand(20000, generator=g) * torch.exp2(
        torch.randint(-30, 11, (20000,), generator=g).float()
    )
    edges = torch.tensor([0.0, 448.0, 456.0, 464.0, 465.0, 480.0, 1e9, math.inf, math.nan])
    tiny = torch.finfo(torch.float32).tiny  # float32's own subnormals, and its largest
    denormals = torch.tensor([tiny / 2, tiny / 1024, 1e-45, tiny, torch.finfo(torch.float32).max])
    cases = torch.cat([near, sweep, drawn, edges, denormals])
    return torch.cat([cases, -cases])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_e4m3_from_bits_is_torchs_conversion_bit_for_bit(compiled):
    """The integer e4m3 encoder the float8 states take on AVX2 CPUs (where torch converts
    element by element) rounds, saturates and keeps NaN as torch's conversion does; and
    the table the decode reads there holds each code's value as torch converts it back."""
    from mixprec.optim.states.codecs import _E4M3_VALUES, _e4m3

    y = _e4m3_cases()
    expected = y.to(torch.float8_e4m3fn).view(torch.uint8)
    encode = torch.compile(_e4m3) if compiled else _e4m3
    assert torch.equal(encode(y).view(torch.uint8), expected)
    for few in (y[:0], y[-1:], y[:1]):  # empty and one-element tensors
        assert torch.equal(
            _e4m3(few).view(torch.uint8), few.to(torch.float8_e4m3fn).view(torch.uint8)
        )
    codes = torch.arange(256, dtype=torch.uint8)
    back = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(_E4M3_VALUES[codes.long()].nan_to_num(7.0), back.nan_to_num(7.0))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_int4_second_moments_decode_as_their_map_reads_every_code(compiled):
    """The int4 second moment's linear map is read by arithmetic where a table read costs
    more (not on AVX2 CPUs): every code of both halves of a byte, under scales of either
    sign (a negative one: codes of roots, squared), zero, subnormal, float32's extremes,
    infinite and NaN, decodes bit for bit as the map's table says (an infinite scale as
    NaN); and no blocks decode to none."""
    from mixprec.optim.engine import can_compile
    from mixprec.optim.states.codecs import _at_least_tiny, pack4, state_codec

    if compiled and not can_compile("cpu"):
        pytest.skip("no C++ compiler for torch.compile on this host")
    codec = state_codec("int4")
    table = codec.table(False, torch.device("cpu"))
    low, high = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    codes = torch.stack([low.reshape(-1), high.reshape(-1)], dim=1).reshape(-1).to(torch.uint8)
    top = torch.finfo(torch.float32).max
    # scales of either sign, zero, subnormal, float32's extremes, infinite and NaN
    scales = torch.tensor(
        [1.0, -1.0, 0.0, -0.0, 3e-3, -7.5, 2.0**-126, 2.0**-140, 1e30, top, -top, 0.5]
        + [2.0**k for k in (-3, 5, 17)]
        + [math.inf, -math.inf, math.nan]
    )
    block = 32  # the first 16 blocks hold every pair of codes once
    codes = codes.repeat(2)[: block * scales.numel()]
    decode = torch.compile(codec.decode) if compiled else codec.decode
    got = decode(pack4(codes), scales, block, False, table)
    values = table[codes.long()].view(-1, block)
    magnitude = scales.abs()[:, None]
    # (an infinite scale, a second moment past float32's range, decodes as NaN)
    magnitude = torch.where(magnitude == math.inf, math.nan, magnitude)
    stored = values * magnitude  # (a negative scale: the codes are of roots, squared back)
    expected = _at_least_tiny(
        torch.where(scales[:, None] < 0, stored * stored, stored), values, magnitude
    )
    assert got[-3:].isnan().all()
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))
    empty = decode(pack4(codes[:0]), scales[:0], block, False, table)
    assert empty.shape == (0, block)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("signed", [True, False], ids=["first", "second"])
def test_float8_keeps_an_infinity_to_its_element(signed, compiled):
    """A tensor stored once (`quantize`, as a saved activation is): an inf made its block's
    scale inf, and every element of the block decoded to NaN (a masked log-softmax's -inf).
    The scale is now the block's finite largest, the inf takes e4m3's NaN code of its sign
    and decodes to itself; the block's other elements code as if it were 0. A NaN still
    makes its block's scale, and the block, NaN. (A moment in the update keeps the plain
    codec: its codes of finite blocks are the same.)"""
    if compiled and not mixprec.optim.engine.can_compile("cpu"):
        pytest.skip("no C++ compiler to build the compiled codec with")
    torch.manual_seed(0)
    x = torch.randn(3, 256)
    x = x.abs() ** 2 if not signed else x
    infinite = x.clone()
    infinite[0, 5] = math.inf
    if signed:
        infinite[0, 9] = -math.inf
    infinite[2, 7] = math.nan
    zeroed = torch.where(infinite.isinf(), 0.0, x)
    run = (lambda f: torch.compile(f, dynamic=False)) if compiled else (lambda f: f)
    fmt = StateFormat("float8")
    encode = run(lambda t: quantize(t, fmt, signed=signed))
    decode = run(lambda c, s: dequantize(c, s, fmt, (3, 256), signed=signed))
    codes, scales = encode(infinite)
    zero_codes, zero_scales = encode(zeroed)
    assert torch.equal(scales[:2], zero_scales[:2]) and torch.isnan(scales[2])
    out, expected = decode(codes, scales), decode(zero_codes, zero_scales)
    assert out[0, 5] == math.inf and (not signed or out[0, 9] == -math.inf)
    finite = torch.isfinite(infinite[:2])
    assert torch.equal(out[:2][finite], expected[:2][finite])
    assert torch.isnan(out[2]).all()


@pytest.mark.parametrize(
    "values",
    [
        [0.0] * 255 + [-math.inf],  # the rest of its block zero: a scale of 0
        [-math.inf],  # one element
        [math.inf] * 256,  # a whole block infinite
        [1e-40, 3e4, -math.inf] * 10,  # a subnormal beside a large value and an inf
        [],  # empty
    ],
    ids=["zeros-and-inf", "one-inf", "all-inf", "span-and-inf", "empty"],
)
def test_a_stored_float8_tensor_keeps_infinities_on_hostile_blocks(values):
    x = torch.tensor(values, dtype=torch.float32)
    codes, scales = quantize(x, "float8")
    back = dequantize(codes, scales, "float8", x.shape)
    assert back.shape == x.shape
    assert torch.equal(back.isinf(), x.isinf()) and torch.equal(back[x.isinf()], x[x.isinf()])
    assert torch.isfinite(back[~x.isinf()]).all()
