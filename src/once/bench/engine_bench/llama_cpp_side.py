"""The llama.cpp side of `once bench engine --baseline llamacpp`: once's own prompts on
`llama-server` (`make llamacpp`), one row per GGUF precision, over loopback.

Rows (fleet/llama_server.py makes the files): `f32`, the folder's own fp32 weights with
an fp32 K/V cache: the row that compares like with like, whose greedy outputs are checked
against once's and whose ratios carry the bars; `q8_0` and `q4_1` (the default model's
shipped file), llama.cpp's usual settings, with its default f16 K/V cache.

Prompts go as token ids to llama-server's native `/completion` (so it tokenizes nothing),
greedy (temperature 0), `ignore_eos`, `cache_prompt` on (its default); streamed where a
token's time is measured (decode step, TTFT), unstreamed for throughput (one reply with
every id). As with vLLM, every figure includes the server's HTTP front end; once's are
in-process.

Each row starts two servers, one after the other, with the row's threads:
- `--parallel` = the largest concurrency, a unified K/V cache just big enough for all of
  those requests at once: throughput per concurrency, every request sent together,
  output tokens over the wall time from the first send to the last finish;
- one slot, one request of the model's length: the decode step at each context (the mean
  gap between streamed tokens after the first; the server's own per-token time is kept
  beside it) and the multi-turn session, whose computed tokens are llama.cpp's own count
  (`timings.prompt_n`, the prompt tokens it evaluated) and TTFT the first streamed token.
"""

import asyncio
import contextlib
import json
import random
import time
from pathlib import Path

import httpx

from once.bench.engine_bench.once_side import (
    SessionPrompts,
    SessionShape,
    num_probes,
    session_summary,
)
from once.bench.engine_bench.workloads import random_ids
from once.fleet.llama_server import (
    F32,
    PRECISIONS,
    LlamaServerSpec,
    gguf_files,
    llama_servers,
    llamacpp_missing_reason,
    llamacpp_version,
)
from once.fleet.processes import read_tail

SLOT_SLACK_TOKENS = 16  # per request: room past prompt + output


async def _run_one(
    http: httpx.AsyncClient, url: str, prompt: list[int], num_output: int, stream: bool = True
) -> dict:
    """One /completion: its ids, TTFT and each token's arrival (streamed), the server's
    timings. A streamed token that ends inside a UTF-8 character is held back by the
    server and sent with the next one, under that one's id only: the times count tokens
    by `tokens_predicted`, and where ids went missing the ids are asked for once more,
    unstreamed (greedy, the same prompt, its cache warm), outside the measured times."""
    body = {
        "prompt": prompt, "n_predict": num_output, "temperature": 0.0, "ignore_eos": True,
        "cache_prompt": True, "return_tokens": True, "stream": stream,
    }  # fmt: skip
    started = time.perf_counter()
    token_times: list[float] = []
    ids: list[int] = []
    timings: dict = {}
    if not stream:
        response = await http.post(f"{url}/completion", json=body)
        response.raise_for_status()
        reply = response.json()
        ids, timings = list(reply.get("tokens") or []), reply.get("timings") or {}
    else:
        async with http.stream("POST", f"{url}/completion", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: ") :])
                count = int(event.get("tokens_predicted") or 0)
                token_times.extend([time.perf_counter()] * (count - len(token_times)))
                ids.extend(event.get("tokens") or [])
                if event.get("stop"):
                    timings = event.get("timings") or {}
    finished = time.perf_counter()
    if stream and len(ids) != len(token_times):
        ids = (await _run_one(http, url, prompt, num_output, stream=False))["ids"]
    if len(ids) != num_output or (stream and len(token_times) != num_output):
        raise RuntimeError(f"llama-server produced {len(ids)} tokens, expected {num_output}")
    return {
        "ids": ids,
        "ttft_s": token_times[0] - started if token_times else None,
        "token_times": token_times,
        "timings": timings,
        "started_at": started,
        "finished_at": finished,
    }


async def measure_throughput(url: str, prompts: list[list[int]], num_output: int) -> dict:
    async with httpx.AsyncClient(timeout=None) as http:
        started = time.perf_counter()
        runs = await asyncio.gather(
            *(_run_one(http, url, p, num_output, stream=False) for p in prompts)
        )
    elapsed = max(run["finished_at"] for run in runs) - started
    return {
        "concurrency": len(prompts),
        "elapsed_s": elapsed,
        "output_tok_s": len(prompts) * num_output / elapsed,
        "outputs": [run["ids"] for run in runs],
    }


async def measure_decode_step(url: str, prompt: list[int], num_decode: int) -> dict:
    async with httpx.AsyncClient(timeout=None) as http:
        run = await _run_one(http, url, prompt, num_decode + 1)
    times, timings = run["token_times"], run["timings"]
    return {
        "context_tokens": len(prompt),
        "decode_step_ms": 1000 * (times[-1] - times[0]) / (len(times) - 1),
        "server_decode_step_ms": timings.get("predicted_per_token_ms"),
        "num_decode_steps": len(times) - 1,
        "prefill_s": run["ttft_s"],
        "prefill_tok_s": len(prompt) / run["ttft_s"],
        "server_prompt_tokens": timings.get("prompt_n"),
    }


async def run_session(url: str, shape: SessionShape, vocab: int, seed: str) -> dict:
    """once_side.run_session's ledger; computed tokens are llama.cpp's own prompt_n."""
    prompts = SessionPrompts(shape, vocab, seed)
    output: list[int] = []
    turns = []
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=None) as http:
        for turn in range(1, shape.num_turns + 1):
            if turn > 1:
                prompts.advance(output)
            prompt = prompts.prompt
            run = await _run_one(http, url, prompt, shape.output_tokens)
            output = run["ids"]
            computed = int(run["timings"]["prompt_n"])
            turns.append(
                {
                    "turn": turn,
                    "prompt_tokens": len(prompt),
                    "new_tokens": prompts.num_new,
                    "computed_tokens": computed,
                    "cached_tokens": len(prompt) - computed,
                    "ttft_ms": 1000 * run["ttft_s"],
                    "e2e_ms": 1000 * (run["finished_at"] - run["started_at"]),
                }
            )
        probes = []
        for k in range(num_probes(shape)):
            run = await _run_one(http, url, prompts.probe(k), 1)
            computed = int(run["timings"]["prompt_n"])
            probes.append({"ttft_ms": 1000 * run["ttft_s"], "computed_tokens": computed})
    return session_summary(turns, True, started, probes)


def measure(
    folder: Path,
    num_threads: int,
    max_model_len: int,
    workload: dict,
    session: SessionShape | None,
    vocab: int,
    seed: str,
    log,
    precisions: tuple[str, ...] = PRECISIONS,
) -> dict:
    """Every row on `workload` (once's prompts: "throughput" per concurrency, "decode",
    "num_output", "decode_steps"); outputs per concurrency are returned for the check."""
    reason = llamacpp_missing_reason()
    if reason:
        return {"status": "skipped", "reason": reason}
    try:
        log("llama.cpp: the GGUF files (converted once, then cached) ...")
        files = gguf_files(folder, precisions)
        result: dict = {"status": "ok", "version": llamacpp_version(), "like_for_like": F32}
    except Exception as exc:  # a peer that fails is reported, the rest of the run is kept
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    result["rows"] = {}
    for precision, path in files.items():
        row = result["rows"][precision] = {"status": "ok"}
        try:
            _measure_row(
                row, path, precision, num_threads, max_model_len, workload, session, vocab,
                seed, log,
            )  # fmt: skip
        except Exception as exc:  # one row failing keeps what it and the others measured
            row.update(status="error", reason=f"{type(exc).__name__}: {exc}")
            log(f"llama.cpp {precision}: error {row['reason']}")
    return result


def _measure_row(
    row: dict,
    gguf: Path,
    precision,
    num_threads,
    max_model_len,
    workload,
    session,
    vocab,
    seed,
    log,
) -> None:
    """Fills `row` as it goes, so a failure part way keeps the figures before it."""
    kv_type = "f32" if precision == F32 else "f16"
    row.update(gguf=str(gguf), kv_type=kv_type, throughput={}, decode={})
    groups = list(workload["throughput"].values())
    num_output = workload["num_output"]
    if groups:
        widest = max(len(prompts) for prompts in groups)
        longest = max(len(p) for prompts in groups for p in prompts)
        spec = LlamaServerSpec(
            gguf, num_threads, widest * (longest + num_output + SLOT_SLACK_TOKENS), widest,
            kv_type,
        )  # fmt: skip
        with llama_servers([spec]) as (server,), _log_tail_on_error(server, row):
            asyncio.run(_warm_up(server.url, vocab))
            for prompts in groups:
                log(f"throughput c{len(prompts)}: llama.cpp {precision} ...")
                row["throughput"][str(len(prompts))] = asyncio.run(
                    measure_throughput(server.url, prompts, num_output)
                )
    spec = LlamaServerSpec(gguf, num_threads, max_model_len, 1, kv_type)
    with llama_servers([spec]) as (server,), _log_tail_on_error(server, row):
        asyncio.run(_warm_up(server.url, vocab))
        for prompt in workload["decode"]:
            log(f"decode at {len(prompt)} context: llama.cpp {precision} ...")
            row["decode"][str(len(prompt))] = asyncio.run(
                measure_decode_step(server.url, prompt, workload["decode_steps"])
            )
        if session is not None and session.num_turns:
            log(f"session of {session.num_turns} turns: llama.cpp {precision} ...")
            row["session"] = asyncio.run(run_session(server.url, session, vocab, seed))


@contextlib.contextmanager
def _log_tail_on_error(server, row: dict):
    # The server's log goes with its temporary folder: keep its tail where it failed.
    # Whether the server was still running tells a crash from a dropped connection.
    try:
        yield
    except Exception:
        row["server_log_tail"] = read_tail(server.log_path)
        row["server_exit_code"] = server.process.poll() if server.process else None
        raise


async def _warm_up(url: str, vocab: int) -> None:
    async with httpx.AsyncClient(timeout=None) as http:
        await _run_one(http, url, random_ids(random.Random("warm-up"), 32, vocab), 4)
