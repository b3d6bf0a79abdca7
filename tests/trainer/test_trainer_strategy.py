"""The strategies' shapes: DDP and FSDP share the process group's work (`ProcessGroupStrategy`)
and neither is the other; rank 0's run directory reaches every rank's loggers through the
loggers' public `version`."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from trainers import QUIET

from mixprec.trainer import Trainer
from mixprec.trainer.loggers import CSVLogger
from mixprec.trainer.strategy import DDPStrategy, FSDPStrategy, ProcessGroupStrategy


def test_ddp_and_fsdp_share_the_process_group_and_neither_is_the_other():
    assert issubclass(DDPStrategy, ProcessGroupStrategy)
    assert issubclass(FSDPStrategy, ProcessGroupStrategy)
    assert not issubclass(FSDPStrategy, DDPStrategy)
    ddp, fsdp = DDPStrategy("cpu", [0, 1]), FSDPStrategy("cpu", [0, 1])
    model = nn.Linear(2, 2)
    assert fsdp.wrap(model) is model and fsdp.sharded and not ddp.sharded


@pytest.mark.parametrize("kind", [DDPStrategy, FSDPStrategy])
def test_a_process_group_refuses_mps_naming_its_strategy(kind):
    with pytest.raises(ValueError, match=f"strategy='{kind.name}' does not run on MPS"):
        kind("mps", [0])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_predict_runs_on_one_device_under_either_strategy(strategy):
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, **QUIET)
    with pytest.raises(ValueError, match="predict runs on one device"):
        trainer.predict(nn.Linear(2, 2), [torch.zeros(1, 2)])


def test_ddp_settings_reach_the_strategy_and_bad_ones_are_refused():
    """Found by a review: DistributedDataParallel's find_unused_parameters could not be
    passed through the Trainer (the strategy builds the wrapper); ``DDP(...)`` carries it,
    as ``FSDP(...)`` carries FSDP's settings."""
    from mixprec.trainer import DDP

    trainer = Trainer(accelerator="cpu", devices=2, strategy=DDP(find_unused_parameters=True),
                      **QUIET)  # fmt: skip
    assert isinstance(trainer.strategy, DDPStrategy) and trainer.strategy.name == "ddp"
    assert trainer.strategy.settings.find_unused_parameters
    assert trainer.strategy.start_method == "spawn"
    forked = Trainer(accelerator="cpu", devices=2, strategy="ddp_fork", **QUIET).strategy
    assert forked.start_method == "fork" and not forked.settings.find_unused_parameters
    with pytest.raises(ValueError, match="find_unused_parameters"):
        DDP(find_unused_parameters="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start_method"):
        DDP(start_method="forkserver")


def test_a_loggers_version_is_set_through_its_public_property(tmp_path):
    logger = CSVLogger(tmp_path)
    logger.version = 7
    assert logger.version == 7 and logger.log_dir == tmp_path / "logs" / "version_7"


def test_a_process_is_seen_running_on_a_system_without_proc(monkeypatch):
    """A fork server's rank watches its launcher's pid (`_running`); on a POSIX system with
    no /proc (macOS) the missing file was read as "the launcher is gone", and every rank
    ended three seconds into its fit. Without /proc the process is asked for by signal 0."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from mixprec.trainer import strategy

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # (reaped: its pid names no process)
    assert strategy._running(os.getpid()) and not strategy._running(ended.pid)

    class NoProc(type(Path())):
        def __new__(cls, path, *rest):
            return super().__new__(cls, str(path).replace("/proc/", "/no-such-dir/", 1))

    monkeypatch.setattr(strategy, "Path", NoProc)
    assert strategy._running(os.getpid()) and not strategy._running(ended.pid)


def test_a_process_forked_after_the_server_started_spawns_its_own_launches():
    """A process forked from one that started the fork server (a forked rank, a fork
    pool's worker) inherits the record of the server but not the server: a launch there
    from the server failed in multiprocessing (waiting on a process not its child). It
    spawns instead."""
    import os

    from mixprec.trainer import strategy

    if strategy.fresh_start_method() != "forkserver":
        pytest.skip("the fork server here is not mixprec's, or this platform has none")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child writes its answer and ends without the parent's teardown)
        try:
            os.write(write, strategy.fresh_start_method().encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as answer:
        assert answer.read() == "spawn"
    assert strategy.fresh_start_method() == "forkserver"


def _nothing(rank: int) -> None:
    pass


def test_forking_ranks_leaves_a_callers_frozen_objects_frozen():
    """Forking ranks freezes what is alive (their collectors leave the launcher's objects
    alone) and thaws it after; a thaw thaws everything, so where the caller had frozen
    objects of their own, they stay frozen (with those frozen here)."""
    import gc

    from mixprec.trainer import strategy

    assert gc.get_freeze_count() == 0
    strategy.run_processes(_nothing, (), 1, "fork", grace=1.0)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        strategy.run_processes(_nothing, (), 1, "fork", grace=1.0)
        assert gc.get_freeze_count() >= mine > 0
    finally:
        gc.unfreeze()
