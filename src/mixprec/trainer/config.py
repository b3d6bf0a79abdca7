"""The Trainer's flags turned into checked settings and objects: `TrainerConfig` (read-only
loop settings), the precision a flag means on a device, the callback list, seeding and
determinism.

Every flag is validated when the Trainer is built, so a typo fails before any data is loaded
and the message says what is accepted.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import random
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from mixprec.activations import as_rules, check_device, wrapped
from mixprec.eager import compiled_wrapper
from mixprec.errors import caller_level
from mixprec.hardware import DeviceInfo, Support
from mixprec.optim.states import parse_state_format
from mixprec.policy.map import PolicyMap
from mixprec.precision import Precision
from mixprec.trainer.callbacks import (
    Callback,
    ModelCheckpoint,
    check_callback,
    keeps_state,
    state_key,
)
from mixprec.trainer.data import num_batches
from mixprec.trainer.module import TrainingModule, hooks_not_called
from mixprec.trainer.progress import RichProgressBar

if TYPE_CHECKING:
    from mixprec.trainer.trainer import Trainer

__all__ = [
    "TrainerConfig",
    "resolve_precision",
    "seed_everything",
]

log = logging.getLogger("mixprec")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int_or_none(name: str, value: Any) -> None:
    if value is not None and not (_is_int(value) and value >= 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")


def _fraction_or_count(name: str, value: Any) -> None:
    if value is None:
        return
    ok = (isinstance(value, float) and 0.0 <= value <= 1.0) or (_is_int(value) and value >= 0)
    if not ok:
        raise ValueError(
            f"{name} must be None, a fraction 0.0-1.0 of the batches, or a number of batches "
            f">= 0, got {value!r}"
        )


@dataclass(frozen=True)
class TrainerConfig:
    """When to stop, how to step, what to limit; see `Trainer` for each field's meaning.

    ``max_epochs`` and ``max_steps`` both None means 1000 epochs (as in Lightning).
    """

    max_epochs: int | None = None
    max_steps: int | None = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    val_check_interval: float | int = 1.0
    limit_train_batches: float | int | None = None
    limit_val_batches: float | int | None = None
    log_every_n_steps: int = 50
    seed: int | None = None
    deterministic: bool = False
    allow_slow_precision: bool = False
    default_root_dir: Path = Path(".")
    compile: bool | dict[str, Any] | None = None  # stored as torch.compile's kwargs, or None

    def __post_init__(self) -> None:
        _positive_int_or_none("max_epochs", self.max_epochs)
        _positive_int_or_none("max_steps", self.max_steps)
        if not (_is_int(self.accumulate_grad_batches) and self.accumulate_grad_batches >= 1):
            raise ValueError(
                "accumulate_grad_batches must be an int >= 1 (micro-batches per optimizer "
                f"step; 1 means no accumulation), got {self.accumulate_grad_batches!r}"
            )
        clip = self.gradient_clip_val
        if clip is not None and not (
            isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0
        ):
            raise ValueError(f"gradient_clip_val must be None or > 0, got {clip!r}")
        if self.gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(
                "gradient_clip_algorithm must be 'norm' or 'value', got "
                f"{self.gradient_clip_algorithm!r}"
            )
        interval = self.val_check_interval
        if not (
            (isinstance(interval, float) and 0.0 < interval <= 1.0)
            or (_is_int(interval) and interval >= 1)
        ):
            raise ValueError(
                "val_check_interval must be a fraction of an epoch in (0.0, 1.0] or a number "
                f"of training batches >= 1, got {interval!r}"
            )
        _fraction_or_count("limit_train_batches", self.limit_train_batches)
        if self.limit_train_batches == 0:
            raise ValueError(
                "limit_train_batches=0 leaves no batch to train on; to only validate, call "
                "Trainer.validate"
            )
        _fraction_or_count("limit_val_batches", self.limit_val_batches)
        if not (_is_int(self.log_every_n_steps) and self.log_every_n_steps >= 1):
            raise ValueError(
                "log_every_n_steps must be an int >= 1 (every how many optimizer steps the "
                f"training values are read back and logged), got {self.log_every_n_steps!r}"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        for name in ("deterministic", "allow_slow_precision"):
            if not isinstance(getattr(self, name), bool):  # ("yes" or 0 read as a choice)
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_epochs is None and self.max_steps is None:
            object.__setattr__(self, "max_epochs", 1000)
        object.__setattr__(self, "compile", compile_options(self.compile))
        object.__setattr__(self, "default_root_dir", Path(self.default_root_dir))


def _compile_keywords() -> list[str]:
    """The keyword arguments torch.compile takes besides the model (this torch's own)."""
    params = inspect.signature(torch.compile).parameters
    return [name for name in params if name != "model"]


def _no_op() -> None:
    """What `compile_options` hands torch.compile to check the arguments (never called)."""


def compile_options(value: Any) -> dict[str, Any] | None:
    """The torch.compile keyword arguments a Trainer's ``compile`` flag means: ``True`` is
    torch's defaults (``{}``), a dict is passed on as given, ``False``/``None`` is eager."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    accepted = _compile_keywords()
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in accepted)
        if unknown:
            raise ValueError(
                f"compile got {', '.join(map(repr, unknown))}, not a torch.compile argument; "
                f"accepted: {', '.join(accepted)}"
            )
        try:  # torch checks mode, backend and options when wrapping, not at the first step
            torch.compile(_no_op, **value)
        except Exception as err:  # noqa: BLE001 - torch raises RuntimeError, InvalidBackend...
            raise ValueError(f"compile={dict(value)!r}: {err}") from None
        return dict(value)
    raise ValueError(
        "compile must be True (torch.compile with its defaults), False, or a dict of "
        f"torch.compile keyword arguments ({', '.join(accepted)}), e.g. "
        f"compile={{'mode': 'max-autotune'}}; got {value!r}"
    )


def _under(name: str, paths: Mapping[str, Any]) -> bool:
    """Whether module `name` is one of `paths` or inside one."""
    return any(not p or name == p or name.startswith(p + ".") for p in paths)


def compile_model(model: nn.Module, options: dict[str, Any]) -> Callable[[], None]:
    """Compile ``model`` in place (``nn.Module.compile``: its ``__call__`` runs compiled, its
    parameters, state-dict keys and ``forward`` stay as they are, so checkpoints carry no
    ``_orig_mod.`` prefix); returns the function that hands it back as it was.

    Called once the model is converted and on its device, before any DDP wrapping: the
    compiled graph then traces mixprec's regions and casts with the final dtypes."""
    storing = {p: o for p, o in wrapped(model).items() if o in ("bf16", "fp8", "offload")}
    held = [n for n, m in model.named_modules() if any(True for _ in m.parameters(False))]
    if storing and all(_under(name, storing) for name in held):
        shown = ", ".join(f"{p or '<root>'}: {o!r}" for p, o in storing.items())
        warnings.warn(
            f"compile= with activations stored ({shown}) around every layer holding "
            "parameters: torch.compile's graphs run no saved-tensor hooks, so a module "
            "storing its activations runs eagerly, and here they hold all the model's "
            "layers: nothing of weight compiles. Give the option to some blocks so the rest "
            "compiles, or drop compile=",
            UserWarning,
            stacklevel=caller_level(),
        )
    before = model.__dict__.get("_compiled_call_impl")
    model.compile(**options)
    shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
    log.info("model %s compiled: torch.compile(%s)", type(model).__name__, shown)

    def undo() -> None:
        if before is None:
            model.__dict__.pop("_compiled_call_impl", None)
        else:
            model.__dict__["_compiled_call_impl"] = before

    return undo


def resolve_precision(
    precision: Any, info: DeviceInfo, allow_slow: bool = False
) -> tuple[PolicyMap, Support]:
    """The policy a ``precision`` flag means on the device ``info`` describes, and its support.

    ``"auto"`` picks the fastest stable precision for that device. Raises
    ``mixprec.PolicySpecError`` for an unknown spec, ``mixprec.PrecisionError`` when the
    device refuses the policy, ``mixprec.SlowPrecisionError`` when it runs far slower than
    float32 there and ``allow_slow`` is false. Never substitutes another precision.
    """
    chosen = Precision(precision, allow_slow=allow_slow, device_info=info)
    support = chosen.resolve()
    return chosen.policy, support


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's (if installed) and torch's generators (all devices)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


@contextlib.contextmanager
def determinism(enabled: bool) -> Iterator[None]:
    """Use deterministic algorithms inside the block when ``enabled``; restore after."""
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    # cuBLAS needs this before its first call to be deterministic
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]


def _check_given(precision: Precision, device: torch.device, allow_slow: bool) -> None:
    """Refuse a configured Precision whose settings contradict the Trainer's: the Trainer
    uses that object as it is and changes none of them."""
    if precision.device not in (None, device):
        raise ValueError(
            f"the Precision given was built for device {precision.device}, but this Trainer "
            f"runs on {device}; build it without device= (the Trainer sets it)"
        )
    described = precision.device_info
    if described is not None and described.type != device.type:
        raise ValueError(
            f"the Precision given describes its device as {described.describe()} "
            f"(device_info=), but this Trainer runs on {device}; describe a {device.type} "
            "device, or leave device_info out"
        )
    if allow_slow and not precision.allow_slow:
        raise ValueError(
            "allow_slow_precision=True, but the Precision given was built with "
            "allow_slow=False; the Trainer runs a configured Precision as it is: build it "
            "with allow_slow=True (the Trainer then allows slow precision too)"
        )


def choose_precision(
    precision: Any,
    device: torch.device,
    allow_slow: bool,
    optimizer_states: str | None = None,
    activations: Any = None,
) -> tuple[Precision, Support, str]:
    """The `Precision` a Trainer's ``precision`` flag means on ``device``, resolved there once
    (`Precision.resolve`: ``"auto"`` picked, the hardware checked), with its support and the
    description of the device judged; logged once (logger ``"mixprec"``).

    A configured `Precision` is used as it is, not copied: the runs go through that object
    (each begins with `Precision.reset`). A spec, Policy or PolicyMap becomes
    ``Precision(spec, allow_slow=allow_slow, optimizer_states=optimizer_states,
    activations=activations)``. Raises as `resolve_precision` does, and ``ValueError`` when a
    configured Precision contradicts the Trainer's device, ``allow_slow_precision``,
    ``optimizer_states`` or ``activations``.
    """
    if isinstance(precision, Precision):
        _check_given(precision, device, allow_slow)
        wanted = str(parse_state_format(optimizer_states)) if optimizer_states else None
        if wanted is not None and precision.optimizer_states != wanted:
            raise ValueError(
                f"optimizer_states={optimizer_states!r}, but the Precision given was built "
                f"with optimizer_states={precision.optimizer_states!r}; the Trainer runs a "
                "configured Precision as it is: set it there"
            )
        wanted_rules = as_rules(activations)
        # (the rules in force: given to the Precision, or carried by its policy map)
        held = precision.activations
        if held is None and precision._policy is not None:
            held = precision._policy.activations
        if wanted_rules is not None and held != wanted_rules:
            raise ValueError(
                f"activations={activations!r}, but the Precision given was built with "
                f"activations={held!r}; the Trainer runs a configured Precision as it is: "
                "set them there"
            )
    else:
        precision = Precision(
            precision,
            allow_slow=allow_slow,
            optimizer_states=optimizer_states,
            activations=activations,
        )
    support = precision.resolve(device)
    if precision.policy.activations is not None:
        check_device(precision.policy.activations.options, device.type)
    info = precision.resolved_for
    assert info is not None
    policy, scaler = precision.policy, precision.scaler
    scaling = f"loss scaler {scaler!r}" if scaler.enabled else "no loss scaling"
    description = info.describe()
    log.info(
        "precision %s on %s: %s (%s); %s",
        policy.name,
        description,
        support.status,
        support.reason,
        scaling,
    )
    return precision, support, description


def make_callbacks(callbacks: Any, progress: bool, checkpointing: bool) -> list[Callback]:
    """The run's callbacks: the given ones, plus the progress bar and a ModelCheckpoint
    when enabled and not given; the ModelCheckpoints last."""
    items = (
        []
        if callbacks is None
        else list(callbacks)
        if isinstance(callbacks, (list, tuple))
        else [callbacks]
    )
    for item in items:
        check_callback(item)
    if progress and not any(isinstance(c, RichProgressBar) for c in items):
        items.append(RichProgressBar())
    if checkpointing and not any(isinstance(c, ModelCheckpoint) for c in items):
        items.append(ModelCheckpoint())
    if not checkpointing and any(isinstance(c, ModelCheckpoint) for c in items):
        raise ValueError("enable_checkpointing=False but a ModelCheckpoint callback was given")
    # the checkpoints last, in their given order: each hook's checkpoint then holds the
    # states the other callbacks reached in that hook (an EarlyStopping after it counted an
    # epoch the checkpoint missed, and a resumed fit stopped an epoch later)
    items = [c for c in items if not isinstance(c, ModelCheckpoint)] + [
        c for c in items if isinstance(c, ModelCheckpoint)
    ]
    # a checkpoint keeps each callback's state under its key: two with one key would mix up
    keys: dict[str, Callback] = {}
    for cb in items:
        if not keeps_state(cb):
            continue
        key = state_key(cb)
        if key in keys:
            raise ValueError(
                f"two callbacks have the same state key {key!r} (a checkpoint could "
                "not tell their states apart); give them distinct settings (another dirpath, "
                "monitor...) or drop the duplicate"
            )
        keys[key] = cb
    return items


def _check_writable(directory: Path, what: str) -> None:
    """Raise now if ``directory`` cannot be created or written, rather than after an epoch."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(
            f"{what} {directory} cannot be created: {existing} is a file, not a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"{what} {directory} cannot be written: {existing} is read-only")


def check_one_loader(data: Any, argument: str) -> None:
    """Refuse several loaders given where the Trainer takes one (each would be taken for a
    batch)."""
    if isinstance(data, (list, tuple)) and any(isinstance(d, DataLoader) for d in data):
        raise ValueError(
            f"{argument} is a {type(data).__name__} holding DataLoaders; this Trainer takes one "
            "DataLoader (or any iterable of batches) there: pass one, e.g. with the datasets "
            "joined by torch.utils.data.ConcatDataset, or validate on each with "
            "trainer.validate(model, loader)"
        )


def check_fit_inputs(trainer: Trainer, model: Any, train: Any, val: Any) -> None:
    """What would otherwise fail only after the first epoch, or never end: no training data,
    several loaders for one, validation data the model cannot validate, fractions of data
    without len(), directories that cannot be written; and a warning for Lightning hooks the
    module defines that never run."""
    if train is None:
        raise ValueError(
            "fit needs training data: train_dataloaders is None (pass a DataLoader or any "
            "iterable of batches)"
        )
    check_one_loader(train, "train_dataloaders")
    check_one_loader(val, "val_dataloaders")
    if val is not None and trainer.config.limit_val_batches != 0:
        check_fractions(trainer.config, train, val)
    names = hooks_not_called(model) if isinstance(model, TrainingModule) else []
    if names:
        warnings.warn(
            f"{type(model).__name__} defines LightningModule hooks this Trainer never calls, so "
            f"their code will not run: {', '.join(names)} (it calls those of "
            "mixprec.trainer.Callback and TrainingModule)",
            stacklevel=3,
        )
    if (
        val is not None
        and trainer.config.limit_val_batches != 0
        and isinstance(model, TrainingModule)
        and type(model).validation_step is TrainingModule.validation_step
    ):
        raise ValueError(
            f"validation data was given but {type(model).__name__} defines no "
            "validation_step; define it, or leave val_dataloaders out"
        )
    for lg in trainer.loggers:
        what = "default_root_dir" if lg.save_dir == trainer.config.default_root_dir else "save_dir"
        _check_writable(lg.save_dir, f"{type(lg).__name__} {what}")
    for cb in trainer.callbacks:
        if isinstance(cb, ModelCheckpoint):
            if cb.dirpath is not None:
                _check_writable(cb.dirpath, "ModelCheckpoint dirpath")
            elif not trainer.loggers:  # it saves under <default_root_dir>/checkpoints
                _check_writable(trainer.config.default_root_dir, "default_root_dir")


def check_fractions(config: TrainerConfig, train: Any, val: Any) -> None:
    """Refuse before training a fraction of data without ``len()`` (a stream, an
    IterableDataset): ``limit_val_batches`` of such validation data would fail at the first
    validation, after a training epoch; ``val_check_interval`` of such training data would
    be ignored (an epoch's length is unknown), as Lightning refuses it too."""
    num_batches(val, config.limit_val_batches, "val")  # (raises for a fraction of no len())
    interval = config.val_check_interval
    if not isinstance(interval, float) or interval == 1.0:
        return
    if num_batches(train, config.limit_train_batches, "train") is None:
        raise ValueError(
            f"val_check_interval={interval} is a fraction of an epoch, but the training data "
            "has no len(), so an epoch's length is unknown: give a number of training batches "
            "(val_check_interval=100 validates every 100 batches), 1.0 (once the data runs "
            "out), or a number of batches as limit_train_batches"
        )


def check_model(model: Any, loss_fn: Any) -> None:
    """A model the Trainer can run: an nn.Module, with a loss_fn unless a TrainingModule."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if compiled_wrapper(model):
        raise TypeError(
            "model was compiled before mixprec converted it (torch.compile(model)), which "
            "also prefixes its checkpoint keys with '_orig_mod.'; pass the plain model and "
            "Trainer(compile=True) (or a dict of torch.compile arguments): it compiles after "
            "conversion"
        )
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise TypeError(
            f"model is wrapped in {type(model).__name__}: pass the plain model (model.module); "
            "the Trainer wraps it itself for the strategy it runs (strategy='ddp' or 'fsdp')"
        )
    if not isinstance(model, TrainingModule) and loss_fn is None:
        raise ValueError(
            f"{type(model).__name__} is a plain nn.Module: pass loss_fn=(output, target) -> "
            "loss to fit/validate/test, or subclass mixprec.TrainingModule"
        )
