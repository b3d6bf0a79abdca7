"""Fixtures every test gets: no state leaks in from the environment or between tests."""

import multiprocessing.forkserver
import os
import signal
import tempfile

import pytest
from hypothesis import settings

import mixprec
from mixprec.device.gemm_ratio import CACHE_ENV
from mixprec.hardware import ALLOW_SLOW_ENV
from mixprec.trainer.strategy import fresh_start_method

_GEMM_CACHE = tempfile.TemporaryDirectory(prefix="mixprec-cache-")

# under CI (CI set, as .ci/run and CI services set it) hypothesis draws the same examples
# every run: a landing is not decided by the luck of a draw (one found a budget an ulp over,
# since an @example); elsewhere each run draws anew, to find what CI's examples miss
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config):
    """The host's GEMM ratios are measured once per run into a cache of its own (child
    processes inherit it), never read from or written to the user's; set before collection,
    since a test module may detect the host when it is imported. The fork server the
    Trainer's ranks and the multi-process tests' fork from starts now, in the session's
    environment (a test changing a variable read on import spawns its ranks instead)."""
    os.environ[CACHE_ENV] = _GEMM_CACHE.name
    os.environ.pop(ALLOW_SLOW_ENV, None)  # (as every test sees it: `_isolated`)
    if fresh_start_method() == "forkserver":
        multiprocessing.forkserver.ensure_running()


def pytest_unconfigure(config):
    _GEMM_CACHE.cleanup()


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    """A user's MIXPREC_ALLOW_SLOW must not change what the tests see, and a test that sets
    the global policy must not leave it set for the next one. Nor may a Ctrl-C handler:
    Lightning ignores SIGINT while it tears down, and child processes inherit an ignored one."""
    monkeypatch.delenv(ALLOW_SLOW_ENV, raising=False)
    before = mixprec.global_policy()
    sigint = signal.getsignal(signal.SIGINT)
    yield
    mixprec.set_global_policy(before)
    signal.signal(signal.SIGINT, sigint)


@pytest.fixture
def fresh_detect():
    """Device detection (remembered per process) made afresh before and after the test, the
    measurements a cache file could not take forgotten too."""
    from mixprec.device import _detect, gemm_ratio

    _detect.cache_clear()
    gemm_ratio._UNSTORED.clear()
    yield
    _detect.cache_clear()
    gemm_ratio._UNSTORED.clear()
