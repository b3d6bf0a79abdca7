"""torch.compile with mixprec: regions, float32 islands and output casts cause no graph break
and no recompile; `Trainer(compile=...)`; `mixprec bench --compile`.

Real torch and tiny models. Graph breaks are counted with `torch._dynamo.explain`, compiles
with `torch._dynamo.utils.counters` and `error_on_recompile`. Most tests compile with the
"aot_eager" backend (dynamo and AOTAutograd, the parts that trace mixprec's code, without a
C++ build); the two marked slow build with inductor, torch's default, as users get it.
"""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset
from trainers import QUIET

import mixprec
from mixprec.bench.report import notes, summarize
from mixprec.bench.runner import run_config
from mixprec.bench.suite import BenchOptions, BenchReport, Row, _spec, metadata, plan
from mixprec.cli import build_parser
from mixprec.cli.bench import _options
from mixprec.policy.map import PolicyMap
from mixprec.trainer import Callback, Trainer, TrainingModule
from mixprec.trainer.checkpoint import load

BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles from scratch and counts only its own compiles."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class IslandNet(nn.Module):
    """A LayerNorm (a float32 island under a mixed policy) between two linear layers."""

    def __init__(self, output: str = "tensor") -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)
        self.output = output

    def forward(self, x: torch.Tensor):
        h = self.head(torch.relu(self.norm(self.fc1(x))))
        if self.output == "tuple":
            return h, h.sum(-1)
        if self.output == "dict":
            return {"logits": h, "extra": [h * 2]}
        return h


def net(spec=None, output: str = "tensor") -> nn.Module:
    torch.manual_seed(0)
    model = IslandNet(output)
    if spec is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bfloat16 is slow on CPUs without bf16 hardware
            mixprec.apply(model, spec)
    return model


def with_rule(spec: str) -> PolicyMap:
    """The policy with a float32 rule on the head (a region of its own below the root)."""
    return PolicyMap(spec, {"head": "float32"})


X = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))


def breaks(fn, *args) -> tuple[int, int, list[str]]:
    """Graphs and graph breaks of ``fn(*args)``, and the reasons; checks that the model's
    layers are inside the graphs (a frame dynamo skips would count no break either)."""
    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*args)
    ops = [op for graph in ex.ops_per_graph for op in graph]
    assert sum(op is F.linear for op in ops) == 2 and F.layer_norm in ops, ops
    return ex.graph_count, ex.graph_break_count, [b.reason for b in ex.break_reasons]


# -- graph breaks --------------------------------------------------------------------------


def test_the_model_alone_compiles_to_one_graph():
    assert breaks(net(), X)[:2] == (1, 0)


@pytest.mark.parametrize("spec", ["bf16-mixed", "16-mixed", "32-true"])
def test_regions_islands_and_rules_cause_no_graph_break(spec):
    model = net(with_rule(spec))
    regions = [n for n, m in model.named_modules() if "forward" in m.__dict__]
    if spec != "32-true":
        assert regions == ["", "norm", "head"]  # root, the island and the rule: three regions
    graphs, n_breaks, reasons = breaks(model, X)
    assert (graphs, n_breaks) == (1, 0), reasons


def test_a_policy_computing_on_copies_of_its_weights_compiles_to_one_graph():
    """Under ``p=bf16,c=f32`` each layer computes on float32 copies of its bfloat16 weights,
    marked for a checkpoint's recomputation by weak references, which dynamo does not trace:
    the graph broke at every copy, and the frame left, guarded on the copy's id, recompiled
    at each call until torch's limit. Traced, the copies are not marked."""
    model = net("p=bf16,c=f32")
    compiled = torch.compile(model, backend=BACKEND)
    for _ in range(3):
        out = compiled(X)
        out.sum().backward()
    assert torch.equal(out, model(X))
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1


def _grads_with_rule(spec: str, option: str, compiled: bool) -> list[torch.Tensor]:
    """The gradients of one step of three linear layers under `spec`, the middle one under
    the activation rule `option`, eager or compiled."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    precision = mixprec.Precision(spec, allow_slow=True, activations={"2": option})
    model = precision.setup(model)
    run = torch.compile(model, backend=BACKEND) if compiled else model
    with precision.forward_context():
        loss = run(precision.convert_input(X)).float().pow(2).mean()
    loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize(
    ("spec", "option"),
    [  # (the cases that differed from eager, and keep)
        ("p=bf16,c=f32", "fp8"),
        ("p=f16,c=f32", "fp8"),
        ("p=f16,c=f32", "bf16"),
        ("p=f16,c=bf16", "fp8"),
        ("p=f16,c=bf16", "keep"),
    ],
)
def test_a_storing_rule_keeps_the_weight_copies_a_compiled_region_makes(spec, option):
    """Found by a review: a region computing on copies of its weights in another dtype made
    them inside the compiled graph, where the storing module saw graph outputs, not casts
    of parameters, and stored them as activations (``fp8``: gradients 2.5% off eager's).
    The tensors standing in for its parameters are kept as weights: compiled gradients equal
    eager's bit for bit."""
    eager = _grads_with_rule(spec, option, compiled=False)
    torch._dynamo.reset()
    compiled = _grads_with_rule(spec, option, compiled=True)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


class SelfAttention(nn.Module):
    """A projection, then attention handed one tensor as query, key and value."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.attn(h, h, h, need_weights=False)[0]


def _attention_grads(compiled: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = mixprec.apply(SelfAttention(), PolicyMap("bf16-true", {"attn": "float32"}), warn=False)
    run = torch.compile(model, backend=BACKEND) if compiled else model
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = run(x)
    out.float().pow(2).mean().backward()
    return out, [p.grad for p in model.parameters()]


def test_a_true_region_keeps_a_tensor_given_twice_one_tensor_when_compiled():
    """Found by a review: a float32 region inside ``bf16-true`` casts its inputs through
    the tree walker, which kept no memo while compiled, so ``attn(h, h, h)`` reached
    MultiheadAttention as three tensors (``query is key`` False) and took its other path:
    gradients 0.4% off eager's. Compiled, the memo compares by `is`: equal bit for bit."""
    eager_out, eager = _attention_grads(compiled=False)
    torch._dynamo.reset()
    out, compiled = _attention_grads(compiled=True)
    assert torch.equal(out, eager_out)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


@pytest.mark.parametrize("output", ["tuple", "dict"])
def test_output_casts_of_nested_outputs_cause_no_graph_break(output):
    model = net("bf16-mixed", output)
    eager = model(X)
    graphs, n_breaks, reasons = breaks(model, X)
    assert (graphs, n_breaks) == (1, 0), reasons
    compiled = torch.compile(model, backend=BACKEND)(X)
    first = compiled[0] if output == "tuple" else compiled["logits"]
    assert first.dtype == torch.float32  # the output cast is in the graph
    assert torch.equal(first, eager[0] if output == "tuple" else eager["logits"])


def test_forward_context_under_compile():
    precision = mixprec.Precision(with_rule("bf16-mixed"), allow_slow=True)
    model = precision.setup(net())
    target = torch.randn(8, 4)

    def loss_of(x, y):
        with precision.forward_context():
            return F.mse_loss(model(x), y)

    graphs, n_breaks, reasons = breaks(loss_of, X, target)
    assert (graphs, n_breaks) == (1, 0), reasons
    torch._dynamo.reset()
    assert torch.equal(torch.compile(loss_of, backend=BACKEND)(X, target), loss_of(X, target))


def test_true_policy_under_forward_context_has_no_graph_break():
    precision = mixprec.Precision("bf16-true", allow_slow=True)
    model = precision.setup(net())
    with precision.forward_context():  # the default dtype is set outside the graph
        graphs, n_breaks, reasons = breaks(model, X)
    assert (graphs, n_breaks) == (1, 0), reasons


def test_true_region_switching_the_default_dtype_breaks_the_graph_but_stays_exact():
    # A float32 rule inside "bf16-true" must switch torch's default dtype for its forward;
    # that switch stays out of every graph (a break, or its frame left to run eagerly: see
    # the next test for why), and the result is exact.
    model = net(with_rule("bf16-true"))
    eager = model(X)
    torch._dynamo.reset()
    assert torch._dynamo.explain(model)(X).break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=BACKEND)(X)
    assert compiled.dtype == eager.dtype == torch.bfloat16
    assert torch.equal(compiled, eager)
    assert torch.get_default_dtype() == torch.float32


def test_why_default_dtype_switches_stay_outside_graphs():
    """torch's AOT tracing (inductor's front end) drops a `set_default_dtype` traced inside a
    graph, so tensors created without a dtype would silently come out float32; mixprec keeps
    the switch out of the graph. If this starts failing, torch fixed it and the lock in
    `mixprec.convert.default_dtype` may be traced instead."""

    def make_ones(x):
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            return x + torch.ones(4)
        finally:
            torch.set_default_dtype(before)

    x = torch.zeros(4, dtype=torch.bfloat16)
    assert make_ones(x).dtype == torch.bfloat16
    assert torch.compile(make_ones, backend=BACKEND)(x).dtype == torch.float32


# -- recompiles ----------------------------------------------------------------------------


def _train(model: nn.Module, steps: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    target = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(X.clone()), target)  # a new input object every step
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("spec", ["bf16-mixed", "32-true"])
def test_compiled_training_compiles_once_and_matches_eager(spec):
    # "32-true": the root is a "true" region, which casts the inputs through the walker
    eager = _train(net(with_rule(spec)), 4)
    model = net(with_rule(spec))
    compiled = torch.compile(model, backend=BACKEND)
    with torch._dynamo.config.patch(error_on_recompile=True):
        losses = _train(compiled, 4)  # forward and backward, weights changing every step
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["frames"]["ok"] == 1
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager), rtol=1e-2, atol=1e-3)
    assert losses[-1] < losses[0]


def _eager_and_compiled_grads(backward_after: bool) -> list[list[torch.Tensor]]:
    """The gradients of one step of the float32-head model under `bf16-mixed`, eager then
    compiled, the forward in `forward_context(backward_after=...)` and the backward after it
    (``backward_after``) or inside it."""
    precision = mixprec.Precision(with_rule("bf16-mixed"), allow_slow=True)
    target = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    grads = []
    for compiled in (False, True):
        model = precision.setup(net())
        run = torch.compile(model, backend=BACKEND) if compiled else model
        with precision.forward_context(backward_after=backward_after):
            loss = F.mse_loss(run(X), target)
            if not backward_after:
                loss.backward()
        if backward_after:
            loss.backward()
        grads.append([p.grad for p in model.parameters()])
    return grads


def test_a_compiled_float32_region_inside_autocast_backpropagates_as_eager():
    """Found by a review: under an outer autocast (Precision's forward_context, the
    Trainer's step), torch's default traced a compiled model's backward in that autocast,
    so the float32 head's backward ran in bfloat16: gradients 1e-3 to 6e-3 apart from
    eager's. While the context is entered, torch.compile traces the backward outside
    autocast, as eager runs it after the context: every gradient equal, bit for bit."""
    eager, compiled = _eager_and_compiled_grads(backward_after=True)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
    # (set while the context is entered only: the process's setting is the user's)
    from torch._functorch import config

    assert config.backward_pass_autocast == "same_as_forward"


def test_a_backward_inside_the_context_keeps_torchs_tracing():
    """A backward run inside the context (Lightning's manual optimization: the plugin asks
    `forward_context(backward_after=False)`) runs under autocast eagerly, and torch's own
    tracing matches it there: compiled and eager gradients equal, bit for bit."""
    eager, compiled = _eager_and_compiled_grads(backward_after=False)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


class BrokenNet(IslandNet):
    """`IslandNet` with a graph break between its first layer and the float32 head."""

    def forward(self, x: torch.Tensor):
        h = torch.relu(self.norm(self.fc1(x)))
        torch._dynamo.graph_break()
        return self.head(h)


def _grads(model: nn.Module, autocast: bool = False) -> list[torch.Tensor]:
    """The gradients of one mse step of ``model`` on `X` (the backward after the forward);
    ``autocast``: the forward and the backward inside the caller's bfloat16 autocast."""
    target = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = F.mse_loss(model(X).float(), target)
        if autocast:
            loss.backward()
    if not autocast:
        loss.backward()
    return [p.grad for p in model.parameters()]


def _applied(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    model = cls()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bfloat16 is slow on CPUs without bf16 hardware
        return mixprec.apply(model, with_rule("bf16-mixed"))


def test_a_graph_break_before_a_float32_rule_backpropagates_as_eager():
    """Found by a review: `apply` alone, compiled whole, with a graph break inside the
    model. Dynamo runs the root region's body eagerly after the break and compiles the rest
    of the forward on its own, with the region's bfloat16 autocast around it, and torch's
    default traced that part's backward in it: the float32 head's backward ran in bfloat16
    (gradients up to 1.6e-2 apart from eager's). The region traces what it calls with the
    backward outside autocast, as eager runs it: every gradient equal, bit for bit."""
    from torch._functorch import config

    eager = _grads(_applied(BrokenNet))
    compiled = _grads(torch.compile(_applied(BrokenNet), backend=BACKEND))
    assert counters["stats"]["unique_graphs"] >= 2  # (the break split the forward)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
    assert config.backward_pass_autocast == "same_as_forward"  # (the user's again after)


def test_a_compiled_submodule_holding_a_float32_rule_backpropagates_as_eager():
    """An applied model run eagerly with one submodule compiled in place (``.compile()``),
    the float32 head inside it: its backward is traced outside the root's autocast, as
    eager runs it (under torch's default it ran in bfloat16)."""

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mid = nn.Linear(32, 32)
            self.head = nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.mid(x))

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(16, 32)
            self.inner = Inner()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(torch.relu(self.fc1(x)))

    def model() -> nn.Module:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return mixprec.apply(Outer(), PolicyMap("bf16-mixed", {"inner.head": "float32"}))

    eager = _grads(model())
    partly = model()
    partly.inner.compile(backend=BACKEND)
    compiled = _grads(partly)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


def test_blocks_compiled_in_place_compile_once_beside_the_first_forwards_watch():
    """Found by a diff review: the first forward's watch for passed-over rules (hooks on
    the modules with a rule and their children) ran around compiled blocks, whose graphs
    were then guarded on the hooks and compiled again at the next step (6 blocks reached
    dynamo's recompile limit). Where compiled code may run inside, nothing is watched:
    each block compiles once."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.norm, self.b = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.b(torch.relu(self.norm(self.a(x))))

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = mixprec.apply(Blocks(), PolicyMap("bf16-mixed", {"layers.0": "float32"}))
    for layer in model.layers:
        layer.compile(backend=BACKEND)
    model(torch.randn(4, 8)).float().sum().backward()
    first = counters["stats"]["unique_graphs"]
    for _ in range(2):
        model(torch.randn(4, 8)).float().sum().backward()
    assert counters["stats"]["unique_graphs"] == first  # (with the watch: twice as many)


def test_a_backward_inside_the_callers_autocast_keeps_torchs_tracing():
    """The caller's own autocast around forward and backward (the region adds none): the
    backward runs under autocast eagerly, torch's own tracing matches it, and the region
    leaves it so: compiled and eager gradients equal, bit for bit."""
    eager = _grads(_applied(BrokenNet), autocast=True)
    compiled = _grads(torch.compile(_applied(BrokenNet), backend=BACKEND), autocast=True)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


@pytest.mark.slow
def test_inductor_build_of_a_mixed_model_with_islands():
    """The default backend, as users get it: one compile, float32 outputs, bf16 numerics."""
    eager = _train(net(with_rule("bf16-mixed")), 3)
    model = net(with_rule("bf16-mixed"))
    model.compile()  # in place, as the Trainer does
    with torch._dynamo.config.patch(error_on_recompile=True):
        losses = _train(model, 3)
    assert counters["stats"]["unique_graphs"] == 1
    assert model(X).dtype == torch.float32
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager), rtol=2e-2, atol=1e-3)
    assert list(model.state_dict()) == list(net().state_dict())


# -- Trainer(compile=...) ------------------------------------------------------------------


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, generator=g)
    return DataLoader(TensorDataset(x, torch.randn(32, 4, generator=g)), batch_size=8)


def _trainer(tmp_path: Path, compile, policy=None, **kwargs) -> Trainer:
    settings = {**QUIET, "max_epochs": 2, "allow_slow_precision": True, "seed": 0, **kwargs}
    policy = policy or with_rule("bf16-mixed")
    return Trainer(policy, default_root_dir=tmp_path, compile=compile, **settings)


def test_compile_flag_is_checked():
    with pytest.raises(ValueError, match=r"compile must be True .*fullgraph.*got 'yes'"):
        Trainer(compile="yes", **QUIET)
    with pytest.raises(ValueError, match=r"'mod', not a torch.compile argument; accepted: "):
        Trainer(compile={"mod": "max-autotune"}, **QUIET)
    with pytest.raises(ValueError, match=r"compile=\{'mode': 'fast'\}: Unrecognized mode=fast"):
        Trainer(compile={"mode": "fast"}, **QUIET)
    with pytest.raises(ValueError, match=r"Invalid backend: 'nope'"):
        Trainer(compile={"backend": "nope"}, **QUIET)
    assert Trainer(compile=True, **QUIET).compile == {}
    assert Trainer(compile={"mode": "reduce-overhead"}, **QUIET).compile == {
        "mode": "reduce-overhead"
    }
    assert Trainer(**QUIET).compile is None


def test_a_model_compiled_before_conversion_is_refused(tmp_path):
    trainer = _trainer(tmp_path, False)
    with pytest.raises(TypeError, match=r"compiled before mixprec converted it.*compile=True"):
        trainer.fit(torch.compile(net()), _data(), loss_fn=F.mse_loss)


@pytest.mark.slow
def test_trainer_compile_true_trains_like_eager_and_saves_plain_keys(tmp_path):
    eager_model = net()
    eager = _trainer(tmp_path / "eager", False)
    eager.fit(eager_model, _data(), loss_fn=F.mse_loss)

    model = net()
    trainer = _trainer(tmp_path / "compiled", True)
    trainer.fit(model, _data(), loss_fn=F.mse_loss)
    assert counters["stats"]["unique_graphs"] == 1  # one compile for 8 steps
    assert trainer.summary()["compiled"] == "torch.compile()"
    assert "_compiled_call_impl" not in model.__dict__  # handed back eager
    loss, eager_loss = trainer.callback_metrics["loss"], eager.callback_metrics["loss"]
    assert loss == pytest.approx(eager_loss, rel=2e-2)

    path = trainer.save_checkpoint(tmp_path / "compiled.ckpt")
    keys = list(load(path)["model"])
    assert keys == list(net().state_dict()) and not any("_orig_mod" in k for k in keys)
    assert torch.equal(load(path)["model"]["fc1.weight"], model.fc1.weight)
    # the compiled run's checkpoint resumes in an eager Trainer
    resume = Trainer(with_rule("bf16-mixed"), max_epochs=3, allow_slow_precision=True, **QUIET)
    resume.fit(net(), _data(), loss_fn=F.mse_loss, ckpt_path=path)
    assert (resume.current_epoch, resume.global_step) == (3, 12)


def test_trainer_compiles_a_true_policy_model_whole(tmp_path):
    """Under "bf16-true" the Trainer runs a compiled plain module in the forward context, so
    the default dtype is set outside the graph and the model's layers are all in one graph
    (an nn.Sequential's own frames are torch's, which dynamo only traces from a caller)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    trainer = _trainer(tmp_path, {"backend": BACKEND}, "bf16-true", max_epochs=1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        trainer.fit(model, _data(), loss_fn=F.mse_loss)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["stats"]["calls_captured"] >= 3  # linear, layer_norm, linear
    assert model[0].weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32


class CompiledAtValidation(Callback):
    """Records whether the model runs compiled when validation starts."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_validation_start(self, trainer, model):
        self.seen.append("_compiled_call_impl" in model.__dict__)


class Module(TrainingModule):
    """A TrainingModule whose step calls itself (its compiled `__call__`) and logs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = net()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_mse", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))


def test_eager_checkpoint_loads_into_a_compiled_trainer(tmp_path):
    policy = PolicyMap("bf16-mixed", {"net.head": "float32"})
    eager_module = Module()
    eager = _trainer(tmp_path / "eager", False, policy)
    eager.fit(eager_module, _data())
    path = eager.save_checkpoint(tmp_path / "eager.ckpt")
    expected = eager.validate(eager_module, _data())[0]["val_loss"]

    probe = CompiledAtValidation()
    compiled = _trainer(tmp_path / "compiled", {"backend": BACKEND}, policy, callbacks=probe)
    module = Module()
    got = compiled.validate(module, _data(), ckpt_path=path)[0]["val_loss"]
    assert probe.seen == [True] and counters["frames"]["ok"] >= 1  # it ran compiled
    assert got == pytest.approx(expected, rel=1e-3)
    assert torch.equal(module.net.head.weight, eager_module.net.head.weight)
    assert "_compiled_call_impl" not in module.__dict__


class RankReport(Callback):
    """Each rank saves its parameters, whether it ran compiled and the graphs it compiled."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_fit_end(self, trainer, model):
        report = {
            "params": model.state_dict(),
            "compiled": "_compiled_call_impl" in model.__dict__,
            "graphs": counters["stats"]["unique_graphs"],
        }
        torch.save(report, self.directory / f"rank{trainer.strategy.global_rank}.pt")


@pytest.mark.slow
def test_ddp_wraps_the_compiled_model(tmp_path):
    """Compiled before the DDP wrapper: each rank compiles once and the ranks, which see
    different halves of the data, end with the same weights (the gradients were reduced)."""
    trainer = Trainer(
        with_rule("bf16-mixed"),
        devices=2,
        strategy="ddp_fork",
        max_epochs=1,
        compile={"backend": BACKEND},
        callbacks=[RankReport(tmp_path)],
        allow_slow_precision=True,
        **QUIET,
    )
    trainer.fit(net(), _data(), loss_fn=F.mse_loss)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["compiled"] and r1["compiled"]
    assert r0["graphs"] == r1["graphs"] == 1
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
    assert not torch.equal(r0["params"]["fc1.weight"], net().fc1.weight)  # it trained


class CompiledFlag(Callback):
    """Each rank records whether its model ran compiled (FSDP's parameters stay sharded)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_fit_end(self, trainer, model):
        compiled = "_compiled_call_impl" in model.__dict__
        rank = trainer.strategy.global_rank
        torch.save(compiled, self.directory / f"compiled{rank}.pt")


@pytest.mark.slow
def test_fsdp_compiles_the_sharded_model_and_trains_as_eager(tmp_path):
    """compile= with strategy="fsdp": each rank compiles its sharded model (after
    `fully_shard`, before the optimizer steps) and, with a backend that does not fuse, the
    weights returned to the caller equal an eager FSDP run's."""
    models = {}
    for name, compile_ in (("eager", None), ("compiled", {"backend": BACKEND})):
        models[name] = model = net()
        trainer = Trainer(
            with_rule("bf16-mixed"), devices=2, strategy="fsdp", max_epochs=1, seed=0,
            compile=compile_, callbacks=[CompiledFlag(tmp_path / name)],
            allow_slow_precision=True, **QUIET,
        )  # fmt: skip
        (tmp_path / name).mkdir()
        trainer.fit(model, _data(), loss_fn=F.mse_loss)
    assert [torch.load(tmp_path / "compiled" / f"compiled{r}.pt") for r in range(2)] == [True] * 2
    assert [torch.load(tmp_path / "eager" / f"compiled{r}.pt") for r in range(2)] == [False] * 2
    eager, compiled = models["eager"].state_dict(), models["compiled"].state_dict()
    for k, v in eager.items():
        assert torch.equal(v, compiled[k]), k
    assert not torch.equal(eager["fc1.weight"], net().fc1.weight)  # it trained


# -- mixprec bench --compile ---------------------------------------------------------------

FACTORY = """
import torch
from torch import nn


def make():
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))

    def make_batch(n):
        g = torch.Generator().manual_seed(0)
        return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)

    return model, make_batch, nn.functional.cross_entropy
"""


def test_bench_plan_labels_compiled_rows_and_reproduces_the_flag(tmp_path, monkeypatch):
    (tmp_path / "factory.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.chdir(tmp_path)
    p = plan(
        BenchOptions(
            model="factory.py:make",
            precisions=["32-true", "bf16-mixed"],
            batch_sizes=[4],
            allow_slow=True,
            compile=True,
        )
    )
    assert [c.label for c in p.configs] == ["32-true (compiled)", "bf16-mixed (compiled)"]
    assert all(c.compiled for c in p.configs)
    assert p.command.endswith("--allow-slow --compile")
    assert metadata(p)["compile"] is True
    args = build_parser().parse_args(["bench", "--model", "factory.py:make", "--compile"])
    assert _options(args).compile is True
    assert _options(build_parser().parse_args(["bench"])).compile is False


@pytest.mark.slow
def test_bench_compiles_both_loops_alike(tmp_path, monkeypatch):
    """Ours and the raw torch loop each compile once (an nn.Sequential of torch modules too,
    which `model.compile()` would leave eager); the first step is timed apart."""
    (tmp_path / "factory.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.chdir(tmp_path)
    p = plan(
        BenchOptions(
            model="factory.py:make",
            precisions=["bf16-mixed"],
            batch_sizes=[4],
            allow_slow=True,
            compile=True,
            steps=2,
            warmup=1,
            threads=torch.get_num_threads(),
        )
    )
    (config,) = p.configs
    spec = _spec(p, config)
    assert spec.compile and spec.raw
    result = run_config(spec)
    assert counters["stats"]["unique_graphs"] == 2  # one graph per loop, no recompile
    assert result.raw is not None
    for loop in (result.mixprec, result.raw):
        assert loop.status == "ok" and len(loop.step_ms) == 2 and loop.first_step_s > 0
    assert result.mixprec.final_loss == pytest.approx(result.raw.final_loss, rel=0.05)
    report = BenchReport(
        dict(metadata(p), memory_method=result.memory_method), [Row(config, result)]
    )
    lines = notes(report, summarize(report))
    assert any(line.startswith("compiled: every model runs under torch.compile") for line in lines)
    assert any("bf16-mixed (compiled) at batch 4: first step (compilation)" in x for x in lines)
