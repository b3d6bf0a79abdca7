"""Support matrix, "auto", and the refuse/slow checks, on the real device and on described ones."""

import os
import re
import subprocess
import sys
import warnings
from contextlib import contextmanager

import pytest
import torch
from devices import AMX_CPU, AVX2_CPU, AVX512_CPU, H100, V100, ZEN4
from torch import nn

import mixprec
from mixprec import (
    Policy,
    PolicyMap,
    PrecisionError,
    SlowPrecisionError,
    hardware,
)
from mixprec.cli import main
from mixprec.errors import SlowPrecisionWarning
from mixprec.hardware import (
    DeviceInfo,
    check,
    detect,
    measuring,
    policy_support,
    resolve_auto,
    support_matrix,
)

SPR = DeviceInfo("cpu", "Xeon", cpu_flags=frozenset({"avx512bw", "amx_bf16", "avx512_fp16"}))
P100 = DeviceInfo("cuda", "Tesla P100", 0, capability=(6, 0))


@pytest.mark.parametrize(
    "info, expected",
    [
        (
            ZEN4,
            {"bf16-mixed": "fast", "16-mixed": "slow", "16-true": "slow", "64-true": "supported"},
        ),
        (SPR, {"bf16-mixed": "fast", "16-mixed": "slow"}),
        (AMX_CPU, {"bf16-mixed": "fast", "bf16-true": "fast", "16-mixed": "slow"}),
        (AVX2_CPU, {"bf16-mixed": "slow", "16-mixed": "slow", "32-true": "fast"}),
        (AVX512_CPU, {"bf16-mixed": "slow", "bf16-true": "slow", "16-mixed": "slow"}),
        (V100, {"bf16-mixed": "refused", "16-mixed": "fast", "32-true": "fast"}),
        (H100, {"bf16-mixed": "fast", "16-mixed": "fast", "bf16-true": "fast"}),
        (P100, {"16-mixed": "supported", "bf16-true": "refused"}),
    ],
    ids=["zen4", "sapphire-rapids", "amx", "old-cpu", "avx512-no-bf16", "v100", "h100", "p100"],
)
def test_support_matrix_by_device(info, expected):
    matrix = support_matrix(info)
    assert set(matrix) == {"32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"}
    for name, status in expected.items():
        assert matrix[name].status == status, (name, matrix[name])
        assert matrix[name].reason


@pytest.mark.parametrize(
    "info, expected",
    [
        (ZEN4, "bf16-mixed"),
        (AMX_CPU, "bf16-mixed"),
        (AVX512_CPU, "32-true"),
        (V100, "16-mixed"),
        (H100, "bf16-mixed"),
        (AVX2_CPU, "32-true"),
        (P100, "32-true"),
    ],
)
def test_auto_picks_the_fastest_stable_precision(info, expected):
    assert resolve_auto(info) == Policy(expected)


def test_refused_precision_raises_and_names_what_works():
    with pytest.raises(
        PrecisionError,
        match=r"'bf16-mixed' is refused on cuda:0 .*8\.0.*"
        r"Supported here: 32-true, 64-true, 16-mixed",
    ):
        check(Policy("bf16-mixed"), info=V100)


def test_slow_precision_raises_unless_allowed():
    with pytest.raises(
        SlowPrecisionError, match="slower than float32.*allow_slow=True.*bf16-mixed"
    ):
        check(Policy("16-mixed"), info=ZEN4)
    assert check(Policy("16-mixed"), info=ZEN4, allow_slow=True).status == "slow"
    assert check(Policy("bf16-mixed"), info=ZEN4).status == "fast"


def test_a_map_is_as_supported_as_its_worst_policy():
    pmap = PolicyMap("bf16-mixed", {"head": "16-mixed"})
    assert policy_support(pmap, ZEN4).status == "slow"
    assert policy_support(pmap, V100).status == "refused"
    assert policy_support(PolicyMap("bf16-mixed"), ZEN4).status == "fast"


def test_this_machine_is_described_and_consistent():
    info = detect("cpu")
    assert info.type == "cpu" and info.name
    assert check("32-true", "cpu").status == "fast"
    assert resolve_auto(info).name in support_matrix(info)
    assert support_matrix(info)[resolve_auto(info).name].status in ("fast", "supported")


def test_apply_only_warns_about_a_slow_precision(monkeypatch):
    monkeypatch.setattr(mixprec.hardware, "detect", lambda device=None: ZEN4)
    with pytest.warns(UserWarning, match="'16-mixed' is slow on cpu"):
        mixprec.apply(nn.Linear(2, 2), "16-mixed")


def test_the_slow_precision_note_names_the_slow_policy_so_it_is_said_once():
    """A map with rules warns as its slow policy does: one message, which Python's default
    filter shows once per place, and a class of its own to filter by."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with hardware.assume(ZEN4), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixprec.apply(model, "16-mixed")
        mixprec.apply(model, PolicyMap("16-mixed", {"1": "bf16-mixed"}))
        mixprec.apply(model, PolicyMap("bf16-mixed", {"1": "16-true"}))
    messages = [str(w.message) for w in caught]
    assert all(w.category is SlowPrecisionWarning for w in caught)
    assert [m.split(" is slow")[0] for m in messages] == [
        "precision '16-mixed'",
        "precision '16-mixed'",
        "precision '16-true'",
    ]
    assert messages[0] == messages[1]


def test_measure_reports_a_rate_per_dtype():
    rates = measuring.measure((torch.float32, torch.bfloat16), "cpu", seconds=0.02)
    assert set(rates) == {"float32", "bfloat16"} and all(r > 0 for r in rates.values())


def test_measure_rates_takes_the_median_of_rounds_and_keeps_their_range():
    rates = measuring.measure_rates((torch.float32,), "cpu", seconds=0.02, repeats=3)
    r = rates["float32"]
    assert 0 < r.low <= r.median <= r.high and r.spread >= 1.0
    assert r.size >= 128 and r.size & (r.size - 1) == 0
    with pytest.raises(ValueError, match="repeats >= 1"):
        measuring.measure_rates((torch.float32,), "cpu", repeats=0)


def test_measured_rates_are_flagged_when_rounds_disagree_or_contradict_the_hardware():
    rate = measuring.Rate
    calm = {"float32": rate(100.0, 95.0, 105.0, 1024), "bfloat16": rate(300.0, 290.0, 310.0, 1024)}
    assert measuring.measure_notice(calm, ZEN4, load=0.5) is None
    # bf16 is fast on a Zen 4: measured 10x slower than float32 means the cores were taken
    slow = {"float32": rate(100.0, 95.0, 105.0, 1024), "bfloat16": rate(10.0, 9.0, 11.0, 1024)}
    notice = measuring.measure_notice(slow, ZEN4, load=0.5)
    assert "bfloat16, fast on this hardware, measured 10.0x slower than float32" in notice
    assert notice.startswith("these rates are not to be trusted")
    # on an AVX2-only CPU bf16 is slow: the same numbers are what the hardware does
    assert measuring.measure_notice(slow, AVX2_CPU, load=0.5) is None
    wide = {"float32": rate(100.0, 20.0, 140.0, 1024)}
    assert "disagreed by more than 1.5x (float32 20.0-140.0 GFLOP/s)" in (
        measuring.measure_notice(wide, ZEN4, load=0.5)
    )
    cores = os.cpu_count() or 1
    busy = measuring.measure_notice(calm, ZEN4, load=cores + 1.0)
    assert f"the 1-minute load average is {cores + 1.0:.2f} on {cores} cores" in busy


def test_info_measure_prints_medians_and_ranges_at_80_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    args = ["info", "--device", "cpu", "--measure", "--seconds", "0.02", "--repeats", "2"]
    with hardware.assume(ZEN4):
        assert main(args) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the table's title wraps at 80 columns
    assert "median of the rounds" in flat and "…" not in out
    assert "lower quartile of the paired rounds' ratios" in flat and "spread" in flat
    assert max(len(line.rstrip()) for line in out.splitlines()) <= 80
    with pytest.raises(SystemExit):
        main(["info", "--measure", "--repeats", "0"])
    assert "expected a whole number >= 1" in capsys.readouterr().err


def test_info_command_prints_the_matrix(capsys):
    assert main(["info", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for name in ("32-true", "bf16-mixed", "16-mixed", '"auto" resolves to', "int8_from_float32"):
        assert name in out


def test_info_says_int8_saves_memory_not_time_without_vnni(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with hardware.assume(AVX2_CPU):
        assert main(["info"]) == 0
    flat = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "int8_from_float32 supported int8: no VNNI" in flat
    with hardware.assume(ZEN4):
        assert main(["info"]) == 0
    flat = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "int8_from_float32 fast int8: VNNI dot products (avx512_vnni)" in flat


def test_info_on_an_amx_cpu_rates_bf16_fast_by_its_measured_speed(capsys, monkeypatch):
    """A Sapphire Rapids-like CPU, described: bfloat16 fast at the size it was measured at,
    float16 rated by its convolutions whatever its GEMMs measured, "auto" bf16-mixed."""
    monkeypatch.setenv("COLUMNS", "200")
    with hardware.assume(AMX_CPU):
        assert main(["info", "--device", "cpu"]) == 0
    flat = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert (
        "bf16-mixed fast bfloat16: bfloat16 matrix instructions (amx_bf16/avx512_bf16); "
        "its GEMMs measured 8x float32's speed here"
    ) in flat
    assert "16-mixed slow float16: its GEMMs measured 0.9x float32's speed here, but rated by" in (
        flat
    )
    assert "(bfloat16 8x, float16 0.9x; below 0.8x is slow): bfloat16 at 1024x1024" in flat
    assert '"auto" resolves to: bf16-mixed' in flat
    assert "bfloat16 would be fast on" not in flat


def test_unknown_device_type_is_refused():
    with pytest.raises(PrecisionError, match="unknown device type 'meta'"):
        detect("meta")


AMX_FLAGS = frozenset({"avx2", "avx512bw", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"})


def test_avx2_vnni_is_a_side_branch_of_onednns_levels():
    """Capped at AVX512_CORE, oneDNN takes no VNNI kernel, avx_vnni's neither (int8 was
    rated fast there while the layer, finding oneDNN's sums wrong, ran its slower float
    path); AVX2_VNNI and ALL keep it."""
    from mixprec.device import cap_cpu_flags

    flags = frozenset({"avx2", "avx_vnni", "avx512bw", "avx512_vnni"})
    assert cap_cpu_flags(flags, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"})[0] == {"avx2", "avx512bw"}
    assert cap_cpu_flags(flags, {"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"})[0] == {"avx2", "avx_vnni"}
    assert cap_cpu_flags(flags, {"ONEDNN_MAX_CPU_ISA": "ALL"})[0] == flags


@pytest.mark.parametrize(
    "env, kept, note",
    [
        ({}, AMX_FLAGS, None),
        ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"avx2"}, "capped by ONEDNN_MAX_CPU_ISA=AVX2"),
        ({"ONEDNN_MAX_CPU_ISA": "avx512_core"}, {"avx2", "avx512bw"}, "ONEDNN_MAX_CPU_ISA"),
        (
            {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
            {"avx2", "avx512bw", "avx512_bf16"},
            "ONEDNN_MAX_CPU_ISA",
        ),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, AMX_FLAGS - {"amx_fp16"}, "AMX"),
        ({"ONEDNN_MAX_CPU_ISA": "ALL"}, AMX_FLAGS, None),
        ({"DNNL_MAX_CPU_ISA": "AVX2"}, {"avx2"}, "DNNL_MAX_CPU_ISA=AVX2"),
        # (ATen's capability caps its own kernels, not oneDNN's GEMMs: bfloat16's ran 2.4x
        # float32 under it on a Zen 5, and was rated slow by its capped flags)
        ({"ATEN_CPU_CAPABILITY": "avx2"}, AMX_FLAGS, "ATEN_CPU_CAPABILITY=avx2 caps torch's own"),
        ({"ATEN_CPU_CAPABILITY": "default"}, AMX_FLAGS, "no flag capped"),
        (
            {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
            {"avx2"},
            "capped by ONEDNN_MAX_CPU_ISA=AVX2; ATEN_CPU_CAPABILITY=avx2 caps",
        ),
        ({"ATEN_CPU_CAPABILITY": "avx512"}, AMX_FLAGS, None),
        ({"ONEDNN_MAX_CPU_ISA": "pentium"}, AMX_FLAGS, "ONEDNN_MAX_CPU_ISA='pentium' not under"),
        # read as the libraries read them: oneDNN's own variable over its old name, no
        # blanks around a value; ATen's lowercase names only (it ignores "AVX2")
        (
            {"ONEDNN_MAX_CPU_ISA": "ALL", "DNNL_MAX_CPU_ISA": "AVX2"},
            AMX_FLAGS,
            "DNNL_MAX_CPU_ISA='AVX2' ignored: ONEDNN_MAX_CPU_ISA is set",
        ),
        ({"DNNL_MAX_CPU_ISA": " AVX2"}, AMX_FLAGS, "DNNL_MAX_CPU_ISA=' AVX2' not understood"),
        ({"ATEN_CPU_CAPABILITY": "AVX2"}, AMX_FLAGS, "ATEN_CPU_CAPABILITY='AVX2' not understood"),
    ],
)
def test_isa_caps_users_set_for_torch_cap_the_flags(env, kept, note):
    """Each cap as its library reads it: a cap the library ignored, read as applied, rated
    a fast bfloat16 CPU slow ("auto" gave 32-true), or stored its speed under the key of a
    process really capped (which then read bfloat16 fast at 0.02x float32)."""
    from mixprec.device import cap_cpu_flags

    flags, why = cap_cpu_flags(AMX_FLAGS, env)
    assert flags == kept
    assert (why is None) if note is None else (note in why)


def test_detection_honours_an_isa_cap_so_any_host_can_play_an_avx2_cpu(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    info = detect("cpu")
    assert not info.cpu_flags & {"avx512bw", "avx512_bf16", "amx_bf16", "avx512_fp16"}
    assert support_matrix(info)["bf16-mixed"].status == "slow"
    assert resolve_auto(info) == Policy("32-true")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert detect("cpu").isa_cap is None or "ONEDNN" not in detect("cpu").isa_cap


def test_assume_stands_in_for_the_host_and_restores_it():
    host = detect("cpu")
    with hardware.assume(ZEN4):
        assert detect("cpu") is ZEN4 and detect() is not H100
        with hardware.assume(AVX2_CPU):
            assert detect("cpu") is AVX2_CPU
            with pytest.raises(SlowPrecisionError, match="It is fast on NVIDIA GPUs"):
                mixprec.Precision("bf16-mixed").setup(nn.Linear(2, 2))
        assert detect("cpu") is ZEN4
        assert mixprec.Precision("bf16-mixed").setup(nn.Linear(2, 2)).weight.dtype == torch.float32
    assert detect("cpu") == host


def test_cuda_on_a_torch_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this torch sees a GPU")
    with pytest.raises(PrecisionError, match="sees no CUDA GPU.*device='cpu'"):
        detect("cuda")


def test_mps_where_there_is_none_is_a_clear_error():
    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    with pytest.raises(PrecisionError, match="device 'mps': .* sees no Apple GPU.*device='cpu'"):
        detect("mps")


def test_info_under_an_isa_cap_rates_bf16_slow_and_says_where_it_is_fast():
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2", COLUMNS="200")
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec.cli", "info", "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(r"bf16-mixed\s*│\s*slow", out)
    assert '"auto" resolves to: 32-true' in out
    assert "bfloat16 would be fast on: NVIDIA GPUs of compute capability 8.0+" in out


@pytest.mark.parametrize(
    "info, expected", [(H100, "bf16-mixed"), (V100, "16-mixed"), (AVX2_CPU, "32-true")]
)
def test_resolve_policy_resolves_auto_against_the_described_device(info, expected):
    from mixprec.hardware import resolve_policy

    assert resolve_policy("auto", info) == PolicyMap(expected)
    assert resolve_policy(" AUTO ", info) == PolicyMap(expected)
    # anything else means the same on every device
    assert resolve_policy("16-true", info) == PolicyMap("16-true")
    pmap = PolicyMap("bf16-mixed", {"head": "32-true"})
    assert resolve_policy(pmap, info) is pmap


@contextmanager
def _gpu_machine(cpu, gpu):
    """A described machine with a CPU and a GPU: every check answers from the descriptions,
    never from the host."""
    with hardware.assume(cpu), hardware.assume(gpu):
        yield


def test_bench_auto_on_the_cpu_of_a_gpu_machine_is_the_cpus_choice():
    from mixprec.bench import suite

    with _gpu_machine(AVX2_CPU, H100):
        policies, _, _ = suite._precisions(["auto"], torch.device("cpu"), allow_slow=False)
    assert list(policies) == ["32-true"]


@_gpu_machine(AVX2_CPU, V100)
def test_precision_auto_resolves_at_setup_on_the_models_device():
    precision = mixprec.Precision("auto")
    with pytest.raises(RuntimeError, match=r"picks its policy and scaler at setup\(\)"):
        precision.policy  # noqa: B018
    precision.setup(nn.Linear(2, 2))  # a CPU model
    assert precision.policy == PolicyMap("32-true")
    assert precision.scaler.kind == "none"
    assert mixprec.Precision("auto", device="cuda").policy == PolicyMap("16-mixed")


@_gpu_machine(AVX2_CPU, V100)
def test_diagnose_resolves_auto_on_its_device():
    model = nn.Sequential(nn.Linear(2, 2))
    batch = (torch.ones(3, 2), torch.zeros(3, dtype=torch.int64))
    report = mixprec.diagnose(
        model, batch, nn.functional.cross_entropy, precision="auto", device="cpu"
    )
    assert report.precision == PolicyMap("32-true")


@pytest.mark.parametrize(
    ("macos", "status"), [(None, "supported"), ((14, 5), "supported"), ((13, 6), "refused")]
)
def test_a_described_apple_gpu_is_rated_from_its_description(macos, status):
    """The bfloat16 rating asked the host's torch for its macOS version: every rating of a
    described MPS device raised on any other machine (RuntimeError, `mixprec info` exit 3)."""
    m2 = DeviceInfo("mps", "Apple M2", macos=macos)
    assert support_matrix(m2)["bf16-mixed"].status == status
    assert resolve_auto(m2).name == "16-mixed"
    with mixprec.hardware.assume(m2):
        assert main(["info", "--device", "mps"]) == 0


def test_int8_is_refused_on_an_apple_gpu():
    """int8 was rated fast on MPS, whose int8 layers have only the float64 fallback there,
    which MPS lacks (the forward would fail)."""
    from mixprec.hardware import policy_support

    m2 = DeviceInfo("mps", "Apple M2", macos=(14, 5))
    support = policy_support("int8_from_float32", m2)
    assert support.status == "refused" and "float64" in support.reason


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"type": "gpu"}, "type is 'cpu', 'cuda' or 'mps'"),
        ({"type": "cuda"}, "needs its capability"),
        ({"type": "cuda", "capability": (9,)}, r"capability is a \(major, minor\)"),
        ({"type": "cuda", "capability": "9.0"}, r"capability is a \(major, minor\)"),
        ({"cpu_flags": "avx512_bf16"}, "cpu_flags is a frozenset"),
        ({"type": "mps", "macos": (14,)}, r"macos is a \(major, minor\)"),
        ({"gemm_ratios": {"bfloat16": True}}, "gemm_ratios"),
    ],
)
def test_a_device_description_that_does_not_hold_together_is_refused(fields, message):
    """These raised a bare torch or unpacking error at the first rating, or rated every
    precision refused (an "xpu") while auto still answered."""
    with pytest.raises(ValueError, match=message):
        DeviceInfo(**{"type": "cpu", "name": "described", **fields})


@pytest.mark.parametrize(
    ("ratio", "text"),
    [(0.7951, "0.795x"), (0.8, "0.8x"), (1.25, "1.25x"), (1.249, "1.2x"), (4.6, "4.6x"),
     (0.061, "0.061x"), (1.2499, "1.2x"), (0.7999, "0.7999x"), (0.996, "0.996x"),
     (1.004, "1x")],
)  # fmt: skip
def test_a_gemm_ratio_is_shown_on_the_side_of_the_thresholds_it_is_rated_by(ratio, text):
    """A Zen 4 measured at 0.7951 was rated slow while the text read "0.8x ... below 0.8x
    is slow"; 1.25 (fast) and 1.249 (supported) both read "1.2x"."""
    from mixprec.hardware import times_text

    assert times_text(ratio) == text


ARM_CPUINFO = {
    # Graviton2 (Neoverse N1) and Graviton3 (Neoverse V1): "Features", no "model name"
    "0xd0c": "processor\t: 0\nFeatures\t: fp asimd aes crc32 atomics fphp asimdhp asimddp\n"
    "CPU implementer\t: 0x41\nCPU part\t: 0xd0c\n",
    "0xd40": "processor\t: 0\nFeatures\t: fp asimd fphp asimdhp sve i8mm bf16 svebf16\n"
    "CPU implementer\t: 0x41\nCPU part\t: 0xd40\n",
}


def test_arm_cpus_are_told_apart_and_their_bf16_instructions_read(monkeypatch):
    """Arm's /proc/cpuinfo names its flags "Features" and has no model name: every Arm CPU
    got the key ('aarch64', no flags), so one's cached GEMM ratios served another, and a
    CPU with bf16 instructions was "emulated" by its flags."""
    import builtins
    import io
    import platform

    import mixprec.device as device

    real_open = builtins.open
    found = {}
    for part, text in ARM_CPUINFO.items():

        def fake_open(path, *args, text=text, **kwargs):
            if path == "/proc/cpuinfo":
                return io.StringIO(text)
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(platform, "machine", lambda: "aarch64")
        found[part] = (device._cpu_name(), device._cpu_flags()[0])
    monkeypatch.setattr(builtins, "open", real_open)
    assert found["0xd0c"][0] == "aarch64 0x41:0xd0c" != found["0xd40"][0]
    assert "bf16" in found["0xd40"][1] and "bf16" not in found["0xd0c"][1]
    v1 = support_matrix(DeviceInfo("cpu", found["0xd40"][0], cpu_flags=found["0xd40"][1]))
    assert v1["bf16-mixed"].status == "supported" and "Arm bfloat16" in v1["bf16-mixed"].reason


# a Skylake-SP Xeon as torch's cpuinfo names it: AVX-512 without VNNI or bf16
SKYLAKE_CAPABILITIES = {
    "architecture": "x86_64",
    "sse2": True,
    "avx2": True,
    "avx512_f": True,
    "avx512_bw": True,
    "avx512_vnni": False,
    "avx_vnni": False,
    "avx512_bf16": False,
    "amx_tile": False,
    "num_logical_cores": 8,
}


def _without_cpuinfo_flags(monkeypatch, machine: str) -> None:
    """A host whose /proc/cpuinfo has no flags line (a sandbox; Windows and Intel Macs have
    no /proc/cpuinfo), its CPU `machine`."""
    import builtins
    import io
    import platform

    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/cpuinfo":
            return io.StringIO("processor\t: 0\nmodel name\t: Described CPU\n")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(platform, "system", lambda: "Windows")


def test_a_cpu_without_a_flags_line_is_read_by_torch(monkeypatch):
    """With no flags line the CPU had no flags: int8 was rated fast on x86 CPUs without VNNI,
    where it runs slower than float32, and bfloat16 "emulated" on CPUs with avx512_bf16."""
    import mixprec.device as device

    _without_cpuinfo_flags(monkeypatch, "AMD64")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: SKYLAKE_CAPABILITIES, raising=False)
    flags, unknown = device._cpu_flags()
    assert {"sse2", "avx2", "avx512f", "avx512bw"} <= flags and not unknown
    assert not flags & {"avx512_vnni", "avx_vnni", "architecture", "num_logical_cores"}
    info = DeviceInfo("cpu", "Skylake", cpu_flags=flags)
    assert policy_support("int8_from_float32", info).status == "supported"
    assert "no avx512_bf16/amx_bf16" in support_matrix(info)["bf16-mixed"].reason
    zen4 = dict(SKYLAKE_CAPABILITIES, avx512_vnni=True, avx512_bf16=True)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: zen4)
    info = DeviceInfo("cpu", "Zen 4", cpu_flags=device._cpu_flags()[0])
    assert support_matrix(info)["bf16-mixed"].status == "fast"
    assert "avx512_bf16, avx512_vnni, avx512bw" in info.describe()


def _fixed_gemm_ratios(monkeypatch, tmp_path) -> None:
    """The host's GEMMs "measured" at set ratios, into a cache of the test's own."""
    from mixprec.device import gemm_ratio

    fixed = gemm_ratio.GemmRatios(
        ratios={"bfloat16": 0.5, "float16": 0.05},
        spread={"bfloat16": 1.0, "float16": 1.0},
        sizes={"bfloat16": 1024, "float16": 128},
        rounds={"bfloat16": 3, "float16": 3},
        seconds=0.4,
        measured_at="2026-01-01 00:00 UTC",
    )
    monkeypatch.setattr(gemm_ratio, "measure", lambda *args: fixed)
    monkeypatch.setenv(gemm_ratio.CACHE_ENV, str(tmp_path))
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.usefixtures("fresh_detect")
def test_flags_a_torch_without_capabilities_cannot_read_are_said_to_be_unknown(
    monkeypatch, tmp_path
):
    """torch's older probes read avx512_vnni but not avx_vnni, avx512f but not avx512bw or
    avx512_fp16: those are unknown, and the ratings say so rather than call them absent."""
    _without_cpuinfo_flags(monkeypatch, "AMD64")
    _fixed_gemm_ratios(monkeypatch, tmp_path)
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    probes = {"avx2": True, "avx512": True, "vnni": False, "avx512_bf16": False}
    for name in ("avx2", "avx512", "vnni", "avx512_bf16", "amx_tile", "amx_fp16"):
        monkeypatch.setattr(torch.cpu, f"_is_{name}_supported", lambda n=name: probes.get(n, False))
    info = detect("cpu")
    assert {"sse2", "avx2", "avx512f"} <= info.cpu_flags
    assert info.unknown_flags == {"avx_vnni", "avx512bw", "avx512_fp16"}
    assert "flags unknown: avx512_fp16, avx512bw, avx_vnni" in info.describe()
    int8 = policy_support("int8_from_float32", info)
    assert int8.status == "supported" and "flags unknown (avx_vnni)" in int8.reason
    matrix = support_matrix(info)
    assert "flags unknown: avx512bw" in matrix["bf16-mixed"].reason
    assert "no bf16 or avx512" not in matrix["bf16-mixed"].reason
    assert "flags unknown (avx512_fp16)" in matrix["16-mixed"].reason
    assert "no float16 hardware" not in matrix["16-mixed"].reason
    # an ISA cap keeps torch from the unknown flags' kernels: they are as good as absent
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI")
    assert detect("cpu").unknown_flags == {"avx_vnni"}


@pytest.mark.usefixtures("fresh_detect")
def test_an_arm_cpu_whose_flags_cannot_be_read_has_bfloat16_unknown(monkeypatch, tmp_path):
    _without_cpuinfo_flags(monkeypatch, "ARM64")
    _fixed_gemm_ratios(monkeypatch, tmp_path)
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    info = detect("cpu")
    assert info.cpu_flags == frozenset() and info.unknown_flags == {"bf16"}
    bf16 = support_matrix(info)["bf16-mixed"]
    assert "flags unknown (bf16)" in bf16.reason and "no bf16" not in bf16.reason
    assert "flags unknown: bf16" in info.describe()


@pytest.mark.parametrize("flag", ["AVX512_BF16", "avx512-bf16", " avx512_bf16", "avx512 bf16"])
def test_a_cpu_flag_spelled_otherwise_than_proc_cpuinfo_is_refused(flag):
    """ "AVX512_BF16" and the like matched no flag mixprec reads: the CPU was silently rated
    as lacking avx512_bf16 (bf16-mixed slow, "auto" 32-true)."""
    with pytest.raises(ValueError, match=re.escape(f"{flag!r} is not spelled") + ".*'avx512_bf16'"):
        DeviceInfo("cpu", "Zen 4", cpu_flags=frozenset({"avx512bw", flag}))
    with pytest.raises(ValueError, match="unknown_flags"):
        DeviceInfo("cpu", "Zen 4", unknown_flags=frozenset({flag}))
    with pytest.raises(ValueError, match="both in cpu_flags and unknown"):
        DeviceInfo("cpu", "x", cpu_flags=frozenset({"bf16"}), unknown_flags=frozenset({"bf16"}))


def _one_gpu(monkeypatch) -> None:
    """A host with one CUDA GPU, as torch.cuda answers: an index past it fails torch's
    assertion, as torch's own `get_device_properties` does."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "H100")

    def properties(device=None):
        raise AssertionError("Invalid device id")

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)


def test_a_gpu_index_past_the_visible_gpus_is_a_clear_error(monkeypatch, capsys):
    """`mixprec info --device cuda:1` on a one-GPU host printed torch's AssertionError with
    a traceback (exit 3)."""
    _one_gpu(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(PrecisionError, match=r"'cuda:1'.* sees 1 CUDA GPU\(s\), cuda:0 \(H100\)"):
        detect("cuda:1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert main(["info", "--device", "cuda:2"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "'cuda:2'" in err and "CUDA_VISIBLE_DEVICES='3'" in err and "Traceback" not in err


RTX4090 = DeviceInfo("cuda", "NVIDIA GeForce RTX 4090", 0, capability=(8, 9))


@pytest.mark.parametrize(
    ("capability", "status"),
    [((8, 9), "slow"), ((8, 6), "slow"), ((7, 5), "slow"), ((12, 0), "slow"),
     ((6, 0), "supported"), ((7, 0), "supported"), ((8, 0), "supported"),
     ((9, 0), "supported"), ((10, 0), "supported")],
)  # fmt: skip
def test_float64_is_slow_on_gpus_without_float64_units(capability, status):
    """An RTX 4090, A10 or L4 (1/64 of the float32 rate) was rated as an H100 for 64-true."""
    gpu = DeviceInfo("cuda", "described", 0, capability=capability)
    assert support_matrix(gpu)["64-true"].status == status


def test_64_true_on_a_gpu_with_slow_float64_is_treated_as_any_slow_precision(monkeypatch):
    with pytest.raises(SlowPrecisionError, match=r"'64-true'.*It is fast on NVIDIA GPUs of comp"):
        check("64-true", info=RTX4090)
    assert check("64-true", info=RTX4090, allow_slow=True).status == "slow"
    with hardware.assume(RTX4090):
        with pytest.raises(SlowPrecisionError):
            mixprec.Precision("64-true", device="cuda").resolve()
        assert mixprec.Precision("64-true", device="cuda", allow_slow=True).resolve().status == (
            "slow"
        )
        monkeypatch.setenv(hardware.ALLOW_SLOW_ENV, "1")
        assert mixprec.Precision("64-true", device="cuda").resolve().status == "slow"
    assert check("64-true", info=H100).status == "supported"


@pytest.mark.parametrize(
    ("flags", "ratio", "status"),
    [(AMX_FLAGS, 0.85, "supported"), (AMX_FLAGS, 1.1, "fast"), (AMX_FLAGS, 0.5, "slow"),
     ({"avx512_bf16", "avx512bw"}, 0.95, "supported"), ({"avx512bw"}, 0.85, "supported")],
)  # fmt: skip
def test_a_bf16_gemm_measured_slower_than_float32_is_not_rated_fast(flags, ratio, status):
    """An AMX or Zen 4 CPU whose bfloat16 GEMMs measured 0.85x float32 was rated fast by
    its flags, the reason quoting the 0.85x beside "fast"."""
    info = DeviceInfo(
        type="cpu", name="described", cpu_flags=frozenset(flags), gemm_ratios={"bfloat16": ratio}
    )
    rated = support_matrix(info)["bf16-mixed"]
    assert rated.status == status
    assert f"{ratio}x" in rated.reason
