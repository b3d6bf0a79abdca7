"""`mixprec doctor path/to/file.py:factory --precision 16-mixed`: argument parsing and printing.

The factory takes no arguments and returns `(model, batch, loss_fn)`, or `(model, batch)`
for a model that gives its own loss: a TrainingModule or LightningModule (`training_step`),
a Hugging Face model (a dict batch with labels), or a model whose forward returns the loss.
Exit status: 0 when the target run passes (finite, no broken module, loss and gradient within
--tolerance of the reference), 1 when it does not, 2 for bad arguments (what mixprec
refuses before the model runs; a reference run that is not finite itself) (3: an error
that stops it, the model's or its loss's own included, from `mixprec.cli`, with its
traceback).

``--search --memory 0.5`` (or ``--speed``) chooses a format per layer instead
(`mixprec.plan.search`): the factory may then return a dict with ``batches`` (a list) and
``eval_batches`` (held-out) instead of one ``batch``. Exit status 0 when the verified plan's
loss is within --tolerance of the baseline's, 1 when not, 2 for bad arguments or a budget
nothing fits (the message names the smallest reachable).

``--fit SIZE`` (a size with its unit, ``"4GiB"``) searches with ``count="training"`` at
the batch of the factory's batches (formats and each block's activation option,
`mixprec.plan.fitting`), measures the plan's
training step in a fresh process (the factory is called there again: it must build the same
model each call), steps down to the next cheaper plan while the measured peak is over, and
writes the policy file of the plan that fits with the least loss, and fit.md (every plan
measured; written when none fits too). Exit status 0 when one fits, 1 when none does (the
message and fit.md say how many bytes the smallest plan is over), 2 for bad arguments (a
size it cannot read) or the measuring process failing (its output's tail said), 3 for an
error of the model's own, with its traceback.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import sys
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mixprec.bench import forkserver
from mixprec.bench.factory import FactoryError, call_factory, load_factory
from mixprec.cli.outputs import check_output_dir
from mixprec.doctor.diagnosis import Diagnosis, ReferenceRunError, diagnose
from mixprec.doctor.report import REPORT_FILES, scale_needed, writes_policy
from mixprec.doctor.verdicts import DEFAULT_TOLERANCE, QUANTIZED_TOLERANCE, scale_text
from mixprec.errors import LossTypeError, PolicySpecError, PrecisionError
from mixprec.files import write_atomically

__all__ = [
    "fit_child",
]


def _unpack(made: Any) -> tuple[Any, Any, Any]:
    if isinstance(made, dict):
        keys = {"model", "batch", "loss_fn"}
        unknown = sorted(set(made) - keys)
        missing = [k for k in ("model", "batch") if k not in made]
        if unknown or missing:
            wrong = (
                f"unknown keys {unknown}" if unknown else "no " + " or ".join(map(repr, missing))
            )
            raise FactoryError(
                f"the factory's dict has {wrong}; it takes 'model', 'batch' and optionally "
                "'loss_fn' (or 'batches' with --search)"
            )
        made = (made["model"], made["batch"], made.get("loss_fn"))
    if isinstance(made, (tuple, list)) and len(made) in (2, 3):
        model, batch, *rest = made
        return model, batch, rest[0] if rest else None
    raise FactoryError(
        "the factory must return (model, batch, loss_fn), (model, batch) for a model that "
        "gives its own loss (TrainingModule, LightningModule, Hugging Face model with labels "
        "in the batch), or a dict with 'model', 'batch' and optionally 'loss_fn'; got "
        f"{type(made).__name__}"
    )


def _search_inputs(made: Any) -> tuple[Any, list[Any], Any, list[Any] | None, Any]:
    """(model, batches, loss_fn, eval_batches, train_batches) of a factory's result for
    --search."""
    if isinstance(made, dict) and "batches" in made:
        if "batch" in made:
            raise FactoryError("the factory's dict has both 'batch' and 'batches': give one")
        keys = {"model", "batches", "eval_batches", "train_batches", "loss_fn"}
        unknown = sorted(set(made) - keys)
        if unknown:
            raise FactoryError(
                f"unknown keys {unknown} in the factory's dict; it takes {sorted(keys)}"
            )
        if "model" not in made:
            raise FactoryError("the factory's dict has 'batches' but no 'model': give both")
        return (
            made.get("model"),
            made["batches"],
            made.get("loss_fn"),
            made.get("eval_batches"),
            made.get("train_batches"),
        )
    model, batch, loss_fn = _unpack(made)
    return model, [batch], loss_fn, None, None


class _ModelRuns:
    """Within it, whether a module's forward has begun (any module's: a run copies the
    model). An error the model or its loss raises comes after that, and goes on to the
    exit-3 path with its traceback; mixprec's own checks of its arguments come before."""

    def __init__(self) -> None:
        self.began = False
        self._handle: Any = None

    def __enter__(self) -> _ModelRuns:
        from torch.nn.modules.module import register_module_forward_pre_hook

        def began(module: Any, args: Any) -> None:
            self.began = True
            self._handle.remove()  # (once: a global hook slows every module call, timed too)

        self._handle = register_module_forward_pre_hook(began)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()  # (removing twice is nothing)

    def bad_input(self, error: Exception) -> bool:
        """Whether `error` says the input is bad (exit 2): mixprec's own refusals, or a
        TypeError / ValueError raised before the model ran (an argument check)."""
        own = (FactoryError, LossTypeError, PolicySpecError, PrecisionError, ReferenceRunError)
        return isinstance(error, own) or not self.began


def _planned(
    args: argparse.Namespace,
    flag: str,
    files: tuple[str, ...],
    run: Any,
    refused: tuple[type[Exception], ...] = (),
) -> tuple[Any, Path | None] | int:
    """What `--search` and `--fit` share: the report directory checked before any work, the
    factory's inputs, the options both take, bad input as exit status 2 (with `refused`,
    more exceptions that mean it), and each warning printed once as a note. `run(inputs,
    options)` does the work; returns its report and the directory, or the exit status."""
    from rich.console import Console

    from mixprec.plan import BudgetError

    err = Console(stderr=True, soft_wrap=True)
    out = None
    bad = (BudgetError, FactoryError, PolicySpecError, PrecisionError, TypeError, ValueError)
    runs = _ModelRuns()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if not args.no_report:
                out = args.out or _numbered(Path("doctor-report"))
                check_output_dir(out, "--out", keep=files)
            inputs = _search_inputs(call_factory(load_factory(args.factory), args.factory))
            options = {
                "formats": [f.strip() for f in args.formats.split(",")] if args.formats else None,
                "baseline": args.baseline or "bf16-mixed",
                "eval_batches": inputs[3],
                "tolerance": args.tolerance if args.tolerance is not None else 0.01,
                "lr": args.lr or 1e-3,
                "device": args.device,
                "allow_slow": args.allow_slow,
                "seed": args.seed,
            }
            with runs:
                report = run(inputs, options)
        except (*bad, *refused) as error:
            if not (runs.bad_input(error) or isinstance(error, (BudgetError, *refused))):
                raise  # (the model's or its loss's own error: exit 3, with its traceback)
            err.print(f"[red]mixprec doctor {flag}: {error}[/]")
            return 2
    for note in _once(str(w.message) for w in caught):
        err.print(f"[dim]note: {note}[/]")
    return report, out


def _search(args: argparse.Namespace) -> int:
    from mixprec import textout
    from mixprec.plan import search
    from mixprec.plan.report import REPORT_FILES as SEARCH_FILES

    budget = {k: v for k, v in (("memory", args.memory), ("speed", args.speed)) if v}

    def run(inputs: tuple[Any, ...], options: dict[str, Any]) -> Any:
        if not budget:
            raise ValueError("--search needs a budget: --memory FRACTION and/or --speed FRACTION")
        model, batches, loss_fn, _, train_batches = inputs
        return search(
            model,
            batches,
            loss_fn,
            budget=budget,
            count=args.count or "weights",
            train_steps=args.train_steps,
            train_batches=train_batches,
            **options,
        )

    done = _planned(args, "--search", SEARCH_FILES, run)
    if isinstance(done, int):
        return done
    report, out = done
    console = textout.console()
    console.print(report.__rich__())
    if out is not None:
        policy = report.save(out, _search_command(args))
        console.print(f"\nplan: {policy} (report: {policy.parent / 'search.md'})")
    return 0 if report.met else 1


# what a fresh process runs to measure plans: `fit_child` with its arguments
FIT_FILES = ("policy.json", "fit.md")


def fit_child(argv: list[str]) -> None:
    """A fresh process's measurement for ``--fit``: ``argv`` is a JSON spec (the factory,
    the plans as policy configs, device, seed, lr) and the file the peaks go to."""
    from mixprec.plan.fitting import step_peaks
    from mixprec.policy.map import PolicyMap

    spec, path = json.loads(argv[0]), argv[1]
    model, batches, loss_fn, _, _ = _search_inputs(
        call_factory(load_factory(spec["factory"]), spec["factory"])
    )
    peaks = step_peaks(
        model,
        list(batches)[0],
        loss_fn,
        [PolicyMap.from_config(c) for c in spec["plans"]],
        device=spec["device"],
        seed=spec["seed"],
        lr=spec["lr"],
    )
    Path(path).write_text(json.dumps([[p.bytes, p.loss] for p in peaks]))


class MeasureError(RuntimeError):
    """The fresh process measuring `--fit`'s plans failed (its exit code and output's tail):
    exit 2, where an error of the model's own exits 3 with its traceback."""


def _fresh_measure(args: argparse.Namespace) -> Any:
    """Measures each plan in a fresh process of its own (`fit_child`, forked from
    `mixprec.bench.forkserver`, else a new interpreter): nothing a plan measured before it
    ran leaves its mark on the allocator."""
    from mixprec.plan.fitting import Peak

    def measure(plans: list[Any]) -> list[Peak]:
        return [peak for plan in plans for peak in measure_one(plan)]

    def measure_one(plan: Any) -> list[Peak]:
        spec = {
            "factory": args.factory,
            "plans": [plan.to_config()],
            "device": args.device,
            "seed": args.seed,
            "lr": args.lr or 1e-3,
        }
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "peaks.json"
            argv = [json.dumps(spec), str(out)]
            code, output = forkserver.run_fresh(
                "mixprec.cli.doctor:fit_child", argv, dict(os.environ)
            )
            if code != 0 or not out.exists():
                tail = output.strip()[-1500:]
                raise MeasureError(
                    f"the process measuring the plans exited with code {code}: {tail}"
                )
            return [Peak(bytes=int(b), loss=float(x)) for b, x in json.loads(out.read_text())]

    return measure


def _fit(args: argparse.Namespace) -> int:
    from rich.console import Console

    from mixprec import textout
    from mixprec.plan.budget import parse_bytes
    from mixprec.plan.fitting import fit

    try:
        budget = parse_bytes(args.fit)
    except ValueError as error:
        Console(stderr=True).print(f"[red]mixprec doctor --fit: {error}[/]")
        return 2

    def run(inputs: tuple[Any, ...], options: dict[str, Any]) -> Any:
        model, batches, loss_fn, _, _ = inputs
        return fit(model, batches, loss_fn, budget=budget, measure=_fresh_measure(args), **options)

    # the process measuring the plans failed, and says why (not the model's own error)
    done = _planned(args, "--fit", FIT_FILES, run, refused=(MeasureError,))
    if isinstance(done, int):
        return done
    report, out = done
    console = textout.console()
    console.print(report.summary(), markup=False, highlight=False)
    if out is not None:
        console.print(f"\n{_write_fit(args, report, out)}")
    return 0 if report.chosen is not None else 1


def _write_fit(args: argparse.Namespace, report: Any, out: Path) -> str:
    """Write fit.md (every plan measured; when none fits, how far the smallest is over)
    and, when a plan fits, its policy.json; returns the line saying where they are."""
    out.mkdir(parents=True, exist_ok=True)
    command = _search_command(args)
    write_atomically(
        out / "fit.md",
        f"# Plan fitting {args.fit}\n\nCommand: `{command}`\n\n```\n{report.summary()}\n```\n",
    )
    if report.chosen is None:
        return f"report: {out / 'fit.md'} (no plan fits: no policy.json written)"
    policy = report.chosen.policy.save(out / "policy.json")
    return f"plan: {policy} (report: {out / 'fit.md'})"


def _search_command(args: argparse.Namespace) -> str:
    """The command line that repeats this search (into another --out)."""
    words = ["mixprec", "doctor", args.factory]
    words += ["--fit", args.fit] if args.fit is not None else ["--search"]
    for flag, value in (
        ("--memory", args.memory),
        ("--speed", args.speed),
        ("--formats", args.formats),
        ("--baseline", args.baseline),
        ("--count", args.count if args.fit is None else None),
        ("--tolerance", args.tolerance),
        ("--train-steps", args.train_steps or None),
        ("--lr", args.lr),
        ("--device", args.device),
        ("--seed", args.seed),
    ):
        if value is not None:
            words += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    if args.allow_slow:
        words.append("--allow-slow")
    return " ".join(shlex.quote(w) for w in words)


# the diagnosis's options, which a search does not take (flag, the value it defaults to)
_DIAGNOSIS_ONLY = (
    ("--precision", "precision", "16-mixed"),
    ("--reference", "reference", "32-true"),
    ("--loss-scale", "loss_scale", None),
    ("--optimizer", "optimizer", None),
    ("--master-weights", "master_weights", None),
    ("--compensation", "compensation", None),
    ("--no-recommend", "no_recommend", False),
    ("--states", "states", None),
)


def _check_args(args: argparse.Namespace) -> int | None:
    """Exit status 2, the reason printed, for options that do not go together; else None."""
    if args.no_report and args.out is not None:
        print(
            "mixprec doctor: --out names the report's directory; --no-report writes none: "
            "give one of them",
            file=sys.stderr,
        )
        return 2
    if args.fit is not None:
        for flag, given in (
            ("--search", args.search),
            ("--memory", args.memory),
            ("--speed", args.speed),
            ("--train-steps", args.train_steps),
            ("--count", args.count),
        ):
            if given:
                print(
                    f"mixprec doctor: {flag} does not go with --fit (--fit searches within the "
                    "bytes it is given and measures each plan)",
                    file=sys.stderr,
                )
                return 2
    if args.search or args.fit is not None:
        what = "--fit" if args.fit is not None else "--search"
        for flag, name, default in _DIAGNOSIS_ONLY:
            if getattr(args, name) != default:
                hint = " (the search's precision is --baseline)" if flag == "--precision" else ""
                print(f"mixprec doctor: {flag} is not an option of {what}{hint}", file=sys.stderr)
                return 2
        return None
    if args.states is not None:
        from mixprec.optim.states import parse_state_format

        try:
            parse_state_format(args.states)
        except ValueError as error:
            print(f"mixprec doctor: --states: {error}", file=sys.stderr)
            return 2
    for flag, given in (
        ("--memory", args.memory),
        ("--speed", args.speed),
        ("--formats", args.formats),
        ("--train-steps", args.train_steps),
        ("--count", args.count),
        ("--baseline", args.baseline),
        ("--allow-slow", args.allow_slow),
    ):
        if given:
            also = " and --fit" if flag in ("--baseline", "--allow-slow") else ""
            hint = " (the diagnosis's precision is --precision)" if flag == "--baseline" else ""
            print(f"mixprec doctor: {flag} is an option of --search{also}{hint}", file=sys.stderr)
            return 2
    for flag, given, what in (
        ("--optimizer", args.optimizer, "how --lr sizes a step"),
        ("--master-weights", args.master_weights, "where --lr's steps are taken"),
        ("--compensation", args.compensation, "how --lr's steps are kept"),
    ):
        if given is not None and args.lr is None:
            print(f"mixprec doctor: {flag} says {what}; give --lr too", file=sys.stderr)
            return 2
    return None


def _run(args: argparse.Namespace) -> int:
    status = _check_args(args)
    if status is not None:
        return status
    if args.fit is not None:
        return _fit(args)
    if args.search:
        return _search(args)
    from rich.console import Console

    from mixprec import textout

    console = textout.console()
    err = Console(stderr=True, soft_wrap=True)
    runs = _ModelRuns()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if not args.no_report:
                out = args.out or _numbered(Path("doctor-report"))
                check_output_dir(out, "--out", keep=REPORT_FILES)
                if importlib.util.find_spec("matplotlib") is None:  # not after the runs
                    raise ValueError(
                        "the report's plots need matplotlib, which is not installed: pip "
                        "install 'matplotlib>=3.7' 'torch==2.13.0' (the plot extra), or pass "
                        "--no-report"
                    )
            model, batch, loss_fn = _unpack(call_factory(load_factory(args.factory), args.factory))
            with runs:
                diagnosis = _diagnose(args, model, batch, loss_fn)
        except (FactoryError, PolicySpecError, PrecisionError, TypeError, ValueError) as error:
            if not runs.bad_input(error):
                raise  # (the model's or its loss's own error: exit 3, with its traceback)
            err.print(f"[red]mixprec doctor: {error}[/]")
            return 2
        console.print(diagnosis.__rich__())
        found, unrecommended = None, None
        # (also with no finding: an error built up across layers misses the tolerance,
        # and the recommendation says what fixes it or why nothing does)
        if not args.no_recommend and (diagnosis.findings or not diagnosis.passes(args.tolerance)):
            found, unrecommended = _recommend(diagnosis, args.tolerance, console, err)
        hurt = _state_check(args, model, batch, loss_fn, console, err)
        if hurt is None:
            return 2
    for note in _once(str(w.message) for w in caught):
        err.print(f"[dim]note: {note}[/]")
    check = _check_command(args, diagnosis, found, None if args.no_report else out)
    if not args.no_report:
        path = diagnosis.save(out, found, unrecommended=unrecommended, check=check)
        policy_file = path.parent / "policy.json"
        written = f"; policy: {policy_file}" if policy_file.exists() else ""
        if found is not None and found.loss_scale is not None:
            scale = scale_text(found.loss_scale)
            written += (
                f"; the fix also needs --loss-scale {scale}"
                if policy_file.exists()
                else f"; no policy.json: the fix is --loss-scale {scale} alone"
            )
        console.print(
            f"\nreport: {path} (plots: {path.parent / 'error.png'}, {path.parent / 'range.png'}"
            f"{written})"
        )
    if check is not None:
        console.print(f"check the fix again: {check}", markup=False, highlight=False)
    return 0 if diagnosis.passes(args.tolerance) and not hurt else 1


def _diagnose(args: argparse.Namespace, model: Any, batch: Any, loss_fn: Any) -> Diagnosis:
    """`diagnose` with the command line's options."""
    return diagnose(
        model,
        batch,
        loss_fn,
        precision=args.precision,
        reference=args.reference,
        loss_scale=args.loss_scale,
        device=args.device,
        seed=args.seed,
        lr=args.lr,
        optimizer=args.optimizer or "adam",
        master_weights={"true": True, "false": False}.get(args.master_weights),
        compensation=args.compensation,
    )


def _check_command(
    args: argparse.Namespace, diagnosis: Diagnosis, found: Any, out: Path | None
) -> str | None:
    """The command that diagnoses the recommended fix again: its policy.json (in `out`, the
    report's directory; None: none is written) and its loss scale; None when there is no
    fix to check (no recommendation, or none needed), or its policy is in no file."""
    if found is None or not found.log:
        return None
    if writes_policy(diagnosis, found):
        if out is None:
            return None
        precision = str(out / "policy.json")
    else:
        precision = args.precision
    words = ["mixprec", "doctor", args.factory, "--precision", precision]
    scale = found.loss_scale if found.loss_scale is not None else args.loss_scale
    for flag, value in (
        ("--reference", args.reference if args.reference != "32-true" else None),
        ("--loss-scale", scale_text(scale) if scale is not None else None),
        ("--tolerance", f"{args.tolerance:g}" if args.tolerance is not None else None),
        ("--device", args.device),
        ("--seed", str(args.seed) if args.seed else None),
        ("--lr", f"{args.lr:g}" if args.lr is not None else None),
        ("--optimizer", args.optimizer),
        ("--master-weights", args.master_weights),
        ("--compensation", args.compensation),
    ):
        if value is not None:
            words += [flag, value]
    return " ".join(shlex.quote(w) for w in [*words, "--no-report"])


def _state_check(
    args: argparse.Namespace, model: Any, batch: Any, loss_fn: Any, console: Any, err: Any
) -> bool | None:
    """``--states``: the layers whose optimizer states that format hurts (printed); whether
    any is (None: a bad format, said on stderr)."""
    if args.states is None:
        return False
    from mixprec.doctor.state_errors import state_errors

    try:
        report = state_errors(
            model, [batch], loss_fn, states=args.states, lr=args.lr or 1e-3, seed=args.seed
        )
    except ValueError as error:
        err.print(f"[red]mixprec doctor: --states: {error}[/]")
        return None
    console.print(str(report), markup=False, highlight=False)
    return bool(report.hurting)


def _numbered(parent: Path) -> Path:
    """A new directory under `parent` named after the time, as the bench names its runs
    (``-2``, ``-3``, ... after it when a run in the same second took the name)."""
    name = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out, n = parent / name, 1
    while out.exists():
        n += 1
        out = parent / f"{name}-{n}"
    return out


def _once(messages: Iterable[str]) -> list[str]:
    """Each note once, in the order it came: the target run, the search for a fix and the
    check of that fix each convert the model, and each warns that the precision is slow."""
    return list(dict.fromkeys(messages))


def _recommend(
    diagnosis: Diagnosis, tolerance: float | None, console: Any, err: Any
) -> tuple[Any, str | None]:
    """(the recommendation, printed, or None; why there is none: `recommend`'s error)."""
    try:
        found = diagnosis.recommend(tolerance=tolerance)
    except PrecisionError as error:
        err.print(f"[red]no recommendation: {error}[/]")
        return None, str(error)
    if not found.log:
        console.print(
            f"\nno rule needed: the run is within tolerance {found.tolerance:g} as it is "
            "(the findings above are risks to watch, e.g. with PrecisionMonitor)"
        )
        return found, None
    console.print("\n[bold]fixing, one step at a time:[/]")
    for line in found.log:
        console.print(f"  {line}")
    console.print("\n[bold]recommended policy:[/]")
    if found.policy == diagnosis.precision:
        console.print(f"{found.policy.name} as it is (no rule needed)", highlight=False)
    else:
        console.print(found.to_code(), markup=False, highlight=False)
    needed = scale_needed(diagnosis, found)
    if needed:
        console.print(needed[0].upper() + needed[1:], markup=False, highlight=False)
    advice = found.scaler_advice()
    if advice:
        console.print(advice, markup=False, highlight=False)
    console.print("with it: " + found.verified.summary().splitlines()[0])
    return found, None


def _add_positive(group: Any, flag: str, help: str) -> None:
    """Add the option `flag`: a positive number (None when not given), refused as argparse
    reads it."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be a positive number, got {text}")
        return value

    group.add_argument(flag, type=parse, help=help)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `mixprec doctor` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "doctor",
        help="find the layers that break in low precision and the policy that fixes them",
        description=(
            "Run a model forward and backward in a reference and a target precision, compare "
            "every layer, and recommend a per-layer policy (and a loss scale where the scale "
            "is the problem). Exit status 0: the target run passes (finite, no broken layer, "
            "loss and gradient within --tolerance of the reference); 1: it does not; 2: bad "
            "arguments; 3: an error stops it, the model's or its loss's own included "
            "(traceback on stderr). With --search: 0 when the verified plan's loss is within "
            "--tolerance of the baseline's, 1 when not, 2 for bad arguments or a budget "
            "nothing fits."
        ),
    )
    p.add_argument(
        "factory",
        help="FILE.py:FACTORY or MODULE:FACTORY; the factory returns (model, batch, loss_fn) "
        "or (model, batch) for a TrainingModule, LightningModule or Hugging Face model",
    )
    p.add_argument(
        "--precision",
        default="16-mixed",
        help="target precision (16-mixed), or a policy file such as the policy.json the "
        "doctor writes with its recommendation",
    )
    p.add_argument("--reference", default="32-true", help="reference precision (32-true)")
    _add_positive(
        p,
        "--loss-scale",
        "loss scale of the target's backward (default: where a dynamic scaler starting at "
        "65536 runs the batch: halved until its gradients are finite)",
    )
    _add_positive(
        p,
        "--tolerance",
        f"relative loss/gradient error the fix must reach ({DEFAULT_TOLERANCE}; "
        f"{QUANTIZED_TOLERANCE} under a quantized policy); with --search, how far the plan's "
        "loss may exceed the baseline's (0.01)",
    )
    p.add_argument("--device", help="run on this device (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed of both runs")
    _add_positive(
        p,
        "--lr",
        "learning rate: also report the parameter updates that round away in 16-bit "
        "weights (true policies)",
    )
    p.add_argument(
        "--optimizer",
        choices=("adam", "sgd"),
        help="how --lr sizes a step: adam (about lr per weight, the default) or sgd "
        "(lr x gradient)",
    )
    p.add_argument(
        "--master-weights",
        choices=("true", "false"),
        type=str.lower,
        help="with --lr: whether 16-bit weights step through float32 masters, as "
        "Precision(master_weights=) takes it (default: float16 weights do, bfloat16 not)",
    )
    p.add_argument(
        "--compensation",
        choices=("kahan", "stochastic"),
        help="with --lr: the 16-bit weights' updates are compensated, as "
        "Precision(compensation=) takes it: none round away",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="report directory, which must not hold an earlier report (default: "
        "doctor-report/<date-time>/, a new one each run)",
    )
    p.add_argument("--no-recommend", action="store_true", help="only diagnose")
    p.add_argument(
        "--states",
        metavar="FORMAT",
        help="also check optimizer states in FORMAT (int8, int4, fp8): name the layers whose "
        "moments it stores with over 10%% error after 3 AdamW steps on the batch (exit 1 if any)",
    )
    _add_search_arguments(p)
    p.add_argument("--no-report", action="store_true", help="write no report files")
    p.set_defaults(func=_run)
    return p


def _add_search_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``mixprec doctor --search``, in their own help group."""
    search = p.add_argument_group(
        "format search",
        "choose a format per layer within a budget (mixprec.plan.search), verified by "
        "running the plan; writes policy.json, search.md and search.json",
    )
    search.add_argument("--search", action="store_true", help="search formats per layer")
    search.add_argument(
        "--fit",
        metavar="SIZE",
        help="search formats and activation options at the batch of the factory's batches "
        "and write the plan of least loss whose training step, measured in a fresh process, "
        "fits SIZE (4GiB, 512MB, 100000B); exit 1 when none does",
    )
    _add_positive(
        search,
        "--memory",
        "bytes budget: a fraction of the baseline's bytes of the searched layers (0.5)",
    )
    _add_positive(
        search,
        "--speed",
        "time budget: a fraction of the baseline's summed step time of those layers",
    )
    search.add_argument(
        "--formats",
        help="comma-separated formats to try (default: those fast on the device: 32-true, "
        "the baseline, bf16-true, int8 and int4 on the baseline...)",
    )
    search.add_argument("--baseline", help="the precision plans depart from (default bf16-mixed)")
    search.add_argument(
        "--count",
        choices=("weights", "training"),
        help="bytes of weights (the default), or also gradients and optimizer state "
        "(training); --search only",
    )
    search.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="also train the plan and the baseline this many AdamW steps (--lr, default 1e-3)",
    )
    search.add_argument(
        "--allow-slow",
        action="store_true",
        help="accept --formats the device runs far slower than float32",
    )
