"""Rules from module paths or module types to values, read and matched one way for every kind
of rule: a `mixprec.PolicyMap`'s policies and `mixprec.activations.ActivationRules`' options.

A key is a module path regex (``re.fullmatch`` against a module's qualified name) or an
``nn.Module`` subclass. For each module, in order: an exact path rule, a regex path rule, a
type rule (``isinstance``, where a quantized layer also counts as the float type it replaced;
a subclass's rule before its base class's); two rules of the same rank matching one module
with different values is an error, not a silent pick.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any, TypeVar

from torch import nn

from mixprec.errors import PolicySpecError

__all__ = ["is_a", "match_rule", "split_rules", "warn_types_imported_twice"]

V = TypeVar("V")
PathRules = dict[str, tuple[re.Pattern[str], V]]  # path regex -> (compiled, value)
TypeRules = dict[type, V]


def split_rules(rules: Mapping[Any, V], kind: str = "") -> tuple[PathRules, TypeRules]:
    """`rules` as path rules (compiled) and type rules, each in the order given; a key that
    is neither, or a regex that does not compile, refused. `kind` names the rules in errors
    (``"activation "``: "activation rule 'x' is not a valid regex")."""
    paths: PathRules = {}
    types: TypeRules = {}
    for key, value in rules.items():
        if isinstance(key, type) and issubclass(key, nn.Module):
            types[key] = value
            continue
        if not isinstance(key, str):
            raise PolicySpecError(
                f"{kind}rule key {key!r} must be a module path regex (str) or an nn.Module subclass"
            )
        try:
            paths[key] = (re.compile(key), value)
        except re.error as err:
            raise PolicySpecError(f"{kind}rule {key!r} is not a valid regex: {err}") from None
    return paths, types


def is_a(module: nn.Module, t: type) -> bool:
    """isinstance, where a quantized layer also counts as the float type it replaced (its
    `float_type`), so a type rule keeps matching after `apply` or `quantize` swapped it."""
    return isinstance(module, t) or issubclass(getattr(module, "float_type", type(None)), t)


def _most_derived(hits: list[type]) -> list[type]:
    """The types of ``hits`` no other hit derives from: a rule for a subclass decides for
    its instances over one for its base class, as Python's dispatch picks the most specific
    (``{nn.Linear: ..., MyLinear: ...}`` gives MyLinear's to a MyLinear)."""
    return [t for t in hits if not any(u is not t and issubclass(u, t) for u in hits)]


def match_rule(
    paths: PathRules, types: TypeRules, name: str, module: nn.Module, kind: str = ""
) -> tuple[Any, str] | None:
    """(value, why) of the rule that decides for the module `module` at path `name`, None
    when no rule matches it; two rules of one rank matching it with different values raise
    PolicySpecError (a type rule for a subclass outranks its base class's)."""
    if name in paths:
        return paths[name][1], f"path rule {name!r}"
    for rank, hits in (
        ("regex rule", [k for k, (rx, _) in paths.items() if rx.fullmatch(name)]),
        ("type rule", _most_derived([t for t in types if is_a(module, t)])),
    ):
        values = [paths[h][1] if isinstance(h, str) else types[h] for h in hits]
        if len(hits) > 1 and any(v != values[0] for v in values[1:]):
            shown = ", ".join(repr(h) if isinstance(h, str) else h.__name__ for h in hits)
            raise PolicySpecError(
                f"module {name or '<root>'!r} ({type(module).__name__}) is matched by "
                f"{len(hits)} {kind}{rank}s of the same rank with different values: {shown}; "
                f"make them disjoint, or decide for it with a path rule"
            )
        if hits:
            hit = hits[0]
            if isinstance(hit, str):
                return paths[hit][1], f"regex rule {hit!r}"
            return types[hit], f"type rule {hit.__name__}"
    return None


def warn_types_imported_twice(
    types: Mapping[type, Any], model: nn.Module, kind: str, stacklevel: int
) -> None:
    """Warn of the type rules (``kind``: "policy", "activation") that match no module of
    ``model`` while a module of a class of the same name is there: a class imported twice
    (a script loaded under another module name) is two classes, and the rule names the one
    the model's instances are not. A rule for a type the model lacks (a map shared by
    several models) is not warned of."""
    modules = [m for _, m in model.named_modules()]
    names_here = {type(m).__qualname__ for m in modules}
    missing = [
        t
        for t in types
        if t.__qualname__ in names_here and not any(isinstance(m, t) for m in modules)
    ]
    if missing:
        named = ", ".join(f"{t.__module__}.{t.__qualname__}" for t in missing)
        warnings.warn(
            f"{kind} type rules match no module of {type(model).__name__}: {named}, whose "
            "name its modules' classes have (a class imported twice, as a script loaded "
            "under another module name, is another class: import it once)",
            stacklevel=stacklevel + 1,
        )
