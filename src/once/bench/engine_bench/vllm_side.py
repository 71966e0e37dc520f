"""The vLLM side of `once bench engine --baseline vllm`: once's own prompts, on vLLM's
OpenAI server (its CPU build from `make vllm`, fp32, prefix caching on, the same thread
count and KV size as once's engine), over loopback.

Prompts go as token ids through the router's `/v1/completions` client, so vLLM tokenizes
nothing and both sides run the same ids. vLLM is served the way its users run it: its
HTTP front end and engine core are separate processes, and every figure here includes
that front end; once's side is measured in-process (no HTTP), which the report says.
vLLM runs compiled (its default) unless `eager` is set; its CPU attention takes blocks in
multiples of 32, so its block is 32 tokens where once's is 16.

Measured, after one warm-up request:
- throughput per concurrency: every request sent at once, output tokens over the wall
  time from the first send to the last finish (greedy, ignore_eos, exactly N each);
- decode step at each context: one stream, the mean gap between its streamed tokens after
  the first (vLLM streams each step's token as it is made);
- the multi-turn session, once's shape (`once_side.run_session`): turn k's prompt is turn
  k-1's prompt + its output + fresh ids; computed tokens are vLLM's own counters (the
  prefix-cache queries minus hits of that turn, from /metrics); TTFT is the first token,
  and the last turn's is the median of it and its probes (`SessionPrompts.probe`).
Greedy outputs come back per request for the equality check against once's.
"""

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from once.bench.engine_bench.once_side import (
    SessionPrompts,
    SessionShape,
    greedy,
    num_probes,
    session_summary,
)
from once.bench.engine_bench.workloads import random_ids
from once.fleet.vllm_server import VllmSpec, vllm_missing_reason, vllm_servers
from once.protocol.engine import GenerateRequest
from once.router.openai_replica import OpenAICompletionsClient
from once.router.vllm_metrics import VllmMetrics

SERVED_NAME = "bench"
VLLM_BLOCK_SIZE = 32


async def _run_one(client: OpenAICompletionsClient, request: GenerateRequest) -> dict:
    """One streamed request: its ids, TTFT, the time of each streamed token, its usage."""
    started = time.perf_counter()
    token_times: list[float] = []
    ids: list[int] = []
    metrics = None
    async for delta in client.generate(request):
        if delta.token_ids:
            token_times.append(time.perf_counter())
            ids.extend(delta.token_ids)
        if delta.metrics is not None:
            metrics = delta.metrics
    return {
        "ids": ids,
        "ttft_s": token_times[0] - started if token_times else None,
        "token_times": token_times,
        "cached_tokens": metrics.num_cached_tokens if metrics else 0,
        "finished_at": time.perf_counter(),
        "started_at": started,
    }


async def measure_throughput(
    client: OpenAICompletionsClient, prompts: list[list[int]], num_output: int
) -> dict:
    requests = [
        GenerateRequest(f"vllm-c{len(prompts)}-{i}", tuple(p), greedy(num_output))
        for i, p in enumerate(prompts)
    ]
    started = time.perf_counter()
    runs = await asyncio.gather(*(_run_one(client, r) for r in requests))
    elapsed = max(run["finished_at"] for run in runs) - started
    num_output_tokens = sum(len(run["ids"]) for run in runs)
    if num_output_tokens != len(prompts) * num_output:
        raise RuntimeError(
            f"vLLM produced {num_output_tokens} tokens, expected {len(prompts) * num_output}"
        )
    return {
        "concurrency": len(prompts),
        "elapsed_s": elapsed,
        "output_tok_s": num_output_tokens / elapsed,
        "outputs": [run["ids"] for run in runs],
    }


async def measure_decode_step(
    client: OpenAICompletionsClient, prompt: list[int], num_decode: int
) -> dict:
    request = GenerateRequest(f"vllm-ctx-{len(prompt)}", tuple(prompt), greedy(num_decode + 1))
    run = await _run_one(client, request)
    times = run["token_times"]
    gaps = len(times) - 1
    return {
        "context_tokens": len(prompt),
        "decode_step_ms": 1000 * (times[-1] - times[0]) / gaps if gaps > 0 else None,
        "num_decode_steps": gaps,
        "prefill_s": run["ttft_s"],
        "prefill_tok_s": len(prompt) / run["ttft_s"] if run["ttft_s"] else None,
    }


async def run_session(
    client: OpenAICompletionsClient,
    read_metrics: Callable[[], Awaitable[VllmMetrics]],
    shape: SessionShape,
    vocab: int,
    seed: str,
) -> dict:
    """once_side.run_session's ledger, vLLM's counters (`read_metrics`: its /metrics) for
    the computed tokens."""
    prompts = SessionPrompts(shape, vocab, seed)
    output: list[int] = []
    turns = []
    started = time.perf_counter()
    for turn in range(1, shape.num_turns + 1):
        if turn > 1:
            prompts.advance(output)
        prompt = prompts.prompt
        before = await read_metrics()
        request = GenerateRequest(f"vllm-turn-{turn}", tuple(prompt), greedy(shape.output_tokens))
        run = await _run_one(client, request)
        counted = (await read_metrics()).since(before)
        output = run["ids"]
        turns.append(
            {
                "turn": turn,
                "prompt_tokens": len(prompt),
                "new_tokens": prompts.num_new,
                "computed_tokens": counted.prefix_cache_queries - counted.prefix_cache_hits,
                "cached_tokens": counted.prefix_cache_hits,
                "ttft_ms": 1000 * run["ttft_s"],
                "e2e_ms": 1000 * (run["finished_at"] - run["started_at"]),
            }
        )
    probes = []
    for k in range(num_probes(shape)):
        before = await read_metrics()
        probe = GenerateRequest(
            f"vllm-turn-{shape.num_turns}-probe-{k}", tuple(prompts.probe(k)), greedy(1)
        )
        run = await _run_one(client, probe)
        counted = (await read_metrics()).since(before)
        computed = counted.prefix_cache_queries - counted.prefix_cache_hits
        probes.append({"ttft_ms": 1000 * run["ttft_s"], "computed_tokens": computed})
    return session_summary(turns, True, started, probes)


def server_spec(
    folder: Path,
    num_threads: int,
    kv_cache_mib: int,
    max_model_len: int,
    eager: bool,
    dtype: str = "float32",
) -> VllmSpec:
    return VllmSpec(
        model_folder=folder,
        served_model_name=SERVED_NAME,
        kv_cache_mib=kv_cache_mib,
        block_size=VLLM_BLOCK_SIZE,
        max_model_len=max_model_len,
        threads=num_threads,
        kv_events=False,
        enforce_eager=eager,
        dtype=dtype,
    )


def measure(
    spec: VllmSpec,
    throughput_prompts: list[list[list[int]]],
    num_output: int,
    decode_prompts: list[list[int]],
    decode_steps: int,
    session: SessionShape | None,
    vocab: int,
    seed: str,
    log,
) -> dict:
    reason = vllm_missing_reason()
    if reason:
        return {"status": "skipped", "reason": reason}
    started = time.perf_counter()
    log(f"vLLM: starting its server ({'eager' if spec.enforce_eager else 'compiled'}) ...")
    with vllm_servers([spec]) as (server,):
        startup_s = time.perf_counter() - started
        result = asyncio.run(
            _measure_all(
                server, throughput_prompts, num_output, decode_prompts, decode_steps,
                session, vocab, seed, log,
            )
        )  # fmt: skip
    started_as = {"eager": spec.enforce_eager, "dtype": spec.dtype}
    return {"status": "ok", "startup_s": startup_s} | started_as | result


async def _measure_all(
    server, throughput_prompts, num_output, decode_prompts, decode_steps, session, vocab, seed, log
) -> dict:
    client = OpenAICompletionsClient(server.url, SERVED_NAME)
    try:
        warm = random_ids(random.Random("warm-up"), 32, vocab)
        await _run_one(client, GenerateRequest("vllm-warm-up", tuple(warm), greedy(4)))
        result: dict = {"throughput": {}, "decode": {}}
        for prompts in throughput_prompts:
            log(f"throughput c{len(prompts)}: vLLM ...")
            result["throughput"][str(len(prompts))] = await measure_throughput(
                client, prompts, num_output
            )
        for prompt in decode_prompts:
            log(f"decode at {len(prompt)} context: vLLM ...")
            result["decode"][str(len(prompt))] = await measure_decode_step(
                client, prompt, decode_steps
            )
        if session is not None and session.num_turns:
            log(f"session of {session.num_turns} turns: vLLM ...")
            await server.reset_prefix_cache()
            result["session"] = await run_session(client, server.metrics, session, vocab, seed)
        return result
    finally:
        await client.aclose()
