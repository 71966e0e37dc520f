"""The router over two live vLLM servers: vLLM's own KV events feed the exact index and the
routing follows them, the approximate index works without events, load comes from vLLM's
/metrics, and a killed server fails over and rejoins when it comes back.

The failover test runs last in this file (it kills and restarts a shared server)."""

import asyncio
import random
import time

import httpx
import pytest

from once.protocol.engine import GenerateRequest, SamplingParams
from once.protocol.errors import EngineDeadError
from once.protocol.kv_blocks import block_hashes
from once.router.openai_replica import OpenAICompletionsClient
from once.router.replicas import Replica
from once.router.router import Router, RouterConfig
from once.router.serve import build_parser, build_router, event_index
from once.router.vllm_metrics import parse_vllm_metrics
from tests.vllm.conftest import BLOCK_SIZE, MODEL

DEADLINE_S = 120.0  # polls on a loaded machine; a quiet one answers in well under a second
SALT = "tenant-a"


def prompt_of(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(100, 40000) for _ in range(length))


def request(request_id, prompt, max_tokens=4, salt=SALT, ignore_eos=True) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    return GenerateRequest(request_id, tuple(prompt), sampling, cache_salt=salt)


async def run(router, req) -> list:
    return [delta async for delta in router.generate(req)]


def make_router(servers, *, exact=True, policy="once") -> Router:
    replicas = []
    for i, server in enumerate(servers):
        client = OpenAICompletionsClient(server.url, MODEL)
        events = event_index(server.kv_events_endpoint) if exact else {}
        replicas.append(
            Replica(server.name, client, index=i, block_size=BLOCK_SIZE, kv_blocks_total=180,
                    **events)
        )  # fmt: skip
    config = RouterConfig(policy=policy, block_size=BLOCK_SIZE, health_interval_s=0.5)
    return Router(replicas, config)


async def until(condition, what: str, deadline_s: float = DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def served_by(router: Router, request_id: str) -> Replica:
    name = next(name for rid, name in reversed(router.decisions) if rid == request_id)
    return next(replica for replica in router.replicas if replica.name == name)


async def test_vllm_kv_events_feed_the_exact_index_and_routing_follows_them(vllm_pair):
    router = make_router(vllm_pair)
    await router.start()
    try:
        # A first prompt per attempt: ZMQ drops what is published before the subscription
        # joins, so a prompt whose events were missed is replaced by a fresh one.
        for attempt in range(5):
            prompt = prompt_of(attempt, 200)  # 6 full blocks of 32 and 8 tokens
            await run(router, request(f"first-{attempt}", prompt))
            holder = served_by(router, f"first-{attempt}")
            hashes = block_hashes(prompt, BLOCK_SIZE, SALT)
            index = holder.prefix_index
            try:
                await until(lambda: index.match(hashes) == 6, "KV events", 20)  # noqa: B023
                break
            except AssertionError:
                continue
        else:
            raise AssertionError("no KV events reached the index in 5 attempts")
        assert holder.prefix_index.kind == "exact"
        other = next(replica for replica in router.replicas if replica is not holder)
        assert other.prefix_index.match(hashes) == 0

        # The next turn carries the first as its prefix: the router sends it to the holder,
        # and vLLM's own usage confirms the 6 blocks were there.
        deltas = await run(router, request("second", prompt + prompt_of(99, 40)))
        assert served_by(router, "second") is holder
        assert deltas[-1].num_cached_tokens == 6 * BLOCK_SIZE
        # Another tenant's salt names other blocks: no match anywhere.
        other_salt = block_hashes(prompt, BLOCK_SIZE, "tenant-b")
        assert all(replica.prefix_index.match(other_salt) == 0 for replica in router.replicas)
    finally:
        await router.aclose()


async def test_without_events_the_approximate_index_keeps_sessions_together(vllm_pair):
    router = make_router(vllm_pair, exact=False)
    try:
        prompt = prompt_of(7, 150)
        await run(router, request("a", prompt, salt="approx"))
        deltas = await run(router, request("b", prompt + prompt_of(8, 30), salt="approx"))
        assert router.replicas[0].prefix_index.kind == "approximate"
        assert served_by(router, "b") is served_by(router, "a")
        assert deltas[-1].num_cached_tokens == 4 * BLOCK_SIZE
    finally:
        await router.aclose()


async def test_load_from_vllm_metrics_counts_requests_the_router_did_not_send(vllm_pair):
    router = make_router(vllm_pair)
    await router.start()
    server = vllm_pair[0]
    body = {"model": MODEL, "prompt": list(prompt_of(3, 50)), "max_tokens": 2000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    try:
        async with httpx.AsyncClient(timeout=None) as http:
            async with http.stream("POST", f"{server.url}/v1/completions", json=body) as reply:
                lines = reply.aiter_lines()
                await anext(lines)  # running now
                await until(lambda: router.replicas[0].num_external_requests >= 1, "/metrics")
                view = router.replicas[0].view((), 0)
                assert view.num_running >= 1  # what the policies weigh
                assert router.replicas[1].num_external_requests == 0
    finally:
        await router.aclose()


def test_once_router_reads_block_size_and_pool_from_vllm(vllm_pair):
    urls = [arg for server in vllm_pair for arg in ("--openai-url", server.url)]
    events = [
        arg for server in vllm_pair for arg in ("--openai-kv-events", server.kv_events_endpoint)
    ]
    args = build_parser().parse_args([*urls, "--openai-model", MODEL, *events])
    router = build_router(args)
    assert router.config.block_size == BLOCK_SIZE  # vLLM's, from its cache_config_info
    metrics = parse_vllm_metrics(httpx.get(f"{vllm_pair[0].url}/metrics").text)
    assert router.replicas[0].kv_blocks_total == metrics.num_blocks > 0
    assert all(replica.prefix_index.kind == "exact" for replica in router.replicas)


async def test_a_killed_server_fails_over_and_rejoins(vllm_pair):
    """Round robin over the two: `streaming` (tokens already out) and `waiting` (in prefill)
    on one server when it is killed. The first ends with a retriable engine_unavailable, the
    second is sent to the other server without its caller noticing. The killed server comes
    back on the same port and socket, rejoins, and its index follows its events again."""
    router = make_router(vllm_pair, policy="round_robin")
    await router.start()
    try:
        streaming = router.generate(request("streaming", prompt_of(11, 40), max_tokens=3000))
        first = await anext(streaming)  # round robin's first pick holds it
        victim = served_by(router, "streaming")
        await run(router, request("between", prompt_of(12, 40)))  # to the other one
        waiting = asyncio.create_task(run(router, request("waiting", prompt_of(13, 3000))))
        await until(lambda: any(rid == "waiting" for rid, _ in router.decisions), "dispatch")
        assert served_by(router, "waiting") is victim
        server = vllm_pair[victim.index]
        server.kill()

        with pytest.raises(EngineDeadError) as failure:
            async for _ in streaming:
                pass
        assert failure.value.code == "engine_unavailable" and first.token_ids
        deltas = await waiting  # retried: the caller sees a whole answer
        assert sum(len(d.token_ids) for d in deltas) == 4
        assert served_by(router, "waiting") is not victim
        assert router.counters["num_retries"] >= 1 and not victim.healthy

        await server.restart()
        await until(lambda: victim.healthy, "the rejoin")
        for i in range(2):  # round robin: one of the two lands on the rejoined server
            await run(router, request(f"after-{i}", prompt_of(14 + i, 100)))
        hashes = [block_hashes(prompt_of(14 + i, 100), BLOCK_SIZE, SALT) for i in range(2)]
        await until(
            lambda: any(victim.prefix_index.match(h) == 3 for h in hashes), "events after rejoin"
        )
        assert victim.counters["num_rejoins"] == 1
    finally:
        await router.aclose()
