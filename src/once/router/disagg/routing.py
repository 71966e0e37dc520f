"""The router's disaggregated path: a prefill leg on a prefill replica, then the decode.

With replicas of role "prefill" among its replicas, the router routes every request to a
decode replica (role "decode" or "both") with its policy, as without them, and then asks
the split policy (`once.router.disagg.split`, shared with the simulator) whether the request
goes through a prefill replica first. If it does:

1. the prefill leg: the same prompt to the prefill replica with one output token and
   `kv_transfer_params = {"do_remote_decode": true, ...}` (vLLM's proxy protocol, which
   once's engines speak too); its last delta carries the params the decode side needs;
2. the decode: the request as it came, with those params, to the decode replica, which
   loads the prompt's KV instead of computing it and streams the whole output.

The client sees only the decode replica's stream (the prefill leg's token is made again,
identically, by the decode side). A prefill leg that fails, or ends without params, is
counted and the request goes to the decode replica unsplit: it computes the prompt itself.
"""

import contextlib
import random
import time
from collections import deque
from dataclasses import replace

from once.protocol.engine import GenerateRequest
from once.router.disagg.split import DECISIONS, SPLIT, SplitPolicy
from once.router.policies import ReplicaView, RequestView
from once.router.replicas import ReplicaFailure

PREFILL_SUFFIX = ":prefill"
MAX_SPLIT_IDS = 100_000
# vLLM's toy proxy sends these keys, the remote_* ones empty, on the prefill request.
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_leg(request: GenerateRequest) -> GenerateRequest:
    forced = request.forced_output_ids
    return replace(
        request,
        request_id=request.request_id + PREFILL_SUFFIX,
        sampling=replace(request.sampling, max_tokens=1),
        forced_output_ids=None if forced is None else forced[:1],
        kv_transfer_params=dict(PREFILL_PARAMS),
    )


class Disaggregation:
    def __init__(self, split: SplitPolicy):
        self.split = split
        self.decisions = dict.fromkeys(DECISIONS, 0)
        self.counters = {
            "num_prefill_legs": 0,
            "num_prefill_failures": 0,  # the leg failed or gave no params: computed unsplit
            "num_split_prompt_tokens": 0,
            "num_uncached_split_tokens": 0,  # what the decode replicas did not compute
            "prefill_leg_s": 0.0,
        }
        self.last_pair: tuple[str, str] | None = None  # (prefill, decode) replica names
        self.split_request_ids: deque[str] = deque(maxlen=MAX_SPLIT_IDS)  # the newest
        self.pairs: dict[str, int] = {}  # "prefill->decode" replica names -> split requests

    def decide(
        self,
        request: RequestView,
        decode: ReplicaView,
        prefills: list[ReplicaView],
        rng: random.Random,
    ):
        decision = self.split.decide(request, decode, prefills, rng)
        self.decisions[decision.reason] += 1
        return decision

    async def run_prefill(self, router, replica, request: GenerateRequest, hashes) -> dict | None:
        """The prefill leg on `replica`; the params for the decode call, None on failure."""
        self.counters["num_prefill_legs"] += 1
        started = time.monotonic()
        params = None
        with contextlib.suppress(ReplicaFailure):
            async with contextlib.aclosing(
                router._stream_from(replica, prefill_leg(request), hashes)
            ) as stream:
                async for delta in stream:
                    if delta.finished and delta.error is None:
                        params = delta.kv_transfer_params
        self.counters["prefill_leg_s"] += time.monotonic() - started
        if not params:
            self.counters["num_prefill_failures"] += 1
            return None
        return params

    def record_split(self, prefill_name: str, decode_name: str, request, uncached: int) -> None:
        self.last_pair = (prefill_name, decode_name)
        self.split_request_ids.append(request.request_id)
        pair = f"{prefill_name}->{decode_name}"
        self.pairs[pair] = self.pairs.get(pair, 0) + 1
        self.counters["num_split_prompt_tokens"] += len(request.prompt_token_ids)
        self.counters["num_uncached_split_tokens"] += uncached

    def stats(self) -> dict:
        return {
            "decisions": dict(self.decisions),
            **self.counters,
            "last_pair": list(self.last_pair) if self.last_pair else None,
            "pairs": dict(self.pairs),  # numeric, so /metrics exports one gauge per pair
        }


__all__ = ["SPLIT", "Disaggregation", "prefill_leg"]
