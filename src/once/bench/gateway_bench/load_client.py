"""The load client of the overhead benchmark, in its own process.

N concurrent streams, each a loop of calls; every call is a 200-token prompt with 128
streamed tokens, read to its last byte. Between two calls a stream pauses for its "tool
time" (uniform in [0.5, 1.5] x --think-ms; 0 makes a closed loop that saturates the
server). Prints one JSON line: per-call latencies.

    python -m once.bench.gateway_bench.load_client --mode gateway|engine --url URL
"""

import argparse
import asyncio
import json
import random
import time

import httpx

from once.bench.gateway_bench.scripted_server import MODEL, OUTPUT_TOKENS

WORDS = (
    "the function returns a value when the test fails because the import path points at "
    "an old module so we patch the config and rerun pytest with verbose output to see"
).split()


def prompt_text(seed: int, num_words: int = 180) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


async def one_call(http: httpx.AsyncClient, mode: str, seed: int, prompt_ids) -> tuple[float, int]:
    start = time.perf_counter()
    units = 0
    if mode == "gateway":
        body = {"model": MODEL, "input": prompt_text(seed), "stream": True, "store": False}
        async with http.stream("POST", "/v1/responses", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                units += line.startswith("event: response.output_text.delta")
    else:
        body = {
            "request_id": f"r{seed}",
            "prompt_token_ids": prompt_ids,
            "sampling": {"max_tokens": OUTPUT_TOKENS, "temperature": 0},
        }
        async with http.stream("POST", "/v1/generate", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                units += bool(line)
    return time.perf_counter() - start, units


async def run(
    url: str, mode: str, concurrency: int, calls: int, warmup: int, think_ms: float
) -> dict:
    prompt_ids = list(range(1000, 1200))  # 200 ids: the engine server takes ids directly
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        for seed in range(warmup):
            await one_call(http, mode, seed, prompt_ids)

        async def stream(worker: int):
            nonlocal errors
            rng = random.Random(worker)
            await asyncio.sleep(rng.uniform(0, think_ms) / 1000)  # streams start spread out
            for i in range(calls):
                if i and think_ms:
                    await asyncio.sleep(rng.uniform(0.5, 1.5) * think_ms / 1000)
                try:
                    latency, _ = await one_call(http, mode, worker * 100_000 + i, prompt_ids)
                    latencies.append(latency)
                except (httpx.HTTPError, OSError):
                    errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(stream(w) for w in range(concurrency)))
        wall = time.perf_counter() - started
    return {"mode": mode, "latencies_s": latencies, "errors": errors, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["gateway", "engine"], required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--calls", type=int, default=20, help="calls per stream")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--think-ms", type=float, default=50.0)
    args = parser.parse_args()
    result = asyncio.run(
        run(args.url, args.mode, args.concurrency, args.calls, args.warmup, args.think_ms)
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
