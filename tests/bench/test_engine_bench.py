"""`once bench engine` end to end on a tiny random model, at tiny sizes."""

import json

import pytest

from once.bench.engine_bench import main
from once.bench.engine_bench.once_side import SessionPrompts, SessionShape
from once.bench.engine_bench.report import BARS
from once.bench.engine_bench.workloads import random_prompts, token_id_range
from once.engine.testing import make_tiny_model

BLOCK_SIZE = 4
SESSION_FLAGS = [
    "--session-turns", "3",
    "--session-system", "32",
    "--session-task", "8",
    "--session-new", "64",
    "--session-output", "8",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bench") / "m")


@pytest.fixture(scope="module")
def results(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("results") / "bench_engine.json"
    argv = [
        "--model", str(tiny_model),
        "--concurrency", "1,2",
        "--prompt-tokens", "16",
        "--output-tokens", "6",
        "--ctx-long", "48",
        "--decode-steps", "3",
        "--block-size", str(BLOCK_SIZE),
        "--kv-cache-gib", "0.01",
        "--threads", "1",
        "--baseline", "transformers",  # the serving peers have tests of their own
        "--out", str(out),
        *SESSION_FLAGS,
    ]  # fmt: skip
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_prompt_ids_stay_inside_a_small_vocabulary():
    low, high = token_id_range(256)
    prompts = random_prompts(3, 50, 256, seed="s")
    assert 0 < low < high <= 256
    assert all(low <= t < high for p in prompts for t in p)
    assert random_prompts(3, 50, 256, seed="s") == prompts
    assert token_id_range(49152) == (100, 40000)


def test_session_shape_defaults_end_near_8k_tokens():
    shape = SessionShape()
    last_prompt = shape.max_tokens - shape.output_tokens
    assert 7800 <= last_prompt <= 8192 - shape.output_tokens


def test_results_carry_every_headline_figure_and_bar(results):
    for name in BARS:
        if name.startswith(("vllm_", "llamacpp_")):  # peers this run did not measure
            assert results[name] is None and results["bars"][name]["pass"] is None, name
            continue
        assert isinstance(results[name], float) and results[name] > 0, name
        bar = results["bars"][name]
        assert bar["threshold"] == BARS[name][1]
        assert bar["pass"] in (True, False)
    assert set(results["once"]["throughput"]) == {"1", "2"}
    assert set(results["transformers"]["throughput"]) == {"1", "2"}
    for stack in ("once", "transformers"):
        for row in results[stack]["throughput"].values():
            assert row["output_tok_s"] > 0 and row["decode_step_ms"] > 0
        assert results[stack]["long_context"]["context_tokens"] == 48
    for row in results["once"]["throughput"].values():
        assert row["num_cached_tokens"] == 0  # fresh prompts, unlike the warm-up's
        assert "outputs" not in row  # kept for a peer's greedy check, not written
    assert results["vllm"] is None  # only with --baseline vllm
    assert results["machine"]["torch"] and results["machine"]["num_threads"] == 1
    assert results["llama_cpp"] is None  # only with --baseline llamacpp


def test_session_ledger_counts_only_new_tokens_with_the_cache(results):
    cached, uncached = results["session"]["cached"], results["session"]["uncached"]
    assert cached["total_computed_tokens"] < uncached["total_computed_tokens"]
    assert [t["prompt_tokens"] for t in cached["turns"]] == [40, 112, 184]
    assert [t["new_tokens"] for t in cached["turns"]] == [40, 72, 72]
    for turn in uncached["turns"]:
        assert turn["computed_tokens"] == turn["prompt_tokens"]
        assert turn["cached_tokens"] == 0
    previous = None
    for turn in cached["turns"]:
        assert turn["cached_tokens"] + turn["computed_tokens"] == turn["prompt_tokens"]
        if previous is not None:
            # Cached: every full block of the previous turn's prompt + output except the
            # last output token, which was sampled but never run through the model.
            num_known = previous["prompt_tokens"] + 8 - 1
            assert turn["cached_tokens"] == num_known // BLOCK_SIZE * BLOCK_SIZE
        previous = turn
    # The previous output counts as new but its KV was computed while decoding it.
    assert cached["computed_over_new"] == pytest.approx((40 + 2 * (64 + 4)) / 184)
    assert results["session_computed_over_new"] == cached["computed_over_new"]
    assert uncached["computed_over_new"] > 1.5


def test_the_last_turn_is_timed_again_by_probes_of_its_shape(results):
    cached, uncached = results["session"]["cached"], results["session"]["uncached"]
    probes, last = cached["last_turn_probes"], cached["turns"][-1]
    assert len(probes) == SessionShape().last_turn_probes
    # Each probe computes its own fresh ids after the last turn's cached prefix, plus the
    # prefix's tail that fills no block (the 8,016-token default: 4, as its last turn).
    prefix = last["prompt_tokens"] - 64
    expected = 64 + prefix % BLOCK_SIZE
    assert [p["computed_tokens"] for p in probes] == [expected] * len(probes)
    times = sorted([last["ttft_ms"], *(p["ttft_ms"] for p in probes)])
    assert cached["last_turn_ttft_median_ms"] == times[len(times) // 2]
    assert uncached["last_turn_probes"] == []  # each would recompute the whole prompt


def test_probes_keep_the_prefix_and_swap_the_fresh_ids():
    shape = SessionShape(num_turns=2, system_tokens=10, task_tokens=2, new_tokens=5)
    prompts = SessionPrompts(shape, 256, "s")
    prompts.advance([7, 8, 9])
    first, second = prompts.probe(0), prompts.probe(1)
    assert len(first) == len(second) == len(prompts.prompt)
    assert first[:-5] == second[:-5] == prompts.prompt[:-5]
    assert len({tuple(first[-5:]), tuple(second[-5:]), tuple(prompts.prompt[-5:])}) == 3
    assert SessionPrompts(shape, 256, "s").probe(0)[-5:] == first[-5:]  # seeded


def test_a_context_longer_than_the_model_fails_before_measuring(tiny_model, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--model", str(tiny_model), "--ctx-long", "4000", "--skip-hf", "--out", str(out)]
    assert main([*argv, "--kv-cache-gib", "0.01"]) == 2
    assert "positions" in capsys.readouterr().err
    assert not out.exists()


def test_prefill_attention_only_writes_both_ratios_and_bars(tiny_model, tmp_path, monkeypatch):
    from once.bench.engine_bench import prefill_attention

    # Shorter contexts and fewer rounds than the real run: the plumbing, not the speed.
    monkeypatch.setattr(prefill_attention, "CONTEXTS", {"2k": 40, "8k": 100})
    monkeypatch.setattr(prefill_attention, "REPEATS", 3)
    out = tmp_path / "prefill.json"
    argv = ["--model", str(tiny_model), "--prefill-attention-only", "--threads", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    measured = results["once"]["prefill_attention"]
    assert measured["threads"] == 1 and measured["repeats"] == 3
    for label in ("2k", "8k"):
        assert results[f"prefill_vs_sdpa_{label}"] == measured[f"prefill_vs_sdpa_{label}"] > 0
        low, high = measured[f"prefill_vs_sdpa_{label}_range"]
        assert low <= measured[f"prefill_vs_sdpa_{label}"] <= high
        for way in ("once", "sdpa", "masked", "two_flash"):
            assert measured[f"prefill_attention_tok_s_{label}_{way}"] > 0
    assert set(results["bars"]) == {"prefill_vs_sdpa_2k", "prefill_vs_sdpa_8k"}
