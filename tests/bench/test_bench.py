"""`mixprec bench` end to end on tiny settings: real subprocesses, real torch, real files.

Every run uses one thread and tiny images so that the whole file stays well under 90 s on
a shared 2-core machine; the numbers are checked for sanity, never for speed.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from devices import AMX_CPU, AVX2_CPU, ZEN4

from mixprec import hardware
from mixprec.bench.report import busy_machine_warning, conclusion, markdown, summarize
from mixprec.bench.runner import OK, OOM, LoopResult, RunResult, set_tf32
from mixprec.bench.suite import BenchOptions, BenchReport, Config, Row, plan
from mixprec.cli import build_parser, main
from mixprec.cli.bench import parse_size
from mixprec.hardware import ALLOW_SLOW_ENV
from mixprec.policy import Policy
from mixprec.policy.map import PolicyMap

TINY = ["--threads", "1", "--warmup", "0"]

FACTORY = textwrap.dedent(
    """
    import torch
    from torch import nn


    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 4))

        def make_batch(n):
            g = torch.Generator().manual_seed(0)
            return torch.randn(n, 32, generator=g), torch.randint(0, 4, (n,), generator=g)

        return model, make_batch, nn.functional.cross_entropy


    class Hog(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 2)

        def forward(self, x):
            x.new_empty(2**29)  # 2 GiB, never touched: fine without a memory limit
            return self.lin(x)


    def hog():
        batch = lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,)))
        return Hog(), batch, nn.functional.cross_entropy


    def broken():
        return nn.Linear(2, 2)


    def raises():
        raise RuntimeError("no weights")


    def needs_arg(size):
        return nn.Linear(size, 2)


    class NoBfloat16(nn.Linear):
        def forward(self, x):
            out = super().forward(x)
            if out.dtype == torch.bfloat16:
                raise RuntimeError("this layer refuses bfloat16")
            return out


    def no_bf16():
        batch = lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,)))
        return NoBfloat16(8, 2), batch, nn.functional.cross_entropy


    def small_only():
        def make_batch(n):
            if n > 4:
                raise ValueError(f"this data set has 4 samples, asked for {n}")
            return torch.randn(n, 8), torch.randint(0, 2, (n,))

        return nn.Linear(8, 2), make_batch, nn.functional.cross_entropy
    """
)


@pytest.fixture
def factory_dir(tmp_path: Path) -> Path:
    (tmp_path / "benchfactory.py").write_text(FACTORY)
    return tmp_path


def _bench(tmp_path: Path, *args: str) -> tuple[int, dict, list[dict], str]:
    out = tmp_path / "out"
    code = main(["bench", *args, "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    return code, results, rows, (out / "report.md").read_text()


def test_default_experiment_end_to_end_writes_all_four_outputs(tmp_path, capsys, monkeypatch):
    # planned as on a CPU with fast bf16; the child processes run bf16 on whatever this host
    # is, allowed by the environment switch they inherit
    monkeypatch.setenv(ALLOW_SLOW_ENV, "1")
    with hardware.assume(ZEN4):
        code, results, rows, md = _bench(
            tmp_path, "--image-size", "16", "--batch-sizes", "2", "4", "--steps", "2", *TINY
        )
    assert code == 0
    expected = ["32-true", "bf16-mixed"]
    meta = results["metadata"]
    assert meta["comparison_gap"] is None and "Why no mixed precision" not in md
    assert meta["precisions"] == expected
    assert meta["model"] == "cnn" and meta["image_size"] == 16
    assert meta["torch_version"] == torch.__version__
    assert meta["command"].startswith("mixprec bench --model cnn --image-size 16")
    assert "profiler" in meta["memory_method"]
    # other work through the run: /proc/stat's busy share less this process's CPU time
    assert meta["cores"] == (os.cpu_count() or 1)
    assert meta["other_busy_cores"] is None or 0 <= meta["other_busy_cores"] <= meta["cores"]
    if os.path.exists("/proc/stat"):
        assert meta["other_busy_cores"] is not None

    entries = results["results"]
    assert [(e["config"]["spec"], e["config"]["batch_size"]) for e in entries] == [
        (p, b) for b in (2, 4) for p in expected
    ]
    for e in entries:
        ours = e["result"]["mixprec"]
        assert e["result"]["status"] == OK
        assert len(ours["step_ms"]) == 2 and all(t > 0 for t in ours["step_ms"])
        assert math.isfinite(ours["final_loss"])
        # the model's weights alone (Adam: weights, grads, two moments) are ~16 MiB
        assert 16 * 2**20 < ours["peak_memory"] < 64 * 2**20
        raw = e["result"]["raw"]
        if Policy(e["config"]["spec"]).is_mixed:
            assert len(raw["step_ms"]) == 2 and raw["peak_memory"] > 0
            # same weights, same batch, same number of steps: nearly the same loss
            assert ours["final_loss"] == pytest.approx(raw["final_loss"], abs=0.05)
            assert e["summary"]["overhead"] is not None
        else:
            assert raw is None and e["summary"]["overhead"] is None
    # the batch dimension shows in the measured memory
    by = {(e["config"]["spec"], e["config"]["batch_size"]): e for e in entries}
    peak = {k: v["result"]["mixprec"]["peak_memory"] for k, v in by.items()}
    assert peak[("32-true", 4)] > peak[("32-true", 2)]
    assert by[("32-true", 2)]["summary"]["speedup"] == 1.0

    assert len(rows) == len(entries)
    for row, e in zip(rows, entries, strict=True):
        assert float(row["median_ms"]) == pytest.approx(e["summary"]["median_ms"])
        assert row["status"] == OK
    assert "| batch | precision | ms/step median |" in md
    assert f"reproduce: `{meta['command']}`" in md
    png = (tmp_path / "out" / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    printed = capsys.readouterr().out
    # piped, the table wraps its headers between words to fit textout.FILE_WIDTH
    assert "ms/step" in printed and "median" in printed and meta["command"] in printed


def test_on_a_cpu_without_fast_bf16_the_default_run_says_why_it_timed_float32_only(
    tmp_path, capsys, monkeypatch
):
    from mixprec.bench import suite

    # (rates measured on a quiet machine: doubted ones are not shown, tested below; the AVX2
    # CPU is described for its plan, the rates measured as a host's)
    monkeypatch.setattr(suite, "rate_doubts", lambda rates, info, load: [])
    monkeypatch.setattr(suite, "assumed", lambda device_type: False)
    with hardware.assume(AVX2_CPU):
        code, results, _, md = _bench(
            tmp_path, "--image-size", "16", "--batch-sizes", "2", "--steps", "1", *TINY
        )
    assert code == 0
    meta = results["metadata"]
    assert meta["precisions"] == ["32-true"]
    gap = meta["comparison_gap"]
    assert gap["asked"] is False
    assert {n: w["status"] for n, w in gap["left_out"].items()} == {
        "bf16-mixed": "slow",
        "16-mixed": "slow",
    }
    rates = gap["matmul_gflops"]
    assert set(rates) == {"float32", "bfloat16", "float16"} and all(r > 0 for r in rates.values())
    anyway = gap["command"]
    assert "--precision 32-true bf16-mixed 16-mixed" in anyway and anyway.endswith("--allow-slow")
    printed = " ".join(capsys.readouterr().out.split())
    for text in (md, printed):
        flat = " ".join(text.split())
        assert "timed: no mixed precision is fast on this device, so only float32 was timed" in flat
        assert "left out: bf16-mixed, slow here (bfloat16: no bf16 or avx512 instructions" in flat
        assert f"float32 {rates['float32']:,.1f} GFLOP/s" in flat
        assert "bfloat16 is fast on NVIDIA GPUs of compute capability 8.0+" in flat
        assert f"to time bf16-mixed and 16-mixed anyway: {anyway}" in flat
    # a few short labelled lines, not one paragraph
    section = md.split("## Why no mixed precision was timed")[1].split("##")[0].strip()
    labels = ("timed", "left out", "matmul rates", "estimate", "where it pays", "to time ")
    for line in section.splitlines():
        assert line.startswith("- ") and line[2:].startswith(labels), line
    assert len(section.splitlines()) >= 5
    # a CPU run says nothing of CUDA, and leaves out the columns no row fills
    assert "CUDA" not in meta["timing"]
    header = next(line for line in md.splitlines() if line.startswith("| batch"))
    assert "raw torch ms/step" not in header and "mixprec overhead" not in md
    assert "peak memory" in header and "ms/step median" in header


def test_matmul_rates_measured_on_a_busy_machine_are_doubted_not_used(
    tmp_path, capsys, monkeypatch
):
    """float16 measured 20x faster than float32 on a busy 2-core host (float32's rounds
    slowed) and was printed without a word, and the estimate of what timing it would cost
    left out silently. The doubts `info --measure` gives are said, and no time is estimated
    from such rates."""
    from mixprec.bench import suite

    doubt = "float16, slow on this hardware, measured 20.2x faster than float32"
    monkeypatch.setattr(suite, "rate_doubts", lambda rates, info, load: [doubt])
    # (the AVX2 CPU described for its float32-only plan, its rates measured as a host's)
    monkeypatch.setattr(suite, "assumed", lambda device_type: False)
    with hardware.assume(AVX2_CPU):
        code, results, _, md = _bench(
            tmp_path, "--image-size", "16", "--batch-sizes", "2", "--steps", "1", *TINY
        )
    assert code == 0
    assert results["metadata"]["comparison_gap"]["matmul_doubts"] == [doubt]
    section = md.split("## Why no mixed precision was timed")[1].split("##")[0]
    flat = " ".join(section.split())
    said = "matmul rates measured now: not shown, as other work used the cores while they were"
    doubted = "float16, slow on this hardware, measured faster than float32"  # (no figure)
    assert f"{said} measured ({doubted}); no rate or time is estimated from them" in flat
    assert "GFLOP/s" not in flat and "20.2x" not in flat
    assert not any(line.startswith("- estimate") for line in section.splitlines())


def test_the_time_estimate_counts_every_untimed_step_of_a_loop():
    """Each loop runs `runner.UNTIMED_STEPS` steps before its warm-up rounds (a warm-up up
    to its first update, then that update and one step more while its memory is measured);
    the estimate of what timing a precision left out costs counted one."""
    from mixprec.bench.report import comparison_gap_lines

    fp32 = Row(
        Config("32-true", "32-true", 8, None, False), RunResult(OK, LoopResult(step_ms=[100.0]))
    )
    report = _report([fp32])  # 3 steps, 1 warm-up round
    left_out = {"status": "slow", "reason": "r", "dtype": "bfloat16", "fast_on": "GPUs"}
    report.metadata["comparison_gap"] = {
        "asked": False, "timed": ["32-true"], "left_out": {"bf16-mixed": left_out},
        "matmul_gflops": {"float32": 100.0, "bfloat16": 10.0}, "command": "",
    }  # fmt: skip
    lines = comparison_gap_lines(report, summarize(report))
    # a step 10x float32's 100 ms: 1 s, ours and the raw loop 3 + 1 + 3 steps each: 14 s
    assert (
        "estimate: a step at batch 8 (float32 100.0 ms) about 1.0 s in bf16-mixed; timing it "
        "about 14.0 s"
    ) in lines, lines


def test_asking_for_float32_only_says_what_was_left_out(tmp_path, capsys):
    with hardware.assume(ZEN4):
        code, results, _, md = _bench(
            tmp_path,
            *("--image-size", "16", "--batch-sizes", "2", "--steps", "1"),
            *("--precision", "32-true"),
            *TINY,
        )
    assert code == 0
    gap = results["metadata"]["comparison_gap"]
    assert gap["asked"] is True and gap["left_out"]["bf16-mixed"]["status"] == "fast"
    # only the fast one is suggested, so no --allow-slow
    assert "--precision 32-true bf16-mixed --steps" in gap["command"]
    assert "--allow-slow" not in gap["command"]
    # and 16-mixed, slow here, by its own command (before: the line named no precision, and
    # its command timed bf16-mixed alone beside an estimate for 16-mixed)
    assert gap["slow_runnable"] == ["16-mixed"]
    assert "--precision 32-true bf16-mixed 16-mixed --steps" in gap["slow_command"]
    assert gap["slow_command"].endswith("--allow-slow")
    flat = " ".join(md.split())
    assert f"to time bf16-mixed anyway: {gap['command']}" in flat
    assert f"to time 16-mixed too (slow here): {gap['slow_command']}" in flat
    assert "timed: only 32-true was asked for (--precision), so only float32 was timed" in flat
    assert "left out: bf16-mixed, fast here" in flat


def test_memory_limit_reports_oom_and_the_run_continues(tmp_path, capsys):
    # blog CNN on 64x64 images: ~24 MB at batch 1 (weights + Adam), ~100 MB at batch 64
    code, results, rows, md = _bench(
        tmp_path,
        *("--image-size", "64", "--batch-sizes", "64", "1", "--precision", "32-true"),
        *("--memory-limit", "50MB", "--steps", "1"),
        *TINY,
    )
    assert code == 0
    status = {e["config"]["batch_size"]: e["result"] for e in results["results"]}
    assert status[1]["status"] == OK and status[1]["mixprec"]["peak_memory"] < 50 * 2**20
    assert status[64]["status"] == OOM and "over the memory limit" in status[64]["mixprec"]["error"]
    assert [r["status"] for r in rows] == [OK, OOM]
    assert "| 64 | 32-true | OOM | - |" in md
    assert "OOM" in capsys.readouterr().out


def test_allocation_beyond_the_memory_limit_fails_like_an_oom(tmp_path, factory_dir, capsys):
    code, results, _, _ = _bench(
        tmp_path,
        *("--model", f"{factory_dir / 'benchfactory.py'}:hog", "--batch-sizes", "2"),
        *("--precision", "32-true", "--memory-limit", "100M", "--steps", "1"),
        *TINY,
    )
    assert code == 0
    (entry,) = results["results"]
    assert entry["result"]["status"] == OOM
    assert "can't allocate memory" in entry["result"]["mixprec"]["error"]


def test_user_factory_model_runs_through_both_loops(tmp_path, factory_dir):
    code, results, _, _ = _bench(
        tmp_path,
        *("--model", f"{factory_dir / 'benchfactory.py'}:make", "--batch-sizes", "8"),
        *("--precision", "32-true", "bf16-mixed", "--allow-slow", "--steps", "3"),
        *TINY,
    )
    assert code == 0
    by = {e["config"]["spec"]: e["result"] for e in results["results"]}
    assert by["32-true"]["status"] == by["bf16-mixed"]["status"] == OK
    loss32 = by["32-true"]["mixprec"]["final_loss"]
    assert by["bf16-mixed"]["mixprec"]["final_loss"] == pytest.approx(loss32, abs=0.05)
    assert by["bf16-mixed"]["raw"]["final_loss"] == pytest.approx(loss32, abs=0.05)
    assert len(by["bf16-mixed"]["raw"]["step_ms"]) == 3
    assert results["metadata"]["model"].endswith("benchfactory.py:make")


def test_a_policy_file_is_timed_with_its_rules(tmp_path, factory_dir):
    # the doctor's policy.json: a bf16 default whose rule puts every layer back in float32
    # trains exactly as 32-true does, so its rules (not only its default) reached the run
    policy = PolicyMap("bf16-mixed", {".*": "32-true"}).save(tmp_path / "policy.json")
    code, results, _, md = _bench(
        tmp_path,
        *("--model", f"{factory_dir / 'benchfactory.py'}:make", "--batch-sizes", "8"),
        *("--precision", "32-true", "bf16-mixed", str(policy), "--allow-slow", "--steps", "2"),
        *TINY,
    )
    assert code == 0
    by = {e["config"]["spec"]: e for e in results["results"]}
    ours = by[str(policy)]
    assert ours["config"]["label"] == str(policy) and ours["result"]["raw"] is None
    loss32 = by["32-true"]["result"]["mixprec"]["final_loss"]
    assert ours["result"]["mixprec"]["final_loss"] == loss32
    assert by["bf16-mixed"]["result"]["mixprec"]["final_loss"] != loss32
    assert f"| {policy} |" in md


def test_plan_of_a_policy_file_keeps_its_islands_and_has_no_raw_twin(tmp_path):
    path = PolicyMap("bf16-mixed", {"head": "32-true"}, float32_islands=False).save(
        tmp_path / "p.json"
    )
    p = plan(
        BenchOptions(
            model="mlp",
            precisions=["32-true", "bf16-mixed", str(path)],
            float32_islands="both",
            allow_slow=True,
        )
    )
    assert p.precisions[str(path)] == PolicyMap.load(path)
    mine = [c for c in p.configs if c.spec == str(path)]
    assert {(c.raw, c.float32_islands, c.label) for c in mine} == {
        (False, False, f"{path} (no f32 islands)")
    }
    assert p.times_low_precision
    assert f"--precision 32-true bf16-mixed {path}" in p.command
    with pytest.raises(ValueError, match="cannot read the policy file"):
        plan(BenchOptions(model="mlp", precisions=[str(tmp_path / "missing.json")]))


def test_user_factory_by_module_name(tmp_path, factory_dir, monkeypatch):
    monkeypatch.chdir(factory_dir)
    code, results, _, _ = _bench(
        tmp_path,
        *("--model", "benchfactory:make", "--batch-sizes", "2", "--precision", "32-true"),
        *("--steps", "1"),
        *TINY,
    )
    assert code == 0 and results["results"][0]["result"]["status"] == OK


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("broken", "must return (model, make_batch, loss_fn), got Linear"),
        ("raises", "raised RuntimeError: no weights ("),
        ("needs_arg", "raised TypeError: needs_arg() missing 1 required positional argument"),
    ],
)
def test_a_broken_factory_stops_the_run_before_anything_is_timed(
    tmp_path, factory_dir, capsys, factory, message
):
    # before: every configuration ran, failed alike, and the run exited 1
    out = tmp_path / "never"
    code = main(
        ["bench", "--model", f"{factory_dir / 'benchfactory.py'}:{factory}"]
        + ["--batch-sizes", "2", "--precision", "32-true", "--out", str(out)]
    )
    captured = capsys.readouterr()
    assert code == 2 and message in " ".join(captured.err.split())
    assert "reproduce:" not in captured.out and not out.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "resnet"], "unknown model 'resnet'"),
        (["--model", "nope.py:make"], "no such file: nope.py"),
        (["--precision", "fp16"], "unknown precision 'fp16'"),
        (["--precision", "p=f32,c=float8_e4m3fn,o=f32"], "float8"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--image-size", "4"], "--image-size must be >= 8"),
        (["--model", "mlp", "--image-size", "64"], "--image-size applies to --model cnn"),
        (["--model", "mixprec.bench.models:BlogCNN"], "needs --batch-sizes"),
        (["--tf32", "on", "--device", "cpu"], "--tf32 applies to CUDA"),
        (["--max-batch", "--device", "cpu"], "needs --memory-limit"),
        (["--device", "mps"], "runs on cpu or cuda"),
    ],
)
def test_bad_options_give_clear_errors(args, message, capsys, tmp_path):
    assert main(["bench", *args, "--out", str(tmp_path / "never")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-sizes", "0"], "batch sizes must be positive integers"),
        (["--batch-sizes", "8,x"], "batch sizes must be positive integers"),
        (["--memory-limit", "lots"], "is not a size"),
        (["--tf32", "maybe"], "choose from 'on', 'off', 'both'"),
        (["--preset", "imagenet"], "choose from 'blog'"),
    ],
)
def test_malformed_options_are_argparse_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_batch_sizes_are_split_at_commas_and_spaces_as_the_error_says():
    """'8 16' quoted as one argument was refused although the message asks for 'space- or
    comma-separated' sizes."""
    args = build_parser().parse_args(["bench", "--batch-sizes", "8 16", "32,64", " 4 "])
    assert args.batch_sizes == [[8, 16], [32, 64], [4]]


def test_far_slower_precisions_need_allow_slow():
    opts = BenchOptions(precisions=["32-true", "16-mixed"], device="cpu")
    with hardware.assume(ZEN4):  # bf16 hardware, no float16 hardware
        with pytest.raises(ValueError, match="--allow-slow"):
            plan(opts)
        opts.allow_slow = True
        assert plan(opts).support["16-mixed"].startswith("slow")


def test_plan_of_the_blog_preset_and_islands_both():
    p = plan(
        BenchOptions(
            preset="blog", precisions=["32-true", "bf16"], float32_islands="both", allow_slow=True
        )
    )
    o = p.options
    assert (o.image_size, o.batch_sizes, o.steps, o.warmup) == (256, [32, 64, 128, 256, 512], 10, 3)
    labels = [c.label for c in p.configs if c.batch_size == 32]
    assert labels == ["32-true", "bf16-mixed", "bf16-mixed (no f32 islands)"]
    assert [c.raw for c in p.configs[:3]] == [False, True, True]
    assert "--precision 32-true bf16-mixed" in p.command
    assert "--float32-islands both" in p.command


def test_max_batch_search_finds_the_boundary(tmp_path):
    # 64x64 blog CNN, a step with Adam's state alive: ~26 MiB at batch 8, ~36 MiB at 16
    code = main(
        [
            "bench",
            *("--image-size", "64", "--batch-sizes", "8", "--precision", "32-true"),
            *("--steps", "1", "--memory-limit", "33M", "--max-batch"),
            *TINY,
            *("--out", str(tmp_path)),
        ]
    )
    assert code == 0
    found = json.loads((tmp_path / "results.json").read_text())["max_batch"]["32-true"]
    probes = {p["batch_size"]: p for p in found["probes"]}
    best, first_oom = found["max_batch"], found["first_oom"]
    assert 1 <= best and first_oom == best + 1
    assert probes[best]["fits"] and probes[best]["peak_memory"] <= 33 * 2**20
    assert not probes[first_oom]["fits"] and probes[first_oom]["peak_memory"] > 33 * 2**20
    # doubling from the smallest batch size until the first OOM, then bisection
    sizes = [p["batch_size"] for p in found["probes"]]
    assert sizes[:3] == [8, 16, 12] and 8 < best < 16
    assert (
        f"32-true: {best} fits, {first_oom} runs out of memory"
        in (tmp_path / "report.md").read_text()
    )


def test_a_failing_max_batch_probe_is_recorded_and_every_result_is_written(
    tmp_path, factory_dir, capsys
):
    # before: the failed probe raised RuntimeError and no output was written
    code, results, rows, md = _bench(
        tmp_path,
        *("--model", f"{factory_dir / 'benchfactory.py'}:small_only", "--batch-sizes", "2"),
        *("--precision", "32-true", "--steps", "1", "--memory-limit", "1GiB", "--max-batch"),
        *TINY,
    )
    assert code == 1  # the search could not finish
    assert [r["status"] for r in rows] == [OK]  # the timed row is kept
    found = results["max_batch"]["32-true"]
    assert (found["max_batch"], found["first_oom"], found["capped"]) == (4, None, False)
    assert [(p["batch_size"], p["status"]) for p in found["probes"]] == [
        (2, OK),
        (4, OK),
        (8, "error"),
    ]
    assert found["error"].startswith("batch 8: error: ")
    assert "ValueError: this data set has 4 samples, asked for 8" in found["error"]
    line = "32-true: search stopped at batch 8: error: "
    assert line in md and "(the largest that fitted before it: 4)" in md
    printed = " ".join(capsys.readouterr().out.split())
    assert line in printed and "the largest that fitted before it: 4" in printed
    assert (tmp_path / "out" / "bench.png").is_file()


def test_a_failing_configuration_is_a_recorded_row_and_the_others_are_written(
    tmp_path, factory_dir, capsys
):
    code, results, rows, md = _bench(
        tmp_path,
        *("--model", f"{factory_dir / 'benchfactory.py'}:no_bf16", "--batch-sizes", "2"),
        *("--precision", "32-true", "bf16-mixed", "--allow-slow", "--steps", "1"),
        *TINY,
    )
    assert code == 1
    assert [(r["precision"], r["status"]) for r in rows] == [
        ("32-true", OK),
        ("bf16-mixed", "error"),
    ]
    failed = results["results"][1]["result"]
    assert failed["error"] == "RuntimeError: this layer refuses bfloat16"
    assert "this layer refuses bfloat16" in md
    assert "bf16-mixed @ 2: error RuntimeError: this layer refuses bfloat16" in " ".join(
        capsys.readouterr().err.split()
    )
    assert (tmp_path / "out" / "bench.png").is_file()


def test_a_failing_raw_twin_is_printed_and_fails_the_run(
    tmp_path, factory_dir, capsys, monkeypatch
):
    """A raw torch.autocast twin that failed where mixprec's loop ran was named in report.md
    alone: nothing on the terminal, and exit status 0."""
    from mixprec.bench import runner

    def failing(spec, device):
        raise RuntimeError("the twin refuses")

    monkeypatch.setattr(runner, "_build_raw", failing)
    code, results, rows, md = _bench(
        tmp_path,
        *("--model", f"{factory_dir / 'benchfactory.py'}:make", "--batch-sizes", "2"),
        *("--precision", "32-true", "bf16-mixed", "--allow-slow", "--steps", "1"),
        *TINY,
    )
    assert code == 1
    assert [(r["precision"], r["status"]) for r in rows] == [("32-true", OK), ("bf16-mixed", OK)]
    assert results["results"][1]["result"]["raw"]["status"] == "error"
    assert "twin of bf16-mixed at batch 2: error (RuntimeError: the twin refuses)" in md
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "bf16-mixed @ 2, its raw torch.autocast twin: error (RuntimeError: the twin refuses); "
        "mixprec's loop ran (its row above)"
    ) in err


def test_repeated_batch_sizes_add_up_and_a_preset_and_timeout_are_reproduced():
    from mixprec.cli import build_parser
    from mixprec.cli.bench import _options

    args = build_parser().parse_args(["bench", "--batch-sizes", "2", "--batch-sizes", "8,4"])
    assert _options(args).batch_sizes == [2, 8, 4]
    p = plan(BenchOptions(preset="blog", precisions=["32-true"], device="cpu", timeout=6.0))
    assert p.command.startswith("mixprec bench --model cnn --preset blog --image-size 256 ")
    assert p.command.endswith(" --timeout 6")


def test_the_recorded_timing_says_how_the_steps_were_taken():
    """A --memory-limit (or --compile) run times each configuration in a fresh process of
    its own, one after another, but its report said they took paired rounds in one."""
    from mixprec.bench.suite import metadata, times_paired

    def timing(**options) -> str:
        with hardware.assume(ZEN4):
            p = plan(BenchOptions(precisions=["32-true"], batch_sizes=[2], device="cpu", **options))
            # (what the terminal's busy-machine warning is told)
            assert times_paired(p) is not bool(options)
            return metadata(p)["timing"]

    assert "take one step each per round in one process" in timing()
    fresh = timing(memory_limit=2**34)
    assert "each configuration in a fresh process of its own, one after another (a memory " in fresh
    assert "unpaired" in fresh and "per round" not in fresh and "paired ratios" not in fresh
    # (step i of one run over step i of the other is no paired ratio: the medians' ratio)
    assert "float32's step i" not in fresh and "ratio of float32's median to the other's" in fresh


def test_the_comparison_gap_measures_matmul_rates_on_one_thread(monkeypatch):
    """Measured on the run's threads, float32's multiply waited for threads on cores other
    work held, and an AVX2 CPU under load printed bfloat16 as 18x faster than float32;
    `hardware.gemm_ratio` measures on one thread."""
    from mixprec.bench import suite

    seen = []

    class Measured(Exception):
        pass

    def measure_rates(**kwargs):
        seen.append(torch.get_num_threads())
        raise Measured

    monkeypatch.setattr(suite, "measure_rates", measure_rates)
    before = torch.get_num_threads()
    with hardware.assume(ZEN4):
        p = plan(BenchOptions(precisions=["32-true"], batch_sizes=[2], device="cpu", threads=2))
    with pytest.raises(Measured):  # (the host, as run: described, nothing is measured)
        suite.comparison_gap(p)
    assert seen == [1] and torch.get_num_threads() == before


def test_a_described_cpu_gets_no_matmul_rates_measured_on_the_host(monkeypatch):
    """Under `assume(AVX2_CPU)` the gap recorded the host's rates (bfloat16 2.0x float32 on
    this Zen 4) beside "bf16-mixed, slow here (... emulated)" and printed them on an idle
    host: rates of another machine. A described device measures none."""
    from mixprec.bench import suite
    from mixprec.bench.report import comparison_gap_lines

    monkeypatch.setattr(suite, "measure_rates", lambda **kwargs: pytest.fail("measured"))
    with hardware.assume(AVX2_CPU):
        p = plan(BenchOptions(batch_sizes=[2], device="cpu", threads=1))
        meta = suite.metadata(p)
        meta["comparison_gap"] = gap = suite.comparison_gap(p)
    assert gap["matmul_gflops"] == {} and gap["matmul_doubts"] == []
    assert "bf16-mixed" in gap["left_out"]
    lines = comparison_gap_lines(BenchReport(meta, []), [])
    assert not any("matmul rates" in line for line in lines)


def test_a_described_device_is_said_as_described_and_the_step_times_as_the_hosts():
    """Found by a review: under `assume(...)` (an AMX Xeon described on an AVX2 host) report.md
    named the described CPU as the machine that timed ("device: cpu (Intel ...; amx_bf16,
    ...)"), nothing said it was described, and the sentence closed "On this machine
    bf16-mixed runs ... at 0.03x ...: train in float32 here", the host's step times charged
    to it; the reproduce line lacked --allow-slow, so on the host it was refused."""
    from mixprec.bench import suite

    options = BenchOptions(
        model="mlp", precisions=["32-true", "bf16-mixed"], batch_sizes=[2], threads=1, steps=6
    )
    with hardware.assume(AMX_CPU):
        p = plan(replace(options, device="cpu"))
        meta = suite.metadata(p)
    described = (
        "cpu (Intel Xeon (Sapphire Rapids); amx_bf16, amx_int8, avx512_bf16, avx512_fp16, "
        "avx512_vnni, avx512bw; 1 thread)"
    )
    assert meta["described_device"] == described
    host = meta["device"]
    assert host.startswith("cpu (") and "Sapphire Rapids" not in host, host
    # (the ratings are the description's: what was run, and why)
    assert meta["support"]["bf16-mixed"] == "fast" and meta["auto_precision"] == "bf16-mixed"
    assert p.command.endswith("--allow-slow"), p.command  # (the host may rate it slow)

    def ok(ms: list[float]) -> RunResult:
        return RunResult(OK, LoopResult(step_ms=ms, peak_memory=100), paired=True)

    rows = [
        Row(Config("32-true", "32-true", 2, None, False), ok([100.0] * 6)),
        Row(Config("bf16-mixed", "bf16-mixed", 2, None, True), ok([3000.0] * 6)),
    ]
    report = BenchReport({**_report([]).metadata, **meta, "memory_method": "m"}, rows)
    md = markdown(report, summarize(report))
    assert f"- device: {host}, the host that took every step time\n" in md, md
    assert (
        f"- described device: {described} (mixprec.device.assume): support and auto_precision "
        "are rated for it, not for the host; the step times are the host's, not its\n"
    ) in md, md
    sentence = conclusion(report, summarize(report))
    assert "at 0.033x the speed of float32" in sentence and "train in float32" not in sentence
    assert sentence.endswith(
        "The device was described (mixprec.device.assume): these are this host's step times, "
        "which say nothing of the described device's speed; time it there before choosing."
    ), sentence
    plain = BenchReport({**report.metadata, "described_device": None}, rows)
    assert "train in float32 here" in conclusion(plain, summarize(plain))
    assert (
        "--allow-slow" not in plan(replace(options, device="cpu", precisions=["32-true"])).command
    )


def test_doubted_matmul_rates_are_not_printed():
    """float32 0.3 GFLOP/s and "bfloat16 3.5 (10.9x float32)" were printed beside the
    doubts, where only the time estimate was dropped."""
    from mixprec.bench.report import comparison_gap_lines

    gap = {
        "asked": True,
        "timed": ["float32"],
        "left_out": {},
        "matmul_gflops": {"float32": 0.3, "bfloat16": 3.5},
        "matmul_doubts": [
            "the rounds disagreed by more than 1.5x (float32 0.1-157.6 GFLOP/s)",
            "the paired rounds' ratios against float32 spread wider than 1.25x (quartiles: "
            "bfloat16 2.52x-19.1x)",
            "bfloat16, slow on this hardware, measured 10.9x faster than float32 (float32's "
            "own rounds were slowed)",
        ],
        "command": None,
    }
    meta = {"precisions": ["32-true"], "comparison_gap": gap, "steps": 1, "warmup": 0}
    flat = " ".join(comparison_gap_lines(BenchReport(meta, []), []))
    for figure in ("0.3", "3.5", "10.9x", "GFLOP/s", "19.1x", "157.6"):
        assert figure not in flat, (figure, flat)
    assert "the rounds disagreed by more than 1.5x;" in flat
    assert "measured faster than float32 (float32's own rounds were slowed)" in flat


def test_the_metadata_records_what_the_pre_run_checks_found(monkeypatch):
    """The conclusion's busy-machine caveat read os.cpu_count() when the report was made and
    guessed other work from load averages; the run now records its core count, the busy
    cores the pre-run check sampled, and whether the warning was due: by those busy cores,
    sampled with --threads given too (the warning read the load average there, a minute
    behind: a run started just after another, on a machine now idle, warned of it)."""
    from mixprec.bench import suite

    monkeypatch.setattr(suite, "busy_cores", lambda: 1.3)
    monkeypatch.setattr(suite, "_load_average", lambda: [9.0, 9.0, 9.0])
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with hardware.assume(ZEN4):
        sampled = suite.metadata(plan(BenchOptions(precisions=["32-true"], batch_sizes=[2])))
        given = suite.metadata(
            plan(BenchOptions(precisions=["32-true"], batch_sizes=[2], threads=1))
        )
    assert sampled["cores"] == 2 and sampled["busy_cores_before"] == 1.3
    assert given["busy_cores_before"] == 1.3  # (--threads given: sampled all the same)
    assert sampled["threads"] == 1 and sampled["busy_warning"] is False  # (one core free)
    assert given["busy_warning"] is False  # (one core free for its one thread; load 9 aside)
    monkeypatch.setattr(suite, "busy_cores", lambda: 1.9)
    with hardware.assume(ZEN4):
        busy = suite.metadata(
            plan(BenchOptions(precisions=["32-true"], batch_sizes=[2], threads=1))
        )
    assert busy["busy_warning"] is True  # (no core free)


def test_a_float64_only_run_says_float64_was_timed():
    from mixprec.bench.report import comparison_gap_lines
    from mixprec.bench.suite import comparison_gap, metadata

    with hardware.assume(ZEN4):
        p = plan(BenchOptions(precisions=["64-true"], batch_sizes=[2], device="cpu", threads=1))
        meta = metadata(p)
        meta["comparison_gap"] = comparison_gap(p)
    assert meta["comparison_gap"]["timed"] == ["float64"]
    gap = comparison_gap_lines(BenchReport(meta, []), [])
    assert gap[0] == "timed: only 64-true was asked for (--precision), so only float64 was timed"


def _report(rows: list[Row]) -> BenchReport:
    meta = {
        "model": "cnn",
        "device": "cpu (test)",
        "torch_version": torch.__version__,
        "mixprec_version": "0",
        "started": "now",
        "command": "mixprec bench",
        "timing": "t",
        "steps": 3,
        "warmup": 1,
        "threads": 1,
        "memory_method": "m",
        "support": {"32-true": "fast", "bf16-mixed": "fast"},
    }
    return BenchReport(meta, rows)


def test_the_outputs_are_written_whole(tmp_path, monkeypatch):
    """results.json and report.md were written with write_text, results.csv line by line
    and bench.png by matplotlib straight to its path: a run stopped while writing (or a
    reader) found half a file, or the last run's results half overwritten."""
    from matplotlib.figure import Figure

    from mixprec.bench.report import OUTPUT_FILES, write_outputs

    def ok(ms):
        return RunResult(OK, LoopResult(step_ms=ms, peak_memory=100), paired=True)

    rows = [
        Row(Config("32-true", "32-true", 8, None, False), ok([40.0, 10.0, 30.0])),
        Row(Config("bf16-mixed", "bf16-mixed", 8, None, True), ok([20.0, 5.0, 15.0])),
    ]
    savefig, opened = Figure.savefig, Path.open

    def to_memory_only(self, where, *args, **kwargs):
        assert not isinstance(where, str | Path), f"{where} written by savefig in place"
        return savefig(self, where, *args, **kwargs)

    def read_only(self, mode="r", *args, **kwargs):
        assert "w" not in mode, f"{self} opened to write in place"
        return opened(self, mode, *args, **kwargs)

    def not_whole(self, *args, **kwargs):
        raise AssertionError(f"{self} written with write_text, not whole")

    monkeypatch.setattr(Figure, "savefig", to_memory_only)
    monkeypatch.setattr(Path, "open", read_only)
    monkeypatch.setattr(Path, "write_text", not_whole)
    paths = write_outputs(tmp_path / "out", _report(rows))
    assert [p.name for p in paths] == list(OUTPUT_FILES)
    assert json.loads(paths[0].read_text())
    assert paths[1].read_text().startswith("batch_size,") or "," in paths[1].read_text()
    assert paths[2].read_text().startswith("# mixprec bench")
    assert paths[3].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summaries_speedup_overhead_and_oom_rows():
    def ok(ms, raw_ms=None, peak=100, paired=True):
        raw = LoopResult(step_ms=raw_ms, peak_memory=peak) if raw_ms else None
        return RunResult(OK, LoopResult(step_ms=ms, peak_memory=peak), raw, paired=paired)

    rows = [
        Row(Config("32-true", "32-true", 8, None, False), ok([40.0, 10.0, 30.0])),
        Row(
            Config("bf16-mixed", "bf16-mixed", 8, None, True),
            ok([20.0, 5.0, 99.0], [16.0, 50.0, 4.0]),
        ),
        Row(Config("32-true", "32-true", 16, None, False), RunResult(OOM, LoopResult(OOM, "x"))),
        Row(Config("bf16-mixed", "bf16-mixed", 16, None, True), ok([20.0], [16.0])),
    ]
    s = summarize(_report(rows))
    assert (s[0].median_ms, s[0].min_ms, s[0].max_ms, s[0].speedup) == (30.0, 10.0, 40.0, 1.0)
    assert s[0].samples_per_s == pytest.approx(8 / 0.030)
    # the median of the rounds' ratios (40/20, 10/5, 30/99), not a ratio of medians (30/20):
    # the round that was slow for bf16 alone does not move it
    assert s[1].speedup == pytest.approx(2.0)
    assert (s[1].speedup_low, s[1].speedup_high, s[1].rounds) == (pytest.approx(30 / 99), 2.0, 3)
    assert s[1].paired  # the rows were timed side by side
    assert s[1].overhead == pytest.approx(20.0 / 16.0 - 1)  # median of 20/16, 5/50, 99/4
    assert s[2].status == OOM and s[2].median_ms is None
    assert s[3].speedup is None  # no float32 result at batch 16 to compare with
    assert s[3].overhead == pytest.approx(0.25)
    md = markdown(_report(rows), s)
    # (3 rounds: the interval is the lowest and highest ratio, and says how few they are)
    row = "| 8 | bf16-mixed | 20.0 | 5.0-99.0 | 400.0 | 2.00x (0.30-2.00, 3 rounds) | 0.0 MiB |"
    # (the overhead with its interval: a median alone read as a finding on a busy machine)
    assert row + " 16.0 | +25.0% (-90.0 to +2375.0, 3 rounds) |" in md
    one = [
        Row(r.config, replace(r.result, mixprec=replace(r.result.mixprec, step_ms=[ms])))
        for r, ms in zip(rows[:2], (40.0, 20.0), strict=True)
    ]
    assert "| 2.00x (1 round) |" in markdown(_report(one), summarize(_report(one)))
    assert "| 16 | 32-true | OOM | - | - | - | - | - | - |" in md
    # rows run apart (each in a process of its own) share no rounds: the ratio of their
    # medians (30/20), with no interval (it paired step i of one run with step i of the other)
    apart = [Row(r.config, replace(r.result, paired=False)) for r in rows]
    s = summarize(_report(apart))
    assert not s[1].paired and s[1].speedup == pytest.approx(1.5)
    assert (s[1].speedup_low, s[1].speedup_high, s[1].rounds) == (None, None, None)
    assert "| 1.50x (medians) |" in markdown(_report(apart), s)


def test_blog_preset_report_shows_the_blogs_v100_numbers():
    report = _report(
        [
            Row(
                Config("32-true", "32-true", 128, False, False),
                RunResult(OK, LoopResult(step_ms=[50.0])),
            )
        ]
    )
    report.metadata["preset"] = "blog"
    md = markdown(report, summarize(report))
    assert "| 128 | 97 | 106 | 1.09x |" in md and "| 512 | 377 | 415 | 1.10x |" in md


def test_busy_machine_warning():
    cores = os.cpu_count() or 1
    assert busy_machine_warning([0.0, 0.0, 0.0], cores, "cpu") is None
    one = busy_machine_warning([cores + 1.0, 0.0, 0.0], 1, "cpu")
    assert "other work was using the CPUs" in one and "paired rounds" in one
    # at one thread there are no fewer threads to advise
    assert one.endswith("rerun on a quieter machine") and "--threads" not in one
    two = busy_machine_warning([cores + 1.0, 0.0, 0.0], 2, "cpu")
    assert two.endswith("rerun on a quieter machine or with --threads 1")
    assert busy_machine_warning([cores + 1.0, 0.0, 0.0], 1, "cuda") is None


def test_set_tf32_keeps_the_legacy_and_new_flags_in_agreement():
    """torch 2.9+ raises on reading matmul precision or `allow_tf32` once the new per-op
    flags were set alone ("mix of the legacy and new APIs"); torch.compile reads them."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for enabled in (True, False):
            set_tf32(enabled)
            assert torch.get_float32_matmul_precision() == ("high" if enabled else "highest")
            assert torch.backends.cuda.matmul.allow_tf32 is enabled
            assert torch.backends.cudnn.allow_tf32 is enabled
            if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
                assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if enabled else "ieee")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_parse_size():
    assert parse_size("1000") == 1000
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("512M") == 512 * 2**20
    assert parse_size("1.5k") == 1536
    assert parse_size("0.5G") == 2**29
    # as the doctor's and the search's sizes: "MB" is 10^6 bytes ("128MB" read 128 MiB here)
    assert parse_size("128MB") == 128 * 10**6 and parse_size("2 GB") == 2 * 10**9
    assert parse_size("128MiB") == 128 * 2**20 and parse_size("100b") == 100
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size("5 parsecs")
    for tiny in ("0.5", "0", "0k"):  # '0.5' was read as 0 bytes, then refused as 'got 0'
        with pytest.raises(argparse.ArgumentTypeError, match="less than one byte"):
            parse_size(tiny)
    assert parse_size("4.1MB") == 4_100_000  # (a float product was a byte short)
    with pytest.raises(argparse.ArgumentTypeError, match="larger than any machine's memory"):
        parse_size("9000000T")  # (each row failed with an OverflowError in setrlimit)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rows_say_tf32_and_measure_device_memory(tmp_path):
    code, results, _, md = _bench(
        tmp_path,
        *("--device", "cuda", "--image-size", "32", "--batch-sizes", "4"),
        *("--precision", "32-true", "16-mixed", "--tf32", "both", "--steps", "2"),
        *TINY,
    )
    assert code == 0
    labels = [e["config"]["label"] for e in results["results"]]
    assert labels == ["32-true (TF32 off)", "32-true (TF32 on)", "16-mixed"]
    for e in results["results"]:
        assert e["result"]["status"] == OK and e["result"]["mixprec"]["peak_memory"] > 0
    assert "max_memory_allocated" in results["metadata"]["memory_method"]
    assert "32-true (TF32 on)" in md


@pytest.mark.parametrize(
    "message",
    [
        "CUDA out of memory. Tried to allocate 2.00 GiB",
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    ],
)
def test_out_of_memory_in_any_library_words_counts_as_oom(message):
    from mixprec.bench.runner import is_oom

    assert is_oom(RuntimeError(message))
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_the_default_thread_count_leaves_cores_other_work_keeps_busy(monkeypatch):
    """Threads that share a core with other work wait for each other at every op, which
    lowers a speed-up measured on them: without --threads the run takes the free cores,
    says so, and writes the count into the reproduce command; --threads is obeyed."""
    import os

    from mixprec.bench import suite

    cores = os.cpu_count() or 1
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(suite, "busy_cores", lambda: cores - 1.0)
        busy = plan(BenchOptions(precisions=["32-true"], batch_sizes=[2], device="cpu"))
        asked = plan(BenchOptions(precisions=["32-true"], batch_sizes=[2], device="cpu", threads=2))
        monkeypatch.setattr(suite, "busy_cores", lambda: 0.0)
        quiet = plan(BenchOptions(precisions=["32-true"], batch_sizes=[2], device="cpu"))
    finally:
        torch.set_num_threads(before)
    assert busy.options.threads == 1 and "--threads 1" in busy.command
    assert f"other work kept {cores - 1.0:.1f} of {cores} cores busy" in busy.threads_note
    assert asked.options.threads == 2 and asked.threads_note is None
    if cores >= 2:  # two free cores: torch's default
        assert quiet.options.threads == 2 and quiet.threads_note is None


@pytest.mark.parametrize(
    ("start", "fits_below", "probed", "found"),
    [
        (70000, 10**9, [70000], (70000, None, True)),  # a start above the cap is probed
        (70000, 70000, [70000, 35000], (69999, 70000, False)),  # then bisected
        (
            3,
            10**9,
            [3, 6, 12, 24, 48, 96, 192, 384, 768, 1536, 3072, 6144, 12288, 24576, 49152, 65536],
            (65536, None, True),
        ),  # the cap itself is probed
    ],
)
def test_the_max_batch_search_probes_its_start_and_its_cap(
    monkeypatch, start, fits_below, probed, found
):
    # before: a smallest batch size above the cap probed nothing and printed ">= 0", and a
    # start that is no power of two stopped doubling at up to half the cap
    from types import SimpleNamespace

    from mixprec.bench import suite
    from mixprec.bench.runner import OOM

    calls = []

    def probe(plan, name, batch, workdir, activations):
        calls.append(batch)
        status = OK if batch < fits_below else OOM
        return SimpleNamespace(status=status, error=None, mixprec=SimpleNamespace(peak_memory=1))

    monkeypatch.setattr(suite, "_probe", probe)
    plan = SimpleNamespace(options=SimpleNamespace(batch_sizes=[start]))
    result = suite.search_max_batch(plan, "bf16-mixed", None)
    assert calls[: len(probed)] == probed
    assert (result["max_batch"], result["first_oom"], result["capped"]) == found


def test_float32_islands_without_a_mixed_precision_is_refused():
    """Before: accepted and dropped silently (no row changes: islands are a mixed
    policy's), its flag kept in the reproduce line."""
    with hardware.assume(ZEN4):  # (bfloat16 fast: nothing else refused)
        with pytest.raises(ValueError, match="--float32-islands off changes the rows of mixed"):
            plan(
                BenchOptions(
                    precisions=["32-true", "bf16-true"], float32_islands="off", batch_sizes=[2]
                )
            )
        options = BenchOptions(precisions=["bf16-mixed"], float32_islands="off", batch_sizes=[2])
        assert plan(options).configs


def test_a_float64_only_run_does_not_say_float32_ran():
    rows = [
        Row(
            Config("64-true", "64-true", 8, None, False),
            RunResult(OK, LoopResult(step_ms=[3.0] * 10, peak_memory=100), paired=True),
        )
    ]
    gap = {"asked": True, "left_out": {"bf16-mixed": {"status": "fast"}}}
    meta = {"model": "cnn", "precisions": ["64-true"], "comparison_gap": gap}
    sentence = conclusion(BenchReport(meta, rows), summarize(BenchReport(meta, rows)))
    assert sentence.startswith("Only 64-true was asked for, so no mixed precision ran to compare")


def test_a_slow_precision_the_environment_allowed_is_reproduced_with_the_flag(monkeypatch):
    """MIXPREC_ALLOW_SLOW=1 ran bf16-mixed on a CPU without fast bf16, and the reproduce
    line left --allow-slow out: run in a shell without the variable, it was refused."""
    monkeypatch.setenv(ALLOW_SLOW_ENV, "1")
    options = BenchOptions(batch_sizes=[2], precisions=["32-true", "bf16-mixed"], threads=1)
    with hardware.assume(AVX2_CPU):
        p = plan(options)
        assert "--allow-slow" in p.command.split()
        monkeypatch.delenv(ALLOW_SLOW_ENV)
        fast_only = plan(replace(options, precisions=["32-true"]))
    assert "--allow-slow" not in fast_only.command.split()


def test_a_quantized_row_has_no_raw_twin_and_the_report_says_why():
    """Found by a review: float8_from_bf16-mixed got a raw "twin" that was a plain bfloat16
    autocast loop without float8 (autocast cannot quantize), so its "mixprec overhead"
    (+67%) measured the quantization, not mixprec. Such a row has no twin, as a policy
    file's has none, and the report says why its overhead is empty."""
    names = ["32-true", "float8_from_bf16-mixed", "bf16-mixed"]
    options = BenchOptions(
        model="mlp", batch_sizes=[2], precisions=names, threads=1, allow_slow=True, steps=1
    )
    with hardware.assume(AVX2_CPU):
        p = plan(options)
    assert [(c.label, c.raw) for c in p.configs] == [
        ("32-true", False),
        ("float8_from_mixed_bfloat16", False),
        ("bf16-mixed", True),
    ]
    loop = LoopResult(step_ms=[2.0] * 6, peak_memory=100)
    rows = [
        Row(c, RunResult(OK, loop, raw=loop if c.raw else None, paired=True)) for c in p.configs
    ]
    report = _report(rows)
    from mixprec.bench.report import notes

    lines = notes(report, summarize(report))
    why = next(line for line in lines if line.startswith("mixprec overhead: none for"))
    assert why.startswith("mixprec overhead: none for float8_from_mixed_bfloat16: it quantizes")
    assert "bf16-mixed," not in why  # (its twin ran)
    overhead = next(line for line in lines if line.startswith("mixprec overhead: the median"))
    assert overhead.endswith(
        "empty where a row has no raw twin: policy files, activation options other than "
        "keep, quantized precisions"
    )


def test_a_presets_steps_leave_the_default_time_budget():
    """Found by a review: --preset blog set the time budget to 0, as if --steps had been
    typed, because its `steps: 10` was merged before the budget's default was chosen; the
    help says the budget is 30 s unless --steps is given."""
    options = BenchOptions(preset="blog", precisions=["32-true"], device="cpu", threads=1)
    p = plan(options)
    assert (p.options.steps, p.options.time_budget) == (10, 30.0)
    assert "--steps 10 --time-budget 30 --warmup 3" in p.command
    typed = plan(replace(options, steps=10))
    assert (typed.options.steps, typed.options.time_budget) == (10, 0.0)


def test_a_memory_limit_given_as_a_float_is_whole_bytes_or_refused():
    """Found by a review: `memory_limit=1.5 * 2**30` passed `plan`, every row then failed
    with a TypeError and the reproduce command read `--memory-limit 1536.0MiB`. An integral
    float is taken as its int; a fraction of a byte is refused by `plan`."""
    options = BenchOptions(model="mlp", batch_sizes=[2], precisions=["32-true"], threads=1, steps=1)
    p = plan(replace(options, memory_limit=1.5 * 2**30))
    assert p.options.memory_limit == 1610612736 and type(p.options.memory_limit) is int
    assert "--memory-limit 1536MiB" in p.command
    with pytest.raises(ValueError, match="--memory-limit must be a whole number of bytes"):
        plan(replace(options, memory_limit=1000.5))


def test_a_memory_limit_is_shown_as_typed_or_in_the_unit_that_divides_it():
    """Found by a review: ``--memory-limit 2GB`` was shown as "1953125KiB" in the reproduce
    line and the notes (binary units were tried before decimal ones), where docs/bench.md says
    they give the limit as typed. A limit given as text is shown as typed; a number of bytes,
    in the unit that divides it with the fewest digits."""
    from mixprec.bench.report import notes
    from mixprec.bench.suite import metadata, size_text

    for typed in ("2GB", "128MB", "256MB", "500MB", "64MiB", "2GiB", "1000KiB", "1536MiB"):
        assert size_text(parse_size(typed)) == typed
    assert size_text(1500) == "1500" and size_text(1_000_000_000_000) == "1TB"
    options = BenchOptions(model="mlp", batch_sizes=[2], precisions=["32-true"], threads=1, steps=1)
    p = plan(replace(options, memory_limit="1.5GiB"))
    assert p.options.memory_limit == 1610612736 and type(p.options.memory_limit) is int
    assert p.command.endswith("--memory-limit 1.5GiB"), p.command
    meta = dict(metadata(p), memory_method="m", memory_limit_text="1.5GiB")
    assert metadata(p)["memory_limit_text"] == "1.5GiB"
    said = notes(BenchReport(meta, []), [])
    assert "memory limit: 1.5GiB per loop (OOM above it)" in said, said
    with pytest.raises(ValueError, match="--memory-limit: not a size: '5 parsecs'"):
        plan(replace(options, memory_limit="5 parsecs"))


def test_auto_asked_for_is_said_as_asked_and_what_it_resolved_to():
    """Found by a review: `--precision auto` resolved to 32-true on a CPU without fast 16-bit,
    and the report said "Only 32-true was asked for (--precision)", which the user had not
    typed. It says auto was asked for, what it resolved to here, and why."""
    from mixprec.bench.report import comparison_gap_lines
    from mixprec.bench.suite import comparison_gap, metadata

    options = BenchOptions(model="mlp", batch_sizes=[2], precisions=["auto"], threads=1, steps=1)
    with hardware.assume(AVX2_CPU):  # (described: no rates are measured)
        p = plan(options)
        meta = dict(metadata(p), comparison_gap=comparison_gap(p), memory_method="m")
    assert p.options.precisions == ["32-true"]
    assert (meta["comparison_gap"]["given"], meta["comparison_gap"]["auto"]) == (
        ["auto"],
        "32-true",
    )
    (config,) = p.configs
    loop = LoopResult(step_ms=[2.0] * 6, peak_memory=100)
    report = BenchReport(meta, [Row(config, RunResult(OK, loop, paired=True))])
    summaries = summarize(report)
    resolved = (
        "auto resolved to 32-true on this device (auto picks bf16-mixed or 16-mixed only "
        "where it is fast, and neither is here)"
    )
    lines = comparison_gap_lines(report, summaries)
    assert lines[0] == (
        f"timed: only auto was asked for (--precision); {resolved}, so only float32 was timed"
    )
    assert conclusion(report, summaries).startswith(
        f"Only auto was asked for; {resolved}, so no mixed precision ran beside float32"
    )


def test_precisions_asked_for_as_dtypes_or_ints_are_said_by_their_names():
    """Found by a review: the precisions as asked for were kept as given, so
    `precisions=[torch.float32]` failed writing the journal (a dtype is not JSON) and `[32]`
    failed joining the report's "only ... asked for"; `"AUTO "` was echoed as typed and a
    repeated one twice. They are kept by their names ("auto" as such), once each."""
    from mixprec.bench.report import comparison_gap_lines
    from mixprec.bench.suite import comparison_gap, metadata

    asked = [32, torch.float32, "AUTO ", "32-true"]
    options = BenchOptions(model="mlp", batch_sizes=[2], precisions=asked, threads=1, steps=1)
    with hardware.assume(AVX2_CPU):
        p = plan(options)
        meta = dict(metadata(p), comparison_gap=comparison_gap(p), memory_method="m")
    assert p.given == ["32-true", "auto"] and meta["comparison_gap"]["given"] == p.given
    meta = json.loads(json.dumps(meta))  # (as the journal writes it)
    (config,) = p.configs
    loop = LoopResult(step_ms=[2.0] * 6, peak_memory=100)
    report = BenchReport(meta, [Row(config, RunResult(OK, loop, paired=True))])
    lines = comparison_gap_lines(report, summarize(report))
    assert lines[0].startswith(
        "timed: only 32-true, auto were asked for (--precision); auto resolved to 32-true"
    )


def test_a_memory_limit_of_any_integral_number_is_kept_as_a_plain_int():
    """Found by a review: `memory_limit=numpy.int64(2**30)` was refused ("must be a whole
    number of bytes") while `numpy.float64(2.0**30)` was taken. Any integral number is taken,
    kept as a plain int (the journal writes it as JSON); a bool is no number of bytes."""
    import numpy as np

    options = BenchOptions(model="mlp", batch_sizes=[2], precisions=["32-true"], threads=1, steps=1)
    for limit in (np.int64(2**30), np.float64(2.0**30), np.int32(2**30)):
        p = plan(replace(options, memory_limit=limit))
        assert type(p.options.memory_limit) is int and p.options.memory_limit == 2**30
        assert json.dumps(p.options.memory_limit) == "1073741824"
    with pytest.raises(ValueError, match="--memory-limit must be a whole number of bytes"):
        plan(replace(options, memory_limit=True))


def test_the_quantized_rows_note_names_only_rows_that_lost_a_twin_and_only_beside_overheads():
    """Found by a review: the note on quantized rows without a raw twin joined labels that
    hold commas with commas ("float8_..., activations keep, float8_..., activations bf16"),
    named rows that never had a twin (float8_from_32-true is not mixed; an activation option
    other than keep has none) and was printed where no overhead column was shown. It names
    only rows that lost their twin to quantization, "; " between them, beside the column."""
    from mixprec.bench.report import notes
    from mixprec.bench.suite import comparison_gap, metadata

    def quantized_note(names, **kw):
        options = BenchOptions(model="mlp", batch_sizes=[2], precisions=names, threads=1)
        with hardware.assume(AVX2_CPU):
            p = plan(replace(options, allow_slow=True, steps=1, **kw))
            meta = dict(metadata(p), comparison_gap=comparison_gap(p), memory_method="m")
        loop = LoopResult(step_ms=[2.0] * 6, peak_memory=100)
        rows = [
            Row(c, RunResult(OK, loop, loop if c.raw else None, paired=True)) for c in p.configs
        ]
        report = BenchReport(meta, rows)
        lines = notes(report, summarize(report))
        return [line for line in lines if line.startswith("mixprec overhead: none for")]

    names = ["32-true", "float8_from_bf16-mixed", "float8_from_32-true", "bf16-mixed"]
    (note,) = quantized_note(names, activations=["keep", "bf16"], float32_islands="both")
    assert note.startswith(
        "mixprec overhead: none for float8_from_mixed_bfloat16, activations keep; "
        "float8_from_mixed_bfloat16, activations keep (no f32 islands): they quantize matmuls"
    )
    assert "float8_from_float32" not in note and "activations bf16" not in note
    # no raw twin ran, so no overhead column: nothing to explain
    assert quantized_note(["32-true", "float8_from_bf16-mixed"]) == []
