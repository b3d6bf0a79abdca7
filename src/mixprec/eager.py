"""Functions that run outside any enclosing ``torch.compile``, with dynamo loaded at their
first call rather than when the module defining them is imported, and the switch that makes
torch.compile trace a compiled region's backward as eager runs it.

``torch.compiler.disable`` applied as a decorator imports torch's dynamo on the spot (about
a second): a process that never compiles (the bench's and the planner's measuring
processes, ``mixprec info``, a launched rank) paid it for every class so decorated.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch._functorch import config as functorch_config

__all__ = ["DYNAMO", "backward_outside_autocast", "compiled_wrapper", "uncompiled"]

F = TypeVar("F", bound=Callable[..., Any])


# sets torch's tracing of a compiled region's backward to "outside autocast" and returns the
# function that puts the setting back (dynamo's low-overhead patcher where torch has it)
if hasattr(functorch_config, "_make_closure_patcher") and hasattr(
    functorch_config, "backward_pass_autocast"
):
    backward_outside_autocast: Callable[[], Callable[[], None]] = (
        functorch_config._make_closure_patcher(backward_pass_autocast="off")
    )
else:  # pragma: no cover - a torch without the setting traces its backward as it does

    def backward_outside_autocast() -> Callable[[], None]:
        return lambda: None


# the module a torch.compile call loads: absent, nothing in the process is compiled
DYNAMO = "torch._dynamo.eval_frame"


def compiled_wrapper(model: Any) -> bool:
    """Whether ``model`` is torch.compile's wrapper of a module (``OptimizedModule``), asked
    without importing dynamo: loaded only by a compile, it made none where it is absent."""
    eval_frame = sys.modules.get(DYNAMO)
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def uncompiled(fn: F) -> F:
    """``fn`` as ``torch.compiler.disable(fn)`` runs it (a graph break in a compiled caller;
    nothing traced inside), the disabled function made at the first call."""
    made: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not made:
            made.append(torch.compiler.disable(fn))
        return made[0](*args, **kwargs)

    return call  # type: ignore[return-value]
