"""The float32-vs-mixed experiment: plan the configurations, run those of each batch size
side by side in rounds in this process (each alone in a fresh one where that changes its
figures: `runner.fresh_process_reason`), telling listeners as it goes, and (optionally)
search the largest batch that fits per precision.

`plan` validates everything before any process starts (unknown specs, precisions the
hardware refuses, far-slower-than-float32 ones without `allow_slow`), so a bad option fails
in a second with a message saying what is accepted.
"""

from __future__ import annotations

import contextlib
import datetime
import numbers
import os
import shlex
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mixprec import device as devices
from mixprec.activations import ActivationRules, check_device
from mixprec.activations import check as check_activations
from mixprec.activations.options import RECOMPUTE, check_option
from mixprec.bench.models import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_IMAGE_SIZE,
    activation_spec,
    check_model,
    check_workload,
    load_workload,
)
from mixprec.bench.rounds import MAX_ROUNDS, STOP_CONFIDENCE
from mixprec.bench.runner import (
    OK,
    OOM,
    RunResult,
    RunSpec,
    fresh_process_reason,
    run_in_process,
    run_isolated,
    run_side_by_side,
)
from mixprec.bench.verdict import TARGET_WIDTH
from mixprec.device import assumed
from mixprec.dtypes import dtype_name
from mixprec.errors import PolicySpecError, PrecisionError, SlowPrecisionError
from mixprec.hardware import (
    FAST,
    REFUSED,
    SLOW,
    DeviceInfo,
    Support,
    check,
    default_device,
    detect,
    fast_on,
    parse_device,
    policy_support,
    resolve_auto,
    resolve_policy,
)
from mixprec.hardware.measuring import measure_rates, rate_doubts
from mixprec.plan.budget import parse_bytes
from mixprec.policy import Policy, QuantizedPolicy
from mixprec.policy.map import PolicyMap, is_policy_file
from mixprec.policy.names import is_auto
from mixprec.timing import busy_cores, cpu_sample, free_threads, other_busy_cores
from mixprec.version import __version__

__all__ = [
    "BASELINE",
    "DEFAULT_TIME_BUDGET",
    "BenchOptions",
    "BenchReport",
    "Config",
    "Listener",
    "PRESETS",
    "Plan",
    "Row",
    "comparison_gap",
    "cores_shared",
    "memory_method",
    "metadata",
    "plan",
    "quantized",
    "run_bench",
    "size_text",
    "threads_over_cores",
    "times_paired",
]

PRESETS: dict[str, dict[str, Any]] = {
    # The seed blog's experiment: its CNN on 256x256 images, batch 32 to 512, on a GPU;
    # float32 vs float16 mixed (the blog's) and the precision recommended for this GPU.
    "blog": {
        "model": "cnn",
        "precisions": ["32-true", "16-mixed", "auto"],
        "image_size": 256,
        "batch_sizes": [32, 64, 128, 256, 512],
        "steps": 10,
        "warmup": 3,
    },
}
# The seed blog's Tesla V100 results, ms/step of its CNN on 256x256 images (Keras fit,
# epoch 20): batch size -> (mixed_float16, float32). Smaller batches are garbled in the text.
BLOG_V100_MS: dict[int, tuple[int, int]] = {128: (97, 106), 256: (188, 206), 512: (377, 415)}
MAX_BATCH_CAP = 2**16
# the precision every speedup is measured against
BASELINE = "32-true"
# seconds of rounds per batch size while a speedup's interval is wide (without --steps)
DEFAULT_TIME_BUDGET = 30.0
# The mixed precisions a float32-only run is compared against, in order of preference.
MIXED_CANDIDATES = ("bf16-mixed", "16-mixed")


@dataclass
class BenchOptions:
    """What to run. `None` fields take defaults from the model, the preset or the device.

    Attributes:
        model: "cnn" (the seed blog post's), "mlp", "transformer", or a user's factory as
            ``file.py:make`` / ``module:make``.
        precisions: the precisions (or policy files) to time; None: float32 and the one
            `mixprec info` recommends here.
        batch_sizes: the batch sizes; None: the model's (or the preset's) defaults.
        image_size: the CNN's square input size in pixels; None: the model's default.
        steps: timed rounds per batch size (one step of each configuration a round), at
            least; None: 10.
        time_budget: seconds of rounds per batch size: past `steps`, more while a speedup's
            interval against float32 is wider than `verdict.TARGET_WIDTH`; None:
            `DEFAULT_TIME_BUDGET`, or 0 (exactly `steps`) when `steps` is given.
        warmup: untimed rounds before them.
        device: "cpu", "cuda", "cuda:N"; None: the best one available.
        threads: CPU threads the configurations use; None: torch's default, or fewer
            when other work keeps cores busy as the run begins (`timing.free_threads`).
        tf32: on CUDA, float32 rows with TF32 "on", "off" or "both".
        allow_slow: also time precisions rated slow on this device.
        memory_limit: bytes (or a size as typed, "2GB") a configuration may use; past it, OOM.
        max_batch: search the largest batch that fits, per precision.
        preset: "blog": the seed blog post's image size and batch sizes (for a GPU).
        float32_islands: mixed precisions with mixprec's float32 norms and softmax "on",
            without them "off", or "both".
        timeout: seconds a configuration may run before it is stopped.
        compile: every configuration under ``torch.compile``.
        activations: activation options to run every precision with, a row each, ``keep``
            among them; recompute options on each block (`models.activation_spec`).
    """

    model: str = "cnn"
    precisions: list[str] | None = None
    batch_sizes: list[int] | None = None
    image_size: int | None = None
    steps: int | None = None
    time_budget: float | None = None
    warmup: int | None = None
    device: str | None = None
    threads: int | None = None
    tf32: str | None = None
    allow_slow: bool = False
    memory_limit: int | str | None = None
    max_batch: bool = False
    preset: str | None = None
    float32_islands: str = "on"
    timeout: float = 900.0
    compile: bool = False
    activations: list[str] | None = None


@dataclass(frozen=True)
class Config:
    """One row of the experiment: a precision (and TF32 setting, activation option) at one
    batch size."""

    label: str
    spec: str
    batch_size: int
    tf32: bool | None
    raw: bool
    float32_islands: bool = True
    compiled: bool = False
    activations: str | None = None


@dataclass
class Plan:
    """Validated options, the configurations to run, and the reproduce command."""

    options: BenchOptions
    device: torch.device
    precisions: dict[str, PolicyMap]
    support: dict[str, str]
    configs: list[Config]
    command: str
    asked: bool = False
    left_out: dict[str, Support] = field(default_factory=dict)
    # why fewer threads than torch's default were chosen (other work on the cores), or None
    threads_note: str | None = None
    # how many cores other work kept busy as the plan was made (`timing.busy_cores`), where
    # it was sampled (a CPU run); None elsewhere
    busy_cores: float | None = None
    # the precisions as asked for, once each, by their labels (32 or torch.float32 as 32-true)
    # and "auto" as such, not what it resolved to; None: not asked for
    given: list[str] | None = None
    # the memory limit as typed, where it was given as text ("2GB"); None: `size_text`'s
    memory_limit_text: str | None = None

    @property
    def times_low_precision(self) -> bool:
        """Whether any precision of the plan computes in a 16-bit (or narrower) dtype, or
        quantizes its matmuls (float8, the block-scaled formats)."""
        return _low_precision(self.precisions)


def _low_precision(precisions: dict[str, PolicyMap]) -> bool:
    """`Plan.times_low_precision` of these precisions."""
    low = (torch.float32, torch.float64)
    return any(
        p.compute_dtype not in low or isinstance(p, QuantizedPolicy)
        for m in precisions.values()
        for p in m.policies()
    )


@dataclass
class Row:
    """A configuration and what its process reported."""

    config: Config
    result: RunResult


@dataclass
class BenchReport:
    """Everything a run produced: metadata, one row per configuration, max-batch search."""

    metadata: dict[str, Any]
    rows: list[Row]
    max_batch: dict[str, dict[str, Any]] = field(default_factory=dict)


def _whole_bytes(limit: object) -> int | None:
    """A memory limit as whole bytes, a plain int (the journal writes it): any integral
    number (``numpy.int64``, ``1.5 * 2**30``) as its int, a fraction of a byte refused (the
    limit caps allocations, counted in bytes), as are a bool and what is not a number."""
    if limit is None:
        return None
    if isinstance(limit, numbers.Real) and not isinstance(limit, bool):
        if isinstance(limit, numbers.Integral) or float(limit).is_integer():
            return int(limit)
    raise ValueError(f"--memory-limit must be a whole number of bytes, got {limit!r}")


def _positive(name: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _resolve(opts: BenchOptions) -> BenchOptions:
    """Fill defaults: the preset's values first, then the model's, then the machine's.
    A preset's steps are a default, not a typed ``--steps``: the budget keeps its default."""
    given_steps = opts.steps
    if opts.preset is not None:
        if opts.preset not in PRESETS:
            raise ValueError(f"unknown preset {opts.preset!r}; known: {', '.join(PRESETS)}")
        preset = PRESETS[opts.preset]
        opts = replace(
            opts,
            **{k: v for k, v in preset.items() if k != "model" and getattr(opts, k) is None},
        )
        if opts.model != preset["model"]:
            raise ValueError(f"--preset {opts.preset} runs --model {preset['model']}")
    check_model(opts.model)
    if opts.image_size is not None and opts.model != "cnn":
        raise ValueError("--image-size applies to --model cnn only")
    builtin = opts.model in DEFAULT_BATCH_SIZES
    if opts.batch_sizes is None and not builtin:
        raise ValueError(f"--model {opts.model} needs --batch-sizes (no defaults for it)")
    budget = opts.time_budget
    if budget is None:
        budget = DEFAULT_TIME_BUDGET if given_steps is None else 0.0
    return replace(
        opts,
        time_budget=budget,
        batch_sizes=sorted(set(opts.batch_sizes or DEFAULT_BATCH_SIZES[opts.model])),
        image_size=opts.image_size if opts.image_size is not None else DEFAULT_IMAGE_SIZE,
        steps=opts.steps if opts.steps is not None else 10,
        warmup=opts.warmup if opts.warmup is not None else 1,
    )


def _device(name: str | None) -> torch.device:
    try:
        device = parse_device(name) if name is not None else default_device()
    except PrecisionError as err:
        raise ValueError(f"--device: {err}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"mixprec bench runs on cpu or cuda, not {device.type}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA GPU is available here")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _precisions(
    specs: list[str] | None, device: torch.device, allow_slow: bool
) -> tuple[dict[str, PolicyMap], dict[str, str], list[str]]:
    """Parse and hardware-check every spec; label -> policy, label -> support note, and the
    specs as asked for, each by its label ("auto" as such), once each.

    A precision is labelled by its name; a policy file (the doctor's ``policy.json``) by its
    path, and keeps its per-layer rules and float32-island setting."""
    info = detect(device)
    if specs is None:
        auto = resolve_auto(info)
        specs = ["32-true"] if auto.name == "32-true" else ["32-true", auto.name]
    policies: dict[str, PolicyMap] = {}
    support: dict[str, str] = {}
    given: list[str] = []
    for spec in specs:
        try:
            # "auto" means the fastest stable precision of the benchmarked device
            policy = resolve_policy(spec, info)
            _refuse_frozen_weights(spec, policy)
            s = check(policy, device, allow_slow=allow_slow, info=info)
        except SlowPrecisionError as err:
            raise ValueError(f"{err} (mixprec bench: pass --allow-slow)") from None
        except (PolicySpecError, PrecisionError) as err:
            raise ValueError(str(err)) from None
        label = spec if is_policy_file(spec) else policy.default.name
        policies.setdefault(label, policy)
        support[label] = f"{s.status}: {s.reason}" if s.status == SLOW else s.status
        # (a dtype or an int as its name: the journal and the report's wording take text)
        given.append("auto" if is_auto(spec) else label)
    return policies, support, list(dict.fromkeys(given))


def _refuse_frozen_weights(spec: str, policy: PolicyMap) -> None:
    """Refuse a precision whose quantized layers hold their weights as codes (int8, int4):
    those weights never train, so its step skips their gradients and updates, and its
    "speedup" against float32's full training step would not be a training speedup."""
    frozen = sorted(
        {
            p.mode
            for p in policy.policies()
            if isinstance(p, QuantizedPolicy) and not p.format.keeps_weight
        }
    )
    if frozen:
        modes = "/".join(frozen)
        raise ValueError(
            f"--precision {spec}: mixprec bench times training steps against float32's, and "
            f"{modes} layers hold their weights as {modes} codes that never train, so their "
            "step skips those weights' gradients and updates and its speedup would not be a "
            "training speedup. Time a precision that trains every weight instead (bf16-mixed, "
            "16-mixed, or float8_from_<policy>, whose layers keep float weights); a quantized "
            "model trains through LoRA adapters (mixprec.quantize.enable_lora), in your own loop"
        )


def _tf32_modes(tf32: str | None, device: torch.device) -> list[bool | None]:
    if device.type != "cuda":
        if tf32 is not None:
            raise ValueError(
                f"--tf32 applies to CUDA GPUs only; this run is on {device.type}, "
                "where float32 has no TF32 mode"
            )
        return [None]
    modes = {"on": [True], "off": [False], "both": [False, True], None: [False, True]}
    if tf32 not in modes:
        raise ValueError(f"--tf32 must be on, off or both, got {tf32!r}")
    return modes[tf32]


def _island_modes(islands: str) -> list[bool]:
    modes = {"on": [True], "off": [False], "both": [True, False]}
    if islands not in modes:
        raise ValueError(f"--float32-islands must be on, off or both, got {islands!r}")
    return modes[islands]


def _label(name: str, fp32_compute: bool, tf32: bool | None, modes: list[bool | None]) -> str:
    if tf32 is None or not fp32_compute or len(modes) == 1:
        return name
    return f"{name} (TF32 {'on' if tf32 else 'off'})"


def size_text(size: int) -> str:
    """`size` bytes as ``--memory-limit`` reads them back, in the unit that divides them with
    the fewest digits ("64MiB" for 67108864, "2GB" for 2000000000, as typed; binary on a
    tie); else the bare bytes (binary units first showed "2GB" as "1953125KiB")."""
    digits, shown = len(str(size)), str(size)
    for base, suffix in ((1024, "iB"), (1000, "B")):
        for power, prefix in ((4, "T"), (3, "G"), (2, "M"), (1, "K")):
            if size % base**power == 0:  # (the largest such unit of a base: its fewest digits)
                whole = size // base**power
                if len(str(whole)) < digits:
                    digits, shown = len(str(whole)), f"{whole}{prefix}{suffix}"
                break
    return shown


def _parsed_size(text: str) -> int:
    """A memory limit given as text, in bytes, as ``--memory-limit`` reads it: a bare number
    counts bytes, else a number and its unit (`plan.budget.parse_bytes`)."""
    if text.strip().isdigit():
        return int(text)
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise ValueError(f"--memory-limit: {err}") from None


def reproduce_command(
    opts: BenchOptions, device: torch.device, memory_limit_text: str | None = None
) -> str:
    """The explicit command that re-runs exactly these settings on this machine (the memory
    limit as `memory_limit_text` where it was typed so)."""
    parts = ["mixprec", "bench", "--model", opts.model]
    if opts.preset is not None:  # the report compares with the preset's published numbers
        parts += ["--preset", opts.preset]
    if opts.model == "cnn":
        parts += ["--image-size", str(opts.image_size)]
    parts += ["--batch-sizes", *map(str, opts.batch_sizes or [])]
    parts += ["--precision", *(opts.precisions or [])]
    parts += ["--steps", str(opts.steps), "--time-budget", f"{opts.time_budget:g}"]
    parts += ["--warmup", str(opts.warmup)]
    parts += ["--device", str(device), "--threads", str(opts.threads)]
    if opts.tf32 is not None:
        parts += ["--tf32", opts.tf32]
    if opts.allow_slow:
        parts.append("--allow-slow")
    if opts.memory_limit is not None:
        limit = opts.memory_limit  # (text: options not yet planned, as typed too)
        shown = limit if isinstance(limit, str) else size_text(limit)
        parts += ["--memory-limit", memory_limit_text or shown]
    if opts.max_batch:
        parts.append("--max-batch")
    if opts.float32_islands != "on":
        parts += ["--float32-islands", opts.float32_islands]
    if opts.compile:
        parts.append("--compile")
    if opts.activations:
        parts += ["--activations", *opts.activations]
    if opts.timeout != BenchOptions.timeout:
        parts += ["--timeout", f"{opts.timeout:g}"]
    return shlex.join(parts)


def plan(options: BenchOptions) -> Plan:
    """Validate `options` and list the configurations; raises ValueError on bad input."""
    opts = _resolve(options)
    limit_text = None
    if isinstance(opts.memory_limit, str):  # (kept as typed for the command and the notes)
        limit_text = opts.memory_limit.strip()
        opts = replace(opts, memory_limit=_parsed_size(limit_text))
    opts = replace(opts, memory_limit=_whole_bytes(opts.memory_limit))
    for name, value, minimum in (
        ("--steps", opts.steps, 1),
        ("--warmup", opts.warmup, 0),
        ("--threads", opts.threads, 1),
        ("--image-size", opts.image_size, 8),
        ("--memory-limit", opts.memory_limit, 1),
    ):
        _positive(name, value, minimum)
    for b in opts.batch_sizes or []:
        _positive("every batch size", b)
    if not (opts.time_budget or 0) >= 0:
        raise ValueError(f"--time-budget must be >= 0 seconds, got {opts.time_budget}")
    if not opts.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {opts.timeout}")
    device = _device(opts.device)
    threads_note, busy = None, None
    # other work's cores as the run begins, sampled whether or not --threads chose the
    # threads (what the busy-machine warning reads: the load average lags by a minute, and
    # a run started just after another would warn of a neighbour gone)
    if device.type == "cpu":  # a GPU's timing does not wait for busy CPU cores
        busy = busy_cores()
    if opts.threads is None:
        threads = torch.get_num_threads()
        if busy is not None:
            threads, threads_note = free_threads(threads, busy, os.cpu_count() or 1)
        opts = replace(opts, threads=threads)
    if opts.max_batch and device.type == "cpu" and opts.memory_limit is None:
        raise ValueError(
            "--max-batch on a CPU needs --memory-limit (e.g. 2GiB): host memory is shared "
            "and swaps long before a batch 'does not fit'"
        )
    with _torch_threads(opts.threads or 1):  # (its errors describe the device)
        policies, support, given = _precisions(opts.precisions, device, opts.allow_slow)
    if any(s.startswith("slow") for s in support.values()):
        # (allowed by MIXPREC_ALLOW_SLOW where not by the flag: the reproduce command, run
        # in a shell without it, needs the flag)
        opts = replace(opts, allow_slow=True)
    activations = _activation_options(opts.activations, policies, device)
    check_workload(opts.model)  # last: it calls a user's factory
    if activations:
        _check_activations(opts, activations)
        opts = replace(opts, activations=activations)
    info = detect(device)
    left_out = {
        name: policy_support(Policy(name), info)
        for name in MIXED_CANDIDATES
        if name not in policies
    }
    asked = opts.precisions is not None
    opts = replace(opts, precisions=list(policies))
    modes = _tf32_modes(opts.tf32, device)
    islands = _island_modes(opts.float32_islands)
    if opts.float32_islands != "on" and not any(
        p.default.is_mixed and not is_policy_file(n) for n, p in policies.items()
    ):
        raise ValueError(  # (it would be dropped silently: islands are a mixed policy's)
            f"--float32-islands {opts.float32_islands} changes the rows of mixed precisions "
            f"named here (float32 norms and softmax; a policy file keeps its own), and none "
            f"of {', '.join(policies)} is one: add one (bf16-mixed, 16-mixed) or leave the "
            "option out"
        )
    configs = []
    for batch in opts.batch_sizes or []:
        for name, policy in policies.items():
            fp32_compute = policy.compute_dtypes() == {torch.float32}
            # a policy file runs as it is written: its own islands, no hand-written twin
            from_file = is_policy_file(name)
            mixed = policy.default.is_mixed and not from_file
            # autocast cannot quantize: a quantized row's twin would be a plain 16-bit loop,
            # and its "overhead" the quantization's cost, not mixprec's
            twin = mixed and not quantized(policy)
            for tf32 in modes if fp32_compute else modes[:1]:
                for island in islands if mixed else [policy.float32_islands]:
                    for option in activations or [None]:
                        label = activation_label(_label(name, fp32_compute, tf32, modes), option)
                        if not island and policy.default.is_mixed:
                            label += " (no f32 islands)"
                        if opts.compile:
                            label += " (compiled)"
                        # the raw torch loop keeps every activation: a twin of keep only
                        raw = twin and option in (None, "keep")
                        configs.append(
                            Config(label, name, batch, tf32, raw, island, opts.compile, option)
                        )
    # (a described device, `assume`, rated what runs; its command runs on the host, whose own
    # ratings may call slow a low precision the description calls fast, and refuse it)
    described = assumed(device.type) and _low_precision(policies)
    ran = replace(opts, allow_slow=True) if described else opts
    command = reproduce_command(ran, device, limit_text)
    return Plan(
        opts,
        device,
        policies,
        support,
        configs,
        command,
        asked,
        left_out,
        threads_note,
        None if busy is None else round(busy, 2),
        given if options.precisions is not None else None,
        limit_text,
    )


def quantized(policy: PolicyMap) -> bool:
    """Whether any layer of `policy` quantizes its matmuls (float8, the block-scaled
    formats), which no ``torch.autocast`` loop does: such a row has no raw twin."""
    return any(isinstance(p, QuantizedPolicy) for p in policy.policies())


def activation_label(name: str, option: str | None) -> str:
    """The row label of precision `name` run with activation `option` (None: as it is)."""
    if option is None:
        return name
    return f"{name}, activations {option}" + (" per block" if option in RECOMPUTE else "")


def _activation_options(
    given: list[str] | None, policies: dict[str, PolicyMap], device: torch.device
) -> list[str] | None:
    """The checked ``--activations`` options, ``keep`` first and each once (None: none
    given); refused: an unknown option, ``offload`` off CUDA, a precision whose policy file
    has activation rules of its own."""
    if not given:
        return None
    try:
        options = [check_option(o, "--activations") for o in given]
        check_device(set(options), device.type)
    except PolicySpecError as err:
        raise ValueError(str(err)) from None
    for name, policy in policies.items():
        if policy.activations is not None:
            raise ValueError(
                f"--activations runs each precision with each option, but {name} has "
                f"activations of its own ({policy.activations.spec()!r}); leave them out of "
                "the file or leave out --activations"
            )
    return list(dict.fromkeys(["keep", *options]))


def _check_activations(opts: BenchOptions, options: list[str]) -> None:
    """Refuse, before any process starts, an option the model cannot take: a recompute
    option on a model without blocks, or on a block updating its buffers in place."""
    model = load_workload(opts.model, opts.image_size or DEFAULT_IMAGE_SIZE).model
    for option in options:
        rules = ActivationRules(activation_spec(model, option))
        try:
            check_activations(model, rules.resolve(model))
        except PolicySpecError as err:
            raise ValueError(f"--activations {option}: {err}") from None


def comparison_gap(p: Plan) -> dict[str, Any] | None:
    """Why a plan times no low precision, with the facts a user needs to decide: each mixed
    precision left out and why, the matmul rate of each dtype measured here now, where they
    would be fast, and the command that times them anyway. None when the plan has one."""
    if p.times_low_precision:
        return None
    # on one thread, as `hardware.gemm_ratio`: threads of one multiply wait for each other
    # on cores other work holds, which slows the faster dtype's multiply most (docs/bench.md)
    # (a described device, `assume`: the host's rates would be another machine's, and
    # contradict the ratings of the one described; none are measured)
    rates: dict[str, float] = {}
    doubts: list[str] = []
    if not assumed(p.device.type):
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            measured = measure_rates(device=p.device, seconds=0.2)
        finally:
            torch.set_num_threads(before)
        rates = {name: r.median for name, r in measured.items()}
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        doubts = rate_doubts(measured, detect(p.device), load)
    fast = [n for n, s in p.left_out.items() if s.status == FAST]
    others = [n for n, s in p.left_out.items() if s.status not in (FAST, REFUSED)]

    def timing(names: list[str]) -> str | None:
        if not names:
            return None
        slow = any(p.left_out[n].status == SLOW for n in names)
        anyway = replace(
            p.options,
            precisions=[*(p.options.precisions or []), *names],
            allow_slow=p.options.allow_slow or slow,
        )
        return reproduce_command(anyway, p.device, p.memory_limit_text)

    # the fast ones first; the slow ones (whose cost the report estimates) by their own command
    runnable = fast or others
    auto = resolve_auto(detect(p.device)).name
    return {
        "asked": p.asked,
        # what was asked for as typed, and what "auto" among it resolved to here
        "given": p.given,
        "auto": auto if any(is_auto(s) for s in p.given or []) else None,
        "timed": sorted({dtype_name(d) for m in p.precisions.values() for d in m.compute_dtypes()}),
        "left_out": {
            name: {
                "status": s.status,
                "reason": s.reason,
                "dtype": str(Policy(name).compute_dtype).removeprefix("torch."),
                "fast_on": fast_on(Policy(name).compute_dtype),
            }
            for name, s in p.left_out.items()
        },
        # (empty for a described device: nothing measured)
        "matmul_gflops": {k: round(v, 2) for k, v in rates.items()},
        # why those rates may not be trusted (a busy machine): no estimate is made from them
        "matmul_doubts": doubts,
        "runnable": runnable,
        "command": timing(runnable),
        "slow_runnable": others if fast else [],
        "slow_command": timing([*fast, *others]) if fast and others else None,
    }


def _spec(p: Plan, config: Config) -> RunSpec:
    o = p.options
    return RunSpec(
        model=o.model,
        precision=config.spec,
        batch_size=config.batch_size,
        image_size=o.image_size or DEFAULT_IMAGE_SIZE,
        device=str(p.device),
        steps=o.steps or 1,
        warmup=o.warmup or 0,
        threads=o.threads or 1,
        tf32=config.tf32,
        allow_slow=o.allow_slow,
        raw=config.raw,
        memory_limit=o.memory_limit,
        float32_islands=config.float32_islands,
        compile=config.compiled,
        activations=None if config.activations == "keep" else config.activations,
    )


def _load_average() -> list[float] | None:
    """The OS's 1/5/15-minute load averages: other work on the machine skews timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """torch's thread count set to the run's `threads` inside (restored after): a device
    described inside (`DeviceInfo.describe`, in messages too) names the threads that time."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _describe(info: DeviceInfo, threads: int) -> str:
    """The device as `mixprec info` shows it, with the thread count the children use."""
    with _torch_threads(threads):
        return info.describe()


def _host(device: torch.device) -> DeviceInfo:
    """The device the steps run on: `detect`'s, the host's under `assume` too (a described
    device rates the precisions, and runs nothing)."""
    if not assumed(device.type):
        return detect(device)
    # (`detect` less the assumption: mixprec.device has no public lookup of the host then)
    caps = tuple(os.environ.get(var) for var in devices._ISA_VARS)
    return devices._detect(device.type, device.index, caps)


def metadata(p: Plan) -> dict[str, Any]:
    """Environment and settings recorded with the results."""
    info = detect(p.device)
    o = p.options
    load, cores = _load_average(), os.cpu_count() or 1
    described = assumed(p.device.type)
    return {
        "mixprec_version": __version__,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        # the machine that took the step times; under `assume`, the described one apart:
        # it rated the precisions (support, auto_precision), and timed nothing
        "device": _describe(_host(p.device), o.threads or 1),
        "described_device": _describe(info, o.threads or 1) if described else None,
        "device_type": p.device.type,
        "model": o.model,
        "image_size": o.image_size if o.model == "cnn" else None,
        "batch_sizes": o.batch_sizes,
        "precisions": o.precisions,
        "support": p.support,
        # what "auto" (`mixprec info`'s recommendation) is here, timed or not
        "auto_precision": resolve_auto(info).name,
        "steps": o.steps,
        "time_budget_s": o.time_budget,
        "warmup": o.warmup,
        "threads": o.threads,
        "threads_note": p.threads_note,
        "memory_limit": o.memory_limit,
        "memory_limit_text": p.memory_limit_text,
        "float32_islands": o.float32_islands,
        "compile": o.compile,
        "activations": o.activations,
        "preset": o.preset,
        "command": p.command,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_average_before": load,
        "cores": cores,
        # what the pre-run checks found: other work's busy cores (sampled where the threads
        # were chosen), and whether the busy-machine warning was due
        "busy_cores_before": p.busy_cores,
        "busy_warning": cores_shared(_busy_measure(p, load), o.threads or 1, cores, p.device.type),
        "timing": _timing(p),
    }


def _busy_measure(p: Plan, load: list[float] | None) -> float | None:
    """Other work's busy cores as the plan sampled them, else the 1-minute load (the one
    measure the pre-run warning reads too)."""
    if p.busy_cores is not None:
        return p.busy_cores
    return load[0] if load else None


def cores_shared(load: float | None, threads: int, cores: int, device_type: str) -> bool:
    """Whether other work keeping `load` of `cores` CPU cores busy leaves fewer free than a
    run's `threads` (with half a core to spare): its threads then wait for each other at
    each parallel op, and single steps slow down at random. Never on a GPU. Threads that
    outnumber the cores on their own (`threads_over_cores`) are not other work: an idle
    machine's load 0 was taken for it (above 2 - 4 + 0.5)."""
    free = max(cores - threads, 0)
    return device_type == "cpu" and load is not None and load > free + 0.5


def threads_over_cores(threads: int, cores: int, device_type: str) -> bool:
    """Whether a CPU run's own `threads` outnumber the `cores`: they then wait for each
    other at each parallel op, other work or none."""
    return device_type == "cpu" and threads > cores


def times_paired(p: Plan) -> bool:
    """Whether the plan's configurations take their steps side by side in rounds (paired),
    not each in a fresh process of its own (`runner.fresh_process_reason`)."""
    return not any(fresh_process_reason(_spec(p, c)) for c in p.configs)


def _timing(p: Plan) -> str:
    """How the step times were taken: paired rounds in one process, or (where a fresh
    process changes a figure) each configuration in its own, unpaired."""
    o = p.options
    step = "per step: zero_grad, forward, loss, backward, optimizer step" + (
        " (CUDA synchronised)" if p.device.type == "cuda" else ""
    )
    fresh = next((r for c in p.configs if (r := fresh_process_reason(_spec(p, c)))), None)
    if fresh is not None:  # (not `times_paired`: the reason is said)
        return (
            f"{step}; each configuration in a fresh process of its own, one after another "
            f"({fresh}): {o.steps} steps, unpaired; warm-up excluded, GC disabled; ms/step "
            "is the median of the steps, a speedup the ratio of float32's median to the "
            "other's, with no interval and no verdict (runs apart in time: a neighbour's load "
            "shifts one run and not the other, which paired rounds do not suffer)"
        )
    return (
        f"{step}; the configurations of a batch size (float32, each mixed precision and its "
        "raw torch.autocast twin) take one step each per round in one process, in an order "
        "changing by round (each loop after each other equally often); at least "
        f"{o.steps} round{'' if o.steps == 1 else 's'}, then "
        f"more while a speedup's {STOP_CONFIDENCE:.0%} interval is wider than "
        f"{TARGET_WIDTH:.2f}x (high/low), within "
        f"{o.time_budget:g} s of rounds per batch size and {MAX_ROUNDS} rounds; warm-up "
        "excluded, GC disabled; ms/step is the median of the rounds, a speedup the median "
        "of the rounds' paired ratios"
    )


def run_spec(spec: RunSpec, workdir: Path, timeout: float | None) -> RunResult:
    """Run one configuration here, or in a fresh process where that changes its figures."""
    if fresh_process_reason(spec) is None:
        return run_in_process(spec, timeout)
    return run_isolated(spec, workdir, timeout)


def _groups(configs: Sequence[Config]) -> list[list[int]]:
    """The indices of the configurations of each batch size, in plan order."""
    groups: dict[int, list[int]] = {}
    for index, config in enumerate(configs):
        groups.setdefault(config.batch_size, []).append(index)
    return list(groups.values())


def run_batch(
    p: Plan,
    configs: Sequence[Config],
    workdir: Path,
    stopped: Callable[[list[RunResult]], None] | None = None,
) -> list[RunResult]:
    """The configurations of one batch size: side by side in rounds in this process, each
    step time paired with float32's of the same round; where a fresh process changes a
    figure (`runner.fresh_process_reason`), each in its own, one after another (unpaired).
    A stop (Ctrl-C, SIGTERM) among fresh processes gives `stopped` the results finished
    before it (in order), then propagates."""
    specs = [_spec(p, c) for c in configs]
    timeout = p.options.timeout
    if any(fresh_process_reason(s) for s in specs):
        results: list[RunResult] = []
        try:
            for s in specs:
                results.append(run_isolated(s, workdir, timeout, stopped=results.append))
        except BaseException:
            if stopped is not None and results:
                stopped(results)
            raise
        return results
    base = next(
        (
            i
            for i, c in enumerate(configs)
            if c.spec == BASELINE and c.activations in (None, "keep")
        ),
        None,
    )
    return run_side_by_side(specs, base, p.options.time_budget or 0.0, timeout * len(specs))


def _probe(
    p: Plan, name: str, batch: int, workdir: Path, activations: str | None = None
) -> RunResult:
    """One step of precision `name` (with activation option `activations`) at `batch`."""
    tf32 = _tf32_modes(p.options.tf32, p.device)[0]
    island = _island_modes(p.options.float32_islands)[0]
    config = Config(
        name,
        name,
        batch,
        tf32,
        raw=False,
        float32_islands=island,
        compiled=p.options.compile,
        activations=activations,
    )
    spec = replace(_spec(p, config), steps=1, warmup=0)
    return run_spec(spec, workdir, p.options.timeout)


class _ProbeFailed(Exception):
    """A max-batch probe neither fitted nor ran out of memory (an error or a timeout)."""


def search_max_batch(
    p: Plan,
    name: str,
    workdir: Path,
    on_probe: Callable[[int, str], None] | None = None,
    activations: str | None = None,
) -> dict[str, Any]:
    """Largest batch of precision `name` (with activation option `activations`) that fits:
    double from the smallest batch size until one runs out of memory, then bisect between
    the last fit and the first OOM.

    A probe that errors or times out stops the search: `error` then says which batch and
    why, `max_batch` is the largest batch that fitted before it (0: none) and `first_oom`
    the smallest that ran out of memory (None: none). `on_probe(batch, status)` follows it.
    """
    probes: list[dict[str, Any]] = []

    def probe(batch: int) -> bool:
        result = _probe(p, name, batch, workdir, activations)
        fits = result.status == OK
        probes.append(
            {
                "batch_size": batch,
                "fits": fits,
                "status": result.status,
                "peak_memory": result.mixprec.peak_memory,
            }
        )
        if on_probe is not None:
            on_probe(batch, result.status)
        if result.status not in (OK, OOM):
            raise _ProbeFailed(f"batch {batch}: {result.status}: {result.error}")
        return fits

    lo, hi, error = 0, None, None
    batch = min(p.options.batch_sizes or [1])
    cap = max(MAX_BATCH_CAP, batch)  # (the cap itself is probed, as a start above it)
    try:
        while True:
            if not probe(batch):
                hi = batch
                break
            lo = batch
            if batch >= cap:
                break
            batch = min(batch * 2, cap)
        if hi is not None:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if probe(mid):
                    lo = mid
                else:
                    hi = mid
    except _ProbeFailed as failed:
        error = str(failed)
    return {
        "max_batch": lo,
        "first_oom": hi,
        "capped": hi is None and error is None,
        "error": error,
        "probes": probes,
        **({"precision": name, "activations": activations} if activations else {}),
    }


class Listener:
    """What a run tells as it goes, in order: `started` once, `measured` after each
    configuration, `probed` after each max-batch probe, `searched` after each precision's
    search, `finished` at the end (not called when the run is stopped). Each does nothing
    here; a listener overrides those it needs."""

    def started(self, meta: dict[str, Any], configs: Sequence[Config]) -> None:
        """The run's metadata, and the configurations it will run, before the first one."""

    def measured(self, row: Row, index: int, seconds: float) -> None:
        """Configuration number `index` (from 1) gave `row`; its batch size took `seconds`."""

    def probed(self, name: str, batch: int, status: str) -> None:
        """A max-batch probe of precision `name` at `batch` ended with `status`."""

    def searched(self, name: str, found: dict[str, Any]) -> None:
        """The max-batch search of precision `name` found `found`."""

    def finished(self, meta: dict[str, Any]) -> None:
        """What the metadata gained at the end: elapsed time, load average, memory method."""


def run_bench(p: Plan, listeners: Sequence[Listener] = ()) -> BenchReport:
    """Run every configuration of plan `p`, batch size by batch size (`run_batch`), then
    the max-batch search if asked, telling `listeners` of each row as its batch size ends."""
    meta = metadata(p)
    meta["comparison_gap"] = comparison_gap(p)
    searches = [
        (name, option, activation_label(name, option))
        for name in (p.precisions if p.options.max_batch else [])
        for option in p.options.activations or [None]
    ]
    meta["max_batch_searches"] = [label for _, _, label in searches]
    for listener in listeners:
        listener.started(meta, p.configs)
    t0 = time.perf_counter()
    cpu0 = cpu_sample() if p.device.type == "cpu" else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="mixprec-bench-") as tmp:
        for group in _groups(p.configs):
            start = time.perf_counter()
            configs = [p.configs[i] for i in group]

            def tell(
                results: list[RunResult], group: list[int] = group, start: float = start
            ) -> None:
                seconds = time.perf_counter() - start
                for index, result in zip(group, results, strict=False):
                    row = Row(p.configs[index], result)
                    rows.append(row)
                    for listener in listeners:
                        listener.measured(row, index + 1, seconds)

            # (rows finished before a stop are told, and so journaled, before it propagates)
            tell(run_batch(p, configs, Path(tmp), stopped=tell))
        max_batch = {}
        for name, option, label in searches:

            def on_probe(batch: int, status: str, label: str = label) -> None:
                for listener in listeners:
                    listener.probed(label, batch, status)

            found = search_max_batch(p, name, Path(tmp), on_probe, option)
            max_batch[label] = found
            for listener in listeners:
                listener.searched(label, found)
    end = {
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "load_average_after": _load_average(),
        # other work through the run, which the load averages give too late and too smoothly
        "other_busy_cores": other_busy_cores(cpu0, cpu_sample() if cpu0 else None, meta["cores"]),
        "memory_method": memory_method(rows),
    }
    meta.update(end)
    for listener in listeners:
        listener.finished(end)
    return BenchReport(meta, rows, max_batch)


def memory_method(rows: Sequence[Row]) -> str:
    """How the rows' peak memory was measured (the first row that says)."""
    return next((r.result.memory_method for r in rows if r.result.memory_method), "")
