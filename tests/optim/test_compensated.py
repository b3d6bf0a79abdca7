"""Compensated updates of 16-bit weights (Kahan, stochastic rounding) without float32 masters."""

from __future__ import annotations

import copy
import io
import math
import types
import warnings

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from torch import nn
from torch._dynamo.utils import counters

import mixprec
from mixprec.optim import LossScaleOptimizer, engine
from mixprec.optim.compensated import (
    COMPILE_MIN_ELEMENTS,
    SMALL,
    Compensator,
    compensator,
    kernels,
    stochastic_round_,
)

OPTIMIZERS = {
    "adamw": lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1),
    "adam": lambda ps, lr: torch.optim.Adam(ps, lr=lr, weight_decay=0.01),
    "sgd-nesterov": lambda ps, lr: torch.optim.SGD(
        ps, lr=lr, momentum=0.9, nesterov=True, weight_decay=0.01
    ),
    "sgd-dampening-maximize": lambda ps, lr: torch.optim.SGD(
        ps, lr=lr, momentum=0.5, dampening=0.2, maximize=True
    ),
    "sgd": lambda ps, lr: torch.optim.SGD(ps, lr=lr),
}


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bfloat16 numbers at ``x`` (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs())) - 7)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_float64_step_is_torchs(name):
    # unlowered parameters step plainly: the algorithm itself must be torch's
    torch.manual_seed(0)
    w0 = torch.randn(5, 3, dtype=torch.float64)
    ours, theirs = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    opt_ours, opt_theirs = OPTIMIZERS[name]([ours], 1e-2), OPTIMIZERS[name]([theirs], 1e-2)
    comp = Compensator("kahan", seed=0)
    for _ in range(20):
        g = torch.randn(5, 3, dtype=torch.float64)
        ours.grad, theirs.grad = g.clone(), g.clone()
        comp.step(opt_ours)
        opt_theirs.step()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def test_an_adamw_group_with_coupled_weight_decay_steps_as_torchs():
    """torch's AdamW reads each group's ``decoupled_weight_decay``: a group that sets it
    False steps with L2 decay there, and did with decoupled decay here (off by 0.43 after
    three steps of lr 0.1, weight decay 0.5)."""
    torch.manual_seed(0)
    w = torch.randn(8, dtype=torch.float64)

    def make() -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
        params = [nn.Parameter(w.clone()) for _ in range(2)]
        groups = [{"params": params[:1]}, {"params": params[1:], "decoupled_weight_decay": False}]
        return params, torch.optim.AdamW(groups, lr=0.1, weight_decay=0.5)

    _steps_as_torch(make, [torch.randn(8, dtype=torch.float64) for _ in range(3)])


@pytest.mark.parametrize("decoupled_first", [True, False])
def test_groups_whose_decay_scalars_coincide_keep_their_own_decay_form(decoupled_first):
    """Under maximize, a decoupled decay's scalar (-lr * wd) can equal another group's L2
    one (wd * -1): small parameters of both were filed under one batched call, and every
    one of them took the first group's form of decay (off by 2e-2 after one step)."""
    torch.manual_seed(0)
    w, g = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    groups = [
        {"decoupled_weight_decay": True, "weight_decay": 1.0},
        {"decoupled_weight_decay": False, "weight_decay": 0.01},
    ]
    if not decoupled_first:
        groups.reverse()

    def make() -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
        params = [nn.Parameter(w.clone()) for _ in groups]
        made = [{"params": [p], **group} for p, group in zip(params, groups, strict=True)]
        return params, torch.optim.Adam(made, lr=0.01, maximize=True)

    _steps_as_torch(make, [g] * 3)


def _steps_as_torch(make, grads: list[torch.Tensor]) -> None:
    """``make()``'s float64 parameters stepped through a Kahan `Compensator` and by torch
    alone on the same gradients end the same, up to float64 rounding."""
    (ours, opt_ours), (theirs, opt_theirs) = make(), make()
    comp = Compensator("kahan", seed=0, compile=False)
    for g in grads:
        for a, b in zip(ours, theirs, strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        comp.step(opt_ours)
        opt_theirs.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_parameter_that_skips_steps_gets_its_own_bias_correction(name):
    """One parameter without a gradient for the first 10 steps is 10 steps behind: Adam's
    bias correction used the first parameter's count for the whole group (off by 1e-2)."""
    torch.manual_seed(0)
    w0 = torch.randn(3, 4, dtype=torch.float64)
    ours = [nn.Parameter(w.clone()) for w in w0]
    theirs = [nn.Parameter(w.clone()) for w in w0]
    opt_ours, opt_theirs = OPTIMIZERS[name](ours, 1e-2), OPTIMIZERS[name](theirs, 1e-2)
    comp = Compensator("kahan", seed=0)
    for step in range(20):
        g = torch.randn(3, 4, dtype=torch.float64)
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            late = (i == 0 and step < 10) or (i == 2 and step % 3 == 0)
            a.grad = b.grad = None if late else g[i].clone()
        comp.step(opt_ours)
        opt_theirs.step()
    for a, b in zip(ours, theirs, strict=True):
        # a few float64 ulps of weights ~1 (torch orders the update's products differently)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
        if "adam" in name:
            assert opt_ours.state[a]["step"] == opt_theirs.state[b]["step"]


def _trajectory(name: str, dtype: torch.dtype, kind: str | None) -> torch.Tensor:
    """1,000 updates of ~1e-4 of each weight; the same gradients and (bfloat16-representable)
    start for every run."""
    gen = torch.Generator().manual_seed(1)
    w0 = (1 + torch.rand(256, generator=gen)).to(torch.bfloat16)  # weights in [1, 2)
    p = nn.Parameter(w0.to(dtype))
    opt = OPTIMIZERS[name]([p], 1e-5 if name.startswith("sgd") else 1e-4)
    comp = Compensator(kind, seed=0) if kind else None
    for _ in range(1000):
        p.grad = (1 + 0.1 * torch.randn(256, generator=gen, dtype=torch.float64)).to(dtype)
        if comp is not None:
            comp.step(opt)
        else:
            opt.step()
    return p.detach().double()


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd-nesterov"])
def test_kahan_tracks_float64_where_plain_bfloat16_stalls(name):
    ref = _trajectory(name, torch.float64, None)
    start = (1 + torch.rand(256, generator=torch.Generator().manual_seed(1))).double()
    start = start.to(torch.bfloat16).double()
    assert (start - ref).abs().min() > 4 * _ulp_bf16(ref).max()  # the reference moves
    plain = _trajectory(name, torch.bfloat16, None)
    assert torch.equal(plain, start)  # every update rounded away: plain bfloat16 stalls
    kahan = _trajectory(name, torch.bfloat16, "kahan")
    assert ((kahan - ref).abs() <= _ulp_bf16(start)).all()  # within one bfloat16 step
    # stochastic rounding is right on average (each weight random-walks a few steps)
    sr = _trajectory(name, torch.bfloat16, "stochastic")
    torch.testing.assert_close((start - sr).mean(), (start - ref).mean(), rtol=0.05, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_is_unbiased_and_seeded(dtype):
    x = torch.full((200_000,), 1.0 + 1e-3)
    out = torch.empty_like(x, dtype=dtype)
    stochastic_round_(out, x, torch.Generator().manual_seed(0))
    spacing = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    values = out.double().unique()
    assert len(values) == 2 and values[1] - values[0] == spacing  # the two neighbours only
    assert abs(out.double().mean().item() - x[0].item()) < 2e-5
    again = torch.empty_like(out)
    stochastic_round_(again, x, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    stochastic_round_(again, x, torch.Generator().manual_seed(1))
    assert not torch.equal(out, again)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compiled", [False, True])
def test_stochastic_rounding_never_overflows_what_rounding_to_nearest_keeps(dtype, compiled):
    """Past a 16-bit type's largest value the neighbour above is infinity: a weight at the
    top of the range plus a small update (float16 65504 + 8) became inf one time in four,
    where rounding to nearest keeps the largest. Values that overflow to nearest still do."""
    top = torch.finfo(dtype).max
    ulp = 32.0 if dtype == torch.float16 else 2.0**120
    x = torch.tensor([top + ulp / 4, -(top + ulp / 4), top + ulp / 2, 1.0, -0.0, float("nan")])
    x = x.repeat_interleave(4096)
    lanes = engine.Lanes(x, 0, 7)
    noise = lanes.noise(0)[1]

    def rounded(x, noise):
        if dtype == torch.bfloat16:
            return engine.stochastic_bits(x, noise).view(torch.float32)
        return engine.round_stochastic(x, noise, dtype)

    fn = torch.compile(rounded, fullgraph=True) if compiled else rounded
    out = fn(x, noise).to(dtype).float().view(6, -1)  # (stored: 65536 is float16's inf)
    nearest = x.to(dtype).float().view(6, -1)
    for i in (0, 1, 3, 4):
        assert torch.equal(out[i].unique(), nearest[i].unique()), i  # one value: no inf
    assert set(out[2].unique().tolist()) <= {top, float("inf")}  # overflows to nearest too
    assert out[5].isnan().all()
    with pytest.raises(ValueError, match="bfloat16 or float16, got dst of dtype torch.float32"):
        stochastic_round_(torch.empty(3), torch.ones(3))


def test_adding_1e3_a_thousand_times_to_one():
    # the facts sheet: plain bfloat16 stays 1.0, stochastic averages ~2.0, Kahan gives 2.000
    results = {}
    for kind in (None, "stochastic", "kahan"):
        p = nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
        opt = torch.optim.SGD([p], lr=1e-3)
        comp = Compensator(kind, seed=0) if kind else None
        for _ in range(1000):
            p.grad = -torch.ones_like(p)
            comp.step(opt) if comp else opt.step()
        results[kind] = p.detach().float()
    assert (results[None] == 1.0).all()
    assert abs(results["stochastic"].mean().item() - 2.0) < 0.01
    assert (results["kahan"] - 2.0).abs().max() <= 2.0**-6  # one bf16 step at 2.0


def _run(kind: str, steps: int, state: dict | None = None, seed: int = 0):
    """A tiny bf16-true model trained for ``steps`` from ``state``; returns the model and
    a checkpoint taken at the end (through torch.save, as a file would)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    precision = mixprec.Precision("bf16-true", compensation=kind, allow_slow=True)
    model, opt = precision.setup(model, opt)
    done = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        done = state["done"]
    data = torch.Generator().manual_seed(7)
    batches = [
        (torch.randn(8, 4, generator=data), torch.randn(8, 1, generator=data)) for _ in range(10)
    ]
    for x, y in batches[done : done + steps]:
        loss = nn.functional.mse_loss(model(precision.convert_input(x)).float(), y)
        precision.backward(loss)
        precision.step(opt)
        opt.zero_grad()
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "done": done + steps},
        buffer,
    )
    buffer.seek(0)
    return model, torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("kind", ["kahan", "stochastic"])
def test_resume_is_bit_identical(kind):
    straight, _ = _run(kind, 10)
    _, half = _run(kind, 5)
    assert half["optimizer"]["compensation"]["kind"] == kind
    resumed, _ = _run(kind, 5, state=half, seed=123)  # another global seed: state must win
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert a.dtype == torch.bfloat16
        assert torch.equal(a, b)


def test_trainer_resume_with_compensation_is_bit_identical(tmp_path):
    from mixprec import Trainer
    from mixprec.trainer import ModelCheckpoint

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16, shuffle=True
    )

    def fit(epochs: int, root, ckpt_path=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        trainer = Trainer(
            precision=mixprec.Precision("bf16-true", compensation="stochastic", allow_slow=True),
            max_epochs=epochs,
            seed=0,
            deterministic=True,
            logger=False,
            enable_progress_bar=False,
            default_root_dir=root,
            callbacks=[ModelCheckpoint(save_last=True)],
        )
        loss = lambda out, y: nn.functional.mse_loss(out.float(), y.float())  # noqa: E731
        trainer.fit(model, data, loss_fn=loss, ckpt_path=ckpt_path)
        return model, trainer

    straight, _ = fit(2, tmp_path / "a")
    fit(1, tmp_path / "b")
    (last,) = (tmp_path / "b").rglob("last.ckpt")
    resumed, trainer = fit(2, tmp_path / "c", ckpt_path=last)
    assert trainer.global_step == 8
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def _caught(make) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()
    return [w for w in caught if "compensation=" in str(w.message)]


def test_warns_once_for_an_uncompensated_16_bit_optimizer():
    def params(dtype):
        return [nn.Parameter(torch.ones(3, dtype=dtype))]

    plain = _caught(lambda: LossScaleOptimizer(torch.optim.AdamW(params(torch.bfloat16))))
    assert len(plain) == 1 and issubclass(plain[0].category, UserWarning)
    assert "compensation='kahan'" in str(plain[0].message)
    fp16 = torch.optim.SGD(params(torch.float16), lr=0.1)
    assert len(_caught(lambda: LossScaleOptimizer(fp16, master_weights=False))) == 1

    opt = torch.optim.AdamW(params(torch.bfloat16))
    assert not _caught(lambda: LossScaleOptimizer(opt, compensation="kahan"))
    opt = torch.optim.AdamW(params(torch.bfloat16))
    assert not _caught(lambda: LossScaleOptimizer(opt, master_weights=True))
    assert not _caught(lambda: LossScaleOptimizer(torch.optim.AdamW(params(torch.float32))))
    assert not _caught(lambda: LossScaleOptimizer(torch.optim.SGD(params(torch.float16))))


def test_the_warning_is_given_once_per_setup_not_per_step():
    model = nn.Linear(2, 1)
    precision = mixprec.Precision("bf16-true", allow_slow=True)

    def train():
        m, opt = precision.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(3):
            precision.backward(m(torch.ones(1, 2, dtype=torch.bfloat16)).float().sum())
            precision.step(opt)

    assert len(_caught(train)) == 1


def test_bad_input_is_a_clear_error():
    bf16 = [nn.Parameter(torch.ones(3, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match="'kahan', 'stochastic' or None"):
        mixprec.Precision("bf16-true", compensation="foo")
    with pytest.raises(ValueError, match="'kahan', 'stochastic' or None"):
        LossScaleOptimizer(torch.optim.AdamW(bf16), compensation="foo")
    with pytest.raises(ValueError, match="choose one"):
        mixprec.Precision("bf16-true", compensation="kahan", master_weights=True)
    with pytest.raises(ValueError, match="choose one"):
        LossScaleOptimizer(torch.optim.AdamW(bf16), compensation="kahan", master_weights=True)
    f32 = [nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match=r"bfloat16/float16 parameters.*float32"):
        LossScaleOptimizer(torch.optim.AdamW(f32), compensation="kahan")
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="bf16-true"):
        mixprec.Precision("bf16-mixed", compensation="kahan", allow_slow=True).setup(
            model, torch.optim.AdamW(model.parameters())
        )
    with pytest.raises(TypeError, match="AdamW, Adam and SGD"):
        LossScaleOptimizer(torch.optim.RMSprop(bf16), compensation="kahan")
    with pytest.raises(ValueError, match="amsgrad"):
        LossScaleOptimizer(torch.optim.Adam(bf16, amsgrad=True), compensation="stochastic")
    with pytest.raises(ValueError, match="compensation='kahan' or 'stochastic'"):
        Compensator(None)  # type: ignore[arg-type]


def test_a_checkpoint_of_another_compensation_is_refused():
    def opt(kind):
        return LossScaleOptimizer(
            torch.optim.AdamW([nn.Parameter(torch.ones(3, dtype=torch.bfloat16))]),
            compensation=kind,
        )

    with pytest.raises(ValueError, match="trained with compensation 'kahan'"):
        opt("stochastic").load_state_dict(opt("kahan").state_dict())


@pytest.mark.parametrize(
    "saved, loading",
    [
        (dict(compensation="stochastic"), dict(compensation="kahan")),
        (dict(compensation="kahan"), dict()),  # (its buffers would be dropped, silently)
        (dict(master_weights=True), dict(compensation="kahan")),
    ],
)
def test_check_state_dict_refuses_what_load_refuses_and_a_refused_load_changes_nothing(
    saved, loading
):
    """Found by a review: check_state_dict (which the Trainer's resume runs before loading
    the weights) passed another compensation kind and another set of masters, which
    load_state_dict then refused after the model was loaded; and a refused load had already
    given float32 masters to the optimizer's groups."""

    def built(**kw):
        torch.manual_seed(0)
        model = nn.Linear(3, 1).to(torch.bfloat16)
        opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters()), model=model,
                                 scaler="none", **kw)  # fmt: skip
        opt.zero_grad()
        model(torch.randn(2, 3, dtype=torch.bfloat16)).float().sum().backward()
        return opt

    state = built(**saved).state_dict()
    opt = built(**loading)
    dtypes = [p.dtype for g in opt.param_groups for p in g["params"]]
    assert not opt.loads_directly(state)
    with pytest.raises(ValueError, match="load_state_dict_across_precisions"):
        opt.check_state_dict(state)
    with pytest.raises(ValueError, match="load_state_dict_across_precisions"):
        opt.load_state_dict(state)
    assert [p.dtype for g in opt.param_groups for p in g["params"]] == dtypes
    assert opt.loads_directly(built(**loading).state_dict())


# -- the compiled step ----------------------------------------------------------------------

STEPPERS = {
    "adamw-kahan-bf16": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1), "kahan"),
    "adam-l2-maximize-stochastic-fp16": (
        lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01, maximize=True),
        "stochastic",
    ),
    "sgd-nesterov-kahan-bf16": (
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
        "kahan",
    ),
    "sgd-stochastic-bf16": (lambda ps: torch.optim.SGD(ps, lr=1e-2), "stochastic"),
}


def _odd_params(dtype: torch.dtype) -> list[nn.Parameter]:
    """One parameter stepped in place, two large ones packed (bfloat16 pairs need an even
    size from an even offset: an odd size, an odd offset) and three small ones packed
    together, one of them transposed, with zeros, subnormals and the largest finite values
    among them."""
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(2 * SMALL + 2, generator=gen)
    big[:4] = torch.tensor([0.0, -0.0, 1e-39, -3e-41])
    big[4:6] = torch.finfo(dtype).max
    odd = torch.randn(SMALL + 3, generator=gen)
    shifted = torch.randn(SMALL + 3, generator=gen).to(dtype)[1:]  # from an odd offset
    small = [torch.randn(5, 7, generator=gen).t(), torch.randn(33, generator=gen), torch.zeros(3)]
    params = [nn.Parameter(t.to(dtype)) for t in [big, odd, *small]]
    params.insert(2, nn.Parameter(shifted))
    assert params[2].storage_offset() == 1
    return params


def _steps(name: str, compile: bool, steps: int = 3) -> list[torch.Tensor]:
    make, kind = STEPPERS[name]
    dtype = torch.float16 if name.endswith("fp16") else torch.bfloat16
    params = _odd_params(dtype)
    opt = make(params)
    comp = Compensator(kind, seed=5, compile=compile)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for i, p in enumerate(params):
            if i == 2 and step == 1:
                p.grad = None  # a step without it: its own step count and key
                continue
            scale = 10.0 ** torch.randint(-9, 1, p.shape, generator=gen)
            g = torch.randn(p.shape, generator=gen) * scale
            p.grad = g.to(dtype)
        comp.step(opt)
    return [p.detach() for p in params] + [
        t for p in params for t in opt.state[p].values() if t.dim() > 0
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns (NaNs and signed zeros compared exactly)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STEPPERS))
def test_the_compiled_step_is_the_eager_step_bit_for_bit(name):
    """torch.compile's fused step and the eager fallback are one function: the same bits for
    AdamW/Adam/SGD, Kahan and stochastic rounding, bfloat16 and float16, a parameter stepped
    in place and packed ones, and zeros, subnormals and the largest finite values."""
    compiled, eager = _steps(name, compile=True), _steps(name, compile=False)
    assert len(compiled) == len(eager) >= 4
    for a, b in zip(compiled, eager, strict=True):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.slow
def test_one_build_serves_every_size():
    """Shapes are dynamic: after the first call, other sizes (and the packed small
    parameters) run the same build, with no recompile."""
    comp = Compensator("kahan", seed=0, compile=True)

    def step(sizes):
        params = [nn.Parameter(torch.ones(n, dtype=torch.bfloat16)) for n in sizes]
        opt = torch.optim.AdamW(params)
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        comp.step(opt)

    step([SMALL])  # builds (or finds) the AdamW Kahan kernel
    with torch._dynamo.config.patch(error_on_recompile=True):
        step([SMALL + 3, 2 * SMALL, 7, 100])


def test_rounding_is_a_function_of_seed_and_step_counts():
    """No generator state: the state is the seed (and the optimizer's step counts), so a
    Compensator rebuilt from ``state_dict`` rounds as the original; a checkpoint of the
    earlier format (with generator states) still loads."""

    def run(comp, opt, p, steps):
        for _ in range(steps):
            p.grad = torch.full_like(p, 1e-3)
            comp.step(opt)

    p = nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    opt = torch.optim.SGD([p], lr=1.0)  # updates of 1/8 of a bfloat16 step
    comp = Compensator("stochastic", seed=3)
    assert comp.state_dict() == {"kind": "stochastic", "seed": 3}
    run(comp, opt, p, 2)
    q = nn.Parameter(p.detach().clone())
    opt_q = torch.optim.SGD([q], lr=1.0)
    opt_q.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch shares "step" tensors
    again = Compensator("stochastic")
    again.load_state_dict({"kind": "stochastic", "seed": 3, "generators": {"cpu": "old"}})
    run(comp, opt, p, 3)
    run(again, opt_q, q, 3)
    assert torch.equal(p, q)
    assert 0.2 < (p < 1).float().mean() < 0.8  # the rounding is random across elements


def _unhash(x: torch.Tensor) -> torch.Tensor:
    """The inverse of ``engine.hash32`` (int64 arithmetic modulo 2^32)."""
    x = x.long() & 0xFFFFFFFF

    def unxorshift(x, shift):
        y = x
        for _ in range(32 // shift + 1):
            y = x ^ (y >> shift)
        return y

    for c, shift in ((0x846CA68B, 16), (0x7FEB352D, 15)):
        x = unxorshift(x, shift)
        x = (x * pow(c, -1, 1 << 32)) & 0xFFFFFFFF
    return unxorshift(x, 16)


def test_the_noise_is_two_halves_of_a_bijection_of_index_plus_key():
    """Element i of a call with key k takes the two 16-bit halves of ``_hash(i + k)``: the
    hash is a bijection of the 32-bit values (its inverse undoes it), so with a uniform key
    each element's 32-bit value is uniform and its halves uniform and independent; a
    call's elements take distinct values; bfloat16 pairs read the same values."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-(1 << 31), 1 << 31, (100_000,), generator=gen, dtype=torch.int64)
    x = torch.cat([x, torch.tensor([0, 1, -1, (1 << 31) - 1, -(1 << 31)])]).int()
    h = engine.hash32(x)
    assert torch.equal(_unhash(h), x.long() & 0xFFFFFFFF)
    key, start, n = -123456789, 1 << 20, 5000
    low, high = engine.random_bits(n, start, key, torch.device("cpu"))
    i = torch.arange(start, start + n, dtype=torch.int64)
    expect = engine.hash32((i + key).int())
    assert torch.equal(low, expect & 0xFFFF)
    assert torch.equal(high, (expect.long() >> 16) & 0xFFFF)
    assert (low | (high << 16)).unique().numel() == n  # distinct 32-bit values
    for half in (0, 1):  # pairs: the even and the odd elements
        got = engine.random_bits(n // 2, start + half, key, torch.device("cpu"), step=2)
        assert torch.equal(got[0], low[half::2]) and torch.equal(got[1], high[half::2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_keeps_signed_zeros_infinities_and_nans_of_any_payload(dtype):
    """The eager bfloat16 rounding adds noise to the bits a bfloat16 drops: a NaN whose
    payload would carry into the sign stays a NaN, and -0.0 stays -0.0."""
    bits = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000, 0x7F800000, -0x800000, -(1 << 31), 0])
    x = bits.to(torch.int32).view(torch.float32)
    for noise in (0, 0xFFFF):
        out = engine.round_stochastic(x, torch.full_like(bits, noise, dtype=torch.int32), dtype)
        assert out[:3].isnan().all()
        assert out[3] == float("inf") and out[4] == float("-inf")
        assert torch.equal(out[5:].signbit(), torch.tensor([True, False]))
        assert (out[5:] == 0).all()


def test_a_weight_without_decay_steps_as_torch_steps_an_infinite_one():
    """Without weight decay the step has no decay term (not a term times zero): an
    infinite weight stays infinite, as in torch's AdamW, instead of becoming inf * 0 = NaN."""
    p = nn.Parameter(torch.tensor([float("inf"), 1.0], dtype=torch.bfloat16))
    opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.0)  # a step of 0.01: below 1 surely
    p.grad = torch.ones_like(p)
    Compensator("stochastic", seed=0).step(opt)
    assert p[0] == float("inf") and p[1] < 1.0


def test_eager_slices_do_not_change_the_step(monkeypatch):
    """The eager path steps cache-sized slices with their offsets: slicing changes nothing."""
    whole = _steps("adamw-kahan-bf16", compile=False, steps=2)
    monkeypatch.setattr(compensator, "EAGER_CHUNK", 1001)  # (odd: slices of odd sizes)
    sliced = _steps("adamw-kahan-bf16", compile=False, steps=2)
    for a, b in zip(whole, sliced, strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_automatic_compile_leaves_small_steps_eager():
    """compile=None builds nothing for a step below COMPILE_MIN_ELEMENTS elements."""
    frames = counters["frames"]["total"]
    model = nn.Linear(16, 16).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    Compensator("kahan", seed=0).step(opt)
    assert counters["frames"]["total"] == frames


@pytest.fixture
def _fresh_builds():
    """Builds of this test only: the compiled steps are rebuilt before and after it."""
    kernels._COMPILED.clear()
    torch._dynamo.reset()
    yield
    kernels._COMPILED.clear()
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.usefixtures("_fresh_builds")
def test_a_failed_automatic_build_warns_once_and_steps_eagerly():
    """compile=None on a host whose C++ compiler does not work: one warning naming the
    error, then the eager step (the same results); compile=True raises instead. (Plain SGD:
    the smallest graph to build before the compiler fails.)"""

    def run(compile):
        p = nn.Parameter(torch.ones(COMPILE_MIN_ELEMENTS, dtype=torch.bfloat16))
        opt = torch.optim.SGD([p], lr=1e-2)
        comp = Compensator("kahan", seed=0, compile=compile)
        for _ in range(2):
            p.grad = torch.full_like(p, 1e-3)
            comp.step(opt)
        return p

    with torch._inductor.config.patch({"cpp.cxx": ("no-such-c++-compiler",)}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            automatic = run(None)
        (warning,) = [w for w in caught if "could not be compiled" in str(w.message)]
        assert "no-such-c++-compiler" in str(warning.message)
        assert "compile=False" in str(warning.message)
        assert torch.equal(automatic, run(False))
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="C\\+\\+ compiler"):
            run(True)


def test_compile_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match="compile must be None, True or False"):
        Compensator("kahan", compile="yes")  # type: ignore[arg-type]


# -- state kept in float32, closures, hooks, and what is refused ------------------------------


@pytest.mark.parametrize(
    "dtype, kind, compile",
    [
        *((d, k, False) for d in (torch.bfloat16, torch.float16) for k in ("kahan", "stochastic")),
        # (compiled: a build per dtype and kind; one of each)
        pytest.param(torch.bfloat16, "kahan", True, marks=pytest.mark.slow),
        pytest.param(torch.float16, "stochastic", True, marks=pytest.mark.slow),
    ],
)
def test_float32_moments_of_16_bit_weights_stay_float32_math(dtype, kind, compile):
    """Moments a user keeps in float32 beside 16-bit weights are float32 arithmetic, bit for
    bit: only the weight's update is compensated. The second moment was stochastically
    rounded to the float16 grid (up to 1e-3 of it off)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(300).to(dtype))
    opt = torch.optim.AdamW([w], lr=1e-3, betas=(0.9, 0.999))
    state = opt.state[w]
    state.update(step=torch.tensor(0.0), exp_avg=torch.zeros(300), exp_avg_sq=torch.zeros(300))
    m, v = torch.zeros(300), torch.zeros(300)
    comp = Compensator(kind, seed=0, compile=compile)
    for _ in range(20):
        g = (torch.randn(300) * 1e-3).to(dtype)
        w.grad = g
        comp.step(opt)
        m = m * 0.9 + g.float() * (1 - 0.9)
        v = v * 0.999 + g.float() * g.float() * (1 - 0.999)
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(state["exp_avg"], m)
    assert torch.equal(state["exp_avg_sq"], v)
    assert w.dtype == dtype


@pytest.mark.parametrize("kind", ["kahan", "stochastic"])
def test_float16_weights_get_float32_adam_moments(kind):
    """Adam's moments of a float16 weight are float32 (made so, or widened from torch's
    float16 ones at the step): in float16 a squared gradient under 2.4e-4 was 0, the update
    divided the first moment by eps, and the weight moved by ~1e3 in one step."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64).half())
    made = nn.Parameter(w.detach().clone())
    opt = torch.optim.AdamW([w], lr=1e-2)
    opt.state[w].update(  # as torch's own step (or its load_state_dict) leaves them
        step=torch.tensor(0.0),
        exp_avg=torch.zeros(64, dtype=torch.float16),
        exp_avg_sq=torch.zeros(64, dtype=torch.float16),
    )
    opt_made = torch.optim.AdamW([made], lr=1e-2)
    comp = Compensator(kind, seed=0, compile=False)
    # (what float16 lost is named, once)
    with pytest.warns(UserWarning, match=r"compensator\.attach\(optimizer\)"):
        for _ in range(3):
            g = (torch.randn(64) * 1e-3).half()  # squares under float16's smallest subnormal
            for p, o in ((w, opt), (made, opt_made)):
                before = p.detach().float().clone()
                p.grad = g.clone()
                comp.step(o)
                assert (p.float() - before).abs().max() <= 1.1e-2  # lr, not ~1e3
    for o, p in ((opt, w), (opt_made, made)):
        assert o.state[p]["exp_avg"].dtype == o.state[p]["exp_avg_sq"].dtype == torch.float32
        assert (o.state[p]["exp_avg_sq"] > 0).all()
    assert torch.equal(w, made)


@pytest.mark.parametrize("kind", ["kahan", "stochastic"])
def test_a_float16_run_resumed_from_a_file_is_the_run_that_never_stopped(kind, tmp_path):
    """torch's load_state_dict casts the float32 Adam moments of float16 weights to float16
    (second moments of gradients ~1e-5 become 0: the next update divided by eps moved
    weights by ~0.4 at lr 1e-3): an attached optimizer keeps them as saved, so a run
    resumed in a fresh process from a file, and one rolled back in place, go on bit for
    bit."""

    def fresh() -> tuple[nn.Parameter, torch.optim.Optimizer]:
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(1000).half())
        return w, torch.optim.AdamW([w], lr=1e-3)

    def steps(w: nn.Parameter, opt: torch.optim.Optimizer, comp: Compensator, n: int, at: int):
        for i in range(at, at + n):
            w.grad = (torch.randn(1000, generator=torch.Generator().manual_seed(i)) * 1e-5).half()
            comp.step(opt)

    w, opt = fresh()
    comp = Compensator(kind, seed=5, compile=False)
    steps(w, opt, comp, 4, 0)
    torch.save(
        {"w": w.detach(), "opt": opt.state_dict(), "comp": comp.state_dict()}, tmp_path / "c.pt"
    )
    steps(w, opt, comp, 4, 4)
    expected = w.detach().clone()

    saved = torch.load(tmp_path / "c.pt")
    w2, opt2 = fresh()
    comp2 = Compensator(kind, compile=False)
    comp2.load_state_dict(saved["comp"])
    comp2.attach(opt2)  # before the load
    with torch.no_grad():
        w2.copy_(saved["w"])
    opt2.load_state_dict(saved["opt"])
    assert opt2.state[w2]["exp_avg_sq"].dtype == torch.float32
    steps(w2, opt2, comp2, 4, 4)
    assert torch.equal(w2, expected)

    # rolled back in place: the optimizer the Compensator stepped is attached already
    with torch.no_grad():
        w.copy_(saved["w"])
    opt.load_state_dict(torch.load(tmp_path / "c.pt")["opt"])
    steps(w, opt, comp, 4, 4)
    assert torch.equal(w, expected)


@pytest.mark.parametrize("kind", ["kahan", "stochastic"])
def test_a_step_with_a_closure_is_the_compensated_step(kind):
    """LossScaleOptimizer.step(closure) took torch's plain 16-bit step: the same gradients
    and seed must give the compensated step's weights and state, bit for bit."""
    data = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 4, generator=data), torch.randn(8, 2, generator=data))] * 4

    def run(with_closure: bool) -> tuple[nn.Module, dict]:
        torch.manual_seed(0)  # the model and the Compensator's seed
        model = nn.Linear(4, 2).to(torch.bfloat16)
        opt = LossScaleOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-3), "none", compensation=kind
        )
        for x, y in batches:

            def closure(x=x, y=y) -> torch.Tensor:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x.bfloat16()).float(), y)
                opt.backward(loss)
                return loss

            if with_closure:
                opt.step(closure)
            else:
                closure()
                opt.step()
        return model, opt.state

    plain, plain_state = run(False)
    closed, closed_state = run(True)
    for a, b in zip(plain.parameters(), closed.parameters(), strict=True):
        assert torch.equal(a, b)
        for key, value in plain_state[a].items():
            assert torch.equal(value, closed_state[b][key]), key
    if kind == "kahan":
        assert "compensation" in closed_state[closed.weight]


def test_step_hooks_run_around_the_compensated_step_as_around_torchs():
    """The optimizer's step pre/post hooks and torch's global ones: the compensated step
    bypassed them. They run in torch's order with torch's arguments, the post-hooks after
    the update; a pre-hook's new arguments are used (here: a closure)."""
    import torch.optim.optimizer as torch_optimizer

    def run(compensated: bool) -> tuple[list, torch.Tensor]:
        seen: list = []
        w = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        opt = torch.optim.AdamW([w], lr=1e-2)

        def record(name):
            return lambda o, args, kwargs: seen.append(
                (name, o is opt, len(args), args[0] is opt, kwargs, w.detach().clone())
            )

        handles = [
            torch_optimizer.register_optimizer_step_pre_hook(record("global pre")),
            opt.register_step_pre_hook(record("pre")),
            opt.register_step_post_hook(record("post")),
            torch_optimizer.register_optimizer_step_post_hook(record("global post")),
        ]
        try:
            w.grad = torch.full_like(w, 0.5)
            if compensated:
                LossScaleOptimizer(opt, "none", compensation="kahan").step()
            else:
                opt.step()
        finally:
            for handle in handles:
                handle.remove()
        return seen, w.detach().clone()

    ours, w_ours = run(True)
    theirs, w_theirs = run(False)
    assert [s[0] for s in ours] == ["global pre", "pre", "post", "global post"]
    assert [s[:5] for s in ours] == [s[:5] for s in theirs]
    for name, *_, seen_w in ours:
        assert torch.equal(seen_w, w_ours if "post" in name else torch.ones(4).bfloat16())
    assert not torch.equal(w_ours, torch.ones(4).bfloat16())

    # a pre-hook that hands the step a closure: the closure runs, its loss comes back
    w = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    opt = torch.optim.SGD([w], lr=0.5)

    def closure() -> torch.Tensor:
        loss = (w.float() ** 2).sum()
        loss.backward()
        return loss

    opt.register_step_pre_hook(lambda o, args, kwargs: ((o, closure), kwargs))
    loss = Compensator("kahan", seed=0).step(opt)
    assert loss == 2.0
    assert torch.equal(w, torch.zeros(2, dtype=torch.bfloat16))  # 1 - 0.5 * 2


def test_an_unwatched_step_skips_torchs_wrapper_and_a_profiled_one_is_recorded():
    """Without hooks or a profiler the step runs without torch's step wrapper (about a
    tenth of a small model's step), with the same result; under a profiler it is recorded
    as torch's step is, and a hook added after a bare step runs at the next."""
    from torch.profiler import profile

    def run(watch: str) -> tuple[torch.Tensor, list[str]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)).to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        comp = Compensator("kahan", seed=1, compile=False)
        seen: list[str] = []

        def post(*_) -> None:
            seen.append("post")

        for i in range(3):
            if watch == "hook" and i == 1:  # (added after a step ran without one)
                opt.register_step_post_hook(post)
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.1 * (i + 1))
            if watch == "profiler":
                with profile() as prof:
                    comp.step(opt)
                seen += [e.name for e in prof.events() if e.name.startswith("Optimizer.step")]
            else:
                comp.step(opt)
        return torch.cat([p.detach().float().flatten() for p in model.parameters()]), seen

    bare, none_seen = run("none")
    hooked, posts = run("hook")
    profiled, records = run("profiler")
    assert torch.equal(bare, hooked) and torch.equal(bare, profiled)
    assert not none_seen and posts == ["post"] * 2
    assert records == ["Optimizer.step#AdamW.step"] * 3


@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
def test_flags_the_step_cannot_honour_are_refused(flag):
    w = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([w], **{flag: True})
    message = rf"do not support AdamW\({flag}=True\).*{flag}=False.*master_weights=True"
    with pytest.raises(ValueError, match=message):
        LossScaleOptimizer(opt, "none", compensation="kahan")
    w.grad = torch.ones_like(w)
    with pytest.raises(ValueError, match=message):
        Compensator("stochastic", seed=0).step(opt)
    assert torch.equal(w, torch.ones(3, dtype=torch.bfloat16))  # nothing stepped
    # a group added later with the flag is refused at the next step
    sgd = torch.optim.SGD([nn.Parameter(torch.ones(3, dtype=torch.bfloat16))], lr=0.1)
    wrapped = LossScaleOptimizer(sgd, "none", compensation="kahan")
    late = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    late.grad = torch.ones_like(late)
    wrapped.add_param_group({"params": [late], "differentiable": True})
    with pytest.raises(ValueError, match=r"SGD\(differentiable=True\)"):
        wrapped.step()


def test_a_low_bit_optimizer_given_a_compensation_is_told_to_take_it_itself():
    """A LowBitAdamW under Precision(compensation=...) was refused as if it were no AdamW
    ("use master_weights=True for other optimizers"): it compensates its own updates."""
    model = nn.Linear(8, 8)
    low = mixprec.LowBitAdamW(model.parameters(), states="int8", min_size=0)
    precision = mixprec.Precision("bf16-true", compensation="kahan", allow_slow=True)
    with pytest.raises(TypeError, match=r"LowBitAdamW\(\.\.\., compensation='kahan'\)"):
        precision.setup(model, low)


def test_a_subclass_that_overrides_step_is_refused():
    """The compensated step would silently stand in for the subclass's own step."""

    class ClippedAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            torch.nn.utils.clip_grad_norm_(self.param_groups[0]["params"], 1.0)
            return super().step(closure)

    class WarmAdamW(torch.optim.AdamW):  # only new defaults: torch's step, accepted
        def __init__(self, params):
            super().__init__(params, lr=1e-2, weight_decay=0.0)

    def bf16() -> list[nn.Parameter]:
        return [nn.Parameter(torch.ones(3, dtype=torch.bfloat16))]

    with pytest.raises(TypeError, match=r"ClippedAdamW overrides step\(\).*master_weights=True"):
        LossScaleOptimizer(ClippedAdamW(bf16()), "none", compensation="kahan")
    with pytest.raises(TypeError, match="ClippedAdamW overrides step"):
        Compensator("kahan", seed=0).step(ClippedAdamW(bf16()))
    ps = bf16()
    opt = LossScaleOptimizer(WarmAdamW(ps), "none", compensation="kahan")
    ps[0].grad = torch.ones_like(ps[0])
    opt.step()
    assert (ps[0] < 1).all()


@pytest.mark.parametrize("size", [5, SMALL + 3])  # packed with others, and stepped alone
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_complex_parameter_steps_as_torch_steps_it(name, size):
    """A complex parameter beside the 16-bit ones steps as its real and imaginary parts, as
    in torch: read as a real tensor, its imaginary part was dropped (a torch warning, and
    the wrong result)."""
    torch.manual_seed(0)
    z0 = torch.randn(size, dtype=torch.complex128)
    ours, theirs = nn.Parameter(z0.clone()), nn.Parameter(z0.clone())
    bf16 = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt_ours, opt_theirs = OPTIMIZERS[name]([ours, bf16], 1e-2), OPTIMIZERS[name]([theirs], 1e-2)
    comp = Compensator("kahan", seed=0, compile=False)
    for _ in range(5):
        g = torch.randn(size, dtype=torch.complex128)
        ours.grad, theirs.grad, bf16.grad = g.clone(), g.clone(), torch.ones_like(bf16)
        comp.step(opt_ours)
        opt_theirs.step()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["kahan", "stochastic"])
def test_resume_keeps_float32_moments_bit_identical(kind):
    """torch's load_state_dict casts a state tensor to its parameter's dtype: float32
    moments beside bfloat16 weights came back rounded to bfloat16, and the resumed run
    differed from one that never stopped."""
    gen = torch.Generator().manual_seed(1)
    grads = [(torch.randn(300, generator=gen) * 1e-3).bfloat16() for _ in range(6)]

    def make(seed: int) -> tuple[nn.Parameter, LossScaleOptimizer]:
        torch.manual_seed(seed)
        w = nn.Parameter(torch.randn(300).bfloat16())
        opt = torch.optim.AdamW([w], lr=1e-3)
        opt.state[w].update(
            step=torch.tensor(0.0), exp_avg=torch.zeros(300), exp_avg_sq=torch.zeros(300)
        )
        return w, LossScaleOptimizer(opt, "none", compensation=kind)

    def steps(w: nn.Parameter, opt: LossScaleOptimizer, grads: list[torch.Tensor]) -> None:
        for g in grads:
            w.grad = g.clone()
            opt.step()

    w, opt = make(0)
    steps(w, opt, grads)
    half_w, half = make(0)
    steps(half_w, half, grads[:3])
    buffer = io.BytesIO()
    torch.save(half.state_dict(), buffer)
    buffer.seek(0)
    resumed_w, resumed = make(5)  # another seed: the checkpoint's must win
    with torch.no_grad():
        resumed_w.copy_(half_w)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.state[resumed_w]["exp_avg_sq"].dtype == torch.float32
    steps(resumed_w, resumed, grads[3:])
    assert torch.equal(w, resumed_w)
    for key, value in opt.state[w].items():
        assert torch.equal(value, resumed.state[resumed_w][key]), key


def test_another_optimizer_classs_state_is_refused_at_load_and_torchs_part_moves_to_torch():
    """An SGD state loaded into a compensated AdamW was accepted and the next step died with
    KeyError: 'step'; it is refused at load, naming the settings that differ. The export
    path: ``lso.optimizer.state_dict()`` is torch's dict, which a plain AdamW loads and steps
    (``lso.state_dict()`` holds it under "optimizer", beside the scaler and masters)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4).to(torch.bfloat16)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(x).sum().backward()
    sgd.step()
    lso = LossScaleOptimizer(torch.optim.AdamW(model.parameters()), compensation="kahan")
    with pytest.raises(ValueError, match=r"hold \['dampening', 'momentum', 'nesterov'\], which "
                       r"this AdamW's lack, .* saved from another optimizer class"):  # fmt: skip
        lso.load_state_dict(sgd.state_dict())
    sgd_lso = LossScaleOptimizer(sgd, compensation="kahan")
    with pytest.raises(ValueError, match="saved from another optimizer class"):
        lso.load_state_dict(sgd_lso.state_dict())
    assert lso.optimizer.state == {}  # nothing was loaded
    lso.backward(model(x).sum())
    lso.step()
    assert lso.state_dict()["optimizer"] == lso.optimizer.state_dict()
    plain = torch.optim.AdamW(model.parameters())
    plain.load_state_dict(lso.optimizer.state_dict())
    model.zero_grad()
    model(x).sum().backward()
    plain.step()
    assert plain.state[model.weight]["step"] == 2


def test_the_compensators_build_refused_by_dynamos_limit_falls_back_to_eager(monkeypatch):
    """The engine's gate is the compensated steps' too: a build dynamo refuses (its limit
    of builds of one function reached in the process) warns once under compile=None and
    the step runs eagerly, as compile=False steps, bit for bit."""
    from mixprec.optim.compensated import Compensator, kernels
    from mixprec.optim.compensated import compensator as compensator_module

    if not engine.can_compile("cpu"):
        pytest.skip("compile=None compiles nothing without a C++ compiler on this host")

    monkeypatch.setattr(compensator_module, "COMPILE_MIN_ELEMENTS", 0)
    # a copy of the step with a code object of its own: no build of an earlier test serves it
    step = kernels.KERNELS["adam", "kahan"]
    fresh = types.FunctionType(
        step.__code__.replace(), step.__globals__, step.__name__, step.__defaults__
    )
    fresh.__kwdefaults__ = step.__kwdefaults__
    monkeypatch.setitem(kernels.KERNELS, ("adam", "kahan"), fresh)
    monkeypatch.setattr(kernels, "_COMPILED", {})
    g = torch.Generator().manual_seed(0)
    weights = [nn.Parameter(torch.randn(300, generator=g).to(torch.bfloat16)) for _ in range(2)]
    copies = [nn.Parameter(w.detach().clone()) for w in weights]
    opts = [torch.optim.AdamW(ws, lr=1e-2) for ws in (weights, copies)]
    auto, eager = (
        Compensator("kahan", seed=3, compile=None),
        Compensator("kahan", seed=3, compile=False),
    )
    with torch._dynamo.config.patch(recompile_limit=0):
        for step in range(2):
            for w, c in zip(weights, copies, strict=True):
                grad = torch.randn(300, generator=g).to(torch.bfloat16)
                w.grad, c.grad = grad.clone(), grad.clone()
            if step == 0:
                with pytest.warns(UserWarning, match="limit of builds"):
                    auto.step(opts[0])
            else:
                auto.step(opts[0])
            eager.step(opts[1])
    for w, c in zip(weights, copies, strict=True):
        assert torch.equal(w, c)


def _kahan_sum(path: str, dtype: torch.dtype, compile: bool, steps: int) -> torch.Tensor:
    """``w + c`` (weight plus Kahan buffer, in float64) of 64 weights at 2^-6 after ``steps``
    plain SGD steps of 2^-26 each down, by the compensated torch SGD or the low-bit SGD."""
    from mixprec.optim.states import LowBitSGD

    p = nn.Parameter(torch.full((64,), 2.0**-6, dtype=dtype))
    if path == "torch":
        opt, comp = torch.optim.SGD([p], lr=2.0**-26), Compensator("kahan", seed=0, compile=compile)
    else:
        opt = LowBitSGD([p], lr=2.0**-26, compensation="kahan", seed=0, compile=compile)
        comp = None
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        comp.step(opt) if comp is not None else opt.step()
    return p.detach().double() + opt.state[p]["compensation"].double()


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("path", ["torch", "low-bit"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kahan_buffer_is_itself_stochastically_rounded_on_every_path(dtype, path, compile):
    """An update of 2^-26 is below half the spacing the buffer has once it holds a few of
    them (bfloat16) or below half of float16's smallest subnormal: rounded to nearest, the
    buffer stops growing before it reaches half a weight spacing (2^-15 for bfloat16, 2^-18
    for float16 at 2^-6), and the weights never move. The engine stores it stochastically
    rounded, so it keeps the sum on average. Before: only bfloat16 weights of torch's
    optimizers had it; float16 ones and the low-bit optimizers' buffers rounded to nearest
    and lost 57% (bfloat16) to all (float16) of the distance moved here."""
    steps = 600
    exact = 2.0**-6 - steps * 2.0**-26
    got = _kahan_sum(path, dtype, compile, steps)
    # the buffer's own rounding errors average out over the 64 weights
    assert abs(got.mean().item() - exact) < 0.05 * steps * 2.0**-26


@pytest.mark.parametrize("size", [64, SMALL])  # packed and copied back; stepped in place
def test_a_graph_saved_before_a_compensated_step_is_refused_after_it(size):
    """A backward through a graph that saved a weight before the step must fail as torch's
    own step makes it fail (the weight was modified in place), whether the step copies a
    small parameter back or writes a large one in place through another tensor."""
    w = nn.Parameter(torch.ones(size, dtype=torch.bfloat16))
    w.grad = torch.ones_like(w)
    optimizer = torch.optim.AdamW([w], lr=1e-3)
    loss = (w * w).sum()  # saves w
    Compensator("kahan", compile=False).step(optimizer)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _kahan_sgd(params: list[nn.Parameter], path: str):
    """A step function: torch's SGD under a Kahan Compensator, or mixprec's LowBitSGD."""
    if path == "compensator":
        optimizer = torch.optim.SGD(params, lr=1e-3)
        compensator = Compensator("kahan", seed=0, compile=False)
        return optimizer, lambda: compensator.step(optimizer)
    from mixprec.optim.states import LowBitSGD

    optimizer = LowBitSGD(params, lr=1e-3, compensation="kahan", seed=0, compile=False)
    return optimizer, optimizer.step


@pytest.mark.parametrize(
    ("dtype", "w", "c", "kept"),
    [
        # half a spacing away from zero is kept, and one step of the buffer's grid past it
        # (a float32 tie rounded again, the buffer rounded up); two steps are not
        (torch.bfloat16, 1.0, 2.0**-8, True),
        (torch.bfloat16, 1.0, 2.0**-8 + 2.0**-15, True),
        (torch.bfloat16, 1.0, 2.0**-8 + 2.0**-14, False),
        (torch.float16, -0.0544, -(2.0**-16 + 2.0**-24), True),
        (torch.float16, -0.0544, -(2.0**-16 + 2.0**-23), False),
        # toward zero at a power of two the spacing is the binade's below
        (torch.bfloat16, 1.0, -(2.0**-9), True),
        (torch.bfloat16, 1.0, -(2.0**-9 + 2.0**-15), False),
        (torch.bfloat16, -1.5, -(2.0**-8), True),
        # beside a weight pruned to zero, only the smallest subnormal
        (torch.bfloat16, 0.0, 2.0**-133, True),
        (torch.bfloat16, 0.0, 2.0**-10, False),
        (torch.float16, 0.0, 2.0**-24, True),
        (torch.float16, 0.0, 2.0**-23, False),
        (torch.float16, -0.0, -(2.0**-23), False),
        (torch.float16, 2.0**-14, 2.0**-23, False),
        (torch.float16, 1.5, -(2.0**-11), True),
        (torch.float16, 1.5, 2.0**-11 + 2.0**-20, False),
        # below the normal range the buffer's grid is the subnormal step, which a step
        # leaves beside a weight there (half the spacing is not on the grid)
        (torch.float16, 3 * 2.0**-24, 2.0**-24, True),
        (torch.float16, 2.0**-14, -(2.0**-24), True),
        (torch.float16, 3 * 2.0**-24, 3 * 2.0**-24, False),
        (torch.float16, float("inf"), 1.0, True),
        (torch.float16, float("nan"), 1.0, True),
        # a non-finite entry (a non-finite gradient applied) is no rounding error: a weight
        # loaded after it took NaN at the next step
        (torch.bfloat16, 1.0, float("nan"), False),
        (torch.bfloat16, 1.0, float("inf"), False),
        (torch.float16, -2.0, float("-inf"), False),
        (torch.float16, float("inf"), float("nan"), False),
    ],
)
def test_a_kahan_entry_is_kept_only_where_a_step_could_have_left_it(dtype, w, c, kept):
    """`engine.settled`, which every Kahan step applies: an entry larger than the rounding
    error a step leaves beside its weight was left beside another weight, and is dropped."""
    weight = torch.tensor([w], dtype=dtype).float()
    buffer = torch.tensor([c], dtype=dtype).float()
    assert buffer.item() == c or math.isnan(c)  # (each case is on the 16-bit grid)
    out = engine.settled(weight, buffer, dtype)
    assert out.item() == c if kept else out.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_kahan_entry_is_judged_by_its_bound_at_every_16_bit_value(dtype):
    """`engine.settled` against its bound written out (half a spacing of the binade of
    weight plus entry, one grid step more; the smallest subnormal where half a spacing is
    under it), for every 16-bit entry beside weights from subnormal to large, both signs."""
    bits, tiny = (7, 2.0**-133) if dtype == torch.bfloat16 else (10, 2.0**-24)
    entries = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    entries = entries.float()
    for w in (0.0, -0.0, tiny, -3 * tiny, 2.0**-14, 2.0**-126, 1.0, -1.5, 3.0e4, 2.0**100):
        weight = torch.full_like(entries, w).to(dtype).float()
        out = engine.settled(weight, entries, dtype)
        total = (weight + entries).abs()
        binade = (total.view(torch.int32) & 0x7F800000).view(torch.float32)
        half = binade * 2.0 ** -(bits + 1)
        bound = torch.where(half < tiny, tiny, half + (half * 2.0**-bits).clamp_min(tiny))
        finite = bound.clamp_max(torch.finfo(torch.float32).max)
        expected = torch.where(entries.abs() <= finite, entries, 0.0)  # (NaN: dropped)
        assert torch.equal(out.view(torch.int32), expected.view(torch.int32)), w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["tie", "adamw", "sgd"])
def test_steps_alone_never_leave_an_entry_the_next_step_drops(case, dtype, monkeypatch):
    """`engine.settled` is for writes from outside: runs with nothing written between
    steps are the runs without it, bit for bit. The first version dropped entries steps
    leave at float32 ties (the sum rounded twice, the buffer rounded up a grid step): from
    step 2 of the tie case on, step 7 of AdamW on float16 weights of ~0.05."""

    def run() -> torch.Tensor:
        torch.manual_seed(0)
        n = 20_000
        if case == "tie":  # w + u a float32 tie of two 16-bit neighbours at every step
            half = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
            bump = 2.0**-16 if dtype == torch.bfloat16 else 2.0**-13
            p = nn.Parameter(torch.ones(n, dtype=dtype))
            opt = torch.optim.SGD([p], lr=1 + bump - 2.0**-23)
            grads = [torch.full((n,), -half, dtype=dtype)] * 6
        else:
            p = nn.Parameter((torch.randn(n) * 0.05).to(dtype))
            opt = (
                torch.optim.AdamW([p], lr=1e-3)
                if case == "adamw"
                else torch.optim.SGD([p], lr=0.01, momentum=0.9)
            )
            gen = torch.Generator().manual_seed(1)
            grads = [(torch.randn(n, generator=gen) * 0.1).to(dtype) for _ in range(40)]
        comp = Compensator("kahan", seed=0, compile=False)
        for g in grads:
            p.grad = g.clone()
            comp.step(opt)
        return torch.cat([p.detach().view(-1), opt.state[p]["compensation"].view(-1)])

    checked = run()
    monkeypatch.setattr(engine, "settled", lambda w, c, dtype: c)
    assert torch.equal(run(), checked)


@pytest.mark.parametrize("path", ["compensator", "low-bit"])
def test_a_weight_written_between_steps_drops_its_kahan_buffer(path):
    """What a Kahan buffer holds is the last rounding error of the weight it was made for:
    after a weight is written by someone else (a pruning mask, a model state loaded) a step
    with a zero gradient leaves it exactly as written; an optimizer state loaded with it
    keeps its buffers, so an in-process resume stays bit for bit."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (96, 160, 2048)]
    optimizer, step = _kahan_sgd(params, path)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        step()
    saved = (copy.deepcopy([p.detach() for p in params]), copy.deepcopy(optimizer.state_dict()))
    with torch.no_grad():
        params[0][:48] = 0  # pruned
        params[2].fill_(1e-3)  # loaded
    # through `.data`, which no version counter sees: the classic pruning idiom, a copy in
    params[1].data[:80].mul_(0)
    written = torch.full((80,), -3e-2, dtype=torch.bfloat16)
    params[1].data[80:].copy_(written)
    for p in params:
        p.grad = torch.zeros_like(p)
    step()
    assert torch.equal(params[0][:48], torch.zeros(48, dtype=torch.bfloat16))
    assert torch.equal(params[1][:80], torch.zeros(80, dtype=torch.bfloat16))
    assert torch.equal(params[1][80:], written)
    assert torch.equal(params[2], torch.full((2048,), 1e-3, dtype=torch.bfloat16))
    # a write that keeps the values (a clamp clipping nothing, SAM's restore) keeps the
    # buffers: compensation goes on
    kept = [optimizer.state[p]["compensation"].clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.clamp_(-100, 100)
    for p in params:
        p.grad = torch.zeros_like(p)
    step()
    settled = [optimizer.state[p]["compensation"] for p in params]
    assert all(torch.equal(a, b) for a, b in zip(kept, settled, strict=True))

    def onward(count: int) -> list[torch.Tensor]:
        torch.manual_seed(1)
        for _ in range(count):
            for p in params:
                p.grad = torch.randn_like(p)
            step()
        return [p.detach().clone() for p in params]

    def restore() -> None:
        with torch.no_grad():
            for p, value in zip(params, saved[0], strict=True):
                p.copy_(value)
        optimizer.load_state_dict(copy.deepcopy(saved[1]))

    restore()
    straight = onward(3)
    restore()
    assert all(torch.equal(a, b) for a, b in zip(straight, onward(3), strict=True))


@pytest.mark.parametrize("path", ["compensator", "low-bit"])
def test_step_counts_stay_exact_past_float32s_integers(path):
    """Step counts are float32 tensors, whose integers end at 2^24: from there adding one
    left every count (so every step's random bits) the same, and each weight rounded the
    same way at every step. A count reaching 2^24 goes on in float64, exactly."""
    p = nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    optimizer, step = _kahan_sgd([p], path)
    p.grad = torch.full_like(p, 1e-3)
    step()
    optimizer.state[p]["step"] = torch.tensor(float(2**24 - 2))
    counts = []
    for _ in range(4):
        step()
        counts.append(int(optimizer.state[p]["step"]))
    assert counts == [2**24 - 1, 2**24, 2**24 + 1, 2**24 + 2]  # (the random keys' steps)
    assert optimizer.state[p]["step"].dtype == torch.float64
    restored = copy.deepcopy(optimizer.state_dict())  # (and it saves and loads)
    optimizer.load_state_dict(restored)
    step()
    assert int(optimizer.state[p]["step"]) == 2**24 + 3


@pytest.mark.parametrize("path", ["compensator", "low-bit"])
def test_a_write_that_keeps_the_weights_keeps_the_kahan_compensation(path):
    """A clamp that clips nothing (or SAM's, an EMA's swap and restore) writes the weights
    every step without changing them: zeroing the buffers at each such write would freeze
    a weight that updates a sixteenth of its spacing a step, as plain bfloat16 does. Settled
    instead, the buffers keep what the step left, and the weight moves as without the
    clamp: 64 updates of 2^-11 from 1.0 reach 1.03125."""
    finals = []
    for clamp in (False, True):
        p = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
        optimizer, step = _kahan_sgd([p], path)
        for _ in range(64):
            p.grad = torch.full_like(p, -(2.0**-11) / 1e-3)  # lr 1e-3: an update of 2^-11
            step()
            if clamp:
                with torch.no_grad():
                    p.clamp_(-10.0, 10.0)
        finals.append(p.detach().clone())
    assert torch.equal(finals[0], torch.full((64,), 1.03125, dtype=torch.bfloat16))
    assert torch.equal(finals[1], finals[0])


def test_the_direct_load_hook_follows_copies_and_leaves_other_loads_alone():
    """A compensated wrapper keeps float32 moments of float16 weights when its torch
    optimizer is loaded directly. That hook was lost in a pickled or deep-copied wrapper
    (torch drops an optimizer's hooks there), and it also fired where it should not: inside
    a load across precisions (which casts to this run's dtypes: float32 moments beside
    bfloat16 weights doubled their memory) and for a wrapper retired by a newer one."""
    import pickle

    p = nn.Parameter(torch.ones(8, dtype=torch.float16))
    wrapper = LossScaleOptimizer(
        torch.optim.AdamW([p], lr=1e-3), scaler="none", compensation="kahan"
    )
    p.grad = torch.full_like(p, 1e-4)
    wrapper.step()
    saved = copy.deepcopy(wrapper.optimizer.state_dict())
    assert saved["state"][0]["exp_avg_sq"].dtype == torch.float32
    for copied in (pickle.loads(pickle.dumps(wrapper)), copy.deepcopy(wrapper)):
        q = copied.optimizer.param_groups[0]["params"][0]
        copied.optimizer.load_state_dict(copy.deepcopy(saved))
        assert copied.optimizer.state[q]["exp_avg_sq"].dtype == torch.float32

    b = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    bf16 = LossScaleOptimizer(torch.optim.AdamW([b]), scaler="none", compensation="kahan")
    f32 = nn.Parameter(torch.ones(8))
    f32.grad = torch.ones(8)
    plain = LossScaleOptimizer(torch.optim.AdamW([f32]), scaler="none")
    plain.step()
    bf16.load_state_dict_across_precisions(plain.state_dict(), {"0": torch.ones(8)})
    assert bf16.optimizer.state[b]["exp_avg"].dtype == torch.bfloat16

    newer = LossScaleOptimizer(wrapper.optimizer, scaler="none", master_weights=False)
    wrapper.optimizer.load_state_dict(copy.deepcopy(saved))
    assert wrapper.optimizer.state[p]["exp_avg_sq"].dtype == torch.float16  # the newer's rule
    p.grad = torch.full_like(p, 1e-4)
    newer.step()


def test_a_float64_step_count_survives_a_fused_optimizers_load():
    """torch's fused AdamW loads its step counts as float32: a count past 2^24 saved in
    float64 came back rounded, a step behind, and the resumed run drew other bits."""
    p = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    wrapper = LossScaleOptimizer(
        torch.optim.AdamW([p], fused=True), scaler="none", compensation="stochastic"
    )
    p.grad = torch.full_like(p, 1e-3)
    wrapper.step()
    wrapper.optimizer.state[p]["step"] = torch.tensor(float(2**24 + 1), dtype=torch.float64)
    saved = copy.deepcopy(wrapper.state_dict())
    wrapper.load_state_dict(saved)
    assert wrapper.optimizer.state[p]["step"].dtype == torch.float64
    assert int(wrapper.optimizer.state[p]["step"]) == 2**24 + 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compiled", [False, True])
def test_nearest_value_is_torchs_conversion_without_a_cast(dtype, compiled):
    """The compiled Kahan write-back takes the rounded weight from `nearest_value`, not from
    a narrowing-widening cast pair a compiler may drop: it must equal torch's conversion
    everywhere, ties, subnormals, the overflow edge, signed zeros, infinities and NaN."""
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(20_000, generator=g) * torch.logspace(-30, 30, 20_000).float()
    top = torch.finfo(dtype).max
    edges = [0.0, -0.0, 2.0**-25, 3 * 2.0**-26, 2.0**-24, 2.0**-14, 1 + 2.0**-11,
             1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, top, 65519.99, 65520.0,
             float("inf"), float("nan"), 1e-40, 3.4e38]  # fmt: skip
    edge = torch.tensor(edges)
    x = torch.cat([spread, edge, -edge, torch.randn(4096, generator=g)])

    def value(x):
        return engine.nearest_value(x, dtype)

    fn = torch.compile(value, fullgraph=True) if compiled else value
    got, expected = fn(x), x.to(dtype).float()
    same = (got.view(torch.int32) == expected.view(torch.int32)) | (got.isnan() & expected.isnan())
    assert same.all(), x[~same][:5]


def test_the_state_entries_a_load_gives_are_the_ones_the_steps_update():
    """torch's optimizers update the state tensors ``load_state_dict`` gives them in place,
    small parameters' as large ones': a reference held outside (a logger, a second load of
    the same dict) follows the run, and a write through ``.data`` is what the next step
    reads. (Keeping small parameters' states joined in one tensor between steps broke
    both, and pickled every view with the whole tensor: tried and not kept.)"""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 300)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comp = Compensator("kahan", seed=5)

    def step():
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        comp.step(opt)

    step()
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)
    held = [opt.state[p]["exp_avg"] for p in model.parameters()]
    before = [h.clone() for h in held]
    step()
    assert all(not torch.equal(h, b) for h, b in zip(held, before, strict=True))
    assert all(opt.state[p]["exp_avg"] is h for p, h in zip(model.parameters(), held, strict=True))
    small = opt.state[model[0].bias]["exp_avg"]
    small.data = torch.zeros_like(small)
    step()
    assert bool((opt.state[model[0].bias]["exp_avg"] != 0).all())


@pytest.mark.parametrize("compile", [False, True])
def test_what_a_step_keeps_for_the_next_follows_the_tensors_memory(compile):
    """A step keeps its packed copy of the small parameters for the next (a tiny model's
    step is mostly Python work), as scratch: weights and states
    given new memory between steps (``.data =``, a checkpoint moved in) are the ones the next
    step reads and writes, the old memory is left alone, and the steps match a run that
    never moved them, bit for bit, as does a pickled copy (which keeps nothing of it)."""
    import pickle

    def run(move: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, SMALL // 256), nn.Linear(SMALL // 256, 7))
        model = model.to(torch.bfloat16)
        assert model[0].weight.numel() >= SMALL > model[1].weight.numel()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        comp = Compensator("kahan", seed=3, compile=compile)
        left = []
        for i in range(4):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            comp.step(opt)
            if move and i == 1:
                for p in model.parameters():
                    old = p.data
                    p.data = old.clone()
                    state = opt.state[p]
                    for name in ("exp_avg", "compensation"):
                        state[name].data = state[name].data.clone()
                    left.append((old, old.clone()))
            if move and i == 2:
                comp = pickle.loads(pickle.dumps(comp))
        assert all(torch.equal(old, value) for old, value in left)
        return [p.detach() for p in model.parameters()], [
            t for p in model.parameters() for t in opt.state[p].values() if t.dim()
        ]

    (weights, states), (moved, moved_states) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(weights, moved, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(states, moved_states, strict=True))


def test_a_compensator_holds_no_memory_of_the_tensors_it_stepped():
    """What a step keeps for the next is scratch of its own: once the model and its
    optimizer are gone, their weights and states are freed even while the Compensator lives
    on (a flat view kept of each large tensor held all of them, a whole model's bytes)."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    model = nn.Sequential(nn.Linear(8, SMALL // 8), nn.Linear(SMALL // 8, 3)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comp = Compensator("kahan", seed=1, compile=False)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        comp.step(opt)
    # their memory (the step counts, 0-dim, are views of the counts' one tensor, kept:
    # `engine.StepCounts`)
    tensors = [*model.parameters()]
    tensors += [t for state in opt.state.values() for t in state.values() if t.dim()]
    refs = [StorageWeakRef(t.untyped_storage()) for t in tensors]
    del model, opt, p, tensors
    gc.collect()
    assert all(ref.expired() for ref in refs)


def test_a_state_reshaped_between_steps_still_steps():
    """A kept pack is laid out by the weights' shapes; a state of the same size in another
    shape (a state dict written by other code) is copied through a pack of its own and
    steps as a fresh Compensator steps it."""
    import pickle

    def run(keep: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        comp = Compensator("kahan", seed=2, compile=False)
        for i in range(3):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            if i == 2:
                state = opt.state[model[0].weight]
                state["exp_avg"] = state["exp_avg"].reshape(1, 12).clone()
            if not keep:
                comp = pickle.loads(pickle.dumps(comp))
            comp.step(opt)
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False), strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameters_on_one_memory_each_take_their_update(dtype):
    """A tied weight and its transpose, each a parameter (``dec.weight =
    nn.Parameter(enc.weight.data.t())``): stepped from one packed copy, the second copy back
    overwrote the first's update (a weight in both moved by one update where torch moves
    it by two). They step in turn, each from a pack of its own, as torch steps them."""

    def tied() -> tuple[torch.Tensor, torch.optim.Optimizer]:
        base = (torch.arange(24, dtype=torch.float32) / 10).to(dtype).view(4, 6)
        enc, dec = nn.Parameter(base), nn.Parameter(base.t())  # (dec not contiguous)
        loose = nn.Parameter(torch.zeros(3, dtype=dtype))  # packed beside them
        for p in (enc, dec, loose):
            p.grad = torch.ones_like(p)
        return base, torch.optim.SGD([enc, dec, loose], lr=0.1)

    ours, optimizer = tied()
    start = ours.float()
    Compensator("kahan", seed=0, compile=False).step(optimizer)
    assert torch.equal(optimizer.param_groups[0]["params"][2], torch.full((3,), -0.1).to(dtype))
    if dtype == torch.float32:  # torch's steps, bit for bit
        theirs, reference = tied()
        reference.step()
        assert torch.equal(ours, theirs)
    else:  # each update rounded to nearest once: within a spacing of the exact result
        exact = start - 0.2
        assert not torch.equal(ours.float(), start - 0.1)
        assert ((ours.float() - exact).abs() <= _ulp_bf16(start.abs().clamp_min(0.2))).all()


def test_a_view_listed_before_the_large_weight_it_shares_steps_first():
    """A small view of a large weight listed ahead of it (each a parameter): the calls ran
    largest first, so the weight stepped before the view, the reverse of torch's order (with
    weight decay). Parameters sharing memory step in a call
    each, in the parameters' order: torch's steps, to float32's rounding (its order apart,
    the shared elements would be 5e-3 off)."""

    def shared() -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
        torch.manual_seed(0)
        base = torch.randn(SMALL + 4)
        params = [nn.Parameter(base[:100]), nn.Parameter(base), nn.Parameter(torch.randn(7))]
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        return params, torch.optim.AdamW(params, lr=1e-2, weight_decay=10.0, foreach=False)

    (ours, optimizer), (theirs, reference) = shared(), shared()
    compensator = Compensator("kahan", seed=0, compile=False)
    replayed, replay = [], compensator._replay
    compensator._replay = lambda plan, opt: replayed.append(replay(plan, opt)) or replayed[-1]
    for _ in range(3):  # (filed, then replayed from the plan)
        compensator.step(optimizer)
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # the view's call of its own is not taken for the small weight's, whose scalars it shares
    assert replayed == [True, True]


def test_a_parameter_listed_twice_in_a_group_is_refused_by_the_compensated_step():
    """torch's optimizers step such a parameter twice; the packed step took it once."""
    p = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's own warning about duplicates)
        optimizer = torch.optim.SGD([p, p], lr=0.1)
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="positions 0 and 1 .* same tensor"):
        Compensator("kahan", seed=0, compile=False).step(optimizer)
    assert torch.equal(p, torch.zeros_like(p))


def _planned_vs_filed(kind: str, events) -> None:
    """Twin AdamW runs step by step, one by a Compensator that keeps its plan between steps,
    the other filed afresh at every step (a new Compensator of the same seed each step): the
    weights and every state tensor equal bit for bit after each step, whatever `events`
    does to both between steps."""

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, SMALL // 8), nn.Linear(SMALL // 8, 3), nn.Linear(3, 5))
        model = model.to(torch.bfloat16)
        model[2].float()  # (a float32 layer: stepped without compensation)
        decay = [model[0].weight, model[1].weight, model[2].weight]
        rest = [model[0].bias, model[1].bias, model[2].bias]
        groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
        return model, torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)

    (a, opt_a), (b, opt_b) = make(), make()
    planned = Compensator(kind, seed=5, compile=False)
    for i in range(8):
        g = torch.Generator().manual_seed(i)
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            q.grad = p.grad.clone()
        events(i, a, opt_a)
        events(i, b, opt_b)
        planned.step(opt_a)
        Compensator(kind, seed=5, compile=False).step(opt_b)
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q), i
            for (name, s), t in zip(opt_a.state[p].items(), opt_b.state[q].values(), strict=True):
                assert torch.equal(s, t), (i, name)


def _lr_parts(i, model, opt):  # groups filed together whose scalars part, then join again
    opt.param_groups[1]["lr"] = 1e-2 if i % 3 else 3e-3


def _decay_changes(i, model, opt):  # a decay form appearing and going
    opt.param_groups[1]["weight_decay"] = 0.05 if i in (3, 4) else 0.0


def _grad_dropped(i, model, opt):  # a parameter without a gradient for a step
    if i == 4:
        model[1].bias.grad = None


def _weight_moved(i, model, opt):  # weights and states given new memory
    if i == 3:
        model[0].weight.data = model[0].weight.data.clone()
        model[2].bias.data = model[2].bias.data.clone()
        state = opt.state[model[1].weight]
        state["exp_avg"].data = state["exp_avg"].data.clone()


def _state_written(i, model, opt):  # a state replaced, a Kahan buffer zeroed in place
    if i == 3:
        state = opt.state[model[2].bias]
        state["exp_avg_sq"] = state["exp_avg_sq"].clone()
    if i == 5 and "compensation" in opt.state[model[1].weight]:
        opt.state[model[1].weight]["compensation"].zero_()


def _reloaded(i, model, opt):  # the optimizer's own state loaded back mid-run
    if i == 4:
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _group_added(i, model, opt):  # a parameter given to the optimizer later
    if i == 0:
        model.extra = nn.Parameter(torch.zeros(6, dtype=torch.bfloat16))
    model.extra.grad = torch.full((6,), 0.5, dtype=torch.bfloat16)
    if i == 3:
        opt.add_param_group({"params": [model.extra], "lr": 1e-2})


def _written_in_place(i, model, opt):  # a weight written in place between steps (pruning)
    if i == 2:
        with torch.no_grad():
            model[1].weight.mul_(0.5)


def _lr_meet(i, model, opt):  # groups filed apart whose scalars meet (a review found them
    opt.param_groups[1]["weight_decay"] = 0.1  # kept apart: other random keys)
    opt.param_groups[1]["lr"] = 3e-3 if i < 3 else 1e-2


def _grad_laid_out(i, model, opt):  # a large weight's gradient transposed, then at an odd
    g = model[0].weight.grad  # offset (a bucket view): packed, then alone again
    if i in (1, 2):
        model[0].weight.grad = g.t().contiguous().t()
    if i == 4:
        flat = torch.empty(g.numel() + 1, dtype=g.dtype)
        flat[1:].copy_(g.flatten())
        model[0].weight.grad = flat[1:].view(g.shape)


def _state_viewed(i, model, opt):  # a state seen in another shape on its memory (`.data`)
    if i == 3:
        small = opt.state[model[1].bias]
        small["exp_avg"].data = small["exp_avg"].data.view(1, -1)
        large = opt.state[model[0].weight]
        large["exp_avg_sq"].data = large["exp_avg_sq"].data.t()


@pytest.mark.parametrize("kind", ["kahan", "stochastic"])
@pytest.mark.parametrize(
    "events",
    [
        _lr_meet,
        _grad_laid_out,
        _state_viewed,
        _lr_parts,
        _decay_changes,
        _grad_dropped,
        _weight_moved,
        _state_written,
        _reloaded,
        _group_added,
        _written_in_place,
    ],
)
def test_a_kept_plan_steps_as_a_fresh_filing_through_every_change(kind, events):
    """A step keeps its filing for the next (a small model's step was its Python: about
    thirty calls a parameter to file it again); whatever changes between steps, the steps
    match steps filed afresh, bit for bit."""
    _planned_vs_filed(kind, events)


def test_a_kept_plan_makes_a_steps_python_calls_independent_of_the_parameters():
    """Once planned, a step of 60 small parameters runs the Python functions a step of 6
    runs, as many times (filing them again had cost about thirty calls a parameter); what
    grows with the parameters is built-in work (the checks that the plan still holds)."""
    import cProfile
    import pstats

    def calls_per_step(loop, short: int, long: int) -> float:
        def calls(steps: int) -> int:
            prof = cProfile.Profile()
            prof.enable()
            loop(steps)
            prof.disable()
            stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
            return sum(entry[1] for (path, _, _), entry in stats.items() if path != "~")

        return (calls(long) - calls(short)) / (long - short)

    def loop_of(n: int):
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n // 2)]).to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        comp = Compensator("kahan", seed=0, compile=False)
        for p in model.parameters():
            p.grad = torch.ones_like(p)

        def loop(steps: int) -> None:
            for _ in range(steps):
                comp.step(opt)

        loop(2)
        return loop

    few, many = calls_per_step(loop_of(6), 5, 15), calls_per_step(loop_of(60), 5, 15)
    assert many == few, (few, many)  # (filed afresh: about 1,600 more)


@pytest.mark.parametrize("kind", ["kahan", "stochastic"])
def test_the_rounding_does_not_depend_on_the_gradients_memory_layout(kind):
    """Found by a review: a large weight whose gradient came at an odd offset (DDP's bucket
    views, rebuilt after the first step) or transposed was stepped from the packed copy, not
    alone, with other random keys: a resumed DDP run (buckets rebuilt at other steps) was not
    bit-identical. Where a weight steps is now its own and its states' layout: a gradient out
    of line steps from a copy."""

    def run(laid_out: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, SMALL // 8), nn.Linear(SMALL // 8, 3))
        model = model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        comp = Compensator(kind, seed=5, compile=False)
        for i in range(4):
            g = torch.Generator().manual_seed(i)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            w = model[0].weight
            if laid_out and i in (1, 3):
                flat = torch.empty(w.numel() + 1, dtype=w.dtype)
                flat[1:].copy_(w.grad.flatten())
                w.grad = flat[1:].view(w.shape)
            if laid_out and i == 2:
                w.grad = w.grad.t().contiguous().t()
            comp.step(opt)
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True), strict=True))


def test_weights_reloaded_after_a_non_finite_step_train_on_with_kahan():
    """Under bf16-true (no loss scaler) an inf gradient reaches the step, as in plain torch,
    and leaves NaN in the Kahan buffer; reloading the last good weights is the way back,
    which plain bf16 and stochastic rounding took, but the kept NaN made the reloaded
    weight NaN at the next step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    precision = mixprec.Precision("bf16-true", compensation="kahan", allow_slow=True)
    model, opt = precision.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    x = precision.convert_input(torch.randn(4, 8))

    def step(poison: bool = False) -> None:
        precision.backward(model(x).float().square().mean())
        if poison:
            model[0].weight.grad[0, 0] = float("inf")
        precision.step(opt)
        opt.zero_grad()

    step()
    good = copy.deepcopy(model.state_dict())
    step(poison=True)
    assert not model[0].weight.isfinite().all()
    model.load_state_dict(good)
    for _ in range(3):
        step()
    assert all(p.isfinite().all() for p in model.parameters())


@pytest.mark.parametrize("kind", ["kahan", "stochastic"])
def test_step_counts_are_float32_whatever_the_default_dtype(kind):
    """The compensated step made its counts in torch's default dtype: under a bfloat16 one
    (a model built so, or a step inside a bf16-true region) they stopped at 256, and every
    later step took the same random bits and bias correction. A 16-bit count already saved
    so goes on in float32."""
    p = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([p], lr=1e-3)
    comp = Compensator(kind, seed=0, compile=False)
    kept = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        for _ in range(300):
            p.grad = -torch.ones_like(p)
            comp.step(opt)
    finally:
        torch.set_default_dtype(kept)
    count = opt.state[p]["step"]
    assert count.dtype == torch.float32 and count.item() == 300
    opt.state[p]["step"] = torch.tensor(256.0, dtype=torch.bfloat16)  # (as saved before)
    for _ in range(2):
        p.grad = -torch.ones_like(p)
        comp.step(opt)
    assert opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"].item() == 258


@pytest.mark.parametrize("seed", ["a", 1.5, True])
def test_a_seed_that_is_not_an_int_is_refused_where_it_is_given(seed):
    """A str or float seed was taken and failed at the first step with a TypeError about
    ``&``; a saved state without its seed raised a bare KeyError."""
    with pytest.raises(TypeError, match="seed must be an int"):
        Compensator("stochastic", seed=seed)
    comp = Compensator("kahan", seed=3)
    with pytest.raises(TypeError, match="seed must be an int"):
        comp.load_state_dict({"kind": "kahan", "seed": seed})
    with pytest.raises(ValueError, match="has no 'seed'"):
        comp.load_state_dict({"kind": "kahan"})
    assert comp.seed == 3


@pytest.mark.parametrize("how", ["replaced", "data"])
def test_a_state_of_fewer_dims_than_its_weight_steps_as_a_fresh_compensator_steps_it(how):
    """Found by a review: a kept pack was keyed by the weights' shapes only, so a state of
    the same size with fewer dims ((8,) beside a (1, 8) weight) copied into its
    weight-shaped piece by broadcasting and failed at the copy out, after the weights were
    written and the step count moved; a fresh Compensator stepped it."""
    import pickle

    def run(keep: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 1), nn.Linear(1, 3)).to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        comp = Compensator("kahan", seed=2, compile=False)
        for i in range(4):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            if i == 2:
                state = opt.state[model[0].weight]
                if how == "replaced":
                    state["exp_avg"] = state["exp_avg"].reshape(8).clone()
                else:  # (the same memory seen in another shape)
                    state["exp_avg"].data = state["exp_avg"].data.view(8)
            if not keep:
                comp = pickle.loads(pickle.dumps(comp))
            comp.step(opt)
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False), strict=True))


def test_a_compensation_an_optimizer_converted_before_cannot_take_is_refused():
    """Found by a review: Precision(compensation=...) was dropped without a word when setup
    got a torch optimizer converted before (optimizer_states): it stands for its low-bit
    optimizer, which keeps the compensation it was converted with (None)."""
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, low = mixprec.Precision("bf16-true", optimizer_states="int8", allow_slow=True).setup(
            model, opt
        )
        kahan = mixprec.Precision(
            "bf16-true", optimizer_states="int8", compensation="kahan", allow_slow=True
        )
        with pytest.raises(ValueError, match=r"converted before.*compensation=None"):
            kahan.setup(model, opt)
        assert low.optimizer.compensation is None


def test_a_compensation_a_wrapper_given_to_setup_lacks_is_refused():
    """Found by a review: Precision("bf16-true", compensation="kahan").setup(model, lso)
    took the LossScaleOptimizer given, which steps without compensation, as it is: the
    precision's compensation was dropped without a word (as its scaler is refused when it
    differs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Linear(8, 4).to(torch.bfloat16)
        precision = mixprec.Precision("bf16-true", compensation="kahan", allow_slow=True)
        given = LossScaleOptimizer(torch.optim.AdamW(model.parameters()), precision.scaler)
        with pytest.raises(ValueError, match=r"LossScaleOptimizer given steps with compensation"):
            precision.setup(model, given)
        given = LossScaleOptimizer(
            torch.optim.AdamW(model.parameters()), precision.scaler, compensation="kahan"
        )
        assert precision.setup(model, given)[1] is given  # the same one: taken as it is
