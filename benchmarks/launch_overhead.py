"""What mixprec adds per step where a step is all Python and dispatch (launch-bound).

A 2-layer MLP (32 -> 32 -> 10, ReLU) on batches of 8, one CPU thread: its matmuls take
microseconds, so a step's time is the Python and the dispatcher calls around them, which is
what `Precision` and the Trainer add to. Four ways train the same steps from the same
weights on the same batches (a list of tensors, no DataLoader), interleaved round by round
in a rotating order (the machine is shared and noisy: only side-by-side numbers mean much):

- raw: the lines of torch.amp a user writes: ``torch.autocast`` around the forward and the
  loss, ``GradScaler`` for float16 (scale, backward, step, update), ``zero_grad``;
- precision: ``Precision.setup``, the forward, ``precision.backward``, ``precision.step``,
  ``zero_grad``;
- trainer bare: ``Trainer(logger=False, enable_checkpointing=False,
  enable_progress_bar=False)``;
- trainer defaults: ``Trainer()`` as it comes: CSV and TensorBoard loggers, a
  ModelCheckpoint, the progress bar (off here: stdout is not a terminal, as in a job log).

Each way's steps are timed one by one in CPU time of the training thread
(``time.thread_time``: torch runs on that one thread here, and time other processes take
on a shared machine does not count), from one batch being taken to the next: for the
Trainer, everything its loop does per batch; setup, the epoch's end and the checkpoint it
writes are not per-step costs. A round's figure is the mean of its steps, leaving out those
over 4x the round's median, so that what happens every 50 steps (a logged row) still
counts. The TensorBoard writer's own thread is not counted. The table gives the median of
the rounds and the best round per way; ratios are to raw's. Function calls and aten ops per
step are counted too: unlike times, they do not depend on the machine's load. Each way's
ratio to raw is also taken round by round (the two ran side by side, so what loaded the
machine then loaded both): the median of those paired ratios and their lower quartile.
``--step-pairs`` pairs closer still: the raw and `Precision` loops take turns one step at a
time (`step_pairs`), where a burst of other work lasts longer than a step and hits both.

    python benchmarks/launch_overhead.py [--rounds 15] [--steps 300] [--ways raw precision]
        [--step-pairs ROUNDS] [--out FILE]
    python benchmarks/launch_overhead.py --profile bf16-mixed  # cProfile of the defaults
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec.precision import Precision
from mixprec.trainer import Trainer

Batches = list[tuple[Tensor, Tensor]]
WAYS = ("raw", "precision", "trainer bare", "trainer defaults")
SPECS = ("32-true", "bf16-mixed", "16-mixed")
COMPUTE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def batches(steps: int) -> Batches:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
        for _ in range(steps)
    ]


def optimizer(kind: str) -> Callable[..., torch.optim.Optimizer]:
    if kind == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=1e-3)
    return lambda params: torch.optim.SGD(params, lr=0.01)


class Timed:
    """The batches, with the time each one was taken (the Trainer iterates it as its data)."""

    def __init__(self, data: Batches) -> None:
        self.data = data
        self.stamps: list[float] = []

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for batch in self.data:
            self.stamps.append(time.thread_time())
            yield batch

    def step_seconds(self) -> list[float]:
        """The time of each step but the last (from its batch to the next one)."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


def raw(model: nn.Module, data: Timed, spec: str, opt_kind: str) -> None:
    """torch.amp as written by hand."""
    opt = optimizer(opt_kind)(model.parameters())
    dtype = COMPUTE.get(spec)
    scaler = torch.amp.GradScaler("cpu") if spec == "16-mixed" else None
    for x, y in data:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)


def with_precision(model: nn.Module, data: Timed, spec: str, opt_kind: str) -> None:
    """A hand-written loop through `mixprec.Precision`."""
    precision = Precision(spec, allow_slow=True)
    model, opt = precision.setup(model, optimizer(opt_kind)(model.parameters()))
    for x, y in data:
        precision.backward(F.cross_entropy(model(x), y))
        precision.step(opt)
        opt.zero_grad(set_to_none=True)


def with_trainer(model: nn.Module, data: Timed, spec: str, opt_kind: str, defaults: bool) -> None:
    """One epoch with the Trainer."""
    off = {} if defaults else dict(logger=False, enable_checkpointing=False)
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            precision=spec,
            max_epochs=1,
            enable_progress_bar=defaults,
            default_root_dir=root,
            allow_slow_precision=True,
            **off,
        )
        trainer.fit(model, data, loss_fn=F.cross_entropy, optimizer=optimizer(opt_kind))


def run_way(way: str, model: nn.Module, data: Batches, spec: str, opt_kind: str) -> list[float]:
    """The seconds of each step of ``way``."""
    timed = Timed(data)
    if way == "raw":
        raw(model, timed, spec, opt_kind)
    elif way == "precision":
        with_precision(model, timed, spec, opt_kind)
    else:
        with_trainer(model, timed, spec, opt_kind, defaults=way == "trainer defaults")
    return timed.step_seconds()


def robust_mean(seconds: list[float]) -> float:
    """The mean of the steps no longer than 4x the median."""
    limit = 4 * statistics.median(seconds)
    return statistics.fmean(t for t in seconds if t <= limit)


def measure(
    spec: str, opt_kind: str, steps: int, rounds: int, ways: tuple[str, ...] = WAYS
) -> dict[str, list[float]]:
    """µs/step of each way per round (after a warm-up round), rounds interleaved."""
    base, data = mlp(), batches(steps)
    times: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(rounds + 1):
        order = ways[r % len(ways) :] + ways[: r % len(ways)]
        for way in order:
            mean = robust_mean(run_way(way, copy.deepcopy(base), data, spec, opt_kind))
            if r:
                times[way].append(mean * 1e6)
    return times


class _Ops(TorchDispatchMode):
    """Counts the aten ops dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.count += 1
        return func(*args, **(kwargs or {}))


def _calls(way: str, data: Batches, spec: str, opt_kind: str) -> int:
    prof = cProfile.Profile()
    prof.enable()
    run_way(way, mlp(), data, spec, opt_kind)
    prof.disable()
    return sum(entry[1] for entry in pstats.Stats(prof).stats.values())  # type: ignore[attr-defined]


def _ops(way: str, data: Batches, spec: str, opt_kind: str) -> int:
    with _Ops() as ops:
        run_way(way, mlp(), data, spec, opt_kind)
    return ops.count


def paired(times: dict[str, list[float]], way: str) -> tuple[float, float]:
    """The median and lower quartile of ``way``'s time over raw's, round by round."""
    ratios = [t / r for t, r in zip(times[way], times["raw"], strict=True)]
    return statistics.median(ratios), statistics.quantiles(ratios, n=4)[0]


def step_pairs(spec: str, opt_kind: str, steps: int, rounds: int) -> list[float]:
    """The precision loop's step time over the raw loop's, step by step: the two train their
    own copies of the model in one process, taking turns one step at a time (which goes first
    alternates), so that a burst of other work on a shared machine falls on both alike. The
    steps are the ones `raw` and `with_precision` take; the first round warms up."""
    dtype = COMPUTE.get(spec)
    model = mlp()
    opt = optimizer(opt_kind)(model.parameters())
    scaler = torch.amp.GradScaler("cpu") if spec == "16-mixed" else None
    precision = Precision(spec, allow_slow=True)
    wrapped = mlp()
    wrapped, wrapped_opt = precision.setup(wrapped, optimizer(opt_kind)(wrapped.parameters()))

    def raw_step(x: Tensor, y: Tensor) -> None:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    def precision_step(x: Tensor, y: Tensor) -> None:
        precision.backward(F.cross_entropy(wrapped(x), y))
        precision.step(wrapped_opt)
        wrapped_opt.zero_grad(set_to_none=True)

    clock = time.thread_time_ns
    ratios = []
    for r in range(rounds + 1):
        for i, (x, y) in enumerate(batches(steps)):
            first, second = (raw_step, precision_step) if i % 2 else (precision_step, raw_step)
            t0 = clock()
            first(x, y)
            t1 = clock()
            second(x, y)
            t2 = clock()
            ours, theirs = (t2 - t1, t1 - t0) if i % 2 else (t1 - t0, t2 - t1)
            if r:
                ratios.append(ours / theirs)
    return ratios


def per_step_counts(
    spec: str, opt_kind: str, ways: tuple[str, ...] = WAYS
) -> dict[str, tuple[float, float]]:
    """Python function calls and aten ops per step of each way: the difference between
    runs of 150 and 50 steps over 100, so that setup and the epoch's end cancel. Counts do
    not depend on the machine's load, unlike times."""
    short, long = batches(50), batches(150)
    out = {}
    for way in ways:
        # imports and each way's one-off work (a logger's first files, compiled glob
        # patterns) done before counting: they would land in the first run counted
        run_way(way, mlp(), short, spec, opt_kind)
        calls = (_calls(way, long, spec, opt_kind) - _calls(way, short, spec, opt_kind)) / 100
        ops = (_ops(way, long, spec, opt_kind) - _ops(way, short, spec, opt_kind)) / 100
        out[way] = (calls, ops)
    return out


def matmul_ratio() -> float:
    """The time of the model's largest matmul (8x32 by 32x32) in bfloat16 over float32: near
    1 where dispatch, not arithmetic, sets a step's time."""
    a, b = torch.randn(8, 32), torch.randn(32, 32)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, w = a.to(dtype), b.to(dtype)
        for _ in range(200):
            x @ w
        t0 = time.perf_counter()
        for _ in range(5000):
            x @ w
        out[dtype] = time.perf_counter() - t0
    return out[torch.bfloat16] / out[torch.float32]


def profile(spec: str, opt_kind: str, steps: int, top: int) -> str:
    """cProfile of the Trainer with its defaults and of the `Precision` loop, the entries in
    mixprec's files, by own time per step."""
    data = batches(steps)
    out = []
    for way in ("trainer defaults", "precision"):
        run_way(way, mlp(), data, spec, opt_kind)  # warm
        prof = cProfile.Profile()
        model = mlp()
        prof.enable()
        run_way(way, model, data, spec, opt_kind)
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(r"mixprec", top)
        out.append(f"## {way}, {spec}, {opt_kind}, {steps} steps\n\n{text.getvalue()}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--specs", nargs="+", default=list(SPECS), choices=SPECS)
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "adamw"])
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument(
        "--step-pairs",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="also time raw and precision step by step, taking turns, for this many rounds",
    )
    parser.add_argument("--out", default=None, help="write a markdown result file here")
    parser.add_argument("--profile", default=None, choices=SPECS, help="cProfile instead")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ways = ("raw", *(w for w in WAYS[1:] if w in args.ways))
    if args.profile:
        for opt_kind in args.optimizers:
            print(profile(args.profile, opt_kind, args.steps, args.top))
        return 0
    both = int("trainer defaults" in ways and "precision" in ways)
    rows, count_rows, pair_rows = [], [], []
    for opt_kind in args.optimizers:
        for spec in args.specs:
            counts = per_step_counts(spec, opt_kind, ways)
            count_rows.append(
                f"| {spec} | {opt_kind} | "
                + " | ".join(f"{counts[w][0]:.0f} / {counts[w][1]:.0f}" for w in ways)
                + " |"
            )
            print(count_rows[-1], flush=True)
            times = measure(spec, opt_kind, args.steps, args.rounds, ways)
            med = {w: statistics.median(v) for w, v in times.items()}
            best = {w: min(v) for w, v in times.items()}
            cells = [f"{med['raw']:.0f} / {best['raw']:.0f}"]
            for way in ways[1:]:
                mid, low = paired(times, way)
                cells.append(
                    f"{med[way]:.0f} / {best[way]:.0f} "
                    f"({mid:.3f}x, {low:.3f}x; {med[way] / med['raw']:.3f}x / "
                    f"{best[way] / best['raw']:.3f}x)"
                )
            if both:
                cells.append(f"{med['trainer defaults'] / med['precision']:.3f}x")
            rows.append(f"| {spec} | {opt_kind} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
            if args.step_pairs:
                ratios = step_pairs(spec, opt_kind, args.steps, args.step_pairs)
                q1, q2, q3 = statistics.quantiles(ratios, n=4)
                pair_rows.append(
                    f"| {spec} | {opt_kind} | {q2:.3f}x | {q1:.3f}x | {q3:.3f}x | {len(ratios)} |"
                )
                print(pair_rows[-1], flush=True)
    command = "python benchmarks/launch_overhead.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    lines = [
        "# Launch-bound step: mixprec against the raw torch.amp loop",
        "",
        f"Command: `{command.strip()}`",
        f"CPU: {platform.processor() or platform.machine()}; "
        f"{mixprec.hardware.detect('cpu').describe()}; torch {torch.__version__}, "
        "torch.set_num_threads(1)",
        f"bfloat16 / float32 time of the model's largest matmul (8x32 @ 32x32): "
        f"{matmul_ratio():.2f}",
        "",
        "µs per step, median of the rounds / best round (ratio to raw: median of the paired "
        "rounds' ratios, their lower quartile; ratio of the medians / of the best rounds):",
        "",
        "| policy | optimizer | "
        + " | ".join(ways)
        + (" | defaults / precision |" if both else " |"),
        "|---|---|" + "---:|" * (len(ways) + both),
        *rows,
        "",
        *(
            [
                "Precision's step over raw's, the two taking turns step by step (`step_pairs`): "
                "median, quartiles, steps:",
                "",
                "| policy | optimizer | median | lower quartile | upper quartile | steps |",
                "|---|---|---:|---:|---:|---:|",
                *pair_rows,
                "",
            ]
            if pair_rows
            else []
        ),
        "Python function calls / aten ops per step (cProfile and a TorchDispatchMode "
        "counter; machine-independent):",
        "",
        "| policy | optimizer | " + " | ".join(ways) + " |",
        "|---|---|" + "---:|" * len(ways),
        *count_rows,
        "",
        f"Model: Linear(32, 32) -> ReLU -> Linear(32, 10), batch 8, cross-entropy; "
        f"{args.steps} steps a round, {args.rounds} rounds after a warm-up round, the ways "
        "interleaved in a rotating order. Targets: precision <= 1.05x raw on a CPU (1.03x on a "
        "GPU), trainer defaults <= 1.10x raw.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
