"""`once router` end to end: a client -> the router served as a once engine -> two once
engine servers, one of which dies."""

import contextlib

import pytest

from once.engine.scripted import ScriptedEngine
from once.engine_http.client import RemoteEngineClient
from once.engine_http.server import build_engine_app
from once.protocol.errors import EngineDeadError
from once.router.replicas import PrefillSpeedMeter
from once.router.serve import build_parser, build_router, main
from tests.router.fake_vllm import serve_app
from tests.router.fakes import collect, make_request

PROMPT = list(range(1, 49))


@contextlib.asynccontextmanager
async def router_over_http(engine):
    """A router over `engine` served by `once engine`'s app, through a 2-connection pool:
    a connection that a finished request keeps makes the third request wait forever."""
    import httpx

    from once.router.replicas import Replica
    from once.router.router import Router, RouterConfig

    async with serve_app(build_engine_app(engine, model_name="s")) as (url, _):
        pool = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=2))
        client = RemoteEngineClient(url, transport=pool)
        router = Router(
            [Replica("r", client, index=0, block_size=16, kv_blocks_total=64)],
            RouterConfig(policy="round_robin"),
        )
        try:
            yield router
        finally:
            await router.aclose()
            await client.aclose()


def test_parser_builds_the_configured_router():
    args = build_parser().parse_args(
        [
            "--engine-url", "http://a:1", "--openai-url", "http://b:2", "--openai-model", "m",
            "--policy", "cache_aware", "--policy-param", "cache_threshold=0.5",
            "--policy-param", "balance_abs_threshold=32", "--block-size", "32",
        ]
    )  # fmt: skip
    router = build_router(args)
    assert [r.name for r in router.replicas] == ["http://a:1", "http://b:2"]
    assert router.policy.cache_threshold == 0.5 and router.policy.balance_abs_threshold == 32
    assert router.config.block_size == 32


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no replica
        ["--openai-url", "http://b:2"],  # no model name
        ["--engine-url", "http://a:1", "--policy", "nope"],
        ["--engine-url", "http://a:1", "--policy-param", "x"],
        ["--engine-url", "http://a:1", "--policy-param", "x=abc"],
        ["--engine-url", "http://a:1", "--policy", "once", "--policy-param", "bogus=1"],
    ],
)
def test_bad_command_lines_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == 2
    assert "usage: once router" in capsys.readouterr().err


def test_prefill_speed_meter_separates_overhead_from_speed():
    meter = PrefillSpeedMeter(prior_tokens_per_s=1000.0)
    assert meter.tokens_per_s == 1000.0
    # ttft = 50 ms overhead + work / 2000 tok/s: mostly cache hits (little work) included.
    for work in [10, 20, 2000, 15, 4000, 30, 1000, 12] * 3:
        meter.add(work, 0.05 + work / 2000)
    assert meter.tokens_per_s == pytest.approx(2000, rel=0.01)
    single = PrefillSpeedMeter(prior_tokens_per_s=1000.0)
    single.add(500, 1.0)  # one sample: the plain ratio
    assert single.tokens_per_s == pytest.approx(500)


async def test_router_served_as_an_engine_survives_a_dead_replica():
    engines = [ScriptedEngine(token_latency_s=0.001), ScriptedEngine(token_latency_s=0.001)]
    stack = contextlib.AsyncExitStack()
    async with stack, serve_app(build_engine_app(engines[1], model_name="s")) as (url1, _):
        url0, _ = await stack.enter_async_context(
            serve_app(build_engine_app(engines[0], model_name="s"))
        )
        args = build_parser().parse_args(
            ["--engine-url", url0, "--engine-url", url1, "--policy", "round_robin"]
            + ["--health-interval", "60"]
        )
        router = build_router(args)
        async with serve_app(build_engine_app(router, model_name="once-router")) as (url, _):
            async with RemoteEngineClient(url) as client:
                await client.check_health()
                _, tokens = await collect(client, make_request("a", PROMPT, forced=[4, 5]))
                assert tokens == [4, 5]
                await stack.aclose()  # replica 0's server goes away
                for i in range(3):
                    _, tokens = await collect(client, make_request(f"b{i}", PROMPT, forced=[6]))
                    assert tokens == [6]
                stats = await client.stats()
                assert stats["num_healthy_replicas"] == 1 and stats["num_retries"] == 1
                assert stats["replicas"][url0]["healthy"] is False
                # With every replica gone, the router's health check and requests fail
                # with the retriable engine_unavailable error.
                router.replicas[1].mark_down("test")
                with pytest.raises(EngineDeadError):
                    await client.check_health()
                with pytest.raises(EngineDeadError):
                    await collect(client, make_request("c", PROMPT))
        await router.aclose()


async def test_routed_http_streams_give_their_connections_back():
    """More requests than the replica client's connection pool holds: each finished
    stream must hand its connection back (a leak hangs the next request forever)."""
    import asyncio

    async with router_over_http(ScriptedEngine(token_latency_s=0.0)) as router:

        async def run(request_id):
            request = make_request(request_id, PROMPT, forced=[4, 5])
            # Read up to the finished delta and stop, as the gateway does.
            async for delta in router.generate(request):
                if delta.finished:
                    break

        async with asyncio.timeout(20):
            for i in range(6):
                await run(f"r{i}")


async def test_a_reader_cancelled_after_the_finished_delta_gives_the_connection_back():
    """The gateway cancels its engine reader once the finished delta is in hand, while the
    router is still closing the replica's HTTP stream. The close must survive that cancel:
    cut, it leaves the connection checked out of the pool (its socket in CLOSE-WAIT), and
    with a pool of 2 the third request waits forever."""
    import asyncio

    async with router_over_http(ScriptedEngine(token_latency_s=0.001)) as router:

        async def read(request, finished: asyncio.Event):
            async for delta in router.generate(request):
                if delta.finished:
                    finished.set()  # and read on, into the router's close of the stream

        async with asyncio.timeout(5):
            for i in range(6):
                finished = asyncio.Event()
                reader = asyncio.create_task(read(make_request(f"r{i}", PROMPT), finished))
                await finished.wait()
                reader.cancel()  # as the gateway's StreamRunner does after the last delta
                await asyncio.gather(reader, return_exceptions=True)


async def test_a_drained_connection_pool_is_engine_unavailable_not_a_hang():
    """Every pooled connection held (here by one slow stream, pool of 1): the next request
    waits `pool_timeout_s` for a connection, then fails as `engine_unavailable`."""
    import asyncio

    import httpx

    from once.engine_http.client import DEFAULT_TIMEOUT, POOL_TIMEOUT_S

    assert DEFAULT_TIMEOUT.pool == POOL_TIMEOUT_S < float("inf")  # every client, by default
    engine = ScriptedEngine(token_latency_s=0.5)
    async with serve_app(build_engine_app(engine, model_name="s")) as (url, _):
        pool = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=1))
        timeout = httpx.Timeout(None, connect=5.0, pool=0.2)
        client = RemoteEngineClient(url, timeout=timeout, transport=pool)
        try:
            holder = client.generate(make_request("holder", PROMPT, max_tokens=20))
            await anext(holder)  # the pool's only connection is now streaming
            async with asyncio.timeout(10):
                with pytest.raises(EngineDeadError, match="PoolTimeout") as excinfo:
                    await collect(client, make_request("starved", PROMPT))
            assert excinfo.value.code == "engine_unavailable"
            await holder.aclose()
        finally:
            await client.aclose()
