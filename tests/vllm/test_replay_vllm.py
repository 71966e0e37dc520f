"""`once replay --engine vllm`'s stacks over a live vLLM server: the recorded outputs are
forced as grammars of their text (vLLM decodes them itself), the once stack's
conversation chains on vLLM's prefix cache, the naive stack reuses nothing, and the
engine counters are vLLM's own."""

from pathlib import Path

from once.bench.replay.plan import plan_session
from once.bench.replay.replay import replay_session
from once.bench.replay.sessions import find_session
from once.bench.replay.stacks import NAIVE, ONCE, load_served_runtime, open_stack
from once.bench.replay.vllm_pool import VllmPool
from once.engine.loader import resolve_model_path
from tests.vllm.conftest import MODEL

MAX_MODEL_LEN = 4096
SESSION = "django__django-11179"  # three short calls: 1.5k-1.8k prompt tokens


async def replay_on(stack_spec, policy, server, plan, runtime, folder):
    metrics = await server.metrics()
    pool = VllmPool([server], MODEL, metrics.block_size, metrics.num_blocks)
    async with open_stack(
        stack_spec, runtime, folder, max_model_len=MAX_MODEL_LEN, vllm_pool=pool, policy=policy
    ) as stack:
        rows = await replay_session(stack, plan)
        return rows, await stack.engine_stats(), await stack.fleet.routing_stats()


async def test_replay_stacks_over_vllm(vllm_pair):
    folder = Path(resolve_model_path(MODEL))
    runtime = load_served_runtime(folder, MAX_MODEL_LEN)
    _, session = find_session(SESSION)
    plan = plan_session(session, runtime, max_calls=3, max_model_len=MAX_MODEL_LEN)
    assert len(plan.calls) == 3
    server = vllm_pair[0]  # structured outputs need vLLM's tokenizer: the plain server

    rows, stats, routing = await replay_on(ONCE, "once", server, plan, runtime, folder)
    # vLLM produced the recorded text: each output parsed to the recorded items.
    assert all(row["output_matches_recording"] for row in rows)
    assert all(row["incremental"] for row in rows[1:])
    for previous, row in zip(rows, rows[1:], strict=False):
        # The chain's prefix (everything before this call's new input) was in vLLM's cache,
        # to a 32-token block.
        assert row["cached_tokens"] >= previous["prompt_tokens"] - 32
    # The engine counters are vLLM's own, since the stack opened (its cache emptied).
    assert stats["num_prompt_tokens"] == sum(row["prompt_tokens"] for row in rows)
    assert stats["num_cached_prompt_tokens"] == sum(row["cached_tokens"] for row in rows)
    assert stats["num_requests_finished"] == 3
    assert routing["vllm"]["hit_ratio"] > 0.5

    rows, stats, _ = await replay_on(NAIVE, "round_robin", server, plan, runtime, folder)
    assert all(row["output_matches_recording"] for row in rows)
    assert [row["cached_tokens"] for row in rows] == [0, 0, 0]  # a fresh salt per request
    assert stats["num_cached_prompt_tokens"] == 0
    assert stats["num_prompt_tokens"] == sum(row["prompt_tokens"] for row in rows)
