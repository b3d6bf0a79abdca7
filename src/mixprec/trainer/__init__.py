"""The Trainer: a fit loop with a precision flag, callbacks, loggers, checkpoints and DDP."""

from mixprec.trainer.callbacks import Callback, EarlyStopping, ModelCheckpoint
from mixprec.trainer.config import resolve_precision, seed_everything
from mixprec.trainer.loggers import CSVLogger, Logger, TensorBoardLogger
from mixprec.trainer.module import TrainingModule
from mixprec.trainer.progress import RichProgressBar
from mixprec.trainer.trainer import Trainer

__all__ = [
    "CSVLogger",
    "Callback",
    "EarlyStopping",
    "Logger",
    "ModelCheckpoint",
    "RichProgressBar",
    "TensorBoardLogger",
    "Trainer",
    "TrainingModule",
    "resolve_precision",
    "seed_everything",
]
