import time

import pytest

from once.gateway.admission.auth import Tenant
from once.gateway.admission.ratelimit import RateLimiter
from once.protocol.errors import RateLimitError
from tests.gateway.test_store import redis_url  # noqa: F401  (a fixture: real redis-server)

ACME = Tenant("acme", requests_per_minute=3, tokens_per_minute=1000)
GLOBEX = Tenant("globex", requests_per_minute=3, tokens_per_minute=1000)
UNLIMITED = Tenant("free")


class FakeClock:
    # `limits` reads time.time() for every window; driving it keeps the tests instant.
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock(1_800_000_010.0)  # 10 s into a minute: window edges are predictable
    monkeypatch.setattr(time, "time", fake)
    return fake


@pytest.fixture
def limiter(clock) -> RateLimiter:
    return RateLimiter()


async def test_request_limit_is_a_429_with_retry_after(limiter, clock):
    for _ in range(3):
        await limiter.hit_request(ACME)
    with pytest.raises(RateLimitError, match="3 requests per minute") as info:
        await limiter.hit_request(ACME)
    assert info.value.status == 429
    assert info.value.code == "rate_limit_exceeded"
    assert info.value.retry_after_s == pytest.approx(60.0)


async def test_other_tenants_are_unaffected(limiter):
    for _ in range(3):
        await limiter.hit_request(ACME)
    with pytest.raises(RateLimitError):
        await limiter.hit_request(ACME)
    for _ in range(3):
        await limiter.hit_request(GLOBEX)
    await limiter.hit_tokens(GLOBEX, 1000)


async def test_the_moving_window_frees_up(limiter, clock):
    for _ in range(3):
        await limiter.hit_request(ACME)
        clock.now += 10
    # Requests at +0, +10, +20; now +30: the first leaves the window at +60.
    with pytest.raises(RateLimitError) as info:
        await limiter.hit_request(ACME)
    assert info.value.retry_after_s == pytest.approx(30.0)
    clock.now += 29
    with pytest.raises(RateLimitError):
        await limiter.hit_request(ACME)
    clock.now += 1.01
    await limiter.hit_request(ACME)  # exactly one slot came free
    with pytest.raises(RateLimitError):
        await limiter.hit_request(ACME)


async def test_token_charging(limiter, clock):
    await limiter.hit_tokens(ACME, 600)
    await limiter.hit_tokens(ACME, 0)  # free
    with pytest.raises(RateLimitError, match="1000 tokens per minute; this request needs 500"):
        await limiter.hit_tokens(ACME, 500)
    await limiter.hit_tokens(ACME, 400)  # the refused 500 was not charged
    with pytest.raises(RateLimitError):
        await limiter.hit_tokens(ACME, 1)


async def test_token_retry_after_covers_the_deficit_without_overshooting(limiter, clock):
    await limiter.hit_tokens(ACME, 900)
    with pytest.raises(RateLimitError) as info:
        await limiter.hit_tokens(ACME, 500)
    retry_after_s = info.value.retry_after_s
    assert retry_after_s > 20  # 399 of 1000 a minute, not the 1 s of a single token
    clock.now += retry_after_s - 0.5
    with pytest.raises(RateLimitError):  # a lower bound: waiting less is never enough
        await limiter.hit_tokens(ACME, 500)
    clock.now += 120
    await limiter.hit_tokens(ACME, 1000)  # the window has fully freed up


async def test_a_request_larger_than_the_budget_can_never_fit(limiter):
    with pytest.raises(RateLimitError, match="can never fit") as info:
        await limiter.hit_tokens(ACME, 1001)
    assert info.value.retry_after_s >= 1
    await limiter.hit_tokens(ACME, 1000)  # nothing was charged


async def test_unlimited_tenant_is_never_limited(limiter):
    for _ in range(500):
        await limiter.hit_request(UNLIMITED)
    await limiter.hit_tokens(UNLIMITED, 10**9)


async def test_mixed_limits():
    limiter = RateLimiter()
    tokens_only = Tenant("t", tokens_per_minute=10)
    for _ in range(100):
        await limiter.hit_request(tokens_only)
    with pytest.raises(RateLimitError):
        await limiter.hit_tokens(tokens_only, 11)


@pytest.mark.parametrize("num_tokens", [-1, 1.5, "10", True, None])
async def test_bad_token_counts(limiter, num_tokens):
    with pytest.raises(ValueError, match="num_tokens"):
        await limiter.hit_tokens(ACME, num_tokens)


def test_bad_configuration():
    with pytest.raises(ValueError, match="strategy"):
        RateLimiter(strategy="leaky-bucket")
    with pytest.raises(ValueError, match="storage"):
        RateLimiter("nosuch://x")


async def test_fixed_window_strategy(clock):
    limiter = RateLimiter(strategy="fixed-window", token_strategy="fixed-window")
    for _ in range(3):
        await limiter.hit_request(ACME)
    with pytest.raises(RateLimitError) as info:
        await limiter.hit_request(ACME)
    assert 1 <= info.value.retry_after_s <= 60


async def test_redis_storage_is_shared_between_gateways(redis_url):  # noqa: F811
    tenant = Tenant(f"shared-{time.monotonic_ns()}", requests_per_minute=2, tokens_per_minute=50)
    first, second = RateLimiter(redis_url), RateLimiter(redis_url)
    await first.hit_request(tenant)
    await second.hit_request(tenant)
    with pytest.raises(RateLimitError) as info:
        await first.hit_request(tenant)
    assert info.value.retry_after_s > 50
    await first.hit_tokens(tenant, 30)
    with pytest.raises(RateLimitError):
        await second.hit_tokens(tenant, 30)


async def test_storage_failure_lets_requests_through(caplog):
    limiter = RateLimiter("redis://127.0.0.1:1/0")
    await limiter.hit_request(ACME)
    await limiter.hit_tokens(ACME, 10)
    assert "not limiting" in caplog.text
