"""Low-bit optimizer states: held-out loss, state bytes, peak training bytes and step time.

Two models, each trained from the same initial weights on the same batches by every
optimizer in the same process, the optimizers taking turns step by step (the first to step
rotates each step), so they see the same machine load:

- ``charlm``: examples/charlm.py's model (``--width``, 4 blocks, ``--block`` bytes),
  ``--steps`` steps with its schedule (linear warm-up over a tenth of the steps, then cosine
  to 10%), lr 2e-3, weight decay 0.01;
- ``gpt2``: a wider model, a Hugging Face GPT-2 of ``--wide-width`` and ``--wide-layers``
  with random weights (nothing downloaded) over byte ids, ``--wide-steps`` steps.

Optimizers: float32 states (``torch.optim.AdamW(foreach=True)``, the baseline); torchao's
``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8`` (torch.compile'd by torchao) and bitsandbytes'
8-bit ``AdamW8bit`` when they are installed (the ``lowbit`` extra; the report says what is
missing or failed); mixprec's ``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8``
(`mixprec.optim.states`). Figures:

- held-out loss: mean cross-entropy (nats/byte) over ``--val-batches`` batches of the last
  10% of the text, after training;
- state bytes: the bytes of every tensor storage in ``optimizer.state`` (tensor subclasses
  counted by their inner tensors, shared storages once), after training;
- peak training bytes: the weights and the optimizer state held between steps, plus the
  peak of live tensor bytes one training step (forward, backward, optimizer step) allocates,
  from the CPU allocator's events recorded by torch.profiler as `mixprec.bench` measures
  CPU memory; measured on the first step after ``--warmup``;
- step times: medians of the optimizer step alone and of the whole training step, over the
  steps after ``--warmup`` (which hold torchao's compilation), GC disabled.

    PYTHONPATH=src python benchmarks/optimizer_states.py [--steps 300] [--models charlm,gpt2]
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
# (not this folder: its kernels.py would stand in for the `kernels` package transformers imports)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT / "examples"))

from charlm import CharGPT, charlm_loaders  # noqa: E402

from mixprec.hardware import detect  # noqa: E402
from mixprec.memory import measured  # noqa: E402
from mixprec.optim import states  # noqa: E402

LR, WEIGHT_DECAY = 2e-3, 0.01
BASELINE = "torch AdamW (float32, foreach)"
TORCHAO_8BIT = "torchao AdamW8bit"
# what the targets ask of each mixprec row: (loss within, state bytes at most) of the baseline
TARGETS = {
    "mixprec AdamW8bit": (0.005, 0.26),
    "mixprec AdamW4bit": (0.015, 0.14),
    "mixprec AdamWFp8": (0.01, None),
}
STEP_TIME_TARGET = 1.2  # times the baseline's optimizer step

Make = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class Candidate:
    """One optimizer: its row name, where it comes from, and how to build it."""

    name: str
    source: str
    make: Make


def _version(package: str) -> str:
    return f"{package} {importlib.metadata.version(package)}"


def candidates() -> tuple[list[Candidate], list[str]]:
    """The optimizers this process can build, and a note for each package that is missing."""
    kw = {"lr": LR, "weight_decay": WEIGHT_DECAY}
    out = [
        Candidate(
            BASELINE,
            _version("torch"),
            lambda ps: torch.optim.AdamW(ps, foreach=True, **kw),
        )
    ]
    notes = []
    try:
        import torchao.optim as ao
    except ImportError as e:
        notes.append(f"torchao is not installed (`pip install torchao`): rows skipped ({e})")
    else:
        for cls in (ao.AdamW8bit, ao.AdamW4bit, ao.AdamWFp8):
            out.append(
                Candidate(
                    f"torchao {cls.__name__}",
                    _version("torchao"),
                    lambda ps, cls=cls: cls(ps, **kw),
                )
            )
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        notes.append(
            f"bitsandbytes is not installed (`pip install bitsandbytes`): its row is skipped ({e})"
        )
    else:
        out.append(
            Candidate(
                "bitsandbytes AdamW8bit",
                _version("bitsandbytes"),
                lambda ps: bnb.optim.AdamW8bit(ps, **kw),
            )
        )
    for cls in (states.AdamW8bit, states.AdamW4bit, states.AdamWFp8):
        out.append(
            Candidate(f"mixprec {cls.__name__}", "mixprec", lambda ps, cls=cls: cls(ps, **kw))
        )
    return out, notes


# -- measures ------------------------------------------------------------------------------


def _storages(value: Any, seen: dict[int, int]) -> None:
    """Record the storages of every tensor in ``value`` (nested containers, subclasses'
    inner tensors) as data pointer -> bytes."""
    if isinstance(value, dict):
        for v in value.values():
            _storages(v, seen)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _storages(v, seen)
    elif isinstance(value, Tensor):
        if type(value) not in (Tensor, nn.Parameter) and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            for n in names:
                _storages(getattr(value, n), seen)
        else:
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct tensor storages held in ``optimizer.state``."""
    seen: dict[int, int] = {}
    _storages(list(optimizer.state.values()), seen)
    return sum(seen.values())


def schedule(steps: int) -> Callable[[int], float]:
    """examples/charlm.py's learning-rate factor: linear warm-up, then cosine to 10%."""
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * done))

    return factor


@dataclass
class Run:
    """One optimizer training its own copy of the model."""

    candidate: Candidate
    model: nn.Module
    loss: Callable[[nn.Module, tuple[Tensor, Tensor]], Tensor]
    steps: int
    optimizer: torch.optim.Optimizer = field(init=False)
    scheduler: torch.optim.lr_scheduler.LRScheduler = field(init=False)
    step_s: list[float] = field(default_factory=list)
    optimizer_s: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    held: float | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        self.optimizer = self.candidate.make(self.model.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule(self.steps))

    def _step(self, batch: tuple[Tensor, Tensor]) -> tuple[float, float]:
        start = time.perf_counter()
        self.loss(self.model, batch).backward()
        mid = time.perf_counter()
        self.optimizer.step()
        end = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return end - start, end - mid

    def step(self, batch: tuple[Tensor, Tensor], timed: bool, measure_memory: bool) -> None:
        """One training step; a failure is recorded and ends this run."""
        try:
            if measure_memory:
                held = sum(p.nbytes for p in self.model.parameters()) + state_bytes(self.optimizer)
                _, grown = measured(torch.device("cpu"), lambda: self._step(batch))
                self.peak_bytes = held + grown
            else:
                whole, opt = self._step(batch)
                if timed:
                    self.step_s.append(whole)
                    self.optimizer_s.append(opt)
        except Exception as e:  # the report shows what failed, e.g. a CPU backend's gap
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

    @torch.no_grad()
    def held_out(self, batches: list[tuple[Tensor, Tensor]]) -> float:
        self.model.eval()
        loss = statistics.fmean(float(self.loss(self.model, b)) for b in batches)
        self.model.train()
        return loss


# -- models --------------------------------------------------------------------------------


def _lm_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    out = model(x)
    logits = out if isinstance(out, Tensor) else out.logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def charlm(args: argparse.Namespace) -> Callable[[], nn.Module]:
    return lambda: CharGPT(block=args.block, dim=args.width, steps=args.steps)


def gpt2(args: argparse.Namespace) -> Callable[[], nn.Module]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = GPT2Config(
        vocab_size=256,
        n_positions=args.block,
        n_embd=args.wide_width,
        n_layer=args.wide_layers,
        n_head=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return lambda: GPT2LMHeadModel(config)


MODELS = {"charlm": charlm, "gpt2": gpt2}


def _batches(loader: Iterable, n: int) -> Iterator[tuple[Tensor, Tensor]]:
    """``n`` training batches, the loader restarted as often as needed."""
    done = 0
    while done < n:
        for batch in loader:
            if done == n:
                return
            yield batch
            done += 1


def train(
    model_name: str, args: argparse.Namespace, chosen: list[Candidate]
) -> tuple[dict[str, Any], list[Run]]:
    """Every candidate trains its copy of the model, step by step in turn."""
    steps = args.steps if model_name == "charlm" else args.wide_steps
    batch_size = args.batch_size if model_name == "charlm" else args.wide_batch_size
    torch.manual_seed(args.seed)
    train_loader, val_loader = charlm_loaders(args.block, batch_size)
    build = MODELS[model_name](args)
    torch.manual_seed(args.seed)
    initial = build().state_dict()
    runs = []
    for c in chosen:
        model = build()
        model.load_state_dict(initial)
        runs.append(Run(c, model, _lm_loss, steps))
    params = sum(p.numel() for p in runs[0].model.parameters())
    gc.collect()
    gc.disable()
    try:
        for i, batch in enumerate(_batches(train_loader, steps)):
            live = [r for r in runs if r.error is None]
            first = i % len(live) if live else 0
            for r in live[first:] + live[:first]:
                r.step(batch, timed=i > args.warmup, measure_memory=i == args.warmup)
            if (i + 1) % 25 == 0:
                print(f"{model_name}: step {i + 1}/{steps}", file=sys.stderr, flush=True)
    finally:
        gc.enable()
    held = [b for _, b in zip(range(args.val_batches), val_loader, strict=False)]
    info = {
        "model": model_name,
        "parameters": params,
        "steps": steps,
        "batch_size": batch_size,
        "block": args.block,
        "timed_steps": max(0, steps - args.warmup - 1),
    }
    for r in runs:
        r.held = None if r.error else r.held_out(held)
    return info, runs


def rows(runs: list[Run]) -> list[dict[str, Any]]:
    """Each run's figures, with ratios against the baseline and torchao's 8-bit AdamW."""
    by_name = {r.candidate.name: r for r in runs}
    base = by_name.get(BASELINE)
    out = []
    for r in runs:
        row: dict[str, Any] = {"optimizer": r.candidate.name, "source": r.candidate.source}
        if r.error is not None:
            row["error"] = r.error
            out.append(row)
            continue
        row.update(
            held_out_loss=r.held,
            state_bytes=state_bytes(r.optimizer),
            peak_bytes=r.peak_bytes,
            optimizer_step_ms=1e3 * statistics.median(r.optimizer_s) if r.optimizer_s else None,
            train_step_ms=1e3 * statistics.median(r.step_s) if r.step_s else None,
        )
        out.append(row)
    ok = {row["optimizer"]: row for row in out if "error" not in row}
    if base is not None and BASELINE in ok:
        b = ok[BASELINE]
        for row in ok.values():
            row["loss_vs_baseline"] = row["held_out_loss"] / b["held_out_loss"] - 1
            row["state_vs_baseline"] = row["state_bytes"] / b["state_bytes"]
            if row["peak_bytes"] and b["peak_bytes"]:
                row["peak_vs_baseline"] = row["peak_bytes"] / b["peak_bytes"]
            for key in ("optimizer_step_ms", "train_step_ms"):
                if row[key] is not None and b[key]:
                    row[key.replace("_ms", "_vs_baseline")] = row[key] / b[key]
    return out


def target_lines(model: str, table: list[dict[str, Any]]) -> list[str]:
    """Each mixprec row against the targets: met or missed, with the figure."""
    ok = {row["optimizer"]: row for row in table if "error" not in row}
    if BASELINE not in ok:
        return []
    ao8 = ok.get(TORCHAO_8BIT)
    lines = []
    for name, (loss_tol, state_max) in TARGETS.items():
        row = ok.get(name)
        if row is None:
            continue
        checks = [
            (
                f"held-out loss within {loss_tol:.1%} of float32 states'",
                abs(row["loss_vs_baseline"]) <= loss_tol,
                f"{row['loss_vs_baseline']:+.2%}"
                if math.isfinite(row["loss_vs_baseline"])
                else "the run diverged: held-out loss nan",
            )
        ]
        if state_max is not None:
            checks.append(
                (
                    f"state bytes <= {state_max}x float32 states'",
                    row["state_vs_baseline"] <= state_max,
                    f"{row['state_vs_baseline']:.4f}x",
                )
            )
        if row.get("optimizer_step_vs_baseline") is not None:
            checks.append(
                (
                    f"optimizer step <= {STEP_TIME_TARGET}x torch AdamW(foreach=True)'s",
                    row["optimizer_step_vs_baseline"] <= STEP_TIME_TARGET,
                    f"{row['optimizer_step_vs_baseline']:.2f}x",
                )
            )
            if ao8 is not None and ao8.get("optimizer_step_ms"):
                ratio = row["optimizer_step_ms"] / ao8["optimizer_step_ms"]
                what = "optimizer step <= torchao's compiled AdamW8bit's"
                checks.append((what, ratio <= 1, f"{ratio:.2f}x"))
        for what, met, figure in checks:
            lines.append(f"- {model}, {name}: {what}: **{'met' if met else 'missed'}** ({figure})")
    return lines


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.2f}"


def _ratio(x: float | None, fmt: str = "{:.3f}x") -> str:
    return "" if x is None else fmt.format(x)


def markdown(command: str, notes: list[str], results: list[dict[str, Any]]) -> str:
    lines = [
        "# Low-bit optimizer states: loss, bytes and step time",
        "",
        f"Command: `{command}`",
        "",
        f"Device: {detect().describe()}; torch {torch.__version__}; "
        f"python {platform.python_version()}.",
        "",
        "The optimizers take turns step by step on identical copies of each model and the same "
        "batches. Loss: held-out cross-entropy (nats/byte) after training. State: bytes of "
        "the tensor storages in `optimizer.state`. Peak: weights + state held between steps + "
        "the peak a training step allocates (torch.profiler's CPU allocator events). Times: "
        "medians over the steps after warm-up (torchao compiles in warm-up).",
    ]
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    all_targets: list[str] = []
    for result in results:
        info = result["info"]
        lines += [
            "",
            f"## {info['model']}: {info['parameters']:,} parameters, {info['steps']} steps, "
            f"batch {info['batch_size']} x {info['block']} bytes, {info['timed_steps']} timed",
            "",
            "| optimizer | source | held-out loss | vs float32 | state MiB | vs float32 | "
            "peak MiB | vs float32 | optimizer step ms | vs float32 | train step ms | "
            "vs float32 |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in result["rows"]:
            if "error" in row:
                lines.append(f"| {row['optimizer']} | {row['source']} | failed: {row['error']} |")
                continue
            lines.append(
                f"| {row['optimizer']} | {row['source']} | {row['held_out_loss']:.4f} | "
                f"{_ratio(row.get('loss_vs_baseline'), '{:+.2%}')} | "
                f"{_mib(row['state_bytes'])} | {_ratio(row.get('state_vs_baseline'))} | "
                f"{_mib(row['peak_bytes'])} | {_ratio(row.get('peak_vs_baseline'))} | "
                f"{_ratio(row['optimizer_step_ms'], '{:.1f}')} | "
                f"{_ratio(row.get('optimizer_step_vs_baseline'), '{:.2f}x')} | "
                f"{_ratio(row['train_step_ms'], '{:.1f}')} | "
                f"{_ratio(row.get('train_step_vs_baseline'), '{:.2f}x')} |"
            )
        all_targets += target_lines(info["model"], result["rows"])
    if all_targets:
        lines += ["", "## Targets", "", *all_targets]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="charlm,gpt2", help="comma-separated: charlm, gpt2")
    p.add_argument("--steps", type=int, default=300, help="char LM training steps")
    p.add_argument("--width", type=int, default=128, help="char LM width")
    p.add_argument("--block", type=int, default=64, help="sequence length (bytes)")
    p.add_argument("--batch-size", type=int, default=8, help="char LM batch")
    p.add_argument("--wide-steps", type=int, default=40, help="GPT-2 training steps")
    p.add_argument("--wide-width", type=int, default=512, help="GPT-2 width (8 heads)")
    p.add_argument("--wide-layers", type=int, default=2, help="GPT-2 blocks")
    p.add_argument("--wide-batch-size", type=int, default=4, help="GPT-2 batch")
    p.add_argument("--val-batches", type=int, default=20, help="held-out batches")
    p.add_argument("--warmup", type=int, default=10, help="untimed first steps")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", help="optimizer names to run, separated by ';' (default: all)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/optimizer_states.md")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    available, notes = candidates()
    chosen = available
    if args.only:
        wanted = [n.strip() for n in args.only.split(";")]
        names = [c.name for c in available]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            p.error(f"--only: unknown optimizer(s) {unknown}; available: {names}")
        chosen = [c for c in available if c.name in wanted]
    models = [m.strip() for m in args.models.split(",")]
    bad = [m for m in models if m not in MODELS]
    if bad:
        p.error(f"--models: unknown {bad}; accepted: {sorted(MODELS)}")
    command = "PYTHONPATH=src python benchmarks/optimizer_states.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    results = []
    for name in models:
        start = time.perf_counter()
        info, runs = train(name, args, chosen)
        info["seconds"] = round(time.perf_counter() - start, 1)
        results.append({"info": info, "rows": rows(runs)})
        print(f"{name}: {info['seconds']} s", flush=True)
    text = markdown(command, notes, results)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if args.json:
        figures = {"command": command, "notes": notes, "results": results}
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
