"""The GPU benchmark scripts run end to end on a CPU at tiny sizes (a smoke test: their
numbers here mean nothing), so the H100 session only has to run them."""

import importlib.util
import json
import subprocess
import sys
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


def test_trainer_overhead_script_tiny_on_cpu(tmp_path, monkeypatch, capsys):
    script = _load("trainer_overhead")
    out = tmp_path / "trainer.md"
    args = ["--device", "cpu", "--tiny", "--precision", "32-true", "--out", str(out)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread times steadily
    try:
        code = script.main(args)
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    text = out.read_text()
    assert "blog CNN on 16x16 images, batch 4" in text
    row = next(line for line in text.splitlines() if line.startswith("| 32-true |"))
    assert row.count("|") == 5 and row.count("%") == 2
    assert text in capsys.readouterr().out


def test_run_h100_script_is_valid_bash_and_lists_its_parts():
    script = GPU / "run_h100.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for part in ("-m cuda", "--preset blog", "--max-batch", "transformer.py", "trainer_overhead"):
        assert part in text
    assert "results.tar.gz" in text
