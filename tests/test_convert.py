"""`apply` / `remove`: dtypes of params, intermediate and final outputs, regions, round trips."""

import copy
import io
import math
import pickle
import re
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import Policy, PolicyMap
from mixprec.convert import applied_policy

f64, f32, f16, bf16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
NORMS = (nn.BatchNorm2d, nn.LayerNorm)


class Zoo(nn.Module):
    """One of each layer kind the issue names, two inputs (tokens and an image)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.ln = nn.LayerNorm(16)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.img = nn.Linear(64, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens, image):
        h = self.emb(tokens)
        h, _ = self.lstm(h)
        h, _ = self.attn(h, h, h, need_weights=False)
        h = self.ln(h).mean(1)
        g = self.bn(self.conv(image)).flatten(1)
        return self.head(h + self.img(g))


def inputs(batch=3):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 20, (batch, 5), generator=g), torch.randn(batch, 1, 4, 4, generator=g)


def record_outputs(model):
    seen = {}
    handles = [
        m.register_forward_hook(
            lambda mod, args, out, name=name: seen.__setitem__(
                name, (out[0] if isinstance(out, tuple) else out).dtype
            )
        )
        for name, m in model.named_modules()
        if name
    ]
    return seen, handles


POLICIES = ["32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"]


# torch's CPU autocast has no float16 LSTM kernel, and no bfloat16 one on CPUs without
# AVX-512 (oneDNN refuses the primitive), so under mixed policies the LSTM gets an explicit
# float32 rule here, as a user on a CPU would write: the tests pass on every CPU.
LSTM_FP32 = {"lstm": "32-true"}


@pytest.mark.parametrize("spec", POLICIES)
def test_dtypes_of_params_intermediates_and_output(spec):
    policy = Policy(spec)
    rules = LSTM_FP32 if policy.is_mixed else {}
    model = mixprec.apply(Zoo(), PolicyMap(policy, rules))
    # integer buffers untouched, floating ones follow the param dtype
    assert model.bn.num_batches_tracked.dtype == torch.int64
    assert model.bn.running_mean.dtype == policy.param_dtype
    assert {p.dtype for p in model.parameters()} == {policy.param_dtype}
    seen, _ = record_outputs(model)
    out = model(*inputs())
    assert out.dtype == policy.output_dtype
    compute = policy.compute_dtype
    if policy.is_mixed:
        # matmul-type layers ran in the compute dtype under autocast ...
        for name in ("lstm", "attn", "conv", "img", "head"):
            assert seen[name] == (f32 if name in rules else compute), name
        # ... the embedding looks up float32 rows, LayerNorm is a float32 island, and
        # BatchNorm (float32 statistics inside its kernel) keeps the 16-bit activations
        assert seen["emb"] == f32
        assert seen["ln"] == f32
        assert seen["bn"] == compute
    else:
        assert set(seen.values()) == {compute}
    out.float().sum().backward()
    assert all(p.grad.dtype == policy.param_dtype for p in model.parameters())


def test_a_float32_rule_inside_a_bf16_model_really_runs_in_float32():
    torch.manual_seed(0)
    model = Zoo()
    reference = copy.deepcopy(model)
    mixprec.apply(model, PolicyMap("bf16-mixed", {"img": "32-true", **LSTM_FP32}))
    seen, _ = record_outputs(model)
    got = {}
    model.img.register_forward_hook(lambda m, a, o: got.update(inp=a[0], out=o))
    model(*inputs())
    assert seen["img"] == f32 and seen["head"] == bf16
    # a bf16 activation arrives; the result equals float32 math on that input, bit for bit
    assert got["inp"].dtype == bf16
    expected = reference.img(got["inp"].float())
    torch.testing.assert_close(got["out"], expected, rtol=0, atol=0)


@pytest.mark.parametrize("spec", ["bf16-true", "16-true"])
def test_a_float32_layer_inside_a_true_policy_hands_back_the_parents_dtype(spec):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    mixprec.apply(model, PolicyMap(spec, {"1": "float32"}))
    seen, _ = record_outputs(model)
    out = model(torch.randn(2, 8))
    low = Policy(spec).compute_dtype
    assert model[1].weight.dtype == f32 and model[2].weight.dtype == low
    assert seen == {"0": low, "1": low, "2": low} and out.dtype == low


@pytest.mark.parametrize("mixed", ["bf16-mixed", "16-mixed"])
def test_float64_layers_beside_mixed_ones_hand_over_through_float32(mixed):
    """autocast leaves float64 alone: a float64 layer's output reached its mixed
    neighbour's float32 weights uncast and the forward failed ("mat1 and mat2 must have the
    same dtype"). Inside a mixed parent a float64 region hands back float32; a mixed region
    takes float64 inputs as float32; the math is float64 there, autocast's here."""
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    low = Policy(mixed).compute_dtype
    inner = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    reference = copy.deepcopy(inner)
    mixprec.apply(inner, PolicyMap(mixed, {"0": "64-true"}))
    out = inner(x)
    h = reference[0].double()(x.double()).float()
    with torch.autocast("cpu", dtype=low):
        h = reference[1](h)
    expected = reference[2](h.float())  # (the norm: a float32 island)
    assert out.dtype == f32
    torch.testing.assert_close(out, expected.float(), rtol=0, atol=0)
    out.sum().backward()
    assert inner[0].weight.grad.dtype == f64 and inner[1].weight.grad.dtype == f32
    # the other way round: a mixed layer inside a float64 model
    outer = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    mixprec.apply(outer, PolicyMap("64-true", {"1": mixed, "2": mixed}))
    out = outer(x)
    assert out.dtype == f64
    out.sum().backward()
    assert outer[0].weight.grad.dtype == f64 and outer[2].weight.grad.dtype == f32


class _Exp(nn.Module):
    def forward(self, x):
        self.seen = x.dtype
        return x.exp()


@pytest.mark.parametrize(
    ("outer", "inner"), [("16-mixed", "bf16-mixed"), ("bf16-mixed", "16-mixed")]
)
def test_a_mixed_layer_takes_the_other_16_bit_dtype_as_float32(outer, inner):
    """A bf16-mixed rule inside a 16-mixed model ran the ops autocast does not list (exp)
    in its float16 input: explain said bfloat16 and the exp overflowed float16 as before.
    A mixed region takes the other 16-bit dtype's inputs as float32 (exactly), as a mixed
    model's own layers run such ops."""
    model = nn.Sequential(nn.Linear(4, 4), _Exp())
    with torch.no_grad():
        model[0].weight.fill_(3.0)
        model[0].bias.zero_()
    mixprec.apply(model, PolicyMap(outer, {"1": inner}))
    out = model(torch.ones(2, 4))
    assert model[1].seen == f32
    assert torch.isfinite(out).all() and out.dtype == f32
    alone = nn.Sequential(nn.Linear(4, 4), _Exp())
    alone.load_state_dict(model.state_dict())
    with torch.autocast("cpu", dtype=Policy(outer).compute_dtype):
        h = alone[0](torch.ones(2, 4))
    torch.testing.assert_close(out, h.float().exp(), rtol=0, atol=0)


def test_a_region_pickled_before_it_kept_its_input_casts_still_runs():
    model = mixprec.apply(
        nn.Sequential(nn.Linear(4, 4)), PolicyMap("16-mixed", {"0": "bf16-mixed"})
    )
    for m in model.modules():
        m.__dict__.get("forward", nn.Module()).__dict__.pop("uncast", None)
    model = pickle.loads(pickle.dumps(model))
    assert model(torch.ones(2, 4)).dtype == f32


def test_islands_keep_norms_in_float32_inside_16_bit_layers():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Softmax(-1))
    mixprec.apply(model, "bf16-mixed")
    seen, _ = record_outputs(model)
    model(torch.randn(2, 8))
    assert seen == {"0": bf16, "1": f32, "2": f32}


def test_uniform_policy_costs_one_region_and_islands_one_each():
    """One region at the root, one per float32 island, and under a mixed policy an entry
    (`_Entry`: nothing done inside the root's autocast) on each module holding modules."""
    model = mixprec.apply(Zoo(), "bf16-mixed")
    wrapped = sorted(n for n, m in model.named_modules() if "forward" in m.__dict__)
    assert wrapped == ["", "attn", "ln"]
    assert type(model.attn.__dict__["forward"]) is mixprec.convert._Entry
    mixprec.apply(model, "bf16-true")
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == [""]


class _EncoderDecoder(nn.Module):
    """A model whose caller may run its encoder alone (as Hugging Face's generate does)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.decoder = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


class _Routed(nn.Module):
    """A model whose forward runs its router with autocast switched off, on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        self.body = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            route = self.router(x.float())
        return self.body(x) * route.softmax(-1)


def test_a_parents_autocast_switched_off_for_a_child_is_left_off():
    """The entry of a child holding modules read "no autocast" as a call from outside the
    model and entered a bfloat16 region: a router its parent runs in float32 on purpose
    computed in bfloat16 (5e-3 off). Called from a region's forward, it runs as it is."""
    torch.manual_seed(0)
    model = _Routed()
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x).float()
    mixprec.apply(model, "bf16-mixed")
    assert torch.equal(model(x), expected)


def _applied_encoder_decoder() -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An `_EncoderDecoder` under bf16-mixed, an input, and the encoder's and the model's
    outputs under torch's bfloat16 autocast before it was applied."""
    torch.manual_seed(0)
    model = _EncoderDecoder()
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model.encoder(x).float()
        whole = model(x).float()
    mixprec.apply(model, "bf16-mixed")
    return model, x, expected, whole


def test_a_module_called_outside_its_models_forward_computes_as_its_policy_says():
    """`apply(model, "bf16-mixed")` then `model.encoder(x)` (T5's generate calls
    get_encoder() so) ran the encoder's matmuls in float32; inside the model's forward its
    entry adds nothing (the same bits as without it)."""
    model, x, expected, whole = _applied_encoder_decoder()
    seen = []
    model.encoder[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    alone = model.encoder(x)
    assert seen == [torch.bfloat16] and alone.dtype == f32
    assert torch.equal(alone, expected)
    assert torch.equal(model(x), whole)


def test_a_module_compiled_on_its_own_computes_as_its_policy_says():
    """``torch.compile(model.encoder)`` called from outside the model's forward: traced, its
    entry passed through (no autocast in the graph), so it computed in float32 where its
    eager call and explain say bfloat16. Compiled whole, the model's entries still add
    nothing inside its region."""
    model, x, expected, whole = _applied_encoder_decoder()
    assert torch.equal(torch.compile(model.encoder, backend="eager")(x), expected)
    assert torch.equal(torch.compile(model, backend="eager")(x), whole)
    # a parent switching autocast off for a child holding modules: off, compiled as eager
    routed = mixprec.apply(_Routed(), "bf16-mixed")
    assert torch.equal(torch.compile(routed, backend="eager")(x), routed(x))
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    # compiled once: the count kept while tracing guards nothing that changes after
    builds = []
    fresh, _, _, _ = _applied_encoder_decoder()

    def backend(graph: torch.fx.GraphModule, example: list) -> torch.fx.GraphModule:
        builds.append(graph)
        return graph

    compiled = torch.compile(fresh, backend=backend)
    for _ in range(3):
        compiled(x)
    assert len(builds) == 1


def test_reapply_does_not_stack_and_remove_restores_the_plain_module():
    model = Zoo()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mixprec.apply(model, "bf16-mixed")
    mixprec.apply(model, "bf16-mixed")
    mixprec.apply(model, PolicyMap("16-mixed", LSTM_FP32))
    assert mixprec.convert.applied_policy(model).default == Policy("16-mixed")
    assert type(model.__dict__["forward"].module) is Zoo
    assert model(*inputs()).dtype == f32
    mixprec.apply(model, "bf16-true")
    mixprec.remove(model)
    assert mixprec.convert.applied_policy(model) is None
    assert not any("forward" in m.__dict__ for m in model.modules())
    after = model.state_dict()
    assert {k: v.dtype for k, v in after.items()} == {k: v.dtype for k, v in before.items()}
    # the bf16-true round trip rounded the weights, but only to bf16 precision
    # (BatchNorm's running statistics moved in the training-mode forward above)
    for k in before:
        if before[k].is_floating_point() and "running" not in k:
            torch.testing.assert_close(after[k], before[k], rtol=1e-2, atol=1e-2)


class _MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return ((self.q(x) @ x.transpose(-1, -2) + mask).softmax(-1)) @ x


class _MasksInItsDtype(nn.Module):
    """Fills its mask with its own dtype's lowest value, as Hugging Face models do; the first
    query's row is masked whole (left padding under a causal mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.attn, self.out = nn.Linear(4, 4), _MaskedAttention(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = torch.finfo(x.dtype).min
        mask = torch.full((x.shape[1], x.shape[1]), low).triu(1)
        mask[0, :] = low
        return self.out(self.attn(self.inp(x), mask))


@pytest.mark.parametrize("rule", ["bf16-true", "16-true"])
def test_a_mask_in_the_parents_lowest_value_stays_finite_in_a_16_bit_region(rule):
    """A float32 model's mask (float32's lowest value) cast into a 16-bit rule's region was
    -inf there: the fully masked row's softmax gave NaN, the loss NaN. It takes the region
    dtype's lowest value; a tensor with grad still overflows to an infinity (a loss
    scaler's signal), and so does every other value past the range."""
    torch.manual_seed(0)
    model = _MasksInItsDtype()
    mixprec.apply(model, PolicyMap("32-true", {"attn": rule}), warn=False)
    x = torch.randn(2, 5, 4)
    assert model(x).isfinite().all()
    dtype = torch.bfloat16 if rule == "bf16-true" else torch.float16
    low, narrow = torch.finfo(f32).min, torch.finfo(dtype).min
    mask = torch.tensor([low, -low, 3.4e38 if dtype == torch.bfloat16 else 7e4, 1.0, -0.0])
    cast = mixprec.convert.cast_floating(mask, dtype)
    assert cast.tolist()[:2] == [narrow, -narrow] and cast[2] == torch.inf
    assert torch.equal(cast[3:], mask[3:].to(dtype))
    grad = mask.clone().requires_grad_()
    assert mixprec.convert.cast_floating(grad, dtype)[0] == -torch.inf
    wide = torch.tensor([torch.finfo(torch.float64).min, 2.0], dtype=torch.float64)
    assert mixprec.convert.cast_floating(wide, f32).tolist() == [low, 2.0]


def test_two_parameters_over_one_memory_are_refused_a_dtype_change():
    """``b.weight = nn.Parameter(a.weight.data)`` ties two layers in float32; each was cast
    apart, so after apply they no longer shared memory and trained apart. A policy keeping
    their dtype takes them; one Parameter shared by two layers is cast once."""
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = nn.Parameter(a.weight.data)
    model = nn.ModuleDict({"a": a, "b": b})
    with pytest.raises(mixprec.PolicySpecError, match="a.weight and b.weight are two Parameters"):
        mixprec.apply(model, "bf16-true")
    assert a.weight.dtype == f32  # refused before the model changed
    mixprec.apply(model, "bf16-mixed")
    assert a.weight.data_ptr() == b.weight.data_ptr()
    tied = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
    tied["b"].weight = tied["a"].weight
    mixprec.apply(tied, "bf16-true")
    assert tied["a"].weight is tied["b"].weight and tied["a"].weight.dtype == torch.bfloat16


def test_parameters_over_disjoint_interleaved_parts_of_one_tensor_are_converted():
    """Found by a review: two Parameters over the column halves of one tensor
    (``nn.Parameter(big[:, :8])``, ``nn.Parameter(big[:, 8:])``) share no byte, but their
    spans from first to last element meet, and `apply` refused them as two Parameters over
    the same memory. They are cast apart, as any two Parameters are; halves that do share
    a column are still refused."""

    class Halves(nn.Module):
        def __init__(self, split: int) -> None:
            super().__init__()
            big = torch.arange(64.0).view(4, 16)
            self.a, self.b = nn.Parameter(big[:, :split]), nn.Parameter(big[:, 8:])

        def forward(self, x):
            return x @ self.a[:, :8].T + x @ self.b.T

    model = mixprec.apply(Halves(8), "bf16-true", warn=False)
    assert model.a.dtype == model.b.dtype == bf16
    assert model.a.tolist() == torch.arange(64.0).view(4, 16)[:, :8].tolist()
    assert model(torch.ones(2, 8)).dtype == bf16
    with pytest.raises(mixprec.PolicySpecError, match="a and b are two Parameters"):
        mixprec.apply(Halves(9), "bf16-true", warn=False)


def test_remove_restores_what_was_added_between_two_applies():
    """A layer and a buffer added after `apply` and converted by a second `apply` come back
    float32 from `remove`, as the first apply's do (they stayed in bfloat16); one added
    in bfloat16 stays so."""
    model = nn.Sequential(nn.Linear(4, 4))
    mixprec.apply(model, "bf16-true")
    model.add_module("head", nn.Linear(4, 4))
    model.register_buffer("scale", torch.ones(4))
    model.register_buffer("low", torch.ones(4, dtype=torch.bfloat16))
    mixprec.apply(model, "bf16-true")
    assert model.head.weight.dtype == model.scale.dtype == torch.bfloat16
    mixprec.remove(model)
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    assert dtypes == {
        **dict.fromkeys(["0.weight", "0.bias", "head.weight", "head.bias"], f32),
        "scale": f32,
        "low": torch.bfloat16,
    }


@pytest.mark.parametrize(
    "spec, change", [("bf16-true", "half"), ("bf16-true", "float"), ("bf16-mixed", "half")]
)
def test_a_dtype_changed_after_apply_is_named_when_torch_refuses_it(spec, change):
    """`.half()` / `.float()` after `apply` leaves regions casting inputs as apply chose:
    torch's dtype clash comes out naming the parameter moved and the way back; an `apply`
    again converts the model anew, `remove` restores float32."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    mixprec.apply(model, spec, warn=False)
    getattr(model, change)()
    moved = "float16" if change == "half" else "float32"
    with pytest.raises(mixprec.PrecisionError, match=rf"0\.weight is {moved}, but mixprec") as err:
        model(torch.randn(2, 4))
    assert isinstance(err.value.__cause__, RuntimeError) and isinstance(err.value, RuntimeError)
    assert "mixprec.apply(model, policy)" in str(err.value)
    mixprec.apply(model, spec, warn=False)
    assert model(torch.randn(2, 4)).dtype == (bf16 if spec == "bf16-true" else f32)
    mixprec.remove(model)
    assert {p.dtype for p in model.parameters()} == {f32}


@pytest.mark.parametrize("rule, parent", [("16-true", "bf16-mixed"), ("bf16-true", "16-mixed")])
def test_a_result_in_the_other_16_bit_dtype_comes_back_float32_in_a_mixed_parent(rule, parent):
    """A float16 layer's result inside a bfloat16-mixed parent came back float16, and the
    parent's ops autocast does not list (exp) ran in float16: exp(12) overflowed to inf."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            with torch.no_grad():
                self.a.weight.copy_(torch.eye(4))
                self.a.bias.zero_()

        def forward(self, x):
            h = torch.exp(self.a(x))
            return h, h.dtype

    model = mixprec.apply(Net(), PolicyMap(parent, {"a": rule}), warn=False)
    out, dtype = model(torch.full((1, 4), 12.0))
    assert dtype == f32 and torch.isfinite(out).all()


def test_a_shared_float16_embedding_hands_a_bfloat16_mixed_caller_float32():
    """Found by a review of the fix above: an embedding shared by a bf16-mixed and a
    bf16-true parent, under a 16-true rule, still handed the mixed one float16 (its ids are
    no floating input to follow), and exp(15) there overflowed."""

    class Parent(nn.Module):
        def __init__(self, emb):
            super().__init__()
            self.emb = emb

        def forward(self, ids):
            e = self.emb(ids)
            return torch.exp(e * 30), e.dtype

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            emb = nn.Embedding(10, 4)
            with torch.no_grad():
                emb.weight.fill_(0.5)
            self.mixed, self.true = Parent(emb), Parent(emb)

        def forward(self, ids):
            return self.mixed(ids), self.true(ids)

    rules = {"true": "bf16-true", nn.Embedding: "16-true"}
    model = mixprec.apply(Root(), PolicyMap("bf16-mixed", rules), warn=False)
    (out, dtype), (_, true_dtype) = model(torch.tensor([1, 2]))
    assert dtype == f32 and torch.isfinite(out).all() and true_dtype == bf16


def test_a_true_region_casts_a_tensor_given_twice_once():
    """(h, h, h) to a "true" attention became three copies: `query is key` failed inside,
    torch's MHA took its separate-projection path and differed from a plain bf16 one."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, h):
            return self.attn(h, h, h, need_weights=False)[0]

    torch.manual_seed(0)
    model = Net().eval()
    plain = copy.deepcopy(model.attn).to(bf16)
    seen = []
    forward = model.attn.forward
    model.attn.forward = lambda q, k, v, **kw: seen.append(q is k is v) or forward(q, k, v, **kw)
    mixprec.apply(model, PolicyMap("32-true", {"attn": "bf16-true"}), warn=False)
    h = torch.randn(2, 5, 16)
    with torch.no_grad():
        out = model(h)
        hb = h.to(bf16)
        assert torch.equal(out, plain(hb, hb, hb, need_weights=False)[0].float())
    assert seen == [True]
    x = torch.randn(3)
    a, b, c = mixprec.convert.cast_floating((x, x, torch.ones(1)), bf16)
    assert a is b and a.dtype == bf16 and b is not c


def test_a_torch_error_other_than_a_dtype_clash_passes_through():
    """A forward's own error (a wrong input shape) is torch's, unchanged, with the dtypes as
    apply set them and after they moved (a review found any RuntimeError, out-of-memory
    included, turned into the dtype explanation once a parameter had moved)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    mixprec.apply(model, "bf16-true", warn=False)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as err:
        model(torch.randn(2, 5))
    assert type(err.value) is RuntimeError
    model = mixprec.apply(nn.Sequential(nn.Linear(4, 4)), "bf16-mixed", warn=False)
    model.to(bf16)  # (runs: autocast casts)
    assert model(torch.randn(2, 4)).dtype == f32
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as err:
        model(torch.randn(2, 5))
    assert type(err.value) is RuntimeError


class IteratedBlocks(nn.Module):
    """Two blocks in an nn.Sequential, which the forward iterates (``iterate``, as
    checkpoint_sequential and timm's checkpoint_seq do) or calls; ``shared``: the first
    block also at a second path."""

    def __init__(self, iterate: bool, shared: bool = False) -> None:
        super().__init__()
        self.iterate = iterate
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 8))
        if shared:
            self.first = self.blocks[0]
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if self.iterate:
            for block in self.blocks:
                x = block(x)
        else:
            x = self.blocks(x)
        return self.head(x)


def _passed_over(model: nn.Module, calls: int = 2) -> list[str]:
    """The "not carried out" warnings of `calls` training forwards of `model`."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(calls):
            model(torch.randn(2, 8)).float().sum().backward()
    return [str(w.message) for w in said if "not carried out" in str(w.message)]


@pytest.mark.parametrize(
    "pmap, rule",
    [
        (PolicyMap("bf16-mixed", {"blocks": "32-true"}), "policy '32-true'"),
        (PolicyMap("32-true", activations={"blocks": "checkpoint"}), "activation option"),
    ],
)
def test_a_rule_on_a_sequential_the_parent_iterates_is_warned_of(pmap, rule):
    """Found by a review: a rule on an nn.Sequential whose parent iterates it was not
    carried out (its forward never runs; its children ran in the parent's region, their
    activations kept) without a word. The first forward watches such modules and warns once,
    naming the module, what ran without it and the regex key that gives them the rule;
    called as a module, or with the first block also reachable elsewhere, nothing is said."""
    said = _passed_over(mixprec.apply(IteratedBlocks(True), pmap, warn=False))
    assert len(said) == 1 and f"the {rule}" in said[0]
    assert "'blocks' (Sequential)" in said[0] and "(blocks.0, blocks.1)" in said[0]
    assert "blocks\\.\\d+ as a regex key" in said[0]
    assert _passed_over(mixprec.apply(IteratedBlocks(False), pmap, warn=False)) == []


def test_a_module_also_held_elsewhere_is_not_taken_as_passed_over():
    """A block reachable at another path too may be called there: only the modules the
    passed-over one alone holds are named."""
    pmap = PolicyMap("bf16-mixed", {"blocks": "32-true", "first": "32-true"})
    said = _passed_over(mixprec.apply(IteratedBlocks(True, shared=True), pmap, warn=False))
    assert len(said) == 1 and "(blocks.1)" in said[0]


def test_a_rule_carried_out_through_forward_or_after_a_raising_first_call_is_judged_right():
    """Found by a diff review: a module with a rule called as ``module.forward(x)`` (its
    region runs; a hook does not fire) was said to be passed over; a first forward that
    raised ended the watch; a parent calling the children by name was told a ``\\d+`` key
    that matches none of them."""

    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Sequential()
            self.emb.word, self.emb.norm = nn.Linear(8, 8), nn.LayerNorm(8)
            self.head = nn.Linear(8, 4)
            self.through_forward = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] != 8:
                raise ValueError("bad input")
            if self.through_forward:
                return self.head(self.emb.forward(x))
            return self.head(self.emb.norm(self.emb.word(x)))

    pmap = PolicyMap("bf16-mixed", {"emb": "32-true"})
    model = mixprec.apply(Named(), pmap, warn=False)
    model.through_forward = True
    assert _passed_over(model) == []
    model = mixprec.apply(Named(), pmap, warn=False)
    with pytest.raises(ValueError, match="bad input"):
        model(torch.randn(2, 3))
    said = _passed_over(model)
    assert len(said) == 1 and "(emb.word, emb.norm)" in said[0]
    key = re.search(r"in its place \((.+) as a regex key, no rule on 'emb'", said[0]).group(1)
    assert key == r"emb\.(norm|word)"
    fixed = mixprec.apply(Named(), PolicyMap("bf16-mixed", {key: "32-true"}), warn=False)
    assert _passed_over(fixed) == []
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (the children's own regions now)
        assert fixed.emb.word(torch.randn(2, 8)).dtype == torch.float32


def test_the_first_forward_watching_rules_changes_no_result():
    """The watched first forward computes what the later ones do (hooks only record), and
    leaves no hook behind."""
    torch.manual_seed(0)
    model = mixprec.apply(
        IteratedBlocks(True), PolicyMap("32-true", activations={"blocks": "checkpoint"}), warn=False
    )
    x = torch.randn(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = model(x)
    assert torch.equal(first, model(x))
    assert not any(m._forward_pre_hooks for m in model.modules())


class RefusedRNN(nn.Module):
    """An LSTM whose forward fails as oneDNN does on a CPU without a 16-bit RNN kernel under
    CPU autocast (so the test runs on any CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("could not create a primitive descriptor for the LSTM forward")
        return self.rnn(x)[0]


@pytest.mark.parametrize("caller", ["bare", "forward_context"])
def test_a_refused_16_bit_rnn_is_named_also_under_the_callers_autocast(caller):
    """Found by a review: the known limitation (a 16-bit RNN under CPU autocast on a CPU
    without its kernel) was explained for a bare ``model(x)`` only; in a training step,
    where the caller's autocast runs the root region, oneDNN's bare RuntimeError came
    through. Named both ways, with the rule that fixes it."""
    precision = mixprec.Precision("bf16-mixed", allow_slow=True)
    model = precision.setup(RefusedRNN())
    x = torch.randn(2, 3, 4)
    with pytest.raises(mixprec.PrecisionError, match=r"RNN layers .*\(rnn\).*nn.LSTM: 'float32'"):
        if caller == "bare":
            model(x)
        else:
            with precision.forward_context():
                model(x)


@pytest.mark.parametrize(
    "saved, loaded", [("bf16-true", "32-true"), ("32-true", "16-true"), ("bf16-mixed", "64-true")]
)
def test_checkpoint_from_one_policy_loads_under_another(saved, loaded):
    a = mixprec.apply(Zoo(), saved)
    b = mixprec.apply(Zoo(), loaded)
    state = a.state_dict()
    assert state.keys() == Zoo().state_dict().keys()
    b.load_state_dict(state)
    for k, v in b.state_dict().items():
        assert v.dtype == (Policy(loaded).param_dtype if v.is_floating_point() else v.dtype)
        torch.testing.assert_close(v, state[k].to(v.dtype), rtol=0, atol=0)


def test_deepcopy_and_pickle_keep_the_policy():
    model = mixprec.apply(Zoo(), PolicyMap("bf16-mixed", LSTM_FP32))
    copied = copy.deepcopy(model)
    assert copied.__dict__["forward"].module is copied
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    unpickled = pickle.loads(pickle.dumps(model))
    expected = model(*inputs())
    for other in (copied, loaded, unpickled):
        assert mixprec.convert.applied_policy(other) == PolicyMap("bf16-mixed", LSTM_FP32)
        torch.testing.assert_close(other(*inputs()), expected, rtol=0, atol=0)


def test_torch_compile_of_an_applied_model_runs_and_matches():
    torch._dynamo.reset()
    model = mixprec.apply(
        nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)), "bf16-mixed"
    )
    x = torch.randn(4, 8)
    compiled = torch.compile(model)
    out = compiled(x)
    assert out.dtype == f32
    torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2)
    out.sum().backward()


def test_output_cast_reaches_nested_structures():
    @dataclass
    class Out:
        logits: torch.Tensor
        ids: torch.Tensor

    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return {"a": (y, [y * 2]), "b": Out(y, torch.arange(3))}

    model = mixprec.apply(Nested(), "bf16-mixed")
    out = model(torch.randn(2, 4))
    assert out["a"][0].dtype == out["a"][1][0].dtype == out["b"].logits.dtype == f32
    assert out["b"].ids.dtype == torch.int64


def test_true_policy_casts_floating_inputs_not_integer_ones():
    model = mixprec.apply(Zoo(), "bf16-true")
    tokens, image = inputs()
    assert model(tokens, image.double()).dtype == bf16


def test_shared_parameter_with_conflicting_dtypes_is_refused():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    model = nn.Sequential(a, b)
    with pytest.raises(mixprec.PolicySpecError, match="shared with '0.weight'"):
        mixprec.apply(model, PolicyMap("32-true", {"1": "bf16-true"}))


def test_a_refused_reapply_leaves_the_previous_policy_and_unrounded_weights():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    model = nn.Sequential(a, b)
    mixprec.apply(model, "bf16-mixed")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(mixprec.PolicySpecError, match="shared with '0.weight'"):
        mixprec.apply(model, PolicyMap("bf16-true", {"1": "float32"}))
    # nothing changed: float32 weights bit for bit, the mixed region still in place
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == f32 for k in before)
    assert mixprec.convert.applied_policy(model) == PolicyMap("bf16-mixed")
    seen, _ = record_outputs(model)
    model(torch.randn(2, 4))
    assert seen == {"0": bf16, "1": bf16}


def test_a_float32_submodule_applied_on_its_own_leaves_the_parents_autocast():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    mixprec.apply(model, "bf16-mixed")
    mixprec.apply(model[2], "float32")
    seen, _ = record_outputs(model)
    model(torch.randn(2, 4))
    assert seen["0"] == bf16 and seen["2"] == f32


def test_a_float32_model_computes_in_float32_under_the_callers_autocast():
    model = mixprec.apply(nn.Linear(4, 4), "32-true")
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == f32
    torch.testing.assert_close(out, torch.nn.functional.linear(x, model.weight, model.bias))


def test_a_module_shared_by_two_parents_runs_in_its_policy_through_both():
    class Two(nn.Module):
        def __init__(self, shared: nn.Module) -> None:
            super().__init__()
            self.a, self.b = nn.Sequential(shared), nn.Sequential(shared)

        def forward(self, x):
            return self.b(self.a(x))

    got = []

    class Probe(nn.Linear):  # records the dtype its matmul computed in
        def forward(self, x):
            out = super().forward(x)
            got.append(out.dtype)
            return out

    model = Two(Probe(4, 4))
    mixprec.apply(model, PolicyMap("bf16-mixed", {"b": "float32", r"[ab]\.0": "bf16-mixed"}))
    model(torch.randn(2, 4))
    assert got == [bf16, bf16]  # through the float32 parent 'b' too


class Residual(nn.Module):
    def __init__(self, s: nn.Module) -> None:
        super().__init__()
        self.s = s

    def forward(self, x):
        return x + self.s(x)


class Residuals(nn.Module):
    """Two residual blocks ``a`` and ``b`` sharing one Linear ``s``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        shared = nn.Linear(16, 16)
        self.a, self.b = Residual(shared), Residual(shared)

    def forward(self, x):
        return self.a(x), self.b(x)


@pytest.mark.parametrize("shared", ["32-true", "bf16-true"])
def test_a_module_shared_by_true_parents_of_two_dtypes_hands_each_its_own(shared):
    """The region took its output dtype from the first path's parent: called by the
    float32 block, the shared layer handed back bfloat16 (the float32 block's result off by
    1.9e-3), or float32 into the bfloat16 block (a bare dtype error further on)."""
    model, plain = Residuals(), Residuals()
    mixprec.apply(model, PolicyMap("32-true", {"a": "bf16-true", r"[ab]\.s": shared}))
    seen = []
    model.a.s.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    x = torch.randn(4, 16)
    _, from_b = model(x)
    assert seen == [(bf16, bf16), (f32, f32)]  # each block gets its own dtype back
    if shared == "32-true":  # the float32 block computes exactly as the plain model
        assert torch.equal(from_b, plain(x)[1])


class Embedded(nn.Module):
    """A block adding a position vector to an embedding it may share with another block."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.s, self.pos = embedding, nn.Parameter(torch.randn(8))

    def forward(self, ids):
        return self.s(ids) + self.pos


class SharedEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        shared = nn.Embedding(10, 8)
        self.a, self.b = Embedded(shared), Embedded(shared)

    def forward(self, ids):
        return self.a(ids), self.b(ids)


@pytest.mark.parametrize(
    ("a", "b", "wanted"),
    [("bf16-true", "32-true", [bf16, f32]), ("bf16-mixed", "bf16-true", [f32, bf16])],
)
def test_a_module_shared_by_parents_of_two_dtypes_without_a_floating_input_hands_each_its_own(
    a, b, wanted
):
    """Given token ids, a shared embedding has no input dtype to follow: it took the first
    path's, so the float32 block added a bfloat16 embedding (off by 2e-3, no error). Each
    caller now gets the dtype it computes in (a mixed one what autocast casts from)."""
    model, plain = SharedEmbedding(), SharedEmbedding()
    mixprec.apply(model, PolicyMap("32-true", {"a": a, "b": b, r"[ab]\.s": "32-true"}))
    seen = []
    model.a.s.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    ids = torch.randint(0, 10, (4, 3))
    out_a, out_b = model(ids)
    assert seen == wanted
    if b == "32-true":  # the float32 block computes exactly as the plain model
        assert torch.equal(out_b, plain(ids)[1])
    # autocast on another device type than the model's is not the caller's
    seen.clear()
    other = "cuda" if next(model.parameters()).device.type == "cpu" else "cpu"
    before = torch.is_autocast_enabled(other)
    torch.set_autocast_enabled(other, True)
    try:
        model(ids)
    finally:
        torch.set_autocast_enabled(other, before)
    assert seen == wanted


@pytest.mark.parametrize("default", ["bf16-mixed", "bf16-true"])
def test_a_rule_on_multihead_attention_out_proj_is_refused(default):
    # the attention reads out_proj.weight itself: out_proj's own forward never runs
    model = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True))
    with pytest.raises(mixprec.PolicySpecError, match="give the rule to '0' itself"):
        mixprec.apply(model, PolicyMap(default, {"0.out_proj": "float32"}))
    assert all(p.dtype == f32 for p in model.parameters())
    mixprec.apply(model, PolicyMap(default, {"0": "float32"}))  # the whole attention is fine
    assert model[0].out_proj.weight.dtype == f32


def test_a_type_rule_on_every_linear_lets_out_proj_follow_its_attention():
    model = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True))
    pmap = PolicyMap("bf16-true", {nn.Linear: "32-true"})
    explained = mixprec.explain(model, pmap)
    assert explained["0.self_attn.out_proj"] == Policy("bf16-true")
    assert explained.sources["0.self_attn.out_proj"] == "follows its attention 0.self_attn"
    assert explained["0.linear1"] == Policy("32-true")
    mixprec.apply(model, pmap)
    assert model[0].self_attn.out_proj.weight.dtype == bf16
    assert model(torch.randn(2, 3, 16)).dtype == bf16


def test_a_head_quantized_apart_from_its_tied_embedding_is_applied():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 16)
            self.head = nn.Linear(16, 16, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, tokens):
            return self.head(self.emb(tokens))

    model = mixprec.apply(Tied(), PolicyMap("32-true", {"head": "int8_from_float32"}))
    assert type(model.head).__name__ == "Int8Linear" and model.emb.weight.dtype == f32
    assert model(torch.tensor([[1, 2]])).shape == (1, 2, 16)


def test_a_reapply_quantization_refuses_keeps_the_previous_regions():
    model = mixprec.apply(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), "bf16-mixed")
    with torch.no_grad():
        model[1].weight[0, 0] = math.nan
    with pytest.raises(ValueError, match="inf/NaN"):
        mixprec.apply(model, "int8_from_bfloat16", warn=False)
    assert mixprec.convert.applied_policy(model) == PolicyMap("bf16-mixed")
    seen, _ = record_outputs(model)
    model(torch.randn(2, 64))
    assert seen == {"0": bf16, "1": bf16}  # still under the mixed region's autocast


def test_explain_defaults_to_the_policy_the_model_was_given():
    model = mixprec.apply(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), "bf16-mixed")
    assert mixprec.explain(model)["1"] == Policy("bf16-mixed")
    assert mixprec.explain(model, "32-true")["1"] == Policy("32-true")
    assert mixprec.explain(nn.Linear(2, 2))[""] == mixprec.global_policy()


def test_explain_shows_the_dtype_a_region_inside_a_true_parent_hands_back():
    """Found by a review: a float32 head inside ``float16`` weights and compute hands its
    result back in float16 (its caller's compute dtype: 70000 became inf), while `explain`
    listed its output as float32. The table and `Explanation.handed_back` now say float16;
    a caller computing in float32 keeps the head's float32 result."""
    from rich.console import Console

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].bias.copy_(torch.tensor([70000.0, 1.2345678]))
    pmap = PolicyMap("p=f16,c=f16,o=f32", {"1": "float32"})
    found = mixprec.explain(model, pmap)
    assert found["1"].output_dtype == torch.float32  # (the policy's own)
    # (layer 0's policy, inherited, says float32 too; it returns what it computes, float16)
    assert found.handed_back == {"0": torch.float16, "1": torch.float16}
    console = Console(width=200, record=True)
    console.print(found)
    row = next(line for line in console.export_text().splitlines() if "path rule '1'" in line)
    assert "float16" in row.split("│")[6] and "hands back float16" in row
    # (the same answer about the model once applied: its parameters' dtypes changed)
    applied = mixprec.apply(copy.deepcopy(model), pmap)
    assert mixprec.explain(applied).handed_back == found.handed_back
    out = mixprec.apply(model, pmap)(torch.zeros(1, 4))
    assert out.dtype == torch.float32 and torch.isinf(out[0, 0])  # (as explained)
    kept = mixprec.PolicyMap("32-true", {"0": "p=f16,c=f16,o=f16"})
    assert mixprec.explain(model, kept).handed_back == {"0": torch.float32}
    out = mixprec.apply(model, kept)(torch.zeros(1, 4))  # (a float32 head: finite)
    assert abs(float(out[0, 0]) - 70000.0) < 1.0


def test_apply_uses_the_global_policy_by_default():
    with mixprec.policy_scope("bf16-true"):
        model = mixprec.apply(nn.Linear(2, 2))
    assert model.weight.dtype == bf16


# -- "true" precisions and tensors made inside forward --------------------------------------


class MakesTensors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) + self.lin(torch.ones(x.shape[0], 3))  # a tensor made in forward


@pytest.mark.parametrize("spec, dtype", [("64-true", f64), ("bf16-true", bf16), ("16-true", f16)])
def test_true_policy_sets_the_default_dtype_for_the_forward_and_restores_it(spec, dtype):
    model = mixprec.apply(MakesTensors(), spec, warn=False)
    assert model(torch.ones(2, 3)).dtype == dtype
    assert torch.get_default_dtype() == f32


def test_default_dtype_is_restored_when_the_forward_raises():
    class Fails(nn.Linear):
        def forward(self, x):
            assert torch.get_default_dtype() == f64
            raise RuntimeError("boom")

    model = mixprec.apply(Fails(2, 2), "64-true")
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.ones(1, 2))
    assert torch.get_default_dtype() == f32


def test_true_forwards_in_two_threads_each_see_their_own_default_dtype():
    import threading

    seen: dict[str, set[torch.dtype]] = {"64": set(), "32": set()}
    start = threading.Barrier(2)

    class Records(nn.Module):
        def __init__(self, key):
            super().__init__()
            self.key = key
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            for _ in range(5):
                seen[self.key].add(torch.ones(1).dtype)
                time.sleep(0.001)  # hand the GIL to the other thread mid-forward
            return self.lin(x)

    wide = mixprec.apply(Records("64"), "64-true")
    # a float32 rule inside a 64-true root: its own region sets float32 back
    narrow = mixprec.apply(nn.Sequential(Records("32")), PolicyMap("64-true", {"0": "32-true"}))

    def run(model):
        start.wait(5)
        for _ in range(10):
            model(torch.ones(1, 2))

    threads = [threading.Thread(target=run, args=(m,)) for m in (wide, narrow)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == {"64": {f64}, "32": {f32}}
    assert torch.get_default_dtype() == f32


def test_forwards_swapping_in_compute_copies_in_two_threads_see_their_own_copies():
    """Under "p=bf16,c=f32" a forward swaps each weight for a float32 copy, which every
    thread calling the model sees: a thread found a weight another's forward had swapped
    (so made no copy of its own), that forward restored the bfloat16 weight mid-way through
    this one, and its float32 matmul met a bfloat16 weight. Such forwards take turns."""
    import threading

    class Slow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.002)  # hand the GIL to the other thread before reading the weight
            seen.add(self.weight.dtype)
            return F.linear(x, self.weight)

    seen: set[torch.dtype] = set()
    model = mixprec.apply(nn.Sequential(Slow(), Slow()), "p=bf16,c=f32", warn=False)
    start, errors = threading.Barrier(3), []

    def run() -> None:
        start.wait(5)
        for _ in range(20):
            try:
                with torch.no_grad():
                    model(torch.ones(2, 4))
            except RuntimeError as err:
                errors.append(str(err))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and seen == {f32}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_precision_forward_context_sets_the_default_dtype_of_a_true_policy():
    precision = mixprec.Precision("64-true", device="cpu")
    with precision.forward_context():
        assert torch.ones(1).dtype == f64
    assert torch.get_default_dtype() == f32
    with mixprec.Precision("32-true", device="cpu").forward_context():
        assert torch.ones(1).dtype == f32


def test_precision_backward_recomputes_a_checkpointed_true_forward_in_its_dtype():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * torch.ones(4)  # a tensor made without a dtype

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)

    torch.manual_seed(0)
    reference = Model()
    model = copy.deepcopy(reference)
    precision = mixprec.Precision("64-true", device="cpu")
    model, opt = precision.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(2, 4)
    with precision.forward_context():
        loss = model(precision.convert_input(x)).sum()
    precision.backward(loss)  # the recompute would make float32 ones: a CheckpointError
    assert torch.get_default_dtype() == f32
    reference.double()
    (reference.block.lin(x.double()) * torch.ones(4, dtype=f64)).sum().backward()
    assert torch.equal(model.block.lin.weight.grad, reference.block.lin.weight.grad)


# -- remove, shared modules, rule typos ---------------------------------------------------


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.rand(2), persistent=False)


def test_remove_restores_non_persistent_buffers_too():
    model = mixprec.apply(Rotary(), "bf16-true", warn=False)
    assert model.inv_freq.dtype == bf16
    mixprec.remove(model)
    assert model.inv_freq.dtype == model.lin.weight.dtype == f32


def test_one_module_at_two_paths_with_conflicting_rules_is_an_error_naming_both():
    shared = nn.Linear(2, 2)
    model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    pmap = PolicyMap("32-true", {"a": "bf16-true"})
    with pytest.raises(mixprec.PolicySpecError, match=r"reachable at 'a\.0' and 'b\.0'"):
        mixprec.apply(model, pmap, warn=False)
    with pytest.raises(mixprec.PolicySpecError, match="one module runs in one policy"):
        mixprec.explain(model, pmap)
    # agreeing paths are fine
    mixprec.apply(model, PolicyMap("32-true", {"a": "64-true", "b": "64-true"}))
    assert shared.weight.dtype == f64


def test_a_path_rule_matching_no_module_warns_with_the_closest_paths():
    model = nn.Sequential()
    model.add_module("encoder", nn.Linear(2, 2))
    with pytest.warns(UserWarning, match=r"'encodr' matches no module.*closest paths: 'encoder'"):
        mixprec.apply(model, PolicyMap("32-true", {"encodr": "64-true"}))


def test_explain_warns_of_a_path_rule_matching_no_module_as_apply_does():
    """`explain`, where a map is checked before a run, said nothing of a path rule with a
    typo (its table showed the layer in the default policy) while warning of a state rule's;
    each warning points at the line calling it."""
    model = nn.Sequential()
    model.add_module("encoder", nn.Linear(2, 2))
    pmap = PolicyMap("32-true", {"encodr": "64-true"}, states={"encodr": "int8"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = mixprec.explain(model, pmap)
    said = {str(w.message).split(" matches")[0]: w.filename for w in caught}
    assert said == {"policy rule 'encodr'": __file__, "state rule 'encodr'": __file__}
    assert table["encoder"] == Policy("32-true")


def test_many_unmatched_path_rules_are_one_warning_and_warn_false_silences_it():
    """20,000 unmatched rules gave 20,000 warnings, with ``warn=False`` too. Now one names the
    first five and counts the rest; ``warn=False`` gives none; `Precision.setup` (which
    applies with ``warn=False`` after its own device check) still says it."""
    model = nn.Sequential()
    model.add_module("encoder", nn.Linear(2, 2))
    rules = {f"layer{i}": "64-true" for i in range(2000)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixprec.apply(model, PolicyMap("32-true", rules))
    [one] = caught
    assert str(one.message).startswith("2000 policy rules match no module of Sequential")
    assert "'layer0', 'layer1', 'layer2', 'layer3', 'layer4' and 1995 more" in str(one.message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixprec.apply(model, PolicyMap("32-true", rules), warn=False)
    with pytest.warns(UserWarning, match="2000 policy rules match no module"):
        mixprec.Precision(PolicyMap("32-true", rules)).setup(model)


# -- what apply refuses, and says why -------------------------------------------------------


def test_apply_checks_its_argument_types():
    with pytest.raises(TypeError, match="apply needs an nn.Module, got str"):
        mixprec.apply("bf16-mixed", nn.Linear(2, 2))  # type: ignore[arg-type]


def test_apply_refuses_torchscript_modules_and_says_what_to_do():
    traced = torch.jit.trace(nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(TypeError, match="TorchScript.*apply the policy to the eager module"):
        mixprec.apply(traced, "64-true")


def test_apply_under_inference_mode_leaves_a_trainable_model():
    model = nn.Linear(2, 2)
    with torch.inference_mode():
        mixprec.apply(model, "64-true")
    assert model.weight.dtype == f64 and not model.weight.is_inference()
    model(torch.ones(1, 2)).sum().backward()
    assert model.weight.grad is not None
    with torch.inference_mode():
        mixprec.remove(model)
    assert not model.weight.is_inference()


def test_lstm_under_16_mixed_on_cpu_names_the_limitation_and_the_fix():
    model = nn.Sequential(nn.LSTM(3, 3))
    mixprec.apply(model, "16-mixed", warn=False)
    with pytest.raises(
        mixprec.PrecisionError, match=r"no float16 kernel for RNN.*nn.LSTM: 'float32'"
    ):
        model(torch.randn(2, 1, 3))
    mixprec.apply(model, PolicyMap("16-mixed", {nn.LSTM: "float32"}), warn=False)
    assert model(torch.randn(2, 1, 3))[0].dtype == f32


def test_a_training_step_under_64_true_creates_float64_tensors():
    from torch.utils.data import DataLoader, TensorDataset

    seen = []

    class Module(mixprec.TrainingModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):
            return self.lin(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            weight = torch.ones(x.shape[0], 1)  # made outside forward, in the step
            seen.append(weight.dtype)
            return ((self.lin(x) - y) ** 2 * weight).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    trainer = mixprec.Trainer(
        precision="64-true",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(Module(), DataLoader(data, batch_size=4))
    assert seen == [f64, f64]
    assert torch.get_default_dtype() == f32


def test_apply_refuses_to_nest_in_either_order_and_leaves_the_model_as_it_was():
    """An apply to a model holding a module applied on its own left that module's region
    running (its matmul in bfloat16 under a float32 map, or a bare dtype error) and `remove`
    gave it bfloat16 weights back; an apply to a layer inside an applied model wrapped its
    regions again."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    mixprec.apply(model[0], "bf16-true")
    with pytest.raises(mixprec.PolicySpecError, match=r"'0' was converted by an apply of its"):
        mixprec.apply(model, "32-true")
    assert model[0].weight.dtype == bf16 and model[2].weight.dtype == f32  # as it was
    mixprec.remove(model[0])
    mixprec.apply(model, PolicyMap("32-true", {"0": "bf16-true"}))  # the way that works
    assert model[0].weight.dtype == bf16
    with pytest.raises(mixprec.PolicySpecError, match="part of a model mixprec.apply converted"):
        mixprec.apply(model[0], "32-true")
    mixprec.remove(model)
    assert all(p.dtype == f32 for p in model.parameters())


@pytest.mark.parametrize("rule", ["0.out_proj", r"0\.out_proj", r".*\.out_proj"])
def test_a_rule_aimed_at_out_proj_alone_is_refused_by_apply_and_explain(rule):
    """Written as a regex, a rule naming only out_proj was dropped silently (out_proj ran in
    its attention's policy, no warning), and `explain` listed the exact-path rule's float32
    that `apply` refuses. A regex reaching other modules too still gives way at out_proj."""
    model = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 8))
    pmap = PolicyMap("bf16-mixed", {rule: "float32"})
    for call in (mixprec.explain, mixprec.apply):
        with pytest.raises(mixprec.PolicySpecError, match="give the rule to '0' itself"):
            call(model, pmap)
    wide = PolicyMap("bf16-mixed", {r"0\.out_proj|1": "float32"})
    assert mixprec.explain(model, wide)["0.out_proj"].name == "bf16-mixed"
    mixprec.apply(model, wide)
    assert model[1].weight.dtype == f32


def test_remove_keeps_a_buffer_two_modules_share_shared():
    """apply kept a shared buffer shared; remove cast it once per owner, so an in-place
    update through one module no longer reached the other."""

    class WithTable(nn.Linear):
        def __init__(self, table: torch.Tensor) -> None:
            super().__init__(4, 4)
            self.register_buffer("table", table)

    table = torch.zeros(4)
    model = nn.Sequential(WithTable(table), WithTable(table))
    mixprec.apply(model, "bf16-true")
    assert model[0].table is model[1].table and model[0].table.dtype == bf16
    mixprec.remove(model)
    assert model[0].table is model[1].table and model[0].table.dtype == f32


def test_a_region_differing_from_its_mixed_parent_in_output_dtype_hands_that_dtype_back():
    """Before: a layer's region inside a mixed parent of the same compute dtype returned
    autocast's bfloat16 whatever its output dtype (the parent's autocast made it skip its
    cast), while `explain` listed float16, and the layer called alone returned float16."""
    seen = {}
    for rules, want in (
        (("bf16-mixed", {"head": "p=f32,c=bf16,o=f16"}), torch.float16),
        (("c=bf16", {"head": "bf16-mixed"}), torch.float32),
    ):
        model = nn.Sequential(OrderedDict(body=nn.Linear(8, 8), head=nn.Linear(8, 4)))
        model.head.register_forward_hook(lambda m, i, o: seen.__setitem__("head", o.dtype))
        mixprec.apply(model, mixprec.PolicyMap(*rules))
        assert mixprec.explain(model)["head"].output_dtype == want
        model(torch.randn(2, 8))
        assert seen["head"] == want
        # the model's own region under its caller's autocast still leaves autocast's outputs
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 8))
        assert seen["head"] == want


class _Positions(nn.Module):
    """Makes a tensor without a dtype (positions), as rotary and sinusoidal embeddings do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(300.0)
        self.seen = (torch.get_default_dtype(), pos.dtype, pos[257].item())
        return x + self.lin(pos[:, None]).sum()


class _WithPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos, self.out = _Positions(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.pos(x))


@pytest.mark.parametrize("root", ["bf16-true", "16-true", "64-true"])
def test_a_mixed_rule_inside_a_true_region_makes_tensors_in_its_weights_dtype(root):
    """A "true" region makes its compute dtype torch's default; a mixed child kept it, so
    tensors its forward made without a dtype came out bfloat16 (position 257 read 256) or
    float64 (a float64 input met bfloat16 weights: autocast refused the matmul). It puts
    its weights' dtype back, as a float32 rule there does."""
    model = mixprec.apply(_WithPositions(), PolicyMap(root, {"pos": "bf16-mixed"}))
    dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}[root]
    out = model(torch.randn(2, 4, dtype=dtype))
    assert model.pos.seen == (torch.float32, torch.float32, 257.0)
    assert out.dtype == dtype and torch.get_default_dtype() == torch.float32


def test_explain_names_the_type_at_every_path_of_a_shared_module():
    lin = nn.Linear(4, 4)
    model = nn.ModuleDict({"a": nn.Sequential(nn.ReLU(), lin), "b": nn.Sequential(nn.ReLU(), lin)})
    assert mixprec.explain(model, "bf16-mixed").types["b.1"] == "Linear"


class Listed(nn.Module):
    """Layers in an `nn.ModuleList` (never called: the model calls each layer), a head;
    each layer records the dtype its own forward computed in."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.computed: list[torch.dtype] = []

        class Layer(nn.Linear):
            def forward(layer, x):
                out = super().forward(x)
                self.computed.append(out.dtype)
                return out

        self.layers = nn.ModuleList([Layer(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize(
    ("default", "rule", "computed"),
    [
        ("bf16-mixed", "32-true", f32),
        ("32-true", "bf16-mixed", bf16),
        ("32-true", "bf16-true", bf16),
    ],
)
def test_a_rule_on_a_list_of_layers_is_carried_out_by_each_layer(default, rule, computed):
    """`resolve` gave each layer the list's policy, but a layer computing as its parent (the
    list) got no region, and the list's own region never ran (nothing calls a ModuleList):
    the layers computed in the model's dtype (bf16-true: a dtype error further on)."""
    model = Listed()
    pmap = PolicyMap(default, {"layers": rule})
    assert pmap.resolve(model)["layers.0"].policy == Policy(rule)
    mixprec.apply(model, pmap)
    assert model(torch.randn(4, 8)).dtype == f32
    assert model.computed == [computed, computed]


def test_a_shared_module_given_no_floating_input_runs_on_the_meta_device():
    """Its caller's dtype asked autocast about "meta", which torch refuses: a model sized on
    the meta device raised in the forward."""
    model = SharedEmbedding().to("meta")
    rules = {"a": "bf16-true", "b": "32-true", r"[ab]\.s": "32-true"}
    mixprec.apply(model, PolicyMap("32-true", rules), warn=False)  # (no device to warn of)
    out_a, out_b = model(torch.zeros(4, 3, dtype=torch.long, device="meta"))
    assert (out_a.device.type, out_b.device.type) == ("meta", "meta")


class _WithLoss(nn.Module):
    """Returns its logits and a loss computed in float32, as a Hugging Face model does."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(x)
        return {"logits": logits, "loss": F.cross_entropy(logits.float(), y)}


@pytest.mark.parametrize("name", ["bf16-true", "16-true"])
def test_a_true_models_float32_loss_is_handed_back_in_float32(name):
    """Under a "true" policy the root cast every floating output to 16 bits, a float32 loss
    computed inside the forward included: rounded (bfloat16) or, scaled by 65536, overflowed
    (float16: a first step skipped). A 0-dim float32 output now stays float32."""
    torch.manual_seed(0)
    model = mixprec.apply(_WithLoss(), name)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    out = model(x, y)
    dtype = Policy(name).compute_dtype
    assert out["logits"].dtype == dtype and out["loss"].dtype == f32
    expected = F.cross_entropy(model.head(x.to(dtype)).float(), y)
    assert torch.equal(out["loss"], expected)


def test_a_true_rule_on_a_transformer_layer_takes_the_padded_fast_paths_nested_tensor():
    """In eval with a padding mask, TransformerEncoder hands its layers a nested tensor:
    casting it for a "true" rule read its range with aminmax, which nested tensors lack."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    fast = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[False] * 5, [False, False, True, True, True]])
    mixprec.apply(fast, PolicyMap("32-true", {r"layers\.0": "bf16-true"}))
    with torch.no_grad():
        out = fast(x, src_key_padding_mask=mask)
    assert out.dtype == f32 and out[0].isfinite().all()


class _RoutedCheckpointed(_Routed):
    """_Routed with its float32 router recomputed in the backward (torch's checkpoint)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            route = torch.utils.checkpoint.checkpoint(self.router, x.float(), use_reentrant=False)
        return self.body(x) * route.softmax(-1)


def test_an_entry_recomputed_in_the_backward_runs_as_in_the_forward():
    """In the backward's recomputation no region runs: the router's entry entered a
    bfloat16 region there, where the forward had passed through in float32, and torch's
    checkpoint refused the recomputed tensors. In a backward an entry passes through."""
    torch.manual_seed(0)
    plain, ckpt = _Routed(), _RoutedCheckpointed()
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(2, 8)
    grads = []
    for model in (mixprec.apply(plain, "bf16-mixed"), mixprec.apply(ckpt, "bf16-mixed")):
        with torch.no_grad():  # (from outside, no recomputation to follow: nothing kept)
            model.router(x)
        model(x).sum().backward()
        grads.append(model.router[0].weight.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("depth", [0, 3])
def test_an_entry_checkpointed_from_outside_its_model_recomputes_as_in_the_forward(
    reentrant, depth
):
    """``checkpoint(model.encoder, x)`` in a loop of one's own: the forward entered the
    encoder's bfloat16 region, but in the backward its entry passed through and the
    recomputation ran in float32 (torch's checkpoint refused it; reentrant, the gradients
    were of a float32 recomputation), also with a model forward between, and with the
    encoder under wrapper modules inside a reentrant checkpoint. An entry recomputed does as
    its forward did: the gradients are a twin's without checkpointing."""
    torch.manual_seed(0)
    model = mixprec.apply(_EncoderDecoder(), "bf16-mixed")
    twin = copy.deepcopy(model)
    x = torch.randn(2, 8, requires_grad=True)
    twin.encoder(x).sum().backward()
    checkpoint = torch.utils.checkpoint.checkpoint
    wrapped = model.encoder
    for _ in range(depth):  # (three frames a module call between checkpoint and the entry)
        wrapped = nn.Sequential(wrapped)
    out = checkpoint(wrapped, x.detach().requires_grad_(), use_reentrant=reentrant)
    model(x)  # (inside the model's forward, before the backward: the entry passes through)
    out.sum().backward()
    assert torch.equal(model.encoder[0].weight.grad, twin.encoder[0].weight.grad)


@pytest.mark.parametrize("reentrant", [False, True])
def test_each_checkpoint_recomputes_its_entries_as_its_own_forward_ran_them(reentrant):
    """Which recomputations entered their region was decided by the address of the first
    input among the last 16 calls from outside: 20 chunks checkpointed from outside before
    one backward recomputed the oldest four in float32 (reentrant: silently, the chunk's
    gradient 17% off), two children checkpointed in one function recomputed the second in
    float32 (its input a new tensor), and an earlier outside call on the input made a
    recomputation inside the model, where its parent had switched autocast off, enter
    bfloat16. Each checkpoint now records the entries its forward entered."""
    torch.manual_seed(0)
    model = mixprec.apply(_EncoderDecoder(), "bf16-mixed")
    checkpoint = torch.utils.checkpoint.checkpoint
    xs = [torch.randn(2, 8, requires_grad=True) for _ in range(20)]
    twins = [x.detach().clone().requires_grad_() for x in xs]
    outs = [
        checkpoint(lambda h: model.decoder(model.encoder(h)), x, use_reentrant=reentrant)
        for x in xs
    ]
    torch.stack(outs).sum().backward()
    torch.stack([model.decoder(model.encoder(x)) for x in twins]).sum().backward()
    for x, twin in zip(xs, twins, strict=True):
        assert torch.equal(x.grad, twin.grad)

    class Parent(nn.Module):  # (runs its encoder in float32 on purpose, checkpointed)
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
            self.head = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", enabled=False):
                h = checkpoint(self.encoder, x, use_reentrant=reentrant)
            return self.head(h)

    parent = mixprec.apply(Parent(), "bf16-mixed")
    x = torch.randn(2, 8, requires_grad=True)
    twin = x.detach().clone().requires_grad_()
    parent(twin).float().sum().backward()
    parent.encoder(x)  # (from outside: enters its region)
    parent(x).float().sum().backward()  # (recomputed as the forward ran it: float32)
    assert torch.equal(x.grad, twin.grad)


class _RoutedLayer(nn.Module):
    """A layer running its router with autocast off, the router checkpointed (``inner``)."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.router = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
        self.body, self.out = nn.Linear(8, 4), nn.Linear(4, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            route = self.inner(self.router, h.float())
        return h + self.out(self.body(h) * route.softmax(-1))


class _RoutedLayers(nn.Module):
    def __init__(self, outer: Any, inner: Any) -> None:
        super().__init__()
        self.outer = outer
        self.layers = nn.ModuleList(_RoutedLayer(inner) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.outer(layer, x)
        return self.head(x)


def _checkpointed(reentrant: bool | None) -> Any:
    """``f(h)`` through torch's checkpoint (reentrant or not), or called plainly (None)."""
    if reentrant is None:
        return lambda f, h: f(h)
    return lambda f, h: torch.utils.checkpoint.checkpoint(f, h, use_reentrant=reentrant)


def _routed_grads(model: nn.Module) -> list[torch.Tensor]:
    """The input's and every parameter's gradient of ``model`` under bf16-mixed."""
    model = mixprec.apply(model, "bf16-mixed")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    model(x).float().square().sum().backward()
    return [x.grad, *(p.grad for p in model.parameters())]


def _assert_recomputed_as_it_ran(grads: Any, outer: bool, inner: bool | None) -> None:
    """``grads(outer, inner)`` with those checkpoints equals it with none, bit for bit."""
    plain = _checkpointed(None)
    expected = grads(plain, plain)
    got = grads(_checkpointed(outer), _checkpointed(inner))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("inner", [True, False, None])
@pytest.mark.parametrize("outer", [True, False])
def test_a_child_run_with_autocast_off_inside_nested_checkpoints_recomputes_as_it_ran(outer, inner):
    """A layer checkpointed inside the model whose forward runs a float32 router (autocast
    off on purpose), the router checkpointed again (or not): in the outer recomputation the
    layer's entry ran as it is but not as inside its model, so the router's entry, met in
    the inner checkpoint's forward with autocast off, read a call from outside and entered
    its bfloat16 region (the gradients 0.3-0.6% off). Recomputed, an entry that ran inside
    its model's forward runs counted so: every gradient equals the un-checkpointed one."""

    def grads(outer: Any, inner: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        return _routed_grads(_RoutedLayers(outer, inner))

    _assert_recomputed_as_it_ran(grads, outer, inner)


class _RoutedBody(_RoutedLayer):
    """`_RoutedLayer` whose forward checkpoints a plain function of its own (``outer``): the
    layer's call is not what the outer checkpoint recomputes."""

    def __init__(self, outer: Any, inner: Any) -> None:
        super().__init__(inner)
        self.outer = outer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.outer(super().forward, h)


@pytest.mark.parametrize("inner", [True, False, None])
@pytest.mark.parametrize("outer", [True, False])
def test_a_float32_router_inside_nested_checkpoints_of_a_plain_function_recomputes_as_it_ran(
    outer, inner
):
    """The layer's forward checkpoints a function of its own (not the layer's call), inside
    which the router runs with autocast off, checkpointed again: in the outer recomputation
    no entry ran before the router's, which met the inner checkpoint's forward, read a call
    from outside and entered its bfloat16 region (the gradients 0.76% off). The router's
    entry now reads the record of the checkpoint recomputed around it, where its forward
    ran inside the model: every gradient equals the un-checkpointed one."""

    def grads(outer: Any, inner: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _RoutedLayers(lambda f, h: f(h), inner)
        model.layers = nn.ModuleList(_RoutedBody(outer, inner) for _ in range(2))
        return _routed_grads(model)

    _assert_recomputed_as_it_ran(grads, outer, inner)


@pytest.mark.parametrize("reentrant", [False, True])
def test_an_entry_entered_and_then_called_under_its_own_autocast_recomputes_both_calls(reentrant):
    """A checkpointed function of one's own calls the encoder from outside twice: first
    entering its bfloat16 region, then under its own bfloat16 autocast (a probe without
    grad). A record of each call's way, the second overwriting the first, recomputed the
    first in float32 (reentrant: silently, 0.35% off; non-reentrant: torch refused it); an
    entry that entered once recomputes each call as it ran."""
    torch.manual_seed(0)
    model = mixprec.apply(_EncoderDecoder(), "bf16-mixed")

    def both(h: torch.Tensor) -> torch.Tensor:
        out = model.encoder(h)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model.encoder(h)
        return out.float()

    x = torch.randn(2, 8, requires_grad=True)
    twin = x.detach().clone().requires_grad_()
    torch.utils.checkpoint.checkpoint(both, x, use_reentrant=reentrant).square().sum().backward()
    weight = model.encoder[0].weight.grad.clone()
    model.zero_grad()
    both(twin).square().sum().backward()
    assert torch.equal(x.grad, twin.grad)
    assert torch.equal(weight, model.encoder[0].weight.grad)


def test_a_layer_called_under_its_own_autocast_from_outside_keeps_its_float32_child():
    """A layer called directly under the user's bfloat16 autocast runs as it is, but its
    model was not counted as running: the router its forward runs with autocast off read a
    call from outside and entered its bfloat16 region, where plain torch (and the whole
    model under the same autocast) runs it in float32."""
    torch.manual_seed(0)
    layer = _RoutedLayer(lambda f, h: f(h))
    plain = copy.deepcopy(layer)
    model = mixprec.apply(_RoutedLayers(lambda f, h: f(h), lambda f, h: f(h)), "bf16-mixed")
    model.layers[0].load_state_dict(plain.state_dict())
    seen = []
    model.layers[0].router[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    h = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = model.layers[0](h), plain(h)
    assert seen == [torch.float32]
    assert torch.equal(got, expected)


class _Recompute(torch.autograd.Function):
    """A recomputation in the backward of one's own, as DeepSpeed's and Megatron's
    checkpoints are written: no torch checkpoint on the stack, no autocast restored."""

    @staticmethod
    def forward(ctx, fn, x):  # type: ignore[no-untyped-def]
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            torch.autograd.backward(ctx.fn(x), grad)
        return None, x.grad


class _Layers(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
        self.head, self.recompute = nn.Linear(8, 4), recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = _Recompute.apply(layer, x) if self.recompute else layer(x)
        return self.head(x)


def test_recomputations_other_than_torchs_checkpoint_and_its_composable_form_run_alike():
    """A recomputation of one's own in the backward (no torch checkpoint found, autocast
    not restored) enters each layer's region as a call from outside does, as its forward
    ran inside the model's region (a first version ran it as it is: in float32, 1.6% off);
    torch's composable checkpoint, which runs no function around the forward, left the
    encoder's entry unmarked (the recomputation refused). Both give a twin's gradients."""
    torch.manual_seed(0)
    plain, own = _Layers(False), _Layers(True)
    own.load_state_dict(plain.state_dict())
    x = torch.randn(4, 8)
    grads = []
    for model in (mixprec.apply(plain, "bf16-mixed"), mixprec.apply(own, "bf16-mixed")):
        given = x.clone().requires_grad_()
        model(given).float().square().sum().backward()
        grads.append([given.grad, *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))

    from torch.distributed._composable import checkpoint as composable

    model = mixprec.apply(_EncoderDecoder(), "bf16-mixed")
    twin = copy.deepcopy(model)
    composable(model.encoder)
    twin.encoder(x).float().sum().backward()
    model.encoder(x).float().sum().backward()
    assert torch.equal(model.encoder[0].weight.grad, twin.encoder[0].weight.grad)
    for reentrant in (False, True):  # (inside torch's checkpoint: its hooks the innermost)
        model.zero_grad()
        given = x.clone().requires_grad_()
        out = torch.utils.checkpoint.checkpoint(model.encoder, given, use_reentrant=reentrant)
        out.float().sum().backward()
        assert torch.equal(model.encoder[0].weight.grad, twin.encoder[0].weight.grad)
    # a block of one's own, checkpointed, calling the encoder under other saved-tensor hooks
    # (save_on_cpu's covered the checkpoint's: found by its module, not by the top hooks)
    first, second = (mixprec.apply(_EncoderDecoder(), "bf16-mixed") for _ in range(2))
    twins = copy.deepcopy((first, second))

    class Block(nn.Module):
        def __init__(self, one: nn.Module, two: nn.Module) -> None:
            super().__init__()
            self.one, self.two = one, two

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            with torch.autograd.graph.save_on_cpu():
                h = self.one(h)
            return self.two(h)  # (recomputed: the first runs again as in the forward)

    composable(Block(first.encoder, second.encoder))(x).float().sum().backward()
    Block(twins[0].encoder, twins[1].encoder)(x).float().sum().backward()
    assert torch.equal(second.encoder[0].weight.grad, twins[1].encoder[0].weight.grad)


def test_an_entry_called_from_outside_under_a_function_transform_runs():
    """The entry read its first input's address to remember the call: a tensor without
    storage (torch.func's batched and gradient-tracking tensors, a sparse input) raised."""
    torch.manual_seed(0)
    model = mixprec.apply(_EncoderDecoder(), "bf16-mixed")
    x = torch.randn(3, 2, 8)
    out = torch.func.vmap(model.encoder)(x)
    assert out.shape == (3, 2, 8) and out.isfinite().all()  # (torch's autocast skips vmap)
    grad = torch.func.grad(lambda h: model.encoder(h).float().sum())(x[0])
    assert grad.shape == (2, 8) and grad.isfinite().all()


def test_a_submodule_compiled_in_place_follows_which_model_runs_around_it():
    """A router compiled in place, traced inside its own model's forward (passing through:
    its parent turned autocast off for it), was reused inside another model's forward,
    where eagerly it enters its own bfloat16 region: dynamo told the running models apart
    by their number, not by which. A traced entry reads its own model's count."""
    torch.manual_seed(0)
    owner = mixprec.apply(_Routed(), "bf16-mixed")
    x, seen = torch.randn(2, 8), {}

    class Host(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", enabled=False):
                seen["router"] = owner.router(x)
            return self.inner(x)

    host = mixprec.apply(Host(), "bf16-mixed")
    host(x)
    expected = seen["router"].clone()
    owner.router.compile(backend="eager")
    owner(x)  # (traced inside its own model's forward: passes through)
    host(x)
    assert torch.equal(seen["router"], expected)


def test_another_models_entry_called_inside_a_forward_keeps_its_own_policy():
    """Entries passed through while any converted model's forward ran: a float16 teacher's
    encoder called inside a bfloat16 student's forward computed in bfloat16. An entry
    passes through only inside its own model's forward."""
    teacher = mixprec.apply(_EncoderDecoder(), "p=f32,c=f16,o=f32")
    seen = []
    teacher.encoder[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))

    class Student(nn.Module):  # (its blocks have entries: its region counts itself)
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(x) + teacher.encoder(x)

    mixprec.apply(Student(), "bf16-mixed")(torch.randn(2, 8))
    assert seen == [torch.float16]


def test_torch_export_traces_an_applied_model_non_strict():
    """torch.export's non-strict trace (its default) reads the forward's ``__code__``,
    which a converted model's region lacked: it failed on every applied model."""
    torch.manual_seed(0)
    model = mixprec.apply(_EncoderDecoder(), "bf16-mixed")
    x = torch.randn(4, 8)
    for module in (model, model.encoder):
        exported = torch.export.export(module, (x,), strict=False).module()
        assert torch.equal(exported(x), module(x))


def test_a_model_on_the_meta_device_is_applied_with_a_warning_to_apply_again():
    """Built on the meta device, `apply` asked the meta device what it supports and raised
    "unknown device type". It applies, warning that the islands that follow the device
    (an attention island on a CPU, a CUDA model's norms) are decided by applying again
    where the model runs; applied again there it computes as a model applied there."""
    with torch.device("meta"):
        model = _EncoderDecoder()
    with pytest.warns(UserWarning, match=r"meta device.*apply the policy again"):
        mixprec.apply(model, "bf16-mixed")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    twin = _EncoderDecoder()
    model.load_state_dict(twin.state_dict())
    mixprec.apply(model, "bf16-mixed")
    x = torch.randn(4, 8)
    assert torch.equal(model(x), mixprec.apply(twin, "bf16-mixed")(x))


def test_a_module_shared_by_two_applied_models_takes_one_policy():
    """A Linear shared by a bf16-mixed model (no region of its own there) and a model
    whose map gave it float32 was accepted: the first model then computed it in float32.
    A shared module must have the same policy in both; the same one is accepted, and once
    the first model's policy is removed, any."""

    def pair(shared: nn.Module) -> nn.Module:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        model.shared = shared
        return model

    shared = nn.Linear(8, 8)
    first = mixprec.apply(pair(shared), "bf16-mixed")
    with pytest.raises(
        mixprec.PolicySpecError, match=r"'shared' \(Linear\) is also 'shared'.*32-true"
    ):
        mixprec.apply(pair(shared), mixprec.PolicyMap("bf16-mixed", {"shared": "float32"}))
    seen = []
    shared.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    first(torch.randn(2, 8))
    assert seen == [torch.bfloat16]  # (the first model's policy, still)
    again = mixprec.apply(pair(shared), "bf16-mixed")  # the same policy: accepted
    mixprec.remove(again)  # (the first model still holds it: a review found it forgotten)
    with pytest.raises(mixprec.PolicySpecError, match="is also 'shared'"):
        mixprec.apply(pair(shared), mixprec.PolicyMap("bf16-mixed", {"shared": "float32"}))
    mixprec.remove(first)
    second = pair(shared)
    mixprec.apply(second, mixprec.PolicyMap("bf16-mixed", {"shared": "float32"}))
    second(torch.randn(2, 8))
    assert seen[-1] == torch.float32


def test_a_copy_taken_while_a_forward_runs_counts_no_region_running():
    """A deepcopy or pickle taken while another thread ran the model's forward copied the
    count of running regions, which nothing in the copy ever lowers: the copy's encoder
    compiled on its own passed through its region (float32) for good."""
    model = mixprec.apply(_EncoderDecoder(), "bf16-mixed")
    family = model.__dict__["forward"].family
    family.eager += 1  # (as while a forward runs in another thread)
    try:
        twin = copy.deepcopy(model)
        loaded = pickle.loads(pickle.dumps(model))
    finally:
        family.eager -= 1
    for copied in (twin, loaded):
        assert copied.__dict__["forward"].family.eager == 0
        compiled = torch.compile(copied.encoder, backend="eager")
        x = torch.randn(2, 8)
        assert torch.equal(compiled(x), copied.encoder(x))


def test_removing_a_policy_from_a_model_sharing_a_changed_module_with_another_is_refused():
    """A teacher and a student sharing an embedding, both bf16-true: `remove(teacher)` cast
    the shared weight back to float32 and took off its region, under the student, whose
    next forward failed on mixed dtypes. It is refused, naming the module, before anything
    changes; once the student's policy is removed, the teacher's goes too."""
    shared = nn.Embedding(10, 8)
    teacher = mixprec.apply(nn.Sequential(shared, nn.Linear(8, 8)), "bf16-true")
    student = mixprec.apply(nn.Sequential(shared, nn.Linear(8, 4)), "bf16-true")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(mixprec.PolicySpecError, match=r"0 is also in a Sequential that is still"):
        mixprec.remove(teacher)
    assert shared.weight.dtype == torch.bfloat16 and student(ids).dtype == torch.bfloat16
    assert applied_policy(teacher) is not None
    mixprec.remove(student)
    mixprec.remove(teacher)
    assert shared.weight.dtype == torch.float32 and teacher(ids).dtype == torch.float32


def test_a_forward_wrapped_after_apply_is_refused_by_remove_and_a_new_policy():
    """A forward replaced after `apply` by a wrapper around mixprec's (a user's, a
    library's) hid the region: a new policy and `remove` left it computing inside, silently
    (bf16 logits after `remove`). Both refuse, naming the module, before anything changes;
    a forward deleted since holds no region and is not asked about."""
    model = mixprec.apply(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), "bf16-mixed")
    region = model.forward
    model.forward = lambda *args, **kwargs: region(*args, **kwargs)
    for undo in (mixprec.remove, lambda m: mixprec.apply(m, "32-true")):
        with pytest.raises(mixprec.PolicySpecError, match=r"forward of '<root>' \(Sequential\)"):
            undo(model)
    assert str(applied_policy(model)) == str(mixprec.PolicyMap("bf16-mixed"))
    model.forward = region  # (put back: both go on)
    mixprec.remove(model)
    assert model(torch.randn(2, 8)).dtype == torch.float32
    again = mixprec.apply(nn.Sequential(nn.Linear(8, 8)), "bf16-mixed")
    del again.forward
    mixprec.remove(again)


def test_a_float_buffer_at_its_dtypes_lowest_value_stays_finite_when_cast():
    """Inputs at float32's lowest value (a mask's fill) keep bfloat16's lowest when cast, but
    buffers were cast plainly: a causal mask buffer became -inf under bf16-true, and a fully
    masked row's softmax NaN. Buffers are cast as inputs are."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("mask", torch.full((4,), torch.finfo(torch.float32).min))

        def forward(self, x):
            return torch.softmax(self.lin(x) * 0 + self.mask, -1)

    model = mixprec.apply(Masked(), "bf16-true")
    assert model.mask.dtype == torch.bfloat16 and model.mask.isfinite().all()
    assert not model(torch.randn(2, 4)).isnan().any()


class _MaskedRows(nn.Module):
    """An additive attention mask buffer at float32's lowest value, its last row masked
    whole (padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        mask = torch.zeros(4, 4)
        mask[:, 2:] = torch.finfo(torch.float32).min
        mask[3, :] = torch.finfo(torch.float32).min
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.lin(x) + self.mask, -1)


@pytest.mark.parametrize("spec", ["bf16-true", "16-true"])
def test_a_float32_checkpoint_loads_a_mask_buffer_finite_into_a_16_bit_model(spec):
    """Found by a review: `apply` keeps a buffer at float32's lowest value finite (the
    16-bit dtype's lowest), but loading the float32 checkpoint into the converted model
    afterwards (pretrained weights, loaded after setup) copied it in as -inf: a fully
    masked row's softmax was NaN. A converted model's load casts buffers as `apply` does;
    every other value loads as before, and after `remove` a load is torch's own."""
    dtype = bf16 if spec == "bf16-true" else f16
    torch.manual_seed(0)
    model = _MaskedRows()
    checkpoint = copy.deepcopy(model.state_dict())
    mixprec.apply(model, spec, warn=False)
    applied = model.mask.clone()
    with torch.no_grad():
        model.lin.weight.zero_()
    model.load_state_dict(checkpoint)
    assert model.mask.dtype == dtype and torch.equal(model.mask, applied)
    assert model.mask.min() == torch.finfo(dtype).min
    assert not model(torch.randn(4, 4)).isnan().any()
    assert torch.equal(model.lin.weight, checkpoint["lin.weight"].to(dtype))
    assert checkpoint["mask"].dtype == f32 and checkpoint["mask"].min() == torch.finfo(f32).min
    model.lin.load_state_dict({k[4:]: v for k, v in checkpoint.items() if k.startswith("lin.")})
    own = model.state_dict()  # (the model's own checkpoint loads as it is)
    model.load_state_dict(own)
    assert torch.equal(model.mask, applied)
    mixprec.remove(model)
    assert not any(m._load_state_dict_pre_hooks for m in model.modules())
    model.load_state_dict(checkpoint)
    assert torch.equal(model.mask, checkpoint["mask"])


class _SparseGraph(nn.Module):
    """A graph layer multiplying by a sparse adjacency, a buffer or an argument."""

    def __init__(self, adj: torch.Tensor | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        if adj is not None:
            self.register_buffer("adj", adj)

    def forward(self, x: torch.Tensor, adj: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sparse.mm(self.adj if adj is None else adj, self.lin(x))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_tensor_reaching_a_16_bit_cast_is_cast():
    """Found by a review: `_cast` looked for a mask's lowest value with ``torch.aminmax``,
    which has no sparse kernel: a sparse adjacency given to a bf16-true model, held as its
    buffer, given in float64 to a bf16-mixed one, or cast by ``convert_input`` raised, where
    torch runs the model. Its values are looked at (their lowest value stays finite)."""
    torch.manual_seed(0)
    adj, x = torch.eye(5).to_sparse(), torch.randn(5, 8)
    plain = _SparseGraph()
    expected = copy.deepcopy(plain).bfloat16()(x.bfloat16(), adj.bfloat16())
    out = mixprec.apply(plain, "bf16-true", warn=False)(x, adj)
    assert out.dtype == bf16 and torch.equal(out, expected)
    held = mixprec.apply(_SparseGraph(adj.clone()), "bf16-true", warn=False)
    assert held.adj.dtype == bf16 and held.adj.is_sparse and held(x).dtype == bf16
    mixed = mixprec.apply(_SparseGraph(), "bf16-mixed", warn=False)
    assert mixed(x, adj.double()).dtype == f32
    batch = mixprec.Precision("bf16-true", allow_slow=True).convert_input((x, adj))
    assert batch[1].dtype == bf16 and batch[1].is_sparse
    low = torch.finfo(f32).min
    dense = torch.tensor([[0.0, low], [2.0, -low]])
    for sparse in (dense.to_sparse(), dense.to_sparse_csr()):
        cast = mixprec.convert.cast_floating(sparse, f16)
        assert cast.layout == sparse.layout and cast.dtype == f16
        want = [[0.0, torch.finfo(f16).min], [2.0, torch.finfo(f16).max]]
        assert cast.to_dense().tolist() == want
    uncoalesced = torch.sparse_coo_tensor(
        [[0, 0], [1, 1]], [low / 2, low / 2], (2, 2), check_invariants=True
    )
    assert mixprec.convert.cast_floating(uncoalesced, bf16).to_dense()[0, 1] == -torch.inf


@pytest.mark.parametrize("spec", ["p=bf16,c=f32", "p=f32,c=f64"])
def test_lazy_layers_under_a_policy_casting_params_materialize_then_cast(spec):
    """Found by a review: under a policy computing in another dtype than its params, the
    region of an nn.Sequential made compute copies of a LazyLinear's parameters before its
    lazy hook had given them a shape: the first forward raised torch's AssertionError
    (in_features 0). Uninitialized parameters are left to the layer, whose own region
    casts them once its hook has materialized them."""
    policy = Policy(spec)
    torch.manual_seed(0)
    model = mixprec.apply(nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 4)), spec)
    x = torch.randn(2, 5)
    out = model(x)
    assert out.dtype == policy.compute_dtype
    assert {p.dtype for p in model.parameters()} == {policy.param_dtype}
    c = policy.compute_dtype
    h = F.linear(x.to(c), model[0].weight.to(c), model[0].bias.to(c)).relu()
    assert torch.equal(out, F.linear(h, model[2].weight.to(c), model[2].bias.to(c)))
    out.sum().backward()
    assert model[0].weight.grad.dtype == policy.param_dtype
    assert model[0].weight.shape == (8, 5)


def test_apply_warns_of_finite_values_a_16_bit_cast_makes_infinities():
    """Found by a review: under 16-true a float32 weight of 1e5 and a BatchNorm's variance
    of 2e5 became inf at apply with no word (the output NaN, the float32 masters built from
    the inf copies). Apply names the tensors, how many values and the largest; a float32
    checkpoint loaded into the converted model warns alike. A mask's sentinel (kept finite)
    and bf16-true (float32's range) do not warn."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), _MaskedRows())
    with torch.no_grad():
        model[0].weight[0, 0] = 1e5
        model[1].running_var.fill_(2e5)
    checkpoint = copy.deepcopy(model.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixprec.apply(copy.deepcopy(model), "bf16-true", warn=False)
    assert not caught
    with pytest.warns(UserWarning, match="0.weight, 1.running_var") as said:
        mixprec.apply(model, "16-true", warn=False)
    message = str(said[0].message)
    assert "5 finite values" in message and "200000" in message and "2.mask" not in message
    assert said[0].filename == __file__
    assert model[0].weight[0, 0] == torch.inf
    with pytest.warns(UserWarning, match=r"1 finite value .*0\.weight"):
        model.load_state_dict({**checkpoint, "1.running_var": torch.ones(4)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.load_state_dict(model.state_dict())  # (nothing past the range: no word)
