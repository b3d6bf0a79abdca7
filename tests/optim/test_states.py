"""Low-bit optimizer states (`mixprec.optim.states`): the formats and their error bounds, the
optimizers against torch's, bytes, checkpoints, format choice per parameter, the compiled
step, and composition with 16-bit weights and `LossScaleOptimizer`."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from mixprec import LossScaleOptimizer, StaticLossScaler
from mixprec.optim.states import (
    AdamW4bit,
    AdamW8bit,
    AdamWFp8,
    LowBitAdam,
    LowBitAdamW,
    LowBitSGD,
    StateFormat,
    assign_formats,
    code_map,
    dequantize,
    explain_formats,
    from_model,
    from_optimizer,
    moment_error,
    parse_state_format,
    quantize,
    state_bytes,
)
from mixprec.optim.states.formats import code_tables, nearest_code

LOW_BIT = ["int8", "int4", "fp8"]
CPU = torch.device("cpu")


# -- formats ----------------------------------------------------------------------------------


def test_state_format_specs_parse_and_print_back():
    assert parse_state_format("int8") == StateFormat("int8", 256)
    assert parse_state_format("int4") == StateFormat("int4", 128)
    assert parse_state_format("fp8") == StateFormat("fp8", 256)
    assert parse_state_format("float32") == StateFormat("float32", None)
    assert parse_state_format(" INT8/block=128 ") == StateFormat("int8", 128)
    assert str(StateFormat("int8", 128)) == "int8/block=128"
    assert str(StateFormat("int4")) == "int4"
    fmt = StateFormat("fp8", 64)
    assert parse_state_format(fmt) is fmt


@pytest.mark.parametrize(
    "spec, message",
    [
        ("int2", "'float32', 'int8', 'int4' or 'float8' \\(or 'fp8'\\)"),
        ("bf16", "'float32', 'int8', 'int4' or 'float8'"),
        ("int8/block=7", "even integer"),
        ("int8/blocks=64", "the only option is 'block=N'"),
        ("int8/block=", "the only option is 'block=N'"),
        ("float32/block=64", "no blocks"),
    ],
)
def test_bad_state_format_specs_say_what_is_accepted(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_state_format(spec)


def test_a_state_format_that_is_not_a_string_is_refused():
    with pytest.raises(TypeError, match="string or a StateFormat"):
        parse_state_format(8)


@pytest.mark.parametrize(
    "fmt, numel, expected",
    [
        ("float32", 1000, 4000),
        ("int8", 256, 256 + 4),
        ("int8", 257, 512 + 8),  # the last block padded
        ("int4", 128, 64 + 4),
        ("int4", 1000, 8 * 64 + 8 * 4),
        ("fp8", 4096, 4096 + 16 * 4),
        ("int8/block=64", 4096, 4096 + 64 * 4),
    ],
)
def test_state_bytes_count_codes_and_scales_exactly(fmt, numel, expected):
    assert parse_state_format(fmt).bytes(numel) == expected


def test_low_bit_states_take_a_quarter_and_an_eighth_of_float32():
    n = 1 << 20
    assert StateFormat("int8").bytes(n) / (4 * n) <= 0.26
    assert StateFormat("fp8").bytes(n) / (4 * n) <= 0.26
    assert StateFormat("int4").bytes(n) / (4 * n) <= 0.14


def test_code_maps_are_sorted_and_shaped_as_the_papers_say():
    for kind, size in [("int8", 256), ("int4", 16)]:
        for signed in (True, False):
            table = code_map(kind, signed)
            assert table.numel() == size and bool((table[1:] > table[:-1]).all())
            assert table[-1] == 1.0
    assert code_map("int8", True).min() < 0 and code_map("int8", False).min() == 0
    # the 4-bit second moment has no zero: 1/16 .. 16/16
    assert torch.equal(code_map("int4", False), torch.arange(1, 17) / 16)
    # a dynamic map has values in every decade down to 1e-6 (int8) or 1e-2 (int4)
    assert 1e-7 < code_map("int8", False)[1] < 1e-6
    # a signed map holds -1, 0 and 1 (and no value below 1e-2 but one negative for int4)
    for kind, zero in [("int8", 128), ("int4", 8)]:
        table = code_map(kind, True)
        assert (table[0], table[zero], table[-1]) == (-1, 0, 1)
    assert 1e-3 < -code_map("int4", True)[7] < 1e-2 < code_map("int4", True)[9]


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("signed", [True, False])
def test_the_code_found_is_the_nearest_value_of_the_map(kind, signed):
    """The cell table and one comparison give what a search over the whole map gives (up
    to a tie at a boundary, one rounding apart)."""
    table = code_map(kind, signed)
    g = torch.Generator().manual_seed(0)
    y = torch.rand(100_000, generator=g) ** 6
    if signed:
        y = y * torch.where(torch.rand(100_000, generator=g) < 0.5, -1.0, 1.0)
    edges = (table[1:] + table[:-1]) / 2
    y = torch.cat([y, table, edges, torch.tensor([0.0, 1.0])]).clamp(-1 if signed else 0, 1)
    codes = nearest_code(y, kind, signed, code_tables(StateFormat(kind), signed, CPU)).long()
    assert 0 <= int(codes.min()) and int(codes.max()) < table.numel()
    found = (table[codes] - y).abs()
    best = (table[None, :] - y[:, None]).abs().min(dim=1).values
    assert float((found - best).max()) <= 6e-8
    assert torch.equal(
        table[
            nearest_code(table, kind, signed, code_tables(StateFormat(kind), signed, CPU)).long()
        ],
        table,
    )


def _blockwise_max(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block's largest magnitude."""
    flat = torch.nn.functional.pad(x.reshape(-1), (0, -x.numel() % block)).view(-1, block)
    return flat.abs().amax(dim=1, keepdim=True).expand_as(flat).reshape(-1)[: x.numel()]


@pytest.mark.parametrize(
    "fmt, signed, bound",
    [
        # half the widest gap of the map, as a fraction of the block's largest magnitude
        ("int8", True, 0.9 / 128),
        # (the second moment's root: (r + d)^2 - r^2 <= 2d + d^2 of the largest)
        ("int8", False, 2 * 0.9 / 256 + (0.9 / 256) ** 2),
        ("int4", True, 0.9 / 8),
        ("int4", False, 1 / 16),  # no zero: below 1/16 rounds up to it
    ],
)
def test_int_quantization_error_is_within_half_a_code_step(fmt, signed, bound):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 301, generator=g)
    x = x if signed else x * x
    codes, scales = quantize(x, fmt, signed=signed)
    back = dequantize(codes, scales, fmt, x.shape, signed=signed)
    assert back.shape == x.shape and back.dtype == torch.float32
    block = parse_state_format(fmt).block
    err = (back - x).abs().reshape(-1)
    assert bool((err <= bound * _blockwise_max(x, block) * (1 + 1e-5)).all())


def test_fp8_quantization_error_is_e4m3s_rounding():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4000, generator=g) * torch.logspace(-3, 3, 4000)
    codes, scales = quantize(x, "fp8")
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    back = dequantize(codes, scales, "fp8", x.shape)
    scale = _blockwise_max(x, 256) / 448
    # half a unit in the last of 3 mantissa bits, or half e4m3's smallest subnormal step
    assert bool(((back - x).abs() <= torch.maximum(x.abs() / 16, scale * 2.0**-10)).all())


def test_fp8_second_moment_decodes_no_positive_value_as_zero():
    """A block of second moments spread over 2^-60 .. 1: e4m3 holds 2^18.8 below a block's
    largest value, its square root 2^37.6 of the moment; below that the root is stored as
    e4m3's smallest subnormal. No positive moment comes back 0, none comes back below
    1/2.25 of itself (so ``m / sqrt(v)`` grows at most 1.5x), and those within 2^-29 of
    the block's largest come back within e4m3's rounding of their root, squared."""
    g = torch.Generator().manual_seed(4)
    v = torch.pow(2.0, -60 * torch.rand(4, 256, generator=g))
    v[:, 0] = 1.0
    v[3, 5] = 0.0
    codes, scales = quantize(v, "fp8", signed=False)
    back = dequantize(codes, scales, "fp8", v.shape, signed=False)
    positive = v > 0
    assert bool((back[positive] > 0).all()) and float(back[3, 5]) == 0.0
    assert bool((back[positive] >= v[positive] / 2.25).all())
    assert torch.equal(back[:, 0], torch.ones(4))
    normal = v >= 2.0**-29
    assert bool(((back - v).abs()[normal] <= v[normal] * ((17 / 16) ** 2 - 1)).all())
    # the update a decoded moment gives an element whose gradient stopped: as float32's,
    # where storing the moment itself in e4m3 would give m / eps
    m, eps = v.sqrt(), 1e-8
    step = m / (back.sqrt() + eps)
    assert float(step.max()) <= 1.5 * float((m / (v.sqrt() + eps)).max())


def test_fp8_adamw_stays_finite_on_gradients_spanning_orders_of_magnitude():
    """Gradients whose scales span 10^-5 .. 1 within each block, half of them zero at each
    step (as an embedding's rows absent from a batch): a second moment stored as itself in
    e4m3 loses the small ones to 0, and their next zero-gradient step is ``m / eps``. Stored
    as its square root, fp8 AdamW tracks float32 AdamW."""
    g = torch.Generator().manual_seed(5)
    scale = torch.pow(10.0, -5 * torch.rand(512, generator=g))
    grads = [
        torch.randn(512, generator=g) * scale * (torch.rand(512, generator=g) < 0.5)
        for _ in range(40)
    ]
    start = torch.randn(512, generator=g)
    ours, ref = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    opt = LowBitAdamW([ours], lr=1e-2, states="fp8", min_size=0, compile=False)
    torch_opt = torch.optim.AdamW([ref], lr=1e-2)
    for grad in grads:
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        torch_opt.step()
        decoded = opt.to_float32_state_dict()["state"][0]["exp_avg_sq"]
        true = torch_opt.state[ref]["exp_avg_sq"]
        assert bool((decoded[true > 0] > 0).all())
    assert bool(ours.isfinite().all())
    # (the e4m3 moment of v itself: differences in the thousands)
    assert float((ref.detach() - start).abs().max()) > 0.2
    assert float((ours - ref).detach().abs().max()) < 0.15
    assert float((ours - ref).detach().abs().mean()) < 1e-2


@pytest.mark.parametrize("fmt, most", [("int8", 0.015), ("int4", 0.2), ("fp8", 0.035)])
def test_relative_error_of_a_normal_moment(fmt, most):
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(3))
    assert 0 < moment_error(x, fmt) < most
    assert moment_error(x, "float32") == 0.0
    assert moment_error(torch.zeros(300), fmt) == 0.0


def test_zero_blocks_and_partial_blocks_round_trip():
    x = torch.zeros(600)
    x[512:] = torch.arange(88) / 88
    for fmt in LOW_BIT:
        codes, scales = quantize(x, fmt)
        assert scales.numel() == parse_state_format(fmt).blocks(600)
        assert codes.numel() == parse_state_format(fmt).code_bytes(600)
        back = dequantize(codes, scales, fmt, (600,))
        assert torch.equal(back[:512], torch.zeros(512))
        assert float((back[512:] - x[512:]).abs().max()) < (0.12 if fmt == "int4" else 0.04)


# -- the optimizers against torch's -----------------------------------------------------------


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 96), (96,), (33, 70), (5000,)]
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params: list[nn.Parameter], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _run(opt: torch.optim.Optimizer, params: list[nn.Parameter], steps: range) -> None:
    for i in steps:
        for p, grad in zip(params, _grads(params, i), strict=True):
            p.grad = grad.to(p.dtype)
        opt.step()


def _twins(make_ours, make_torch, steps: int = 30):
    ours, ref = _params(), _params()
    _run(make_ours(ours), ours, range(steps))
    _run(make_torch(ref), ref, range(steps))
    return ours, ref


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(
        float((x.detach().float() - y.detach().float()).abs().max())
        for x, y in zip(a, b, strict=True)
    )


def test_float32_states_follow_torch_adamw_adam_and_sgd():
    kw = dict(states="float32", compile=False)
    ours, ref = _twins(
        lambda ps: LowBitAdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    )
    assert _max_diff(ours, ref) < 5e-6
    ours, ref = _twins(
        lambda ps: LowBitAdam(ps, lr=1e-2, weight_decay=0.1, **kw),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
    )
    assert _max_diff(ours, ref) < 5e-6
    for nesterov, dampening in [(False, 0.0), (True, 0.0), (False, 0.3)]:
        ours, ref = _twins(
            lambda ps, n=nesterov, d=dampening: LowBitSGD(
                ps, lr=1e-2, momentum=0.9, dampening=d, nesterov=n, weight_decay=1e-3, **kw
            ),
            lambda ps, n=nesterov, d=dampening: torch.optim.SGD(
                ps, lr=1e-2, momentum=0.9, dampening=d, nesterov=n, weight_decay=1e-3
            ),
        )  # fmt: skip
        assert _max_diff(ours, ref) < 5e-6


@pytest.mark.parametrize("beta2", [0.999, 0.99999])
def test_the_update_takes_one_minus_each_beta_in_double_as_torch_does(beta2):
    """1 - beta2 taken from beta2 rounded to float32 is 1.4e-3 off for beta2 = 0.99999 (the
    second moment with it): the update's own kernel (a transposed weight steps there, not in
    torch's fused call) takes 1 - beta1 and 1 - beta2 worked out in double, as torch does."""
    torch.manual_seed(0)
    w = torch.randn(64, 32)
    ours = nn.Parameter(w.t().contiguous().t())  # (not contiguous: mixprec's kernel)
    ref = nn.Parameter(w.clone())
    opt = LowBitAdamW([ours], betas=(0.9, beta2), states="float32", min_size=0, compile=False)
    torch_opt = torch.optim.AdamW([ref], betas=(0.9, beta2), foreach=False)
    for _ in range(3):
        ours.grad = torch.randn(64, 32)
        ref.grad = ours.grad.clone()
        opt.step()
        torch_opt.step()
    v, v_ref = opt.state[ours]["exp_avg_sq"], torch_opt.state[ref]["exp_avg_sq"]
    assert float((v / v_ref - 1).abs().max()) < 1e-6
    assert torch.equal(opt.state[ours]["exp_avg"], torch_opt.state[ref]["exp_avg"])


@pytest.mark.parametrize("fmt, most", [("int8", 2e-3), ("fp8", 6e-3), ("int4", 2.5e-2)])
def test_low_bit_adamw_tracks_float32_adamw(fmt, most):
    """As 8-bit Adam tracks 32-bit Adam in bitsandbytes' tests: after 30 steps of lr 1e-2
    (each weight moved ~0.3) the weights stay within `most` of torch's, on average far
    closer; the moments' own error stays within the format's."""
    ours, ref = _twins(
        lambda ps: LowBitAdamW(ps, lr=1e-2, states=fmt, min_size=0, compile=False),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    )
    moved = _max_diff(ref, _params())
    assert moved > 0.2
    assert _max_diff(ours, ref) < most * 10
    mean = sum(float((a - b).detach().abs().mean()) for a, b in zip(ours, ref, strict=True)) / 4
    assert mean < most


def test_low_bit_sgd_tracks_float32_sgd():
    ours, ref = _twins(
        lambda ps: LowBitSGD(ps, lr=1e-2, momentum=0.9, min_size=0, compile=False),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    )
    assert _max_diff(ours, ref) < 0.05
    assert sum(float((a - b).abs().mean()) for a, b in zip(ours, ref, strict=True)) / 4 < 1e-2


def test_low_bit_adamw_trains_a_regression_as_well_as_adamw():
    def train(make) -> float:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 1))
        opt = make(model.parameters())
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 64, generator=g)
        y = x[:, :3].sum(1, keepdim=True)
        for _ in range(150):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        return float(loss)

    base = train(lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    assert base < 0.05
    for fmt in LOW_BIT:
        assert (
            train(lambda ps, f=fmt: LowBitAdamW(ps, lr=3e-3, states=f, min_size=0, compile=False))
            < 2 * base + 0.01
        )


def test_state_bytes_are_the_formats_bytes():
    params = _params()
    opt = AdamW8bit(params, min_size=4096, compile=False)
    _run(opt, params, range(1))
    expected = 0
    for p in params:
        fmt = StateFormat("int8") if p.numel() >= 4096 else StateFormat("float32")
        expected += 2 * fmt.bytes(p.numel())
        assert opt.state[p]["format"] == str(fmt)
    assert state_bytes(opt) == expected
    torch_opt = torch.optim.AdamW(params)
    _run(torch_opt, params, range(1))
    assert state_bytes(torch_opt) == 8 * sum(p.numel() for p in params)


def test_drop_in_classes_pick_their_formats():
    params = _params()
    for cls, fmt in [(AdamW8bit, "int8"), (AdamW4bit, "int4"), (AdamWFp8, "fp8")]:
        opt = cls(params, lr=1e-3, compile=False)
        assert opt.format_of(params[3], opt.param_groups[0]) == parse_state_format(fmt)
        assert opt.format_of(params[1], opt.param_groups[0]) == StateFormat("float32")


def test_a_group_key_overrides_the_format_and_is_checked():
    params = _params()
    opt = LowBitAdamW(
        [{"params": params[:2]}, {"params": params[2:], "states": "int4/block=64"}],
        states="fp8",
        min_size=0,
        compile=False,
    )
    _run(opt, params, range(2))
    assert [opt.state[p]["format"] for p in params] == [
        "float8",
        "float8",
        "int4/block=64",
        "int4/block=64",
    ]
    with pytest.raises(ValueError, match="'float32', 'int8', 'int4' or 'float8'"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "states": "int3"})


def test_refusals_name_what_to_do():
    params = _params()
    with pytest.raises(ValueError, match="amsgrad"):
        LowBitAdamW(params, amsgrad=True)
    with pytest.raises(ValueError, match="block_size is for low-bit"):
        LowBitAdamW(params, states="float32", block_size=64)
    with pytest.raises(ValueError, match="compensation must be"):
        LowBitAdamW(params, compensation="exact")
    with pytest.raises(TypeError, match="keep_float32"):
        LowBitAdamW(params, keep_float32="embeddings")
    with pytest.raises(ValueError, match="min_size"):
        LowBitAdamW(params, min_size=-1)
    with pytest.raises(TypeError, match="converts torch.optim.AdamW, Adam and SGD"):
        from_optimizer(torch.optim.RMSprop(params))
    with pytest.raises(ValueError, match="amsgrad=True"):
        from_optimizer(torch.optim.AdamW(params, amsgrad=True))


@pytest.mark.parametrize("fmt", ["int8", "int4/block=96"])
def test_a_large_parameter_steps_in_parts_with_the_same_result(fmt, monkeypatch):
    from mixprec.optim.states import optimizers

    whole, parts = _params(), _params()
    _run(LowBitAdamW(whole, lr=1e-2, states=fmt, min_size=0, compile=False), whole, range(3))
    # not a whole number of blocks either (a CPU's calls take CPU_CHUNK, an accelerator's CHUNK)
    monkeypatch.setattr(optimizers, "CPU_CHUNK", 1000)
    monkeypatch.setattr(optimizers, "CHUNK", 1000)
    _run(LowBitAdamW(parts, lr=1e-2, states=fmt, min_size=0, compile=False), parts, range(3))
    assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))


# -- checkpoints --------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as comparable bits (torch.equal has no float8 kernel)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _flat_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: LowBitAdamW(ps, lr=1e-2, states="int8", min_size=1000, compile=False),
        lambda ps: LowBitAdamW(ps, lr=1e-2, states="int4", min_size=0, compile=False),
        lambda ps: LowBitAdam(ps, lr=1e-2, states="fp8", weight_decay=0.01, compile=False),
        lambda ps: LowBitSGD(ps, lr=1e-2, momentum=0.9, nesterov=True, compile=False),
    ],
    ids=["adamw-int8", "adamw-int4", "adam-fp8", "sgd-int8"],
)
def test_a_resumed_run_is_bit_identical_to_one_that_never_stopped(make, tmp_path):
    straight = _params()
    opt = make(straight)
    _run(opt, straight, range(10))

    first = _params()
    opt_a = make(first)
    _run(opt_a, first, range(5))
    torch.save(
        {"params": [p.detach() for p in first], "opt": opt_a.state_dict()}, tmp_path / "c.pt"
    )

    saved = torch.load(tmp_path / "c.pt", weights_only=True)
    resumed = [nn.Parameter(t.clone()) for t in saved["params"]]
    opt_b = make(resumed)
    opt_b.load_state_dict(saved["opt"])
    _run(opt_b, resumed, range(5, 10))
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_flat_state(opt), _flat_state(opt_b), strict=True):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("compensation", ["stochastic", "kahan"])
def test_a_resumed_compensated_bfloat16_run_is_bit_identical(compensation):
    """The random bits are the engine's: a hash of the seed, the step counts and the
    parameters' indices, so the state dict holds the seed and no generator state, and a
    resumed run (here built with another seed, restored from the state) is the same run."""

    def make(ps, seed=3):
        return LowBitAdamW(ps, lr=1e-3, compensation=compensation, seed=seed, compile=False)

    straight = _params(dtype=torch.bfloat16)
    _run(make(straight), straight, range(6))
    first = _params(dtype=torch.bfloat16)
    opt_a = make(first)
    _run(opt_a, first, range(3))
    state = copy.deepcopy(opt_a.state_dict())
    assert state["seed"] == 3 and "generator" not in state
    resumed = [nn.Parameter(p.detach().clone()) for p in first]
    opt_b = make(resumed, seed=99)
    opt_b.load_state_dict(state)
    assert opt_b.seed == 3
    # float32 moments and scales beside bfloat16 weights stay float32 (torch's loader would
    # cast them to bfloat16)
    floats = {
        v.dtype for s in opt_b.state.values() for k, v in s.items()
        if k not in ("step", "format", "compensation") and not k.endswith("codes")
    }  # fmt: skip
    assert floats == {torch.float32}
    _run(opt_b, resumed, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


def test_a_state_saved_with_a_generator_state_loads_and_steps():
    """States saved before the engine's random bits hold the stochastic rounding's
    generator state: it is checked, set aside, and the run continues (the rounding is the
    engine's from then on)."""
    params = _params(dtype=torch.bfloat16)
    opt = LowBitAdamW(params, lr=1e-3, compensation="stochastic", seed=3, compile=False)
    _run(opt, params, range(2))
    old = copy.deepcopy(opt.state_dict())
    del old["seed"]
    old["generator"] = torch.Generator().manual_seed(3).get_state()
    again = LowBitAdamW(params, lr=1e-3, compensation="stochastic", seed=5, compile=False)
    again.load_state_dict(copy.deepcopy(old))
    assert again.seed == 5
    _run(again, params, range(2, 3))
    old["generator"] = "not a state"
    fresh = LowBitAdamW(params, lr=1e-3, compensation="stochastic", compile=False)
    with pytest.raises(ValueError, match="generator"):
        fresh.load_state_dict(old)


@pytest.mark.parametrize("fmt, most", [("int8", 0.02), ("fp8", 0.08)])
def test_a_torch_adamw_state_loads_quantized_and_exports_back(fmt, most):
    params = _params()
    torch_opt = torch.optim.AdamW(params, lr=1e-2)
    _run(torch_opt, params, range(3))
    saved = copy.deepcopy(torch_opt.state_dict())

    ours = LowBitAdamW(params, lr=1e-2, states=fmt, min_size=1000, compile=False)
    ours.load_state_dict(saved)
    big, small = params[0], params[1]
    assert ours.state[big]["format"] == str(parse_state_format(fmt))
    assert "exp_avg_codes" in ours.state[big]
    assert ours.state[small]["format"] == "float32"
    assert torch.equal(ours.state[small]["exp_avg"], torch_opt.state[small]["exp_avg"])

    exported = ours.to_float32_state_dict()
    plain = torch.optim.AdamW(params, lr=1e-2)
    plain.load_state_dict(exported)
    for p in params:
        for name in ("exp_avg", "exp_avg_sq"):
            back, original = plain.state[p][name], torch_opt.state[p][name]
            assert back.shape == p.shape and back.dtype == torch.float32
            assert moment_error(original, fmt, signed=name == "exp_avg") < most
            assert float((back - original).norm() / original.norm()) < most
        assert plain.state[p]["step"] == 3
    # and the loaded state steps on
    _run(ours, params, range(3, 5))
    assert int(ours.state[big]["step"]) == 5


def test_from_optimizer_keeps_groups_and_settings_and_quantizes_the_state():
    params = _params()
    torch_opt = torch.optim.AdamW(
        [{"params": params[:2], "lr": 1e-2}, {"params": params[2:], "weight_decay": 0.5}],
        lr=1e-3, betas=(0.8, 0.99), foreach=True,
    )  # fmt: skip
    _run(torch_opt, params, range(2))
    converted = from_optimizer(torch_opt, "int8", min_size=1000, compile=False)
    assert isinstance(converted, LowBitAdamW)
    groups = [(g["lr"], g["betas"], g["weight_decay"], g["states"]) for g in converted.param_groups]
    assert groups == [(1e-2, (0.8, 0.99), 0.01, "int8"), (1e-3, (0.8, 0.99), 0.5, "int8")]
    assert converted.state[params[0]]["format"] == "int8"
    assert int(converted.state[params[0]]["step"]) == 2
    sgd = from_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), compile=False)
    assert isinstance(sgd, LowBitSGD) and sgd.param_groups[0]["momentum"] == 0.9
    assert isinstance(from_optimizer(torch.optim.Adam(params)), LowBitAdam)
    # one parameter's own format keeps the groups one to one (a scheduler can follow them)
    torch_opt = torch.optim.AdamW(params, lr=1e-2)
    schedule = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=1, gamma=0.5)
    own = from_optimizer(torch_opt, "int8", formats={params[3]: "int4"}, min_size=0)
    assert [(len(g["params"]), g["states"]) for g in own.param_groups] == [(4, "int8")]
    schedule.optimizer = own
    _run(own, params, range(1))
    schedule.step()
    assert own.param_groups[0]["lr"] == 5e-3
    assert [own.state[p]["format"] for p in params] == ["int8", "int8", "int8", "int4"]


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("states", ["float32", "int8"])
def test_a_groups_own_decoupled_weight_decay_survives_conversion(cls, states):
    """torch's Adam and AdamW read each group's ``decoupled_weight_decay``: a group that
    overrides its class's form keeps it through `from_optimizer` and a state-dict round
    trip (the flag was dropped, and the group stepped with the class's form: off by 0.46
    after three steps). Float32 states step as torch's fused step does, bit for bit."""
    torch.manual_seed(0)
    w = torch.randn(300)
    override = cls is not torch.optim.AdamW

    def make(**kw: object) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
        params = [nn.Parameter(w.clone()) for _ in range(2)]
        groups = [
            {"params": params[:1]},
            {"params": params[1:], "decoupled_weight_decay": override},
        ]
        return params, cls(groups, lr=0.1, weight_decay=0.5, **kw)

    (ours, torch_opt), (theirs, reference) = make(), make(fused=True)
    converted = from_optimizer(torch_opt, states, min_size=0, compile=False)
    for step in range(3):
        if step == 1:  # (and through its state dict)
            converted.load_state_dict(copy.deepcopy(converted.state_dict()))
        g = torch.randn(300)
        for p in ours + theirs:
            p.grad = g.clone()
        converted.step()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        if states == "float32":
            assert torch.equal(a, b)
        else:  # (int8 moments: close, the decay's form is what differed by 0.46)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-2)


# -- which format, and why ------------------------------------------------------------------------


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 16)
        self.body = nn.Linear(16, 512)
        self.head = nn.Linear(512, 16)


def test_formats_per_parameter_with_reasons():
    model = _Tiny()
    model.head.bias.requires_grad_(False)
    got = assign_formats(model, "int4", rules={r"head\..*": "fp8"})
    assert got == {
        "embed.weight": (StateFormat("float32"), "embedding"),
        "body.weight": (StateFormat("int4"), "default"),
        "body.bias": (StateFormat("float32"), "small: 512 < 4096 elements"),
        "head.weight": (StateFormat("fp8"), "rule 'head\\\\..*'"),
    }
    text = explain_formats(got)
    assert text.splitlines()[0].split() == ["embed.weight", "float32", "embedding"]
    plain = assign_formats(model.named_parameters(), "int8", embeddings_float32=False)
    assert plain["embed.weight"] == (StateFormat("int8"), "default")
    with pytest.raises(TypeError, match="named_parameters"):
        assign_formats([torch.zeros(3)])


def test_from_model_groups_by_format_and_keeps_embeddings_float32():
    model = _Tiny()
    opt = from_model(model, LowBitAdamW, "int8", lr=1e-2, compile=False)
    assert [(g["states"], len(g["params"])) for g in opt.param_groups] == [
        ("float32", 3),
        ("int8", 2),
    ]
    x = torch.randint(0, 1000, (8,))
    model.head(model.body(model.embed(x))).sum().backward()
    opt.step()
    assert opt.state[model.embed.weight]["format"] == "float32"
    assert opt.state[model.body.weight]["format"] == "int8"


def test_keep_float32_picks_parameters():
    params = _params()
    opt = LowBitAdamW(params, min_size=0, keep_float32=lambda p: p.dim() == 1, compile=False)
    _run(opt, params, range(1))
    assert [opt.state[p]["format"] for p in params] == ["int8", "float32", "int8", "float32"]


def _tied() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(128, 128, bias=False), nn.ReLU(), nn.Linear(128, 128))
    model[2].weight = model[0].weight  # one parameter, two owners (GPT-2's lm_head and wte)
    return model


def test_a_state_rule_naming_the_second_owner_of_a_tied_parameter_reaches_it():
    """Found by a review: a state rule was matched against a tied parameter's first name's
    owner only, so ``states={"lm_head": "int8"}`` on GPT-2 (whose ``lm_head.weight`` is
    ``transformer.wte.weight``) left the tie at the default or the embedding's float32,
    silently. Every owner's path is matched now; an explicit rule outranks the embedding's
    float32 and the default the other owner falls to."""
    from mixprec import PolicyMap, Precision

    model = _tied()
    for rule in ("2", "0", "0|2"):
        pmap = PolicyMap("32-true", states={rule: "int8"})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the rule matches: nothing to warn of
            pmap.warn_unmatched_states(model)
            formats = pmap.state_formats(model, "float32")
        assert formats["0.weight"][0] == StateFormat("int8")
        assert formats["0.weight"][1].startswith(f"state rule {rule!r}")
    said = PolicyMap("32-true", states={"2": "int8"}).state_formats(model)["0.weight"][1]
    assert said == "state rule '2' via 2.weight (tied)"
    # rules on parameter names reach the second name too
    by_name = assign_formats(model, "float32", rules={r"2\.weight": "int4"})
    assert by_name["0.weight"] == (StateFormat("int4"), "rule '2\\\\.weight' via 2.weight (tied)")
    # an embedding's table tied to a head: the head's rule outranks the table's float32
    tied = nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 64, bias=False))
    tied[1].weight = tied[0].weight
    got = PolicyMap("32-true", states={"1": "int8"}).state_formats(tied)
    assert got == {"0.weight": (StateFormat("int8"), "state rule '1' via 1.weight (tied)")}
    # and the optimizer steps the tie in that format
    model = _tied()
    precision = Precision(PolicyMap("32-true", states={"2": "int8"}))
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    precision.backward(model(torch.randn(4, 128)).square().mean())
    opt.step()
    assert opt.optimizer.state[model[2].weight]["format"] == "int8"


def test_tied_owners_given_different_state_formats_are_refused():
    """Found by a review: a tied parameter holds one optimizer state, so rules giving its
    two owners different formats cannot both hold; only the first owner's was used, without
    a word. Refused now, naming both paths and rules, as the policy rules refuse a tie given
    two dtypes; two rules agreeing on the format are taken."""
    from mixprec import PolicyMap
    from mixprec.errors import PolicySpecError

    model = _tied()
    pmap = PolicyMap("32-true", states={"0": "int4", "2": "int8"})
    said = (
        r"parameter '0\.weight' is also '2\.weight' \(tied.*\), but the rules give module "
        r"'0' int4 \(state rule '0'\) and module '2' int8 \(state rule '2'\); give both "
        r"modules the same state format"
    )
    with pytest.raises(PolicySpecError, match=said):
        pmap.state_formats(model)
    with pytest.raises(ValueError, match="tied"):
        assign_formats(model, "int8", rules={r"0\..*": "int4", r"2\..*": "fp8"})
    agreed = PolicyMap("32-true", states={"0": "int8", "2": "int8"}).state_formats(model)
    assert agreed["0.weight"] == (StateFormat("int8"), "state rule '0'")
    small = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    small[1].weight = small[0].weight  # under min_size: float32 whatever the rules say
    got = PolicyMap("32-true", states={"0": "int4", "1": "int8"}).state_formats(small)
    assert got == {"0.weight": (StateFormat("float32"), "small: 64 < 4096 elements")}


# -- the compiled step ----------------------------------------------------------------------------


def test_compiled_step_matches_eager_and_a_changing_lr_does_not_recompile():
    from torch._dynamo.utils import counters

    eager_params, compiled_params = _params(), _params()
    eager = LowBitAdamW(eager_params, lr=1e-2, states="int8", min_size=0, compile=False)
    compiled = LowBitAdamW(compiled_params, lr=1e-2, states="int8", min_size=0, compile=True)
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)) for o in (eager, compiled)
    ]
    for i in range(2):
        _run(eager, eager_params, range(i, i + 1))
        _run(compiled, compiled_params, range(i, i + 1))
        for s in schedules:
            s.step()
    built = counters["stats"]["unique_graphs"]
    for i in range(2, 6):
        _run(eager, eager_params, range(i, i + 1))
        _run(compiled, compiled_params, range(i, i + 1))
        for s in schedules:
            s.step()
    assert counters["stats"]["unique_graphs"] == built, "a learning-rate change recompiled"
    assert compiled.param_groups[0]["lr"] == pytest.approx(1e-2 / 7)
    assert _max_diff(eager_params, compiled_params) < 1e-4


@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_the_compiled_compensated_step_draws_the_eager_steps_random_bits(compensation):
    """bfloat16 weights written back by the engine inside the compiled update: the same
    random bits as the eager update (a hash of the element's index and the call's key), and
    the same weights on this CPU."""
    runs = {}
    for compile in (False, True):
        params = _params(dtype=torch.bfloat16)
        opt = LowBitAdamW(
            params, lr=1e-3, states="int8", min_size=0, compensation=compensation,
            compile=compile, seed=7,
        )  # fmt: skip
        _run(opt, params, range(3))
        runs[compile] = params
    for a, b in zip(runs[False], runs[True], strict=True):
        assert torch.equal(a, b)


# -- composition --------------------------------------------------------------------------------


def test_bfloat16_weights_with_kahan_keep_updates_that_round_away():
    """Updates far below bfloat16's spacing: rounded to nearest they vanish; with a Kahan
    buffer (or stochastic rounding) the weights follow float32 weights stepped alike."""

    def run(dtype, compensation):
        p = nn.Parameter(torch.full((8192,), 1.0, dtype=dtype))
        opt = LowBitAdamW([p], lr=1e-4, weight_decay=0.0, compensation=compensation, compile=False)
        for _ in range(100):
            p.grad = torch.full_like(p, -1.0)
            opt.step()
        return p.detach().float()

    exact = run(torch.float32, None)
    assert float(exact.mean()) == pytest.approx(1.01, abs=1e-4)
    assert float(run(torch.bfloat16, None).mean()) == 1.0  # every update rounded away
    kahan = run(torch.bfloat16, "kahan")
    assert float((kahan - exact).abs().max()) <= 2**-7  # within one bfloat16 step
    stochastic = run(torch.bfloat16, "stochastic")
    assert float(stochastic.mean()) == pytest.approx(1.01, abs=1e-3)


def test_bfloat16_weights_and_int8_moments_take_about_five_bytes_per_parameter():
    p = nn.Parameter(torch.zeros(1 << 16, dtype=torch.bfloat16))
    opt = AdamW8bit([p], compensation="kahan", compile=False)
    p.grad = torch.randn_like(p)
    opt.step()
    per_param = (state_bytes(opt) + 2 * p.numel()) / p.numel()  # states, Kahan, weight
    assert per_param == pytest.approx(2 + 2 + 2 * (1 + 4 / 256))


def test_a_loss_scale_optimizer_wraps_it_skips_on_inf_and_saves_it():
    torch.manual_seed(0)
    model = nn.Linear(128, 64)
    inner = LowBitAdamW(model.parameters(), lr=1e-2, min_size=0, compile=False)
    opt = LossScaleOptimizer(inner, StaticLossScaler(2.0**8))
    x = torch.randn(4, 128)
    opt.backward(model(x).square().mean())
    assert opt.step() is True or not opt.step_was_skipped
    before = [p.detach().clone() for p in model.parameters()]
    codes = inner.state[model.weight]["exp_avg_codes"].clone()
    opt.zero_grad()
    opt.backward(model(x).square().mean())
    model.weight.grad[0, 0] = math.inf
    opt.step()
    assert opt.step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert torch.equal(codes, inner.state[model.weight]["exp_avg_codes"])
    assert int(inner.state[model.weight]["step"]) == 1
    saved = copy.deepcopy(opt.state_dict())
    again = LossScaleOptimizer(
        LowBitAdamW(model.parameters(), lr=1e-2, min_size=0, compile=False),
        StaticLossScaler(2.0**8),
    )
    again.load_state_dict(saved)
    assert torch.equal(again.optimizer.state[model.weight]["exp_avg_codes"], codes)


def test_float16_weights_under_a_loss_scale_optimizer_step_float32_masters():
    torch.manual_seed(0)
    model = nn.Linear(128, 64).half()
    inner = LowBitAdamW(model.parameters(), lr=1e-3, min_size=0, compile=False)
    opt = LossScaleOptimizer(inner)
    x = torch.randn(4, 128, dtype=torch.float16)
    before = model.weight.detach().clone()
    opt.backward(model(x).float().square().mean())
    opt.step()
    master = opt.master_params[model.weight]
    assert master.dtype == torch.float32 and inner.state[master]["format"] == "int8"
    assert not torch.equal(before, model.weight)
    assert torch.equal(model.weight, master.detach().half())


def test_a_self_compensating_low_bit_optimizer_is_not_warned_about_under_the_wrapper():
    """`LossScaleOptimizer` warns about 16-bit weights stepped without compensation; a
    `LowBitAdamW(compensation="kahan")` compensates them itself, so only the plain one warns."""
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LossScaleOptimizer(LowBitAdamW(model.parameters(), compensation="kahan"))
    with pytest.warns(UserWarning, match="without float32 master weights"):
        LossScaleOptimizer(LowBitAdamW(model.parameters()))


def test_step_hooks_and_the_profiler_see_a_low_bit_step_as_torchs():
    """A low-bit step runs inside torch's step wrapper, as torch's optimizers do: the
    optimizer's and torch's global hooks around it with torch's arguments (the closure as
    the caller passed it), a profiler's record under torch's name, the same result."""
    import torch.optim.optimizer as torch_optimizer
    from torch.profiler import profile

    def run(watch: str) -> tuple[torch.Tensor, list]:
        torch.manual_seed(0)
        model = nn.Linear(64, 80)
        opt = AdamW8bit(model.parameters(), lr=1e-2, min_size=0, compile=False)
        seen: list = []
        handles = []
        if watch == "hooks":
            handles = [
                torch_optimizer.register_optimizer_step_pre_hook(
                    lambda o, args, kwargs: seen.append(("pre", args[0] is o, len(args), kwargs))
                ),
                opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post",))),
            ]
        try:
            for i in range(3):
                for p in model.parameters():
                    p.grad = torch.full_like(p, 0.01 * (i + 1))
                if watch == "profiler":
                    with profile() as prof:
                        opt.step()
                    seen += [e.name for e in prof.events() if e.name.startswith("Optimizer.step")]
                elif watch == "hooks" and i == 2:
                    opt.step(closure=lambda: None)
                else:
                    opt.step()
        finally:
            for handle in handles:
                handle.remove()
        return torch.cat([p.detach().flatten() for p in model.parameters()]), seen

    bare, nothing = run("none")
    assert not nothing
    hooked, seen = run("hooks")
    assert torch.equal(hooked, bare)
    assert seen[:4] == [("pre", True, 1, {}), ("post",)] * 2
    assert seen[4][:3] == ("pre", True, 1) and list(seen[4][3]) == ["closure"]
    profiled, records = run("profiler")
    assert torch.equal(profiled, bare)
    assert records == ["Optimizer.step#AdamW8bit.step"] * 3


@pytest.mark.parametrize("cls", ["LowBitAdamW", "LowBitAdam"])
def test_the_float32_state_dict_says_which_decay_its_steps_took(cls):
    """torch's Adam reads a group without ``decoupled_weight_decay`` as L2 decay: a
    LowBitAdamW run handed to ``Adam(decoupled_weight_decay=True)`` went on with L2 decay
    (0.036 off the uninterrupted run after 3 more steps)."""
    import mixprec.optim.states as states

    decoupled = cls == "LowBitAdamW"
    w0 = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
    grads = [torch.randn(16, 16, generator=torch.Generator().manual_seed(s)) for s in range(6)]
    kw = dict(lr=1e-2, weight_decay=0.5)
    ref = nn.Parameter(w0.clone())
    whole = torch.optim.Adam([ref], decoupled_weight_decay=decoupled, **kw)
    p = nn.Parameter(w0.clone())
    low = getattr(states, cls)([p], states="float32", compile=False, **kw)
    for s in range(6):
        ref.grad = grads[s]
        whole.step()
        if s < 3:
            p.grad = grads[s]
            low.step()
    handed = low.to_float32_state_dict()
    assert handed["param_groups"][0]["decoupled_weight_decay"] is decoupled
    torch_opt = torch.optim.Adam([p], decoupled_weight_decay=decoupled, **kw)
    torch_opt.load_state_dict(handed)
    for s in range(3, 6):
        p.grad = grads[s]
        torch_opt.step()
    torch.testing.assert_close(p, ref, rtol=0, atol=1e-6)
