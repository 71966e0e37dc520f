"""Keep-alives: something on the wire while a response waits, so no client idles out.

A 14k-token prompt takes minutes to prefill on a busy CPU, and nothing streams meanwhile.
Clients give up on a silent stream: Codex CLI after `stream_idle_timeout_ms` (300 s by
default) with "idle timeout waiting for SSE", HTTP clients at their read timeout (the
`openai` and `anthropic` SDKs: 600 s). What resets each timer decides what to send:

- Codex (codex-rs/codex-api/src/sse/responses.rs) wraps `eventsource_stream` in
  `tokio::time::timeout(idle_timeout, stream.next())`. That stream yields only dispatched
  events: an SSE comment (`: keep-alive`) or a blank event never ends the wait. Any event
  with data does, even one it does not know (`_ => {}`). Over WebSocket
  (endpoint/responses_websocket.rs) the timer is on text frames: ping frames are answered
  in its pump task and never reach it. So the Responses API gets a real event on both
  transports: `response.in_progress` again, with the response as it stands, which the
  API already sends and every client (the SDKs, Codex) takes as a no-op.
- Messages: Anthropic's own `ping` event, which its SDK and Claude Code skip.
- Chat Completions has no event to spare (every `data:` line is a chunk its clients
  index into): an SSE comment, which every SSE parser drops, resets byte-level read
  timeouts (httpx, undici, proxies).

`with_keep_alives` yields `KEEP_ALIVE` between the items of a source whenever `interval_s`
passes without one, from the second item on (after the response's opening events). The
source advances in a task of its own so that waiting can be given up without cancelling
it; when the consumer stops early, a step still running is cancelled there (its finally
blocks run in that task) and waited for.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Final, TypeVar

T = TypeVar("T")


class _KeepAlive:
    def __repr__(self) -> str:
        return "KEEP_ALIVE"


KEEP_ALIVE: Final = _KeepAlive()
SSE_COMMENT: Final = b": keep-alive\n\n"
_closing: set[asyncio.Future] = set()  # cancelled steps still running their finally blocks


async def with_keep_alives(
    source: AsyncIterator[T], interval_s: float
) -> AsyncIterator[T | _KeepAlive]:
    """`source`'s items, with KEEP_ALIVE after every `interval_s` of waiting for the next."""
    step: asyncio.Future[T] | None = None
    started = False
    try:
        while True:
            if step is None:
                step = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({step}, timeout=interval_s if started else None)
            if not done:
                yield KEEP_ALIVE
                continue
            finished, step = step, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            started = True
            yield item
    finally:
        if step is not None and not step.done():
            step.cancel()
            _closing.add(step)  # held until it ends, even if this wait is cut short
            step.add_done_callback(_closing.discard)
            await asyncio.wait({step})
        elif step is not None and not step.cancelled():
            step.exception()  # retrieved: a step that failed while nobody waited is no news
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()  # a no-op when the cancelled step already ended it
