"""Rope scaling as served: YaRN (from the model's config or `--rope-scaling`) gives the same
logits as transformers with the same rope_scaling, past the trained positions too."""

import json

import pytest
import torch

from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.models.config import ModelConfig, serving_model_config
from once.engine.testing import make_tiny_model, reference_model
from once.protocol.engine import GenerateRequest, SamplingParams
from once.protocol.errors import UnsupportedModelError
from tests.engine.test_engine_parity import assert_logits_match, capture_logits

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def yarn_model_dir(tmp_path_factory):
    # Trained on 64 positions, stretched 4x: the prompts below run past 64.
    return make_tiny_model(
        tmp_path_factory.mktemp("yarn") / "llama", max_position_embeddings=256, rope_scaling=YARN
    )


def _run(model_dir, prompt, **overrides):
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=128, **overrides)
    )
    records = capture_logits(engine)
    request = GenerateRequest(
        "r", tuple(prompt), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    engine.generate([request])
    return engine, records


def test_yarn_in_the_model_config_matches_transformers(yarn_model_dir):
    prompt = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    engine, records = _run(yarn_model_dir, prompt)
    assert dict(engine.model_config.rope_scaling)["rope_type"] == "yarn"
    assert_logits_match(reference_model(yarn_model_dir), records)


def test_the_flag_replaces_the_model_rope_scaling(tmp_path):
    plain = make_tiny_model(tmp_path / "plain", max_position_embeddings=256)
    scaled = make_tiny_model(
        tmp_path / "scaled", max_position_embeddings=256, rope_scaling=YARN
    )  # same seed: same weights
    prompt = torch.randint(3, 256, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    _, records = _run(plain, prompt, rope_scaling=json.dumps(YARN))
    assert_logits_match(reference_model(scaled), records)
    # Without the flag the plain model is not the scaled one: the flag did the work.
    _, unscaled = _run(plain, prompt)
    assert not torch.allclose(unscaled[-1][1], records[-1][1], atol=1e-3)


def test_bad_rope_scaling_is_refused_with_the_setting_named():
    with pytest.raises(ValueError, match="rope_scaling"):
        EngineConfig(rope_scaling="{not json")
    base = ModelConfig("LlamaForCausalLM", 256, 64, 128, 2, 4, 2, 16, 64)
    with pytest.raises(UnsupportedModelError, match="rope_type"):
        base.with_rope_scaling({"rope_type": "bogus", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="factor"):
        base.with_rope_scaling({"rope_type": "yarn"})


def test_a_context_past_the_trained_positions_is_warned_about(caplog):
    base = ModelConfig("LlamaForCausalLM", 256, 64, 128, 2, 4, 2, 16, 64)
    assert base.trained_context == 64
    with caplog.at_level("WARNING"):
        serving_model_config(base, "", 256)
    assert "yarn" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        scaled = serving_model_config(base, json.dumps(YARN), 256)
    assert scaled.trained_context == 256 and not caplog.text
