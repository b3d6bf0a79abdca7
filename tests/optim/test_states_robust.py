"""The low-bit optimizers on inputs that used to break them: state dicts of the wrong shape,
format or algorithm (refused at load, the optimizer left as it was), states converted to the
loading optimizer's format, complex parameters, zero-size and sub-block parameters under
stochastic rounding, a momentum raised from 0, a bfloat16 default dtype, blocks larger than
the parameter, sparse gradients, and a low-bit state handed to a torch optimizer."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from mixprec import LossScaleOptimizer, Precision
from mixprec.optim.states import (
    AdamW4bit,
    AdamW8bit,
    AdamWFp8,
    LowBitAdam,
    LowBitAdamW,
    LowBitSGD,
    StateFormat,
    dequantize,
    from_optimizer,
    quantize,
    state_bytes,
)

KW = dict(compile=False)


def _params(shapes=((64, 128), (96,)), dtype=torch.float32, seed=0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    drawn = dtype if dtype.is_complex else torch.float32  # (whatever the default dtype)
    return [nn.Parameter(torch.randn(s, generator=g, dtype=drawn).to(dtype)) for s in shapes]


def _run(opt: torch.optim.Optimizer, params: list[nn.Parameter], steps: range) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(1000 + i)
        for p in params:
            drawn = p.dtype if p.is_complex() else torch.float32
            p.grad = torch.randn(p.shape, generator=g, dtype=drawn).to(p.dtype)
        opt.step()


def _gap(a: torch.Tensor, b: torch.Tensor, reduce=torch.amax) -> float:
    """The largest (or, with ``torch.mean``, the mean) absolute difference of two tensors."""
    return float(reduce((a.detach() - b.detach()).abs()))


def _snapshot(opt: torch.optim.Optimizer) -> tuple[list, list]:
    """Everything a load could change: each state's values (tensors as bytes) and groups."""
    states = [
        {k: (v.dtype, v.view(torch.uint8).clone() if v.dtype == torch.float8_e4m3fn else v.clone())
         if torch.is_tensor(v) else v for k, v in s.items()}
        for s in opt.state.values()
    ]  # fmt: skip
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return states, groups


def _same(a: tuple[list, list], b: tuple[list, list]) -> bool:
    def equal(x, y):
        if isinstance(x, tuple) and len(x) == 2 and torch.is_tensor(x[1]):
            return x[0] == y[0] and torch.equal(x[1], y[1])
        return x == y

    return (
        a[1] == b[1]
        and len(a[0]) == len(b[0])
        and all(
            s.keys() == t.keys() and all(equal(s[k], t[k]) for k in s)
            for s, t in zip(a[0], b[0], strict=True)
        )
    )


# -- item 3: refused at load, naming the parameter, before changing anything ---------------------


def _torch_adamw_state(params: list[nn.Parameter]) -> dict:
    opt = torch.optim.AdamW(params, lr=1e-2)
    _run(opt, params, range(2))
    return copy.deepcopy(opt.state_dict())


def _transposed(state: dict) -> None:
    state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"].t().contiguous()


def _truncated(state: dict) -> None:
    state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"].reshape(-1)[:10].clone()


def _dropped(state: dict) -> None:
    del state["state"][0]["exp_avg_sq"]


@pytest.mark.parametrize(
    "spoil, message",
    [
        (_transposed, r"'exp_avg' of parameter 0 \(shape \[64, 128\]\) is torch.float32 of "
         r"shape \[128, 64\]"),
        (_truncated, r"'exp_avg' of parameter 0 \(shape \[64, 128\]\) is torch.float32 of "
         r"shape \[10\]"),
        (_dropped, r"parameter 0 \(shape \[64, 128\]\) lacks \['exp_avg_sq'\]"),
    ],
    ids=["transposed", "truncated", "missing"],
)  # fmt: skip
def test_a_torch_state_of_the_wrong_shape_is_refused_naming_the_parameter(spoil, message):
    params = _params()
    saved = _torch_adamw_state(params)
    spoil(saved)
    opt = AdamW8bit(params, lr=1e-2, min_size=1000, **KW)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(saved)
    assert not opt.state


def _short_codes(state: dict) -> None:
    state["state"][0]["exp_avg_codes"] = state["state"][0]["exp_avg_codes"][:-256].clone()


def _float_scales(state: dict) -> None:
    state["state"][0]["exp_avg_sq_scales"] = state["state"][0]["exp_avg_sq_scales"].double()


def _relabelled(state: dict) -> None:
    state["state"][0]["format"] = "int4"


def _unknown_format(state: dict) -> None:
    state["state"][0]["format"] = "int3"


def _missing_codes(state: dict) -> None:
    del state["state"][0]["exp_avg_sq_codes"]


def _stray_moment(state: dict) -> None:
    state["state"][0]["max_exp_avg_sq"] = torch.zeros(64, 128)


@pytest.mark.parametrize(
    "spoil, message",
    [
        (_short_codes, r"'exp_avg_codes' of parameter 0 \(shape \[64, 128\]\) is torch.uint8 "
         r"of shape \[7936\]; its int8 state keeps torch.uint8 of shape \[8192\]"),
        (_float_scales, r"'exp_avg_sq_scales' of parameter 0 .* is torch.float64"),
        (_relabelled, r"'exp_avg_codes' of parameter 0 .* its int4 state keeps torch.uint8 of "
         r"shape \[4096\]"),
        (_unknown_format, r"saved state of parameter 0 \(shape \[64, 128\]\): unknown state "
         r"format 'int3'"),
        (_missing_codes, r"parameter 0 \(shape \[64, 128\]\) lacks \['exp_avg_sq_codes'\]"),
        (_stray_moment, r"parameter 0 \(shape \[64, 128\]\) holds \['max_exp_avg_sq'\], which "
         r"AdamW8bit's int8 states do not"),
    ],
    ids=["short-codes", "float64-scales", "relabelled", "unknown-format", "missing-codes",
         "stray-moment"],
)  # fmt: skip
def test_a_low_bit_state_of_the_wrong_layout_is_refused_and_changes_nothing(spoil, message):
    params = _params()
    source = AdamW8bit(params, lr=1e-2, min_size=1000, **KW)
    _run(source, params, range(2))
    saved = copy.deepcopy(source.state_dict())
    spoil(saved)
    # a stepped optimizer whose state the failed load must leave exactly as it was
    opt = AdamW8bit(params, lr=3e-3, min_size=1000, **KW)
    _run(opt, params, range(3))
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(saved)
    assert _same(_snapshot(opt), before)
    assert opt.param_groups[0]["lr"] == 3e-3


def test_a_bad_last_parameter_leaves_the_earlier_ones_unloaded():
    params = _params()
    source = AdamW8bit(params, lr=1e-2, min_size=1000, **KW)
    _run(source, params, range(4))
    saved = copy.deepcopy(source.state_dict())
    saved["state"][1]["exp_avg"] = saved["state"][1]["exp_avg"][:5].clone()
    opt = AdamW8bit(params, lr=3e-3, min_size=1000, **KW)
    _run(opt, params, range(1))
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=r"parameter 1 \(shape \[96\]\)"):
        opt.load_state_dict(saved)
    assert _same(_snapshot(opt), before)
    assert int(opt.state[params[0]]["step"]) == 1


def test_another_algorithms_state_is_refused_by_its_group_settings():
    params = _params()
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    _run(sgd, params, range(1))
    with pytest.raises(ValueError, match=r"lacks \['betas', 'eps'\], which AdamW8bit needs"):
        AdamW8bit(params, **KW).load_state_dict(copy.deepcopy(sgd.state_dict()))
    adamw = _torch_adamw_state(params)
    with pytest.raises(ValueError, match=r"lacks \['dampening', 'momentum', 'nesterov'\]"):
        LowBitSGD(params, lr=0.1, momentum=0.9, **KW).load_state_dict(adamw)
    # a torch SGD state still loads into LowBitSGD (no step count: torch's SGD keeps none)
    low_sgd = LowBitSGD(params, lr=0.1, momentum=0.9, min_size=1000, **KW)
    low_sgd.load_state_dict(copy.deepcopy(sgd.state_dict()))
    assert low_sgd.state[params[0]]["format"] == "int8"
    assert int(low_sgd.state[params[0]]["step"]) == 0
    _run(low_sgd, params, range(1, 2))


@pytest.mark.parametrize("flag", ["amsgrad", "maximize", "capturable", "differentiable"])
def test_a_group_stepped_with_a_flag_the_step_ignores_is_refused_on_load(flag):
    """(capturable and differentiable loaded and stayed in the groups, ignored)"""
    params = _params()
    opt = torch.optim.AdamW(params, **{flag: True})
    state = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=rf"group 0 was stepped with {flag} \("):
        LowBitAdamW(params, **KW).load_state_dict(state)


# -- formats: a state saved in another format takes the loading optimizer's ----------------------


def _moments(opt: torch.optim.Optimizer, p: torch.Tensor) -> list[torch.Tensor]:
    entry = opt.to_float32_state_dict()["state"]
    key = [q for g in opt.param_groups for q in g["params"]].index(p)
    return [entry[key]["exp_avg"], entry[key]["exp_avg_sq"]]


def test_an_int8_state_loads_into_adamw4bit_as_int4():
    params = _params()
    source = AdamW8bit(params, lr=1e-2, min_size=1000, **KW)
    _run(source, params, range(3))
    opt = AdamW4bit(params, lr=1e-2, min_size=1000, **KW)
    opt.load_state_dict(copy.deepcopy(source.state_dict()))
    state, big = opt.state[params[0]], params[0]
    assert state["format"] == "int4" and opt.param_groups[0]["states"] == "int4"
    assert state["exp_avg_codes"].numel() == big.numel() // 2  # two codes a byte
    assert state["exp_avg_scales"].numel() == big.numel() // 128
    for name, signed, original, loaded in zip(
        ("exp_avg", "exp_avg_sq"), (True, False), _moments(source, big), _moments(opt, big),
        strict=True,
    ):  # fmt: skip
        # exactly the int8 moment stored in int4, so within int4's error of it
        codes, scales = quantize(original, "int4", signed=signed)
        assert torch.equal(loaded, dequantize(codes, scales, "int4", big.shape, signed=signed))
        assert float((loaded - original).norm() / original.norm()) < 0.2, name  # int4's
    assert int(state["step"]) == 3
    _run(opt, params, range(3, 4))
    assert opt.state[big]["format"] == "int4"


def test_a_float32_state_of_ours_loads_quantized_and_back():
    params = _params()
    source = LowBitAdamW(params, lr=1e-2, states="float32", **KW)
    _run(source, params, range(2))
    opt = AdamWFp8(params, lr=1e-2, min_size=1000, **KW)
    opt.load_state_dict(copy.deepcopy(source.state_dict()))
    assert opt.state[params[0]]["format"] == "float8"
    back = LowBitAdamW(params, lr=1e-2, states="float32", **KW)
    back.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert back.state[params[0]]["format"] == "float32"
    assert back.state[params[0]]["exp_avg"].dtype == torch.float32


def test_a_group_whose_states_change_converts_at_its_next_step():
    params, reference = _params(), _params()
    opt = AdamW8bit(params, lr=1e-2, min_size=1000, **KW)
    ref = AdamW8bit(reference, lr=1e-2, min_size=1000, **KW)
    _run(opt, params, range(3))
    _run(ref, reference, range(3))
    opt.param_groups[0]["states"] = "int4"
    _run(opt, params, range(3, 4))
    _run(ref, reference, range(3, 4))
    state = opt.state[params[0]]
    assert state["format"] == "int4" and state["exp_avg_codes"].numel() == 64 * 128 // 2
    for ours, theirs in zip(_moments(opt, params[0]), _moments(ref, reference[0]), strict=True):
        assert float((ours - theirs).norm() / theirs.norm()) < 0.2  # int4's error
    assert opt.state[params[1]]["format"] == "float32"  # small: unchanged


# -- item 4: complex parameters step as torch steps them (real pairs) ----------------------------


@pytest.mark.parametrize("cls", [LowBitAdamW, LowBitAdam])
def test_complex_parameters_follow_torch(cls):
    torch_cls = torch.optim.AdamW if cls is LowBitAdamW else torch.optim.Adam
    shapes = ((40, 64), (7,))
    ours = _params(shapes, torch.complex64)
    ref = _params(shapes, torch.complex64)
    start = [p.detach().clone() for p in ref]
    lows = [_params(shapes, torch.complex64) for _ in range(2)]
    opt = cls(ours, lr=1e-2, weight_decay=0.1, states="float32", **KW)
    _run(opt, ours, range(20))
    _run(torch_cls(ref, lr=1e-2, weight_decay=0.1), ref, range(20))
    assert max(_gap(a, b) for a, b in zip(ref, start, strict=True)) > 0.1
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == torch.complex64
        assert _gap(a, b) < 5e-6
    assert opt.state[ours[0]]["exp_avg"].dtype == torch.complex64
    for fmt, low in zip(("int8", "int4"), lows, strict=True):
        low_opt = cls(low, lr=1e-2, weight_decay=0.1, states=fmt, min_size=1000, **KW)
        _run(low_opt, low, range(20))
        # 2560 complex elements are 5120 real ones: int8's 20 blocks, int4's 40
        assert low_opt.state[low[0]]["exp_avg_scales"].numel() == 5120 // StateFormat(fmt).block
        most = 5e-3 if fmt == "int8" else 5e-2
        assert _gap(low[0], ref[0], torch.mean) < most
    # the float32 state goes to torch and back as complex moments
    plain = torch_cls(ours, lr=1e-2, weight_decay=0.1)
    plain.load_state_dict(copy.deepcopy(opt.to_float32_state_dict()))
    assert plain.state[ours[0]]["exp_avg"].dtype == torch.complex64
    quantized = cls(ours, lr=1e-2, states="int8", min_size=1000, **KW)
    quantized.load_state_dict(copy.deepcopy(plain.state_dict()))
    back = _moments(quantized, ours[0])[0]
    exact = opt.state[ours[0]]["exp_avg"]
    assert back.dtype == torch.complex64 and float((back - exact).norm() / exact.norm()) < 0.02


# -- item 5: stochastic rounding of zero-size and sub-block parameters ---------------------------


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8", "float32"])
def test_stochastic_rounding_steps_zero_size_and_sub_block_parameters(fmt):
    shapes = ((0,), (3,), (100,), (300,))
    params = _params(shapes, torch.bfloat16)
    ref = [nn.Parameter(p.detach().float()) for p in params]
    opt = LowBitAdamW(params, lr=1e-2, states=fmt, min_size=0, compensation="stochastic", **KW)
    _run(opt, params, range(3))
    _run(torch.optim.AdamW(ref, lr=1e-2), ref, range(3))
    assert params[0].shape == (0,) and int(opt.state[params[0]]["step"]) == 3
    for p, r in zip(params[1:], ref[1:], strict=True):
        # within a few bfloat16 spacings (2^-7 at 1..2) of float32 AdamW, each weight moved
        # about 0.02
        assert _gap(p.float(), r) < 0.04
        assert _gap(p.float(), r, torch.mean) < 0.01


def test_stochastic_round_refuses_a_source_of_another_shape():
    from mixprec.optim.compensated import stochastic_round_

    dst = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"src of shape \[256\] into dst of shape \[3\]"):
        stochastic_round_(dst, torch.ones(256))


# -- item 6: a momentum raised from 0 starts its buffer as torch's SGD does ----------------------


@pytest.mark.parametrize("nesterov, dampening", [(False, 0.0), (False, 0.3), (True, 0.0)])
def test_a_momentum_warm_up_follows_torch_sgd(nesterov, dampening):
    ours, ref = _params(), _params()
    opt = LowBitSGD(ours, lr=1e-2, momentum=0.0, weight_decay=1e-3, states="float32", **KW)
    torch_opt = torch.optim.SGD(ref, lr=1e-2, momentum=0.0, weight_decay=1e-3)
    # momentum 0, raised, back to 0 (the buffer kept), raised again (the buffer resumed)
    for momentum, steps in [(0.0, range(2)), (0.5, range(2, 4)), (0.0, range(4, 5)),
                            (0.9, range(5, 8))]:  # fmt: skip
        for o in (opt, torch_opt):
            for g in o.param_groups:
                g.update(momentum=momentum, nesterov=nesterov and momentum > 0,
                         dampening=dampening)  # fmt: skip
        _run(opt, ours, steps)
        _run(torch_opt, ref, steps)
        for a, b in zip(ours, ref, strict=True):
            assert _gap(a, b) < 1e-6
    for p, q in zip(ours, ref, strict=True):
        buffer = torch_opt.state[q]["momentum_buffer"]
        assert float((opt.state[p]["momentum_buffer"] - buffer).abs().max()) < 1e-6


def test_a_momentum_warm_up_with_low_bit_buffers_steps():
    params, ref = _params(), _params()
    opt = LowBitSGD(params, lr=1e-2, momentum=0.0, min_size=1000, **KW)
    torch_opt = torch.optim.SGD(ref, lr=1e-2, momentum=0.0)
    _run(opt, params, range(1))
    _run(torch_opt, ref, range(1))
    for o in (opt, torch_opt):
        o.param_groups[0]["momentum"] = 0.9
    _run(opt, params, range(1, 4))
    _run(torch_opt, ref, range(1, 4))
    assert "momentum_buffer_codes" in opt.state[params[0]]
    assert _gap(params[0], ref[0]) < 5e-3


# -- item 8: a bfloat16 default dtype ------------------------------------------------------------


MAKERS = {
    "LowBitAdamW": lambda ps, fmt: LowBitAdamW(ps, lr=1e-2, states=fmt, min_size=1000, **KW),
    "LowBitAdam": lambda ps, fmt: LowBitAdam(ps, lr=1e-2, states=fmt, min_size=1000, **KW),
    "LowBitSGD": lambda ps, fmt: LowBitSGD(
        ps, lr=1e-2, momentum=0.9, states=fmt, min_size=1000, **KW
    ),
    "AdamW8bit": lambda ps, fmt: AdamW8bit(ps, lr=1e-2, min_size=1000, **KW),
    "AdamW4bit": lambda ps, fmt: AdamW4bit(ps, lr=1e-2, min_size=1000, **KW),
    "AdamWFp8": lambda ps, fmt: AdamWFp8(ps, lr=1e-2, min_size=1000, **KW),
}
CASES = [
    (name, fmt)
    for name in MAKERS
    for fmt in (["float32", "int8", "int4", "fp8"] if name.startswith("LowBit") else [None])
]


@pytest.mark.parametrize("name, fmt", CASES)
def test_a_bfloat16_default_dtype_changes_nothing(name, fmt):
    make = MAKERS[name]
    expected = _params()
    _run(make(expected, fmt), expected, range(2))
    torch.set_default_dtype(torch.bfloat16)
    try:
        params = _params()
        opt = make(params, fmt)
        _run(opt, params, range(2))
        # and a torch state loads under it too
        loaded = make(_params(), fmt)
        loaded.load_state_dict(copy.deepcopy(opt.to_float32_state_dict()))
    finally:
        torch.set_default_dtype(torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(params, expected, strict=True))
    floats = {
        v.dtype for s in opt.state.values() for k, v in s.items()
        if torch.is_tensor(v) and v.is_floating_point() and not k.endswith("_codes")
    }  # fmt: skip
    assert floats == {torch.float32}


# -- blocks larger than the parameter -------------------------------------------------------------


def test_a_block_larger_than_the_parameter_is_cut_to_it():
    p = nn.Parameter(torch.randn(4096))
    opt = AdamW8bit([p], block_size=65536, min_size=0, **KW)
    _run(opt, [p], range(1))
    assert opt.state[p]["format"] == "int8/block=4096"
    assert state_bytes(opt) == 2 * (4096 + 4)  # codes and one scale per moment
    # a huge block asks for no more than the parameter's default blocks take
    q = nn.Parameter(torch.randn(1000))
    huge = LowBitAdamW(
        [{"params": [q], "states": f"int4/block={1 << 30}"}], states="int8", min_size=0, **KW
    )
    _run(huge, [q], range(1))
    assert huge.state[q]["format"] == "int4/block=1024"
    assert state_bytes(huge) == 2 * (1024 // 2 + 4)
    # a block the parameter fills is kept
    r = nn.Parameter(torch.randn(5000))
    kept = AdamW8bit([r], block_size=1024, min_size=0, **KW)
    _run(kept, [r], range(1))
    assert kept.state[r]["format"] == "int8/block=1024"


# -- sparse gradients ------------------------------------------------------------------------------


def test_a_sparse_gradient_is_refused_before_any_parameter_is_stepped():
    dense = nn.Linear(8, 4)
    embed = nn.Embedding(10, 8, sparse=True)
    params = [*dense.parameters(), embed.weight]
    opt = LowBitAdamW(params, lr=1e-2, **KW)
    (dense(embed(torch.tensor([1, 2]))).sum()).backward()
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError) as refused:
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert not opt.state
    message = str(refused.value)
    assert "parameter 2, shape [10, 8]" in message and "nothing was updated" in message
    assert "sparse=False" in message and "torch.optim.SparseAdam" in message


# -- a low-bit state dict handed to a torch optimizer ----------------------------------------------


def test_a_loss_scale_optimizer_over_torch_refuses_a_low_bit_state_naming_the_way_out():
    params = _params()
    low = AdamW8bit(params, lr=1e-2, min_size=1000, **KW)
    _run(low, params, range(1))
    wrapped = LossScaleOptimizer(torch.optim.AdamW(params, lr=1e-2))
    with pytest.raises(ValueError, match=r"to_float32_state_dict\(\)"):
        wrapped.load_state_dict(copy.deepcopy(low.state_dict()))
    low_wrapped = LossScaleOptimizer(low)
    with pytest.raises(ValueError, match=r"to_float32_state_dict\(\)"):
        wrapped.load_state_dict(copy.deepcopy(low_wrapped.state_dict()))
    assert not wrapped.optimizer.state
    wrapped.load_state_dict(copy.deepcopy(low.to_float32_state_dict()))
    assert wrapped.optimizer.state[params[0]]["exp_avg"].dtype == torch.float32


def _copies_step_alike(make, copy_of) -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(20, 30)), nn.Parameter(torch.randn(300))]
    opt = make(params)
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    twin = copy_of(opt)
    twins = [p for group in twin.param_groups for p in group["params"]]
    for seed in range(2, 4):
        g = torch.Generator().manual_seed(seed)
        for p, q in zip(params, twins, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        twin.step()
    for p, q in zip(params, twins, strict=True):
        assert torch.equal(p, q)


def _pickled(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copy_of", [copy.deepcopy, _pickled], ids=["deepcopy", "pickle"])
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: LowBitAdamW(ps, states="int8", min_size=500, compile=False, seed=3),
        lambda ps: LowBitSGD(ps, lr=0.1, momentum=0.9, states="fp8", min_size=0, compile=False),
    ],
    ids=["adamw-int8", "sgd-fp8"],
)
def test_a_copied_or_pickled_optimizer_steps_as_the_original(make, copy_of):
    """Its settings live in attributes (formats, min_size, the seed, the compile gate),
    which torch's pickling of optimizers leaves out: a copy failed at its first step
    ('no attribute min_size'). Now a deepcopy and a pickled copy step as the original,
    bit for bit."""
    _copies_step_alike(make, copy_of)


def test_a_state_dict_loads_back_into_its_optimizer_again_and_again():
    """torch's loader adds 'differentiable' to the optimizer's defaults, and the next load
    refused every saved group as 'another optimizer class' for lacking it."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(300))]
    opt = LowBitAdamW(params, states="int8", min_size=0, compile=False)
    params[0].grad = torch.randn(300)
    opt.step()
    for _ in range(3):
        opt.load_state_dict(opt.state_dict())
    opt.step()
    assert int(opt.state[params[0]]["step"]) == 2


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
@pytest.mark.parametrize("fmt", ["int8", "float32"])
def test_kahan_steps_a_non_contiguous_bfloat16_weight_as_its_contiguous_copy(layout, fmt):
    """A bfloat16 weight laid out transposed or channels-last (its Kahan buffer made in its
    layout, as `zeros_like` makes it) steps as the same weight laid out contiguously, bit
    for bit, weights and buffers; the buffer keeps its layout. (The buffer was read as a
    flat view, which such a layout has not: the step raised.)"""
    g = torch.Generator().manual_seed(0)
    if layout == "transposed":
        odd = torch.randn(70, 90, generator=g).t()
    else:
        odd = torch.randn(8, 6, 5, 5, generator=g).contiguous(memory_format=torch.channels_last)
    odd = nn.Parameter(odd.to(torch.bfloat16))
    plain = nn.Parameter(odd.detach().contiguous())
    assert not odd.is_contiguous()
    opts = [
        LowBitAdamW([p], lr=1e-2, states=fmt, min_size=0, compensation="kahan", compile=False)
        for p in (odd, plain)
    ]
    for _ in range(3):
        grad = torch.randn(odd.shape, generator=g).to(torch.bfloat16)
        odd.grad, plain.grad = grad.clone(), grad.clone()
        for opt in opts:
            opt.step()
    assert torch.equal(odd, plain)
    buffers = [opt.state[p]["compensation"] for opt, p in zip(opts, (odd, plain), strict=True)]
    assert torch.equal(*buffers)
    assert buffers[0].stride() == odd.stride()
    assert buffers[0].abs().sum() > 0  # (the buffers hold what rounding lost)


def _fresh(function):
    """A copy of ``function`` with a code object of its own, which dynamo caches apart."""
    import types

    code, names = function.__code__.replace(), function.__globals__
    return types.FunctionType(code, names, function.__name__, function.__defaults__)


def test_dynamos_build_limit_falls_back_to_eager_under_compile_none(monkeypatch):
    """Builds of the update accumulate in a process (formats, dtypes, compensations, other
    optimizers); past dynamo's limit a further one is refused. Under compile=None that
    step, and every later one, runs eagerly with one warning saying why, as the same
    optimizer with compile=False steps, bit for bit; under compile=True it raises. (It
    raised under None too: a default step failing after enough builds elsewhere.)"""
    from mixprec.optim.engine import can_compile
    from mixprec.optim.states import kernels, native
    from mixprec.optim.states import optimizers as optimizers_module

    if not can_compile("cpu"):
        pytest.skip("compile=None compiles nothing without a C++ compiler on this host")

    # a limit of no builds at all: the first call is refused at once, before anything
    # runs; of a copy of the update (its own code object: no build of an earlier test
    # in this process serves it)
    refuse = torch._dynamo.config._make_closure_patcher(
        recompile_limit=0, automatic_dynamic_shapes=False
    )
    monkeypatch.setattr(kernels, "_apply_settings", refuse)
    monkeypatch.setattr(kernels, "_KERNELS", {"adam": _fresh(kernels.adam_update)})
    monkeypatch.setattr(kernels, "_COMPILED", {})
    monkeypatch.setattr(optimizers_module, "COMPILE_MIN_ELEMENTS", 0)
    monkeypatch.setattr(native, "library", lambda: None)  # (the build is the subject)
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(1000, generator=g)) for _ in range(2)]
    plain = [nn.Parameter(p.detach().clone()) for p in params]
    auto = LowBitAdamW(params, min_size=0, compile=None)
    eager = LowBitAdamW(plain, min_size=0, compile=False)
    for step in range(2):
        grads = [torch.randn(1000, generator=g) for _ in params]
        for p, q, grad in zip(params, plain, grads, strict=True):
            p.grad, q.grad = grad.clone(), grad.clone()
        if step == 0:
            with pytest.warns(UserWarning, match="limit of builds.*runs eagerly"):
                auto.step()
        else:
            auto.step()
        eager.step()
    for p, q in zip(params, plain, strict=True):
        assert torch.equal(p, q)
    forced = LowBitAdamW([nn.Parameter(torch.randn(1000))], min_size=0, compile=True)
    forced.param_groups[0]["params"][0].grad = torch.randn(1000)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        forced.step()


def test_a_copy_of_an_optimizer_precision_converted_steps_its_own_parameters():
    """Precision.setup's conversion linked the new optimizer to the torch one by closures
    over the originals: a deep copy of the converted optimizer stepped the original's
    parameters (and asked the original's ids which to keep float32), and pickling failed."""
    import mixprec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 64), nn.Linear(64, 64))
    precision = mixprec.Precision("32-true", optimizer_states="int8")
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.arange(4)

    def step(m, o):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()

    step(model, opt.optimizer)
    model2, low2 = copy.deepcopy((model, opt.optimizer))
    before, before2 = model[1].weight.detach().clone(), model2[1].weight.detach().clone()
    step(model2, low2)
    assert torch.equal(model[1].weight, before)  # the original did not move
    assert not torch.equal(model2[1].weight, before2)
    formats = {n: low2.state[p]["format"] for n, p in model2.named_parameters()}
    assert formats == {"0.weight": "float32", "1.weight": "int8", "1.bias": "float32"}
    assert low2.stands_for is not opt.optimizer.stands_for  # (the torch one, copied too)
    _pickled(opt.optimizer)


@pytest.mark.parametrize("shapes", [((64, 128),), ((64, 128), (96, 32))], ids=["alone", "bucket"])
def test_kahan_takes_up_weights_cast_to_bfloat16_after_float32_steps(shapes):
    """A Kahan buffer was made only at a parameter's first step, if 16-bit then: a model
    cast to bfloat16 after float32 steps (Precision('bf16-true').setup does) raised a
    KeyError or an AssertionError at its next step."""
    params = _params(shapes)
    opt = LowBitAdamW(params, states="int8", min_size=0, compensation="kahan", **KW)
    _run(opt, params, range(2))
    for p in params:
        p.data = p.data.to(torch.bfloat16)
    _run(opt, params, range(2, 4))
    for p in params:
        buf = opt.state[p]["compensation"]
        assert buf.dtype == torch.bfloat16 and buf.shape == p.shape and buf.abs().sum() > 0


@pytest.mark.parametrize("states", ["float32", "int8", "int4", "float8"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_float64_weights_step_in_float64(states, dtype, monkeypatch):
    """float64 weights were rounded to float32 at every step (1 + 1e-12 became 1 at lr 0);
    now the update runs in float64 and follows torch's AdamW to the moments' storage. float8
    moments coded on an AVX2 CPU (their e4m3 bytes made from float32 bits: taken here on any
    CPU) read a float64 update's bits as twice as many codes, and the step raised."""
    from mixprec.optim.states import codecs

    monkeypatch.setattr(codecs, "_AVX2", True)
    params = _params(((48, 64),), dtype=dtype)
    with torch.no_grad():
        params[0].add_(1e-12)
    kept = params[0].detach().clone()
    opt = LowBitAdamW(params, lr=0.0, states=states, min_size=0, **KW)
    _run(opt, params, range(2))
    assert torch.equal(params[0], kept)
    ours, theirs = _params(((48, 64),), dtype=dtype), _params(((48, 64),), dtype=dtype)
    _run(LowBitAdamW(ours, lr=1e-2, states=states, min_size=0, **KW), ours, range(3))
    _run(torch.optim.AdamW(theirs, lr=1e-2), theirs, range(3))
    err = (ours[0] - theirs[0]).abs().max().item()
    assert err < {"float32": 1e-6, "int8": 1e-3, "int4": 2e-2, "float8": 1e-2}[states], err
    sgd = _params(((48, 64),), dtype=dtype)
    with torch.no_grad():
        sgd[0].add_(1e-12)
    kept = sgd[0].detach().clone()
    _run(LowBitSGD(sgd, lr=0.0, momentum=0.9, states=states, min_size=0, **KW), sgd, range(2))
    assert torch.equal(sgd[0], kept)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_float64_weights_take_their_hyperparameters_in_double(dtype):
    """A float64 update read its learning rate, betas and decay as float32 values (lr 0.1
    became 0.10000000149), so it left torch's float64 step by about 5e-8 of the update.
    Where the moments' storage rounds nothing (SGD without momentum; Adam's first step,
    from zero moments) the two now agree to float64's own rounding: a few units in the last
    place where they were about 1e-8 apart."""
    ours, theirs = _params(((48, 64),), dtype=dtype), _params(((48, 64),), dtype=dtype)
    sgd = dict(lr=0.1, weight_decay=0.1)
    _run(LowBitSGD(ours, states="float32", min_size=0, **sgd, **KW), ours, range(3))
    _run(torch.optim.SGD(theirs, **sgd), theirs, range(3))
    real = torch.view_as_real if dtype.is_complex else (lambda t: t)
    assert _gap(real(ours[0]), real(theirs[0])) < 1e-14  # (torch's step fuses a multiply-add)
    ours, theirs = _params(((48, 64),), dtype=dtype), _params(((48, 64),), dtype=dtype)
    adam = dict(lr=0.1, betas=(0.7, 0.9), weight_decay=0.3)
    _run(LowBitAdamW(ours, states="int8", min_size=0, **adam, **KW), ours, range(1))
    _run(torch.optim.AdamW(theirs, foreach=False, **adam), theirs, range(1))
    assert _gap(real(ours[0]), real(theirs[0])) < 1e-14


@pytest.mark.parametrize("states", ["float32", "int8"])
@pytest.mark.parametrize("cls", [LowBitAdamW, LowBitAdam, LowBitSGD])
def test_a_complex128_parameters_export_steps_in_torch(cls, states):
    """Found by a review: `to_float32_state_dict()` gave a complex128 parameter complex64
    moments; torch's optimizer loads them as they are (it casts only a real parameter's
    state) and failed at its step ("expected dtype float for `end` but got dtype double").
    They are exported in the parameter's dtype, of the values the low-bit state decodes to,
    and torch steps on from them as this optimizer does."""
    torch_cls = {LowBitAdamW: torch.optim.AdamW, LowBitAdam: torch.optim.Adam}
    kw = dict(lr=1e-2) if cls is not LowBitSGD else dict(lr=1e-2, momentum=0.9)
    ours = _params(((48, 64),), dtype=torch.complex128)
    opt = cls(ours, states=states, min_size=0, **kw, **KW)
    _run(opt, ours, range(2))
    exported = opt.to_float32_state_dict()
    names = ("momentum_buffer",) if cls is LowBitSGD else ("exp_avg", "exp_avg_sq")
    state = opt.state[ours[0]]
    for name in names:
        if states == "float32":
            decoded = state[name]
        else:
            codes, scales = state[f"{name}_codes"], state[f"{name}_scales"]
            real = dequantize(codes, scales, states, (48, 64, 2), signed=name != "exp_avg_sq")
            decoded = torch.view_as_complex(real)
        moment = exported["state"][0][name]
        assert moment.dtype == torch.complex128
        assert torch.equal(moment, decoded.to(torch.complex128))
    theirs = [nn.Parameter(ours[0].detach().clone())]
    plain = torch_cls.get(cls, torch.optim.SGD)(theirs, **kw)
    plain.load_state_dict(copy.deepcopy(exported))
    _run(plain, theirs, range(2, 3))
    if states == "float32":  # (int8 rounds its moments again at the step)
        _run(opt, ours, range(2, 3))
        assert _gap(torch.view_as_real(ours[0]), torch.view_as_real(theirs[0])) < 1e-6


@pytest.mark.parametrize("flag", ["maximize", "amsgrad", "capturable", "differentiable"])
@pytest.mark.parametrize("cls", [LowBitAdamW, LowBitSGD])
def test_a_group_asking_for_a_flag_the_step_ignores_is_refused(cls, flag):
    """The constructor and the converters refused these; a group holding one (in the
    constructor's groups or add_param_group) was taken and stepped without it (a
    maximizing SGD minimized)."""
    params = _params()
    with pytest.raises(ValueError, match=f"sets {flag} \\("):
        cls([{"params": params[:1], flag: True}], **KW)
    opt = cls(params[:1], **KW)
    with pytest.raises(ValueError, match=f"sets {flag} \\("):
        opt.add_param_group({"params": params[1:], flag: True})
    opt.add_param_group({"params": params[1:], flag: False})  # (off: taken)


@pytest.mark.parametrize("flag", ["maximize", "amsgrad", "capturable", "differentiable"])
@pytest.mark.parametrize("cls", [LowBitAdamW, LowBitSGD])
def test_a_flag_set_on_a_group_after_construction_is_refused_at_the_step(cls, flag):
    """A group given the flag later (``opt.param_groups[0]["maximize"] = True``) was
    stepped without it: a maximizing optimizer minimized, silently. The step refuses it
    before any parameter moves, and steps again once it is set back."""
    params = _params()
    opt = cls(params, **KW)
    _run(opt, params, range(1))
    before = [p.detach().clone() for p in params]
    opt.param_groups[0][flag] = True
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=f"parameter group 0 of {cls.__name__} sets {flag}"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    opt.param_groups[0][flag] = False
    opt.step()
    assert not all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_a_parameter_listed_twice_in_a_group_is_refused():
    """It counted two steps and took one from the same old state."""
    p = _params(((64, 96),))[0]
    with pytest.raises(ValueError, match=r"lists a parameter of shape \[64, 96\] twice"):
        AdamW8bit([p, p], **KW)


def test_a_parameter_listed_twice_by_an_iterator_group_is_refused():
    """A group's parameters given as an iterator (``itertools.chain`` of two modules'
    parameters, one of them tied to both) went past the check, which read lists only: the
    weight moved two steps' worth while its count said one. The group's parameters are read
    as the list torch makes of them, and that list is checked."""
    import itertools

    tied = _params(((64, 96),))[0]
    with pytest.raises(ValueError, match=r"lists a parameter of shape \[64, 96\] twice"):
        AdamW8bit([{"params": itertools.chain([tied], iter([tied]))}], **KW)
    p, q = _params(((64, 96), (32, 8)))
    opt = AdamW8bit([{"params": (t for t in (p, q))}], **KW)  # (read once, kept as a list)
    assert opt.param_groups[0]["params"] == [p, q]


def test_a_parameter_named_twice_is_refused():
    """Found by a review: a group given as (name, parameter) pairs went past the check,
    which looked at the pairs, not their parameters: a tied weight listed under both names
    (``named_parameters(remove_duplicate=False)``) moved about twice as far a step."""
    tied = _params(((64, 96),))[0]
    with pytest.raises(ValueError, match=r"lists a parameter of shape \[64, 96\] twice"):
        AdamW8bit([("embed.weight", tied), ("head.weight", tied)], **KW)
    p, q = _params(((64, 96), (32, 8)))
    opt = AdamW8bit([("a", p), ("b", q)], **KW)  # (distinct parameters: taken, named)
    assert opt.param_groups[0]["params"] == [p, q]


def test_a_state_dict_leaves_the_live_state_as_it_was():
    """The layout a state dict records ("shards") went into the live state too (torch's
    state dict holds the state's own dicts), where a later load found an int among the
    tensors."""
    params = _params()
    opt = AdamW8bit(params, min_size=0, **KW)
    _run(opt, params, range(1))
    before = {p: set(s) for p, s in opt.state.items()}
    saved = opt.state_dict()
    assert saved["state"][0]["shards"] == 1
    assert {p: set(s) for p, s in opt.state.items()} == before
    assert all("shards" not in s for s in opt.state.values())


@pytest.mark.parametrize("states", ["float32", "int8", "int4", "fp8"])
@pytest.mark.parametrize("size, alone", [(50, False), (1000, False), (300, True), (800, False)])
def test_a_parameter_resized_after_its_first_step_is_refused(states, size, alone):
    """A parameter whose data is replaced by one of another size no longer fits its state.
    torch's fused kernel (float32 moments) read past a smaller one; low-bit moments were
    stepped with the old blocks silently (a parameter stepped alone, or in a bucket of the
    same number of blocks) or failed on a bare size check. Each is refused before any
    parameter moves, naming the parameter. (A low-bit state records its blocks, not its
    elements: a size within the same blocks is not seen.)"""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(600))] + ([] if alone else [nn.Parameter(torch.randn(300))])
    opt = LowBitAdamW(params, states=states, min_size=0, **KW)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    params[0].data = torch.randn(size)
    for p in params:
        p.grad = torch.randn_like(p)
    others = [p.detach().clone() for p in params[1:]]
    with pytest.raises(RuntimeError, match=r"parameter 0 \(shape \[\d+\]\) no longer has the size"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params[1:], others, strict=True))


def test_a_strided_gradient_of_a_float32_state_steps_its_own_elements():
    """torch's fused kernel, which steps float32 moments of float32 parameters, reads a
    strided gradient (``g[:, ::2]``, set by hand) as if its elements were consecutive: the
    step took the wrong elements (2e-2 off torch's AdamW, 5e-2 off its SGD), also for the
    biases `AdamW8bit` keeps in float32."""
    torch.manual_seed(0)
    w = torch.randn(20, 16)
    g = torch.randn(20, 32)[:, ::2]
    for ours_cls, torch_cls, kw in [
        (LowBitAdamW, torch.optim.AdamW, dict(lr=1e-2)),
        (LowBitSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
        (AdamW8bit, torch.optim.AdamW, dict(lr=1e-2)),  # (below min_size: float32 moments)
    ]:
        ours, ref = nn.Parameter(w.clone()), nn.Parameter(w.clone())
        extra = {} if ours_cls is AdamW8bit else {"states": "float32", "min_size": 0}
        ours.grad, ref.grad = g, g.contiguous()
        ours_cls([ours], **kw, **extra, **KW).step()
        torch_cls([ref], **kw, foreach=False).step()
        assert float((ours - ref).abs().max()) < 1e-6


def test_a_torch_optimizer_of_a_channels_last_weight_converts_and_steps():
    """torch makes the moments (and SGD's buffer, a copy of the gradient) of a channels-last
    weight channels-last; converted as they were, the next step could not read them as
    flat (``view size is not compatible``)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last)
    x = torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last)
    for make in (
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    ):
        for states in ("float32", "int8"):
            source = make(conv.parameters())
            conv.zero_grad()
            conv(x).square().mean().backward()
            source.step()
            low = from_optimizer(source, states, min_size=0, **KW)
            conv(x).square().mean().backward()
            low.step()
            assert all(torch.isfinite(p).all() for p in conv.parameters())


@pytest.mark.parametrize("step", [torch.tensor(3), torch.tensor([3.0])])
def test_a_saved_step_count_of_another_dtype_or_shape_loads_and_steps(step):
    """torch's optimizers step a saved count that is an int64 tensor or of shape [1]; the
    low-bit step failed on them (a cast error, or ``int()`` of a list). They load as a
    0-dim float32 count and step on."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(300))
    source = torch.optim.AdamW([nn.Parameter(p.detach().clone())], lr=1e-2)
    source.param_groups[0]["params"][0].grad = torch.randn(300)
    source.step()
    saved = copy.deepcopy(source.state_dict())
    saved["state"][0]["step"] = step
    opt = AdamW8bit([p], min_size=0, **KW)
    opt.load_state_dict(saved)
    p.grad = torch.randn(300)
    opt.step()
    assert opt.state[p]["step"].shape == () and float(opt.state[p]["step"]) == 4.0


def _adam_weights(optimizer_of, load=None, steps=5):
    """A weight after `steps` steps of fixed gradients (weight decay 0.5), the optimizer
    first loading `load`."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64))
    optimizer = optimizer_of([p])
    if load is not None:  # (a copy: torch's loader keeps the saved tensors, steps them)
        optimizer.load_state_dict(copy.deepcopy(load))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        p.grad = torch.randn(64, generator=g)
        optimizer.step()
    return p.detach(), optimizer


def test_an_adam_state_loaded_into_an_adamw_keeps_its_decoupled_decay():
    """A torch Adam state dict (``decoupled_weight_decay=False``) loaded into `LowBitAdamW`
    made it run L2 decay, silently (torch's AdamW sets the flag back to True on load); a
    group keeps this optimizer's form of decay, as it keeps its format."""
    _, adam = _adam_weights(lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.5), steps=3)
    saved = adam.state_dict()
    want, torch_adamw = _adam_weights(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.5), load=saved
    )
    got, ours = _adam_weights(
        lambda ps: LowBitAdamW(ps, lr=1e-2, weight_decay=0.5, states="float32"), load=saved
    )
    assert torch_adamw.param_groups[0]["decoupled_weight_decay"] is True
    assert ours.param_groups[0].get("decoupled_weight_decay", True) is True
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # an Adam keeps its L2 decay loading an AdamW's state (the moments are the same kind)
    _, adamw = _adam_weights(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.5), steps=3)
    saved = adamw.state_dict()
    l2, _ = _adam_weights(
        lambda ps: LowBitAdam(ps, lr=1e-2, weight_decay=0.5, states="float32"), load=saved
    )
    saved["param_groups"][0]["decoupled_weight_decay"] = False
    want, _ = _adam_weights(lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.5), load=saved)
    torch.testing.assert_close(l2, want, rtol=0, atol=1e-6)


def test_low_bit_adam_takes_torch_adams_positional_arguments():
    p = nn.Parameter(torch.randn(8))
    optimizer = LowBitAdam([p], 1e-3, (0.8, 0.99), 1e-6, 0.1, states="float32")
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        1e-3,
        (0.8, 0.99),
        1e-6,
        0.1,
    )
    assert LowBitAdam([p]).param_groups[0]["weight_decay"] == 0.0
    # torch's sixth positional argument, amsgrad: False taken, True refused saying why
    for cls in (LowBitAdam, LowBitAdamW):
        assert cls([p], 1e-3, (0.9, 0.999), 1e-8, 0.0, False).param_groups[0]["lr"] == 1e-3
        with pytest.raises(ValueError, match="does not support amsgrad"):
            cls([p], 1e-3, (0.9, 0.999), 1e-8, 0.0, True)


@pytest.mark.parametrize("states", ["float32", "int8"])
def test_a_low_bit_step_inside_a_compiled_function_runs_as_eagerly(states):
    """``torch.compile`` around the optimizer's step (a compiled training step) crashed in
    dynamo's tracing of the step's planning; the step runs outside it, as called eagerly."""
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(4096))
        optimizer = LowBitAdamW([p], states=states, min_size=0, compile=False)
        step = torch.compile(optimizer.step) if compiled else optimizer.step
        for i in range(3):
            p.grad = torch.full_like(p, 0.1 * (i + 1))
            step()
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("states", ["float32", "int8"])
def test_a_graph_saved_before_a_low_bit_step_is_refused_after_it(states):
    """A backward through a graph that saved a weight before the step fails, as after
    torch's foreach step, also where float32 moments take torch's fused CPU kernel (which
    writes without telling autograd)."""
    w = nn.Parameter(torch.ones(4096))
    w.grad = torch.ones_like(w)
    optimizer = LowBitAdamW([w], states=states, compile=False)
    loss = (w * w).sum()  # saves w
    optimizer.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_layer_written_while_frozen_drops_its_joined_kahan_buffer():
    """A parameter left out of a step (frozen) has its joined Kahan buffer released into a
    tensor of its own; the record of what the step last wrote followed the old buffer, so a
    weight loaded while frozen kept its old rounding error and moved at the next step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)).to(torch.bfloat16)
    optimizer = LowBitSGD(
        model.parameters(), lr=1e-3, states="int8", min_size=256, compensation="kahan",
        compile=False,
    )  # fmt: skip
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    for frozen in (False, False, False, True):
        model[1].requires_grad_(not frozen)
        optimizer.zero_grad()
        model(x).float().square().mean().backward()
        optimizer.step()
    model[1].load_state_dict({"weight": torch.full((32, 32), 1e-3), "bias": torch.zeros(32)})
    model[1].requires_grad_(True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    # what the weight carries (itself and its buffer) is the loaded value to within half a
    # spacing there (2^-18) and a step of the buffer's grid (2^-25: a step leaves that much
    # past a float32 tie, so it is kept): an old buffer kept whole was off by up to half the
    # old weights' spacing; a tie of half a spacing kept beside an odd weight moves it a
    # step, its buffer the other way (the buffer is rounded stochastically)
    loaded = torch.tensor(1e-3, dtype=torch.bfloat16).float()
    weight = model[1].weight.detach().float()
    carried = weight + optimizer.state[model[1].weight]["compensation"].float()
    assert float((carried - loaded).abs().max()) <= 2.0**-18 + 2.0**-25
    assert float((weight - loaded).abs().max()) <= 2.0**-17
    assert int((weight != loaded).sum()) <= 8


def test_a_float64_step_count_loads_as_it_was_saved():
    """Counts past 2^24 go on in float64; a load cast them to float32, rounding an odd count
    down: the resumed run was a step behind and drew other random bits."""
    p = nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    optimizer = LowBitAdamW([p], states="float32", compensation="stochastic", compile=False)
    p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.state[p]["step"] = torch.tensor(float(2**24 + 1), dtype=torch.float64)
    fresh = LowBitAdamW([p], states="float32", compensation="stochastic", compile=False)
    fresh.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    fresh.step()
    assert fresh.state[p]["step"].dtype == torch.float64
    assert int(fresh.state[p]["step"]) == 2**24 + 2


def test_a_refused_step_makes_no_momentum_buffer():
    """A step refused for a resized parameter had made the SGD momentum buffers of the
    parameters planned before it: their next step took a buffer started at (1 - dampening)
    times the gradient, where torch's starts it at the gradient."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(100)), nn.Parameter(torch.randn(100))
    groups = [{"params": [a], "momentum": 0.0}, {"params": [b], "momentum": 0.9}]
    ours = LowBitSGD(groups, lr=0.1, dampening=0.5, states="float32", compile=False)
    a2 = nn.Parameter(a.detach().clone())
    torch_sgd = torch.optim.SGD([a2], lr=0.1, dampening=0.5)
    a.grad, b.grad = torch.randn(100), torch.randn(100)
    ours.step()  # a without momentum: no buffer; b's made
    a2.grad = a.grad.clone()
    torch_sgd.step()
    ours.param_groups[0]["momentum"] = torch_sgd.param_groups[0]["momentum"] = 0.9
    kept = b.data
    b.data, b.grad = torch.randn(120), torch.randn(120)
    with pytest.raises(RuntimeError, match="no longer has the size"):
        ours.step()
    b.data, b.grad = kept, torch.randn(100)
    for _ in range(2):
        a.grad = torch.randn(100)
        a2.grad = a.grad.clone()
        ours.step()
        torch_sgd.step()
    assert torch.equal(a, a2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_an_in_process_rollback_of_a_kahan_run_continues_it_bit_for_bit(dtype, name):
    """Weights and state saved, two steps taken, both put back in the same optimizer: the
    next steps are an uninterrupted run's. The write puts the weights back to the values the
    buffers were made for, so the settling at the next step keeps every entry, ties of half
    a spacing beside odd weights and float16's spacing below a power of two included."""
    from mixprec.optim.states import LowBitAdamW, LowBitSGD

    make = {"sgd": LowBitSGD, "adamw": LowBitAdamW}[name]

    def grads(params, step):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)

    def fresh():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, dtype=dtype)) for n in (96, 160, 8192)]
        return params, make(params, lr=1e-3, compensation="kahan", compile=False)

    straight, opt = fresh()
    for step in range(8):
        grads(straight, step)
        opt.step()
    rolled, opt = fresh()
    for step in range(4):
        grads(rolled, step)
        opt.step()
    weights, state = [p.detach().clone() for p in rolled], copy.deepcopy(opt.state_dict())
    for step in range(2):
        grads(rolled, 50 + step)
        opt.step()
    with torch.no_grad():
        for p, w in zip(rolled, weights, strict=True):
            p.copy_(w)
    opt.load_state_dict(state)
    for step in range(4, 8):
        grads(rolled, step)
        opt.step()
    for a, b in zip(straight, rolled, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("states", ["int8", "float32"])
def test_parameters_over_the_same_memory_take_both_updates_as_torchs(states):
    """Two Parameters over one tensor (and a third over a disjoint part of another buffer):
    a flat run read both before writing either, so the second update overwrote the first."""
    from mixprec.optim.states import LowBitSGD

    shared = torch.zeros(5000, dtype=torch.bfloat16)
    buffer = torch.zeros(10000, dtype=torch.bfloat16)
    params = [nn.Parameter(shared), nn.Parameter(shared), nn.Parameter(buffer[:5000])]
    params.append(nn.Parameter(buffer[5000:]))
    opt = LowBitSGD(params, lr=0.1, states=states, min_size=0, compile=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert float(shared[0]) == pytest.approx(-0.2, rel=1e-2)  # both updates, as torch's
    assert float(buffer[0]) == pytest.approx(-0.1, rel=1e-2) == float(buffer[-1])


def test_parameters_over_the_same_memory_step_in_torchs_order_whatever_their_runs():
    """Two Parameters over one tensor, the first with float32 states (torch's fused
    kernel's bucket), the second with int8 ones (stepped alone): the second stepped first,
    as runs of single parameters went before the buckets', so the first's decay read the
    second's update."""
    from mixprec.optim.states import LowBitSGD

    def run(make) -> float:
        w = torch.ones(8)
        a, b = nn.Parameter(w), nn.Parameter(w)
        opt = make([a, b])
        a.grad, b.grad = torch.zeros(8), torch.ones(8)
        opt.step()
        return float(a.detach()[0])

    theirs = run(lambda ps: torch.optim.SGD(ps, lr=0.5, weight_decay=1.0))
    ours = run(
        lambda ps: LowBitSGD(
            ps, lr=0.5, weight_decay=1.0, states="float32", min_size=0, compile=False,
            formats={ps[1]: "int8"},
        )
    )  # fmt: skip
    assert ours == theirs == -0.25


@pytest.mark.parametrize("cls", ["LowBitSGD", "LowBitAdamW"])
def test_a_data_swap_onto_another_parameters_memory_plans_the_step_again(cls):
    """A ``.data`` swap that puts a parameter over another's memory between steps left the
    last plan standing (dtype, shape and layout unchanged): their flat run read both before
    writing either, and one update was lost."""
    from mixprec.optim import states as mod

    def run(replan: bool) -> torch.Tensor:
        a, b = nn.Parameter(torch.zeros(8)), nn.Parameter(torch.zeros(8))
        opt = getattr(mod, cls)([a, b], lr=1.0, states="int8", min_size=0, compile=False)
        for _ in range(2):
            a.grad, b.grad = torch.ones(8), torch.ones(8)
            opt.step()
        b.data = a.data
        a.grad, b.grad = torch.ones(8), torch.ones(8)
        if replan:
            opt._layout = None
        opt.step()
        return a.detach().clone()

    assert torch.equal(run(replan=False), run(replan=True))


def test_an_empty_saved_entry_is_no_state_as_torch_loads_it():
    """Reading ``optimizer.state[p]`` of a parameter not stepped yet makes an empty entry,
    which its state dict carries; torch's loader takes it, ours refused it as lacking moments."""
    from mixprec.optim.states import AdamW8bit

    params = [nn.Parameter(torch.randn(300, 256)), nn.Parameter(torch.randn(10))]
    opt = AdamW8bit(params, compile=False)
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    assert opt.state[params[1]] == {}
    fresh = AdamW8bit(params, compile=False)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert params[1] not in fresh.state or fresh.state[params[1]] == {}
    for p in params:
        p.grad = torch.ones_like(p)
    fresh.step()
    assert int(fresh.state[params[1]]["step"]) == 1 and int(fresh.state[params[0]]["step"]) == 2


def test_a_quantized_state_is_refused_by_a_parameter_of_another_shape_and_the_same_size():
    """Flat int8 codes of a (32, 64) weight have the length a (64, 32) one's need: loaded
    into a model whose parameters come in another order they were taken silently, each
    element stepping with another's moments. The saved shape is checked; a state saved
    without it (an earlier release's) still loads by its lengths."""
    params = _params(((32, 64), (64, 32)))
    source = AdamW8bit(params, lr=1e-2, min_size=1000, **KW)
    _run(source, params, range(2))
    saved = copy.deepcopy(source.state_dict())
    assert saved["state"][0]["shape"] == [32, 64]
    swapped = [params[1], params[0]]
    opt = AdamW8bit(swapped, lr=1e-2, min_size=1000, **KW)
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \[64, 32\]\).*shape \[32, 64\]"):
        opt.load_state_dict(copy.deepcopy(saved))
    assert not opt.state
    for entry in saved["state"].values():
        del entry["shape"]
    opt.load_state_dict(saved)
    assert "shape" not in opt.state[swapped[0]]
    again = AdamW8bit(params, lr=1e-2, min_size=1000, **KW)
    again.load_state_dict(copy.deepcopy(source.state_dict()))
    _run(again, params, range(2, 3))


@pytest.mark.parametrize("seed", ["a", 1.5])
def test_a_seed_that_is_not_an_int_is_refused_at_construction_and_load(seed):
    """A str or float seed was taken and failed at the first compensated step."""
    with pytest.raises(TypeError, match="seed must be an int"):
        AdamW8bit([nn.Parameter(torch.zeros(4))], seed=seed)
    opt = AdamW8bit([nn.Parameter(torch.zeros(4))], seed=5)
    with pytest.raises(TypeError, match="seed must be an int"):
        opt.load_state_dict({**opt.state_dict(), "seed": seed})
    assert opt.seed == 5


@pytest.mark.parametrize("name", ["int8", "int4", "float8"])
def test_a_finite_gradient_whose_square_overflows_spoils_its_block_visibly(name):
    """A gradient of 1e30 (finite, so no loss scaler skips it) overflows its block's second
    moment: int8's and float8's weights turned NaN, int4's block froze silently (its updates
    all 0, its weights finite)."""
    p = nn.Parameter(torch.ones(512))
    opt = LowBitAdamW([p], lr=0.1, states=name, min_size=0, compile=False)
    for step in range(3):
        p.grad = torch.full((512,), 1e-3)
        p.grad[0] = 1e30 if step == 0 else 1e-3
        opt.step()
    block = StateFormat(name).block
    assert p[:block].isnan().all() and p[block:].isfinite().all()


def test_torch_flags_are_taken_or_refused_as_torch_code_passes_them():
    """Code written for torch's AdamW crashed on foreach/fused with a TypeError about an
    unexpected argument; maximize/capturable/differentiable, betas of one number and a block
    given twice are refused, naming what is wrong."""
    p = nn.Parameter(torch.zeros(4))
    LowBitAdamW([p], foreach=True, fused=False)
    LowBitSGD([p], foreach=False, fused=True)
    with pytest.raises(ValueError, match=r"does not support maximize=True \(.*minimizes\)"):
        LowBitAdamW([p], maximize=True)
    with pytest.raises(ValueError, match="does not support capturable=True"):
        AdamW8bit([p], capturable=True)
    with pytest.raises(ValueError, match="does not support differentiable=True"):
        LowBitSGD([p], differentiable=True)
    with pytest.raises(ValueError, match=r"invalid betas \(0.9,\): two numbers"):
        LowBitAdamW([p], betas=(0.9,))
    with pytest.raises(ValueError, match="invalid eps None"):
        LowBitAdamW([p], eps=None)
    for spec in ("int8/block=100", "int8/block=256"):
        with pytest.raises(ValueError, match=f"states='{spec}' and block_size=128 name two"):
            LowBitAdamW([p], states=spec, block_size=128)
    LowBitAdamW([p], betas=(torch.tensor(0.9), torch.tensor(0.99)))
    LowBitAdamW([p], betas=torch.tensor([0.9, 0.99]))
    LowBitAdamW([p], betas=[0.9, 0.99])
    assert LowBitAdamW([p], states="int8/block=128", block_size=128).param_groups


def test_low_bit_adam_takes_torch_adams_decoupled_weight_decay():
    """``LowBitAdam(decoupled_weight_decay=True)``, as torch's Adam takes it, was a
    TypeError; it now steps as torch's Adam does with it (float32 states: to rounding)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(16, 16))
    ref = nn.Parameter(w.detach().clone())
    ours = LowBitAdam([w], lr=0.1, weight_decay=0.5, decoupled_weight_decay=True, states="float32")
    theirs = torch.optim.Adam([ref], lr=0.1, weight_decay=0.5, decoupled_weight_decay=True)
    for _ in range(3):
        w.grad, ref.grad = torch.ones_like(w), torch.ones_like(ref)
        ours.step()
        theirs.step()
    torch.testing.assert_close(w, ref, rtol=0, atol=1e-6)
    # a state of either decay's form loads: the form is the loading optimizer's own
    plain = LowBitAdam([nn.Parameter(w.detach().clone())], lr=0.1, states="float32")
    plain.load_state_dict(ours.state_dict())
    assert not plain.param_groups[0].get("decoupled_weight_decay")
    again = LowBitAdam([w], decoupled_weight_decay=True, states="float32")
    again.load_state_dict(plain.state_dict())
    assert again.param_groups[0]["decoupled_weight_decay"]


@pytest.mark.parametrize(
    "make, tensors",
    [
        (LowBitAdamW, {"eps": 1e-3, "weight_decay": 0.1, "betas": (0.8, 0.9)}),
        (LowBitSGD, {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
    ],
)
def test_one_element_tensor_hyperparameters_step_as_their_numbers(make, tensors):
    """Found by a review: a 1-D one-element tensor ``eps``/``weight_decay``/``momentum``/
    ``dampening`` was accepted (torch's optimizers take it) and the float32 states' fused
    step raised torch's bare TypeError; it steps as the same numbers do (to float32's
    rounding: a tensor holds 0.8 in float32, a number in double)."""

    def run(as_tensor: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4, 8))
        kw = {
            k: (tuple(torch.tensor([b]) for b in v) if isinstance(v, tuple) else torch.tensor([v]))
            if as_tensor
            else v
            for k, v in tensors.items()
        }
        opt = make([p], lr=0.01, states="float32", **kw)
        for _ in range(3):
            p.grad = torch.randn_like(p)
            opt.step()
        moments = [t.clone() for t in opt.state[p].values() if torch.is_tensor(t) and t.dim()]
        return [p.detach().clone(), *moments]

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b)


def test_the_uncompensated_warning_gives_a_low_bit_optimizer_the_advice_it_takes(recwarn):
    """Found by a review: `LossScaleOptimizer(LowBitAdamW(<bfloat16 parameters>))` warned
    "Pass compensation='kahan' (or 'stochastic') to Precision / LossScaleOptimizer", which
    both refuse for a low-bit optimizer (it compensates its own updates); the warning now
    says to build it with compensation=, and following that warns no more."""
    model = nn.Linear(64, 64).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="round away") as caught:
        LossScaleOptimizer(LowBitAdamW(model.parameters(), lr=1e-3, **KW), scaler="none")
    said = str(caught[0].message)
    assert "LowBitAdamW(..., compensation='kahan')" in said
    assert "'stochastic') to Precision" not in said
    recwarn.clear()
    low = LowBitAdamW(model.parameters(), lr=1e-3, compensation="kahan", **KW)
    LossScaleOptimizer(low, scaler="none")
    assert not [w for w in recwarn if "round away" in str(w.message)]
    with pytest.warns(UserWarning, match=r"'stochastic'\) to Precision"):  # (torch's)
        LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), scaler="none")


def test_a_converted_low_bit_optimizer_is_told_to_pass_compensation_to_precision(recwarn):
    """Found by a diff review: the low-bit optimizer `Precision(optimizer_states=...)`
    converts from the user's torch AdamW was told to build itself with compensation=, which
    the user never builds; passing compensation= to Precision converts it with one, and
    silences the warning."""
    model = nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.warns(UserWarning, match="round away") as caught:
        Precision("bf16-true", optimizer_states="int8", allow_slow=True).setup(model, opt)
    said = str(caught[0].message)
    assert "Pass compensation='kahan' (or 'stochastic') to Precision" in said
    assert "LowBitAdamW(..., compensation" not in said
    recwarn.clear()
    model = nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    Precision("bf16-true", optimizer_states="int8", compensation="kahan", allow_slow=True).setup(
        model, opt
    )
    assert not [w for w in recwarn if "round away" in str(w.message)]
