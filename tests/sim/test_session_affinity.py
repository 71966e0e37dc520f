"""session_affinity in the simulator (issue 32 item 4): it came out identical to
least_loaded on every figure of the Mooncake trace. The trace has no session keys, and a
request without one falls back to the same least-loaded pick (same rng draws), so the two
are one policy there; on sessions with keys they must differ."""

from once.router.policies import make_policy
from once.sim.cluster import Cluster
from tests.sim.conftest import make_profile, make_request


def _sessions(keyed: bool):
    # 4 sessions of 3 calls each, overlapping in time: each call extends its session's
    # previous prompt; sessions share nothing.
    requests = []
    for session in range(4):
        for call in range(3):
            hashes = tuple(1000 * session + block for block in range(call + 2))
            extra = {"session_key": f"s{session}"} if keyed else {}
            arrival = 0.05 * session + 0.5 * call
            requests.append(make_request(f"s{session}#{call}", arrival, hashes, **extra))
    return requests


def _replicas_per_session(policy: str, keyed: bool):
    profile = make_profile()
    result = Cluster([profile] * 3, make_policy(policy), seed=7).run(_sessions(keyed))
    homes: dict[str, set[int]] = {}
    for state in result.states:
        homes.setdefault(state.request.request_id.split("#")[0], set()).add(state.replica)
    return homes, [s.replica for s in sorted(result.states, key=lambda s: s.request.request_id)]


def test_with_session_keys_every_session_stays_on_one_replica():
    homes, _ = _replicas_per_session("session_affinity", keyed=True)
    assert all(len(replicas) == 1 for replicas in homes.values())


def test_least_loaded_moves_sessions_that_session_affinity_keeps():
    affinity, affinity_picks = _replicas_per_session("session_affinity", keyed=True)
    spread, least_loaded_picks = _replicas_per_session("least_loaded", keyed=True)
    assert any(len(replicas) > 1 for replicas in spread.values())
    assert affinity_picks != least_loaded_picks


def test_without_session_keys_the_two_policies_are_the_same_policy():
    _, affinity_picks = _replicas_per_session("session_affinity", keyed=False)
    _, least_loaded_picks = _replicas_per_session("least_loaded", keyed=False)
    assert affinity_picks == least_loaded_picks
