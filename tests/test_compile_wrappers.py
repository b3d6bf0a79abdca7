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


def test_apply_remove_and_explain_of_a_compile_wrapper_act_on_its_model():
    """apply on torch.compile(model) converted the wrapper: regions outside the graph
    (16-bit backward in float32 rules), rules under '_orig_mod.'; remove and explain of the
    wrapper found no policy (remove did nothing, silently). Its model is converted now, with
    gradients as compiling the converted model gives (a Hugging Face or Accelerate user hands
    over a model compiled already)."""

    def gradients(wrap_first: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        policy = PolicyMap("bf16-mixed", {"2": "float32"})
        model = _net()
        if wrap_first:
            run = mixprec.apply(torch.compile(model, backend=BACKEND), policy, warn=False)
        else:
            run = torch.compile(mixprec.apply(model, policy, warn=False), backend=BACKEND)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        F.mse_loss(run(x), torch.ones(8, 4)).backward()
        return [p.grad for p in model.parameters()]

    for first, then in zip(gradients(True), gradients(False), strict=True):
        assert torch.equal(first, then)
    model = _net()
    wrapped = torch.compile(model, backend=BACKEND)
    assert mixprec.apply(wrapped, "bf16-true", warn=False) is wrapped
    assert model[0].weight.dtype == torch.bfloat16
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
    with pytest.warns(UserWarning, match="<root>: 'fp8'.*nothing of weight compiles"):
        trainer.fit(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), data, loss_fn=F.mse_loss)

    class Wrapper(nn.Module):  # (all of it one child: the same trap a level down)
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

        def forward(self, x):
            return self.net(x)

    trainer = Trainer(compile={"backend": BACKEND}, activations={"net": "bf16"}, **quiet)
    with pytest.warns(UserWarning, match="net: 'bf16'.*nothing of weight compiles"):
        trainer.fit(Wrapper(), data, loss_fn=F.mse_loss)
    trainer = Trainer(compile={"backend": BACKEND}, activations={"0": "fp8"}, **quiet)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*nothing compiles")
        trainer.fit(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), data, loss_fn=F.mse_loss)


def test_accelerate_prepares_a_model_compiled_before_it_is_handed_over():
    """A review of the first fix (which refused torch.compile's wrapper in apply) found
    `prepare` refusing a model the user compiled before handing it over, as it had run."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from mixprec.integrations.huggingface import prepare

    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = mixprec.Precision("bf16-mixed", allow_slow=True)
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    prepared, opt = prepare(
        accelerator, precision, torch.compile(model, backend=BACKEND), optimizer
    )
    with precision.forward_context():
        loss = prepared(torch.randn(4, 16)).float().sum()
    accelerator.backward(loss)
    opt.step()
    assert mixprec.convert.applied_policy(model) is not None
    assert all(torch.isfinite(p).all() for p in model.parameters())
