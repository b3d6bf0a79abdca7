"""Two gloo processes: only rank 1 sees an inf, and both ranks skip and back off together."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawning import WORLD, run_ranks

from mixprec.optim import LossScaleOptimizer
from mixprec.optim.scaling import DynamicLossScaler


def _worker(rank: int, out_dir: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    group = dist.new_group(list(range(WORLD)))
    opt = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        DynamicLossScaler(init_scale=2.0**10, process_group=group),
    )
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    before = model.weight.detach().clone()
    taken = []
    for step in range(3):
        opt.backward(F.mse_loss(model(x + rank), y))
        if step == 1 and rank == 1:
            model.weight.grad[0, 0] = math.inf
        taken.append(opt.step())
        opt.zero_grad()
        if step == 0:
            after_first = model.weight.detach().clone()
        if step == 1:
            assert torch.equal(model.weight, after_first)
    torch.save(
        {
            "taken": taken,
            "scale": opt.loss_scale,
            "moved": not torch.equal(before, model.weight),
            "stats": opt.scaler.stats(),
        },
        f"{out_dir}/rank{rank}.pt",
    )


@pytest.mark.slow
def test_only_rank_one_overflows_and_both_ranks_skip(tmp_path):
    run_ranks(_worker, str(tmp_path), nprocs=WORLD)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r in results:
        assert r["taken"] == [True, False, True]
        assert r["scale"] == 2.0**9
        assert r["moved"]
        assert (r["stats"].skipped_steps, r["stats"].last_overflow_step) == (1, 1)
