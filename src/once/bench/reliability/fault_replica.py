"""A replica killed mid-stream behind the router.

Two `once engine` processes (scripted: forced outputs, 0.5 s to the first token, 50 ms a
token after) behind a round-robin `Router`. Four sessions stream; once each has tokens,
two more are sent, and the replica serving the last of them is SIGKILLed while that
request still waits for its first token. What must hold:

- the streams the dead replica was serving end with `engine_unavailable` (retriable);
- the request it had not answered yet is retried on the other replica by the router
  itself and completes, the caller none the wiser;
- the sessions on the other replica complete exactly, as if nothing happened;
- a client that retries a failed stream once (as an OpenAI client retries a 503) gets
  its whole output: no session is lost.
"""

import asyncio
import time

from once.bench.reliability.fault_kit import FaultContext, FaultResult
from once.bench.reliability.fault_servers import running_all
from once.engine_http.client import RemoteEngineClient
from once.protocol.engine import GenerateRequest, SamplingParams
from once.protocol.errors import EngineDeadError, OnceError
from once.router.router import Router, RouterConfig

NUM_OUTPUT_TOKENS = 40
PROMPT = tuple(range(1, 65))
REPLICA_ARGS = ["replica", "--ttft-s", "0.5", "--token-latency-s", "0.05"]
WAIT_S = 30.0  # hang guard for each wait on the streams


def output_of(session: int) -> tuple[int, ...]:
    return tuple(1000 * (session + 1) + i for i in range(NUM_OUTPUT_TOKENS))


class Session:
    """One request streamed through the router, with what came back."""

    def __init__(self, router: Router, index: int):
        self.router = router
        self.index = index
        self.tokens: list[int] = []
        self.error: OnceError | None = None
        self.attempts = 0

    def request_id(self, attempt: int = 0) -> str:
        return f"session-{self.index}-try-{attempt}"

    def request(self) -> GenerateRequest:
        return GenerateRequest(
            request_id=self.request_id(self.attempts),
            prompt_token_ids=PROMPT,
            sampling=SamplingParams(max_tokens=NUM_OUTPUT_TOKENS, ignore_eos=True),
            forced_output_ids=output_of(self.index),
        )

    async def stream(self) -> None:
        request = self.request()
        self.attempts += 1
        self.tokens, self.error = [], None
        try:
            async for delta in self.router.generate(request):
                self.tokens.extend(delta.token_ids)
        except OnceError as exc:
            self.error = exc

    @property
    def complete(self) -> bool:
        return self.error is None and tuple(self.tokens) == output_of(self.index)


async def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {WAIT_S:.0f} s for {what}")
        await asyncio.sleep(0.01)


async def replica_killed_mid_stream(context: FaultContext) -> FaultResult:
    logs = context.folder("replica_killed")
    async with running_all([REPLICA_ARGS, REPLICA_ARGS], logs) as servers:
        clients = [RemoteEngineClient(server.url) for server in servers]
        router = Router.over(clients, RouterConfig(policy="round_robin", health_interval_s=60))
        try:
            sessions = [Session(router, i) for i in range(6)]
            tasks = [asyncio.create_task(s.stream()) for s in sessions[:4]]
            await _wait_until(lambda: all(len(s.tokens) >= 3 for s in sessions[:4]), "tokens")
            tasks += [asyncio.create_task(s.stream()) for s in sessions[4:]]
            await _wait_until(lambda: len(router.decisions) >= 6, "the routing of 6 requests")
            where = {request_id: name for request_id, name in router.decisions}
            victim = where[sessions[5].request_id()]
            victim_index = [r.name for r in router.replicas].index(victim)
            servers[victim_index].kill()
            async with asyncio.timeout(WAIT_S):
                await asyncio.gather(*tasks)
            first_try = {s.index: (s.complete, s.error) for s in sessions}
            # Streams on the victim that had tokens (sessions 0..3 routed there).
            cut = [s for s in sessions[:4] if where[s.request_id()] == victim]
            spared = [s for s in sessions[:5] if where[s.request_id()] != victim]
            retried_by_router = router.counters["num_retries"]
            for session in sessions:
                if not session.complete:
                    async with asyncio.timeout(WAIT_S):
                        await session.stream()  # the client's own retry, once
            stats = await router.stats()
        finally:
            await router.aclose()
            await asyncio.gather(*(client.aclose() for client in clients))

    def retriable(error) -> bool:
        return isinstance(error, EngineDeadError) and error.code == "engine_unavailable"

    checks = {
        "streams cut on the killed replica end with a retriable error": bool(cut)
        and all(not first_try[s.index][0] and retriable(first_try[s.index][1]) for s in cut),
        "the unanswered request is retried by the router and completes": first_try[5][0]
        and retried_by_router >= 1,
        "sessions on the other replica complete exactly": bool(spared)
        and all(first_try[s.index][0] for s in spared),
        "the killed replica is marked down": not stats["replicas"][victim]["healthy"],
    }
    lost = sum(not s.complete for s in sessions)
    return FaultResult(
        "replica_killed",
        checks,
        sessions_lost=lost,
        detail={
            "sessions": len(sessions),
            "cut_mid_stream": len(cut),
            "retried_by_router_before_first_token": retried_by_router,
            "retried_by_client": sum(s.attempts > 1 for s in sessions),
            "unaffected": len(spared),
            "router_failed_after_stream": stats["num_failed_after_stream"],
        },
    )
