"""`once replay --baseline vllm` without a server: the vs-vLLM ledger's arithmetic and
bars, the flags, and the column's client loop against a fake vLLM (httpx MockTransport)
that serves Chat Completions as SSE and prefix-cache counters on /metrics."""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from once.agent.transport.base import payload_bytes
from once.bench.replay import cli
from once.bench.replay.baseline_session import parse_baselines
from once.bench.replay.chat_column import chat_body, chat_tools, replay_column
from once.bench.replay.plan import PlannedCall, SessionPlan
from once.bench.replay.vllm_baseline import check_vllm_baseline, vllm_peer
from once.bench.replay.vllm_pool import literal_grammar
from once.bench.replay.vs_peers import (
    add_vs_peer,
    markdown_lines,
    matched_calls,
    probe_text,
    summary_lines,
    vs_peer_row,
)
from once.bench.traces import MINI_SWE_AGENT, SWEAGENT_1_1, Call, Session
from once.router.openai_replica import structured_outputs


def _once(index: int, **fields) -> dict:
    row = {
        "index": index,
        "bytes_sent": 100,
        "tokens_tokenized": 50,
        "prompt_tokens": 1000,
        "computed_tokens": 40,
        "output_tokens": 10,
        "ttft_s": 0.2,
        "wall_s": 1.0,
        "break_cause": None,
    }
    return row | fields


def _vllm(index: int, **fields) -> dict:
    row = {
        "index": index,
        "source_folder": "mini",
        "bytes_sent": 2000,
        "tokens_tokenized": 1000,
        "prompt_tokens": 1000,
        "computed_tokens": 50,
        "output_tokens": 10,
        "ttft_s": 0.5,
        "wall_s": 2.0,
        "server_cpu_s": 3.0,
        "finish_reason": "stop",
    }
    return row | fields


def test_matched_calls_keeps_the_calls_both_columns_completed():
    once = {"s": [_once(0), _once(1), _once(2)], "t": [_once(0)]}
    vllm = {"s": [_vllm(0), _vllm(1, error="HTTP 400: too long")], "u": [_vllm(0)]}
    once_rows, vllm_rows = matched_calls(once, vllm, ["s", "t", "u"])
    assert [r["index"] for r in once_rows] == [0]  # 1 failed on vLLM, 2 never ran there
    assert vllm_rows == [vllm["s"][0]]


def test_ratios_are_once_over_vllm_with_the_bars():
    once = [
        _once(0, computed_tokens=1000, tokens_tokenized=1000, bytes_sent=5000, ttft_s=1.0),
        _once(1, ttft_s=0.1),
        _once(2, ttft_s=0.3),
    ]
    vllm = [
        _vllm(0, computed_tokens=1000, ttft_s=1.2),
        _vllm(1, ttft_s=0.5),
        _vllm(2, ttft_s=0.4, finish_reason="length"),
    ]
    row = vs_peer_row("vllm", once, vllm, once_cpu_s=4.5)
    assert row["calls"] == 3 and row["append_only"]
    assert row["computed_ratio"] == round(1080 / 1100, 4)
    assert row["tokenized_ratio"] == round(1100 / 3000, 4)
    assert row["bytes_ratio"] == round(5200 / 6000, 4)
    assert row["ttft_p50_ratio"] == round(0.3 / 0.5, 4)  # medians of the same calls
    assert row["prompt_ratio"] == 1.0
    assert row["server_cpu_ratio"] == 0.5  # once 4.5 s, vLLM 3 x 3.0 s
    assert row["outputs_cut"] == 1
    met = {key: bar["met"] for key, bar in row["bars"].items()}
    assert met == {
        "computed_ratio": True,
        "tokenized_ratio": False,
        "bytes_ratio": False,
        "ttft_p50_ratio": True,
    }
    assert row["once"]["computed_tokens"] == 1080 and row["vllm"]["server_cpu_s"] == 9.0


def test_the_bytes_bar_holds_only_on_append_only_groups():
    once = [_once(0, bytes_sent=10), _once(1, bytes_sent=10, break_cause="role_switch")]
    row = vs_peer_row("vllm", once, [_vllm(0), _vllm(1)])
    assert not row["append_only"] and row["bytes_ratio"] < 0.1
    assert row["bars"]["bytes_ratio"]["met"] is None
    assert row["server_cpu_ratio"] is None  # once's CPU not measured
    assert vs_peer_row("vllm", [], [])["computed_ratio"] is None


def _report() -> dict:
    once_calls = {
        "a": [_once(0), _once(1)],
        "b": [_once(0, break_cause=None)],
        "c": [_once(0)],  # vLLM never ran it
    }
    return {
        "sources": {"mini": {}, "swe": {}},
        "total": {},
        "calls": {"once": once_calls},
        "per_session": {
            "once": {
                s: {"cpu_s": {"harness": 9.0, "gateway": 1.0, "engine": 2.0}} for s in once_calls
            }
        },
    }


def _column(probe_works: bool) -> dict:
    second = {"status": 200, "error": None, "input_tokens": 52, "cached_tokens": 32}
    if not probe_works:
        second = {
            "status": 404,
            "error": "Response with id 'x' not found.",
            "input_tokens": None,
            "cached_tokens": None,
        }
    return {
        "sends": "its OpenAI server",
        "forcing": "literal grammar",
        "tokenized_means": "usage.prompt_tokens",
        "computed_from": "/metrics",
        "responses_probe": {"previous_response_id_works": probe_works, "calls": [{}, second]},
        "calls": {
            "a": [_vllm(0), _vllm(1)],
            "b": [_vllm(0, source_folder="swe"), _vllm(1, source_folder="swe", error="HTTP 400")],
        },
    }


def test_add_vs_peer_per_source_and_total():
    report = _report()
    add_vs_peer(report, "vllm", _column(probe_works=False))
    assert report["sources"]["mini"]["vs_vllm"]["calls"] == 2
    assert report["sources"]["swe"]["vs_vllm"]["calls"] == 1
    total = report["total"]["vs_vllm"]
    assert total["calls"] == 3
    assert total["once"]["server_cpu_s"] == 6.0  # gateway + engine of a and b
    assert total["computed_ratio"] == round(3 * 40 / (3 * 50), 4)
    assert report["vllm"]["failed_calls"] == 1
    lines = summary_lines(report)
    assert any("total" in line and "0.800" in line for line in lines)
    assert "fails, HTTP 404" in lines[-1]
    markdown = "\n".join(markdown_lines(report))
    assert "| total | 3 | 0.800 |" in markdown
    assert summary_lines({"total": {}}) == [] == markdown_lines({"total": {}})


def test_probe_text_when_it_works():
    assert (
        probe_text(_column(probe_works=True)) == "works (second call: 52 input tokens, 32 cached)"
    )


def test_baseline_flag_is_a_comma_list():
    assert parse_baselines("transformers") == ["transformers"]
    assert parse_baselines("vllm, transformers,vllm") == ["vllm", "transformers"]
    for bad in ("sglang", "", "vllm,sglang"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_baselines(bad)
    args = cli.build_parser().parse_args(["--baseline", "transformers,vllm"])
    assert args.baseline == ["transformers", "vllm"]
    assert check_vllm_baseline(cli.build_parser().parse_args([])) is None
    crowded = cli.build_parser().parse_args(["--baseline", "vllm", "--concurrency", "2"])
    assert "--concurrency 1" in check_vllm_baseline(crowded)


def test_chat_body_carries_the_history_tools_and_the_forced_text():
    tools = chat_tools(
        [
            {
                "type": "function",
                "name": "bash",
                "description": "run",
                "parameters": {"type": "object"},
                "strict": False,
            }
        ]
    )
    assert tools == [
        {
            "type": "function",
            "function": {"name": "bash", "description": "run", "parameters": {"type": "object"}},
        }
    ]
    messages = ({"role": "user", "content": "hi"},)
    forcing = {"structured_outputs": structured_outputs(literal_grammar('say "ok"'))}
    body = chat_body(messages, tools, forcing, 7, "m")
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["tools"] == tools
    assert body["structured_outputs"] == {"grammar": 'start: "say \\"ok\\""\n'}
    assert (body["max_tokens"], body["temperature"], body["stream"]) == (7, 0.0, True)
    assert "tools" not in chat_body(messages, chat_tools(None), {}, 1, "m")


class FakeRuntime:
    """What the forcing reads of a runtime: the eos ids and a decoder."""

    builder = SimpleNamespace(eos_ids=[2])
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "ok")


class FakeVllm:
    """/metrics counters that grow as a prefix cache would; Chat Completions as SSE."""

    def __init__(self):
        self.queries = self.hits = 0
        self.bodies: list[dict] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            text = (
                f"vllm:prefix_cache_queries_total {self.queries}.0\n"
                f"vllm:prefix_cache_hits_total {self.hits}.0\n"
            )
            return httpx.Response(200, text=text)
        body = json.loads(request.content)
        self.bodies.append(body)
        prompt = sum(len(m["content"]) for m in body["messages"])
        if prompt > 60:
            return httpx.Response(400, json={"error": {"message": "too long"}})
        hits = 16 if len(self.bodies) > 1 else 0  # what the previous call left cached
        self.queries, self.hits = self.queries + prompt, self.hits + hits
        chunks = [
            {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"delta": {"content": "ok"}, "finish_reason": "stop"}]},
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": 2,
                    "prompt_tokens_details": {"cached_tokens": hits},
                },
            },
        ]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


def _plan(source: str, contents: list[str], forced_ids=(5, 6)) -> SessionPlan:
    """A session of user turns, each call forced to `forced_ids` (the llama.cpp tests too)."""
    calls, history = [], []
    for index, content in enumerate(contents):
        history = [*history, {"role": "user", "content": content}]
        calls.append(Call(index, tuple(history), {"role": "assistant", "content": "ok"}))
    session = Session(f"f/{source}", source, Path(source), tuple(calls))
    planned = [PlannedCall(c.index, {}, [], [1] * 10, list(forced_ids), True, None) for c in calls]
    return SessionPlan(session, planned, [])


async def test_replay_column_reads_the_counters_around_each_call():
    fake = FakeVllm()
    http = httpx.AsyncClient(transport=httpx.MockTransport(fake.handle))
    plans = [
        ("mini", _plan(MINI_SWE_AGENT, ["a" * 20, "b" * 10, "c" * 40])),
        ("swe", _plan(SWEAGENT_1_1, ["d" * 8])),
    ]
    cpu = iter(range(100))
    async with http:
        records = await replay_column(
            http, "http://vllm", plans, vllm_peer(FakeRuntime, lambda: next(cpu))
        )
    first, second, third = records["f/" + MINI_SWE_AGENT]
    assert (first["prompt_tokens"], first["computed_tokens"], first["cached_tokens"]) == (20, 20, 0)
    assert (second["tokens_tokenized"], second["computed_tokens"], second["cached_tokens"]) == (
        30,
        14,
        16,
    )
    assert second["usage_cached_tokens"] == 16 and second["finish_reason"] == "stop"
    assert second["bytes_sent"] == payload_bytes(fake.bodies[1])
    assert second["forced_tokens"] == 2 and second["server_cpu_s"] == 1
    assert len(fake.bodies[1]["messages"]) == 2  # the whole history, every call
    assert fake.bodies[0]["structured_outputs"] == {"grammar": 'start: "ok"\n'}  # eos dropped
    assert "error" in third and "computed_tokens" not in third  # refused: kept, not counted
    (swe,) = records["f/" + SWEAGENT_1_1]
    assert fake.bodies[-1]["tools"][0]["function"]["name"] == "bash"  # the recorded tools
    assert swe["source_folder"] == "swe" and swe["ttft_s"] <= swe["wall_s"]


def test_a_length_vllm_would_refuse_is_refused_before_any_stack_runs(capsys):
    from once.bench.replay.cli import main

    argv = ["--model", "smollm2", "--max-model-len", "16384", "--baseline", "vllm"]
    assert main(argv) == 2
    assert "--max-model-len 8192" in capsys.readouterr().err
