"""Quantized policies end to end: float8 and int8-LoRA training through the Trainer with
checkpoint resume, `torch.compile` of quantized layers, and DDP replicas (issue 12)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainers import QUIET

import mixprec
from mixprec.quantize import Int8Linear, enable_lora, merge_lora
from mixprec.quantize.float8 import DELAYED_BUFFERS, Float8Linear, convert_to_float8
from mixprec.trainer import Callback, Trainer

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def loader() -> DataLoader:
    """8 shuffled batches of 8 (shuffled from torch's global generator, which resumes)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    return DataLoader(TensorDataset(x, 0.3 * x[:, :2]), batch_size=8, shuffle=True)


def float8_net(seed: int) -> nn.Module:
    """Linear(16, 1040) converts under every recipe (out > 1024, multiples of 16); the head
    Linear(1040, 2) is too small for tensorwise/delayed and stays float."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 1040), nn.Tanh(), nn.Linear(1040, 2))


def int8_lora_net(seed: int) -> nn.Module:
    """An int8 model with rank-4 adapters on both Linear layers."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2))
    mixprec.quantize(model, "int8")
    enable_lora(model, rank=4)
    return model


def fit(model: nn.Module, spec: str, root: Path, steps: int, ckpt: Path | None = None) -> Trainer:
    trainer = Trainer(
        precision=spec,
        max_steps=steps,
        seed=3,
        deterministic=True,
        allow_slow_precision=True,
        default_root_dir=root,
        **QUIET,
    )
    trainer.fit(model, loader(), loss_fn=F.mse_loss, optimizer=ADAMW, ckpt_path=ckpt)
    return trainer


def assert_resume_is_bit_identical(
    make: Callable[[int], nn.Module], spec: str, tmp: Path
) -> nn.Module:
    """12 steps straight vs 5 steps, a Trainer checkpoint, and a resume into a model built
    from another seed: every state-dict entry (buffers included) is equal; returns the
    straight run's model."""
    straight = make(0)
    fit(straight, spec, tmp / "a", 12)
    first = make(0)
    path = fit(first, spec, tmp / "b", 5).save_checkpoint(tmp / "half.ckpt")
    resumed = make(1)
    assert fit(resumed, spec, tmp / "c", 12, ckpt=path).global_step == 12
    a, b = straight.state_dict(), resumed.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    return straight


@pytest.mark.parametrize(
    "spec",
    [
        "float8/delayed:16_from_float32",
        "float8/delayed:16_from_mixed_bfloat16",
        "float8_from_float32",
        "float8/rowwise_from_float32",
    ],
)
def test_float8_trainer_resume_is_bit_identical(tmp_path, spec):
    model = assert_resume_is_bit_identical(float8_net, spec, tmp_path)
    assert isinstance(model[0], Float8Linear) and type(model[2]) is nn.Linear
    if "delayed" in spec:
        layer = model[0]
        assert set(DELAYED_BUFFERS) <= set(dict(layer.named_buffers()))
        # 12 steps recorded one amax per step in each 16-long history, newest first
        for name in ("input", "weight", "grad_output"):
            history = getattr(layer, f"{name}_amax_history")
            assert bool((history[:12] > 0).all()) and bool((history[12:] == 0).all()), name
            assert getattr(layer, f"{name}_scale").item() > 0


@pytest.mark.parametrize("spec", ["bf16-mixed", "16-mixed"])
def test_int8_lora_resumes_bit_identically_under_mixed_policies(tmp_path, spec):
    assert_resume_is_bit_identical(int8_lora_net, spec, tmp_path)


def test_int8_lora_trains_only_the_adapters_and_resumes_bit_identically(tmp_path):
    model = int8_lora_net(0)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora" not in k}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{i}.lora_{ab}" for i in (0, 2) for ab in "AB"
    }
    x = loader().dataset.tensors[0]
    y0 = model(x)
    fit(model, "32-true", tmp_path / "t", 6)
    after = model.state_dict()
    for name, value in frozen.items():  # int8 weights, scales and (frozen) biases
        assert torch.equal(after[name], value), name
    assert after["0.qweight"].dtype == torch.int8
    assert all(bool(after[f"{i}.lora_B"].abs().sum() > 0) for i in (0, 2))
    assert not torch.allclose(model(x), y0)

    straight = assert_resume_is_bit_identical(int8_lora_net, "32-true", tmp_path / "r")
    with torch.no_grad():
        unmerged = straight(x)
        assert merge_lora(straight) == 2
        merged = straight(x)
    assert not any("lora" in n for n, _ in straight.named_parameters())
    assert all(isinstance(straight[i], Int8Linear) for i in (0, 2))
    # the merged weight is quantized again: outputs move by int8 rounding only
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=0.02 * unmerged.abs().max().item())


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_lora_on_a_quantized_embedding_trains_merges_and_dequantizes(mode):
    """Adapters on an int8/int4 Embedding (padding_idx 0): they start as a no-op, only A/B
    train, the padding row stays the quantized table's, merging and dequantizing keep the
    outputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(40, 32, padding_idx=0), nn.Linear(32, 40))
    mixprec.quantize(model, mode)
    emb = model[0]
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    idx = torch.tensor([[0, 3, 7, 3], [12, 0, 39, 5]])
    y0 = model(idx)
    params = enable_lora(emb, rank=4)
    assert params == [emb.lora_A, emb.lora_B] and emb.lora_A.shape == (4, 40)
    assert emb.lora_B.shape == (32, 4) and torch.equal(model(idx), y0)
    opt = torch.optim.AdamW(params, lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        opt.step()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in frozen.items())
    with torch.no_grad():
        rows, table = emb(idx), emb.dequantized_weight()
        assert torch.equal(rows[0, 0], table[0])  # padding row unchanged
        assert not torch.allclose(rows, table[idx])
        torch.testing.assert_close(rows, table[idx] + emb.lora_delta()[idx], rtol=1e-5, atol=1e-6)
        as_float = mixprec.quantize.dequantize(copy.deepcopy(model))
        assert type(as_float[0]) is nn.Embedding
        torch.testing.assert_close(as_float[0](idx), rows, rtol=1e-5, atol=1e-6)
        assert merge_lora(model) == 1 and emb.lora_A is None
        tolerance = {"int8": 0.01, "int4": 0.1}[mode] * rows.abs().max().item()
        torch.testing.assert_close(emb(idx), rows, rtol=0, atol=tolerance)


def compiled_matches_eager(make: Callable[[], nn.Module]) -> None:
    """Forward and backward of a compiled copy equal eager's within tolerance, buffers
    (delayed amax histories) included, and dynamo traces the model in one graph."""
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(2))
    eager, compiled = make(), make()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(make())(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    fn = torch.compile(compiled)
    for _ in range(2):
        for model, call in ((eager, eager), (compiled, fn)):
            model.zero_grad()
            call(x).square().mean().backward()
    torch.testing.assert_close(fn(x), eager(x), rtol=1e-5, atol=1e-5)
    grads_e = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    grads_c = {n: p.grad for n, p in compiled.named_parameters() if p.grad is not None}
    assert grads_e.keys() == grads_c.keys() and grads_e
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-6)
    for (name, a), (_, b) in zip(eager.named_buffers(), compiled.named_buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=0, msg=name)


def test_trainer_compile_of_a_float8_delayed_model_matches_eager(tmp_path):
    """`Trainer(compile=True)`: the same parameters and amax histories as an eager run."""
    models = {compile: float8_net(0) for compile in (False, True)}
    for compile, model in models.items():
        trainer = Trainer(
            precision="float8/delayed:16_from_float32",
            max_steps=4,
            seed=3,
            allow_slow_precision=True,
            compile=compile,
            default_root_dir=tmp_path,
            **QUIET,
        )
        trainer.fit(model, loader(), loss_fn=F.mse_loss, optimizer=ADAMW)
    eager, compiled = (m.state_dict() for m in models.values())
    assert list(eager) == list(compiled)
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-5, atol=1e-6, msg=name)


def _small(mode: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    if mode == "int8":
        mixprec.quantize(model, "int8")
        enable_lora(model, rank=4)  # something to differentiate
    else:
        convert_to_float8(model, recipe=mode, skip_small=False)
    return model


@pytest.mark.parametrize("mode", ["int8", "delayed"])
def test_torch_compile_matches_eager_without_graph_breaks(mode):
    compiled_matches_eager(functools.partial(_small, mode))


class DumpParams(Callback):
    """Each rank saves its final state dict to ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_fit_end(self, trainer, model):
        rank = trainer.strategy.global_rank
        torch.save(model.state_dict(), self.directory / f"rank{rank}.pt")


@pytest.mark.slow
def test_ddp_float8_delayed_replicas_are_identical(tmp_path):
    """Two gloo ranks, different data: identical parameters, amax histories and scales
    (the Trainer all-reduces the histories to their max every step)."""
    model = float8_net(0)
    trainer = Trainer(
        precision="float8/delayed:16_from_float32",
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_steps=4,
        allow_slow_precision=True,
        callbacks=[DumpParams(tmp_path)],
        default_root_dir=tmp_path,
        **QUIET,
    )
    trainer.fit(model, loader(), loss_fn=F.mse_loss, optimizer=ADAMW)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0.keys() == r1.keys()
    for name, value in r0.items():
        assert torch.equal(value, r1[name]), name
    assert (r0["0.grad_output_amax_history"][:4] > 0).all()  # four steps recorded


@pytest.mark.slow
def test_ddp_int8_lora_replicas_are_identical_and_the_int8_weights_untouched(tmp_path):
    model = int8_lora_net(0)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora" not in k}
    trainer = Trainer(
        precision="bf16-mixed",
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_steps=4,
        allow_slow_precision=True,
        callbacks=[DumpParams(tmp_path)],
        default_root_dir=tmp_path,
        **QUIET,
    )
    trainer.fit(model, loader(), loss_fn=F.mse_loss, optimizer=ADAMW)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0.keys() == r1.keys() == model.state_dict().keys()
    for name, value in r0.items():
        assert torch.equal(value, r1[name]), name
        assert torch.equal(value, model.state_dict()[name]), name
    for name, value in frozen.items():
        assert torch.equal(r0[name], value), name
    assert bool(r0["0.lora_B"].abs().sum() > 0)
