"""What the bench says around its figures: which precisions it refuses to compare, the
advice of its closing sentence, the busy-machine warning, progress lines, the rounding of a
ratio, the memory limit and the device in messages. Synthetic rows and described devices:
nothing is timed, so no figure depends on the host."""

from __future__ import annotations

import os

import pytest
import torch
from devices import AVX2_CPU

from mixprec.bench.report import (
    _speedup_cell,
    busy_machine_warning,
    comparison_gap_lines,
    conclusion,
    notes,
    progress_line,
    summarize,
)
from mixprec.bench.runner import OK, LoopResult, RunResult
from mixprec.bench.suite import BenchOptions, BenchReport, Config, Row, plan
from mixprec.cli.bench import parse_size
from mixprec.hardware import assume

PEAKS = {"32-true": 100, "bf16-mixed": 60, "16-mixed": 100}


def _report(times: dict[str, list[float]], paired: bool = True, **meta) -> BenchReport:
    """float32 and the other precisions of `times` at batch 8, their step times given."""
    rows = [
        Row(
            Config(key, key, 8, None, key != "32-true"),
            RunResult(
                OK,
                LoopResult(step_ms=ms, peak_memory=PEAKS[key]),
                paired=paired,
                fresh_process=not paired,
            ),
        )
        for key, ms in times.items()
    ]
    base = {
        "model": "cnn",
        "threads": 1,
        "cores": 2,
        "device_type": "cpu",
        "support": {key: "fast" for key in times},
        "precisions": list(times),
        "batch_sizes": [8],
        "load_average_before": [0.0, 0.0, 0.0],
        "timing": "t",
        "warmup": 1,
        "memory_method": "m",
    }
    return BenchReport({**base, **meta}, rows)


def _said(report: BenchReport) -> tuple[str, list[str]]:
    summaries = summarize(report)
    return conclusion(report, summaries), notes(report, summaries)


def _options(**given) -> BenchOptions:
    return BenchOptions(
        model="cnn", image_size=8, batch_sizes=[1], steps=1, threads=1, device="cpu", **given
    )


@pytest.mark.parametrize("spec", ["int8_from_float32", "int4_from_bf16-mixed"])
def test_a_precision_whose_weights_never_train_is_refused_before_anything_runs(spec):
    """int8/int4 layers hold their weights as codes that never train: their step skips
    those weights' gradients and updates, and the bench printed "int8_from_float32 trains
    the mlp model 2.3x as fast as float32" against float32's full training step."""
    with pytest.raises(ValueError, match="never train") as err:
        plan(_options(precisions=["32-true", spec]))
    assert spec in str(err.value) and "bf16-mixed" in str(err.value)


def test_advice_to_train_in_float32_names_the_fast_precision_that_was_not_timed():
    """16-mixed timed at 0.26x on a CPU where bf16-mixed is fast (and "auto") ended "train
    in float32 here", passing by the precision that would pay."""
    times = {"32-true": [25.0] * 10, "16-mixed": [96.0] * 10}
    sentence, _ = _said(_report(times, auto_precision="bf16-mixed"))
    assert "train in float32 here" not in sentence, sentence
    assert "train in float32 rather than 16-mixed" in sentence, sentence
    assert "bf16-mixed, which mixprec info rates fast here, was not timed" in sentence
    # where "auto" is float32, or was timed, there is nothing to add
    for auto in ("32-true", "16-mixed"):
        sentence, _ = _said(_report(times, auto_precision=auto))
        assert sentence.endswith("train in float32 here."), sentence


def test_the_busy_warning_advises_dropping_only_the_options_given():
    """Under --memory-limit alone the warning said "rerun without --memory-limit and
    --compile"; with no option given (results of an older version) it named both too."""
    times = {"32-true": [100.0] * 6, "bf16-mixed": [50.0] * 6}
    busy = [9.0, 9.0, 9.0]
    for meta, named, absent in (
        ({"memory_limit": 2**30}, "without --memory-limit, which", "--compile"),
        ({"compile": True}, "without --compile, which", "--memory-limit"),
        ({}, "rerun with this version", "--"),
    ):
        report = _report(times, paired=False, load_average_before=busy, **meta)
        sentence, said = _said(report)
        warning = next(n for n in said if n.startswith("WARNING"))
        assert named in warning and absent not in warning.split("; ")[-1], (meta, warning)
        assert named in sentence, (meta, sentence)  # (the same facts as the sentence's)


def test_the_busy_warning_does_not_advise_a_command_that_is_refused():
    """Without --memory-limit a CPU's --max-batch is refused: advising to drop the limit
    alone gave a command that fails."""
    from mixprec.cli.bench import _busy_warning

    with pytest.raises(ValueError, match="needs --memory-limit"):
        plan(_options(precisions=["32-true"], max_batch=True))
    p = plan(_options(precisions=["32-true"], max_batch=True, memory_limit=2**30))
    p.busy_cores = float(os.cpu_count() or 1)  # (every core busy: the warning is due)
    warning = _busy_warning(p)
    assert warning is not None and "--memory-limit" in warning and "--max-batch" in warning
    assert "--compile" not in warning, warning


def test_the_busy_warning_reads_the_busy_cores_the_threads_were_chosen_by():
    """The threads note said "other work kept 1.0 of 2 cores busy as the run began" and the
    warning beside it "1-minute load 2.1 on 2 cores": two measures, two verdicts."""
    load = [2.1, 2.0, 2.0]
    assert busy_machine_warning(load, 1, "cpu", cores=2, paired=True) is not None
    assert busy_machine_warning(load, 1, "cpu", cores=2, paired=True, busy_cores=1.0) is None
    warning = busy_machine_warning([0.1] * 3, 1, "cpu", cores=2, paired=True, busy_cores=1.8)
    assert "other work kept 1.8 of 2 cores busy as the run began" in warning
    assert "1-minute" not in warning
    times = {"32-true": [100.0] * 6, "bf16-mixed": [50.0] * 6}
    _, said = _said(_report(times, load_average_before=load, busy_cores_before=1.0))
    assert not any(n.startswith("WARNING") for n in said), said


def test_a_fresh_process_row_says_its_seconds_are_its_batch_sizes():
    """Both rows of a batch size run one after another in fresh processes printed the same
    "(7.3 s, fresh process)", each read as its own time."""
    row = Row(
        Config("32-true", "32-true", 4, None, False),
        RunResult(OK, LoopResult(step_ms=[21.6] * 6, peak_memory=2**20), fresh_process=True),
    )
    line = progress_line(row, 1, 4, 7.3)
    assert line.endswith("(in a fresh process, batch in 7.3 s)"), line


@pytest.mark.parametrize(
    ("ratios", "word"),
    [
        ((1.001, 1.002, 1.003, 1.004, 1.005, 1.006, 1.007, 1.008, 1.009, 1.0095), "as fast"),
        ((0.994, 0.9945, 0.995, 0.995, 0.995, 0.995, 0.9955, 0.996, 0.996, 0.9962), "speed"),
        ((1.001, 1.003, 1.004, 1.005, 1.006), "Too few rounds"),
    ],
)
def test_the_sentence_rounds_a_ratio_as_the_table_does(ratios, word):
    """The table printed 1.006x (1.002-1.009) and the sentence "1.01x as fast"; 0.995x
    (0.994-0.996) read "0.99x the speed" there."""
    report = _report({"32-true": [100.0] * len(ratios), "bf16-mixed": [100 / r for r in ratios]})
    summaries = summarize(report)
    cell = _speedup_cell(summaries[1]).split(" ")[0]  # "1.006x"
    sentence = conclusion(report, summaries)
    assert word in sentence and (f" {cell} " in sentence or f"{cell})" in sentence), (
        cell,
        sentence,
    )


def test_error_messages_describe_the_device_with_the_runs_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with assume(AVX2_CPU), pytest.raises(ValueError) as err:
            plan(_options(precisions=["32-true", "16-mixed"]))
    finally:
        torch.set_num_threads(before)
    assert "1 thread)" in str(err.value) and "2 threads" not in str(err.value), err.value


@pytest.mark.parametrize(
    ("typed", "shown"), [("64MiB", "64MiB"), ("67108864", "64MiB"), ("500MB", "500MB")]
)
def test_the_memory_limit_is_shown_as_typed(typed, shown):
    """--memory-limit 64MiB was shown as 67108864 in the reproduce line and the notes."""
    from mixprec.bench.suite import size_text

    limit = parse_size(typed)
    assert size_text(limit) == shown and parse_size(size_text(limit)) == limit
    p = plan(_options(precisions=["32-true"], memory_limit=limit))
    assert f"--memory-limit {shown}" in p.command
    times = {"32-true": [100.0] * 6}
    _, said = _said(_report(times, paired=False, memory_limit=limit))
    assert f"memory limit: {shown} per loop (OOM above it)" in said
    assert size_text(1500) == "1500"  # (no whole unit: bytes, as parse_size reads a number)


def test_several_precisions_timed_were_timed():
    gap = {
        "asked": True,
        "timed": ["float32", "float64"],
        "left_out": {},
        "matmul_gflops": {},
        "matmul_doubts": [],
        "command": None,
    }
    times = {"32-true": [100.0] * 6}
    report = _report(times, comparison_gap=gap, precisions=["32-true", "64-true"], steps=6)
    lines = comparison_gap_lines(report, summarize(report))
    assert lines[0] == (
        "timed: only 32-true, 64-true were asked for (--precision), so only float32 and "
        "float64 were timed"
    ), lines[0]
