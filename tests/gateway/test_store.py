import asyncio
import logging
import shutil
import socket
import sqlite3
import subprocess
import time

import pytest
import redis

from once.gateway.state.store import (
    MemoryResponseStore,
    RedisResponseStore,
    SQLiteResponseStore,
    StoredResponse,
    open_store,
)

KINDS = ["memory", "sqlite", "redis"]


class FakeClock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    port = _free_port()
    server = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail(f"redis-server did not start on port {port}")
                time.sleep(0.05)
        yield url
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=10)


def make_record(response_id="resp_1", tenant="acme", **overrides) -> StoredResponse:
    fields = dict(
        id=response_id,
        tenant=tenant,
        created_at=1_700_000_000.5,
        response={"id": response_id, "object": "response", "output": [{"text": "héllo ✓"}]},
        input_items=[{"type": "message", "role": "user", "content": "hi"}],
        previous_response_id="resp_0",
        render_key="model|instr|tools",
        prompt_token_ids=[1, 2, 3, 49151, 0, 2**31 - 1],
        output_token_ids=[7, 8, 2],
    )
    fields.update(overrides)
    return StoredResponse(**fields)


@pytest.fixture(params=KINDS)
async def store(request, tmp_path):
    if request.param == "memory":
        store = MemoryResponseStore(ttl_s=60)
    elif request.param == "sqlite":
        store = SQLiteResponseStore(tmp_path / "responses.db", ttl_s=60)
    else:
        url = request.getfixturevalue("redis_url")
        redis.Redis.from_url(url).flushdb()
        store = RedisResponseStore(url, ttl_s=60)
    yield store
    await store.close()


# -- behaviour shared by every store --------------------------------------------------------


async def test_round_trip_is_exact(store):
    record = make_record()
    before = time.time()
    await store.put(record)
    assert before + 59 < record.expires_at <= time.time() + 60
    loaded = await store.get("resp_1", "acme")
    assert loaded == record  # every field, ids and dicts exact, expires_at included
    assert loaded is not record


async def test_missing_gives_none_and_delete_false(store):
    assert await store.get("resp_nope", "acme") is None
    assert await store.delete("resp_nope", "acme") is False


async def test_tenant_isolation(store):
    await store.put(make_record("resp_1", "acme"))
    assert await store.get("resp_1", "globex") is None
    assert await store.delete("resp_1", "globex") is False
    assert (await store.get("resp_1", "acme")).tenant == "acme"


async def test_tenant_names_with_separators_cannot_collide(store):
    await store.put(make_record("c", "a:b", render_key="first"))
    await store.put(make_record("b:c", "a", render_key="second"))
    assert (await store.get("c", "a:b")).render_key == "first"
    assert (await store.get("b:c", "a")).render_key == "second"


async def test_delete(store):
    await store.put(make_record())
    assert await store.delete("resp_1", "acme") is True
    assert await store.get("resp_1", "acme") is None
    assert await store.delete("resp_1", "acme") is False


async def test_put_replaces_same_id(store):
    await store.put(make_record(output_token_ids=[1]))
    await store.put(make_record(output_token_ids=[1, 2, 3]))
    assert (await store.get("resp_1", "acme")).output_token_ids == [1, 2, 3]


async def test_large_id_lists(store):
    prompt = [(i * 7919) % 49152 for i in range(100_000)]
    await store.put(make_record(prompt_token_ids=prompt, output_token_ids=prompt[:5000]))
    loaded = await store.get("resp_1", "acme")
    assert loaded.prompt_token_ids == prompt
    assert loaded.output_token_ids == prompt[:5000]


async def test_concurrent_puts(store):
    records = [make_record(f"resp_{i}", output_token_ids=[i] * (i + 1)) for i in range(60)]
    await asyncio.gather(*(store.put(record) for record in records))
    loaded = await asyncio.gather(*(store.get(record.id, "acme") for record in records))
    assert [r.output_token_ids for r in loaded] == [r.output_token_ids for r in records]


@pytest.mark.parametrize(
    "overrides",
    [
        {"response": {"bad": object()}},
        {"response": {"nan": float("nan")}},
        {"response": ["not", "a", "dict"]},
        {"input_items": [{"ok": 1}, "not a dict"]},
        {"prompt_token_ids": [1, 2**40]},
        {"output_token_ids": [1.5]},
        {"output_token_ids": ["7"]},
        {"id": ""},
        {"tenant": None},
        {"created_at": float("inf")},
        {"previous_response_id": 5},
    ],
)
async def test_bad_put_raises_and_keeps_what_is_stored(store, overrides):
    good = make_record()
    await store.put(good)
    bad = make_record(**overrides)
    with pytest.raises(ValueError):
        await store.put(bad)
    assert await store.get("resp_1", "acme") == good


# -- expiry ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_ttl_expiry_with_clock(kind, tmp_path):
    clock = FakeClock()
    if kind == "memory":
        store = MemoryResponseStore(ttl_s=10, clock=clock)
    else:
        store = SQLiteResponseStore(tmp_path / "r.db", ttl_s=10, clock=clock)
    record = make_record()
    await store.put(record)
    assert record.expires_at == clock.now + 10
    clock.now += 9.9
    assert await store.get("resp_1", "acme") is not None
    clock.now += 0.2
    assert await store.get("resp_1", "acme") is None
    assert await store.delete("resp_1", "acme") is False
    await store.close()


async def test_redis_ttl_expiry(redis_url):
    store = RedisResponseStore(redis_url, ttl_s=2.0)
    await store.put(make_record("resp_ttl"))
    assert await store.get("resp_ttl", "acme") is not None  # 2 s: read well inside its TTL
    async with asyncio.timeout(10):  # then Redis expires it
        while await store.get("resp_ttl", "acme") is not None:
            await asyncio.sleep(0.1)
    await store.close()


async def test_sqlite_purges_expired_rows_lazily(tmp_path):
    clock = FakeClock()
    path = tmp_path / "r.db"
    store = SQLiteResponseStore(path, ttl_s=20, purge_interval_s=30, clock=clock)
    await store.put(make_record("old"))
    clock.now += 25  # old has expired, but no purge yet: the interval has not passed
    await store.put(make_record("new1"))
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM responses").fetchone()[0] == 2
    assert await store.get("old", "acme") is None  # invisible at once all the same
    clock.now += 6
    await store.put(make_record("new2"))  # 31 s since the store opened: purges now
    with sqlite3.connect(path) as conn:
        ids = {row[0] for row in conn.execute("SELECT id FROM responses")}
    assert ids == {"new1", "new2"}
    await store.close()


async def test_memory_store_is_bounded_lru():
    store = MemoryResponseStore(ttl_s=60, max_entries=2)
    await store.put(make_record("a"))
    await store.put(make_record("b"))
    assert await store.get("a", "acme") is not None  # a is now the most recently used
    await store.put(make_record("c"))
    assert len(store) == 2
    assert await store.get("b", "acme") is None
    assert await store.get("a", "acme") is not None
    assert await store.get("c", "acme") is not None


async def test_memory_store_is_bounded_in_bytes():
    store = MemoryResponseStore(ttl_s=60, max_bytes=1_000_000)
    big = list(range(100_000))  # 400 kB packed
    for name in ("a", "b", "c"):
        await store.put(make_record(name, prompt_token_ids=big))
    assert len(store) == 2 and 800_000 < store.num_bytes <= 1_000_000
    assert await store.get("a", "acme") is None
    await store.put(make_record("b", prompt_token_ids=[1]))  # a replacement frees its bytes
    assert store.num_bytes < 500_000
    await store.delete("c", "acme")
    await store.delete("b", "acme")
    assert store.num_bytes == 0


# -- SQLite specifics -----------------------------------------------------------------------


async def test_sqlite_survives_restart(tmp_path):
    path = tmp_path / "nested" / "r.db"
    store = SQLiteResponseStore(path, ttl_s=60)
    record = make_record()
    await store.put(record)
    await store.close()
    with pytest.raises(RuntimeError, match="closed"):
        await store.get("resp_1", "acme")

    reopened = SQLiteResponseStore(path, ttl_s=60)
    assert await reopened.get("resp_1", "acme") == record
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    await reopened.close()


@pytest.mark.parametrize(
    "corruption",
    [
        "UPDATE responses SET prompt_ids = x'010203'",
        "UPDATE responses SET response_json = '{not json'",
        "UPDATE responses SET input_items_json = '{\"a\": 1}'",
        "UPDATE responses SET render_key = x'00'",
        "UPDATE responses SET created_at = 'abc'",
    ],
)
async def test_sqlite_corrupt_row_reads_as_none(tmp_path, caplog, corruption):
    path = tmp_path / "r.db"
    store = SQLiteResponseStore(path, ttl_s=60)
    await store.put(make_record())
    await store.put(make_record("resp_2", "other"))
    with sqlite3.connect(path) as conn:
        conn.execute(corruption + " WHERE id = 'resp_1'")
    with caplog.at_level(logging.WARNING, logger="once.gateway.state.store"):
        assert await store.get("resp_1", "acme") is None
    assert "corrupt" in caplog.text
    assert (await store.get("resp_2", "other")).id == "resp_2"  # the rest is unharmed
    await store.close()


def test_sqlite_rejects_a_file_that_is_not_a_database(tmp_path):
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ValueError, match="junk.db"):
        SQLiteResponseStore(path, ttl_s=60)


# -- Redis specifics ------------------------------------------------------------------------


async def test_redis_corrupt_value_reads_as_none(redis_url, caplog):
    store = RedisResponseStore(redis_url, ttl_s=60)
    await store.put(make_record("resp_c"))
    key = store._key("acme", "resp_c")
    client = redis.Redis.from_url(redis_url)
    for garbage in (b"garbage", client.get(key)[:40]):
        client.set(key, garbage)
        with caplog.at_level(logging.WARNING, logger="once.gateway.state.store"):
            assert await store.get("resp_c", "acme") is None
    assert "corrupt" in caplog.text
    client.close()
    await store.close()


async def test_redis_gateways_share_state(redis_url):
    first = RedisResponseStore(redis_url, ttl_s=60)
    second = RedisResponseStore(redis_url, ttl_s=60)
    record = make_record("resp_shared")
    await first.put(record)
    assert await second.get("resp_shared", "acme") == record
    assert await second.delete("resp_shared", "acme") is True
    assert await first.get("resp_shared", "acme") is None
    await first.close()
    await second.close()


async def test_redis_down_is_a_clear_503():
    from once.gateway.state.store import ResponseStoreUnavailableError

    store = RedisResponseStore(f"redis://127.0.0.1:{_free_port()}/0", ttl_s=60)
    with pytest.raises(ResponseStoreUnavailableError) as info:
        await store.get("resp_1", "acme")
    assert info.value.status == 503
    await store.close()


# -- open_store -----------------------------------------------------------------------------


async def test_open_store_specs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    memory = open_store("memory", ttl_s=5)
    relative = open_store("sqlite:///rel.db", ttl_s=5)
    absolute = open_store(f"sqlite:///{tmp_path}/abs.db", ttl_s=5)  # sqlite:////abs/path
    plain = open_store("plain.db", ttl_s=5)
    remote = open_store("redis://127.0.0.1:1/0", ttl_s=5)
    assert isinstance(memory, MemoryResponseStore)
    assert isinstance(remote, RedisResponseStore)
    assert relative.path == tmp_path.joinpath("rel.db").relative_to(tmp_path)
    assert absolute.path == tmp_path / "abs.db" and absolute.path.is_absolute()
    assert (tmp_path / "rel.db").exists() and (tmp_path / "plain.db").exists()
    for store in (memory, relative, absolute, plain, remote):
        await store.close()


@pytest.mark.parametrize("spec", ["postgres://x", "responses.json", "sqlite:///", ""])
def test_open_store_rejects_unknown_specs(spec):
    with pytest.raises(ValueError):
        open_store(spec, ttl_s=5)


@pytest.mark.parametrize("ttl_s", [0, -1, float("inf"), float("nan")])
def test_ttl_must_be_positive(ttl_s):
    with pytest.raises(ValueError, match="ttl_s"):
        MemoryResponseStore(ttl_s)


async def test_a_capped_sqlite_store_refuses_puts_when_full_and_keeps_what_it_has(tmp_path):
    from once.gateway.state.store import ResponseStoreUnavailableError

    store = open_store(f"sqlite:///{tmp_path / 'capped.db'}", ttl_s=60, max_bytes=40_000)
    big = {"id": "x", "text": "y" * 3000}
    kept = []
    with pytest.raises(ResponseStoreUnavailableError, match="full"):
        for i in range(100):
            record = make_record(f"resp_{i}", response=big)
            await store.put(record)
            kept.append(record)
    assert 3 <= len(kept) < 100
    assert await store.get(f"resp_{len(kept)}", "acme") is None  # nothing half-written
    assert [await store.get(r.id, "acme") for r in kept] == kept
    await store.delete(kept[0].id, "acme")
    await store.put(make_record("resp_after", response=big))  # room again
    await store.close()


def test_a_store_cap_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        SQLiteResponseStore(tmp_path / "x.db", ttl_s=5, max_bytes=0)
