"""Activation options on a GPU: the largest batch each fits under one memory limit, and its
step time, against keeping every saved tensor.

The model is `transformer.py`'s decoder LM with a vocabulary of 8192 (d=1024, 12 layers, 16
heads, 512 tokens: the blocks' saved tensors, not the logits, are most of the step's
memory), trained with fused AdamW through `mixprec.Precision("bf16-mixed", activations=...)`.
Options: keep, bf16, fp8 and offload for the whole model; checkpoint and selective for each
block (`mixprec.bench.models.activation_spec`, as `mixprec bench --activations` does).

Memory, one option at a time (one model alive): after a warm step, the peak of one step at
batch b is `torch.cuda.max_memory_allocated` over what was allocated before the model was
built. Peaks at two batches give the fixed bytes and the bytes per sample; the largest batch
under `--limit` predicted from them is then checked by measuring (down while over, up while
the next batch fits), so the batch reported is a measured fit and the next one a measured
miss. Time: every option's model built at `--time-batch`, the options taking turns step by
step in rotated order, each step between two synchronisations; per option the median step
and the median (and quartiles) of its per-round ratio to keep's step of the same round.
Results are written after each option and at the end; the run stops at `--budget` seconds
and keeps what it measured.

    PYTHONPATH=src python benchmarks/gpu/activations.py --out OUT              # a GPU
    PYTHONPATH=src python benchmarks/gpu/activations.py --device cpu --tiny --out OUT

`--tiny` (transformer.py's TINY dims, 2 rounds) is a smoke test: a CPU has no
`max_memory_allocated`, so its memory phase is skipped and its times mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transformer import LM, TINY, Dims, lm_loss  # noqa: E402

from mixprec import Precision  # noqa: E402
from mixprec.bench.models import activation_spec  # noqa: E402
from mixprec.plan.budget import parse_bytes  # noqa: E402

OPTIONS = ("keep", "bf16", "fp8", "checkpoint", "selective", "offload")
# options whose largest batch is predicted from the two fitted peaks, not stepped at
UNCHECKED = ("offload",)
MAX_PROBES = 10
FULL = Dims(vocab=8192, dim=1024, layers=12, heads=16, seq=512, batch=16)
# (option, what is compared, bound): the targets
TARGETS = (
    ("fp8", "batch", 1.6),
    ("checkpoint", "batch", 2.5),
    ("fp8", "time", 1.25),
    ("checkpoint", "time", 1.4),
)


class Budget:
    """Seconds left of the run; `spent` once they are gone."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    @property
    def spent(self) -> bool:
        return time.monotonic() >= self.end


def build(option: str, dims: Dims, device: torch.device, allow_slow: bool) -> Callable[[int], None]:
    """A training step at a given batch size for `option`, its model seeded alike."""
    torch.manual_seed(0)
    with device:
        model = LM(dims)
    spec = activation_spec(model, option)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    precision = Precision("bf16-mixed", device=device, activations=spec, allow_slow=allow_slow)
    model, opt = precision.setup(model, opt)
    gen = torch.Generator(device=device).manual_seed(1)
    batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def step(batch: int) -> None:
        if batch not in batches:
            batches.clear()  # one batch held at a time
            tokens = torch.randint(
                0, dims.vocab, (batch, dims.seq + 1), device=device, generator=gen
            )
            batches[batch] = (tokens[:, :-1], tokens[:, 1:])
        tokens, targets = batches[batch]
        opt.zero_grad(set_to_none=True)
        with precision.forward_context():
            loss = lm_loss(model(tokens), targets)
        precision.backward(loss)
        precision.step(opt)

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def search(
    peak: Callable[[int], int], fit: tuple[int, int], limit: int, cap: int, check: bool = True,
    more: Callable[[], bool] = lambda: True,
) -> dict[str, Any]:  # fmt: skip
    """The largest batch whose measured `peak(batch)` is at most `limit` (at most `cap`): a
    line through the peaks at the two `fit` batches predicts it; then each probe is the line
    through the two largest batches measured so far, kept strictly between the largest
    measured fit and the smallest measured miss (their midpoint when the line is no help),
    until those two are adjacent. `check=False` keeps the first prediction; `more()` False
    (a spent budget) or `MAX_PROBES` peaks stop it unsettled, at the largest measured fit."""
    peaks: dict[int, int] = {}

    def measured(batch: int) -> int:
        peaks[batch] = peak(batch)
        return peaks[batch]

    def line(a: int, b: int) -> int:
        slope = (peaks[b] - peaks[a]) / (b - a)
        return int((limit - peaks[a]) // slope) + a if slope > 0 else cap

    low, high = measured(fit[0]), measured(fit[1])
    predicted = max(1, min(line(*fit), cap))
    settled = capped = False
    batch = predicted
    while check and len(peaks) < MAX_PROBES and more():
        measured(batch)
        fits = [b for b, p in peaks.items() if p <= limit]
        misses = [b for b, p in peaks.items() if p > limit]
        lo, hi = max(fits, default=0), min(misses, default=None)
        if hi is not None and hi - lo <= 1:
            settled = True
            break
        if hi is None and lo >= cap:
            capped = True
            break
        top = sorted(peaks)[-2:]
        guess = line(*top)
        ceiling = cap if hi is None else hi - 1
        batch = max(lo + 1, min(guess, ceiling))
        if batch in peaks:  # the line points at a measured batch: halve the gap instead
            batch = (lo + ceiling + 1) // 2
    fits = [b for b, p in peaks.items() if p <= limit]
    return {
        "fit_batches": list(fit),
        "peaks_at_fit": [low, high],
        "bytes_per_sample": (high - low) / (fit[1] - fit[0]),
        # (the slope near the limit: at large batches a recomputed block's transient grows
        # the peak faster than the saved activations do at the fit batches)
        "bytes_per_sample_at_top": _slope(peaks, *sorted(peaks)[-2:]),
        "predicted": predicted,
        "max_batch": max(fits, default=0) if check else predicted,
        "checked": settled,
        "capped": capped,
        "peaks": peaks,
    }


def _slope(peaks: dict[int, int], a: int, b: int) -> float:
    return (peaks[b] - peaks[a]) / (b - a)


def largest_batch(
    option: str, dims: Dims, device: torch.device, limit: int, fit: tuple[int, int], cap: int,
    budget: Budget, allow_slow: bool,
) -> dict[str, Any]:  # fmt: skip
    """The memory phase of one option on CUDA: `search` over its measured step peaks."""
    base = torch.cuda.memory_allocated(device)
    step = build(option, dims, device, allow_slow)
    step(fit[0])  # the optimizer's states exist from here on

    def peak(batch: int) -> int:
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(batch)
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base

    # offload: a step at the predicted batch would pin gigabytes of host memory
    found = search(peak, fit, limit, cap, option not in UNCHECKED, lambda: not budget.spent)
    return {"option": option, **found}


def time_options(
    options: list[str], dims: Dims, device: torch.device, batch: int, rounds: int, budget: Budget,
    allow_slow: bool, profile: bool = False,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Every option's step at `batch`, taking turns; medians and ratios to keep's."""
    steps = {}
    for option in options:
        steps[option] = build(option, dims, device, allow_slow)
        for _ in range(2):
            steps[option](batch)
    _sync(device)
    times: dict[str, list[float]] = {o: [] for o in options}
    for r in range(rounds):
        if budget.spent:
            break
        order = options[r % len(options) :] + options[: r % len(options)]
        for option in order:
            _sync(device)
            start = time.perf_counter()
            steps[option](batch)
            _sync(device)
            times[option].append(time.perf_counter() - start)
    out = {}
    for option in options:
        ratios = sorted(t / k for t, k in zip(times[option], times["keep"], strict=True))
        out[option] = {
            "ms": statistics.median(times[option]) * 1e3 if times[option] else None,
            "vs_keep": statistics.median(ratios) if ratios else None,
            "quartiles": (
                [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]] if ratios else None
            ),
            "rounds": len(times[option]),
        }
    if profile:
        for option in options:
            out[option]["profile"] = profile_step(steps[option], batch, device)
    del steps
    _release(device)
    return out


def profile_step(step: Callable[[int], None], batch: int, device: torch.device) -> dict[str, Any]:
    """One step under torch.profiler: its wall time, the device's kernel time and launches
    (a step whose wall time is far above its kernel time waits on the host: Python and
    dispatch), and the ops with the most host time of their own."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    _sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step(batch)
        _sync(device)
        wall = time.perf_counter() - start
    on_device = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
    ]
    copies = [e for e in on_device if e.name.startswith(("Memcpy", "Memset"))]
    kernels = [e for e in on_device if not e.name.startswith(("Memcpy", "Memset"))]
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "wall_ms": wall * 1e3,
        # (summed: kernels on several streams at once count each)
        "kernel_ms": sum(e.device_time for e in kernels) / 1e3,
        "kernels": len(kernels),
        "copy_ms": sum(e.device_time for e in copies) / 1e3,
        "top_host_ops": [
            {"op": e.key, "calls": e.count, "self_host_ms": e.self_cpu_time_total / 1e3}
            for e in ops[:8]
        ],
    }


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def _unsettled(m: dict[str, Any]) -> str:
    """A largest batch the search did not settle: the prediction alone (unmeasured), or the
    largest measured fit when the budget or the probe limit stopped it."""
    if len(m["peaks"]) <= 2:
        return f"{m['predicted']} (predicted from the fit, unmeasured)"  # (at most the cap)
    return f">= {m['max_batch']} (unsettled)"


def markdown(report: dict[str, Any]) -> str:
    meta = report["metadata"]
    memory, timing = report["memory"], report["time"]
    keep_batch = memory.get("keep", {}).get("max_batch")
    lines = [
        f"# Activation options on {meta['device_name']} (torch {meta['torch']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Model: decoder LM {meta['dims']}, {meta['parameters'] / 1e6:.1f}M parameters, "
        f"bf16-mixed, AdamW. Memory limit {_mib(meta['limit'])} MiB "
        "(`max_memory_allocated` of one step over what was allocated before the model); "
        f"times at batch {meta['time_batch']}.",
        "",
        f"| activations | largest batch under the limit | vs keep | peak at batch "
        f"{meta['fit'][1]} (MiB) | MiB per sample (fit; near the limit) | ms/step "
        "| vs keep (paired median; quartiles) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for option in meta["options"]:
        m, t = memory.get(option), timing.get(option)
        if option in report["skipped"]:
            lines.append(f"| {option} | skipped: {report['skipped'][option]} | | | | | |")
            continue
        batch = vs = peak = per = "-"
        if m:
            batch = str(m["max_batch"])
            if m["capped"]:
                batch = f">= {batch} (the cap)"
            elif not m["checked"]:
                batch = _unsettled(m)
            if keep_batch and (m["checked"] or m["capped"]):
                vs = f"{m['max_batch'] / keep_batch:.2f}x"
                vs = (">= " if m["capped"] else "") + vs
            peak = _mib(m["peaks_at_fit"][1])
            per = f"{_mib(m['bytes_per_sample'])}; {_mib(m['bytes_per_sample_at_top'])}"
        ms = ratio = "-"
        if t and t["ms"] is not None:
            ms = f"{t['ms']:.1f}"
            q = t["quartiles"]
            ratio = f"{t['vs_keep']:.3f}x ({q[0]:.3f}-{q[1]:.3f})"
        lines.append(f"| {option} | {batch} | {vs} | {peak} | {per} | {ms} | {ratio} |")
    profiled = {o: t["profile"] for o, t in timing.items() if t.get("profile")}
    if profiled:
        lines += [
            "",
            "One step profiled (wall time against the device's kernel time: the rest is the "
            "host's Python and dispatch, or waits):",
            "",
            "| activations | wall ms | kernel ms | kernels | copy ms | ops with the most host "
            "time (calls, ms) |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for option, prof in profiled.items():
            top = "; ".join(
                f"{o['op']} ({o['calls']}, {o['self_host_ms']:.1f})"
                for o in prof["top_host_ops"][:5]
            )
            lines.append(
                f"| {option} | {prof['wall_ms']:.1f} | {prof['kernel_ms']:.1f} "
                f"| {prof['kernels']} | {prof.get('copy_ms', 0.0):.1f} | {top} |"
            )
    lines += ["", "Targets:", ""]
    for option, what, bound in TARGETS:
        if what == "batch":
            m = memory.get(option)
            if not (m and keep_batch and (m["checked"] or m["capped"])):
                lines.append(f"- {option} batch >= {bound}x keep's: not measured")
                continue
            got = m["max_batch"] / keep_batch
            verdict = "met" if got >= bound else "missed"
            lines.append(f"- {option} largest batch >= {bound}x keep's: {verdict} ({got:.2f}x)")
        else:
            t = timing.get(option)
            if not (t and t["vs_keep"] is not None):
                lines.append(f"- {option} step <= {bound}x keep's: not measured")
                continue
            got = t["vs_keep"]
            verdict = "met" if got <= bound else "missed"
            lines.append(f"- {option} step time <= {bound}x keep's: {verdict} ({got:.3f}x)")
    return "\n".join(lines) + "\n"


def write(out: Path, report: dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(markdown(report))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--options", nargs="+", default=list(OPTIONS), choices=OPTIONS)
    parser.add_argument("--limit", default="8GiB", help="memory limit (10GiB, 512MiB, ...)")
    parser.add_argument("--fit", type=int, nargs=2, default=[4, 8], help="two batch sizes")
    parser.add_argument("--cap", type=int, default=96, help="the largest batch probed")
    parser.add_argument("--time-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--budget", type=float, default=90.0, help="seconds for the run")
    parser.add_argument(
        "--profile", action="store_true", help="also profile one step of each option"
    )
    parser.add_argument("--tiny", action="store_true", help="a smoke test: TINY dims")
    parser.add_argument("--allow-slow", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("activations"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: pass --device cpu (with --tiny for a smoke test)")
        return 2
    dims, rounds, time_batch = (TINY, 2, 2) if args.tiny else (FULL, args.rounds, args.time_batch)
    dims = replace(dims, batch=time_batch)
    options = ["keep", *(o for o in args.options if o != "keep")]
    budget = Budget(args.budget)
    args.out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "benchmarks/gpu/activations.py", *given])
    with torch.device("meta"):
        parameters = sum(p.numel() for p in LM(dims).parameters())
    report: dict[str, Any] = {
        "metadata": {
            "command": command,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "dims": asdict(dims),
            "parameters": parameters,
            "limit": parse_bytes(args.limit),
            "fit": args.fit,
            "time_batch": time_batch,
            "options": list(options),
        },
        "memory": {},
        "time": {},
        "skipped": {},
    }
    if "offload" in options and device.type != "cuda":
        report["skipped"]["offload"] = "CUDA only"
        options.remove("offload")
    if device.type == "cuda":
        # what a process allocates once (cuBLAS workspaces...) before the first base reading,
        # so that no option's peaks carry it
        build("keep", dims, device, args.allow_slow)(args.fit[0])
        _release(device)
        for option in options:
            if budget.spent:
                break
            _release(device)
            report["memory"][option] = largest_batch(
                option, dims, device, report["metadata"]["limit"], tuple(args.fit), args.cap,
                budget, args.allow_slow,
            )  # fmt: skip
            _release(device)
            m = report["memory"][option]
            print(f"{option}: largest batch {m['max_batch']} (predicted {m['predicted']})")
            write(args.out, report)
    if not budget.spent:
        report["time"] = time_options(
            options, dims, device, time_batch, rounds, budget, args.allow_slow, args.profile
        )
    write(args.out, report)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
