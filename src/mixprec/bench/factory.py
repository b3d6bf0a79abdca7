"""Load a user's factory named ``path/to/file.py:name`` or ``package.module:name``.

`mixprec bench --model` and `mixprec doctor` both take such a reference; one loader means one
set of rules and one set of errors. The bench owns it because each of a benchmark's processes
builds its workload from the reference (`models.load_workload`); the doctor's command, a layer
above, borrows it. A file is imported as a module registered in ``sys.modules``
(dataclasses, ``from __future__ import annotations`` and pickling look their module up
there); a module name is imported from the working directory first, as ``python -m`` would.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from mixprec.errors import FactoryError

__all__ = [
    "FactoryError",
    "call_factory",
    "load_factory",
]


def parse_reference(reference: str) -> tuple[str, str]:
    """Split ``"file.py:name"`` / ``"module:name"`` into (target, name); FactoryError if the
    text is neither."""
    target, sep, attr = reference.rpartition(":")
    if not sep or not target or not attr.isidentifier():
        raise FactoryError(
            f"expected FILE.py:FACTORY or MODULE:FACTORY, got {reference!r} "
            "(e.g. examples/doctor_demo.py:make or my_models:make)"
        )
    return target, attr


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _where(err: BaseException) -> str:
    """`file:line` of the innermost frame of the user's code that raised `err`."""
    if isinstance(err, SyntaxError):
        return f"{err.filename}:{err.lineno}"
    frames = traceback.extract_tb(err.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise FactoryError(f"no such file: {path}")
    name = "_mixprec_factory_" + re.sub(r"\W", "_", str(path.resolve().with_suffix("")))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise FactoryError(f"cannot import {path} as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise FactoryError(
            f"importing {path} failed: {type(err).__name__}: {err} ({_where(err)})"
        ) from err
    return module


def _import_module(target: str) -> ModuleType:
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as err:
        raise FactoryError(f"cannot import module {target!r}: {err}") from None
    except Exception as err:
        raise FactoryError(
            f"importing module {target!r} failed: {type(err).__name__}: {err} ({_where(err)})"
        ) from err


def load_factory(reference: str) -> Callable[..., Any]:
    """The callable that ``reference`` names; FactoryError saying what is wrong otherwise."""
    target, attr = parse_reference(reference)
    module = _import_file(Path(target)) if _is_file(target) else _import_module(target)
    factory = getattr(module, attr, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise FactoryError(
            f"{target} has no callable {attr!r}; its callables: {', '.join(found) or 'none'}"
        )
    return factory


def call_factory(factory: Callable[..., Any], reference: str, *args: Any) -> Any:
    """Call a loaded factory; an exception inside it becomes a FactoryError naming it."""
    try:
        return factory(*args)
    except Exception as err:
        raise FactoryError(
            f"factory {reference} raised {type(err).__name__}: {err} ({_where(err)})"
        ) from err
