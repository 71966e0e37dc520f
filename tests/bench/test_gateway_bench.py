"""The gateway benchmark's added-time percentiles, read from a Prometheus histogram."""

import math

import pytest

from once.bench.gateway_bench.overhead import histogram_quantile

INF = float("inf")


def test_quantiles_interpolate_within_the_bucket_they_fall_in():
    # 10 observations: 4 up to 1 ms, 5 more up to 2 ms, 1 more up to 5 ms.
    buckets = {0.001: 4, 0.002: 9, 0.005: 10, INF: 10}
    assert histogram_quantile(buckets, 0.2) == pytest.approx(0.0005)  # 2 of the first 4
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.0012)  # 1 of the next 5
    assert histogram_quantile(buckets, 0.99) == pytest.approx(0.002 + 0.003 * 0.9)


def test_quantiles_are_never_below_zero_and_stop_at_the_last_finite_bound():
    assert histogram_quantile({0.001: 0, 0.002: 0, INF: 3}, 0.5) == 0.002
    assert histogram_quantile({0.001: 5, INF: 5}, 0.0) == 0.0
    assert math.isnan(histogram_quantile({0.001: 0, INF: 0}, 0.5))
