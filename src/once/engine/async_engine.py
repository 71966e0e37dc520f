"""AsyncEngine: the in-process EngineClient.

The synchronous step loop runs on its own thread (torch releases the GIL inside ops, so
the event loop stays responsive); requests and aborts reach it through a locked inbox, and
deltas come back to each caller's asyncio queue via call_soon_threadsafe.

Throttle (`EngineConfig.slowdown` s >= 1): after each step the loop sleeps (s - 1) x the
step's wall time and only then delivers the step's deltas, so every token leaves s times
later than it would have: the replica behaves as a machine s times slower (a first
token is delayed too, which a sleep after delivery would not do).
"""

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable

from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.os_threads import ENGINE_THREAD_NAME, name_os_thread
from once.protocol.engine import GenerateRequest, TokenDelta
from once.protocol.errors import EngineDeadError, OnceError


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.engine = engine
        self._slowdown = engine.config.slowdown
        self._sleep, self._clock = sleep, clock  # injectable: tests check the throttle
        self.throttle_sleep_s = 0.0  # seconds slept by the throttle, in total
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._inbox_adds: list[GenerateRequest] = []
        self._inbox_aborts: list[str] = []
        self._inbox_pauses: list[tuple[str, float]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD_NAME, daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine(config))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        # Raises before anything is admitted. A constraint is compiled there (cached after):
        # on a thread, since the first one also builds the grammar tokenizer (~1 s).
        if request.sampling.constraint is None:
            self.engine.validate(request)
        else:
            await asyncio.to_thread(self.engine.validate, request)
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request.request_id in self._streams:
                raise OnceError(f"request id {request.request_id!r} is already streaming")
            self._streams[request.request_id] = (asyncio.get_running_loop(), queue)
            self._inbox_adds.append(request)
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
                if not finished:  # the caller went away: free the request's blocks
                    self._inbox_aborts.append(request.request_id)
            self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox_aborts.append(request_id)
        self._wakeup.set()

    async def pause_session(self, session_key: str, expected_s: float) -> None:
        """A hint: the session's agent runs a tool for about `expected_s`."""
        with self._lock:
            self._inbox_pauses.append((session_key, expected_s))
        self._wakeup.set()

    async def stats(self) -> dict:
        stats = self.engine.stats()
        stats["engine_alive"] = self._dead is None
        stats["slowdown"] = self._slowdown
        stats["throttle_sleep_s"] = self.throttle_sleep_s
        return stats

    async def close(self) -> None:
        self._stopped = True
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join, 10)
        if not self._thread.is_alive():
            await asyncio.to_thread(self.engine.close)

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _run(self) -> None:
        name_os_thread(ENGINE_THREAD_NAME)
        try:
            while not self._stopped:
                with self._lock:
                    adds, self._inbox_adds = self._inbox_adds, []
                    aborts, self._inbox_aborts = self._inbox_aborts, []
                    pauses, self._inbox_pauses = self._inbox_pauses, []
                for request in adds:
                    try:
                        self.engine.add_request(request)
                    except OnceError as exc:
                        self._deliver(request.request_id, exc)
                for request_id in aborts:
                    self.engine.abort_request(request_id)
                for session_key, expected_s in pauses:
                    self.engine.pause_session(session_key, expected_s)
                if not self.engine.has_unfinished_requests():
                    self.engine.run_timers()
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                started = self._clock()
                deltas = self.engine.step()
                self.engine.publish_kv_events()  # before the tokens: routers see blocks first
                if self._slowdown > 1.0:
                    pause_s = (self._slowdown - 1.0) * (self._clock() - started)
                    self.throttle_sleep_s += pause_s
                    self._sleep(pause_s)
                for delta in deltas:
                    self._deliver(delta.request_id, delta)
        except BaseException as exc:  # the loop must never die silently
            self._dead = exc
            with self._lock:
                streams = list(self._streams)
            for request_id in streams:
                self._deliver(request_id, EngineDeadError(f"engine loop died: {exc!r}"))
