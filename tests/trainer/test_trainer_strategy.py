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


def test_a_loggers_version_is_set_through_its_public_property(tmp_path):
    logger = CSVLogger(tmp_path)
    logger.version = 7
    assert logger.version == 7 and logger.log_dir == tmp_path / "logs" / "version_7"
