"""Per-layer policies: rules from module paths or module types to a `Policy`.

Precedence, highest first, for each module (qualified name from `named_modules()`):

1. an exact path rule (the key equals the module's name);
2. a regex path rule (`re.fullmatch(key, name)`; no implicit prefix match);
3. a type rule (`isinstance(module, key)`);
4. a float32 island: layer/group/instance/RMS norms and softmax-type layers compute in
   float32 when the policy they would inherit is mixed, as torch's CUDA autocast computes
   norms and softmaxes. Where the device's own autocast already runs a layer's op in float32
   (`AUTOCAST_FLOAT32`: CUDA's layer_norm, group_norm and softmaxes) the layer is no island
   and gets no region: autocast does the very same casts, and a step dispatches exactly what
   a `torch.autocast` loop does. CPU autocast runs none of them in float32, so there each is
   an island, a difference from CPU autocast that `explain` states with its reason;
5. the parent's effective policy (children inherit);
6. the map's default.

Two rules of the same rank matching one module is an error naming both.

Beside its policy, a module whose forward calls attention (`calls_attention`) under a policy
computing in 16 bits may run that attention in float32 (`Resolution.float32_attention`): where
the device's 16-bit attention is slower than float32 (`mixprec.hardware.slow_attention`), or
as the map's ``float32_attention`` says.

A map may also say which optimizer-state format each parameter's moments take (``states``)
and how each layer keeps the tensors its forward saves for the backward (``activations``),
as `PolicyMap` tells; `explain` shows both.
"""

from __future__ import annotations

import difflib
import errno
import inspect
import json
import os
import re
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parameter import is_lazy

from mixprec.activations.rules import ActivationRules, ActivationsSpec, Choice, as_rules
from mixprec.aliasing import overlapping_pairs
from mixprec.errors import PolicySpecError
from mixprec.files import write_atomically
from mixprec.optim.states.assign import Assignment, assign_formats, closest, warn_unmatched_rules
from mixprec.optim.states.formats import StateFormat, parse_state_format
from mixprec.policy import Policy, QuantizedPolicy, as_policy
from mixprec.policy.files import (
    ACTIVATION_FORM,
    RULE_FORM,
    RuleKey,
    activations_code,
    activations_config,
    check_nameable,
    checked_states,
    code_name,
    config_activations,
    config_policy,
    config_rule_key,
    describe,
    type_name,
    unique_keys,
)
from mixprec.policy.matching import (
    PathRules,
    TypeRules,
    match_rule,
    split_rules,
    warn_types_imported_twice,
)
from mixprec.quantize.rules import skip_reason, weights_read_by_parents

__all__ = [
    "PolicyMap",
    "Resolution",
    "ISLAND_TYPES",
    "as_map",
    "dtype_plan",
    "check_bypassed",
    "float_dtypes",
    "is_policy_file",
    "island_policy",
    "config_in_words",
    "resumable_config",
]

# What torch's CUDA autocast runs in float32 (layer_norm, group_norm, softmax, ...), made
# true on every device. BatchNorm is not an island: its kernels take 16-bit inputs with
# float32 statistics and accumulate in float32 on CPU and CUDA alike, and a float32 island
# there costs step time and activation memory (docs/policies.md gives the figures).
ISLAND_TYPES: tuple[type[nn.Module], ...] = tuple(
    t
    for t in (
        nn.modules.instancenorm._InstanceNorm,
        nn.LayerNorm,
        nn.GroupNorm,
        nn.LocalResponseNorm,
        getattr(nn, "RMSNorm", None),
        nn.Softmax,
        nn.LogSoftmax,
        nn.Softmin,
    )
    if t is not None
)

# The island types whose op torch's autocast for that device type already runs in float32
# (CUDA's lists: layer_norm and group_norm cast to float32; softmax, log_softmax and softmin's
# softmax get a float32 result dtype). CPU autocast lists none of them.
AUTOCAST_FLOAT32: dict[str, tuple[type[nn.Module], ...]] = {
    "cuda": (nn.LayerNorm, nn.GroupNorm, nn.Softmax, nn.LogSoftmax, nn.Softmin),
}

StatesSpec = str | Mapping[str, str]

_SDPA = F.scaled_dot_product_attention

# unmatched path rules named (with the closest paths) in the one warning; the rest counted
_UNMATCHED_NAMED = 5


def _code_calls_attention(code: types.CodeType, names: Mapping[str, Any]) -> bool:
    """Whether `code` (or a function or comprehension nested in it) names torch's attention:
    an attribute ``scaled_dot_product_attention`` (``F.``, ``torch.nn.functional.``) or a
    global bound to that function under any name."""
    for name in code.co_names:
        if name == "scaled_dot_product_attention" or names.get(name) is _SDPA:
            return True
    return any(
        _code_calls_attention(c, names) for c in code.co_consts if isinstance(c, types.CodeType)
    )


@cache
def _class_calls_attention(cls: type[nn.Module]) -> bool:
    forward = inspect.unwrap(cls.forward)
    code = getattr(forward, "__code__", None)
    return code is not None and _code_calls_attention(code, getattr(forward, "__globals__", {}))


def calls_attention(module: nn.Module) -> bool:
    """Whether `module`'s own forward calls torch's `scaled_dot_product_attention`: its
    class's forward names that function. Read from the code, not run: attention reached
    through a helper defined elsewhere (a table of attention functions, as Hugging Face
    models use) is not seen, nor `nn.MultiheadAttention`'s, which runs inside
    `F.multi_head_attention_forward` where no torch function mode can reach it."""
    return _class_calls_attention(type(module))


@dataclass(frozen=True)
class Resolution:
    """The effective policy of one module and why it applies; under a quantized policy,
    whether the module is quantized or, for a layer with parameters, why it is skipped
    (it then runs in the policy's source float policy). `float32_attention`: why the
    attention its forward calls runs in float32 though its policy computes in 16 bits (None:
    it does not)."""

    policy: Policy
    source: str
    quantized: bool = False
    skipped: str | None = None
    float32_attention: str | None = None


def _with_quantization(
    res: Resolution, module: nn.Module, read: Mapping[int, str] | None = None
) -> Resolution:
    """``res`` with whether its quantized policy quantizes ``module`` or why not; ``read``:
    `weights_read_by_parents` of the model."""
    policy = res.policy
    if not isinstance(policy, QuantizedPolicy):
        return res
    reason = skip_reason(policy, module, (read or {}).get(id(module)))
    if reason is None:
        return Resolution(policy, res.source, quantized=True)
    if any(True for _ in module.parameters(recurse=False)):
        return Resolution(policy, res.source, skipped=reason)
    return Resolution(policy, res.source)


def float_dtypes(policy: Policy) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(param, compute, output): what a policy stores and computes in, quantization aside."""
    return (policy.param_dtype, policy.compute_dtype, policy.output_dtype)


def check_bypassed(model: nn.Module, resolved: Mapping[str, Resolution]) -> None:
    """Refuse a policy that `MultiheadAttention.out_proj` cannot follow: the attention reads
    its weight directly, so the projection's own forward (and region) never runs. (`apply`
    and `explain` both refuse it.)"""
    for name, module in model.named_modules():
        if not isinstance(module, nn.MultiheadAttention):
            continue
        inner = f"{name}.out_proj" if name else "out_proj"
        outer, proj = resolved[name], resolved[inner]
        if proj.quantized or float_dtypes(outer.policy) == float_dtypes(proj.policy):
            continue
        raise PolicySpecError(
            f"{inner!r} resolves to {proj.policy.name} ({proj.source}) but its "
            f"MultiheadAttention {name or '<root>'!r} to {outer.policy.name}: the attention "
            "uses out_proj's weight inside its own forward, so out_proj runs in the "
            f"attention's policy; give the rule to {name or '<root>'!r} itself"
        )


def _is_out_proj(name: str, modules: Mapping[str, nn.Module]) -> bool:
    """Whether the module at ``name`` is a `MultiheadAttention`'s ``out_proj``."""
    parent, _, leaf = name.rpartition(".")
    return (
        leaf == "out_proj"
        and isinstance(modules.get(name), nn.Linear)
        and isinstance(modules.get(parent), nn.MultiheadAttention)
    )


def island_policy(inherited: Policy) -> Policy:
    """The float32 island a norm/softmax layer gets inside a mixed policy."""
    return Policy(
        param_dtype=inherited.param_dtype, compute_dtype="float32", output_dtype="float32"
    )


def _rule_policy(key: Any, policy: Any) -> Policy:
    """The policy of the rule ``key``; None is refused (it would read as "no rule here", while
    `as_policy` takes it as the global policy of the moment)."""
    if policy is None:
        name = key.__name__ if isinstance(key, type) else repr(key)
        raise PolicySpecError(
            f"the rule {name} has no policy (None); give a policy such as '32-true' or "
            "'bf16-mixed', or leave the rule out to have the layer follow its parent"
        )
    return as_policy(policy)


class PolicyMap:
    """A default policy plus ordered rules (path regex or module type -> policy).

    The one policy type the rest of mixprec holds: a plain policy is a map with no rules.
    ``states``: the optimizer-state format of every parameter (``"int8"``) or rules from
    module path regexes to formats (``{"head": "int4", "tok": "float32"}``, first match in
    order), for `Precision.setup` to convert the optimizer with (`state_formats`).
    ``activations``: how every layer keeps its saved activations (``"fp8"``) or rules from
    module path regexes or module types to options (``{r"blocks\\.\\d+": "checkpoint"}``),
    which `mixprec.apply` puts on the model (`mixprec.activations`).
    """

    def __init__(
        self,
        default: Any = None,
        rules: Mapping[RuleKey, Any] | None = None,
        *,
        float32_islands: bool = True,
        float32_attention: bool | None = None,
        states: StatesSpec | None = None,
        activations: ActivationsSpec | ActivationRules | None = None,
    ) -> None:
        self.default: Policy = as_policy(default)
        # how each layer keeps its saved activations: None keeps them all as torch does
        self.activations: ActivationRules | None = as_rules(activations)
        # optimizer-state formats: one for every parameter, or {module path regex: format}
        self.states: str | dict[str, str] | None = checked_states(states)
        if not isinstance(float32_islands, bool):
            raise TypeError(
                f"float32_islands must be True or False, not {type(float32_islands).__name__} "
                f"{float32_islands!r}"
            )
        if float32_attention is not None and not isinstance(float32_attention, bool):
            raise TypeError(
                "float32_attention must be True, False or None (where the device's 16-bit "
                f"attention is slower than float32), not {type(float32_attention).__name__} "
                f"{float32_attention!r}"
            )
        self.float32_islands = float32_islands
        # attention (scaled_dot_product_attention) in float32 under 16-bit policies: True
        # everywhere, False nowhere, None where `hardware.slow_attention` says it is faster
        self.float32_attention = float32_attention
        if rules is not None and not isinstance(rules, Mapping):
            example = (
                " (dict(...) turns a list of (key, policy) pairs into one)"
                if isinstance(rules, (list, tuple))
                else ""
            )
            raise TypeError(
                f"PolicyMap rules must be a mapping {{path regex or module type: policy}}, got "
                f"{type(rules).__name__} {rules!r}{example}; e.g. "
                "PolicyMap('bf16-mixed', {'head': '32-true', nn.LayerNorm: '32-true'})"
            )
        # path rules (compiled) and type rules, each in the order given
        self._paths: PathRules[Policy]
        self._types: TypeRules[Policy]
        self._paths, self._types = split_rules(
            {k: _rule_policy(k, p) for k, p in (rules or {}).items()}
        )

    @property
    def rules(self) -> dict[RuleKey, Policy]:
        """The rules as given, path rules first."""
        return {**{k: p for k, (_, p) in self._paths.items()}, **self._types}

    def _ruled(self, name: str, module: nn.Module) -> Resolution | None:
        found = match_rule(self._paths, self._types, name, module)
        return None if found is None else Resolution(*found)

    def unmatched_paths(self, names: list[str]) -> list[str]:
        """The path rules that match none of `names` (module paths)."""
        return [
            key
            for key, (rx, _) in self._paths.items()
            if key not in names and not any(rx.fullmatch(n) for n in names)
        ]

    def warn_unmatched_rules(self, model: nn.Module, *, stacklevel: int = 2) -> None:
        """Warn about the rules that match no module of ``model``: path rules (a typo far
        more often than intent), in one warning for all of them (a generated map may hold
        thousands), each named with the closest paths; and, in another, type rules that
        match no module while a module of a class of the same name is there: a class imported
        twice (a script loaded under another module name) is two classes, and the rule names
        the one the model's instances are not (a rule for a type the model lacks, as a map
        shared by several models holds, is not warned of). ``stacklevel`` counts from the
        caller, as `warnings.warn`'s."""
        warn_types_imported_twice(self._types, model, "policy", stacklevel + 1)
        names = [name for name, _ in model.named_modules(remove_duplicate=False)]
        unmatched = self.unmatched_paths(names)
        if not unmatched:
            return

        def closest(key: str) -> str:
            close = difflib.get_close_matches(key, [n for n in names if n], n=3, cutoff=0.5)
            return ", ".join(map(repr, close))

        how = "rules are re.fullmatch'ed against named_modules() paths"
        if len(unmatched) == 1:
            (key,) = unmatched
            hint = f"; closest paths: {closest(key)}" if closest(key) else ""
            message = (
                f"policy rule {key!r} matches no module of {type(model).__name__} ({how}){hint}"
            )
        else:
            said = [
                f"{key!r}" + (f" (closest paths: {closest(key)})" if closest(key) else "")
                for key in unmatched[:_UNMATCHED_NAMED]
            ]
            more = len(unmatched) - len(said)
            message = (
                f"{len(unmatched)} policy rules match no module of {type(model).__name__} "
                f"({how}): " + ", ".join(said) + (f" and {more} more" if more else "")
            )
        warnings.warn(message, stacklevel=stacklevel + 1)

    def resolve(
        self,
        model: nn.Module,
        *,
        slow_attention: frozenset[torch.dtype] = frozenset(),
        device_type: str = "cpu",
    ) -> dict[str, Resolution]:
        """Effective policy of every module of `model`, keyed by qualified name.

        A module reachable at two paths (shared) runs in one policy: paths resolving it to
        different policies are an error naming both. `slow_attention`: the 16-bit dtypes in
        which the device's attention is slower than float32 (`hardware.slow_attention`),
        where a policy computing in them runs its attention in float32 unless
        `float32_attention` says otherwise. `device_type`: where the model runs, whose
        autocast may already compute an island type in float32 (`AUTOCAST_FLOAT32`)."""
        covered = AUTOCAST_FLOAT32.get(device_type, ())
        out: dict[str, Resolution] = {}
        first_path: dict[int, str] = {}
        modules = dict(model.named_modules(remove_duplicate=False))
        read = weights_read_by_parents(model)
        for name, module in modules.items():
            if name in out:
                continue
            self._resolve_one(name, module, out, covered, device_type, read)
            self._follow_attention(name, module, modules, out, read)
            out[name] = self._attention_island(module, out[name], slow_attention)
            other = first_path.setdefault(id(module), name)
            if other != name and out[other].policy != out[name].policy:
                a, b = out[other], out[name]
                raise PolicySpecError(
                    f"module {type(module).__name__} is reachable at {other!r} and {name!r}, "
                    f"which resolve to {a.policy.name} ({a.source}) and {b.policy.name} "
                    f"({b.source}); one module runs in one policy: give both paths the same "
                    "policy"
                )
        return out

    def _follow_attention(
        self,
        name: str,
        module: nn.Module,
        modules: dict[str, nn.Module],
        out: dict[str, Resolution],
        read: Mapping[int, str] | None = None,
    ) -> None:
        """`MultiheadAttention` uses its `out_proj` weight inside its own forward, so the
        projection runs in the attention's policy: a type or regex rule that reaches it
        through the attention (a rule on every Linear) gives way. A path rule naming it
        stays, and `apply` refuses it with the reason."""
        parent, _, leaf = name.rpartition(".")
        if leaf != "out_proj" or not isinstance(module, nn.Linear):
            return
        if not isinstance(modules.get(parent), nn.MultiheadAttention):
            return
        attention = out[parent]
        if out[name].source.startswith("path") or self._aimed_at_out_projs(name, modules):
            return
        if float_dtypes(out[name].policy) != float_dtypes(attention.policy):
            out[name] = _with_quantization(
                Resolution(attention.policy, f"follows its attention {parent or '<root>'}"),
                module,
                read,
            )

    def _aimed_at_out_projs(self, name: str, modules: Mapping[str, nn.Module]) -> bool:
        """Whether a regex rule deciding for the ``out_proj`` at ``name`` matches attentions'
        out_projs only (``attn\\.out_proj``, ``.*\\.out_proj``): aimed at them as a path
        rule is, it stays, so that `apply` refuses it, where one reaching other modules too
        (``.*proj``) gives way as a type rule does."""
        hits = [rx for rx, _ in self._paths.values() if rx.fullmatch(name)]
        if len(hits) != 1:
            return False
        return all(_is_out_proj(n, modules) for n in modules if hits[0].fullmatch(n))

    def _attention_island(
        self, module: nn.Module, res: Resolution, slow: frozenset[torch.dtype]
    ) -> Resolution:
        """`res` with `float32_attention` set where `module` calls attention under a policy
        computing in 16 bits and the map (or, left to the device, `slow`) wants it in
        float32."""
        policy = res.policy
        dtype = policy.compute_dtype
        if dtype not in (torch.bfloat16, torch.float16):
            return res
        if self.float32_attention is False or not calls_attention(module):
            return res
        if self.float32_attention:
            why = "float32_attention=True"
        elif dtype in slow:
            why = f"{str(dtype).removeprefix('torch.')} attention is slower than float32 here"
        else:
            return res
        return Resolution(policy, res.source, res.quantized, res.skipped, why)

    def _resolve_one(
        self,
        name: str,
        module: nn.Module,
        out: dict[str, Resolution],
        covered: tuple[type[nn.Module], ...] = (),
        device_type: str = "cpu",
        read: Mapping[int, str] | None = None,
    ) -> None:
        ruled = self._ruled(name, module)
        if ruled is not None:
            out[name] = _with_quantization(ruled, module, read)
            return
        parent = name.rpartition(".")[0] if name else None
        if parent is None:
            inherited = Resolution(self.default, "default")
        else:
            up = out[parent].policy
            inherited = Resolution(up, f"inherited from {parent or '<root>'}")
        if self.float32_islands and isinstance(module, ISLAND_TYPES) and inherited.policy.is_mixed:
            if isinstance(module, covered):
                why = f"{inherited.source}; {device_type} autocast computes it in float32 itself"
                out[name] = _with_quantization(Resolution(inherited.policy, why), module, read)
            else:
                out[name] = Resolution(island_policy(inherited.policy), "float32 island")
        else:
            out[name] = _with_quantization(inherited, module, read)

    def state_default(self, optimizer_states: str | StateFormat | None = None) -> str | None:
        """The state format of the parameters no state rule names, canonically spelled:
        ``optimizer_states`` (`Precision`'s), else this map's single ``states`` format; None
        when neither gives one. Another ``optimizer_states`` beside a single ``states`` is
        refused: the format is given once."""
        given = str(parse_state_format(optimizer_states)) if optimizer_states is not None else None
        if isinstance(self.states, str):
            if given not in (None, self.states):
                raise ValueError(
                    f"optimizer_states={given!r}, but the policy map's states say "
                    f"{self.states!r}: give the format once"
                )
            return self.states
        return given

    def state_formats(
        self, model: nn.Module, default: str | None = None, *, frozen: bool = False
    ) -> dict[str, Assignment]:
        """Each trainable parameter's (with ``frozen``, every parameter's: an optimizer
        converted holds frozen ones, stepped once unfrozen) optimizer-state format and why, as
        `mixprec.optim.states.assign_formats` decides: parameters under its ``min_size`` keep
        float32 ("small"); then this map's state rules (``re.fullmatch`` on the module path
        owning the parameter, the first rule in order wins; a tied parameter is matched under
        every owner's path, and owners ruled into different formats are a `PolicySpecError`);
        then embedding tables keep float32; the rest take ``default`` (`Precision`'s
        ``optimizer_states``), else the map's single ``states`` format, else float32."""
        if isinstance(self.states, str):
            default = default or self.states
        rules = self.states if isinstance(self.states, dict) else {}
        return assign_formats(
            model,
            default or "float32",
            rules=rules,
            warn=False,  # `warn_unmatched_states` names the rules as written
            frozen=frozen,
            on_modules=True,  # a rule names the module owning its parameters
        )

    def warn_unmatched_states(self, model: nn.Module, *, stacklevel: int = 2) -> None:
        """Warn, as for policy rules, about the state rules that match no module owning
        parameters of ``model``: a typo far more often than intent. A rule written as a
        parameter name (``"2.weight"``) is told its module's path (``"2"``), one naming a
        module without parameters of its own (``"body"``) the rule reaching those below."""
        if not isinstance(self.states, dict):
            return
        params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        owners = sorted({n.rpartition(".")[0] for n in params})  # ("" where the root has some)
        modules = [n for n, _ in model.named_modules(remove_duplicate=False) if n]
        unmatched = {}
        for key in self.states:
            rx = re.compile(key)
            if any(rx.fullmatch(o) for o in owners):
                continue
            param = next((n for n in params if rx.fullmatch(n)), None)
            module = next((m for m in modules if rx.fullmatch(m)), None)
            if param is not None:
                hint = f"{param!r} is a parameter: name its module, {param.rpartition('.')[0]!r}"
            elif module is not None:
                below = key + r"\..*"
                hint = f"{module!r} has no parameters of its own: '{below}' names those below it"
            else:
                hint = closest(key, owners)
            unmatched[key] = hint
        warn_unmatched_rules(
            unmatched,
            f"module of {type(model).__name__} owning parameters",
            "state rules are re.fullmatch'ed against module paths, as policy rules are, "
            "not parameter names",
            stacklevel=stacklevel + 1,
        )

    def activation_choices(self, model: nn.Module) -> dict[str, Choice]:
        """Each module's activation option and why (``keep`` everywhere without
        ``activations``), as `mixprec.activations.ActivationRules.resolve` decides."""
        return (self.activations or ActivationRules()).resolve(model)

    def with_activations(self, activations: ActivationsSpec | ActivationRules) -> PolicyMap:
        """This map with ``activations`` (`Precision`'s); refused when this map has other
        activation rules: they are given once."""
        given = as_rules(activations)
        if self.activations is not None and self.activations != given:
            raise PolicySpecError(
                f"activations={given.spec()!r}, but the policy map's activations say "
                f"{self.activations.spec()!r}: give them once"
            )
        return self.replace(activations=given)

    def replace(self, **changes: Any) -> PolicyMap:
        """This map with some of its arguments changed (``default``, ``rules``,
        ``float32_islands``, ``float32_attention``, ``states``, ``activations``), the rest
        as they are: ``plan.replace(states="int8")``."""
        given = dict(
            default=self.default,
            rules=self.rules,
            float32_islands=self.float32_islands,
            float32_attention=self.float32_attention,
            states=self.states,
            activations=self.activations,
        )
        unknown = sorted(set(changes) - set(given))
        if unknown:
            raise TypeError(f"PolicyMap has no argument {unknown[0]!r}; it takes {list(given)}")
        return PolicyMap(**{**given, **changes})

    def policies(self) -> set[Policy]:
        """Every policy this map can hand out (default, rules, and islands)."""
        found = {self.default, *self._types.values(), *(p for _, p in self._paths.values())}
        if self.float32_islands:
            found |= {island_policy(p) for p in found if p.is_mixed}
        return found

    def compute_dtypes(self) -> set[torch.dtype]:
        return {p.compute_dtype for p in self.policies()}

    @property
    def needs_loss_scaling(self) -> bool:
        return any(p.needs_loss_scaling for p in self.policies())

    @property
    def name(self) -> str:
        n = len(self._paths) + len(self._types)
        return self.default.name if n == 0 else f"{self.default.name} + {n} rule(s)"

    def to_config(self) -> dict[str, Any]:
        """JSON-friendly dict; type keys are stored as 'type:package.module.Class'."""
        return {
            "default": self.default.to_config(),
            "rules": [{"path": k, "policy": p.to_config()} for k, (_, p) in self._paths.items()]
            + [{"type": type_name(t), "policy": p.to_config()} for t, p in self._types.items()],
            "float32_islands": self.float32_islands,
            # left out when None (the device decides), so maps without it keep their files
            **(
                {"float32_attention": self.float32_attention}
                if self.float32_attention is not None
                else {}
            ),
            **({"states": self.states} if self.states is not None else {}),
            **(
                {"activations": activations_config(self.activations)}
                if self.activations is not None
                else {}
            ),
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> PolicyMap:
        """Inverse of `to_config`, as strict as the constructor: an unknown key, a null or a
        value of the wrong type is an error naming the key and what it takes. A policy may
        be given as a name (``"bf16-mixed"``) or as `Policy.to_config()` gives it."""
        if not isinstance(config, Mapping) or "default" not in config:
            raise PolicySpecError(
                "PolicyMap.from_config takes the dict PolicyMap.to_config() returns (keys "
                "default, rules, float32_islands, float32_attention, states, activations; "
                "'default', the "
                f"policy of the modules no rule names, is required), got {config!r}"
            )
        unknown = [key for key in config if key not in _MAP_KEYS]
        if unknown:
            raise PolicySpecError(
                f"unknown policy map key(s) {', '.join(map(repr, unknown))}; the keys are "
                "'default' (a policy), 'rules' (a list of rules, " + RULE_FORM + "), "
                "'float32_islands' (true or false), 'float32_attention' (true or false; "
                "left out: where the device's 16-bit attention is slower than float32) and "
                "'states' (an optimizer-state format, or {module path regex: format}) and "
                "'activations' (an activation option, or a list of rules, " + ACTIVATION_FORM + ")"
            )
        default = config_policy("'default'", config["default"])
        rule_list = config.get("rules", [])
        if not isinstance(rule_list, (list, tuple)):
            raise PolicySpecError(
                f"'rules' is {describe(rule_list)}; it is a list of rules, each " + RULE_FORM
            )
        islands = config.get("float32_islands", True)
        if not isinstance(islands, bool):
            raise PolicySpecError(f"'float32_islands' is {describe(islands)}; it is true or false")
        attention = config.get("float32_attention")
        if "float32_attention" in config and not isinstance(attention, bool):
            raise PolicySpecError(
                f"'float32_attention' is {describe(attention)}; it is true or false (left "
                "out: where the device's 16-bit attention is slower than float32)"
            )
        rules: dict[RuleKey, Policy] = {}
        for i, rule in enumerate(rule_list):
            key = config_rule_key(i, rule)
            if key in rules:
                shown = key if isinstance(key, str) else type_name(key)
                raise PolicySpecError(
                    f"rule {i} repeats the rule for {shown!r}: one rule per path or type"
                )
            rules[key] = config_policy(f"rule {i} 'policy'", rule["policy"])
        if "states" in config and config["states"] is None:
            raise PolicySpecError(
                "'states' is null; it is one optimizer-state format ('int8') or an object "
                "{module path regex: format}, or left out"
            )
        return cls(
            default,
            rules,
            float32_islands=islands,
            float32_attention=attention,
            states=config.get("states"),
            activations=config_activations(config["activations"])
            if "activations" in config
            else None,
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write `to_config()` as a JSON policy file (atomically: a reader never sees half of
        it); `PolicyMap.load`, `mixprec.Precision`, the Trainer's ``precision=`` and the
        CLI's ``--precision`` read it back. Returns the path."""
        for t in [*self._types, *(self.activations.rules if self.activations else {})]:
            if isinstance(t, type):
                check_nameable(t, "PolicyMap.load could not import it back")
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(
                errno.EISDIR,
                f"cannot save a policy file at {str(path)!r}: it is a directory; give a file "
                f"path, e.g. {str(path / 'policy.json')!r}",
            )
        try:
            write_atomically(path, json.dumps(self.to_config(), indent=2) + "\n")
        except OSError as error:  # said of the file asked for, not of the temporary one
            missing = (
                "" if path.parent.is_dir() else f" (its folder {str(path.parent)!r} does not exist)"
            )
            raise type(error)(
                error.errno, f"cannot save the policy file {str(path)!r}: {error.strerror}{missing}"
            ) from None
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PolicyMap:
        """The policy a JSON file holds: a map as `save` writes it (the doctor's
        ``policy.json``), or a single policy's `Policy.to_config()`. Checked as strictly as
        `from_config`: unknown or repeated keys, nulls and wrong types are errors naming the
        file, the key and what it takes."""
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise PolicySpecError(f"cannot read the policy file {str(path)!r}: {error}") from None
        try:
            config = json.loads(text, object_pairs_hook=unique_keys)
        except json.JSONDecodeError as error:
            raise PolicySpecError(f"cannot read the policy file {str(path)!r}: {error}") from None
        except PolicySpecError as error:  # a repeated key
            raise PolicySpecError(f"policy file {str(path)!r}: {error}") from None
        if not isinstance(config, Mapping):
            raise PolicySpecError(
                f"policy file {str(path)!r} holds {describe(config)}; a policy file holds a "
                'JSON object: a policy map as PolicyMap.save writes it ({"default": policy, '
                '"rules": [...], "float32_islands": true}) or one policy as '
                'Policy.to_config() gives it ({"param_dtype": ..., "compute_dtype": ..., '
                '"output_dtype": ...}); e.g. {"default": "bf16-mixed"}'
            )
        try:
            return as_map(config)
        except (PolicySpecError, TypeError, ValueError) as error:
            raise PolicySpecError(f"policy file {str(path)!r}: {error}") from None

    def to_code(self) -> str:
        """Python source that rebuilds this map (what the doctor prints for users to paste).

        Raises for a type rule whose class Python source cannot name (defined in a function).
        """
        lines = ["mixprec.PolicyMap(", f"    {self.default.name!r},", "    {"]
        for key, (_, p) in self._paths.items():
            lines.append(f"        {key!r}: {p.name!r},")
        for t, p in self._types.items():
            lines.append(f"        {code_name(t)}: {p.name!r},")
        lines.append("    },")
        if not self.float32_islands:
            lines.append("    float32_islands=False,")
        if self.float32_attention is not None:
            lines.append(f"    float32_attention={self.float32_attention},")
        if self.states is not None:
            lines.append(f"    states={self.states!r},")
        if self.activations is not None:
            lines.append(f"    activations={activations_code(self.activations)},")
        lines.append(")")
        return "\n".join(lines)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PolicyMap):
            return NotImplemented
        return self.to_config() == other.to_config()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        rules = ", ".join(
            f"{k!r}: {p.name!r}" if isinstance(k, str) else f"{k.__name__}: {p.name!r}"
            for k, p in self.rules.items()
        )
        states = f", states={self.states!r}" if self.states is not None else ""
        if self.activations is not None:
            states += f", activations={self.activations.spec()!r}"
        return f"PolicyMap({self.default.name!r}, {{{rules}}}{states})"


_MAP_KEYS = ("default", "rules", "float32_islands", "float32_attention", "states", "activations")


def is_policy_file(spec: Any) -> bool:
    """Whether a precision spec names a policy file (a path ending in ``.json``) rather than a
    precision: no precision name ends that way."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    return isinstance(spec, str) and spec.lower().endswith(".json")


def as_map(policy: Any = None) -> PolicyMap:
    """The one coercion to a policy type: a PolicyMap as it is, anything `as_policy` takes
    (a spec, Policy, config dict; None: the global policy) as a map with no rules, a
    `PolicyMap.to_config()` dict (any dict with a map's key) as the map it describes, and a
    ``.json`` path as the policy file it names (`PolicyMap.load`)."""
    if isinstance(policy, PolicyMap):
        return policy
    if is_policy_file(policy):
        return PolicyMap.load(policy)
    if isinstance(policy, Mapping) and any(key in policy for key in _MAP_KEYS):
        return PolicyMap.from_config(policy)
    return PolicyMap(as_policy(policy))


def dtype_plan(
    model: nn.Module, resolved: dict[str, Resolution], *, replaced: bool = False
) -> list[tuple[nn.Module, str, str, torch.dtype]]:
    """(module, "parameter"/"buffer", key, dtype) for every floating tensor whose dtype the
    policy changes; a `PolicySpecError` for a tensor shared by modules that store it in
    different dtypes. Changes nothing, so `apply` can check before it converts (and
    `explain` refuses what `apply` would).
    `replaced`: leave out the layers quantization is about to replace (a head quantized
    apart from the embedding it shares a weight with shares nothing afterwards)."""
    owners: dict[int, tuple[str, torch.dtype]] = {}
    plan = []
    params: list[tuple[str, nn.Parameter, torch.dtype]] = []  # each Parameter once
    for name, module in model.named_modules():
        if replaced and resolved[name].quantized:
            continue
        policy = resolved[name].policy
        fixed = getattr(module, "fixed_dtype_buffers", ())  # float8 delayed scales
        for kind, store in (("parameter", module._parameters), ("buffer", module._buffers)):
            dtype = policy.param_dtype if kind == "parameter" else policy.buffer_dtype
            for key, t in store.items():
                if t is None or not t.is_floating_point():
                    continue
                if kind == "buffer" and key in fixed:
                    continue
                path = f"{name}.{key}" if name else key
                seen = owners.setdefault(id(t), (path, dtype))
                if seen[1] != dtype:
                    raise PolicySpecError(
                        f"{kind} {path} is shared with {seen[0]!r}, but the policy stores it "
                        f"as {dtype} here and {seen[1]} there; give both modules the same "
                        "param dtype"
                    )
                if t.dtype != dtype:
                    plan.append((module, kind, key, dtype))
                if kind == "parameter" and seen[0] == path:
                    params.append((path, t, dtype))
    _refuse_aliases(params)
    return plan


def _refuse_aliases(params: list[tuple[str, nn.Parameter, torch.dtype]]) -> None:
    """Refuse two parameters (distinct objects) over overlapping memory, as
    ``b.weight = nn.Parameter(a.weight.data)`` ties them, where the policy changes the dtype
    of either: each is cast apart, so they would no longer share memory, and training would
    move them apart silently."""
    held = []
    for path, t, dtype in params:
        if is_lazy(t) or not t.numel() or t.device.type == "meta":
            continue
        try:
            t.data_ptr()
        except RuntimeError:  # (a tensor subclass without memory of its own: a DTensor's)
            continue
        held.append((path, t, t.dtype != dtype))
    for i, j in overlapping_pairs([t for _, t, _ in held]):
        if held[i][2] or held[j][2]:
            raise PolicySpecError(
                f"parameters {held[i][0]} and {held[j][0]} are two Parameters over the same "
                "memory (as b.weight = nn.Parameter(a.weight.data) ties them), and the policy "
                "changes their dtype: each would be cast apart and they would train apart. Tie "
                "them as one Parameter (b.weight = a.weight), or give both a policy that keeps "
                "their dtype"
            )


def resumable_config(config: Any) -> Any:
    """A map's ``to_config()`` as a resume compares it: without the activation options,
    which leave the weights, the loss scaler, the masters and the optimizer state as they
    are (a run resumed with ``checkpoint`` after running out of memory is the same run)."""
    if isinstance(config, Mapping):
        return {k: v for k, v in config.items() if k != "activations"}
    return config


def config_in_words(config: Any) -> str:
    """A saved map's ``to_config()`` in words: the map it builds, or the config itself where
    its type rules' classes cannot be imported here (a class defined in a script)."""
    try:
        return repr(PolicyMap.from_config(config))
    except PolicySpecError:
        return repr(config)
