"""A CPU's bfloat16/float16 ratings from a measured GEMM speed against float32: the flags are
the prior and the explanation, the measurement the verdict, cached per machine. Described
CPUs state their ratios, so every outcome here is the same on any host."""

import json
import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from devices import AMX_CPU, AVX2_CPU, AVX512_CPU, H100, ZEN4
from torch import nn

import mixprec
from mixprec import SlowPrecisionError, device, hardware
from mixprec.cli import main
from mixprec.device import DeviceInfo, gemm_ratio
from mixprec.hardware import check, measuring, resolve_auto, support_matrix
from mixprec.policy import as_policy


def _cpu(flags, **ratios):
    return DeviceInfo("cpu", "described", cpu_flags=frozenset(flags), gemm_ratios=ratios or None)


def test_on_an_avx512_cpu_without_bf16_bf16_is_slow_naming_its_measured_ratio():
    matrix = support_matrix(AVX512_CPU)
    assert matrix["bf16-mixed"].status == "slow"
    assert "measured 0.42x float32's speed" in matrix["bf16-mixed"].reason
    assert "no avx512_bf16/amx_bf16" in matrix["bf16-mixed"].reason
    assert resolve_auto(AVX512_CPU) == mixprec.Policy("32-true")
    with pytest.raises(SlowPrecisionError, match=r"'bf16-mixed'.*measured 0\.42x.*allow_slow"):
        check("bf16-mixed", info=AVX512_CPU)
    with hardware.assume(AVX512_CPU), pytest.raises(SlowPrecisionError, match=r"0\.42x"):
        mixprec.Precision("bf16-mixed").setup(nn.Linear(2, 2))
    assert check("bf16-mixed", info=AVX512_CPU, allow_slow=True).status == "slow"


@pytest.mark.parametrize(
    "info, ratings, auto",
    [
        (ZEN4, {"bf16-mixed": "fast", "16-mixed": "slow"}, "bf16-mixed"),
        (AMX_CPU, {"bf16-mixed": "fast", "16-mixed": "slow"}, "bf16-mixed"),
        (H100, {"bf16-mixed": "fast", "16-mixed": "fast"}, "bf16-mixed"),
    ],
    ids=["zen4", "amx", "h100"],
)
def test_where_16_bits_are_fast_the_measurement_changes_nothing(info, ratings, auto):
    matrix = support_matrix(info)
    assert {name: matrix[name].status for name in ratings} == ratings
    assert resolve_auto(info).name == auto


@pytest.mark.parametrize(
    "info, expected",
    [
        # flags predict fast, the GEMM measured half float32's speed: slow
        (_cpu({"avx512bw", "avx512_bf16"}, bfloat16=0.5), "slow"),
        (_cpu({"avx512bw", "avx512_bf16"}, bfloat16=1.0), "fast"),
        # no bf16 instructions known (an Arm CPU's flags are not read), yet measured fast
        (_cpu(set(), bfloat16=1.6), "fast"),
        (_cpu(set(), bfloat16=0.9), "supported"),
        (_cpu({"avx2"}, bfloat16=0.02), "slow"),
        # stated without a measurement: the flags alone
        (_cpu({"avx512bw", "avx512_bf16"}), "fast"),
        (_cpu({"avx512bw"}), "slow"),
    ],
)
def test_the_measured_ratio_overrules_the_flags_for_bfloat16(info, expected):
    assert hardware.dtype_support(torch.bfloat16, info).status == expected


def test_a_fast_float16_gemm_does_not_make_float16_fast_where_its_convolutions_are_slow():
    s = hardware.dtype_support(torch.float16, _cpu({"avx512_fp16"}, float16=1.5))
    assert s.status == "slow" and "convolutions" in s.reason and "1.5x" in s.reason
    amx = _cpu({"amx_fp16"}, float16=0.3)
    assert hardware.dtype_support(torch.float16, amx).status == "slow"


def test_described_ratios_are_checked():
    with pytest.raises(ValueError, match="'float8'.*bfloat16 and float16.*positive"):
        _cpu({"avx2"}, float8=0.5)
    with pytest.raises(ValueError, match="bfloat16"):
        _cpu({"avx2"}, bfloat16=0.0)
    info = _cpu({"avx2"}, bfloat16=0.5)
    assert hash(info) == hash(_cpu({"avx2"}, bfloat16=0.7)) and info != _cpu({"avx2"})


def test_info_rates_bf16_slow_on_an_avx512_cpu_without_bf16(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with hardware.assume(AVX512_CPU):
        assert main(["info", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"bf16-mixed\s*│\s*slow\s*│ bfloat16: its GEMMs measured 0\.42x", out)
    assert '"auto" resolves to: 32-true' in out
    assert "speed against float32 (bfloat16 0.42x, float16 0.05x" in out
    with hardware.assume(ZEN4):
        assert main(["info", "--device", "cpu"]) == 0
    assert "rated by this CPU's flags alone" in capsys.readouterr().out


def test_the_search_and_the_bench_plan_read_the_same_rating():
    from mixprec.bench import suite
    from mixprec.plan.units import default_formats

    chosen, left_out = default_formats(as_policy("32-true"), AVX512_CPU)
    assert "bf16-true" not in chosen and "measured 0.42x" in left_out["bf16-true"]
    with hardware.assume(AVX512_CPU):
        policies, _, _ = suite._precisions(None, torch.device("cpu"), allow_slow=False)
        with pytest.raises(ValueError, match=r"0\.42x.*--allow-slow"):
            suite._precisions(["bf16-mixed"], torch.device("cpu"), allow_slow=False)
    assert list(policies) == ["32-true"]


def test_the_doctor_does_not_offer_bf16_where_it_is_rated_slow():
    """A float16 range problem goes to float32, not bfloat16, on a CPU whose bf16 GEMMs are
    slow; on a Zen 4 bfloat16 is offered first."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.fill_(3e4)
    batch = (torch.full((2, 4), 10.0), torch.zeros(2, dtype=torch.int64))
    offered = {}
    for info in (AVX512_CPU, ZEN4):
        with hardware.assume(info):
            report = mixprec.diagnose(
                model, batch, nn.functional.cross_entropy, precision="16-mixed", device="cpu"
            )
            rec = report.recommend()
        offered[info.name] = {str(p) for p in rec.policy.policies()}
    assert not any("bf16" in name for name in offered[AVX512_CPU.name])
    assert any("bf16" in name for name in offered[ZEN4.name])


def _fresh(monkeypatch, folder):
    monkeypatch.setenv(gemm_ratio.CACHE_ENV, str(folder))
    device._detect.cache_clear()


@pytest.mark.usefixtures("fresh_detect")
def test_the_host_is_measured_once_per_machine_and_torch(tmp_path, monkeypatch):
    _fresh(monkeypatch, tmp_path)
    first = device.detect("cpu")
    path = tmp_path / gemm_ratio.CACHE_FILE
    data = json.loads(path.read_text())
    (entry,) = data["entries"]
    assert entry["key"]["cpu"] == first.name and entry["key"]["torch"] == torch.__version__
    assert entry["key"]["flags"] == sorted(first.cpu_flags)
    assert set(first.gemm_ratios) == {"bfloat16", "float16"}
    assert str(path) in first.gemm_note and "on one thread" in first.gemm_note
    # a later process reads the cache: what it says is what rates the host
    entry["measured"]["ratios"] = {"bfloat16": 0.5, "float16": 0.6}
    path.write_text(json.dumps(data))
    device._detect.cache_clear()
    assert device.detect("cpu").gemm_ratios == {"bfloat16": 0.5, "float16": 0.6}
    assert support_matrix(device.detect("cpu"))["bf16-mixed"].status == "slow"
    # measured under another torch: measured again, and kept beside it
    entry["key"]["torch"] = "2.0.0"
    path.write_text(json.dumps(data))
    device._detect.cache_clear()
    again = device.detect("cpu")
    assert again.gemm_ratios != {"bfloat16": 0.5, "float16": 0.6}
    versions = [e["key"]["torch"] for e in json.loads(path.read_text())["entries"]]
    assert versions == ["2.0.0", torch.__version__]
    assert not list(tmp_path.glob(".*"))  # written by replacing, no temporary left


@pytest.mark.usefixtures("fresh_detect")
def test_remeasure_replaces_the_cached_ratios(tmp_path, monkeypatch):
    _fresh(monkeypatch, tmp_path)
    device.detect("cpu")
    path = tmp_path / gemm_ratio.CACHE_FILE
    data = json.loads(path.read_text())
    data["entries"][0]["measured"]["ratios"] = {"bfloat16": 0.5, "float16": 0.6}
    path.write_text(json.dumps(data))
    device._detect.cache_clear()
    assert device.detect("cpu").gemm_ratios == {"bfloat16": 0.5, "float16": 0.6}
    again = device.remeasure()
    assert again.gemm_ratios != {"bfloat16": 0.5, "float16": 0.6}
    assert device.detect("cpu") is again
    assert len(json.loads(path.read_text())["entries"]) == 1


@pytest.mark.usefixtures("fresh_detect")
def test_a_cache_that_is_not_ours_is_measured_again(tmp_path, monkeypatch):
    _fresh(monkeypatch, tmp_path)
    (tmp_path / gemm_ratio.CACHE_FILE).write_text("not json")
    info = device.detect("cpu")
    assert set(info.gemm_ratios) == {"bfloat16", "float16"}
    assert json.loads((tmp_path / gemm_ratio.CACHE_FILE).read_text())["entries"]


@pytest.mark.usefixtures("fresh_detect")
def test_a_cache_that_cannot_be_written_is_said_and_the_host_still_rated(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _fresh(monkeypatch, blocker / "cache")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = device.detect("cpu")
    assert set(info.gemm_ratios) == {"bfloat16", "float16"}
    (w,) = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert "could not cache" in str(w.message) and gemm_ratio.CACHE_ENV in str(w.message)


@pytest.mark.usefixtures("fresh_detect")
def test_a_remeasure_that_cannot_be_cached_measures_once(tmp_path, monkeypatch):
    """Found by a review: `mixprec info --measure` with an unwritable cache measured twice
    (and warned twice), the first measurement thrown away."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _fresh(monkeypatch, blocker / "cache")
    calls = []
    fixed = _measured_at_fixed_ratios(monkeypatch)
    monkeypatch.setattr(gemm_ratio, "measure", lambda *args: calls.append(1) or fixed)
    with pytest.warns(RuntimeWarning, match="could not cache") as said:
        info = device.remeasure()
    assert len(calls) == 1 and len(said) == 1
    assert info.gemm_ratios == fixed.ratios and device.detect("cpu") is info


def test_the_cache_lives_where_the_user_cache_is(tmp_path):
    assert gemm_ratio.cache_path({gemm_ratio.CACHE_ENV: "/a", "XDG_CACHE_HOME": "/b"}) == (
        gemm_ratio.Path("/a/gemm-ratios.json")
    )
    assert gemm_ratio.cache_path({"XDG_CACHE_HOME": "/b"}) == gemm_ratio.Path(
        "/b/mixprec/gemm-ratios.json"
    )
    assert gemm_ratio.cache_path({}).parts[-3:] == (".cache", "mixprec", "gemm-ratios.json")


def test_measuring_leaves_the_rng_autocast_and_threads_alone_and_says_its_sizes():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    threads = torch.get_num_threads()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m = gemm_ratio.measure()
    assert torch.equal(torch.get_rng_state(), before) and torch.get_num_threads() == threads
    for field in (m.ratios, m.spread, m.sizes, m.rounds):
        assert set(field) == {"bfloat16", "float16"}
    assert set(m.sizes.values()) <= set(gemm_ratio.SIZES)
    assert all(v > 0 for v in m.ratios.values()) and all(v >= 1 for v in m.spread.values())
    for name, size in m.sizes.items():
        assert f"{name} at {size}x{size}" in m.note() and "on one thread" in m.note()


class _Cpu:
    """Timers for `gemm_ratio.rate` from a described CPU: float32 at `gflops`, each dtype at
    its speed against float32 at each size; a clock that the timed multiplies advance (a turn
    is two of them), and the sizes each dtype was timed at."""

    def __init__(self, gflops: float, speed: dict[str, dict[int, float]]):
        self.gflops, self.speed, self.now = gflops, speed, 0.0
        self.timed: dict[str, set[int]] = {}

    def multiply(self, name, size):
        t = 2 * size**3 / (self.gflops * 1e9)
        return t / (1.0 if name == "float32" else self.speed[name][size])

    def timer_at(self, size, names):
        for name in names:
            self.timed.setdefault(name, set()).add(size)
            self.now += self.multiply(name, size)  # the warm-up

        def time_one(name):
            t = self.multiply(name, size)
            self.now += 2 * t
            return t

        return time_one

    def clock(self):
        return self.now


AMX_SPEED = {
    "bfloat16": {128: 1.2, 256: 4.5, 512: 7.1, 1024: 8.0},
    "float16": {128: 0.9, 256: 0.9, 512: 0.9, 1024: 0.9},
}


def test_a_cpu_is_rated_at_a_training_size_not_at_a_small_one():
    """An AMX CPU's bfloat16 is rated at 1024x1024, where it runs 8x float32's speed, not at
    128x128, where its tiles' setup makes it 1.2x."""
    cpu = _Cpu(150.0, AMX_SPEED)
    rated = gemm_ratio.rate(["bfloat16", "float16"], cpu.timer_at, cpu.clock)
    assert {n: size for n, (_, size) in rated.items()} == {"bfloat16": 1024, "float16": 1024}
    assert rated["bfloat16"][0].ratio("bfloat16") == pytest.approx(8.0)
    assert cpu.now < gemm_ratio.BUDGET_S


def test_a_dtype_far_slower_than_float32_is_rated_at_the_size_that_shows_it():
    """On an AVX2-only CPU bfloat16 is emulated, over 10x slower at 128x128 already: it is
    rated there and never multiplied larger (a 1024x1024 one takes seconds)."""
    slow = {n: dict.fromkeys(gemm_ratio.SIZES, 0.03) for n in ("bfloat16", "float16")}
    cpu = _Cpu(50.0, slow)
    rated = gemm_ratio.rate(["bfloat16", "float16"], cpu.timer_at, cpu.clock)
    assert {n: size for n, (_, size) in rated.items()} == {"bfloat16": 128, "float16": 128}
    assert cpu.timed["bfloat16"] == {128} and cpu.now < gemm_ratio.BUDGET_S
    # one slow dtype does not hold the other back
    cpu = _Cpu(150.0, {**AMX_SPEED, "float16": slow["float16"]})
    rated = gemm_ratio.rate(["bfloat16", "float16"], cpu.timer_at, cpu.clock)
    assert rated["float16"][1] == 128 and rated["bfloat16"][1] == 1024
    assert cpu.timed["float16"] == {128}


def test_a_slow_cpu_is_rated_at_the_largest_size_its_budget_allows():
    cpu = _Cpu(5.0, {n: dict.fromkeys(gemm_ratio.SIZES, 0.5) for n in ("bfloat16", "float16")})
    rated = gemm_ratio.rate(["bfloat16", "float16"], cpu.timer_at, cpu.clock)
    (size,) = {size for _, size in rated.values()}
    assert size < gemm_ratio.TRAINING and cpu.now < 1.25 * gemm_ratio.BUDGET_S
    assert rated["bfloat16"][0].ratio("bfloat16") == pytest.approx(0.5)


def test_a_size_whose_warm_up_shows_it_will_not_fit_is_left_for_the_one_before():
    """A CPU whose float32 falls off a cliff at 1024x1024 (its caches): the growth estimate
    from 512x512 says it fits, the warm-up says it does not, and the rating stays at 512."""

    class Cliff(_Cpu):
        def multiply(self, name, size):
            return super().multiply(name, size) * (6.0 if size == 1024 else 1.0)

    cpu = Cliff(150.0, AMX_SPEED)
    rated = gemm_ratio.rate(["bfloat16", "float16"], cpu.timer_at, cpu.clock)
    assert {size for _, size in rated.values()} == {512}
    assert rated["bfloat16"][0].ratio("bfloat16") == pytest.approx(7.1)
    assert 1024 in cpu.timed["float32"] and cpu.now < 1.25 * gemm_ratio.BUDGET_S


def test_the_note_says_each_dtypes_size_and_when_its_rounds_disagreed():
    m = gemm_ratio.GemmRatios(
        ratios={"bfloat16": 8.0, "float16": 0.03},
        spread={"bfloat16": 1.6, "float16": 2.0},
        sizes={"bfloat16": 1024, "float16": 128},
        rounds={"bfloat16": 15, "float16": 3},
        seconds=0.31,
        measured_at="2026-01-01 00:00 UTC",
    )
    note = m.note()
    assert "bfloat16 at 1024x1024 (15 rounds, within 1.60x)" in note
    assert "float16 at 128x128" in note and "so not measured larger" in note
    assert "on one thread" in note and "in 0.31 s" in note
    # float16's upper quartile is still decisively slow: only bfloat16's rounds are in doubt
    assert m.noisy() == ["bfloat16"] and "rounds of bfloat16 disagreed" in note


def test_a_rating_never_contradicts_its_reason():
    """Flags that predict emulation and a GEMM measured at float32's speed: the reason says
    what was measured and that the flags predicted otherwise, not "slower than float32"
    beside a rating of "supported"."""
    s = hardware.dtype_support(torch.bfloat16, _cpu({"avx2"}, bfloat16=1.1))
    assert s.status == "supported"
    assert s.reason.startswith("its GEMMs measured 1.1x float32's speed here, about float32's")
    assert "not what its flags predict (no bf16 or avx512 instructions" in s.reason
    s = hardware.dtype_support(torch.bfloat16, _cpu({"avx512bw", "avx512_bf16"}, bfloat16=0.5))
    assert s.status == "slow" and "slower than its flags predict" in s.reason


def test_info_measure_times_every_dtype_at_one_size_and_pairs_them_with_float32():
    rates = measuring.measure_rates(
        (torch.float32, torch.bfloat16, torch.float16), "cpu", seconds=0.02, repeats=2
    )
    assert len({r.size for r in rates.values()}) == 1
    assert rates["float32"].ratio == 1.0 and rates["float32"].ratio_spread == 1.0
    assert all(r.ratio > 0 and r.ratio_spread >= 1.0 for r in rates.values())


def test_the_measure_notice_says_when_the_paired_ratios_disagree():
    rate = measuring.Rate
    rates = {
        "float32": rate(100.0, 95.0, 105.0, 1024, 1.0),
        "bfloat16": rate(300.0, 290.0, 310.0, 1024, 3.0, 1.6),
    }
    notice = measuring.measure_notice(rates, ZEN4, load=0.5)
    assert "ratios against float32 spread wider than 1.25x (quartiles: bfloat16 3x-4.8x)" in notice


def test_a_cap_set_after_the_process_multiplied_is_not_measured_under_its_key(tmp_path):
    """oneDNN reads ONEDNN_MAX_CPU_ISA once: a process that multiplied before setting it runs
    its GEMMs uncapped, so what it measures must not be cached as the capped CPU's (every later
    capped process would read it). The capped view it asked for is rated by its flags."""
    if device.cap_cpu_flags(device._cpu_flags()[0], {"ONEDNN_MAX_CPU_ISA": "AVX2"})[1] is None:
        pytest.skip("this CPU has nothing past AVX2: the cap changes nothing in a real process")
    script = (
        "import json, os, torch\n"
        "from mixprec import device, hardware\n"
        "a = torch.ones(64, 64, dtype=torch.bfloat16); a @ a\n"
        "os.environ['ONEDNN_MAX_CPU_ISA'] = 'AVX2'\n"
        "info = device.detect('cpu')\n"
        "bf16 = hardware.dtype_support(torch.bfloat16, info)\n"
        "print(json.dumps([info.gemm_ratios, info.gemm_note, info.isa_cap, bf16.status]))\n"
    )
    caps = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
    env = {k: v for k, v in os.environ.items() if k not in caps}
    env[gemm_ratio.CACHE_ENV] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    ratios, note, cap, bf16 = json.loads(proc.stdout)
    assert cap == "capped by ONEDNN_MAX_CPU_ISA=AVX2" and bf16 == "slow"
    assert ratios is None and "not measured in this process" in note
    path = tmp_path / gemm_ratio.CACHE_FILE
    entries = json.loads(path.read_text())["entries"] if path.exists() else []
    assert not [e for e in entries if e["key"]["isa_cap"]]


@pytest.mark.usefixtures("fresh_detect")
def test_a_late_cap_reads_what_a_process_under_it_measured(tmp_path, monkeypatch):
    """In a process whose kernels are not under the cap asked for, the capped CPU is rated by
    what a process under that cap cached, and the note says where it comes from."""
    _fresh(monkeypatch, tmp_path)
    for var in ("DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(var, raising=False)
    # this process's oneDNN started uncapped: mixprec was imported without a cap
    monkeypatch.setitem(device._ONEDNN_AT_IMPORT, "ONEDNN_MAX_CPU_ISA", None)
    monkeypatch.setitem(device._ONEDNN_AT_IMPORT, "DNNL_MAX_CPU_ISA", None)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    # a CPU with instructions past the cap, whatever this host has (on an AVX2-only one the
    # cap would change nothing)
    host = device._cpu_flags()
    past = frozenset({"avx512f", "avx512bw", "avx512_bf16"})
    monkeypatch.setattr(device, "_cpu_flags", lambda: (host[0] | past, host[1]))
    flags, cap = device.cap_cpu_flags(device._cpu_flags()[0], {"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert cap is not None
    key = {"cpu": device._cpu_name(), "flags": sorted(flags), "isa_cap": cap}
    measured = {**_MEASURED, "ratios": {"bfloat16": 0.02, "float16": 0.03}}
    key = {**key, "torch": torch.__version__, "method": gemm_ratio.METHOD}
    entry = {"key": key, "measured": measured}
    (tmp_path / gemm_ratio.CACHE_FILE).write_text(json.dumps({"entries": [entry]}))
    info = device.detect("cpu")
    assert info.gemm_ratios == {"bfloat16": 0.02, "float16": 0.03}
    assert "read from" in info.gemm_note and "not measured in this process" in info.gemm_note
    assert len(json.loads((tmp_path / gemm_ratio.CACHE_FILE).read_text())["entries"]) == 1
    # an entry an older measurement wrote (no method, or another) is not read
    for old in ({k: v for k, v in key.items() if k != "method"}, {**key, "method": 1}):
        entry = {"key": old, "measured": measured}
        (tmp_path / gemm_ratio.CACHE_FILE).write_text(json.dumps({"entries": [entry]}))
        device._detect.cache_clear()
        assert device.detect("cpu").gemm_ratios is None


def test_the_measure_notice_never_advises_the_option_already_given():
    rate = measuring.Rate
    wide = {"float32": rate(100.0, 20.0, 140.0, 1024)}
    assert "(--seconds 2)" in measuring.measure_notice(wide, ZEN4, load=0.5)
    notice = measuring.measure_notice(wide, ZEN4, load=0.5, seconds=2.0)
    assert "(--seconds 8)" in notice and "--seconds 2)" not in notice
    assert "(--seconds 2)" in measuring.measure_notice(wide, ZEN4, seconds=0.1)


def test_an_avx2_cpu_is_judged_as_before():
    assert support_matrix(AVX2_CPU)["bf16-mixed"].status == "slow"
    assert resolve_auto(AVX2_CPU).name == "32-true"


def test_the_allow_slow_switch_silences_the_slow_precision_warning(monkeypatch):
    with hardware.assume(AVX512_CPU), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixprec.apply(nn.Linear(2, 2), "bf16-mixed")
        monkeypatch.setenv(hardware.ALLOW_SLOW_ENV, "1")
        mixprec.apply(nn.Linear(2, 2), "bf16-mixed")
    assert [w.category for w in caught] == [mixprec.SlowPrecisionWarning]
    assert "measured 0.42x" in str(caught[0].message)


def test_a_measure_notice_flags_a_slow_dtype_that_measured_faster_than_float32():
    """Under load, float32's turns slowed so that float16 (0.06x on a Zen 4) read 15x as
    fast as float32 beneath a table rating it slow, and nothing said so."""
    rate = measuring.Rate
    rates = {
        "float32": rate(0.4, 0.3, 0.4, 128, 1.0, 1.0),
        "bfloat16": rate(0.9, 0.8, 0.9, 128, 2.26, 1.11),
        "float16": rate(5.6, 5.6, 5.7, 128, 15.07, 1.12),
    }
    notice = measuring.measure_notice(rates, ZEN4, load=1.2)
    assert "float16, slow on this hardware, measured 15.1x faster than float32" in notice
    quiet = {**rates, "float16": rate(0.02, 0.02, 0.02, 128, 0.06, 1.05)}
    quiet["float32"] = rate(150.0, 148.0, 152.0, 128, 1.0, 1.0)
    quiet["bfloat16"] = rate(600.0, 590.0, 610.0, 128, 4.0, 1.05)
    assert measuring.measure_notice(quiet, ZEN4, load=0.5) is None


def test_a_fast_dtype_whose_few_first_rounds_other_work_slowed_is_not_rated_there():
    """bfloat16 (4x float32) with two of its three 128x128 turns slowed 60x read 0.07x there,
    under DECISIVE, and was rated slow from rounds that disagreed 30x; it is decided only
    when its upper quartile is under DECISIVE too, so it goes on to the sizes that show it."""
    cpu = _Cpu(150.0, {**AMX_SPEED, "bfloat16": dict.fromkeys(gemm_ratio.SIZES, 4.0)})
    hits = [0]
    timer_at = cpu.timer_at

    def disturbed(size, names):
        time_one = timer_at(size, names)

        def one(name):
            t = time_one(name)
            if name == "bfloat16" and size == 128 and hits[0] < 2:
                hits[0] += 1
                cpu.now += 59 * 2 * t
                return 60 * t
            return t

        return one

    rated = gemm_ratio.rate(["bfloat16", "float16"], disturbed, cpu.clock)
    assert hits[0] == 2 and rated["bfloat16"][1] > 128
    assert rated["bfloat16"][0].ratio("bfloat16") == pytest.approx(4.0)


@pytest.mark.parametrize("bad", [math.inf, True, 0.0, math.nan])
def test_a_cached_ratio_that_no_measurement_gives_is_measured_again(bad):
    """A cached Infinity passed the cache's check (> 0), and DeviceInfo, which refuses it,
    then made detect() and `mixprec info` fail until the file was deleted by hand."""
    entry = {
        "measured": {
            "ratios": {"bfloat16": 4.0, "float16": 0.06},
            "spread": {"bfloat16": 1.0, "float16": 1.0},
            "sizes": {"bfloat16": 1024, "float16": 128},
            "rounds": {"bfloat16": 3, "float16": 3},
            "seconds": 0.5,
            "measured_at": "2026-12-02 17:00 UTC",
        }
    }
    assert gemm_ratio._from_entry(entry) is not None
    entry["measured"]["ratios"]["bfloat16"] = bad
    assert gemm_ratio._from_entry(entry) is None


_MEASURED = {
    "ratios": {"bfloat16": 4.0, "float16": 0.06},
    "spread": {"bfloat16": 1.0, "float16": 1.0},
    "sizes": {"bfloat16": 1024, "float16": 128},
    "rounds": {"bfloat16": 3, "float16": 3},
    "seconds": 0.5,
    "measured_at": "2026-12-02 17:00 UTC",
}


def _measured_at_fixed_ratios(monkeypatch) -> gemm_ratio.GemmRatios:
    """The host's GEMMs "measured" at set ratios, at once: what is cached, not how fast the
    host is, is under test."""
    fixed = gemm_ratio.GemmRatios(**{**_MEASURED, "ratios": {"bfloat16": 0.5, "float16": 0.05}})
    monkeypatch.setattr(gemm_ratio, "measure", lambda *args: fixed)
    return fixed


@pytest.mark.parametrize(
    ("field", "bad"),
    [("seconds", None), ("seconds", -1.0), ("seconds", math.nan), ("seconds", math.inf),
     ("seconds", "0.5"), ("seconds", True), ("measured_at", None), ("measured_at", 5)],
)  # fmt: skip
def test_a_cache_entry_with_a_bad_time_is_measured_again(field, bad):
    entry = {"measured": {**_MEASURED, field: bad}}
    assert gemm_ratio._from_entry({"measured": _MEASURED}) is not None
    assert gemm_ratio._from_entry(entry) is None


@pytest.mark.usefixtures("fresh_detect")
def test_a_cache_entry_without_its_time_does_not_stop_detect_or_info(tmp_path, monkeypatch):
    """A hand-edited "seconds": null passed the cache's check, then failed every CPU detect(),
    Precision and `mixprec info` (exit 3) until the file was deleted."""
    _fresh(monkeypatch, tmp_path)
    fixed = _measured_at_fixed_ratios(monkeypatch)
    device.detect("cpu")
    path = tmp_path / gemm_ratio.CACHE_FILE
    data = json.loads(path.read_text())
    data["entries"][0]["measured"]["seconds"] = None
    path.write_text(json.dumps(data))
    device._detect.cache_clear()
    assert device.detect("cpu").gemm_ratios == fixed.ratios
    assert json.loads(path.read_text())["entries"][0]["measured"]["seconds"] == fixed.seconds
    path.write_text(json.dumps(data))
    device._detect.cache_clear()
    assert main(["info", "--device", "cpu"]) == 0


@pytest.mark.usefixtures("fresh_detect")
def test_ratios_that_could_not_be_cached_are_not_said_to_be(tmp_path, monkeypatch, capsys):
    """`mixprec info` said "cached in <path>" right after warning it could not cache there."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _fresh(monkeypatch, blocker / "cache")
    _measured_at_fixed_ratios(monkeypatch)
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.warns(RuntimeWarning, match="could not cache"):
        assert main(["info", "--device", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"not cached ({blocker / 'cache' / gemm_ratio.CACHE_FILE} could not be written" in out
    assert "cached in" not in out
    _fresh(monkeypatch, tmp_path / "writable")
    assert f"; cached in {tmp_path / 'writable'}" in device.detect("cpu").gemm_note
