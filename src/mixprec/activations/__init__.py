"""Activation memory per layer: how the tensors a forward saves for the backward are kept.

A `mixprec.PolicyMap`'s ``activations`` (or ``Precision(activations=...)``,
``Trainer(activations=...)``) gives each layer one option (`options`): ``keep``, ``bf16``,
``fp8``, ``checkpoint``, ``selective`` or ``offload``, by rules on module paths or types
(`rules`); `mixprec.apply` puts them on the model (`wrapper.install`), every door through it
alike, and `mixprec.shard` before FSDP2 shards it.

- `options`: the option names, which a module cannot take and why (`refusal`);
- `rules`: `ActivationRules`, each module's option and why;
- `codecs`: the storage of ``bf16`` and ``fp8`` (the optimizer states' float8 codec);
- `recompute`: ``checkpoint`` and ``selective``;
- `wrapper`: the forward wrapper, `install` and the checks before it goes on;
- `measure`: `saved_bytes`, each layer's saved activations for one batch.
"""

from __future__ import annotations

from mixprec.activations.codecs import Fp8Saved
from mixprec.activations.measure import saved_bytes
from mixprec.activations.options import OPTIONS, RECOMPUTE, refusal
from mixprec.activations.recompute import mark_region_cast
from mixprec.activations.rules import ActivationRules, ActivationsSpec, as_rules
from mixprec.activations.wrapper import (
    ActivationForward,
    check,
    check_device,
    install,
    installed,
    warn_if_root_unused,
    wrapped,
)

__all__ = [
    "OPTIONS",
    "RECOMPUTE",
    "ActivationForward",
    "ActivationRules",
    "ActivationsSpec",
    "Fp8Saved",
    "as_rules",
    "check",
    "check_device",
    "install",
    "installed",
    "mark_region_cast",
    "refusal",
    "saved_bytes",
    "warn_if_root_unused",
    "wrapped",
]
