"""The KV cache is sized to the context asked for, or the engine refuses to start.

Issue 33: `--max-model-len 32768` on SmolLM2-135M silently became 23,296, the tokens a
1 GiB cache (the old fixed default) holds. Auto (no size set): the cache holds one request
of the context asked for. A size set too small for the context asked for is refused with
a message naming both settings. Without a context asked for, the model's own is cut to
what the cache holds (a warning), as before.
"""

import subprocess
import sys

import pytest
import torch

from once.engine.attention import PagedKVCache
from once.engine.config import (
    DEFAULT_KV_CACHE_GIB,
    EngineConfig,
    EngineSettingError,
    kv_cache_blocks,
)
from once.engine.core import LLMEngine
from once.engine.loader import resolve_model_path
from once.model_files import DEFAULT_MODEL


def test_auto_is_one_gib_or_one_request_of_the_context_asked_for():
    bytes_per_block = 16 * 46080  # SmolLM2-135M in fp32: 45 KiB a token
    one_gib = int(DEFAULT_KV_CACHE_GIB * 2**30 // bytes_per_block)
    assert kv_cache_blocks(EngineConfig(), bytes_per_block) == one_gib  # 23,296 tokens
    assert kv_cache_blocks(EngineConfig(max_model_len=8192), bytes_per_block) == one_gib
    assert kv_cache_blocks(EngineConfig(max_model_len=32768), bytes_per_block) == 2048
    assert kv_cache_blocks(EngineConfig(max_model_len=32769), bytes_per_block) == 2049
    set_small = EngineConfig(max_model_len=32768, kv_cache_gib=0.5)
    assert kv_cache_blocks(set_small, bytes_per_block) == int(0.5 * 2**30 // bytes_per_block)
    assert kv_cache_blocks(EngineConfig(num_kv_blocks=7), bytes_per_block) == 7


@pytest.mark.parametrize("bad", [{"kv_cache_gib": -1.0}, {"kv_cache_gib": float("nan")},
                                 {"num_kv_blocks": -1}, {"max_model_len": -5}])  # fmt: skip
def test_negative_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        EngineConfig(**bad)


def test_a_set_cache_too_small_for_the_context_asked_is_refused(tiny_model_dir):
    bytes_per_block = tiny_bytes_per_block(tiny_model_dir)
    config = EngineConfig(
        model=str(tiny_model_dir), max_model_len=256, kv_cache_gib=8 * bytes_per_block / 2**30
    )
    with pytest.raises(EngineSettingError, match="--max-model-len 256") as refused:
        LLMEngine(config)
    assert "holds 128 tokens" in str(refused.value) and "--kv-cache-gib" in str(refused.value)


def test_the_models_own_context_is_cut_to_a_set_cache(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=16))
    assert engine.max_model_len == 64


def tiny_bytes_per_block(folder) -> int:
    c = LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=64)).model_config
    return PagedKVCache.bytes_per_block(c.num_layers, 16, c.num_kv_heads, c.head_dim, torch.float32)


@pytest.mark.slow
def test_max_model_len_32768_is_served_in_full():
    folder = resolve_model_path(DEFAULT_MODEL)
    # cpu_gemm="torch": no packed second copy of the weights; the cache is what is checked.
    engine = LLMEngine(EngineConfig(model=str(folder), max_model_len=32768, cpu_gemm="torch"))
    assert engine.max_model_len == 32768
    assert len(engine.pool.blocks) * engine.config.block_size >= 32768


@pytest.mark.slow
def test_the_command_line_refuses_a_cache_too_small_in_one_line():
    command = "import sys; from once.cli import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-c", command, "serve", "--no-safety", "--max-model-len", "32768",
         "--kv-cache-gib", "1", "--port", "9"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("once: error: the KV cache (--kv-cache-gib 1) holds 23296 tokens")
    assert "Traceback" not in done.stderr
