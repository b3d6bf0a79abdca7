"""Support matrix, "auto", and the refuse/slow checks, on the real device and on described ones."""

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy, PolicyMap, PrecisionError, SlowPrecisionError
from mixprec.cli import main
from mixprec.hardware import DeviceInfo, check, detect, policy_support, resolve_auto, support_matrix

ZEN4 = DeviceInfo("cpu", "AMD Zen 4", cpu_flags=frozenset({"avx512bw", "avx512_bf16"}))
SPR = DeviceInfo("cpu", "Xeon", cpu_flags=frozenset({"avx512bw", "amx_bf16", "avx512_fp16"}))
OLD_CPU = DeviceInfo("cpu", "old", cpu_flags=frozenset({"avx2"}))
V100 = DeviceInfo("cuda", "Tesla V100", 0, capability=(7, 0))
H100 = DeviceInfo("cuda", "H100", 0, capability=(9, 0))
P100 = DeviceInfo("cuda", "Tesla P100", 0, capability=(6, 0))


@pytest.mark.parametrize(
    "info, expected",
    [
        (
            ZEN4,
            {"bf16-mixed": "fast", "16-mixed": "slow", "16-true": "slow", "64-true": "supported"},
        ),
        (SPR, {"bf16-mixed": "fast", "16-mixed": "slow"}),
        (OLD_CPU, {"bf16-mixed": "slow", "16-mixed": "slow", "32-true": "fast"}),
        (V100, {"bf16-mixed": "refused", "16-mixed": "fast", "32-true": "fast"}),
        (H100, {"bf16-mixed": "fast", "16-mixed": "fast", "bf16-true": "fast"}),
        (P100, {"16-mixed": "supported", "bf16-true": "refused"}),
    ],
    ids=["zen4", "sapphire-rapids", "old-cpu", "v100", "h100", "p100"],
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
        (V100, "16-mixed"),
        (H100, "bf16-mixed"),
        (OLD_CPU, "32-true"),
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
        SlowPrecisionError, match="far slower than float32.*allow_slow=True.*bf16-mixed"
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


def test_measure_reports_a_rate_per_dtype():
    rates = mixprec.hardware.measure((torch.float32, torch.bfloat16), "cpu", seconds=0.02)
    assert set(rates) == {"float32", "bfloat16"} and all(r > 0 for r in rates.values())


def test_info_command_prints_the_matrix(capsys):
    assert main(["info", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for name in ("32-true", "bf16-mixed", "16-mixed", '"auto" resolves to'):
        assert name in out


def test_unknown_device_type_is_refused():
    with pytest.raises(PrecisionError, match="unknown device type 'meta'"):
        detect("meta")


@pytest.mark.parametrize(
    "info, expected", [(H100, "bf16-mixed"), (V100, "16-mixed"), (OLD_CPU, "32-true")]
)
def test_resolve_policy_resolves_auto_against_the_described_device(info, expected):
    from mixprec.hardware import resolve_policy

    assert resolve_policy("auto", info) == PolicyMap(expected)
    assert resolve_policy(" AUTO ", info) == PolicyMap(expected)
    # anything else means the same on every device
    assert resolve_policy("16-true", info) == PolicyMap("16-true")
    pmap = PolicyMap("bf16-mixed", {"head": "32-true"})
    assert resolve_policy(pmap, info) is pmap


def _gpu_machine(monkeypatch, cpu, gpu):
    """A described machine whose default device is a GPU: `detect()` answers from the
    descriptions, never from the host."""
    from mixprec import hardware
    from mixprec.bench import suite

    def detect_described(device=None):
        device = torch.device(device) if device is not None else torch.device("cuda", 0)
        return gpu if device.type == "cuda" else cpu

    monkeypatch.setattr(hardware, "default_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(hardware, "detect", detect_described)
    monkeypatch.setattr(suite, "detect", detect_described)


def test_bench_auto_on_the_cpu_of_a_gpu_machine_is_the_cpus_choice(monkeypatch):
    from mixprec.bench import suite

    _gpu_machine(monkeypatch, OLD_CPU, H100)
    policies, _ = suite._precisions(["auto"], torch.device("cpu"), allow_slow=False)
    assert list(policies) == ["32-true"]


def test_precision_auto_resolves_at_setup_on_the_models_device(monkeypatch):
    _gpu_machine(monkeypatch, OLD_CPU, V100)
    precision = mixprec.Precision("auto")
    with pytest.raises(RuntimeError, match=r"picks its policy and scaler at setup\(\)"):
        precision.policy  # noqa: B018
    precision.setup(nn.Linear(2, 2))  # a CPU model
    assert precision.policy == PolicyMap("32-true")
    assert precision.scaler.kind == "none"
    assert mixprec.Precision("auto", device="cuda").policy == PolicyMap("16-mixed")


def test_diagnose_resolves_auto_on_its_device(monkeypatch):
    _gpu_machine(monkeypatch, OLD_CPU, V100)
    model = nn.Sequential(nn.Linear(2, 2))
    batch = (torch.ones(3, 2), torch.zeros(3, dtype=torch.int64))
    report = mixprec.diagnose(
        model, batch, nn.functional.cross_entropy, precision="auto", device="cpu"
    )
    assert report.precision == PolicyMap("32-true")
