import asyncio
import contextlib

import pytest

from once.protocol.kv_blocks import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_hashes,
    hash_block_tokens,
)
from once.router.index import (
    ApproximatePrefixIndex,
    ExactPrefixIndex,
    decode_vllm_event_batch,
    event_from_dict,
    zmq_event_subscriber,
)

TOKENS = list(range(100, 164))  # 4 blocks of 16
HASHES = block_hashes(TOKENS, 16)


def test_approximate_index_matches_leading_blocks_only():
    index = ApproximatePrefixIndex(max_blocks=100)
    index.record(HASHES[:3])
    assert index.match(HASHES) == 3
    # The same tokens after a different head are different blocks (chained hashes).
    assert index.match(block_hashes(TOKENS[16:], 16)) == 0
    assert index.match(block_hashes(TOKENS, 16, cache_salt="other tenant")) == 0


def test_approximate_index_evicts_least_recently_routed_first():
    index = ApproximatePrefixIndex(max_blocks=4)
    other = block_hashes(list(range(500, 532)), 16)
    index.record(HASHES[:2])
    index.record(other)
    index.record(HASHES[:1])  # refresh block 0: block 1 is now the oldest
    index.record(block_hashes(list(range(900, 916)), 16))
    assert len(index) == 4 and index.num_evicted == 1
    assert index.match(HASHES) == 1
    assert index.match(other) == 2
    with pytest.raises(ValueError):
        ApproximatePrefixIndex(max_blocks=0)


def test_exact_index_follows_stored_removed_and_cleared():
    index = ExactPrefixIndex()
    index.apply([BlockStored(HASHES[:2], None, TOKENS[:32], 16)])
    index.apply([BlockStored([HASHES[2]], HASHES[1], TOKENS[32:48], 16).to_dict()])
    assert index.match(HASHES) == 3
    index.apply([BlockRemoved([HASHES[1]])])
    assert index.match(HASHES) == 1  # a hole ends the prefix
    index.apply([BlockRemoved([12345])])  # unknown: ignored
    index.apply([AllBlocksCleared()])
    assert index.match(HASHES) == 0 and len(index) == 0


def test_exact_index_rehashes_foreign_engine_hashes():
    # vLLM's hashes differ from ours: the index re-derives ours from token ids + parent.
    index = ExactPrefixIndex(rehash=True)
    index.apply([BlockStored([b"\x01" * 8, b"\x02" * 8], None, TOKENS[:32], 16)])
    index.apply([BlockStored([b"\x03" * 8], b"\x02" * 8, TOKENS[32:48], 16)])
    assert index.match(HASHES) == 3
    index.apply([BlockRemoved([b"\x03" * 8])])
    assert index.match(HASHES) == 2
    # A block whose parent the index never saw cannot be placed: skipped, not guessed.
    index.apply([BlockStored([b"\x09" * 8], b"\x08" * 8, TOKENS[48:64], 16)])
    assert index.match(HASHES) == 2


def test_exact_index_rejects_malformed_events():
    index = ExactPrefixIndex()
    with pytest.raises(ValueError, match="token ids"):
        index.apply([BlockStored([1, 2], None, TOKENS[:20], 16)])
    with pytest.raises(ValueError, match="unknown KV event"):
        index.apply([{"type": "BlockMoved"}])
    with pytest.raises(ValueError, match="not a KV event"):
        index.apply([42])


def test_event_dicts_round_trip():
    stored = BlockStored([1, 2], 7, TOKENS[:32], 16)
    assert event_from_dict(stored.to_dict()) == stored
    assert event_from_dict(BlockRemoved([3]).to_dict()) == BlockRemoved([3])
    assert event_from_dict({"type": "AllBlocksCleared"}) == AllBlocksCleared()


def test_decode_vllm_msgpack_batch():
    # What msgpack.unpackb gives for vLLM's KVEventBatch (array_like, tagged, defaults
    # omitted): [ts, [events...], dp_rank].
    payload = [
        1700000000.5,
        [
            ["BlockStored", [11, 12], None, TOKENS[:32], 16, None, "GPU"],
            ["BlockStored", [13], 12, TOKENS[32:48], 16],
            ["BlockRemoved", [11], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    events = decode_vllm_event_batch(payload)
    assert events[0] == BlockStored([11, 12], None, TOKENS[:32], 16, None, "GPU")
    assert events[1] == BlockStored([13], 12, TOKENS[32:48], 16, None, None)
    assert events[2] == BlockRemoved([11], "GPU")
    assert events[3] == AllBlocksCleared()
    index = ExactPrefixIndex(rehash=True)
    index.apply(events[:2])
    assert index.match(HASHES) == 3
    with pytest.raises(ValueError):
        decode_vllm_event_batch([1.0, [["BlockMoved"]]])
    with pytest.raises(ValueError):
        decode_vllm_event_batch("junk")


def test_rehash_uses_the_same_chain_as_the_engine():
    first = hash_block_tokens(None, TOKENS[:16])
    assert hash_block_tokens(first, TOKENS[16:32]) == HASHES[1]


async def test_zmq_subscriber_follows_a_vllm_style_publisher():
    zmq = pytest.importorskip("zmq")  # pyzmq and msgpack are optional
    zmq_asyncio = pytest.importorskip("zmq.asyncio")
    msgpack = pytest.importorskip("msgpack")

    publisher = zmq_asyncio.Context.instance().socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    index = ExactPrefixIndex(rehash=True)
    task = asyncio.create_task(zmq_event_subscriber(f"tcp://127.0.0.1:{port}", index))
    try:
        # vLLM sends bytes hashes; [topic, 8-byte sequence number, msgpack batch].
        batch = [1.0, [["BlockStored", [b"h1", b"h2"], None, TOKENS[:32], 16, None, "GPU"]]]
        for seq in range(2000):  # PUB drops messages until the subscriber has joined (10 s)
            await publisher.send_multipart(
                [b"kv-events", seq.to_bytes(8, "big"), msgpack.packb(batch)]
            )
            await asyncio.sleep(0.005)
            if index.match(HASHES) == 2:
                break
        assert index.match(HASHES) == 2
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        publisher.close(linger=0)


def test_exact_index_follows_blocks_into_the_kv_tiers_of_a_tiered_engine(tmp_path):
    """A tiered engine's own events: blocks evicted from the device but held in host
    memory are a tier match, priced as a load, not a device match."""
    from once.engine.config import EngineConfig
    from once.engine.core import LLMEngine
    from once.engine.testing import make_tiny_model
    from once.protocol.engine import GenerateRequest, SamplingParams

    folder = make_tiny_model(tmp_path / "tiny")
    config = EngineConfig(model=str(folder), block_size=4, num_kv_blocks=16, kv_host_blocks=64)
    engine = LLMEngine(config)
    engine.enable_kv_events()
    index = ExactPrefixIndex()
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = list(range(3, 25))
    engine.generate([GenerateRequest("first", tuple(first), greedy)])
    engine.generate([GenerateRequest("evicting", tuple(range(100, 158)), greedy)])
    engine.close()
    index.apply(engine.take_kv_events())
    hashes = block_hashes(first, 4)
    assert index.match(hashes) == 0  # gone from the device pool...
    assert index.match_tiers(hashes, 0) == len(hashes)  # ...held in host memory
    index.apply([BlockRemoved(hashes[2:3], "HOST")])
    assert index.match_tiers(hashes, 0) == 2
