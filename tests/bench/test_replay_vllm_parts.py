"""The parts of `once replay --engine vllm` that need no live server: the literal grammar a
recorded output is forced with accepts exactly the recorded text (checked with
llguidance, vLLM's structured-output backend), the naive stack's fresh salt per request,
the vLLM bar of the routing section, and the flag checks."""

import asyncio

import llguidance
import llguidance.hf
import pytest

from once.bench.replay.cli import build_parser, check_routing_args
from once.bench.replay.routing import routed_runs, routing_section
from once.bench.replay.stacks import text_forcing
from once.bench.replay.vllm_pool import FreshSaltClient, literal_grammar
from once.gateway.testing import load_runtime
from once.model_files import DEFAULT_MODEL
from once.protocol.engine import GenerateRequest, SamplingParams


@pytest.fixture(scope="module")
def runtime():
    return load_runtime(DEFAULT_MODEL)


def matcher_for(runtime, grammar: str) -> llguidance.LLMatcher:
    tokenizer = llguidance.hf.from_tokenizer(runtime.tokenizer)
    return llguidance.LLMatcher(tokenizer, llguidance.grammar_from("lark", grammar))


@pytest.mark.parametrize(
    "text",
    [
        'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls \\"a b\\""}}\n'
        "</tool_call>",
        "Tabs\tand ünïcode 🎉, braces {x} and a backslash \\ end",
        "",
    ],
)
def test_forced_output_grammar_accepts_the_recorded_ids_then_only_eos(runtime, text):
    ids = runtime.tokenizer.encode(text, add_special_tokens=False)
    eos = min(runtime.builder.eos_ids)
    constraint = text_forcing(runtime)([*ids, eos])  # the eos that ends the turn is dropped
    assert constraint.kind == "lark"
    matcher = matcher_for(runtime, constraint.text)
    assert not matcher.is_error(), matcher.get_error()
    assert matcher.consume_tokens(ids), matcher.get_error()
    assert matcher.is_accepting()
    assert matcher.consume_token(eos)  # the grammar's end: eos is allowed and stops it
    assert matcher.is_stopped()


def test_forced_output_grammar_rejects_other_text(runtime):
    matcher = matcher_for(runtime, literal_grammar("yes").text)
    assert not matcher.consume_tokens(runtime.tokenizer.encode("no", add_special_tokens=False))


def test_fresh_salt_per_request():
    seen = []

    class Inner:
        async def generate(self, request):
            seen.append(request.cache_salt)
            yield None

        async def stats(self):
            return {"num_running": 0}

    client = FreshSaltClient(Inner())  # type: ignore[arg-type]
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(), cache_salt="tenant")

    async def run():
        for _ in range(2):
            async for _ in client.generate(request):
                pass
        return await client.stats()

    assert asyncio.run(run()) == {"num_running": 0}  # the rest passes through
    assert len(set(seen)) == 2 and "tenant" not in seen


def rows(prompt: int, cached: int, ttft: float) -> list[dict]:
    return [{"prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
             "ttft_s": ttft, "replica": "vllm-0"}]  # fmt: skip


def vllm_stats(policy: str, queries: int, hits: int) -> dict:
    return {
        "policy": policy,
        "router": {},
        "requests_per_replica": {"vllm-0": 1},
        "slow_replicas": [],
        "vllm": {"hit_ratio": hits / queries, "computed_tokens": queries - hits},
    }


def test_routing_section_holds_vllms_bar():
    runs = routed_runs(
        ["once", "round_robin"], replicas=2, slow_replicas=0, slowdown=1.0, threads=1
    )
    records = {
        "once": {"s": rows(1000, 900, 1.0)},
        "once/round_robin": {"s": rows(1000, 500, 2.0)},
        "naive": {"s": rows(1000, 0, 3.0)},
        "once/single": {"s": rows(1000, 900, 1.0)},
    }
    stats = {
        "once": vllm_stats("once", 1000, 900),
        "once/round_robin": vllm_stats("round_robin", 1000, 500),
        "naive": vllm_stats("round_robin", 1000, 0),
    }
    section = routing_section(runs, records, stats)
    assert section["vllm_live"] is True
    assert section["policies"]["once"]["hit_ratio"] == 0.9
    assert section["hit_ratio_vs_round_robin"] == 1.8
    assert section["p90_ttft_ratio_vs_round_robin"] == 0.5
    assert section["computed_ratio_vs_once_engine"] == 1.0
    assert section["bar"] == {
        "hit_ratio_vs_round_robin": True,
        "p90_vs_round_robin": True,
        "computed_vs_once_engine": True,
    }
    stats["once"] = vllm_stats("once", 1000, 600)  # vLLM computed 400 where once's engine 100
    section = routing_section(runs, records, stats)
    assert section["bar"]["hit_ratio_vs_round_robin"] is False
    assert section["bar"]["computed_vs_once_engine"] is False


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--policies", "once", "sglang_router"], "needs --engine vllm"),
        (["--engine", "vllm", "--slow-replicas", "1", "--replicas", "2"], "cannot be throttled"),
        (["--engine", "vllm", "--vllm-kv-mib", "0"], "--vllm-kv-mib must be >= 1"),
        (["--engine", "vllm", "--replicas", "2", "--policies", "once", "sglang_router"], None),
    ],
)
def test_engine_flags(flags, problem):
    args = build_parser().parse_args(flags)
    found = check_routing_args(args)
    assert (found is None) if problem is None else (problem in found)
