"""`GET /v1/responses/{id}/input_items`: the items a stored response was generated from.

As in the OpenAI API, a response continued with `previous_response_id` was generated from
the whole chain, so its input items are, oldest first: each earlier response's own input
items followed by its output items, then this response's own input items. The chain is
read back through the store (each record keeps only its request's new items), and stops
where a record has expired or was deleted: what is gone is not listed.

Items are returned in the API's item shapes (the SDK's `ResponseItem` union): a message
whose content was a plain string gets a one-part content list, every item gets an `id`
(the client's own, or one derived from the owning response and position, so pages stay
stable across calls) and a `status`. Paging follows the API: `order` (default `desc`,
newest first), `limit` 1-100 (default 20) and `after`, an item id from an earlier page.
"""

from once.gateway.state.store import ResponseStore
from once.protocol.errors import InvalidRequestError

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
# A chain longer than this is cut at its newest records (agent sessions run to hundreds).
MAX_CHAIN = 10_000


async def chain_items(store: ResponseStore, record, tenant: str) -> list[dict]:
    """Every input item of `record`, oldest first, in listed shape."""
    records = [record]
    seen = {record.id}
    previous = record.previous_response_id
    while previous and previous not in seen and len(records) < MAX_CHAIN:
        earlier = await store.get(previous, tenant)
        if earlier is None:
            break
        records.append(earlier)
        seen.add(earlier.id)
        previous = earlier.previous_response_id
    items: list[dict] = []
    for depth, stored in enumerate(reversed(records)):
        own = [listed(item, stored.id, i) for i, item in enumerate(stored.input_items)]
        items += own
        if depth < len(records) - 1:  # an earlier turn's output is input to the later ones
            items += [dict(item) for item in stored.response.get("output") or ()]
    return items


def listed(item: dict, owner_id: str, index: int) -> dict:
    """One request input item in the API's item shape."""
    item = dict(item)
    item.setdefault("id", f"item_{owner_id.removeprefix('resp_')}_{index}")
    item.setdefault("status", "completed")
    if item.get("type", "message") == "message":
        item["type"] = "message"
        content = item.get("content")
        if isinstance(content, str):
            assistant = item.get("role") == "assistant"
            part: dict[str, object] = {
                "type": "output_text" if assistant else "input_text",
                "text": content,
            }
            if assistant:
                part["annotations"] = []
            item["content"] = [part]
    return item


def page(items: list[dict], order: str, limit: int, after: str | None) -> dict:
    """One page of `items` (oldest first) in the API's list shape."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise InvalidRequestError(f"no input item with id {after!r}", param="after")
        start = ids.index(after) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }


def parse_query(query) -> tuple[str, int, str | None]:
    """(order, limit, after) from the query string, with the API's bounds."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequestError("'order' must be 'asc' or 'desc'", param="order")
    raw_limit = query.get("limit", str(DEFAULT_LIMIT))
    try:
        limit = int(raw_limit)
    except ValueError:
        raise InvalidRequestError("'limit' must be an integer", param="limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequestError(f"'limit' must be between 1 and {MAX_LIMIT}", param="limit")
    return order, limit, query.get("after")
