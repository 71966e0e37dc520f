"""Stored responses: what `previous_response_id` and `GET/DELETE /v1/responses/{id}` read.

A record keeps the response as returned, the request's own new input items, and the token
ids of the prompt and the output, so a later turn on any connection can continue the
conversation without re-rendering or re-tokenizing it.

Every store obeys the same contract:
- Records are scoped to a tenant. A missing, expired, deleted or other tenant's record all
  read as None (and delete as False): the caller cannot tell them apart, so nothing leaks.
- A record is encoded (and so validated) before anything is written: a bad put raises
  ValueError and leaves what is stored untouched.
- A record that fails to decode reads as None with a logged warning, never an exception.
- Token ids are stored as little-endian int32 bytes (4 bytes an id instead of a JSON number
  or a Python int), dicts as compact JSON.
"""

import asyncio
import logging
import math
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol
from urllib.parse import quote

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from once.gateway.state.store_codec import (
    StoredResponse,
    _check_ttl,
    _decode_or_none,
    _encode,
    _pack,
    _Row,
    _unpack,
)
from once.protocol.errors import OnceError

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


class ResponseStoreUnavailableError(OnceError):
    # The backing store (SQLite file, Redis server) failed: a server fault, not "not found".
    code = "response_store_unavailable"
    status = 503
    error_type = "server_error"


class ResponseStore(Protocol):
    async def put(self, record: StoredResponse) -> None: ...

    async def get(self, response_id: str, tenant: str) -> StoredResponse | None: ...

    async def delete(self, response_id: str, tenant: str) -> bool: ...

    async def close(self) -> None: ...


# -- stores ---------------------------------------------------------------------------------


class MemoryResponseStore:
    """A dict with a TTL, bounded by LRU eviction in entries and in bytes (records are kept
    packed: 4 bytes a token id)."""

    def __init__(
        self, ttl_s: float, *, max_entries=10_000, max_bytes=1 << 30, clock: Clock = time.time
    ):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be >= 1")
        self.ttl_s = _check_ttl(ttl_s)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, record: StoredResponse) -> None:
        now = self._clock()
        row = _encode(record, now + self.ttl_s)
        blob = _pack(row)
        self._pop((record.tenant, record.id))
        self._entries[(record.tenant, record.id)] = (row.expires_at, blob)
        self.num_bytes += len(blob)
        record.expires_at = row.expires_at
        # No purge pass: the bounds cap memory; expired entries are dropped when a get meets
        # them or when LRU order reaches them. The newest entry always stays.
        while len(self._entries) > 1 and (
            len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes
        ):
            self._pop(next(iter(self._entries)))  # least recently used

    def _pop(self, key: tuple[str, str]) -> tuple[float, bytes] | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= len(entry[1])
        return entry

    async def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        key = (tenant, response_id)
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            self._pop(key)
            return None
        self._entries.move_to_end(key)
        return _decode_or_none(lambda: _unpack(entry[1]), f"{tenant}/{response_id}")

    async def delete(self, response_id: str, tenant: str) -> bool:
        entry = self._pop((tenant, response_id))
        return entry is not None and entry[0] > self._clock()

    async def close(self) -> None:
        self._entries.clear()
        self.num_bytes = 0


_SQLITE_SCHEMA_VERSION = 1
_SQLITE_COLUMNS = ", ".join(_Row._fields)
_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL, id TEXT NOT NULL, created_at REAL NOT NULL, expires_at REAL NOT NULL,
    previous_response_id TEXT, render_key TEXT NOT NULL, response_json TEXT NOT NULL,
    input_items_json TEXT NOT NULL, prompt_ids BLOB NOT NULL, output_ids BLOB NOT NULL,
    PRIMARY KEY (tenant, id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS responses_expires_at ON responses (expires_at);
"""
_SQL_PUT = f"INSERT OR REPLACE INTO responses ({_SQLITE_COLUMNS}) VALUES ({', '.join('?' * 10)})"
_SQL_GET = f"SELECT {_SQLITE_COLUMNS} FROM responses WHERE tenant=? AND id=? AND expires_at>?"
_SQL_DELETE = "DELETE FROM responses WHERE tenant=? AND id=? AND expires_at>?"
_SQL_PURGE = "DELETE FROM responses WHERE expires_at <= ?"


class SQLiteResponseStore:
    """One WAL-mode table; survives a restart. Every query runs on one worker thread that
    owns the connection: calls are serialized without a lock and the event loop never waits
    on disk. Records are encoded on the caller's loop (a snapshot of lists it may keep
    mutating) and decoded on the worker. Expired rows are hidden by every query at once and
    deleted at most every `purge_interval_s`, piggybacking on a put. `max_bytes` caps the
    file (SQLite's max_page_count): past it a put fails as on a full disk (SQLITE_FULL),
    each put being one statement that is rolled back whole."""

    def __init__(
        self,
        path: str | Path,
        ttl_s: float,
        *,
        purge_interval_s=60.0,
        clock: Clock = time.time,
        max_bytes: int | None = None,
    ):
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.ttl_s = _check_ttl(ttl_s)
        self.purge_interval_s = purge_interval_s
        self._clock = clock
        self._last_purge = clock()
        self._closed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = self._connect()
        except sqlite3.Error as exc:
            raise ValueError(f"cannot open response store {self.path}: {exc}") from exc
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="once-sqlite-store")

    def _connect(self) -> sqlite3.Connection:
        # check_same_thread=False: the connection is made here, then used only by the worker.
        conn = sqlite3.connect(
            self.path, timeout=10.0, isolation_level=None, check_same_thread=False
        )
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, _SQLITE_SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"unknown schema version {version}")
            conn.executescript(_SQLITE_SCHEMA)
            conn.execute(f"PRAGMA user_version={_SQLITE_SCHEMA_VERSION}")
            if self.max_bytes is not None:
                page_size = conn.execute("PRAGMA page_size").fetchone()[0]
                conn.execute(f"PRAGMA max_page_count={max(1, self.max_bytes // page_size)}")
        except BaseException:
            conn.close()
            raise
        return conn

    async def _run(self, fn: Callable, *args):
        if self._closed:
            raise RuntimeError(f"response store {self.path} is closed")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)
        except sqlite3.Error as exc:
            raise ResponseStoreUnavailableError(f"response store {self.path}: {exc}") from exc

    async def put(self, record: StoredResponse) -> None:
        now = self._clock()
        row = _encode(record, now + self.ttl_s)
        purge = now - self._last_purge >= self.purge_interval_s
        if purge:
            self._last_purge = now
        await self._run(self._put_sync, row, now if purge else None)
        record.expires_at = row.expires_at

    def _put_sync(self, row: _Row, purge_before: float | None) -> None:
        self._conn.execute(_SQL_PUT, row)
        if purge_before is not None:
            self._conn.execute(_SQL_PURGE, (purge_before,))

    async def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        return await self._run(self._get_sync, (tenant, response_id, self._clock()))

    def _get_sync(self, key: tuple[str, str, float]) -> StoredResponse | None:
        row = self._conn.execute(_SQL_GET, key).fetchone()
        where = f"{key[0]}/{key[1]} in {self.path}"
        return None if row is None else _decode_or_none(lambda: _Row(*row), where)

    async def delete(self, response_id: str, tenant: str) -> bool:
        key = (tenant, response_id, self._clock())
        return await self._run(lambda: self._conn.execute(_SQL_DELETE, key).rowcount > 0)

    async def close(self) -> None:
        if self._closed:
            return
        # Queued calls run first: the worker is FIFO, and close is queued behind them.
        await self._run(self._conn.close)
        self._closed = True
        self._worker.shutdown(wait=False)


@contextmanager
def _redis_errors():
    try:
        yield
    except RedisError as exc:
        raise ResponseStoreUnavailableError(f"redis response store: {exc}") from exc


class RedisResponseStore:
    """One packed blob per record under `once:resp:{tenant}:{id}`, expiring via PX.

    The tenant is percent-encoded in the key so that no (tenant, id) pair can spell another
    tenant's key (tenant "a:b" + id "c" versus tenant "a" + id "b:c").
    """

    def __init__(
        self, url: str, ttl_s: float, *, key_prefix: str = "once:resp:", timeout_s: float = 5.0
    ):
        self.ttl_s = _check_ttl(ttl_s)
        self.key_prefix = key_prefix
        # Connects lazily, on the first command; a Redis that stops answering costs each
        # call `timeout_s`, then ResponseStoreUnavailableError.
        self._client = aioredis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )

    def _key(self, tenant: str, response_id: str) -> str:
        return f"{self.key_prefix}{quote(tenant, safe='')}:{response_id}"

    async def put(self, record: StoredResponse) -> None:
        row = _encode(record, time.time() + self.ttl_s)
        key = self._key(record.tenant, record.id)
        with _redis_errors():
            await self._client.set(key, _pack(row), px=max(1, math.ceil(self.ttl_s * 1000)))
        record.expires_at = row.expires_at

    async def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        with _redis_errors():
            blob = await self._client.get(self._key(tenant, response_id))
        if blob is None:
            return None
        data = blob.encode() if isinstance(blob, str) else blob
        record = _decode_or_none(lambda: _unpack(data), f"{tenant}/{response_id} in redis")
        if record is not None and (record.tenant, record.id) != (tenant, response_id):
            logger.warning("redis key for %s/%s holds another record", tenant, response_id)
            return None
        return record

    async def delete(self, response_id: str, tenant: str) -> bool:
        with _redis_errors():
            return await self._client.delete(self._key(tenant, response_id)) > 0

    async def close(self) -> None:
        await self._client.aclose()


def open_store(
    spec: str, ttl_s: float, *, max_bytes: int = 0, redis_timeout_s: float = 5.0
) -> ResponseStore:
    """ "memory", "sqlite:///relative.db" or "sqlite:////absolute.db" (SQLAlchemy's form),
    a plain path ending in .db/.sqlite/.sqlite3, or "redis://host:port/db" (also rediss://,
    unix://). `max_bytes` caps a SQLite file (0: no cap); `redis_timeout_s` bounds each Redis
    call."""
    cap = max_bytes or None
    if spec in ("memory", "memory://"):
        return MemoryResponseStore(ttl_s)
    if spec.startswith("sqlite:///"):
        path = spec.removeprefix("sqlite:///")
        if not path:
            raise ValueError(f"response store spec {spec!r} names no file")
        return SQLiteResponseStore(path, ttl_s, max_bytes=cap)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisResponseStore(spec, ttl_s, timeout_s=redis_timeout_s)
    if "://" not in spec and spec.endswith((".db", ".sqlite", ".sqlite3")):
        return SQLiteResponseStore(spec, ttl_s, max_bytes=cap)
    raise ValueError(
        f"unknown response store {spec!r}: expected 'memory', 'sqlite:///path.db', a path "
        "ending in .db, or 'redis://host:port/db'"
    )
