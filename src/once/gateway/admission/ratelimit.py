"""Per-tenant limits on requests and tokens per minute, on the `limits` library.

Requests use `strategy` (moving window by default: exact, one entry per request). Tokens
use a sliding-window counter by default: the moving window keeps one entry per unit of
cost, so charging 100k tokens would push 100k list entries (in memory, or into a Redis
list); the counter keeps two numbers per window at any cost.

Storage is in process (`memory://`) or shared by several gateways (`redis://...`, the
`redis` client). A storage failure lets the request through with a logged warning: the
limiter guards capacity, and losing Redis should not stop serving.
"""

import logging
import time

from limits import RateLimitItem, RateLimitItemPerMinute
from limits.aio.strategies import (
    FixedWindowRateLimiter,
    MovingWindowRateLimiter,
    SlidingWindowCounterRateLimiter,
)
from limits.errors import ConfigurationError, StorageError
from limits.storage import storage_from_string

from once.gateway.admission.auth import Tenant
from once.protocol.errors import RateLimitError

logger = logging.getLogger(__name__)

_WINDOW_S = 60.0
_REDIS_SCHEMES = ("redis://", "rediss://", "redis+unix://")


def _async_storage_uri(storage_uri: str) -> str:
    # `limits` names its asyncio storages "async+<scheme>"; accept the plain form too.
    return storage_uri if storage_uri.startswith("async+") else f"async+{storage_uri}"


# limits' own STRATEGIES table, with the concrete classes' types.
STRATEGIES: dict[
    str,
    type[MovingWindowRateLimiter]
    | type[FixedWindowRateLimiter]
    | type[SlidingWindowCounterRateLimiter],
] = {
    "moving-window": MovingWindowRateLimiter,
    "fixed-window": FixedWindowRateLimiter,
    "sliding-window-counter": SlidingWindowCounterRateLimiter,
}


class RateLimiter:
    def __init__(
        self,
        storage_uri: str = "memory://",
        strategy: str = "moving-window",
        *,
        token_strategy: str = "sliding-window-counter",
        redis_timeout_s: float = 5.0,
    ):
        for name in (strategy, token_strategy):
            if name not in STRATEGIES:
                raise ValueError(f"unknown rate limit strategy {name!r}; one of {list(STRATEGIES)}")
        uri = _async_storage_uri(storage_uri)
        options: dict = {}
        if storage_uri.startswith(_REDIS_SCHEMES):
            # A Redis that stops answering costs a request `redis_timeout_s`, not a hang.
            timeouts = {
                "socket_timeout": redis_timeout_s,
                "socket_connect_timeout": redis_timeout_s,
            }
            options = {"implementation": "redispy", **timeouts}
        try:
            storage = storage_from_string(uri, wrap_exceptions=True, **options)
        except ConfigurationError as exc:
            raise ValueError(f"bad rate limit storage {storage_uri!r}: {exc}") from exc
        self.storage_uri = storage_uri
        self._request_limiter = STRATEGIES[strategy](storage)
        self._token_limiter = STRATEGIES[token_strategy](storage)

    async def hit_request(self, tenant: Tenant) -> None:
        limit = tenant.requests_per_minute
        if limit is None:
            return
        item = RateLimitItemPerMinute(limit, namespace="once-requests")
        if not await self._hit(self._request_limiter, item, tenant, 1):
            retry_after_s = await self._retry_after_s(self._request_limiter, item, tenant, 1)
            raise RateLimitError(
                f"Rate limit reached for tenant {tenant.name!r}: {limit} requests per minute. "
                f"Try again in {retry_after_s:.0f} s.",
                retry_after_s=retry_after_s,
            )

    async def hit_tokens(self, tenant: Tenant, num_tokens: int) -> None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        limit = tenant.tokens_per_minute
        if limit is None or num_tokens == 0:
            return
        if num_tokens > limit:
            raise RateLimitError(
                f"This request needs {num_tokens} tokens but tenant {tenant.name!r} is limited "
                f"to {limit} tokens per minute, so it can never fit; shorten the input or lower "
                "max_output_tokens.",
                param="input",
                retry_after_s=_WINDOW_S,
            )
        item = RateLimitItemPerMinute(limit, namespace="once-tokens")
        if not await self._hit(self._token_limiter, item, tenant, num_tokens):
            retry_after_s = await self._retry_after_s(self._token_limiter, item, tenant, num_tokens)
            raise RateLimitError(
                f"Rate limit reached for tenant {tenant.name!r}: {limit} tokens per minute; "
                f"this request needs {num_tokens}. Try again in {retry_after_s:.0f} s.",
                retry_after_s=retry_after_s,
            )

    async def _hit(self, limiter, item: RateLimitItem, tenant: Tenant, cost: int) -> bool:
        try:
            return await limiter.hit(item, tenant.name, cost=cost)
        except StorageError as exc:
            logger.warning("rate limit storage %s failed, not limiting: %s", self.storage_uri, exc)
            return True

    async def _retry_after_s(
        self, limiter, item: RateLimitItem, tenant: Tenant, cost: int
    ) -> float:
        try:
            stats = await limiter.get_window_stats(item, tenant.name)
        except StorageError:
            return 1.0
        wait_s = stats.reset_time - time.time()  # when the next unit frees up
        if isinstance(limiter, SlidingWindowCounterRateLimiter):
            # A cost of many units waits for its whole deficit. The weighted count of a
            # sliding-window counter falls by at most `limit` a window (the previous window's
            # count, which is <= limit, fades out linearly), so deficit / limit of a window is
            # a lower bound: never too long a wait, and it spares the client a run of retries
            # that are bound to fail.
            deficit = max(0, cost - stats.remaining - 1)
            wait_s = max(wait_s, deficit * _WINDOW_S / item.amount)
        return max(1.0, wait_s)
