"""`once run`'s plan: forced outputs are exactly the ids the next request carries."""

import pytest

from once.bench.session_run import pick_session, plan_session, run_plans
from once.bench.traces import default_traces_dir
from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.loader import resolve_model_path
from once.model_files import load_tokenizer


@pytest.fixture(scope="module")
def plans():
    if not default_traces_dir().exists():
        pytest.skip("shared agent traces not present")
    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    return plan_session(pick_session(), tokenizer, max_len=8192, max_calls=4)


def test_next_request_extends_prompt_plus_forced_output(plans):
    assert len(plans) == 4
    for prev, nxt in zip(plans, plans[1:], strict=False):
        head = prev.prompt_ids + prev.forced_ids
        assert nxt.prompt_ids[: len(head)] == head


def test_replay_with_cache_computes_only_new_tokens(plans, tiny_engine_factory):
    engine = tiny_engine_factory()
    rows = run_plans(engine, plans[:3], "t")
    assert rows[0]["computed_tokens"] == rows[0]["prompt_tokens"]
    for row in rows[1:]:
        # Only the new tokens plus the unfilled tail of the last cached block are computed.
        assert row["new_tokens"] < row["computed_tokens"] <= row["new_tokens"] + 16


@pytest.fixture
def tiny_engine_factory(tmp_path):
    from once.engine.testing import make_tiny_model

    def factory():
        # The real tokenizer's ids need the real vocabulary size; weights can be tiny.
        folder = make_tiny_model(tmp_path / "m", vocab_size=49152, max_position_embeddings=8192)
        return LLMEngine(EngineConfig(model=str(folder), kv_cache_gib=0.05))

    return factory
