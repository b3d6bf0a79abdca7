"""One factory loader for bench and doctor, and bad command-line input caught before any
work starts, with a usage exit code (2) distinct from the doctor's "broken layer" (1)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

from mixprec.bench.factory import FactoryError, call_factory, load_factory
from mixprec.cli import main

ANNOTATED = textwrap.dedent(
    """
    from __future__ import annotations

    from dataclasses import dataclass

    import torch
    from torch import nn


    @dataclass
    class Batch:
        x: torch.Tensor
        y: torch.Tensor


    def make():
        torch.manual_seed(0)
        return nn.Linear(4, 2), lambda n: (torch.randn(n, 4), torch.randint(0, 2, (n,))), (
            nn.functional.cross_entropy
        )


    def make_doctor():
        torch.manual_seed(0)
        batch = Batch(torch.randn(8, 4), torch.randint(0, 2, (8,)))
        return nn.Linear(4, 2), (batch.x, batch.y), nn.functional.cross_entropy


    def raises():
        raise RuntimeError("no weights here")
    """
)


@pytest.fixture
def annotated(tmp_path: Path) -> Path:
    path = tmp_path / "annotated.py"
    path.write_text(ANNOTATED)
    return path


def test_a_dataclass_under_future_annotations_loads_for_bench_and_doctor(annotated, tmp_path):
    # before: the bench's loader did not register the module, and @dataclass failed in it
    factory = load_factory(f"{annotated}:make")
    model, make_batch, _ = factory()
    assert make_batch(3)[0].shape == (3, 4) and model.in_features == 4
    code = main(
        ["bench", "--model", f"{annotated}:make", "--batch-sizes", "2", "--precision", "32-true"]
        + ["--steps", "1", "--warmup", "0", "--threads", "1", "--out", str(tmp_path / "b")]
    )
    assert code == 0
    doctor = ["doctor", f"{annotated}:make_doctor", "--precision", "32-true", "--no-report"]
    assert main(doctor) == 0


@pytest.mark.parametrize(
    "source, message",
    [
        ("def make(:\n    pass\n", r"importing .*bad\.py failed: SyntaxError: .*bad\.py:1\)"),
        ("import not_a_module_anywhere\n", r"ModuleNotFoundError: No module named"),
        ("raise SystemError('boom')\n", r"SystemError: boom \(.*bad\.py:1\)"),
        ("make = 3\n", r"has no callable 'make'"),
    ],
)
def test_a_broken_factory_file_is_a_clear_usage_error(tmp_path, capsys, source, message):
    path = tmp_path / "bad.py"
    path.write_text(source)
    with pytest.raises(FactoryError, match=message):
        load_factory(f"{path}:make")
    out = str(tmp_path / "o")
    assert main(["bench", "--model", f"{path}:make", "--batch-sizes", "2", "--out", out]) == 2
    assert "mixprec bench: error" in capsys.readouterr().err
    assert main(["doctor", f"{path}:make", "--no-report"]) == 2
    assert "mixprec doctor" in capsys.readouterr().err


def test_a_factory_that_raises_is_named_with_its_line(annotated, capsys):
    with pytest.raises(FactoryError, match=r"raised RuntimeError: no weights here \(.*:\d+\)"):
        call_factory(load_factory(f"{annotated}:raises"), "annotated.py:raises")
    assert main(["doctor", f"{annotated}:raises", "--no-report"]) == 2
    assert "no weights here" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--image-size", "0"], "--image-size must be >= 8, got 0"),
        (["--timeout", "0"], "--timeout must be > 0 seconds, got 0.0"),
    ],
)
def test_bench_zero_values_are_errors_not_defaults(tmp_path, capsys, args, message):
    assert main(["bench", *args, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def test_bench_out_is_checked_before_anything_is_timed(tmp_path, capsys):
    a_file = tmp_path / "taken.txt"
    a_file.write_text("keep me")
    for out, message in (
        (a_file, "is a file"),
        (a_file / "sub", f"is under the file {a_file}"),
    ):
        assert main(["bench", "--out", str(out)]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert message in err and "configurations" not in err
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "results.json").write_text("{}")
    assert main(["bench", "--out", str(earlier)]) == 2
    assert "already holds results.json" in " ".join(capsys.readouterr().err.split())
    assert (earlier / "results.json").read_text() == "{}" and a_file.read_text() == "keep me"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_out_where_no_file_can_be_written_is_refused_before_the_run(capsys):
    # permission bits pass for root: only a real write tells
    assert main(["bench", "--out", "/proc/mixprec-results"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "/proc is not writable" in err and "configurations" not in err


def test_doctor_bad_tolerance_and_out_fail_before_the_diagnosis(annotated, tmp_path, capsys):
    ref = f"{annotated}:make_doctor"
    with pytest.raises(SystemExit) as exc:
        main(["doctor", ref, "--tolerance", "-1"])
    assert exc.value.code == 2
    assert "tolerance must be a positive number, got -1" in capsys.readouterr().err
    a_file = tmp_path / "f"
    a_file.write_text("")
    assert main(["doctor", ref, "--out", str(a_file / "report")]) == 2
    assert f"is under the file {a_file}" in " ".join(capsys.readouterr().err.split())


def test_an_unknown_device_is_a_usage_error_everywhere(annotated, tmp_path, capsys):
    assert main(["bench", "--device", "tpu", "--out", str(tmp_path / "o")]) == 2
    assert "unknown device 'tpu'; mixprec runs on 'cpu', 'cuda'" in capsys.readouterr().err
    assert main(["info", "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err
    assert main(["doctor", f"{annotated}:make_doctor", "--device", "tpu", "--no-report"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_infos_measuring_settings_without_measure_are_a_usage_error(capsys):
    """``--seconds`` and ``--repeats`` set how ``--measure`` measures: without it they
    were ignored silently."""
    for given in (["--seconds", "2"], ["--repeats", "3"]):
        with pytest.raises(SystemExit) as stopped:
            main(["info", *given])
        assert stopped.value.code == 2
        assert "add --measure" in capsys.readouterr().err


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_mps_without_mps_is_a_usage_error_everywhere(annotated, tmp_path, capsys):
    # before: `info` printed a line and crashed in the support matrix, `doctor` in torch
    assert main(["info", "--device", "mps"]) == 2
    captured = capsys.readouterr()
    assert "device 'mps'" in captured.err and "sees no Apple GPU" in captured.err
    assert captured.out == ""
    assert main(["doctor", f"{annotated}:make_doctor", "--device", "mps", "--no-report"]) == 2
    assert "sees no Apple GPU" in " ".join(capsys.readouterr().err.split())
    assert main(["bench", "--device", "mps", "--out", str(tmp_path / "o")]) == 2
    assert "mixprec bench runs on cpu or cuda, not mps" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--precision", "32-true", "bf16[/]"], "unknown precision 'bf16[/]'; accepted: "),
        (["--model", "m[/x].py:make", "--batch-sizes", "2"], "no such file: m[/x].py"),
    ],
)
def test_bench_input_with_brackets_gets_its_usage_error(tmp_path, capsys, args, message):
    """Found by a review: a `--precision 'bf16[/]'` typo or a `--model 'm[/x].py:make'`
    crashed with rich's MarkupError (exit 3) while printing the error, instead of the usage
    error (exit 2) listing what is accepted: the error names user text, printed as given."""
    assert main(["bench", *args, "--threads", "1", "--out", str(tmp_path / "o")]) == 2
    assert message in " ".join(capsys.readouterr().err.split())
