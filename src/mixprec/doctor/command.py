"""`mixprec doctor path/to/file.py:factory --precision 16-mixed`: argument parsing and printing.

The factory takes no arguments and returns `(model, batch, loss_fn)`, or `(model, batch)`
for a TrainingModule (or a model whose forward returns the loss). Exit status: 0 when the
target precision runs clean, 1 when a module is broken in it, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixprec.doctor.diagnosis import BROKEN, DEFAULT_TOLERANCE, Diagnosis, diagnose
from mixprec.errors import PolicySpecError, PrecisionError


class FactoryError(ValueError):
    """The `file.py:factory` argument could not be loaded or gave something unusable."""


def load_factory(spec: str) -> Callable[[], Any]:
    """Resolve "path/to/file.py:name" or "package.module:name" to the callable it names."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise FactoryError(
            f"expected FILE.py:FACTORY or MODULE:FACTORY, got {spec!r} "
            "(e.g. examples/doctor_demo.py:make)"
        )
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise FactoryError(f"no such file: {path}")
        module_spec = importlib.util.spec_from_file_location(f"_mixprec_doctor_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise FactoryError(f"cannot import {path} as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module  # dataclasses and pickling look it up
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise FactoryError(f"cannot import module {target!r}: {err}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        found = sorted(n for n in vars(module) if not n.startswith("_"))
        raise FactoryError(
            f"{target} has no callable {attr!r}; it defines: {', '.join(found) or 'nothing'}"
        )
    return factory


def _unpack(made: Any) -> tuple[Any, Any, Any]:
    if isinstance(made, dict):
        made = (made.get("model"), made.get("batch"), made.get("loss_fn"))
    if isinstance(made, (tuple, list)) and len(made) in (2, 3):
        model, batch, *rest = made
        return model, batch, rest[0] if rest else None
    raise FactoryError(
        "the factory must return (model, batch, loss_fn), (training_module, batch) or a dict "
        f"with 'model', 'batch' and optionally 'loss_fn'; got {type(made).__name__}"
    )


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    err = Console(stderr=True, soft_wrap=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model, batch, loss_fn = _unpack(load_factory(args.factory)())
            diagnosis = diagnose(
                model,
                batch,
                loss_fn,
                precision=args.precision,
                reference=args.reference,
                loss_scale=args.loss_scale,
                device=args.device,
                seed=args.seed,
            )
        except (FactoryError, PolicySpecError, PrecisionError, TypeError, ValueError) as error:
            err.print(f"[red]mixprec doctor: {error}[/]")
            return 2
        console.print(diagnosis.__rich__())
        if not args.no_recommend and diagnosis.findings:
            _recommend(diagnosis, args.tolerance, console, err)
    for note in sorted({str(w.message) for w in caught}):
        err.print(f"[dim]note: {note}[/]")
    if not args.no_report:
        path = diagnosis.save(args.out)
        console.print(
            f"\nreport: {path} (plots: {path.parent / 'error.png'}, {path.parent / 'range.png'})"
        )
    return 1 if any(m.verdict == BROKEN for m in diagnosis.modules.values()) else 0


def _recommend(diagnosis: Diagnosis, tolerance: float, console: Any, err: Any) -> None:
    try:
        recommended = diagnosis.recommend(tolerance=tolerance)
    except PrecisionError as error:
        err.print(f"[red]no recommendation: {error}[/]")
        return
    console.print("\n[bold]fixing, one module at a time:[/]")
    for line in diagnosis.recommend_log:
        console.print(f"  {line}")
    console.print("\n[bold]recommended policy:[/]")
    console.print(recommended.to_code(), markup=False, highlight=False)
    if diagnosis.fixed is not None:
        console.print("with it: " + diagnosis.fixed.summary().splitlines()[0])


def _loss_scale(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"loss scale must be positive, got {text}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `mixprec doctor` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "doctor",
        help="find the layers that break in low precision and the policy that fixes them",
        description=(
            "Run a model forward and backward in a reference and a target precision, compare "
            "every layer, and recommend a per-layer policy. Exit status 0: clean; 1: broken "
            "layers found; 2: bad arguments."
        ),
    )
    p.add_argument(
        "factory",
        help="FILE.py:FACTORY or MODULE:FACTORY; the factory returns (model, batch, loss_fn) "
        "or (training_module, batch)",
    )
    p.add_argument("--precision", default="16-mixed", help="target precision (16-mixed)")
    p.add_argument("--reference", default="32-true", help="reference precision (32-true)")
    p.add_argument(
        "--loss-scale",
        type=_loss_scale,
        default=None,
        help="loss scale of the target's backward (default: where a dynamic scaler settles)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help=f"relative loss/gradient error the fix must reach ({DEFAULT_TOLERANCE})",
    )
    p.add_argument("--device", default=None, help="run on this device (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed of both runs")
    p.add_argument("--out", default="doctor-report", help="report directory (doctor-report)")
    p.add_argument("--no-recommend", action="store_true", help="only diagnose")
    p.add_argument("--no-report", action="store_true", help="write no report files")
    p.set_defaults(func=_run)
    return p
