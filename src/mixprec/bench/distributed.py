"""`mixprec bench --strategy fsdp --devices N`: memory per rank of data-parallel training,
whole models (DDP) vs sharded ones (FSDP2 through `mixprec.sharding.shard`), per precision.

Each (strategy, precision) runs in N fresh processes (gloo on CPU, nccl on CUDA), which
train a few AdamW steps of the workload and report, per rank:

- held bytes: the parameters, gradients and optimizer state this rank holds after a step
  (before ``zero_grad``), summed from the tensors themselves (a DTensor's local shard). DDP's
  communication buckets (about one more copy of the gradients) are not counted;
- step peak: what the rank held before a step (parameters and optimizer state, as above) plus
  the peak growth of live tensor bytes during the step, from the allocator's events
  (``torch.profiler``; CUDA: ``max_memory_allocated``): activations, gradients, gathered
  parameters and buckets included;
- process peak RSS: the process's resident-set high-water mark (``ru_maxrss``), torch's own
  libraries included, so it differs between strategies by less than the tensors do.

A (strategy, precision) whose ranks fail (a refused set-up, an error, a killed process) is a
`FailedRun` carrying the first rank's error; the others are still measured and written.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import re
import resource
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import ProcessException

from mixprec.bench.models import load_workload
from mixprec.errors import PrecisionError
from mixprec.hardware import check, detect, policy_support
from mixprec.memory import measured
from mixprec.policy.map import as_map
from mixprec.precision import Precision
from mixprec.step import backward, plain_loss
from mixprec.trainer.strategy import end_finished_process, free_port, run_processes
from mixprec.tree import map_tensors

__all__ = [
    "DEFAULT_PRECISIONS",
    "CTRL_C_GRACE_S",
    "FailedRun",
    "Interrupted",
    "MemorySpec",
    "OUTPUT_FILES",
    "RankMemory",
    "Row",
    "STRATEGIES",
    "check_precisions",
    "command_line",
    "default_precisions",
    "held_bytes",
    "markdown",
    "measure",
    "run",
    "summary",
    "write",
]

STRATEGIES = ("ddp", "fsdp")
# seconds a measurement's ranks have, after a Ctrl-C, to end by themselves before they are
# terminated: they write nothing that a kill could leave half-done
CTRL_C_GRACE_S = 1.0
DEFAULT_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
OUTPUT_FILES = ("memory.json", "memory.md")


@dataclass
class MemorySpec:
    """One (strategy, precision) measurement; picklable for the spawned ranks."""

    strategy: str
    precision: str
    model: str
    batch_size: int
    steps: int
    devices: int
    device: str
    threads: int
    allow_slow: bool


@dataclass
class RankMemory:
    """What one rank held and peaked at, in bytes."""

    strategy: str
    precision: str
    rank: int
    params: int
    grads: int
    optimizer: int
    step_peak: int
    rss_peak: int
    final_loss: float

    @property
    def held(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optimizer


@dataclass
class FailedRun:
    """A (strategy, precision) whose ranks did not finish, with the error a rank reported."""

    strategy: str
    precision: str
    error: str


Row = RankMemory | FailedRun  # what `run` gives for each spec: its ranks, or its failure


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C stopped `run`: `rows` are the specs measured before it, and the interrupted
    one as a `FailedRun`; every rank has ended."""

    def __init__(self, rows: list[Row]) -> None:
        super().__init__()
        self.rows = rows


class MeasurementFailed(RuntimeError):
    """`measure`'s ranks did not finish; `error` is the first rank's error."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def held_bytes(model: nn.Module, optimizer: Any) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes this process holds: local shards of
    DTensors, whole tensors otherwise. ``optimizer``: a `LossScaleOptimizer` (its float32
    masters, under a "true" 16-bit policy, count as optimizer state and their gradients as
    gradients: the step keeps both) or a plain optimizer."""
    masters = list(getattr(optimizer, "master_params", {}).values())
    inner = getattr(optimizer, "optimizer", optimizer)
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(t.grad) for t in (*model.parameters(), *masters) if t.grad is not None)
    state = sum(_local_bytes(m) for m in masters) + sum(
        _local_bytes(v)
        for s in inner.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    return params, grads, state


def _blocks(name: str, module: nn.Module) -> bool:
    return isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))


def _rank(rank: int, spec: MemorySpec, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device, rank) if spec.device == "cuda" else torch.device("cpu")
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=spec.devices)
        _measure_rank(rank, spec, device, out)
    except Exception as err:
        detail = "".join(traceback.format_exception_only(type(err), err)).strip()
        Path(out, f"rank{rank}.error").write_text(detail)
        raise  # ends the process, group and all; the parent stops the other ranks
    # The group goes last: a DDP wrapper or FSDP mesh freed after it can hang at exit.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    end_finished_process()


def _measure_rank(rank: int, spec: MemorySpec, device: torch.device, out: str) -> None:
    """Train ``spec.steps`` steps on this rank and write what it held to ``rank{r}.json``."""
    work = load_workload(spec.model, seed=0)
    model = work.model.to(device)
    precision = Precision(spec.precision, device=device, allow_slow=spec.allow_slow)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    if spec.strategy == "fsdp":
        from mixprec.sharding import shard

        wrap = _blocks if any(_blocks("", m) for m in model.modules()) else None
        model, opt = shard(
            model,
            precision.policy,
            wrap=wrap,
            scaler=precision.scaler,
            optimizer_factory=adamw,
            master_weights=precision.master_weights,
            allow_slow=spec.allow_slow,
        )
        model, lso = precision.setup(model, opt, convert=False)
        step_model: nn.Module = model
    else:
        opt = adamw(model.parameters())
        model, lso = precision.setup(model, opt)
        ids = [device.index] if device.type == "cuda" else None
        step_model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    inputs, targets = work.make_batch(spec.batch_size)
    inputs, targets = (map_tensors(lambda t: t.to(device), x) for x in (inputs, targets))

    def step() -> tuple[torch.Tensor, tuple[int, int, int]]:
        loss = plain_loss(precision, step_model, (inputs, targets), work.loss_fn)
        backward(precision, loss)
        precision.step()
        held = held_bytes(model, lso)
        lso.zero_grad(set_to_none=True)
        return loss.detach(), held

    for _ in range(max(0, spec.steps - 1)):
        step()
    before = sum(held_bytes(model, lso))  # no gradients between steps
    (loss, held), growth = measured(device, step)
    row = RankMemory(
        spec.strategy,
        spec.precision,
        rank,
        *held,
        step_peak=before + growth,
        rss_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        final_loss=float(loss),
    )
    Path(out, f"rank{rank}.json").write_text(json.dumps(asdict(row)))


def measure(spec: MemorySpec, workdir: Path) -> list[RankMemory]:
    """Run ``spec`` in ``spec.devices`` fresh processes; every rank's numbers.

    Raises `MeasurementFailed` with the lowest failing rank's error (or how a process
    ended, when it could not say) when a rank fails; the others are stopped then."""
    # a policy file's path names the precision: flattened to one directory name
    out = workdir / re.sub(r"[^\w.,=-]", "_", f"{spec.strategy}-{spec.precision}")
    out.mkdir(parents=True, exist_ok=True)
    for r in range(spec.devices):  # an earlier run's files in this --out say nothing now
        for name in (f"rank{r}.json", f"rank{r}.error"):
            (out / name).unlink(missing_ok=True)
    try:
        run_processes(
            _rank, (spec, free_port(), str(out)), spec.devices, "spawn", grace=CTRL_C_GRACE_S
        )
    except ProcessException as err:
        said = [out / f"rank{r}.error" for r in range(spec.devices)]
        told = [p.read_text() for p in said if p.exists()]
        how = str(err).strip().splitlines()[-1]  # "process 1 terminated with signal ..."
        raise MeasurementFailed(told[0] if told else how) from None
    return [
        RankMemory(**json.loads((out / f"rank{r}.json").read_text())) for r in range(spec.devices)
    ]


def default_precisions(device: str, allow_slow: bool) -> tuple[list[str], dict[str, str]]:
    """`DEFAULT_PRECISIONS` that run at speed on `device` (all of them with `allow_slow`),
    and the ones left out with the reason: the default must not fail where bf16 is slow."""
    kept, left = [], {}
    for spec in DEFAULT_PRECISIONS:
        try:
            check(as_map(spec), torch.device(device), allow_slow=allow_slow)
        except PrecisionError as err:
            support = policy_support(spec, detect(device))
            left[spec] = support.reason or str(err)
        else:
            kept.append(spec)
    return kept, left


def check_precisions(precisions: list[str], device: str, allow_slow: bool) -> None:
    """Raise (`PrecisionError` / `SlowPrecisionError`, naming ``--allow-slow``) before any
    process starts if a precision is refused or slow here."""
    for spec in precisions:
        check(as_map(spec), torch.device(device), allow_slow=allow_slow)


def run(
    specs: list[MemorySpec],
    workdir: Path,
    on_done: Callable[[MemorySpec, list[Row]], None] | None = None,
) -> list[Row]:
    """Measure every spec in turn: its ranks' rows, or one `FailedRun` when they failed (the
    next specs still run). A Ctrl-C raises `Interrupted` with the rows measured so far."""
    rows: list[Row] = []
    for spec in specs:
        try:
            done: list[Row] = list(measure(spec, workdir))
        except MeasurementFailed as failed:
            done = [FailedRun(spec.strategy, spec.precision, failed.error)]
        except KeyboardInterrupt:
            stopped = "interrupted (Ctrl-C) before its ranks finished"
            raise Interrupted([*rows, FailedRun(spec.strategy, spec.precision, stopped)]) from None
        rows += done
        if on_done is not None:
            on_done(spec, done)
    return rows


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


# a summary line's numbers: None in the line of a failed run
_NUMBERS = (
    "params", "grads", "optimizer", "held", "held_vs_ddp", "step_peak", "rss_peak", "final_loss"
)  # fmt: skip


def summary(rows: list[Row]) -> list[dict[str, Any]]:
    """One line per (strategy, precision), in the order measured: the largest rank's held
    bytes (and their parts), as a fraction of DDP's in the same precision, and the largest
    peaks over the ranks; or, for a `FailedRun`, its error and no numbers."""
    groups: dict[tuple[str, str], list[RankMemory]] = {}
    errors: dict[tuple[str, str], str] = {}
    for r in rows:
        groups.setdefault((r.strategy, r.precision), [])
        if isinstance(r, FailedRun):
            errors[(r.strategy, r.precision)] = r.error
        else:
            groups[(r.strategy, r.precision)].append(r)
    worst = {k: max(ranks, key=lambda r: r.held) for k, ranks in groups.items() if ranks}
    lines: list[dict[str, Any]] = []
    for (strategy, precision), ranks in groups.items():
        if (strategy, precision) in errors:
            error = errors[(strategy, precision)]
            numbers = dict.fromkeys(_NUMBERS)
            lines.append({"strategy": strategy, "precision": precision, **numbers, "error": error})
            continue
        r = worst[(strategy, precision)]
        ddp = worst.get(("ddp", precision))
        lines.append(
            {
                "strategy": strategy,
                "precision": precision,
                "params": r.params,
                "grads": r.grads,
                "optimizer": r.optimizer,
                "held": r.held,
                "held_vs_ddp": r.held / ddp.held if ddp is not None else None,
                "step_peak": max(x.step_peak for x in ranks),
                "rss_peak": max(x.rss_peak for x in ranks),
                "final_loss": r.final_loss,
                "error": None,
            }
        )
    return lines


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}x"


def markdown(lines: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The table with the command and host it was measured with."""
    head = (
        "| strategy | precision | params MiB | grads MiB | optimizer MiB | held MiB | "
        "held vs DDP | step peak MiB | process peak RSS MiB |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    body = "".join(
        f"| {x['strategy']} | {x['precision']} |{' failed |' * 7}\n"
        if x["error"] is not None
        else f"| {x['strategy']} | {x['precision']} | {_mib(x['params'])} | "
        f"{_mib(x['grads'])} | {_mib(x['optimizer'])} | {_mib(x['held'])} | "
        f"{_ratio(x['held_vs_ddp'])} | {_mib(x['step_peak'])} | {_mib(x['rss_peak'])} |\n"
        for x in lines
    )
    failed = "".join(
        f"- {x['strategy']} {x['precision']}: {' '.join(x['error'].split())}\n"
        for x in lines
        if x["error"] is not None
    )
    if failed:
        failed = f"Failed (no numbers):\n\n{failed}\n"
    return (
        f"# Memory per rank: DDP vs FSDP ({meta['devices']} ranks)\n\n"
        f"command: `{meta['command']}`\n\nhost: {meta['host']}\n\n"
        f"model: {meta['model']}, batch {meta['batch_size']} per rank, AdamW, "
        f"{meta['steps']} steps\n\n"
        f"{head}{body}\n{failed}"
        "Per (strategy, precision), the rank holding the most. held = parameters + gradients "
        "+ optimizer state this rank holds after a step (local shards of DTensors; float32 "
        "masters of a 16-bit model counted as optimizer state, their gradients as gradients; "
        "DDP's gradient buckets not counted); step peak = held before a step (parameters + "
        "optimizer state) + the peak growth of live tensor bytes during it (allocator events "
        "via torch.profiler on CPU, max_memory_allocated on CUDA): activations, gradients and "
        "gathered parameters included; process peak RSS = the process's "
        "high-water mark, torch's libraries included.\n"
    )


def write(out: Path, rows: list[Row], meta: dict[str, Any]) -> list[Path]:
    """memory.json (every rank, the failed runs, the summary, the command and host) and
    memory.md."""
    out.mkdir(parents=True, exist_ok=True)
    lines = summary(rows)
    payload = {
        **meta,
        "summary": lines,
        "ranks": [asdict(r) for r in rows if isinstance(r, RankMemory)],
        "failed": [asdict(r) for r in rows if isinstance(r, FailedRun)],
    }
    paths = [out / OUTPUT_FILES[0], out / OUTPUT_FILES[1]]
    paths[0].write_text(json.dumps(payload, indent=2))
    paths[1].write_text(markdown(lines, meta))
    return paths


def command_line() -> str:
    """How this process was started, for the record."""
    return " ".join(["mixprec", *sys.argv[1:]])
