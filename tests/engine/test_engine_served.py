"""The real AsyncEngine behind `once engine`'s HTTP app, through RemoteEngineClient."""

from once.engine.async_engine import AsyncEngine
from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine_http.client import RemoteEngineClient
from once.protocol.engine import GenerateRequest, SamplingParams

from .test_server import collect, serve


async def test_real_engine_over_http_matches_in_process(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=64)
    request = GenerateRequest("r", (3, 4, 5, 6, 7), SamplingParams(temperature=0, max_tokens=6))
    want = LLMEngine(config).generate([request])["r"]
    engine = AsyncEngine.from_config(config)
    try:
        async with serve(engine) as base_url, RemoteEngineClient(base_url) as client:
            got = await collect(client, request)
            again = await collect(
                client,
                GenerateRequest("r2", (3, 4, 5, 6, 7, 8, 9, 10, 11), SamplingParams(max_tokens=2)),
            )
            stats = await client.stats()
    finally:
        await engine.close()
    assert [t for d in got for t in d.token_ids] == [t for d in want for t in d.token_ids]
    assert again[0].num_cached_tokens == 4  # the one full block of the first prompt
    assert stats["num_requests_finished"] == 2 and stats["num_kv_blocks_used"] == 0
