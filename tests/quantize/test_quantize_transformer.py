"""torch's nn.TransformerEncoder under quantized and float8 layers: its fused inference paths
read the feed-forward weights themselves, so a swap turns them off (and back on)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from mixprec import PolicyMap, apply, quantize, remove
from mixprec.quantize import dequantize
from mixprec.quantize.float8 import convert_from_float8, convert_to_float8


def encoder() -> nn.Sequential:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=True))


SWAPS: dict[str, Callable[[nn.Module], object]] = {
    "int8": lambda m: quantize(m, "int8"),
    "int4": lambda m: quantize(m, "int4", group_size=32),
    "mxfp8": lambda m: quantize(m, "mxfp8"),
    "float8": lambda m: convert_to_float8(m, skip_small=False, emulate=True),
}


@pytest.mark.parametrize("swap", list(SWAPS))
@pytest.mark.parametrize("padded", [False, True])
def test_an_encoder_in_eval_without_gradients_runs_its_swapped_layers(swap, padded):
    """Without gradients in eval mode the layer's fused path read ``linear1.weight``: an int8
    or int4 layer has none (AttributeError), and a float8 or block-scaled layer's forward was
    passed over (its float weights used as they are). With a padding mask the encoder's
    nested-tensor path read them too. Now both are off and the swapped layers compute."""
    model = encoder()
    SWAPS[swap](model)
    assert type(model[0].layers[0].linear1) is not nn.Linear
    model.eval()
    x = torch.randn(2, 5, 64)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2]) if padded else None
    with torch.no_grad():
        fused = model[0](x, src_key_padding_mask=mask)
    slow = model[0](x, src_key_padding_mask=mask)  # gradients on: torch's layer-by-layer path
    if padded:  # the padded tokens' outputs are whatever each path leaves there
        fused, slow = fused[0], slow[0]
    # the attention's own fused kernel still runs (it reads no swapped layer): float32
    # rounding apart; a float8 layer passed over was off by ~1e-2
    torch.testing.assert_close(fused, slow.detach())


LATER_LAYER = r"0\.layers\.1\..*"
LATER_SWAPS: dict[str, Callable[[nn.Module], object]] = {
    "int8": lambda m: quantize(m, "int8", filter=LATER_LAYER),
    "float8": lambda m: convert_to_float8(m, skip_small=False, filter=LATER_LAYER),
    "apply": lambda m: apply(
        m, PolicyMap("32-true", {r"0\.layers\.1\.linear\d": "int8_from_float32"}), warn=False
    ),
}


@pytest.mark.parametrize("swap", list(LATER_SWAPS))
def test_an_encoder_whose_later_layer_is_swapped_runs_a_padded_batch(swap):
    """The encoder's nested-tensor path was turned off only when its first layer changed:
    with a later layer quantized, a padded batch in eval mode without gradients was nested
    by the untouched first layer and the swapped one, off its fused path, failed on it
    (RuntimeError: NestedTensorImpl doesn't support sizes). Now any changed layer turns it
    off, and turning the layer back into float turns it back on."""
    model = encoder()
    LATER_SWAPS[swap](model)
    stack = model[0]
    assert type(stack.layers[0].linear1) is nn.Linear
    assert type(stack.layers[1].linear1) is not nn.Linear
    assert not stack.use_nested_tensor
    model.eval()
    x = torch.randn(2, 5, 64)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        fused = stack(x, src_key_padding_mask=mask)
    torch.testing.assert_close(fused[0], stack(x, src_key_padding_mask=mask)[0].detach())
    if swap == "apply":
        remove(model)  # (its int8 layers stay)
    (convert_from_float8 if swap == "float8" else dequantize)(model)
    assert stack.use_nested_tensor and not hasattr(stack, "_mixprec_fast_path")


@pytest.mark.parametrize(
    ("swap", "undo"),
    [("int8", dequantize), ("mxfp8", dequantize), ("float8", convert_from_float8)],
)
def test_turning_the_layers_back_into_float_turns_the_fused_paths_back_on(swap, undo):
    model = encoder()
    layer, stack = model[0].layers[0], model[0]
    before = (layer.activation_relu_or_gelu, stack.use_nested_tensor)
    SWAPS[swap](model)
    assert (layer.activation_relu_or_gelu, stack.use_nested_tensor) == (0, False)
    undo(model)
    assert type(layer.linear1) is nn.Linear
    assert (layer.activation_relu_or_gelu, stack.use_nested_tensor) == before
    assert not hasattr(layer, "_mixprec_fast_path") and not hasattr(stack, "_mixprec_fast_path")


def test_an_encoder_whose_feed_forward_is_left_float_keeps_its_fused_paths():
    model = encoder()
    quantize(model, "int8", filter=lambda path, m: "linear" not in path)
    layer = model[0].layers[0]
    assert type(layer.linear1) is nn.Linear and layer.activation_relu_or_gelu == 1
    assert model[0].use_nested_tensor


def test_a_copy_of_a_quantized_encoder_keeps_its_fused_paths_off():
    model = encoder()
    quantize(model, "int8")
    twin = copy.deepcopy(model).eval()
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        assert torch.equal(twin(x), model.eval()(x))


def test_a_region_on_a_feed_forward_linear_is_not_passed_over():
    """A rule giving linear1 a policy of its own wraps its forward in a region; the fused
    path read its weight itself, passing the region's casts over. Now the layer computes as
    it does with gradients on, and `remove` turns the fused paths back on."""
    model = encoder()
    layer = model[0].layers[0]
    apply(model, PolicyMap("32-true", {r".*\.linear1": "bf16-true"}), warn=False)
    assert layer.linear1.weight.dtype == torch.bfloat16
    model.eval()
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        fused = model(x)
    torch.testing.assert_close(fused, model(x).detach())
    assert layer.activation_relu_or_gelu == 0 and not model[0].use_nested_tensor
    remove(model)
    assert layer.activation_relu_or_gelu == 1 and model[0].use_nested_tensor


@pytest.mark.parametrize("path", [r".*\.self_attn", r".*\.norm1", r".*\.norm2"])
@pytest.mark.parametrize("policy", ["bf16-true", "bf16-mixed"])
def test_a_region_on_the_attention_or_a_norm_is_not_passed_over(path, policy):
    """The fused path read the attention's and the norms' weights too: a bf16 attention or
    norm among float32 layers failed there on mixed dtypes, and an autocast region was
    passed over (the layer computed in float32)."""
    model = encoder()
    layer = model[0].layers[0]
    apply(model, PolicyMap("32-true", {path: policy}), warn=False)
    assert layer.activation_relu_or_gelu == 0 and not model[0].use_nested_tensor
    model.eval()
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        fused = model(x)
    # the attention's own fused kernel may still run in bfloat16: bfloat16 rounding apart
    torch.testing.assert_close(fused, model(x).detach(), atol=2e-2, rtol=2e-2)
    remove(model)
    assert layer.activation_relu_or_gelu == 1 and model[0].use_nested_tensor
