"""A DDP rank that raises ends the whole run quickly: real gloo, two real processes.

Before, the failing rank waited in a teardown barrier while the other waited in the gradient
all-reduce, for gloo's 30-minute timeout, and the error was never shown. Each case runs in a
subprocess with a deadline far below that; the parent must re-raise the first rank's own
exception and leave no process behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from mixprec.trainer import TrainingModule

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc"),
]


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Boom(ValueError):
    """The user's own error, raised on one rank only."""


class FailsOnOneRank(TrainingModule):
    def __init__(self, where: str, rank: int) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.where, self.rank = where, rank

    def forward(self, x):
        return self.net(x)

    def _maybe_fail(self, where: str, batch_idx: int = 1) -> None:
        if where == self.where and batch_idx == 1:
            if self.trainer.strategy.global_rank == self.rank:
                raise Boom(f"user error in {where} on rank {self.rank}")

    def on_fit_start(self):
        self._maybe_fail("on_fit_start")

    def training_step(self, batch, batch_idx):
        self._maybe_fail("training_step", batch_idx)
        return F.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self._maybe_fail("validation_step", batch_idx)
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))


SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
from torch.utils.data import DataLoader
from test_trainer_ddp_failures import Boom, FailsOnOneRank, data
from mixprec.trainer import Trainer

if __name__ == "__main__":
    trainer = Trainer(devices=2, strategy={strategy!r}, max_epochs=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False)
    start = time.monotonic()
    try:
        trainer.fit(FailsOnOneRank({where!r}, {rank}), DataLoader(data(), batch_size=4),
                    DataLoader(data(), batch_size=8))
    except Boom as err:
        print("CAUGHT", err, "|", " ".join(getattr(err, "__notes__", [])).replace("\\n", " "))
        print("SECONDS", time.monotonic() - start)
"""


def leftover_processes(tag: str) -> list[int]:
    """Processes still running with ``tag`` in their environment."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if tag.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("strategy", ["ddp", "ddp_fork"])
@pytest.mark.parametrize(
    "where, rank",
    [("training_step", 1), ("validation_step", 0), ("on_fit_start", 1)],
)
def test_one_failing_rank_ends_the_run_with_its_own_error(tmp_path, strategy, where, rank):
    script = tmp_path / "run.py"
    tests = str(Path(__file__).parent)
    script.write_text(
        textwrap.dedent(SCRIPT.format(tests=tests, strategy=strategy, where=where, rank=rank))
    )
    tag = f"MIXPREC_TEST_{uuid.uuid4().hex}"
    env = {**os.environ, tag: "1", "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
        )
    finally:
        left = leftover_processes(tag)
        for pid in left:
            os.kill(pid, 9)
    assert proc.returncode == 0, proc.stderr[-3000:]
    caught = [line for line in proc.stdout.splitlines() if line.startswith("CAUGHT")]
    assert caught, proc.stdout + proc.stderr[-3000:]
    assert f"user error in {where} on rank {rank}" in caught[0]
    assert f"rank {rank} of 2" in caught[0]  # the note says where it was raised
    assert left == []


class SkipsOnRankOne(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if batch_idx == 1 and self.trainer.strategy.global_rank == 1:
            return None
        return F.mse_loss(self(batch[0]), batch[1])


SKIP_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from torch.utils.data import DataLoader
from test_trainer_ddp_failures import SkipsOnRankOne, data
from mixprec.trainer import Trainer

if __name__ == "__main__":
    trainer = Trainer(devices=2, strategy="ddp_fork", max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False)
    try:
        trainer.fit(SkipsOnRankOne(), DataLoader(data(), batch_size=4))
    except RuntimeError as err:
        print("CAUGHT", str(err).splitlines()[0])
"""


def test_a_batch_skipped_on_one_rank_is_a_clear_error_under_ddp(tmp_path):
    script = tmp_path / "skip.py"
    script.write_text(textwrap.dedent(SKIP_SCRIPT.format(tests=str(Path(__file__).parent))))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert "CAUGHT training_step returned None for batch 1 on rank 1: under DDP" in proc.stdout, (
        proc.stdout + proc.stderr[-3000:]
    )
