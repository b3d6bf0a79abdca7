"""`mixprec bench --strategy`: memory per rank from the tensors each rank holds; one real
2-process FSDP measurement, the counting itself, the report and the refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from devices import AVX2_CPU
from torch import nn

import mixprec
from mixprec import hardware
from mixprec.bench import distributed
from mixprec.bench.distributed import MemorySpec, RankMemory, held_bytes
from mixprec.cli import main
from mixprec.hardware import ALLOW_SLOW_ENV

TINY = """
import torch
from torch import nn

def factory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    batch = lambda n: (torch.randn(n, 8), torch.randint(0, 4, (n,)))
    return model, batch, nn.functional.cross_entropy
"""
N_PARAMS = 8 * 16 + 16 + 16 * 4 + 4
STEP_TENSORS = 4 * 4  # AdamW keeps one float32 step count per parameter tensor


def test_held_bytes_count_parameters_gradients_and_optimizer_state():
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert held_bytes(model, opt) == (4 * N_PARAMS, 4 * N_PARAMS, 8 * N_PARAMS + STEP_TENSORS)


def test_held_bytes_count_the_float32_masters_and_their_gradients(monkeypatch):
    """Under 16-true the step keeps float32 masters and their gradients beside the float16
    model; they were left out, so the bench's table held 16-true at 0.6x float32's memory
    where it holds 1.1x."""
    monkeypatch.setenv(ALLOW_SLOW_ENV, "1")
    precision = mixprec.Precision("16-true")
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model, lso = precision.setup(model, torch.optim.AdamW(model.parameters()))
    precision.backward(model(torch.randn(2, 8, dtype=torch.float16)).float().mean() * 1e-3)
    assert precision.step()  # (not skipped: AdamW made its moments)
    params, grads, state = held_bytes(model, lso)
    assert params == 2 * N_PARAMS  # the float16 model
    assert grads == 4 * N_PARAMS  # the masters' float32 gradients (the step moved them)
    assert state == 4 * N_PARAMS + 8 * N_PARAMS + STEP_TENSORS  # masters, then AdamW's


@pytest.mark.slow
def test_two_fsdp_ranks_each_hold_half_of_what_one_ddp_rank_holds(tmp_path):
    (tmp_path / "tiny.py").write_text(textwrap.dedent(TINY))
    spec = MemorySpec(
        "fsdp", "32-true", f"{tmp_path / 'tiny.py'}:factory", batch_size=4, steps=2,
        devices=2, device="cpu", threads=1, allow_slow=False,
    )  # fmt: skip
    ranks = distributed.measure(spec, tmp_path / "runs")
    ddp_held = 16 * N_PARAMS + STEP_TENSORS  # whole float32 model, gradients, AdamW state
    for r in ranks:
        assert (r.params, r.grads) == (2 * N_PARAMS, 2 * N_PARAMS)  # every dim 0 splits evenly
        assert r.optimizer == 4 * N_PARAMS + STEP_TENSORS
        assert r.held <= 0.55 * ddp_held
        assert r.step_peak > r.held - r.grads  # held before the step, plus what the step made
        assert r.rss_peak > 0 and r.final_loss == r.final_loss


def test_report_compares_each_strategy_with_ddp_in_the_same_precision(tmp_path):
    def row(strategy: str, rank: int, params: int) -> RankMemory:
        return RankMemory(strategy, "bf16-mixed", rank, params, params, 2 * params, 10, 20, 1.0)

    rows = [row("ddp", 0, 100), row("ddp", 1, 100), row("fsdp", 0, 52), row("fsdp", 1, 48)]
    lines = distributed.summary(rows)
    assert [(x["strategy"], x["held"], x["held_vs_ddp"]) for x in lines] == [
        ("ddp", 400, 1.0),
        ("fsdp", 208, 0.52),  # the rank holding the most
    ]
    meta = dict(command="mixprec bench --strategy fsdp", host="a host", devices=2,
                model="tiny", batch_size=2, steps=2)  # fmt: skip
    js, md = distributed.write(tmp_path, rows, meta)
    assert "| fsdp | bf16-mixed |" in md.read_text() and "0.520x" in md.read_text()
    assert "command: `mixprec bench --strategy fsdp`" in md.read_text()
    assert json.loads(js.read_text())["ranks"][2]["params"] == 52


def test_slow_precisions_and_bad_counts_are_refused_before_any_process_starts(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv(ALLOW_SLOW_ENV, raising=False)
    with hardware.assume(AVX2_CPU):
        code = main(
            [
                "bench",
                "--strategy",
                "fsdp",
                "--precision",
                "bf16-mixed",
                "--out",
                str(tmp_path / "a"),
            ]
        )
    assert code == 2 and "--allow-slow" in capsys.readouterr().err
    assert main(["bench", "--strategy", "ddp", "--devices", "0", "--out", str(tmp_path)]) == 2
    assert "--devices" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-sizes", "2", "4"], "--strategy measures one batch size, got 2 4"),
        (["--max-batch"], "--max-batch is an option of the timing run, not of --strategy"),
        (["--timeout", "5"], "--timeout is an option of the timing run"),
        (["--float32-islands", "off"], "--float32-islands is an option of the timing run"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--device", "mps"], "--strategy runs on cpu or cuda, not mps"),
        (["--model", "nope"], "unknown model 'nope': use one of cnn, mlp, transformer"),
    ],
)
def test_what_the_memory_run_cannot_do_is_refused_before_any_process_starts(
    tmp_path, capsys, args, message
):
    """Each of these was dropped (all but the first batch size, the timing options, a
    device other than cuda ran on the CPU) or failed inside the ranks (exit 1)."""
    out = tmp_path / "out"
    code = main(["bench", "--strategy", "ddp", "--precision", "32-true", *args, "--out", str(out)])
    assert code == 2 and message in " ".join(capsys.readouterr().err.split())
    assert not out.exists()
    assert main(["bench", "--devices", "3", "--out", str(out)]) == 2
    assert "--devices is an option of --strategy" in capsys.readouterr().err


def test_auto_is_the_fastest_stable_precision_of_the_measured_device(tmp_path, capsys):
    (tmp_path / "file").write_text("")  # an --out that is a file: checked after the precisions
    for auto in ("auto", " AUTO"):  # (spelled as Precision takes it; "AUTO" was refused)
        args = ["bench", "--strategy", "ddp", "--precision", auto, "--out", f"{tmp_path}/file"]
        assert main(args) == 2
        assert "is a file: give a directory path" in capsys.readouterr().err


def test_the_default_precisions_leave_out_what_is_slow_here_and_say_why(monkeypatch):
    monkeypatch.delenv(ALLOW_SLOW_ENV, raising=False)
    with hardware.assume(AVX2_CPU):
        kept, left = distributed.default_precisions("cpu", allow_slow=False)
        assert kept == ["32-true"] and list(left) == ["bf16-mixed", "bf16-true"]
        assert all("bfloat16" in why for why in left.values())
        assert distributed.default_precisions("cpu", allow_slow=True) == (
            list(distributed.DEFAULT_PRECISIONS),
            {},
        )


@pytest.mark.slow
def test_a_failing_configuration_is_a_recorded_row_and_the_others_are_written(tmp_path, capsys):
    """fsdp under 16-true (float32 masters beside float16 shards) used to crash the command
    after the ddp row, with nothing written; now it is a row with the refusal, exit 1."""
    (tmp_path / "tiny.py").write_text(textwrap.dedent(TINY))
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            *("--strategy", "fsdp", "--precision", "16-true", "--allow-slow"),
            *("--model", f"{tmp_path / 'tiny.py'}:factory", "--batch-sizes", "4"),
            *("--steps", "2", "--threads", "1", "--out", str(out)),
        ]
    )
    assert code == 1
    refusal = "PrecisionError: shard(model, '16-true') with master_weights=None"
    result = json.loads((out / "memory.json").read_text())
    [failed] = result["failed"]
    assert (failed["strategy"], failed["precision"]) == ("fsdp", "16-true")
    assert refusal in failed["error"] and "'16-mixed' rather than '16-true'" in failed["error"]
    assert [(r["strategy"], r["rank"]) for r in result["ranks"]] == [("ddp", 0), ("ddp", 1)]
    ddp, fsdp = result["summary"]
    assert ddp["error"] is None and ddp["params"] == 2 * N_PARAMS  # whole float16 weights
    assert fsdp["error"] == failed["error"] and fsdp["held"] is None
    md = (out / "memory.md").read_text()
    assert "| ddp | 16-true | " in md and "| fsdp | 16-true |" + " failed |" * 7 in md
    assert f"- fsdp 16-true: mixprec.errors.{refusal}" in md
    assert refusal in " ".join(capsys.readouterr().err.split())


# The second spec's ranks stop in the factory: rank 1 ignoring SIGINT stands for a rank blocked
# where Python's handler never runs (torch retries a store connect through EINTR)
STUCK = """
import os, signal, time
from pathlib import Path
import torch
import torch.distributed as dist
from torch import nn

MARKS = Path({marks!r})

def factory():
    rank = dist.get_rank() if dist.is_initialized() else "parent"  # the parent checks it
    calls = MARKS / f"rank{{rank}}.calls"
    calls.write_text(str(int(calls.read_text()) + 1 if calls.exists() else 1))
    if rank != "parent" and calls.read_text() == "2":
        if rank == 1:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        (MARKS / f"rank{{rank}}.pid").write_text(str(os.getpid()))
        while True:
            time.sleep(0.1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    batch = lambda n: (torch.randn(n, 8), torch.randint(0, 4, (n,)))
    return model, batch, nn.functional.cross_entropy
"""

CLI = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from mixprec.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _gone(pid: int) -> bool:
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.slow
def test_ctrl_c_while_fsdp_ranks_run_ends_every_rank_and_keeps_the_measured_rows(tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while the fsdp ranks
    ran, one of them not answering it: the command waited at exit for that rank (torch's store
    timeout, 30 minutes) and wrote nothing. Now every rank ends within seconds, the ddp rows
    measured before are written, and the exit status is 130."""
    (tmp_path / "stuck.py").write_text(textwrap.dedent(STUCK.format(marks=str(tmp_path))))
    out = tmp_path / "out"
    args = [
        *("bench", "--strategy", "fsdp", "--precision", "32-true"),
        *("--model", f"{tmp_path / 'stuck.py'}:factory", "--batch-sizes", "4"),
        *("--steps", "2", "--threads", "1", "--out", str(out)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "log.txt", "w") as log:  # not a pipe: a rank left behind would hold it
        cli = subprocess.Popen(
            [sys.executable, "-c", CLI, *args], stdout=log, stderr=log, env=env,
            start_new_session=True,
        )  # fmt: skip
    pid_files = [tmp_path / f"rank{r}.pid" for r in range(2)]
    try:
        deadline = time.monotonic() + 180
        while not all(f.exists() and f.read_text() for f in pid_files):
            assert cli.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "the fsdp ranks did not start"
            time.sleep(0.2)
        ranks = [int(f.read_text()) for f in pid_files]
        os.killpg(cli.pid, signal.SIGINT)
        code = cli.wait(timeout=30)
        assert code == 130, (tmp_path / "log.txt").read_text()[-3000:]
        assert all(_gone(pid) for pid in ranks)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait()
    result = json.loads((out / "memory.json").read_text())
    assert [(r["strategy"], r["rank"]) for r in result["ranks"]] == [("ddp", 0), ("ddp", 1)]
    [stopped] = result["failed"]
    assert (stopped["strategy"], stopped["error"]) == (
        "fsdp",
        "interrupted (Ctrl-C) before its ranks finished",
    )
    assert "interrupted (Ctrl-C)" in (tmp_path / "log.txt").read_text()
