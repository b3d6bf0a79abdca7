"""Multi-tensor steps: a step's calls (aten calls counted by a dispatch mode, not timed) do
not grow with the number of parameters, for the low-bit optimizers and for the compensated
steps of torch's optimizers alike; the bucketed step does what the per-parameter step did,
and states saved by the per-parameter step load and continue."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.optim.states import LowBitAdam, LowBitAdamW, LowBitSGD, state_bytes
from mixprec.optim.states.codecs import unpack4
from mixprec.optim.states.formats import dequantize

DATA = Path(__file__).parent / "data"


class _CountOps(TorchDispatchMode):
    """Counts the aten calls that compute (views, which only re-describe memory, left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _params(n: int, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    torch.manual_seed(0)
    # sizes with and without partial blocks, below and above min_size; 24 of them
    # together within one flat update (buckets.FLAT_MAX)
    sizes = [(20, 30), (300,), (64, 64), (17,)]
    return [nn.Parameter(torch.randn(sizes[i % len(sizes)], dtype=dtype)) for i in range(n)]


def _ops_of_a_step(make, n: int, dtype: torch.dtype = torch.float32) -> int:
    params = _params(n, dtype)
    opt = make(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the first step makes the states
    with _CountOps() as counter:
        opt.step()
    return counter.calls


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: LowBitAdamW(ps, states="int8", min_size=1000, compile=False),
        lambda ps: LowBitAdamW(ps, states="int4", min_size=0, compile=False),
        lambda ps: LowBitAdamW(ps, states="fp8", compile=False),
        lambda ps: LowBitAdamW(ps, states="float32", compile=False),
        lambda ps: LowBitSGD(ps, lr=0.1, momentum=0.9, states="int8", min_size=500, compile=False),
        lambda ps: LowBitSGD(ps, lr=0.1, states="float32", compile=False),
    ],
    ids=["int8", "int4", "fp8", "float32", "sgd-int8", "sgd-float32"],
)
def test_the_calls_of_a_step_do_not_grow_with_the_number_of_parameters(make):
    # (8 and 24: two low-bit parameters or more share each flat update; one alone is
    # stepped in place, with fewer calls still)
    assert _ops_of_a_step(make, 8) == _ops_of_a_step(make, 24)
    assert _ops_of_a_step(make, 4) <= _ops_of_a_step(make, 8)


class _CountCats(TorchDispatchMode):
    """Counts the concatenations a step makes."""

    def __init__(self) -> None:
        super().__init__()
        self.cats = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.cats += func is torch.ops.aten.cat.default
        return func(*args, **(kwargs or {}))


def _stepped(opt: torch.optim.Optimizer, params: list[nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    opt.step()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: LowBitAdamW(ps, states="int8", min_size=0, compile=False),
        lambda ps: LowBitAdamW(ps, states="fp8", min_size=0, compile=False),
        lambda ps: LowBitSGD(ps, lr=0.1, momentum=0.9, states="int4", min_size=0, compile=False),
    ],
    ids=["int8", "fp8", "sgd-int4"],
)
def test_a_buckets_low_bit_moments_stay_joined_from_step_to_step(make):
    """After a bucket's first step its parameters' codes and scales are slices of one
    tensor per moment, and later steps update them in place: the same tensors, and no
    concatenation but the parameters' and the gradients'."""
    params = _params(8)
    opt = make(params)
    _stepped(opt, params, 0)
    names = [k for k in opt.state[params[0]] if k.endswith(("_codes", "_scales"))]
    before = {(i, k): opt.state[p][k] for i, p in enumerate(params) for k in names}
    for k in names:
        assert len({opt.state[p][k].untyped_storage().data_ptr() for p in params}) == 1, k
    with _CountCats() as counter:
        _stepped(opt, params, 1)
    assert counter.cats == 2  # (the parameters, the gradients)
    assert all(opt.state[params[i]][k] is t for (i, k), t in before.items())


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_a_bfloat16_buckets_moments_and_kahan_buffers_stay_joined(kind):
    """bfloat16 parameters with Kahan buffers: their moments (float32 ones too, shaped as
    torch keeps them) and buffers are slices of one tensor each after the first step, and
    later steps concatenate only the parameters and the gradients."""
    params = _params(8, torch.bfloat16)
    opt = LowBitAdamW(params, states=kind, min_size=0, compensation="kahan", compile=False)
    _stepped(opt, params, 0)
    names = [k for k, v in opt.state[params[0]].items() if torch.is_tensor(v) and k != "step"]
    assert "compensation" in names
    before = {(i, k): opt.state[p][k] for i, p in enumerate(params) for k in names}
    for k in names:
        assert len({opt.state[p][k].untyped_storage().data_ptr() for p in params}) == 1, k
    for p in params:
        assert opt.state[p]["compensation"].shape == p.shape
        if kind == "float32":
            assert opt.state[p]["exp_avg"].shape == p.shape
    with _CountCats() as counter:
        _stepped(opt, params, 1)
    assert counter.cats == 2  # (the parameters, the gradients)
    assert all(opt.state[params[i]][k] is t for (i, k), t in before.items())


def test_a_state_replaced_between_steps_is_joined_again_with_the_same_step():
    """A state tensor replaced by another with the same values (as a user's copy, or a
    loader's, would) is what the next step reads and updates: the step equals one
    without the replacement, bit for bit, and the states are joined again."""
    runs = []
    for replace in (False, True):
        params = _params(8)
        opt = LowBitAdamW(params, states="int8", min_size=0, compile=False)
        _stepped(opt, params, 0)
        if replace:
            state = opt.state[params[3]]
            state["exp_avg_codes"] = state["exp_avg_codes"].clone()
            state["exp_avg_sq_scales"] = state["exp_avg_sq_scales"].clone()
        _stepped(opt, params, 1)
        _stepped(opt, params, 2)
        runs.append((params, opt))
    (plain, _), (replaced, opt) = runs
    for p, q in zip(plain, replaced, strict=True):
        assert torch.equal(p, q)
    storages = {opt.state[p]["exp_avg_codes"].untyped_storage().data_ptr() for p in replaced}
    assert len(storages) == 1


@pytest.mark.parametrize(
    "kind, dtype, compensation",
    [
        ("int8", torch.float32, None),
        ("float32", torch.bfloat16, "kahan"),
        ("int4", torch.bfloat16, "kahan"),
    ],
    ids=["int8", "float32-kahan", "int4-kahan"],
)
def test_a_parameter_left_out_of_its_bucket_keeps_no_joined_tensor_alive(kind, dtype, compensation):
    """A parameter frozen after its bucket was joined (its gradient None from then on)
    gets copies of its own states at the next step, so the joined tensors of the old
    bucket are freed: the states' storages hold the states' bytes and no more (but the
    Kahan buffers' padding to whole blocks in their bucket, under a block of bfloat16
    each); and its states keep their values."""
    from mixprec.optim.states import state_bytes

    params = _params(8, dtype)
    opt = LowBitAdamW(params, states=kind, min_size=0, compensation=compensation, compile=False)
    _stepped(opt, params, 0)
    frozen = params[5]
    kept = {k: v.clone() for k, v in opt.state[frozen].items() if torch.is_tensor(v)}
    frozen.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = None if p is frozen else torch.randn(p.shape, generator=g).to(dtype)
    opt.step()
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for state in opt.state.values()
        for k, t in state.items()
        if torch.is_tensor(t) and k != "step"
    }
    padding = 0 if compensation is None or kind == "float32" else len(params) * 256 * 2
    assert state_bytes(opt) <= sum(storages.values()) <= state_bytes(opt) + padding
    for k, v in kept.items():
        assert torch.equal(opt.state[frozen][k], v), k


_EVENTS = st.lists(
    st.tuples(
        st.lists(st.booleans(), min_size=6, max_size=6),  # which parameters have a gradient
        st.sampled_from(["step", "replace", "reload"]),  # and what happens before the step
    ),
    min_size=2,
    max_size=6,
)


@settings(max_examples=40, deadline=None)
@given(
    events=_EVENTS,
    kind=st.sampled_from(["int8", "int4", "fp8", "float32"]),
    sgd=st.booleans(),
    kahan=st.booleans(),
)
def test_joined_states_step_as_states_joined_afresh_every_step(events, kind, sgd, kahan):
    """Differential: an optimizer keeping its joined states across steps, while parameters
    drop in and out of their bucket (a gradient None), states are replaced by copies and
    the whole state dict is reloaded between steps, steps as one that joins its states
    afresh at every step (what the step did before states stayed joined): the same
    parameters and the same states, bit for bit. Low-bit moments of float32 parameters,
    and, of bfloat16 ones with Kahan buffers (padded to whole blocks in their bucket) or
    without, low-bit or float32 moments."""
    dtype = torch.bfloat16 if kahan or kind == "float32" else torch.float32
    compensation = "kahan" if kahan else None

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        kw = dict(states=kind, compensation=compensation, compile=False)
        if kind != "float32":
            kw["min_size"] = 0
        if sgd:
            return LowBitSGD(params, lr=0.1, momentum=0.9, **kw)
        return LowBitAdamW(params, **kw)

    kept, fresh = _params(6, dtype), _params(6, dtype)
    opt, reference = make(kept), make(fresh)
    for i, (has_grad, event) in enumerate(events):
        if event == "replace":
            for state in opt.state.values():
                for k, v in list(state.items()):
                    if torch.is_tensor(v) and k != "step":
                        state[k] = v.clone()
        elif event == "reload":
            opt.load_state_dict(opt.state_dict())
        g = torch.Generator().manual_seed(i)
        for a, b, on in zip(kept, fresh, has_grad, strict=True):
            grad = torch.randn(a.shape, generator=g).to(dtype)
            a.grad, b.grad = (grad, grad.clone()) if on else (None, None)
        opt.step()
        reference._flats.clear()  # (joined afresh)
        reference._layout = None  # (planned afresh)
        reference.step()
    for a, b in zip(kept, fresh, strict=True):
        assert torch.equal(a, b)
        assert opt.state[a].keys() == reference.state[b].keys()
        for k, v in opt.state[a].items():
            if torch.is_tensor(v):
                assert torch.equal(v, reference.state[b][k]), k


_PLAN_EVENTS = st.lists(
    st.tuples(
        st.lists(st.booleans(), min_size=6, max_size=6),  # which parameters have a gradient
        st.sampled_from(
            [
                "step",
                "step",
                "lr",
                "states",
                "flag",
                "momentum",
                "data",
                "replace",
                "reload",
                "compensation",
                "min_size",
                "keep",
            ]
        ),  # fmt: skip
    ),
    min_size=2,
    max_size=8,
)


def _event(opt: torch.optim.Optimizer, params: list[nn.Parameter], event: str, i: int) -> None:
    """Change what a step's plan is made of (as a user, a scheduler or a checkpoint may)."""
    group = opt.param_groups[0]
    if event == "lr":
        group["lr"] = group["lr"] * 0.5
    elif event == "states":
        group["states"] = ["int8", "int4", "fp8", "float32"][i % 4]
    elif event == "flag":
        if "nesterov" in group:
            group["nesterov"] = not group["nesterov"] and group["momentum"] > 0
        else:
            group["decoupled_weight_decay"] = not group.get("decoupled_weight_decay", True)
    elif event == "momentum" and "momentum" in group:
        group["momentum"] = 0.0 if group["momentum"] else 0.9
        group["nesterov"] = False
    elif event == "data":
        params[i % len(params)].data = params[i % len(params)].data.clone()
    elif event == "replace":
        for state in opt.state.values():
            for k, v in list(state.items()):
                if torch.is_tensor(v):
                    state[k] = v.clone()
    elif event == "reload":
        opt.load_state_dict(opt.state_dict())
    elif event == "compensation":
        opt.compensation = {None: "kahan", "kahan": "stochastic", "stochastic": None}[
            opt.compensation
        ]
    elif event == "min_size":  # (the 300- and 17-element parameters in float32, or not)
        opt.min_size = 500 if opt.min_size == 0 else 0
    elif event == "keep":
        opt.keep_float32 = (lambda p: p.dim() == 1) if opt.keep_float32 is None else None


@settings(max_examples=40, deadline=None)
@given(
    events=_PLAN_EVENTS,
    kind=st.sampled_from(["int8", "int4", "fp8", "float32"]),
    sgd=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_a_step_taking_its_last_plan_again_steps_as_one_planned_afresh(events, kind, sgd, dtype):
    """Differential: an optimizer that takes the last step's plan again when its parameters
    and states are unchanged steps as one that plans every step, bit for bit, while the
    learning rate, the group's state format, its flags (decoupled decay, nesterov), SGD's
    momentum, a parameter's data, the states (replaced, reloaded), the compensation, the
    optimizer's ``min_size`` and ``keep_float32`` and the set of parameters with a gradient
    change between steps."""

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        kw = dict(states=kind, min_size=0, compile=False)
        if sgd:
            return LowBitSGD(params, lr=0.1, momentum=0.9, **kw)
        return LowBitAdamW(params, lr=0.01, **kw)

    kept, fresh = _params(6, dtype), _params(6, dtype)
    opt, reference = make(kept), make(fresh)
    for i, (has_grad, event) in enumerate(events):
        _event(opt, kept, event, i)
        _event(reference, fresh, event, i)
        g = torch.Generator().manual_seed(i)
        for a, b, on in zip(kept, fresh, has_grad, strict=True):
            grad = torch.randn(a.shape, generator=g).to(dtype)
            a.grad, b.grad = (grad, grad.clone()) if on else (None, None)
        opt.step()
        reference._layout = None  # (planned afresh)
        reference.step()
        for a, b in zip(kept, fresh, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(kept, fresh, strict=True):
        assert opt.state[a].keys() == reference.state[b].keys()
        for k, v in opt.state[a].items():
            if torch.is_tensor(v):
                assert torch.equal(_bytes(v), _bytes(reference.state[b][k])), k


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.dtype.itemsize == 1 else t


def test_a_step_of_the_same_parameters_plans_nothing_and_a_change_plans_again():
    """The plan of a step is taken again by the next step of the same parameters and
    states (the same `_Layout`, even as the learning rate changes), from the step after
    the one that joined its bucket's states; it is made anew when a gradient goes
    missing, a state is replaced or the group's format changes."""
    params = _params(6)
    opt = LowBitAdamW(params, min_size=0, compile=False)

    def step() -> object:
        for p in params:
            if p.grad is None:
                p.grad = torch.ones_like(p)
        opt.step()
        return opt._layout

    def settled() -> object:
        # (a step that joins states has the next one planned afresh)
        step()
        layout = step()
        assert layout is not None and step() is layout
        return layout

    assert step() is None  # (the first step joined its bucket's states)
    first = settled()
    opt.param_groups[0]["lr"] = 1e-4
    assert step() is first
    params[1].grad = None
    opt.step()
    assert opt._layout is None  # (the bucket without it was joined)
    second = settled()  # (the gradient back)
    assert second is not first
    opt.state[params[0]]["exp_avg_codes"] = opt.state[params[0]]["exp_avg_codes"].clone()
    third = settled()
    assert third is not second
    opt.param_groups[0]["states"] = "int4"
    fourth = settled()
    assert fourth is not third and opt.state[params[0]]["format"] == "int4"


@pytest.mark.parametrize("change", ["min_size", "keep_float32", "group"])
def test_a_replayed_step_still_converts_states_whose_format_changed(change):
    """A step the last plan fits skips preparing the states (their formats checked
    against `format_of`) while what the formats are chosen from is unchanged; a change
    of ``min_size``, of ``keep_float32`` or of a group's format between replayed steps
    still converts the states at the next step."""
    params = [nn.Parameter(torch.randn(300)), nn.Parameter(torch.randn(64, 64))]
    opt = LowBitAdamW(params, min_size=0, compile=False)

    def step() -> None:
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()

    for _ in range(3):
        step()
    assert opt._layout is not None and opt.state[params[0]]["format"] == "int8"
    if change == "min_size":
        opt.min_size = 500
    elif change == "keep_float32":
        opt.keep_float32 = lambda p: p.dim() == 1
    else:
        opt.param_groups[0]["states"] = "float32"
    step()
    assert opt.state[params[0]]["format"] == "float32"


def test_a_joined_state_saves_once_and_resumes_bit_for_bit(tmp_path):
    """torch.save stores the joined tensors once (the file is about the states' bytes,
    not a copy of them per parameter), and a fresh optimizer loading it continues as the
    saving one does, bit for bit."""
    from mixprec.optim.states import state_bytes

    params = _params(8)
    opt = LowBitAdamW(params, states="int8", min_size=0, compile=False)
    for seed in range(2):
        _stepped(opt, params, seed)
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    assert path.stat().st_size < state_bytes(opt) + 64 * 1024
    resumed = [nn.Parameter(p.detach().clone()) for p in params]
    again = LowBitAdamW(resumed, states="int8", min_size=0, compile=False)
    again.load_state_dict(torch.load(path, weights_only=True))
    for seed in range(2, 4):
        _stepped(opt, params, seed)
        _stepped(again, resumed, seed)
    for p, q in zip(params, resumed, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_the_calls_of_a_compensated_bfloat16_step_do_not_grow(compensation):
    def make(ps):
        return LowBitAdamW(
            ps, states="int8", min_size=500, compensation=compensation, compile=False
        )

    assert _ops_of_a_step(make, 4, torch.bfloat16) == _ops_of_a_step(make, 12, torch.bfloat16)


@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ],
    ids=["adamw", "sgd"],
)
def test_the_calls_of_a_compensated_torch_step_do_not_grow(make, compensation):
    """The engine's other user: `Compensator` stepping torch's AdamW and SGD over bfloat16
    weights makes the same aten calls for 4 parameters as for 12 (their step counts moved
    and read in a fixed number of calls, the small ones stepped from one packed copy)."""
    from mixprec.optim.compensated import Compensator

    def ops(n: int) -> int:
        params = _params(n, torch.bfloat16)
        opt = make(params)
        comp = Compensator(compensation, seed=0, compile=False)
        for p in params:
            p.grad = torch.randn_like(p)
        comp.step(opt)  # the first step makes the states
        with _CountOps() as counter:
            comp.step(opt)
        return counter.calls

    assert ops(4) == ops(12)


def test_the_compiled_update_runs_once_per_bucket_whatever_the_number_of_parameters(monkeypatch):
    """One compiled call per bucket: the low-bit parameters of one group in one format
    (within `buckets.FLAT_MAX` elements), counted around the real compiled update."""
    from mixprec.optim.states import kernels

    counted = []
    original = kernels.run_compiled

    def counting(algorithm, args):
        counted.append(algorithm)
        return original(algorithm, args)

    monkeypatch.setattr(kernels, "run_compiled", counting)
    for n in (4, 12):
        counted.clear()
        params = _params(n)
        opt = LowBitAdamW(params, states="int8", min_size=1000, compile=True)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        assert counted == ["adam"]


@pytest.mark.parametrize("name", ["int8", "int4", "fp8", "sgd-int8"])
def test_a_state_saved_by_the_per_parameter_step_loads_and_continues(name):
    """tests/optim/data/per_parameter_states.pt: states after 3 steps of the step that
    updated one parameter per call, and the parameters 2 steps later; loaded into today's
    optimizer, the same 2 steps land there (up to a code rounded the other way at a tie).
    int4 has since stored its second moment's root: the saved ``v`` (positive scales) reads
    as it was stored, and the steps after store roots, whose rounding moves the weights
    within a tenth of their steps (a ``v`` read as a root would move them tenfold)."""
    saved = torch.load(DATA / "per_parameter_states.pt", weights_only=True)[name]
    params = [nn.Parameter(p.clone()) for p in saved["params"]]
    make = {
        "int8": lambda ps: LowBitAdamW(ps, lr=1e-2, states="int8", min_size=1000),
        "int4": lambda ps: LowBitAdamW(ps, lr=1e-2, states="int4", min_size=0),
        "fp8": lambda ps: LowBitAdamW(ps, lr=1e-2, states="fp8", min_size=0),
        "sgd-int8": lambda ps: LowBitSGD(ps, lr=1e-2, momentum=0.9, states="int8", min_size=0),
    }[name]
    opt = make(params)
    opt.load_state_dict(saved["state_dict"])
    if name == "int4":  # (the saved v, as v: its map's value times the block's scale)
        for p in params:
            state = opt.state[p]
            scales = state["exp_avg_sq_scales"]
            assert (scales > 0).all()
            levels = (unpack4(state["exp_avg_sq_codes"]).float() + 1) / 16
            expected = (levels.view(-1, 128) * scales[:, None]).reshape(-1)[: p.numel()]
            got = dequantize(
                state["exp_avg_sq_codes"], scales, "int4", p.shape, signed=False
            ).reshape(-1)
            assert torch.equal(got, expected)
    for step in range(3, 5):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    atol = 5e-3 if name == "int4" else 1e-5
    for p, expected in zip(params, saved["after"], strict=True):
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=atol)
    for state in opt.state.values():
        assert int(state["step"]) == 5


@settings(max_examples=30, deadline=None)
@given(
    algorithm=st.sampled_from(["adamw", "adam", "sgd"]),
    lrs=st.lists(st.sampled_from([1e-3, 3e-2, 0.1]), min_size=3, max_size=3),
    weight_decay=st.sampled_from([0.0, 1e-2, 0.3]),
    momentum=st.sampled_from([0.0, 0.9]),
    nesterov=st.booleans(),
    dampening=st.sampled_from([0.0, 0.3]),
    gradients=st.lists(st.lists(st.booleans(), min_size=5, max_size=5), min_size=2, max_size=4),
    lr_tensor=st.booleans(),
)
def test_float32_states_step_as_torchs_fused_optimizers_bit_for_bit(
    algorithm, lrs, weight_decay, momentum, nesterov, dampening, gradients, lr_tensor
):
    """Differential: float32 moments of contiguous float32 parameters on a CPU take torch's
    fused step, one call for the bucket, whatever the parameters' sizes (one here is past
    FLAT_MAX): the parameters and the moments end as `torch.optim.AdamW(fused=True)`'s (and
    Adam's, and SGD's with momentum, dampening and nesterov) bit for bit, over two groups,
    a learning rate changed between steps (a float or a tensor), gradients missing on
    some steps and a complex parameter stepped as its real pairs."""
    nesterov = nesterov and momentum > 0 and dampening == 0
    if algorithm == "sgd":  # (torch's fused SGD fails on buffers started at different steps)
        gradients = [[True] * 5, *gradients[1:]]
    shapes = [(40, 30), (300,), (1 << 17) + 5, (7,), (9, 4)]

    def params(complex_last: bool) -> list[nn.Parameter]:
        """The parameters; the last complex, or (torch's fused steps take no complex
        tensor) its real pairs."""
        torch.manual_seed(0)
        made = [torch.randn(s) for s in shapes[:4]]
        last = torch.randn(shapes[4], dtype=torch.complex64)
        made.append(last if complex_last else torch.view_as_real(last).clone())
        return [nn.Parameter(t) for t in made]

    def groups(ps: list[nn.Parameter], lr: float) -> list[dict]:
        return [{"params": ps[:3]}, {"params": ps[3:], "lr": lr / 2}]

    def make(ps: list[nn.Parameter], torchs: bool) -> torch.optim.Optimizer:
        lr = torch.tensor(lrs[0]) if lr_tensor else lrs[0]
        if algorithm == "sgd":
            kw = dict(lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
                      weight_decay=weight_decay)  # fmt: skip
            cls = torch.optim.SGD if torchs else LowBitSGD
        else:
            kw = dict(lr=lr, weight_decay=weight_decay)
            cls = {
                (True, "adamw"): torch.optim.AdamW,
                (True, "adam"): torch.optim.Adam,
                (False, "adamw"): LowBitAdamW,
                (False, "adam"): LowBitAdam,
            }[torchs, algorithm]
        if torchs:
            return cls(groups(ps, lrs[0]), fused=True, **kw)
        return cls(groups(ps, lrs[0]), states="float32", compile=False, **kw)

    ours, theirs = params(True), params(False)
    opt, reference = make(ours, False), make(theirs, True)
    for i, present in enumerate(gradients):
        lr = lrs[i % len(lrs)]
        for o in (opt, reference):
            o.param_groups[0]["lr"] = torch.tensor(lr) if lr_tensor else lr
        g = torch.Generator().manual_seed(i)
        for a, b, on in zip(ours, theirs, present, strict=True):
            grad = torch.randn(a.shape, generator=g, dtype=a.dtype)
            a.grad, b.grad = (grad, _real(grad).clone()) if on else (None, None)
        opt.step()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(_real(a), b)
        for k, v in reference.state[b].items():
            if torch.is_tensor(v) and k != "step":
                assert torch.equal(_real(opt.state[a][k]), v), k


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


@pytest.mark.parametrize("algorithm", ["adamw", "sgd"])
def test_float32_parameters_over_one_memory_step_as_torchs_fused_optimizers_bit_for_bit(
    algorithm,
):
    """Parameters over one memory step one at a time, as torch's fused call steps its list;
    float32 ones were stepped by the update of our own (its lerp and its order of float32
    operations: thousands of elements a last bit off torch's). Now by torch's fused kernel,
    one call each: the parameters end as `torch.optim.AdamW(fused=True)`'s bit for bit."""
    ends = {}
    for torchs in (False, True):
        torch.manual_seed(0)
        base = torch.randn(64, 64)
        ps = [nn.Parameter(base), nn.Parameter(base[0]), nn.Parameter(torch.randn(10, 10))]
        if algorithm == "sgd":
            cls, kw = (torch.optim.SGD, {}) if torchs else (LowBitSGD, {"states": "float32"})
            kw["momentum"] = 0.9
        else:
            cls, kw = (torch.optim.AdamW, {}) if torchs else (LowBitAdamW, {"states": "float32"})
        opt = cls(ps, lr=1e-2, **kw, **({"fused": True} if torchs else {"compile": False}))
        for i in range(4):
            g = torch.Generator().manual_seed(i)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        ends[torchs] = [p.detach().clone() for p in ps]
    for ours, theirs in zip(ends[False], ends[True], strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "kind, dtype",
    [("int8", torch.float32), ("fp8", torch.float32), ("float32", torch.bfloat16)],
)
def test_sgd_whose_momentum_is_set_to_zero_steps_plainly_and_keeps_its_buffer(kind, dtype):
    """As torch's SGD: a group whose momentum is set to 0 after steps with momentum steps
    ``p - lr * grad`` and leaves its buffer as it was (a later momentum takes it up
    again). Bucketed, the buffer was still joined and stepped: int8 and float8 buffers
    raised, and a float32 buffer beside bfloat16 parameters was overwritten and the step
    scaled by ``1 - dampening``."""
    params = _params(6, dtype)
    opt = LowBitSGD(params, lr=0.1, momentum=0.9, dampening=0.5, states=kind, min_size=0)
    g = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
    opt.step()
    key = "momentum_buffer" if kind == "float32" else "momentum_buffer_codes"
    kept = {p: _bytes(opt.state[p][key]).clone() for p in params}
    opt.param_groups[0]["momentum"] = 0.0
    for _ in range(2):
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        opt.step()
        for p, old in zip(params, before, strict=True):
            expected = (old.float() + -0.1 * p.grad.float()).to(dtype)
            assert torch.equal(p.detach(), expected)
            assert torch.equal(_bytes(opt.state[p][key]), kept[p])


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_sgd_follows_its_momentum_as_it_is_raised_from_zero_lowered_and_raised(kind):
    """As torch's SGD, a bucketed LowBitSGD whose momentum goes 0 -> 0.9 -> 0 -> 0.5
    between steps starts its buffer at the first step with momentum, steps plainly while it
    is 0 and takes the buffer up again (within the low-bit buffer's error). Before, a
    bucket joined without a buffer kept stepping without one: the momentum was ignored
    for good, silently."""
    params, plain = _params(6), _params(6)
    opt = LowBitSGD(params, lr=0.1, momentum=0.0, states=kind, min_size=0)
    reference = torch.optim.SGD(plain, lr=0.1, momentum=0.0)
    start = [p.detach().clone() for p in plain]
    g = torch.Generator().manual_seed(0)
    for momentum in [0.0, 0.0, 0.9, 0.9, 0.9, 0.0, 0.5, 0.5]:
        for o in (opt, reference):
            o.param_groups[0]["momentum"] = momentum
        for p, q in zip(params, plain, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        reference.step()
    for p, q, s in zip(params, plain, start, strict=True):
        # (ignoring the momentum, as before, puts them about 0.6 of the distance apart;
        # int4's 16 levels a buffer, about 0.1)
        moved = float((q - s).abs().mean())
        assert float((p - q).abs().mean()) < (0.25 if kind == "int4" else 0.05) * moved


def test_step_counts_advance_joined_and_join_again_when_replaced():
    """`StepCounts`: the counts of the states stepped become 0-dim views of one tensor
    (values kept), advance together and read back; a count replaced (a checkpoint loaded)
    or another set of states joins again; counts that cannot join (float64 here) advance
    as they are. A state dict of joined counts saves, loads into a fresh optimizer and into
    torch's AdamW, and steps on."""
    from mixprec.optim.engine import StepCounts

    states = [{"step": torch.tensor(float(i))} for i in range(3)]
    counts = StepCounts()
    assert counts.advance(states) == [1, 2, 3]
    views = [s["step"] for s in states]
    assert all(v._base is counts.whole for v in views)
    assert counts.advance(states) == [2, 3, 4] and [s["step"] for s in states] == views
    states[1]["step"] = torch.tensor(10.0)  # (replaced)
    assert counts.advance(states) == [3, 11, 5]
    assert states[1]["step"]._base is counts.whole and float(views[1]) == 3.0
    assert counts.advance(states[:2]) == [4, 12]  # (another set)
    assert float(states[2]["step"]) == 5.0
    odd = [{"step": torch.tensor(1.0, dtype=torch.float64)}, {"step": torch.tensor(2.0)}]
    assert counts.advance(odd) == [2, 3] and odd[0]["step"].dtype == torch.float64

    params = _params(4)
    opt = LowBitAdamW(params, states="float32", min_size=0)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.step()
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    again = LowBitAdamW(copies, states="float32", min_size=0)
    again.load_state_dict(torch.load(io.BytesIO(saved.getvalue())))
    others = [nn.Parameter(p.detach().clone()) for p in params]
    plain = torch.optim.AdamW(others, fused=True)
    plain.load_state_dict(opt.to_float32_state_dict())
    for o in (opt, again, plain):
        for p in o.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        o.step()
    for a, b, c in zip(params, copies, others, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
        assert float(opt.state[a]["step"]) == float(again.state[b]["step"]) == 3.0


def _grads(params: list[nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


@pytest.mark.parametrize(
    "make, dtype",
    [
        (lambda ps: LowBitAdamW(ps, lr=1e-2, states="int8", min_size=0, compile=False), None),
        (lambda ps: LowBitSGD(ps, lr=1e-2, momentum=0.9, states="fp8", compile=False), None),
        # float8 codes: torch pickles a float8 tensor but cannot load it back
        (lambda ps: LowBitAdamW(ps, lr=1e-2, states="fp8", min_size=0, compile=False), None),
        (
            lambda ps: LowBitAdamW(
                ps, lr=1e-2, states="float32", compensation="kahan", compile=False
            ),
            torch.bfloat16,
        ),
    ],
)
def test_a_pickled_optimizer_keeps_its_states_and_counts_stepping(make, dtype):
    """A plain pickle (multiprocessing, Ray) stores a state's joined step count and moment
    slices apart from the tensors they were views of: the copy's counts stayed at the
    pickle's value while it stepped on, and its state dict resumed 2e-3 away. The copy joins
    them again: its states, counts and further steps are those of the optimizer never
    pickled, bit for bit."""

    def run(pickled: bool):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(300)), nn.Parameter(torch.randn(129))]
        if dtype is not None:
            params = [nn.Parameter(p.detach().to(dtype)) for p in params]
        opt = make(params)
        for step in range(6):
            if step == 3 and pickled:
                params, opt = pickle.loads(pickle.dumps((params, opt)))
            _grads(params, step)
            opt.step()
        return params, opt

    ref_params, ref = run(False)
    params, opt = run(True)
    for p, q in zip(params, ref_params, strict=True):
        assert torch.equal(p, q)
        mine, theirs = opt.state[p], ref.state[q]
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            if torch.is_tensor(value):
                assert torch.equal(mine[key], value), key
    resumed = make(params)
    resumed.load_state_dict(opt.state_dict())
    again = make(ref_params)
    again.load_state_dict(ref.state_dict())
    for step in range(6, 8):
        _grads(params, step)
        _grads(ref_params, step)
        resumed.step()
        again.step()
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params, strict=True))


def test_a_pickled_optimizer_holds_its_states_bytes_not_a_bucket_per_parameter():
    """A pickle writes a view with all of the memory under it: each parameter's slices of
    its bucket's joined moments carried the whole bucket (32 parameters of 4096 elements:
    8.6 MB for 0.27 MB of states). Each slice now goes as a copy of its own."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(64, 64)) for _ in range(32)]
    opt = LowBitAdamW(params, lr=1e-3, states="int8", min_size=0, compile=False)
    _grads(params, 0)
    opt.step()
    held = sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
        if torch.is_tensor(v)
    )  # fmt: skip
    codes = opt.state[params[1]]["exp_avg_codes"]
    assert codes.untyped_storage().nbytes() > 16 * codes.nbytes  # joined
    size = len(pickle.dumps(opt)) - len(pickle.dumps(params))
    assert size < 1.5 * held + 100_000, (size, held)


# -- what a kept plan and joined states must notice ---------------------------------------------


def _sgd_steps(opt, params, steps, change=None, afresh=False):
    """``steps`` SGD steps of seeded bfloat16 gradients (the second parameter's first at
    step 1); ``change(opt, i)`` before step ``i``; ``afresh``: planned and joined anew
    every step (the reference)."""
    for i in range(steps):
        g = torch.Generator().manual_seed(100 + i)
        for j, p in enumerate(params):
            p.grad = None if (i == 0 and j == 1) else torch.randn(p.shape, generator=g).bfloat16()
        if change is not None:
            change(opt, i)
        if afresh:
            opt._flats.clear()
            opt._layout = None
        opt.step()


@pytest.mark.parametrize(
    ("sizes", "before", "after"),
    [((64, 96), "int8/block=96", "int8/block=64"), ((100, 300), "int8", "float32")],
)
def test_a_format_change_joins_the_kahan_buffers_again(sizes, before, after):
    """SGD without momentum keeps only Kahan buffers joined, and a format change keeps
    those tensors while padding the parameters otherwise: the entry joined under the old
    padding was taken again, reading and writing other elements' compensation silently
    (equal total padding) or failing on a bare size check."""

    def change(opt, i):
        if i == 3:
            opt.param_groups[0]["states"] = after

    runs = []
    for afresh in (False, True):
        g = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(n, generator=g).bfloat16()) for n in sizes]
        opt = LowBitSGD(params, lr=1e-3, states=before, min_size=0, compensation="kahan",
                        compile=False)  # fmt: skip
        _sgd_steps(opt, params, 6, change, afresh)
        runs.append((params, opt))
    (kept, opt), (fresh, reference) = runs
    for a, b in zip(kept, fresh, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["compensation"], reference.state[b]["compensation"])


@pytest.mark.parametrize("compensation", ["stochastic", "kahan"])
def test_buckets_a_fresh_plan_would_join_are_joined(compensation):
    """A parameter whose first SGD step came a step after its neighbour's was planned apart
    (its first step makes its buffer), and the kept plan kept it apart, where a fresh plan
    (a resumed run's) buckets the two: the random bits follow a bucket's layout, so a
    resumed stochastic run differed from the one that never stopped."""
    runs = []
    for afresh in (False, True):
        g = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(300, generator=g).bfloat16()) for _ in range(2)]
        opt = LowBitSGD(params, lr=1e-3, momentum=0.9, states="int8", min_size=0,
                        compensation=compensation, compile=False)  # fmt: skip
        _sgd_steps(opt, params, 5, afresh=afresh)
        runs.append(params)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("states", ["float32", "int8"])
def test_state_tensors_given_other_memory_through_data_are_followed(states):
    """The snippet that moves an optimizer's state to a device (``v.data = v.data.to(d)``
    on each state tensor) keeps the tensor objects: the joined step counts and moments and
    the plan's views went on updating the old memory, the state's counts stopped and a
    checkpoint held stale moments. Here the memory is a copy (same device)."""
    runs = []
    for move in (False, True):
        params = _params(3)
        opt = LowBitAdamW(params, lr=1e-2, states=states, min_size=0, compile=False)
        for i in range(8):
            g = torch.Generator().manual_seed(i)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            if move and i == 3:
                for state in opt.state.values():
                    for v in state.values():
                        if torch.is_tensor(v):
                            v.data = v.data.clone()
            opt.step()
        runs.append((params, opt))
    (kept, opt), (moved, other) = runs
    for a, b in zip(kept, moved, strict=True):
        assert torch.equal(a, b)
        assert other.state[b]["step"].item() == 8
        for k, v in opt.state[a].items():
            if torch.is_tensor(v):
                assert torch.equal(v, other.state[b][k]), k


def test_a_refused_step_leaves_the_step_counts():
    """A step refused before any update (a parameter resized since its state was made)
    said nothing was updated, yet every parameter's step count had moved on by one."""
    params = _params(2)
    opt = LowBitAdamW(params, states="int8", min_size=0, compile=False)
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    params[0].data = torch.randn(20, 40)  # (800 elements: four blocks where 600 took three)
    params[0].grad = torch.ones(20, 40)
    with pytest.raises(RuntimeError, match="no longer has the size"):
        opt.step()
    assert [opt.state[p]["step"].item() for p in params] == [2.0, 2.0]


@pytest.mark.parametrize("cls", [LowBitAdamW, LowBitSGD])
def test_a_complex_parameter_after_an_odd_sized_float64_one_steps_with_float32_moments(cls):
    """A float64 parameter of an odd size and a complex128 one, float32 moments (the
    default under ``min_size``): joined in one run, the complex moment's piece began at an
    odd offset, read back as complex it failed ("storage_offset divisible by 2") after the
    step counts had moved. Complex parameters run apart: the step is torch's (the real
    pairs stepped by torch's optimizer, float64 moments against our float32)."""
    torch.manual_seed(0)
    made = [torch.randn(5, dtype=torch.float64), torch.randn(3, dtype=torch.complex128)]
    ours = [nn.Parameter(t.clone()) for t in made]
    theirs = [nn.Parameter(t.clone()) for t in (made[0], torch.view_as_real(made[1]))]
    kw = {"momentum": 0.9} if cls is LowBitSGD else {}
    opt = cls(ours, lr=1e-2, compile=False, **kw)
    reference = (torch.optim.SGD if cls is LowBitSGD else torch.optim.AdamW)(theirs, lr=1e-2, **kw)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        for a, b in zip(ours, theirs, strict=True):
            grad = torch.randn(a.shape, generator=g, dtype=a.dtype)
            a.grad, b.grad = grad, _real(grad).clone()
        opt.step()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(_real(a), b, rtol=1e-5, atol=1e-6)


def test_state_bytes_counts_the_padding_of_joined_kahan_buffers():
    """Parameters stepped together hold slices of one Kahan buffer padded to whole blocks:
    `state_bytes` added the slices and missed the padding (20 parameters of 4097 elements,
    int8: 255 elements of two bytes each a parameter). It counts each storage once, whole."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4097).bfloat16()) for _ in range(20)]
    opt = LowBitAdamW(params, lr=1e-3, states="int8", compensation="kahan", compile=False)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    storages = {}
    for state in opt.state.values():
        for key, t in state.items():
            if key != "step" and torch.is_tensor(t):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    joined = {opt.state[p]["compensation"].untyped_storage().data_ptr() for p in params}
    assert len(joined) < len(params)  # (the case that was undercounted)
    assert state_bytes(opt) == sum(storages.values())


@pytest.mark.parametrize(
    ("states", "dtype", "compensation"),
    [
        ("float32", torch.float32, None),
        ("int8", torch.float32, None),
        ("int4", torch.bfloat16, "kahan"),
        ("fp8", torch.bfloat16, "kahan"),
    ],
)
def test_state_bytes_on_the_meta_device_equal_the_cpus(states, dtype, compensation):
    """Every storage on the meta device has the address 0: `state_bytes` counted the first
    state tensor of a meta model and no other (torch's AdamW a quarter of its bytes), where
    a meta model is how one sizes states without their memory; and the step took every meta
    parameter for one overlapping the others, stepping each alone, so Kahan buffers were not
    joined (nor their padding counted) as on the CPU. Counted and laid out as on the CPU."""
    counts = []
    for device in ("cpu", "meta"):
        params = [
            nn.Parameter(torch.zeros(64, 128, device=device, dtype=dtype)),
            nn.Parameter(torch.zeros(8200, device=device, dtype=dtype)),
        ]
        for p in params:
            p.grad = torch.zeros_like(p)
        kw = {} if compensation is None else {"compensation": compensation}
        ours = LowBitAdamW(params, states=states, min_size=0, **kw)
        torchs = torch.optim.AdamW(params)
        ours.step()
        torchs.step()
        counts.append((state_bytes(ours), state_bytes(torchs)))
    assert counts[0] == counts[1]
    assert counts[0][1] == 2 * dtype.itemsize * (64 * 128 + 8200)
