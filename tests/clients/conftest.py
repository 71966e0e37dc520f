import pytest

from once.gateway.model import ModelRuntime
from once.gateway.testing import DEFAULT_MODEL, load_runtime


@pytest.fixture(scope="session")
def runtime() -> ModelRuntime:
    return load_runtime(DEFAULT_MODEL)
