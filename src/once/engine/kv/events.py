"""KV cache events in vLLM's format, so a router's exact prefix index can follow them.

vLLM publishes `KVEventBatch(ts, events)` with `BlockStored(block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium)`, `BlockRemoved(block_hashes, medium)` and
`AllBlocksCleared()`. The dicts below carry the same fields plus a `type` tag.
"""

import time
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "CPU"

    def to_dict(self) -> dict:
        return {"type": "BlockStored", **asdict(self)}


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = "CPU"

    def to_dict(self) -> dict:
        return {"type": "BlockRemoved", **asdict(self)}


@dataclass(frozen=True)
class AllBlocksCleared:
    def to_dict(self) -> dict:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    events: list[KVEvent]
    ts: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return {"ts": self.ts, "events": [e.to_dict() for e in self.events]}
