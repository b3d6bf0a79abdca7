"""The activation options: how a layer keeps what its forward saves for the backward.

- ``keep``: as torch saves it (what autocast computed: float32 in a float32 island, bfloat16
  after a bfloat16 matmul);
- ``bf16``: saved float32 tensors stored as bfloat16, cast back when the backward reads them;
- ``fp8``: saved floating tensors stored as float8 e4m3 codes over blocks of 256 elements with
  one float32 scale each, the optimizer states' ``fp8`` codec (attention's as ``bf16`` stores
  them: its backward recomputes its weights against an exact log-sum-exp);
- ``checkpoint``: nothing saved inside the layer; its forward runs again in the backward
  (torch's non-reentrant checkpointing), under the autocast and default dtype it ran in;
- ``selective``: matmul, convolution and attention outputs saved, the cheap ops between them
  recomputed (torch's selective checkpointing);
- ``offload``: saved tensors moved to pinned host memory and back (CUDA only).

Recomputing runs a forward twice, so a layer updating its buffers in place there (BatchNorm's
running statistics in training) cannot be recomputed: `refusal` says so before anything runs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mixprec.errors import PolicySpecError

__all__ = [
    "OPTIONS",
    "RECOMPUTE",
    "accepted",
    "check_option",
    "refusal",
]

OPTIONS: tuple[str, ...] = ("keep", "bf16", "fp8", "checkpoint", "selective", "offload")
# the options storing saved tensors in fewer bits
STORAGE: frozenset[str] = frozenset({"bf16", "fp8"})
# the options running the forward again in the backward
RECOMPUTE: frozenset[str] = frozenset({"checkpoint", "selective"})


def accepted(options: tuple[str, ...] = OPTIONS) -> str:
    """The options as an error message lists them: ``'keep', 'bf16', ... or 'offload'``."""
    quoted = [repr(o) for o in options]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1] if len(quoted) > 1 else quoted[0]


def check_option(value: Any, where: str = "activations") -> str:
    """`value` as an option name (case and surrounding spaces aside); an error naming
    `where` and the accepted options otherwise."""
    if not isinstance(value, str) or value.strip().lower() not in OPTIONS:
        shown = f"{type(value).__name__} {value!r}" if not isinstance(value, str) else repr(value)
        raise PolicySpecError(f"{where}: unknown activation option {shown}; expected {accepted()}")
    return value.strip().lower()


def _updates_buffers(module: nn.Module) -> str | None:
    """The path (below `module`) of a layer whose training forward updates its buffers in
    place: a BatchNorm tracking running statistics."""
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            return name or "<itself>"
    return None


def refusal(module: nn.Module, option: str) -> str | None:
    """Why `module` cannot take `option` (None: it can). A recomputed forward runs twice per
    step, so BatchNorm's running statistics would take each batch twice."""
    if option not in RECOMPUTE:
        return None
    inner = _updates_buffers(module)
    if inner is None:
        return None
    others = tuple(o for o in OPTIONS if o not in RECOMPUTE)
    layer = type(module.get_submodule("" if inner == "<itself>" else inner)).__name__
    where = "it" if inner == "<itself>" else f"its {layer} {inner!r}"
    return (
        f"{option!r} recomputes the forward in the backward, and {where} updates running "
        "statistics in place there, so each batch would count twice; "
        f"give this module {accepted(others)}, recompute the modules around the BatchNorm, "
        "or build it with track_running_stats=False"
    )
