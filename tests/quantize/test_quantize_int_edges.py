"""int8/int4 layers at their edges: a checkpoint loaded into a model cast first, casts of
tied codes, casts refused before anything changes, peft's trained copies, selective
checkpointing of `torch._int_mm`, and LoRA under DDP."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from spawning import WORLD, run_ranks
from torch import nn
from torch.nn.utils import prune

import mixprec
import mixprec.quantize.int8 as int8
from mixprec.activations.recompute import recomputed
from mixprec.convert import applied_policy
from mixprec.quantize import dequantize, enable_lora, quantize
from mixprec.quantize.float8 import convert_to_float8

SPECS = ["int8", "int4/16"]
CAST_POLICY = {torch.float16: "16-true", torch.bfloat16: "bf16-true"}


def _tiny_rows_net(spec: str, seed: int = 0) -> nn.Sequential:
    """A quantized Linear(32, 8) whose weights are at most 1e-5 (row 3: 3e-6): float32
    scales a float16 rounded to nearest would turn to 0."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 8))
    with torch.no_grad():
        model[0].weight.mul_(1e-5 / model[0].weight.abs().max())
        model[0].weight[3].mul_(0.3)
    quantize(model, spec)
    return model


def _cast(model: nn.Module, dtype: torch.dtype, how: str) -> None:
    if how == "method":
        model.to(dtype)
    else:
        mixprec.apply(model, CAST_POLICY[dtype], warn=False)


def _assert_same_state(got: nn.Module, want: nn.Module) -> None:
    want_state = want.state_dict()
    for key, t in got.state_dict().items():
        assert t.dtype == want_state[key].dtype, key
        assert torch.equal(t, want_state[key]), key


@pytest.mark.parametrize("how", ["method", "apply"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", SPECS)
def test_float32_scales_loaded_into_a_16_bit_model_are_requantized_as_a_cast_is(spec, dtype, how):
    """Set up first (``.half()``, `apply`), then resume: the float32 scales were copied into
    the 16-bit buffers rounded to nearest, against codes made for the float32 ones (a float16
    row of tiny weights got scale 0 and came back all zeros). Loaded, they requantize into the
    buffers' dtype, bit for bit as loading first and casting after does."""
    state = _tiny_rows_net(spec).state_dict()
    want = _tiny_rows_net(spec, seed=1)
    want.load_state_dict(state)
    _cast(want, dtype, how)
    got = _tiny_rows_net(spec, seed=1)
    _cast(got, dtype, how)
    got.load_state_dict(state)
    _assert_same_state(got, want)
    assert (got[0].dequantized_weight().abs().amax(dim=1) > 0).all()
    # scales that fit the buffers' dtype load as they are, codes untouched
    back = _tiny_rows_net(spec, seed=1)
    back.load_state_dict(got.state_dict())
    assert torch.equal(back[0].qweight, got[0].qweight)
    assert torch.equal(back[0].weight_scale, got[0].weight_scale.float())


def _tied(spec: str) -> nn.ModuleDict:
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(64, 32), "head": nn.Linear(32, 64, bias=False)})
    model["head"].weight = model["emb"].weight
    with torch.no_grad():
        model["emb"].weight[0] = torch.randn(32) * 1e-6  # scales that do not fit float16
    quantize(model, spec)
    return model


@pytest.mark.parametrize("cast", ["half", "bfloat16"])
@pytest.mark.parametrize("spec", SPECS)
def test_a_cast_of_tied_codes_keeps_one_copy_and_dequantize_ties_them_again(spec, cast):
    """``model.half()`` requantized each side of a tied embedding and head on its own: two
    copies of the codes (twice the bytes), and `dequantize` no longer tied the weights."""
    model = _tied(spec)
    alone = copy.deepcopy(model["head"])
    getattr(alone, cast)()
    getattr(model, cast)()
    emb, head = model["emb"], model["head"]
    for key in int8.CODE_BUFFERS:
        if key in head._buffers:
            assert emb._buffers[key] is head._buffers[key], key
            assert torch.equal(head._buffers[key], alone._buffers[key]), key
    assert head.weight_scale.dtype == getattr(torch, {"half": "float16"}.get(cast, cast))
    dequantize(model)
    assert model["emb"].weight is model["head"].weight


@pytest.mark.parametrize("spec", SPECS)
def test_peft_modules_to_save_copies_stay_float_and_train(spec):
    """peft's ``modules_to_save`` copy of a layer (its trainable head) was quantized like any
    Linear: its weight became codes and silently stopped training. It stays float, saying
    why; the frozen original beside it quantizes."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    config = peft.LoraConfig(r=4, target_modules=["0"], modules_to_save=["2"])
    model = peft.get_peft_model(model, config)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    result = quantize(model, spec)
    saved = "base_model.model.2.modules_to_save.default"
    assert saved not in result.quantized
    assert "modules_to_save" in result.skipped[saved]
    assert "base_model.model.2.original_module" in result.quantized
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == trainable
    model(torch.randn(4, 32)).sum().backward()
    assert sorted(n for n, p in model.named_parameters() if p.grad is not None) == trainable


def test_selective_checkpointing_of_the_int_mm_path_keeps_the_saved_sums_unchanged(
    monkeypatch,
):
    """int8_linear scaled `torch._int_mm`'s output in place, the output selective
    checkpointing saves (it saves every `_int_mm`): the backward failed with "Tensor cached
    during selective activation checkpoint has been mutated". (Taken on every CPU here; a
    VNNI CPU takes it for one token.)"""
    monkeypatch.setattr(int8, "_takes_int_mm", lambda *args: True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 16))
    quantize(model, "int8")
    x = torch.randn(1, 32)

    def grads(selective: bool) -> list[torch.Tensor]:
        model.zero_grad()
        xi = x.clone().requires_grad_(True)
        if selective:
            out = recomputed(model, "selective", (xi,), {})
        else:
            out = model(xi)
        out.pow(2).sum().backward()
        return [xi.grad, *(p.grad for p in model.parameters())]

    for plain, selective in zip(grads(False), grads(True), strict=True):
        assert torch.equal(plain, selective)


def test_a_16_bit_apply_refuses_scales_it_cannot_store_before_changing_anything():
    """apply("16-true") over float32 scales float16 cannot hold (a 7e4 weight) raised from
    the middle of the conversion: layers before it already float16, no policy recorded, and
    a message naming no layer that said to quantize in float32. Refused first, naming the
    layer, the dtype and what is accepted; `cast_scales` changes nothing when it refuses."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    with torch.no_grad():
        model[1].weight[0, 0] = 7e4
    quantize(model, "int8")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"'1'.*torch\.float16.*bf16.*'32-true'") as refused:
        mixprec.apply(model, "16-true", warn=False)
    assert "quantize it with" not in str(refused.value)
    assert applied_policy(model) is None
    assert "forward" not in model.__dict__
    for key, t in model.state_dict().items():
        assert t.dtype == before[key].dtype and torch.equal(t, before[key]), key
    layer = model[1]
    buffers = dict(layer._buffers)
    with pytest.raises(ValueError, match="torch.float16"):
        layer.cast_scales(torch.float16)
    assert all(layer._buffers[k] is t for k, t in buffers.items())
    # loaded into a float16 model, they are refused too, naming the layer
    half = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    quantize(half, "int8")
    half.half()
    with pytest.raises(RuntimeError, match="scales of '1' in torch.float16"):
        half.load_state_dict(before)
    # what the message offers is accepted
    mixprec.apply(model, mixprec.PolicyMap("16-true", {"1": "32-true"}), warn=False)
    assert model[0].weight.dtype == torch.float16
    assert model[1].weight_scale.dtype == torch.float32
    mixprec.remove(model)
    mixprec.apply(model, "bf16-true", warn=False)
    assert model[1].weight_scale.dtype == torch.bfloat16


def _ddp_lora_worker(rank: int) -> None:
    torch.manual_seed(0)
    wrapped = nn.Sequential(nn.Linear(32, 16))
    quantize(wrapped, "int8")
    ddp = nn.parallel.DistributedDataParallel(wrapped)
    with pytest.raises(ValueError, match="enable LoRA before wrapping"):
        enable_lora(ddp, 2)
    assert wrapped[0].lora_rank == 0
    # under an initialized group, a model not wrapped yet takes adapters; wrapped after,
    # DDP keeps its replicas equal
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16))
    quantize(model, "int8")
    adapters = enable_lora(model, 2)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(adapters, lr=0.5)
    torch.manual_seed(100 + rank)  # each rank its own batch
    ddp(torch.randn(4, 32)).pow(2).mean().backward()
    opt.step()
    mine = model[0].lora_B.detach().clone()
    first = mine.clone()
    torch.distributed.broadcast(first, src=0)
    assert mine.abs().max() > 0 and torch.equal(mine, first)


@pytest.mark.slow
def test_enable_lora_on_a_ddp_wrapped_model_is_refused():
    """Adapters added to a model DDP wraps already are not in its reducer: each rank trained
    its own and the replicas drifted apart, with no word."""
    run_ranks(_ddp_lora_worker, nprocs=WORLD)


def test_a_cast_of_a_model_of_many_quantized_layers_keeps_every_layer():
    """The casts' memo drops its dead entries past 64 layers; it asked a live code tensor
    for its truth value and every cast of a larger model (``.cpu()``, ``.float()``) raised."""
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(70)])
    mixprec.quantize(model, "int8")
    codes = [layer.qweight for layer in model]
    model.cpu().float()
    assert all(layer.qweight is code for layer, code in zip(model, codes, strict=True))


def test_remove_casts_int8_scales_back_as_half_does_not_to_the_nearest():
    """`remove` restored a float16 model's scales with a plain cast: a row of weights below
    float16's normal range lost its scale to rounding (the row read as zeros)."""
    from mixprec.quantize import merge_lora

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 4)).half()
    with torch.no_grad():
        model[0].weight[0] = torch.randn(32).half() * 1e-6
    quantize(model, "int8")
    mixprec.apply(model, "bf16-mixed", warn=False)  # float32 scales
    enable_lora(model, rank=2)
    merge_lora(model)  # a no-op merge requantized in float32: scales no float16 holds
    expected = copy.deepcopy(model[0]).half()
    mixprec.remove(model)
    assert model[0].weight_scale.dtype == torch.float16
    assert torch.equal(model[0].dequantized_weight(), expected.dequantized_weight())
    assert model[0].dequantized_weight()[0].abs().max() > 1e-6


@pytest.mark.parametrize("mode", ["int8", "mxfp8"])
def test_a_layer_whose_forward_is_replaced_on_the_instance_stays_float_with_the_reason(mode):
    """A swapped layer dropped a forward replaced on the instance (as accelerate's hooks
    replace it): the model computed without it, silently. Such a layer is skipped, in
    quantize and in apply's explanation; mixprec's own regions do not count."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    plain = model[0].forward
    model[0].forward = lambda x: plain(x) * 0.5
    x = torch.randn(4, 64)
    expected = model(x)
    result = quantize(model, mode)
    assert "forward is replaced on the instance" in result.skipped["0"]
    assert list(result.quantized) == ["1"] and type(model[0]) is nn.Linear
    assert torch.allclose(model(x), expected, rtol=0.1, atol=0.05)
    applied = mixprec.apply(nn.Sequential(nn.Linear(64, 64)), "bf16-mixed", warn=False)
    assert "0" in mixprec.explain(applied, f"{mode}_from_bf16-mixed").quantization
    assert "replaced" not in mixprec.explain(applied, f"{mode}_from_bf16-mixed").quantization["0"]


def _reparametrized(how: str, tensor: str) -> nn.Linear:
    layer = nn.Linear(64, 64)
    if how == "weight_norm":
        with warnings.catch_warnings():  # (deprecated for torch.nn.utils.parametrizations')
            warnings.simplefilter("ignore", FutureWarning)
            return nn.utils.weight_norm(layer)
    if how == "spectral_norm":
        return nn.utils.spectral_norm(layer)
    prune.l1_unstructured(layer, tensor, amount=0.3)
    return layer


@pytest.mark.parametrize(
    ("how", "tensor"),
    [
        ("weight_norm", "weight"),
        ("spectral_norm", "weight"),
        ("pruning", "weight"),
        ("pruning", "bias"),
    ],
)
@pytest.mark.parametrize("mode", ["int8", "mxfp8", "float8"])
def test_a_layer_reparametrized_by_torch_nn_utils_stays_float_with_the_reason(how, tensor, mode):
    """torch.nn.utils's weight_norm, spectral_norm and pruning recompute the weight (or bias)
    in a forward pre-hook from parameters of the layer's own (weight_g, weight_orig): the
    swapped layer carried the hook without them, and its forward raised AttributeError.
    Such a layer is skipped, saying what to remove, in explain, quantize and
    convert_to_float8."""
    torch.manual_seed(0)
    model = nn.Sequential(_reparametrized(how, tensor), nn.Linear(64, 64))
    reason = f"torch.nn.utils's {how} recomputes its {tensor} before each forward"
    if mode == "float8":
        skipped: dict[str, str] = {}
        convert_to_float8(model, skip_small=False, skipped=skipped)
    else:
        said = mixprec.explain(model, f"{mode}_from_float32")
        assert said.quantized == ["1"] and reason in said.skipped["0"]
        skipped = quantize(model, mode).skipped
    assert list(skipped) == ["0"] and reason in skipped["0"]
    assert type(model[0]) is nn.Linear and type(model[1]) is not nn.Linear
    model(torch.randn(4, 64))  # (raised AttributeError)


@pytest.mark.parametrize("mode", ["int8", "int4", "mxfp8"])
def test_dequantize_of_a_bare_quantized_layer_returns_its_float_layer(mode):
    """A quantized layer given alone came back still quantized (only children were
    swapped); it gives its float layer now, with the weight it held."""
    layer = nn.Linear(64, 32)
    wrapper = nn.Sequential(layer)
    quantize(wrapper, mode)
    quantized = wrapper[0]
    expected = dequantize(copy.deepcopy(wrapper))[0]
    back = dequantize(quantized)
    assert type(back) is nn.Linear
    assert torch.equal(back.weight, expected.weight) and torch.equal(back.bias, expected.bias)


def _large_weight_net(spec: str) -> nn.Sequential:
    """Linear, ReLU, quantized Linear whose weight holds one 1e7: its float32 scale is past
    float16's range."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    with torch.no_grad():
        model[2].weight[3, 4] = 1e7
    quantize(model, spec)
    return model


@pytest.mark.parametrize("spec", ["int8", "int4/32"])
def test_a_refused_cast_leaves_the_refusing_layer_as_it_was(spec):
    """Found by a review: ``model.half()`` cast the layer's scales (to float16's nearest:
    inf for a 1e7 weight) before it refused them, and left them beside codes made for the
    float32 ones: after ``model.float()``, the usual fallback, every output was NaN. The
    refusing layer is left as it was: its codes, scales and bias untouched."""
    model = _large_weight_net(spec)
    layer = model[2]
    h = torch.randn(4, 32)
    want = layer(h)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ValueError, match=r"torch\.float16"):
        model.half()
    for key, t in layer.state_dict().items():
        assert t.dtype == before[key].dtype and torch.equal(t, before[key]), key
    model.float()  # (the Linear before it was cast already: it is float again)
    assert torch.equal(layer(h), want)
    assert torch.isfinite(model(torch.randn(4, 32))).all()


@pytest.mark.parametrize("spec", ["int8", "int4/32"])
def test_a_refused_load_leaves_the_layers_codes_and_scales_as_they_were(spec):
    """Found by a review: a checkpoint whose float32 scales a float16 layer cannot store was
    reported (RuntimeError) but its scales copied in all the same, rounded to nearest (inf)
    beside the layer's own codes: NaN outputs. The refused codes and scales are not loaded
    (as torch skips a tensor of the wrong shape), and not reported missing either."""
    state = _large_weight_net(spec).state_dict()
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    quantize(model, spec)
    model.half()
    layer = model[2]
    codes = {k: v.clone() for k, v in layer.code_buffers().items()}
    with pytest.raises(RuntimeError, match="scales of '2' in torch.float16") as refused:
        model.load_state_dict(state)
    assert "Missing key" not in str(refused.value)
    for key, t in layer.code_buffers().items():
        assert t.dtype == codes[key].dtype and torch.equal(t, codes[key]), key
    assert torch.isfinite(layer(torch.randn(2, 32, dtype=torch.float16))).all()
