"""The vLLM column of `once replay --baseline vllm`: the recorded calls as their clients
sent them, to vLLM's own OpenAI server.

After once's stacks have closed (the two never share the cores), one vLLM CPU server
starts from `.venv-vllm` (fleet/vllm_server.py) on the served model's folder: fp32,
eager, prefix caching on, as many threads as once's engine (`usable_cores`), a KV cache
of once's `kv_cache_gib`, and `--enable-auto-tool-choice --tool-call-parser hermes`
(without them vLLM refuses any request that carries `tools`; hermes reads SmolLM2's
`<tool_call>` blocks). After one warm-up call and the Responses probe its prefix cache
is emptied; then chat_column.py sends it every planned call.

What is vLLM's own in the ledger (chat_column.py keeps the rest):
- computed_tokens / cached_tokens: vLLM's prefix-cache counters on /metrics (queries
  minus hits, hits) read before and after the call, as engine_bench/vllm_side.py reads
  them per turn;
- ttft_s: vLLM sends its role chunk with the first token's output, before the tool
  parser may hold text back;
- server_cpu_s: user + system CPU of the server's processes (API server and engine core,
  its session), read from /proc as cpu.py reads once's replicas (the same reader for
  both columns; psutil would be a new dependency for the same figure).
Forced outputs: the recorded output's text (the forced ids decoded, as the routed vLLM
stacks force it: stacks.text_forcing) goes as a literal Lark grammar in
`structured_outputs`: vLLM decodes the recorded text itself, so both columns produce the
same outputs. A call that stopped for length (vLLM chose a longer tokenization of the
text) counts in `outputs_cut`.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import httpx

from once.bench.replay.chat_column import (
    TIMEOUT,
    ChatPeer,
    check_column_flags,
    replay_column,
    stream_chat,
)
from once.bench.replay.cpu import processes_cpu_s
from once.bench.replay.plan import SessionPlan
from once.bench.replay.stacks import TINY, TOKENIZER_MODEL, text_forcing
from once.bench.replay.vllm_pool import sessions_of_processes
from once.cpus import usable_cores
from once.fleet.vllm_server import VllmServer, VllmSpec, start_vllm_servers, vllm_missing_reason
from once.router.openai_replica import structured_outputs
from once.router.vllm_metrics import VllmMetrics, parse_vllm_metrics

VLLM = "vllm"
TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
FORCING = (
    "literal grammar of the recorded output text (structured_outputs), max_tokens = forced length"
)


def check_vllm_baseline(args) -> str | None:
    """The problem with `--baseline vllm` and the other flags, or None."""
    if VLLM not in (getattr(args, "baseline", None) or ()):
        return None
    return check_column_flags(args, VLLM) or vllm_missing_reason()


def check_vllm_length(args) -> None:
    """ValueError when vLLM would refuse `--max-model-len` (past the positions the model
    holds, without rope scaling): said before once's stacks run, not after them. The
    tiny model is made for the length asked; a model not converted yet is checked by
    vLLM itself."""
    from once.model_files import find_model_folder
    from once.protocol.errors import ModelNotFoundError

    if VLLM not in (getattr(args, "baseline", None) or ()) or args.model == TINY:
        return
    try:
        config = json.loads((find_model_folder(args.model) / "config.json").read_text())
    except (ModelNotFoundError, OSError, ValueError):
        return
    held = config.get("max_position_embeddings")
    if held and args.max_model_len > held and not config.get("rope_scaling"):
        raise ValueError(
            f"--baseline vllm: vLLM refuses --max-model-len {args.max_model_len} for a model "
            f"that holds {held} positions; use --max-model-len {held} or less"
        )


def column_spec(model_folder: Path, *, kv_cache_gib: float, max_model_len: int) -> VllmSpec:
    return VllmSpec(
        Path(model_folder),
        served_model_name=TOKENIZER_MODEL,
        kv_cache_mib=math.ceil(kv_cache_gib * 1024),
        max_model_len=max_model_len,
        threads=usable_cores(),  # once's engine: EngineConfig.num_threads 0
        kv_events=False,
        extra_args=TOOL_ARGS,
    )


def vllm_peer(runtime, cpu_seconds) -> ChatPeer:
    """The recorded text as a literal Lark grammar; computed = the growth of vLLM's
    prefix-cache counters over the call (queries - hits)."""
    as_constraint = text_forcing(runtime)

    def split(result: dict, before: VllmMetrics, after: VllmMetrics) -> tuple[int, int]:
        grown = after.since(before)
        return grown.prefix_cache_hits, grown.prefix_cache_queries - grown.prefix_cache_hits

    return ChatPeer(
        VLLM,
        forcing=lambda ids, tools: {"structured_outputs": structured_outputs(as_constraint(ids))},
        prompt_split=split,
        cpu_seconds=cpu_seconds,
        read_counters=read_counters,
    )


def server_pids(server: VllmServer) -> list[int]:
    """Every process of the server: it runs in a session of its own (processes.py), its
    engine core a child in the same session."""
    if server.process is None:
        raise RuntimeError(f"{server.name} has no process")
    session = server.process.pid
    return [pid for pid, session_of in sessions_of_processes() if session_of == session]


async def read_counters(http: httpx.AsyncClient, url: str) -> VllmMetrics:
    response = await http.get(f"{url}/metrics")
    response.raise_for_status()
    return parse_vllm_metrics(response.text)


async def probe_responses(http: httpx.AsyncClient, url: str, model: str) -> dict:
    """A two-call session on vLLM's own `/v1/responses`: the second call names the first
    by `previous_response_id`, as Codex's WebSocket mode does. What happens is the answer."""
    calls = []
    previous = None
    for text in ("Say hello.", "And once more."):
        body: dict = {"model": model, "input": text, "max_output_tokens": 4, "store": True}
        if previous is not None:
            body["previous_response_id"] = previous
        response = await http.post(f"{url}/v1/responses", json=body)
        answer = response.json() if response.content else {}
        usage = answer.get("usage") or {}
        calls.append(
            {
                "status": response.status_code,
                "error": (answer.get("error") or {}).get("message"),
                "input_tokens": usage.get("input_tokens"),
                "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens"),
            }
        )
        previous = answer.get("id")
        if response.status_code != 200:
            break
    second = calls[-1] if len(calls) == 2 else None
    works = second is not None and second["status"] == 200
    return {"previous_response_id_works": works, "calls": calls}


async def run_vllm_column(
    model_folder: Path,
    plans: list[tuple[str, SessionPlan]],
    runtime,
    *,
    kv_cache_gib: float,
    max_model_len: int,
    log=None,
) -> dict:
    """Start the server, warm it, probe /v1/responses, empty its cache, replay: the column."""
    spec = column_spec(model_folder, kv_cache_gib=kv_cache_gib, max_model_len=max_model_len)
    if log is not None:
        log(f"vLLM: starting its server ({spec.threads} threads, {spec.kv_cache_mib} MiB KV) ...")
    started = time.perf_counter()
    async with start_vllm_servers([spec]) as (server,), httpx.AsyncClient(timeout=TIMEOUT) as http:
        startup_s = time.perf_counter() - started
        warm = {"model": TOKENIZER_MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        await stream_chat(http, server.url, warm | {"max_tokens": 4, "stream": True})
        probe = await probe_responses(http, server.url, TOKENIZER_MODEL)
        await server.reset_prefix_cache()
        pids = server_pids(server)
        peer = vllm_peer(runtime, lambda: processes_cpu_s(pids))
        calls = await replay_column(http, server.url, plans, peer, log)
    return {
        "server": {
            "version": "vLLM CPU (.venv-vllm), OpenAI server, /v1/chat/completions",
            "threads": spec.threads,
            "kv_cache_mib": spec.kv_cache_mib,
            "block_size": spec.block_size,
            "max_model_len": spec.max_model_len,
            "prefix_caching": spec.prefix_caching,
            "eager": spec.enforce_eager,
            "extra_args": list(spec.extra_args),
            "startup_s": round(startup_s, 3),
        },
        "sends": "its OpenAI server, stateless Chat Completions, the full history every call",
        "forcing": FORCING,
        "tokenized_means": "usage.prompt_tokens: vLLM renders and tokenizes the whole "
        "conversation on every call",
        "computed_from": "vLLM's /metrics prefix_cache_queries - prefix_cache_hits, per call",
        "responses_probe": probe,
        "calls": calls,
    }
