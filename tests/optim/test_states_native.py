"""The hand-written CPU kernel of the low-bit Adam/AdamW step (`mixprec.optim.states.native`)
held to the eager update: the first moment's codes and scales bit for bit (its arithmetic
has no square root), the second's within the last bit of a root (the kernel's square root is
correctly rounded, torch's vectorized one may be a last bit off), the parameters within a
float32 rounding; on gradients spanning orders of magnitude, zeros, a NaN, partial blocks,
both decays; the same bits on one thread and two; and the fallbacks: switched off, no
compiler, a block past its scratch. And its float8 codec of a saved activation, held to the
states' codec bit for bit on hostile values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.optim.engine import can_compile
from mixprec.optim.states import LowBitAdam, LowBitAdamW, formats, kernels, native

pytestmark = pytest.mark.skipif(not can_compile("cpu"), reason="no C compiler on this host")

KINDS = ["int8", "int4", "float8"]


def _params(seed: int = 0) -> list[nn.Parameter]:
    """A matrix, a vector of a partial last block, a parameter of one block."""
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in ((40, 37), (300,), (128,))]


def _grads(params: list[nn.Parameter], step: int) -> list[torch.Tensor]:
    """Gradients from 1e-3 to 1e2 by step, one block of the matrix zero on even steps."""
    g = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(p.shape, generator=g) * 10.0 ** (step % 6 - 3) for p in params]
    if step % 2 == 0:
        grads[0].view(-1)[256:512] = 0.0
    return grads


def _stepped(cls, kind: str, compile: bool, steps: int = 12, **kw) -> tuple[list, object]:
    params = _params()
    opt = cls(params, lr=1e-2, states=kind, min_size=0, compile=compile, weight_decay=0.05, **kw)
    for step in range(steps):
        for p, grad in zip(params, _grads(params, step), strict=True):
            p.grad = grad
        opt.step()
    return params, opt


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture
def counted(monkeypatch):
    """The number of native kernel calls (the test fails if the compiled build is asked)."""
    calls = []
    run = native.adam

    def adam(args):
        ran = run(args)
        calls.append(ran)
        return ran

    def no_build(algorithm):
        raise AssertionError(f"the compiled {algorithm} update was built")

    monkeypatch.setattr(native, "adam", adam)
    monkeypatch.setattr(kernels, "compiled", no_build)
    return calls


@pytest.mark.parametrize("cls", [LowBitAdamW, LowBitAdam], ids=["decoupled", "l2"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_steps_as_the_eager_update(cls, kind, counted):
    ours, fast = _stepped(cls, kind, compile=True)
    assert counted and all(counted)
    plain, slow = _stepped(cls, kind, compile=False)
    for p, q in zip(ours, plain, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        a, b = fast.state[p], slow.state[q]
        assert torch.equal(_bits(a["exp_avg_codes"]), _bits(b["exp_avg_codes"]))
        assert torch.equal(a["exp_avg_scales"], b["exp_avg_scales"])
        torch.testing.assert_close(
            a["exp_avg_sq_scales"], b["exp_avg_sq_scales"], rtol=3e-7, atol=0
        )
        # a root a last bit off may move a code across a boundary: a handful at most
        differ = _bits(a["exp_avg_sq_codes"]) != _bits(b["exp_avg_sq_codes"])
        assert int(differ.sum()) <= 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_nan_gradient_spoils_its_block_and_no_other(kind, counted):
    runs = []
    for compile in (True, False):
        params = _params()
        opt = LowBitAdamW(params, states=kind, min_size=0, compile=compile)
        for step in range(3):
            for p, grad in zip(params, _grads(params, step), strict=True):
                p.grad = grad
            if step == 1:
                params[1].grad[5] = float("nan")
            opt.step()
        runs.append((params, opt))
    (ours, fast), (plain, slow) = runs
    spoiled = ours[1].isnan()
    assert torch.equal(spoiled, plain[1].isnan())
    assert spoiled.any() and not spoiled.all()  # its block, not the parameter's others
    torch.testing.assert_close(ours[1][~spoiled], plain[1][~spoiled], rtol=1e-5, atol=1e-6)
    for key in ("exp_avg_scales", "exp_avg_sq_scales"):
        assert torch.equal(fast.state[ours[1]][key].isnan(), slow.state[plain[1]][key].isnan())


@pytest.mark.parametrize("kind", KINDS)
def test_one_thread_and_two_step_the_same_bits(kind):
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs.append(_stepped(LowBitAdamW, kind, compile=True, steps=4))
    finally:
        torch.set_num_threads(before)
    (ours, one), (theirs, two) = runs
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        for key in ("exp_avg_codes", "exp_avg_sq_codes", "exp_avg_scales", "exp_avg_sq_scales"):
            assert torch.equal(_bits(one.state[p][key]), _bits(two.state[q][key]))


def _args(p=None, g=None, kind="int8", block=256, compensation=None) -> tuple:
    """`kernels.adam_update`'s arguments for two blocks of zeros."""
    p = torch.zeros(512) if p is None else p
    g = torch.zeros(512) if g is None else g
    codes, scales, hp = torch.zeros(512, dtype=torch.uint8), torch.zeros(2), torch.zeros(9)
    tables = (torch.zeros(256), torch.zeros(256))
    return (
        p,
        g,
        codes,
        scales,
        codes,
        scales,
        tables,
        None,
        hp,
        0,
        kind,
        block,
        True,
        compensation,
    )


def test_switched_off_or_unbuildable_the_compiled_update_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_LIBRARY", [])
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.library() is None
    # a compiler that fails: no library, nothing left behind in the cache
    monkeypatch.setattr(native, "_LIBRARY", [])
    monkeypatch.delenv(native.NATIVE_ENV)
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    assert native.library() is None
    assert list(tmp_path.rglob("*.so")) == []
    assert native.adam(_args()) is False


def test_a_cache_that_cannot_be_written_leaves_the_update_as_it_was(monkeypatch, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # (the cache folder's parent is a file: no folder can be made)
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(blocked))
    monkeypatch.setattr(native, "_LIBRARY", [])
    assert native.library() is None
    assert native.adam(_args()) is False


def test_a_build_is_cached_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_LIBRARY", [])
    assert native.library() is not None
    built = list(tmp_path.rglob("*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_LIBRARY", [])
    assert native.library() is not None
    assert [p.stat().st_mtime_ns for p in tmp_path.rglob("*.so")] == [stamp]


def test_what_the_kernel_does_not_take_is_left_to_the_compiled_update():
    lib = native.library()
    assert lib is not None
    assert native.adam(_args()) is True
    assert native.adam(_args(p=torch.zeros(512).bfloat16())) is False
    assert native.adam(_args(g=torch.zeros(512).double())) is False
    assert native.adam(_args(p=torch.zeros(512, 2)[:, 0])) is False  # strided
    assert native.adam(_args(kind="float32")) is False
    assert native.adam(_args(compensation="kahan")) is False
    assert native.adam(_args(block=2 * lib.mixprec_max_block())) is False


def test_a_step_too_small_to_compile_takes_the_kernel_under_compile_none(counted):
    """compile=None compiles no update of fewer than 2^16 elements (a build takes seconds),
    but the kernel, built once in about a second, steps it; compile=False stays eager."""
    params = _params()
    opt = LowBitAdamW(params, states="int8", min_size=0)
    for p, grad in zip(params, _grads(params, 0), strict=True):
        p.grad = grad
    opt.step()
    assert counted and all(counted)
    counted.clear()
    eager = LowBitAdamW(_params(), states="int8", min_size=0, compile=False)
    for p, grad in zip(eager.param_groups[0]["params"], _grads(params, 0), strict=True):
        p.grad = grad
    eager.step()
    assert counted == []


def _hostile(name: str) -> list[torch.Tensor]:
    """Two gradients of one hostile kind."""
    g = torch.Generator().manual_seed(7)
    n = 1024
    if name == "one":
        return [torch.randn(1, generator=g), torch.randn(1, generator=g)]
    if name == "empty":
        return [torch.zeros(0), torch.zeros(0)]
    x = torch.randn(n, generator=g)
    if name == "span":  # magnitudes from 1e-2 to 1e2 in every block
        x = x * torch.logspace(-2, 2, n)
    elif name == "outlier":
        x = x * 1e-3
        x[7] = 1e6
    elif name == "denormal":
        x = x * 1e-40
    elif name == "inf":
        x[3] = float("inf")
    return [x, x * 0.5]


@pytest.mark.parametrize("name", ["span", "outlier", "denormal", "inf", "one", "empty"])
@pytest.mark.parametrize("kind", KINDS)
def test_hostile_gradients_step_as_the_eager_update(kind, name, counted):
    runs = []
    for compile in (True, False):
        grads = _hostile(name)
        p = nn.Parameter(torch.randn(grads[0].shape, generator=torch.Generator().manual_seed(1)))
        opt = LowBitAdamW([p], lr=1e-2, states=kind, min_size=0, compile=compile)
        for grad in grads:
            p.grad = grad
            opt.step()
        runs.append((p.detach(), opt.state[p]))
    (ours, fast), (plain, slow) = runs
    assert torch.equal(ours.isnan(), plain.isnan())
    finite = ~ours.isnan()
    torch.testing.assert_close(ours[finite], plain[finite], rtol=1e-5, atol=1e-6)
    assert torch.equal(_bits(fast["exp_avg_codes"]), _bits(slow["exp_avg_codes"]))
    assert torch.equal(fast["exp_avg_scales"].isnan(), slow["exp_avg_scales"].isnan())
    scales = ~fast["exp_avg_scales"].isnan()
    assert torch.equal(fast["exp_avg_scales"][scales], slow["exp_avg_scales"][scales])


def _hostile_values() -> dict[str, torch.Tensor]:
    """Tensors the activation codec must code as the states' codec does: ordinary values,
    magnitudes spanning float32's range, infinities, NaN, -0, subnormals, values past
    e4m3's largest over a small scale, zeros, one element, none, and lengths ending in a partial
    block."""
    g = torch.Generator().manual_seed(3)
    special = torch.randn(777, generator=g)
    special[[5, 70]] = torch.tensor([torch.inf, -torch.inf])
    special[[200, 300, 301]] = torch.tensor([torch.nan, 1e-40, -0.0])
    return {
        "normal": torch.randn(1 << 14, generator=g),
        "span": torch.randn(1000, generator=g) * torch.logspace(-30, 30, 1000),
        "special": special,
        "zeros": torch.zeros(130),
        "all_inf": torch.full((64,), -torch.inf),
        "extremes": torch.tensor([3e38, -3e38, 1e-45] * 30),
        "subnormal": torch.randn(65, generator=g) * 1e-39,
        "one": torch.tensor([2.5]),
        "empty": torch.zeros(0),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(_hostile_values()))
def test_the_fp8_codec_codes_and_decodes_as_the_states_codec(dtype, name):
    """`fp8_encode` gives `quantize`'s codes and scales bit for bit, `fp8_decode`
    `dequantize`'s values in the tensor's dtype (NaN where it has NaN, signs of zeros too)."""
    x = _hostile_values()[name].to(dtype)
    fmt = formats.StateFormat("fp8", 64)
    codes, scales = formats.quantize(x, fmt, signed=True)
    got = native.fp8_encode(x, 64)
    assert got is not None
    assert torch.equal(got[0].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(got[1].isnan(), scales.isnan())
    assert torch.equal(got[1].nan_to_num(), scales.nan_to_num())
    expected = formats.dequantize(codes, scales, fmt, (x.numel(),), signed=True).to(dtype)
    out = native.fp8_decode(got[0], got[1], x.numel(), dtype, 64)
    assert out is not None and out.dtype == dtype
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())
    assert torch.equal(out.signbit() & ~out.isnan(), expected.signbit() & ~expected.isnan())


def test_the_fp8_codec_gives_the_same_bits_on_one_thread_and_two():
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(4)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.fp8_encode(x, 64)
        torch.set_num_threads(2)
        two = native.fp8_encode(x, 64)
        decoded = native.fp8_decode(two[0], two[1], x.numel(), x.dtype, 64)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0].view(torch.uint8), two[0].view(torch.uint8))
    assert torch.equal(one[1], two[1])
    assert torch.equal(decoded, native.fp8_decode(one[0], one[1], x.numel(), x.dtype, 64))


def test_what_the_fp8_codec_does_not_take_is_left_to_the_caller(monkeypatch):
    """float16 and float64, a strided tensor, a block past the scratch: None (the caller's
    compiled or eager codec runs); and nothing where the kernel is switched off."""
    x = torch.randn(256)
    assert native.fp8_encode(x.half(), 64) is None
    assert native.fp8_encode(x.double(), 64) is None
    assert native.fp8_encode(x[::2], 64) is None
    assert native.fp8_encode(x, 2 * native.library().mixprec_max_block()) is None
    codes, scales = native.fp8_encode(x, 64)
    assert native.fp8_decode(codes, scales, 256, torch.float16, 64) is None
    monkeypatch.setattr(native, "_LIBRARY", [])
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.fp8_encode(x, 64) is None
    assert native.fp8_decode(codes, scales, 256, torch.float32, 64) is None


def test_the_fp8_codec_refuses_sizes_it_would_read_past():
    """Codes and scales too few for the elements asked for (read past by the kernel: values
    of whatever memory follows), and a block that is not a positive number of elements (the
    kernel divided by zero, or returned memory never written), raise, naming what was given."""
    x = torch.randn(4096)
    codes, scales = native.fp8_encode(x, 64)
    with pytest.raises(ValueError, match="take 4096 codes and 64 scales, got 64 codes and 1"):
        native.fp8_decode(codes[:64], scales[:1], 4096, torch.float32, 64)
    with pytest.raises(ValueError, match="take 4096 codes and 128 scales"):
        native.fp8_decode(codes, scales, 4096, torch.float32, 32)
    with pytest.raises(ValueError, match="one-byte codes and float32 scales"):
        native.fp8_decode(codes, scales.double(), 4096, torch.float32, 64)
    for block in (0, -64):
        with pytest.raises(ValueError, match=f"at least 1 element, got {block}"):
            native.fp8_decode(codes, scales, 4096, torch.float32, block)
        with pytest.raises(ValueError, match=f"at least 1 element, got {block}"):
            native.fp8_encode(x, block)
    with pytest.raises(ValueError, match="numel must be at least 0"):
        native.fp8_decode(codes, scales, -1, torch.float32, 64)
