import random

import pytest

from once.sim.profiles import ReplicaProfile
from once.sim.workload import SimRequest


def make_profile(**overrides) -> ReplicaProfile:
    values = dict(
        name="test",
        description="round numbers for exact checks",
        step_base_s=0.01,
        decode_per_seq_s=0.001,
        decode_per_context_token_s=1e-6,
        prefill_per_token_s=1e-4,
        prefill_attention_s_per_pair=1e-8,
        max_num_batched_tokens=1024,
        max_num_seqs=16,
        block_size=16,
        kv_blocks=64,
        ttft_slo_s=1.0,
        tpot_slo_s=0.05,
    )
    values.update(overrides)
    return ReplicaProfile(**values)


def make_request(
    request_id: str,
    arrival_s: float,
    hashes: tuple[int, ...],
    num_output: int = 4,
    num_prompt: int | None = None,
    **extra,
) -> SimRequest:
    num_prompt = num_prompt if num_prompt is not None else 16 * len(hashes)
    return SimRequest(request_id, arrival_s, num_prompt, num_output, hashes, **extra)


class RoundRobinStandIn:
    """A local stand-in policy, so the simulator is tested apart from router/policies.py."""

    name = "rr-stand-in"

    def __init__(self):
        self.next = 0

    def choose(self, request, replicas, rng: random.Random) -> int:
        chosen = replicas[self.next % len(replicas)].index
        self.next += 1
        return chosen


@pytest.fixture
def profile() -> ReplicaProfile:
    return make_profile()
