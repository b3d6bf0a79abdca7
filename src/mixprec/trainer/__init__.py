"""The Trainer: a fit loop with a precision flag, callbacks, loggers, checkpoints, DDP and
FSDP.

- `trainer`: `Trainer`, its entry points (fit, validate, test, predict), process launching,
  and the set-up of a run: device, `Precision.setup` (or `sharding.shard` under FSDP, then
  the optimizers), the DDP wrap. The only module touching the Trainer's private state.
- `loop`: the run object (progress counters, metric stores, hook dispatch to the module then
  the callbacks) and the steps, through `mixprec.step` (one checked loss: `step.batch_loss`).
- `config`: the flags checked before anything runs (`TrainerConfig`, the precision string).
- `optimizers`: what `configure_optimizers` returned, in any form Lightning accepts, made
  uniform (optimizers and their schedulers' interval, frequency and monitored metric).
- `checkpoint`, `resume`, `sharded`: checkpoints written atomically (weights, optimizers,
  scaler, policy, step, RNG, loader generators), resumed bit for bit; DCP shards under FSDP.
- `strategy`: single device, DDP and FSDP over torch.distributed; `data`: batches on the
  device, sharded over processes, restartable mid-epoch; `interrupt`: Ctrl-C held back while
  a checkpoint is written.
- `callbacks`, `loggers`, `metrics`, `progress`, `module`: the hooks a user extends,
  CSV/TensorBoard logs, logged values, the progress bar and memory summary, `TrainingModule`.

No two trainer modules import each other at module level, annotations included
(`tests/test_package.py`).
"""

from mixprec.trainer.callbacks import Callback, EarlyStopping, ModelCheckpoint, RunEstimate
from mixprec.trainer.checkpoint import CheckpointError
from mixprec.trainer.config import TrainerConfig, resolve_precision, seed_everything
from mixprec.trainer.loggers import CSVLogger, Logger, TensorBoardLogger
from mixprec.trainer.loop import EmptyEpochError
from mixprec.trainer.module import TrainingModule
from mixprec.trainer.progress import RichProgressBar
from mixprec.trainer.strategy import DDP, FSDP
from mixprec.trainer.trainer import Trainer

__all__ = [
    "CSVLogger",
    "Callback",
    "CheckpointError",
    "DDP",
    "EarlyStopping",
    "EmptyEpochError",
    "FSDP",
    "Logger",
    "ModelCheckpoint",
    "RichProgressBar",
    "RunEstimate",
    "TensorBoardLogger",
    "Trainer",
    "TrainerConfig",
    "TrainingModule",
    "resolve_precision",
    "seed_everything",
]
