"""Load: many concurrent WebSocket sessions of replayed agent traffic for a bounded time.

The gateway runs as its own process (gateway_server.py) around a scripted engine that
streams every response at a fixed token rate; this process is the client. `sessions`
slots each run one replayed session at a time (replay_frames.py) on a connection of its
own: its calls in order, a tool pause between two calls, the connection closed at the
end; then the slot starts the next session, until `seconds` are up (a session started
before then runs to its end). A warm-up round (one session per slot) comes first, so
the caches that fill once (tokenizer, the SDK's validators, bounded LRUs) are full
before memory is first read.

Figures:
- errors: calls that got an error frame, ended other than `completed`, lost their
  connection or passed the hang guard;
- the time the gateway added per response: its own measurement (pipeline.py), the
  `once_gateway_added_seconds` histogram scraped before and after the timed run, as
  `once bench gateway` reads it;
- memory: VmRSS of the gateway process at gc-stable points (SIGUSR1 makes it collect
  first): at the start (after the warm-up, no session open), at checkpoints during the
  run, and at the end (every session closed). Growth per 1k sessions is the least-squares
  slope of the checkpoints' RSS against the sessions completed by then, over the
  checkpoints taken once twice `sessions` sessions have completed. RSS is a high-water
  mark (malloc keeps its heap), so it rises until the mix of open sessions has been at
  its largest, and with `sessions` slots that takes more than one generation of them: in
  two runs on the same code, a slope from the first generation on read 1.2 and 6.8
  MB/1k, both from a jump at 1.3-1.6 generations, flat after it. From the second on,
  what open sessions hold is a constant the slope ignores, while what finished sessions
  leave behind adds up. A slope over many points does not swing with one noisy reading
  the way end minus start would.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import time

import websockets

from once.bench.gateway_bench.overhead import (
    ADDED_HISTOGRAM,
    histogram_quantile,
    percentile,
    scrape_histogram,
)
from once.bench.reliability.process import GatewayProcess
from once.bench.reliability.replay_frames import PREVIOUS, ReplayScript, replay_scripts

CALL_TIMEOUT_S = 120.0  # a hang guard, far above any call's time
# The context the load's gateway serves: the recorded sessions' calls run past SmolLM2's
# 8192 tokens, and the engine is scripted, so any context costs the same.
LOAD_CONTEXT = 32768
TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


async def gc_stable_rss_mb(gateway: GatewayProcess) -> float:
    os.kill(gateway.pid, signal.SIGUSR1)
    await asyncio.sleep(0.5)  # the collection runs at the server's next bytecode
    return gateway.rss_mb()


def growth_slope_mb_per_1k(checkpoints: list[dict]) -> float | None:
    """Least-squares slope of RSS against completed sessions, in MB per 1,000 sessions."""
    xs = [point["completed_sessions"] for point in checkpoints]
    ys = [point["rss_mb"] for point in checkpoints]
    if len(xs) < 3 or len(set(xs)) < 2:
        return None
    return 1000 * statistics.linear_regression(xs, ys).slope


class LoadClient:
    def __init__(self, url: str, scripts: list[ReplayScript], think_s: float, seed: int):
        self.ws_url = url.replace("http://", "ws://") + "/v1/responses"
        self.scripts = scripts
        self.think_s = think_s
        self.rng = random.Random(seed)
        self.num_started = 0
        self.completed_sessions = 0
        self.requests = 0
        self.errors = 0
        self.error_samples: list[str] = []
        self.latencies_s: list[float] = []

    def _error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what[:300])

    async def session(self) -> None:
        replay = self.num_started
        self.num_started += 1
        script = self.scripts[replay % len(self.scripts)]
        frames = script.frames_for(replay)
        rng = random.Random(replay)
        previous_id = None
        try:
            async with websockets.connect(
                self.ws_url, compression=None, max_size=None, ping_interval=None,
                open_timeout=CALL_TIMEOUT_S, close_timeout=10,
            ) as socket:  # fmt: skip
                for index, frame in enumerate(frames):
                    if index:
                        await asyncio.sleep(rng.uniform(0.5, 1.5) * self.think_s)
                    if frame.get("previous_response_id") == PREVIOUS:
                        frame = {**frame, "previous_response_id": previous_id}
                    previous_id = await self.call(socket, frame, script.session_id)
                    if previous_id is None:
                        return
        except (OSError, websockets.WebSocketException, TimeoutError) as e:
            self._error(f"{script.session_id}: connection {type(e).__name__}: {e}")
            return
        self.completed_sessions += 1

    async def call(self, socket, frame: dict, session_id: str) -> str | None:
        """One response, read to its terminal event; its id, or None after an error."""
        self.requests += 1
        started = time.perf_counter()
        await socket.send(json.dumps(frame, ensure_ascii=False))
        async with asyncio.timeout(CALL_TIMEOUT_S):
            while True:
                event = json.loads(await socket.recv())
                if event.get("type") in TERMINAL:
                    break
        if event["type"] != "response.completed":
            self._error(f"{session_id}: {event['type']}: {json.dumps(event)[:200]}")
            return None
        self.latencies_s.append(time.perf_counter() - started)
        return event["response"]["id"]

    async def run_slots(self, num_slots: int, deadline: float | None) -> None:
        """Each slot runs sessions back to back until the deadline (None: one each)."""

        async def slot() -> None:
            await asyncio.sleep(self.rng.uniform(0, self.think_s))  # slots start spread out
            while True:
                await self.session()
                if deadline is None or time.monotonic() >= deadline:
                    return

        await asyncio.gather(*(slot() for _ in range(num_slots)))


async def _measure(
    gateway: GatewayProcess, client: LoadClient, sessions: int, seconds: float, num_checkpoints: int
) -> dict:
    url = gateway.url
    await client.run_slots(sessions, None)  # the warm-up round
    warmup_completed, warmup_errors = client.completed_sessions, client.errors
    rss_start = await gc_stable_rss_mb(gateway)
    added_before = await asyncio.to_thread(scrape_histogram, url, ADDED_HISTOGRAM)
    client.completed_sessions = client.requests = client.errors = 0
    client.latencies_s.clear()

    started = time.monotonic()
    checkpoints: list[dict] = []

    async def record_checkpoints() -> None:
        interval = seconds / num_checkpoints
        for n in range(1, num_checkpoints + 1):
            await asyncio.sleep(max(0.0, started + n * interval - time.monotonic()))
            rss = await gc_stable_rss_mb(gateway)
            checkpoints.append(
                {"t_s": round(time.monotonic() - started, 2),
                 "completed_sessions": client.completed_sessions, "rss_mb": round(rss, 2)}
            )  # fmt: skip

    monitor = asyncio.create_task(record_checkpoints())
    await client.run_slots(sessions, started + seconds)
    await monitor
    wall_s = time.monotonic() - started
    rss_end = await gc_stable_rss_mb(gateway)
    added_after = await asyncio.to_thread(scrape_histogram, url, ADDED_HISTOGRAM)
    added = {bound: added_after[bound] - added_before.get(bound, 0.0) for bound in added_after}
    steady = [point for point in checkpoints if point["completed_sessions"] >= 2 * sessions]
    slope = growth_slope_mb_per_1k(steady)
    latencies = client.latencies_s or [float("nan")]
    return {
        "load_sessions": sessions,
        "load_seconds": round(wall_s, 1),
        "load_completed_sessions": client.completed_sessions,
        "load_requests": client.requests,
        "load_errors": client.errors,
        "load_error_samples": client.error_samples,
        "load_added_ms_p50": 1000 * histogram_quantile(added, 0.50),
        "load_added_ms_p99": 1000 * histogram_quantile(added, 0.99),
        "load_added_responses": added.get(float("inf"), 0.0),
        "load_e2e_ms_p50": 1000 * percentile(latencies, 50),
        "load_e2e_ms_p99": 1000 * percentile(latencies, 99),
        "gateway_rss_mb_start": round(rss_start, 2),
        "gateway_rss_mb_end": round(rss_end, 2),
        "gateway_memory_growth_mb_per_1k_sessions": slope,
        "load_memory_checkpoints": checkpoints,
        "load_warmup_sessions": warmup_completed,
        "load_warmup_errors": warmup_errors,
    }


def run_load(
    sessions: int = 256,
    seconds: float = 60,
    *,
    calls_per_session: int = 6,
    token_rate: float = 50.0,
    output_tokens: int = 32,
    think_s: float = 1.0,
    num_checkpoints: int = 16,
    seed: int = 0,
) -> dict:
    """`sessions` concurrent replayed sessions for `seconds`; the figures above, flat."""
    if sessions < 1 or seconds <= 0 or num_checkpoints < 1:
        raise ValueError("sessions, seconds and num_checkpoints must be positive")
    scripts = replay_scripts(calls_per_session=calls_per_session)
    gateway = GatewayProcess(
        token_rate=token_rate, output_tokens=output_tokens, max_model_len=LOAD_CONTEXT
    )
    with gateway:
        client = LoadClient(gateway.url, scripts, think_s, seed)
        result = asyncio.run(_measure(gateway, client, sessions, seconds, num_checkpoints))
        num_log_lines, log_tail = gateway.num_log_lines(), gateway.log_tail()
    result.update(
        load_gateway_log_lines=num_log_lines,
        load_gateway_log_tail=log_tail if num_log_lines else "",
        load_calls_per_session=calls_per_session,
        load_token_rate=token_rate,
        load_output_tokens=output_tokens,
        load_think_s=think_s,
        load_recorded_sessions=len(scripts),
    )
    return result
