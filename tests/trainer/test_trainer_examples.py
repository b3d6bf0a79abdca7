"""Both examples train in every precision (tiny sizes here; benchmarks/ runs them full size)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PRECISIONS = ["32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true"]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("precision", PRECISIONS)
def test_digits_runs_in_every_precision(precision, tmp_path):
    result = load("digits").run(precision, epochs=2, width=8, allow_slow=True, root=str(tmp_path))
    assert result["precision"] == precision and result["steps"] == 40
    assert result["test_acc"] > 0.5  # ten classes: chance is 0.1
    assert result["median_samples_per_sec"] > 0


@pytest.mark.parametrize("precision", PRECISIONS)
def test_charlm_runs_in_every_precision(precision, tmp_path):
    result = load("charlm").run(
        precision, steps=6, batch_size=4, width=32, allow_slow=True, root=str(tmp_path)
    )
    assert result["precision"] == precision and result["steps"] == 6
    assert math.isfinite(result["val_loss"]) and result["val_loss"] < math.log(256) + 0.5


def test_charlm_text_is_the_standard_library_and_the_split_holds_out_its_end():
    charlm = load("charlm")
    text = charlm.stdlib_text()
    assert b"def " in text and len(text) > 500_000
    train, val = charlm.charlm_loaders(block=128, batch_size=8)
    split = int(len(text) * 0.9)
    assert bytes(train.dataset.data.tolist()) == text[:split]
    assert bytes(val.dataset.data.tolist()) == text[split:]
