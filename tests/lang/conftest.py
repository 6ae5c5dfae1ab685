"""Fixtures for the program-DSL tests: a fresh instant FakeEngine per test."""

import pytest

from deepinfer.lang.testing import FakeEngine


@pytest.fixture
def engine():
    return FakeEngine()
