"""One replay, two runs: the live router and the simulator, for checking that they agree.

The same policy code decides in both (router/policies.py), so with the same inputs and the
same seed they must take the same decisions in the same order. This module builds one
small replay (conversations with shared prefixes, one call at a time) in both forms - the
`GenerateRequest`s the router takes and the `SimRequest`s the simulator takes, with the
router's own chained block hashes - and runs each side to a list of (request id, replica
name) decisions.

Where the two sides differ by definition, the replay is built so that the difference does
not show, and `check_alignable` refuses a replay where it would:

- Cached prefix. The router counts at most (prompt - 1) // block_size blocks (the engine
  always computes the last prompt token); the simulator counts every matched full block.
  They agree when no prompt is a whole number of blocks.
- Output blocks. The router (and a real engine) caches the blocks filled by a request's
  output; the simulator publishes only the prompt's blocks. They agree when no output
  completes a block: prompt % block_size + outputs - 1 < block_size.
- Load. The router counts what it sent and has not seen finish; the simulator knows where
  each request is on its virtual clock. In the sequential mode calls are issued one after
  another (each after the previous one finished, a single closed loop in the simulator), so
  every decision sees an idle cluster on both sides. In the wave mode a wave of calls is
  in flight at once (the simulator: arrivals at the same instant; live: the engines hold
  the first token until the whole wave is routed). Both sides then count the same
  requests in flight, the same decode tokens, and the same queued prefill tokens as long
  as no call hits the cache: the simulator counts a waiting request's prompt whole, the
  router its uncached part. The KV blocks in use differ (the simulator counts blocks
  admitted, shared ones once; the router every in-flight request's blocks), so the wave
  mode suits the policies that read only load: round_robin, least_loaded, power_of_two,
  session_affinity, and once without its decode term - with prompts that share nothing
  (`unique_prompt_waves`).
- Speed. The router measures each replica's prefill speed; the simulator reads it from the
  profile. `pin_prefill_speed` replaces the router's measurement with the profile's
  number (measurement noise is not a policy difference). Decode speed is not aligned (the
  router: measured per-stream speed times streams in flight; the simulator: the profile's
  32-sequence throughput): with nothing in flight no policy reads it; under load once
  reads it, so the wave test runs once with decode_weight=0.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from once.protocol.engine import GenerateRequest, SamplingParams
from once.protocol.kv_blocks import block_hashes
from once.router.policies import Policy
from once.router.replicas import PrefillSpeedMeter, Replica
from once.router.router import Router
from once.sim.cluster import Cluster
from once.sim.profiles import ReplicaProfile
from once.sim.workload import SimRequest


@dataclass(frozen=True)
class ReplayCall:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # forced in the live run, counted in the simulator
    session_key: str | None = None


def conversation_replay(
    num_conversations: int = 5,
    num_turns: int = 3,
    *,
    block_size: int = 16,
    num_output_tokens: int = 4,
    seed: int = 0,
) -> list[ReplayCall]:
    """Conversations interleaved turn by turn (c0 t0, c1 t0, ..., c0 t1, ...).

    Every prompt starts with one shared system block; conversations in pairs share three
    more "tool" blocks; each turn appends the previous output and a new user message.
    User messages are sized so that every prompt ends 1 to block_size - num_output_tokens
    tokens past a block boundary: the outputs then fit in its partial block (module doc).
    """
    if num_conversations < 1 or num_turns < 1:
        raise ValueError("num_conversations and num_turns must be >= 1")
    if not 1 <= num_output_tokens < block_size:
        raise ValueError("num_output_tokens must be in [1, block_size)")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 32_000) for _ in range(n)]

    system = tokens(block_size)
    tool_sets = [tokens(3 * block_size) for _ in range((num_conversations + 1) // 2)]
    histories = [system + tool_sets[c // 2] for c in range(num_conversations)]
    calls: list[ReplayCall] = []
    for turn in range(num_turns):
        for conversation, history in enumerate(histories):
            # A user message of one to three blocks, cut so that the prompt ends `target`
            # tokens past a block boundary.
            target = rng.randint(1, block_size - num_output_tokens)
            remainder = len(history) % block_size
            num_user = rng.randint(1, 3) * block_size + (target - remainder) % block_size
            history.extend(tokens(num_user))
            output = tuple(tokens(num_output_tokens))
            calls.append(
                ReplayCall(
                    request_id=f"conv{conversation}-turn{turn}",
                    prompt_token_ids=tuple(history),
                    output_token_ids=output,
                    session_key=f"conv{conversation}",
                )
            )
            history.extend(output)
    check_alignable(calls, block_size)
    return calls


def check_alignable(calls: Sequence[ReplayCall], block_size: int) -> None:
    """Raise ValueError naming the first call where router and simulator differ by
    definition (a whole-block prompt, or an output that completes a block)."""
    seen: set[str] = set()
    for call in calls:
        if call.request_id in seen:
            raise ValueError(f"request id {call.request_id!r} appears twice")
        seen.add(call.request_id)
        num_prompt, num_output = len(call.prompt_token_ids), len(call.output_token_ids)
        if num_prompt < 1 or num_output < 1:
            raise ValueError(f"{call.request_id}: prompt and output must be non-empty")
        if num_prompt % block_size == 0:
            raise ValueError(
                f"{call.request_id}: a prompt of {num_prompt} tokens is whole blocks; the "
                "router can reuse one block fewer than the simulator counts"
            )
        if num_prompt % block_size + num_output - 1 >= block_size:
            raise ValueError(
                f"{call.request_id}: its output completes a block the router caches and "
                "the simulator does not"
            )


def generate_requests(calls: Sequence[ReplayCall]) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            request_id=call.request_id,
            prompt_token_ids=call.prompt_token_ids,
            sampling=SamplingParams(max_tokens=len(call.output_token_ids), ignore_eos=True),
            session_key=call.session_key,
            forced_output_ids=call.output_token_ids,
        )
        for call in calls
    ]


def sim_requests(calls: Sequence[ReplayCall], block_size: int) -> list[SimRequest]:
    """The calls as one closed loop: each arrives when the previous one finished."""
    requests: list[SimRequest] = []
    previous: str | None = None
    for call in calls:
        requests.append(
            SimRequest(
                request_id=call.request_id,
                arrival_s=0.0,
                num_prompt_tokens=len(call.prompt_token_ids),
                num_output_tokens=len(call.output_token_ids),
                block_hashes=tuple(block_hashes(call.prompt_token_ids, block_size)),
                session_key=call.session_key,
                after=previous,
            )
        )
        previous = call.request_id
    return requests


def unique_prompt_waves(
    num_waves: int,
    wave_size: int,
    *,
    block_size: int = 16,
    num_output_tokens: int = 4,
    seed: int = 0,
) -> list[list[ReplayCall]]:
    """Waves of calls whose prompts share no block (so no call hits a cache), each with a
    session key of its own among `wave_size` sessions (session i: call i of every wave)."""
    if num_waves < 1 or wave_size < 1:
        raise ValueError("num_waves and wave_size must be >= 1")
    if not 1 <= num_output_tokens < block_size:
        raise ValueError("num_output_tokens must be in [1, block_size)")
    rng = random.Random(seed)
    waves: list[list[ReplayCall]] = []
    for wave in range(num_waves):
        calls = []
        for position in range(wave_size):
            num_prompt = rng.randint(1, 6) * block_size + rng.randint(
                1, block_size - num_output_tokens
            )
            calls.append(
                ReplayCall(
                    request_id=f"wave{wave}-call{position}",
                    # Distinct first tokens: no two prompts share even their first block.
                    prompt_token_ids=(wave * wave_size + position + 1,)
                    + tuple(rng.randrange(1, 32_000) for _ in range(num_prompt - 1)),
                    output_token_ids=tuple(
                        rng.randrange(1, 32_000) for _ in range(num_output_tokens)
                    ),
                    session_key=f"session{position}",
                )
            )
        waves.append(calls)
    check_alignable([call for calls in waves for call in calls], block_size)
    return waves


def sim_wave_requests(
    waves: Sequence[Sequence[ReplayCall]], block_size: int, gap_s: float = 1000.0
) -> list[SimRequest]:
    """Wave w arrives whole at w * gap_s (open loop); `gap_s` must outlast a wave."""
    requests: list[SimRequest] = []
    for number, calls in enumerate(waves):
        for request in sim_requests(calls, block_size):
            requests.append(replace(request, arrival_s=number * gap_s, after=None))
    return requests


class PinnedPrefillSpeed(PrefillSpeedMeter):
    """A prefill meter that keeps its speed: the router sees the profile's number."""

    def add(self, work_tokens: float, ttft_s: float) -> None:
        pass


def pin_prefill_speed(replica: Replica, tokens_per_s: float) -> None:
    """The router sees the profile's speed, and the queues the simulator sees: a wave
    arrives there at one instant, so no prefill work is taken off while it is routed."""
    replica.prefill_meter = PinnedPrefillSpeed(tokens_per_s)
    replica.live_estimates = False


async def run_live(
    router: Router, calls: Sequence[ReplayCall]
) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Send the calls through the router one at a time. Returns its decisions (request id,
    replica name) and the cached prompt tokens each request's replica reported."""
    start = len(router.decisions)
    cached: dict[str, int] = {}
    for request in generate_requests(calls):
        async for delta in router.generate(request):
            if delta.num_cached_tokens is not None:
                cached[request.request_id] = delta.num_cached_tokens
    return list(router.decisions)[start:], cached


async def run_live_waves(
    router: Router, waves: Sequence[Sequence[ReplayCall]]
) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Each wave: its calls routed in order while the earlier ones of the wave are still
    before their first token (the engines must hold it a while: a ScriptedEngine with
    `ttft_s` > 0), then all awaited. Raises RuntimeError when a call of the wave finished
    before the wave was routed (the run would not be what the simulator sees)."""
    start = len(router.decisions)
    cached: dict[str, int] = {}

    async def one(request: GenerateRequest) -> None:
        async for delta in router.generate(request):
            if delta.num_cached_tokens is not None:
                cached[request.request_id] = delta.num_cached_tokens

    for calls in waves:
        tasks = []
        for number, request in enumerate(generate_requests(calls), 1):
            tasks.append(asyncio.create_task(one(request)))
            await asyncio.sleep(0)  # the task routes up to its first await, in order
            in_flight = sum(len(replica.in_flight) for replica in router.replicas)
            if in_flight != number:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise RuntimeError(
                    f"{request.request_id}: {in_flight} requests in flight, expected {number}; "
                    "the engines answered before the wave was routed"
                )
        await asyncio.gather(*tasks)
    return list(router.decisions)[start:], cached


def run_sim(
    requests: Sequence[SimRequest],
    profiles: Sequence[ReplicaProfile],
    policy: Policy,
    *,
    seed: int,
    kv_blocks: int | None = None,
) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Run `sim_requests(...)` or `sim_wave_requests(...)` on a simulated cluster. Returns
    its decisions (request id, replica name) and the cached prompt tokens of each request."""
    cluster = Cluster(profiles, policy, seed=seed, kv_blocks=kv_blocks)
    result = cluster.run(requests)
    names = [replica.name for replica in result.replicas]
    decisions = [(d.request_id, names[d.replica]) for d in result.decisions]
    cached = {state.request.request_id: state.num_cached_tokens for state in result.states}
    return decisions, cached
