"""The API reference (docs/api.md) has an entry for every mixprec class and function the
docs' and the README's examples use, and renders dataclass fields with types and meanings."""

import ast
import importlib
import inspect
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _dotted_uses(code: str) -> set[str]:
    """Every dotted name the code reaches from a mixprec import: `mixprec.bench.plan`,
    `PolicyMap.load` (imported from mixprec.policy.map) as `mixprec.policy.map.PolicyMap.load`."""
    tree = ast.parse(code)
    alias: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "mixprec":
                    alias[a.asname or "mixprec"] = a.name if a.asname else "mixprec"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mixprec":
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    uses = set()
    for node in ast.walk(tree):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in alias:
            uses.add(".".join([alias[node.id], *reversed(parts)]))
    return uses


def _walk(path: str, stop_at_object: bool):
    """The object `path` names: the whole path, or (`stop_at_object`) the first object along
    it that is not a plain module (a class's method is documented with its class)."""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            try:
                obj = importlib.import_module(".".join(parts[: i + 1]))
            except ImportError:
                return None
        if stop_at_object and (not isinstance(obj, types.ModuleType) or callable(obj)):
            return obj
    return obj


def _documented() -> set[int]:
    entries = re.findall(r"^::: (\S+)", API.read_text(), re.M)
    return {id(_walk(e, stop_at_object=False)) for e in entries}


def test_every_class_and_function_the_examples_use_has_a_reference_entry():
    documented = _documented()
    missing = {}
    for page in PAGES:
        for code in BLOCK.findall(page.read_text()):
            for use in _dotted_uses(code):
                obj = _walk(use, stop_at_object=True)
                if obj is None or not (isinstance(obj, type) or callable(obj)):
                    continue
                if id(obj) not in documented:
                    missing.setdefault(use, page.name)
    assert not missing, f"no entry in docs/api.md for {missing}"


FIELDS = [
    ("mixprec.bench.BenchOptions", 18),
    ("mixprec.hardware.DeviceInfo", 12),
    ("mixprec.plan.SearchReport", None),
    ("mixprec.doctor.diagnosis.Recommendation", None),
]


@pytest.mark.parametrize(("path", "count"), FIELDS)
def test_dataclass_fields_are_described_where_the_reference_renders_them(path, count):
    """mkdocstrings renders a google-style ``Attributes:`` section as a table of name, type
    (from the annotation) and meaning: every field must be in it."""
    import dataclasses

    obj = _walk(path, stop_at_object=False)
    fields = [f.name for f in dataclasses.fields(obj)]
    if count is not None:
        assert len(fields) == count
    doc = inspect.getdoc(obj) or ""
    assert "Attributes:" in doc, path
    section = doc.split("Attributes:", 1)[1]
    described = re.findall(r"^\s{4}(\w+)(?: \([^)]*\))?:", section, re.M)
    assert described == fields, path
    assert id(obj) in _documented(), f"{path} has no entry in docs/api.md"
