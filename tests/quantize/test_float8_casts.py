"""The float8 casts compiled (as they run on CUDA by default) equal the eager ones bit for bit,
checked by compiling them for the CPU (and on a GPU, for CUDA); and what a float8 step
dispatches, compiled and op by op."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.quantize import float8_casts
from mixprec.quantize.float8 import E4M3, E5M2, Float8Linear, amax_to_scale
from mixprec.quantize.float8_casts import abs_max, saturated_cast, set_compiled_casts

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ],
)


@pytest.fixture
def compiled_on_cpu():
    previous = set_compiled_casts(("cpu",))
    try:
        yield
    finally:
        set_compiled_casts(previous)


@pytest.fixture(params=["cpu", CUDA])
def device(request):
    """The device whose casts are compiled during the test (CUDA's by Triton)."""
    previous = set_compiled_casts((request.param,))
    try:
        yield request.param
    finally:
        set_compiled_casts(previous)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so NaN payloads, signs of zero and the fp8 codes all compare."""
    return t.reshape(-1).contiguous().view(torch.uint8)


def _hard_values(dtype: torch.dtype, device: str) -> torch.Tensor:
    """A 2-D tensor with NaN, +-inf, signed zeros, float32 subnormals, values that saturate
    and ordinary ones, rows and columns of each."""
    torch.manual_seed(0)
    x = torch.randn(24, 40) * torch.logspace(-3, 3, 40)
    x[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])
    x[1] = 0.0
    x[2, :4] = torch.tensor([1e-40, -3e-42, 2.5e-39, 1e-45])
    x[3, 7] = 3.0e38
    x[:, 9] = -0.0
    return x.to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_casts_equal_eager_bit_for_bit(device, dtype):
    x = _hard_values(dtype, device)
    finite = x.clone()
    finite[0, :3] = 1.0
    calls = []
    for t in (x, finite):
        for dim in (None, 0, -1):
            compiled = abs_max(t, dim)
            set_compiled_casts(())
            eager = abs_max(t, dim)
            set_compiled_casts((device,))
            assert torch.equal(_bits(compiled), _bits(eager)), (dtype, dim)
            calls.append(compiled)
            power_of_2 = dim is not None
            for fp8 in (E4M3, E5M2) if dim is None else (E4M3,):
                scale = amax_to_scale(eager, fp8, power_of_2=power_of_2)
                compiled8 = saturated_cast(t, scale, fp8)
                set_compiled_casts(())
                eager8 = saturated_cast(t, scale, fp8)
                set_compiled_casts((device,))
                assert compiled8.dtype == eager8.dtype == fp8
                assert torch.equal(_bits(compiled8), _bits(eager8)), (dtype, dim, fp8)
    # the compiled path did run: each function was compiled
    assert set(float8_casts._compiled) == {
        float8_casts._abs_max_whole,
        float8_casts._abs_max_along,
        float8_casts._e4m3_by_tensor,
        float8_casts._e5m2_by_tensor,
        float8_casts._e4m3_by_axis,
    }
    # and gave the abs-max: NaN where one is held, else the largest magnitude
    assert calls[0].isnan() and calls[3] == finite.abs().max().float()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_float8_linear_step_with_compiled_casts_equals_eager(device, recipe):
    """A training step of a Float8Linear under bf16 autocast: output, input and weight
    gradients and the delayed buffers equal bit for bit with the casts compiled or not (on
    an SM 8.9+ GPU through the real float8 matmul)."""

    def step(compiled: bool) -> list[torch.Tensor]:
        set_compiled_casts((device,) if compiled else ())
        torch.manual_seed(1)
        layer = Float8Linear(32, 48, recipe=recipe, amax_history_length=4, device=device)
        x = (torch.randn(16, 32, device=device) * 3).requires_grad_()
        outs = []
        for _ in range(2):  # delayed: the second step scales from the recorded history
            with torch.autocast(device, dtype=torch.bfloat16):
                out = layer(x)
            out.float().square().sum().backward()
            outs += [out, x.grad.clone(), layer.weight.grad.clone()]
        return outs + list(layer.buffers())

    compiled, eager = step(True), step(False)
    assert len(compiled) == len(eager)
    for a, b in zip(compiled, eager, strict=True):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def test_casts_run_eager_where_compiling_cannot_help(compiled_on_cpu):
    x = torch.randn(4, 4)
    assert float8_casts._wants_compiled(x)
    set_compiled_casts(())
    assert not float8_casts._wants_compiled(x)
    set_compiled_casts(("cpu",))
    # a tensor that wants a gradient keeps its autograd graph through the eager ops
    w = torch.randn(4, 4, requires_grad=True)
    assert not float8_casts._wants_compiled(w)
    with torch.no_grad():
        assert float8_casts._wants_compiled(w)
    with _OpCounter():  # a dispatch mode sees every op, which a compiled kernel would hide
        assert not float8_casts._wants_compiled(x)
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(t):
        seen.append(float8_casts._wants_compiled(t))  # inside a trace: traced op by op
        return t + 1

    traced(x)
    assert seen == [False]


def test_set_compiled_casts_refuses_what_is_not_a_device_list():
    with pytest.raises(TypeError, match="collection of device types"):
        set_compiled_casts("cuda")
    with pytest.raises(ValueError, match="unknown device type 'gpu'.*'cuda'"):
        set_compiled_casts(["gpu"])
    assert float8_casts.compiled_cast_devices() == ("cuda",)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched (each a kernel launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _step(layer: Float8Linear, x: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    out.float().sum().backward()


def test_compiled_step_runs_each_cast_as_two_compiled_kernels(compiled_on_cpu):
    """A tensorwise forward + backward makes 3 casts (input, weight, output gradient): each
    one compiled abs-max and one compiled cast, no elementwise cast op left eager, and no
    device-to-host copy."""
    torch.manual_seed(0)
    layer = Float8Linear(32, 32)
    x = torch.randn(8, 32, requires_grad=True)
    for _ in range(2):  # compile (the output gradient of sum() is a broadcast: its own graph)
        _step(layer, x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(layer, x)
    names = collections.Counter(e.name for e in prof.events())
    assert sum(n for name, n in names.items() if name.startswith("Torch-Compiled Region")) == 6
    for op in ("abs", "linalg_vector_norm", "nan_to_num", "isfinite", "where", "clamp_"):
        assert names[f"aten::{op}"] == 0, op
    assert names["aten::_local_scalar_dense"] == names["aten::item"] == 0


@pytest.mark.parametrize(
    "recipe, ops_now, ops_before",
    [
        ("tensorwise", 79, 89),
        ("rowwise", 139, 159),
        ("rowwise_with_gw_hp", 104, 117),
        ("delayed", 139, 149),
    ],
)
def test_eager_step_dispatches_fewer_ops_and_no_host_sync(recipe, ops_now, ops_before):
    """Op by op (a CPU; a GPU where torch cannot compile) a forward + backward under bf16
    autocast dispatches fewer aten ops than before (each a kernel launch on a GPU): a cast is
    an abs-max in one op and a 2-op NaN fix-up, where it was abs, amax and a 4-op finiteness
    test. And none reads a value back to the host (an `.item()` stalls it on a GPU)."""
    torch.manual_seed(0)
    layer = Float8Linear(32, 32, recipe=recipe)
    x = torch.randn(8, 32, requires_grad=True)
    _step(layer, x)
    with _OpCounter() as counter:
        _step(layer, x)
    ops = counter.ops
    assert ops["_local_scalar_dense"] == 0
    # the delayed recipe's only abs is its history's finiteness test, on 0-dim amaxes
    assert ops["abs"] == (3 if recipe == "delayed" else 0)
    assert sum(ops.values()) == ops_now < ops_before, dict(ops)


def test_without_triton_cuda_casts_run_op_by_op_and_say_so_once(monkeypatch):
    import torch.utils._triton

    if torch.utils._triton.has_triton():
        pytest.skip("Triton is installed here")
    monkeypatch.setattr(float8_casts, "_unavailable", {})
    with pytest.warns(RuntimeWarning, match="float8 casts on cuda run op by op .*Triton"):
        assert float8_casts._why_not_compiled("cuda") == (
            "torch.compile needs Triton for cuda and it is not installed"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert float8_casts._why_not_compiled("cuda") is not None


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_an_inf_under_a_finite_scale_casts_to_nan_compiled_as_eagerly(device, fp8):
    """A delayed recipe's scale comes from its history, so it stays finite while the tensor
    holds an inf. The compiled cast turned that inf into the format's largest value (+-448,
    +-57344: inductor folds ``x * 0`` to 0), and an overflowed step looked finite to the loss
    scaler; it is NaN, as eagerly, per element."""
    x = torch.tensor([[1.0, float("inf"), -float("inf"), float("nan"), -0.0, 2.0]], device=device)
    scale = torch.tensor(2.0, device=device)
    set_compiled_casts(())
    eager = saturated_cast(x, scale, fp8)
    set_compiled_casts((device,))
    compiled = saturated_cast(x, scale, fp8)
    assert torch.equal(_bits(compiled), _bits(eager))
    assert torch.isnan(compiled[0, 1:4].float()).all()
    assert torch.isfinite(compiled[0, [0, 4, 5]].float()).all()


def test_casts_compile_only_on_gpus_whose_triton_writes_float8():
    """Triton writes e4m3 from compute capability 8.9 (Ada, Hopper): on an A100, T4 or RTX
    30xx a compiled cast failed to build at the first float8 forward. Below 8.9 the casts
    run op by op (warned once per GPU); the decision is the capability's alone."""
    assert float8_casts.TRITON_FLOAT8_FROM == (8, 9)
    for capability in [(7, 5), (8, 0), (8, 6), (8, 7)]:
        assert not float8_casts.triton_writes_float8(capability)
    for capability in [(8, 9), (9, 0), (10, 0), (12, 0)]:
        assert float8_casts.triton_writes_float8(capability)
