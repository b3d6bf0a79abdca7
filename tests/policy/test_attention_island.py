"""The attention island: under a policy computing in 16 bits (mixed or "true"), a module whose
forward calls `F.scaled_dot_product_attention` runs that call in float32 where the device's
16-bit attention is slower than float32 (CPUs without AMX), or where the user asks; nowhere
else.

Hardware is described (`hardware.assume`), never probed: the island's numerics are the same on
every CPU, and which modules get one depends on the `DeviceInfo` alone.
"""

from __future__ import annotations

import copy
import json
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from devices import AVX2_CPU, H100, ZEN4
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as attend

import mixprec
from mixprec import PolicyMap, PolicySpecError
from mixprec.hardware import DeviceInfo, assume, slow_attention
from mixprec.policy.map import calls_attention

AMX = DeviceInfo("cpu", "Xeon with AMX", cpu_flags=frozenset({"avx512bw", "amx_bf16", "amx_fp16"}))
BF16, F32 = torch.bfloat16, torch.float32


class Attention(nn.Module):
    """Calls torch's attention directly on its inputs (no weights: the island's math alone)."""

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


class Block(nn.Module):
    """A pre-norm attention block: the module that calls attention holds the projections."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(*(z.transpose(1, 2) for z in (q, k, v)), is_causal=True)
        return x + self.mlp(y.transpose(1, 2).reshape(b, t, d))


class AliasedBlock(Block):
    """Attention through another name, inside a nested function."""

    def forward(self, x):
        def heads(z):
            return z.view(*z.shape[:2], self.heads, -1).transpose(1, 2)

        q, k, v = self.qkv(x).chunk(3, -1)
        return x + attend(heads(q), heads(k), heads(v)).transpose(1, 2).flatten(2)


class AttentionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.Sequential(Block(), AliasedBlock())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


def qkv(dtype: torch.dtype = BF16, grad: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 2, 6, 4, generator=g).to(dtype).requires_grad_(grad) for _ in range(3)]


def islands(model: nn.Module) -> list[str]:
    return list(mixprec.explain(model).float32_attention)


# -- numerics -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16 inputs", "float32 inputs"])
def test_island_is_float32_attention_of_its_inputs_cast_back_to_bfloat16(dtype):
    """Exactly `sdpa(q.float(), k.float(), v.float()).to(bf16)`: the float32 kernel on the
    inputs as given (float32 ones are not rounded to bfloat16 first), the result in the dtype
    autocast would have given; the gradients are that expression's."""
    with assume(ZEN4):
        model = mixprec.apply(Attention(), "bf16-mixed")
    q, k, v = qkv(dtype, grad=True)
    out = model(q, k, v)  # the root's region: bf16 autocast, then the output cast to float32
    out.backward(torch.arange(out.numel(), dtype=F32).view_as(out) / 100)
    mine = [t.grad for t in (q, k, v)]

    q2, k2, v2 = qkv(dtype, grad=True)
    ref = F.scaled_dot_product_attention(q2.float(), k2.float(), v2.float(), is_causal=True)
    ref = ref.to(BF16).float()
    ref.backward(torch.arange(ref.numel(), dtype=F32).view_as(ref) / 100)
    assert torch.equal(out, ref)
    for got, want in zip(mine, (q2.grad, k2.grad, v2.grad), strict=True):
        assert got.dtype == dtype and torch.equal(got, want)

    with torch.autocast("cpu", dtype=BF16):  # what autocast alone computes differs
        plain = F.scaled_dot_product_attention(*qkv(dtype), is_causal=True)
    assert plain.dtype == BF16 and not torch.equal(plain.float(), out)


def test_a_float_mask_joins_the_float32_attention():
    with assume(ZEN4):
        model = mixprec.apply(Attention(), "bf16-mixed")
    q, k, v = qkv()
    mask = torch.randn(6, 6, generator=torch.Generator().manual_seed(1))
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    assert torch.equal(model(q, k, v, mask), want.to(BF16).float())


class AttentionWithoutAutocast(nn.Module):
    """Switches autocast off around its own attention call."""

    def forward(self, q, k, v):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_attention_called_with_autocast_off_runs_as_called():
    """The island reads autocast when attention is called: off there, nothing changes (a
    bfloat16 call stays a bfloat16 kernel call)."""
    with assume(ZEN4):
        model = mixprec.apply(AttentionWithoutAutocast(), "bf16-mixed")
        assert islands(model) == [""]
    q, k, v = qkv()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(model(q, k, v), want.float())


# -- where it applies ------------------------------------------------------------------------


def test_only_modules_whose_forward_calls_attention_get_an_island():
    model = AttentionNet()
    assert [n for n, m in model.named_modules() if calls_attention(m)] == ["blocks.0", "blocks.1"]
    with assume(ZEN4):
        mixprec.apply(model, "bf16-mixed")
        assert islands(model) == ["blocks.0", "blocks.1"]
        why = mixprec.explain(model).float32_attention["blocks.0"]
        assert why == "bfloat16 attention is slower than float32 here"
        assert "; attention in float32 (bfloat16" in str(mixprec.explain(model))  # the table
    # the root and the float32 LayerNorm island keep their regions, the blocks their
    # islands and the container its entry (`_Entry`); nothing else is wrapped
    wrapped = [n for n, m in model.named_modules() if "forward" in m.__dict__]
    assert wrapped == [
        *["", "blocks", "blocks.0", "blocks.0.norm", "blocks.0.mlp"],
        *["blocks.1", "blocks.1.norm", "blocks.1.mlp"],
    ]
    out = model(torch.randn(2, 5, 4))
    assert out.dtype == F32 and out.shape == (2, 5, 3)


def test_under_bf16_true_the_island_is_float32_attention_of_the_bfloat16_inputs():
    """A "true" policy casts the inputs to bfloat16 and switches autocast off: the island
    runs the attention in float32 on those inputs and hands bfloat16 back."""
    with assume(ZEN4):
        model = mixprec.apply(Attention(), "bf16-true")
        assert islands(model) == [""]
    q, k, v = qkv(F32)
    want = F.scaled_dot_product_attention(
        *(t.to(BF16).float() for t in (q, k, v)), is_causal=True
    ).to(BF16)
    out = model(q, k, v)
    assert out.dtype == BF16 and torch.equal(out, want)
    bf16 = F.scaled_dot_product_attention(*(t.to(BF16) for t in (q, k, v)), is_causal=True)
    assert not torch.equal(out, bf16)  # not the bfloat16 kernel's result


@pytest.mark.parametrize(
    "policy",
    ["32-true", PolicyMap("bf16-mixed", {"blocks": "32-true"})],
    ids=["float32", "float32 rule"],
)
def test_no_island_where_attention_computes_in_float32(policy):
    with assume(ZEN4):
        model = mixprec.apply(AttentionNet(), policy)
        assert islands(model) == []
    assert not any("forward" in m.__dict__ for m in model.blocks.children())


def test_the_char_lm_gets_one_island_per_block():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import charlm

    with assume(ZEN4):
        model = charlm.CharGPT(block=8, dim=16, layers=3)
        mixprec.Precision("bf16-mixed").setup(model)
        assert islands(model) == ["blocks.0", "blocks.1", "blocks.2"]
    assert model(torch.randint(0, 256, (2, 8))).dtype == F32


# -- the device decides, the user overrides ------------------------------------------------


def test_slow_attention_per_device():
    assert slow_attention(ZEN4) == {BF16, torch.float16}
    assert slow_attention(AVX2_CPU) == {BF16, torch.float16}
    assert slow_attention(AMX) == frozenset()
    assert slow_attention(H100) == frozenset()


@pytest.mark.parametrize("device", [AMX], ids=["AMX CPU"])
def test_off_where_bfloat16_attention_is_fast(device):
    with assume(device):
        model = mixprec.apply(Attention(), "bf16-mixed")
        assert islands(model) == []
    q, k, v = qkv()
    with torch.autocast("cpu", dtype=BF16):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True).float()
    assert torch.equal(model(q, k, v), want)


def test_the_user_turns_it_off_and_on():
    q, k, v = qkv()
    with assume(ZEN4):
        off = mixprec.apply(Attention(), PolicyMap("bf16-mixed", float32_attention=False))
        assert islands(off) == []
    with torch.autocast("cpu", dtype=BF16):
        bf16 = F.scaled_dot_product_attention(q, k, v, is_causal=True).float()
    assert torch.equal(off(q, k, v), bf16)

    with assume(AMX):
        on = mixprec.apply(Attention(), PolicyMap("bf16-mixed", float32_attention=True))
        assert mixprec.explain(on).float32_attention == {"": "float32_attention=True"}
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert torch.equal(on(q, k, v), want.to(BF16).float())

    with assume(ZEN4):  # re-applying replaces the island, and remove takes it away
        mixprec.apply(on, PolicyMap("bf16-mixed", float32_attention=False))
        assert islands(on) == [] and "forward" in on.__dict__
        mixprec.remove(on)
    assert "forward" not in on.__dict__


def test_the_setting_travels_with_the_map(tmp_path):
    pmap = PolicyMap("bf16-mixed", {"head": "32-true"}, float32_attention=False)
    assert pmap.to_config()["float32_attention"] is False
    assert "float32_attention" not in PolicyMap("bf16-mixed").to_config()  # left to the device
    assert PolicyMap.from_config(pmap.to_config()) == pmap
    assert PolicyMap.load(pmap.save(tmp_path / "p.json")).float32_attention is False
    assert "    float32_attention=False,\n)" in pmap.to_code()
    assert pmap != PolicyMap("bf16-mixed", {"head": "32-true"})


class Overflow(nn.Module):
    """A projection whose outputs overflow float16: the doctor recommends a rule for it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.proj = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.proj(torch.relu(self.inp(x)))


def test_the_doctors_recommendation_keeps_the_setting():
    torch.manual_seed(0)
    model, x, y = Overflow(), torch.randn(16, 8), torch.randint(0, 4, (16,))
    with torch.no_grad():  # outputs up to 1e5, past float16's 65504
        scale = 1e5 / model(x).abs().max()
        model.proj.weight.mul_(scale), model.proj.bias.mul_(scale)
    policy = PolicyMap("16-mixed", float32_attention=False)
    with assume(ZEN4):
        fix = mixprec.diagnose(model, (x, y), F.cross_entropy, precision=policy).recommend()
    assert set(fix.policy.rules) == {"proj"} and fix.policy.float32_attention is False


def test_bad_settings_are_refused():
    with pytest.raises(TypeError, match="float32_attention must be True, False or None .*'no'"):
        PolicyMap("bf16-mixed", float32_attention="no")  # type: ignore[arg-type]
    bad = json.loads('{"default": "bf16-mixed", "float32_attention": "false"}')
    with pytest.raises(PolicySpecError, match="'float32_attention' is the string 'false'; it is"):
        PolicyMap.from_config(bad)


# -- it travels with the model -------------------------------------------------------------


def test_copies_and_pickles_keep_the_island():
    with assume(ZEN4):
        model = mixprec.apply(AttentionNet(), "bf16-mixed")
    x = torch.randn(2, 5, 4)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(other(x), model(x))
        assert other.blocks[0].forward.module is other.blocks[0]


def test_compiles_to_one_graph_with_the_same_result():
    with assume(ZEN4):
        model = mixprec.apply(AttentionNet(), "bf16-mixed")
    x = torch.randn(2, 5, 4)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    ops = [op for graph in explained.ops_per_graph for op in graph]
    assert ops.count(F.scaled_dot_product_attention) == 2
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=1e-2)
    torch._dynamo.reset()
