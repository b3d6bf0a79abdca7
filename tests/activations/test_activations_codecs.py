"""The storage codecs: fp8 decodes as the optimizer states' codec does, bit for bit; bf16
stores float32 activations only; parameters and inputs are never copied; a tensor saved
twice is stored once; and the memory a step holds goes down."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import mixprec
from mixprec.activations import codecs, saved_bytes, wrapped
from mixprec.activations.codecs import FP8, Fp8Saved, Reshaped, ToBfloat16, ToFp8, is_activation
from mixprec.memory import measured
from mixprec.optim.states.formats import dequantize, quantize


def saved_by(codec, work):
    """What `codec` packed (original, packed) and what it unpacked, for one forward and
    backward of `work`."""
    packs, unpacks = [], []

    def pack(t):
        packed = codec.pack(t)
        packs.append((t.detach().clone(), packed))
        return packed

    def unpack(packed):
        out = codec.unpack(packed)
        unpacks.append(out)
        return out

    with saved_tensors_hooks(pack, unpack):
        loss = work()
    loss.backward()
    return packs, unpacks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_saved_tensor_decodes_bit_for_bit_as_the_states_codec(dtype):
    torch.manual_seed(0)
    x = (torch.randn(40, 33) * torch.logspace(-3, 3, 33)).to(dtype).requires_grad_()
    packs, unpacks = saved_by(ToFp8(), lambda: (x * 2).sin().sum())
    (original, packed), read = packs[-1], unpacks[-1]  # sin's input, x * 2
    assert original.dtype == dtype and read.dtype == dtype
    codes, scales = quantize(original, "fp8", signed=True)
    assert torch.equal(packed.codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(packed.scales, scales)
    expected = dequantize(codes, scales, "fp8", original.shape, signed=True).to(dtype)
    assert torch.equal(read, expected)
    assert not torch.equal(read, original)  # lossy: e4m3 keeps 3 mantissa bits


def test_fp8_codes_in_chunks_are_the_whole_tensors_codes(monkeypatch):
    """The codec encodes and decodes a chunk of blocks at a time (its float32 temporaries
    stay a chunk's size): the codes, scales and values read are those of the whole."""
    torch.manual_seed(0)
    x = torch.randn(7, 333, dtype=torch.bfloat16, requires_grad=True)
    monkeypatch.setattr(codecs, "CHUNK", 2 * FP8.block)
    packs, unpacks = saved_by(ToFp8(), lambda: (x * 2).sin().sum())
    (original, packed), read = packs[-1], unpacks[-1]
    codes, scales = quantize(original, "fp8", signed=True)
    assert torch.equal(packed.codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(packed.scales, scales)
    expected = dequantize(codes, scales, "fp8", original.shape, signed=True).bfloat16()
    assert torch.equal(read, expected)


def test_bf16_stores_float32_activations_and_reads_them_back_as_float32():
    torch.manual_seed(0)
    x = torch.randn(8, 300, requires_grad=True)
    packs, unpacks = saved_by(ToBfloat16(), lambda: (x * 3).exp().sum())
    (original, packed), read = packs[-1], unpacks[-1]  # exp saves its result
    assert packed[0].dtype == torch.bfloat16 and read.dtype == torch.float32
    assert torch.equal(read, original.to(torch.bfloat16).float())


def test_parameters_inputs_and_casts_of_parameters_are_kept_as_they_are():
    torch.manual_seed(0)
    layer = nn.Linear(300, 300)
    x = torch.randn(4, 300)
    for codec in (ToBfloat16(), ToFp8()):
        packs, _ = saved_by(codec, lambda: layer(x).sum())  # noqa: B023
        assert all(isinstance(p, torch.Tensor) for _, p in packs)  # input and weight as is
    with torch.autocast("cpu", torch.bfloat16):
        w = layer.weight.to(torch.bfloat16).t()
    assert not is_activation(w) and not is_activation(layer.weight) and not is_activation(x)
    assert is_activation(layer(x))


def test_a_tensor_saved_twice_in_a_forward_is_stored_once_also_as_a_reshaped_view():
    torch.manual_seed(0)
    x = torch.randn(4, 16, 64, requires_grad=True)
    q, k = nn.Linear(64, 64), nn.Linear(64, 64)
    codec = ToFp8()

    def work():
        h = torch.tanh(x)  # saved by tanh; each 3-d Linear saves it flattened to 64 x 64
        return (q(h) * k(h)).sum()

    packs, _ = saved_by(codec, work)
    stored = [p for _, p in packs if not isinstance(p, torch.Tensor)]
    assert len(stored) == 5  # tanh's h, the Linears' views of it, q(h), k(h)
    views = [p for p in stored if isinstance(p, Reshaped)]
    assert len(views) == 2 and all(v.packed is stored[0] and v.shape == (64, 64) for v in views)
    assert torch.equal(codec.unpack(views[0]), codec.unpack(stored[0]).view(64, 64))
    assert sum(p.codes.numel() for p in stored if isinstance(p, Fp8Saved)) == 3 * 4 * 16 * 64


def mlp(width: int = 256, depth: int = 6) -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]
    return nn.Sequential(*layers, nn.Linear(width, 1))


@pytest.mark.parametrize(("option", "at_most"), [("bf16", 0.55), ("fp8", 0.3)])
def test_storage_options_shrink_the_saved_activations_and_the_step_peak(option, at_most):
    x = torch.randn(512, 256)
    plain = mixprec.apply(mlp(), "32-true")
    stored = mixprec.apply(mlp(), mixprec.PolicyMap("32-true", activations=option))
    assert wrapped(stored) == {"": option}
    kept, small = sum(saved_bytes(plain, x).values()), sum(saved_bytes(stored, x).values())
    assert kept == 6 * 512 * 256 * 4  # each Tanh's output (the next Linear's input), float32
    assert small <= at_most * kept

    def step(model):
        return lambda: model(x).sum().backward()

    _, plain_peak = measured(torch.device("cpu"), step(plain))
    _, stored_peak = measured(torch.device("cpu"), step(stored))
    # the codec's float32 temporaries take some of it back, one layer at a time
    assert stored_peak < plain_peak - 0.25 * kept


def test_storage_options_train_close_to_keep():
    x, y = torch.randn(64, 256), torch.randn(64, 1)
    grads = {}
    for option in ("keep", "bf16", "fp8"):
        model = mixprec.apply(mlp(), mixprec.PolicyMap("32-true", activations=option))
        nn.functional.mse_loss(model(x), y).backward()
        grads[option] = torch.cat([p.grad.flatten() for p in model.parameters()])
    for option, tolerance in (("bf16", 0.02), ("fp8", 0.1)):
        error = (grads[option] - grads["keep"]).norm() / grads["keep"].norm()
        assert 0 < error < tolerance, option


def test_a_deep_copy_of_a_stored_model_stores_too():
    model = mixprec.apply(mlp(), mixprec.PolicyMap("32-true", activations="fp8"))
    twin = copy.deepcopy(model)
    assert wrapped(twin) == {"": "fp8"} and twin.__dict__["forward"].module is twin
    x = torch.randn(8, 256)
    assert sum(saved_bytes(twin, x).values()) == sum(saved_bytes(model, x).values())
    assert FP8.block == 256
