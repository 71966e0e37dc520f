"""The vLLM column of `once replay --baseline vllm`: the recorded calls as their clients
sent them, to vLLM's own OpenAI server.

After once's stacks have closed (the two never share the cores), one vLLM CPU server
starts from `.venv-vllm` (fleet/vllm_server.py) on the served model's folder: fp32,
eager, prefix caching on, as many threads as once's engine (`usable_cores`), a KV cache
of once's `kv_cache_gib`, and `--enable-auto-tool-choice --tool-call-parser hermes`
(without them vLLM refuses any request that carries `tools`; hermes reads SmolLM2's
`<tool_call>` blocks). After one warm-up call and the Responses probe its prefix cache
is emptied; then the sessions run one after another, call by call, each call a
stateless streamed `POST /v1/chat/completions` with the recorded `messages` (the whole
history, every call) and the recorded tools.

Per call, the ledger once's columns keep:
- bytes_sent: the JSON body as it goes on the wire;
- tokens_tokenized = prompt_tokens = `usage.prompt_tokens`: vLLM renders the whole
  conversation with the chat template and tokenizes all of it on every call;
- computed_tokens / cached_tokens: vLLM's own prefix-cache counters on /metrics (queries
  minus hits, hits) read before and after the call, as engine_bench/vllm_side.py reads
  them per turn; `usage.prompt_tokens_details.cached_tokens` is kept beside them;
- ttft_s: send -> the first streamed chunk (vLLM sends its role chunk with the first
  token's output, before the tool parser may hold text back); wall_s: send -> [DONE];
- server_cpu_s: user + system CPU of the server's processes (API server and engine core,
  its session) across the call, read from /proc as cpu.py reads once's replicas (the
  same reader for both columns; psutil would be a new dependency for the same figure).
Forced outputs: the recorded output's text (the forced ids decoded, as the routed vLLM
stacks force it: stacks.text_forcing) goes as a literal Lark grammar in
`structured_outputs`, greedy, with max_tokens = the forced length (its closing eos
included): vLLM decodes the recorded text itself, so both columns produce the same
outputs. A call that stopped for length (vLLM chose a longer tokenization of the text)
counts in `outputs_cut`. A call vLLM refused keeps its error and is left out of the
comparison; the next call goes on (nothing carries over: the client is stateless).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from once.agent.transport.base import payload_bytes
from once.bench.payloads import session_tools
from once.bench.replay.cpu import processes_cpu_s
from once.bench.replay.plan import SessionPlan
from once.bench.replay.stacks import TOKENIZER_MODEL, text_forcing
from once.bench.replay.vllm_pool import sessions_of_processes
from once.cpus import usable_cores
from once.fleet.vllm_server import VllmServer, VllmSpec, start_vllm_servers, vllm_missing_reason
from once.protocol.engine import OutputConstraint
from once.router.openai_replica import structured_outputs
from once.router.vllm_metrics import parse_vllm_metrics

VLLM = "vllm"
TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
FORCING = (
    "literal grammar of the recorded output text (structured_outputs), max_tokens = forced length"
)
TIMEOUT = httpx.Timeout(None, connect=60.0)  # a call takes as long as the server needs


def check_vllm_baseline(args) -> str | None:
    """The problem with `--baseline vllm` and the other flags, or None."""
    if VLLM not in (getattr(args, "baseline", None) or ()):
        return None
    if (args.concurrency, args.replicas, args.engine) != (1, 1, "once"):
        return (
            "--baseline vllm compares once's in-process engine, one session at a time, with "
            "vLLM's server: it needs --concurrency 1, --replicas 1 and --engine once"
        )
    return vllm_missing_reason()


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


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function tools (the replay's recorded shape) as Chat Completions tools."""
    if not tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                key: tool[key] for key in ("name", "description", "parameters") if key in tool
            },
        }
        for tool in tools
    ]


def chat_body(messages, tools, forced: OutputConstraint, max_tokens: int, model: str) -> dict:
    body: dict = {"model": model, "messages": list(messages)}
    if tools:
        body["tools"] = tools
    return body | {
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "structured_outputs": structured_outputs(forced),
    }


def server_pids(server: VllmServer) -> list[int]:
    """Every process of the server: it runs in a session of its own (processes.py), its
    engine core a child in the same session."""
    if server.process is None:
        raise RuntimeError(f"{server.name} has no process")
    session = server.process.pid
    return [pid for pid, session_of in sessions_of_processes() if session_of == session]


async def read_counters(http: httpx.AsyncClient, url: str):
    response = await http.get(f"{url}/metrics")
    response.raise_for_status()
    return parse_vllm_metrics(response.text)


async def stream_chat(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed call: TTFT, wall, usage, finish reason (or the server's error)."""
    content = json.dumps(body, ensure_ascii=False).encode()
    started = time.perf_counter()
    first: float | None = None
    usage: dict = {}
    finish_reason = None
    headers = {"content-type": "application/json"}
    async with http.stream(
        "POST", f"{url}/v1/chat/completions", content=content, headers=headers
    ) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            return {"error": f"HTTP {response.status_code}: {text[:500]}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                return {"error": str(chunk["error"])[:500]}
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - started
            for choice in chunk.get("choices") or ():
                finish_reason = choice.get("finish_reason") or finish_reason
            usage = chunk.get("usage") or usage
    wall = time.perf_counter() - started
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": first if first is not None else wall,
        "wall_s": wall,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "output_tokens": usage.get("completion_tokens", 0),
        "usage_cached_tokens": details.get("cached_tokens") or 0,
        "finish_reason": finish_reason,
    }


async def replay_column(
    http: httpx.AsyncClient,
    url: str,
    plans: list[tuple[str, SessionPlan]],
    as_constraint: Callable[[list[int]], OutputConstraint],
    cpu_seconds: Callable[[], float],
    log=None,
) -> dict[str, list[dict]]:
    """Every planned call, in order, to the server at `url`: records by session."""
    records: dict[str, list[dict]] = {}
    for source_folder, plan in plans:
        tools = chat_tools(session_tools(plan.session))
        rows = records[plan.session_id] = []
        for call in plan.calls:
            recorded = plan.session.calls[call.index]
            body = chat_body(
                recorded.messages, tools, as_constraint(call.forced_ids), len(call.forced_ids),
                TOKENIZER_MODEL,
            )  # fmt: skip
            before = await read_counters(http, url)
            cpu_before = cpu_seconds()
            result = await stream_chat(http, url, body)
            cpu_s = cpu_seconds() - cpu_before
            grown = (await read_counters(http, url)).since(before)
            row = {
                "session_id": plan.session_id,
                "source_folder": source_folder,
                "index": call.index,
                "bytes_sent": payload_bytes(body),
                "forced_tokens": len(call.forced_ids),
                "server_cpu_s": round(cpu_s, 3),
                **result,
            }
            if "error" not in result:
                row["tokens_tokenized"] = result["prompt_tokens"]
                row["cached_tokens"] = grown.prefix_cache_hits
                row["computed_tokens"] = grown.prefix_cache_queries - grown.prefix_cache_hits
            rows.append(row)
            if log is not None:
                log(_call_line(row))
    return records


def _call_line(row: dict) -> str:
    where = f"vllm  {row['session_id']} call {row['index']}"
    if "error" in row:
        return f"{where}: {row['error']}"
    return (
        f"{where}: prompt {row['prompt_tokens']} (cached {row['cached_tokens']}), TTFT "
        f"{row['ttft_s']:.2f} s, wall {row['wall_s']:.2f} s, {row['output_tokens']} tokens "
        f"({row['finish_reason']})"
    )


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
        calls = await replay_column(
            http, server.url, plans, text_forcing(runtime), lambda: processes_cpu_s(pids), log
        )
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
        "forcing": FORCING,
        "tokenized_means": "usage.prompt_tokens: vLLM renders and tokenizes the whole "
        "conversation on every call",
        "computed_from": "vLLM's /metrics prefix_cache_queries - prefix_cache_hits, per call",
        "responses_probe": probe,
        "calls": calls,
    }
