"""The CPU kernels' build leaves the process's floating-point state alone."""

import pytest

from once.engine.kernels import load_cpu_kernels

SMALLEST_NORMAL = float.fromhex("0x1p-1022")


def test_loading_the_kernels_keeps_subnormal_floats():
    if load_cpu_kernels() is None:
        pytest.skip("no C compiler: the pure-torch paths run")
    # With flush-to-zero set (crtfastmath.o's constructor), this halving would give 0.0.
    assert SMALLEST_NORMAL / 2 > 0.0
    assert SMALLEST_NORMAL / 2 * 2 == SMALLEST_NORMAL
