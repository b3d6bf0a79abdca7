"""Fixtures every test gets: no state leaks in from the environment or between tests."""

import signal

import pytest

import mixprec
from mixprec.hardware import ALLOW_SLOW_ENV


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
