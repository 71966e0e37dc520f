import json
import random

import pytest

from once.kv_eviction.base import LRU
from once.kv_eviction.policies import EVICTION_POLICIES
from once.sim import main
from once.sim.cluster import Cluster
from once.sim.profiles import load_profile
from once.sim.tiers import TierConfig, TierStore
from tests.sim.conftest import RoundRobinStandIn, make_profile, make_request
from tests.sim.test_cli import _mooncake_file

# 1 MB blocks over 1 GB/s: 1 ms a block from host memory, 10 ms from disk.
TIERED = dict(
    kv_bytes_per_block=1_000_000,
    host_bandwidth_bytes_per_s=1e9,
    host_load_latency_s=5e-4,
    disk_bandwidth_bytes_per_s=1e8,
    disk_load_latency_s=2e-3,
)


def tiered_profile(**overrides):
    return make_profile(**{**TIERED, **overrides})


def test_a_block_evicted_from_the_device_is_loaded_from_host_not_recomputed():
    profile = tiered_profile(kv_blocks=8)
    requests = [
        make_request("a", 0.0, (1, 2, 3, 4)),  # 4 prompt blocks + 1 output block
        make_request("b", 10.0, (11, 12, 13, 14)),
        make_request("c", 20.0, (21, 22, 23, 24)),  # pushes a's blocks off the device
        make_request("again", 30.0, (1, 2, 3, 4, 5)),
    ]
    cluster = Cluster([profile], RoundRobinStandIn(), tiers=TierConfig(host_ratio=1.0))
    result = cluster.run(requests)
    again = result.states[-1]
    assert again.num_device_cached_tokens == 0
    assert again.num_cached_tokens == 4 * 16  # a's four blocks, loaded
    host = result.replicas[0].tiers.top
    assert host.stats.num_hit_blocks == 4 and host.stats.num_hit_tokens == 64
    # Only the fifth block was prefilled for "again".
    without = Cluster([profile], RoundRobinStandIn()).run(requests)
    assert without.states[-1].num_cached_tokens == 0
    assert without.replicas[0].num_prefilled_tokens - result.replicas[0].num_prefilled_tokens == 64


def test_host_evictions_are_written_to_disk_and_disk_drops_its_own():
    disk = TierStore("disk", 2, LRU(), 1e8, 0.0)
    host = TierStore("host", 2, LRU(), 1e9, 0.0, below=disk)
    for block_hash in (1, 2, 3, 4):
        host.put(block_hash, (None, 0, False), now=float(block_hash))
    assert set(host.lineage) == {3, 4} and set(disk.lineage) == {1, 2}
    host.touch(3, now=5.0)  # 4 is now host's least recent
    host.put(5, (None, 0, False), now=6.0)
    assert set(host.lineage) == {3, 5} and set(disk.lineage) == {2, 4}
    assert disk.stats.num_evictions == 1 and host.stats.num_evictions == 3


@pytest.mark.parametrize("tier_eviction", EVICTION_POLICIES)
def test_device_host_and_disk_never_exceed_their_capacities(monkeypatch, tier_eviction):
    profile = tiered_profile(kv_blocks=12)
    rng = random.Random(7)
    requests, conversations, next_hash = [], [], 1000
    for i in range(150):
        if conversations and rng.random() < 0.7:
            hashes = rng.choice(conversations)
            hashes.extend(range(next_hash, next_hash + 2))
            next_hash += 2
        else:
            hashes = [rng.randrange(3), *range(next_hash, next_hash + 2)]
            next_hash += 2
            conversations.append(hashes)
        requests.append(make_request(f"r{i}", i * 0.05, tuple(hashes[:10]), num_output=3))
    tiers = TierConfig(1.0, 2.0, host_eviction=tier_eviction, disk_eviction=tier_eviction)
    cluster = Cluster([profile] * 2, RoundRobinStandIn(), eviction="lfu-da", tiers=tiers)
    overflows = []
    put, start = TierStore.put, cluster._start

    def checked_put(store, block_hash, lineage, now):
        put(store, block_hash, lineage, now)
        if len(store) > store.capacity or len(store.policy) != len(store):
            overflows.append((store.name, len(store), len(store.policy)))

    def checked_start(replica, now):  # after every admission, publish and release
        start(replica, now)
        if replica.cache.num_used + len(replica.cache.policy) > replica.cache.capacity:
            overflows.append(("device", replica.cache.num_used))

    monkeypatch.setattr(TierStore, "put", checked_put)
    monkeypatch.setattr(cluster, "_start", checked_start)
    result = cluster.run(requests)
    assert not overflows
    stores = [s for r in result.replicas for s in r.tiers.stores]
    assert [s.capacity for s in stores] == [12, 24, 12, 24]
    assert sum(s.stats.num_hit_blocks for s in stores) > 0
    assert any(s.name == "disk" and s.stats.num_writes for s in stores)
    for replica in result.replicas:
        tier_tokens = sum(s.stats.num_hit_tokens for s in replica.tiers.stores)
        assert replica.num_cached_tokens == replica.num_device_cached_tokens + tier_tokens


def test_a_load_delays_the_first_token_by_bytes_over_bandwidth_plus_latency():
    profile = tiered_profile(kv_blocks=16)
    cluster = Cluster([profile], RoundRobinStandIn(), tiers=TierConfig(1.0, 1.0))
    host, disk = cluster.replicas[0].tiers.stores
    for depth, block_hash in enumerate((1, 2, 3)):
        host.put(block_hash, (block_hash - 1 or None, depth, False), now=0.0)
    disk.put(4, (3, 3, False), now=0.0)
    request = make_request("r", 1.0, (1, 2, 3, 4, 5), num_output=1)  # 80 prompt tokens
    (state,) = cluster.run([request]).states
    load_s = (5e-4 + 3 * 1_000_000 / 1e9) + (2e-3 + 1_000_000 / 1e8)
    assert state.ready_s - 1.0 == pytest.approx(load_s, rel=1e-12)
    # After the load, one step prefills the 16 uncached tokens after 64 loaded ones.
    ttft_s = load_s + profile.step_base_s + profile.prefill_s(16, 64)
    assert state.first_token_s - 1.0 == pytest.approx(ttft_s, rel=1e-12)
    assert host.stats.num_loaded_bytes == 3_000_000 and disk.stats.num_loaded_bytes == 1_000_000


def test_the_step_loop_does_not_wait_for_a_load():
    # A decoding request keeps its steps going while another waits for its load.
    profile = tiered_profile(kv_blocks=32, host_load_latency_s=0.05)
    cluster = Cluster([profile], RoundRobinStandIn(), tiers=TierConfig(1.0))
    cluster.replicas[0].tiers.top.put(7, (None, 0, False), now=0.0)
    busy = make_request("busy", 0.0, (1,), num_output=200)
    loading = make_request("loading", 0.1, (7, 8), num_output=2)
    states = {s.request.request_id: s for s in cluster.run([busy, loading]).states}
    assert states["loading"].first_token_s >= states["loading"].ready_s
    alone = Cluster([profile], RoundRobinStandIn()).run([busy]).states[0]
    # busy's decode is slowed by sharing steps, never stalled for the 51 ms load.
    assert states["busy"].finish_s - alone.finish_s < 0.05


def _report(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_ratio_zero_reproduces_the_results_from_before_tiers(tmp_path, capsys):
    path = _mooncake_file(tmp_path)
    argv = ["--trace-path", str(path), "--replicas", "3", "--load", "0.7", "--kv-blocks", "12"]
    argv += ["--json", "--policies", "once", "round_robin"]
    plain = _report(capsys, argv)
    zero = _report(capsys, [*argv, "--host-tier-ratio", "0", "--disk-tier-ratio", "0"])
    assert zero == plain
    rows = {row["policy"]: row for row in plain["policies"]}
    # Measured with the simulator as it was before tiers (commit 20479f7).
    assert rows["once"]["hit_ratio"] == 0.22972972972972974
    assert rows["once"]["ttft_p90_s"] == 2.659162874093643
    assert rows["once"]["prefilled_tokens"] == 204288
    assert rows["round_robin"]["ttft_p90_s"] == 3.0872246286197536
    assert rows["round_robin"]["kv_evictions"] == 408
    assert "tiers" not in rows["once"] and "tier_ttft_p90_ratio" not in plain


def test_the_report_compares_once_with_and_without_tiers(tmp_path, capsys):
    path = _mooncake_file(tmp_path)
    argv = ["--trace-path", str(path), "--replicas", "3", "--load", "0.7", "--kv-blocks", "12"]
    report = _report(capsys, [*argv, "--json", "--policies", "once", "--host-tier-ratio", "4"])
    once = report["policies"][0]
    assert report["ttft_p90_s_tiers"] == once["ttft_p90_s"]
    assert report["tier_ttft_p90_ratio"] == pytest.approx(
        report["ttft_p90_s_tiers"] / report["ttft_p90_s_no_tiers"]
    )
    assert report["ttft_p90_s_no_tiers"] == report["once_no_tiers"]["ttft_p90_s"]
    assert once["hit_ratio"] > once["device_hit_ratio"]
    assert once["hit_ratio"] > report["hit_ratio_no_tiers"]
    assert report["hit_ratio_vs_bound"] == pytest.approx(
        once["hit_ratio"] / once["hit_ratio_bound"]
    )
    host = once["tiers"]["host"]
    assert host["capacity_blocks_per_replica"] == 48
    assert host["loaded_bytes"] == host["hit_blocks"] * report["kv_block_bytes"]
    assert 0 < host["hit_tokens"] <= host["hit_blocks"] * 512
    assert host["load_s"] == pytest.approx(
        host["num_loads"] * 5e-4 + host["loaded_bytes"] / 50e9
    )  # the H200 profile's host tier


def test_the_h200_profile_sizes_a_block_from_the_model_shape():
    profile = load_profile()
    assert profile.kv_block_bytes == 2 * 32 * 8 * 128 * 2 * 512  # 64 MiB
    with pytest.raises(ValueError, match="kv_bytes_per_block"):
        _ = make_profile().kv_block_bytes
    with pytest.raises(ValueError, match="host_bandwidth"):
        make_profile(host_bandwidth_bytes_per_s=-1.0)


def test_a_tier_without_bandwidth_or_a_disk_without_host_is_refused(tmp_path, capsys):
    path = _mooncake_file(tmp_path, num=10)
    base = ["--trace-path", str(path), "--policies", "once"]
    assert main([*base, "--profile", "cpu-once-smollm2", "--host-tier-ratio", "1"]) == 2
    assert "bandwidth" in capsys.readouterr().err
    assert main([*base, "--disk-tier-ratio", "1"]) == 2
    assert "host tier" in capsys.readouterr().err
