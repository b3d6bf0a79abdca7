"""int8/int4 quantize Hugging Face's Conv1D (GPT-2's Linear with a transposed weight) as the
Linear it computes: the same outputs as quantizing that Linear, one copy of a tied weight."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.quantize import Int4Linear, Int8Linear

transformers = pytest.importorskip("transformers")
Conv1D = transformers.pytorch_utils.Conv1D


def pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    conv = Conv1D(24, 48)  # nf=24 outputs, nx=48 inputs: weight [48, 24]
    nn.init.normal_(conv.bias)
    linear = nn.Linear(48, 24)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    return nn.Sequential(conv), nn.Sequential(linear)


@pytest.mark.parametrize(("mode", "kind"), [("int8", Int8Linear), ("int4", Int4Linear)])
def test_a_conv1d_quantizes_to_what_its_linear_quantizes_to(mode: str, kind: type) -> None:
    conv, linear = pair()
    x = torch.randn(5, 48)
    with torch.no_grad():
        assert torch.equal(conv(x), conv(x))
    options = {"group_size": 32} if mode == "int4" else {}
    result = mixprec.quantize(conv, mode, **options)
    mixprec.quantize(linear, mode, **options)
    assert type(conv[0]) is kind and list(result.quantized) == ["0"]
    assert (conv[0].in_features, conv[0].out_features) == (48, 24)
    assert conv[0].bias is not None
    for name, buffer in linear[0].named_buffers():
        assert torch.equal(buffer, dict(conv[0].named_buffers())[name]), name
    with torch.no_grad():
        assert torch.equal(conv(x), linear(x))


def test_a_dequantized_conv1d_is_the_linear_it_computes() -> None:
    conv, _ = pair()
    original = copy.deepcopy(conv)
    mixprec.quantize(conv, "int8")
    mixprec.quantize.dequantize(conv)
    assert type(conv[0]) is nn.Linear and conv[0].weight.shape == (24, 48)
    x = torch.randn(3, 48)
    with torch.no_grad():
        torch.testing.assert_close(conv(x), original(x), atol=0.05, rtol=0.05)


def test_float8_and_block_scaled_formats_leave_a_conv1d_float() -> None:
    conv, _ = pair()
    result = mixprec.quantize(conv, "mxfp8")
    assert type(conv[0]) is Conv1D
    assert "unsupported type Conv1D: mxfp8 quantizes Linear" in result.skipped["0"]


def test_gpt2_conv1d_layers_quantize_and_the_tied_head_shares_one_copy() -> None:
    config = transformers.GPT2Config(
        n_embd=32,
        n_layer=1,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    before = float(model(input_ids=ids, labels=ids).loss)
    result = mixprec.quantize(model, "int8")
    assert "transformer.h.0.mlp.c_fc" in result.quantized
    assert model.lm_head.qweight is model.transformer.wte.qweight
    after = float(model(input_ids=ids, labels=ids).loss)
    assert after == pytest.approx(before, rel=0.02)


@pytest.mark.parametrize(("mode", "options"), [("int8", {}), ("int4", {"group_size": 32})])
def test_a_layer_whose_parent_reads_its_weight_stays_float_and_explain_says_why(mode, options):
    """T5's feed-forward reads ``self.wo.weight`` (to pick its input's dtype): quantize and
    explain put codes there and every forward raised AttributeError. The layer stays float
    now, for the same reason in both."""
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
        decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    wo = "encoder.block.0.layer.1.DenseReluDense.wo"
    spec = f"{mode}/32_from_float32" if options else f"{mode}_from_float32"
    said = mixprec.explain(model, spec).quantization[wo]
    assert said.startswith("skipped: ") and "its parent T5DenseActDense reads its weight" in said
    result = mixprec.quantize(model, mode, **options)
    assert "T5DenseActDense reads its weight" in result.skipped[wo]
    assert type(model.get_submodule(wo)) is nn.Linear
    assert type(model.get_submodule(wo.replace("wo", "wi"))) in (Int8Linear, Int4Linear)
    ids = torch.randint(0, 64, (2, 5))
    model(input_ids=ids, labels=ids).loss.backward()  # (raised AttributeError before)


class _ComputesWithChildWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.proj.weight, self.proj.bias)


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4", "float8"])
def test_a_format_keeping_the_weight_skips_a_layer_whose_parent_computes_with_it(mode):
    """mxfp8, nvfp4 and float8 keep the float weight beside their own matmul: a parent
    computing with ``self.proj.weight`` passed the swapped layer by, reported quantized while
    the model computed in float. Such a layer is skipped with the reason; T5's reads of
    ``self.wo.weight``'s dtype (and ``isinstance``) do not compute with it, and its ``wo`` is
    quantized."""
    model = nn.Sequential(_ComputesWithChildWeight())
    result = mixprec.quantize(model, mode)
    assert "computes with its weight" in result.skipped["0.proj"]
    assert type(model[0].proj) is nn.Linear
    if mode == "float8":  # (T5's layers are too small to gain from float8)
        return
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
        decoder_start_token_id=0,
    )  # fmt: skip
    t5 = transformers.T5ForConditionalGeneration(config)
    wo = "encoder.block.0.layer.1.DenseReluDense.wo"
    assert wo in mixprec.quantize(t5, mode).quantized


class _ComputesInAHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def _mix(me, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, me.proj.weight, me.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mix(x)


class _ComputesWithAGrandchildWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(64, 64))
        self.heads = nn.ModuleDict({"a": nn.Sequential(nn.ReLU(), nn.Linear(64, 64))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.block[0].weight), self.heads["a"][-1].weight)


class _WeightProperty(_ComputesWithChildWeight):
    @property
    def _weight(self) -> torch.Tensor:
        return self.proj.weight


class _ComputesInABaseClassProperty(_WeightProperty):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._weight)


class _ComputesThroughALocalName(nn.Module):
    """Reads its children's weights through local names (missed: the literal
    ``self.<child>.weight`` was the only form seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.blocks = nn.ModuleList([nn.Linear(64, 64)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.proj
        blocks = self.blocks  # (a container: its child's weight below it)
        return F.linear(F.linear(x, proj.weight), blocks[0].weight)


READERS = {
    _ComputesThroughALocalName: ["0.blocks.0", "0.proj"],
    _ComputesInAHelper: ["0.proj"],
    _ComputesWithAGrandchildWeight: ["0.block.0", "0.heads.a.1"],
    _ComputesInABaseClassProperty: ["0.proj"],
}


@pytest.mark.parametrize("reader", list(READERS), ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("mode", ["mxfp8", "int8"])
def test_a_weight_read_in_a_helper_or_below_a_child_is_a_parent_read_too(reader, mode):
    """Only ``self.<child>.weight`` in the parent's own forward counted: a read in a method
    forward calls (or a property), or of a grandchild's weight (``self.block[0].weight``),
    was missed. mxfp8 reported the layer quantized while the model computed in float
    (bit-identical output); int8 raised AttributeError at the forward. Such a layer is
    skipped now, with the reason, in explain, apply and quantize."""
    torch.manual_seed(0)
    model, x = nn.Sequential(reader()), torch.randn(4, 64)
    expected = model(x)
    what = "computes with its weight" if mode == "mxfp8" else "reads its weight"
    said = mixprec.explain(model, f"{mode}_from_float32")
    assert said.quantized == []
    for path in READERS[reader]:
        assert f"its parent {reader.__name__} {what}" in said.skipped[path]
    mixprec.apply(model, f"{mode}_from_float32", warn=False)
    assert all(type(model.get_submodule(path)) is nn.Linear for path in READERS[reader])
    assert torch.equal(model(x), expected)  # (int8 raised AttributeError here)
    result = mixprec.quantize(nn.Sequential(reader()), mode)
    assert sorted(result.skipped) == READERS[reader] and not result.quantized


class _TiesAndInitsOutsideForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 64)
        self.head = nn.Linear(64, 64, bias=False)
        self.head.weight = self.emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.head.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def test_a_weight_tied_or_initialised_outside_forward_is_no_parent_read():
    """Methods forward does not reach (``__init__`` tying a head to its embedding, an
    initialiser) do not make the layers read by their parent: both quantize."""
    result = mixprec.quantize(nn.Sequential(_TiesAndInitsOutsideForward()), "int8")
    assert sorted(result.quantized) == ["0.emb", "0.head"] and not result.skipped
