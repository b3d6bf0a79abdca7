"""Checkpoints of compensated runs: what a load checks first, and the Kahan buffers a
checkpoint moved to another precision folds into its weights."""

from __future__ import annotations

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
