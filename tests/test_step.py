"""One training step (`mixprec.step`): the Trainer, the doctor and the bench compute the same
loss for the same batch under the same precision, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mixprec import Trainer, diagnose
from mixprec.bench.models import load_workload
from mixprec.bench.runner import RunSpec, _build_mixprec
from mixprec.trainer import Callback

FACTORY = """
import torch
from torch import nn
import torch.nn.functional as F


def make():
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))

    def make_batch(n):
        g = torch.Generator().manual_seed(1)
        return torch.randn(n, 8, generator=g) * 3, torch.randint(0, n, (n,), generator=g)

    def contrastive(out, target):  # a loss with a matmul of its own, as contrastive ones have
        return F.cross_entropy(out @ out.T, target)

    return model, make_batch, contrastive
"""


class FirstLoss(Callback):
    def __init__(self) -> None:
        self.loss: torch.Tensor | None = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.loss is None:
            self.loss = outputs.detach()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-mixed"])
def test_the_trainer_the_doctor_and_the_bench_compute_one_loss(tmp_path, precision):
    path = tmp_path / "workload.py"
    path.write_text(FACTORY)
    name = f"{path}:make"

    work = load_workload(name)
    x, y = work.make_batch(16)
    first = FirstLoss()
    trainer = Trainer(
        precision=precision,
        accelerator="cpu",
        max_steps=1,
        allow_slow_precision=True,
        callbacks=[first],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(work.model, DataLoader(TensorDataset(x, y), batch_size=16), loss_fn=work.loss_fn)

    work = load_workload(name)
    found = diagnose(work.model, (x, y), loss_fn=work.loss_fn, precision=precision, device="cpu")

    spec = RunSpec(
        model=name,
        precision=precision,
        batch_size=16,
        image_size=32,
        device="cpu",
        steps=1,
        warmup=0,
        threads=torch.get_num_threads(),
        allow_slow=True,
    )
    bench_loss = _build_mixprec(spec, torch.device("cpu")).step()

    assert first.loss is not None and first.loss.dtype == bench_loss.dtype
    # a mixed policy's outputs are float32, and so is the loss computed from them
    assert bench_loss.dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float32)
    assert float(first.loss) == found.target_loss == float(bench_loss)
    if precision != "32-true":  # the precision did change the loss: the test can tell
        assert found.target_loss != found.loss
