"""The client side of a peer column of `once replay --baseline vllm,llamacpp`: the
recorded calls as their clients sent them, to a peer's own OpenAI server.

Each call is a stateless streamed `POST /v1/chat/completions` with the recorded
`messages` (the whole history, every call) and the recorded tools, greedy, `max_tokens`
= the forced length (its closing eos included), the recorded output forced by the
fields the peer takes (`ChatPeer.forcing`). Sessions run one after another, call by
call. Per call the row keeps the ledger once's columns keep:

- bytes_sent: the JSON body as it goes on the wire;
- tokens_tokenized = prompt_tokens = `usage.prompt_tokens`: the peer renders the whole
  conversation with its chat template and tokenizes all of it on every call;
- cached_tokens / computed_tokens: the peer's own counters (`ChatPeer.prompt_split`,
  from counters read before and after the call and/or the reply itself);
  `usage.prompt_tokens_details.cached_tokens` is kept beside them;
- ttft_s: send -> the first streamed chunk with a choice; wall_s: send -> [DONE];
- server_cpu_s: the server's processes' CPU across the call (`ChatPeer.cpu_seconds`).

A call the peer refused keeps its error and is left out of the comparison (vs_peers.py);
the next call goes on (nothing carries over: the client is stateless).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from once.agent.transport.base import payload_bytes
from once.bench.payloads import session_tools
from once.bench.replay.plan import SessionPlan
from once.bench.replay.stacks import TOKENIZER_MODEL

TIMEOUT = httpx.Timeout(None, connect=60.0)  # a call takes as long as the server needs


@dataclass(frozen=True)
class ChatPeer:
    """What one peer's column changes in the shared loop."""

    name: str  # "vllm", "llamacpp": log lines and the JSON
    # (forced ids, the call's Chat Completions tools) -> the body fields forcing the output
    forcing: Callable[[list[int], list[dict] | None], dict]
    # (the call's result, counters before, counters after) -> (cached, computed)
    prompt_split: Callable[[dict, Any, Any], tuple[int, int]]
    cpu_seconds: Callable[[], float]
    # read before and after each call, when the peer counts on an endpoint of its own
    read_counters: Callable[[httpx.AsyncClient, str], Awaitable[Any]] | None = None


def check_column_flags(args, name: str) -> str | None:
    """The problem with `--baseline <name>` and the other flags, or None."""
    if name not in (getattr(args, "baseline", None) or ()):
        return None
    if (args.concurrency, args.replicas, args.engine) != (1, 1, "once"):
        return (
            f"--baseline {name} compares once's in-process engine, one session at a time, "
            "with the peer's server: it needs --concurrency 1, --replicas 1 and --engine once"
        )
    return None


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


def chat_body(messages, tools, forcing: dict, max_tokens: int, model: str) -> dict:
    body: dict = {"model": model, "messages": list(messages)}
    if tools:
        body["tools"] = tools
    return body | {
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **forcing,
    }


async def stream_chat(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed call: TTFT, wall, usage, finish reason, the server's `timings` where
    it sends them (llama-server, in its last chunk), or the server's error."""
    content = json.dumps(body, ensure_ascii=False).encode()
    started = time.perf_counter()
    first: float | None = None
    usage: dict = {}
    timings: dict = {}
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
            if not isinstance(chunk, dict):  # a bare marker carries nothing to count
                continue
            if "error" in chunk:
                return {"error": str(chunk["error"])[:500]}
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - started
            for choice in chunk.get("choices") or ():
                finish_reason = choice.get("finish_reason") or finish_reason
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    wall = time.perf_counter() - started
    details = usage.get("prompt_tokens_details") or {}
    result = {
        "ttft_s": first if first is not None else wall,
        "wall_s": wall,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "output_tokens": usage.get("completion_tokens", 0),
        "usage_cached_tokens": details.get("cached_tokens") or 0,
        "finish_reason": finish_reason,
    }
    return result | ({"timings": timings} if timings else {})


async def replay_column(
    http: httpx.AsyncClient,
    url: str,
    plans: list[tuple[str, SessionPlan]],
    peer: ChatPeer,
    log=None,
) -> dict[str, list[dict]]:
    """Every planned call, in order, to the server at `url`: records by session."""
    records: dict[str, list[dict]] = {}
    for source_folder, plan in plans:
        tools = chat_tools(session_tools(plan.session))
        rows = records[plan.session_id] = []
        for call in plan.calls:
            recorded = plan.session.calls[call.index]
            forcing = peer.forcing(call.forced_ids, tools)
            body = chat_body(
                recorded.messages, tools, forcing, len(call.forced_ids), TOKENIZER_MODEL
            )
            before = await _counters(peer, http, url)
            cpu_before = peer.cpu_seconds()
            result = await stream_chat(http, url, body)
            cpu_s = peer.cpu_seconds() - cpu_before
            after = await _counters(peer, http, url)
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
                row["cached_tokens"], row["computed_tokens"] = peer.prompt_split(
                    result, before, after
                )
            rows.append(row)
            if log is not None:
                log(_call_line(peer.name, row))
    return records


async def _counters(peer: ChatPeer, http: httpx.AsyncClient, url: str):
    return None if peer.read_counters is None else await peer.read_counters(http, url)


def _call_line(name: str, row: dict) -> str:
    where = f"{name}  {row['session_id']} call {row['index']}"
    if "error" in row:
        return f"{where}: {row['error']}"
    return (
        f"{where}: prompt {row['prompt_tokens']} (cached {row['cached_tokens']}), TTFT "
        f"{row['ttft_s']:.2f} s, wall {row['wall_s']:.2f} s, {row['output_tokens']} tokens "
        f"({row['finish_reason']})"
    )
