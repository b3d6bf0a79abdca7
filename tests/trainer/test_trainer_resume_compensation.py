"""A checkpoint of a 16-bit run resumed with another compensation or master-weights setting
restores as one of another precision does (the weights from the checkpoint's masters or
compensated weights), instead of failing after the model was loaded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainers import SILENT

import mixprec
from mixprec.optim import master_weights_by_name
from mixprec.trainer import Trainer


def loader() -> DataLoader:
    x = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def _trainer(steps: int, root, **settings) -> Trainer:
    precision = mixprec.Precision("bf16-true", allow_slow=True, **settings)
    return Trainer(precision=precision, max_steps=steps, default_root_dir=root, **SILENT)


@pytest.mark.parametrize(
    "saved, resumed",
    [
        (dict(compensation="stochastic"), dict(compensation="kahan")),
        (dict(master_weights=True), dict(compensation="kahan")),
        (dict(compensation="kahan"), dict(master_weights=True)),
    ],
)
def test_a_resume_with_another_compensation_restores_across(tmp_path, saved, resumed):
    """Found by a review: the resume's checks passed, the model was loaded, then the
    optimizer's load refused the checkpoint (a raw ValueError, the model half-restored)."""
    torch.manual_seed(0)
    first = nn.Linear(3, 1)
    trainer = _trainer(2, tmp_path, **saved)
    trainer.fit(first, loader(), loss_fn=F.mse_loss)
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)
    full = {**state["model"], **master_weights_by_name(state["optimizers"][0], state["model"])}

    torch.manual_seed(1)
    second = nn.Linear(3, 1)
    again = _trainer(2, tmp_path, **resumed)  # (restored at step 2: no step more)
    again.fit(second, loader(), loss_fn=F.mse_loss, ckpt_path=path)
    for name, p in second.named_parameters():
        assert torch.equal(p.detach(), full[name].to(torch.bfloat16)), name
    if "master_weights" in resumed:  # (the masters are the checkpoint's compensated weights)
        masters = again.optimizers[0].master_params
        for name, p in second.named_parameters():
            assert torch.equal(masters[p], full[name].float()), name
    _trainer(4, tmp_path, **resumed).fit(second, loader(), loss_fn=F.mse_loss, ckpt_path=path)


def test_a_float16_run_resumed_with_another_compensation_keeps_its_float32_moments(tmp_path):
    """Found by a review: the across-precisions load cast a compensated float16 run's
    float32 Adam moments to float16 (second moments of 1e-9 became 0, and the next step
    divided by eps)."""

    def trainer(steps: int, kind: str) -> Trainer:
        precision = mixprec.Precision("16-true", allow_slow=True, compensation=kind)
        return Trainer(precision=precision, max_steps=steps, default_root_dir=tmp_path, **SILENT)

    def small() -> nn.Linear:
        m = nn.Linear(3, 1)
        with torch.no_grad():
            m.weight.fill_(1e-4)
            m.bias.zero_()
        return m

    x = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, 1e-4 * x.sum(1, keepdim=True)), batch_size=4)
    fit = dict(loss_fn=F.mse_loss, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    first = trainer(2, "stochastic")
    first.fit(small(), data, **fit)
    path = tmp_path / "two.ckpt"
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["optimizers"][0]["optimizer"]["state"]
    again = trainer(2, "kahan")
    again.fit(small(), data, ckpt_path=path, **fit)
    state = again.optimizers[0].optimizer.state
    for index, p in enumerate(again.optimizers[0].optimizer.param_groups[0]["params"]):
        moment = state[p]["exp_avg_sq"]
        assert moment.dtype == torch.float32
        assert torch.equal(moment, saved[index]["exp_avg_sq"])
