"""L4: KV blocks in Redis (or Valkey), shared by every replica of a model.

A session that moves to another replica (its own died, or the router rebalanced) finds its
prefix here and loads it instead of recomputing. Keys are `once:kv:<layout fingerprint>:
<block hash>`, values block_codec's bytes, so replicas of different models or layouts
sharing one Redis never read each other's blocks. Redis bounds the memory: run it with
`maxmemory` and `maxmemory-policy allkeys-lru` (each key also expires after `ttl_s`, so an
unbounded Redis still forgets). Every call has a short socket timeout and any Redis error
is a miss or a skipped write: the shared tier can only save work, never stall or fail a
request.
"""

import logging
from collections.abc import Sequence

import redis

logger = logging.getLogger(__name__)


class SharedTier:
    name = "shared"

    def __init__(self, url: str, fingerprint: bytes, ttl_s: int = 3600, timeout_s: float = 0.5):
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.prefix = f"once:kv:{fingerprint.hex()}:".encode()
        self.ttl_s = ttl_s
        self.num_errors = 0

    def _key(self, block_hash: int) -> bytes:
        return self.prefix + f"{block_hash & (2**64 - 1):016x}".encode()

    def run_length(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks are stored (one round trip for all of them)."""
        if not block_hashes:
            return 0
        try:
            pipeline = self.client.pipeline(transaction=False)
            for block_hash in block_hashes:
                pipeline.exists(self._key(block_hash))
            found = pipeline.execute()
        except redis.RedisError as exc:
            self._failed("lookup", exc)
            return 0
        count = 0
        for exists in found:
            if not exists:
                break
            count += 1
        return count

    def put(self, block_hash: int, data: bytes) -> bool:
        try:
            self.client.set(self._key(block_hash), data, ex=self.ttl_s)
        except redis.RedisError as exc:
            self._failed("write", exc)
            return False
        return True

    def get(self, block_hash: int) -> bytes | None:
        try:
            data = self.client.get(self._key(block_hash))
        except redis.RedisError as exc:
            self._failed("read", exc)
            return None
        return data if isinstance(data, bytes) else None

    def discard(self, block_hash: int) -> None:
        try:
            self.client.delete(self._key(block_hash))
        except redis.RedisError as exc:
            self._failed("delete", exc)

    def _failed(self, what: str, exc: Exception) -> None:
        self.num_errors += 1
        if self.num_errors == 1 or self.num_errors % 1000 == 0:
            logger.warning("shared KV tier: %s failed (%d so far): %s", what, self.num_errors, exc)

    def close(self) -> None:
        self.client.close()
