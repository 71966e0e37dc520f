import pytest

from once.engine.testing import make_tiny_model, reference_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_dir):
    return reference_model(tiny_model_dir)
