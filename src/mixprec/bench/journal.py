"""A bench run's record on disk, written as it goes, and the report rebuilt from it.

`Journal` is a `suite.Listener` that appends one JSON line per event to ``rows.jsonl`` (the
run's metadata and plan, each configuration's row as soon as it is measured, each max-batch
probe and search, the end), each line flushed and fsynced before the run goes on. A run
stopped at any point (Ctrl-C, SIGTERM, a crash, a machine taken away) leaves every row it
finished;
`load` turns the file back into a `BenchReport`, marked as stopped when the end is missing,
from which the report files are written, at the end of a run as after a stop.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mixprec.bench.runner import OK, OOM, RunResult
from mixprec.bench.suite import BenchReport, Config, Listener, Row, memory_method

__all__ = ["JOURNAL", "Journal", "load"]

JOURNAL = "rows.jsonl"


class Journal(Listener):
    """Appends a run's events to `path` (see the module doc); the file must not exist yet."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._t0 = time.perf_counter()

    def _append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def started(self, meta: dict[str, Any], configs: Sequence[Config]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            raise FileExistsError(f"{self.path} already holds a run's record")
        planned = [{"label": c.label, "batch_size": c.batch_size} for c in configs]
        self._t0 = time.perf_counter()
        self._append({"kind": "start", "metadata": meta, "planned": planned})

    def measured(self, row: Row, index: int, seconds: float) -> None:
        self._append(
            {
                "kind": "row",
                "index": index,
                "seconds": round(seconds, 3),
                "elapsed_s": round(time.perf_counter() - self._t0, 1),
                "config": asdict(row.config),
                "result": asdict(row.result),
            }
        )

    def probed(self, name: str, batch: int, status: str) -> None:
        probe = {"batch_size": batch, "fits": status == OK, "status": status}
        self._append({"kind": "probe", "precision": name, "probe": probe})

    def searched(self, name: str, found: dict[str, Any]) -> None:
        self._append({"kind": "max_batch", "precision": name, "found": found})

    def finished(self, meta: dict[str, Any]) -> None:
        self._append({"kind": "end", "metadata": meta})


def _records(path: Path) -> list[dict[str, Any]]:
    """The file's records; a last line cut short (the process killed while writing it) is
    left out, any other line that is not JSON is an error naming it."""
    text = path.read_text()
    lines = text.split("\n")
    complete, cut = lines[:-1], lines[-1]
    records = []
    for number, line in enumerate(complete, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {number}, is not a bench record: {err}") from None
    if cut:
        try:  # a whole record whose newline did not make it
            records.append(json.loads(cut))
        except json.JSONDecodeError:
            pass
    return records


def load(path: Path) -> BenchReport | None:
    """The report of the run recorded in `path`; None when it stopped before its first
    record. A run without its end record gets ``metadata["stopped"]``: how many of the
    planned configurations finished, and those that did not run."""
    if not path.exists():
        return None
    records = _records(path)
    if not records or records[0].get("kind") != "start":
        return None
    start = records[0]
    meta = dict(start["metadata"])
    rows: list[Row] = []
    max_batch: dict[str, dict[str, Any]] = {}
    probes: dict[str, list[dict[str, Any]]] = {}
    end = None
    elapsed = 0.0
    for record in records[1:]:
        kind = record["kind"]
        if kind == "row":
            rows.append(Row(Config(**record["config"]), RunResult.from_dict(record["result"])))
            elapsed = record["elapsed_s"]
        elif kind == "probe":
            probes.setdefault(record["precision"], []).append(record["probe"])
        elif kind == "max_batch":
            max_batch[record["precision"]] = record["found"]
        elif kind == "end":
            end = record["metadata"]
        else:
            raise ValueError(f"{path}: unknown record kind {kind!r}")
    for name, made in probes.items():  # a search the stop cut short: what its probes found
        if name not in max_batch:
            max_batch[name] = _cut_search(made)
    if end is not None:
        meta.update(end)
    else:
        planned = start["planned"]
        meta.update(elapsed_s=elapsed, memory_method=memory_method(rows))
        meta["stopped"] = {
            "finished": len(rows),
            "planned": len(planned),
            "not_run": [f"{c['label']} @ {c['batch_size']}" for c in planned[len(rows) :]],
        }
    return BenchReport(meta, rows, max_batch)


def _cut_search(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """A max-batch search stopped by the run's stop, as far as its probes went: the largest
    batch that fitted below the smallest that ran out of memory, marked ``cut`` (a probe
    the stop itself ended, which neither fitted nor ran out of memory, says nothing)."""
    ooms = [p["batch_size"] for p in probes if p["status"] == OOM]
    first_oom = min(ooms, default=None)
    fitted = [p["batch_size"] for p in probes if p["fits"]]
    below = [b for b in fitted if first_oom is None or b < first_oom]
    return {
        "max_batch": max(below, default=0),
        "first_oom": first_oom,
        "capped": False,
        "error": None,
        "cut": True,
        "probes": probes,
    }
