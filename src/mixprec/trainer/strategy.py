"""Where training runs: one device, or one process per device with DistributedDataParallel
(every process holds the whole model) or FSDP2 (parameters, gradients and optimizer state
sharded across the processes: ``FSDPStrategy``, `mixprec.sharding.shard`). `Strategy` is
what the Trainer and its loops ask of each; none of them knows the Trainer.

``DDPStrategy`` works in two ways. Launched by ``torchrun`` (the environment holds ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), each process joins the
group the launcher described; this is also how training spans several machines. Started from
a plain ``python`` process, the Trainer launches the processes itself on this machine
(``torch.multiprocessing``: fresh processes by default, "fork" with ``strategy="ddp_fork"``);
each child then sees the same environment variables a torchrun child would and takes the
first path. The backend is gloo on CPU and nccl on CUDA. ``FSDPStrategy`` launches the same
way. Fresh processes are forked from a server process that imported torch and mixprec once
(multiprocessing's "forkserver", Python 3.14's default on Linux: a launch costs a fork, not
an interpreter importing torch, seconds a rank), each taking the launcher's environment;
where that cannot hold (no forkserver on the platform, a server started by other code, or
a variable read on import changed since the server started) they are spawned.
"""

from __future__ import annotations

import abc
import contextlib
import gc
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import re
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.multiprocessing.spawn import ProcessException
from torch.nn.parallel import DistributedDataParallel

from mixprec.errors import PrecisionError
from mixprec.optim import check_sharded_masters
from mixprec.precision import Precision
from mixprec.trainer.data import distributed
from mixprec.trainer.interrupt import ctrl_c_deferred
from mixprec.trainer.loggers import Logger

T = TypeVar("T")

__all__ = [
    "DDP",
    "FSDP",
    "end_finished_process",
    "free_port",
    "fresh_start_method",
    "run_processes",
]

ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps")
STRATEGIES = ("auto", "single_device", "ddp", "ddp_fork", "fsdp")
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """Whether this process is one of a group described by torchrun-style env variables."""
    return all(k in os.environ for k in _LAUNCH_ENV)


def resolve_accelerator(accelerator: str) -> str:
    """ "cpu", "cuda" or "mps" for an ``accelerator`` flag; raise if it is unknown or absent."""
    if not isinstance(accelerator, str) or accelerator.lower() not in ACCELERATORS:
        raise ValueError(
            f"unknown accelerator {accelerator!r}; accepted: {', '.join(map(repr, ACCELERATORS))}"
        )
    name = accelerator.lower()
    mps = getattr(torch.backends, "mps", None)
    has_mps = bool(mps and mps.is_available())
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if has_mps else "cpu"
    if name in ("cuda", "gpu"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"accelerator={accelerator!r} but CUDA is not available here (torch "
                f"{torch.__version__}); use accelerator='cpu' or 'auto'"
            )
        return "cuda"
    if name == "mps" and not has_mps:
        raise ValueError("accelerator='mps' but MPS is not available here; use 'cpu' or 'auto'")
    return name


def resolve_devices(accelerator: str, devices: int | str | list[int]) -> list[int]:
    """Device indices (CUDA) or process slots (CPU) from a ``devices`` flag."""
    if devices == "auto":
        return list(range(torch.cuda.device_count())) if accelerator == "cuda" else [0]
    if isinstance(devices, bool) or not isinstance(devices, (int, list, tuple)):
        raise ValueError(
            f"devices must be a positive int, a list of GPU indices or 'auto', got {devices!r}"
        )
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices must be at least 1, got {devices}")
        ids = list(range(devices))
    else:
        ids = list(devices)
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"devices as a list must hold GPU indices >= 0, got {devices!r}")
        if accelerator != "cuda":
            raise ValueError(
                f"a list of device indices ({devices!r}) needs accelerator='cuda'; "
                f"on {accelerator} pass the number of processes"
            )
    if accelerator == "cuda" and max(ids) >= torch.cuda.device_count():
        raise ValueError(
            f"devices={devices!r} asks for GPU {max(ids)}, but {torch.cuda.device_count()} "
            "are visible"
        )
    if accelerator == "mps" and len(ids) > 1:
        raise ValueError("MPS has one device; use devices=1")
    return ids


@dataclass(frozen=True)
class FSDP:
    """Settings of ``Trainer(strategy=FSDP(...))``; ``strategy="fsdp"`` is ``FSDP()``.

    Args:
        wrap: ``(name, module) -> bool``, the modules sharded as units of their own (default:
            the blocks of top-level ModuleLists/Sequentials; float32 islands always are).
            A module-level function: spawned processes unpickle it.
        reduce_dtype: the dtype gradients are reduce-scattered in (None, the default:
            float32, or the parameters' dtype where wider, float64 under ``64-true``;
            float16 only under a loss-scaling precision, ``16-mixed``).
        sync_micro_batches: with ``accumulate_grad_batches > 1``, False (default) keeps each
            window's gradients unsharded and its parameters gathered between micro-batches
            (no communication until the window's last backward, like DDP's ``no_sync``; one
            unsharded copy of the parameters and gradients during the window); True
            reduce-scatters and reshards after every micro-batch (least memory, most traffic).
    """

    wrap: Callable[[str, nn.Module], bool] | None = None
    reduce_dtype: torch.dtype | None = None
    sync_micro_batches: bool = False

    def __post_init__(self) -> None:
        if self.wrap is not None and not callable(self.wrap):
            raise ValueError(f"FSDP(wrap=...) must be (name, module) -> bool, got {self.wrap!r}")
        floats = (None, torch.float32, torch.bfloat16, torch.float16, torch.float64)
        if self.reduce_dtype not in floats:
            raise ValueError(
                f"FSDP(reduce_dtype=...) must be None or a float dtype, got {self.reduce_dtype!r}"
            )
        if not isinstance(self.sync_micro_batches, bool):
            raise ValueError(
                "FSDP(sync_micro_batches=...) must be True or False, got "
                f"{self.sync_micro_batches!r}"
            )


@dataclass(frozen=True)
class DDP:
    """Settings of ``Trainer(strategy=DDP(...))``; ``strategy="ddp"`` is ``DDP()``,
    ``strategy="ddp_fork"`` is ``DDP(start_method="fork")``.

    Args:
        find_unused_parameters: True when some parameters get no gradient in a step (a
            pooler or a branch the loss does not use): DistributedDataParallel then marks
            them ready after each forward (one walk of the autograd graph a step), where it
            would otherwise wait for their gradients and fail at the next step ("Expected to
            have finished reduction in the prior iteration").
        start_method: how the Trainer starts the processes it launches: "spawn" (default:
            fresh processes, forked from a server where it can) or "fork" (Linux, CPU).
    """

    find_unused_parameters: bool = False
    start_method: str = "spawn"

    def __post_init__(self) -> None:
        if not isinstance(self.find_unused_parameters, bool):
            raise ValueError(
                "DDP(find_unused_parameters=...) must be True or False, got "
                f"{self.find_unused_parameters!r}"
            )
        if self.start_method not in ("spawn", "fork"):
            raise ValueError(
                f"DDP(start_method=...) must be 'spawn' or 'fork', got {self.start_method!r}"
            )


def make_strategy(
    accelerator: str, devices: int | str | list[int], strategy: str | FSDP | DDP
) -> Strategy:
    """The strategy object for the Trainer's ``accelerator``, ``devices`` and ``strategy``."""
    settings = strategy if isinstance(strategy, FSDP) else FSDP()
    ddp = strategy if isinstance(strategy, DDP) else None
    if isinstance(strategy, FSDP):
        strategy = "fsdp"
    elif isinstance(strategy, DDP):
        strategy = "ddp_fork" if strategy.start_method == "fork" else "ddp"
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(
            f"unknown strategy {strategy!r}; accepted: {', '.join(map(repr, STRATEGIES))} "
            "or an FSDP(...) or DDP(...) object"
        )
    accel = resolve_accelerator(accelerator)
    ids = resolve_devices(accel, devices)
    if strategy == "single_device" and len(ids) > 1:
        raise ValueError(f"strategy='single_device' needs devices=1, got {devices!r}")
    if strategy == "auto":
        strategy = "ddp" if len(ids) > 1 else "single_device"
    if strategy == "single_device":
        device = torch.device("cuda", ids[0]) if accel == "cuda" else torch.device(accel)
        return SingleDeviceStrategy(device)
    if strategy == "fsdp":
        return FSDPStrategy(accel, ids, settings)
    if ddp is None:
        ddp = DDP(start_method="fork" if strategy == "ddp_fork" else "spawn")
    return DDPStrategy(accel, ids, ddp)


class Strategy(abc.ABC):
    """Where a run trains and how its processes work together: what the Trainer and its
    loops ask of `SingleDeviceStrategy`, `DDPStrategy` and `FSDPStrategy`. The methods
    with a body here are what a strategy keeping whole models in every process does."""

    name: str
    launches_processes = False  # whether this process must start the others
    sharded = False  # whether each process holds only a shard of the model

    def __init__(self, device: torch.device) -> None:
        self.device = device  # this process's
        self.world_size = 1
        self.global_rank = 0
        self.local_rank = 0

    @property
    def is_global_zero(self) -> bool:
        """Whether this process logs, shows progress and writes checkpoints."""
        return self.global_rank == 0

    @abc.abstractmethod
    def setup(self, stage: str = "fit") -> None:
        """Join the process group, if any, and pin this process's device, for ``stage``
        (fit, validate, test, predict)."""

    @abc.abstractmethod
    def teardown(self, failed: bool = False) -> None:
        """Leave the process group if this strategy created it; after a failure
        (``failed``) without waiting for the other processes."""

    @abc.abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """The module that training steps run through."""

    @abc.abstractmethod
    def no_sync(self, wrapped: nn.Module, sync: bool) -> AbstractContextManager[Any]:
        """A context for one micro-batch; gradients are all-reduced only when ``sync``."""

    @abc.abstractmethod
    def prepare_loader(
        self, loader: Iterable[Any], seed: int, *, evaluation: bool = False
    ) -> Iterable[Any]:
        """``loader`` as this process should iterate it (``evaluation``: a validation or test
        loader, whose metrics a padded shard would skew)."""

    @abc.abstractmethod
    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Average ``values`` over processes."""

    @abc.abstractmethod
    def any(self, flag: bool) -> bool:
        """True if ``flag`` is true in any process."""

    @abc.abstractmethod
    def union(self, names: list[str]) -> list[str]:
        """The sorted union of ``names`` over processes (what each logged may differ)."""

    @abc.abstractmethod
    def agree_on_version(self, loggers: list[Logger]) -> None:
        """Make every process's loggers write to rank 0's run directory."""

    def broadcast(self, value: T) -> T:
        """Rank 0's ``value`` (picklable) on every process: what all must name alike, such
        as a checkpoint's path (a collective: every process calls it)."""
        return value

    def gather(self, value: T) -> list[T]:
        """Every process's ``value`` (picklable, on the CPU), in rank order, on every
        process (a collective: every process calls it)."""
        return [value]

    def shard(self, model: nn.Module, precision: Precision) -> bool:
        """Shard ``model`` in place under ``precision``'s policy; False when this strategy
        keeps whole models (the precision then converts the model itself)."""
        return False

    def check_optimizers(  # noqa: B027 (whole models: any optimizer of theirs trains them)
        self, model: nn.Module, optimizers: list[Any]
    ) -> None:
        """Raise if the optimizers cannot train ``model`` as this strategy set it up."""

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's whole state on the CPU in this process (a collective where sharded:
        every process calls it, rank 0 gets the tensors)."""
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _group_size() -> int:
    """How many processes this one runs beside: its process group's size, or where it has
    none yet, the ``WORLD_SIZE`` a launcher (torchrun) gave it."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


class SingleDeviceStrategy(Strategy):
    """Everything in this process on one device."""

    name = "single_device"

    def setup(self, stage: str = "fit") -> None:
        """No group to join; a fit refused inside one of several processes (torchrun's, or
        a group initialised by hand), where each would train the same run alone and write
        the same checkpoints, and the loss scale's overflow flag, float8's amaxes and the
        rounding seed would wait on collectives the others never join (an evaluation or a
        prediction on one process, as after a DDP fit, runs)."""
        size = _group_size()
        if size > 1 and stage == "fit":
            raise ValueError(
                f"this process is one of {size} in a process group (torchrun, or "
                "dist.init_process_group), but the Trainer runs on one device alone "
                f"(strategy={self.name!r}): each process would train the same run and write "
                "the same checkpoints, and mixprec's collectives would wait on the others. "
                "Train across them with strategy='ddp' or 'fsdp' and devices=<processes per "
                "machine>, or start a single process"
            )

    def teardown(self, failed: bool = False) -> None:
        pass

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def no_sync(self, wrapped: nn.Module, sync: bool) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def prepare_loader(
        self, loader: Iterable[Any], seed: int, *, evaluation: bool = False
    ) -> Iterable[Any]:
        return loader

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def any(self, flag: bool) -> bool:
        return flag

    def union(self, names: list[str]) -> list[str]:
        return sorted(names)

    def agree_on_version(self, loggers: list[Logger]) -> None:
        pass  # one process, one directory


class ProcessGroupStrategy(Strategy):
    """One process per device in a process group, launched here or by torchrun: what DDP
    and FSDP share (joining and leaving the group, launching, loaders, reductions, the run
    directory); each says how a model trains across the processes."""

    def __init__(self, accelerator: str, device_ids: list[int], start_method: str = "spawn"):
        if accelerator == "mps":
            raise ValueError(
                f"strategy={self.name!r} does not run on MPS; use accelerator='cpu' or 'cuda'"
            )
        self.accelerator = accelerator
        self.device_ids = device_ids
        self.start_method = start_method
        self.backend = "nccl" if accelerator == "cuda" else "gloo"
        first = (
            torch.device("cuda", device_ids[0]) if accelerator == "cuda" else torch.device("cpu")
        )
        super().__init__(first)
        self._owns_group = False

    @property
    def launches_processes(self) -> bool:  # type: ignore[override]
        """True when this process must start the others: not launched by torchrun, nor
        already in a process group (one a script initialised itself, as under srun)."""
        return not (launched_by_torchrun() or (dist.is_available() and dist.is_initialized()))

    def setup(self, stage: str = "fit") -> None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", len(self.device_ids)))
        if local_world != len(self.device_ids):
            raise ValueError(
                f"Trainer(devices={len(self.device_ids)}) but the launcher started {local_world} "
                "processes on this machine; make them match (torchrun --nproc-per-node)"
            )
        if not dist.is_initialized():
            dist.init_process_group(self.backend, init_method="env://")
            self._owns_group = True
        self.world_size = dist.get_world_size()
        self.global_rank = dist.get_rank()
        self.local_rank = self._local_rank()
        if self.accelerator == "cuda":
            self.device = torch.device("cuda", self.device_ids[self.local_rank])
            torch.cuda.set_device(self.device)

    def _local_rank(self) -> int:
        """This process's index among this machine's: the launcher's ``LOCAL_RANK``; in a
        group initialised without it, the rank, where the group is this machine's alone."""
        if "LOCAL_RANK" in os.environ:
            return int(os.environ["LOCAL_RANK"])
        if self.world_size == len(self.device_ids):
            return self.global_rank
        raise ValueError(
            f"this process group has {self.world_size} processes but Trainer(devices="
            f"{len(self.device_ids)}) and no LOCAL_RANK says which device is this process's; "
            "set LOCAL_RANK (and LOCAL_WORLD_SIZE) as torchrun does"
        )

    def no_sync(self, wrapped: nn.Module, sync: bool) -> AbstractContextManager[Any]:
        return contextlib.nullcontext() if sync else wrapped.no_sync()  # type: ignore[operator]

    def prepare_loader(
        self, loader: Iterable[Any], seed: int, *, evaluation: bool = False
    ) -> Iterable[Any]:
        return distributed(loader, self.global_rank, self.world_size, seed, evaluation=evaluation)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        out = values.detach().to(self.device, torch.float64).clone()
        dist.all_reduce(out)
        return out / self.world_size

    def any(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def union(self, names: list[str]) -> list[str]:
        gathered: list[list[str] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, names)
        return sorted({n for ranks in gathered for n in ranks or []})

    def broadcast(self, value: T) -> T:
        if self.world_size == 1:
            return value
        held = [value]
        dist.broadcast_object_list(held, src=0)
        return held[0]

    def gather(self, value: T) -> list[T]:
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def agree_on_version(self, loggers: list[Logger]) -> None:
        if self.world_size > 1 and loggers:
            # only rank 0 chooses (choosing creates the directory)
            versions = [loggers[0].version if self.global_rank == 0 else None]
            dist.broadcast_object_list(versions, src=0)
            for lg in loggers:
                lg.version = versions[0]

    def teardown(self, failed: bool = False) -> None:
        # After a clean run every rank arrives before the group goes away, so none tears it
        # down while another still talks to it. After a failure the others may be waiting in
        # a collective this rank will never join: a barrier would wait with them until the
        # backend's timeout (30 minutes), hiding the error. Leave at once instead: the peers'
        # pending collectives fail, or the launcher stops them when this process exits.
        if self._owns_group and dist.is_initialized():
            if not failed:
                dist.barrier()
            dist.destroy_process_group()
        self._owns_group = False

    def launch(self, function: Callable[..., Any], *args: Any) -> Any:
        """Run ``function(*args)`` in ``len(device_ids)`` new processes on this machine;
        return what rank 0 returned. Raises what a child raised."""
        nprocs = len(self.device_ids)
        if self.start_method == "fork":
            if torch.cuda.is_initialized():
                raise RuntimeError(
                    "strategy='ddp_fork' cannot fork after CUDA was initialized in this process; "
                    "use strategy='ddp' (spawn) or torchrun"
                )
            payload: Any = (function, args)
        else:
            try:
                payload = pickle.dumps((function, args))
            except (pickle.PicklingError, AttributeError, TypeError) as err:
                raise TypeError(
                    f"strategy='ddp' starts {nprocs} fresh processes (forkserver or spawn), so the "
                    "model, data, "
                    f"loss_fn, optimizer and callbacks must be picklable: {err}. Define them at "
                    "module level (not lambdas or local classes), launch with torchrun, or use "
                    "strategy='ddp_fork' (Linux, CPU)"
                ) from None
        threads = max(1, (os.cpu_count() or 1) // nprocs) if self.accelerator == "cpu" else 0
        if self.start_method == "fork":
            # OpenMP's threads do not survive a fork: a forked rank entering a parallel region
            # on more than one thread, after this process had run one, waited for them for
            # ever (torch's own ops too: its DataLoader's forked workers take one thread)
            threads = 1
        with tempfile.TemporaryDirectory(prefix="mixprec-ddp-") as tmp:
            try:
                # when one process fails, torch stops the others (SIGTERM, then SIGKILL)
                method = self.start_method
                if method == "spawn":
                    method = fresh_start_method()
                # (a process forked from the fork server has the server's environment: it
                # takes the launcher's; forked or spawned ones have it already)
                env = dict(os.environ) if method == "forkserver" else None
                run_processes(
                    _child,
                    (payload, nprocs, free_port(), tmp, threads, env),
                    nprocs,
                    method,
                    grace=CTRL_C_GRACE_S,
                )
            except ProcessException as err:
                raise _first_failure(Path(tmp), nprocs, err) from None
            # written by our own rank-0 child a moment ago: a trusted pickle
            return torch.load(Path(tmp) / "rank0.pt", weights_only=False)


class DDPStrategy(ProcessGroupStrategy):
    """One process per device; gradients all-reduced by DistributedDataParallel, under the
    ``DDP(...)`` settings."""

    name = "ddp"

    def __init__(self, accelerator: str, device_ids: list[int], settings: DDP | None = None):
        self.settings = settings or DDP()
        super().__init__(accelerator, device_ids, start_method=self.settings.start_method)

    def wrap(self, model: nn.Module) -> nn.Module:
        ids = [self.device.index] if self.device.type == "cuda" else None
        return _DistributedDataParallel(
            model, device_ids=ids, find_unused_parameters=self.settings.find_unused_parameters
        )


# the start of torch's reducer error when a step's loss left parameters without gradients
_REDUCER_WAITED = "Expected to have finished reduction in the prior iteration"


class _DistributedDataParallel(DistributedDataParallel):
    """DistributedDataParallel whose forward says how to pass ``find_unused_parameters``
    through the Trainer when torch's reducer asks for it (torch's own advice names an
    argument of the wrapper, which the Trainer builds)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as err:
            said = str(err)
            if self.find_unused_parameters or _REDUCER_WAITED not in said:
                raise
            raise RuntimeError(
                "DDP waited for gradients of parameters the last step's loss did not use (a "
                "pooler, an unused branch"
                + _unused_names(self.module, said)
                + "): pass Trainer(strategy=DDP(find_unused_parameters=True)) (from "
                "mixprec.trainer import DDP), or make every parameter take part in the loss. "
                f"torch said: {said}"
            ) from err


def _unused_names(module: nn.Module, said: str) -> str:
    """The names of the parameters torch's reducer error lists by index (its indices count
    the parameters that require gradients, in the module's order), as ``": a, b"``; empty
    where it lists none."""
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", said)
    if found is None:
        return ""
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    picked = [names[int(i)] for i in found.group(1).split() if int(i) < len(names)]
    return f": {', '.join(picked)}" if picked else ""


class FSDPStrategy(ProcessGroupStrategy):
    """One process per device, launched as for DDP; parameters, gradients and optimizer
    state sharded by FSDP2 under the run's policy (`mixprec.sharding.shard`): float32 sharded
    masters for ``*-mixed`` policies, float32 islands as float32 units, quantized layers for
    quantized rules. Optimizers are built after sharding; checkpoints are sharded
    (`mixprec.trainer.sharded`)."""

    name = "fsdp"
    sharded = True

    def __init__(self, accelerator: str, device_ids: list[int], settings: FSDP | None = None):
        super().__init__(accelerator, device_ids)
        self.settings = settings or FSDP()

    def shard(self, model: nn.Module, precision: Precision) -> bool:
        from torch.distributed.fsdp import FSDPModule

        from mixprec.sharding import shard

        sharded_as = (precision.policy.to_config(), self.settings)
        if isinstance(model, FSDPModule):  # by an earlier fit/validate in this process
            if model.__dict__.get("_mixprec_sharded_as") != sharded_as:
                raise PrecisionError(
                    f"this {type(model).__name__} is already sharded, under other settings "
                    "than this run's (precision or FSDP(...)); FSDP shards a module once: "
                    "build a new model, or use the same Trainer settings"
                )
            _reset_sharded(model)
            return True
        check_sharded_masters(
            {r.policy.param_dtype for r in precision.policy.resolve(model).values()},
            master_weights=precision.master_weights,
            compensation=precision.compensation,
            setup=f"strategy='fsdp' with precision {precision.policy.name!r}",
        )
        shard(
            model,
            precision.policy,
            wrap=self.settings.wrap,
            scaler=precision.scaler,
            reduce_dtype=self.settings.reduce_dtype,
            master_weights=precision.master_weights,
            allow_slow=precision.allow_slow,
        )
        model.__dict__["_mixprec_sharded_as"] = sharded_as
        return True

    def check_optimizers(self, model: nn.Module, optimizers: list[Any]) -> None:
        mine = {id(p) for p in model.parameters()}
        for opt in optimizers:
            if any(id(p) not in mine for g in opt.param_groups for p in g["params"]):
                raise PrecisionError(
                    f"this {type(opt).__name__} holds parameters the sharded model does not "
                    "have: it was built before sharding (FSDP replaces the parameters), so it "
                    "would never train the model. Build it from self.parameters() inside "
                    "configure_optimizers, or pass a factory: "
                    "fit(..., optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))"
                )

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model  # FSDP's hooks sit on the sharded model's units

    def no_sync(self, wrapped: nn.Module, sync: bool) -> AbstractContextManager[Any]:
        from torch.distributed.fsdp import FSDPModule

        root = getattr(wrapped, "module", wrapped)
        if self.settings.sync_micro_batches or not isinstance(root, FSDPModule):
            return contextlib.nullcontext()
        return _fsdp_window(root, sync)


@contextlib.contextmanager
def _fsdp_window(root: nn.Module, sync: bool) -> Iterator[None]:
    """One micro-batch of an accumulation window under FSDP2: outside the window's last, no
    reduce-scatter and no reshard after backward. The flags are FSDP2's defaults again on
    leaving, however it is left: a step that raised left them off, and a later run on the
    model (a refit) then never reduced its gradients, so never trained."""
    root.set_requires_gradient_sync(sync)  # type: ignore[operator]
    root.set_reshard_after_backward(sync)  # type: ignore[operator]
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)  # type: ignore[operator]
        root.set_reshard_after_backward(True)  # type: ignore[operator]


def _reset_sharded(model: nn.Module) -> None:
    """A model sharded by an earlier run, made as a fresh one for the next: FSDP2's gradient
    sync and reshard flags at their defaults, the state of an iteration that raised (mid
    forward or backward) dropped, and the unsharded gradients FSDP2 accumulates between a
    window's micro-batches cleared (an optimizer's zero_grad does not reach them: a run that
    raised inside a window left them, and the next run's first step added them to its own)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        # (each root an iteration ran from: the model, or a child a training_step called
        # directly; FSDP2 sets a root on its first forward, and resetting one it never set
        # up fails; torch >= 2.12: waits, reshards)
        reset = getattr(module, "reset_iter_state", None)
        root = getattr(getattr(module, "_get_fsdp_state", lambda: None)(), "_is_root", None)
        if callable(reset) and root is True:
            reset()
        module.set_requires_gradient_sync(True, recurse=False)
        module.set_reshard_after_backward(True, recurse=False)
        # (FSDP2's private state, read with defaults: gone in another torch, nothing to clear)
        state = getattr(module, "_get_fsdp_state", lambda: None)()
        for group in getattr(state, "_fsdp_param_groups", ()):
            for param in getattr(group, "fsdp_params", ()):
                if getattr(param, "unsharded_accumulated_grad", None) is not None:
                    param.unsharded_accumulated_grad = None
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


# what a fork server started here imports once for every process it forks
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "mixprec", "mixprec.trainer")
# the environment variables a process forked from the server may have read before the
# launch: what the server's interpreter, torch, its libraries (OpenMP, oneDNN, BLAS) and
# mixprec read when they load or import (every other variable is read in the rank, after it
# takes the launcher's environment: CUDA's, a process group's, cuBLAS's workspace)
_READ_ON_IMPORT = (
    "ATEN_", "ONEDNN_", "DNNL_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH",
    "PYTORCH_", "MIXPREC_", "PYTHON", "LD_",
)  # fmt: skip
# of those, ones written into the environment as a program runs and read when used: inductor's
# cache folder (torch writes it on first use), the NVML check of CUDA's presence (transformers'
# Trainer writes it)
_NOT_READ_ON_IMPORT = frozenset({"TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK"})
# the environment the fork server this process started was started in (empty: none started)
_SERVER_ENV: list[dict[str, str]] = []
# the process that started it: a process forked from this one inherits the server's record
# but not the server, which only the process that started it can use
_SERVER_OWNER: list[int] = []


def fresh_start_method() -> str:
    """How fresh processes start: "forkserver" where multiprocessing's fork server is this
    process's own (started here, or to be started now, importing `FORKSERVER_PRELOAD`) and
    was started with the variables read on import (`_READ_ON_IMPORT`) as they are now, else
    "spawn". A server started by other code, or under other such variables, imported torch
    and mixprec under settings (``ATEN_CPU_CAPABILITY``, thread counts) that may not be the
    launch's."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(_READ_ON_IMPORT) and k not in _NOT_READ_ON_IMPORT
    }
    server = multiprocessing.forkserver._forkserver
    # (private attributes, read with a default: where they are missing, spawn)
    running = getattr(server, "_forkserver_pid", 1) is not None
    if _SERVER_OWNER and _SERVER_OWNER[0] != os.getpid():  # (a forked copy: not ours)
        return "spawn"
    if not _SERVER_ENV:
        if running:  # (someone else's, or attributes this Python lacks)
            return "spawn"
        preload = list(getattr(server, "_preload_modules", []))
        multiprocessing.set_forkserver_preload(
            [*preload, *(m for m in FORKSERVER_PRELOAD if m not in preload)]
        )
        _SERVER_ENV.append(env)
        _SERVER_OWNER.append(os.getpid())
        return "forkserver"
    if not running:  # (ended: the next launch starts it again, in this environment)
        _SERVER_ENV[0] = env
    return "forkserver" if _SERVER_ENV[0] == env else "spawn"


def free_port() -> int:
    """A TCP port free on this host now, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# seconds a launched process has, once its launcher is gone, to end by itself before it is ended
LAUNCHER_GONE_GRACE_S = 3.0
# seconds the Trainer's launched processes have, after a Ctrl-C reached their launcher, to end
# by themselves (a rank finishes the checkpoint it was writing) before they are terminated
CTRL_C_GRACE_S = 30.0
# seconds a terminated (SIGTERM) process has to end before it is killed (SIGKILL)
_TERMINATE_GRACE_S = 3.0


def run_processes(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    nprocs: int,
    start_method: str,
    grace: float,
) -> None:
    """Run ``function(rank, *args)`` in `nprocs` new processes and wait for them, as torch's
    ``start_processes`` does (a failing process stops the others; `ProcessException`).

    A Ctrl-C in this process ends every launched one before its ``KeyboardInterrupt`` goes
    on: they have `grace` seconds to end by themselves (a terminal's Ctrl-C reached them
    too), then SIGTERM, then SIGKILL. Without it this process, leaving the join, waited at
    exit for any rank that did not end: one blocked where Python's signal handler never runs
    (connecting to the store of a rank the Ctrl-C ended: torch retries through the signal)
    held it for torch's 30-minute store timeout. A Ctrl-C while the processes start is held
    until they are all started, so none is left behind."""
    context = None
    try:
        with ctrl_c_deferred(), _frozen_for_fork(start_method == "fork"):
            context = mp.start_processes(
                function, args=args, nprocs=nprocs, start_method=start_method, join=False
            )
        while not context.join():
            pass
    except KeyboardInterrupt:
        if context is not None:
            _stop(context.processes, grace)
        raise


@contextlib.contextmanager
def _frozen_for_fork(fork: bool) -> Iterator[None]:
    """Around forking processes: garbage this process holds is freed first, where its
    threads run (a forked process collecting it, a process group dropped in a cycle whose
    destructor joins its threads, joined threads it does not have and died: SIGSEGV), and what
    is alive at the fork is frozen, so that a forked process's collector leaves it alone; it
    is thawed after, unless the caller had frozen objects itself (a thaw would take theirs
    too, so the objects frozen here stay frozen with them)."""
    if not fork:
        yield
        return
    thaw = gc.get_freeze_count() == 0
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if thaw:
            gc.unfreeze()


def _stop(processes: list[Any], grace: float) -> None:
    """End `processes`: up to `grace` seconds to end by themselves (a second Ctrl-C cuts it
    short), then SIGTERM, then SIGKILL for any still alive after `_TERMINATE_GRACE_S`."""
    deadline = time.monotonic() + grace
    try:
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        pass
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _end_with_launcher(rank: int) -> None:
    """End this launched process when the process that launched it dies (killed, out of
    memory): it would otherwise train on, with no one to report to, holding its memory and
    GPU. torch has Linux send it SIGINT then (a KeyboardInterrupt: logs flushed, the process
    group left); where that never comes (the launcher ran in the background of a shell
    script, which ignores SIGINT, or this is not Linux) or does not end it, a watcher thread
    ends it `LAUNCHER_GONE_GRACE_S` seconds later. On POSIX the thread watches this process's
    parent id, which changes when the launcher dies: the launcher's sentinel pipe stays open
    while a sibling forked after this rank (``ddp_fork``) holds a copy of its write end, so
    that rank 0 learnt of the death only after rank 1 had ended. A process forked by the fork
    server has the server for parent: it watches the launcher's process id itself. Elsewhere
    it waits on the sentinel (a process handle on Windows)."""
    launcher = multiprocessing.parent_process()
    if launcher is None:  # not started by multiprocessing
        return
    own_child = os.getppid() == launcher.pid

    def watch() -> None:
        if os.name == "posix":
            while os.getppid() == launcher.pid if own_child else _running(launcher.pid):
                time.sleep(0.25)
        else:
            launcher.join()  # returns once the launcher has exited
        print(
            f"mixprec: the process that launched DDP rank {rank} (pid {launcher.pid}) is gone; "
            "this rank ends",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(LAUNCHER_GONE_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="mixprec-launcher-watch", daemon=True).start()


def _running(pid: int) -> bool:
    """Whether the process `pid` runs: it exists and has not ended (a zombie, ended but not
    yet reaped by its parent, has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if Path("/proc/self/stat").exists():  # (a /proc without the process: gone)
            return False
        try:  # (no /proc, as on macOS: whether the process exists, ours to signal or not)
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _child(
    rank: int,
    payload: Any,
    nprocs: int,
    port: int,
    tmp: str,
    threads: int,
    env: dict[str, str] | None,
) -> None:
    if env is not None:  # (forked from the fork server: the launcher's environment)
        os.environ.clear()
        os.environ.update(env)
    _end_with_launcher(rank)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
    )
    if threads:
        torch.set_num_threads(threads)
    function, args = pickle.loads(payload) if isinstance(payload, bytes) else payload
    try:
        out = function(*args)
    except BaseException as exc:
        _record_failure(Path(tmp), rank, exc)
        if isinstance(exc, KeyboardInterrupt):  # (the launcher's Ctrl-C handling ends it)
            raise
        end_failed_process()
    if rank == 0:
        torch.save(out, Path(tmp) / "rank0.pt")
    end_finished_process()


def end_finished_process() -> None:
    """End a launched process that finished its work, skipping the interpreter's teardown:
    objects the run left alive (an FSDP mesh, a DDP reducer) are destroyed there after their
    process group, and about one exit in four then aborts in torch's C++ destructors
    ("terminate called without an active exception", SIGABRT), failing a run that succeeded.
    Everything this process owed its launcher is written by now."""
    _exit_now(0)


def end_failed_process() -> None:
    """End a launched process whose work raised (its exception recorded for the launcher),
    skipping the interpreter's teardown: there a failed rank could block for good (about one
    run in ten on a loaded 2-core host, the launcher waiting on it), while its peer waited in
    a collective this rank had left, for gloo's 30-minute timeout. Exiting at once lets the
    launcher see the failure and stop the others."""
    _exit_now(1)


def _exit_now(code: int) -> None:
    """Flush this process's output and end it with ``code``, without the interpreter's
    teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _record_failure(directory: Path, rank: int, exc: BaseException) -> None:
    """Leave this process's exception (pickled if it can be), its traceback and the time it
    was raised for the parent, which re-raises the first one."""
    try:
        pickled: bytes | None = pickle.dumps(exc)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    record = {
        "time": time.time(),
        "exception": pickled,
        "text": "".join(traceback.format_exception(exc)),
    }
    # written aside and renamed: a rank terminated by the launcher while writing (the first
    # failure ends the others) leaves no half record for the parent to read
    aside = directory / f".failure-rank{rank}.pkl.tmp"
    aside.write_bytes(pickle.dumps(record))
    os.replace(aside, directory / f"failure-rank{rank}.pkl")


def _first_failure(directory: Path, nprocs: int, err: Exception) -> BaseException:
    """The exception raised first among the launched processes (the others typically fail
    after it, in a collective it left), with a note naming its rank and its traceback."""
    records = []
    for path in directory.glob("failure-rank*.pkl"):
        # written by our own child processes: a trusted pickle (whole: renamed when written)
        record = pickle.loads(path.read_bytes())
        records.append((record["time"], int(path.stem.removeprefix("failure-rank")), record))
    if not records:  # killed by a signal (out of memory?) before it could say why
        return RuntimeError(f"a DDP process died without raising an exception: {err}")
    _, rank, record = min(records, key=lambda r: r[:2])
    exc = pickle.loads(record["exception"]) if record["exception"] is not None else None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(record["text"].strip().splitlines()[-1])
    exc.add_note(f"raised in DDP process rank {rank} of {nprocs}; its traceback:\n{record['text']}")
    return exc
