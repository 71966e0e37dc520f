import json
from pathlib import Path

import pytest

from once.sim.calibrate import fit_cpu_profile
from once.sim.profiles import CPU_PROFILE, DEFAULT_PROFILE, load_profile, load_profiles
from tests.sim.conftest import make_profile

_BENCH = Path(__file__).resolve().parents[2] / "results" / "bench_engine.json"


def test_shipped_profiles_load_within_the_kv_cap():
    profiles = load_profiles()
    assert {DEFAULT_PROFILE, CPU_PROFILE} <= set(profiles)
    for profile in profiles.values():
        assert profile.kv_blocks * profile.block_size <= 2000 * 512
        assert profile.prefill_tokens_per_s > 0 and profile.decode_tokens_per_s > 0
    h200, cpu = profiles[DEFAULT_PROFILE], profiles[CPU_PROFILE]
    assert h200.prefill_tokens_per_s > 50 * cpu.prefill_tokens_per_s


def test_cpu_profile_is_the_fit_of_the_engine_benchmark():
    if not _BENCH.exists():
        pytest.skip("no results/bench_engine.json")
    fitted = fit_cpu_profile(json.loads(_BENCH.read_text()))
    profile = load_profile(CPU_PROFILE)
    for name, value in fitted.items():
        assert getattr(profile, name) == pytest.approx(value, rel=0.01), name
    # and the fit reproduces the measured 8,000-token prefill within 5%
    bench = json.loads(_BENCH.read_text())
    steps = -(-8000 // profile.max_num_batched_tokens)
    predicted = profile.prefill_s(8000, 0) + steps * profile.step_base_s
    assert predicted == pytest.approx(bench["once"]["long_context"]["prefill_s"], rel=0.05)


def test_attention_makes_a_prefill_after_a_long_context_dearer():
    profile = make_profile()
    assert profile.prefill_s(100, 5000) > profile.prefill_s(100, 0)
    assert profile.prefill_s(100, 0) == pytest.approx(100 * 1e-4 + 100 * 50.5 * 1e-8)


def test_bad_profiles_are_refused():
    with pytest.raises(ValueError, match="exceed the cap"):
        make_profile(kv_blocks=2001, block_size=512)
    with pytest.raises(ValueError, match="must be > 0"):
        make_profile(step_base_s=0.0)
    with pytest.raises(ValueError, match="unknown replica profile"):
        load_profile("tpu-v9")
    with pytest.raises(ValueError, match="bad profiles TOML"):
        load_profiles("[x\n")
    with pytest.raises(ValueError, match="profile 'x'"):
        load_profiles("[x]\nspeed = 1\n")
    with pytest.raises(ValueError, match="unknown profile fields"):
        make_profile().with_overrides(warp_speed=9)
