"""The low-precision paths of issue 24 beside their anchors, on the machine in hand.

Three sections, each a set of callables that take turns call by call (after two warm-up
calls each), reporting each callable's median and fastest call; a row compares mixprec's
median with its anchors' in the same run, and checks the issue's targets on those medians.

- int8/int4 Linear (`mixprec.quantize`) against a float32 ``nn.Linear`` and, for int8,
  ``torch.ao.quantization.quantize_dynamic`` (torch's own dynamic int8 Linear), under
  ``torch.inference_mode``. The kernel each mixprec layer runs is printed (``layer.kernel``:
  it says when this CPU has none and the layer dequantizes or falls back).
- The optimizer step on ~2.1M bfloat16 parameters: mixprec's compensated AdamW through the
  public API (``Precision("bf16-true", compensation="kahan" | "stochastic")``) against
  torch-optimi's ``AdamW(kahan_sum=True)``, a plain bfloat16 torch AdamW and a float32 one.
- One training step of the char LM of examples/charlm.py (d 256, 4 layers, 32 x 128
  tokens): float32, mixprec's bf16-mixed, a raw ``torch.autocast`` loop and mixprec's
  bf16-true + Kahan.

An anchor that is not installed or fails here is reported missing, never skipped silently.
Rows whose targets are missed get a torch.profiler breakdown of mixprec's call (``--profile
all``: every row). A row is a `Line` of a `Group`; add one there.

    python benchmarks/kernels.py [--repeats 30] [--lm-repeats 10] [--only int4]
        [--threads N] [--profile missed|all|none] [--save | --out PATH.md]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Precision
from mixprec.hardware import SLOW, DeviceInfo, detect, dtype_support
from mixprec.quantize.int8 import cpu_int8_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import charlm  # noqa: E402

Call = Callable[[], object]
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Target:
    """mixprec's median at most ``ratio`` times the anchor's (0.33: 3x faster)."""

    anchor: str
    ratio: float
    words: str


@dataclass(frozen=True)
class Line:
    """One row of the table: mixprec's callable `mine` beside `anchors` of its group."""

    name: str
    mine: str
    anchors: tuple[str, ...]
    targets: tuple[Target, ...] = ()


@dataclass
class Group:
    """Callables that take turns, and the rows read from their times."""

    section: str
    calls: dict[str, Call]
    lines: list[Line]
    missing: dict[str, str] = field(default_factory=dict)  # anchor -> why it did not run
    notes: list[str] = field(default_factory=list)
    medians: dict[str, float] = field(default_factory=dict)  # ms
    fastest: dict[str, float] = field(default_factory=dict)  # ms


def anchor(
    calls: dict[str, Call], missing: dict[str, str], name: str, make: Callable[[], Call]
) -> None:
    """Add the anchor `name` built by `make` to `calls`, or say in `missing` why it cannot
    run here (not installed, or an engine this build lacks: it raises on its first call)."""
    try:
        call = make()
        call()
    except (ImportError, AttributeError, RuntimeError, NotImplementedError) as err:
        missing[name] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        return
    calls[name] = call


# --- int8/int4 Linear ------------------------------------------------------------------------


def ao_dynamic_int8(linear: nn.Linear, x: torch.Tensor) -> Call:
    """torch.ao's dynamic int8 Linear (per-tensor activations, fbgemm/oneDNN kernels)."""
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated, still the anchor
        warnings.simplefilter("ignore")
        model = torch.ao.quantization.quantize_dynamic(
            nn.Sequential(copy.deepcopy(linear)), {nn.Linear}, dtype=torch.qint8
        )
    return lambda: model(x)


AO = "torch.ao dynamic int8"
LINEARS = [  # (name, mode, features, outputs, tokens, targets)
    (
        "int4 Linear 4096x4096, 1 token (decode)", "int4", 4096, 4096, 1,
        (Target("float32", 1 / 3, ">= 3x faster than float32"),),
    ),
    (
        "int4 Linear 4096x4096, 256 tokens", "int4", 4096, 4096, 256,
        (Target("float32", 1.0, "no slower than float32"),),
    ),
    (
        "int8 Linear 1024x1024, 128 tokens", "int8", 1024, 1024, 128,
        (
            Target(AO, 1.1, "<= 1.1x torch.ao's time"),
            Target("float32", 1 / 1.5, ">= 1.5x faster than float32"),
        ),
    ),
    (
        "int8 Linear 4096x4096, 256 tokens", "int8", 4096, 4096, 256,
        (Target(AO, 1.1, "<= 1.1x torch.ao's time"),),
    ),
    ("int8 Linear 4096x4096, 1 token (decode)", "int8", 4096, 4096, 1, ()),
]  # fmt: skip


def linear_group(
    name: str, mode: str, features: int, outputs: int, tokens: int, targets: tuple[Target, ...]
) -> Group:
    """A Linear(features -> outputs) quantized by `mode` on `tokens` float32 tokens, beside
    the float32 Linear (and for int8 torch.ao's dynamic int8 Linear)."""
    torch.manual_seed(0)
    linear = nn.Linear(features, outputs)
    x = torch.randn(tokens, features)
    model = nn.Sequential(copy.deepcopy(linear))
    result = mixprec.quantize(model, mode)
    calls: dict[str, Call] = {"mixprec": lambda: model(x)}
    missing: dict[str, str] = {}
    anchors = (AO, "float32") if mode == "int8" else ("float32",)
    if mode == "int8":
        anchor(calls, missing, AO, lambda: ao_dynamic_int8(linear, x))
    anchor(calls, missing, "float32", lambda: lambda: linear(x))
    group = Group(
        "int8/int4 Linear (float32 inputs, torch.inference_mode)",
        calls,
        [Line(name, "mixprec", anchors, targets)],
        missing,
    )
    group.notes.append(f"{name}: mixprec ran {result.kernels['0']}")
    return group


# --- the optimizer step ----------------------------------------------------------------------


def mlp(dtype: torch.dtype) -> nn.Module:
    """512-1024-1024-512 (2.10M parameters), the model of benchmarks/compensated.py, with
    fixed gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512)
    ).to(dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def stepper(model: nn.Module, step: Callable[[], object]) -> Call:
    """An optimizer step on `model`'s gradients (put back should a step drop them)."""

    def call() -> None:
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.randn_like(p) * 1e-3
        step()

    return call


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def compensated(kind: str) -> Call:
    model = mlp(torch.bfloat16)
    precision = Precision("bf16-true", compensation=kind, allow_slow=True)
    model, _ = precision.setup(model, adamw(model))
    return stepper(model, precision.step)


def plain(dtype: torch.dtype) -> Call:
    model = mlp(dtype)
    return stepper(model, adamw(model).step)


def optimi_kahan() -> Call:
    import optimi

    model = mlp(torch.bfloat16)
    opt = optimi.AdamW(model.parameters(), lr=1e-3, kahan_sum=True, foreach=True)
    return stepper(model, opt.step)


OPTIMI = "torch-optimi AdamW(kahan_sum=True)"
BF16 = "bf16 torch AdamW"
STEP_TARGETS = (
    Target(OPTIMI, 1.0, "<= 1.0x torch-optimi's Kahan step"),
    Target(BF16, 1.2, "<= 1.2x plain bf16 AdamW"),
)


def step_group() -> Group:
    """mixprec's compensated AdamW steps beside optimi's Kahan AdamW and plain AdamW."""
    calls: dict[str, Call] = {
        "Kahan": compensated("kahan"),
        "stochastic": compensated("stochastic"),
    }
    missing: dict[str, str] = {}
    anchor(calls, missing, OPTIMI, optimi_kahan)
    anchor(calls, missing, BF16, lambda: plain(torch.bfloat16))
    anchor(calls, missing, "float32 torch AdamW", lambda: plain(torch.float32))
    anchors = (OPTIMI, BF16, "float32 torch AdamW")
    return Group(
        "AdamW step, 2.10M parameters (bfloat16 unless float32; torch AdamW foreach=True)",
        calls,
        [
            Line("bf16 + Kahan (mixprec Precision, compensation='kahan')", "Kahan", anchors,
                 STEP_TARGETS),
            Line("bf16 + stochastic rounding (mixprec, compensation='stochastic')", "stochastic",
                 anchors, STEP_TARGETS),
        ],
        missing,
    )  # fmt: skip


# --- a char LM training step -----------------------------------------------------------------


def lm_step(
    precision: Precision | None, autocast: bool = False, batch: int = 32, compile: bool = False
) -> Call:
    """One training step (forward, loss, backward, AdamW step) of examples/charlm.py's model
    on a fixed batch: through `precision` when given, else a plain torch loop (in
    ``torch.autocast`` bfloat16 when `autocast`). `compile`: the converted model compiled in
    place (inductor), as ``Trainer(compile=True)`` does."""
    torch.manual_seed(0)
    model = charlm.CharGPT(block=128, dim=256, layers=4)
    data = torch.randint(0, 256, (batch, 129))
    xy = (data[:, :-1], data[:, 1:])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    if precision is None:

        def call() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(xy[0])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), xy[1].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()

        return call
    model, wrapped = precision.setup(model, opt)
    if compile:
        model.compile()

    def step() -> None:
        with precision.forward_context():
            logits = model(xy[0])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), xy[1].flatten())
        precision.backward(loss)
        precision.step()
        wrapped.zero_grad()

    return step


# issue 24 item 4: the recommended precision at least twice float32's speed on a bf16 CPU
LM_TARGET = Target("float32", 0.5, ">= 2.0x faster than float32")


def lm_group() -> Group:
    """A char LM training step in float32, bf16-mixed (as the device decides its attention's
    dtype, with attention in bfloat16, and compiled), raw autocast and bf16-true + Kahan."""
    bf16_attention = mixprec.PolicyMap("bf16-mixed", float32_attention=False)
    calls = {
        "float32": lm_step(None),
        "bf16-mixed": lm_step(Precision("bf16-mixed", allow_slow=True)),
        "bf16-mixed, bf16 attention": lm_step(Precision(bf16_attention, allow_slow=True)),
        "bf16-mixed compiled": lm_step(Precision("bf16-mixed", allow_slow=True), compile=True),
        "torch.autocast bf16": lm_step(None, autocast=True),
        "bf16-true + Kahan": lm_step(Precision("bf16-true", compensation="kahan", allow_slow=True)),
    }
    attention = mixprec.explain(charlm.CharGPT(block=128, dim=256, layers=4), "bf16-mixed")
    return Group(
        "char LM training step (examples/charlm.py model: d 256, 4 layers, 32 x 128 tokens)",
        calls,
        [
            Line("bf16-mixed (mixprec Precision)", "bf16-mixed", ("torch.autocast bf16",
                 "bf16-mixed, bf16 attention", "float32"), (LM_TARGET,)),
            Line("bf16-mixed, float32_attention=False", "bf16-mixed, bf16 attention",
                 ("float32",)),
            Line("bf16-mixed + torch.compile (Trainer(compile=True))", "bf16-mixed compiled",
                 ("bf16-mixed", "float32"), (LM_TARGET,)),
            Line("bf16-true + Kahan (mixprec Precision)", "bf16-true + Kahan", ("float32",),
                 (LM_TARGET,)),
            Line("raw torch.autocast bf16 (no mixprec)", "torch.autocast bf16", ("float32",)),
        ],
        notes=[
            "char LM bf16-mixed: attention in float32 inside autocast in "
            + (", ".join(attention.float32_attention) or "no module")
            + f" ({next(iter(attention.float32_attention.values()), 'not on this device')})"
        ],
    )  # fmt: skip


# --- measuring and writing -------------------------------------------------------------------


def take_turns(calls: dict[str, Call], repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median and fastest ms per call of each callable, the callables called in turn
    `repeats` times after two warm-up calls each."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e3)
    return (
        {name: statistics.median(ts) for name, ts in times.items()},
        {name: min(ts) for name, ts in times.items()},
    )


def verdicts(group: Group, line: Line) -> list[tuple[str, bool | None]]:
    """Each target of `line`: (words with the measured ratio, met; None: not measured)."""
    out: list[tuple[str, bool | None]] = []
    for target in line.targets:
        if target.anchor not in group.medians:
            out.append((f"{target.words}: not measured ({target.anchor} missing)", None))
            continue
        ratio = group.medians[line.mine] / group.medians[target.anchor]
        met = ratio <= target.ratio
        out.append((f"{target.words}: {'met' if met else 'MISSED'} ({ratio:.2f}x its time)", met))
    return out


def profile(call: Call, calls: int = 5, top: int = 8) -> list[str]:
    """torch.profiler's ops with the most self CPU time over `calls` calls of `call`, as
    markdown rows: op, self ms per call, share of the self time."""
    call()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [
        f"| {e.key} | {e.self_cpu_time_total / 1e3 / calls:.3f} | "
        f"{100 * e.self_cpu_time_total / total:.0f}% |"
        for e in events[:top]
    ]


def cpu_kind(info: DeviceInfo) -> str:
    """The CPU kind the results are filed under: amx, avx512_bf16, avx2 or the machine."""
    for kind, flag in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx2", "avx2")):
        if flag in info.cpu_flags:
            return kind
    return os.uname().machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="calls per Linear/step row")
    parser.add_argument("--lm-repeats", type=int, default=10, help="char LM training steps")
    parser.add_argument("--only", default="", help="the rows whose section or name has this")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    parser.add_argument("--profile", choices=("missed", "all", "none"), default="missed")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--out", type=Path, default=None, help="also write the table here")
    out.add_argument(
        "--save", action="store_true", help="write results/kernels_<cpu>[_<N>thread].md"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = detect("cpu")

    builders: list[tuple[str, Callable[[], Group]]] = [
        (f"int Linear {row[0]}", lambda row=row: linear_group(*row)) for row in LINEARS
    ]
    builders += [("AdamW optimizer step Kahan stochastic", step_group)]
    builders += [("char LM training step", lm_group)]
    bf16 = dtype_support(torch.bfloat16, info)
    left_out = []
    load_before, start = os.getloadavg(), time.perf_counter()
    groups = []
    for words, build in builders:
        if args.only.lower() not in words.lower():
            continue
        if words.startswith("char LM") and bf16.status == SLOW and "char" not in args.only:
            left_out.append(  # hours of bf16 steps that say only what hardware already does
                f"char LM training step: left out, bfloat16 is slow here ({bf16.reason}); "
                "`--only 'char LM'` runs it anyway"
            )
            continue
        group = build()
        repeats = args.lm_repeats if group.section.startswith("char LM") else args.repeats
        with torch.inference_mode(group.section.startswith("int8/int4")):
            group.medians, group.fastest = take_turns(group.calls, repeats)
        groups.append(group)
    seconds, load_after = time.perf_counter() - start, os.getloadavg()

    int8 = cpu_int8_kernels()
    command = " ".join(["python benchmarks/kernels.py", *sys.argv[1:]])
    lines = [
        "# Low-precision paths beside their anchors (issue 24)",
        "",
        f"Command: `PYTHONPATH=src {command}`",
        f"Device: {info.describe()}; {torch.get_num_threads()} torch threads; "
        f"ATen CPU capability {torch.backends.cpu.get_cpu_capability()}; oneDNN int8 sums "
        f"{'exact' if int8['onednn'] is None else 'unusable: ' + str(int8['onednn'])}; "
        f"torch {torch.__version__}",
        f"Host load average (1, 5, 15 min): {', '.join(f'{v:.2f}' for v in load_before)} "
        f"before, {', '.join(f'{v:.2f}' for v in load_after)} after ({seconds:.0f} s).",
        "",
        f"Median ms of {args.repeats} calls per callable ({args.lm_repeats} char LM steps), "
        "the callables of a section taking turns call by call; in brackets the fastest call "
        "and its ratio, what a quiet host gives (other processes' bursts stall the OpenMP "
        "regions of every op). Ratios are mixprec's time over the anchor's: below 1 is "
        "faster. Targets compare medians.",
    ]
    missed: list[tuple[Group, Line]] = []
    section = None
    for group in groups:
        if group.section != section:
            section = group.section
            lines += ["", f"## {section}", "", "| row | ms [fastest] | anchors: ms (mixprec / "
                      "anchor) [fastest: ratio] | targets |", "|---|---:|---|---|"]  # fmt: skip
        for line in group.lines:
            mine, best = group.medians[line.mine], group.fastest[line.mine]
            cells = [
                f"{name}: {group.medians[name]:.3f} ({mine / group.medians[name]:.2f}x) "
                f"[{group.fastest[name]:.3f}: {best / group.fastest[name]:.2f}x]"
                for name in line.anchors
                if name in group.medians
            ] + [f"{name}: missing ({group.missing[name]})" for name in line.anchors
                 if name in group.missing]  # fmt: skip
            found = verdicts(group, line)
            if args.profile == "all" or (
                args.profile == "missed" and any(met is False for _, met in found)
            ):
                missed.append((group, line))
            lines.append(
                f"| {line.name} | {mine:.3f} [{best:.3f}] | {'; '.join(cells)} | "
                f"{'; '.join(words for words, _ in found) or '-'} |"
            )
    notes = [note for group in groups for note in group.notes] + left_out
    if notes:
        lines += ["", "Kernels (`QuantizeResult.kernels`) and islands (`mixprec.explain`):", ""]
        lines += [f"- {n}" for n in notes]
    if missed:
        lines += ["", "## Where mixprec's time goes (torch.profiler, self CPU time)"]
    for group, line in missed:
        lines += ["", f"{line.name}:", "", "| op | self ms per call | share |", "|---|---:|---:|"]
        calls = 2 if group.section.startswith("char LM") else 5
        with torch.inference_mode(group.section.startswith("int8/int4")):
            lines += profile(group.calls[line.mine], calls)
    text = "\n".join(lines) + "\n"
    print(text)
    threads = f"_{args.threads}thread" if args.threads else ""
    path = RESULTS / f"kernels_{cpu_kind(info)}{threads}.md" if args.save else args.out
    if path is not None:
        path.write_text(text)


if __name__ == "__main__":
    main()
