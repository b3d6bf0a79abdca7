"""Fresh processes for the measurements that need one, in milliseconds instead of seconds.

A bench configuration run under a memory limit or compiled needs a process of its own
(`runner.fresh_process_reason`), as does each plan `mixprec doctor --fit` measures. Started as
a new interpreter, each pays for importing torch and mixprec (seconds on a CPU), which a
``--max-batch`` search pays once per probe. So a server process imports them once and forks a
child per measurement: the child is a
new process (its own address space, limit and allocator; nothing was ever run, compiled or
placed on a GPU in the server, which starts no thread), started from the state a new
interpreter reaches after the same imports. The server is started on the first request with
this process's environment and again whenever the environment has changed since (variables
read at import, such as ``ATEN_CPU_CAPABILITY``, must be the child's); each child takes the
caller's environment of the moment.

Protocol, one JSON line each way: the parent sends ``{"target": "module:function", "argv":
[...], "log": path, "env": {...}, "cwd": folder}``; the server answers ``{"pid": n}`` when
the child runs and ``{"exit": code, "cpu": seconds}`` (a negative signal number for a killed
child; the CPU time it used, which the parent counts as its own: `timing.add_own_cpu`) when
it ends. The child runs ``function(argv)`` in ``cwd`` with its output in ``log`` (exit code 0
unless it returns another or raises). Where fork is not available, or the server
cannot start or stops under way, `run_fresh` starts a new interpreter instead.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

from mixprec.timing import add_own_cpu

__all__ = ["Server", "ServerStopped", "run_fresh", "server"]


class ServerStopped(RuntimeError):
    """The fork server ended while a request was under way (its child's fate unknown)."""


class Server:
    """A running fork server (see the module's docstring) and the environment it started in."""

    def __init__(self, proc: subprocess.Popen, env: dict[str, str]) -> None:
        self.proc = proc
        self.env = env
        self.child: int | None = None
        self._lock = threading.Lock()  # (one request at a time)

    @classmethod
    def start(cls) -> Server | None:
        """A new server, or None where this platform cannot fork or the server died at start."""
        if not hasattr(os, "fork") or sys.platform == "win32":
            return None
        env = _environment()
        proc = subprocess.Popen(
            [sys.executable, "-c", "from mixprec.bench.forkserver import _serve; _serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        ready = _read(proc.stdout, None)
        if not ready or not ready.get("ready"):
            proc.kill()
            proc.wait()
            return None
        return cls(proc, env)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(
        self,
        target: str,
        argv: list[str],
        log: str,
        env: dict[str, str],
        timeout: float | None = None,
    ) -> int | None:
        """Run ``target`` (``"module:function"``) on ``argv`` in a forked child with the
        environment ``env`` and its output in ``log``: its exit code (a negative signal
        number when a signal ended it), or None when ``timeout`` passed (the child is
        killed). An exception while waiting (Ctrl-C, SIGTERM raised as one) kills the child
        and ends the server, and propagates."""
        request = {"target": target, "argv": argv, "log": log, "env": env, "cwd": os.getcwd()}
        with self._lock:
            return self._run(request, timeout)

    def _run(self, request: dict[str, Any], timeout: float | None) -> int | None:
        try:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError as error:
                raise ServerStopped("the fork server had stopped") from error
            started = _read(self.proc.stdout, None)
            if not started or "pid" not in started:
                raise ServerStopped("the fork server stopped before its child started")
            self.child = started["pid"]
            ended = _read(self.proc.stdout, timeout)
            if ended is None:  # the time is up: kill the child, then take its exit
                os.kill(self.child, signal.SIGKILL)
                _read(self.proc.stdout, None)
                return None
            if "exit" not in ended:
                raise ServerStopped("the fork server stopped while its child ran")
            # (the server's child, not this process's: its CPU time is not in this rusage)
            add_own_cpu(float(ended.get("cpu", 0.0)))
            return int(ended["exit"])
        except BaseException:
            self.close(kill=True)
            raise
        finally:
            self.child = None

    def close(self, kill: bool = False) -> None:
        """End the server: its requests closed, so that it exits once its child has (with
        ``kill``, the child is killed first, and reaped by the server before it exits)."""
        if kill and self.child is not None:
            try:
                os.kill(self.child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
            except OSError:  # (a request half written when the caller was interrupted)
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()


_SERVER: list[Server] = []
_LOCK = threading.Lock()


def server() -> Server | None:
    """This process's fork server: started on first use, started again when it died or when
    the environment changed since it started; None where it cannot run."""
    with _LOCK:
        if _SERVER and (not _SERVER[0].alive() or _SERVER[0].env != _environment()):
            _SERVER.pop().close(kill=True)
        if not _SERVER:
            started = Server.start()
            if started is None:
                return None
            _SERVER.append(started)
        return _SERVER[0]


# what no import reads, changing from one call to the next: a test runner's name of the test
_VOLATILE = ("PYTEST_CURRENT_TEST",)


def _environment() -> dict[str, str]:
    """The environment a server is started in and compared by."""
    return {k: v for k, v in os.environ.items() if k not in _VOLATILE}


def run_fresh(
    target: str, argv: list[str], env: dict[str, str], timeout: float | None = None
) -> tuple[int | None, str]:
    """Run ``target`` (``"module:function"``) on ``argv`` in a fresh process with the
    environment ``env``: forked from this process's server, or a new interpreter where the
    server cannot run or stopped under way. (Its exit code, None when ``timeout`` passed and
    it was killed; what it wrote to stdout and stderr.)"""
    found = server()
    if found is not None:
        with tempfile.TemporaryDirectory(prefix="mixprec-fresh-") as tmp:
            log = Path(tmp) / "output.txt"
            try:
                code = found.run(target, argv, str(log), env, timeout)
            except ServerStopped:
                pass  # (the interpreter below)
            else:
                return code, log.read_text(errors="replace") if log.exists() else ""
    module, name = target.split(":")
    call = f"import sys; from {module} import {name}; sys.exit({name}(sys.argv[1:]) or 0)"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", call, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return None, ""
    return proc.returncode, proc.stderr or proc.stdout or ""


@atexit.register
def _stop() -> None:
    while _SERVER:
        _SERVER.pop().close()


def _read(stream: IO[str] | None, timeout: float | None) -> dict[str, Any] | None:
    """The next JSON line of ``stream``; None at its end or when ``timeout`` passed first."""
    assert stream is not None
    if timeout is not None:
        ready, _, _ = select.select([stream], [], [], max(timeout, 0.0))
        if not ready:
            return None
    line = stream.readline()
    return json.loads(line) if line else None


def _serve() -> None:
    """The server: import the runner (torch, mixprec) once, and what a configuration's first
    step imports (dynamo, which torch's optimizers import when built: seconds), then fork a
    child per request."""
    import torch._dynamo  # noqa: F401

    import mixprec.bench.runner  # noqa: F401

    if threading.active_count() != 1:  # forking a process with threads is unsafe
        print(json.dumps({"ready": False}), flush=True)
        return
    # Ctrl-C reaches the whole process group: the parent stops the child it waits for, and
    # the server ends when the parent closes its requests
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status, usage = os.wait4(pid, 0)
        cpu = usage.ru_utime + usage.ru_stime
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status), "cpu": cpu}), flush=True)


def _child(request: dict[str, Any]) -> None:
    """A forked child: the request's environment, working folder and output file, its target
    on its argv, exit."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # (the server's requests are not the child's input)
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])  # (as a new interpreter's '' on sys.path: the caller's folder)
        module, name = request["target"].split(":")
        code = getattr(importlib.import_module(module), name)(request["argv"]) or 0
    except BaseException:  # noqa: BLE001 - the child's error goes to its log, then it exits
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
