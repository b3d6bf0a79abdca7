"""Compensated updates of 16-bit weights (Kahan, stochastic rounding) without float32 masters."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec.compensated import Compensator, stochastic_round_
from mixprec.optim import LossScaleOptimizer

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
