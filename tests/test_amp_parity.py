"""A mixed-precision step costs nothing over the two lines of torch.amp it replaces: the same
aten ops in the same dtypes as a `torch.autocast` (+ `GradScaler`) loop on the same model,
except where the policy asks for more than the device's autocast (float32 islands), which
`explain` lists; and no host sync beyond GradScaler's one read of the overflow flag.

The op streams are recorded with a `TorchDispatchMode` on CPU. CUDA's autocast decisions are
checked on a described H100."""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec import PolicyMap, Precision
from mixprec.bench.models import MLP, BlogCNN, TinyTransformer, probabilities_nll
from mixprec.hardware import assume
from mixprec.optim.scaling import DynamicLossScaler
from mixprec.step import backward, plain_loss
from tests.devices import H100, ZEN4

ROOT = Path(__file__).resolve().parents[1]
MIXED = ["bf16-mixed", "16-mixed"]
# free ops that say nothing of what is computed: views, autograd's detach, the profiler's
# record_function markers
FREE = {"view", "_unsafe_view", "detach", "alias", "select", "unbind", "t", "transpose"}


class OpStream(TorchDispatchMode):
    """Every aten op dispatched, with the dtypes of its tensor inputs and outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = torch.utils._pytree.tree_leaves((args, kwargs))
        outs = torch.utils._pytree.tree_leaves(out)
        self.ops.append((func.overloadpacket.__name__, _dtypes(ins), _dtypes(outs)))
        return out

    def computing(self) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
        """The ops that compute or move data in another dtype: no views, no markers, and no
        copy that keeps its dtype (GradScaler copies its flag and inverse scale to their own
        device before its kernel, where they already are: mixprec does not)."""
        return [
            op
            for op in self.ops
            if op[0] not in FREE
            and not op[0].startswith("_record_function")
            and not (op[0] == "_to_copy" and op[1][:1] == op[2])
        ]


def _dtypes(leaves: list[Any]) -> tuple[str, ...]:
    return tuple(str(t.dtype).removeprefix("torch.") for t in leaves if isinstance(t, torch.Tensor))


def _dtype(spec: str) -> torch.dtype:
    return torch.float16 if spec.startswith("16") else torch.bfloat16


def _raw_step(model, opt, scaler, batch, loss_fn, dtype) -> None:
    x, y = batch
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype):
        loss = loss_fn(model(x), y)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def _mixprec_step(model, opt, precision, batch, loss_fn) -> None:
    opt.zero_grad(set_to_none=True)
    backward(precision, plain_loss(precision, model, batch, loss_fn))
    precision.step(opt)


def _streams(
    make: Callable[[], nn.Module], batch: Any, loss_fn: Callable, spec: str, **map_kwargs: Any
) -> tuple[OpStream, OpStream]:
    """One recorded step of each loop, after a first step that creates Adam's state."""
    torch.manual_seed(0)
    raw_model = make()
    our_model = copy.deepcopy(raw_model)
    dtype = _dtype(spec)
    raw_opt = torch.optim.Adam(raw_model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    precision = Precision(PolicyMap(spec, **map_kwargs), allow_slow=True)
    our_model, our_opt = precision.setup(
        our_model, torch.optim.Adam(our_model.parameters(), lr=1e-3)
    )
    _raw_step(raw_model, raw_opt, scaler, batch, loss_fn, dtype)
    _mixprec_step(our_model, our_opt, precision, batch, loss_fn)
    with OpStream() as raw:
        _raw_step(raw_model, raw_opt, scaler, batch, loss_fn, dtype)
    with OpStream() as ours:
        _mixprec_step(our_model, our_opt, precision, batch, loss_fn)
    return raw, ours


def _decoder_lm() -> tuple[Callable[[], nn.Module], Any, Callable]:
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    try:
        import transformer as gpu_lm
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "gpu"))
    dims = gpu_lm.Dims(vocab=64, dim=32, layers=1, heads=2, seq=8, batch=2)
    tokens = torch.randint(0, dims.vocab, (dims.batch, dims.seq + 1), generator=_gen())
    return lambda: gpu_lm.LM(dims), (tokens[:, :-1], tokens[:, 1:]), gpu_lm.lm_loss


def _char_lm() -> tuple[Callable[[], nn.Module], Any, Callable]:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import charlm
    finally:
        sys.path.remove(str(ROOT / "examples"))
    tokens = torch.randint(0, 256, (2, 9), generator=_gen())

    def loss(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    return (
        lambda: charlm.CharGPT(block=8, dim=32, layers=1, heads=2),
        (
            tokens[:, :-1],
            tokens[:, 1:],
        ),
        loss,
    )


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _workload(name: str) -> tuple[Callable[[], nn.Module], Any, Callable]:
    if name == "cnn":  # the seed blog's CNN, on 32x32 images
        x = torch.rand(2, 3, 32, 32, generator=_gen())
        return BlogCNN, (x, torch.randint(0, 10, (2,), generator=_gen())), probabilities_nll
    if name == "mlp":  # the bench's MLP, narrower
        x, y = torch.randn(2, 1024, generator=_gen()), torch.randint(0, 10, (2,), generator=_gen())
        return lambda: MLP(width=32), (x, y), F.cross_entropy
    if name == "transformer":
        tokens = torch.randint(0, 50, (2, 9), generator=_gen())

        def lm(logits, targets):
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

        make = lambda: TinyTransformer(vocab=50, dim=32, heads=2, layers=1, seq=8)  # noqa: E731
        return make, (tokens[:, :-1], tokens[:, 1:]), lm
    if name == "char LM":
        return _char_lm()
    return _decoder_lm()


MODELS = ["cnn", "mlp", "transformer", "char LM", "decoder LM"]


@pytest.mark.parametrize("spec", MIXED)
@pytest.mark.parametrize("name", MODELS)
def test_a_step_dispatches_what_autocast_and_grad_scaler_do(name, spec):
    """With no float32 islands asked for, mixprec's step and the torch.amp loop dispatch the
    same computing ops in the same dtypes, the loss included (computed inside autocast on
    the outputs as autocast made them), the scaler's unscale, skip check and update
    included."""
    make, batch, loss_fn = _workload(name)
    no_more = dict(float32_islands=False, float32_attention=False)
    raw, ours = _streams(make, batch, loss_fn, spec, **no_more)
    assert ours.computing() == raw.computing()


@pytest.mark.parametrize("name", MODELS)
def test_what_a_step_does_beyond_cpu_autocast_is_what_explain_lists(name):
    """With the default islands, each extra op is a cast into or out of a layer `explain`
    lists as computing in float32 beyond CPU autocast (none where a float32 input reaches it,
    as in a pre-norm transformer), and nothing else differs in kind. On
    a described Zen 4, whose bfloat16 attention is fast, attention stays in bfloat16."""
    make, batch, loss_fn = _workload(name)
    with assume(ZEN4):
        raw, ours = _streams(make, batch, loss_fn, "bf16-mixed")
        model = make()
        explanation = mixprec.explain(model, "bf16-mixed")
    differences = explanation.autocast_differences
    island_types = mixprec.policy.map.ISLAND_TYPES
    islands = {n for n, m in model.named_modules() if isinstance(m, island_types)}
    assert set(differences) == islands | set(explanation.float32_attention)
    for path in islands:
        assert "cpu autocast would run it in its input's dtype" in differences[path], path
    if not differences:
        assert ours.computing() == raw.computing()
        return
    kinds = lambda s: sorted({op for op, *_ in s.computing()})  # noqa: E731
    assert kinds(ours) == kinds(raw)
    # at most a cast in and out of each listed layer's forward and backward
    assert len(ours.computing()) - len(raw.computing()) <= 4 * len(differences)


def test_on_a_described_h100_no_layer_is_an_island_that_cuda_autocast_already_runs_in_float32():
    model = nn.Sequential(
        nn.Linear(8, 8),
        nn.LayerNorm(8),
        nn.GroupNorm(2, 8),
        nn.Softmax(-1),
        nn.LogSoftmax(-1),
        nn.Softmin(-1),
        nn.InstanceNorm1d(8),
    )
    with assume(H100):
        on_gpu = mixprec.explain(model, "bf16-mixed", device="cuda")
    on_cpu = mixprec.explain(model, "bf16-mixed", device="cpu")
    covered = {"1", "2", "3", "4", "5"}
    for path in covered:
        assert on_gpu[path] == mixprec.Policy("bf16-mixed")
        assert "cuda autocast computes it in float32 itself" in on_gpu.sources[path]
        assert on_cpu[path].compute_dtype == torch.float32
    # what CUDA autocast leaves in 16 bits stays an island there, and says so
    assert set(on_gpu.autocast_differences) == {"6"}
    assert "cuda autocast would run it in its input's dtype" in on_gpu.autocast_differences["6"]
    assert set(on_cpu.autocast_differences) == covered | {"6"}


def test_apply_on_a_cuda_model_installs_no_region_where_cuda_autocast_already_casts():
    """The regions `apply` installs follow the device's autocast (checked on a meta-device
    stand-in: `apply` reads the model's device type)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Softmax(-1))
    resolved = PolicyMap("16-mixed").resolve(model, device_type="cuda")
    assert {r.policy for r in resolved.values()} == {mixprec.Policy("16-mixed")}
    resolved = PolicyMap("16-mixed").resolve(model, device_type="cpu")
    assert resolved["1"].source == resolved["2"].source == "float32 island"


@pytest.mark.parametrize("spec", MIXED)
def test_the_loss_sees_the_outputs_as_autocast_made_them(spec):
    """In a step (and in `forward_context`) the model's region adds nothing to the caller's
    autocast: the loss gets the 16-bit logits inside autocast, as in a torch.amp loop, where
    CUDA's log_softmax reads them in its float32 kernel. Outside a step the mixed policy's
    outputs are float32."""
    precision = Precision(spec, allow_slow=True)
    model, _ = precision.setup(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)),
        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1),
    )
    seen = {}

    def loss_fn(out, y):
        seen["dtype"], seen["autocast"] = out.dtype, torch.is_autocast_enabled("cpu")
        return F.cross_entropy(out, y)

    loss = plain_loss(precision, model, (torch.randn(2, 4), torch.tensor([0, 2])), loss_fn)
    assert seen == {"dtype": _dtype(spec), "autocast": True}
    assert loss.dtype == torch.float32  # autocast's float32 list holds cross_entropy
    with precision.forward_context():
        assert model(torch.randn(2, 4)).dtype == _dtype(spec)
    assert model(torch.randn(2, 4)).dtype == torch.float32


class SyncCount(TorchDispatchMode):
    """Device-to-host reads: `.item()` and `bool()`/`float()` of a tensor dispatch
    `_local_scalar_dense`; `.tolist()` is counted through the patched method."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._local_scalar_dense:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def count_tolist(monkeypatch):
    calls = []
    tolist = torch.Tensor.tolist

    def counted(self):
        calls.append(1)
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    return calls


@pytest.mark.parametrize(
    ("spec", "fused", "extra"),
    [
        ("bf16-mixed", False, 0),
        ("bf16-mixed", True, 0),
        ("16-mixed", False, 0),
        ("16-mixed", True, 1),
    ],
)
def test_precision_step_reads_the_device_no_more_than_grad_scaler(spec, fused, extra, count_tolist):
    """Reads of the device per step, against the torch.amp loop on the same model (torch's
    non-capturable Adam reads its own step counters: both loops have those). bf16: none
    added. float16: GradScaler's one read of the overflow flag, no more; with a fused
    optimizer, whose kernel skips by itself so that GradScaler reads nothing, the flag is
    read once after the step is queued (the skip count and `step_was_skipped`). A clean
    step's scale update reads nothing: the scale's bounds and floor are known on the host."""
    dtype = _dtype(spec)
    torch.manual_seed(0)
    raw_model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = copy.deepcopy(raw_model)
    precision = Precision(spec, allow_slow=True)
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), fused=fused))
    raw_opt = torch.optim.AdamW(raw_model.parameters(), fused=fused)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    batch = (torch.randn(4, 4), torch.tensor([0, 1, 1, 0]))
    for _ in range(3):
        with SyncCount() as raw:
            _raw_step(raw_model, raw_opt, scaler, batch, F.cross_entropy, dtype)
        raw_reads = raw.count + len(count_tolist)
        count_tolist.clear()
        with SyncCount() as ours:
            _mixprec_step(model, opt, precision, batch, F.cross_entropy)
        assert ours.count + len(count_tolist) == raw_reads + extra
        count_tolist.clear()
    if spec == "bf16-mixed":
        with SyncCount() as ours:
            precision.step(opt)  # the step alone: not one read
        assert ours.count == 0 or not fused


@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_fused_adamw_follows_grad_scalers_grad_scale_protocol_bit_for_bit(explicit_unscale):
    """Without an explicit unscale the fused kernel divides the still-scaled gradients by
    `grad_scale` itself, as under GradScaler; after one it gets `grad_scale=None`. With a
    scale that is no power of two, x / s and x * (1 / s) differ in the last bit: only the
    same protocol gives the same parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ref_model = copy.deepcopy(model)
    scaler = DynamicLossScaler(3000.0, growth_interval=2, min_scale=0.0, max_scale=math.inf)
    precision = Precision("16-mixed", scaler=scaler, allow_slow=True)
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    ref = torch.amp.GradScaler("cpu", init_scale=3000.0, growth_interval=2)
    gen = _gen()
    for step in range(8):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        with precision.forward_context():
            loss = F.cross_entropy(model(x), y)
        precision.backward(loss)
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss = F.cross_entropy(ref_model(x), y)
        ref.scale(ref_loss).backward()
        assert torch.equal(loss, ref_loss)
        if step == 3:
            model[2].weight.grad[1, 1] = math.inf
            ref_model[2].weight.grad[1, 1] = math.inf
        if explicit_unscale:
            precision.unscale_()
            ref.unscale_(ref_opt)
        stepped = precision.step(opt)
        ref.step(ref_opt)
        ref.update()
        assert stepped is (step != 3)
        assert precision.scaler.loss_scale == ref.get_scale()
        for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b), f"parameters differ at step {step}"
        opt.zero_grad()
        ref_opt.zero_grad()
