"""Prefix indices: which full blocks of a prompt a replica probably (or surely) holds.

Blocks are named by chained hashes (`once.protocol.kv_blocks`, vLLM's scheme), so "the
first k hashes are present" means "the first k blocks of this exact prefix are cached".
Both indices answer `match(block_hashes) -> number of leading blocks present`.

- `ApproximatePrefixIndex` is kept by the router from what it routed: the prompt's blocks
  when a request is sent (SGLang's router inserts at routing time too), and the blocks of
  prompt + output when it finishes (the next turn of a conversation starts with them). It
  cannot see evictions, so it is bounded: an LRU over at most `max_blocks` hashes, which
  should be about the replica's KV capacity.
- `ExactPrefixIndex` follows the engine's KV events (BlockStored / BlockRemoved /
  AllBlocksCleared, vLLM's format; the once engine publishes the same). With
  `rehash=True` it re-derives the router's own hash of each stored block from the event's
  token ids and the parent's hash (as Dynamo's indexer does), so it works with an engine
  whose hash function differs (vLLM's); the block's `extra_keys` (vLLM publishes the
  cache salt there) join the hash as once's own hashing adds them, so a tenant's salted
  prompts match; events without them leave salted prompts unmatched (a conservative miss).
  With `rehash=False` the engine's hashes are used as
  they are: right for the once engine, which hashes like the router.

KV tiers: events whose medium names a tier below the device pool (HOST, DISK, SHARED, as
the once engine's tiered connector sends them; vLLM's offloading sends CPU for a GPU
engine's host tier, which the index cannot tell from a CPU engine's device pool, so only
once's names count) go to a second set: `match_tiers` counts how far a prefix goes on in
the tiers past the device match, which a policy prices as load time, not recompute.
Tier events carry no token ids, so they are keyed by the engine's hashes (right for the
once engine; with `rehash` a tier block counts only while the device copy's router hash
is known).

`decode_vllm_event_batch` turns one decoded vLLM ZMQ payload (msgpack of msgspec structs,
`array_like` and tagged) into these events; `zmq_event_subscriber` (needs `pyzmq` and
`msgpack`, not installed here) reads them from a vLLM server's publisher.
"""

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from once.protocol.kv_blocks import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    hash_block_tokens,
)


def count_leading(present, block_hashes: Sequence[int]) -> int:
    num_blocks = 0
    for block_hash in block_hashes:
        if block_hash not in present:
            break
        num_blocks += 1
    return num_blocks


class ApproximatePrefixIndex:
    kind = "approximate"

    def __init__(self, max_blocks: int = 2000):
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()  # LRU, oldest first
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, block_hashes: Sequence[int]) -> int:
        # Read-only: scoring every replica must not refresh the ones not chosen.
        return count_leading(self._blocks, block_hashes)

    def record(self, block_hashes: Sequence[int]) -> None:
        """The replica was sent (or computed) these blocks: they are now most recent."""
        for block_hash in block_hashes:
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
            self.num_evicted += 1

    def clear(self) -> None:
        self._blocks.clear()


TIER_MEDIA = ("HOST", "DISK", "SHARED")


class ExactPrefixIndex:
    kind = "exact"

    def __init__(self, *, rehash: bool = False):
        self.rehash = rehash
        self._tier_blocks: dict[str, set[int]] = {medium: set() for medium in TIER_MEDIA}
        # engine hash -> router hash (identity without rehash); the keys are what the
        # replica holds now.
        self._blocks: dict = {}
        self._router_hashes: dict[int, int] = {}  # router hash -> reference count
        self.num_events = 0
        self.num_bad_batches = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, block_hashes: Sequence[int]) -> int:
        return count_leading(self._router_hashes, block_hashes)

    def match_tiers(self, block_hashes: Sequence[int], start: int) -> int:
        """Blocks after the first `start` held in some tier below the device pool."""
        count = 0
        for block_hash in block_hashes[start:]:
            if not any(block_hash in blocks for blocks in self._tier_blocks.values()):
                break
            count += 1
        return count

    def _apply_tier(self, event: BlockStored | BlockRemoved) -> None:
        blocks = self._tier_blocks[event.medium]  # type: ignore[index]
        for engine_hash in event.block_hashes:
            router_hash = self._blocks.get(engine_hash, None if self.rehash else engine_hash)
            if router_hash is None:
                continue
            if isinstance(event, BlockStored):
                blocks.add(router_hash)
            else:
                blocks.discard(router_hash)

    def apply(self, events: Iterable[KVEvent | dict]) -> None:
        for event in events:
            if isinstance(event, dict):
                event = event_from_dict(event)
            self.num_events += 1
            medium = getattr(event, "medium", None)
            if medium in TIER_MEDIA and isinstance(event, BlockStored | BlockRemoved):
                self._apply_tier(event)
            elif isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                for engine_hash in event.block_hashes:
                    self._remove(engine_hash)
            elif isinstance(event, AllBlocksCleared):
                self._blocks.clear()  # the device pool only: tiers keep their blocks
                self._router_hashes.clear()
            else:
                raise ValueError(f"not a KV event: {event!r}")

    def clear(self) -> None:
        self.apply([AllBlocksCleared()])

    def _store(self, event: BlockStored) -> None:
        size = event.block_size
        if size < 1 or len(event.token_ids) < size * len(event.block_hashes):
            raise ValueError(
                f"BlockStored has {len(event.token_ids)} token ids for "
                f"{len(event.block_hashes)} blocks of {size}"
            )
        parent = None
        if self.rehash and event.parent_block_hash is not None:
            parent = self._blocks.get(event.parent_block_hash)
            if parent is None:
                return  # the parent is unknown (evicted, or before we subscribed)
        for i, engine_hash in enumerate(event.block_hashes):
            if engine_hash in self._blocks:
                parent = self._blocks[engine_hash]
                continue
            if self.rehash:
                tokens = event.token_ids[i * size : (i + 1) * size]
                parent = hash_block_tokens(parent, tokens, _extra_keys(event, i))
                router_hash = parent
            else:
                router_hash = engine_hash
            self._blocks[engine_hash] = router_hash
            self._router_hashes[router_hash] = self._router_hashes.get(router_hash, 0) + 1

    def _remove(self, engine_hash) -> None:
        router_hash = self._blocks.pop(engine_hash, None)
        if router_hash is None:
            return
        count = self._router_hashes[router_hash] - 1
        if count:
            self._router_hashes[router_hash] = count
        else:
            del self._router_hashes[router_hash]


def _extra_keys(event: BlockStored, i: int) -> tuple | None:
    """Block i's extra hash keys as once hashes them: vLLM publishes the cache salt as the
    first block's `[salt]`, which once hashes as `(salt,)`."""
    keys = event.extra_keys[i] if event.extra_keys and i < len(event.extra_keys) else None
    return tuple(keys) if keys else None


def event_from_dict(data: dict) -> KVEvent:
    """The inverse of the events' `to_dict` (the once engine's JSON form)."""
    kind = data.get("type")
    if kind == "BlockStored":
        return BlockStored(
            block_hashes=list(data["block_hashes"]),
            parent_block_hash=data.get("parent_block_hash"),
            token_ids=list(data["token_ids"]),
            block_size=int(data["block_size"]),
            lora_id=data.get("lora_id"),
            medium=data.get("medium"),
            extra_keys=data.get("extra_keys"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(list(data["block_hashes"]), data.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {kind!r}")


def decode_vllm_event_batch(payload: Sequence) -> list[KVEvent]:
    """One vLLM `KVEventBatch` as msgpack decodes it: `[ts, events, dp_rank?]`. Each event
    is a map tagged by `type` (vLLM 0.32: the events are not `array_like`, only the batch
    is; extra fields such as `group_idx` are ignored) or, from older versions,
    `[tag, *fields]` in declaration order with trailing defaults omitted."""
    if not isinstance(payload, list | tuple) or len(payload) < 2:
        raise ValueError("a vLLM KV event batch is [ts, events, ...]")
    events: list[KVEvent] = []
    for raw in payload[1]:
        if isinstance(raw, dict):
            events.append(event_from_dict(raw))
            continue
        tag, fields = raw[0], list(raw[1:])
        if tag == "BlockStored":
            fields += [None] * (6 - len(fields))
            hashes, parent, token_ids, block_size, lora_id, medium = fields[:6]
            events.append(
                BlockStored(list(hashes), parent, list(token_ids), int(block_size), lora_id, medium)
            )
        elif tag == "BlockRemoved":
            events.append(BlockRemoved(list(fields[0]), fields[1] if len(fields) > 1 else None))
        elif tag == "AllBlocksCleared":
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown vLLM KV event tag {tag!r}")
    return events


async def zmq_event_subscriber(endpoint: str, index: ExactPrefixIndex, topic: str = "") -> None:
    """Follow a vLLM publisher (`--kv-events-config '{"enable_kv_cache_events": true,
    "publisher": "zmq", "endpoint": "tcp://*:5557"}'`) until cancelled. Frames are
    `[topic, seq (8 bytes big-endian), msgpack payload]`. Needs `pyzmq` and `msgpack`."""
    import msgpack  # noqa: PLC0415 - optional dependencies, only for vLLM replicas
    import zmq  # noqa: PLC0415
    import zmq.asyncio  # noqa: PLC0415

    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.connect(endpoint)
    socket.setsockopt_string(zmq.SUBSCRIBE, topic)
    try:
        while True:
            frames = await socket.recv_multipart()
            try:
                index.apply(decode_vllm_event_batch(msgpack.unpackb(frames[-1], raw=False)))
            except (ValueError, TypeError, KeyError, IndexError):
                index.num_bad_batches += 1  # one malformed batch must not stop the feed
    finally:
        socket.close(linger=0)
