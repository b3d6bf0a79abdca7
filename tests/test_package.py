"""The package's shape: a light top level, imports that point one way, no import cycles."""

from __future__ import annotations

import ast
import importlib
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import mixprec

SRC = Path(mixprec.__file__).parent

# Lower layers first; a module may import only from its own layer's package or from layers
# below it. Utilities with no knowledge of precision sit at the bottom.
LAYERS: list[set[str]] = [
    {"errors", "version", "textout", "timing", "memory", "tree", "files", "aliasing", "eager"},
    {"dtypes", "compensated", "optim.compensated", "optim.engine"},
    {"device"},
    {"formats"},
    {"policy.names"},
    {"policy"},
    {"quantize", "states", "optim.states", "activations"},
    {"policy.map", "policy.files", "policy.explanation"},
    {"hardware"},
    {"convert", "scaling", "optim.scaling", "hardware.measuring"},
    {"optim", "optim.checkpoint", "optim.masters"},
    {"precision"},
    {"step"},
    {"sharding"},
    {"trainer"},
    {"doctor"},
    {"plan"},
    {"bench"},
    {"integrations"},
    {"cli", "__init__"},
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _component(module: str) -> str:
    """The LAYERS entry a module belongs to: the longest naming it or a package above it
    (`mixprec.trainer.loop` -> "trainer", `mixprec.policy.map` -> "policy.map"; `mixprec` ->
    "__init__")."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYER_OF:
            return ".".join(parts[:n])
    return parts[0] if parts else "__init__"


def _imports(path: Path, *, annotations: bool = False) -> list[tuple[str, bool]]:
    """(imported mixprec module, at module level?) for every import in `path`, skipping
    those under `if TYPE_CHECKING:` (never run) unless `annotations` is set."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            checking = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            if checking and not annotations:
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                if child.module.startswith("mixprec"):
                    # `from pkg import module` imports that module, not only the package
                    subs = [f"{child.module}.{a.name}" for a in child.names]
                    found.extend((m, top) for m in subs if m in MODULES)
                    if not all(m in MODULES for m in subs):
                        found.append((child.module, top))
            elif isinstance(child, ast.Import):
                found.extend((a.name, top) for a in child.names if a.name.startswith("mixprec"))
            inner = top and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            visit(child, inner)

    visit(tree, True)
    return found


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def test_every_package_module_has_a_layer():
    unknown = {_component(m) for m in _modules()} - set(LAYER_OF)
    assert not unknown, f"add {sorted(unknown)} to LAYERS (and to docs/architecture.md)"


def test_the_tests_mirror_the_package():
    """A folder of tests/ is named after a package of src/mixprec, and a test named after a
    package lives in its folder: a module's tests are where the module is."""
    tests = Path(__file__).parent
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert folders <= packages, f"not a package of src/mixprec: {sorted(folders - packages)}"
    misplaced = [
        f"{p.relative_to(tests)} (belongs in tests/{package}/)"
        for p in tests.rglob("test_*.py")
        for package in [p.stem.removeprefix("test_").split("_")[0]]
        if package in packages and p.parent.name != package
    ]
    assert not misplaced, "\n".join(misplaced)


def test_imports_point_down_the_layers():
    """Every import counts: at module level, inside functions and under ``if
    TYPE_CHECKING:`` (an annotation naming a higher layer's class ties the layers too)."""
    wrong = []
    for module, path in _modules().items():
        here = _component(module)
        for imported, _ in _imports(path, annotations=True):
            there = _component(imported)
            if there == "__init__" and imported == "mixprec" and here != "__init__":
                wrong.append(f"{module} imports the top-level package (import a module instead)")
            elif there != here and LAYER_OF[there] > LAYER_OF[here]:
                wrong.append(f"{module} ({here}) imports {imported} ({there}), a layer above")
    assert not wrong, "\n".join(wrong)


def _check_no_cycle(graph: dict[str, set[str]]) -> None:
    """Raise naming the first cycle found in `graph` (module -> the modules it imports)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_import_cycle_at_module_level():
    modules = MODULES
    graph = {
        m: {i for i, top in _imports(p) if top and i in modules and i != m}
        for m, p in modules.items()
    }
    _check_no_cycle(graph)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of `graph` (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            nxt = next((n for n in edges if n not in index or n in stack), None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set(stack[stack.index(node) :])
                    del stack[stack.index(node) :]
                    found.append(component)
            elif nxt in index:
                low[node] = min(low[node], index[nxt])
            else:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
    return found


def _folder(module: str) -> str:
    """The package a module's file sits in (`mixprec.policy.map` and `mixprec.policy` ->
    "mixprec.policy"; a root module -> "mixprec")."""
    if MODULES[module].name == "__init__.py":
        return module
    return module.rpartition(".")[0]


def test_no_import_circle_spans_two_folders():
    """No set of modules across packages imports one another round, counting every import
    (functions and annotations too): each package can be read and changed from the bottom."""
    graph = {
        m: {i for i, _ in _imports(p, annotations=True) if i in MODULES and i != m}
        for m, p in MODULES.items()
    }
    circles = [
        "{" + ", ".join(sorted(c)) + "}"
        for c in _strongly_connected(graph)
        if len({_folder(m) for m in c}) > 1
    ]
    assert not circles, "modules of several packages import each other:\n" + "\n".join(circles)


TRAINER_CLASS_MODULE = "mixprec.trainer.trainer"


def test_the_trainer_package_imports_in_one_direction():
    """No two modules of `mixprec.trainer` know each other, counting every import: at module
    level, inside functions, and under ``if TYPE_CHECKING:`` (for annotations). The one
    exception: annotation-only imports of the `Trainer` class, which sits atop the package
    (it imports the rest) and is what callbacks, modules and the run object hand around."""
    trainer_modules = {m: p for m, p in MODULES.items() if m.startswith("mixprec.trainer")}
    graph = {}
    for m, p in trainer_modules.items():
        run = {i for i, _ in _imports(p)}
        annotated = {i for i, _ in _imports(p, annotations=True)} - run
        graph[m] = {
            i for i in run | (annotated - {TRAINER_CLASS_MODULE}) if i in trainer_modules and i != m
        }
    _check_no_cycle(graph)


# classes whose private attributes (fields set on `self`, methods) only their own body touches
PRIVATE_TO_CLASS = [
    ("mixprec.optim.wrapper", "LossScaleOptimizer"),
    ("mixprec.optim.checkpoint", "OptimizerCheckpoint"),
    ("mixprec.optim.masters", "MasterWeights"),
]


def _private_attributes(cls: ast.ClassDef) -> set[str]:
    """The private methods of `cls` and the private fields its methods set or read on `self`."""

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef) and private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def _touched(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) where `names` are reached through anything but `self`: `x._name`,
    `getattr(x, "_name")`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in _REFLECTION:
            arg = node.args[1] if len(node.args) > 1 else None
            if isinstance(arg, ast.Constant) and arg.value in names:
                found.append((node.lineno, arg.value))
    return found


_REFLECTION = {"getattr", "setattr", "hasattr", "delattr"}


def test_only_a_loss_scale_optimizer_touches_its_private_attributes():
    """`joint_step`, `Precision`, the Trainer and the integrations use the wrapper's public
    methods: a private field or method of a LossScaleOptimizer (or of its MasterWeights)
    reached from outside the class body is a coupling the class cannot change alone."""
    wrong = []
    for owner_module, owner in PRIVATE_TO_CLASS:
        owner_tree = ast.parse(MODULES[owner_module].read_text())
        cls = next(n for n in owner_tree.body if isinstance(n, ast.ClassDef) and n.name == owner)
        names = _private_attributes(cls)
        assert names, f"no private attribute found in {owner}"
        for module, path in MODULES.items():
            tree = owner_tree if module == owner_module else ast.parse(path.read_text())
            for line, name in _touched(tree, names):
                if module == owner_module and cls.lineno <= line <= (cls.end_lineno or 0):
                    continue  # the class's own body (another instance: a retired wrapper)
                wrong.append(f"{module}:{line} touches {owner}.{name}")
    assert not wrong, "\n".join(wrong)


def _reaches_into_a_trainer(node: ast.AST) -> str | None:
    """The private name `node` reaches on something called ``trainer`` (``trainer._log``,
    ``self.trainer._metrics``, ``getattr(trainer, "_x")``), else None."""

    def is_trainer(value: ast.AST) -> bool:
        return (isinstance(value, ast.Name) and value.id == "trainer") or (
            isinstance(value, ast.Attribute) and value.attr == "trainer"
        )

    def private(name: object) -> bool:
        return isinstance(name, str) and name.startswith("_") and not name.startswith("__")

    if isinstance(node, ast.Attribute) and private(node.attr) and is_trainer(node.value):
        return node.attr
    if isinstance(node, ast.Call) and ast.unparse(node.func) in _REFLECTION and node.args:
        arg = node.args[1] if len(node.args) > 1 else None
        if is_trainer(node.args[0]) and isinstance(arg, ast.Constant) and private(arg.value):
            return arg.value
    return None


def test_only_the_trainer_module_touches_the_trainers_private_state():
    """The run object (`trainer.loop.Run`) holds what the loops, checkpoints and callbacks
    move on (progress, metric stores, hooks): no module but `trainer/trainer.py` reaches a
    private attribute of a Trainer. The integrations are left out: their ``trainer`` is the
    host framework's (Lightning's, Hugging Face's), not ours."""
    wrong = []
    for module, path in MODULES.items():
        if module == TRAINER_CLASS_MODULE or _component(module) == "integrations":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = _reaches_into_a_trainer(node)
            if name is not None:
                wrong.append(f"{module}:{node.lineno} touches Trainer.{name}")
    assert not wrong, "\n".join(wrong)


def test_import_mixprec_is_light_and_the_trainer_loads_on_first_use():
    code = (
        "import sys, mixprec\n"
        "heavy = sorted(m for m in sys.modules if m.startswith(('mixprec.trainer', "
        "'mixprec.doctor', 'mixprec.bench', 'rich')))\n"
        "print(heavy)\n"
        "mixprec.Trainer\n"
        "print('mixprec.trainer' in sys.modules, 'Trainer' in dir(mixprec))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    assert out == ["[]", "True True"]


def test_the_doctor_loads_neither_the_trainer_nor_rich():
    """The doctor (layer 11) sits above the Trainer but needs none of it: the monitor defines
    the Trainer's hooks without importing it, and tables import rich only to print."""
    code = (
        "import sys, mixprec\n"
        "mixprec.diagnose, mixprec.PrecisionMonitor\n"
        "from mixprec.doctor import diagnose\n"
        "print(sorted(m for m in sys.modules if m.startswith(('mixprec.trainer', 'rich'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    assert out == ["[]"]


def test_the_top_level_holds_the_daily_names_only():
    assert sorted(mixprec.__all__) == sorted(
        [
            "ActivationRules",
            "AdamW4bit",
            "AdamW8bit",
            "AdamWFp8",
            "DynamicLossScaler",
            "LossScaleDivergedError",
            "LossScaleOptimizer",
            "LossScaler",
            "LowBitAdamW",
            "LowBitSGD",
            "NoLossScaler",
            "Policy",
            "PolicyMap",
            "PolicySpecError",
            "Precision",
            "PrecisionError",
            "PrecisionMonitor",
            "SlowPrecisionError",
            "SlowPrecisionWarning",
            "StaticLossScaler",
            "Trainer",
            "TrainingModule",
            "__version__",
            "apply",
            "diagnose",
            "explain",
            "global_policy",
            "policy_scope",
            "quantize",
            "remove",
            "search",
            "set_global_policy",
        ]
    )
    for name in mixprec.__all__:
        assert getattr(mixprec, name) is not None
    try:
        mixprec.joint_step  # noqa: B018
    except AttributeError as err:
        assert "no attribute 'joint_step'" in str(err)
    else:
        raise AssertionError("helpers live in their modules, not at the top level")


def test_dir_of_the_top_level_shows_its_public_names_only():
    """`dir(mixprec)` (what tab completion offers) lists the public names, the submodules
    loaded so far and the module's dunders, not the helpers its file imports for itself."""
    shown = set(dir(mixprec))
    assert set(mixprec.__all__) <= shown
    others = {n for n in shown - set(mixprec.__all__) if not (n[:2] == n[-2:] == "__")}
    submodules = {n for n in others if sys.modules.get(f"mixprec.{n}") is getattr(mixprec, n)}
    assert others == submodules, f"not public: {sorted(others - submodules)}"
    assert {"hardware", "policy", "optim"} <= submodules


def _public_modules() -> list[str]:
    """The package's public modules: no part of the dotted name starts with an underscore."""
    return [m for m in MODULES if not any(part.startswith("_") for part in m.split("."))]


def _listed(path: Path) -> list[str] | None:
    """The names in the module-level `__all__` of the file at `path` (None without one)."""
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return list(ast.literal_eval(node.value))
    return None


def test_every_public_module_declares_its_public_names():
    """Each public module says in `__all__` which of its names are its interface, and each
    name there exists (the lazy ones of the top level too)."""
    wrong = []
    for name in _public_modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:  # an integration whose extra is not installed
            if (err.name or "").startswith("mixprec"):
                raise
            continue
        listed = vars(module).get("__all__")
        if listed is None:
            wrong.append(f"{name} has no __all__")
            continue
        absent = [n for n in listed if not hasattr(module, n)]
        private = [n for n in listed if n.startswith("_") and not n.endswith("__")]
        wrong += [f"{name}.__all__ lists {n!r}, which it lacks" for n in absent]
        wrong += [f"{name}.__all__ lists the private {n!r}" for n in private]
    assert not wrong, "\n".join(wrong)


def _used_names(path: Path) -> list[tuple[int, str, str]]:
    """(line, mixprec module, name) for each name the file at `path` takes from a mixprec
    module: imported from it (``from mixprec.hardware import check``) or read from it as an
    attribute (``hardware.check`` after ``from mixprec import hardware``). A name that is
    itself a module is followed into (``quantize.float8.Float8Linear``)."""
    tree = ast.parse(path.read_text())
    modules: dict[str, str] = {}  # local name -> the mixprec module it is bound to
    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in MODULES:
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                else:
                    used.append((node.lineno, node.module, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    modules[alias.asname or alias.name.partition(".")[0]] = (
                        alias.name if alias.asname else alias.name.partition(".")[0]
                    )
    for node in ast.walk(tree):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if not (chain and isinstance(node, ast.Name) and node.id in modules):
            continue
        module = modules[node.id]
        for name in reversed(chain):
            if f"{module}.{name}" not in MODULES:
                used.append((node.lineno, module, name))
                break
            module = f"{module}.{name}"
    return used


def test_a_name_another_package_uses_is_in_its_all():
    """A module's `__all__` is its interface: what users and other packages use. Every name
    a module of another package takes from it (imported, or read as an attribute of the
    module) is listed there; a name shared only between the modules of one package (one
    folder: `mixprec.plan.verify` and `mixprec.plan.searching`, or a package's `__init__`
    and its modules) is that package's internal and need not be."""
    listed = {m: _listed(MODULES[m]) for m in _public_modules()}
    wrong = []
    for module, path in MODULES.items():
        for line, source, name in _used_names(path):
            names = listed.get(source)
            if names is None or source == module or _folder(source) == _folder(module):
                continue
            if not name.startswith("_") and name not in names:
                wrong.append(f"{module}:{line} uses {source}.{name}")
    assert not wrong, "not in the __all__ of the module they come from:\n" + "\n".join(wrong)


def test_checkpoints_are_written_atomically_in_one_place():
    """`trainer.checkpoint.atomic_write` and its steps (which a sharded save takes across
    ranks) are the one code that names, links and syncs a checkpoint's temporary file or
    directory: no other trainer module does any of that itself, or reaches into the
    checkpoint module's private helpers."""
    owner = "mixprec.trainer.checkpoint"
    done_by_owner = {"os.fsync", "os.link", "secrets.token_hex"}
    wrong = []
    for module, path in MODULES.items():
        if not module.startswith("mixprec.trainer") or module == owner:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in done_by_owner:
                wrong.append(f"{module}:{node.lineno} calls {ast.unparse(node.func)}")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and ast.unparse(node.value) in ("ckpt_io", "checkpoint")
            ):
                wrong.append(f"{module}:{node.lineno} touches {owner}.{node.attr}")
    assert not wrong, "\n".join(wrong)


# Measured figures and history belong in docs/ and benchmarks/results/, not in the source's
# prose (docstrings and comments), where they go stale unseen. What counts as one:
FIGURES = {
    "a ratio": re.compile(r"(?<![\w.])\d+(?:\.\d+)?x\b"),
    "a ratio in words": re.compile(
        r"(?<![\w.])\d+(?:\.\d+)? times (?:as|faster|slower|more|less|longer|shorter)\b"
    ),
    "a measurement": re.compile(
        r"(?<![\w.])\d+(?:[.,]\d+)?"
        r"(?: ?(?:ms|us|µs|ns|GB|GiB|MB|MiB|KB|KiB|TB|TiB|[GT]FLOP/s)| s)(?![\w/])"
    ),
    "a percentage": re.compile(r"(?<![\w.])\d+(?:\.\d+)?%"),
    "history": re.compile(r"\bissue \d+|\buntil issue\b|(?<![\w&])#\d+\b|\b(?:was|were) \d"),
}
# Not figures, so left out before matching: text in double quotes (what the code reads or
# writes, e.g. "2GiB" as a size argument, "0.0081x" as a printed rate), and a constant's
# value quoted beside its name (`HEADROOM` (4x)): the behaviour, stated where it is used.
NOT_FIGURES = re.compile(r'"[^"\n]*"|`[A-Z][A-Z0-9_]*` \([^)\n]*\)')


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and every string statement (docstrings) in `path`."""
    text = path.read_text()
    lines = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                lines += enumerate(node.value.value.split("\n"), start=node.lineno)
    return lines


def measured_figures(src: Path) -> list[tuple[str, str, str]]:
    """(file:line, what, the figure) for each figure in the prose of the package at `src`
    (the directory holding ``mixprec``)."""
    found = []
    for path in sorted((src / "mixprec").rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        for line, text in _prose(path):
            for what, rx in FIGURES.items():
                for m in rx.finditer(NOT_FIGURES.sub("", text)):
                    found.append((f"{rel}:{line}", what, m.group(0)))
    return found


def test_the_source_states_no_measured_figures_or_history():
    """Docstrings and comments explain; the numbers a run measured and the project's history
    live in docs/ and benchmarks/results/ (see FIGURES and NOT_FIGURES for what counts)."""
    wrong = [f"{where}: {what} {figure!r}" for where, what, figure in measured_figures(SRC.parent)]
    assert not wrong, "move these to docs/ or benchmarks/results/:\n" + "\n".join(wrong)


# A docstring says what a thing is and how to use it; the long story (each flag in full, the
# measurements, the design) lives in docs/. At most this many lines:
DOCSTRING_LINES = 30


def _docstring_lengths() -> dict[str, int]:
    """Lines of each module's, class's and function's docstring, by dotted name."""
    lengths = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in [tree, *ast.walk(tree)]:
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                continue
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                name = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
                lengths[name] = max(lengths.get(name, 0), len(doc.split("\n")))
    return lengths


def test_no_docstring_runs_over_30_lines():
    wrong = [
        f"{name}: {lines} lines"
        for name, lines in sorted(_docstring_lengths().items())
        if lines > DOCSTRING_LINES
    ]
    assert not wrong, f"over {DOCSTRING_LINES} lines (move the detail to docs/):\n" + "\n".join(
        wrong
    )


def test_the_architecture_page_is_a_short_map_naming_every_package():
    """docs/architecture.md is read in two minutes: a row per package in a line or two
    (the detail lives in the packages' docstrings), every package named in a row."""
    page = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    words = {row.split("|")[1].strip(): len(re.sub(r"[`|]", " ", row).split()) for row in rows}
    long = {name: n for name, n in words.items() if n > 50}
    assert not long, f"rows over 50 words (move the detail to the docstring): {long}"
    assert len(page.split()) < 1200
    named = " ".join(words)
    packages = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").exists())
    missing = [p for p in packages if f"`{p}/" not in named and f"`{p}`" not in named]
    assert not missing, f"packages without a row in docs/architecture.md: {missing}"
