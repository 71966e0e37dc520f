"""`once bench engine --profile`: the step broken down by block, on the tiny model."""

import json

import pytest

from once.bench.engine_bench import main, step_profile
from once.engine.quant_q8_0 import Q8_0Linear
from once.engine.testing import make_tiny_model

SHAPES = ("decode_b1_ctx128", "decode_b1_ctx40", "prefill_after_prefix")


@pytest.mark.parametrize("weights", ["fp32", "q8_0"])
def test_profile_names_every_block_and_adds_up(tmp_path, weights):
    model = make_tiny_model(tmp_path / "m")
    out = tmp_path / "profile.json"
    argv = [
        "--model", str(model), "--threads", "1", "--profile", "--profile-steps", "4",
        "--profile-prefix", "40", "--profile-new", "12", "--weights", weights,
        "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    results = json.loads(out.read_text())
    assert results["part"] == "profile" and results["weights"] == weights
    for shape in SHAPES:
        part = results[shape]
        blocks = part["blocks_ms"]
        # Every matmul role and every wrapped block was seen: the timers reached the model.
        for role in ("qkv", "o_proj", "gate_up", "down_proj", "lm_head"):
            assert blocks[f"matmul.{role}"] > 0, (shape, role)
        for block in step_profile.BLOCKS:
            assert blocks[block] > 0, (shape, block)
        assert "matmul.other" not in blocks
        # The parts are the step: blocks + the model's rest + the engine around it.
        assert sum(blocks.values()) == pytest.approx(part["step_ms"], rel=0.02)
    assert results["decode_b1_ctx128"]["steps"] == 4
    prefill = results["prefill_after_prefix"]
    assert prefill["computed_tokens"] <= 12 + 16  # the cached prefix was not recomputed


def test_weight_bytes_follow_the_format(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    fp32 = step_profile.make_engine(str(model), 1, weights="fp32").model
    q8 = step_profile.make_engine(str(model), 1, weights="q8_0").model
    assert isinstance(q8.lm_head, Q8_0Linear)
    # int8 values plus one fp16 scale per 32: 34 bytes for fp32's 128.
    ratio = step_profile.weight_bytes_per_token(q8) / step_profile.weight_bytes_per_token(fp32)
    assert ratio == pytest.approx(34 / 128, rel=0.01)


def test_the_timers_come_off_after_the_profile(tmp_path):
    import once.engine.models.llama as llama

    model = make_tiny_model(tmp_path / "m")
    engine = step_profile.make_engine(str(model), 1)
    before = llama.linear
    with step_profile.BlockTimers(engine).installed():
        assert llama.linear is not before
    assert llama.linear is before and "forward" not in vars(engine.model)
