"""The GPU benchmark scripts run end to end on a CPU at tiny sizes (a smoke test: their
numbers here mean nothing), so the H100 session only has to run them."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "benchmarks" / "gpu"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_transformer_script_tiny_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    transformer = _load("transformer")
    out = tmp_path / "out"
    names = ["fp32 strict (TF32 off)", "16-mixed"]
    args = ["--device", "cpu", "--tiny", "--compile", "off", "--threads", "1", "--allow-slow"]
    assert transformer.main([*args, "--precision", *names, "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    meta = report["metadata"]
    assert meta["dims"] == {"vocab": 256, "dim": 64, "layers": 2, "heads": 4, "seq": 32, "batch": 2}
    assert meta["flops_per_step"] == 6 * meta["matmul_parameters"] * 64 + 12 * 2 * 64 * 32 * 64
    assert [(r["variant"], r["compile"]) for r in report["rows"]] == [(n, False) for n in names]
    for row in report["rows"]:
        result = row["result"]
        assert result["status"] == "ok", result.get("error")
        for loop in ("mixprec", "raw"):
            assert len(result[loop]["step_ms"]) == 2
            assert result[loop]["peak_memory"] is None  # measured on CUDA only
        s = row["summary"]
        assert s["tokens_per_s"] > 0 and s["mfu"] > 0
        assert s["overhead"] == pytest.approx(s["ms"] / s["raw_ms"] - 1)
    # float32: the two loops compute the same thing; same loss after the same updates
    fp32 = report["rows"][0]["result"]
    assert fp32["mixprec"]["final_loss"] == fp32["raw"]["final_loss"]
    assert fp32["mixprec"]["skipped_steps"] == fp32["raw"]["skipped_steps"] == 0
    md = (out / "results.md").read_text()
    assert "| fp32 strict (TF32 off) | no |" in md and "| 16-mixed | no |" in md
    assert "989" in md and "494" in md and "67" in md
    assert not list(out.glob(".job-*"))  # the children's result files are cleaned up
    png = out / "transformer.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_transformer_script_refuses_cuda_without_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    transformer = _load("transformer")
    assert transformer.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "--device cpu --tiny" in capsys.readouterr().err


def test_transformer_script_gives_its_children_an_indexed_cuda_device(tmp_path, monkeypatch):
    """`--device cuda` (run_h100.sh's) reaches each child as cuda:N: the child calls
    torch.cuda.set_device, which refuses a device without an index."""
    transformer = _load("transformer")
    jobs = []

    def fake_run(job, out_dir, timeout):
        jobs.append(job)
        return {"status": "error", "error": "not run"}

    monkeypatch.setattr(transformer, "run_isolated", fake_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "H100")
    args = ["--device", "cuda", "--precision", "bf16-mixed", "--compile", "off"]
    assert transformer.main([*args, "--out", str(tmp_path)]) == 1
    assert [job.device for job in jobs] == ["cuda:0"]


def _main_on_one_thread(script, args: list[str]) -> int:
    """``script.main(args)`` with torch on one thread (a shared 2-core machine: one thread
    times steadily), the thread count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return script.main(args)
    finally:
        torch.set_num_threads(threads)


def test_trainer_overhead_script_tiny_on_cpu(tmp_path, monkeypatch, capsys):
    script = _load("trainer_overhead")
    out = tmp_path / "trainer.md"
    args = ["--device", "cpu", "--tiny", "--precision", "32-true", "--out", str(out)]
    assert _main_on_one_thread(script, args) == 0
    text = out.read_text()
    assert "blog CNN on 16x16 images, batch 4" in text
    row = next(line for line in text.splitlines() if line.startswith("| 32-true |"))
    assert row.count("|") == 5 and row.count("%") == 2
    assert text in capsys.readouterr().out


def test_float8_mlp_script_tiny_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    script = _load("float8_mlp")
    out = tmp_path / "out"
    variants = ["bf16-mixed", "float8", "float8 op-by-op casts"]
    args = ["--device", "cpu", "--tiny", "--out", str(out), "--variants", *variants]
    assert _main_on_one_thread(script, args) == 0
    rows = [json.loads(line) for line in (out / "float8_mlp.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == variants
    for r in rows:
        assert len(r["step_ms"]) == 2 and r["ms"] > 0 and r["peak_mib"] is None
    md = (out / "float8_mlp.md").read_text()
    assert "d=64, hidden 128, 32 tokens" in md
    assert "| bf16-mixed |" in md and "| 1.00x |" in md and "| float8 op-by-op casts |" in md
    assert "--variants bf16-mixed float8 'float8 op-by-op casts'" in md  # the command, quoted


def test_float8_mlp_script_builds_float8_models_with_the_casts_asked_for():
    script = _load("float8_mlp")
    base = script.make_mlp(64, 128, torch.device("cpu"))
    model, casts = script.build("float8", base, skip_small=False)
    kinds = [type(m).__name__ for m in model if not isinstance(m, torch.nn.GELU)]
    assert kinds == ["Float8Linear"] * 4 and casts == ("cuda",)
    assert script.build("float8 op-by-op casts", base, skip_small=False)[1] == ()
    plain, _ = script.build("bf16-mixed", base, skip_small=False)
    assert [type(m).__name__ for m in plain][:1] == ["Linear"]


def test_states_adamw_script_tiny_on_cpu(tmp_path, monkeypatch):
    """mixprec's low-bit AdamWs against torch's, each stepping its own copy; a row per
    optimizer with its paired ratio and state bytes, written as it goes."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    script = _load("states_adamw")
    out = tmp_path / "out"
    args = ["--device", "cpu", "--tiny", "--warmup", "1", "--out", str(out)]
    assert _main_on_one_thread(script, args) == 0
    rows = [json.loads(line) for line in (out / "states_adamw.jsonl").read_text().splitlines()]
    names = [r["optimizer"] for r in rows]
    assert names[:4] == [
        "torch AdamW (foreach)",
        "mixprec AdamW8bit",
        "mixprec AdamW4bit",
        "mixprec AdamWFp8",
    ]
    assert rows[0]["vs_baseline"] == 1.0 and all(len(r["step_ms"]) == 2 for r in rows)
    by = {r["optimizer"]: r["state_bytes"] for r in rows}
    # two float32 moments against one byte (int8, float8) or half a byte (int4) each
    assert by["mixprec AdamW8bit"] < by["torch AdamW (foreach)"] / 3
    assert by["mixprec AdamW4bit"] < by["mixprec AdamW8bit"]
    md = (out / "states_adamw.md").read_text()
    assert "| tiny (" in md and "--tiny" in md
    assert script.main(["--device", "cuda"]) == 2 or torch.cuda.is_available()


def test_activations_script_tiny_on_cpu(tmp_path, monkeypatch):
    """Every option but offload (CUDA only, said so) timed against keep on the tiny LM; the
    memory phase needs CUDA's max_memory_allocated, so off a GPU the targets on batches say
    they were not measured."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    script = _load("activations")
    out = tmp_path / "out"
    args = ["--device", "cpu", "--tiny", "--allow-slow", "--out", str(out)]
    assert _main_on_one_thread(script, args) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["skipped"] == {"offload": "CUDA only"}
    assert list(report["time"]) == ["keep", "bf16", "fp8", "checkpoint", "selective"]
    assert all(t["rounds"] == 2 and t["ms"] > 0 for t in report["time"].values())
    assert report["time"]["keep"]["vs_keep"] == 1.0
    md = (out / "results.md").read_text()
    assert "| offload | skipped: CUDA only |" in md
    assert "- fp8 batch >= 1.6x keep's: not measured" in md
    assert "--tiny" in md


def test_activations_search_settles_the_largest_batch_by_measuring():
    """A line through two peaks predicts; lines through the largest batches measured, kept
    between the largest fit and the smallest miss, settle it; a cap, no check, a spent
    budget and a limit nothing fits are said so."""
    search = _load("activations").search
    calls = []

    def peak(per, steeper=0):  # a line, growing `steeper` more per sample from batch 8 on
        def measure(batch):
            calls.append(batch)
            return 100 + per * batch + steeper * max(0, batch - 8)

        return measure

    found = search(peak(10), (4, 8), limit=300, cap=96)
    assert (found["predicted"], found["max_batch"], found["checked"]) == (20, 20, True)
    assert calls == [4, 8, 20, 21]
    calls.clear()  # a step whose peak grows faster at large batches (checkpoint's, say)
    found = search(peak(2, steeper=30), (4, 8), limit=1000, cap=96)
    assert (found["predicted"], found["max_batch"], found["checked"]) == (96, 35, True)
    assert calls[:3] == [4, 8, 96] and len(calls) <= 8 and {35, 36} <= set(calls)
    found = search(peak(1), (4, 8), limit=300, cap=96)
    assert (found["max_batch"], found["capped"], found["checked"]) == (96, True, False)
    found = search(peak(10), (4, 8), limit=300, cap=96, check=False)
    assert (found["max_batch"], found["checked"], len(found["peaks"])) == (20, False, 2)
    calls.clear()
    found = search(peak(10, steeper=30), (4, 8), limit=300, cap=96, more=lambda: False)
    assert (found["max_batch"], found["checked"], calls) == (8, False, [4, 8])
    found = search(peak(10), (4, 8), limit=50, cap=96)
    assert (found["predicted"], found["max_batch"], found["checked"]) == (1, 0, True)


RUN_H100 = GPU / "run_h100.sh"
DEFAULT_PARTS = ["cuda", "blog256", "blog32", "transformer", "trainer", "float8"]


def test_run_h100_script_is_valid_bash_and_lists_its_parts():
    subprocess.run(["bash", "-n", str(RUN_H100)], check=True)
    text = RUN_H100.read_text()
    for part in ("-m cuda", "--preset blog", "--max-batch", "transformer.py", "trainer_overhead"):
        assert part in text
    assert "float8_mlp.py" in text and "results.tar.gz" in text
    assert 'run cuda "${CUDA_TIMEOUT:-150}" INT -- "$PYTHON" -m pytest -v -m cuda' in text
    assert re.findall(r"^[^#\n]*\bpython\b.*$", text, re.M) == ['PYTHON="${PYTHON:-python}"']


def test_run_h100_budgets_fit_one_nine_minute_command():
    """The six default parts, each at its whole budget, plus the machine header fit the
    total, and the total fits 9 minutes."""
    text = RUN_H100.read_text()
    assert f"ALL=({' '.join(DEFAULT_PARTS)})" in text
    budgets = {
        name.lower(): int(seconds)
        for name, seconds in re.findall(r"\$\{(\w+)_TIMEOUT:-(\d+)\}", text)
    }
    total = int(re.search(r"TOTAL_BUDGET=\"\$\{TOTAL_BUDGET:-(\d+)\}\"", text).group(1))
    assert total <= 9 * 60
    assert sum(budgets[p] for p in DEFAULT_PARTS) + 15 <= total


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the parts would really run")
def test_run_h100_script_writes_as_it_goes_and_skips_what_the_total_cannot_fit(tmp_path):
    """On a CPU the float8 part runs and exits 2 (no GPU), its row, log and the packed copies
    written; with the total spent, parts are skipped and said so. The parts run $PYTHON, this
    interpreter, though the `python` first on PATH has no torch (a virtual environment's
    interpreter running the suite without activating it)."""
    out, pack = tmp_path / "res", tmp_path / "pack"
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").write_text("#!/bin/sh\necho 'No module named torch' >&2\nexit 1\n")
    (bare / "python").chmod(0o755)
    path = f"{bare}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "TOTAL_BUDGET": "200", "PYTHON": sys.executable, "PATH": path}
    cmd = ["bash", str(RUN_H100), "--out", str(out), "--pack", str(pack), "float8"]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=200)
    summary = (out / "summary.md").read_text()
    assert "| float8 | 2 |" in summary
    assert "no CUDA GPU here" in (out / "float8.log").read_text()
    assert (pack / "summary.md").read_text() == summary
    with tarfile.open(pack / "results.tar.gz") as tar:
        assert "./float8.log" in tar.getnames()
    env["TOTAL_BUDGET"] = "10"
    cmd = ["bash", str(RUN_H100), "--out", str(out / "again"), "trainer", "cuda"]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=200)
    summary = (out / "again" / "summary.md").read_text()
    assert "| trainer | skipped: 0s of TOTAL_BUDGET left | - | 50 |" in summary
    assert "| cuda | skipped: 0s of TOTAL_BUDGET left | - | 150 |" in summary
    assert not (out / "again" / "cuda.log").exists()
