"""The llama.cpp column of `once replay --baseline llamacpp`: the recorded calls as their
clients sent them, to llama-server's own OpenAI endpoint.

After once's stacks have closed (the two never share the cores), one `llama-server`
(`make llamacpp`; fleet/llama_server.py) starts on the f32 GGUF of the served model's
folder: once's own fp32 weights with an fp32 K/V cache, as many threads as once's engine
(`usable_cores`), `--ctx-size` = `--max-model-len`, one slot (`--parallel 1`), and
`--jinja`, without which it refuses any request that carries `tools` (it then renders
with the GGUF's own `tokenizer.chat_template`). Prompt caching is llama.cpp's default
(`cache_prompt: true`, sent explicitly): with one slot each call reuses the KV of the
longest common prefix with the previous call. One warm-up call (a raw `/completion` of a
word, so the first replayed call finds nothing of it cached); then chat_column.py sends
it every planned call.

What is llama.cpp's own in the ledger (chat_column.py keeps the rest):
- computed_tokens = `timings.prompt_n`, the prompt tokens it evaluated, and
  cached_tokens = `timings.cache_n`, from the last streamed chunk (llama-server adds its
  timings there), as engine_bench/llama_cpp_side.py counts its session;
- server_cpu_s: user + system CPU of its one process (all its threads), from /proc.
Forced outputs: the recorded output's text (stacks.forced_text, what the vLLM column
forces) as a GBNF grammar whose one sentence is that text (llama-server's `grammar`
field), greedy: llama.cpp decodes the recorded text itself, then its grammar leaves it
only the end of turn. llama-server refuses a grammar beside `tools` unless tool_choice
is "none", so calls with tools carry tool_choice "none" (SmolLM2's template renders no
tools either way, and with "none" nothing parses tool calls out of the output).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from once.bench.replay.chat_column import TIMEOUT, ChatPeer, check_column_flags, replay_column
from once.bench.replay.cpu import processes_cpu_s
from once.bench.replay.plan import SessionPlan
from once.bench.replay.stacks import forced_text
from once.cpus import usable_cores
from once.fleet.llama_server import (
    F32,
    LlamaServerSpec,
    gguf_files,
    llamacpp_missing_reason,
    llamacpp_version,
    start_llama_servers,
)

LLAMACPP = "llamacpp"
FORCING = (
    "GBNF grammar of the recorded output text (grammar: root ::= the text), greedy, "
    "max_tokens = forced length; tool_choice none where the call has tools"
)
_GBNF_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def check_llamacpp_baseline(args) -> str | None:
    """The problem with `--baseline llamacpp` and the other flags, or None."""
    if LLAMACPP not in (getattr(args, "baseline", None) or ()):
        return None
    return check_column_flags(args, LLAMACPP) or llamacpp_missing_reason()


def column_spec(gguf: Path, *, max_model_len: int) -> LlamaServerSpec:
    return LlamaServerSpec(
        gguf,
        threads=usable_cores(),  # once's engine: EngineConfig.num_threads 0
        ctx_size=max_model_len,
        parallel=1,  # one slot: every call lands where the previous one left its KV
        kv_type="f32",  # once's K/V precision
        extra_args=("--jinja",),
    )


def gbnf_literal(text: str) -> str:
    """A GBNF grammar whose one sentence is `text`. Printable ASCII stays as it is; quote,
    backslash, tab and the line ends take GBNF's escapes, anything else \\x, \\u or
    \\U (the grammar stays ASCII, whatever the text)."""
    return f'root ::= "{"".join(_gbnf_char(c) for c in text)}"\n'


def _gbnf_char(char: str) -> str:
    if char in _GBNF_ESCAPES:
        return _GBNF_ESCAPES[char]
    code = ord(char)
    if 0x20 <= code < 0x7F:
        return char
    if code < 0x80:
        return f"\\x{code:02X}"
    return f"\\u{code:04X}" if code < 0x10000 else f"\\U{code:08X}"


def llamacpp_peer(runtime, cpu_seconds) -> ChatPeer:
    """The recorded text as a GBNF literal; computed = llama.cpp's own prompt_n."""
    as_text = forced_text(runtime)

    def forcing(ids: list[int], tools: list[dict] | None) -> dict:
        fields = {"grammar": gbnf_literal(as_text(ids)), "cache_prompt": True}
        return fields | ({"tool_choice": "none"} if tools else {})

    return ChatPeer(LLAMACPP, forcing, prompt_split, cpu_seconds)


def prompt_split(result: dict, before=None, after=None) -> tuple[int, int]:
    """(cached, computed) from the timings of llama-server's last streamed chunk."""
    timings = result.get("timings") or {}
    if "prompt_n" not in timings:
        raise RuntimeError(f"llama-server sent no timings with its reply: {result}")
    return int(timings.get("cache_n", 0)), int(timings["prompt_n"])


async def run_llamacpp_column(
    model_folder: Path,
    plans: list[tuple[str, SessionPlan]],
    runtime,
    *,
    max_model_len: int,
    log=None,
) -> dict:
    """Make (or find) the f32 GGUF, start the server, warm it, replay: the column."""
    if log is not None:
        log("llama.cpp: the f32 GGUF of the model folder (converted once, then cached) ...")
    gguf = (await asyncio.to_thread(gguf_files, model_folder, (F32,)))[F32]
    spec = column_spec(gguf, max_model_len=max_model_len)
    if log is not None:
        log(f"llama.cpp: starting llama-server ({spec.threads} threads, ctx {spec.ctx_size}) ...")
    started = time.perf_counter()
    async with start_llama_servers([spec]) as (server,), httpx.AsyncClient(timeout=TIMEOUT) as http:
        startup_s = time.perf_counter() - started
        warm = {"prompt": "Hello", "n_predict": 4, "temperature": 0.0, "cache_prompt": True}
        (await http.post(f"{server.url}/completion", json=warm)).raise_for_status()
        if server.process is None:
            raise RuntimeError(f"{server.name} has no process")
        pid = server.process.pid
        peer = llamacpp_peer(runtime, lambda: processes_cpu_s([pid]))
        calls = await replay_column(http, server.url, plans, peer, log)
    return {
        "server": {
            "version": f"llama-server {llamacpp_version()}, /v1/chat/completions",
            "gguf": str(gguf),
            "threads": spec.threads,
            "ctx_size": spec.ctx_size,
            "parallel": spec.parallel,
            "kv_type": spec.kv_type,
            "batch_size": spec.batch_size,
            "cache_prompt": True,
            "extra_args": list(spec.extra_args),
            "startup_s": round(startup_s, 3),
        },
        "sends": "llama-server's OpenAI endpoint, stateless Chat Completions with its prompt "
        "cache (one slot: each call reuses the previous call's KV), the full history every call",
        "forcing": FORCING,
        "tokenized_means": "usage.prompt_tokens: llama-server renders (the GGUF's chat "
        "template, --jinja) and tokenizes the whole conversation on every call",
        "computed_from": "llama-server's timings.prompt_n (prompt tokens it evaluated), per call",
        "calls": calls,
    }
