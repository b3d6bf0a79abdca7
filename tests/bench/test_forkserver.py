"""The bench's fork server: a configuration forked from it measures what one in a new
interpreter measures; a timeout or an interrupt kills its child (and, interrupted, the
server); a changed environment starts a new server, and a child runs in the caller's
environment of the moment."""

from __future__ import annotations

import os
import signal

import pytest

from mixprec.bench import forkserver
from mixprec.bench.runner import OK, RunSpec, run_isolated

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")

FACTORY = """
import os
import torch
from torch import nn


def make():
    # what the process's environment says, beside this file
    with open(os.path.join(os.path.dirname(__file__), "seen.txt"), "w") as f:
        f.write(os.environ.get("MIXPREC_FORKSERVER_TEST", "unset"))
    torch.manual_seed(0)
    batch = lambda n: (torch.randn(n, 8), torch.randint(0, 2, (n,)))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return model, batch, nn.functional.cross_entropy
"""


@pytest.fixture
def spec(tmp_path) -> RunSpec:
    """A tiny model's configuration under a memory limit (which takes a fresh process)."""
    (tmp_path / "tinyfactory.py").write_text(FACTORY)
    return RunSpec(
        model=f"{tmp_path / 'tinyfactory.py'}:make", precision="32-true", batch_size=4,
        image_size=8, device="cpu", steps=1, warmup=0, threads=1, memory_limit=2**30,
    )  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def stopped_after():
    """The tests share a server (each start imports torch: seconds); none is left after."""
    yield
    forkserver._stop()


def test_a_forked_configuration_measures_what_a_new_interpreter_does(tmp_path, spec, monkeypatch):
    work = tmp_path / "work"
    forked = run_isolated(spec, work)
    assert forkserver._SERVER, "the configuration did not go through the server"
    monkeypatch.setattr(forkserver, "server", lambda: None)
    started = run_isolated(spec, work)
    assert forked.status == started.status == OK
    assert forked.fresh_process and started.fresh_process
    assert forked.mixprec.peak_memory == started.mixprec.peak_memory
    assert forked.mixprec.final_loss == started.mixprec.final_loss
    assert list(work.iterdir()) == []  # results and logs removed


def test_a_timeout_kills_the_child_and_the_server_serves_on(tmp_path, spec):
    timed_out = run_isolated(spec, tmp_path, timeout=0.01)
    assert timed_out.status == "timeout" and timed_out.fresh_process
    server = forkserver.server()
    assert server is not None and server.alive()
    assert run_isolated(spec, tmp_path).status == OK
    assert forkserver.server() is server


def test_a_changed_environment_starts_a_new_server_and_reaches_the_child(
    tmp_path, spec, monkeypatch
):
    seen = tmp_path / "seen.txt"
    work = tmp_path / "work"
    assert run_isolated(spec, work).status == OK
    first = forkserver.server()
    assert first is not None and seen.read_text() == "unset"
    monkeypatch.setenv("MIXPREC_FORKSERVER_TEST", "seen")
    assert run_isolated(spec, work).status == OK
    assert seen.read_text() == "seen"  # the caller's environment of the moment
    second = forkserver.server()
    assert second is not first and not first.alive()  # started anew in it


def test_an_interrupt_while_waiting_kills_the_child_and_the_server(tmp_path, spec, monkeypatch):
    killed: list[int] = []
    kill = os.kill

    def recorded(pid, sig):
        if sig == signal.SIGKILL:
            killed.append(pid)
        return kill(pid, sig)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    server = forkserver.server()
    assert server is not None
    monkeypatch.setattr(forkserver.os, "kill", recorded)
    before = signal.signal(signal.SIGALRM, interrupt)
    long = RunSpec(**{**spec.__dict__, "steps": 100_000})
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(KeyboardInterrupt):
            run_isolated(long, tmp_path)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
        monkeypatch.undo()
    assert len(killed) == 1 and killed[0] != server.proc.pid  # the child
    with pytest.raises(ProcessLookupError):
        os.kill(killed[0], 0)  # (reaped by the server, which then ended)
    assert not server.alive()  # (the next configuration starts a new one: `server`)


BURN = """
import time


def burn(argv):
    start = time.process_time()
    while time.process_time() - start < float(argv[0]):
        pass
"""


def test_the_cpu_time_of_a_forked_child_counts_as_the_callers_own(tmp_path, monkeypatch):
    """A configuration forked by the server is the server's child, not the caller's: its CPU
    time was in no rusage the caller read, so the bench counted its own measurements as
    other work (`other_busy_cores` about one core too high per busy thread). The server
    sends each child's CPU time back with its exit, and the caller counts it."""
    from mixprec.timing import cpu_sample

    (tmp_path / "mixprec_burn_test.py").write_text(BURN)
    monkeypatch.chdir(tmp_path)
    assert forkserver.server() is not None  # (started first: its own imports are not timed)
    before = cpu_sample()
    code, output = forkserver.run_fresh("mixprec_burn_test:burn", ["0.5"], dict(os.environ))
    after = cpu_sample()
    assert code == 0, output
    assert after[2] - before[2] >= 0.45
