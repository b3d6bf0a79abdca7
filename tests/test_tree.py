"""`mixprec.tree`: every container shape a batch or an output takes, and each place that walks
one (output cast, input conversion, the Trainer's device move, the bench, the doctor)."""

from collections import ChainMap, OrderedDict, UserDict, defaultdict, namedtuple
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec.tree import iter_tensors, map_tensors

f32, f64, f16 = torch.float32, torch.float64, torch.float16

Pair = namedtuple("Pair", "x y")


class TaggedList(list):
    def __init__(self, tag: str, items: Any) -> None:
        super().__init__(items)
        self.tag = tag


class TaggedDict(dict):
    def __init__(self, tag: str, **items: Any) -> None:
        super().__init__(**items)
        self.tag = tag


class Output(OrderedDict):
    """Like transformers' ModelOutput: an ordered mapping whose items are also attributes."""

    def __init__(self, **items: Any) -> None:
        super().__init__(**items)
        for k, v in items.items():
            object.__setattr__(self, k, v)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)


@dataclass
class WithDerived:
    logits: torch.Tensor
    hidden: torch.Tensor = field(init=False)
    note: str = field(init=False, default="unset")


@dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    b: tuple


def _x(dtype=f64):
    return torch.ones(2, dtype=dtype)


def shapes() -> dict[str, Any]:
    derived = WithDerived(_x())
    derived.hidden = _x()
    derived.note = "set in forward"
    return {
        "tuple": (_x(), [_x()]),
        "namedtuple": Pair(_x(), torch.arange(2)),
        "defaultdict": defaultdict(list, a=_x()),
        "list subclass": TaggedList("t", [_x()]),
        "dict subclass": TaggedDict("t", a=_x()),
        "ChainMap": ChainMap({"a": _x()}, {"b": _x()}),
        "UserDict": UserDict(a=_x()),
        "ModelOutput-style": Output(logits=_x()),
        "dataclass init=False": derived,
        "frozen dataclass": Frozen(_x(), (_x(), 3)),
    }


@pytest.mark.parametrize("name", list(shapes()))
def test_every_shape_keeps_its_type_and_extras_and_gets_its_tensors_mapped(name):
    tree = shapes()[name]
    out = map_tensors(lambda t: t.float() if t.is_floating_point() else t, tree)
    assert type(out) is type(tree)
    assert {t.dtype for t in iter_tensors(out) if t.is_floating_point()} == {f32}
    assert {t.dtype for t in iter_tensors(tree) if t.is_floating_point()} == {f64}  # untouched
    assert len(list(iter_tensors(out))) == len(list(iter_tensors(tree)))
    if isinstance(tree, (TaggedList, TaggedDict)):
        assert out.tag == "t"
    if isinstance(tree, defaultdict):
        assert out.default_factory is list
    if isinstance(tree, ChainMap):
        assert [dict(m).keys() for m in out.maps] == [{"a": 0}.keys(), {"b": 0}.keys()]
    if isinstance(tree, Output):
        assert out.logits is out["logits"] and out.logits.dtype == f32
    if isinstance(tree, WithDerived):
        assert out.note == "set in forward" and out.hidden.dtype == f32


def test_unchanged_trees_come_back_as_they_are_and_shared_tensors_stay_shared():
    tree = {"a": (torch.arange(3), [torch.arange(2)]), "b": Pair(torch.arange(1), None)}
    assert map_tensors(lambda t: t, tree) is tree
    x = _x()
    out = map_tensors(lambda t: t.float(), (x, [x]))
    assert out[0] is out[1][0]


@given(
    st.recursive(
        st.sampled_from(["f", "i", "s"]),
        lambda kids: st.one_of(
            st.lists(kids, max_size=3),
            st.lists(kids, max_size=3).map(tuple),
            st.dictionaries(st.text(max_size=2), kids, max_size=3),
        ),
        max_leaves=10,
    )
)
def test_map_then_iter_finds_every_tensor_in_order(spec):
    def build(s):
        if s == "f":
            return torch.zeros(1, dtype=f64)
        if s == "i":
            return torch.zeros(1, dtype=torch.int64)
        if isinstance(s, str):
            return s
        if isinstance(s, dict):
            return {k: build(v) for k, v in s.items()}
        return type(s)(build(v) for v in s)

    tree = build(spec)
    before = [t.dtype for t in iter_tensors(tree)]
    out = map_tensors(lambda t: t.float() if t.is_floating_point() else t, tree)
    after = [t.dtype for t in iter_tensors(out)]
    assert after == [f32 if d == f64 else d for d in before]


# -- the places that walk trees -------------------------------------------------------------


class Returns(nn.Module):
    def __init__(self, make: Any) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.make = make

    def forward(self, x):
        return self.make(self.lin(x))


def _derived(y):
    out = WithDerived(y)
    out.hidden = y * 2
    out.note = "set in forward"
    return out


@pytest.mark.parametrize(
    "make",
    [
        lambda y: defaultdict(list, a=y),
        lambda y: TaggedList("t", [y]),
        lambda y: TaggedDict("t", a=y),
        lambda y: ChainMap({"a": y}),
        lambda y: UserDict(a=y),
        lambda y: Output(logits=y),
        _derived,
    ],
    ids=["defaultdict", "list subclass", "dict subclass", "ChainMap", "UserDict", "Output", "dc"],
)
def test_output_cast_of_apply_reaches_every_shape(make):
    model = mixprec.apply(Returns(make), "params=float64,compute=float64,output=float32")
    out = model(torch.ones(1, 2))
    floats = [t for t in iter_tensors(out) if t.is_floating_point()]
    assert floats and {t.dtype for t in floats} == {f32}
    if isinstance(out, WithDerived):
        assert out.note == "set in forward"


def test_a_64_true_model_returning_a_dataclass_keeps_its_init_false_field():
    model = mixprec.apply(Returns(_derived), "64-true")
    out = model(torch.ones(1, 2))
    assert out.note == "set in forward"
    assert out.hidden.dtype == out.logits.dtype == f64


def test_convert_input_casts_a_chainmap_batch_for_a_true_policy():
    precision = mixprec.Precision("64-true")
    batch = ChainMap({"x": torch.ones(2)}, {"y": torch.ones(2)})
    out = precision.convert_input(batch)
    assert isinstance(out, ChainMap) and out["x"].dtype == out["y"].dtype == f64


def test_trainer_device_move_reaches_a_dataclass_batch():
    from mixprec.trainer.data import to_device

    @dataclass
    class Batch:
        x: torch.Tensor
        y: torch.Tensor

    batch = Batch(torch.ones(2), torch.zeros(2))
    # the meta device stands in for an accelerator: every tensor must land there
    moved = to_device(batch, torch.device("meta"))
    assert moved.x.device.type == moved.y.device.type == "meta"
    assert batch.x.device.type == "cpu"


def test_bench_runner_builds_a_namedtuple_batch(monkeypatch):
    from mixprec.bench import models, runner

    Batch = namedtuple("Batch", "inputs targets")

    def load(*args, **kwargs):
        return models.Workload(
            nn.Linear(4, 3),
            lambda n: Batch(torch.randn(n, 4), torch.randint(0, 3, (n,))),
            nn.functional.cross_entropy,
            "tiny",
        )

    monkeypatch.setattr(models, "load_workload", load)
    spec = runner.RunSpec("mlp", "32-true", 2, 8, "cpu", steps=1, warmup=0, threads=1)
    loop = runner._build_mixprec(spec, torch.device("cpu"))
    assert torch.isfinite(loop.step())


def test_doctor_moves_and_probes_a_namedtuple_batch():
    model = nn.Sequential(nn.Linear(2, 2))
    batch = Pair(torch.ones(3, 2), torch.zeros(3, dtype=torch.int64))
    report = mixprec.diagnose(
        model, batch, nn.functional.cross_entropy, precision="bf16-mixed", device="cpu"
    )
    assert report.finite


class Tagged(tuple):
    def __new__(cls, items, tag="t"):
        new = super().__new__(cls, items)
        new.tag = tag
        return new


def test_a_defaultdict_subclass_whose_init_takes_other_arguments_keeps_its_factory():
    """Copied without its __init__, its default_factory (held in C) was lost: None."""

    class Outputs(defaultdict):
        def __init__(self, step: int) -> None:
            super().__init__(list)
            self.step = step

    tree = Outputs(3)
    tree["logits"] = _x()
    out = map_tensors(lambda t: t.float(), tree)
    assert type(out) is Outputs and out.step == 3 and out["logits"].dtype == f32
    out["aux"].append(1)
    assert out.default_factory is list and out["aux"] == [1]


def test_tuple_subclasses_torch_return_types_and_custom_ones():
    r = torch.max(torch.ones(3, 4, dtype=f64), 1)
    out = mixprec.convert.cast_floating(r, f32)
    assert type(out) is type(r) and out.values.dtype == f32 and out.indices.dtype == torch.int64
    tagged = mixprec.convert.cast_floating(Tagged([_x()], tag="kept"), f32)
    assert type(tagged) is Tagged and tagged.tag == "kept" and tagged[0].dtype == f32


def test_a_tensor_given_twice_stays_one_tensor_under_compile_without_recompiles():
    """Found by a review: under torch.compile the walker kept no memo (an `id()` memo makes
    dynamo guard on each batch), so a tensor given twice (attention's query and key) came
    out as two and ``query is key`` no longer held. Compiled, the memo compares by `is`:
    shared stays shared, and new batches of the same shape run the one graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    def walk(batch: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        out = map_tensors(lambda t: t * 2, batch)
        return out, out["q"] is out["k"] and out["k"] is out["v"][0]

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(walk, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            x = torch.randn(3, generator=torch.Generator().manual_seed(seed))
            out, shared = compiled({"q": x, "k": x, "v": [x, torch.ones(2)]})
            assert shared and out["q"] is out["k"] and torch.equal(out["q"], x * 2)
    assert counters["frames"]["ok"] == 1 and not counters["graph_break"]
    torch._dynamo.reset()
