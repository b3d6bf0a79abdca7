"""Every Python example in the README runs as written, the same way on every CPU."""

import re
from pathlib import Path

import pytest
from devices import AVX2_CPU, AVX512_CPU

from mixprec import SlowPrecisionError, hardware
from mixprec.hardware import ALLOW_SLOW_ENV

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
# The README's promise is about a CPU without fast bf16: every host runs the examples as if it
# were one, with the switch the README names, so the outcome never depends on the host.


def _run(index: int) -> None:
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {})


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ALLOW_SLOW_ENV, "1")
    with hardware.assume(AVX2_CPU):
        _run(index)


def test_without_the_switch_a_cpu_without_fast_bf16_refuses_the_trainer_example(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    trainer_example = next(i for i, b in enumerate(BLOCKS) if 'Trainer(precision="bf16-mixed"' in b)
    assert ALLOW_SLOW_ENV in README.read_text()
    with hardware.assume(AVX2_CPU), pytest.raises(SlowPrecisionError, match=f"{ALLOW_SLOW_ENV}=1"):
        _run(trainer_example)


@pytest.mark.parametrize("call", ['Trainer(precision="bf16-mixed"', 'Precision("bf16-mixed")'])
def test_on_an_avx512_cpu_without_bf16_the_bf16_examples_raise_naming_the_measured_ratio(
    call, tmp_path, monkeypatch
):
    """The CPU class most rented servers have: bf16 converted in software, its GEMMs measured
    at 0.42x float32's speed; the README's promise holds there too."""
    monkeypatch.chdir(tmp_path)
    example = next(i for i, b in enumerate(BLOCKS) if call in b)
    with hardware.assume(AVX512_CPU), pytest.raises(SlowPrecisionError, match=r"measured 0\.42x"):
        _run(example)


def test_the_doctor_demo_is_said_to_exit_1_by_design():
    """`mixprec doctor` exits 1 when the target precision fails (tests/doctor/test_doctor.py runs
    the
    demo and checks it): a newcomer reading the README must not take that for a crash."""
    text = " ".join(README.read_text().split())
    command = "mixprec doctor examples/doctor_demo.py:make --precision 16-mixed"
    after = text[text.index(command) :]
    assert after.index("exits with status 1 by design") < 200
    assert "`pool.softmax`" in after[:600]


def test_the_trainer_and_loop_examples_print_what_they_did(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ALLOW_SLOW_ENV, "1")
    trainer = next(i for i, b in enumerate(BLOCKS) if 'Trainer(precision="bf16-mixed"' in b)
    loop = next(i for i, b in enumerate(BLOCKS) if 'Precision("bf16-mixed")' in b)
    with hardware.assume(AVX2_CPU):
        _run(trainer)
        out = capsys.readouterr().out
        assert re.search(r"^epoch 0: loss \d\.\d{3}\nepoch 1: loss \d\.\d{3}$", out, re.M)
        assert "precision: bf16-mixed (slow: bfloat16: no bf16 or avx512 instructions" in out
        assert "epochs / steps: 2 / 16" in out and "peak memory:" in out
        _run(loop)
        out = capsys.readouterr().out
        assert re.search(r"^step 2: loss \d\.\d{3}, parameters torch\.float32$", out, re.M)
        assert out.rstrip().endswith("bf16-mixed none")
