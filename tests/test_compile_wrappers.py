"""torch.compile around mixprec's contexts and of converted models, found by a review:
gradients of a function compiled whole with `forward_context` inside, and `apply`,
`remove` and `explain` given torch.compile's wrapper."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import mixprec
from mixprec.policy.map import PolicyMap

BACKEND = "aot_eager"  # (dynamo's tracing and autograd without inductor: seconds, exact)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _gradients(compiled: bool) -> tuple[dict[str, torch.Tensor], int]:
    torch._dynamo.reset()
    counters.clear()
    precision = mixprec.Precision(PolicyMap("bf16-mixed", {"2": "float32"}), allow_slow=True)
    model = precision.setup(_net())

    def loss_of(x, y):
        with precision.forward_context():
            return F.mse_loss(model(x), y)

    run = torch.compile(loss_of, backend=BACKEND) if compiled else loss_of
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    run(x, torch.ones(8, 4)).backward()
    breaks = sum(counters["graph_break"].values())
    return {n: p.grad for n, p in model.named_parameters()}, breaks


def test_forward_context_compiled_inside_a_function_gives_eagers_gradients():
    """The context's backward-outside-autocast wrapper, which dynamo cannot trace, broke
    the graph and left the backward traced in autocast: the float32 layer's gradients were
    computed in bfloat16 (0.3-0.6% off eager's)."""
    eager, _ = _gradients(compiled=False)
    compiled, breaks = _gradients(compiled=True)
    assert breaks == 0
    for name, grad in eager.items():
        assert torch.equal(grad, compiled[name]), name


def test_apply_refuses_a_compile_wrapper_and_remove_and_explain_see_through_it():
    """apply on torch.compile(model) converted the wrapper: regions outside the graph (16-bit
    backward in float32 rules), rules under '_orig_mod.'; remove and explain of the wrapper
    found no policy (remove did nothing, silently)."""
    model = _net()
    with pytest.raises(TypeError, match="torch.compile wrapper .*torch.compile\\(mixprec.apply"):
        mixprec.apply(torch.compile(model, backend=BACKEND), "bf16-true")
    assert mixprec.convert.applied_policy(model) is None
    mixprec.apply(model, "bf16-true", warn=False)
    wrapped = torch.compile(model, backend=BACKEND)
    assert mixprec.explain(wrapped)["0"] == mixprec.Policy("bf16-true")
    assert mixprec.remove(wrapped) is wrapped
    assert model[0].weight.dtype == torch.float32 and mixprec.convert.applied_policy(model) is None


def test_the_trainer_warns_that_a_whole_model_storing_activations_compiles_nothing():
    """Found by a review: Trainer(compile=..., activations="fp8") ran the whole model eagerly
    (a storing module runs outside compiled graphs, and it was the model) while its summary
    said "compiled"; options on blocks leave the rest compiling, unwarned."""
    from torch.utils.data import DataLoader, TensorDataset

    from mixprec.trainer import Trainer

    x = torch.randn(8, 4)
    data = DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)
    quiet = dict(max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    trainer = Trainer(compile={"backend": BACKEND}, activations="fp8", **quiet)
    with pytest.warns(UserWarning, match="activations 'fp8' on the whole model.*nothing compiles"):
        trainer.fit(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), data, loss_fn=F.mse_loss)
    trainer = Trainer(compile={"backend": BACKEND}, activations={"0": "fp8"}, **quiet)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*nothing compiles")
        trainer.fit(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), data, loss_fn=F.mse_loss)
