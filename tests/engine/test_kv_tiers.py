"""KV tiers below the device pool: what comes back from host memory, disk or Redis gives
the same logits as recomputing it, and anything missing or corrupt is a miss.

The engine scenes use the tiny model with a device pool of 16 blocks of 4 tokens: a first
prompt (22 tokens) is cached, a second (58 tokens, its 6 outputs fill all 16 blocks)
evicts it from the device, and the first prompt with 3 more tokens then finds its 5
leading blocks (20 tokens) only in a tier.
"""

import asyncio
import shutil

import pytest
import torch

from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.kv.block_codec import decode_block, encode_block, layout_fingerprint
from once.engine.kv.disk_tier import DiskTier
from once.engine.kv.host_tier import HostTier
from once.kv_eviction.policies import LFUDynamicAging
from once.protocol.engine import GenerateRequest
from tests.engine.test_engine_parity import GREEDY, assert_logits_match, capture_logits, prompts

SHAPE = (2, 4, 2, 8)  # layers, block size, KV heads, head dim
FINGERPRINT = layout_fingerprint("model", torch.float32, SHAPE)
FIRST, EVICTING = prompts(9, [22])[0], prompts(10, [58])[0]
RETURNING = FIRST + [7, 8, 9]


def block(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)


def empty_block() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(SHAPE), torch.empty(SHAPE)


# -- the parts ---------------------------------------------------------------------------


def test_a_block_round_trips_and_any_damage_is_a_miss():
    k, v = block(0)
    data = encode_block(FINGERPRINT, 42, k, v)
    k_out, v_out = empty_block()
    assert decode_block(data, FINGERPRINT, 42, k_out, v_out)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)

    flipped = bytearray(data)
    flipped[-5] ^= 0x01  # one bit of V
    other_layout = layout_fingerprint("model", torch.float32, (2, 4, 2, 16))
    for bad, fingerprint, block_hash in [
        (bytes(flipped), FINGERPRINT, 42),
        (data[:-1], FINGERPRINT, 42),
        (data, FINGERPRINT, 43),
        (data, other_layout, 42),
        (b"", FINGERPRINT, 42),
        (None, FINGERPRINT, 42),
    ]:
        k_out, v_out = torch.zeros(SHAPE), torch.zeros(SHAPE)
        assert not decode_block(bad, fingerprint, block_hash, k_out, v_out)
        assert not k_out.any() and not v_out.any()  # nothing half-copied


def test_host_tier_is_bounded_and_hands_back_what_it_evicts():
    host = HostTier(2, SHAPE, torch.float32)
    for i in range(2):
        assert host.put(i, *block(i)) == []
    k_out, v_out = empty_block()
    assert host.get(0, k_out, v_out)  # 0 is now the more recent
    evicted = host.put(2, *block(2), keep_evicted=True)
    assert [victim for victim, _, _ in evicted] == [1] and len(host) == 2
    assert torch.equal(evicted[0][1], block(1)[0])
    assert host.run_length([0, 2, 1]) == 2 and 1 not in host


def test_host_tier_runs_the_simulators_policies():
    host = HostTier(2, SHAPE, torch.float32, policy=LFUDynamicAging())
    host.put(0, *block(0))
    host.put(1, *block(1))
    for _ in range(3):
        host.get(1, *empty_block())  # 1 is hit often, 0 never
    host.put(2, *block(2))
    assert 1 in host and 0 not in host


def test_disk_tier_is_bounded_and_survives_a_restart(tmp_path):
    size = len(encode_block(FINGERPRINT, 0, *block(0)))
    disk = DiskTier(tmp_path, 3 * size, FINGERPRINT)
    for i in range(4):
        assert disk.put(i, encode_block(FINGERPRINT, i, *block(i)))
    assert len(disk) == 3 and 0 not in disk and disk.num_bytes == 3 * size
    (disk.folder / "0000000000000009.kv.1.tmp").write_bytes(b"torn")

    again = DiskTier(tmp_path, 3 * size, FINGERPRINT)
    assert sorted(again.size_of) == [1, 2, 3]
    assert not list(again.folder.glob("*.tmp"))  # a write that never finished is gone
    k_out, v_out = empty_block()
    assert decode_block(again.get(2), FINGERPRINT, 2, k_out, v_out)
    assert torch.equal(k_out, block(2)[0])
    (again.folder / f"{3:016x}.kv").unlink()
    assert again.get(3) is None and 3 not in again  # a missing file is a miss, forgotten


# -- the engine --------------------------------------------------------------------------


def tiered_engine(model_dir, **tiers) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=16, **tiers)
    return LLMEngine(config)


def run(engine: LLMEngine, request_id: str, tokens: list[int]):
    return engine.generate([GenerateRequest(request_id, tuple(tokens), GREEDY)])[request_id]


def evict_first_prompt(engine: LLMEngine) -> None:
    run(engine, "first", FIRST)
    run(engine, "evicting", EVICTING)
    assert engine.stats()["num_kv_evictions"] >= 5


@pytest.mark.parametrize("mode", ["write_through", "write_back"])
def test_host_tier_brings_back_the_evicted_prefix_with_the_same_logits(
    tiny_model_dir, tiny_reference, mode
):
    engine = tiered_engine(tiny_model_dir, kv_host_blocks=64, kv_offload=mode)
    evict_first_prompt(engine)
    records = capture_logits(engine)
    out = run(engine, "returning", RETURNING)
    assert out[0].num_cached_tokens == 20
    stats = engine.stats()
    assert stats["kv_tier_host_hit_blocks"] == 5
    assert stats["kv_tier_host_loaded_bytes"] == 5 * engine.connector.host.bytes_per_block
    assert_logits_match(tiny_reference, records)
    engine.close()


def test_without_tiers_the_same_scene_recomputes(tiny_model_dir):
    engine = tiered_engine(tiny_model_dir)
    evict_first_prompt(engine)
    assert run(engine, "returning", RETURNING)[0].num_cached_tokens == 0


def disk_engine(model_dir, folder) -> LLMEngine:
    # The host tier gets the device pool's 16 slots: the evicting prompt's blocks push
    # the first prompt's out of it too, so they come back from disk.
    return tiered_engine(model_dir, kv_disk_path=str(folder))


def test_disk_tier_serves_a_restarted_engine_with_the_same_logits(
    tiny_model_dir, tiny_reference, tmp_path
):
    first = disk_engine(tiny_model_dir, tmp_path)
    run(first, "first", FIRST)
    first.close()  # its queued writes are on disk now

    restarted = disk_engine(tiny_model_dir, tmp_path)
    records = capture_logits(restarted)
    out = run(restarted, "returning", RETURNING)
    stats = restarted.stats()
    assert out[0].num_cached_tokens == 20 and stats["kv_tier_disk_hit_blocks"] == 5
    assert stats["kv_tier_prefetches"] == 1 and stats["kv_tier_load_timeouts"] == 0
    assert_logits_match(tiny_reference, records)
    restarted.close()


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_corrupt_or_missing_disk_blocks_are_recomputed(
    tiny_model_dir, tiny_reference, tmp_path, damage
):
    first = disk_engine(tiny_model_dir, tmp_path)
    run(first, "first", FIRST)
    first.close()
    restarted = disk_engine(tiny_model_dir, tmp_path)  # its index lists every block
    files = sorted(restarted.connector.disk.folder.glob("*.kv"))
    assert len(files) >= 5
    for path in files:
        if damage == "delete":
            path.unlink()
        else:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x10
            path.write_bytes(bytes(data))
    records = capture_logits(restarted)
    out = run(restarted, "returning", RETURNING)
    assert out[0].num_cached_tokens == 0
    stats = restarted.stats()
    assert stats["kv_tier_disk_hit_blocks"] == 0
    assert stats["kv_tier_disk_corrupt_blocks"] == (1 if damage == "flip" else 0)
    assert_logits_match(tiny_reference, records)
    restarted.close()


@pytest.fixture
def redis_url(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    from once.bench.local_redis import RedisServer

    server = RedisServer(tmp_path)
    asyncio.run(server.start())
    yield server.url
    server.kill()


def test_shared_tier_moves_a_prefix_to_another_replica(tiny_model_dir, tiny_reference, redis_url):
    replica = tiered_engine(tiny_model_dir, kv_shared_url=redis_url)
    run(replica, "first", FIRST)
    replica.close()  # as good as dead: nothing of it is used below but Redis

    other = tiered_engine(tiny_model_dir, kv_shared_url=redis_url)
    records = capture_logits(other)
    out = run(other, "returning", RETURNING)
    stats = other.stats()
    assert out[0].num_cached_tokens == 20 and stats["kv_tier_shared_hit_blocks"] == 5
    assert_logits_match(tiny_reference, records)
    other.close()


def test_an_unreachable_shared_tier_is_a_miss_not_a_failure(tiny_model_dir):
    engine = tiered_engine(tiny_model_dir, kv_shared_url="redis://127.0.0.1:1/0")
    out = run(engine, "first", FIRST)
    assert out[-1].finish_reason == "length" and out[0].num_cached_tokens == 0
    engine.close()
    assert engine.stats()["kv_tier_shared_errors"] >= 1


def test_write_back_spills_from_host_to_disk_and_loads_back(
    tiny_model_dir, tiny_reference, tmp_path
):
    engine = tiered_engine(tiny_model_dir, kv_disk_path=str(tmp_path), kv_offload="write_back")
    evict_first_prompt(engine)  # out of the device into host memory...
    for i, other in enumerate(prompts(11, [58, 58])):  # ...and out of host memory
        run(engine, f"evicting {i}", other)
    engine.connector.flush()
    assert engine.stats()["kv_tier_disk_saved_blocks"] >= 5
    records = capture_logits(engine)
    out = run(engine, "returning", RETURNING)
    stats = engine.stats()
    assert out[0].num_cached_tokens == 20 and stats["kv_tier_disk_hit_blocks"] >= 1
    assert_logits_match(tiny_reference, records)
    engine.close()


def test_a_pinned_host_block_outlives_later_puts_until_released(monkeypatch):
    host = HostTier(2, SHAPE, torch.float32)
    host.put(0, *block(0))
    host.pin(0)  # promoted for a waiting request
    for i in range(1, 4):
        host.put(i, *block(i))
    assert 0 in host and len(host) == 2
    host.pin(3)
    host.put(4, *block(4))  # every slot pinned: refused, nothing lost
    assert host.num_refused == 1 and {0, 3} == set(host.slot_of)
    host.unpin([0])
    host.put(5, *block(5))
    assert 0 not in host and 5 in host

    import once.engine.kv.host_tier as host_tier

    monkeypatch.setattr(host_tier, "PIN_S", -1.0)  # a pin nobody released lapses
    host.pin(5)
    host.put(6, *block(6))
    assert 6 in host and host.num_refused == 1
