"""How long a replay's clients wait, and what they say while they do.

A replay call waits for real work: on a quiet machine the naive stack's 14k-token prefill
takes a minute on two cores; on a busy one (three CPU-bound jobs beside it) it took over
ten, and the client's old fixed 600 s timeout turned that slowness into a failure with no
report (issue 31). So the clients never time out waiting for the server to answer:

- connect (TCP to the loopback gateway, the WebSocket handshake): bounded, generously;
  an accept that does not come in minutes is a dead server, not a slow one.
- read (the gap between two streamed bytes): unbounded by default. The gateway streams a
  keep-alive while it waits for the engine (gateway/keep_alive.py), so a finite read
  timeout is a liveness check only when it is longer than the keep-alive interval;
  `read_s` lets a test shrink it to show exactly that.
- WebSocket pings: off on the client. Client and gateway share one event loop in a
  replay; a ping unanswered for 20 s on a starved loop would close a healthy connection.

`waiting_notices` prints a line while one call has waited long, so a slow run shows where
it is (the progress bars' elapsed time does not render in a log that is not a terminal).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import openai

NOTICE_EVERY_S = 60.0


@dataclass(frozen=True)
class ClientTimeouts:
    connect_s: float = 120.0
    read_s: float | None = None  # None: wait as long as the server keeps the stream open
    write_s: float = 600.0  # the naive stack's full-history bodies, over loopback
    websocket_open_s: float = 120.0

    def sdk(self) -> openai.Timeout:
        """For the `openai` and `anthropic` SDKs (both on httpx2)."""
        return openai.Timeout(
            connect=self.connect_s, read=self.read_s, write=self.write_s, pool=self.connect_s
        )

    def websocket_options(self) -> dict:
        """`websockets` connect options for the SDK's `responses.connect()`."""
        return {"open_timeout": self.websocket_open_s, "ping_interval": None}


PATIENT = ClientTimeouts()


@contextlib.asynccontextmanager
async def waiting_notices(
    what: str, log: Callable[[str], None] | None, every_s: float = NOTICE_EVERY_S
) -> AsyncIterator[None]:
    """While the body runs, `log` "<what>: still waiting after N s" every `every_s`."""
    if log is None:
        yield
        return
    started = time.perf_counter()

    async def notify() -> None:
        while True:
            await asyncio.sleep(every_s)
            log(f"{what}: still waiting after {time.perf_counter() - started:.0f} s")

    notices = asyncio.create_task(notify())
    try:
        yield
    finally:
        notices.cancel()
        await asyncio.gather(notices, return_exceptions=True)
