"""Fixtures every test gets: no state leaks in from the environment or between tests."""

import pytest

import mixprec
from mixprec.hardware import ALLOW_SLOW_ENV


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    """A user's MIXPREC_ALLOW_SLOW must not change what the tests see, and a test that sets
    the global policy must not leave it set for the next one."""
    monkeypatch.delenv(ALLOW_SLOW_ENV, raising=False)
    before = mixprec.global_policy()
    yield
    mixprec.set_global_policy(before)
