"""checkpoint and selective: gradients equal the un-checkpointed ones bit for bit under every
kind of policy, activations are not kept, and what cannot be recomputed (or offloaded here)
is refused with the options accepted."""

from __future__ import annotations

import collections
import dataclasses
import gc
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import PolicyMap, PolicySpecError, Precision
from mixprec.activations import saved_bytes, wrapped
from mixprec.activations.recompute import SAVED_OPS, SelectivePolicy
from mixprec.quantize.float8 import Float8Linear


class Block(nn.Module):
    """A residual MLP block with a LayerNorm (a float32 island under mixed policies),
    dropout (recomputed with the same mask) and a tensor made without a dtype (which must
    come out alike when a "true" policy's block is recomputed in the backward)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(nn.functional.gelu(self.fc(self.norm(x))))
        return x + self.out(h) * torch.ones(x.shape[-1], device=x.device).to(x.dtype)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), Block(), Block(), nn.Linear(32, 4))


def gradients(policy, activations, x: torch.Tensor) -> list[torch.Tensor]:
    model = net()
    precision = Precision(policy, allow_slow=True, activations=activations)
    model = precision.setup(model)
    torch.manual_seed(1)  # dropout's masks
    loss = model(precision.convert_input(x)).float().pow(2).mean()
    precision.backward(loss)
    return [p.grad for p in model.parameters() if p.grad is not None]


# (the last two store parameters in one dtype and compute in another: the model's region
# casts them for the whole forward, and a block's own casts again in its recomputation)
POLICIES = [
    "bf16-mixed",
    "16-mixed",
    "bf16-true",
    "int8_from_mixed_bfloat16",
    "32-true",
    "p=bf16,c=f32",
    "p=f16,c=bf16",
]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    "activations",
    [{r"[12]": "checkpoint"}, {r"[12]": "selective"}, "checkpoint", "selective"],
)
def test_recomputed_gradients_equal_kept_ones_bit_for_bit(policy, activations):
    """Under a policy casting its stored parameters (p=bf16,c=f32), a block recomputed
    selectively failed the backward: its recomputation cast the weights, which the model's
    region had cast in the forward, outside the block's record."""
    x = torch.randn(8, 16)
    kept = gradients(policy, None, x)
    again = gradients(policy, activations, x)
    assert len(kept) == len(again) > 0
    for a, b in zip(kept, again, strict=True):
        assert torch.equal(a, b)


class _CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.lin(x)))


@pytest.mark.parametrize("policy", ["bf16-mixed", "16-mixed"])
def test_selective_on_a_layer_called_twice_under_autocast_recomputes(policy):
    """A layer called twice in a forward (or tied weights) under autocast: its weight was
    cast once, the second call served from autocast's cache, and the second call's
    recomputation cast it again, an op its selective record lacked: torch failed the
    backward ("_to_copy encountered during backward but not found in storage"). Each
    recomputed call now casts from a fresh cache, as its recomputation does. The weight's
    two uses are then two casts, their gradients summed in float32 where keep sums them in
    the 16-bit dtype of its one shared cast: close, not equal."""
    x = torch.randn(4, 16)
    grads = []
    for activations in (None, {"lin": "selective"}):
        torch.manual_seed(0)
        precision = Precision(policy, allow_slow=True, activations=activations)
        model = precision.setup(_CalledTwice())
        precision.backward(model(x).float().mean() * 1e-2)
        grads.append([p.grad for p in model.parameters()])
    for kept, again in zip(*grads, strict=True):
        torch.testing.assert_close(again, kept, rtol=1e-2, atol=1e-6)


def test_checkpointed_blocks_keep_only_their_inputs():
    x = torch.randn(64, 16)
    plain = mixprec.apply(net(), "32-true")
    blocks = mixprec.apply(net(), PolicyMap("32-true", activations={r"[12]": "checkpoint"}))
    assert wrapped(blocks) == {"1": "checkpoint", "2": "checkpoint"}
    kept, held = saved_bytes(plain, x), saved_bytes(blocks, x)
    assert held["1"] == held["2"] == 64 * 32 * 4  # each block's input
    assert sum(kept[n] for n in kept if n.startswith(("1", "2"))) > 4 * held["1"]
    assert held["1.fc"] == held["2.out"] == 0


def test_selective_saves_matmul_outputs_and_recomputes_the_rest():
    aten, policy = torch.ops.aten, SelectivePolicy()
    assert policy(None, aten.mm.default).name == "MUST_SAVE"
    assert policy(None, aten.addmm.default).name == "MUST_SAVE"
    assert policy(None, aten.gelu.default).name == "PREFER_RECOMPUTE"
    # a view with a version counter of its own over a saved product is saved with it; the
    # same view of a recomputed op's output is recomputed
    assert policy(None, aten.bmm.default).name == "MUST_SAVE"
    assert policy(None, aten._unsafe_view.default).name == "MUST_SAVE"
    assert policy(None, aten.clone.default).name == "PREFER_RECOMPUTE"
    assert policy(None, aten._unsafe_view.default).name == "PREFER_RECOMPUTE"
    assert aten.convolution in SAVED_OPS


class _BiasedScores(nn.Module):
    """Attention scores written in place after ``torch.matmul``, as T5's attention does."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.o = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(self.q(x), self.k(x).transpose(-1, -2))
        scores += self.bias
        return x + self.o(scores.softmax(-1) @ x)


def test_selective_refuses_a_write_into_a_batched_matmul_output_instead_of_adding_it_twice():
    """``torch.matmul``'s batched output is a view with a version counter of its own over the
    product selective keeps: the write went unseen and the recomputation added the bias a
    second time (gradients 36% off). Now torch's mutation check catches it; `checkpoint`
    recomputes it bit for bit."""
    x = torch.randn(2, 4, 8)
    grads = {}
    for option in (None, "checkpoint", "selective"):
        torch.manual_seed(0)
        precision = Precision("32-true", activations=option)
        model = precision.setup(_BiasedScores())
        loss = model(x).square().mean()
        if option == "selective":
            with pytest.raises(RuntimeError, match="mutated"):
                precision.backward(loss)
            continue
        precision.backward(loss)
        grads[option] = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads[None], grads["checkpoint"], strict=True))


def bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), nn.Sequential(nn.Linear(8, 8))
    )


@pytest.mark.parametrize("option", ["checkpoint", "selective"])
def test_recomputing_a_batchnorm_is_refused_before_anything_changes(option):
    model = bn_net()
    weight = model[0][0].weight.detach().clone()
    pmap = PolicyMap("bf16-true", activations={"0": option})
    with pytest.raises(
        PolicySpecError,
        match=rf"module '0' \(Sequential\) cannot take the activation option '{option}' "
        r"\(path rule .0.\): .* its BatchNorm1d \(at .1. inside it\) updates running "
        r"statistics in place .* "
        r"'keep', 'bf16', 'fp8' or 'offload'",
    ):
        mixprec.apply(model, pmap)
    assert model[0][0].weight.dtype == torch.float32 and torch.equal(model[0][0].weight, weight)
    assert "forward" not in model.__dict__
    with pytest.raises(PolicySpecError, match="BatchNorm1d"):
        Precision("32-true", activations=option).setup(bn_net())


def test_batchnorm_takes_the_other_options_and_unrecomputed_neighbours_are_recomputed():
    model = mixprec.apply(
        bn_net(), PolicyMap("32-true", activations={"0": "fp8", "1": "checkpoint"})
    )
    assert wrapped(model) == {"0": "fp8", "1": "checkpoint"}
    model(torch.randn(16, 4)).sum().backward()
    assert int(model[0][1].num_batches_tracked) == 1


def test_a_buffer_updated_in_a_recomputed_forward_is_refused_when_it_happens():
    torch.manual_seed(0)
    layer = Float8Linear.from_float(nn.Linear(16, 16), recipe="delayed")
    model = mixprec.apply(nn.Sequential(layer), PolicyMap("32-true", activations="checkpoint"))
    with pytest.raises(PolicySpecError, match="updated its buffer .* in a forward that"):
        model(torch.randn(4, 16))


class _Average(nn.Module):
    """A running average kept by assigning its buffer anew in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        y = self.lin(x)
        self.ema = 0.9 * self.ema + 0.1 * y.detach().mean(0)
        return torch.tanh(y)


@pytest.mark.parametrize("option", ["checkpoint", "selective"])
def test_a_buffer_assigned_anew_in_a_recomputed_forward_is_refused(option):
    """Only in-place writes were seen: a buffer assigned anew (``self.ema = 0.9 * self.ema
    + ...``) was updated again by the recomputation in the backward, silently (twice the
    counts, the average moved twice)."""
    model = mixprec.apply(_Average(), PolicyMap("32-true", activations=option))
    with pytest.raises(PolicySpecError, match="updated its buffer 'ema' in a forward that"):
        model(torch.randn(4, 8))


class _FrozenScale(nn.Module):
    """A running statistic kept in a frozen parameter, updated in place in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.scale.mul_(0.5).add_(x.abs().mean(0))
        return self.lin(x) * self.scale


@pytest.mark.parametrize("option", ["checkpoint", "selective"])
def test_a_frozen_parameter_updated_in_a_recomputed_forward_is_refused_as_a_buffer_is(option):
    """Only buffers were watched: a frozen parameter updated in place was updated again by
    the recomputation, and the backward read the twice-updated value (gradients 0.8 off)."""
    model = mixprec.apply(_FrozenScale(), PolicyMap("32-true", activations=option))
    with pytest.raises(PolicySpecError, match="updated its parameter 'scale' in a forward"):
        model(torch.randn(4, 8))


@pytest.mark.parametrize("policy", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("option", ["checkpoint", "selective"])
def test_a_weight_written_between_the_forward_and_the_backward_fails_a_recomputation(
    policy, option
):
    """An optimizer step taken before the backward: a stored layer's backward fails on
    its saved weight (torch's error), a recomputed one read the new weight, silently."""
    torch.manual_seed(0)
    model = mixprec.apply(
        nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)),
        PolicyMap(policy, activations=option),
    )
    loss = model(torch.randn(8, 16)).float().sum()
    with torch.no_grad():
        model[2].weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


class _FunctionalGRU(nn.Module):
    """A GRU cell run by ``torch.gru_cell`` on the module's own weights (no GRU layer)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.w_ih = nn.Parameter(torch.randn(3 * d, d) * 0.3)
        self.w_hh = nn.Parameter(torch.randn(3 * d, d) * 0.3)
        self.b_ih = nn.Parameter(torch.randn(3 * d) * 0.1)
        self.b_hh = nn.Parameter(torch.randn(3 * d) * 0.1)

    def forward(self, xs):
        h = xs.new_zeros(xs.shape[1:])
        for x in xs:
            h = torch.gru_cell(x, h, self.w_ih, self.w_hh, self.b_ih, self.b_hh)
        return h


def test_selective_fails_a_write_into_an_unsafe_chunk_of_a_kept_product():
    """``torch.gru_cell`` on a CPU adds in place into ``unsafe_chunk`` pieces of the
    matmul outputs selective keeps (pieces with version counters of their own): the
    recomputation read the changed products, and the gradients were 20-40% off, silently.
    The pieces are kept too, so the write fails the backward."""
    torch.manual_seed(0)
    model = mixprec.apply(_FunctionalGRU(), PolicyMap("32-true", activations="selective"))
    out = model(torch.randn(3, 2, 8)).square().sum()
    with pytest.raises(RuntimeError, match="mutated"):
        out.backward()


def test_offload_is_refused_off_cuda_naming_the_options_accepted():
    accepted = "'keep', 'bf16', 'fp8', 'checkpoint' or 'selective'"
    with pytest.raises(PolicySpecError, match=f"'offload' .* CUDA only; .* {accepted}"):
        Precision("32-true", activations="offload", device="cpu").setup(net())
    if not torch.cuda.is_available():
        with pytest.raises(PolicySpecError, match="this machine has no CUDA device"):
            mixprec.apply(net(), PolicyMap("32-true", activations={"1": "offload"}))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload needs a CUDA device")
def test_offload_moves_saved_tensors_to_the_host_and_back():
    x = torch.randn(64, 16, device="cuda")
    grads = []
    for activations in (None, "offload"):
        model = Precision("bf16-mixed", activations=activations).setup(net().cuda())
        torch.manual_seed(1)
        model(x).float().pow(2).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_compiled_models_recompute_and_store_as_eager_ones_do():
    x = torch.randn(8, 16)
    eager = Precision("32-true", activations={"[12]": "checkpoint"}).setup(net().eval())
    eager(x).sum().backward()  # eval: no dropout, whose compiled masks differ
    compiled = Precision("32-true", activations={"[12]": "checkpoint"}).setup(net().eval())
    # one graph: the watch on modules called inside a recomputed forward stays out of it
    torch.compile(compiled, backend="aot_eager", fullgraph=True)(x).sum().backward()
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    grads = []
    for compiled in (False, True):  # a module storing in fp8 runs eagerly inside the graph
        model = Precision("32-true", activations={"1": "fp8"}).setup(net().eval())
        (torch.compile(model) if compiled else model)(x).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    kept = Precision("32-true").setup(net().eval())
    kept(x).sum().backward()
    assert not torch.allclose(kept[1].fc.weight.grad, model[1].fc.weight.grad, atol=1e-6)


class _Stack(nn.Module):
    """Blocks kept in an nn.ModuleList (no forward of its own), as transformers keep layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("option", ["checkpoint", "fp8"])
def test_a_rule_on_a_module_list_is_carried_out_by_each_of_its_layers(option):
    """A rule on an nn.ModuleList wrapped the list, whose forward nothing calls: a no-op,
    while `explain` showed every layer taking it. Each layer now takes it on its own."""
    x = torch.randn(64, 16)
    torch.manual_seed(0)
    plain = mixprec.apply(_Stack(), "32-true")
    torch.manual_seed(0)
    ruled = mixprec.apply(_Stack(), PolicyMap("32-true", activations={"layers": option}))
    assert wrapped(ruled) == {"layers.0": option, "layers.1": option}
    kept, held = saved_bytes(plain, x), saved_bytes(ruled, x)
    assert sum(held.values()) < 0.5 * sum(kept.values())
    torch.manual_seed(1)
    ruled(x).pow(2).mean().backward()
    torch.manual_seed(1)
    plain(x).pow(2).mean().backward()
    grads = [(a.grad, b.grad) for a, b in zip(plain.parameters(), ruled.parameters(), strict=True)]
    for a, b in grads:
        if option == "checkpoint":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=0.1, atol=1e-3)


class _Scaled(nn.Module):
    """A layer making a tensor without a dtype whose values round otherwise in bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (torch.arange(16.0) / 7.0).exp().to(x.dtype)


@pytest.mark.parametrize("option", ["checkpoint", "selective"])
def test_a_layer_recomputed_inside_a_true_rule_region_keeps_its_default_dtype(option):
    """A recomputed layer inside a bf16-true rule's region (not the map's default) ran
    again in the backward under the map's float32 default: a tensor made without a dtype
    came out float32 (checkpoint: silently other gradients; selective: torch's error). It
    recomputes under the default dtype its forward ran in."""

    def grads(activations):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(_Scaled(), _Scaled()))
        pmap = PolicyMap("32-true", rules={"1": "bf16-true"}, activations=activations)
        precision = Precision(pmap, allow_slow=True)
        model = precision.setup(model)
        precision.backward(model(torch.randn(4, 8)).float().pow(2).mean())
        return [p.grad for p in model.parameters()]

    for a, b in zip(grads(None), grads({r"1\.0": option}), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "layer", [nn.GRU(8, 8), nn.RNN(8, 8), nn.GRUCell(8, 8), nn.LSTMCell(8, 8), nn.LSTM(8, 8)]
)
def test_selective_refuses_recurrent_layers_and_checkpoint_takes_them(layer):
    """GRU's CPU kernels write into the matmul outputs selective keeps: its gradients came
    out silently wrong (RNN, LSTMCell: torch's error in the backward)."""
    refused = r"'selective' keeps the matmul outputs .* 'checkpoint'"
    with pytest.raises(PolicySpecError, match=refused):
        mixprec.apply(nn.Sequential(layer), PolicyMap("32-true", activations={"0": "selective"}))
    mixprec.apply(nn.Sequential(layer), PolicyMap("32-true", activations={"0": "checkpoint"}))


def test_recomputing_an_instance_norm_tracking_statistics_is_refused():
    norm = nn.InstanceNorm1d(4, track_running_stats=True)
    model = nn.Sequential(nn.Sequential(nn.Conv1d(2, 4, 3), norm))
    with pytest.raises(
        PolicySpecError, match=r"InstanceNorm1d \(at .1. inside it\) updates running statistics"
    ):
        mixprec.apply(model, PolicyMap("32-true", activations={"0": "checkpoint"}))
    mixprec.apply(
        nn.Sequential(nn.Sequential(nn.Conv1d(2, 4, 3), nn.InstanceNorm1d(4))),
        PolicyMap("32-true", activations={"0": "checkpoint"}),
    )


def test_a_region_entered_in_a_backward_on_another_thread_does_not_wait_for_the_lock():
    """CUDA's autograd runs a backward on a thread of its own while the thread that called
    it holds the default-dtype lock (`backward_context` under a "true" policy). A region
    entered there (a float32 island inside a recomputed block) waited for that lock: a
    deadlock. Inside a backward the lock is not taken; simulated here with the backward run
    on a second thread while this one holds the lock."""
    import threading

    from mixprec.dtypes import default_dtype

    seen = []

    class Recomputes(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            with default_dtype(torch.float64):
                seen.append(torch.ones(1).dtype)
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    y = Recomputes.apply(x).sum()
    with default_dtype(torch.bfloat16):
        worker = threading.Thread(target=y.backward)
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive(), "the backward waited for the lock"
    assert seen == [torch.float64] and torch.equal(x.grad, torch.full((3,), 2.0))
    assert torch.get_default_dtype() == torch.float32


class _KeywordScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, bias: float = 0.0) -> torch.Tensor:
        return self.l(x * scale) + bias


class _CallsScaled(nn.Module):
    def __init__(self, mutate: bool) -> None:
        super().__init__()
        self.pre, self.b, self.mutate = nn.Linear(16, 16), _KeywordScaled(), mutate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.full((16,), 2.0)
        y = self.b(self.pre(x), scale=scale, bias=1.0)
        if self.mutate:
            scale.add_(1)  # (a mask or scale the caller reuses)
        return y


@pytest.mark.parametrize("option", ["checkpoint", "selective"])
def test_a_tensor_given_by_keyword_and_written_in_place_after_is_refused_as_when_kept(option):
    """Before: keyword tensors were bound in a closure the checkpoint never saw, so one
    written in place after the call was recomputed from its new values: gradients off by
    half their size, no error (kept, or given positionally, torch raises)."""
    x = torch.randn(4, 16)
    grads = []
    for opt in ("keep", {"b": option}):
        torch.manual_seed(0)
        model = mixprec.Precision("32-true", activations=opt).setup(_CallsScaled(False))
        model(x).sum().backward()
        grads.append(model.pre.weight.grad)
    assert torch.equal(*grads)  # (keyword tensors and other keywords reach the layer)
    torch.manual_seed(0)
    model = mixprec.Precision("32-true", activations={"b": option}).setup(_CallsScaled(True))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()


class _Counts(nn.Module):
    """Counts its calls in a buffer, in place, whether training or not."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x) * self.calls


@pytest.mark.parametrize("option", ["checkpoint", "selective"])
def test_a_buffer_updated_in_a_recomputed_forward_is_refused_in_eval_mode_too(option):
    """Buffers were checked in training mode only: in eval() the recomputation updated the
    buffer again and read its new value (the count 2 where the forward saw 1, the layer's
    gradients doubled), silently."""
    model = mixprec.apply(
        nn.Sequential(_Counts(), nn.Linear(8, 1)), PolicyMap("32-true", activations={"0": option})
    ).eval()
    with pytest.raises(PolicySpecError, match="updated its buffer 'calls' in a forward that"):
        model(torch.randn(4, 8))


class _Pairs(nn.Module):
    """Takes tensors inside a tuple (Hugging Face's ``position_embeddings=(cos, sin)``) and a
    dict, by keyword or positionally, beside non-tensor leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, pair=None, extra=None, *, pos=None):
        a, b = pos if pos is not None else pair
        scale, shift = (
            (extra["scale"], extra["shift"]) if type(extra) is dict else (extra.scale, extra.shift)
        )
        return (self.fc(x) * a + b) * scale + shift


@dataclasses.dataclass
class _Extra:
    """What a layer's caller may pass in a dataclass (a config, a cache): torch's pytree
    does not open one."""

    scale: torch.Tensor
    shift: float


@dataclasses.dataclass
class _ExtraDict(collections.OrderedDict):
    """A dataclass that is an OrderedDict too (as Hugging Face's model outputs are): its
    ``copy.copy`` calls the class without the fields it requires."""

    scale: torch.Tensor
    shift: float


class _CallsPairs(nn.Module):
    def __init__(self, how: str, write: str | None = None) -> None:
        super().__init__()
        self.inp, self.layer, self.out = nn.Linear(4, 8), _Pairs(), nn.Linear(8, 1)
        self.how, self.write = how, write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.full((8,), 2.0), torch.zeros(8)
        pair, extra = [a, b], {"scale": torch.full((8,), 3.0), "shift": 1.0}
        if self.how == "dataclass":
            extra = _Extra(extra["scale"], extra["shift"])
        elif self.how == "dict dataclass":
            extra = _ExtraDict(extra["scale"], extra["shift"])
        if self.how == "keyword":
            y = self.layer(self.inp(x), extra=extra, pos=pair)
        else:
            y = self.layer(self.inp(x), pair, extra)
        scale = extra["scale"] if type(extra) is dict else extra.scale
        if self.write == "in place":  # (a cache the caller reuses)
            a.mul_(10)
            scale.add_(1)
        elif self.write == "replaced":  # (the caller's containers changed, not the tensors)
            pair[0] = a * 10
            if type(extra) is dict:
                extra["scale"], extra["shift"] = scale + 1, 5.0
            else:
                extra.scale, extra.shift = scale + 1, 5.0
        return self.out(y)


def _pairs_grads(how: str, activations, write: str | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = mixprec.Precision("32-true", activations=activations).setup(_CallsPairs(how, write))
    model(torch.randn(3, 4)).sum().backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("how", ["keyword", "positional", "dataclass", "dict dataclass"])
@pytest.mark.parametrize("option", ["checkpoint", "selective"])
def test_tensors_nested_in_arguments_and_written_in_place_after_are_refused_as_when_kept(
    how, option
):
    """Only bare tensors given by keyword reached the checkpoint: tensors inside a tuple,
    list or dict (and later a dataclass, which torch's pytree does not open) stayed in a
    closure, so one written in place after the call was recomputed from its new values (the
    layer's gradients ten times too large), silently. A container changed after the call
    (an element or a field replaced) is recomputed as the forward saw it."""
    kept = _pairs_grads(how, "keep")
    for write in (None, "replaced"):  # (the nested tensors and the rest reach the layer)
        for a, b in zip(kept, _pairs_grads(how, {"layer": option}, write), strict=True):
            assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _pairs_grads(how, {"layer": option}, "in place")


class _Residual(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.fc(x)))


@pytest.mark.parametrize("parent", ["bf16", "fp8"])
@pytest.mark.parametrize("option", ["checkpoint", "selective"])
def test_a_block_recomputed_inside_a_storing_parent_recomputes_from_its_exact_inputs(
    parent, option
):
    """torch's checkpoint saves the block's inputs through the saved-tensor hooks around
    it: inside a bf16 or fp8 parent it recomputed the block from rounded inputs, and the
    block's gradients came out far from keep's. Its inputs are kept exactly: the block's
    gradients are keep's, bit for bit."""
    x = torch.randn(16, 8)
    grads = {}
    for name, activations in (("keep", None), ("nested", {"": parent, "1": option})):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), _Residual(), nn.Linear(32, 1))
        model = mixprec.Precision("32-true", activations=activations).setup(model)
        model(x).sum().backward()
        grads[name] = [p.grad for p in model[1].parameters()]
    for a, b in zip(grads["keep"], grads["nested"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("parent", ["bf16", "fp8"])
@pytest.mark.parametrize("option", ["checkpoint", "selective"])
def test_self_attention_recomputed_inside_a_storing_parent_sees_one_input(parent, option):
    """Found by a review: nn.MultiheadAttention recomputed inside a bf16 or fp8 parent
    failed its backward (torch's "Recomputed values ... have different metadata"): the
    checkpoint saved the input passed as query, key and value three times through the
    parent's hooks and handed back three tensors, so the recomputation took ``query is
    key`` false and projected them apart, where the forward had packed one projection.
    Each tensor goes to the checkpoint once: the gradients are those of the attention
    kept inside the same parent, bit for bit."""
    x = torch.randn(3, 12, 32)
    grads = {}
    for name in ("keep", "nested"):
        activations = {"": parent, "self_attn": option if name == "nested" else "keep"}
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        model = mixprec.Precision("32-true", activations=activations).setup(layer)
        model(x).sum().backward()
        grads[name] = [p.grad for p in model.self_attn.parameters()]
    for a, b in zip(grads["keep"], grads["nested"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["checkpoint", "selective"])
def test_a_size_argument_reaches_the_recomputation_as_a_size(mode):
    """Arguments are flattened to pass their tensors to the checkpoint; a torch.Size came
    back from the tree as a plain tuple, and a layer calling ``shape.numel()`` failed in the
    backward."""

    class Reshaping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
            return self.fc(x.reshape(shape.numel() // 8, 8))

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.layer = nn.Linear(4, 8), Reshaping()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            return self.layer(h, h.shape).sum()

    torch.manual_seed(0)
    grads = []
    for activations in ("keep", {"layer": mode}):
        torch.manual_seed(0)
        model = mixprec.Precision("32-true", activations=activations).setup(Outer())
        model(torch.ones(3, 4)).backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize("option", ["checkpoint", "selective"])
def test_a_block_run_through_functional_call_recomputes_with_the_weights_it_was_given(option):
    """``torch.func.functional_call`` swaps tensors in for the parameters for one call; the
    recomputation in the backward ran outside that swap, on the module's own weights, and
    the gradients were another model's (0.28 off under checkpoint)."""

    def gradients(activations):
        precision = Precision("32-true", activations=activations)
        model = precision.setup(net())
        given = {n: (p.detach() * 1.5).requires_grad_() for n, p in model.named_parameters()}
        torch.manual_seed(1)  # dropout's masks
        x = torch.randn(8, 16)
        torch.func.functional_call(model, given, (x,)).pow(2).mean().backward()
        return [given[n].grad for n in given]

    for kept, again in zip(gradients(None), gradients({r"[12]": option}), strict=True):
        assert torch.equal(kept, again)


def test_a_checkpoint_recasts_a_regions_weights_rather_than_keeping_its_copies():
    """A region's compute-dtype copies are made again alike in the recomputation, so a
    checkpointed block keeps none of them to the backward (selective does: its record must
    see the same ops)."""
    from mixprec.activations import recompute

    model = net()
    precision = Precision("p=bf16,c=f32", activations={r"[12]": "checkpoint"})
    model = precision.setup(model)
    seen = []
    real = recompute._replaced_parameters

    def spy(module, selective):
        swapped, recast, weights = real(module, selective)
        seen.append((selective, len(swapped), len(recast), len(real(module, True)[0])))
        return swapped, recast, weights

    recompute._replaced_parameters = spy
    try:
        model(torch.randn(8, 16)).float().sum().backward()
    finally:
        recompute._replaced_parameters = real
    assert seen and all(
        not selective and kept == 0 and recast == everything > 0
        for selective, kept, recast, everything in seen
    )


class _HandsItsNormIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.norm = _TakesANorm(), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x, self.norm)


class _TakesANorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return torch.relu(norm(self.lin(x)))


@pytest.mark.parametrize("option", ["checkpoint", "selective"])
def test_a_batchnorm_called_inside_a_recomputed_module_but_held_elsewhere_is_refused(option):
    """Only the recomputed module's own buffers were watched: a BatchNorm its parent hands
    in took every batch twice (forward and recomputation), silently. Every module the
    forward calls is watched."""
    model = mixprec.apply(_HandsItsNormIn(), PolicyMap("32-true", activations={"block": option}))
    with pytest.raises(PolicySpecError, match="BatchNorm1d updated its buffer.*of _TakesANorm"):
        model(torch.randn(16, 8))
    model.eval()
    model(torch.randn(16, 8)).sum().backward()  # (no statistics updated in eval mode)


class _ReadsItsChildsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.proj.weight, self.proj.bias))


@pytest.mark.parametrize("policy", ["p=bf16,c=f32", "p=f16,c=bf16", "bf16-true"])
def test_checkpoint_recomputes_a_module_reading_its_childs_weight_bit_for_bit(policy):
    """A module computing with its child's weight itself got the enclosing region's compute
    copy in the forward and the stored weight in the recomputation (the backward failed on
    mixed dtypes). The copies are cast again, fresh, for the recomputation."""
    grads = {}
    for option in (None, "checkpoint"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), _ReadsItsChildsWeight(), nn.Linear(16, 2))
        precision = Precision(
            policy, allow_slow=True, activations={"1": option} if option else None
        )
        model = precision.setup(model)
        x = precision.convert_input(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))
        precision.backward(model(x).float().square().mean())
        grads[option] = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads[None], grads["checkpoint"], strict=True))


class _Sleeps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)  # (long enough for the other thread to run forwards meanwhile)
        return self.lin(x)


def test_a_batchnorm_training_in_another_thread_is_not_taken_for_one_called_inside():
    """The watch on modules a recomputed forward calls saw every thread's: a BatchNorm
    training in another thread was refused as if called inside."""
    model = mixprec.apply(
        nn.Sequential(_Sleeps(), nn.Linear(8, 1)),
        PolicyMap("32-true", activations={"0": "checkpoint"}),
    )
    other, stop = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), threading.Event()

    def train_other() -> None:
        while not stop.is_set():
            other(torch.randn(16, 8)).sum().backward()

    worker = threading.Thread(target=train_other)
    worker.start()
    try:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
    finally:
        stop.set()
        worker.join()


@pytest.mark.parametrize("block", [_ReadsItsChildsWeight, lambda: Block(16)])
def test_checkpoint_under_functional_call_recomputes_from_the_tensors_given(block):
    """Under a policy storing bfloat16 and computing in float32, a checkpointed module run
    through ``torch.func.functional_call`` was recomputed from the model's own weights (the
    call's swap is gone in the backward): gradients of the tensors given 32% off. The
    region's copies are cast again from what they were cast from."""
    grads = {}
    for option in (None, "checkpoint"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), block(), nn.Linear(16, 2))
        acts = {"1": option} if option else None
        precision = Precision("p=bf16,c=f32", allow_slow=True, activations=acts)
        model = precision.setup(model)
        given = {n: (p.detach() * 1.5).requires_grad_() for n, p in model.named_parameters()}
        x = precision.convert_input(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))
        out = torch.func.functional_call(model, given, (x,))
        precision.backward(out.float().square().mean())
        grads[option] = [t.grad for t in given.values()]
    assert all(torch.equal(a, b) for a, b in zip(grads[None], grads["checkpoint"], strict=True))


class _TorchCheckpointed(nn.Module):
    """Blocks each run through torch's own checkpoint in the forward (as Hugging Face's
    ``gradient_checkpointing_enable()`` runs its layers)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("option", ["bf16", "fp8"])
def test_a_storing_module_inside_torchs_checkpoint_leaves_its_saves_to_the_recomputation(
    option, reentrant
):
    """A module taking `bf16` or `fp8` inside a block torch's checkpoint recomputes: its
    hooks, innermost, stored and held its saves from the forward to the backward, so nothing
    of it was recomputed, and its gradients carried the rounding (2.6% off under fp8). It is
    left to torch's checkpoint, as the `checkpoint` option's own region leaves its modules:
    nothing stored is held after the forward, and the gradients are the checkpointed ones
    bit for bit."""
    from mixprec.activations import codecs

    x = torch.randn(8, 32)
    grads, held = {}, {}
    for activations in (None, {r"blocks\.\d+\.(fc|out)": option}):
        torch.manual_seed(0)
        model = mixprec.apply(
            _TorchCheckpointed(reentrant), PolicyMap("32-true", activations=activations)
        )
        out = model(x.requires_grad_(reentrant))
        stored = (codecs.Fp8Saved, codecs.Copied)
        held[activations is None] = [o for o in gc.get_objects() if type(o) in stored]
        out.square().sum().backward()
        grads[activations is None] = [p.grad for p in model.parameters()]
    assert held[False] == []
    assert all(torch.equal(g, k) for g, k in zip(grads[False], grads[True], strict=True))
