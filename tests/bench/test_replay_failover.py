"""Failover in a routed replay: a replica killed mid-replay loses no session.

The end-to-end test starts two real `once engine` processes (tiny model) behind the
router, replays several sessions at once (WebSocket, then HTTP), SIGKILLs the slow
replica while one of its responses is streaming, and checks that every call of every
session completed with the recorded output, and that every failure the client saw was the
retriable `engine_unavailable`. Two fast tests pin the parts: `ForcedOutputEngine`
re-queues the output of a failed request, and the `routing` section's figures.
"""

import asyncio
import time
from pathlib import Path

import pytest

from once.bench.replay.cli import build_parser, check_routing_args
from once.bench.replay.forced import ForcedOutputEngine
from once.bench.replay.plan import plan_session
from once.bench.replay.replay import CallRecord, replay_session
from once.bench.replay.routing import SINGLE, routed_runs, routing_section
from once.bench.replay.stacks import (
    NAIVE,
    ONCE,
    load_served_runtime,
    make_tiny_replay_model,
    open_stack,
)
from once.bench.traces import MINI_SWE_AGENT, Call, Session
from once.protocol.engine import FINISH_ERROR, GenerateRequest, SamplingParams, TokenDelta
from once.protocol.errors import EngineDeadError

MAX_LEN = 2048
SLOWDOWN = 8.0  # the replica to be killed streams slowly: the kill lands mid-response


class FailingThenFineEngine:
    """Fails its first request after one delta (a dead replica), ends the second with a
    finish reason `error`, and serves the rest; keeps the forced ids it was sent."""

    def __init__(self):
        self.forced_seen: list[tuple[int, ...]] = []

    async def generate(self, request: GenerateRequest):
        attempt = len(self.forced_seen)
        self.forced_seen.append(request.forced_output_ids)
        forced = list(request.forced_output_ids)
        yield TokenDelta(request.request_id, forced[:1], num_cached_tokens=0)
        if attempt == 0:
            raise EngineDeadError("replica died")
        if attempt == 1:
            yield TokenDelta(request.request_id, [], FINISH_ERROR, error={"code": "x"})
            return
        yield TokenDelta(request.request_id, forced[1:], "length")

    async def abort(self, request_id: str) -> None:
        pass

    async def stats(self) -> dict:
        return {}


async def test_forced_output_goes_back_to_the_front_when_a_request_fails():
    inner = FailingThenFineEngine()
    forced = ForcedOutputEngine(inner)
    forced.expect("s", [(1, 2, 3), (4, 5)])

    def request(n: int) -> GenerateRequest:
        return GenerateRequest(f"r{n}", (9, 9), SamplingParams(max_tokens=8), session_key="s")

    with pytest.raises(EngineDeadError):
        async for _ in forced.generate(request(0)):
            pass
    assert forced.remaining("s") == 2  # the first call's output is queued again
    deltas = [delta async for delta in forced.generate(request(1))]
    assert deltas[-1].finish_reason == FINISH_ERROR and forced.remaining("s") == 2
    deltas = [delta async for delta in forced.generate(request(2))]
    assert [t for d in deltas for t in d.token_ids] == [1, 2, 3]
    assert forced.remaining("s") == 1
    # A consumer that stops reading mid-stream (a cancelled call) also gives it back.
    stream = forced.generate(request(3))
    await anext(stream)
    await stream.aclose()
    assert forced.remaining("s") == 1
    assert inner.forced_seen == [(1, 2, 3), (1, 2, 3), (1, 2, 3), (4, 5)]


def _row(ttft_s: float, cached: int, replica: str | None = None, **extra) -> dict:
    row = {"ttft_s": ttft_s, "prompt_tokens": 100, "cached_tokens": cached}
    row["computed_tokens"] = 100 - cached
    if replica:
        row["replica"] = replica
    return {**row, **extra}


def test_routing_section_figures_from_hand_made_records():
    runs = routed_runs(
        ["once", "session_affinity", "round_robin"],
        replicas=2,
        slow_replicas=1,
        slowdown=2.0,
        threads=1,
    )
    assert [run.spec.name for run in runs] == [
        "once", "once/session_affinity", "once/round_robin", "naive", SINGLE,
    ]  # fmt: skip
    ttfts = [0.1 * (i + 1) for i in range(10)]  # p90 of 0.1..1.0 is 0.91
    records = {
        "once": {"s": [_row(t, 90, "replica-0") for t in ttfts]},
        "once/session_affinity": {"s": [_row(2 * t, 80, "replica-1") for t in ttfts]},
        "once/round_robin": {"s": [_row(t, 40, f"replica-{i % 2}") for i, t in enumerate(ttfts)]},
        "naive": {"s": [_row(t, 0, "replica-0") for t in ttfts]},
        SINGLE: {"s": [_row(t, 95) for t in ttfts]},
    }
    records["once"]["s"][3].update(retries=1, error_codes=["engine_unavailable"])
    stats = {
        name: {
            "policy": name,
            "router": {"num_retries": 0},
            "requests_per_replica": {"replica-0": 6, "replica-1": 4},
            "slow_replicas": ["replica-1"],
        }
        for name in ("once", "once/session_affinity", "once/round_robin", "naive")
    }
    section = routing_section(runs, records, stats)
    once = section["policies"]["once"]
    assert once["cached_tokens"] == 900 and once["computed_tokens"] == 100
    assert once["ttft_p50_s"] == 0.55 and once["ttft_p90_s"] == 0.91
    assert once["retries"] == 1 and once["error_codes"] == {"engine_unavailable": 1}
    assert once["requests_per_replica"] == {"replica-0": 6, "replica-1": 4}
    assert section["policies"]["round_robin"]["calls_per_replica"] == {
        "replica-0": 5,
        "replica-1": 5,
    }
    assert section["single_replica"]["cached_tokens"] == 950
    assert section["naive_round_robin"]["cached_tokens"] == 0
    assert section["cached_ratio_vs_single"] == round(900 / 950, 4)
    assert section["p90_ttft_ratio_vs_session_affinity"] == 0.5
    assert section["p90_ttft_ratio_vs_round_robin"] == 1.0
    assert section["slow_replicas"] == ["replica-1"] and section["replicas"] == 2
    assert section["bar"] == {
        "cached_vs_single": True,
        "p90_vs_session_affinity": True,
        "p90_vs_round_robin": True,
    }


def _session(name: str, num_calls: int = 4) -> Session:
    system = {"role": "system", "content": "You are a careful agent. " * 12}
    history: list[dict] = [system, {"role": "user", "content": f"Task {name}: fix it. " * 8}]
    calls = []
    for index in range(num_calls):
        output = {"role": "assistant", "content": f"Step {index} of {name}: run `ls src/` " * 4}
        calls.append(Call(index=index, messages=tuple(history), output=output))
        history += [output, {"role": "user", "content": f"observation {index}\n" * 8}]
    return Session(f"hand/{name}", MINI_SWE_AGENT, Path(name), tuple(calls))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = make_tiny_replay_model(tmp_path_factory.mktemp("tiny") / "m", MAX_LEN)
    return folder, load_served_runtime(folder, MAX_LEN)


@pytest.mark.parametrize("spec", [ONCE, NAIVE], ids=["websocket", "http"])
async def test_killing_a_replica_mid_replay_loses_no_session(served, spec):
    folder, runtime = served
    plans = [plan_session(_session(name), runtime) for name in ("a", "b", "c", "d")]
    started = time.monotonic()
    async with open_stack(
        spec, runtime, folder, max_model_len=MAX_LEN, kv_cache_gib=0.05,
        replicas=2, slow_replicas=1, slowdown=SLOWDOWN, policy="round_robin",
    ) as stack:  # fmt: skip
        victim = stack.fleet.processes[1]  # the slow one
        assert victim.slowdown == SLOWDOWN
        num_done = 0
        killed_at_call: list[int] = []

        def on_call():
            nonlocal num_done
            num_done += 1

        def streaming_on_victim() -> bool:
            return any(
                record.first_token_s is not None
                and record.finish_reason is None
                and stack.replica_of(record.request_id) == victim.name
                for record in stack.forced.records
            )

        async def kill_when_a_response_streams_on_the_victim():
            while not (num_done >= 2 and streaming_on_victim()):
                await asyncio.sleep(0.005)
            victim.kill()
            killed_at_call.append(num_done)

        killer = asyncio.create_task(kill_when_a_response_streams_on_the_victim())
        results = await asyncio.gather(
            *(replay_session(stack, plan, concurrent=True, on_call=on_call) for plan in plans)
        )
        await asyncio.wait_for(killer, 1)
        keys = [f"replay/{spec.name}/{plan.session_id}" for plan in plans]
        assert all(stack.forced.remaining(key) == 0 for key in keys)
        routing = await stack.fleet.routing_stats()
        assert victim.process.poll() is not None  # it really died
    rows = [row for rows in results for row in rows]
    assert [len(r) for r in results] == [len(plan.calls) for plan in plans]
    assert all(row["output_matches_recording"] and row["prompt_matches_plan"] for row in rows)
    codes = [code for row in rows for code in row.get("error_codes", ())]
    assert codes, "the kill landed mid-response: the client must have seen it and retried"
    assert set(codes) == {"engine_unavailable"}
    assert sum(row.get("retries", 0) for row in rows) == len(codes)
    assert routing["router"]["num_failed_no_replica"] == 0
    # After the kill every call went to the survivor.
    retried = [row for row in rows if row.get("retries")]
    assert all(row["replica"] == "replica-0" for row in retried)
    assert killed_at_call and killed_at_call[0] < len(rows)
    assert time.monotonic() - started < 300  # no hang (replica starts included)


def test_routing_flags_are_checked_and_the_default_record_keeps_its_shape():
    def problem(*argv):
        return check_routing_args(build_parser().parse_args(list(argv)))

    assert problem() is None
    routed = ["--replicas", "2", "--slow-replicas", "1"]
    assert problem(*routed, "--policies", "dynamo", "once") is None
    assert "include once" in problem("--replicas", "2", "--policies", "round_robin")
    assert "need --replicas > 1" in problem("--slow-replicas", "1")
    assert "between 0 and" in problem("--replicas", "2", "--slow-replicas", "3")
    assert ">= 1.0" in problem("--replicas", "2", "--slowdown", "0.5")
    with pytest.raises(SystemExit):  # not a policy name of router/policies.py
        build_parser().parse_args(["--policies", "fastest"])
    # One replica, no failure: a call record has exactly the keys it had before routing.
    fields = {name: 0 for name in CallRecord.__dataclass_fields__}
    row = CallRecord(**{**fields, "replica": None, "error_codes": ()}).to_dict()
    assert not {"replica", "retries", "error_codes"} & set(row)
    retried = CallRecord(**{**fields, "replica": "replica-0", "retries": 1,
                            "error_codes": ("engine_unavailable",)}).to_dict()  # fmt: skip
    assert retried["replica"] == "replica-0" and retried["error_codes"] == ["engine_unavailable"]


async def test_replicas_feed_the_router_an_exact_index_over_zmq(served):
    from once.bench.replay.replicas import open_fleet
    from once.router.index import ExactPrefixIndex

    folder, _ = served
    async with open_fleet(
        folder, count=2, max_model_len=MAX_LEN, kv_cache_gib=0.05, policy="round_robin"
    ) as fleet:
        await asyncio.sleep(1.0)  # the ZMQ subscriptions reach the publishers
        prompt = tuple(range(1, 100))  # 6 full blocks of 16
        request = GenerateRequest("z", prompt, SamplingParams(max_tokens=2))
        async for _ in fleet.router.generate(request):
            pass
        served_by = [r for r in fleet.router.replicas if r.counters["num_finished"]][0]
        assert isinstance(served_by.prefix_index, ExactPrefixIndex)
        for _ in range(500):  # events arrive asynchronously (10 s at most)
            if len(served_by.prefix_index) == 6:
                break
            await asyncio.sleep(0.02)
        assert len(served_by.prefix_index) == 6  # exactly the engine's cached blocks
        others = [r for r in fleet.router.replicas if r is not served_by]
        assert all(len(r.prefix_index) == 0 for r in others)
