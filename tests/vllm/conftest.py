"""Two live vLLM servers (vLLM's CPU build, from `make vllm`), shared by every test here.

- `vllm-0` is a plain server: prefix caching, KV events over ZMQ, llguidance for
  structured outputs;
- `vllm-1` also runs with `--skip-tokenizer-init`: it has no tokenizer at all, so a
  request it serves was never tokenized (or rendered) by vLLM.
Both run the converted SmolLM2 folder at fp32 in eager mode, one thread each, with a
256 MiB KV cache. They start once per session (about 30 s each on a quiet machine, all at
once) and stop at its end; a test that kills one restarts it before it returns. Without
vLLM's virtualenv the tests skip, except in CI (CI=true), where that is a failure.
"""

import os

import pytest

from once.engine.loader import resolve_model_path
from once.fleet.vllm_server import VllmServer, VllmSpec, vllm_missing_reason, vllm_servers
from once.model_files import DEFAULT_MODEL

MODEL = DEFAULT_MODEL  # vLLM serves it under once's own name
BLOCK_SIZE = 32


@pytest.fixture(scope="session")
def vllm_pair() -> list[VllmServer]:
    reason = vllm_missing_reason()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    folder = resolve_model_path(MODEL)
    plain = VllmSpec(folder, served_model_name=MODEL, kv_cache_mib=256, threads=1)
    tokenless = VllmSpec(
        folder, served_model_name=MODEL, kv_cache_mib=256, threads=1, skip_tokenizer_init=True
    )
    with vllm_servers([plain, tokenless]) as servers:
        yield servers
