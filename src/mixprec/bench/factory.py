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
    """The file imported (afresh) as a module. Where its stem is a module name that imports
    this file or nothing (or a file imported here before), the module is imported under that
    name: a policy file's type rule naming ``stem.Class`` then names the class the model's
    instances have (a second import would make another class of the same name, matching
    none of them), and policies written from it name ``stem.Class`` too."""
    if not path.is_file():
        raise FactoryError(f"no such file: {path}")
    stem = path.stem
    known = sys.modules.get(stem) if stem.isidentifier() else None
    if known is not None:  # (imported before: replaced where it is this file, or one of ours)
        own = _ALIASED.get(stem) is known or (
            Path(getattr(known, "__file__", "") or "").resolve() == path.resolve()
        )
    else:
        own = stem.isidentifier() and _names_this_file(stem, path)
    name = (
        stem
        if own
        else "_mixprec_factory_" + re.sub(r"\W", "_", str(path.resolve().with_suffix("")))
    )
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise FactoryError(f"cannot import {path} as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        if known is not None and own:
            sys.modules[name] = known
        else:
            del sys.modules[name]
        raise FactoryError(
            f"importing {path} failed: {type(err).__name__}: {err} ({_where(err)})"
        ) from err
    if own:
        _ALIASED[stem] = module
    return module


# the factory files imported under their own names (a later file of the same name replaces
# one of them: in one process, as a notebook or the tests run several)
_ALIASED: dict[str, ModuleType] = {}


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


def _names_this_file(stem: str, path: Path) -> bool:
    """Whether importing `stem` would import `path` or nothing (never a standard or
    installed module of that name: registering the file under it would shadow that one)."""
    try:
        spec = importlib.util.find_spec(stem)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return stem not in sys.builtin_module_names
    return spec.origin is not None and Path(spec.origin).resolve() == path.resolve()


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
