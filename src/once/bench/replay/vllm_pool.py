"""Live vLLM servers under a routed replay (`once replay --engine vllm --replicas N`).

    async with open_vllm_pool(folder, count=2, threads=1, max_model_len=..., kv_cache_mib=...)
            as pool:
        async with open_vllm_fleet(pool, policy="round_robin", prefix_caching=True) as fleet:
            ...  # fleet.engine is what the gateway reaches

The N servers start once for the whole replay (a vLLM start costs tens of seconds here)
and every stack gets them with empty caches: `open_vllm_fleet` resets their prefix caches
(`/reset_prefix_cache`), then builds a fresh router (the stack's policy, an exact prefix
index per server fed by that server's own ZMQ KV events) and reads each server's
`/metrics` as the stack's starting point. The stack's engine counters are the growth of
vLLM's own counters since then: prompt tokens, prefix-cache queries and hits, generated
tokens, finished requests (`engine_stats`, summed over the servers).

The policy `sglang_router` puts SGLang's router in front instead of once's
(sglang_router.py): the engine is then a client of it that sends prompts as text.

Two stacks need more than a router:
- the naive stack has no prefix cache anywhere; vLLM's is a server flag, so instead each
  of its requests carries a fresh `cache_salt` (vLLM salts the first block's hash with
  it): no request can reuse another's blocks, on the same servers;
- a replay forces the recorded outputs. vLLM cannot be handed output ids, so the
  recorded output goes as a grammar matching exactly its text (`literal_grammar`): vLLM
  decodes every token itself, under llguidance's mask, and the gateway gets output that
  parses to the recorded items, so the once stack's conversation chains as recorded.
  vLLM may pick another tokenization of that text than the recording's; the replay keeps
  the ids vLLM produced, as a client would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from once.bench.replay.sglang_router import SGLANG_ROUTER_POLICY, sglang_router
from once.fleet.vllm_server import VllmServer, VllmSpec, start_vllm_servers
from once.protocol.engine import EngineClient, GenerateRequest, OutputConstraint, TokenDelta
from once.router.openai_replica import OpenAICompletionsClient
from once.router.replicas import Replica
from once.router.router import Router, RouterConfig
from once.router.serve import event_index
from once.router.vllm_metrics import VllmMetrics


@dataclass
class VllmPool:
    servers: list[VllmServer]
    served_model: str
    block_size: int
    kv_blocks: int  # per server
    log_folder: Path | None = None  # where a peer router's log goes (a temporary folder if None)


@contextlib.asynccontextmanager
async def open_vllm_pool(
    model_folder: Path,
    *,
    count: int,
    served_model: str,
    threads: int,
    max_model_len: int,
    kv_cache_mib: int,
    log_folder: Path | None = None,
) -> AsyncIterator[VllmPool]:
    """`count` vLLM servers with prefix caching and KV events, up until the block ends."""
    spec = VllmSpec(
        Path(model_folder),
        served_model_name=served_model,
        kv_cache_mib=kv_cache_mib,
        max_model_len=max_model_len,
        threads=threads,
    )
    async with start_vllm_servers([spec] * count, log_folder=log_folder) as servers:
        first = await servers[0].metrics()
        if first.block_size is None or first.num_blocks is None:
            raise RuntimeError(f"{servers[0].name} does not report its KV layout on /metrics")
        yield VllmPool(servers, served_model, first.block_size, first.num_blocks, log_folder)


class FreshSaltClient:
    """An OpenAI replica client whose every request has a salt of its own: no prefix reuse."""

    def __init__(self, inner: OpenAICompletionsClient):
        self.inner = inner

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        return self.inner.generate(replace(request, cache_salt=uuid.uuid4().hex))

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def literal_grammar(text: str) -> OutputConstraint:
    """A Lark grammar (llguidance's dialect) whose one sentence is `text`; Lark literals are
    JSON strings there."""
    return OutputConstraint("lark", f"start: {json.dumps(text, ensure_ascii=False)}\n")


@dataclass
class VllmFleet:
    """One stack's view of the pool: what routes (once's router, or a client of a peer
    router), and vLLM's counters since the stack opened."""

    pool: VllmPool
    engine: EngineClient
    router: Router | None  # None: a peer router routes
    policy: str
    started: list[VllmMetrics]
    last: list[VllmMetrics] = field(default_factory=list)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    slow_names: Sequence[str] = ()

    def replica_pids(self) -> list[int]:
        """Every process of every server: vLLM computes in an engine-core child process."""
        sessions = {s.process.pid for s in self.pool.servers if s.process is not None}
        return [pid for pid, session in sessions_of_processes() if session in sessions]

    async def grown_per_server(self) -> list[VllmMetrics]:
        """vLLM's counters per server, their growth since the stack opened. A server that
        does not answer counts with its last answer, so they never go back."""
        now = await asyncio.gather(
            *(server.metrics() for server in self.pool.servers), return_exceptions=True
        )
        previous = self.last or self.started
        self.last = [
            reading if isinstance(reading, VllmMetrics) else before
            for reading, before in zip(now, previous, strict=True)
        ]
        return [m.since(s) for m, s in zip(self.last, self.started, strict=True)]

    async def grown(self) -> VllmMetrics:
        """`grown_per_server`, summed."""
        totals = await self.grown_per_server()
        return VllmMetrics(
            prefix_cache_queries=sum(t.prefix_cache_queries for t in totals),
            prefix_cache_hits=sum(t.prefix_cache_hits for t in totals),
            prompt_tokens=sum(t.prompt_tokens for t in totals),
            generation_tokens=sum(t.generation_tokens for t in totals),
            requests_finished=sum(t.requests_finished for t in totals),
            preemptions=sum(t.preemptions for t in totals),
        )

    async def engine_stats(self) -> dict:
        """The replay's engine counters, as vLLM counted them. Evictions are not counted
        by vLLM: 0 here, the ledger's misses carry them."""
        grown = await self.grown()
        return {
            "num_prompt_tokens": grown.prompt_tokens,
            "num_cached_prompt_tokens": grown.prefix_cache_hits,
            "num_computed_prompt_tokens": grown.prompt_tokens - grown.prefix_cache_hits,
            "num_recomputed_tokens": 0,
            "num_generated_tokens": grown.generation_tokens,
            "num_kv_evictions": 0,
            "num_requests_finished": grown.requests_finished,
            "num_preemptions": grown.preemptions,
        }

    def replica_of(self, request_id: str) -> str | None:
        """Which server once's router chose; a peer router does not say."""
        if self.router is None:
            return None
        for decided_id, name in reversed(self.router.decisions):
            if decided_id == request_id:
                return name
        return None

    async def routing_stats(self) -> dict:
        """Requests per server as vLLM counted them (every finish reason), whoever routed."""
        per_server = await self.grown_per_server()
        grown = await self.grown()
        finished = {
            server.name: reading.requests_finished
            for server, reading in zip(self.pool.servers, per_server, strict=True)
        }
        router = {}
        notes: list[dict] = []
        if self.router is not None:
            stats = await self.router.stats()
            router = {key: stats[key] for key in self.router.counters}
            notes = list(self.router.decision_notes)
        return {
            "policy": self.policy,
            "router": router,
            "decisions": notes,
            "requests_per_replica": finished,
            "finished_per_replica": finished,
            "slow_replicas": [],
            "vllm": {
                "prefix_cache_queries": grown.prefix_cache_queries,
                "prefix_cache_hits": grown.prefix_cache_hits,
                "hit_ratio": grown.hit_ratio,
                "prompt_tokens": grown.prompt_tokens,
                "computed_tokens": grown.prompt_tokens - grown.prefix_cache_hits,
                "generation_tokens": grown.generation_tokens,
                "preemptions": grown.preemptions,
            },
        }


def sessions_of_processes() -> list[tuple[int, int]]:
    """(pid, session id) of every process this one can see (Linux /proc)."""
    pairs = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone, or not ours to read
        pairs.append((int(stat.parent.name), int(fields[3])))  # fields: state ppid pgrp session
    return pairs


@contextlib.asynccontextmanager
async def open_vllm_fleet(
    pool: VllmPool, *, policy: str, prefix_caching: bool, prompt_text=None
) -> AsyncIterator[VllmFleet]:
    """The pool's servers with empty prefix caches behind a fresh `Router(policy)`, or
    behind sglang-router for `SGLANG_ROUTER_POLICY` (`prompt_text`: ids -> text, needed
    then)."""
    await asyncio.gather(*(server.reset_prefix_cache() for server in pool.servers))
    if policy == SGLANG_ROUTER_POLICY:
        if prompt_text is None or not prefix_caching:
            raise ValueError("sglang-router needs prompt_text and fronts prefix-caching stacks")
        async with _sglang_fleet(pool, prompt_text) as fleet:
            yield fleet
        return
    clients = [OpenAICompletionsClient(server.url, pool.served_model) for server in pool.servers]
    replica_clients: list[EngineClient] = (
        list(clients) if prefix_caching else [FreshSaltClient(c) for c in clients]  # type: ignore[misc]
    )
    replicas = [
        Replica(server.name, client, index=i, block_size=pool.block_size,
                kv_blocks_total=pool.kv_blocks, **event_index(server.kv_events_endpoint))
        for i, (server, client) in enumerate(zip(pool.servers, replica_clients, strict=True))
    ]  # fmt: skip
    router = Router(replicas, RouterConfig(policy=policy, block_size=pool.block_size))
    try:
        started = list(await asyncio.gather(*(server.metrics() for server in pool.servers)))
        await router.start()
        yield VllmFleet(pool, router, router, policy, started)
    finally:
        await router.aclose()
        await asyncio.gather(*(client.aclose() for client in clients))


@contextlib.asynccontextmanager
async def _sglang_fleet(pool: VllmPool, prompt_text) -> AsyncIterator[VllmFleet]:
    with contextlib.ExitStack() as folders:
        log_folder = pool.log_folder or Path(
            folders.enter_context(tempfile.TemporaryDirectory(prefix="sglang-router-"))
        )
        async with sglang_router([s.url for s in pool.servers], log_folder) as url:
            client = OpenAICompletionsClient(url, pool.served_model, prompt_text=prompt_text)
            try:
                started = list(await asyncio.gather(*(s.metrics() for s in pool.servers)))
                yield VllmFleet(pool, client, None, SGLANG_ROUTER_POLICY, started)
            finally:
                await client.aclose()
