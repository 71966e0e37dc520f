"""The engine throttle (`EngineConfig.slowdown`): a replica that runs at 1/slowdown speed.

Timing the steps would make a flaky test; instead the clock and the sleep are injected and
the test checks that each step asks for the sleep that makes it `slowdown` times longer.
"""

import itertools

import pytest

from once.cli import _add_engine_flags, _engine_config
from once.engine.async_engine import AsyncEngine
from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.protocol.engine import GenerateRequest, SamplingParams


class FakeClock:
    """Each reading is `tick` seconds after the previous one: every step 'takes' one tick."""

    def __init__(self, tick: float):
        self._readings = itertools.count()
        self.tick = tick

    def __call__(self) -> float:
        return next(self._readings) * self.tick


async def _run_one(engine: AsyncEngine, max_tokens: int) -> list:
    request = GenerateRequest(
        "r", (3, 4, 5, 6, 7), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    )
    return [delta async for delta in engine.generate(request)]


@pytest.mark.parametrize("slowdown", [1.0, 3.0])
async def test_each_step_sleeps_slowdown_minus_one_times_its_wall_time(tiny_model_dir, slowdown):
    config = EngineConfig(
        model=str(tiny_model_dir), block_size=4, num_kv_blocks=64, slowdown=slowdown
    )
    sleeps: list[float] = []
    engine = AsyncEngine(LLMEngine(config), sleep=sleeps.append, clock=FakeClock(0.25))
    try:
        deltas = await _run_one(engine, max_tokens=6)
        stats = await engine.stats()
    finally:
        await engine.close()
    assert sum(len(d.token_ids) for d in deltas) == 6
    if slowdown == 1.0:
        assert sleeps == [] and stats["throttle_sleep_s"] == 0.0
        return
    # One prefill step and a decode step per further token, each (3 - 1) x 0.25 s.
    assert len(sleeps) >= 6
    assert sleeps == pytest.approx([0.5] * len(sleeps))
    assert stats["throttle_sleep_s"] == pytest.approx(0.5 * len(sleeps))
    assert stats["slowdown"] == 3.0


@pytest.mark.parametrize("bad", [0.5, 0.0, -1.0, float("nan"), float("inf")])
def test_slowdown_below_one_or_not_finite_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="slowdown must be a finite number >= 1.0"):
        EngineConfig(slowdown=bad)


def test_slowdown_from_env_and_flag(monkeypatch):
    import argparse

    monkeypatch.setenv("ONCE_ENGINE_SLOWDOWN", "2.5")
    assert EngineConfig.from_env().slowdown == 2.5
    parser = argparse.ArgumentParser()
    _add_engine_flags(parser)
    assert _engine_config(parser.parse_args([])).slowdown == 2.5  # the env var holds
    assert _engine_config(parser.parse_args(["--slowdown", "2"])).slowdown == 2.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--slowdown", "0.5"])


@pytest.mark.parametrize(
    "name, value", [("ONCE_ENGINE_CPU_GEMM", "blas"), ("ONCE_ENGINE_SLOWDOWN", "0.5"),
                    ("ONCE_ENGINE_MAX_NUM_SEQS", "many")],
)  # fmt: skip
def test_a_bad_engine_setting_in_the_environment_is_a_one_line_error(monkeypatch, name, value):
    import argparse

    monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    _add_engine_flags(parser)
    with pytest.raises(SystemExit, match="once: error: bad engine setting") as error:
        _engine_config(parser.parse_args([]))
    assert value in str(error.value)
