"""The KV block contract: how a cached block is named, and what is said about it.

Engines, the router's prefix indices, the simulator and vLLM replicas all speak it, so it
lives here, free of torch and of any layer.

Names: chained block hashes (the scheme vLLM uses).

    hash(block i) = H(hash(block i-1), token ids of block i, extra keys of block i)

so equal hashes mean equal whole prefixes, not just equal blocks. H is SHA-256 over the
pickled triple, as in vLLM; the first block's parent is a seed hash and its extra keys carry
the tenant's cache salt, so tenants never share blocks. Hashes are truncated to 64 bits
(the int form vLLM's KV events use for external consumers) to keep dict keys and event
payloads small; collisions are still guarded by comparing token ids on every hit.

Events: vLLM publishes `KVEventBatch(ts, events)` with `BlockStored(block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium)`, `BlockRemoved(block_hashes,
medium)` and `AllBlocksCleared()`. The dataclasses below carry the same fields, and their
dicts a `type` tag, so a router's exact prefix index can follow either kind of engine.
"""

import hashlib
import os
import pickle
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

# --- block hashes ----------------------------------------------------------------------


def _seed_hash() -> int:
    # A fixed seed (not os.urandom) so separate processes (engines, the router's
    # approximate index, the simulator) compute the same hashes for the same prefix.
    seed = os.environ.get("ONCE_HASH_SEED", "once")
    return int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big")


NONE_HASH = _seed_hash()


def hash_block_tokens(
    parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> int:
    parent = NONE_HASH if parent_hash is None else parent_hash
    payload = pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=5)
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "big")


def extend_block_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
) -> list[int]:
    """Append the hashes of every full block of `token_ids` not yet in `hashes`."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        extra = (cache_salt,) if (i == 0 and cache_salt) else None
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(parent, block, extra))
    return hashes


def block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[int]:
    return extend_block_hashes([], token_ids, block_size, cache_salt)


def prompt_tail_hash(
    hashes: Sequence[int], prompt: Sequence[int], block_size: int, cache_salt: str | None = None
) -> tuple[int, int] | None:
    """(hash, number of tokens) of a prompt's tail: the tokens past its last full block
    that a prefix match can use, all but the prompt's last token (whose logits make the
    first output token). None when that tail is empty. Prefill/decode disaggregation
    sends the tail's K/V so the decode side computes one token; its hash never equals a
    full block's (its extra keys say "tail")."""
    num_full = (len(prompt) - 1) // block_size
    tail = prompt[num_full * block_size : len(prompt) - 1]
    if not tail or len(hashes) < num_full:
        return None
    parent = hashes[num_full - 1] if num_full else None
    extra = ("tail", cache_salt if num_full == 0 else None)
    return hash_block_tokens(parent, tail, extra), len(tail)


# --- KV events (vLLM's format) ---------------------------------------------------------


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "CPU"
    # Per block, what else went into its hash besides parent and tokens (vLLM >= 0.11
    # publishes them: the first block's carries the cache salt), or None throughout.
    extra_keys: list | None = None

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
