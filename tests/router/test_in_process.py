"""The router over real in-process engines (the tiny random model): exact prefix indices
fed by the engines' KV events."""

import pytest

from once.engine.async_engine import AsyncEngine
from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.testing import make_tiny_model
from once.protocol.kv_blocks import block_hashes
from once.router import Router, RouterConfig
from once.router.replicas import in_process_replica
from tests.router.fakes import collect, make_request


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


async def test_exact_index_follows_the_engines_kv_events(tiny_model_dir):
    engines = [
        AsyncEngine(
            LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=64))
        )
        for _ in range(2)
    ]
    replicas = [in_process_replica(f"e{i}", e, index=i) for i, e in enumerate(engines)]
    router = Router(replicas, RouterConfig(policy="once", block_size=4))
    try:
        prompt = list(range(3, 40))  # 9 full blocks of 4
        deltas, tokens = await collect(router, make_request("a", prompt, max_tokens=4))
        assert len(tokens) == 4
        first = router.decisions[-1][1]
        home = next(r for r in replicas if r.name == first)
        home.sync_index()
        # The engine reported the prompt's blocks (and maybe output blocks) as stored.
        assert home.prefix_index.match(router_hashes(prompt)) == 9
        other = next(r for r in replicas if r is not home)
        other.sync_index()
        assert len(other.prefix_index) == 0
        # The second turn is routed to the replica that holds its prefix, and hits it.
        history = prompt + tokens + [5, 6, 7]
        deltas, _ = await collect(router, make_request("b", history, max_tokens=2))
        assert router.decisions[-1][1] == first
        assert deltas[0].num_cached_tokens >= 36
    finally:
        await router.aclose()
        for engine in engines:
            await engine.close()


def router_hashes(prompt):
    return tuple(block_hashes(prompt, 4))
