"""What the router estimates of a replica without asking it: its prefill speed (a fit of
TTFT against work) and its prefill queue (drained first come, first served at that speed,
so a request sent a while ago no longer counts whole)."""

import dataclasses
import random

import pytest

import once.router.replicas as replicas_module
from once.engine.scripted import ScriptedEngine
from once.router import Replica, make_policy
from once.router.policies import RequestView
from once.router.replicas import PrefillSpeedMeter
from tests.router.fakes import make_request


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(replicas_module, "time", clock)
    return clock


def fit(samples, prior=1000.0) -> PrefillSpeedMeter:
    meter = PrefillSpeedMeter(prior)
    for work, ttft in samples:
        meter.add(work, ttft)
    return meter


def test_the_speed_fit_recovers_overhead_and_speed_from_linear_ttfts():
    meter = fit([(x, 0.02 + x / 5000) for x in (100, 3000, 800, 12000, 40, 6000)])
    assert meter.tokens_per_s == pytest.approx(5000, rel=1e-6)
    assert meter.overhead_s == pytest.approx(0.02, rel=1e-6)


def test_one_sample_or_equal_work_gives_the_plain_ratio():
    assert fit([(2000, 0.5)]).tokens_per_s == pytest.approx(4000)
    assert fit([(2000, 0.5), (2000, 0.3)]).tokens_per_s == pytest.approx(5000, rel=0.05)
    assert fit([(0, 0.01), (0, 0.02)]).tokens_per_s == 1000.0  # no work seen: the prior


def test_the_overhead_is_never_above_the_fastest_request():
    # Small requests that waited behind work the queue estimate missed, one idle request,
    # two large prefills of ~1 s: a free intercept (0.37 s) would rate the replica at 11.7k
    # tokens/s; held under the idle request's 20 ms, the fit predicts the large ones.
    samples = [(50, 0.02), (100, 0.5), (200, 0.6), (8000, 1.0), (8000, 1.1)]
    meter = fit(samples)
    assert meter.overhead_s <= 0.02
    assert 8000 / meter.tokens_per_s == pytest.approx(1.05, rel=0.1)


def test_prompts_prefilled_together_do_not_make_prefill_look_free():
    # Live vLLM (README, "once in front of live vLLM"): two prompts of 2,142 and 3,615
    # tokens of work got their first tokens together after ~22.1 s. A free intercept of
    # 22.1 s rated the replica at 824k tokens/s; half the larger one's TTFT at most.
    meter = fit([(2142, 22.05), (3615, 22.1)])
    assert meter.overhead_s <= 11.05 + 1e-9
    assert 150 < meter.tokens_per_s < 400


def test_a_negative_overhead_is_clamped_to_zero():
    # Superlinear prefill (attention): the free line crosses zero below 0.
    meter = fit([(1000, 0.1), (5000, 0.8), (10000, 2.0)])
    assert meter.overhead_s == 0.0
    assert 10000 / meter.tokens_per_s == pytest.approx(1.9, rel=0.1)


def test_the_fit_follows_a_replica_that_slows_down():
    meter = fit([(x, x / 10_000) for x in (1000, 4000, 2000, 8000) * 4])
    assert meter.tokens_per_s == pytest.approx(10_000, rel=1e-6)
    for x in (1000, 4000, 2000, 8000) * 20:  # now at half speed: the window forgets
        meter.add(x, x / 5_000)
    assert meter.tokens_per_s == pytest.approx(5_000, rel=0.01)


def dispatch(replica: Replica, request_id: str, num_tokens: int) -> None:
    prompt = [hash((request_id, i)) % 30_000 + 1 for i in range(num_tokens)]
    replica.on_dispatch(make_request(request_id, prompt, forced=[1]), ())


def test_the_queue_drains_oldest_first_at_the_measured_speed(clock):
    replica = Replica("r", ScriptedEngine(), index=0, prefill_tokens_per_s=1000.0)
    dispatch(replica, "a", 2000)
    dispatch(replica, "b", 1000)
    assert replica.num_queued_prefill_tokens() == 3000
    clock.now += 1.5
    assert replica.num_queued_prefill_tokens() == 1500
    assert [f.num_prefill_left for f in replica.in_flight.values()] == [500, 1000]
    # b was sent while a was still queued: a's remaining 2000 tokens were ahead of it.
    assert replica.in_flight["b"].num_queued_ahead == 2000
    clock.now += 0.4
    assert [f.num_prefill_left for f in replica.in_flight.values()] == [500, 1000]  # lazy
    assert replica.num_queued_prefill_tokens() == 1100
    replica.on_delta("a", 1)
    replica.on_delta("b", 1)
    assert replica.num_queued_prefill_tokens() == 0


def test_a_request_still_waiting_caps_the_speed(clock):
    replica = Replica("r", ScriptedEngine(), index=0, prefill_tokens_per_s=1000.0)
    dispatch(replica, "a", 2000)
    dispatch(replica, "b", 1000)  # 2,000 tokens ahead of it
    clock.now += 2.0
    assert replica.prefill_tokens_per_s(clock.now) == pytest.approx(1000)
    # 4 s and a (2,000 tokens) has no first token: the replica does at most 500 tokens/s
    # (b, 3,000 tokens in 4 s, allows 750).
    clock.now += 2.0
    assert replica.view((), 0).prefill_tokens_per_s == pytest.approx(500)
    replica.on_delta("a", 1)  # the fit learns it too
    assert replica.prefill_meter.tokens_per_s == pytest.approx(500)
    clock.now += 6.0  # b: 3,000 tokens and still nothing after 10 s
    assert replica.prefill_tokens_per_s(clock.now) == pytest.approx(300)
    replica.on_delta("b", 1)
    assert replica.prefill_tokens_per_s(clock.now) == replica.prefill_meter.tokens_per_s < 500


def test_idle_time_is_not_banked_and_a_first_token_ends_the_estimate(clock):
    replica = Replica("r", ScriptedEngine(), index=0, prefill_tokens_per_s=1000.0)
    clock.now += 30.0  # idle: the 30 s of capacity must not drain the next request
    dispatch(replica, "a", 2000)
    dispatch(replica, "b", 2000)
    clock.now += 0.5
    assert replica.num_queued_prefill_tokens() == 3500
    replica.on_delta("a", 1)  # a's first token: a is done, whatever was estimated
    assert replica.num_queued_prefill_tokens() == 2000


def test_frozen_estimates_count_requests_whole_and_keep_the_fitted_speed(clock):
    replica = Replica("r", ScriptedEngine(), index=0, prefill_tokens_per_s=1000.0)
    replica.live_estimates = False
    dispatch(replica, "a", 2000)
    clock.now += 5.0
    assert replica.num_queued_prefill_tokens() == 2000
    assert replica.view((), 0).prefill_tokens_per_s == 1000.0


def test_once_keeps_a_request_on_the_fast_replica_whose_queue_is_nearly_done(clock):
    fast = Replica("fast", ScriptedEngine(), index=0, prefill_tokens_per_s=10_000.0)
    slow = Replica("slow", ScriptedEngine(), index=1, prefill_tokens_per_s=5_000.0)
    dispatch(fast, "big", 8000)
    clock.now += 0.7  # 7,000 of its 8,000 tokens are done
    request = RequestView("new", 2000, (), 16)
    policy = make_policy("once")

    def choice() -> str:
        views = [replica.view((), 2000) for replica in (fast, slow)]
        return ("fast", "slow")[policy.choose(request, views, random.Random(0))]

    assert choice() == "fast"  # (1,000 + 2,000) / 10k = 0.3 s against 2,000 / 5k = 0.4 s
    fast.live_estimates = False
    fast.in_flight["big"].num_prefill_left = 8000  # counted whole: (8,000 + 2,000) / 10k
    assert choice() == "slow"


def test_a_decode_leg_with_transferred_kv_queues_one_token_and_teaches_no_speed(clock):
    replica = Replica("r", ScriptedEngine(), index=0, prefill_tokens_per_s=1000.0)
    prompt = list(range(1, 4001))
    request = make_request("d", prompt, forced=[1])
    request = dataclasses.replace(request, kv_transfer_params={"do_remote_prefill": True})
    replica.on_dispatch(request, ())
    assert replica.num_queued_prefill_tokens() == 1  # its prompt's KV comes from elsewhere
    clock.now += 3.0  # waiting for the transfer: not a sign of a slow replica
    assert replica.prefill_tokens_per_s(clock.now) == pytest.approx(1000)
    replica.on_delta("d", 1)
    assert replica.prefill_meter.tokens_per_s == pytest.approx(1000)  # the prior, untaught


def test_a_request_past_its_predicted_first_token_counts_half_until_it_comes(clock):
    replica = Replica("r", ScriptedEngine(), index=0, prefill_tokens_per_s=1000.0)
    dispatch(replica, "big", 4000)
    dispatch(replica, "next", 1000)
    clock.now += 3.9
    assert replica.num_queued_prefill_tokens() == 1100  # on time: drained at the speed
    clock.now += 0.2  # big is due at 4 s and has no first token
    assert replica.num_queued_prefill_tokens() == 3000
    assert replica.in_flight["big"].num_prefill_left == 2000
    assert replica.in_flight["next"].num_prefill_left == 1000  # still waits behind it
    clock.now += 30.0
    assert replica.num_queued_prefill_tokens() == 3000  # not done until its first token
    replica.on_delta("big", 1)
    assert replica.num_queued_prefill_tokens() == 1000
    clock.now += 0.5
    assert replica.num_queued_prefill_tokens() < 1000  # the queue behind it drains again


def test_a_new_session_avoids_a_replica_busy_with_an_overdue_prefill(clock):
    busy = Replica("busy", ScriptedEngine(), index=0, prefill_tokens_per_s=1000.0)
    idle = Replica("idle", ScriptedEngine(), index=1, prefill_tokens_per_s=500.0)
    dispatch(busy, "tool-output", 5000)
    clock.now += 5.5  # past its predicted first token, which has not come
    request = RequestView("first-call", 1500, (), 16, session_key="new")
    views = [replica.view((), 1500) for replica in (busy, idle)]
    assert views[0].num_queued_prefill_tokens > 0
    chosen = make_policy("once").choose(request, views, random.Random(0))
    assert chosen == idle.index
