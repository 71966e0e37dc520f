"""The engine out of KV blocks under a burst.

A real engine (the tiny random-weight model, on CPU) with room for less than two requests'
blocks and a queue of `MAX_NUM_WAITING`, served as `once engine` is, takes a burst of
`NUM_REQUESTS` requests at once. Each client honours the answer: a request refused with
503 `engine_overloaded` is sent again after its `retry-after`, up to `MAX_TRIES` times.
What must hold:

- admission queues what fits (running requests preempt each other for blocks and are
  recomputed) and refuses the rest before any token with 503 `engine_overloaded` and a
  `retry-after` header: never a crash, a hang or a half-streamed answer;
- every request completes within its tries; afterwards the engine is alive, holds no
  request's blocks, and answers its health check.
"""

import asyncio
import json

import httpx

from once.bench.reliability.fault_kit import FaultContext, FaultResult
from once.gateway.testing import serve_app
from once.protocol.engine import GenerateRequest, SamplingParams

NUM_KV_BLOCKS = 12  # of 16 tokens: one request below needs 8
MAX_NUM_WAITING = 4
NUM_REQUESTS = 16
NUM_PROMPT_TOKENS = 64
NUM_OUTPUT_TOKENS = 64
MAX_TRIES = 10
REQUEST_TIMEOUT_S = 60.0  # hang guard


class BurstClient:
    """One request of the burst, sent until it completes or its tries run out."""

    def __init__(self, http: httpx.AsyncClient, index: int):
        self.http = http
        self.index = index
        self.tries = 0
        self.refusals: list[tuple[int, str | None, str | None]] = []  # status, code, retry-after
        self.output: list[int] = []
        self.finish_reason: str | None = None

    def request(self) -> dict:
        prompt = tuple(3 + (self.index * 7 + i) % 250 for i in range(NUM_PROMPT_TOKENS))
        sampling = SamplingParams(max_tokens=NUM_OUTPUT_TOKENS, ignore_eos=True, seed=self.index)
        return GenerateRequest(f"burst-{self.index}-{self.tries}", prompt, sampling).to_dict()

    async def run(self) -> None:
        while self.tries < MAX_TRIES and self.finish_reason is None:
            self.tries += 1
            async with self.http.stream("POST", "/v1/generate", json=self.request()) as reply:
                if reply.status_code != 200:
                    error = json.loads(await reply.aread()).get("error", {})
                    retry_after = reply.headers.get("retry-after")
                    self.refusals.append((reply.status_code, error.get("code"), retry_after))
                    await asyncio.sleep(float(retry_after or 1))
                    continue
                async for line in reply.aiter_lines():
                    if line.strip():
                        delta = json.loads(line)
                        self.output.extend(delta.get("token_ids") or ())
                        self.finish_reason = delta.get("finish_reason") or self.finish_reason


async def kv_blocks_exhausted_by_a_burst(context: FaultContext) -> FaultResult:
    from once.engine.async_engine import AsyncEngine
    from once.engine.config import EngineConfig
    from once.engine.testing import make_tiny_model
    from once.engine_http.server import build_engine_app

    folder = make_tiny_model(context.folder("kv_burst") / "tiny")
    config = EngineConfig(
        model=str(folder),
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_num_waiting=MAX_NUM_WAITING,
        num_threads=1,
    )
    engine = AsyncEngine.from_config(config)
    try:
        app = build_engine_app(engine, model_name="tiny")
        async with (
            serve_app(app) as (url, _),
            httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as http,
        ):
            clients = [BurstClient(http, i) for i in range(NUM_REQUESTS)]
            async with asyncio.timeout(REQUEST_TIMEOUT_S * 2):
                await asyncio.gather(*(client.run() for client in clients))
            health = await http.get("/healthz")
            stats = await engine.stats()
    finally:
        await engine.close()

    refusals = [refusal for client in clients for refusal in client.refusals]
    completed = [c for c in clients if c.finish_reason == "length"]
    checks = {
        "the burst overflowed the queue": bool(refusals),
        "refusals are 503 engine_overloaded with retry-after": all(
            status == 503 and code == "engine_overloaded" and retry_after
            for status, code, retry_after in refusals
        ),
        "every admitted request streamed its whole output": all(
            len(c.output) == NUM_OUTPUT_TOKENS for c in completed
        ),
        "the engine is alive and healthy": stats["engine_alive"] and health.status_code == 200,
        "no request holds KV blocks afterwards": stats["num_kv_blocks_used"] == 0
        and stats["num_running"] == stats["num_waiting"] == 0,
    }
    return FaultResult(
        "kv_burst",
        checks,
        sessions_lost=NUM_REQUESTS - len(completed),
        detail={
            "requests": NUM_REQUESTS,
            "kv_blocks": NUM_KV_BLOCKS,
            "blocks_per_request": (NUM_PROMPT_TOKENS + NUM_OUTPUT_TOKENS) // 16,
            "max_num_waiting": MAX_NUM_WAITING,
            "refused_with_retry_after": len(refusals),
            "engine_rejected": stats["num_requests_rejected"],
            "preemptions": stats["num_preemptions"],
            "max_tries_used": max(c.tries for c in clients),
            "completed": len(completed),
        },
    )
