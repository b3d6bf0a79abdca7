"""The optimizer side lives in `mixprec.optim`: the old paths (``mixprec.states``,
``mixprec.compensated``, ``mixprec.scaling`` and their submodules) still import, each with a
DeprecationWarning naming the new path, and stand for the very same modules; mixprec itself
imports none of them."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

import mixprec
import mixprec.optim
from mixprec.optim.states import StateFormat

MOVED = [
    ("mixprec.states", "mixprec.optim.states"),
    ("mixprec.states.assign", "mixprec.optim.states.assign"),
    ("mixprec.states.buckets", "mixprec.optim.states.buckets"),
    ("mixprec.states.codecs", "mixprec.optim.states.codecs"),
    ("mixprec.states.formats", "mixprec.optim.states.formats"),
    ("mixprec.states.kernels", "mixprec.optim.states.kernels"),
    ("mixprec.states.optimizers", "mixprec.optim.states.optimizers"),
    ("mixprec.compensated", "mixprec.optim.compensated"),
    ("mixprec.compensated.compensator", "mixprec.optim.compensated.compensator"),
    ("mixprec.compensated.kernels", "mixprec.optim.compensated.kernels"),
    ("mixprec.compensated.rules", "mixprec.optim.compensated.rules"),
    ("mixprec.scaling", "mixprec.optim.scaling"),
]


def _forget(old: str) -> None:
    """Drop the old path (and its submodules) from the import system, so that importing it
    runs its stand-in again; the new modules stay loaded."""
    top = ".".join(old.split(".")[:2])
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]
    vars(mixprec).pop(top.split(".")[1], None)


@pytest.mark.parametrize(("old", "new"), MOVED, ids=[old for old, _ in MOVED])
def test_an_old_path_warns_naming_the_new_one_and_is_the_new_module(old: str, new: str) -> None:
    _forget(old)
    top_new = re.escape(".".join(new.split(".")[:3]))
    with pytest.warns(DeprecationWarning, match=f"moved to {top_new}") as w:
        __import__(old)  # (as an import statement does)
    assert sys.modules[old] is importlib.import_module(new)
    # told at the line that imported it, not inside the import machinery
    assert w[0].filename == __file__


def test_names_imported_through_an_old_path_are_the_new_ones() -> None:
    _forget("mixprec.states")
    with pytest.warns(DeprecationWarning, match="mixprec.optim.states"):
        from mixprec.states.formats import StateFormat as old
    assert old is StateFormat
    _forget("mixprec.scaling")
    with pytest.warns(DeprecationWarning, match="mixprec.optim.scaling"):
        from mixprec import scaling
    assert scaling.DynamicLossScaler is mixprec.DynamicLossScaler


def test_mixprec_imports_no_old_path() -> None:
    """Every module of the package loads without touching a moved path."""
    code = (
        "import pkgutil, warnings, importlib\n"
        "warnings.filterwarnings('error', message=r'mixprec\\.\\w+ moved to')\n"
        "import mixprec\n"
        "skip = ('mixprec.states', 'mixprec.compensated', 'mixprec.scaling')\n"
        "for m in pkgutil.walk_packages(mixprec.__path__, 'mixprec.'):\n"
        "    if m.name.endswith('__main__') or m.name.startswith(skip):\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ModuleNotFoundError as err:  # an integration's missing extra\n"
        "        if (err.name or '').startswith('mixprec'):\n"
        "            raise\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "ok"


def test_the_optim_package_gives_its_names_and_submodules_on_first_use() -> None:
    from mixprec.optim import LossScaleOptimizer, convert_for

    assert LossScaleOptimizer.__module__ == "mixprec.optim.wrapper"
    assert convert_for.__module__ == "mixprec.optim.conversion"
    assert {"states", "compensated", "scaling", "convert_for"} <= set(dir(mixprec.optim))
    assert mixprec.optim.scaling is importlib.import_module("mixprec.optim.scaling")
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        mixprec.optim.nothing  # noqa: B018
