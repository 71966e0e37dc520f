"""The second bar's pieces: transformers with prefix reuse, the output cut, the figures.

The baseline must compute exactly what a full recompute computes (else its timing is of
a different computation); the cut must keep every later request consistent with it.
"""

import argparse
import json
from pathlib import Path

import pytest
import torch

from once.bench.replay.baseline import PrefixReuseBaseline, run_baseline, second_bar
from once.bench.replay.baseline_session import (
    cut_outputs,
    kv_cache_gib_for,
    resolve_session_mode,
)
from once.bench.replay.plan import plan_session
from once.bench.replay.stacks import TINY, load_served_runtime, make_tiny_replay_model
from once.bench.traces import MINI_SWE_AGENT, Call, Session
from once.engine.testing import make_tiny_model, reference_model

MAX_LEN = 4096


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m")
    return reference_model(folder, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def replay_folder(tmp_path_factory):
    # SmolLM2's tokenizer and vocabulary on random weights: plans of real renders.
    return make_tiny_replay_model(tmp_path_factory.mktemp("replay") / "m", MAX_LEN)


@pytest.fixture(scope="module")
def runtime(replay_folder):
    return load_served_runtime(replay_folder, MAX_LEN)


def _ids(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=generator).tolist()


@torch.inference_mode()
def _full_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]  # (T, vocab)


@pytest.mark.parametrize("prefill_chunk", [2048, 7])
def test_suffix_reuse_step_equals_full_recompute(tiny, prefill_chunk):
    first_prompt, first_output, new_items = _ids(40, 1), _ids(6, 2), _ids(25, 3)
    runner = PrefixReuseBaseline(tiny, prefill_chunk=prefill_chunk)
    call = runner.run_call(0, first_prompt, first_output)
    assert (call.reused_tokens, call.computed_tokens, call.decode_steps) == (0, 40, 5)

    prompt = first_prompt + first_output + new_items
    logits, reused = runner.prefill(prompt)
    # The last output token was never fed back: its KV does not exist to reuse.
    assert reused == len(first_prompt) + len(first_output) - 1
    full = _full_logits(tiny, prompt + [17])
    torch.testing.assert_close(logits, full[len(prompt) - 1], atol=1e-4, rtol=1e-4)
    step = runner.decode(17)
    torch.testing.assert_close(step, full[len(prompt)], atol=1e-4, rtol=1e-4)
    assert runner.cache.get_seq_length() == len(prompt) + 1


def test_changed_prefix_crops_the_cache_and_still_matches(tiny):
    prompt = _ids(50, 4)
    runner = PrefixReuseBaseline(tiny)
    runner.run_call(0, prompt, _ids(4, 5))
    edited = prompt[:20] + _ids(30, 6)  # the history was edited at token 20
    logits, reused = runner.prefill(edited)
    assert reused == 20
    assert runner.cache.get_seq_length() == len(edited)
    torch.testing.assert_close(logits, _full_logits(tiny, edited)[-1], atol=1e-4, rtol=1e-4)
    # The same prompt again: everything but its last token is reused.
    _, reused_again = runner.prefill(edited)
    assert reused_again == len(edited) - 1


def test_run_baseline_totals_and_bad_inputs(tiny, replay_folder, runtime):
    plan = plan_session(_session(), runtime)
    result = run_baseline(reference_model(replay_folder, attn_implementation="sdpa"), [plan])
    rows = result["sessions"][plan.session_id]
    assert len(rows) == len(plan.calls)
    assert result["decode_steps"] == sum(len(c.forced_ids) - 1 for c in plan.calls)
    assert result["computed_tokens"] + result["reused_tokens"] == sum(
        len(c.prompt_ids) for c in plan.calls
    )
    assert rows[1]["reused_tokens"] > 0  # an append-only session reuses its history
    assert result["wall_s"] == pytest.approx(result["prefill_s"] + result["decode_s"], abs=2e-3)
    runner = PrefixReuseBaseline(tiny)
    with pytest.raises(ValueError, match="empty"):
        runner.prefill([])
    with pytest.raises(ValueError, match="no output"):
        runner.run_call(0, [5, 6], [])
    with pytest.raises(ValueError, match="prefill_chunk"):
        PrefixReuseBaseline(tiny, prefill_chunk=0)


def _session(tool_calls: bool = False) -> Session:
    history: list[dict] = [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": "Fix the bug in parser.py."},
    ]
    lengths = [2, 40, 3]  # words: outputs of about 9, 160 and 13 tokens
    calls = []
    for index, words in enumerate(lengths):
        output = {
            "role": "assistant",
            "content": " ".join(f"step{index}_{w}" for w in range(words)),
        }
        if tool_calls and index == 1:
            output["tool_calls"] = [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
            ]
        calls.append(Call(index=index, messages=tuple(history), output=output))
        history = [*history, output, {"role": "user", "content": f"observation {index}"}]
    return Session("hand/cut", MINI_SWE_AGENT, Path("cut"), tuple(calls))


def test_cut_outputs_keeps_later_requests_consistent(runtime):
    session = _session()
    original = plan_session(session, runtime)
    assert len(original.calls[1].forced_ids) > 21  # the long output needs a cut
    cut = cut_outputs(session, runtime, 20)
    plan = plan_session(cut, runtime)
    lengths = [len(call.forced_ids) for call in plan.calls]
    assert lengths[0] == len(original.calls[0].forced_ids)  # short outputs untouched
    assert lengths[2] == len(original.calls[2].forced_ids)
    assert 20 <= lengths[1] <= 22  # 20 tokens and the eos (a merge at the cut: +-1)
    assert original.calls[1].forced_ids[:19] == plan.calls[1].forced_ids[:19]
    long_text = session.calls[1].output["content"]
    assert long_text.startswith(cut.calls[1].output["content"])
    for earlier, later in zip(plan.calls, plan.calls[1:], strict=False):
        held = earlier.prompt_ids + earlier.forced_ids
        assert later.prompt_ids[: len(held)] == held  # the next request carries the cut
    assert cut.calls[2].messages[2] is cut.calls[1].messages[2] is not None
    assert all(m["content"] != long_text for m in cut.calls[2].messages)


def test_cut_outputs_bad_inputs(runtime):
    with pytest.raises(ValueError, match=">= 1"):
        cut_outputs(_session(), runtime, 0)
    with pytest.raises(ValueError, match="tool calls"):
        cut_outputs(_session(tool_calls=True), runtime, 20)
    assert cut_outputs(_session(), runtime, 10_000) == _session()  # nothing to cut


def test_second_bar_figures():
    def row(ttft, wall):
        return {"engine_ttft_s": ttft, "wall_s": wall}

    records = {
        "once": {"s": [row(1.0, 2.0), row(0.5, 1.0)]},
        "naive": {"s": [row(1.0, 2.0), row(11.0, 12.0)]},
    }
    baseline = {"wall_s": 12.0, "prefill_s": 8.0, "decode_s": 4.0}
    figures = second_bar(records, baseline)
    assert figures["prefill_s"] == {"once": 1.5, "naive": 12.0}
    assert figures["prefill_ratio"] == 8.0
    assert figures["wall_ratio_vs_transformers_reuse"] == 0.25
    assert "wall_ratio_vs_transformers_reuse" not in second_bar(records, None)


def test_session_mode_flags(runtime):
    args = argparse.Namespace(model="smollm2", max_output_tokens=None)
    resolve_session_mode(args, TINY)
    assert (args.model, args.max_output_tokens) == ("smollm2-135m-instruct", 96)
    args = argparse.Namespace(model=TINY, max_output_tokens=None)
    resolve_session_mode(args, TINY)
    assert args.max_output_tokens == 0
    with pytest.raises(ValueError, match=">= 0"):
        resolve_session_mode(argparse.Namespace(model=TINY, max_output_tokens=-1), TINY)


def test_kv_cache_sized_for_one_longest_request(tmp_path):
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3}
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 576}))
    folder = tmp_path
    # SmolLM2's shape: 30 layers x 3 KV heads x 64 x (K, V) x 4 bytes = 46,080 bytes a token.
    assert kv_cache_gib_for(folder, 16384) == pytest.approx(1.1 * 46080 * 16384 / 2**30, 1e-3)
    assert kv_cache_gib_for(folder, 16) == 0.25
