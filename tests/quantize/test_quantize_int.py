"""int8 and int4 quantized layers: error bounds, the exact integer matmul, state_dict
round trips, dequantize, LoRA, and `quantize`'s choices and errors."""

from __future__ import annotations

import copy
import io
import json
import os
import platform
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec.errors import PolicySpecError
from mixprec.quantize import (
    Int4Embedding,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    dequantize,
    enable_lora,
    merge_lora,
    quantize,
    weight_bytes,
)
from mixprec.quantize.int4 import (
    dequantize_groups,
    groups_of,
    kernel_for,
    pack,
    quantize_groups,
    unpack,
)
from mixprec.quantize.int8 import (
    ACC_MAX_K,
    F32_EXACT_K,
    INT_MM_MIN_K,
    ONEDNN_MAX_K,
    cpu_int8_kernels,
    float_sums,
    int8_linear,
    int_matmul,
    onednn_prepack,
    onednn_product,
    quantize_rows,
    quantize_tokens,
    storable_scale,
    wrong_sums,
)

FAST = settings(max_examples=15, deadline=None)
SRC = Path(__file__).resolve().parents[2] / "src"


def _weights(rows: int, cols: int, seed: int, spread: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-spread, spread, rows)[:, None]
    w[0] = 0.0  # an all-zero channel
    return w


@FAST
@given(st.integers(1, 9), st.integers(1, 40), st.integers(0, 99), st.floats(0, 3))
def test_int8_rows_are_within_half_a_step_of_the_weight(rows, cols, seed, spread):
    w = _weights(rows, cols, seed, spread)
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (rows,)
    assert q.abs().max() <= 127
    err = (w - q.float() * scale[:, None]).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-6)).all()
    amax = w.abs().amax(dim=1)
    nonzero = amax > 0
    # the largest weight of each channel lands on +-127, and the step is max|w| / 127
    assert (q.abs().amax(dim=1)[nonzero] == 127).all()
    torch.testing.assert_close(scale[nonzero], amax[nonzero] / 127, rtol=0, atol=0)
    assert scale[0] == 1 and (q[0] == 0).all()


@FAST
@given(st.integers(1, 20), st.integers(1, 70), st.integers(1, 20), st.integers(0, 99))
@example(m=1, k=1, n=2, seed=0)  # torch's CPU _int_mm gives garbage for K == 1
def test_int_matmul_is_the_exact_integer_product(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    out = int_matmul(a, b)
    assert out.dtype == torch.int32 and torch.equal(out, (a.long() @ b.long().t()).int())


def test_int8_a_reduction_longer_than_int32_holds_is_chunked_not_overflowed():
    """Linear(140000, 16) at full scale summed 127 * 127 * 140000 > 2**31 - 1 in int32 and
    returned -126288.5 for every output instead of 140000."""
    assert ACC_MAX_K * 127 * 127 <= 2**31 - 1 < (ACC_MAX_K + 1) * 127 * 127
    model = nn.Sequential(nn.Linear(140000, 16))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
    quantize(model, "int8")
    x = torch.ones(2, 140000)
    torch.testing.assert_close(model(x), torch.full((2, 16), 140000.0), rtol=1e-6, atol=0)
    q = torch.full((1, 140000), 127, dtype=torch.int8)
    assert int_matmul(q, q).item() == 127 * 127 * 140000


@FAST
@given(st.integers(1, 20), st.integers(2, 70), st.integers(1, 9), st.integers(1, 12))
def test_int_matmul_in_chunks_equals_it_in_one(m, k, n, max_k):
    g = torch.Generator().manual_seed(m * k + n)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    whole = int_matmul(a, b)
    chunked = int_matmul(a, b, max_k=max_k)
    assert chunked.dtype == (torch.int64 if k > max_k else torch.int32)
    assert torch.equal(chunked, whole.long())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m, k, n", [(32, 48, 16), (3, 20, 5)])  # torch._int_mm, float64
def test_int_matmul_in_chunks_on_cuda_equals_the_cpu_product(m, k, n):
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    out = int_matmul(a.cuda(), b.cuda(), max_k=16)  # chunks of 16 columns: strided views
    assert out.dtype == torch.int64 and torch.equal(out.cpu(), a.long() @ b.long().t())


def test_int8_linear_equals_a_float_reference_of_the_same_integer_math():
    torch.manual_seed(0)
    lin = nn.Linear(24, 10)
    layer = Int8Linear.from_float(lin)
    x = torch.randn(2, 3, 24) * torch.tensor([1.0, 1e-3, 50.0])[None, :, None]
    qx = torch.round(x.reshape(6, 24) / (x.reshape(6, 24).abs().amax(1, keepdim=True) / 127))
    qw, ws = quantize_rows(lin.weight)
    assert torch.equal(layer.qweight, qw) and torch.equal(layer.weight_scale, ws)
    acc = qx.double() @ qw.double().t()  # exact in float64
    xs = x.reshape(6, 24).abs().amax(1) / 127
    ref = (acc.float() * ws[None, :] * xs[:, None] + lin.bias.float()).reshape(2, 3, 10)
    assert torch.equal(quantize_tokens(x)[0].float(), qx)
    assert torch.equal(layer(x), ref)
    # and it stays close to the float layer it came from
    torch.testing.assert_close(layer(x), lin(x), rtol=0.05, atol=0.05 * lin(x).abs().max().item())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_int8_a_non_finite_token_gives_a_nan_output_row_the_others_unchanged(bad):
    """A NaN token used to come out finite: its scale became 1 and its codes 0."""
    torch.manual_seed(0)
    layer = Int8Linear.from_float(nn.Linear(32, 16))
    x = torch.randn(2, 3, 32)
    clean = layer(x)
    x[1, 0, 7] = bad
    out = layer(x)
    assert torch.isnan(out[1, 0]).all()
    others = torch.ones(2, 3, dtype=torch.bool)
    others[1, 0] = False
    assert torch.equal(out[others], clean[others])
    q, scale = quantize_tokens(x)
    assert torch.isnan(scale[3]) and (q[3] == 0).all()  # codes 0, never a NaN cast to int


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_refused_naming_the_layer_and_rows(mode, bad):
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    with torch.no_grad():
        model[2].weight[5, 3] = bad
        model[2].weight[30, 0] = bad
    told = r"cannot quantize 2\.weight: .* 2 value\(s\) inf/NaN, in rows 5, 30"
    with pytest.raises(ValueError, match=told):
        quantize(model, mode, **({"group_size": 8} if mode == "int4" else {}))
    with pytest.raises(ValueError, match="inf/NaN"):
        (quantize_rows if mode == "int8" else lambda w: quantize_groups(w, 8))(model[2].weight)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_float64_weight_past_float32s_range_is_refused(mode):
    """A float64 weight is quantized through float32, where a finite 1e39 is infinite:
    the check ran on the float64 weight and passed, and the row's scale became NaN (int8)
    or inf (int4), its outputs NaN. Refused as an infinity is."""
    model = nn.Sequential(nn.Linear(32, 32)).double()
    with torch.no_grad():
        model[0].weight[3, 1] = 1e39
    with pytest.raises(ValueError, match=r"0\.weight: .*1 value\(s\) inf/NaN or past float32's"):
        quantize(model, mode, **({"group_size": 8} if mode == "int4" else {}))


def test_merging_non_finite_adapters_is_refused_and_keeps_them():
    layer = Int8Linear.from_float(nn.Linear(32, 8))
    layer.enable_lora(2)
    with torch.no_grad():
        layer.lora_B.fill_(float("nan"))
    with pytest.raises(ValueError, match="inf/NaN"):
        layer.merge_lora()
    assert layer.lora_rank == 2 and torch.isnan(layer.lora_B).all()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_merging_gives_the_bias_back_the_requires_grad_it_had(mode):
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model[0].bias.requires_grad_(False)  # frozen by the user before the adapters
    quantize(model, mode, **({"group_size": 8} if mode == "int4" else {}))
    enable_lora(model, 2)
    assert not model[0].bias.requires_grad and not model[1].bias.requires_grad
    merge_lora(model)
    assert not model[0].bias.requires_grad and model[1].bias.requires_grad


def test_int8_weight_gets_no_gradient_bias_and_input_do():
    torch.manual_seed(0)
    layer = Int8Linear.from_float(nn.Linear(16, 4))
    x = torch.randn(5, 16, requires_grad=True)
    grad = torch.randn(5, 4)
    layer(x).backward(grad)
    assert [n for n, p in layer.named_parameters()] == ["bias"]
    assert torch.equal(layer.bias.grad, grad.sum(0))
    # straight through the activation rounding: d(x W^T)/dx with the dequantized weight
    torch.testing.assert_close(x.grad, grad @ layer.dequantized_weight())


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(40, 32),
        nn.Linear(32, 48),
        nn.GELU(),
        nn.LayerNorm(48),
        nn.Linear(48, 32),
        nn.Linear(32, 40, bias=False),
    )
    model[5].weight = model[0].weight  # tied output head
    return model


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_state_dict_reloads_bit_identical_without_quantizing_again(mode):
    model = _model()
    result = quantize(model, mode)
    assert sorted(result.quantized) == ["0", "1", "4", "5"]
    x = torch.randint(0, 40, (3, 7))
    y = model(x)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    # a freshly initialised model quantized the same way takes the checkpoint as it is
    torch.manual_seed(1)
    other = _model()
    for p in other.parameters():
        nn.init.normal_(p)
    quantize(other, mode)
    assert not torch.equal(other(x), y)
    other.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert torch.equal(other(x), y)
    ints = {k: v.dtype for k, v in model.state_dict().items() if k.endswith("qweight")}
    assert set(ints.values()) == {torch.int8 if mode == "int8" else torch.uint8}


@pytest.mark.parametrize("mode, ratio", [("int8", 3.0), ("int4", 5.0)])
def test_tied_weights_share_one_quantized_copy(mode, ratio):
    model = _model()
    before = weight_bytes(model)
    quantize(model, mode)
    assert model[0].qweight is model[5].qweight
    assert before / weight_bytes(model) > ratio


@FAST
@given(st.integers(1, 5), st.integers(1, 33), st.integers(0, 99))
def test_int4_packing_round_trips(rows, count, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, count), generator=g, dtype=torch.uint8)
    packed = pack(q)
    assert packed.shape == (rows, (count + 1) // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, count), q)
    assert torch.equal(packed[:, 0] & 0x0F, q[:, 0])  # low nibble first


@FAST
@given(
    st.integers(1, 6),
    st.integers(1, 50),
    st.sampled_from([-1, 2, 7, 16, 128]),
    st.integers(0, 99),
    st.floats(0, 3),
)
def test_int4_groups_are_within_half_a_step(rows, cols, group, seed, spread):
    w = _weights(rows, cols, seed, spread)
    if seed % 2:
        w = w.abs()  # a one-signed weight: the grid still holds zero exactly
    packed, scale, zero = quantize_groups(w, group)
    size = cols if group == -1 else min(group, cols)
    n = -(-cols // size)
    assert scale.shape == zero.shape == (rows, n) and zero.max() <= 15
    deq = dequantize_groups(packed, scale, zero, cols, group)
    assert deq.shape == w.shape
    step = scale.repeat_interleave(size, dim=1)[:, :cols]
    assert ((w - deq).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all()
    assert (deq[w == 0] == 0).all()


def test_int4_linear_is_the_float_matmul_of_its_dequantized_weight():
    torch.manual_seed(0)
    lin = nn.Linear(40, 6)
    layer = Int4Linear.from_float(lin, group_size=16)
    assert layer.weight_scale.shape == (6, 3) and layer.qweight.shape == (6, 24)
    x = torch.randn(4, 40)
    assert torch.equal(layer(x), F.linear(x, layer.dequantized_weight(), lin.bias))
    torch.testing.assert_close(layer(x), lin(x), rtol=0.1, atol=0.1)


@pytest.mark.parametrize("group", [16, 32])  # dequantized matmul; the int4 kernel
def test_int4_linear_computes_in_a_16_bit_inputs_dtype_outside_autocast(group):
    """FSDP2 casts inputs (not these buffers) to bfloat16: the float32 weight met a bfloat16
    input and F.linear refused the mix."""
    torch.manual_seed(0)
    layer = Int4Linear.from_float(nn.Linear(64, 8), group)
    x = torch.randn(3, 64).bfloat16()
    out = layer(x)
    w, b = layer.dequantized_weight().bfloat16(), layer.bias.bfloat16()
    assert out.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as before: autocast's dtype
        assert torch.equal(layer(x.float()), out)
    if group == 16:  # no kernel for groups of 16: the weight dequantized, then F.linear
        assert torch.equal(out, F.linear(x, w, b))
    else:  # the kernel: the same product within its bfloat16 rounding
        _assert_within_int4_kernel_rounding(layer, x, out)


@pytest.mark.parametrize("mode", ["int8", "int4/32", "int4/16"])
def test_a_float64_input_inside_autocast_gives_float64_as_nn_linear_does(mode):
    """Found by a review: inside bfloat16 autocast, a float64 input came out in bfloat16,
    where nn.Linear returns float64 (autocast leaves float64 alone)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 8).double()
    model = nn.Sequential(copy.deepcopy(lin))
    quantize(model, mode)
    x = torch.randn(3, 64, dtype=torch.float64)
    outside = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(x).dtype == torch.float64
        inside = model(x)
        assert model(x.float()).dtype == torch.bfloat16  # (float32: autocast's, as before)
    assert inside.dtype == torch.float64 and torch.equal(inside, outside)


def test_int4_embedding_dequantizes_only_the_rows_looked_up():
    torch.manual_seed(0)
    emb = nn.Embedding(30, 20)
    layer = Int4Embedding.from_float(emb, group_size=8)
    idx = torch.tensor([[3, 0, 29], [7, 7, 1]])
    assert torch.equal(layer(idx), F.embedding(idx, layer.dequantized_weight()))
    layer8 = Int8Embedding.from_float(emb)
    assert torch.equal(layer8(idx), F.embedding(idx, layer8.dequantized_weight()))


@pytest.mark.parametrize("kind", ["int8", "int4", "int8+lora", "int4+lora"])
@pytest.mark.parametrize("bad", [-1, -30, 30, 31])
def test_an_id_out_of_range_raises_index_error_as_nn_embedding_does(kind, bad):
    """int4 indexed its buffers directly: -1 silently returned the last row."""
    emb = nn.Embedding(30, 20)
    layer = (
        Int8Embedding.from_float(emb)
        if kind.startswith("int8")
        else Int4Embedding.from_float(emb, group_size=8)
    )
    if kind.endswith("lora"):
        layer.enable_lora(2)
    idx = torch.tensor([[3, bad]])
    with pytest.raises(IndexError, match="index out of range"):
        emb(idx)
    with pytest.raises(IndexError, match="index out of range"):
        layer(idx)
    with pytest.raises(RuntimeError, match="indices.* Long, Int"):
        layer(torch.tensor([True, False]))  # a mask is not a list of ids


@pytest.mark.parametrize("mode", ["float8", "mxfp8"])
def test_dequantize_gives_every_formats_layers_back_as_the_linear_they_hold(mode):
    """`dequantize` asks each layer's format (`Format.to_float`): a float8 layer, which it
    left quantized before, becomes the Linear holding its own parameters, as a block-scaled
    one does."""
    from mixprec.quantize.float8 import convert_to_float8

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64))
    params = list(model.parameters())
    if mode == "float8":  # delayed, with its amax-history buffers; too small for its rule
        convert_to_float8(model, recipe="delayed", amax_history_length=4, skip_small=False)
    else:
        quantize(model, mode)
    assert all(isinstance(getattr(m, "quantization_mode", None), str) for m in model[::2])
    dequantize(model)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert not list(model.buffers())  # float8's amax histories went with its layer


def test_quantize_takes_the_keywords_the_formats_declare():
    model = nn.Sequential(nn.Linear(64, 32))
    with pytest.raises(
        TypeError,
        match=r"unknown option\(s\) groupsize; the formats take "
        r"amax_history_length \(float8\), group_size \(int4\), recipe",
    ):
        quantize(model, "int4", groupsize=32)
    assert quantize(model, "int4", group_size=32).quantized == {"0": "int4 (groups of 32)"}


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_dequantize_gives_float_layers_back_tied_again(mode):
    model = _model()
    quantize(model, mode)
    weight = model[1].dequantized_weight()
    x = torch.randint(0, 40, (2, 5))
    y = model(x)
    dequantize(model)
    assert [type(m) for m in model] == [
        nn.Embedding,
        nn.Linear,
        nn.GELU,
        nn.LayerNorm,
        nn.Linear,
        nn.Linear,
    ]
    assert torch.equal(model[1].weight, weight) and model[5].weight is model[0].weight
    if mode == "int4":  # weight-only: the float layers compute the same, up to the int4
        # kernel's bfloat16 activations (exactly the same where layers dequantize): under
        # 1% of the output range through three Linear layers
        torch.testing.assert_close(model(x), y, rtol=0, atol=0.01 * y.abs().max().item())


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_lora_trains_only_the_adapters_and_merges_into_the_same_outputs(mode):
    model = _model()
    quantize(model, mode)
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 40, (4, 6))
    y0 = model(x)
    params = enable_lora(model, rank=4, alpha=8)
    assert len(params) == 4 * 2  # the embedding and three Linear layers
    assert torch.equal(model(x), y0)  # B (A for the embedding) starts at zero
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{i}.lora_{ab}" for i in (0, 1, 4, 5) for ab in "AB"
    } | {"3.weight", "3.bias"}
    opt = torch.optim.SGD(params, lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())
    y1 = model(x)
    assert not torch.allclose(y1, y0)
    layers = [model[i] for i in (0, 1, 4, 5)]
    with torch.no_grad():
        merged = [
            m.dequantized_weight() + m.lora_B @ m.lora_A * (m.lora_alpha / m.lora_rank)
            for m in layers[1:]
        ]
        merged.insert(0, layers[0].dequantized_weight() + layers[0].lora_delta())
    with pytest.warns(UserWarning, match="shared by 0, 5"):  # the tied embedding and head
        assert merge_lora(model) == 4
    assert not any("lora" in n for n, _ in model.named_parameters())
    for m, w in zip(layers, merged, strict=True):  # merged = the adapted weight, quantized
        if mode == "int8":
            q, scale = quantize_rows(w)
            expected = q.float() * scale[:, None]
        else:
            expected = dequantize_groups(*quantize_groups(w, 128), w.shape[1], 128)
        assert torch.equal(m.dequantized_weight(), expected)
    # outputs move by the re-quantization only: a few % of the output range (int4's 16
    # levels per channel of these N(0, 1) weights move it most)
    tolerance = {"int8": 0.03, "int4": 0.15}[mode] * y1.abs().max().item()
    torch.testing.assert_close(model(x), y1, rtol=0, atol=tolerance)
    assert model[1].bias.requires_grad


def test_lora_state_dict_round_trips():
    model = _model()
    quantize(model, "int8")
    enable_lora(model[1], rank=2)
    with torch.no_grad():
        model[1].lora_B.normal_()
    x = torch.randint(0, 40, (2, 3))
    other = _model()
    quantize(other, "int8")
    enable_lora(other[1], rank=2)
    other.load_state_dict(model.state_dict())
    assert torch.equal(other(x), model(x))


def test_quantize_reports_skips_and_honours_filters():
    model = nn.ModuleDict(
        {
            "a": nn.Linear(32, 32),
            "b": nn.Linear(32, 32),
            "small": nn.Linear(4, 32),
            "n": nn.LayerNorm(32),
        }
    )
    result = quantize(copy.deepcopy(model), "int8", filter=re.compile(r"a|small"))
    assert list(result.quantized) == ["a"]
    assert result.skipped == {
        "b": "excluded by filter",
        "small": "too small: 4 input features (fewer than 16 save little and lose the most "
        "accuracy)",
        "n": "unsupported type LayerNorm: int8 quantizes Linear, Embedding and "
        "Hugging Face's Conv1D",
    }
    result = quantize(model, "int4", filter=lambda path, m: path != "a", group_size=16)
    assert list(result.quantized) == ["b"] and result.quantized["b"] == "int4 (groups of 16)"
    assert type(model["a"]) is nn.Linear and model["b"].group_size == 16
    assert "quantized 1 layer(s)" in str(result) and "excluded by filter" in str(result)
    # a policy name carries its options; quantizing again leaves quantized layers alone
    again = mixprec.quantize(model, "int4/16_from_float32")
    assert list(again.quantized) == ["a"] and model["b"].group_size == 16


def test_embeddings_with_max_norm_or_sparse_gradients_stay_float():
    """So does one scaling its gradient by the ids' frequency: quantized and dequantized, it
    came back without the option (a row read three times got three times the gradient)."""
    model = nn.ModuleDict(
        {
            "a": nn.Embedding(9, 32, max_norm=1.0),
            "b": nn.Embedding(9, 32, sparse=True),
            "c": nn.Embedding(9, 32, scale_grad_by_freq=True),
        }
    )
    result = quantize(model, "int8")
    assert result.quantized == {} and all(
        "unsupported option" in r for r in result.skipped.values()
    )
    assert set(result.skipped) == {"a", "b", "c"}


@pytest.mark.parametrize("spec", ["int8", "int4/32"])
def test_a_frozen_weight_comes_back_frozen_from_dequantize(spec):
    """`dequantize` gives each float layer back with its weight as trainable as it was: a
    weight frozen before quantizing came back trainable (an optimizer built after the round
    trip trained it)."""
    from mixprec.quantize import dequantize

    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    model[0].weight.requires_grad_(False)
    model[1].weight.requires_grad_(False)
    quantize(model, spec)
    dequantize(model)
    assert [p.requires_grad for p in (model[0].weight, model[1].weight, model[2].weight)] == [
        False,
        False,
        True,
    ]
    assert model[1].bias.requires_grad


def test_a_layer_at_two_paths_is_swapped_at_both():
    shared = nn.Linear(32, 32)
    model = nn.ModuleDict({"x": shared, "y": nn.Sequential(shared)})
    quantize(model, "int8")
    assert type(model["x"]) is Int8Linear and model["y"][0] is model["x"]
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    mixprec.apply(model, "int4/16_from_float32")
    assert type(model[0]) is Int4Linear and model[2] is model[0]


def test_a_tied_weight_quantized_two_ways_gets_two_copies():
    model = _model()
    pmap = mixprec.PolicyMap("32-true", {"0": "int8_from_float32", "5": "int4/16_from_float32"})
    mixprec.apply(model, pmap)
    assert type(model[0]) is Int8Embedding and type(model[5]) is Int4Linear
    assert model[5].group_size == 16 and model[5].qweight.dtype == torch.uint8


def test_bfloat16_storage_keeps_int_weights_and_stores_scales_in_bfloat16():
    model = nn.Sequential(nn.Linear(32, 32))
    mixprec.apply(model, "int8_from_bfloat16", warn=False)
    layer = model[0]
    assert layer.qweight.dtype == torch.int8 and layer.weight_scale.dtype == torch.bfloat16
    assert model(torch.randn(2, 32)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: quantize(nn.Sequential(), "int2"),
            PolicySpecError,
            "modes are int8, int4, float8",
        ),
        (lambda: quantize(nn.Sequential(), "int8", group_size=64), PolicySpecError, "int4 option"),
        (lambda: quantize(nn.Sequential(), "int4", group_size=0), PolicySpecError, "group size 0"),
        (
            lambda: quantize(nn.Sequential(), "int4/64_from_float32", group_size=32),
            PolicySpecError,
            "names its options already",
        ),
        (
            lambda: quantize(nn.Sequential(), "int8", filter=3),
            TypeError,
            "filter must be None, a callable",
        ),
        (
            lambda: quantize(nn.Sequential(), "int8", filter="("),
            PolicySpecError,
            "not a valid regex",
        ),
        (lambda: quantize(nn.Linear(32, 32), "int8"), ValueError, r"nn.Sequential\(model\)"),
        (
            lambda: quantize(nn.Linear(4112, 16, device="meta"), "float8"),
            ValueError,
            r"the model itself is a Linear: wrap it, e.g. nn.Sequential\(model\)",
        ),
        (lambda: quantize("model", "int8"), TypeError, "needs an nn.Module"),
        (lambda: enable_lora(nn.Linear(32, 4), 2), ValueError, "quantize first"),
        (
            lambda: enable_lora(Int8Linear.from_float(nn.Linear(32, 4)), 0),
            ValueError,
            "positive int",
        ),
        (lambda: Int4Linear(32, 4).merge_lora(), ValueError, "not enabled"),
    ],
)
def test_bad_input_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_enabling_lora_twice_is_refused():
    layer = Int4Linear.from_float(nn.Linear(32, 4), group_size=16)
    enable_lora(layer, 2)
    with pytest.raises(ValueError, match="already enabled"):
        enable_lora(layer, 2)


def test_the_top_level_name_is_the_callable_package():
    model = nn.Sequential(nn.Linear(32, 32))
    assert list(mixprec.quantize(model, "int8").quantized) == ["0"]
    assert mixprec.quantize.dequantize is dequantize and mixprec.quantize.enable_lora is enable_lora
    assert type(mixprec.quantize.dequantize(model)[0]) is nn.Linear


def test_an_optimizer_built_before_precision_setup_keeps_training_the_biases():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = mixprec.Precision("int8_from_float32")
    model, opt = precision.setup(model, opt)
    assert type(model[0]) is Int8Linear and type(model[2]) is Int8Linear
    bias = model[2].bias.detach().clone()
    with precision.forward_context():
        loss = F.cross_entropy(model(torch.randn(8, 32)), torch.randint(0, 4, (8,)))
    loss.backward()
    opt.step()
    assert not torch.equal(model[2].bias, bias)


@pytest.mark.parametrize("mode", ["int8", "int4/8_from_float32"])
def test_merging_adapters_of_a_tied_weight_unties_it_as_trained_and_says_so(mode):
    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.head = nn.Linear(16, 32, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(idx))

    torch.manual_seed(0)
    model = TiedLM()
    quantize(model, mode)
    assert model.emb.qweight is model.head.qweight  # one quantized copy
    one_copy = weight_bytes(model)
    opt = torch.optim.SGD(enable_lora(model, rank=4), lr=0.5)
    for _ in range(5):
        loss = model(torch.randint(0, 32, (8,))).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    idx = torch.arange(32)
    with torch.no_grad():
        trained = model(idx)
    untied = r"untied the quantized weight shared by emb, head.*\+\d+ bytes"
    with pytest.warns(UserWarning, match=untied):
        assert merge_lora(model) == 2
    assert model.emb.qweight is not model.head.qweight
    assert weight_bytes(model) == 2 * one_copy  # each holds its own copy now
    with torch.no_grad():  # both adapters' changes kept, up to one more rounding
        atol = 0.05 * trained.abs().max().item()
        torch.testing.assert_close(model(idx), trained, rtol=0, atol=atol)


@pytest.mark.parametrize("mode", ["int8", "int4/8_from_float32"])
def test_quantizing_one_side_of_a_tied_weight_says_it_unties_them(mode):
    """quantize(model, "int8", filter="head") on a tied embedding and head untied them
    without a word: the head kept codes of the weight while the embedding trained on (0.196
    apart in 3 steps). It warns now, from the caller's line; both sides quantized, or a
    float8-style layer keeping the weight, give no warning."""

    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.head = nn.Linear(16, 32, bias=False)
            self.head.weight = self.emb.weight

    with pytest.warns(UserWarning, match=r"head.weight is tied to emb.weight, which stays fl") as w:
        quantize(TiedLM(), mode, filter="head")
    assert w[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize(TiedLM(), mode)
        quantize(TiedLM(), mode, filter="emb|head")


def test_merging_untied_layers_gives_no_warning():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    quantize(model, "int8")
    enable_lora(model, rank=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert merge_lora(model) == 2


# --- what a new user tries (issue 22's adversarial sweep) ---------------------------------


def _tiny_rows(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """64 x 32 weights whose rows span 1e-7 to 1 (and one all-zero row)."""
    torch.manual_seed(0)
    w = (torch.randn(64, 32) * torch.logspace(-7, 0, 64)[:, None]).to(dtype)
    w[1] = 0.0
    return w


def _assert_within_half_a_stored_step(layer: nn.Module, w: torch.Tensor) -> None:
    """Every weight within half a step of the scale the layer stores, codes times scales in
    float32 (no row of real weights comes back zero)."""
    scale = layer.weight_scale.float()
    if layer.quantization_mode == "int8":
        deq, step = layer.qweight.float() * scale[:, None], scale[:, None]
    else:
        q = unpack(layer.qweight, 32).float() - layer.weight_zero.float()
        deq, step = q * scale, scale
    assert (scale > 0).all()
    assert ((deq - w.float()).abs() <= step / 2 * (1 + 1e-5)).all()
    nonzero = w.float().abs().amax(1) > 0
    assert (deq.abs().amax(1)[nonzero] > 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_16_bit_weights_stay_within_half_a_stored_step(dtype, mode):
    """Codes came from float32 scales, then the scales were rounded to the weight's dtype: a
    float16 row of tiny weights got scale 0 (it came back all zeros), and bfloat16 rows
    missed the half-step bound by up to 127 scale roundings."""
    w = _tiny_rows(dtype)
    model = nn.Sequential(nn.Linear(32, 64).to(dtype))
    with torch.no_grad():
        model[0].weight.copy_(w)
    quantize(model, mode, **({"group_size": 32} if mode == "int4" else {}))
    assert model[0].weight_scale.dtype == dtype
    _assert_within_half_a_stored_step(model[0], w)


@pytest.mark.parametrize(
    "spec", ["int8_from_bf16-true", "int4/32_from_16-true", "int4/32_from_bf16-true"]
)
def test_scales_a_policy_stores_in_16_bits_keep_weights_within_half_a_step(spec):
    """apply quantizes the float32 weights, then casts the scales to the policy's 16-bit
    param dtype: the same rounding, so the scales are rounded up to that dtype first."""
    w = _tiny_rows()
    model = nn.Sequential(nn.Linear(32, 64))
    with torch.no_grad():
        model[0].weight.copy_(w)
    mixprec.apply(model, spec, warn=False)
    assert model[0].weight_scale.dtype == mixprec.Policy(spec).param_dtype
    _assert_within_half_a_stored_step(model[0], w)


@pytest.mark.parametrize("mode", ["int8", "int4/-1"])
def test_a_float16_row_near_its_largest_value_is_refused_not_stored_to_come_back_inf(mode):
    """A float16 row holding 65504: its scale, rounded up to a float16, times the largest
    code is past float16's range, so the row dequantized to inf (and so did the layer's
    output). Refused, as a scale beyond the range is."""
    model = nn.Sequential(nn.Embedding(64, 64)).half()
    with torch.no_grad():
        model[0].weight[3, 5] = 65504.0
    with pytest.raises(ValueError, match="times its largest code .* exceeds torch.float16"):
        mixprec.quantize(model, mode)
    assert type(model[0]) is nn.Embedding  # nothing swapped


def test_a_scale_beyond_the_storage_dtype_is_refused():
    """Rounded up past float16's max, a scale would be inf and its row's codes 0."""
    layer = Int8Linear.from_float(nn.Linear(32, 4).half())
    before = layer.qweight.clone()
    too_far = "largest scale 7.87e\\+04 times its largest code \\(127\\) exceeds torch.float16"
    with pytest.raises(ValueError, match=too_far):
        layer.requantize(torch.full((4, 32), 1e7))
    assert torch.equal(layer.qweight, before)
    assert storable_scale(torch.tensor([1e-9, 1.0004]), torch.float16, "w", 127).tolist() == [
        2**-24,  # float16's smallest subnormal, not 0
        1.0009765625,  # rounded up, not down to 1.0
    ]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_model_on_the_meta_device_quantizes_then_loads_a_quantized_checkpoint(mode):
    """check_finite read the values of the meta weights (RuntimeError: Tensor.item() cannot
    be called on meta tensors): the big-model pattern, layout first, weights loaded."""

    def net(device=None):
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(40, 32, device=device), nn.Linear(32, 16, device=device))

    options = {"group_size": 16} if mode == "int4" else {}
    real = net()
    quantize(real, mode, **options)
    meta = net("meta")
    assert list(quantize(meta, mode, **options).quantized) == ["0", "1"]
    assert meta[1].qweight.is_meta
    meta.load_state_dict(real.state_dict(), assign=True)
    x = torch.randint(0, 40, (2, 5))
    assert torch.equal(meta(x), real(x))


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize(
    "x",
    [
        torch.ones(2, 32, dtype=torch.long),  # came out as int64 outputs
        torch.ones(2, 32, dtype=torch.bool),  # came out as bool (int8)
        torch.ones(2, 32, dtype=torch.complex64),  # imaginary part dropped with a warning
        torch.randn(2, 31),  # failed inside torch._int_mm / F.linear
        torch.tensor(1.0),  # IndexError: tuple index out of range (int8)
    ],
)
def test_a_quantized_linear_refuses_inputs_a_linear_cannot_take(mode, x):
    layer = (
        Int8Linear.from_float(nn.Linear(32, 8))
        if mode == "int8"
        else Int4Linear.from_float(nn.Linear(32, 8), 16)
    )
    name = "Int8Linear" if mode == "int8" else "Int4Linear"
    expected = f"{name}(32, 8) needs a floating input whose last dim is 32, got {x.dtype} "
    with pytest.raises(ValueError, match=re.escape(expected + f"of shape {tuple(x.shape)}")):
        layer(x)


@pytest.mark.parametrize("mode", ["int8", "int4", "int4-kernel"])
def test_empty_batches_1d_and_nd_inputs_work_as_in_a_linear(mode):
    lin = nn.Linear(32, 8)
    if mode == "int8":
        layer = Int8Linear.from_float(lin)
    else:  # groups of 16 dequantize; groups of 32 go through the int4 kernel where it exists
        layer = Int4Linear.from_float(lin, 32 if mode == "int4-kernel" else 16)
    for shape in [(0, 32), (2, 0, 32), (32,), (2, 3, 4, 32)]:
        x = torch.randn(shape)
        assert layer(x).shape == lin(x).shape
    x = torch.randn(32, 6).t()  # non-contiguous
    torch.testing.assert_close(layer(x), layer(x.contiguous()), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_lora_adapters_take_an_input_of_another_dtype_outside_autocast(mode, dtype):
    """The float32 adapters met a bfloat16 (FSDP2's cast) or float64 input and F.linear
    refused the mix, though the quantized layer under them takes it."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 8)
    layer = Int8Linear.from_float(lin) if mode == "int8" else Int4Linear.from_float(lin, 16)
    x = torch.randn(3, 32, dtype=dtype)
    plain = layer(x)
    layer.enable_lora(2)
    with torch.no_grad():
        layer.lora_B.fill_(0.5)
    out = layer(x)
    delta = F.linear(F.linear(x.float(), layer.lora_A), layer.lora_B)
    assert out.dtype == dtype
    assert torch.equal(out, plain + delta.to(dtype))
    out.float().sum().backward()
    assert layer.lora_A.grad is not None and layer.lora_A.grad.dtype == torch.float32


def test_quantizing_again_with_other_options_is_refused_not_ignored():
    """A layer already quantized in the mode was kept as it was: int4 groups of 8 stayed
    groups of 8 when groups of 16 were asked for, a rowwise float8 layer stayed rowwise."""
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 32))
    quantize(model, "int4", group_size=8)
    assert quantize(model, "int4", group_size=8).quantized == {}  # the same: nothing to do
    again = r"0 is already quantized to int4 \(groups of 8\), not int4 \(groups of 16\)"
    with pytest.raises(ValueError, match=again + r".*mixprec.quantize.dequantize\(model\)"):
        quantize(model, "int4", group_size=16)
    with pytest.raises(ValueError, match=again):
        mixprec.apply(model, "int4/16_from_float32", warn=False)
    assert model[1].group_size == 8
    big = nn.Sequential(nn.Linear(4112, 16))
    quantize(big, "float8", recipe="delayed", amax_history_length=16)
    assert quantize(big, "float8/delayed:16_from_float32").quantized == {}
    with pytest.raises(
        ValueError,
        match=r"already quantized to float8 \(delayed, amax history of 16\), not float8 "
        r"\(tensorwise\) as asked.*convert_from_float8",
    ):
        quantize(big, "float8")
    with pytest.raises(ValueError, match="amax history of 16.*amax history of 1024"):
        quantize(big, "float8", recipe="delayed")


# --- the int4 and int8 kernels (issue 24) ---------------------------------------------------


def _int4_kernel_here(layer: Int4Linear) -> None:
    """Skip unless torch's packed int4 kernel runs on this host (a plain-capability build)."""
    name, why_not = kernel_for(layer.qweight.device, layer.kernel_group)
    if why_not is not None:
        pytest.skip(f"no packed int4 kernel here: {why_not}")


def _assert_within_int4_kernel_rounding(
    layer: Int4Linear, x: torch.Tensor, out: torch.Tensor
) -> None:
    """`out` is the layer's float64 product with its stored (dequantized) weight within what
    the kernel's bfloat16 rounding can move it: activations to bfloat16 (2**-9 of |x|), the
    kernel's weight ``(q - 8) * scale + (8 - zero) * scale`` with both in bfloat16 (within
    1/32 of a step: half a bfloat16 unit of 8 steps, twice), the output to bfloat16."""
    n, size = groups_of(layer.in_features, layer.group_size)
    step = layer.weight_scale.double().repeat_interleave(size, dim=1)[:, : layer.in_features]
    w = layer.dequantized_weight().double()
    xd = x.reshape(-1, layer.in_features).double()
    bias = torch.zeros(layer.out_features, dtype=torch.float64)
    if layer.bias is not None:
        bias = layer.bias.detach().double()
    ref = xd @ w.t() + bias
    bound = xd.abs() @ (step / 32 + w.abs() * 2**-8).t() + 2**-7 * (ref.abs() + bias.abs())
    err = (out.reshape(ref.shape).double() - ref).abs()
    assert (err <= bound + 1e-6).all(), (err - bound).max()


@pytest.mark.parametrize(
    "rows, features, group",
    [
        (200, 512, 64),  # rows padded to the kernel's 16
        (48, 100, 32),  # a short last group: input padded with zeros to 128
        (32, 64, -1),  # one group per row, of 64
        (16, 256, 256),
    ],
)
def test_int4_kernel_multiplies_the_stored_weight_by_torchs_zero_point_convention(
    rows, features, group
):
    """The kernel's weight is ``(q - 8) * s + o`` per group; o = (8 - zero) * scale gives
    mixprec's ``(q - zero) * scale``. Weights of one sign put zero at 0 and 15."""
    torch.manual_seed(0)
    lin = nn.Linear(features, rows)
    with torch.no_grad():
        lin.weight[: rows // 4].abs_()  # zero point 0
        lin.weight[rows // 4 : rows // 2].abs_().neg_()  # zero point 15
    layer = Int4Linear.from_float(lin, group)
    _int4_kernel_here(layer)
    assert layer.kernel.startswith("aten._weight_int4pack_mm_for_cpu for float32/bfloat16")
    zeros = layer.weight_zero[: rows // 2]
    assert {0, 15} <= set(zeros.flatten().tolist())
    x = torch.randn(7, 3, features)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (7, 3, rows)
    _assert_within_int4_kernel_rounding(layer, x, out)
    # exactly the kernel's formula, up to its float32 sums and bfloat16 output
    size = groups_of(features, group)[1]
    s32 = layer.weight_scale.float()
    offsets = ((8 - layer.weight_zero.float()) * s32).bfloat16().double()
    q = unpack(layer.qweight, layer.qweight.shape[1] * 2).double().view(rows, -1, size)
    wk = ((q - 8) * s32.bfloat16().double()[..., None] + offsets[..., None]).flatten(1)
    xb = F.pad(x.reshape(-1, features).bfloat16().double(), (0, wk.shape[1] - features))
    ref = xb @ wk.t() + lin.bias.double()
    no_bias = out.reshape(-1, rows).double() - lin.bias.double() - (ref - lin.bias.double())
    mags = xb.abs() @ wk.abs().t()
    assert (no_bias.abs() <= 2**-8 * (ref - lin.bias.double()).abs() + 2e-5 * mags).all()


def test_int4_kernel_takes_bfloat16_autocast_and_one_token_inputs():
    torch.manual_seed(0)
    layer = Int4Linear.from_float(nn.Linear(256, 64), 128)
    _int4_kernel_here(layer)
    for x in (torch.randn(1, 256), torch.randn(256), torch.randn(2, 5, 256).bfloat16()):
        out = layer(x)
        assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], 64)
        _assert_within_int4_kernel_rounding(layer, x, out)
    x = torch.randn(4, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, layer(x.bfloat16()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_int4_inputs_the_kernel_does_not_take_dequantize_exactly_as_before(dtype):
    torch.manual_seed(0)
    layer = Int4Linear.from_float(nn.Linear(64, 32), 32)
    x = torch.randn(3, 64, dtype=dtype)
    w, b = layer.dequantized_weight().to(dtype), layer.bias.to(dtype)
    assert torch.equal(layer(x), F.linear(x, w, b))


def test_int4_kernel_backward_gives_the_input_the_stored_weights_gradient():
    """The kernel op has no derivative: the layer's gradient is F.linear's with the stored
    (dequantized) weight, as before; the bias and LoRA adapters train."""
    torch.manual_seed(0)
    layer = Int4Linear.from_float(nn.Linear(64, 32), 32)
    _int4_kernel_here(layer)
    x = torch.randn(5, 64, requires_grad=True)
    grad = torch.randn(5, 32)
    layer(x).backward(grad)
    assert torch.equal(x.grad, grad @ layer.dequantized_weight())
    assert torch.equal(layer.bias.grad, grad.sum(0))
    layer.enable_lora(2)
    with torch.no_grad():
        layer.lora_B.fill_(0.1)
    layer(torch.randn(5, 64)).sum().backward()
    assert layer.lora_A.grad is not None and layer.lora_A.grad.abs().sum() > 0


def test_quantize_says_which_matmul_each_linear_runs_and_why():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32), nn.Embedding(10, 64))
    result = quantize(model, "int4", group_size=16)
    assert set(result.kernels) == {"0", "1"}  # embeddings look rows up: no matmul
    why = "groups of 16: the packed int4 kernels take groups of 32, 64, 128, 256"
    assert result.kernels["0"] == f"dequantize the weight, then F.linear ({why})"
    assert "0: int4 (groups of 16); matmul: dequantize the weight" in str(result)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(8, 32))
    result = quantize(model, "int8", filter=lambda path, m: True)
    assert result.kernels["0"] == model[0].kernel
    assert any(name in model[0].kernel for name in ("oneDNN", "torch._int_mm", "float32 matmul"))


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("inference", [False, True])
def test_the_prepacked_weight_follows_loaded_and_requantized_buffers(mode, inference):
    """The kernels multiply by a copy of the weight packed on first use: a checkpoint loaded
    into the buffers in place (inference tensors count no versions), a requantized weight
    and a move must not leave it stale; state_dict, deepcopy and pickling see only the
    canonical buffers."""

    def net(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(128, 64))
        quantize(model, mode)
        return model

    x = torch.randn(3, 128)
    with torch.inference_mode(inference):
        model, other = net(0), net(1)
        before, wanted = model(x), other(x)
        assert not torch.equal(before, wanted)
        model.load_state_dict(other.state_dict())
        assert torch.equal(model(x), wanted)
        keys = set(model.state_dict())
        assert keys == {"0.qweight", "0.weight_scale", "0.bias"} | (
            {"0.weight_zero"} if mode == "int4" else set()
        )
        copied = copy.deepcopy(model)
        buf = io.BytesIO()
        torch.save(model, buf)
        assert torch.equal(copied(x), wanted)
        assert torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=False)(x), wanted)
        with torch.no_grad():
            model[0].requantize(torch.zeros(64, 128))
        assert torch.equal(model(x), model[0].bias.expand(3, 64))


def test_int4_kernel_runs_per_channel_groups_only_of_a_kernel_size():
    torch.manual_seed(0)
    wide = Int4Linear.from_float(nn.Linear(300, 16), -1)
    assert wide.kernel.endswith(
        "(groups of 300: the packed int4 kernels take groups of 32, 64, 128, 256)"
    )
    x = torch.randn(2, 300)
    assert torch.equal(wide(x), F.linear(x, wide.dequantized_weight(), wide.bias))


@pytest.mark.parametrize("m, k, n", [(1, 16, 8), (7, 24, 10), (33, 300, 40), (130, 1024, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_linear_is_the_same_integer_math_whichever_kernel_runs(m, k, n, dtype):
    """oneDNN's prepacked int8 linear, torch._int_mm and the float64 fallback give the same
    sums, so a layer's output is the float reference of its integer math bit for bit."""
    torch.manual_seed(k)
    lin = nn.Linear(k, n)
    layer = Int8Linear.from_float(lin)
    x = (torch.randn(m, k) * torch.logspace(-3, 2, m)[:, None]).to(dtype)
    qx, xs = quantize_tokens(x)
    qw, ws = layer.qweight, layer.weight_scale
    acc = (qx.double() @ qw.double().t()).float()  # exact in float64, then as int32 -> float32
    want = (acc * ws[None, :] * xs[:, None] + lin.bias.float()).to(dtype)
    assert torch.equal(layer(x), want)
    if cpu_int8_kernels()["onednn"] is None:  # the prepacked kernel, called directly
        packed = onednn_prepack(qw, ws)
        assert torch.equal(int8_linear(x, qw, ws, packed), int8_linear(x, qw, ws))


def _edge_tokens(k: int) -> torch.Tensor:
    """Tokens whose codes sit on rounding ties (scale 1: the row's largest value is 127),
    an all-zero token, tokens below float32's normal range (their scales are subnormal or
    0), a huge one, and tokens holding a NaN or an inf."""
    g = torch.Generator().manual_seed(k)
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, -127.0])
    rows = [ties.repeat(k // 10 + 1)[:k], torch.zeros(k)]
    for magnitude in (1e-39, 1e-44, 1e38):
        rows.append(torch.randn(k, generator=g).clamp(-3, 3) * magnitude)
    for bad in (float("nan"), float("inf"), -float("inf")):
        row = torch.randn(k, generator=g)
        row[k // 2] = bad
        rows.append(row)
    rows.append(torch.randn(k, generator=g))
    return torch.stack(rows)


@pytest.mark.parametrize("k", [16, 40])
def test_int8_codes_round_ties_to_even_and_every_kernel_gives_the_same_edge_rows(k):
    """Codes come from a rounding addition and the bits of the sum, not from round and a
    float-to-int conversion: ties go to even and clamp at 127 as ``torch.round`` and clamp
    give them; zero, subnormal, huge and non-finite tokens come out of each kernel alike
    (non-finite ones NaN, the zero one the bias)."""
    x = _edge_tokens(k)
    q, scale = quantize_tokens(x)
    assert q[0, :10].tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -126, -127]
    finite = torch.isfinite(x).all(1)
    # a scale that underflowed to 0 (the 1e-44 token) divides 0 by 0: code 0
    want = torch.round(x[finite] / scale[finite, None]).clamp(-127, 127).nan_to_num(0.0)
    assert torch.equal(q[finite].float(), want)
    assert (q[~finite] == 0).all() and torch.isnan(scale[~finite]).all()
    torch.manual_seed(0)
    lin = nn.Linear(k, 24)
    layer = Int8Linear.from_float(lin)
    qw, ws = layer.qweight, layer.weight_scale
    acc = (q.double() @ qw.double().t()).float()
    ref = acc * ws[None, :] * scale[:, None]
    ref[1] = 0.0  # the zero token: its scale (1 here) meets sums of 0 on every path
    out = int8_linear(x, qw, ws)
    assert torch.equal(out[finite], ref[finite]) and torch.isnan(out[~finite]).all()
    assert torch.equal(layer(x)[1], lin.bias.detach())
    if cpu_int8_kernels()["onednn"] is None:
        fast = int8_linear(x, qw, ws, onednn_prepack(qw, ws))
        assert torch.equal(fast[finite], out[finite]) and torch.isnan(fast[~finite]).all()


def test_onednn_product_takes_the_unsigned_codes_and_refuses_signed_ones():
    """oneDNN's int8 linear takes the codes plus 128 as uint8 (zero point 128); given int8
    codes it used to flip them in place, and an int8 input reached a reference loop ~3000x
    slower: now it is refused, saying what it takes."""
    a = torch.randint(-127, 128, (4, 32), dtype=torch.int8)
    b = torch.randint(-127, 128, (8, 32), dtype=torch.int8)
    with pytest.raises(ValueError, match="codes plus 128 as uint8, got torch.int8"):
        onednn_product(a, onednn_prepack(b))
    if cpu_int8_kernels()["onednn"] is None:
        scales = torch.rand(8) + 0.5
        got = onednn_product(a.view(torch.uint8) ^ 0x80, onednn_prepack(b, scales))
        assert torch.equal(got, torch.mul((a.long() @ b.long().t()).float(), scales))


@pytest.mark.parametrize("inference", [False, True])
def test_int8_prepacked_scales_follow_the_weight_scale_buffer(inference):
    """oneDNN's call multiplies by the weight scales packed beside the weight: scales
    changed in place or replaced must not leave the packed copy stale."""
    torch.manual_seed(0)
    layer = Int8Linear.from_float(nn.Linear(64, 32))
    x = torch.randn(5, 64)
    with torch.inference_mode(inference):
        before = layer(x)
        with torch.no_grad():
            layer.weight_scale.mul_(2.0)
        doubled = Int8Linear.from_float(nn.Linear(64, 32))
        doubled.load_state_dict(layer.state_dict())
        assert torch.equal(layer(x), doubled(x)) and not torch.equal(layer(x), before)
        layer.weight_scale = layer.weight_scale / 4.0
        doubled.weight_scale = doubled.weight_scale / 4.0
        assert torch.equal(layer(x), doubled(x))


@pytest.mark.parametrize("k", [1, INT_MM_MIN_K, ONEDNN_MAX_K, ONEDNN_MAX_K + 1])
def test_int8_linear_sums_full_scale_codes_exactly_at_each_kernels_bounds(k):
    """At full scale (codes 127 x 127) every product is largest: below `INT_MM_MIN_K` the
    float64 path (torch._int_mm gave garbage for K == 1), up to `ONEDNN_MAX_K` oneDNN's
    unsigned codes (255 x 127 per product) fit its int32 sums, past it torch._int_mm. Each
    layer's output is exactly K, for one token and for several."""
    lin = nn.Linear(k, 3)  # quantize skips a layer this small; the layer itself takes it
    with torch.no_grad():
        lin.weight.fill_(1.0)
        lin.bias.zero_()
    layer = Int8Linear.from_float(lin)
    if cpu_int8_kernels()["onednn"] is None:
        assert layer.kernel.startswith("oneDNN") == (INT_MM_MIN_K <= k <= ONEDNN_MAX_K)
    for tokens in (1, 4):
        for sign in (1.0, -1.0):
            out = layer(torch.full((tokens, k), sign))
            assert torch.equal(out, torch.full((tokens, 3), sign * k))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_model_moved_to_another_dtype_after_a_forward_computes_as_a_fresh_one(mode):
    """The prepacked copy made by a forward must not outlive ``.to(dtype)`` / ``.to(device)``:
    the moved layer computes as one quantized and moved without ever running."""

    def net() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32))
        quantize(model, mode)
        return model

    x = torch.randn(5, 128)
    used, fresh = net(), net()
    used(x)
    used.to("cpu").to(torch.bfloat16)
    fresh.to(torch.bfloat16)
    assert torch.equal(used(x.bfloat16()), fresh(x.bfloat16()))
    assert torch.equal(used(x[:1].bfloat16()), fresh(x[:1].bfloat16()))
    used.float()
    fresh.float()
    assert torch.equal(used(x), fresh(x))


def test_a_kernel_whose_int8_sums_saturate_is_found_out():
    """Without VNNI oneDNN sums pairs of u8 x s8 products in 16 bits: a row of 127s summed
    to 8160 instead of 1032256. The check runs each kernel on operands that expose it."""

    def saturating(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        products = (a.long() + 128)[:, None, :] * b.long()[None, :, :]  # as u8 x s8
        pairs = F.pad(products, (0, products.shape[-1] % 2)).unflatten(-1, (-1, 2)).sum(-1)
        sums = pairs.clamp(-(2**15), 2**15 - 1).sum(-1)
        return sums - 128 * b.long().sum(-1)[None, :]

    assert wrong_sums(lambda a, b: a.long() @ b.long().t()) is None
    assert wrong_sums(saturating).startswith("wrong sums for (3, 64) x (16, 64) int8 codes")

    def broken(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no kernel for this CPU\nmore")

    assert wrong_sums(broken) == "it raised RuntimeError: no kernel for this CPU"


CAPPED = """
import json, torch, torch.nn.functional as F
from torch import nn
from mixprec.quantize import Int4Linear, Int8Linear
from mixprec.quantize.int8 import int_matmul, quantize_tokens
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
a = torch.randint(-127, 128, (33, 64), generator=g, dtype=torch.int8)
b = torch.randint(-127, 128, (16, 64), generator=g, dtype=torch.int8)
a[0] = 127
b[:8] = 127
exact = torch.equal(int_matmul(a, b).long(), a.long() @ b.long().t())
lin = nn.Linear(64, 16)
int8 = Int8Linear.from_float(lin)
x = torch.randn(33, 64)
qx, xs = quantize_tokens(x)
acc = (qx.double() @ int8.qweight.double().t()).float()
want = acc * int8.weight_scale[None, :] * xs[:, None] + lin.bias
int4 = Int4Linear.from_float(lin, 32)
dequantized = F.linear(x, int4.dequantized_weight(), lin.bias)
print(json.dumps({
    "int_matmul": exact, "int8": torch.equal(int8(x), want), "int8_kernel": int8.kernel,
    "int4": torch.equal(int4(x), dequantized), "int4_kernel": int4.kernel,
}))
"""


@pytest.mark.slow
def test_with_the_isa_capped_the_kernels_that_go_wrong_are_not_used():
    """CI runs the suite with ONEDNN_MAX_CPU_ISA=AVX2 / ATEN_CPU_CAPABILITY capped: on a VNNI
    host so capped, oneDNN's int8 sums (and torch._int_mm's) saturated, and a plain ATen build
    has only a scalar int4 loop. The layers fall back, say so, and stay exact."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "default"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", CAPPED], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["int_matmul"] and got["int8"] and got["int4"]
    assert got["int4_kernel"] == (
        "dequantize the weight, then F.linear (ATen CPU capability DEFAULT: no vectorised int4 "
        "kernel)"
    ) or platform.machine().lower() in ("aarch64", "arm64")
    if "float32 matmul" in got["int8_kernel"]:  # the saturating kernels were found and named
        assert "wrong sums" in got["int8_kernel"] or "raised" in got["int8_kernel"]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_weight_that_is_not_contiguous_quantizes_to_the_same_layer(mode: str) -> None:
    # a transposed view as the weight: int8's prepacked codes were read in the wrong order
    # (outputs off by ~29 where int8 rounding allows ~0.2)
    torch.manual_seed(0)
    weight = torch.randn(48, 24).t()
    x = torch.randn(5, 48)
    layers = []
    for w in (weight, weight.contiguous()):
        model = nn.Sequential(nn.Linear(48, 24))
        model[0].weight = nn.Parameter(w)
        model[0].bias = nn.Parameter(torch.zeros(24))
        mixprec.quantize(model, mode, **({"group_size": 32} if mode == "int4" else {}))
        layers.append(model)
    with torch.no_grad():
        assert torch.equal(layers[0](x), layers[1](x))
        error = (layers[0](x) - F.linear(x, weight)).abs().max()
    assert error < (0.5 if mode == "int8" else 3.0)


@FAST
@given(
    st.integers(1, 9), st.integers(1, 2 * F32_EXACT_K + 5), st.integers(1, 9), st.integers(0, 99)
)
def test_float_sums_are_the_exact_integer_sums(m, k, n, seed):
    """The CPU path without an exact int8 kernel multiplies the codes in float32: exact while
    every partial sum is an integer below 2**24, so in chunks of `F32_EXACT_K` features,
    added in float64 past one chunk."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    sums = float_sums(a, b)
    assert sums.dtype == (torch.float32 if k <= F32_EXACT_K else torch.float64)
    assert torch.equal(sums.long(), a.long() @ b.long().t())


@pytest.mark.parametrize("k", [F32_EXACT_K, F32_EXACT_K + 1, 3 * F32_EXACT_K])
@pytest.mark.parametrize("sign", [1, -1])
def test_float_sums_of_full_scale_codes_are_exact_at_the_chunk_bound(k, sign):
    """127 x 127 over 1040 features is 16774160, the largest sum float32 holds exactly (each
    added product moves it by 16129 < its float32 step past 2**24: one feature more in one
    chunk would round). Past the bound the chunks keep every sum exact."""
    assert F32_EXACT_K * 127 * 127 <= 2**24 < (F32_EXACT_K + 1) * 127 * 127
    a = torch.full((2, k), 127 * sign, dtype=torch.int8)
    b = torch.full((3, k), 127, dtype=torch.int8)
    b[1] = -127
    want = torch.tensor([127 * 127 * k, -127 * 127 * k, 127 * 127 * k]) * sign
    assert torch.equal(float_sums(a, b).long(), want.expand(2, 3))
    assert torch.equal(int_matmul(a, b).long(), want.expand(2, 3))


def test_the_float_path_of_an_int8_linear_equals_the_integer_reference():
    """Below `INT_MM_MIN_K` features (and on CPUs without VNNI) a layer sums in float32; its
    outputs are the int32 sums' float32 values times the weight, then the token scales."""
    torch.manual_seed(0)
    lin = nn.Linear(INT_MM_MIN_K - 1, 7)
    layer = Int8Linear.from_float(lin)
    assert layer.kernel.startswith("float32 matmul of the int8 codes")
    x = torch.randn(5, INT_MM_MIN_K - 1)
    qx, xs = quantize_tokens(x)
    acc = (qx.long() @ layer.qweight.long().t()).int().float()
    want = acc * layer.weight_scale[None, :] * xs[:, None] + lin.bias
    with torch.no_grad():
        assert torch.equal(layer(x), want)


def test_without_exact_onednn_sums_torch_int_mm_is_not_used_even_where_exact(monkeypatch):
    """Without VNNI torch._int_mm's sums can be exact yet run a reference loop (22-25x float32's
    time on an AVX2-only EPYC, where the layer took it): a CPU whose oneDNN int8 sums are
    wrong takes the float32 path, says why, and gives the same outputs."""
    from mixprec.quantize import int8 as int8_module

    torch.manual_seed(0)
    lin = nn.Linear(64, 24)
    x = torch.randn(5, 64)
    qx, xs = quantize_tokens(x)
    layer = Int8Linear.from_float(lin)
    want = (qx.long() @ layer.qweight.long().t()).float() * layer.weight_scale * xs[:, None]
    want = want + lin.bias
    monkeypatch.setattr(
        int8_module, "_cpu_int8_kernels", {"onednn": "wrong sums for (as probed)", "int_mm": None}
    )
    assert layer.kernel.startswith("float32 matmul of the int8 codes")
    assert "torch._int_mm: exact, but a reference loop without VNNI" in layer.kernel
    with torch.profiler.profile() as prof, torch.no_grad():
        for tokens in (x, x[:1]):
            got = layer(tokens)
            torch.testing.assert_close(got, want[: len(tokens)], rtol=0, atol=0)
        assert torch.equal(
            int_matmul(qx, layer.qweight), (qx.long() @ layer.qweight.long().t()).int()
        )
    assert "aten::_int_mm" not in {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("k", [30, F32_EXACT_K, 2 * F32_EXACT_K + 21])
@pytest.mark.parametrize("m", [1, 7])
def test_float_sums_in_tiles_of_weight_rows_are_the_exact_sums(monkeypatch, m, k):
    """`float_sums` converts the weight codes a tile of rows at a time (cache-sized: converting
    a whole 4096 x 4096 weight per call took 2-3x float32's time); with tiny tiles (64 rows) a
    150-row weight is three tiles, the last one short, and every sum is still exact."""
    from mixprec.quantize import int8 as int8_module

    monkeypatch.setattr(int8_module, "FLOAT_TILE_BYTES", 1)
    g = torch.Generator().manual_seed(k + m)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (150, k), generator=g, dtype=torch.int8)
    a[0], b[:, :] = 127, b.sign().to(torch.int8) * 127  # full scale: the largest sums
    got = float_sums(a, b)
    assert got.dtype == (torch.float32 if k <= F32_EXACT_K else torch.float64)
    assert torch.equal(got.long(), a.long() @ b.long().t())
    assert torch.equal(int_matmul(a, b).long(), a.long() @ b.long().t())


@pytest.mark.parametrize("other", ["mxfp8_from_float32", "float8/rowwise_from_float32"])
def test_a_tied_side_in_a_format_that_keeps_the_weight_counts_as_float(other):
    """A side swapped for a float8 or block-format layer keeps training its float weight,
    as a float side does: int8 codes on the other side untied them (0.25 apart after one
    step on GPT-2's embedding and head) with no warning, which a side left float gave."""
    from mixprec import PolicyMap, apply

    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model[1].weight = model[0].weight
    rules = {"0": "int8_from_float32", "1": other}
    with pytest.warns(UserWarning, match=r"0.weight is tied to 1.weight, which stays float"):
        apply(model, PolicyMap("32-true", rules))


def test_a_model_holding_a_torchscript_module_quantizes():
    """Reading which children a parent's forward reads the weight of asked a TorchScript
    module's class for its forward, which raises AttributeError there."""
    model = nn.Sequential(nn.Linear(64, 64), torch.jit.script(nn.Sequential(nn.Linear(64, 64))))
    result = quantize(model, "int8")
    assert list(result.quantized) == ["0"]


@pytest.mark.parametrize("mode", ["int8", "int4/32"])
def test_int_swaps_both_ways_keep_the_layers_hooks_and_training_mode(mode):
    """An int8/int4 layer swapped in for a Linear or an Embedding (and the float layer
    `dequantize` swaps back) dropped the user's hooks (a forward hook zeroing an output
    ran no more) and came back in training mode inside a model in eval mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 64)).eval()
    calls = []
    model[0].register_forward_hook(lambda mod, inp, out: calls.append("embedding") or out * 2)
    model[1].register_forward_pre_hook(lambda mod, args: calls.append("linear") or None)
    model[1].register_forward_hook(lambda mod, inp, out: out * 0)
    ids = torch.tensor([[1, 2, 3]])
    mixprec.quantize(model, mode)
    assert type(model[0]).__name__.endswith("Embedding") and "Int" in type(model[1]).__name__
    assert not model[0].training and not model[1].training
    assert torch.equal(model(ids), torch.zeros(1, 3, 64)) and calls == ["embedding", "linear"]
    mixprec.quantize.dequantize(model)
    assert type(model[1]) is nn.Linear and not model[1].training
    calls.clear()
    assert torch.equal(model(ids), torch.zeros(1, 3, 64)) and calls == ["embedding", "linear"]


def test_weight_bytes_of_a_model_on_the_meta_device_count_every_tensor_once():
    """Every meta tensor's storage sits at address 0, so all of them counted as one (256
    bytes where the model holds 25,088)."""

    def build() -> nn.Module:
        return nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 32))

    on_cpu = build()
    with torch.device("meta"):
        on_meta = build()
    assert weight_bytes(on_meta) == weight_bytes(on_cpu) == 4 * (64 * 64 + 64 * 32 + 32)
    tied = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)).to("meta")
    tied[1].weight = tied[0].weight
    assert weight_bytes(tied) == 4 * 64 * 64  # a tied weight once


def test_int4_groups_spanning_past_float32s_largest_quantize_finite():
    """A group holding -2e38 and 2e38: hi - lo overflowed to inf, the scale was inf and the
    group dequantized to NaN from finite weights."""
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = -2e38, 2e38, 1.0
    packed, scale, zero = quantize_groups(w, 32)
    back = dequantize_groups(packed, scale, zero, 32, 32)
    assert torch.isfinite(scale).all() and torch.isfinite(back).all()
    assert (back - w).abs().max() <= scale.max() / 2 * 1.0001


def test_int4_float16_groups_of_both_signs_are_stored_when_their_values_fit():
    """A float16 group spanning -40000 .. 40000 was refused ("times its largest code (15)
    exceeds float16's range"), though its codes reach only 8 steps from the zero point
    (42.7k, within float16). The reach checked is the group's own."""
    w = torch.zeros(2, 32, dtype=torch.float16)
    w[0, 0], w[0, 1] = -40000.0, 40000.0
    packed, scale, zero = quantize_groups(w, 32)
    back = dequantize_groups(packed, scale.to(torch.float16), zero, 32, 32)
    assert torch.isfinite(back).all()
    assert (back.float() - w.float()).abs().max() <= scale.max() / 2 * 1.01
    w[1, 0] = 65504.0  # and a group reaching float16's largest is still refused
    with pytest.raises(ValueError, match="exceeds torch.float16's range"):
        quantize_groups(w, 32)


def test_int8_rows_of_subnormal_weights_keep_their_values():
    """max |w| under 127 times float32's smallest subnormal: the scale underflowed to 0 and
    the row came back as zeros, against |w - q * s| <= s / 2."""
    w = torch.tensor([[7.0, -2.0, 0.0, 1.0]]) * 2.0**-149
    q, scale = quantize_rows(w)
    assert scale.item() > 0
    assert torch.equal(q.float() * scale[:, None], w)


def test_int8_weights_whose_sums_times_scale_pass_float32_are_refused():
    """Found by a review: a forward multiplies the codes' sums by the weight's scale before
    the input's (the order every kernel path shares), so weights around 1e36 gave outputs of
    inf where the true ones are 4e6, silently. Such a weight is refused when quantized;
    weights just inside the bound give the float layer's outputs."""
    from mixprec.quantize.int8 import Int8Linear, ScaleRangeError

    g = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (4, 64), generator=g).float() * 2 - 1
    huge = nn.Sequential(nn.Linear(64, 4))
    with torch.no_grad():
        huge[0].weight.copy_(signs * 1e36)
    with pytest.raises(ScaleRangeError, match="0.weight to int8: .* sum of 64 products of codes"):
        mixprec.apply(huge, "int8_from_32-true")
    assert isinstance(huge[0], nn.Linear)  # (refused before any layer was swapped)
    with pytest.raises(ScaleRangeError, match="the weight to int8"):
        Int8Linear.from_float(huge[0])
    # an Embedding's lookups sum nothing: a second review found it refused too
    table = nn.Sequential(nn.Embedding(8, 4096))
    with torch.no_grad():
        table[0].weight.fill_(1e33)
    mixprec.apply(table, "int8_from_32-true")
    assert torch.isfinite(table(torch.tensor([3]))).all()
    layer = nn.Linear(64, 4, bias=False)
    with torch.no_grad():
        layer.weight.copy_(signs * 1e30)
    x = torch.full((2, 64), 1e-30)
    q, scale = quantize_rows(layer.weight)
    out = int8_linear(x, q, scale)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, layer(x), rtol=1e-2)


@pytest.mark.parametrize("k", [512, 2 * F32_EXACT_K + 21])
def test_float_sums_stay_exact_inside_autocast(monkeypatch, k):
    """The float32 matmuls of the codes run with autocast off: inside bfloat16 autocast (an
    ``int8_from_bf16-mixed`` layer's region) they ran in bfloat16, sums off by up to 504,
    and a layer on a CPU without exact integer kernels gave other outputs than on one with
    them (outside autocast, converted to autocast's dtype, is what it must give)."""
    from mixprec.quantize import int8 as int8_module

    g = torch.Generator().manual_seed(k)
    a = torch.randint(-127, 128, (8, k), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (64, k), generator=g, dtype=torch.int8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = float_sums(a, b)
    assert torch.equal(got.long(), a.long() @ b.long().t())
    monkeypatch.setattr(
        int8_module, "_cpu_int8_kernels", {"onednn": "none (as probed)", "int_mm": None}
    )
    torch.manual_seed(0)
    layer = Int8Linear.from_float(nn.Linear(k, 64))
    x = torch.randn(8, k)
    with torch.no_grad():
        want = layer(x).to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = layer(x)
    assert inside.dtype == torch.bfloat16
    assert torch.equal(inside, want)


def _steps(layer, weight):
    """The largest distance of `layer`'s int8 weight from `weight`, in its stored steps."""
    scale = layer.weight_scale.float()[:, None]
    return ((layer.qweight.float() * scale - weight.float()).abs() / scale).max().item()


@pytest.mark.parametrize("policy", ["int8_from_p=f16,c=bf16,o=bf16", "int8_from_bf16-true"])
def test_scales_are_made_in_the_dtype_they_are_stored_in(policy):
    """Scales are computed in the dtype `apply` stores them in: a policy casting parameters
    stores buffers in its compute dtype (its scales were made for float16 and cast to
    bfloat16 by nearest: 0.97 of a step off), and a float16 model under a bfloat16 policy got
    bfloat16 scales squeezed through float16 (a row of tiny weights shrank by a quarter)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64))
    with torch.no_grad():
        model[0].weight[0] = torch.randn(32) * 3e-6
    model = model.half() if policy == "int8_from_bf16-true" else model
    weight = model[0].weight.detach().float().clone()
    mixprec.apply(model, policy, warn=False)
    layer = model[0]
    assert layer.weight_scale.dtype == torch.bfloat16
    assert _steps(layer, weight) <= 0.5
    assert (layer.weight_scale.float() * 127 >= weight.abs().amax(dim=1)).all()


@pytest.mark.parametrize("cast", ["apply", "method"])
@pytest.mark.parametrize("spec", ["int8", "int4/16"])
def test_a_cast_of_quantized_scales_requantizes_where_they_do_not_fit(cast, spec):
    """Scales cast to a dtype that does not hold them (`apply(model, "16-true")` or
    ``model.half()`` after `quantize`) quantize the weight again in it, scales rounded up:
    rounded to nearest, a float16 row of tiny weights got scale 0 (its outputs were the bias
    alone) and other scales fell below their rows' largest weight / 127. Exact casts
    (float16 scales to float32) change nothing; a tied embedding and head keep sharing."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(64, 32), "head": nn.Linear(32, 64)})
    model["head"].weight = model["emb"].weight
    with torch.no_grad():
        model["emb"].weight[0] = torch.randn(32) * 1e-6
    mixprec.quantize(model, spec)
    before = model["head"].dequantized_weight().float()
    if cast == "apply":
        mixprec.apply(model, "16-true", warn=False)
    else:
        model.half()
    head, emb = model["head"], model["emb"]
    assert head.weight_scale.dtype == torch.float16
    assert (head.weight_scale > 0).all()
    assert head.dequantized_weight()[0].abs().max() > 0  # the tiny row kept its values
    after = head.dequantized_weight().float()
    # within a stored step of the weight the codes stood for (rounded up: codes in range)
    step = head.weight_scale.float().reshape(before.shape[0], -1).amax(dim=1, keepdim=True)
    assert ((after - before).abs() <= step).all()
    assert torch.equal(emb.dequantized_weight(), head.dequantized_weight())
    if cast == "apply":
        assert emb.qweight is head.qweight and emb.weight_scale is head.weight_scale
    codes = head.qweight.clone()
    model.float()  # exact: float16 values fit float32
    assert torch.equal(head.qweight, codes)
    assert torch.equal(head.dequantized_weight().half(), after.half())


@pytest.mark.parametrize("spec", ["int8", "int4/16"])
def test_a_peft_models_adapters_stay_float_and_its_base_layers_quantize(spec):
    """peft's LoRA adapters are Linear layers too: `quantize` on a peft model swapped its
    ``lora_A`` (64 input features) for codes, which froze it (only B trained). They are
    skipped, saying why; the base layers quantize (QLoRA) and both adapters train."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["0", "2"]))
    result = quantize(model, spec)
    assert sorted(result.quantized) == [
        "base_model.model.0.base_layer",
        "base_model.model.2.base_layer",
    ]
    adapters = [path for path in result.skipped if ".lora_" in path]
    assert len(adapters) == 4
    assert all("a peft LoRA adapter" in result.skipped[path] for path in adapters)
    model(torch.randn(4, 64)).sum().backward()
    trained = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    assert [n.split(".")[-3] for n in trained] == ["lora_A", "lora_B", "lora_A", "lora_B"]


@pytest.mark.parametrize("spec", ["int8", "int4/16"])
def test_dequantize_with_adapters_gives_the_bias_back_its_training(spec):
    """`enable_lora` freezes the bias; `merge_lora` gives it back, but `dequantize` with the
    adapters folded in left it frozen (the float model's biases never trained again)."""
    from mixprec.quantize import dequantize, enable_lora

    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model[1].bias.requires_grad_(False)
    quantize(model, spec)
    enable_lora(model, 4)
    assert not model[0].bias.requires_grad
    dequantize(model)
    assert model[0].bias.requires_grad and model[0].weight.requires_grad
    assert not model[1].bias.requires_grad  # frozen before: stays frozen


def test_setup_warns_when_lora_adapters_are_in_no_optimizer():
    """Adapters enabled after the optimizer was built never trained (the loss stayed put,
    the biases it trained before frozen by enable_lora), with no word."""
    import warnings as warnings_module

    from mixprec.quantize import enable_lora

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    precision = mixprec.Precision("int8_from_float32")
    model = precision.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    precision.setup(model, optimizer)
    adapters = enable_lora(model, rank=4)
    with pytest.warns(UserWarning, match="4 LoRA adapter tensor.* are in no optimizer"):
        precision.setup(model, optimizer)
    with warnings_module.catch_warnings():
        warnings_module.simplefilter("error")
        mixprec.Precision("int8_from_float32").setup(model, torch.optim.AdamW(adapters))


def _code_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "lora" not in k}


def _assert_same_buffers(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    moved = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not moved, moved


INT_MODES = ["int8", "int4/32", "int4/16", "int4/-1"]
SCALE_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["int8", "int4/16"])
def test_merging_adds_the_adapters_to_the_exact_weight(mode, dtype):
    """`merge_lora` quantizes the weight the codes stand for plus the adapters' change, the
    weight taken exactly (codes times scales in float32), not first rounded to the 16-bit
    dtype of the scales."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(48, 40).to(dtype))
    quantize(layer, mode)
    layer = layer[0]
    layer.enable_lora(2)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.01)
    buffers = {**layer.code_buffers(), "weight_scale": layer.weight_scale.float()}
    merged = layer.weight_from(buffers) + layer.lora_delta()
    expected = layer.quantized_buffers(merged, dtype)
    layer.merge_lora()
    _assert_same_buffers(layer.code_buffers(), expected)


def test_int4_of_a_transposed_weight_is_that_of_its_contiguous_copy():
    """A Hugging Face Conv1D's weight is quantized transposed: a view of it, not a copy."""
    w = torch.randn(64, 40)
    got, want = quantize_groups(w.t(), 16), quantize_groups(w.t().contiguous(), 16)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
