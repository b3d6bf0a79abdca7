"""benchmarks/optimizer_states.py runs end to end at a tiny size (its figures here mean
nothing), and the bytes it reports are the optimizers' exact state bytes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from torch import nn

from mixprec.optim.states import AdamW8bit, state_bytes

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location(
        "optimizer_states", ROOT / "benchmarks" / "optimizer_states.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_runs_tiny_and_reports_every_row(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the test's threads stay
    bench = _load()
    out, figures = tmp_path / "states.md", tmp_path / "states.json"
    only = ";".join([bench.BASELINE, "mixprec AdamW8bit", "mixprec AdamW4bit"])
    args = [
        "--models", "charlm", "--steps", "4", "--warmup", "1", "--width", "32", "--block", "16",
        "--batch-size", "2", "--val-batches", "1", "--only", only,
        "--out", str(out), "--json", str(figures),
    ]  # fmt: skip
    assert bench.main(args) == 0
    md = out.read_text()
    assert md.startswith("# Low-bit optimizer states")
    assert "PYTHONPATH=src python benchmarks/optimizer_states.py --models charlm" in md
    report = json.loads(figures.read_text())
    [result] = report["results"]
    rows = {r["optimizer"]: r for r in result["rows"]}
    assert list(rows) == [bench.BASELINE, "mixprec AdamW8bit", "mixprec AdamW4bit"]
    params = result["info"]["parameters"]
    # float32 AdamW: two float32 moments of every element and a float32 step per tensor
    n_tensors = len(list(bench.CharGPT(block=16, dim=32).parameters()))
    assert rows[bench.BASELINE]["state_bytes"] == 8 * params + 4 * n_tensors
    for name in ("mixprec AdamW8bit", "mixprec AdamW4bit"):
        row = rows[name]
        assert row["state_bytes"] < rows[bench.BASELINE]["state_bytes"]
        assert row["peak_bytes"] > row["state_bytes"] and row["optimizer_step_ms"] > 0
        assert f"| {name} | mixprec |" in md
    assert "## Targets" in md and "mixprec AdamW8bit: held-out loss within 0.5%" in md


def test_state_bytes_count_every_storage_once_with_the_step() -> None:
    bench = _load()
    model = nn.Linear(128, 64)
    opt = AdamW8bit(model.parameters(), lr=1e-3)
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    # mixprec's own count leaves the 4-byte steps out
    assert bench.state_bytes(opt) == state_bytes(opt) + 4 * 2
