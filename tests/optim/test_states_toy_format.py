"""The registry of optimizer-state formats (`mixprec.optim.states.codecs`): a format declared
in one object is parsed, applied, saved, loaded, explained and counted everywhere.

A toy format, declared and registered in this file alone, keeps each moment as int16 codes
(a linear map of the element over its block's largest magnitude, the second moment as its
square root), 32 elements a block: no other file knows it, and everything below reaches it
through the registry."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import PolicyMap, Precision
from mixprec.optim.states import (
    LowBitAdamW,
    StateCodec,
    StateFormat,
    dequantize,
    parse_state_format,
    quantize,
    register_state_format,
    state_bytes,
    state_codec,
    state_kinds,
    unregister_state_format,
)
from mixprec.plan import search
from mixprec.policy.explanation import explain

TOP = 32767.0


class ToyCodec(StateCodec):
    name = "toy16"
    aliases = ("toy",)
    default_block = 32
    code_dtype = torch.int16
    description = "int16 linear codes, one float32 scale per 32 elements"

    def encode(self, x, signed, table):
        if not signed:
            x = x.sqrt()
        absmax = x.abs().amax(dim=1)
        safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        codes = torch.round(x / safe[:, None] * TOP).to(torch.int16)
        return codes.reshape(-1), absmax

    def decode(self, codes, scales, block, signed, table):
        values = codes.to(torch.float32).view(-1, block) / TOP * scales[:, None]
        return values if signed else values * values


@pytest.fixture
def toy() -> Iterator[StateCodec]:
    codec = register_state_format(ToyCodec())
    try:
        yield codec
    finally:
        unregister_state_format("toy16")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(64, 128)  # 8192 weights each: low-bit states
        self.head = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _train(precision: Precision, model: nn.Module, opt, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(16, 64, generator=g)
        precision.backward(F.mse_loss(model(x), x))
        precision.step()


def test_the_toy_is_registered_parsed_and_spelled_by_its_name(toy) -> None:
    assert state_codec("toy") is toy and "toy16" in state_kinds()
    fmt = parse_state_format("TOY/block=64")
    assert fmt == StateFormat("toy16", 64) and fmt.codec is toy
    assert str(fmt) == "toy16/block=64" and str(parse_state_format("toy")) == "toy16"
    # 2 bytes a code and a float32 scale per 32 elements, padding counted
    assert parse_state_format("toy").bytes(100) == 2 * 128 + 4 * 4
    x = torch.randn(3, 50)
    back = dequantize(*quantize(x, "toy"), "toy", x.shape)
    assert float((back - x).abs().max()) < 1e-3 * float(x.abs().max())
    with pytest.raises(ValueError, match="registered already"):
        register_state_format(ToyCodec())


def test_the_toy_is_refused_once_unregistered() -> None:
    with pytest.raises(ValueError, match="unknown state format 'toy16'"):
        parse_state_format("toy16")


def test_the_toy_steps_saves_and_loads_bit_for_bit(toy) -> None:
    model = Net()
    opt = LowBitAdamW(model.parameters(), lr=1e-2, states="toy", compile=False)
    precision = Precision("32-true")
    model, wrapped = precision.setup(model, opt)
    _train(precision, model, wrapped)
    state = opt.state[model.body.weight]
    assert state["format"] == "toy16" and state["exp_avg_codes"].dtype == torch.int16
    assert state["exp_avg_codes"].numel() == 8192 and state["exp_avg_scales"].numel() == 256
    # two weights of 8192 elements, two moments each; the biases' float32 moments
    assert state_bytes(opt) == 4 * StateFormat("toy16").bytes(8192) + 2 * 4 * (128 + 64)

    saved = copy.deepcopy(opt.state_dict())
    twin_model = copy.deepcopy(model)
    twin = LowBitAdamW(twin_model.parameters(), lr=1e-2, states="toy", compile=False)
    twin.load_state_dict(saved)
    twin_precision = Precision("32-true")
    twin_model, twin_wrapped = twin_precision.setup(twin_model, twin)
    _train(precision, model, wrapped, 2)
    _train(twin_precision, twin_model, twin_wrapped, 2)
    for a, b in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(a, b)
    # and into an int8 optimizer: decoded from the toy's codes and stored in int8
    other = LowBitAdamW(copy.deepcopy(model).parameters(), lr=1e-2, states="int8", compile=False)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    moved = other.to_float32_state_dict()["state"][0]["exp_avg"]
    kept = opt.to_float32_state_dict()["state"][0]["exp_avg"]
    assert float((moved - kept).norm() / kept.norm()) < 0.02


def test_a_policy_file_states_rule_applies_and_explain_names_the_toy(toy, tmp_path: Path):
    pmap = PolicyMap("32-true", states={"body": "toy"})
    loaded = PolicyMap.load(pmap.save(tmp_path / "policy.json"))
    assert loaded.states == {"body": "toy16"}
    model = Net()
    precision = Precision(loaded, optimizer_states="int8")
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(precision, model, opt)
    formats = {n: opt.optimizer.state[p]["format"] for n, p in model.named_parameters()}
    assert formats == {
        "body.weight": "toy16",
        "body.bias": "float32",
        "head.weight": "int8",
        "head.bias": "float32",
    }
    said = explain(model, loaded, optimizer_states="int8").states
    assert said["body.weight"] == ("toy16", "state rule 'body'")
    assert "toy16" in str(explain(model, loaded, optimizer_states="int8"))


def test_optimizer_states_takes_the_toy(toy) -> None:
    model = Net()
    precision = Precision("32-true", optimizer_states="toy")
    assert precision.optimizer_states == "toy16"
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(precision, model, opt)
    assert opt.optimizer.state[model.head.weight]["format"] == "toy16"
    assert mixprec.explain(model, "32-true", optimizer_states="toy").states["head.weight"] == (
        "toy16",
        "default",
    )


def test_the_search_counts_the_toys_bytes(toy) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
    batches = [(torch.randn(16, 64), torch.randn(16, 64)) for _ in range(2)]
    common = dict(formats=["32-true"], baseline="32-true", count="training", reps=1)
    report = search(model, batches, F.mse_loss, budget={"memory": 0.8}, states="toy", **common)
    assert report.policy.states == {"0": "toy16", "2": "toy16"}
    fmt = StateFormat("toy16")
    # weights and gradients, the toy's moments of the two big weights; float32 ones of biases
    expected = sum(8 * 8192 + 2 * fmt.bytes(8192) + 16 * b for b in (128, 64))
    assert report.measured["plan"].unit_bytes == expected
