"""How a benchmark run ended is a `RunStatus`, not a free string: results read back from the
JSON a fresh process or a journal wrote hold the same members, and a status no run can end
with is refused where it is made."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from mixprec.bench.runner import OK, OOM, LoopResult, RunResult, RunStatus


def test_a_result_read_back_from_json_holds_run_statuses():
    result = RunResult(OK, LoopResult(OOM, error="out of memory"), raw=LoopResult())
    text = json.dumps(asdict(result))
    assert json.loads(text)["mixprec"]["status"] == "oom"  # written as its value
    back = RunResult.from_dict(json.loads(text))
    assert back == result
    assert back.status is RunStatus.OK and back.mixprec.status is RunStatus.OOM
    assert f"{back.mixprec.status}" == "oom"


def test_a_status_no_run_ends_with_is_refused():
    with pytest.raises(ValueError, match="'fine' is not a valid RunStatus"):
        LoopResult("fine")
    with pytest.raises(ValueError, match="'done' is not a valid RunStatus"):
        RunResult.from_dict({"status": "done", "mixprec": {}})
