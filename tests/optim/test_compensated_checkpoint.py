"""Checkpoints of compensated runs: what a load checks first, and the Kahan buffers a
checkpoint moved to another precision folds into its weights."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec.optim import LossScaleOptimizer, master_weights_by_name

torch.set_num_threads(1)


def _stochastic_run() -> tuple[nn.Module, LossScaleOptimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, LossScaleOptimizer(opt, scaler="none", model=model, compensation="stochastic")


@pytest.mark.parametrize(
    "entry",
    [
        {"kind": "stochastic"},
        {"kind": "stochastic", "seed": 5.0},
        {"kind": "stochastic", "seed": torch.tensor(5)},
        {"seed": 5},
        "stochastic",
    ],
    ids=["no-seed", "float-seed", "tensor-seed", "no-kind", "not-a-dict"],
)
def test_a_compensation_entry_the_compensator_refuses_is_refused_before_anything_loads(entry):
    """Found by a review: check_state_dict looked at the saved compensation's kind only, so
    an entry without a seed (or with a float or tensor one) passed it, and load_state_dict
    raised in the Compensator's load after the scaler and the optimizer's state were
    loaded; a Trainer's resume raised a bare ValueError after the weights were overwritten.
    The Compensator's own check now runs in check_state_dict."""
    model, opt = _stochastic_run()
    for _ in range(3):
        model(torch.randn(2, 4).bfloat16()).float().sum().backward()
        opt.step()
        opt.zero_grad()
    state = {**opt.state_dict(), "compensation": entry}
    _, fresh = _stochastic_run()
    seed = fresh._compensator.seed
    with pytest.raises((TypeError, ValueError), match="seed|compensation"):
        fresh.check_state_dict(state)
    with pytest.raises((TypeError, ValueError), match="seed|compensation"):
        fresh.load_state_dict(state)
    assert len(fresh.optimizer.state) == 0 and fresh._compensator.seed == seed


def test_a_trainer_resume_refuses_a_bad_compensation_entry_with_the_model_untouched(tmp_path):
    """Found by a review: a checkpoint whose compensation has no seed raised a bare
    ValueError at resume, after the model's weights were overwritten by the checkpoint's;
    it is now a CheckpointError saying nothing was loaded, the model as it was."""
    from mixprec import Trainer
    from mixprec.trainer import CheckpointError, ModelCheckpoint

    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
    )

    def trainer(root: str, epochs: int) -> Trainer:
        precision = mixprec.Precision("bf16-true", compensation="stochastic", allow_slow=True)
        return Trainer(
            precision=precision,
            max_epochs=epochs,
            seed=0,
            logger=False,
            enable_progress_bar=False,
            default_root_dir=root,
            callbacks=[ModelCheckpoint(save_last=True)],
        )

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out.float(), y.float())

    torch.manual_seed(0)
    trainer(tmp_path / "a", 1).fit(nn.Linear(4, 1), data, loss_fn=loss)
    (last,) = (tmp_path / "a").rglob("last.ckpt")
    state = torch.load(last, weights_only=False)
    state["optimizers"][0]["compensation"] = {"kind": "stochastic"}  # no seed
    edited = tmp_path / "edited.ckpt"
    torch.save(state, edited)
    torch.manual_seed(1)
    fresh = nn.Linear(4, 1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match="no 'seed'.*Nothing was loaded"):
        trainer(tmp_path / "b", 2).fit(
            fresh, data, loss_fn=loss, ckpt_path=tmp_path / "edited.ckpt"
        )
    after = fresh.state_dict()
    assert all(torch.equal(before[k].to(after[k].dtype), after[k]) for k in before)


def _low_bit_run(compensation: str | None) -> tuple[nn.Module, LossScaleOptimizer]:
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    precision = mixprec.Precision(
        "bf16-true", optimizer_states="int8", compensation=compensation, allow_slow=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, lso = precision.setup(model, opt)
    return model, lso


def test_a_low_bit_optimizers_own_kahan_buffers_count_as_the_checkpoints_compensation():
    """Found by a review: a low-bit optimizer's Kahan buffers (optimizer_states= with
    compensation="kahan") were invisible to the checkpoint logic: the state_dict's
    compensation was None, master_weights_by_name folded nothing, and the checkpoint
    loaded directly into an uncompensated run, its buffers' part of the weights lost (a
    torch AdamW's Kahan checkpoint is refused there and folded across precisions)."""
    model, lso = _low_bit_run("kahan")
    torch.manual_seed(1)
    for _ in range(5):
        loss = model(torch.randn(8, 16).bfloat16()).float().pow(2).mean()
        loss.backward()
        lso.step()
        lso.zero_grad()
    state = lso.state_dict()
    assert state["compensation"] == {"kind": "kahan", "seed": lso.optimizer.seed}
    buffer = state["optimizer"]["state"][0]["compensation"]
    assert (buffer != 0).any()
    model_state = model.state_dict()
    masters = master_weights_by_name(state, model_state)
    assert torch.equal(masters["weight"], model.weight.float() + buffer.float())

    kahan_model, kahan = _low_bit_run("kahan")  # the same precision loads it as it is
    assert kahan.loads_directly(state)

    plain_model, plain = _low_bit_run(None)
    assert not plain.loads_directly(state)
    with pytest.raises(ValueError, match="load_state_dict_across_precisions"):
        plain.load_state_dict(state)
    assert len(plain.optimizer.state) == 0
    plain.load_state_dict_across_precisions(state, {**model_state, **masters})
    plain_model.load_state_dict({**model_state, **masters})
    assert all("compensation" not in s for s in plain.optimizer.state.values())
    assert torch.equal(plain_model.weight, masters["weight"].bfloat16())


def test_folding_kahan_buffers_drops_the_entries_the_next_step_would_drop():
    """Found by a review: master_weights_by_name added every Kahan buffer entry to its
    weight, where the step itself keeps only those that can be the weight's last rounding
    error (`engine.settled`): a weight pruned to 0 between steps came back non-zero in a
    checkpoint moved to another precision (its old error added), and stays 0 in the run."""
    torch.manual_seed(0)
    model = nn.Linear(16, 4).to(torch.bfloat16)
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3), scaler="none", model=model,
        compensation="kahan",
    )  # fmt: skip
    for _ in range(5):
        model(torch.randn(8, 16).bfloat16()).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    buffer = opt.optimizer.state[model.weight]["compensation"]
    assert (buffer[:, :8] != 0).any()
    with torch.no_grad():
        model.weight[:, :8] = 0  # pruned
    masters = master_weights_by_name(opt.state_dict(), model.state_dict())
    assert torch.equal(masters["weight"][:, :8], torch.zeros(4, 8))
    # the entries beside the weights the steps left keep their error
    kept = model.weight[:, 8:].float() + buffer[:, 8:].float()
    assert torch.equal(masters["weight"][:, 8:], kept)
    # as the run's own next step (a zero gradient) leaves the pruned weights
    model.weight.grad, model.bias.grad = (
        torch.zeros_like(model.weight),
        torch.zeros_like(model.bias),
    )
    opt.step()
    assert torch.equal(model.weight[:, :8], torch.zeros(4, 8, dtype=torch.bfloat16))


# -- resumes by parameter name ---------------------------------------------------------------


class _QK(nn.Module):
    """Two same-shaped projections, defined q first (``first="q"``) or k first: the same
    model after a refactor that reordered its fields."""

    def __init__(self, first: str = "q") -> None:
        super().__init__()
        for name in (first, "k" if first == "q" else "q"):
            setattr(self, name, nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x) * 2 - self.k(x)


class _Wrapped(nn.Module):
    """``inner`` under ``prefix`` (DDP's ``module``, torch.compile's ``_orig_mod``)."""

    def __init__(self, inner: nn.Module, prefix: str) -> None:
        super().__init__()
        self.add_module(prefix, inner)
        self.inner = [inner]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner[0](x)


_RESUMED_SETTINGS = {
    "16-true": (torch.float16, {}),
    "bf16-kahan": (torch.bfloat16, {"scaler": "none", "compensation": "kahan"}),
}


def _qk_run(
    setting: str, first: str, grouped: bool = False, wrap: str | None = None
) -> tuple[nn.Module, LossScaleOptimizer]:
    dtype, kw = _RESUMED_SETTINGS[setting]
    torch.manual_seed(0)
    model = _QK(first).to(dtype)
    if grouped:  # one group per layer, in the fields' order, the second without decay
        first_layer, second_layer = (model.q, model.k) if first == "q" else (model.k, model.q)
        groups = [
            {"params": list(first_layer.parameters()), "weight_decay": 0.1},
            {"params": list(second_layer.parameters()), "weight_decay": 0.0},
        ]
    else:
        groups = [{"params": list(model.parameters())}]
    named = _Wrapped(model, wrap) if wrap else model
    opt = torch.optim.AdamW(groups, lr=1e-2)
    return model, LossScaleOptimizer(opt, model=named, **kw)


def _qk_steps(model: nn.Module, opt: LossScaleOptimizer, seeds: range) -> None:
    dtype = next(model.parameters()).dtype
    for seed in seeds:
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)).to(dtype)
        opt.backward(model(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()


def _per_name(model: nn.Module, opt: LossScaleOptimizer) -> dict[str, torch.Tensor]:
    """Each parameter's weight, master (if any) and optimizer state, by name."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().clone()
        if p in opt.master_params:
            out[name + ":master"] = opt.master_params[p].detach().clone()
        for key, value in opt.state[p].items():
            out[f"{name}:{key}"] = value.clone() if torch.is_tensor(value) else value
    return out


@pytest.mark.parametrize("setting", list(_RESUMED_SETTINGS))
@pytest.mark.parametrize("grouped", [False, True], ids=["one-group", "groups"])
def test_a_resume_into_parameters_in_another_order_restores_each_by_name(setting, grouped):
    """Found by a review: load_state_dict restored the masters and the optimizer's state
    by position, never reading the saved param_names: a model whose same-shaped fields
    were defined in another order (or whose groups were listed in another order) resumed
    with its masters copied over the weights model.load_state_dict had just restored (q
    and k swapped), and with each other's Adam moments and Kahan buffers. They now go
    by name, each group's settings with its parameters: restored bit for bit, and the
    16-true run resumes bit for bit (a Kahan step's rounding bits are keyed by a
    parameter's position: the reordered model's next steps round otherwise, within it)."""
    model, opt = _qk_run(setting, "q", grouped)
    _qk_steps(model, opt, range(3))
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(opt.state_dict())
    at_save = _per_name(model, opt)
    _qk_steps(model, opt, range(3, 5))  # the run that never stopped

    resumed, fresh = _qk_run(setting, "k", grouped)  # q and k defined the other way round
    resumed.load_state_dict(model_state)
    fresh.load_state_dict(state)
    loaded = _per_name(resumed, fresh)
    assert at_save.keys() == loaded.keys() and any(k.endswith("exp_avg") for k in loaded)
    if setting == "bf16-kahan":
        assert any(k.endswith("compensation") for k in loaded)
    for key, value in at_save.items():
        assert _identical(loaded[key], value), key
    _qk_steps(resumed, fresh, range(3, 5))
    want, got = _per_name(model, opt), _per_name(resumed, fresh)
    for key, value in want.items():
        if setting == "16-true":
            assert _identical(got[key], value), key
        elif ":" not in key:
            torch.testing.assert_close(got[key], value, atol=2e-3, rtol=0)
    if grouped:  # each parameter in the group of its saved settings
        for layer in ("q", "k"):
            decay = [g["weight_decay"] for g in opt.param_groups if _holds(opt, g, model, layer)]
            here = [
                g["weight_decay"] for g in fresh.param_groups if _holds(fresh, g, resumed, layer)
            ]
            assert decay == here


def _identical(a: object, b: object) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _holds(opt: LossScaleOptimizer, group: dict, model: nn.Module, layer: str) -> bool:
    return any(opt.model_param(p) is getattr(model, layer).weight for p in group["params"])


def test_groups_whose_settings_would_mix_by_name_are_refused_before_anything_changes():
    """Found by a review: a restore by name into groups holding other parameters than at
    the save would give a group's settings to parameters saved with others': refused."""
    model, opt = _qk_run("16-true", "q", grouped=True)
    _qk_steps(model, opt, range(2))
    state = opt.state_dict()
    torch.manual_seed(0)
    other = _QK("q").half()
    groups = [  # weights in one group, biases in the other
        {"params": [other.q.weight, other.k.weight], "weight_decay": 0.1},
        {"params": [other.q.bias, other.k.bias], "weight_decay": 0.0},
    ]
    fresh = LossScaleOptimizer(torch.optim.AdamW(groups, lr=1e-2), model=other)
    masters = [m.clone() for m in fresh.master_params.values()]
    with pytest.raises(ValueError, match=r"(?s)group.*k\.weight.*q\.weight|q\.weight.*k\.weight"):
        fresh.load_state_dict(state)
    assert len(fresh.optimizer.state) == 0
    assert all(
        torch.equal(a, b) for a, b in zip(masters, fresh.master_params.values(), strict=True)
    )


def test_an_optimizer_state_of_another_model_is_refused_by_name_before_anything_changes():
    """Found by a review: an optimizer state saved for another model whose parameters have
    the same shapes (q and k here, a and b there) loaded by position without a word, its
    masters copied over the model's weights. It is refused, naming parameters, before
    anything is loaded."""
    model, opt = _qk_run("16-true", "q")
    _qk_steps(model, opt, range(2))
    state = opt.state_dict()

    class AB(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    torch.manual_seed(1)
    other = AB().half()
    fresh = LossScaleOptimizer(torch.optim.AdamW(other.parameters(), lr=1e-2), model=other)
    weights = {k: v.clone() for k, v in other.state_dict().items()}
    masters = [m.clone() for m in fresh.master_params.values()]
    scale = fresh.loss_scale
    for call in (fresh.check_state_dict, fresh.load_state_dict):
        with pytest.raises(ValueError, match=r"(?s)q\.weight.*a\.weight|a\.weight.*q\.weight"):
            call(state)
    assert len(fresh.optimizer.state) == 0 and fresh.loss_scale == scale
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in weights.items())
    assert all(
        torch.equal(a, b) for a, b in zip(masters, fresh.master_params.values(), strict=True)
    )


@pytest.mark.parametrize("saved_prefix", ["module", "_orig_mod", "_fsdp_wrapped_module", None])
def test_a_state_saved_under_a_wrapper_prefix_resumes_by_name(saved_prefix):
    """Found by a review (restores by name): the names of a model saved under DDP
    (``module.``), torch.compile (``_orig_mod.``) or FSDP and resumed without it, or the
    other way round, differ by that prefix on every name: matched without it, in another order
    too, bit for bit."""
    load_prefix = None if saved_prefix else "module"
    model, opt = _qk_run("16-true", "q", wrap=saved_prefix)
    _qk_steps(model, opt, range(3))
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(opt.state_dict())
    _qk_steps(model, opt, range(3, 5))

    resumed, fresh = _qk_run("16-true", "k", wrap=load_prefix)
    resumed.load_state_dict(model_state)
    fresh.load_state_dict(state)
    _qk_steps(resumed, fresh, range(3, 5))
    want, got = _per_name(model, opt), _per_name(resumed, fresh)
    for key, value in want.items():
        assert _identical(got[key], value), key


class _Tied(nn.Module):
    """GPT-2's tying: the head's weight is the embedding's, one parameter of two names."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.h = nn.Embedding(8, 4), nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x):
        return self.lm_head(self.h(self.wte(x)))


def test_a_tied_parameter_named_once_on_one_side_matches_its_names_on_the_other():
    """Found by a diff review: a torch optimizer built from named_parameters() names a tied
    parameter once (``wte.weight``), a LossScaleOptimizer with ``model=`` by both owners;
    compared as whole sets of names, the load was refused as another model's, both ways."""
    torch.manual_seed(0)
    model = _Tied()
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    model(torch.tensor([1, 2, 3])).square().mean().backward()
    opt.step()
    other = _Tied()
    other.load_state_dict(model.state_dict())
    lso = LossScaleOptimizer(torch.optim.AdamW(other.parameters(), lr=1e-2), model=other)
    lso.load_state_dict(copy.deepcopy(opt.state_dict()))
    for name, p in model.named_parameters():
        assert torch.equal(lso.state[other.get_parameter(name)]["exp_avg"], opt.state[p]["exp_avg"])
    back = LossScaleOptimizer(torch.optim.AdamW(_Tied().named_parameters(), lr=1e-2))
    back.load_state_dict(copy.deepcopy(lso.state_dict()))  # (and the other way)


def test_names_under_another_prefix_on_each_side_match():
    """Found by a diff review: a state saved through DDP (``module.q.weight``) and loaded
    with ``model=`` a holder of the same network (``net.q.weight``) was refused: a prefix was
    stripped on one side only."""

    class Holder(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    saved_under = Holder(net)
    saved_under.module = saved_under.net
    del saved_under.net
    opt = LossScaleOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), model=saved_under)
    opt.backward(net(torch.randn(2, 4)).square().sum())
    opt.step()
    again = copy.deepcopy(net)
    fresh = LossScaleOptimizer(torch.optim.AdamW(again.parameters(), lr=1e-2), model=Holder(again))
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    for (_, p), q in zip(net.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(fresh.state[q]["exp_avg"], opt.state[p]["exp_avg"])


def test_a_state_moved_across_precisions_gives_each_parameter_its_own_moments():
    """Found by a review (restores by name): load_state_dict_across_precisions took the
    masters by name but the optimizer's state by position: into a model whose same-shaped
    fields come in another order, q's moments went to k."""
    model, opt = _qk_run("16-true", "q")
    _qk_steps(model, opt, range(3))
    state = copy.deepcopy(opt.state_dict())
    weights = {**model.state_dict(), **master_weights_by_name(state, model.state_dict())}
    resumed, fresh = _qk_run("bf16-kahan", "k")
    resumed.load_state_dict(weights)
    fresh.load_state_dict_across_precisions(state, weights)
    for name, p in model.named_parameters():
        mine = fresh.state[resumed.get_parameter(name)]
        saved = opt.state[p]
        assert torch.equal(mine["exp_avg"], saved["exp_avg"].to(mine["exp_avg"].dtype)), name


def test_a_torch_optimizer_state_with_parameter_names_loads_by_name():
    """Found by a review (restores by name): a torch optimizer's own state, built from
    named_parameters() (its groups hold param_names, torch >= 2.6), loaded by position
    into a wrapper over a model whose same-shaped fields come in another order."""
    torch.manual_seed(0)
    model = _QK("q")
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    resumed = _QK("k")
    resumed.load_state_dict(model.state_dict())
    fresh = LossScaleOptimizer(
        torch.optim.AdamW(resumed.parameters(), lr=1e-2), scaler="none", model=resumed
    )
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    for name, p in model.named_parameters():
        mine = fresh.state[resumed.get_parameter(name)]
        assert torch.equal(mine["exp_avg"], opt.state[p]["exp_avg"]), name
