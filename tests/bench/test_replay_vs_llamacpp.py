"""`once replay --baseline llamacpp`: the GBNF literal, the server's flags, the column's
client loop against a fake llama-server (httpx MockTransport: Chat Completions as SSE,
its timings in the last chunk), vs_llamacpp beside vs_vllm in the summary and report.md;
and, where `make llamacpp` has built it, a short real replay (SmolLM2, two calls)."""

import json

import httpx
import pytest

from once.agent.transport.base import payload_bytes
from once.bench.replay import cli
from once.bench.replay.chat_column import replay_column
from once.bench.replay.llamacpp_baseline import (
    check_llamacpp_baseline,
    column_spec,
    gbnf_literal,
    llamacpp_peer,
    prompt_split,
)
from once.bench.replay.vs_peers import add_vs_peer, markdown_lines, summary_lines
from once.bench.traces import MINI_SWE_AGENT, SWEAGENT_1_1
from once.fleet.llama_server import LlamaServer, llamacpp_missing_reason
from tests.bench.test_replay_vs_vllm import FakeRuntime, _plan


def test_the_gbnf_literal_escapes_what_gbnf_would_read_otherwise():
    assert gbnf_literal('say "hi"') == 'root ::= "say \\"hi\\""\n'
    assert gbnf_literal("a\\b\n\tc\r") == 'root ::= "a\\\\b\\n\\tc\\r"\n'
    assert gbnf_literal("\x01 é ☃ 😀 [x-y]") == (
        'root ::= "\\x01 \\u00E9 \\u2603 \\U0001F600 [x-y]"\n'  # brackets are plain in a string
    )


def test_the_server_runs_once_threads_f32_kv_one_slot_and_jinja(tmp_path, monkeypatch):
    monkeypatch.setattr("once.bench.replay.llamacpp_baseline.usable_cores", lambda: 3)
    spec = column_spec(tmp_path / "model-f32.gguf", max_model_len=8192)
    command = LlamaServer(spec, "s", 4242, tmp_path).command()
    flag = {name: command[command.index(name) + 1] for name in ("-t", "--ctx-size", "-ctk")}
    assert flag == {"-t": "3", "--ctx-size": "8192", "-ctk": "f32"}
    assert command[command.index("--parallel") + 1] == "1" and "--jinja" in command


def test_the_flags_it_needs(tmp_path, monkeypatch):
    parse = cli.build_parser().parse_args
    assert parse(["--baseline", "vllm,llamacpp"]).baseline == ["vllm", "llamacpp"]
    assert check_llamacpp_baseline(parse(["--baseline", "vllm"])) is None
    crowded = parse(["--baseline", "llamacpp", "--replicas", "2"])
    assert "--baseline llamacpp" in check_llamacpp_baseline(crowded)
    monkeypatch.setenv("ONCE_LLAMACPP_HOME", str(tmp_path / "nowhere"))
    assert "make llamacpp" in check_llamacpp_baseline(parse(["--baseline", "llamacpp"]))


class FakeLlamaServer:
    """One slot that keeps the previous prompt: prompt_n is what the new prompt adds."""

    def __init__(self):
        self.previous = 0
        self.bodies: list[dict] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        if "tools" in body and body.get("tool_choice") != "none":
            return httpx.Response(400, json={"error": {"message": "grammar with tools"}})
        prompt = sum(len(m["content"]) for m in body["messages"])
        cached = min(self.previous, prompt - 1)
        self.previous = prompt
        timings = {"cache_n": cached, "prompt_n": prompt - cached, "predicted_n": 2}
        chunks = [
            {"choices": [{"delta": {"role": "assistant", "content": "o"}}]},
            {"choices": [{"delta": {"content": "k"}, "finish_reason": None}]},
            {"choices": [{"delta": {}, "finish_reason": "stop"}]},
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": 3,
                    "prompt_tokens_details": {"cached_tokens": cached},
                },
                "timings": timings,
            },
        ]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


async def test_replay_column_counts_llama_cpp_s_own_prompt_n():
    fake = FakeLlamaServer()
    http = httpx.AsyncClient(transport=httpx.MockTransport(fake.handle))
    plans = [
        ("mini", _plan(MINI_SWE_AGENT, ["a" * 20, "b" * 10], forced_ids=[5, 6, 2])),
        ("swe", _plan(SWEAGENT_1_1, ["d" * 8])),
    ]
    cpu = iter(range(0, 100, 2))
    async with http:
        peer = llamacpp_peer(FakeRuntime, lambda: next(cpu))
        records = await replay_column(http, "http://llama", plans, peer)
    first, second = records["f/" + MINI_SWE_AGENT]
    assert (first["tokens_tokenized"], first["cached_tokens"], first["computed_tokens"]) == (
        20, 0, 20,
    )  # fmt: skip
    assert (second["tokens_tokenized"], second["cached_tokens"], second["computed_tokens"]) == (
        30, 20, 10,
    )  # fmt: skip
    assert second["usage_cached_tokens"] == 20 and second["timings"]["prompt_n"] == 10
    assert second["bytes_sent"] == payload_bytes(fake.bodies[1]) and second["server_cpu_s"] == 2
    body = fake.bodies[0]
    assert body["grammar"] == 'root ::= "ok"\n'  # the recorded text, its eos dropped
    assert (body["max_tokens"], body["temperature"], body["cache_prompt"]) == (3, 0.0, True)
    assert "tool_choice" not in body  # no tools: nothing to switch off
    (swe,) = records["f/" + SWEAGENT_1_1]
    assert fake.bodies[-1]["tool_choice"] == "none" and fake.bodies[-1]["tools"]
    assert "error" not in swe and swe["source_folder"] == "swe"


def test_a_reply_without_timings_is_an_error_not_a_zero():
    with pytest.raises(RuntimeError, match="no timings"):
        prompt_split({"prompt_tokens": 5})


def _row(index: int, **fields) -> dict:
    row = {
        "index": index, "bytes_sent": 100, "tokens_tokenized": 50, "prompt_tokens": 1000,
        "computed_tokens": 40, "output_tokens": 10, "ttft_s": 0.2, "wall_s": 1.0,
        "break_cause": None, "source_folder": "mini", "server_cpu_s": 1.0,
        "finish_reason": "stop",
    }  # fmt: skip
    return row | fields


def test_vs_llamacpp_beside_vs_vllm_in_the_summary_and_report():
    report: dict = {
        "sources": {"mini": {}},
        "total": {},
        "calls": {"once": {"a": [_row(0), _row(1)]}},
    }
    llama = {
        "sends": "llama-server's OpenAI endpoint",
        "forcing": "GBNF",
        "tokenized_means": "usage.prompt_tokens",
        "computed_from": "timings.prompt_n",
        "calls": {"a": [_row(0, computed_tokens=80), _row(1, prompt_tokens=990)]},
    }
    vllm = llama | {"sends": "its OpenAI server", "responses_probe": {"calls": [{}]}}
    add_vs_peer(report, "llamacpp", llama)
    add_vs_peer(report, "vllm", vllm)
    total = report["total"]["vs_llamacpp"]
    assert total["calls"] == 2 and total["computed_ratio"] == round(80 / 120, 4)
    assert total["prompt_differs"] == 1 and total["llamacpp"]["prompt_tokens"] == 1990
    assert report["sources"]["mini"]["vs_llamacpp"] == total
    lines = summary_lines(report)
    heads = [line for line in lines if line.startswith("vs ")]
    assert heads[0].startswith("vs vLLM (its") and heads[1].startswith("vs llama.cpp (llama")
    assert "1 of 2 calls" in lines[-1] and "responses" not in lines[-1]  # vLLM's probe only
    markdown = "\n".join(markdown_lines(report))
    assert "## once vs llama.cpp (same calls)" in markdown and "| llama.cpp | 200 |" in markdown


@pytest.mark.slow
@pytest.mark.skipif(llamacpp_missing_reason() is not None, reason="llama.cpp is not built")
def test_replay_with_the_llamacpp_column():
    """SmolLM2 through once's stacks, then the same two calls to llama-server: its prompt
    cache holds the first call, the grammar forces the recorded text. The replay runs in a
    process of its own: its two SmolLM2 engines take ~3 GB the test process would keep."""
    import subprocess
    import sys

    session = "django__django-11179"  # mini-swe-agent: append-only, no tools
    argv = [
        "--model", "smollm2", "--sessions", session, "--max-calls", "2",
        "--max-output-tokens", "16", "--max-model-len", "4096", "--baseline", "llamacpp",
        "--no-progress", "--json",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "once.bench.replay.cli", *argv], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    calls = report["llamacpp"]["calls"][f"mini-swe-agent__gemini-3-pro-preview/{session}"]
    first, second = calls
    for call in calls:
        assert "error" not in call
        assert call["cached_tokens"] + call["computed_tokens"] == call["prompt_tokens"]
        # The recorded text, or its first forced-length tokens where greedy decoding
        # split it finer than once's tokenizer (call 0 here: 19 tokens against 17).
        assert call["finish_reason"] in ("stop", "length")
        assert 0 < call["output_tokens"] <= call["forced_tokens"]
    assert first["cached_tokens"] == 0 and second["computed_tokens"] < first["computed_tokens"]
    total = report["total"]["vs_llamacpp"]
    assert total["calls"] == 2 and total["append_only"]
    assert total["outputs_cut"] == sum(c["finish_reason"] == "length" for c in calls)
    # The same template text; llama.cpp's tokenizer merges "\n\n" before a digit, so its
    # prompts here are a token shorter than once's.
    assert 0.99 < total["prompt_ratio"] < 1.01
    assert total["bytes_ratio"] < 1 and total["tokenized_ratio"] < 1
