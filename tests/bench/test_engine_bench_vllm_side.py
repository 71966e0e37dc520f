"""The vLLM side of the engine bench against a fake vLLM server (tests/router/fake_vllm.py):
what it sends, what it counts, and that a wrong token count fails the measurement."""

import asyncio
from dataclasses import replace

import pytest

from once.bench.engine_bench import vllm_side
from once.bench.engine_bench.once_side import SessionShape
from once.engine.scripted import ScriptedEngine
from once.router.openai_replica import OpenAICompletionsClient
from once.router.vllm_metrics import VllmMetrics
from tests.router.fake_vllm import build_fake_vllm, serve_app

VOCAB = 256


async def _with_fake(body):
    # Each request gets exactly the tokens it asked for (the bench asks for ignore_eos).
    app = build_fake_vllm(ScriptedEngine(lambda r: list(range(200, 200 + r.sampling.max_tokens))))
    async with serve_app(app) as (url, _server):
        client = OpenAICompletionsClient(url, "fake")
        try:
            return await body(client), app
        finally:
            await client.aclose()


def test_throughput_counts_every_output_token_and_sends_ids():
    prompts = [[100 + i, 101, 102] for i in range(3)]

    async def body(client):
        return await vllm_side.measure_throughput(client, prompts, 5)

    result, app = asyncio.run(_with_fake(body))
    assert result["concurrency"] == 3
    assert [len(ids) for ids in result["outputs"]] == [5, 5, 5]
    assert result["output_tok_s"] == pytest.approx(15 / result["elapsed_s"])
    sent = [body["prompt"] for body in app.state.bodies]
    assert sorted(sent) == sorted(prompts)  # token ids, not text
    assert all(body["ignore_eos"] and body["temperature"] == 0 for body in app.state.bodies)


def test_decode_step_is_the_mean_gap_after_the_first_token():
    async def body(client):
        return await vllm_side.measure_decode_step(client, list(range(100, 140)), 6)

    result, _ = asyncio.run(_with_fake(body))
    assert result["context_tokens"] == 40
    assert result["num_decode_steps"] == 6  # 7 tokens streamed: 6 gaps
    assert result["decode_step_ms"] is not None and result["decode_step_ms"] >= 0


def test_session_takes_computed_tokens_from_the_server_counters():
    shape = SessionShape(num_turns=3, system_tokens=20, task_tokens=4, new_tokens=6,
                         output_tokens=4)  # fmt: skip
    counters = VllmMetrics()
    prompts: list[int] = []

    async def read_metrics():
        return counters

    async def body(client):
        nonlocal counters
        original = client.generate

        async def generate(request):
            nonlocal counters
            # The server "computes" all but 8 tokens of each turn after the first.
            n = len(request.prompt_token_ids)
            hits = 0 if not prompts else 8
            prompts.append(n)
            counters = replace(
                counters,
                prefix_cache_queries=counters.prefix_cache_queries + n,
                prefix_cache_hits=counters.prefix_cache_hits + hits,
            )
            async for delta in original(request):
                yield delta

        client.generate = generate
        return await vllm_side.run_session(client, read_metrics, shape, VOCAB, "s")

    result, _ = asyncio.run(_with_fake(body))
    assert [t["prompt_tokens"] for t in result["turns"]] == [24, 34, 44]  # + 4 out + 6 new
    assert [t["computed_tokens"] for t in result["turns"]] == [24, 26, 36]
    assert result["total_cached_tokens"] == 16
    assert result["total_new_tokens"] == 24 + 10 + 10
    # The last turn's probes: its length, computed by the same counters.
    assert [p["computed_tokens"] for p in result["last_turn_probes"]] == [36] * 4
    assert prompts[3:] == [44] * 4


def test_a_short_answer_fails_the_throughput_measurement():
    async def body(client):
        async def short(request):
            from once.protocol.engine import TokenDelta

            yield TokenDelta(request.request_id, [1], "stop")

        client.generate = short
        return await vllm_side.measure_throughput(client, [[100, 101]], 5)

    with pytest.raises(RuntimeError, match="expected 5"):
        asyncio.run(_with_fake(body))


def test_baselines_parse_and_refuse_unknown_names():
    import argparse

    from once.bench.engine_bench import peers

    assert peers.parse_baselines("vllm,llamacpp,transformers") == (
        "vllm", "llamacpp", "transformers",
    )  # fmt: skip
    with pytest.raises(argparse.ArgumentTypeError, match="sglang"):
        peers.parse_baselines("vllm,sglang")


def test_output_agreement_counts_equal_outputs_and_the_agreeing_prefix():
    from once.bench.engine_bench import peers

    ours = [[1, 2, 3, 4], [5, 6, 7, 8]]
    theirs = [[1, 2, 3, 4], [5, 6, 0, 8]]
    agreement = peers.output_agreement(ours, theirs)
    assert agreement["num_equal"] == 1 and agreement["num_requests"] == 2
    assert agreement["mean_agreeing_prefix"] == pytest.approx((1.0 + 0.5) / 2)


def test_peer_figures_are_once_over_the_peer_on_the_same_measurement():
    from once.bench.engine_bench import report

    results = {
        "options": {"prompt_tokens": 128},
        "once": {
            "throughput": {
                "1": {"output_tok_s": 30.0, "decode_step_ms": 20.0},
                "32": {"output_tok_s": 300.0, "decode_step_ms": 90.0},
            },
            "long_context": {"context_tokens": 8000, "decode_step_ms": 40.0},
        },
        "session": {"cached": {"turns": [{"ttft_ms": 100.0}, {"ttft_ms": 150.0}]}},
        "vllm": {
            "status": "ok",
            "throughput": {"1": {"output_tok_s": 20.0}, "32": {"output_tok_s": 400.0}},
            "decode": {"128": {"decode_step_ms": 25.0}, "8000": {"decode_step_ms": 80.0}},
            "session": {"turns": [{"ttft_ms": 90.0}, {"ttft_ms": 300.0}], "computed_over_new": 1.1},
        },
        "llama_cpp": {
            "status": "ok",
            "like_for_like": "f32",
            "rows": {
                "f32": {"throughput": {"1": {"output_tok_s": 60.0}}, "decode": {}},
                "q4_1": {
                    "throughput": {"1": {"output_tok_s": 120.0}},
                    "decode": {"8000": {"decode_step_ms": 10.0}},
                    "session": {"turns": [{"ttft_ms": 50.0}, {"ttft_ms": 75.0}]},
                },
            },
        },
    }
    figures = report.peer_figures(results)
    assert figures["vllm_tok_s_ratio_c1"] == pytest.approx(1.5)
    assert figures["vllm_tok_s_ratio_c32"] == pytest.approx(0.75)
    assert figures["vllm_step_ratio_b1"] == pytest.approx(0.8)
    assert figures["vllm_step_ratio_b1_ctx_long"] == pytest.approx(0.5)
    assert figures["vllm_ttft_ratio_turn20"] == pytest.approx(0.5)
    assert figures["llamacpp_tok_s_ratio_c1"] == pytest.approx(0.5)  # the f32 row's
    assert figures["llamacpp_q4_1_tok_s_ratio_c1"] == pytest.approx(0.25)
    assert figures["llamacpp_q4_1_step_ratio_b1_ctx_long"] == pytest.approx(4.0)
    assert figures["llamacpp_q4_1_ttft_ratio_turn20"] == pytest.approx(2.0)
    assert figures["llamacpp_ttft_ratio_turn20"] is None  # the f32 row ran no session
    verdicts = report.bars(figures)
    assert verdicts["vllm_tok_s_ratio_c1"]["pass"] is True
    assert verdicts["vllm_tok_s_ratio_c32"]["pass"] is False
    assert verdicts["vllm_ttft_ratio_turn20"]["pass"] is True
    # A run without the peer has no figure rather than a made-up one.
    del results["vllm"], results["llama_cpp"]
    assert report.peer_figures(results)["vllm_tok_s_ratio_c1"] is None
    assert report.peer_figures(results)["llamacpp_tok_s_ratio_c1"] is None


def test_a_child_the_bench_ran_is_not_other_load():
    import subprocess
    import sys

    from once.bench.engine_bench import report

    start = report.cpu_snapshot()
    # A peer's server stand-in: a child that burns CPU for a while and ends.
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import time\nt=time.process_time()\nwhile time.process_time()-t<0.5: pass",
        ],
        check=True,
    )  # noqa: E501
    end = report.cpu_snapshot()
    assert end[2] - start[2] >= 0.45  # its CPU seconds are the bench's own


def test_the_vllm_dtype_reaches_the_server_command(tmp_path):
    from once.bench.engine_bench.cli import build_parser
    from once.fleet.vllm_server import VllmServer

    for argv, dtype in (([], "float32"), (["--vllm-dtype", "bfloat16"], "bfloat16")):
        args = build_parser().parse_args(["--baseline", "vllm", *argv])
        spec = vllm_side.server_spec(tmp_path, 2, 64, 1024, True, args.vllm_dtype)
        command = VllmServer(spec, "v0", 8000, tmp_path).command()
        assert command[command.index("--dtype") + 1] == dtype
