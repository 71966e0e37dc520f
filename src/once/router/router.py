"""The router: an `EngineClient` that sends each request to one of N replicas.

Per request: hash the prompt's full blocks (the engines' chained hashes), sync the exact
indices from their KV events, ask the policy (policies.py, shared with the simulator) for a
replica given each one's load, speed and cached prefix, stream the replica's deltas back.

Failover. A replica that raises `EngineDeadError` (dead process, refused connection, cut
stream), an OS error, or stays silent past `first_delta_timeout_s` / `delta_timeout_s`,
is marked down and skipped by every policy until a health probe succeeds (every
`health_interval_s`, in the background). The request in hand:
- if nothing was streamed to the caller yet, it is sent again to another replica (at
  most `max_attempts` replicas in all): the caller never notices;
- if deltas were streamed, it ends with `EngineDeadError` (code `engine_unavailable`,
  HTTP 503), which a client may retry as a whole; partial output is never spliced.
`EngineOverloadedError` moves the request to another replica without marking anything
down. Request errors (too long, bad ids) go to the caller as they are.

Pointing the router at vLLM (it cannot be installed on these machines, so this path is
tested against a fake server speaking the same wire format):

    vllm serve MODEL --port 8001 --enable-prompt-tokens-details \\
        --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                             "endpoint": "tcp://*:5557", "topic": "kv-events"}'

    client = OpenAICompletionsClient("http://host:8001", model="MODEL")
    index = ExactPrefixIndex(rehash=True)  # vLLM hashes differently: re-derive ours
    task = asyncio.create_task(zmq_event_subscriber("tcp://host:5557", index))
    replica = Replica("vllm-0", client, index=0, block_size=16,  # vLLM's --block-size
                      kv_blocks_total=..., prefix_index=index)
    router = Router([replica, ...], RouterConfig(policy="once"))

or from the command line, with approximate indices: `once router --openai-url
http://host:8001 --openai-model MODEL ...` (serve.py). Without the ZMQ subscriber (it
needs `pyzmq` and `msgpack`) leave `prefix_index` out and the router keeps an approximate
index from the prompts it routed. The router's `block_size` must equal vLLM's
`--block-size` (16 by default). vLLM must return output token ids: >= 0.10.2 does with
`return_token_ids` (always sent), older ones need `--return-tokens-as-token-ids`; a server
that streams text only gets a clear error, never a silent re-tokenization. SGLang accepts
the same token-id prompts; whether its build streams output ids decides whether the
client can use it (untested here); it publishes no KV events in vLLM's format, so its
replicas use the approximate index.

Disaggregation: replicas of role "prefill" take only the prefill legs of requests the split
policy sends through one (disagg/routing.py); everything else is routed among the others.
"""

import asyncio
import contextlib
import random
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

from once.protocol.engine import FINISH_ERROR, EngineClient, GenerateRequest, TokenDelta
from once.protocol.errors import EngineDeadError, EngineOverloadedError
from once.protocol.kv_blocks import block_hashes, extend_block_hashes
from once.router.disagg.routing import Disaggregation
from once.router.disagg.split import SPLIT, SplitPolicy
from once.router.policies import Policy, ReplicaView, RequestView, make_policy
from once.router.replicas import Replica, ReplicaFailure

MAX_SESSIONS = 65536  # sessions whose last replica is remembered for pause hints


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "once"
    policy_params: dict = field(default_factory=dict)
    block_size: int = 16  # must equal the replicas' KV block size for the index to match
    max_attempts: int = 3  # replicas tried for one request before giving up
    first_delta_timeout_s: float | None = None  # None: a long CPU prefill is not a death
    delta_timeout_s: float | None = None
    health_interval_s: float = 1.0
    probe_timeout_s: float = 5.0  # a hung replica must not stall the health loop
    seed: int = 0  # of the tie-breaking rng: same seed, same decisions as the simulator
    max_decisions: int = 10_000  # recent (request id, replica name) pairs kept
    max_decision_notes: int = 1_000  # recent decisions with what the policy saw
    # With prefill replicas: which requests go through one (disagg/split.py); None: defaults.
    pd_split: SplitPolicy | None = None

    def __post_init__(self):
        if self.block_size < 1 or self.max_attempts < 1:
            raise ValueError("block_size and max_attempts must be >= 1")
        for name in ("first_delta_timeout_s", "delta_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None")
        if self.health_interval_s <= 0 or self.probe_timeout_s <= 0:
            raise ValueError("health_interval_s and probe_timeout_s must be > 0")


async def _aclose_quietly(stream: AsyncIterator[TokenDelta]) -> None:
    # EngineClient.generate promises an iterator; those that can be closed (async
    # generators, all of ours) are, which runs their finally blocks.
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


def _is_dead_delta(delta: TokenDelta) -> bool:
    return delta.finish_reason == FINISH_ERROR and (delta.error or {}).get("code") in (
        EngineDeadError.code,
        EngineOverloadedError.code,
    )


class Router:
    def __init__(self, replicas: Sequence[Replica], config: RouterConfig | None = None):
        if not replicas:
            raise ValueError("a router needs at least one replica")
        names = [replica.name for replica in replicas]
        if len(set(names)) != len(names):
            raise ValueError(f"replica names must be unique: {names}")
        self.config = config or RouterConfig()
        for position, replica in enumerate(replicas):
            if replica.index != position:
                raise ValueError("replica.index must equal its position in the list")
            if replica.block_size != self.config.block_size:
                raise ValueError(f"replica {replica.name} block size differs from the router's")
        self.replicas = list(replicas)
        self.prefill_indices = [r.index for r in replicas if r.role == "prefill"]
        if len(self.prefill_indices) == len(self.replicas):
            raise ValueError("a router with prefill replicas needs a decode (or both) replica")
        self.pd = None
        if self.prefill_indices:
            self.pd = Disaggregation(self.config.pd_split or SplitPolicy())
        self.policy: Policy = make_policy(self.config.policy, **self.config.policy_params)
        self.rng = random.Random(self.config.seed)
        self.decisions: deque[tuple[str, str]] = deque(maxlen=self.config.max_decisions)
        self.decision_notes: deque[dict] = deque(maxlen=self.config.max_decision_notes)
        self._where: dict[str, Replica] = {}  # request id -> replica serving it now
        # session key -> the replica of its last call: where a pause hint is useful.
        self._session_where: OrderedDict[str, Replica] = OrderedDict()
        self._health_task: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()  # replica streams being closed
        self.counters = dict.fromkeys(
            (
                "num_requests",
                "num_finished",
                "num_retries",
                "num_failed_after_stream",
                "num_failed_no_replica",
            ),
            0,
        )

    @classmethod
    def over(
        cls, clients: Sequence[EngineClient], config: RouterConfig | None = None, **replica_kw
    ) -> "Router":
        """A router over plain clients, named replica-0..N-1, approximate indices."""
        config = config or RouterConfig()
        replicas = [
            Replica(f"replica-{i}", client, index=i, block_size=config.block_size, **replica_kw)
            for i, client in enumerate(clients)
        ]
        return cls(replicas, config)

    # -- EngineClient -----------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self._ensure_health_loop()
        self.counters["num_requests"] += 1
        prompt = request.prompt_token_ids
        hashes = tuple(block_hashes(prompt, self.config.block_size, request.cache_salt))
        tried: set[int] = set()
        while True:
            replica, request_view, views = self._choose(request, hashes, tried)
            if self.pd is not None and not tried and request.kv_transfer_params is None:
                request = await self._maybe_split(request, request_view, views, replica, hashes)
            tried.add(replica.index)
            streamed = False
            try:
                async with contextlib.aclosing(self._stream_from(replica, request, hashes)) as it:
                    async for delta in it:
                        streamed = True
                        if delta.finished:  # counted now: the caller may stop reading here
                            self.counters["num_finished"] += 1
                        yield delta
                return
            except ReplicaFailure as failure:
                cause = failure.__cause__
                if streamed:
                    self.counters["num_failed_after_stream"] += 1
                    raise EngineDeadError(
                        f"replica {replica.name} failed while streaming {request.request_id} "
                        f"({cause!r}); the request can be retried"
                    ) from cause
                if len(tried) >= self.config.max_attempts:
                    self.counters["num_failed_no_replica"] += 1
                    raise EngineDeadError(
                        f"{request.request_id} failed on {len(tried)} replicas, last "
                        f"{replica.name}: {cause!r}; the request can be retried"
                    ) from cause
                self.counters["num_retries"] += 1

    async def _maybe_split(self, request, request_view, views, replica, hashes):
        # The first attempt of a request only: a retry goes to its new replica unsplit.
        assert self.pd is not None
        prefills = [views[i] for i in self.prefill_indices]
        decision = self.pd.decide(request_view, views[replica.index], prefills, self.rng)
        if decision.reason != SPLIT or decision.prefill_index is None:
            return request
        prefill = self.replicas[decision.prefill_index]
        params = await self.pd.run_prefill(self, prefill, request, hashes)
        if params is None:
            return request
        self.pd.record_split(prefill.name, replica.name, request, decision.num_uncached_tokens)
        return replace(request, kv_transfer_params=params)

    async def abort(self, request_id: str) -> None:
        replica = self._where.get(request_id)
        if replica is not None:
            await replica.client.abort(request_id)

    async def pause_session(self, session_key: str, expected_s: float) -> None:
        """A pause hint goes to the replica that holds the session's blocks."""
        replica = self._session_where.get(session_key)
        pause = getattr(replica.client, "pause_session", None) if replica else None
        if pause is not None:
            await pause(session_key, expected_s)

    async def stats(self) -> dict:
        replicas = {replica.name: replica.stats() for replica in self.replicas}
        num_prompt = sum(r["num_prompt_tokens"] for r in replicas.values())
        num_cached = sum(r["num_cached_tokens"] for r in replicas.values())
        return {
            "policy": self.policy.name,
            **self.counters,
            "num_running": sum(r["num_running"] for r in replicas.values()),
            "num_healthy_replicas": sum(r["healthy"] for r in replicas.values()),
            "num_prompt_tokens": num_prompt,
            "num_cached_prompt_tokens": num_cached,
            "prefix_cache_hit_rate": num_cached / num_prompt if num_prompt else 0.0,
            "replicas": replicas,
            **({"pd": self.pd.stats()} if self.pd is not None else {}),
        }

    async def check_health(self) -> None:
        # The engine server's /healthz calls this: the router is up while a replica is.
        if not any(replica.healthy for replica in self.replicas):
            raise EngineDeadError("no healthy replica")

    # -- health -----------------------------------------------------------------------------

    async def check_replicas(self) -> None:
        """One health pass: probe every down replica at once (the ones that answer rejoin)
        and read the others' own load where their servers report it (vLLM's /metrics)."""
        down = [replica for replica in self.replicas if not replica.healthy]
        up = [replica for replica in self.replicas if replica.healthy]
        timeout = self.config.probe_timeout_s
        results = await asyncio.gather(
            *(replica.probe(timeout) for replica in down),
            *(replica.refresh_server_load(timeout) for replica in up),
        )
        for replica, alive in zip(down, results[: len(down)], strict=True):
            if alive:
                replica.mark_up()

    async def start(self) -> None:
        """Start the background work (health loop, KV-event feeds) before the first request,
        so the indices see the replicas' caches fill from the start."""
        self._ensure_health_loop()

    async def aclose(self) -> None:
        await asyncio.gather(*(replica.stop_index_feed() for replica in self.replicas))
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        await asyncio.gather(*self._closing, return_exceptions=True)  # before the clients go

    def _ensure_health_loop(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        for replica in self.replicas:
            replica.start_index_feed()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_replicas()

    # -- routing ----------------------------------------------------------------------------

    def _choose(self, request: GenerateRequest, hashes: tuple[int, ...], tried: set[int]):
        for replica in self.replicas:
            replica.sync_index()
        num_prompt = len(request.prompt_token_ids)
        views = [replica.view(hashes, num_prompt) for replica in self.replicas]
        # Prefill replicas serve only the prefill legs of split requests.
        unavailable = tried | set(self.prefill_indices)
        views = [replace(v, healthy=False) if v.index in unavailable else v for v in views]
        request_view = RequestView(
            request_id=request.request_id,
            num_prompt_tokens=len(request.prompt_token_ids),
            block_hashes=hashes,
            block_size=self.config.block_size,
            session_key=request.session_key,
            max_output_tokens=request.sampling.max_tokens,
        )
        try:
            chosen = self.policy.choose(request_view, views, self.rng)
        except EngineDeadError:
            self.counters["num_failed_no_replica"] += 1
            raise
        if not views[chosen].healthy:
            raise RuntimeError(f"policy {self.policy.name} chose an unavailable replica")
        self.decisions.append((request.request_id, self.replicas[chosen].name))
        self.decision_notes.append(decision_note(request_view, views, self.replicas[chosen].name))
        # The prefill replicas' views as they are, for the split decision.
        views = [self.replicas[i].view(hashes, num_prompt) if i in self.prefill_indices
                 else view for i, view in enumerate(views)]  # fmt: skip
        return self.replicas[chosen], request_view, views

    async def _stream_from(
        self, replica: Replica, request: GenerateRequest, hashes: tuple[int, ...]
    ) -> AsyncGenerator[TokenDelta, None]:
        """The replica's deltas, with its bookkeeping; a replica fault -> ReplicaFailure."""
        replica.on_dispatch(request, hashes)
        self._where[request.request_id] = replica
        if request.session_key:
            self._session_where[request.session_key] = replica
            self._session_where.move_to_end(request.session_key)
            if len(self._session_where) > MAX_SESSIONS:
                self._session_where.popitem(last=False)
        output_ids: list[int] = []
        num_cached: int | None = None
        first = True
        finished = False
        stream = replica.client.generate(request)
        try:
            while True:
                config = self.config
                timeout = config.first_delta_timeout_s if first else config.delta_timeout_s
                # asyncio.timeout, not wait_for: Python 3.11's wait_for runs each anext in
                # a task of its own; this way the stream (an HTTP response, for a remote
                # replica) is advanced and closed from this task only.
                try:
                    async with asyncio.timeout(timeout):
                        delta = await anext(stream)
                except StopAsyncIteration:
                    raise EngineDeadError(f"{replica.name} ended the stream unfinished") from None
                if _is_dead_delta(delta):
                    raise EngineDeadError(str((delta.error or {}).get("message")))
                first = False
                output_ids.extend(delta.token_ids)
                if delta.num_cached_tokens is not None:
                    num_cached = delta.num_cached_tokens
                replica.on_delta(request.request_id, len(delta.token_ids))
                if delta.finished:
                    finished = True
                    # Blocks of prompt + output (minus the last token, never computed) are
                    # cached now: the next turn of this conversation starts with them.
                    tokens = list(request.prompt_token_ids) + output_ids[:-1]
                    completed = extend_block_hashes(
                        list(hashes), tokens, self.config.block_size, request.cache_salt
                    )
                    if num_cached is None and delta.metrics is not None:
                        num_cached = delta.metrics.num_cached_tokens
                    replica.on_finish(request.request_id, delta.metrics, num_cached, completed)
                    yield delta
                    return
                yield delta
        except EngineOverloadedError as exc:
            replica.on_abandon(request.request_id)
            raise ReplicaFailure() from exc
        except (EngineDeadError, TimeoutError, OSError) as exc:
            replica.mark_down(f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):
                await replica.client.abort(request.request_id)
            raise ReplicaFailure() from exc
        finally:
            if not finished:
                replica.on_abandon(request.request_id)
            if self._where.get(request.request_id) is replica:
                del self._where[request.request_id]
            await self._close_stream(stream)

    async def _close_stream(self, stream: AsyncIterator[TokenDelta]) -> None:
        """Close a replica's stream in a task of its own, shielded from our cancellation.

        A caller often cancels its reader right after the finished delta, which is when
        this finally is closing the replica's stream; for a remote replica that means
        releasing an HTTP connection (httpcore's own shields do not stop asyncio's
        cancel). Cut there, the connection stays checked out of the pool forever and its
        socket sits in CLOSE-WAIT: a hundred such requests and the pool is dry."""
        closing = asyncio.ensure_future(_aclose_quietly(stream))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        await asyncio.shield(closing)


def decision_note(request: RequestView, views: Sequence[ReplicaView], chosen: str) -> dict:
    """What a decision saw, for a replay to show why a call went where it went: per healthy
    replica [queued prefill tokens, prompt tokens it holds, prefill tokens/s]."""
    seen = {
        v.name: [v.num_queued_prefill_tokens, v.matched_prefix_blocks * request.block_size,
                 round(v.prefill_tokens_per_s, 1)] for v in views if v.healthy
    }  # fmt: skip
    note = {"request_id": request.request_id, "session_key": request.session_key}
    return {**note, "prompt_tokens": request.num_prompt_tokens, "replica": chosen, "views": seen}
