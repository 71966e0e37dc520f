import asyncio

import pytest

from once.engine.scripted import ScriptedEngine, scripted_logprobs
from once.engine_http.client import RemoteEngineClient
from once.engine_http.server import build_engine_app
from once.gateway.testing import serve_app
from once.protocol.engine import EngineClient, GenerateRequest, SamplingParams
from once.protocol.errors import ContextLengthExceededError, EngineDeadError
from once.router import Replica, Router, RouterConfig, make_policy
from tests.router.fakes import KillableEngine, PacedPrefillEngine, collect, make_request

PROMPT = list(range(1, 65))  # 4 full blocks of 16


def test_router_config_rejects_bad_values():
    with pytest.raises(ValueError):
        RouterConfig(max_attempts=0)
    with pytest.raises(ValueError):
        RouterConfig(first_delta_timeout_s=0)
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router.over([ScriptedEngine()], RouterConfig(policy="nope"))
    with pytest.raises(ValueError, match="at least one"):
        Router([])
    with pytest.raises(ValueError, match="block size"):
        Router([Replica("a", ScriptedEngine(), index=0, block_size=8)])


async def test_router_is_an_engine_client_and_streams_a_replica_output():
    engines = [ScriptedEngine(), ScriptedEngine()]
    router = Router.over(engines, RouterConfig(policy="round_robin"))
    assert isinstance(router, EngineClient)
    deltas, tokens = await collect(router, make_request("a", PROMPT, forced=[7, 8, 9]))
    assert tokens == [7, 8, 9] and deltas[-1].finish_reason == "length"
    await collect(router, make_request("b", PROMPT, forced=[1]))
    assert [len(e.requests) for e in engines] == [1, 1]
    stats = await router.stats()
    assert stats["num_requests"] == stats["num_finished"] == 2
    assert stats["replicas"]["replica-0"]["num_routed"] == 1
    assert stats["num_running"] == 0
    assert [name for _, name in router.decisions] == ["replica-0", "replica-1"]
    # Each decision keeps what the policy saw: both replicas, the second one after the
    # first replica had served the same prompt (its blocks now indexed there).
    first, second = router.decision_notes
    assert [first["request_id"], first["replica"], second["replica"]] == [
        "a",
        "replica-0",
        "replica-1",
    ]
    assert set(second["views"]) == {"replica-0", "replica-1"} and second["prompt_tokens"] == 64
    assert second["views"]["replica-0"][1] > 0 == second["views"]["replica-1"][1]
    await router.aclose()


async def test_logprobs_pass_through_in_process_and_remote_replicas_and_a_retry():
    dead, local, served = KillableEngine(), ScriptedEngine(tokens_per_delta=2), ScriptedEngine()
    dead.kill()
    async with serve_app(build_engine_app(served, model_name="scripted")) as (url, _):
        async with RemoteEngineClient(url) as remote:
            router = Router.over([dead, local, remote], RouterConfig(policy="round_robin"))
            sampling = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2)
            for rid in ("a", "b", "c"):  # a dead replica first: retried elsewhere
                request = GenerateRequest(rid, tuple(PROMPT), sampling, forced_output_ids=(5, 6, 7))
                deltas, tokens = await collect(router, request)
                assert tokens == [5, 6, 7]
                got = [entry for d in deltas for entry in d.logprobs or []]
                assert got == scripted_logprobs([5, 6, 7], 2)
            plain, _ = await collect(router, make_request("d", PROMPT, forced=[5]))
            assert all(d.logprobs is None for d in plain)
            await router.aclose()
    asked = [r for r in local.requests + served.requests if r.request_id != "d"]
    assert local.requests and served.requests  # both kinds of replica served some
    assert sorted(r.request_id for r in asked) == ["a", "b", "c"]
    assert all(r.sampling.logprobs == 2 for r in asked)


@pytest.mark.parametrize("policy", ["once", "cache_aware", "dynamo", "session_affinity"])
async def test_conversation_turns_follow_their_cache(policy):
    engines = [ScriptedEngine(), ScriptedEngine(), ScriptedEngine()]
    router = Router.over(engines, RouterConfig(policy=policy))
    history = list(PROMPT)
    for turn in range(4):
        request = make_request(f"t{turn}", history, forced=[100 + turn] * 20, session_key="s")
        deltas, tokens = await collect(router, request)
        if turn:
            # The whole previous turn (prompt + output) was cached on the chosen replica.
            assert deltas[0].num_cached_tokens >= len(history) - 16 - 20
        history = history + tokens + [200 + turn] * 10
    assert len({name for _, name in router.decisions}) == 1
    stats = await router.stats()
    assert stats["prefix_cache_hit_rate"] > 0.5
    await router.aclose()


async def test_request_errors_reach_the_caller_without_marking_the_replica_down():
    router = Router.over([ScriptedEngine(max_model_len=10), ScriptedEngine(max_model_len=10)])
    with pytest.raises(ContextLengthExceededError):
        await collect(router, make_request("long", PROMPT))
    stats = await router.stats()
    assert stats["num_healthy_replicas"] == 2 and stats["num_retries"] == 0
    assert stats["num_running"] == 0
    await router.aclose()


async def test_a_dead_replica_is_skipped_and_the_request_retried_elsewhere():
    dead, alive = KillableEngine(), KillableEngine()
    dead.kill()
    router = Router.over([dead, alive], RouterConfig(policy="round_robin"))
    for i in range(3):
        _, tokens = await collect(router, make_request(f"r{i}", PROMPT, forced=[5, 6]))
        assert tokens == [5, 6]
    assert dead.num_generate_calls == 1  # tried once, then marked down
    stats = await router.stats()
    assert stats["num_retries"] == 1
    assert stats["replicas"]["replica-0"]["healthy"] is False
    assert "connection refused" in stats["replicas"]["replica-0"]["down_reason"]
    await router.aclose()


async def test_a_replica_killed_mid_stream_gives_a_clean_retriable_error():
    engine = KillableEngine(token_latency_s=0.01)
    other = KillableEngine()
    router = Router.over([engine, other], RouterConfig(policy="round_robin"))
    stream = router.generate(make_request("mid", PROMPT, forced=list(range(50))))
    first = await anext(stream)
    assert first.token_ids == [0]
    engine.kill()
    with pytest.raises(EngineDeadError, match="can be retried") as excinfo:
        async for _ in stream:
            pass
    assert excinfo.value.status == 503
    # The next request goes to the surviving replica and completes.
    _, tokens = await collect(router, make_request("next", PROMPT, forced=[1, 2]))
    assert tokens == [1, 2] and other.num_generate_calls == 1
    assert (await router.stats())["num_failed_after_stream"] == 1
    await router.aclose()


async def test_a_silent_replica_times_out_and_the_request_moves():
    slow = ScriptedEngine(ttft_s=5.0)
    fast = ScriptedEngine()
    config = RouterConfig(policy="round_robin", first_delta_timeout_s=0.05)
    router = Router.over([slow, fast], config)
    _, tokens = await collect(router, make_request("t", PROMPT, forced=[3]))
    assert tokens == [3]
    assert slow.finish_reasons == {"t": "abort"}  # the timed-out request was cancelled
    assert (await router.stats())["replicas"]["replica-0"]["healthy"] is False
    await router.aclose()


async def test_a_replica_rejoins_when_its_health_probe_succeeds():
    engines = [KillableEngine(), KillableEngine()]
    router = Router.over(engines, RouterConfig(policy="round_robin", health_interval_s=0.02))
    engines[0].kill()
    await collect(router, make_request("a", PROMPT, forced=[1]))
    assert router.replicas[0].healthy is False
    await router.check_replicas()
    assert router.replicas[0].healthy is False  # still dead: stays out
    engines[0].revive()
    for _ in range(1000):  # the background health loop brings it back (10 s at most)
        if router.replicas[0].healthy:
            break
        await asyncio.sleep(0.01)
    assert router.replicas[0].healthy
    assert router.replicas[0].counters["num_rejoins"] == 1
    await collect(router, make_request("b", PROMPT, forced=[1]))
    await collect(router, make_request("c", PROMPT, forced=[1]))
    assert engines[0].num_generate_calls >= 2
    await router.aclose()


async def test_all_replicas_dead_is_a_clean_error():
    engines = [KillableEngine(), KillableEngine()]
    for engine in engines:
        engine.kill()
    router = Router.over(engines)
    with pytest.raises(EngineDeadError):
        await collect(router, make_request("x", PROMPT))
    with pytest.raises(EngineDeadError, match="no healthy replica"):
        await collect(router, make_request("y", PROMPT))
    assert (await router.stats())["num_healthy_replicas"] == 0
    await router.aclose()


async def test_abort_reaches_the_replica_serving_the_request():
    engines = [ScriptedEngine(token_latency_s=0.05), ScriptedEngine(token_latency_s=0.05)]
    router = Router.over(engines)
    stream = router.generate(make_request("ab", PROMPT, forced=list(range(40))))
    await anext(stream)
    await router.abort("ab")
    rest = [delta async for delta in stream]
    assert rest[-1].finish_reason == "abort"
    assert sum(len(e.requests) for e in engines) == 1
    assert (await router.stats())["num_running"] == 0
    await router.aclose()


async def test_closing_the_stream_early_frees_the_replica():
    engine = ScriptedEngine(token_latency_s=0.05)
    router = Router.over([engine])
    stream = router.generate(make_request("c", PROMPT, forced=list(range(40))))
    await anext(stream)
    await stream.aclose()
    assert engine.finish_reasons == {"c": "abort"}
    assert (await router.stats())["num_running"] == 0
    await router.aclose()


async def test_killing_a_replica_during_a_concurrent_run_loses_no_session():
    engines = [KillableEngine(ttft_s=0.004, token_latency_s=0.002) for _ in range(3)]
    router = Router.over(engines, RouterConfig(policy="once"))
    outcomes: list[str] = []
    turns_done: dict[int, int] = {}

    async def session(s: int) -> None:
        await asyncio.sleep(0.003 * s)  # staggered, so replicas hold requests in all phases
        history = [1000 + s] * 40
        turn = 0
        while turn < 6:
            request_id = f"s{s}-t{turn}-{len(outcomes)}"
            request = make_request(request_id, history, forced=[s] * 10, session_key=f"s{s}")
            try:
                _, tokens = await collect(router, request)
            except EngineDeadError:
                outcomes.append("retriable")
                continue  # the client retries the same turn, as the error invites
            outcomes.append("ok")
            history += tokens + [7] * 5
            turn += 1
        turns_done[s] = turn

    async def killer() -> None:
        # Kill replica-1 when it holds one request still in prefill and one streaming.
        flights = router.replicas[1].in_flight.values
        for _ in range(2000):
            phases = {flight.first_delta_at is None for flight in flights()}
            if phases == {True, False}:
                break
            await asyncio.sleep(0.0005)
        engines[1].kill()

    await asyncio.gather(*(session(s) for s in range(12)), killer())
    # Every session finished every turn; failures were clean retriable errors only.
    assert turns_done == dict.fromkeys(range(12), 6)
    stats = await router.stats()
    assert outcomes.count("retriable") == stats["num_failed_after_stream"] >= 1
    assert stats["num_retries"] >= 1  # requests still in prefill moved silently
    assert stats["replicas"]["replica-1"]["healthy"] is False
    assert stats["num_running"] == 0
    await router.aclose()


async def test_once_policy_measures_a_slow_replica_and_favours_the_fast_one():
    # Slow enough that a sample (0.05-0.5 s) is far above a busy machine's timer jitter.
    slow = PacedPrefillEngine(prefill_tokens_per_s=2_000)
    fast = PacedPrefillEngine(prefill_tokens_per_s=4_000)
    router = Router.over([slow, fast], RouterConfig(policy="round_robin"))
    # Warm-up: alternate requests of different sizes over both replicas.
    for i in range(16):
        await collect(router, make_request(f"w{i}", [i] * (200 + 50 * i), forced=[1]))
    router.policy = make_policy("once")
    speeds = [replica.prefill_meter.tokens_per_s for replica in router.replicas]
    assert speeds[1] / speeds[0] == pytest.approx(2.0, rel=0.3)
    # New sessions, one at a time: the fast replica is predicted faster for every cold one.
    for i in range(6):
        await collect(router, make_request(f"n{i}", [500 + i] * 400, forced=[1]))
    assert [name for _, name in list(router.decisions)[-6:]] == ["replica-1"] * 6
    await router.aclose()


async def test_a_hung_health_check_counts_as_down():
    class Hung(ScriptedEngine):
        async def check_health(self):
            await asyncio.sleep(60)

    router = Router.over([Hung(), ScriptedEngine()], RouterConfig(probe_timeout_s=0.05))
    router.replicas[0].mark_down("test")
    await asyncio.wait_for(router.check_replicas(), 1.0)
    assert router.replicas[0].healthy is False
    # Without check_health, stats() is the probe, and a dead engine loop fails it.
    router.replicas[1].mark_down("test")
    await router.check_replicas()
    assert router.replicas[1].healthy is True
    await router.aclose()


async def test_stats_compare_the_index_prediction_with_the_engine_report():
    router = Router.over([ScriptedEngine()])
    await collect(router, make_request("a", PROMPT, forced=[1]))
    await collect(router, make_request("b", PROMPT, forced=[1]))
    replica = (await router.stats())["replicas"]["replica-0"]
    # b's prompt is 4 full blocks; the last token is always computed, so both the index
    # and the engine count 3 blocks (48 tokens) served from cache.
    assert replica["num_predicted_cached_tokens"] == 48
    assert replica["num_cached_tokens"] == 48
    assert replica["num_prompt_tokens"] == 128
    await router.aclose()


async def test_a_pause_hint_goes_to_the_replica_of_the_sessions_last_call():
    engines = [ScriptedEngine(), ScriptedEngine()]
    router = Router.over(engines, RouterConfig(policy="round_robin"))
    await collect(router, make_request("a", PROMPT, forced=[1], session_key="s-a"))
    await collect(router, make_request("b", PROMPT, forced=[1], session_key="s-b"))
    await router.pause_session("s-b", 3.0)
    await router.pause_session("s-a", 1.0)
    await router.pause_session("never-seen", 1.0)  # no replica holds it: dropped
    assert [e.pauses for e in engines] == [[("s-a", 1.0)], [("s-b", 3.0)]]
    await router.aclose()
