"""How `mixprec bench` runs its configurations: in this process where a fresh one changes no
figure, each row on disk as soon as it is measured, the report rebuilt from the disk at the
end and when Ctrl-C or SIGTERM stops the run, and memory measured alike whichever loop or
configuration a process runs first. Real processes, real signals, real files; tiny models."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from mixprec.bench.journal import JOURNAL, Journal, load
from mixprec.bench.runner import (
    OK,
    LoopResult,
    RunResult,
    RunSpec,
    fresh_process_reason,
    is_oom,
    run_config,
    run_in_process,
    run_isolated,
    run_side_by_side,
)
from mixprec.bench.suite import Config, Row
from mixprec.cli import main
from mixprec.device import DeviceInfo, assume

FACTORY = textwrap.dedent(
    """
    import time

    import torch
    from torch import nn

    # what a library allocates on first use and keeps for the life of the process, as cuBLAS
    # does with a workspace per handle and stream
    WORKSPACE = []


    class Net(nn.Module):
        def __init__(self, on_large_batch=None):
            super().__init__()
            self.body = nn.Sequential(
                nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 4)
            )
            self.on_large_batch = on_large_batch

        def forward(self, x):
            if x.shape[0] > 2 and self.on_large_batch == "sleep":
                time.sleep(120)
            if x.shape[0] > 2 and self.on_large_batch == "interrupt":
                raise KeyboardInterrupt
            if self.on_large_batch == "workspace" and not WORKSPACE:
                WORKSPACE.append(torch.empty(2**20, dtype=torch.uint8))
            return self.body(x)


    def _workload(on_large_batch=None):
        torch.manual_seed(0)

        def make_batch(n):
            g = torch.Generator().manual_seed(0)
            return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)

        return Net(on_large_batch), make_batch, nn.functional.cross_entropy


    def make():
        return _workload()


    def sleepy():
        return _workload("sleep")


    def interrupted():
        return _workload("interrupt")


    def workspace():
        return _workload("workspace")
    """
)
MODULE = "benchruns_factory"


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The factories as an importable module in the working directory (a child process
    imports it from there too); imported once per process, so its WORKSPACE persists."""
    (tmp_path / f"{MODULE}.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    return tmp_path


def _spec(factory: str, precision: str, batch: int = 4, raw: bool = False) -> RunSpec:
    return RunSpec(
        model=f"{MODULE}:{factory}",
        precision=precision,
        batch_size=batch,
        image_size=8,
        device="cpu",
        steps=2,
        warmup=1,
        threads=1,
        allow_slow=True,
        raw=raw,
    )


def _figures(result: RunResult) -> list[tuple]:
    """The deterministic figures of a result: everything but the times."""
    loops = [result.mixprec] + ([result.raw] if result.raw is not None else [])
    return [(x.status, x.peak_memory, x.final_loss, x.skipped_steps) for x in loops]


def test_in_process_figures_equal_fresh_process_ones(factories, tmp_path):
    before = torch.get_num_threads()
    run_in_process(_spec("make", "32-true", batch=8))  # something ran here first
    for precision, raw in (("bf16-mixed", True), ("16-mixed", True)):
        spec = _spec("make", precision, raw=raw)
        assert fresh_process_reason(spec) is None
        here = run_in_process(spec)
        fresh = run_isolated(spec, tmp_path / "work")
        assert (here.fresh_process, fresh.fresh_process) == (False, True)
        assert here.status == fresh.status == OK, (here.error, fresh.error)
        assert _figures(here) == _figures(fresh), precision
        assert here.mixprec.peak_memory > 0 and len(here.mixprec.step_ms) == 2
    assert torch.get_num_threads() == before  # the run's thread count is not left behind


def test_side_by_side_rows_share_rounds_and_keep_their_own_figures(factories):
    """The configurations of a batch size take turns in one process: every loop has one
    step per round, and each row's memory, loss and skipped steps are what it gives alone."""
    specs = [_spec("make", "32-true"), _spec("make", "bf16-mixed", raw=True)]
    together = run_side_by_side(specs, base=0, budget_s=0.0)
    for spec, result in zip(specs, together, strict=True):
        alone = run_in_process(spec)
        assert result.status == OK and result.paired and not alone.paired
        assert result.rounds_stop == "steps"
        assert _figures(result) == _figures(alone), spec.precision
    steps = [together[0].mixprec.step_ms, *(r.mixprec.step_ms for r in together[1:])]
    assert [len(s) for s in steps] == [2, 2] and len(together[1].raw.step_ms) == 2


def test_a_failing_row_leaves_its_batch_sizes_other_rows_measured(factories):
    specs = [_spec("make", "32-true"), replace(_spec("make", "32-true"), model="nope:make")]
    ok, failed = run_side_by_side(specs, base=0)
    assert ok.status == OK and len(ok.mixprec.step_ms) == 2
    assert failed.status == "error" and "nope" in failed.error and not failed.paired


@pytest.mark.parametrize("failing_call", [4, 6])  # (after 3 in setup: warm-up, timed)
def test_a_raw_twin_failing_leaves_mixprecs_row_measured(factories, monkeypatch, failing_call):
    """The raw torch.autocast twin's error marked the whole configuration failed: mixprec's
    loop had run, its timings were dropped and its row showed the twin's error as its own.
    The twin leaves the rounds; the row is mixprec's, and report.md names the twin."""
    from mixprec.bench import runner
    from mixprec.bench.report import markdown, summarize
    from mixprec.bench.suite import BenchReport

    built = runner._build_raw

    def failing(spec, device):
        loop = built(spec, device)
        taken = loop.train_step
        calls = [0]

        def step():
            calls[0] += 1
            if calls[0] == failing_call:  # (once: a twin that failed is not stepped again)
                raise RuntimeError("expected scalar type BFloat16 but found Float")
            return taken()

        loop.train_step = step
        return loop

    monkeypatch.setattr(runner, "_build_raw", failing)
    specs = [
        replace(_spec("make", p, raw=p != "32-true"), steps=4, warmup=2)
        for p in ("32-true", "bf16-mixed")
    ]
    base, mixed = run_side_by_side(specs, base=0, budget_s=0.0)
    assert mixed.status == OK and mixed.error is None and len(mixed.mixprec.step_ms) == 4
    assert mixed.raw.status == "error" and "BFloat16" in mixed.raw.error
    assert not mixed.raw.step_ms
    rows = [
        Row(Config(s.precision, s.precision, 4, None, s.raw), r)
        for s, r in zip(specs, (base, mixed), strict=True)
    ]
    meta = {
        "model": "make", "threads": 1, "device_type": "cpu", "device": "cpu",
        "support": {"32-true": "fast", "bf16-mixed": "fast"}, "load_average_before": [0, 0, 0],
        "timing": "", "warmup": 1, "memory_method": "", "torch_version": "",
        "mixprec_version": "", "started": "", "command": "", "steps": 4,
        "precisions": ["32-true", "bf16-mixed"],
    }  # fmt: skip
    report = BenchReport(meta, rows)
    md = markdown(report, summarize(report))
    assert "- the raw torch.autocast twin of bf16-mixed at batch 4: error (RuntimeError" in md
    assert "| 4 | bf16-mixed | error" not in md


def test_each_loop_runs_the_untimed_steps_the_time_estimate_counts(factories, monkeypatch):
    """`runner.UNTIMED_STEPS` steps per loop before its warm-up and timed rounds, which the
    estimate of what timing a precision left out costs counts (it counted 1 where 3 ran)."""
    from mixprec.bench import runner

    steps = []
    step = runner.Loop.step

    def counted(loop: runner.Loop) -> torch.Tensor:
        steps.append(loop)
        return step(loop)

    monkeypatch.setattr(runner.Loop, "step", counted)
    result = run_in_process(replace(_spec("make", "32-true"), steps=4, warmup=2))
    assert result.status == OK and len(result.mixprec.step_ms) == 4
    assert len(steps) == runner.UNTIMED_STEPS + 2 + 4


def test_what_needs_a_fresh_process_says_why():
    spec = _spec("make", "32-true")
    assert "memory limit" in fresh_process_reason(replace(spec, memory_limit=2**30))
    assert "torch.compile" in fresh_process_reason(replace(spec, compile=True))


def test_memory_a_process_keeps_after_first_use_is_charged_to_neither_loop(factories, tmp_path):
    """The bench's loop measured first used to be charged for what libraries allocate once per
    process (on CUDA the cuBLAS workspaces: 65 MiB on an H200, mixprec's loop 171.7 MB
    against the raw loop's 103.4 MB); here a 1 MiB stand-in, allocated on first use and kept:
    each loop measures as it does with a model that allocates none."""
    spec = _spec("workspace", "bf16-mixed", raw=True)
    kept = run_config(spec)  # the first use in this process
    assert sys.modules[MODULE].WORKSPACE[0].numel() == 2**20  # allocated and kept
    plain = run_config(replace(spec, model=f"{MODULE}:make"))
    assert kept.status == plain.status == OK
    assert kept.mixprec.peak_memory == plain.mixprec.peak_memory
    assert kept.raw.peak_memory == plain.raw.peak_memory
    assert abs(kept.mixprec.peak_memory - kept.raw.peak_memory) < 2**10
    # and the same figures in a process where it is allocated for the first time
    assert _figures(run_isolated(spec, tmp_path / "work")) == _figures(kept)


def test_an_error_in_process_is_the_configurations_result():
    spec = replace(_spec("make", "32-true"), model="mixprec.bench.models:no_such_factory")
    result = run_in_process(spec)
    assert result.status == "error" and "no callable 'no_such_factory'" in result.error


def test_a_deadline_passed_in_process_is_a_timeout(factories):
    result = run_in_process(replace(_spec("make", "32-true"), steps=1000), timeout=0.0)
    assert result.status == "timeout" and result.error == "no result after 0 s"


def _bench_args(factory: str, out: Path) -> list[str]:
    return [
        *("bench", "--model", f"{MODULE}:{factory}", "--batch-sizes", "2", "4"),
        *("--precision", "32-true", "--steps", "1", "--warmup", "0", "--threads", "1"),
        *("--out", str(out)),
    ]


def _check_stopped_run(out: Path, by: str) -> None:
    rows = [json.loads(x) for x in (out / JOURNAL).read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["start", "row"]
    results = json.loads((out / "results.json").read_text())
    [entry] = results["results"]
    assert (entry["config"]["batch_size"], entry["result"]["status"]) == (2, OK)
    assert results["metadata"]["stopped"] == {
        "finished": 1,
        "planned": 2,
        "not_run": ["32-true @ 4"],
        "by": by,
    }
    line = f"stopped by {by} after 1 of 2 configurations; not run: 32-true @ 4"
    assert line in (out / "report.md").read_text()
    assert "| 2 | 32-true |" in (out / "report.md").read_text()
    assert (out / "results.csv").read_text().count("\n") == 2  # header and the one row


def test_sigterm_after_the_first_configuration_leaves_its_row_and_a_report(factories):
    out = factories / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mixprec.cli", *_bench_args("sleepy", out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, COLUMNS="200"),
    )
    watchdog = threading.Timer(300, proc.kill)  # a run that never prints ends the test
    watchdog.start()
    try:
        printed = []
        for line in proc.stdout:  # the progress line arrives while the second one runs
            printed.append(line)
            if line.startswith("[1/2]"):
                break
        assert printed and printed[-1].startswith("[1/2] 32-true @ 2: ok, "), printed
        assert "ms/step, peak " in printed[-1]
        # on disk before the run goes on
        assert [json.loads(x)["kind"] for x in (out / JOURNAL).read_text().splitlines()] == [
            "start",
            "row",
        ]
        time.sleep(0.5)  # inside the second configuration's 120 s step
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=120)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "[2/2]" not in rest and "stopped by SIGTERM after 1 of 2" in " ".join(err.split())
    _check_stopped_run(out, "SIGTERM")


def test_ctrl_c_after_the_first_configuration_leaves_its_row_and_a_report(factories, capsys):
    out = factories / "out"
    assert main(_bench_args("interrupted", out)) == 128 + signal.SIGINT
    captured = capsys.readouterr()
    assert "[1/2] 32-true @ 2: ok, " in captured.out and "[2/2]" not in captured.out
    assert "stopped by Ctrl-C after 1 of 2 configurations" in " ".join(captured.err.split())
    _check_stopped_run(out, "Ctrl-C")


def test_a_finished_run_is_rebuilt_whole_and_a_record_cut_short_is_left_out(tmp_path):
    journal = Journal(tmp_path / JOURNAL)
    configs = [Config("32-true", "32-true", b, None, False) for b in (2, 4)]
    result = RunResult(OK, LoopResult(step_ms=[1.0], peak_memory=10, final_loss=0.5), None, "m")
    journal.started({"model": "m"}, configs)
    journal.measured(Row(configs[0], result), 1, 0.1)
    journal.measured(Row(configs[1], result), 2, 0.1)
    journal.finished({"elapsed_s": 0.2, "memory_method": "m"})
    report = load(journal.path)
    assert [r.config.batch_size for r in report.rows] == [2, 4]
    assert report.rows[0].result == result and "stopped" not in report.metadata
    assert report.metadata["elapsed_s"] == 0.2
    # killed while writing the end record: the rows are all there, the run marked stopped
    text = journal.path.read_text()
    journal.path.write_text(text[: text.rindex('{"kind": "end"') + 20])
    report = load(journal.path)
    assert len(report.rows) == 2 and report.metadata["stopped"]["not_run"] == []
    with pytest.raises(FileExistsError):
        Journal(journal.path).started({}, configs)


def test_the_peak_is_a_steps_with_the_optimizers_state_alive(factories):
    """The peak was measured up to the first optimizer update only, whose forward and
    backward run before Adam's moments exist: a step's peak holds them beside the
    activations, so every later step needed two moments more than the bench reported and
    `--max-batch` called batches that run out of memory fits."""
    from benchruns_factory import make

    from mixprec.bench.runner import _build_mixprec, _first_update
    from mixprec.memory import measured

    spec = _spec("make", "32-true", batch=64)  # activations past the update's own peak
    peak = run_in_process(spec).mixprec.peak_memory
    _, to_first_update = measured(torch.device("cpu"), lambda: _first_update(_build_mixprec, spec))
    moments = 2 * sum(p.numel() * p.element_size() for p in make()[0].parameters())
    assert peak >= to_first_update + moments
    # and the method the report prints says so (it named the old window)
    from mixprec.bench.runner import CPU_MEMORY_METHOD, CUDA_MEMORY_METHOD

    for method in (CPU_MEMORY_METHOD, CUDA_MEMORY_METHOD):
        assert "one step past the first optimizer update" in method


def test_a_run_stopped_during_the_max_batch_search_keeps_its_probes(factories):
    """SIGTERM in the search (its probe of batch 4, in a process of its own): the probe of
    batch 2 that fitted was lost and the report did not say the search had been cut. It
    now keeps the probes made and says how far the search went."""
    out = factories / "out"
    args = _bench_args("sleepy", out)
    args.remove("4")  # (one configuration: batch 2; the search then probes 4)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mixprec.cli", *args, "--max-batch", "--memory-limit", "4GiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, COLUMNS="200"),
    )
    watchdog = threading.Timer(300, proc.kill)  # a run that never prints ends the test
    watchdog.start()
    try:
        for line in proc.stdout:
            if line.startswith("max batch 32-true: 2 fits"):
                break
        time.sleep(1.0)  # inside the probe of batch 4's 120 s step
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "max-batch search not finished: 32-true" in " ".join(err.split())
    kinds = [json.loads(x)["kind"] for x in (out / JOURNAL).read_text().splitlines()]
    assert kinds == ["start", "row", "probe"]
    found = json.loads((out / "results.json").read_text())["max_batch"]["32-true"]
    assert (found["max_batch"], found["first_oom"], found["cut"]) == (2, None, True)
    assert [p["batch_size"] for p in found["probes"]] == [2]
    line = "32-true: search cut short when the run was stopped (the largest that fitted: 2)"
    assert line in (out / "report.md").read_text()


def test_a_cut_search_counts_only_probes_that_ran_out_of_memory(tmp_path):
    """A probe the stop itself ended (an error, a timeout) neither fitted nor ran out of
    memory: a cut search rebuilt from the journal read it as the first batch out of memory."""
    journal = Journal(tmp_path / JOURNAL)
    config = Config("32-true", "32-true", 2, None, False)
    result = RunResult(OK, LoopResult(step_ms=[1.0], peak_memory=10, final_loss=0.5), None, "m")
    journal.started({"model": "m", "max_batch_searches": ["32-true"]}, [config])
    journal.measured(Row(config, result), 1, 0.1)
    for batch, status in ((2, OK), (4, OK), (8, "oom"), (6, "error")):
        journal.probed("32-true", batch, status)
    found = load(journal.path).max_batch["32-true"]
    assert (found["max_batch"], found["first_oom"], found["cut"]) == (4, 8, True)
    journal.path.write_text("\n".join(journal.path.read_text().splitlines()[:-2]) + "\n")
    found = load(journal.path).max_batch["32-true"]
    assert (found["max_batch"], found["first_oom"]) == (4, None)


def test_a_fresh_process_judges_the_device_assumed_here(factories, tmp_path):
    """Under `assume`, the plan rated bf16-mixed fast on a described AMX CPU, but a row run
    in a fresh process (a memory limit, a largest-batch probe) rated the host and refused it
    as slow: 'every mixed precision configuration failed'."""
    amx = DeviceInfo(
        "cpu",
        "Intel Xeon Platinum 8480+",
        cpu_flags=frozenset({"avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16"}),
        gemm_ratios={"bfloat16": 3.0, "float16": 0.05},
    )
    slow_here = DeviceInfo("cpu", "a CPU without bf16", cpu_flags=frozenset({"avx2"}))
    spec = replace(_spec("make", "bf16-mixed"), allow_slow=False)
    with assume(amx):
        result = run_isolated(spec, tmp_path / "work")
    assert result.status == OK, result.error
    with assume(slow_here):
        refused = run_isolated(spec, tmp_path / "work")
    assert "slower than float32" in refused.error


def test_allocation_failures_in_other_words_are_out_of_memory():
    """LAPACK's workspace fails with std::bad_alloc; under the bench's address-space cap a
    oneDNN primitive whose scratch memory cannot be had 'could not execute'."""
    assert is_oom(RuntimeError("std::bad_alloc"))
    primitive = RuntimeError("could not execute a primitive")
    assert not is_oom(primitive)  # (no cap: some other failure)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (2**46, hard))
    try:
        assert is_oom(primitive)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_each_fresh_process_compiles_with_empty_caches_and_the_raw_twin_alone(
    tmp_path, monkeypatch
):
    """Found by a review: `bench --compile` compiled the raw torch.autocast twin right after
    mixprec's loop in one process, dynamo and inductor warm (3-4x faster than alone), and
    inductor's disk cache in /tmp carried over between processes and runs (a second run's
    raw loop compiled in 0.1 s). Each fresh process gets an empty compile cache folder of
    its own, removed after it, and the twin's first step is timed in a process of its own."""
    from mixprec.bench import runner

    calls = []

    def fake(target, argv, env, timeout=None):
        cache = Path(env["TORCHINDUCTOR_CACHE_DIR"])
        assert cache.is_dir() and not any(cache.iterdir())  # empty, this process's own
        assert env["TRITON_CACHE_DIR"] == str(cache / "triton")
        calls.append((target.split(":")[1], cache))
        alone = LoopResult(first_step_s=4.0)  # (the twin compiled alone)
        ours, warm = LoopResult(first_step_s=5.0), LoopResult(first_step_s=1.0)
        found = RunResult(OK, ours, warm) if target.endswith(":main") else alone
        Path(argv[1]).write_text(json.dumps(asdict(found)))
        return 0, ""

    monkeypatch.setattr(runner.forkserver, "run_fresh", fake)
    spec = replace(_spec("make", "bf16-mixed", raw=True), compile=True)
    result = run_isolated(spec, tmp_path / "work")
    assert [target for target, _ in calls] == ["main", "raw_first_step"]
    assert calls[0][1] != calls[1][1] and not any(c.exists() for _, c in calls)
    assert (result.mixprec.first_step_s, result.raw.first_step_s) == (5.0, 4.0)
    calls.clear()  # an uncompiled row under a memory limit: one process, its own cache too
    run_isolated(replace(spec, compile=False, memory_limit=2**30), tmp_path / "work")
    assert [target for target, _ in calls] == ["main"]


def test_the_raw_twins_first_step_process_builds_the_raw_loop_alone(
    factories, tmp_path, monkeypatch
):
    """Found by a review (see above): the process timing the raw twin's compilation readies
    the raw loop alone, as `run_group` readies it (same peak), and no mixprec loop first."""
    from mixprec.bench import runner

    spec = _spec("make", "bf16-mixed", raw=True)
    expected = run_config(spec).raw

    def refused(*args):
        raise AssertionError("mixprec's loop was built")

    monkeypatch.setattr(runner, "_build_mixprec", refused)
    path = tmp_path / "raw.json"
    assert runner.raw_first_step([json.dumps(asdict(spec)), str(path)]) == 0
    alone = LoopResult(**json.loads(path.read_text()))
    assert alone.status == OK and alone.first_step_s > 0
    assert alone.peak_memory == expected.peak_memory


def _fake_processes(monkeypatch, twin, calls=None):
    """`forkserver.run_fresh` faked: mixprec's process measures both loops (its compile 5 s),
    the raw twin's cold-compile process does `twin(argv)` (its exit code and output)."""
    from mixprec.bench import runner

    def fake(target, argv, env, timeout=None):
        if calls is not None:
            calls.append((target.split(":")[1], timeout))
        if target.endswith(":main"):
            loop = LoopResult(first_step_s=5.0, step_ms=[1.0, 1.0])
            found = RunResult(OK, loop, replace(loop, first_step_s=1.0))
            Path(argv[1]).write_text(json.dumps(asdict(found)))
            return 0, ""
        return twin(argv)

    monkeypatch.setattr(runner.forkserver, "run_fresh", fake)


def test_a_stop_while_the_raw_twin_compiles_keeps_the_measured_row(tmp_path, monkeypatch):
    """Found by a review: with --compile, SIGTERM (or Ctrl-C) during the raw twin's
    cold-compile process, after mixprec's process had measured everything, dropped the whole
    row: nothing was journaled ("stopped by SIGTERM after 0 of 1 configurations"). The row is
    journaled, only the twin's compile time missing and said why, then the stop propagates."""
    from devices import AVX2_CPU

    from mixprec import hardware
    from mixprec.bench.suite import BenchOptions, plan, run_bench

    def stopped(argv):
        raise KeyboardInterrupt

    _fake_processes(monkeypatch, stopped)
    options = BenchOptions(model="mlp", batch_sizes=[2], precisions=["bf16-mixed"], threads=1)
    with hardware.assume(AVX2_CPU):
        p = plan(replace(options, compile=True, allow_slow=True, steps=2, warmup=0))
        with pytest.raises(KeyboardInterrupt):
            run_bench(p, [Journal(tmp_path / JOURNAL)])
    report = load(tmp_path / JOURNAL)
    (row,) = report.rows
    assert report.metadata["stopped"]["finished"] == 1
    assert row.result.status == OK and row.result.mixprec.first_step_s == 5.0
    assert row.result.raw.first_step_s is None  # (not the warm 1.0 s)
    assert row.result.raw.first_step_error == "the run was stopped while it compiled"


def _crashed(argv):
    return 1, "Traceback (most recent call last):\nRuntimeError: inductor exploded"


def _failed(argv):
    failed = LoopResult(status="error", error="RuntimeError: compile failed")
    Path(argv[1]).write_text(json.dumps(asdict(failed)))
    return 0, ""


@pytest.mark.parametrize(
    "twin, why",
    [
        (_crashed, "its process exited with code 1: RuntimeError: inductor exploded"),
        (lambda argv: (None, ""), "timed out (after the "),
        (lambda argv: (-9, ""), "killed by SIGKILL, the usual sign of running out of host"),
        (_failed, "error: RuntimeError: compile failed"),
    ],
)
def test_a_failed_raw_cold_compile_says_why_it_is_missing(tmp_path, monkeypatch, twin, why):
    """Found by a review: where the raw twin's cold-compile process crashed, timed out, was
    killed or failed, its compile time went missing without a word (the row stayed ok, the
    note just left the raw time out). The twin's `first_step_error` says why, and the note."""
    from devices import AVX2_CPU

    from mixprec import hardware
    from mixprec.bench.report import notes, summarize
    from mixprec.bench.suite import BenchOptions, BenchReport, metadata, plan

    _fake_processes(monkeypatch, twin)
    spec = replace(_spec("make", "bf16-mixed", raw=True), compile=True)
    result = run_isolated(spec, tmp_path / "work", timeout=60)
    assert result.status == OK and result.raw.status == OK
    assert result.raw.first_step_s is None and result.raw.first_step_error.startswith(why)
    options = BenchOptions(model="mlp", batch_sizes=[4], precisions=["bf16-mixed"], threads=1)
    with hardware.assume(AVX2_CPU):
        p = plan(replace(options, compile=True, allow_slow=True, steps=2))
        meta = dict(metadata(p), comparison_gap=None, memory_method="m")
    (config,) = p.configs
    report = BenchReport(meta, [Row(config, result)])
    line = next(n for n in notes(report, summarize(report)) if "first step (comp" in n)
    assert line.startswith(
        "bf16-mixed (compiled) at batch 4: first step (compilation) 5.0 s; raw loop's cold "
        f"compile not measured: {why}"
    )


def test_the_raw_cold_compile_runs_after_mixprecs_loop_worked_within_the_timeout(
    tmp_path, monkeypatch
):
    """Found by a review: the raw twin's cold-compile process ran even where mixprec's own
    compiled loop had failed (its row an error: nothing to compare), and with the whole
    `--timeout` again, so a configuration could take twice its "seconds per configuration".
    It runs only after mixprec's loop succeeded, in the time the first process left."""
    from mixprec.bench import runner

    clock = [1000.0]

    class Clock:  # (mixprec's process takes 40 s of the configuration's 60)
        monotonic = staticmethod(lambda: clock[0])
        monotonic_ns = staticmethod(time.monotonic_ns)

    def alone(argv):
        Path(argv[1]).write_text(json.dumps(asdict(LoopResult(first_step_s=4.0))))
        return 0, ""

    calls = []
    _fake_processes(monkeypatch, alone, calls)
    fake = runner.forkserver.run_fresh

    def slow(target, argv, env, timeout=None):
        clock[0] += 40.0 if target.endswith(":main") else 0.0
        return fake(target, argv, env, timeout)

    monkeypatch.setattr(runner.forkserver, "run_fresh", slow)
    monkeypatch.setattr(runner, "time", Clock)
    spec = replace(_spec("make", "bf16-mixed", raw=True), compile=True)
    assert run_isolated(spec, tmp_path / "work", timeout=60).raw.first_step_s == 4.0
    assert calls == [("main", 60), ("raw_first_step", 20.0)]
    calls.clear()  # no time left: no second process, and why
    result = run_isolated(spec, tmp_path / "work", timeout=30)
    assert calls == [("main", 30)]
    assert result.raw.first_step_error == "no time left of --timeout (30 s per configuration)"
    calls.clear()  # mixprec's loop failed: the row is an error, no twin compiled for it

    def failed(target, argv, env, timeout=None):
        calls.append((target.split(":")[1], timeout))
        error = LoopResult(status="error", error="RuntimeError: mixprec compile failed")
        found = RunResult("error", error, LoopResult(first_step_s=1.0), error=error.error)
        Path(argv[1]).write_text(json.dumps(asdict(found)))
        return 0, ""

    monkeypatch.setattr(runner.forkserver, "run_fresh", failed)
    result = run_isolated(spec, tmp_path / "work", timeout=60)
    assert result.status == "error" and calls == [("main", 60)]
    # (a diff review: the twin's warm compile, taken after ours, was kept as if cold)
    assert result.raw.first_step_s is None
    assert result.raw.first_step_error == "not timed alone: a loop of this configuration failed"
