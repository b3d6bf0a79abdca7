"""The compile gate's check of a compiled kernel against its eager form on a device whose
compiled numerics the suite does not hold (a GPU's): run here on the CPU by trusting no
device, with mixprec's own kernels held to their eager form bit for bit (the compensated
step, the fp8 codec) and with a build that drifts."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mixprec.activations import codecs
from mixprec.activations.codecs import ToFp8
from mixprec.optim import engine
from mixprec.optim.compensated import Compensator
from mixprec.optim.engine import CompileGate, can_compile
from mixprec.optim.states import LowBitAdamW, native

needs_compiler = pytest.mark.skipif(not can_compile("cpu"), reason="no C++ compiler here")


@pytest.fixture
def untrusted(monkeypatch):
    monkeypatch.setattr(engine, "TRUSTED", ())


def test_a_build_that_drifts_from_eager_is_caught_its_step_redone_and_dropped(untrusted):
    gate = CompileGate(None, "test step", "(a hint)")
    x = torch.arange(6.0)
    alias = x[2:]  # a view: the check's copies keep it one

    def drifting(a, b):
        a.add_(1.0)
        b.mul_(2.0)
        return a.sum()

    def exact(a, b):
        a.add_(1.0)
        b.mul_(3.0)
        return a.sum()

    with pytest.warns(UserWarning, match="test step compiled on cpu differs from its eager"):
        result, ran = gate.run(drifting, x, alias, eager=exact)
    assert ran and gate.failed is not None
    assert torch.equal(x, torch.tensor([1.0, 2.0, 9.0, 12.0, 15.0, 18.0]))  # eager's
    assert float(result) == 57.0  # eager's result, from its own copies
    assert not gate.wants(torch.device("cpu"), 1 << 30)  # eager from now on


def test_a_matching_build_is_checked_once_per_device_type(untrusted):
    gate = CompileGate(None, "test step", "")
    calls = []

    def eager(a):
        calls.append("eager")
        return a.add_(1.0)

    x = torch.zeros(4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gate.run(lambda a: a.add_(1.0), x, eager=eager)
        gate.run(lambda a: a.add_(1.0), x, eager=eager)
    assert not [w for w in seen if "eager form" in str(w.message)]
    assert calls == ["eager"] and len(gate.checked) == 1 and gate.failed is None
    assert torch.equal(x, torch.full((4,), 2.0))


def test_calls_past_the_size_bound_and_trusted_devices_are_not_checked(monkeypatch):
    gate = CompileGate(None, "test step", "")
    x = torch.zeros(64)
    gate.run(lambda a: a.add_(1.0), x, eager=lambda a: a.add_(2.0))  # the CPU is trusted
    monkeypatch.setattr(engine, "TRUSTED", ())
    monkeypatch.setattr(engine, "CHECK_MAX_BYTES", 64 * 4 - 1)
    gate.run(lambda a: a.add_(1.0), x, eager=lambda a: a.add_(2.0))
    assert gate.checked == set() and gate.failed is None and float(x[0]) == 2.0


def test_nans_of_other_payloads_match_and_each_kernel_and_dtype_is_checked(untrusted):
    gate = CompileGate(None, "test step", "")

    def quiet(a):
        a.copy_(torch.tensor([float("nan"), 1.0]))

    def payload(a):  # another NaN's bits
        a.copy_(torch.tensor([0x7FC00001, 0x3F800000], dtype=torch.int32).view(torch.float32))

    x = torch.zeros(2)
    gate.run(payload, x, eager=quiet)
    assert gate.failed is None and len(gate.checked) == 1

    def drifting(a):
        a.add_(1.0)

    with pytest.warns(UserWarning, match="differs from its eager form"):
        gate.run(drifting, torch.zeros(2, dtype=torch.float64), eager=lambda a: a.add_(2.0))
    assert gate.failed is not None  # another kernel, another dtype: checked too


def test_results_of_another_shape_dtype_or_value_are_drift(untrusted):
    for got, expected in [
        (lambda a: (a * 2, 3), lambda a: (a * 2, 4)),
        (lambda a: a.int(), lambda a: a.float()),
        (lambda a: a.repeat(2), lambda a: a),
    ]:
        gate = CompileGate(None, "test step", "")
        with pytest.warns(UserWarning, match="differs from its eager form"):
            gate.run(got, torch.zeros(4), eager=expected)
        assert gate.failed is not None


@needs_compiler
def test_the_compensated_step_and_the_fp8_codec_pass_their_check(untrusted, monkeypatch):
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(70000, generator=g).to(torch.bfloat16))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    comp = Compensator("kahan", seed=1, compile=True)
    monkeypatch.setattr(codecs.GATE, "compile", True)
    monkeypatch.setattr(codecs.GATE, "checked", set())
    monkeypatch.setattr(native, "_LIBRARY", [None])  # (the compiled codec, as off the CPU)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        params[0].grad = torch.randn(70000, generator=g).to(torch.bfloat16)
        comp.step(opt)
        ToFp8().decode(ToFp8().encode(torch.randn(64, 96, generator=g)))
        # a decode to another dtype is a build of its own, so a check of its own
        ToFp8().decode(ToFp8().encode(torch.randn(64, 96, generator=g).to(torch.bfloat16)))
    assert not [w for w in seen if "eager form" in str(w.message)]
    # one check per kernel, dtypes and dtype arguments: two encodes, two decodes
    assert len(codecs.GATE.checked) == 4 and codecs.GATE.failed is None


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_compiled_kahan_low_bit_step_does_not_lean_on_a_cast_pair(monkeypatch, dtype):
    """torch 2.11's inductor drops ``x.to(bfloat16).to(float32)`` as pointless even under
    ``emulate_precision_casts`` (an H200 run: a third of the weights a step off the eager
    step's, every Kahan buffer lost, on CUDA and on that machine's CPU alike); this inductor
    does so without that option. The compiled write-back takes its rounded weight from
    `engine.nearest_value`, so the step keeps to the eager one without the option too."""
    from mixprec.optim.states import kernels

    options = kernels._options()
    monkeypatch.setattr(kernels, "_options", lambda: {**options, "emulate_precision_casts": False})
    monkeypatch.setattr(kernels, "_COMPILED", {})
    torch._dynamo.reset()

    def run(compile):
        g = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(300, 256, generator=g).to(dtype))]
        # (float32 moments: the write-back is every format's, and their update builds in a
        # third of int8's time)
        opt = LowBitAdamW(
            params, lr=1e-3, states="float32", compensation="kahan", compile=compile, seed=1
        )
        for _ in range(4):
            params[0].grad = (torch.randn(300, 256, generator=g) * 1e-2).to(dtype)
            opt.step()
        assert opt.compiles("cpu") == (compile is None)
        return params[0].detach(), opt.state[params[0]]["compensation"].float()

    (w, c), (w0, c0) = run(None), run(False)
    assert torch.equal(w, w0)
    # (the buffers: equal but where a compiled update is a float32 ulp off eager's)
    assert float((c != c0).float().mean()) < 1e-2 and bool(c0.abs().gt(0).float().mean() > 0.5)


def _nudged(steps: int):
    """The fp8 codec's eager encode with every scale one float32 ulp up and one code moved
    ``steps`` e4m3 values: what a GPU's compiled division may give (``steps`` 1)."""
    eager = codecs._KERNELS["encode_blocks"]

    def call(blocks):
        codes, scales = eager(blocks)
        scales = torch.nextafter(scales, torch.full_like(scales, torch.inf))
        raw = codes.view(torch.uint8).clone()
        i = int((raw > 0).logical_and(raw < 0x70).nonzero()[0])  # a positive code below 448
        raw[i] += steps
        return raw.view(torch.float8_e4m3fn), scales

    return call


@pytest.mark.parametrize("steps", [1, 2])
def test_the_fp8_codec_check_allows_a_last_bit_and_refuses_more(untrusted, steps):
    """An H200's compiled codec had scales a float32 ulp off eager's in half the blocks and
    so codes at exact ties one e4m3 value apart; held bit for bit, its first call sent every
    later one to the eager codec (a 168M LM's step from 0.1 to 4 s). The codec's check
    allows that and nothing more: a code two values off is refused, eager's results kept."""
    blocks = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 3
    eager = codecs._KERNELS["encode_blocks"]
    gate = CompileGate(None, "fp8 codec", "(hint)")
    if steps == 1:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            (codes, scales), ran = gate.run(_nudged(1), blocks, eager=eager, agree=codecs._agrees)
        assert ran and gate.failed is None
        assert not torch.equal(scales, eager(blocks)[1])  # the compiled results are kept
    else:
        with pytest.warns(UserWarning, match="1 elements of its results past a last bit"):
            (codes, scales), ran = gate.run(_nudged(2), blocks, eager=eager, agree=codecs._agrees)
        assert gate.failed is not None
        expected = eager(blocks)
        assert torch.equal(scales, expected[1]) and torch.equal(
            codes.view(torch.uint8), expected[0].view(torch.uint8)
        )
    # decoded values: a last bit of their dtype allowed, two refused
    x = torch.randn(1000).to(torch.bfloat16)
    up = torch.nextafter(x, torch.full_like(x, torch.inf))
    assert codecs._agrees([up], [x]) == ""
    assert codecs._agrees([torch.nextafter(up, torch.full_like(x, torch.inf))], [x])


@needs_compiler
def test_the_fp8_codec_builds_once_for_saves_under_autocast_and_outside(monkeypatch):
    """A forward saves under autocast and a recomputation outside it: the codec's calls run
    with autocast off, one build for both (each state was a build, toward dynamo's limit
    of eight a function, reached on an H200 run)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    monkeypatch.setattr(codecs, "_COMPILED", {})
    monkeypatch.setattr(codecs.GATE, "compile", True)
    monkeypatch.setattr(native, "_LIBRARY", [None])  # (the compiled codec, as off the CPU)
    torch._dynamo.reset()
    x = torch.randn(128, 256).to(torch.bfloat16)
    outside = ToFp8().encode(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = ToFp8().encode(x)
    assert torch.equal(outside.scales, inside.scales)
    assert len(_debug_get_cache_entry_list(codecs._KERNELS["encode_blocks"].__code__)) == 1


def test_the_codec_check_holds_infinities_nans_and_structure_exactly():
    inf, nan = float("inf"), float("nan")
    eager = torch.tensor([inf, -inf, nan, 1.0, 0.0])
    assert codecs._agrees([eager.clone()], [eager]) == ""
    for wrong in ([0.0, -inf, nan, 1.0, 0.0], [inf, inf, nan, 1.0, 0.0], [inf, -inf, 1.0, 1.0, 0.0],
                  [inf, -inf, nan, inf, 0.0]):  # fmt: skip
        assert codecs._agrees([torch.tensor(wrong)], [eager]) == (
            "1 elements of its results past a last bit"
        )
    assert codecs._agrees([eager], [eager, eager]) == "a different number of results"
    assert "where eager gives" in codecs._agrees([eager], [3])
    assert codecs._agrees([torch.tensor([1, 2])], [torch.tensor([1, 3])])


def test_nearest_value_quiets_nan_payloads():
    """A NaN whose low 16 bits are set carried into bfloat16's exponent or sign (to -0.0 or
    -inf) in `nearest_bits`; torch's conversion gives a NaN."""
    bits = torch.tensor([0x7FFFA0DC, 0xFF8044E3 - (1 << 32), 0x7FC00001], dtype=torch.int32)
    assert engine.nearest_value(bits.view(torch.float32), torch.bfloat16).isnan().all()
