"""The summary's memory row: the peak of tensor memory at an optimizer step (measured as
the bench measures it) with the parts a user can act on, and the process's resident memory
labelled as such; a feature that saves memory shows it there."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainers import QUIET

from mixprec.trainer import Trainer

ROW = re.compile(
    r"(?P<peak>[\d.,]+) MiB of tensors at a step \(weights (?P<weights>[\d.,]+) MiB, "
    r"gradients (?P<gradients>[\d.,]+) MiB, optimizer states (?P<states>[\d.,]+) MiB, "
    r"activations and temporaries (?P<activations>[\d.,]+) MiB\); "
    r"(?P<resident>[\d,]+) MiB resident \(the whole process\)"
)


def _memory(states: str | None) -> dict[str, float]:
    """The memory row of a 2-step fit of 8 Linear(128, 128) layers (16384-element weights,
    whose states the low-bit optimizer quantizes; eagerly: 131072 elements a step are too
    few for it to compile) with AdamW, its states in `states`."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])
    x = torch.randn(8, 128)
    t = Trainer(max_steps=2, optimizer_states=states, **QUIET)
    t.fit(model, DataLoader(TensorDataset(x, x), batch_size=4), loss_fn=F.mse_loss)
    match = ROW.fullmatch(t.summary()["peak memory"])
    assert match, t.summary()["peak memory"]
    return {k: float(v.replace(",", "")) for k, v in match.groupdict().items()}


def test_the_summary_shows_what_int8_optimizer_states_save_in_tensor_memory():
    """The process's resident memory hid it (it grows with int8 states: the kernels and
    tables loaded); the tensor peak of the second step and the optimizer states' part show
    the saving."""
    full, int8 = _memory(None), _memory("int8")
    weights = 8 * (128 * 128 + 128) * 4 / 2**20
    assert full["weights"] == int8["weights"] == round(weights, 2)
    assert full["gradients"] == int8["gradients"] == round(weights, 2)
    assert full["states"] == round(2 * weights, 2)  # AdamW's two float32 moments
    assert int8["states"] < full["states"] / 2
    assert int8["peak"] < full["peak"]
    for parts in (full, int8):
        assert parts["peak"] >= parts["weights"] + parts["gradients"] + parts["states"] - 0.02
        assert parts["resident"] > parts["peak"]
