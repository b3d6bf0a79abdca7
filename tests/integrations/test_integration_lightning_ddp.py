"""mixprec's Lightning plugin under Lightning's own DDP strategy: two gloo processes."""

from __future__ import annotations

import math

import pytest
import torch
from spawning import WORLD, run_ranks
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("pytorch_lightning")

from test_integration_lightning import Regressor, StepRecorder  # noqa: E402

from mixprec import DynamicLossScaler  # noqa: E402
from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402

STEPS = 5
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]


class PoisonedOnRankOne(Regressor):
    """An inf in rank 1's loss only, at global step 2."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 2 and self.trainer.global_rank == 1:
            loss = loss * math.inf
        return loss


def _worker(rank: int, out: str) -> None:
    """Lightning finds the process group run_ranks made (LOCAL_RANK set: processes created
    outside it) and runs its DDP strategy in it."""
    torch.manual_seed(0)
    model, rec = PoisonedOnRankOne(), StepRecorder()
    plugin = MixprecPrecision(
        "16-mixed", allow_slow=True, scaler=DynamicLossScaler(init_scale=2.0**8)
    )
    g = torch.Generator().manual_seed(1)
    n = 2 * 8 * STEPS  # batches of 8 per rank
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy="ddp", plugins=[plugin], max_steps=STEPS,
        callbacks=[rec], enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, logger=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=8))
    changed = [
        any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        for before, after in zip(rec.before, rec.after, strict=True)
    ]
    stats = plugin.scaler.stats()
    torch.save(
        {
            "changed": changed,
            "lrs": rec.lrs,
            "stats": (stats.steps, stats.skipped_steps, stats.scale),
            "strategy": type(trainer.strategy).__name__,
            "world": trainer.world_size,
            "params": [p.detach().clone() for p in model.parameters()],
            "dtypes": {p.dtype for p in model.parameters()},
        },
        f"{out}/rank{rank}.pt",
    )


def test_an_overflow_on_one_rank_is_skipped_by_both_and_replicas_stay_identical(tmp_path):
    run_ranks(_worker, str(tmp_path), nprocs=WORLD)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD))
    for r in (r0, r1):
        assert (r["strategy"], r["world"]) == ("DDPStrategy", WORLD)
        assert r["changed"] == [True, True, False, True, True]  # DDP's all-reduce spread the inf
        assert r["stats"] == (STEPS, 1, 2.0**7)  # both backed off once
        assert r["lrs"][2] == r["lrs"][3]  # the skipped step did not advance the scheduler
        assert r["dtypes"] == {torch.float32}  # float32 masters under 16-mixed
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b)
