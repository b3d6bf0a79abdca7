"""Policies autocast cannot give ("p=f16,c=bf16", "p=bf16,c=f32", "p=f32,c=f64", ...) compute
as jmp computes them: each forward runs on copies of the parameters cast to the compute
dtype, gradients come back in the parameter dtype, outputs leave in the output dtype.
They were refused, or (earlier) ran in dtypes the policy did not name."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import mixprec
from mixprec.sharding import shard

f64, f32, f16, bf16 = torch.float64, torch.float32, torch.float16, torch.bfloat16


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _record_compute(model: nn.Module) -> dict[str, tuple[torch.dtype, ...]]:
    """Per leaf module with weights: (input dtype, weight dtype its forward sees, output)."""
    seen: dict[str, tuple[torch.dtype, ...]] = {}
    for name, module in model.named_modules():
        if "weight" not in module._parameters:
            continue

        def hook(m, args, out, name=name):
            seen[name] = (args[0].dtype, m.weight.dtype, out.dtype)

        module.register_forward_hook(hook)
    return seen


class _Linears(TorchFunctionMode):
    """Records the (input, weight) dtypes of every F.linear call inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.seen.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def _jmp_by_hand(model: nn.Module, compute: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """jmp's recipe written out: params cast to the compute dtype, inputs too, then the call."""
    copies = {n: p.to(compute) for n, p in model.named_parameters()}
    return torch.func.functional_call(model, copies, (x.to(compute),))


def test_float16_params_compute_in_bfloat16_exactly_as_jmp_and_train():
    """Policy("p=f16,c=bf16") raised; jmp gives float16 params, bfloat16 compute and output.
    Through Precision it now computes bit for bit as jmp's cast-to-compute does, returns
    float16 gradients, and steps the float16 weights through float32 masters."""
    model = _mlp()
    reference = copy.deepcopy(model)
    precision = mixprec.Precision("p=f16,c=bf16", scaler=1.0, allow_slow=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = precision.setup(model, optimizer)
    assert {p.dtype for p in model.parameters()} == {f16}
    # BatchNorm's running statistics are read and updated where the layer computes
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {bf16}
    seen = _record_compute(model)

    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
    with precision.forward_context():
        out = model(precision.convert_input(x))
    precision.backward(F.mse_loss(out.float(), y))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert precision.step(optimizer)

    reference.half()
    reference[1].running_mean = reference[1].running_mean.to(bf16)
    reference[1].running_var = reference[1].running_var.to(bf16)
    params = dict(reference.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    ref_out = _jmp_by_hand(reference, bf16, x)
    F.mse_loss(ref_out.float(), y).backward()

    assert out.dtype == bf16 and torch.equal(out, ref_out)
    assert seen == {"0": (bf16, bf16, bf16), "1": (bf16, bf16, bf16), "3": (bf16, bf16, bf16)}
    for name, p in params.items():
        assert grads[name].dtype == f16 and torch.equal(grads[name], p.grad)
        # SGD on the float32 master, rounded back to the float16 weight
        expected = before[name].float().add(p.grad.float(), alpha=-0.1).half()
        assert torch.equal(dict(model.named_parameters())[name].detach(), expected)
    assert torch.equal(model[1].running_mean, reference[1].running_mean)
    assert torch.equal(model[1].running_var, reference[1].running_var)


@pytest.mark.parametrize(
    ("spec", "param", "compute"),
    [
        ("p=f16,c=bf16", f16, bf16),
        ("p=bf16,c=f16", bf16, f16),
        ("p=bf16,c=f32", bf16, f32),  # crashed at the first matmul under autocast
        ("p=f32,c=f64", f32, f64),  # autocast left it in float32
        ("p=f64,c=bf16", f64, bf16),  # autocast left it in float64
    ],
)
def test_each_storage_compute_pair_trains_in_the_dtypes_it_names(spec, param, compute):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(36, 8),
        nn.LayerNorm(8),  # computes in the compute dtype: float32 islands are autocast's
        nn.Linear(8, 3),
    )
    precision = mixprec.Precision(spec, allow_slow=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = precision.setup(model, optimizer)
    seen = _record_compute(model)
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 3, 5, 5, generator=gen), torch.randn(4, 3, generator=gen)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(20):  # a float16 loss scale starts high and backs off on overflow
        optimizer.zero_grad()
        with precision.forward_context():
            out = model(precision.convert_input(x))
        precision.backward(F.mse_loss(out.float(), y))
        assert {p.grad.dtype for p in model.parameters()} == {param}
        if precision.step(optimizer):
            break
    assert optimizer.step_was_skipped is False
    assert out.dtype == compute  # jmp: the output follows the compute dtype
    assert set(seen.values()) == {(compute, compute, compute)}
    assert {p.dtype for p in model.parameters()} == {param}
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {compute}
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert mixprec.explain(model)["4"] == mixprec.Policy(spec)


def test_a_cast_rule_inside_other_policies_casts_only_its_own_params():
    """A rule in a region of its own (under autocast), and a rule sharing its parent's
    region ("bf16-true" around float64 params computing in bfloat16): each layer computes
    in bfloat16 on copies, and keeps its own storage and gradient dtype."""
    torch.manual_seed(0)
    for default, rule, stored, output in [
        ("bf16-mixed", "p=f16,c=bf16,o=bf16", f16, f32),
        ("bf16-true", "p=f64,c=bf16,o=bf16", f64, bf16),
    ]:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        mixprec.apply(model, mixprec.PolicyMap(default, {"2": rule}), warn=False)
        with _Linears() as linears:
            out = model(torch.randn(3, 8))
        out.float().sum().backward()
        assert model[2].weight.dtype == stored and model[2].weight.grad.dtype == stored
        assert linears.seen[1] == (bf16, bf16)  # the rule's matmul: (input, weight)
        assert out.dtype == output  # the root's output dtype


def test_a_tied_weight_is_cast_once_and_gets_both_gradients():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    torch.manual_seed(0)
    model = Tied()
    reference = copy.deepcopy(model).half()
    mixprec.apply(model, "p=f16,c=bf16", warn=False)
    ids = torch.tensor([[1, 2, 3]])
    out = model(ids)
    out.float().sum().backward()
    shared = reference.embed.weight
    ref_out = torch.func.functional_call(reference, {"embed.weight": shared.to(bf16)}, (ids,))
    ref_out.float().sum().backward()
    assert model.embed.weight is model.head.weight and model.embed.weight.dtype == f16
    assert torch.equal(out, ref_out) and torch.equal(model.embed.weight.grad, shared.grad)


def test_a_layer_called_directly_casts_its_params_too(tmp_path):
    """A training step may call a submodule itself, past the root's region (the Trainer runs
    it in the precision's forward context): the layer casts its own parameters. Attention
    reads its out_proj's weight inside its own forward: that is cast as well."""
    from mixprec.trainer import Trainer, TrainingModule

    class Net(TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
            self.net = _mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            mixed, _ = self.attention(x, x, x)
            out = self.net(mixed.flatten(0, 1))
            assert out.dtype == bf16
            return F.mse_loss(out.float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = [(torch.randn(2, 3, 8), torch.randn(6, 4)) for _ in range(2)]
    trainer = Trainer(
        precision="p=f16,c=bf16",
        max_steps=2,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        allow_slow_precision=True,
    )
    trainer.fit(model, data)
    assert trainer.global_step == 2
    for name, p in model.named_parameters():
        assert p.dtype == f16 and not torch.equal(p.detach(), before[name].half()), name


def test_compiles_to_one_graph_with_the_eager_result():
    model = _mlp().eval()
    precision = mixprec.Precision("p=f16,c=bf16", allow_slow=True)
    precision.setup(model)
    x = precision.convert_input(torch.randn(4, 8))
    with precision.forward_context():
        eager = model(x)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(x)
        compiled = torch.compile(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    assert compiled.dtype == bf16 and torch.equal(compiled, eager)


@pytest.fixture
def one_rank(tmp_path):
    """A one-process gloo group: FSDP2 shards over a world of one."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_sharding_keeps_the_buffers_where_the_layer_computes(one_rank):
    """FSDP2 gathers float16 parameters as bfloat16 copies, as the cast does; BatchNorm's
    statistics stored in float16 failed ("expected scalar type BFloat16 but found Half")."""
    model = _mlp()
    reference = copy.deepcopy(model)
    shard(
        model,
        "p=f16,c=bf16",
        scaler=mixprec.DynamicLossScaler(),
        allow_slow=True,
        master_weights=False,
    )
    mixprec.apply(reference, "p=f16,c=bf16", warn=False)
    x = torch.randn(6, 8)
    out = model(x)
    out.float().sum().backward()
    assert out.dtype == bf16 and torch.equal(out, reference(x))
    assert {p.grad.dtype for p in model.parameters()} == {f16}
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {bf16}
