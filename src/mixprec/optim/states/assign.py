"""Which state format each parameter of a model gets, and why; optimizers built from a
model or converted from a torch optimizer with those formats.

An optimizer sees tensors, not modules: the choices that need the model (an embedding's
table keeps float32 moments, as bitsandbytes advises for its ``StableEmbedding``; a rule
naming parameters by path) are made here and handed to the optimizer as parameter groups,
one per format (the group key ``"states"``).

Precedence, first match wins: a parameter below ``min_size`` elements keeps float32 (the
optimizer enforces it too); a rule (``re.fullmatch`` of a regex on the parameter's name,
in the rules' order); an embedding's weight (float32); the default ``states``. A tied
parameter (one tensor under several names) is matched under each name: a rule on any of
them outranks the embedding's float32 and the default, and rules giving its names
different formats are refused (it holds one state).
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.errors import PolicySpecError
from mixprec.optim.engine import SUPPORTED_OPTIMIZERS
from mixprec.optim.states.checkpoint import UNSUPPORTED_FLAGS
from mixprec.optim.states.formats import StateFormat, parse_state_format
from mixprec.optim.states.optimizers import (
    MIN_SIZE,
    LowBitAdam,
    LowBitAdamW,
    LowBitOptimizer,
    LowBitSGD,
)

__all__ = [
    "Assignment",
    "assign_formats",
    "closest",
    "explain_formats",
    "format_groups",
    "from_model",
    "from_optimizer",
    "low_bit_settings",
    "warn_unmatched_rules",
]

Assignment = tuple[StateFormat, str]
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
# torch's implementation flags, dropped on conversion (they choose torch's kernels)
_IMPLEMENTATION = ("foreach", "fused")
_DROPPED = {*UNSUPPORTED_FLAGS, *_IMPLEMENTATION}
# a setting the low-bit Adam takes per group only: its class gives the default
_GROUP_ONLY = ("decoupled_weight_decay",)
# unmatched rules named, with their hints, in one warning (a generated map may hold many)
_UNMATCHED_NAMED = 5


def _named(
    model_or_named: nn.Module | Iterable[tuple[str, torch.Tensor]], frozen: bool = False
) -> tuple[list[tuple[str, torch.Tensor]], dict[int, list[str]], set[int]]:
    """(name, parameter) pairs, each parameter once under its first name (trainable ones of
    a model, or every one with ``frozen``), every name of each parameter by its id (a tied
    one has several: GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``), and the ids
    of embedding tables."""
    if isinstance(model_or_named, nn.Module):
        every = [
            (n, p)
            for n, p in model_or_named.named_parameters(remove_duplicate=False)
            if frozen or p.requires_grad
        ]
        tables = {id(m.weight) for m in model_or_named.modules() if isinstance(m, _EMBEDDINGS)}
    else:
        every = list(model_or_named)
        for item in every:
            if not (isinstance(item, tuple) and len(item) == 2 and torch.is_tensor(item[1])):
                raise TypeError(
                    "assign_formats takes a model or (name, parameter) pairs such as "
                    "model.named_parameters()"
                )
        tables = set()
    named, names = [], {}
    for n, p in every:
        if id(p) not in names:
            named.append((n, p))
        names.setdefault(id(p), []).append(n)
    return named, names, tables


def assign_formats(
    model_or_named: nn.Module | Iterable[tuple[str, torch.Tensor]],
    states: str | StateFormat = "int8",
    *,
    rules: Mapping[str, str | StateFormat] | None = None,
    min_size: int = MIN_SIZE,
    embeddings_float32: bool = True,
    warn: bool = True,
    frozen: bool = False,
    on_modules: bool = False,
) -> dict[str, Assignment]:
    """Each trainable parameter's name -> (its moments' `StateFormat`, why): ``"small:
    1024 < 4096 elements"``, ``"rule 'head\\..*'"``, ``"embedding"`` or ``"default"``.

    ``rules`` maps a regex on parameter names (``re.fullmatch``) to a format spec; a rule
    matching no parameter is a typo far more often than intent, so ``warn`` says so (one
    warning, with the closest names). Embedding tables (of ``nn.Embedding``/
    ``nn.EmbeddingBag``, known only when a model is given) keep float32 unless
    ``embeddings_float32=False``. ``frozen``: a model's frozen parameters too (an optimizer
    holding them steps them once unfrozen). ``on_modules``: ``rules`` are ``re.fullmatch``'ed
    against the path of the module owning each parameter instead (a policy map's state
    rules: the rule as written, so that an anchor or an inline flag means what it says; said
    as ``"state rule 'head'"``). A tied parameter, keyed by its first name, is matched under
    every name (``"rule 'lm_head' via lm_head.weight (tied)"``): an explicit rule outranks
    the embedding's float32 and the default; two names ruled into different formats are a
    `PolicySpecError` (a ValueError) naming both."""
    default = parse_state_format(states)
    compiled = [(re.compile(k), k, parse_state_format(v)) for k, v in (rules or {}).items()]
    named, aliases, tables = _named(model_or_named, frozen)
    if warn:
        names = [name for every in aliases.values() for name in every]
        owner = (
            type(model_or_named).__name__
            if isinstance(model_or_named, nn.Module)
            else "the parameters given"
        )
        warn_unmatched_rules(
            {
                key: closest(key, names)
                for rx, key, _ in compiled
                if not any(rx.fullmatch(n) for n in names)
            },
            f"trainable parameter of {owner}",
            "rules are re.fullmatch'ed against parameter names",
        )
    label = "state rule" if on_modules else "rule"
    out: dict[str, Assignment] = {}
    for name, p in named:
        n = p.numel()
        # (a small parameter keeps float32 whatever its names' rules say)
        rule = _ruled(compiled, aliases[id(p)], on_modules, label) if n >= min_size else None
        if n < min_size:
            out[name] = (StateFormat("float32"), f"small: {n} < {min_size} elements")
        elif rule is not None:
            at, key, fmt = rule
            out[name] = (fmt, f"{label} {key!r}" + (f" via {at} (tied)" if at != name else ""))
        elif embeddings_float32 and id(p) in tables:
            out[name] = (StateFormat("float32"), "embedding")
        else:
            out[name] = (default, "default")
    return out


def _ruled(
    compiled: list[tuple[re.Pattern[str], str, StateFormat]],
    names: list[str],
    on_modules: bool,
    label: str,
) -> tuple[str, str, StateFormat] | None:
    """(name, rule, format) of the first of a parameter's ``names`` a rule matches (each
    name's first rule in order), or None. A tied parameter holds one state: an explicit rule
    on any owner outranks the default or embedding another falls to, and two owners ruled
    into different formats are refused, as a tie given two param dtypes is."""
    found = None
    for name in names:
        target = name.rpartition(".")[0] if on_modules else name
        rule = next(((key, fmt) for rx, key, fmt in compiled if rx.fullmatch(target)), None)
        if rule is None:
            continue
        if found is None:
            found = (name, *rule)
        elif found[2] != rule[1]:
            first, key, fmt = found
            what = "module" if on_modules else "parameter"
            there = first.rpartition(".")[0] if on_modules else first
            raise PolicySpecError(
                f"parameter {first!r} is also {name!r} (tied: one parameter, one optimizer "
                f"state), but the rules give {what} {there!r} {fmt} ({label} {key!r}) and "
                f"{what} {target!r} {rule[1]} ({label} {rule[0]!r}); give both {what}s the "
                "same state format"
            )
    return found


def closest(key: str, names: Sequence[str]) -> str:
    """A hint naming the ``names`` closest to a rule ``key`` (``"closest: 'a', 'b'"``), or
    ``""`` when none is close."""
    close = difflib.get_close_matches(key, [n for n in names if n], n=3, cutoff=0.5)
    return f"closest: {', '.join(map(repr, close))}" if close else ""


def warn_unmatched_rules(
    unmatched: Mapping[str, str], target: str, how: str, *, stacklevel: int = 2
) -> None:
    """One warning naming the state rules that match nothing, as `mixprec.convert` warns
    of policy rules: ``unmatched`` maps each rule to a hint (``""`` for none), ``target``
    says what the rules were matched against (``"trainable parameter of Net"``), ``how``
    how rules match. ``stacklevel`` counts from the caller, as `warnings.warn`'s."""
    if not unmatched:
        return
    if len(unmatched) == 1:
        ((key, hint),) = unmatched.items()
        message = f"state rule {key!r} matches no {target} ({how})" + (f"; {hint}" if hint else "")
    else:
        said = [
            f"{key!r}" + (f" ({hint})" if hint else "")
            for key, hint in list(unmatched.items())[:_UNMATCHED_NAMED]
        ]
        more = len(unmatched) - len(said)
        message = (
            f"{len(unmatched)} state rules match no {target} ({how}): "
            + ", ".join(said)
            + (f" and {more} more" if more else "")
        )
    warnings.warn(message, stacklevel=stacklevel + 1)


def explain_formats(assignments: Mapping[str, Assignment]) -> str:
    """A table, one line per parameter, of `assign_formats`' answer: name, format, why."""
    if not assignments:
        return "(no trainable parameters)"
    width = max(len(n) for n in assignments)
    kinds = max(len(str(f)) for f, _ in assignments.values())
    return "\n".join(
        f"{name:<{width}}  {str(fmt):<{kinds}}  {why}" for name, (fmt, why) in assignments.items()
    )


def format_groups(
    model_or_named: nn.Module | Iterable[tuple[str, torch.Tensor]],
    assignments: Mapping[str, Assignment],
    **group: Any,
) -> list[dict[str, Any]]:
    """Parameter groups, one per format in ``assignments`` (in order of first use), each
    with ``"states"`` set and the extra ``group`` settings (``lr=...``)."""
    named, _, _ = _named(model_or_named)
    groups: dict[str, dict[str, Any]] = {}
    for name, p in named:
        if name not in assignments:
            continue
        spec = str(assignments[name][0])
        if spec not in groups:
            groups[spec] = {"params": [], "states": spec, **group}
        groups[spec]["params"].append(p)
    return list(groups.values())


def from_model(
    model: nn.Module,
    optimizer: type[LowBitOptimizer] = LowBitAdamW,
    states: str | StateFormat = "int8",
    *,
    rules: Mapping[str, str | StateFormat] | None = None,
    min_size: int = MIN_SIZE,
    embeddings_float32: bool = True,
    **kwargs: Any,
) -> LowBitOptimizer:
    """An ``optimizer`` (a low-bit class) of ``model``'s trainable parameters, grouped by
    the formats `assign_formats` gives them; ``kwargs`` go to the optimizer (``lr=...``)."""
    if not (isinstance(optimizer, type) and issubclass(optimizer, LowBitOptimizer)):
        raise TypeError(
            f"optimizer must be a low-bit optimizer class (LowBitAdamW, LowBitAdam, "
            f"LowBitSGD), got {optimizer!r}"
        )
    assignments = assign_formats(
        model, states, rules=rules, min_size=min_size, embeddings_float32=embeddings_float32
    )
    groups = format_groups(model, assignments)
    return optimizer(groups, states=states, min_size=min_size, **kwargs)


def _low_bit_class(optimizer: torch.optim.Optimizer) -> type[LowBitOptimizer]:
    """The low-bit class standing for a torch optimizer of the engine's supported ones
    (`mixprec.optim.engine.SUPPORTED_OPTIMIZERS`, exactly those classes)."""
    if isinstance(optimizer, LowBitOptimizer):
        raise TypeError(f"{type(optimizer).__name__} is already a low-bit optimizer")
    kind = type(optimizer)
    if kind not in SUPPORTED_OPTIMIZERS:
        raise TypeError(
            f"from_optimizer converts torch.optim.AdamW, Adam and SGD, got {kind.__name__}"
        )
    if SUPPORTED_OPTIMIZERS[kind] == "sgd":
        return LowBitSGD
    if kind is torch.optim.AdamW or optimizer.defaults.get("decoupled_weight_decay"):
        return LowBitAdamW
    return LowBitAdam


def low_bit_settings(group: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A torch AdamW/Adam/SGD parameter group (live or saved) as the low-bit optimizer
    converted from it holds it: a flag the low-bit step does not honour refused when set
    (``amsgrad``...), torch's implementation flags dropped. ``name``: the torch class."""
    for flag, why in UNSUPPORTED_FLAGS.items():
        if group.get(flag):
            raise ValueError(f"{name}({flag}=True) cannot be converted: {why}")
    return {k: v for k, v in group.items() if k not in _DROPPED}


def from_optimizer(
    optimizer: torch.optim.Optimizer,
    states: str | StateFormat = "int8",
    formats: Mapping[torch.Tensor, str | StateFormat] | None = None,
    **kwargs: Any,
) -> LowBitOptimizer:
    """The low-bit optimizer standing for the torch ``optimizer`` (AdamW, Adam or SGD):
    the same parameter groups and settings, its state moved over with every float32 moment
    stored in its parameter's format (quantized). ``formats`` gives some parameters their
    own format (the optimizer's ``formats``: the groups stay one to one with the torch
    optimizer's); ``kwargs`` go to the new optimizer (``min_size``, ``compensation``,
    ``compile``...). A learning-rate scheduler built on the torch optimizer follows the new
    one once re-pointed (``scheduler.optimizer = converted``)."""
    cls = _low_bit_class(optimizer)
    name = type(optimizer).__name__
    groups = [low_bit_settings(g, name) for g in optimizer.param_groups]
    defaults = {k: v for k, v in optimizer.defaults.items() if k not in {*_DROPPED, *_GROUP_ONLY}}
    converted = cls(groups, **{**defaults, "states": states, "formats": formats, **kwargs})
    for group in converted.param_groups:
        for p in group["params"]:
            old = optimizer.state.get(p)
            if old:
                state = {k: v for k, v in old.items()}
                converted.state[p] = state
                converted.adopt(p, state, group)
    return converted
