"""Precision and LossScaleOptimizer on the paths that used to give silent wrong results or
raw errors: groups added after setup, setup twice, kept references to the inner optimizer,
unfrozen parameters, closures, loading foreign states; plus named master weights."""

import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from nets import mlp
from torch import nn

import mixprec
from mixprec import Precision
from mixprec.optim import LossScaleOptimizer, master_weights_by_name
from mixprec.optim.scaling import DynamicLossScaler, NoLossScaler, StaticLossScaler

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)


def _loss(model: nn.Module, seed: int = 1) -> torch.Tensor:
    x, y = _batch(seed)
    return F.mse_loss(model(x.to(model[0].weight.dtype)).float(), y)


def _fp16_precision(scale: float = 1024.0) -> Precision:
    return Precision("16-true", allow_slow=True, scaler=StaticLossScaler(scale))


# -- groups added after setup, kept references, unfrozen parameters (16-true) -------------------


def test_clip_after_add_param_group_measures_unscaled_gradients():
    precision = _fp16_precision()
    model = mlp()
    model, opt = precision.setup(model, torch.optim.SGD(model[0].parameters(), lr=0.1))
    opt.add_param_group({"params": list(model[2].parameters())})
    precision.backward(_loss(model))
    expected = torch.linalg.vector_norm(
        torch.stack([(p.grad.float() / 1024).norm() for p in model.parameters()])
    )
    norm = precision.clip_grad_norm_(model, 1e9)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    assert norm < 10  # the scaled gradients would measure about a thousand times more


def test_zero_grad_on_a_kept_inner_optimizer_clears_the_float16_gradients():
    precision = _fp16_precision()
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = precision.setup(model, inner)
    for _ in range(2):
        inner.zero_grad()  # the user's reference, not the wrapper
        precision.backward(_loss(model))
        assert precision.step(inner)
    assert all(p.grad is None for p in model.parameters())
    # a third backward sees only its own gradient, not three accumulated ones
    inner.zero_grad()
    precision.backward(_loss(model))
    single = [p.grad.float().clone() for p in model.parameters()]
    precision.unscale_(inner)
    for p, g in zip(model.parameters(), single, strict=True):
        torch.testing.assert_close(opt.master_params[p].grad, g / 1024, rtol=0, atol=0)


def test_group_added_on_the_inner_optimizer_gets_float32_masters():
    precision = _fp16_precision()
    model = mlp()
    inner = torch.optim.SGD(model[0].parameters(), lr=1e-6)
    model, opt = precision.setup(model, inner)
    inner.add_param_group({"params": list(model[2].parameters())})
    before = model[2].weight.detach().float().clone()
    precision.backward(_loss(model))
    assert precision.step(opt)
    master = opt.master_params[model[2].weight]
    assert master.dtype == f32 and inner.param_groups[1]["params"][0] is master
    assert not torch.equal(master, before)  # the tiny update survives in float32
    assert torch.equal(model[2].weight, master.to(f16))


def test_parameter_unfrozen_after_setup_is_stepped_through_a_master():
    precision = _fp16_precision()
    model = mlp()
    model[2].requires_grad_(False)
    model, opt = precision.setup(model, torch.optim.SGD(model.parameters(), lr=1e-6))
    assert model[2].weight not in opt.master_params
    model[2].requires_grad_(True)
    before = model[2].weight.detach().float().clone()
    precision.backward(_loss(model))
    assert precision.step(opt)
    master = opt.master_params[model[2].weight]
    assert not torch.equal(master, before) and torch.equal(model[2].weight, master.to(f16))


def test_a_run_unfrozen_after_setup_resumes_bit_for_bit():
    """A layer frozen at setup has its master made at its first step after unfreezing. A
    resumed run builds the wrapper before any step, so its optimizer held no master for it
    and loading the checkpoint was refused as "saved under another precision policy"."""

    def build():
        model = mlp()
        model[2].requires_grad_(False)
        precision = _fp16_precision()
        model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        return precision, model, opt

    def step(precision, model, opt, seed):
        opt.zero_grad()
        precision.backward(_loss(model, seed))
        precision.step(opt)

    precision, model, opt = build()
    step(precision, model, opt, 1)
    model[2].requires_grad_(True)
    step(precision, model, opt, 2)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    for seed in (3, 4):
        step(precision, model, opt, seed)

    precision2, model2, opt2 = build()
    model2[2].requires_grad_(True)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    for seed in (3, 4):
        step(precision2, model2, opt2, seed)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert model2[2].weight in opt2.master_params


# -- one optimizer, one wrapper -------------------------------------------------------------


def _one_sgd_update(seed: int = 0) -> list[torch.Tensor]:
    model = mlp(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _loss(model).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_setup_twice_with_the_same_optimizer_steps_it_once():
    precision = Precision("32-true")
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    model, first = precision.setup(model, sgd)
    model, again, same = precision.setup(model, sgd, sgd)  # a re-run cell, a repeated arg
    assert first is again is same and precision.optimizers == [first]
    precision.backward(_loss(model))
    assert precision.step()
    for p, q in zip(model.parameters(), _one_sgd_update(), strict=True):
        assert torch.equal(p, q)


def test_a_second_wrapper_takes_over_and_the_first_refuses_to_step():
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    first = Precision("32-true")
    model, old = first.setup(model, sgd)
    second = Precision("32-true")  # two Precisions on one optimizer
    model, new = second.setup(model, sgd)
    assert new is not old and new.optimizer is sgd
    second.backward(_loss(model))
    with pytest.raises(RuntimeError, match="replaced by a newer wrapper"):
        first.step()
    with pytest.raises(ValueError, match="passed twice"):
        second.step(new, new)
    assert second.step()
    for p, q in zip(model.parameters(), _one_sgd_update(), strict=True):
        assert torch.equal(p, q)  # stepped once, not twice


def test_rewrapping_a_16_true_optimizer_keeps_its_masters_linked_to_the_model():
    model = mlp().to(f16)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    LossScaleOptimizer(sgd)  # dropped at once: the optimizer now holds float32 masters
    opt = LossScaleOptimizer(sgd, StaticLossScaler(64.0))
    assert set(opt.master_params) == set(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(_loss(model))
    assert opt.step()
    for p, old in zip(model.parameters(), before, strict=True):
        assert not torch.equal(p, old) and torch.equal(p, opt.master_params[p].to(f16))


# -- closures -----------------------------------------------------------------------------------


def test_lbfgs_closure_steps_like_plain_torch_without_loss_scaling():
    ref_model, model = mlp(), mlp()
    ref = torch.optim.LBFGS(ref_model.parameters(), lr=0.5, max_iter=4)
    precision = Precision("32-true")
    model, opt = precision.setup(model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4))

    def ref_closure():
        ref.zero_grad()
        loss = _loss(ref_model)
        loss.backward()
        return loss

    def closure():
        opt.zero_grad()
        loss = _loss(model)
        precision.backward(loss)
        return loss

    for _ in range(2):
        ref.step(ref_closure)
        assert precision.step(opt, closure=closure)
    for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(TypeError, match="needs a closure"):
        precision.step(opt)


def test_lbfgs_closure_with_bf16_masters_re_evaluates_the_moved_masters():
    precision = Precision("bf16-true", allow_slow=True, master_weights=True)
    model = mlp()
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    model, opt = precision.setup(model, lbfgs)
    losses = []

    def closure():
        opt.zero_grad()
        loss = _loss(model)
        precision.backward(loss)
        losses.append(loss.item())
        return loss

    assert precision.step(opt, closure=closure)
    assert len(losses) > 2 and losses[-1] < losses[0]  # each evaluation saw the new masters
    for p in model.parameters():
        assert torch.equal(p, opt.master_params[p].to(bf16))


def test_closure_with_loss_scaling_is_a_clear_error():
    model = mlp()
    precision = Precision("32-true", scaler="dynamic")
    model, opt = precision.setup(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(RuntimeError, match="bf16-mixed"):
        precision.step(opt, closure=lambda: _loss(model))


# -- wrong arguments and foreign states -------------------------------------------------------


def test_step_takes_the_inner_optimizer_and_names_foreign_ones():
    precision = Precision("32-true")
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    precision.setup(model, sgd)
    precision.backward(_loss(model))
    assert precision.step(sgd)  # the optimizer set up, in place of its wrapper
    for p, q in zip(model.parameters(), _one_sgd_update(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="was not set up by this Precision"):
        precision.step(torch.optim.SGD(mlp().parameters(), lr=0.1))
    with pytest.raises(TypeError, match="takes the optimizers returned by setup"):
        precision.step("sgd")
    with pytest.raises(ValueError, match="no optimizer to step"):
        Precision("32-true").step()


def test_setup_and_constructor_arguments_are_checked():
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="model .an nn.Module. first"):
        Precision("32-true").setup(sgd, model)
    with pytest.raises(TypeError, match="argument 2 must be a torch.optim.Optimizer"):
        Precision("32-true").setup(model, "adam")
    with pytest.raises(TypeError, match="master_weights must be None, True or False"):
        Precision("32-true", master_weights="yes")
    with pytest.raises(TypeError, match="allow_slow must be True or False"):
        Precision("32-true", allow_slow="no")
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        LossScaleOptimizer(list(model.parameters()))


def test_plain_torch_optimizer_state_loads_and_continues_exactly():
    ref_model, model = mlp(), mlp()
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    for seed in (1, 2):
        ref.zero_grad()
        _loss(ref_model, seed).backward()
        ref.step()
    model.load_state_dict(ref_model.state_dict())
    opt = LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), NoLossScaler())
    opt.load_state_dict(_saved(ref.state_dict()))
    for seed in (3, 4):
        ref.zero_grad()
        opt.zero_grad()
        _loss(ref_model, seed).backward()
        opt.backward(_loss(model, seed))
        ref.step()
        assert opt.step()
    for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_unknown_and_mismatched_states_are_refused_before_anything_changes():
    model = mlp()
    opt = LossScaleOptimizer(torch.optim.Adam(model.parameters()), DynamicLossScaler(2.0**8))
    with pytest.raises(ValueError, match="not a LossScaleOptimizer state"):
        opt.load_state_dict({"lr": 0.1})
    precision = Precision("32-true")
    with pytest.raises(ValueError, match=r"precision\.scaler\.load_state_dict"):
        precision.load_state_dict(torch.amp.GradScaler("cpu").state_dict())

    # an optimizer state from a model of another shape (same number of parameters)
    other = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    other_opt = LossScaleOptimizer(torch.optim.Adam(other.parameters()), DynamicLossScaler(4.0))
    other_opt.backward(_loss(other))
    other_opt.step()
    with pytest.raises(ValueError, match=r"parameter 0 .* another model"):
        opt.load_state_dict(other_opt.state_dict())
    with pytest.raises(ValueError, match="'exp_avg'.*another model"):
        opt.load_state_dict(other_opt.optimizer.state_dict())
    assert opt.loss_scale == 2.0**8 and not opt.state  # nothing was loaded


# -- master weights by name ------------------------------------------------------------------


def _saved(obj: object) -> object:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_bf16_true_masters_restore_into_32_true_bit_exactly():
    precision = Precision("bf16-true", allow_slow=True, master_weights=True)
    model = mlp()
    # groups in another order than the model's: masters are matched by name, not position
    groups = [{"params": list(model[2].parameters())}, {"params": list(model[0].parameters())}]
    model, opt = precision.setup(model, torch.optim.AdamW(groups, lr=1e-3))
    for seed in (1, 2, 3):
        opt.zero_grad()
        precision.backward(_loss(model, seed))
        assert precision.step(opt)
    masters = {n: opt.master_params[p].detach().clone() for n, p in model.named_parameters()}
    ckpt = _saved({"model": model.state_dict(), "optimizer": opt.state_dict()})
    assert all(v.dtype == bf16 for v in ckpt["model"].values())

    restored = mlp(seed=7)
    by_name = master_weights_by_name(ckpt["optimizer"], ckpt["model"])
    assert sorted(by_name) == sorted(masters)
    restored.load_state_dict({**ckpt["model"], **by_name})
    for name, p in restored.named_parameters():
        assert p.dtype == f32 and torch.equal(p, masters[name])
    # the masters are not the bfloat16 weights rounded back up
    assert any(not torch.equal(masters[n], ckpt["model"][n].float()) for n in masters)


def test_tied_parameters_get_their_master_under_every_name():
    model = mlp()
    model[2] = nn.Linear(8, 8)
    model.append(nn.Tanh())
    model.append(nn.Linear(8, 8))
    model[4].weight = model[2].weight
    precision = _fp16_precision()
    model, opt = precision.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    by_name = master_weights_by_name(opt.state_dict(), model.state_dict())
    assert by_name["2.weight"] is by_name["4.weight"]
    assert torch.equal(by_name["2.weight"], model[2].weight.float())


def test_masters_without_names_are_a_clear_error_unless_the_optimizer_has_them():
    model = mlp().to(f16)
    plain = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="has no name"):
        master_weights_by_name(plain.state_dict(), model.state_dict())
    named = LossScaleOptimizer(torch.optim.SGD(mlp().to(f16).named_parameters(), lr=0.1))
    assert sorted(master_weights_by_name(named.state_dict(), model.state_dict())) == sorted(
        model.state_dict()
    )


def test_same_precision_resume_checks_masters_and_points_across_precisions():
    model16 = mlp()
    p16 = _fp16_precision()
    model16, opt16 = p16.setup(model16, torch.optim.SGD(model16.parameters(), lr=0.1))
    model32 = mlp()
    model32, opt32 = Precision("32-true").setup(
        model32, torch.optim.SGD(model32.parameters(), lr=0.1)
    )
    with pytest.raises(ValueError, match="master_weights_by_name"):
        opt32.load_state_dict(opt16.state_dict())
    # same precision: masters and parameters come back exactly
    precision = _fp16_precision()
    twin = mlp(seed=3)
    twin, twin_opt = precision.setup(twin, torch.optim.SGD(twin.parameters(), lr=0.1))
    twin_opt.load_state_dict(_saved(opt16.state_dict()))
    for p, q in zip(model16.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(opt16.master_params[p], twin_opt.master_params[q])


def test_joint_step_with_a_nan_in_one_of_two_16_true_optimizers_keeps_the_other_exact():
    """The clean optimizer's float16 parameters follow their masters; the other's stay."""
    precision = _fp16_precision()
    model = mlp()
    model, a, b = precision.setup(
        model,
        torch.optim.SGD(model[0].parameters(), lr=0.1),
        torch.optim.SGD(model[2].parameters(), lr=0.1),
    )
    before = copy.deepcopy(model.state_dict())
    precision.backward(_loss(model))
    model[2].bias.grad[0] = math.nan
    assert precision.step() is False
    assert not a.step_was_skipped and b.step_was_skipped
    assert torch.equal(model[2].weight, before["2.weight"])
    assert torch.equal(model[0].weight, a.master_params[model[0].weight].to(f16))
    assert not torch.equal(model[0].weight, before["0.weight"])


def test_joint_step_waits_for_the_end_of_an_accumulation_window():
    """Two optimizers whose host holds them inside an accumulation window (`step_gate`,
    Accelerate's ``sync_gradients``): `precision.step(a, b)` stepped them and updated the
    scale at every micro-batch, where each one's own `step` waits. It now waits too, and
    optimizers held and free at once are refused."""
    precision = _fp16_precision()
    model = mlp()
    model, a, b = precision.setup(
        model,
        torch.optim.SGD(model[0].parameters(), lr=0.1),
        torch.optim.SGD(model[2].parameters(), lr=0.1),
    )
    window = {"ends": False}
    a.step_gate = b.step_gate = lambda: window["ends"]
    before = copy.deepcopy(model.state_dict())
    precision.backward(_loss(model))
    assert precision.step(a, b) is False and precision.step() is False
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert precision.scaler.stats().steps == 0
    precision.backward(_loss(model))
    window["ends"] = True
    assert precision.step(a, b) is True and precision.scaler.stats().steps == 1
    assert not torch.equal(model[0].weight, before["0.weight"])
    b.step_gate = None
    window["ends"] = False
    with pytest.raises(ValueError, match="some are inside an accumulation window"):
        precision.step(a, b)


def test_a_bad_scaler_state_leaves_the_optimizer_untouched():
    model = mlp()
    opt = LossScaleOptimizer(torch.optim.Adam(model.parameters()), DynamicLossScaler(2.0**8))
    opt.backward(_loss(model))
    opt.step()
    state = opt.state_dict()
    state["scaler"] = {"kind": "static", "scale": 4.0}
    fresh = LossScaleOptimizer(torch.optim.Adam(mlp().parameters()), DynamicLossScaler(2.0**8))
    with pytest.raises(ValueError, match="cannot load a 'static' loss scaler state"):
        fresh.load_state_dict(state)
    assert not fresh.state and fresh.loss_scale == 2.0**8


def test_the_scheduler_gate_finds_the_wrapper_of_a_converted_optimizer():
    """With ``optimizer_states=`` the optimizer given to setup is converted into a low-bit
    one, which the wrapper steps: `scheduler_step(scheduler, optimizer)` did not find that
    wrapper and advanced the schedule after a skipped step (lr 1.0 -> 0.5), where
    `Precision.step(optimizer)` found it. Both find it now."""
    for states in (None, "int8"):
        torch.manual_seed(0)
        model = nn.Linear(64, 64)
        plain = torch.optim.AdamW(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
        precision = mixprec.Precision("16-mixed", allow_slow=True, optimizer_states=states)
        model, opt = precision.setup(model, plain)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the skipped step's own warning)
            precision.backward(model(torch.randn(2, 64)).float().sum() * float("inf"))
            assert precision.step(plain) is False
            assert mixprec.optim.scheduler_step(scheduler, plain) is False
        assert opt.param_groups[0]["lr"] == 1.0


def test_a_loss_scale_optimizer_of_another_scaler_is_refused_by_step():
    """A LossScaleOptimizer built by hand, with a scaler of its own, was stepped by
    `Precision.step` with the gradients of this precision's scaled loss never unscaled
    (2^16 times too large under 16-mixed). Refused, as an optimizer not set up is."""
    model = nn.Linear(4, 1)
    precision = mixprec.Precision("16-mixed", allow_slow=True)
    model = precision.setup(model)
    own = mixprec.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), scaler="none")
    precision.backward(model(torch.randn(8, 4)).float().mean())
    before = model.weight.detach().clone()
    for call in (lambda: precision.step(own), lambda: precision.step(own, own)):
        with pytest.raises(ValueError, match="has its own scaler"):
            call()
    assert torch.equal(model.weight, before)


def test_the_state_of_a_mastered_parameter_is_read_by_the_model_parameter():
    """Under float32 masters the optimizer's state is keyed by the masters: reading it by
    the model's parameter made an empty entry, and the next ``state_dict()`` failed with a
    bare KeyError. A model parameter reads its master's state."""
    model = nn.Linear(4, 2)
    precision = mixprec.Precision("16-true", allow_slow=True, scaler=1.0)
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    precision.backward(model(torch.randn(3, 4, dtype=torch.float16)).float().sum())
    precision.step(opt)
    state = opt.state[model.weight]
    assert "exp_avg" in state and state["exp_avg"].dtype == torch.float32
    assert model.weight in opt.state and len(opt.state) == 2
    assert len(opt.state_dict()["optimizer"]["state"]) == 2


def test_setup_warns_about_an_optimizer_of_another_model():
    """An optimizer built on another model's parameters steps that model: the one set up
    would never train. The Trainer warned; `Precision.setup` said nothing."""
    model, other = nn.Linear(4, 4), nn.Linear(4, 4)
    precision = mixprec.Precision("32-true")
    with pytest.warns(UserWarning, match=r"optimizer 0 \(SGD\) holds none of the parameters"):
        precision.setup(model, torch.optim.SGD(other.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixprec.Precision("32-true").setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_setting_up_again_under_masters_does_not_call_the_optimizer_foreign():
    """A second setup (a re-run cell) of a model whose optimizer holds its float32 masters
    warned that the optimizer held none of the model's parameters."""
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    precision = mixprec.Precision("16-true", allow_slow=True)
    model, wrapped = precision.setup(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert precision.setup(model, wrapped)[1] is wrapped
        assert precision.setup(model, opt)[1] is wrapped
    with pytest.warns(UserWarning, match="holds none of the parameters"):
        precision.setup(nn.Linear(4, 2).half(), wrapped)
