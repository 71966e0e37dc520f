"""A real gateway (uvicorn on a free loopback port) around a scripted engine.

The model side is SmolLM2's real tokenizer and chat template (the converted model folder),
with `ScriptedEngine` producing the token ids (see `once.gateway.testing`).
"""

import pytest

from once.gateway.model import ModelRuntime
from once.gateway.testing import DEFAULT_MODEL, load_runtime, scripted_texts, serve_gateway

MODEL = DEFAULT_MODEL
__all__ = ["MODEL", "scripted_texts", "serve_gateway"]


@pytest.fixture(scope="session")
def runtime() -> ModelRuntime:
    return load_runtime(MODEL)
