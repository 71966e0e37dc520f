"""Prefill/decode disaggregation in the simulator: a prefill pool, a decode pool, the link.

    request --router--> decode replica chosen by the policy (decode pool)
                |
                +-- SplitPolicy says split --> prefill replica: prefill leg (1 token)
                                                 | each chunk's KV, as it is computed
                                                 v
                                               link (the prefill replica's NIC)
                                                 |
                                  decode leg <---+ when the last byte is in + latency

The first `num_prefill` replicas of a cluster serve prefill legs only; the others serve
decode legs and, for requests the split policy keeps home, colocated requests as before.
A prefill leg is the request with one output token. After each of its chunks, the tokens
computed past the decode replica's cached prefix go onto the link, which sends one
transfer after another at the profile's bandwidth: the transfer of a chunk overlaps the
computation of the next (pipelined), and only the last chunk's bytes and the fixed latency
are added after the prefill ends. The decode leg then joins its replica's queue with its
prompt in KV but the last token, which it computes in the step that makes the first output
token (as vLLM's decode instance does). The blocks the decode replica already held when the
request was routed are not sent. With `SplitPolicy.prefix_from_decode`, a prefill leg whose
replica lacks part of that prefix fetches it (from a store both sides share, as Mooncake's
and SGLang HiCache's prefill instances do) at the link's rate and waits for it like a tier
load, instead of recomputing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from once.router.disagg.split import DECISIONS, SplitPolicy
from once.sim.profiles import ReplicaProfile
from once.sim.replica import RequestState


@dataclass(frozen=True)
class PDConfig:
    num_prefill: int
    split: SplitPolicy = field(default_factory=SplitPolicy)
    # The decode replicas' token budget per step (None: the profile's). A decode instance
    # runs small steps so that the prefills it keeps (the short ones, or all of them while
    # the prefill pool is backed up) cost its decodes little, as PD deployments tune them.
    decode_max_batched_tokens: int | None = None

    def profiles(self, profiles: Sequence[ReplicaProfile]) -> list[ReplicaProfile]:
        """The cluster's profiles with the decode replicas' step budget applied."""
        budget = self.decode_max_batched_tokens
        decode = [p.with_overrides(max_num_batched_tokens=budget) if budget else p
                  for p in profiles[self.num_prefill :]]  # fmt: skip
        return [*profiles[: self.num_prefill], *decode]

    def check(self, num_replicas: int) -> None:
        if not 1 <= self.num_prefill < num_replicas:
            raise ValueError(
                f"a P:D split needs 1 <= prefill replicas < {num_replicas}, got {self.num_prefill}"
            )


def transfer_s_per_token(profile: ReplicaProfile) -> float:
    if not profile.transfer_bandwidth_bytes_per_s:
        raise ValueError(f"profile {profile.name!r} has no transfer_bandwidth_bytes_per_s for --pd")
    return profile.kv_block_bytes / profile.block_size / profile.transfer_bandwidth_bytes_per_s


class KVLink:
    """One prefill replica's outgoing link: transfers go one after another."""

    def __init__(self, profile: ReplicaProfile):
        self.bytes_per_token = profile.kv_block_bytes / profile.block_size
        self.bandwidth = profile.transfer_bandwidth_bytes_per_s
        self.latency_s = profile.transfer_latency_s
        self.free_s = 0.0
        self.num_bytes = 0
        self.busy_s = 0.0

    def send(self, num_tokens: int, now: float) -> float:
        """Queue `num_tokens` of KV at `now`; returns when their last byte is sent."""
        num_bytes = int(num_tokens * self.bytes_per_token)
        duration_s = num_bytes / self.bandwidth
        self.free_s = max(self.free_s, now) + duration_s
        self.num_bytes += num_bytes
        self.busy_s += duration_s
        return self.free_s


@dataclass
class KVTransfer:
    """A prefill leg's KV on its way to `decode_state`'s replica."""

    decode_state: RequestState
    link: KVLink
    from_tokens: int  # the decode replica holds the prompt up to here
    pull_prefix: bool = False  # the prefill leg fetches the decode side's prefix it lacks
    sent_tokens: int = 0
    sent_s: float = 0.0
    started_s: float | None = None
    num_pulled_tokens: int = 0

    def pull_s(self, num_tokens: int) -> float:
        """Time to fetch `num_tokens` of prefix KV into the prefill replica (the link's other
        direction, so it does not queue behind outgoing transfers)."""
        self.num_pulled_tokens += num_tokens
        link = self.link
        return num_tokens * link.bytes_per_token / link.bandwidth + link.latency_s

    def send(self, num_computed: int, now: float) -> None:
        start = max(self.from_tokens, self.sent_tokens)
        if num_computed <= start:
            return
        if self.started_s is None:
            self.started_s = now
        self.sent_s = self.link.send(num_computed - start, now)
        self.sent_tokens = num_computed

    def ready_s(self, prefill_end_s: float) -> float:
        return max(prefill_end_s, self.sent_s) + self.link.latency_s


@dataclass
class PDStats:
    decisions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DECISIONS, 0))
    num_transferred_tokens: int = 0
    num_pulled_tokens: int = 0
    transfer_wait_s: list[float] = field(default_factory=list)  # prefill end -> decode ready

    def report(self, links: list[KVLink]) -> dict:
        waits = sorted(self.transfer_wait_s)
        return {
            "decisions": dict(self.decisions),
            "num_split": self.decisions["split"],
            "transferred_bytes": sum(link.num_bytes for link in links),
            "transferred_tokens": self.num_transferred_tokens,
            "pulled_prefix_tokens": self.num_pulled_tokens,
            "link_busy_s": sum(link.busy_s for link in links),
            "mean_transfer_wait_s": sum(waits) / len(waits) if waits else 0.0,
            "max_transfer_wait_s": waits[-1] if waits else 0.0,
        }
