"""How a stored response is encoded: one validated row, the same for every backend.

Token ids are little-endian int32 bytes (4 bytes an id instead of a JSON number or a
Python int), dicts compact JSON. Encoding validates, so a bad record fails before any
write; decoding failures read as None with a warning (see store.py's contract).
"""

import json
import logging
import math
import struct
import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

# Warnings keep the store's logger name: operators filter on it.
logger = logging.getLogger("once.gateway.state.store")


@dataclass
class StoredResponse:
    id: str
    tenant: str
    created_at: float  # unix seconds
    response: dict  # the Responses API object as returned to the client
    input_items: list[dict]  # this request's own new input items
    previous_response_id: str | None
    render_key: str  # fingerprint of (model, instructions, tools) used to render
    prompt_token_ids: list[int]  # the full prompt ids of this response
    output_token_ids: list[int]  # ids the model produced
    expires_at: float = 0.0  # set by the store from its TTL on put


# -- encoding -------------------------------------------------------------------------------


class _Row(NamedTuple):
    # One encoded record; also the SQLite column order.
    tenant: str
    id: str
    created_at: float
    expires_at: float
    previous_response_id: str | None
    render_key: str
    response_json: str
    input_items_json: str
    prompt_ids: bytes
    output_ids: bytes


def _ids_to_bytes(ids: list[int], field: str) -> bytes:
    try:
        packed = array("i", ids)  # 'i' is 4 bytes on every platform CPython supports
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"{field} must be a list of int32 token ids ({exc})") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _ids_from_bytes(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"token id blob has {len(data)} bytes, not a multiple of 4")
    packed = array("i")
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


def _to_json(value: object, field: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{field} is not JSON-serializable ({exc})") from None


def _encode(record: StoredResponse, expires_at: float) -> _Row:
    created_at = record.created_at
    checks = (
        (isinstance(record.id, str) and record.id, "id must be a non-empty string"),
        (isinstance(record.tenant, str) and record.tenant, "tenant must be a non-empty string"),
        (isinstance(record.render_key, str), "render_key must be a string"),
        (isinstance(record.previous_response_id, str | None), "previous_response_id: str|None"),
        (isinstance(created_at, int | float) and math.isfinite(created_at), "bad created_at"),
        (isinstance(record.response, dict), "response must be a dict"),
        (
            isinstance(record.input_items, list)
            and all(isinstance(item, dict) for item in record.input_items),
            "input_items must be a list of dicts",
        ),
    )
    for ok, problem in checks:
        if not ok:
            raise ValueError(f"stored response {record.id!r}: {problem}")
    return _Row(
        record.tenant,
        record.id,
        float(created_at),
        expires_at,
        record.previous_response_id,
        record.render_key,
        _to_json(record.response, "response"),
        _to_json(record.input_items, "input_items"),
        _ids_to_bytes(record.prompt_token_ids, "prompt_token_ids"),
        _ids_to_bytes(record.output_token_ids, "output_token_ids"),
    )


def _decode(row: _Row) -> StoredResponse:
    response = json.loads(row.response_json)
    input_items = json.loads(row.input_items_json)
    types = (str, str, float, float, str | None, str)
    if not all(isinstance(value, kind) for value, kind in zip(row[:6], types, strict=True)):
        raise ValueError("a scalar field has the wrong type")
    if not isinstance(response, dict) or not isinstance(input_items, list):
        raise ValueError("response or input_items has the wrong type")
    return StoredResponse(
        id=row.id,
        tenant=row.tenant,
        created_at=row.created_at,
        response=response,
        input_items=input_items,
        previous_response_id=row.previous_response_id,
        render_key=row.render_key,
        prompt_token_ids=_ids_from_bytes(row.prompt_ids),
        output_token_ids=_ids_from_bytes(row.output_ids),
        expires_at=row.expires_at,
    )


# Blob layout (memory and Redis stores):
#   magic | u32 x4 lengths (scalars, response, input_items, prompt) | scalars JSON |
#   response JSON | input_items JSON | prompt ids | output ids (the rest)
_BLOB_MAGIC = b"once-response-v1:"
_BLOB_HEADER = struct.Struct("<4I")


def _pack(row: _Row) -> bytes:
    scalars = json.dumps(list(row[:6])).encode()
    parts = [scalars, row.response_json.encode(), row.input_items_json.encode(), row.prompt_ids]
    header = _BLOB_HEADER.pack(*(len(part) for part in parts))
    return b"".join([_BLOB_MAGIC, header, *parts, row.output_ids])


def _unpack(blob: bytes) -> _Row:
    if not blob.startswith(_BLOB_MAGIC):
        raise ValueError("not a once stored-response blob")
    offset = len(_BLOB_MAGIC)
    lengths = _BLOB_HEADER.unpack_from(blob, offset)
    offset += _BLOB_HEADER.size
    parts = []
    for length in lengths:
        parts.append(blob[offset : offset + length])
        offset += length
    scalars = json.loads(parts[0])
    if not isinstance(scalars, list) or len(scalars) != 6:
        raise ValueError("bad scalar header")
    tenant, response_id, created_at, expires_at, previous_response_id, render_key = scalars
    return _Row(
        tenant,
        response_id,
        created_at,
        expires_at,
        previous_response_id,
        render_key,
        parts[1].decode(),
        parts[2].decode(),
        parts[3],
        blob[offset:],
    )


def _decode_or_none(load: Callable[[], _Row], where: str) -> StoredResponse | None:
    try:
        return _decode(load())
    except (ValueError, TypeError, struct.error) as exc:
        logger.warning("stored response %s is corrupt and was ignored: %s", where, exc)
        return None


def _check_ttl(ttl_s: float) -> float:
    if not isinstance(ttl_s, int | float) or not math.isfinite(ttl_s) or ttl_s <= 0:
        raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
    return float(ttl_s)
