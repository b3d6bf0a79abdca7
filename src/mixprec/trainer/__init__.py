"""The Trainer: a fit loop with a precision flag, callbacks, loggers, checkpoints, DDP and
FSDP."""

from mixprec.trainer.callbacks import Callback, EarlyStopping, ModelCheckpoint, RunEstimate
from mixprec.trainer.checkpoint import CheckpointError
from mixprec.trainer.config import TrainerConfig, resolve_precision, seed_everything
from mixprec.trainer.loggers import CSVLogger, Logger, TensorBoardLogger
from mixprec.trainer.loop import EmptyEpochError
from mixprec.trainer.module import TrainingModule
from mixprec.trainer.progress import RichProgressBar
from mixprec.trainer.strategy import FSDP
from mixprec.trainer.trainer import Trainer

__all__ = [
    "CSVLogger",
    "Callback",
    "CheckpointError",
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
