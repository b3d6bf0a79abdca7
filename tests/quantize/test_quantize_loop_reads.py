"""A parent reading its children's weights through a loop variable, a comprehension or a
variable index (MoE experts stacked, layers run with ``F.linear``) is a parent read: those
layers stay float, with the reason, as a parent reading ``self.proj.weight`` does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.quantize.float8 import convert_to_float8


def _linears(n: int = 2, bias: bool = True) -> nn.ModuleList:
    return nn.ModuleList([nn.Linear(64, 64, bias=bias) for _ in range(n)])


class _Loop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = _linears()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(F.linear(x, layer.weight, layer.bias))
        return x


class _StackedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = _linears(bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.stack([e.weight for e in self.experts])
        return torch.einsum("bi,eoi->beo", x, w).sum(1)


class _VariableIndex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = _linears()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.layers)):
            x = F.linear(x, self.layers[i].weight)
        return x


class _DictItems(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({"a": nn.Linear(64, 64), "b": nn.Linear(64, 64)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _name, m in self.blocks.items():
            x = F.linear(x, m.weight, m.bias)
        return x


class _DictValues(_DictItems):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(F.linear(x, m.weight) for m in self.blocks.values())


class _Enumerated(_Loop):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = F.linear(x, layer.weight) * (i + 1)
        return x


class _Zipped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = _linears(), _linears()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(
            self.up,
            self.down,
            strict=True,
        ):
            x = F.linear(torch.relu(F.linear(x, up.weight)), down.weight)
        return x


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Module(), nn.Module()])
        for block in self.blocks:
            block.layers = _linears(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            for layer in block.layers:
                x = F.linear(x, layer.weight)
        return x


class _FusedQKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(64, 64, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.cat([lin.weight for lin in (self.q, self.k, self.v)])
        return F.linear(x, w).sum(-1, keepdim=True).expand(-1, 64)


class _LocalTuple(_FusedQKV):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projs = (self.q, self.k, self.v)
        return sum(F.linear(x, lin.weight) for lin in projs)


READERS = {
    _Loop: ["0.layers.0", "0.layers.1"],
    _StackedExperts: ["0.experts.0", "0.experts.1"],
    _VariableIndex: ["0.layers.0", "0.layers.1"],
    _DictItems: ["0.blocks.a", "0.blocks.b"],
    _DictValues: ["0.blocks.a", "0.blocks.b"],
    _Enumerated: ["0.layers.0", "0.layers.1"],
    _Zipped: ["0.down.0", "0.down.1", "0.up.0", "0.up.1"],
    _Nested: ["0.blocks.0.layers.0", "0.blocks.1.layers.0"],
    _FusedQKV: ["0.k", "0.q", "0.v"],  # (a tuple written out: its items, not their children)
    _LocalTuple: ["0.k", "0.q", "0.v"],
}


@pytest.mark.parametrize("reader", list(READERS), ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("mode", ["mxfp8", "int8"])
def test_a_weight_read_through_a_loop_or_index_is_a_parent_read(reader, mode):
    """Only literal chains (``self.layers[0].weight``) counted: mxfp8 reported these layers
    quantized while the model computed in float (bit-identical output); int8 raised
    AttributeError at the forward. They are skipped now, with the reason, in explain, apply
    and quantize."""
    torch.manual_seed(0)
    model, x = nn.Sequential(reader()), torch.randn(3, 64)
    expected = model(x)
    what = "computes with its weight" if mode == "mxfp8" else "reads its weight"
    said = mixprec.explain(model, f"{mode}_from_float32")
    assert said.quantized == []
    for path in READERS[reader]:
        assert f"its parent {reader.__name__} {what}" in said.skipped[path]
    mixprec.apply(model, f"{mode}_from_float32", warn=False)
    assert all(type(model.get_submodule(path)) is nn.Linear for path in READERS[reader])
    assert torch.equal(model(x), expected)
    result = mixprec.quantize(nn.Sequential(reader()), mode)
    assert sorted(result.skipped) == READERS[reader] and not result.quantized


@pytest.mark.parametrize("reader", list(READERS), ids=lambda cls: cls.__name__)
def test_float8_leaves_a_layer_read_through_a_loop_float(reader):
    """convert_to_float8 swapped these layers for Float8Linears the parent passed by."""
    skipped: dict[str, str] = {}
    model = convert_to_float8(nn.Sequential(reader()), skip_small=False, skipped=skipped)
    assert sorted(skipped) == READERS[reader]
    assert all(f"its parent {reader.__name__} computes" in why for why in skipped.values())
    assert all(type(model.get_submodule(path)) is nn.Linear for path in READERS[reader])


class _CallsEachLayer(_Loop):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("mode", ["mxfp8", "int8"])
def test_a_loop_calling_each_layer_quantizes_them(mode):
    """A loop calling its layers reads no weight itself: they are quantized."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_CallsEachLayer()), torch.randn(3, 64)
    result = mixprec.quantize(model, mode)
    assert sorted(result.quantized) == ["0.layers.0", "0.layers.1"] and not result.skipped
    assert model(x).shape == (3, 64)
