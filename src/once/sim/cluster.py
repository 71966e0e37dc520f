"""The cluster: a router policy in front of N simulated replicas, run as discrete events.

Events on a heap, ordered by (virtual time, sequence number): a request arrives (the policy
picks a replica from `ReplicaView`s built like the live router's, with the replica's exact
prefix match, as an index fed by KV events would give), or a replica's step ends (its
finished requests are recorded, a closed-loop session's next call is scheduled, the next
step is planned), or a request's load from a lower KV tier is in (the replica is woken as by
an arrival, so the request joins its next step), or, disaggregated (`once.sim.disagg.transfer`), a
decode leg's KV has arrived from its prefill replica. A step-end event carries the replica's
version; one that a later plan replaced is skipped. Nothing sleeps: a 30-minute trace runs
in seconds.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from once.kv_eviction.policies import eviction_factory
from once.router.disagg.split import SPLIT
from once.router.policies import Policy, ReplicaView, RequestView
from once.sim.disagg.transfer import KVLink, KVTransfer, PDConfig, PDStats, transfer_s_per_token
from once.sim.profiles import ReplicaProfile
from once.sim.replica import RequestState, SimReplica
from once.sim.tiers import TierConfig, build_tiers
from once.sim.workload import SimRequest

LOAD_DONE = -1  # in place of a step-end event's version (versions count up from 0)


@dataclass(frozen=True)
class Decision:
    request_id: str
    replica: int
    time_s: float
    prefill_replica: int | None = None  # disaggregated: where its prefill leg ran


@dataclass
class SimResult:
    states: list[RequestState]  # every request, in arrival order
    replicas: list[SimReplica]
    decisions: list[Decision]
    end_s: float
    pd: dict = field(default_factory=dict)  # disaggregated: PDStats.report(); else empty


class Cluster:
    def __init__(
        self,
        profiles: Sequence[ReplicaProfile],
        policy: Policy,
        *,
        seed: int = 0,
        kv_blocks: int | None = None,
        span_decodes: bool = True,
        eviction: str = "lru",  # the engines' own LRU; `once sim` defaults to DEFAULT_EVICTION
        tiers: TierConfig | None = None,  # KV tiers below each device pool; None: none
        pd: PDConfig | None = None,  # the first pd.num_prefill replicas serve prefill legs
    ):
        if not profiles:
            raise ValueError("a cluster needs at least one replica")
        if pd is not None:
            pd.check(len(profiles))
            split = replace(pd.split, transfer_s_per_token=transfer_s_per_token(profiles[0]))
            pd = replace(pd, split=split)
            profiles = pd.profiles(profiles)
        self.pd = pd
        self.pd_stats = PDStats()
        make_eviction = eviction_factory(eviction, seed)
        tiers = tiers or TierConfig()
        # One factory per tier, so an oracle policy's future is shared within a tier only.
        tier_factories = {
            "host": eviction_factory(tiers.host_eviction, seed + 1),
            "disk": eviction_factory(tiers.disk_eviction, seed + 2),
        }
        self.replicas = []
        for i, profile in enumerate(profiles):
            device_blocks = kv_blocks or profile.kv_blocks
            lower = build_tiers(profile, device_blocks, tiers, lambda t: tier_factories[t]())
            self.replicas.append(
                SimReplica(
                    i,
                    profile,
                    kv_blocks,
                    span_decodes=span_decodes,
                    eviction=make_eviction(),
                    tiers=lower,
                )
            )
        num_prefill = pd.num_prefill if pd is not None else 0
        for replica in self.replicas[:num_prefill]:
            replica.name = f"prefill-{replica.index}"
        self.links = [KVLink(replica.profile) for replica in self.replicas[:num_prefill]]
        self.policy = policy
        self.rng = random.Random(seed)
        # (time, sequence, payload): a request arriving, (replica index, version) of a
        # step ending, or a decode leg whose KV has arrived.
        self._events: list[tuple[float, int, SimRequest | RequestState | tuple[int, int]]] = []
        self._sequence = 0

    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        followers = {r.after: r for r in requests if r.after is not None}
        ids = {r.request_id for r in requests}
        missing = [r.after for r in requests if r.after is not None and r.after not in ids]
        if missing:
            raise ValueError(f"requests follow unknown request ids, e.g. {missing[0]!r}")
        for replica in self.replicas:
            replica.cache.policy.prepare(requests)  # only an oracle (Belady) looks
            for store in replica.tiers.stores if replica.tiers is not None else ():
                store.policy.prepare(requests)
        for request in requests:
            if request.after is None:
                self._push(request.arrival_s, request)
        states: list[RequestState] = []
        decisions: list[Decision] = []
        now = 0.0
        while self._events:
            now, _, payload = heapq.heappop(self._events)
            if isinstance(payload, SimRequest):
                state, prefill_index = self._route(payload, now)
                states.append(state)
                decisions.append(
                    Decision(state.request.request_id, state.replica, now, prefill_index)
                )
                if state.rejected:
                    self._follow(state, followers, now)
            elif isinstance(payload, RequestState):  # a decode leg, its KV transferred
                self.replicas[payload.replica].enqueue(payload)
                self._wake(self.replicas[payload.replica], now)
            else:
                replica_index, version = payload
                replica = self.replicas[replica_index]
                if version == LOAD_DONE:
                    self._wake(replica, now)
                    continue
                if version != replica.version:
                    continue  # superseded by a later plan
                for state in replica.finish_step(now):
                    if isinstance(state.transfer, KVTransfer):  # the cluster's own legs
                        self._hand_off(state.transfer, now)
                    else:
                        self._follow(state, followers, now)
                self._start(replica, now)
        report = self.pd_stats.report(self.links) if self.pd is not None else {}
        return SimResult(states, self.replicas, decisions, now, report)

    def views(self, request: SimRequest, now: float) -> list[ReplicaView]:
        return [self._view(replica, request, now) for replica in self.replicas]

    def _view(self, replica: SimReplica, request: SimRequest, now: float) -> ReplicaView:
        num_device = replica.cache.match_prefix(request.block_hashes)
        tier_blocks: tuple[int, ...] = ()
        tier_load_s = 0.0
        if replica.tiers is not None:
            counts = replica.tiers.match(request.block_hashes, num_device)
            tier_blocks, tier_load_s = tuple(counts), replica.tiers.load_s(counts)
        return ReplicaView(
            index=replica.index,
            name=replica.name,
            healthy=True,
            num_running=len(replica.running) + len(replica.waiting),
            num_queued_prefill_tokens=replica.num_queued_prefill_tokens(),
            num_decode_tokens=replica.num_decode_tokens(now),
            kv_blocks_used=replica.cache.num_used,
            kv_blocks_total=replica.cache.capacity,
            cached_prefix_blocks=num_device,
            prefill_tokens_per_s=replica.profile.prefill_tokens_per_s,
            decode_tokens_per_s=replica.profile.decode_tokens_per_s,
            tier_prefix_blocks=tier_blocks,
            tier_load_s=tier_load_s,
        )

    def _route(self, request: SimRequest, now: float) -> tuple[RequestState, int | None]:
        view = RequestView(
            request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            block_hashes=request.block_hashes,
            block_size=self.replicas[0].profile.block_size,
            session_key=request.session_key,
            max_output_tokens=request.num_output_tokens,
        )
        views = self.views(request, now)
        num_prefill = self.pd.num_prefill if self.pd is not None else 0
        chosen = self.policy.choose(view, views[num_prefill:], self.rng)
        replica = self.replicas[chosen]
        state = RequestState(request=request, arrival_s=now, replica=chosen)
        if not replica.fits(request):
            state.rejected = True  # longer than the replica's whole KV capacity
            state.finish_s = now
            return state, None
        if self.pd is not None:
            decision = self.pd.split.decide(view, views[chosen], views[:num_prefill], self.rng)
            self.pd_stats.decisions[decision.reason] += 1
            prefill_index = decision.prefill_index
            if decision.reason == SPLIT and prefill_index is not None:
                from_tokens = request.num_prompt_tokens - decision.num_uncached_tokens
                self._split(state, prefill_index, from_tokens, now)
                return state, prefill_index
        replica.enqueue(state)
        self._wake(replica, now)
        return state, None

    def _split(self, state: RequestState, prefill_index: int, from_tokens: int, now: float):
        # The decode leg waits off every queue until its KV is in (`_hand_off`).
        state.transferred = True
        request = replace(state.request, num_output_tokens=1)
        pull = self.pd is not None and self.pd.split.prefix_from_decode
        transfer = KVTransfer(state, self.links[prefill_index], from_tokens, pull)
        leg = RequestState(request, now, prefill_index, transfer=transfer)
        self.replicas[prefill_index].enqueue(leg)
        self._wake(self.replicas[prefill_index], now)

    def _hand_off(self, transfer: KVTransfer, now: float) -> None:
        ready_s = transfer.ready_s(now)
        self.pd_stats.transfer_wait_s.append(ready_s - now)
        self.pd_stats.num_transferred_tokens += max(0, transfer.sent_tokens - transfer.from_tokens)
        self.pd_stats.num_pulled_tokens += transfer.num_pulled_tokens
        self._push(ready_s, transfer.decode_state)

    def _wake(self, replica: SimReplica, now: float) -> None:
        # Something can join the replica's next step: start one if idle, else end a decode
        # span after the step in progress.
        if replica.plan is None:
            self._start(replica, now)
        else:
            end_s = replica.cut_span(now)
            if end_s is not None:
                self._push(end_s, (replica.index, replica.version))

    def _start(self, replica: SimReplica, now: float) -> None:
        end_s = replica.start_step(now)
        if end_s is not None:
            self._push(end_s, (replica.index, replica.version))
        pending = replica.wakeups + (replica.tiers.pending if replica.tiers is not None else [])
        for ready_s in pending:
            self._push(ready_s, (replica.index, LOAD_DONE))
        replica.wakeups.clear()
        if replica.tiers is not None:
            replica.tiers.pending.clear()

    def _follow(self, state: RequestState, followers: dict, now: float) -> None:
        follower = followers.get(state.request.request_id)
        if follower is not None:
            self._push(now + follower.think_s, follower)

    def _push(self, time_s: float, payload: SimRequest | RequestState | tuple[int, int]) -> None:
        self._sequence += 1
        heapq.heappush(self._events, (time_s, self._sequence, payload))
