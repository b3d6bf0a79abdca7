"""Which activation option each module of a model takes: `ActivationRules`, rules from module
paths or module types to options, resolved as a `mixprec.PolicyMap`'s policy rules are.

Precedence for each module: an exact path rule, a regex path rule (``re.fullmatch``), a type
rule (``isinstance``), the parent's option, the default (``"keep"``, or the one option given
for every module). Two rules of the same rank matching one module is an error. Below a module
that is recomputed (``checkpoint``, ``selective``) nothing is saved, so the modules there take
its option whatever their own rules say, and the resolution says why.

A container that is never called (`nn.ModuleList`, `nn.ModuleDict`: no ``forward`` of its own)
passes its option to its children, each of which then takes it on its own: a
``{"layers": "checkpoint"}`` rule recomputes each layer of the list.
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from mixprec.activations.options import RECOMPUTE, check_option
from mixprec.errors import PolicySpecError
from mixprec.policy.matching import is_a, match_rule, split_rules, warn_types_imported_twice

__all__ = ["ActivationRules", "ActivationsSpec", "Choice", "as_rules", "never_called"]

# what `Precision(activations=...)` and `PolicyMap(activations=...)` take: one option for
# every module, or {module path regex or module type: option}
ActivationsSpec = str | Mapping[str | type, str]
# (option, why) of one module
Choice = tuple[str, str]


def never_called(module: nn.Module) -> bool:
    """Whether `module` has no ``forward`` of its own (`nn.ModuleList`, `nn.ModuleDict`): a
    container its parent reaches into, whose own forward nothing calls, so an option on it
    is carried out by its children."""
    return type(module).forward is nn.Module.forward and "forward" not in module.__dict__


def _key_name(key: Any) -> str:
    return key.__name__ if isinstance(key, type) else repr(key)


class ActivationRules:
    """A default option and rules from module path regexes or module types to options.

    ``ActivationRules("fp8")`` stores every layer's saved tensors in fp8;
    ``ActivationRules({r"blocks\\.\\d+": "checkpoint", nn.Linear: "bf16"})`` recomputes each
    block and keeps the other Linear layers' saved tensors in bfloat16."""

    def __init__(self, spec: ActivationsSpec | ActivationRules = "keep") -> None:
        if isinstance(spec, ActivationRules):
            self.default: str = spec.default
            self._paths: dict[str, tuple[re.Pattern[str], str]] = dict(spec._paths)
            self._types: dict[type, str] = dict(spec._types)
            return
        self._paths = {}
        self._types = {}
        if isinstance(spec, str):
            self.default = check_option(spec)
            return
        if not isinstance(spec, Mapping):
            raise PolicySpecError(
                "activations takes one option for every module ('fp8') or a mapping "
                "{module path regex or module type: option} "
                f"({{'blocks\\\\.\\\\d+': 'checkpoint'}}), got {type(spec).__name__} {spec!r}"
            )
        self.default = "keep"
        options = {k: check_option(o, f"activation rule {_key_name(k)}") for k, o in spec.items()}
        self._paths, self._types = split_rules(options, "activation ")

    @property
    def rules(self) -> dict[str | type, str]:
        """The rules as given, path rules first."""
        return {**{k: o for k, (_, o) in self._paths.items()}, **self._types}

    @property
    def options(self) -> set[str]:
        """Every option these rules can give a module."""
        return {self.default, *self.rules.values()}

    def spec(self) -> ActivationsSpec:
        """What builds these rules again: the one option, or the rules mapping."""
        return self.rules if self.rules else self.default

    def _ruled(self, name: str, module: nn.Module) -> Choice | None:
        return match_rule(self._paths, self._types, name, module, "activation ")

    def resolve(self, model: nn.Module) -> dict[str, Choice]:
        """(option, why) of every module of `model`, keyed by qualified name. A module
        reachable at two paths that resolve differently is an error naming both."""
        out: dict[str, Choice] = {}
        first: dict[int, str] = {}
        recomputed: dict[str, str] = {}  # module -> the recomputed module it runs inside
        for name, module in model.named_modules(remove_duplicate=False):
            parent = name.rpartition(".")[0] if name else None
            up = out.get(parent) if parent is not None else None
            if parent is not None and parent in recomputed:
                recomputed[name] = recomputed[parent]
                out[name] = (out[parent][0], f"recomputed with {recomputed[name] or '<root>'!r}")
            else:
                ruled = self._ruled(name, module)
                if ruled is not None:
                    out[name] = ruled
                elif up is not None:
                    out[name] = (up[0], f"inherited from {parent or '<root>'}")
                else:
                    out[name] = (self.default, "default")
                if out[name][0] in RECOMPUTE and not never_called(module):
                    recomputed[name] = name
            other = first.setdefault(id(module), name)
            if out[other][0] != out[name][0]:
                raise PolicySpecError(
                    f"module {type(module).__name__} is reachable at {other!r} and {name!r}, "
                    f"whose activation options are {out[other][0]!r} ({out[other][1]}) and "
                    f"{out[name][0]!r} ({out[name][1]}); give both paths the same option"
                )
        return out

    def unmatched_paths(self, names: list[str]) -> list[str]:
        """The path rules that match none of `names` (module paths)."""
        return [
            key
            for key, (rx, _) in self._paths.items()
            if key not in names and not any(rx.fullmatch(n) for n in names)
        ]

    def _matched(self, key: str | type, modules: list[tuple[str, nn.Module]]) -> list[str]:
        """The paths of `modules` that the rule `key` matches (of any rank)."""
        if isinstance(key, type):
            return [name for name, module in modules if is_a(module, key)]
        rx = self._paths[key][0]
        return [name for name, _ in modules if name == key or rx.fullmatch(name)]

    def _unmatched_types(self, modules: list[tuple[str, nn.Module]]) -> list[str]:
        """The type rules that match no module, but for a class imported twice (warned of
        by `warn_types_imported_twice`)."""
        names = {type(m).__qualname__ for _, m in modules}
        return [
            t.__name__
            for t in self._types
            if t.__qualname__ not in names and not self._matched(t, modules)
        ]

    def _shadowed(self, model: nn.Module, modules: list[tuple[str, nn.Module]]) -> list[str]:
        """The rules whose every module runs inside a recomputed one that gives it another
        option, with why: the rule takes no effect."""
        if not self.rules:
            return []
        choices = self.resolve(model)
        said = []
        for key, option in self.rules.items():
            hits = self._matched(key, modules)
            if hits and all(
                choices[n][1].startswith("recomputed with") and choices[n][0] != option
                for n in hits
            ):
                said.append(f"{_key_name(key)}: {option!r} ({choices[hits[0]][1]})")
        return said

    def warn_unmatched(self, model: nn.Module, *, stacklevel: int = 2) -> None:
        """One warning naming the rules that match no module of `model` (path rules with
        the closest paths; type rules), as for policy path rules: a typo or a wrong class far
        more often than intent; one naming type rules for a class imported twice
        (`warn_types_imported_twice`); and one naming the rules whose modules all run inside
        a recomputed module, whose option they take instead."""
        warn_types_imported_twice(self._types, model, "activation", stacklevel + 1)
        modules = list(model.named_modules(remove_duplicate=False))
        names = [name for name, _ in modules]
        said = []
        for key in self.unmatched_paths(names):
            close = difflib.get_close_matches(key, [n for n in names if n], n=3, cutoff=0.5)
            said.append(
                f"{key!r}" + (f" (closest: {', '.join(map(repr, close))})" if close else "")
            )
        said += self._unmatched_types(modules)
        if said:
            warnings.warn(
                f"activation rule(s) {', '.join(said)} match no module of "
                f"{type(model).__name__} (path rules are re.fullmatch'ed against "
                "named_modules() paths, type rules matched by isinstance)",
                stacklevel=stacklevel + 1,
            )
        shadowed = self._shadowed(model, modules)
        if shadowed:
            warnings.warn(
                f"activation rule(s) {'; '.join(shadowed)} take no effect: every module they "
                "match runs inside a recomputed module, which recomputes it whatever its own "
                "option; give the option to modules outside it, or do not recompute it",
                stacklevel=stacklevel + 1,
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ActivationRules):
            return NotImplemented
        return self.default == other.default and self.rules == other.rules

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ActivationRules({self.spec()!r})"


def as_rules(spec: Any) -> ActivationRules | None:
    """`spec` (None, an option, a mapping, or rules) as `ActivationRules`; None stays None."""
    return None if spec is None else ActivationRules(spec)
