"""Policy files: how a `mixprec.PolicyMap`'s rules, float32 islands, state formats and
activation options are written to and read from JSON (``PolicyMap.to_config``,
``from_config``, ``save``, ``load``) and Python (``to_code``), each value checked on the way
in with an error that names the entry and what it accepts; a module type is written as its
import path and imported back."""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from mixprec.activations.rules import ActivationRules
from mixprec.errors import PolicySpecError
from mixprec.optim.states.formats import parse_state_format
from mixprec.policy import Policy, as_policy

__all__: list[str] = []

RuleKey = str | type
# what one rule of a policy file looks like, for the errors that refuse one
RULE_FORM = (
    "{'path': regex, 'policy': policy} or {'type': 'package.module.Class', 'policy': policy}, "
    "a policy being a name such as 'bf16-mixed' or what Policy.to_config() gives"
)


ACTIVATION_FORM = (
    "each {'path': regex, 'option': option} or {'type': 'package.module.Class', 'option': "
    "option}, an option being 'keep', 'bf16', 'fp8', 'checkpoint', 'selective' or 'offload'"
)


def type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def check_nameable(t: type, why: str, *, script: bool = True) -> None:
    """Refuse a type rule's class defined inside a function: no import can reach it; and,
    unless ``script`` is False, one defined in the script being run (``__main__``): another
    process imports its own script under that name."""
    if "<locals>" in t.__qualname__:
        raise PolicySpecError(
            f"type rule {t.__name__} is a class defined inside a function ({type_name(t)}): "
            f"{why}. Define the class at module level, or use a path rule for those modules"
        )
    if script and t.__module__ == "__main__":
        raise PolicySpecError(
            f"type rule {t.__name__} is a class of the script being run "
            f"(__main__.{t.__qualname__}): {why} in another process. Define the class in a "
            "module the file can import, or use a path rule for those modules"
        )


def code_name(t: type) -> str:
    """How Python source names a type rule's class: its import path, or its bare name for a
    class of the running script (the code is pasted there)."""
    check_nameable(t, "source code cannot name it", script=False)
    return t.__qualname__ if t.__module__ == "__main__" else type_name(t)


def import_type(path: str) -> type:
    """The class a policy file names by its import path: the longest importable module
    prefix, then attributes (a class nested in another, ``pkg.mod.Outer.Inner``)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except ValueError:  # (an empty name: "..Linear")
            break
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            break
        return obj
    raise PolicySpecError(f"cannot import module type {path!r} named in a policy map")


def activations_config(rules: ActivationRules) -> str | list[dict[str, str]]:
    """``activations`` as a policy file keeps it: the one option, or the rules in order."""
    if not rules.rules:
        return rules.default
    return [
        {"path": key, "option": option}
        if isinstance(key, str)
        else {"type": type_name(key), "option": option}
        for key, option in rules.rules.items()
    ]


def activations_code(rules: ActivationRules) -> str:
    """Python source of ``activations``: the option, or the rules dict."""
    if not rules.rules:
        return repr(rules.default)
    items = []
    for key, option in rules.rules.items():
        items.append(
            f"{key!r}: {option!r}" if isinstance(key, str) else f"{code_name(key)}: {option!r}"
        )
    return "{" + ", ".join(items) + "}"


def config_activations(value: Any) -> ActivationRules:
    """The ``activations`` of a config, as strictly checked as its policy rules."""
    if isinstance(value, str):
        return ActivationRules(value)
    if not isinstance(value, (list, tuple)):
        raise PolicySpecError(
            f"'activations' is {describe(value)}; it is one activation option ('fp8') or a "
            "list of rules, " + ACTIVATION_FORM
        )
    rules: dict[RuleKey, str] = {}
    for i, rule in enumerate(value):
        where = f"activation rule {i}"
        forms = ({"path", "option"}, {"type", "option"})
        if not isinstance(rule, Mapping) or set(rule) not in forms:
            shown = dict(rule) if isinstance(rule, Mapping) else rule
            raise PolicySpecError(f"{where} is {describe(shown)}; " + ACTIVATION_FORM)
        kind = "path" if "path" in rule else "type"
        if not isinstance(rule[kind], str):
            raise PolicySpecError(f"{where} '{kind}' is {describe(rule[kind])}; it is a string")
        key: RuleKey = rule[kind]
        if kind == "type":
            found = import_type(rule[kind])
            if not (isinstance(found, type) and issubclass(found, nn.Module)):
                raise PolicySpecError(f"{where} 'type' {rule[kind]!r} is not an nn.Module subclass")
            key = found
        if key in rules:
            raise PolicySpecError(f"{where} repeats the rule for {rule[kind]!r}: one rule each")
        rules[key] = rule["option"]
    return ActivationRules(rules)


def checked_states(states: Any) -> str | dict[str, str] | None:
    """A map's ``states``, each format checked and spelled canonically (``"int8"``,
    ``"int4/block=64"``); errors name the rule and what is accepted."""
    if states is None:
        return None
    if isinstance(states, str):
        try:
            return str(parse_state_format(states))
        except ValueError as error:
            raise PolicySpecError(f"states: {error}") from None
    if not isinstance(states, Mapping):
        raise PolicySpecError(
            f"states must be one optimizer-state format ('int8', 'int4', 'fp8', 'float32') or "
            f"a mapping {{module path regex: format}}, got {describe(states)}"
        )
    out = {}
    for key, spec in states.items():
        if not isinstance(key, str):
            raise PolicySpecError(f"state rule key {key!r} must be a module path regex (str)")
        try:
            re.compile(key)
            out[key] = str(parse_state_format(spec))
        except re.error as error:
            raise PolicySpecError(f"state rule {key!r} is not a valid regex: {error}") from None
        except (TypeError, ValueError) as error:
            raise PolicySpecError(f"state rule {key!r}: {error}") from None
    return out


def describe(value: Any) -> str:
    """A config value as JSON would name it, for errors: null, the string 'false', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, (list, tuple)):
        return f"a list ({value!r})"
    if isinstance(value, Mapping):
        return f"an object ({dict(value)!r})"
    return f"{type(value).__name__} {value!r}"


def config_policy(where: str, value: Any) -> Policy:
    """The policy a config value names; `where` says which key, in errors."""
    if value is None:
        raise PolicySpecError(
            f"{where} is null; give a policy: a name such as 'bf16-mixed' or what "
            "Policy.to_config() gives"
        )
    try:
        return as_policy(value)
    except PolicySpecError as error:
        raise PolicySpecError(f"{where}: {error}") from None


def config_rule_key(i: int, rule: Any) -> RuleKey:
    """The path or module type of rule `i` of a config, checked for form and types."""
    if not isinstance(rule, Mapping):
        raise PolicySpecError(
            f"rule {i} of the policy map config is {describe(rule)}; each rule is " + RULE_FORM
        )
    unknown = [key for key in rule if key not in ("path", "type", "policy")]
    if unknown or "policy" not in rule or ("path" in rule) == ("type" in rule):
        wrong = f" (unknown key(s) {', '.join(map(repr, unknown))})" if unknown else ""
        raise PolicySpecError(
            f"rule {i} of the policy map config is {dict(rule)!r}{wrong}; each rule is " + RULE_FORM
        )
    kind = "path" if "path" in rule else "type"
    key = rule[kind]
    if not isinstance(key, str):
        takes = "a regex" if kind == "path" else "a class name 'package.module.Class'"
        raise PolicySpecError(f"rule {i} '{kind}' is {describe(key)}; it takes {takes}")
    if kind == "path":
        return key
    found = import_type(key)
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise PolicySpecError(
            f"rule {i} 'type' {key!r} names {type(found).__name__} {found!r}, not an nn.Module "
            "subclass"
        )
    return found


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a key given twice is an error (json keeps the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise PolicySpecError(f"key {key!r} appears twice in one object")
        out[key] = value
    return out
