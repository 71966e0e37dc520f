"""One KV block as bytes, for the tiers that keep blocks outside this process's memory.

    magic (8) | layout fingerprint (16) | block hash (8) | payload length (8) | crc32 (4)
    payload: K of every layer, then V of every layer, in the engine's dtype, C order

The fingerprint is a digest of what makes two blocks' bytes interchangeable: the model
files, dtype, layer count, block size, KV heads and head dim. A disk folder or a Redis
shared by engines of different models, or read after an upgrade that changed the layout,
can then never hand one of them another's K/V. The block hash covers the tokens and the
cache salt. CRC-32 over the payload catches torn writes and flipped bits (it is not a
defense against someone who can write the store, who could as well write a valid block).
Anything that fails a check is a miss: the caller recomputes, never reads wrong K/V.
"""

import hashlib
import mmap
import struct
import zlib

import torch

MAGIC = b"ONCEKV01"
_HEADER = struct.Struct("<8s16sQQI")
HEADER_BYTES = _HEADER.size


def layout_fingerprint(model_identity: str, dtype: torch.dtype, block_shape: tuple) -> bytes:
    text = f"{model_identity}|{dtype}|{tuple(block_shape)}"
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def encode_block(fingerprint: bytes, block_hash: int, k: torch.Tensor, v: torch.Tensor) -> bytes:
    payload = _raw_bytes(k) + _raw_bytes(v)
    header = _HEADER.pack(
        MAGIC, fingerprint, block_hash & (2**64 - 1), len(payload), zlib.crc32(payload)
    )
    return header + payload


def decode_block(
    data: bytes | bytearray | memoryview | mmap.mmap | None,
    fingerprint: bytes,
    block_hash: int,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
) -> bool:
    """Copy a stored block into `k_out`/`v_out`; False (nothing copied) unless every
    check passes: whole header, magic, layout, hash, length and checksum."""
    if data is None or len(data) < HEADER_BYTES:
        return False
    magic, stored_fingerprint, stored_hash, length, crc = _HEADER.unpack_from(data)
    half = k_out.numel() * k_out.element_size()
    if (
        magic != MAGIC
        or stored_fingerprint != fingerprint
        or stored_hash != block_hash & (2**64 - 1)
        or length != 2 * half
        or len(data) != HEADER_BYTES + length
    ):
        return False
    payload = memoryview(data)[HEADER_BYTES:]
    if zlib.crc32(payload) != crc:
        return False
    # A writable buffer (a copy-on-write mapping, a bytearray) is read in place.
    buffer = bytearray(payload) if payload.readonly else payload
    as_bytes = torch.frombuffer(buffer, dtype=torch.uint8)
    k_out.copy_(as_bytes[:half].view(k_out.dtype).view(k_out.shape))
    v_out.copy_(as_bytes[half:].view(v_out.dtype).view(v_out.shape))
    return True
