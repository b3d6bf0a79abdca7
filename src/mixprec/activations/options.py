"""The activation options: how a layer keeps what its forward saves for the backward.

- ``keep``: as torch saves it (what autocast computed: float32 in a float32 island, bfloat16
  after a bfloat16 matmul);
- ``bf16``: saved float32 tensors stored as bfloat16, cast back when the backward reads them;
- ``fp8``: saved floating tensors stored as float8 e4m3 codes over blocks of 64 elements with
  one float32 scale each, the optimizer states' ``fp8`` codec at that block (attention's as
  ``bf16`` stores them: its backward recomputes its weights against an exact log-sum-exp);
- ``checkpoint``: nothing saved inside the layer; its forward runs again in the backward
  (torch's non-reentrant checkpointing), under the autocast and default dtype it ran in;
- ``selective``: matmul, convolution and attention outputs saved, the cheap ops between them
  recomputed (torch's selective checkpointing);
- ``offload``: saved tensors moved to pinned host memory and back (CUDA only).

Recomputing runs a forward twice, so a layer updating its buffers in place there (BatchNorm's
or InstanceNorm's running statistics in training) cannot be recomputed, and ``selective``
cannot take a recurrent layer (its CPU kernels write into the matmul outputs selective keeps):
`refusal` says so before anything runs.
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


def _first(module: nn.Module, kinds: tuple[type, ...], tracking: bool) -> str | None:
    """The path below `module` (``"<itself>"`` for it) of its first layer of one of `kinds`
    (with ``tracking``: only one tracking running statistics)."""
    for name, m in module.named_modules():
        if isinstance(m, kinds) and (not tracking or m.track_running_stats):
            return name or "<itself>"
    return None


def _where(module: nn.Module, inner: str) -> str:
    if inner == "<itself>":
        return "it"
    return f"its {type(module.get_submodule(inner)).__name__} (at {inner!r} inside it)"


# layers whose training forward updates buffers in place: normalizations tracking running
# statistics (BatchNorm, SyncBatchNorm, InstanceNorm with track_running_stats=True)
_TRACKING = (nn.modules.batchnorm._NormBase,)
# recurrent layers: on a CPU their kernels write in place into chunks of the matmul outputs
# that `selective` saves, so its recomputation reads mutated values (GRU: silently wrong
# gradients; RNN, LSTMCell: torch's error)
_RECURRENT = (nn.RNNBase, nn.RNNCellBase)


def refusal(module: nn.Module, option: str) -> str | None:
    """Why `module` cannot take `option` (None: it can). A recomputed forward runs twice per
    step, so running statistics would take each batch twice; ``selective`` keeps matmul
    outputs that a recurrent layer's kernels then write into."""
    if option not in RECOMPUTE:
        return None
    others = tuple(o for o in OPTIONS if o not in RECOMPUTE)
    inner = _first(module, _TRACKING, tracking=True)
    if inner is not None:
        return (
            f"{option!r} recomputes the forward in the backward, and {_where(module, inner)} "
            "updates running statistics in place there, so each batch would count twice; "
            f"give this module {accepted(others)}, recompute the modules around the "
            "normalization, or build it with track_running_stats=False"
        )
    inner = _first(module, _RECURRENT, tracking=False) if option == "selective" else None
    if inner is not None:
        return (
            f"'selective' keeps the matmul outputs for the backward, and {_where(module, inner)} "
            "writes into them in place (a recurrent layer's kernels do), so its recomputation "
            f"would read changed values; give this module {accepted(('checkpoint', *others))}"
        )
    return None
