"""One default-model engine for the whole folder, set as the DSL's default backend."""

import pytest

import deepinfer as di


@pytest.fixture(scope="session")
def engine(default_engine):
    di.set_default_backend(default_engine)
    return default_engine
