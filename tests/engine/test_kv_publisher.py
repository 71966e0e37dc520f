"""The engine's KV events over ZMQ in vLLM's wire format, read by the router's subscriber."""

import asyncio
import socket

from once.engine.async_engine import AsyncEngine
from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.kv.publisher import encode_batch
from once.protocol.engine import GenerateRequest, SamplingParams
from once.protocol.kv_blocks import AllBlocksCleared, BlockRemoved, BlockStored
from once.router.index import ExactPrefixIndex, decode_vllm_event_batch, zmq_event_subscriber


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_encoding_round_trips_through_the_vllm_decoder():
    import msgpack

    events = [
        BlockStored([11, 12], None, list(range(32)), 16, None, "CPU"),
        BlockRemoved([11], "CPU"),
        AllBlocksCleared(),
    ]
    assert decode_vllm_event_batch(msgpack.unpackb(encode_batch(events), raw=False)) == events


async def test_a_subscriber_follows_the_engines_prefix_cache_exactly(tiny_model_dir):
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    config = EngineConfig(
        model=str(tiny_model_dir), num_kv_blocks=12, max_model_len=192,
        kv_events_endpoint=endpoint,
    )  # fmt: skip
    engine = AsyncEngine(LLMEngine(config))
    index = ExactPrefixIndex()
    subscriber = asyncio.create_task(zmq_event_subscriber(endpoint, index))
    try:
        await asyncio.sleep(1.0)  # a ZMQ subscription takes a moment to reach the publisher

        async def run(request_id, prompt):
            request = GenerateRequest(request_id, tuple(prompt), SamplingParams(max_tokens=2))
            async for _ in engine.generate(request):
                pass

        async def index_matches_engine():
            cached = set(engine.engine.pool.cached)
            for _ in range(500):  # 10 s
                if set(index._blocks) == cached:
                    return cached
                await asyncio.sleep(0.02)
            raise AssertionError(f"index {sorted(index._blocks)} != engine {sorted(cached)}")

        await run("a", range(1, 65))  # 4 full blocks cached
        first = await index_matches_engine()
        assert len(first) == 4
        # Fill the 12-block cache with other prompts: the first one's blocks are evicted,
        # and the index drops them too.
        await run("b", range(65, 129))
        await run("c", range(129, 193))
        await run("d", [(7 * i) % 250 + 1 for i in range(64)])
        final = await index_matches_engine()
        assert engine.engine.pool.num_evictions > 0 and first - final  # removals followed
    finally:
        subscriber.cancel()
        await engine.close()
        engine.engine.kv_publisher.close()
