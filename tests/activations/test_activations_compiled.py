"""A block compiled on its own before setup (``model.blocks[i] = torch.compile(block)``, as
torchtitan compiles per block) takes its activation option as the eager block does: the
option goes on the module torch.compile's wrapper compiles, as `mixprec.apply` takes a
compiled model's."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn

from mixprec import Precision
from mixprec.activations import saved_bytes, wrapped

BACKEND = "aot_eager"  # (dynamo's tracing and autograd without inductor: seconds, exact)


def net(compiled: bool) -> nn.Module:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.2), nn.GELU(), nn.Linear(32, 32))
    model = nn.Sequential(nn.Linear(16, 32), block, nn.Linear(32, 4))
    if compiled:
        model[1] = torch.compile(block, backend=BACKEND)
    return model


@pytest.mark.parametrize("option", ["bf16", "fp8", "checkpoint", "selective"])
def test_a_block_compiled_before_setup_takes_its_option_as_the_eager_block_does(option):
    """Found by a review: the option went on torch.compile's wrapper, outside its graph.
    ``bf16`` and ``fp8`` saw only the graph's saves, made without history, and kept them
    whole, silently (the review's fp8 block held 2.8x the eager block's bytes); ``checkpoint``
    and ``selective`` ran torch's checkpoint around the compiled call, which failed (dynamo
    raised tracing the watch on modules called in a recomputed forward, or torch's selective
    checkpointing found its cache "mutated"). On the module compiled, the block's saved bytes
    and gradients equal the eager block's bit for bit."""
    x = torch.randn(8, 16)
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = Precision("32-true", activations={"1": option}).setup(net(compiled))
        held = sum(n for path, n in saved_bytes(model, x).items() if path.startswith("1"))
        torch.manual_seed(1)  # dropout's masks
        model(x).pow(2).mean().backward()
        runs.append((held, [p.grad for p in model.parameters()], wrapped(model)))
    (eager_held, eager, _), (held, grads, on) = runs
    assert held == eager_held
    assert all(torch.equal(a, b) for a, b in zip(eager, grads, strict=True))
    assert on == {"1._orig_mod": option}


@pytest.mark.parametrize("option", ["bf16", "fp8"])
def test_a_block_compiled_inside_a_storing_model_runs_its_output_codecs_functions(option):
    """Found by a diff review: inside a block compiled on its own, under a model storing in
    ``bf16`` or ``fp8``, a softmax's or tanh's output stored near one, then another function
    the storing mode handles (an ``amax``, a ``log1p``) failed with a KeyError: dynamo broke
    inside the mode and ran the code it traced for the first function for the second. The
    mode leaves functions alone while dynamo traces them; the compiled block trains."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return h.softmax(-1).amax(-1) + torch.log1p(-h.tanh().pow(2) * 0.5).sum(-1)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(torch.compile(Block(), backend=BACKEND))
    model = Precision("32-true", activations=option).setup(model)
    model(torch.randn(8, 16)).sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
