"""One benchmark configuration (model, precision, batch size), run in this process or in a
fresh one; docs/bench.md ("How it measures") tells the method in full.

`run_in_process` runs it here (threads and TF32 flags restored afterwards); `run_isolated` runs
`main` in a fresh process (`mixprec.bench.forkserver`), which writes a JSON result. A fresh
process is needed only where the process itself shapes a figure (`fresh_process_reason`): a
memory limit caps a whole process, and torch.compile's caches carry over between models.

Each loop first runs once, eagerly, up to its first optimizer update and is dropped, so what
libraries set up on first use for the life of the process (cuBLAS workspaces) is charged to
no loop. Then it is built again and run up to its first optimizer update (one step, unless
float16 overflow skips some) and one step more while its peak memory is measured, so that
the peak is a training step's with the optimizer's state alive (the forward and backward
before the first update run without it): on CUDA
`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, minus what was allocated
before the loop was built; on CPU the peak of live tensor bytes from the allocator's events
that `torch.profiler` records (`profile_memory=True`).

With `compile`, both loops' models are compiled alike, with `torch.compile(model)` after
conversion and placement (not `model.compile()`, which leaves a model made of torch.nn
modules only, such as a raw `nn.Sequential`, uncompiled); the first step's time is kept
apart as `first_step_s`, each loop's compiling first in a fresh process (`run_isolated`).

A mixed configuration also runs a hand-written `torch.autocast` loop (plus
`torch.amp.GradScaler` for float16) on an identical model, so that "mixprec overhead"
compares like with like. `run_group` runs the configurations of one batch size side by side,
in rounds (`rounds.run_rounds`) of one step of each loop in an order changing from round to
round, so that float32's step of round i and bf16's make one paired ratio
(`verdict.ratio_interval`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mixprec.bench import forkserver
from mixprec.bench.rounds import RoundPolicy, run_rounds
from mixprec.device import DeviceInfo, assume, assumed, detect
from mixprec.memory import measured
from mixprec.tree import map_tensors

__all__ = [
    "ERROR",
    "Loop",
    "LoopResult",
    "OK",
    "OOM",
    "RunResult",
    "RunSpec",
    "RunStatus",
    "UNTIMED_STEPS",
    "fresh_process_reason",
    "is_oom",
    "main",
    "raw_first_step",
    "run_config",
    "run_in_process",
    "run_isolated",
    "run_side_by_side",
    "set_tf32",
]


class RunStatus(str, Enum):
    """How a loop or a configuration ended; written into results and journals as its value."""

    OK = "ok"
    OOM = "oom"  # out of memory: the batch does not fit
    ERROR = "error"
    TIMEOUT = "timeout"

    def __str__(self) -> str:
        return self.value


OK, OOM, ERROR, TIMEOUT = RunStatus.OK, RunStatus.OOM, RunStatus.ERROR, RunStatus.TIMEOUT
_AFTER_WARM_UP = (
    "from model build to one step past the first optimizer update (its state made), after "
    "one untimed run of the same loop "
    "(what libraries allocate once per process, such as cuBLAS workspaces, is not counted)"
)
CPU_MEMORY_METHOD = (
    "peak live tensor bytes from the CPU allocator's events (torch.profiler, "
    f"profile_memory=True), {_AFTER_WARM_UP}"
)
CUDA_MEMORY_METHOD = f"torch.cuda.max_memory_allocated, {_AFTER_WARM_UP}"
_ADDRESS_SPACE_SLACK = 512 * 2**20
MAX_STEPS_TO_FIRST_UPDATE = 32
# steps past the first optimizer update while the peak memory is measured (its state alive)
STEPS_PAST_UPDATE = 1
# the untimed steps each loop runs before its warm-up rounds (float16's skipped ones aside):
# the dropped warm-up up to its first update, then that update again and `STEPS_PAST_UPDATE`
# more while its memory is measured (`_ready_loop`)
UNTIMED_STEPS = 1 + 1 + STEPS_PAST_UPDATE


@dataclass
class RunSpec:
    """Everything one configuration needs; JSON-serialisable for the child process."""

    model: str
    precision: str
    batch_size: int
    image_size: int
    device: str
    steps: int
    warmup: int
    threads: int
    tf32: bool | None = None
    allow_slow: bool = False
    raw: bool = False
    memory_limit: int | None = None
    float32_islands: bool = True
    seed: int = 0
    compile: bool = False
    # an activation option for the model (`models.activation_spec`); None: as the policy says
    activations: str | None = None


@dataclass
class LoopResult:
    """Outcome of one training loop (ours or the raw torch one) in a configuration.

    `skipped_steps` counts optimizer steps skipped on gradient overflow over all the loop's
    steps (memory, warm-up and timed ones); skipped steps are cheaper. `first_step_s` is the
    wall time of the first step, compilation included when the model is compiled.
    """

    status: RunStatus = OK
    error: str | None = None
    peak_memory: int | None = None
    step_ms: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    final_loss: float | None = None
    first_step_s: float | None = None
    # why `first_step_s` is missing where it was to be timed (a compiled raw twin's cold
    # compile in a process of its own failed, timed out or was stopped); None: not missing
    first_step_error: str | None = None

    def __post_init__(self) -> None:
        self.status = RunStatus(self.status)  # read back from JSON as its value


@dataclass
class RunResult:
    """What a configuration gave: our loop, and the raw torch loop when one was asked for.

    `paired`: its step times are rounds shared with the other rows of its batch size (step
    i of each from round i); `rounds_stop`: why its rounds ended (`rounds.STEPS`, ...).
    """

    status: RunStatus
    mixprec: LoopResult
    raw: LoopResult | None = None
    memory_method: str = ""
    error: str | None = None
    fresh_process: bool = False
    paired: bool = False
    rounds_stop: str | None = None

    def __post_init__(self) -> None:
        self.status = RunStatus(self.status)  # read back from JSON as its value

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunResult:
        raw = d.get("raw")
        return cls(
            status=d["status"],
            mixprec=LoopResult(**d["mixprec"]),
            raw=LoopResult(**raw) if raw is not None else None,
            memory_method=d.get("memory_method", ""),
            error=d.get("error"),
            fresh_process=d.get("fresh_process", False),
            paired=d.get("paired", False),
            rounds_stop=d.get("rounds_stop"),
        )


def is_oom(err: BaseException) -> bool:
    """Whether an exception means the device ran out of memory."""
    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    msg = str(err)
    # cuBLAS / cuDNN report a failed workspace allocation in their own words, C++ code
    # (LAPACK's workspace) its own; under the bench's address-space cap a oneDNN primitive
    # whose scratch memory cannot be had fails to execute, in no words about memory
    library = ("ALLOC_FAILED", "ALLOCATION_FAILED", "NOT_ENOUGH_WORKSPACE", "std::bad_alloc")
    capped = resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY
    return (
        "can't allocate memory" in msg
        or "out of memory" in msg.lower()
        or any(word in msg for word in library)
        or (capped and "could not execute a primitive" in msg)
    )


def set_tf32(enabled: bool) -> None:
    """Allow (or forbid) TF32 tensor cores for float32 matmuls and cuDNN (conv and RNN) on CUDA.

    Through the ``allow_tf32`` flags: since torch 2.9 each also sets the per-op
    ``fp32_precision`` values, so both APIs agree. Setting only the new ones leaves torch in
    the "mix of the legacy and new APIs" state, where ``torch.get_float32_matmul_precision()``
    and the ``allow_tf32`` getters (read by torch.compile and other libraries) raise.
    """
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def _limit_memory(limit: int | None, loops: int, device: torch.device) -> None:
    """Enforce a memory `limit` for each of `loops` loops like a device's capacity:
    allocations beyond it fail.

    CUDA: the caching allocator's per-process fraction, the limit for each loop (the raw
    loop lives beside ours). CPU: an address-space limit (RLIMIT_AS) of the process's
    current size plus the limit for each loop plus slack for allocator arenas; `run_group`
    sets it again after the first loop's warm-up, so that what the process loads once for its
    life (torch.compile's kernels and compiler, thread pools: address space that holds no
    tensor) is in the base rather than taken from the limit. Either way an over-limit step
    fails with a real allocation error; the measured peak is also compared with the limit,
    per loop, by the caller.
    """
    if limit is None:
        return
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, loops * limit / total), device)
        return
    # Start the thread pool and its allocator arenas before measuring the process size.
    torch.nn.functional.conv2d(torch.ones(2, 3, 16, 16), torch.ones(4, 3, 3, 3)).sum()
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    cap = size + loops * limit + _ADDRESS_SPACE_SLACK
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


# -- the two loops -------------------------------------------------------------------------


@dataclass
class Loop:
    """A ready training loop: `step()` runs one training step and returns its loss.

    `optimizer` is the plain torch optimizer doing the updates: its per-parameter step
    counter tells how many steps were taken rather than skipped on overflow.
    """

    train_step: Callable[[], Tensor]
    optimizer: torch.optim.Optimizer
    steps_run: int = 0

    def step(self) -> Tensor:
        self.steps_run += 1
        return self.train_step()

    @property
    def steps_taken(self) -> int:
        for state in self.optimizer.state.values():
            return int(state["step"])
        return 0


def _build_mixprec(spec: RunSpec, device: torch.device) -> Loop:
    """Our loop: the workload set up through `mixprec.Precision`."""
    from mixprec.bench.models import activation_spec, load_workload
    from mixprec.policy.map import PolicyMap, is_policy_file
    from mixprec.precision import Precision
    from mixprec.step import backward, plain_loss

    work = load_workload(spec.model, spec.image_size, spec.seed)
    model = work.model.to(device)
    inputs, targets = map_tensors(lambda t: t.to(device), work.make_batch(spec.batch_size))
    if is_policy_file(spec.precision):  # its rules and islands as the file has them
        policy = PolicyMap.load(spec.precision)
    else:
        policy = PolicyMap(spec.precision, float32_islands=spec.float32_islands)
    if spec.activations is not None:
        policy = policy.with_activations(activation_spec(work.model, spec.activations))
    precision = Precision(policy, device=device, allow_slow=spec.allow_slow)
    model, optimizer = precision.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    if spec.compile:  # after conversion: the graph traces mixprec's regions and casts
        model = torch.compile(model)
    batch = (inputs, targets)

    def step() -> Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = plain_loss(precision, model, batch, work.loss_fn)
        backward(precision, loss)
        precision.step(optimizer)
        return loss.detach()

    return Loop(step, optimizer.optimizer)


def _build_raw(spec: RunSpec, device: torch.device) -> Loop:
    """The hand-written torch loop for a mixed policy: autocast, plus GradScaler for float16."""
    from mixprec.bench.models import load_workload
    from mixprec.policy import Policy

    policy = Policy(spec.precision)
    work = load_workload(spec.model, spec.image_size, spec.seed)
    model = work.model.to(device)
    inputs, targets = map_tensors(lambda t: t.to(device), work.make_batch(spec.batch_size))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if spec.compile:
        model = torch.compile(model)
    dtype = policy.compute_dtype
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    loss_fn = work.loss_fn

    def step() -> Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = loss_fn(model(inputs), targets)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return loss.detach()

    return Loop(step, optimizer)


class _TimedOut(Exception):
    """An in-process configuration ran past its deadline (checked between steps)."""


def _check(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise _TimedOut


def _first_update(
    build: Callable[[RunSpec, torch.device], Loop],
    spec: RunSpec,
    deadline: float | None = None,
    then: int = 0,
) -> tuple[Loop, float]:
    """Build a loop and run it up to its first taken optimizer step, which creates the
    optimizer's state (float16 runs skip their first steps while the loss scale settles),
    and ``then`` steps more; also returns the seconds of the first step (which compiles a
    compiled model)."""
    device = torch.device(spec.device)
    loop = build(spec, device)
    t0 = time.perf_counter()
    loop.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first = time.perf_counter() - t0
    while loop.steps_taken == 0 and loop.steps_run < MAX_STEPS_TO_FIRST_UPDATE:
        _check(deadline)
        loop.step()
    for _ in range(then):
        _check(deadline)
        loop.step()
    return loop, first


def _warm_up(
    build: Callable[[RunSpec, torch.device], Loop], spec: RunSpec, deadline: float | None
) -> None:
    """Run the loop once up to its first update and drop it (see the module doc). Eagerly:
    compiling here would warm torch.compile's caches and shorten the measured compilation."""
    device = torch.device(spec.device)
    _first_update(build, replace(spec, compile=False), deadline)
    _release(device)


def _oom_message(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip()[:300]}"


def _detail(err: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(err), err)).strip()


def _fail(res: LoopResult, err: Exception) -> None:
    """Record a loop's failure: out of memory is a result, anything else an error."""
    if is_oom(err):
        res.status, res.error = OOM, _oom_message(err)
    else:
        res.status, res.error = ERROR, _detail(err)


def _use_tf32(spec: RunSpec, device: torch.device) -> None:
    if device.type == "cuda" and spec.tf32 is not None:
        set_tf32(spec.tf32)


def _ready_loop(
    spec: RunSpec,
    name: str,
    res: LoopResult,
    device: torch.device,
    deadline: float | None,
    warmed: Callable[[], None] = lambda: None,
) -> Loop | None:
    """Build loop `name` ("mixprec" or "raw") of `spec`, warmed up (then `warmed()` is
    called) and run to its first update and one step more (with the optimizer's state
    alive) while its peak memory is measured; None (the reason in `res`) when it failed."""
    build = _build_mixprec if name == "mixprec" else _build_raw
    try:
        _warm_up(build, spec, deadline)
        warmed()
        (loop, res.first_step_s), res.peak_memory = measured(
            device, lambda: _first_update(build, spec, deadline, then=STEPS_PAST_UPDATE)
        )
    except _TimedOut:
        raise
    except Exception as err:  # noqa: BLE001 - the loop's result; the others go on
        _fail(res, err)
        _release(device)
        return None
    if spec.memory_limit is not None and res.peak_memory > spec.memory_limit:
        res.status = OOM
        res.error = (
            f"peak {res.peak_memory} bytes is over the memory limit of {spec.memory_limit} bytes"
        )
        del loop
        _release(device)
        return None
    return loop


def run_group(
    specs: Sequence[RunSpec],
    base: int | None = None,
    budget_s: float = 0.0,
    deadline: float | None = None,
) -> list[RunResult]:
    """Run configurations that differ only in precision (and TF32) side by side in this
    process: each loop is built and its memory measured in turn, then every loop (ours and
    each raw twin) takes one step per round (`rounds.run_rounds`), so step i of every row is
    from the same round. `specs[base]` is the float32 baseline: with `budget_s`, rounds are
    added beyond the first ``steps`` while a speedup's interval against it is wide. The first
    spec's device, threads, steps and warm-up apply to all. `deadline` (a
    `time.monotonic()` value) is checked between steps: past it, `_TimedOut` is raised."""
    first = specs[0]
    device = torch.device(first.device)
    torch.set_num_threads(first.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    method = CUDA_MEMORY_METHOD if device.type == "cuda" else CPU_MEMORY_METHOD
    count = sum(1 + s.raw for s in specs)  # loops, ours and the raw twins
    # a CPU's first warm-up runs under twice the limit, the warm-ups and steps after it under
    # the limit from the size it leaves (`_limit_memory`)
    _limit_memory(first.memory_limit, count * (1 if device.type == "cuda" else 2), device)
    limited = device.type == "cuda"

    def warmed() -> None:  # a CPU's address-space limit: after the first warm-up
        nonlocal limited
        if not limited:
            _limit_memory(first.memory_limit, count, device)
            limited = True

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    results = [{"mixprec": LoopResult(), **({"raw": LoopResult()} if s.raw else {})} for s in specs]
    loops: dict[tuple[int, str], Loop] = {}
    for i, spec in enumerate(specs):
        _use_tf32(spec, device)
        for name, res in results[i].items():
            loop = _ready_loop(spec, name, res, device, deadline, warmed)
            if loop is not None:
                loops[i, name] = loop
    # a configuration fails with mixprec's loop; its raw twin failing (setting up, or at a
    # step) only takes the twin out of the rounds: its error is kept on its own result
    failed = {i for i, res in enumerate(results) if res["mixprec"].status != OK}
    last: dict[tuple[int, str], Tensor] = {}

    def timer(key: tuple[int, str], loop: Loop) -> Callable[[], float | None]:
        spec, res = specs[key[0]], results[key[0]][key[1]]

        def step() -> float | None:
            if key[0] in failed or res.status != OK:  # (a twin that failed stays out)
                return None
            _use_tf32(spec, device)
            sync()
            t0 = time.perf_counter()
            try:
                last[key] = loop.step()
                sync()
            except Exception as err:  # noqa: BLE001 - the loop's result; the others go on
                _fail(res, err)
                if key[1] == "mixprec":
                    failed.add(key[0])
                return None
            return (time.perf_counter() - t0) * 1e3

        return step

    steps = {key: timer(key, loop) for key, loop in loops.items() if key[0] not in failed}

    def check() -> None:
        _check(deadline)

    if first.warmup:
        run_rounds(steps, [], RoundPolicy(first.warmup), before_round=check)
    pairs = [
        ((base, "mixprec"), (i, "mixprec"))
        for i in range(len(specs))
        if base is not None and i != base
    ]
    policy = RoundPolicy(first.steps, budget_s if pairs else 0.0)
    gc.collect()
    gc.disable()
    try:
        rounds = run_rounds(steps, pairs, policy, before_round=check)
    finally:
        gc.enable()
    for key, ms in rounds.times.items():
        results[key[0]][key[1]].step_ms = ms
        results[key[0]][key[1]].final_loss = float(last[key])
    for key, loop in loops.items():
        if key[0] not in failed:
            results[key[0]][key[1]].skipped_steps = loop.steps_run - loop.steps_taken
    out = []
    for res in results:
        ours = res["mixprec"]
        error = ours.error if ours.status == ERROR else None
        status = ours.status
        paired = len(specs) > 1 and status == OK
        out.append(
            RunResult(
                status,
                ours,
                res.get("raw"),
                method,
                error=error,
                paired=paired,
                rounds_stop=rounds.stop if status == OK else None,
            )
        )
    return out


def run_config(spec: RunSpec, deadline: float | None = None) -> RunResult:
    """Run one configuration in this process (`run_in_process` restores the settings it
    changes); `deadline` as in `run_group`."""
    return run_group([spec], deadline=deadline)[0]


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- in this process or a fresh one --------------------------------------------------------


def fresh_process_reason(spec: RunSpec) -> str | None:
    """Why `spec` must run in a fresh process, or None when this one gives the same figures.

    A memory limit caps a whole process (an address-space limit measured from the process's
    size on a CPU, the caching allocator's per-process fraction on CUDA), and torch.compile
    keeps caches, and a limit on recompilations, across models in one process, so a later
    compiled configuration would compile less (or fall back to eager) and time its first step
    differently. Everything else is measured from a clean start in any process.
    """
    if spec.memory_limit is not None:
        return "a memory limit caps a whole process"
    if spec.compile:
        return "torch.compile's caches carry over between models in one process"
    return None


def _timeout_result(timeout: float | None) -> RunResult:
    return RunResult(TIMEOUT, LoopResult(TIMEOUT), error=f"no result after {timeout:.0f} s")


def run_in_process(spec: RunSpec, timeout: float | None = None) -> RunResult:
    """Run `spec` in this process, as a fresh process would (see `run_side_by_side`)."""
    return run_side_by_side([spec], timeout=timeout)[0]


def run_side_by_side(
    specs: Sequence[RunSpec],
    base: int | None = None,
    budget_s: float = 0.0,
    timeout: float | None = None,
) -> list[RunResult]:
    """`run_group` in this process, as a fresh process would: the thread count and TF32
    flags it sets are restored afterwards and its memory released. An exception becomes an
    error result of every spec, carrying its message (as in a child process); `timeout`
    (seconds for the whole group) is checked between steps. KeyboardInterrupt and other
    BaseExceptions propagate."""
    device = torch.device(specs[0].device)
    threads = torch.get_num_threads()
    tf32 = (
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        if device.type == "cuda"
        else None
    )
    deadline = time.monotonic() + timeout if timeout is not None else None
    try:
        return run_group(specs, base, budget_s, deadline)
    except _TimedOut:
        return [_timeout_result(timeout) for _ in specs]
    except Exception as err:  # noqa: BLE001 - reported as the configurations' result
        detail = _detail(err)
        return [RunResult(ERROR, LoopResult(ERROR, detail), error=detail) for _ in specs]
    finally:
        torch.set_num_threads(threads)
        if tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        _release(device)


def run_isolated(
    spec: RunSpec,
    workdir: Path,
    timeout: float | None = None,
    stopped: Callable[[RunResult], None] | None = None,
) -> RunResult:
    """Run `spec` in a fresh process and return its result (`forkserver.run_fresh`: forked
    from a server that imported torch once, so it starts in milliseconds, or a new Python
    interpreter where that cannot run). Each fresh process has empty torch.compile disk
    caches of its own (`_fresh_env`).

    Compiled with a raw twin, where both loops ran, the twin's first step (its compilation)
    is timed again in a fresh process of its own (`raw_first_step`), as ours was: compiled
    after ours in one process, it found dynamo and inductor warm and took a third of the
    time. The two processes share `timeout` (seconds for the configuration): the second
    gets what the first left. Where it gives no time, the twin's `first_step_error` says why.
    A stop (Ctrl-C, SIGTERM raised as an exception) during it leaves the rest measured:
    `stopped` gets that result before the stop propagates.

    A child killed by SIGKILL (the kernel's out-of-memory killer) is reported as OOM; a
    crash or an exception in the child as an error carrying the end of its output.
    """
    start = time.monotonic()
    code, output, found = _run_fresh(spec, "main", workdir, timeout)
    if code is None:
        return replace(_timeout_result(timeout), fresh_process=True)
    if found is not None:
        result = replace(RunResult.from_dict(found), fresh_process=True)
        raw = result.raw
        if spec.compile and raw is not None and raw.first_step_s is not None:
            # (no compilation time is better than the warm one it took after ours)
            raw.first_step_s = None
            if result.status != OK or raw.status != OK:
                raw.first_step_error = "not timed alone: a loop of this configuration failed"
        if spec.compile and result.status == OK and raw is not None and raw.status == OK:
            left = None if timeout is None else timeout - (time.monotonic() - start)
            try:
                _raw_cold_compile(spec, raw, workdir, left, timeout)
            except BaseException:
                raw.first_step_error = "the run was stopped while it compiled"
                if stopped is not None:
                    stopped(result)
                raise
        return result
    if code == -9:
        msg = "killed by SIGKILL, the usual sign of running out of host memory"
        return RunResult(OOM, LoopResult(OOM, msg), error=msg, fresh_process=True)
    tail = output.strip()[-1500:]
    msg = f"benchmark process exited with code {code}: {tail}"
    return RunResult(ERROR, LoopResult(ERROR, msg), error=msg, fresh_process=True)


def _raw_cold_compile(
    spec: RunSpec, raw: LoopResult, workdir: Path, left: float | None, timeout: float | None
) -> None:
    """Time the raw twin's first step in a fresh process of its own (`raw_first_step`),
    within the `left` seconds of the configuration's `timeout`: into `raw.first_step_s`, or
    why not into `raw.first_step_error`."""
    if left is not None and left <= 0:
        raw.first_step_error = f"no time left of --timeout ({timeout:g} s per configuration)"
        return
    code, output, alone = _run_fresh(spec, "raw_first_step", workdir, left)
    if code is None:
        why = f"timed out (after the {left:.1f} s left of --timeout's {timeout:g} s)"
    elif alone is not None:
        loop = LoopResult(**alone)
        if loop.status == OK and loop.first_step_s is not None:
            raw.first_step_s = loop.first_step_s
            return
        why = f"{loop.status}: {loop.error}"
    elif code == -9:
        why = "killed by SIGKILL, the usual sign of running out of host memory"
    else:
        last = output.strip().splitlines()[-1:] or ["no output"]  # (a traceback's error)
        why = f"its process exited with code {code}: {last[0][-300:]}"
    raw.first_step_error = why


def _fresh_env(spec: RunSpec, cache: str) -> dict[str, str]:
    """A fresh process's environment: `spec`'s threads, and torch.compile's on-disk caches
    (inductor's FX graph, AOTAutograd and kernel caches, Triton's kernels) in `cache`, an
    empty folder of its own, so that no process compiles less for what another (or an
    earlier run, in /tmp/torchinductor_<user>) compiled."""
    env = dict(os.environ, OMP_NUM_THREADS=str(spec.threads))
    env["TORCHINDUCTOR_CACHE_DIR"] = cache
    env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    return env


def _run_fresh(
    spec: RunSpec, target: str, workdir: Path, timeout: float | None
) -> tuple[int | None, str, dict[str, Any] | None]:
    """Run this module's `target` on `spec` in a fresh process with empty compile caches
    (removed afterwards): its exit code (None: timed out), output and JSON result (None
    when it wrote none)."""
    workdir.mkdir(parents=True, exist_ok=True)
    tag = f"{spec.precision}-{spec.activations}-{spec.batch_size}-{spec.tf32}"
    tag = tag.replace("/", "_").replace(",", "_")
    out_path = workdir / f"result-{tag}-{os.getpid()}-{time.monotonic_ns()}.json"
    argv = [json.dumps(asdict(spec)), str(out_path)]
    kind = torch.device(spec.device).type
    if assumed(kind):  # (the child judges the device the plan judged, not the host)
        argv.append(_device_json(detect(kind)))
    with tempfile.TemporaryDirectory(
        prefix="mixprec-compile-cache-", ignore_cleanup_errors=True
    ) as cache:
        try:
            code, output = forkserver.run_fresh(
                f"mixprec.bench.runner:{target}", argv, _fresh_env(spec, cache), timeout
            )
            found = json.loads(out_path.read_text()) if out_path.exists() else None
        finally:
            out_path.unlink(missing_ok=True)
    return code, output, found if code is not None else None


def _device_json(info: DeviceInfo) -> str:
    """A described device (`mixprec.device.assume`) as JSON, for a fresh process."""
    facts = {f.name: getattr(info, f.name) for f in fields(info)}
    for name in ("cpu_flags", "unknown_flags"):
        facts[name] = sorted(facts[name])
    if facts["gemm_ratios"] is not None:
        facts["gemm_ratios"] = dict(facts["gemm_ratios"])
    return json.dumps(facts)


def _device_from_json(text: str) -> DeviceInfo:
    facts = json.loads(text)
    for name in ("cpu_flags", "unknown_flags"):
        facts[name] = frozenset(facts[name])
    for name in ("capability", "macos"):
        if facts[name] is not None:
            facts[name] = tuple(facts[name])
    return DeviceInfo(**facts)


def main(argv: list[str] | None = None) -> int:
    """Child entry point: `python -m mixprec.bench.runner SPEC_JSON RESULT_PATH`."""
    spec_json, result_path, *described = argv if argv is not None else sys.argv[1:]
    spec = RunSpec(**json.loads(spec_json))
    try:
        with assume(_device_from_json(described[0])) if described else contextlib.nullcontext():
            result = run_config(spec)
    except Exception as err:  # noqa: BLE001 - reported to the parent, which shows it
        detail = _detail(err)
        result = RunResult(ERROR, LoopResult(ERROR, detail), error=detail)
        traceback.print_exc()
    Path(result_path).write_text(json.dumps(asdict(result)))
    return 0


def raw_first_step(argv: list[str]) -> int:
    """Child entry point (`run_isolated`): the raw twin of a compiled `spec` alone, readied as
    in `run_group` (eager warm-up, then compiled up to its first update, memory measured),
    its `LoopResult` written; no mixprec loop compiles before it in this process."""
    spec_json, result_path, *described = argv
    spec = RunSpec(**json.loads(spec_json))
    device = torch.device(spec.device)
    torch.set_num_threads(spec.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _use_tf32(spec, device)
    res = LoopResult()
    with assume(_device_from_json(described[0])) if described else contextlib.nullcontext():
        _ready_loop(spec, "raw", res, device, None)
    Path(result_path).write_text(json.dumps(asdict(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
