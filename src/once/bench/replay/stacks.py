"""The two stacks a replay compares, each the real harness transport, gateway and engine.

- `once`: WebSocket mode (`{previous_response_id, new items}` when the rule allows), the
  gateway's incremental tokenization (it follows from WebSocket continuations), the
  engine's prefix cache.
- `naive`: stateless HTTP with the full history every call, so the gateway renders and
  tokenizes everything, and an engine without prefix cache.

Both serve the same model: by default a tiny random-weight Llama with SmolLM2's tokenizer
and vocabulary (compute is real but cheap), or SmolLM2 itself.

The engine is one in-process `AsyncEngine` by default; with `replicas` > 1 it is a
`Router(policy)` over that many `once engine` processes (replicas.py), some of them
throttled, and `ForcedOutputEngine` sits in front of the router. Given a `vllm_pool`
(vllm_pool.py), the router is over live vLLM servers instead, and the recorded outputs
are forced as grammars of their text.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

import anthropic
import openai

from once.agent.transport.base import Transport
from once.bench.replay.forced import ForcedOutputEngine
from once.bench.replay.replicas import Fleet, open_fleet
from once.bench.replay.timeouts import PATIENT, ClientTimeouts
from once.bench.replay.vllm_pool import VllmFleet, VllmPool, literal_grammar, open_vllm_fleet
from once.gateway.config import GatewayConfig
from once.gateway.pipeline import ResponsePipeline
from once.gateway.prompt.render import NotIncrementalError
from once.protocol.engine import EngineClient

if TYPE_CHECKING:  # the engine (and torch) is imported when a stack opens
    from once.engine.async_engine import AsyncEngine
    from once.router.router import Router

TOKENIZER_MODEL = "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TINY = "tiny"


@dataclass(frozen=True)
class StackSpec:
    name: str
    websocket: bool  # else stateless HTTP, full requests
    prefix_caching: bool
    incremental_tokenization: bool = True  # False: the gateway renders every prompt in full
    speculative_method: str = ""  # the engine's drafter ("ngram", "suffix"); "" is off
    api: str = "responses"  # or "chat" (Chat Completions), "messages" (Anthropic Messages)
    # The client sends its running tool-time estimates as pause hints (agent/pauses.py).
    pause_hints: bool = False


ONCE = StackSpec("once", websocket=True, prefix_caching=True)
NAIVE = StackSpec("naive", websocket=False, prefix_caching=False, incremental_tokenization=False)
APIS = ("responses-ws", "responses-http", "chat", "messages")


def stacks_for(api: str) -> dict[str, StackSpec]:
    """once and naive speaking `api`; naive is always stateless, with no cache anywhere
    (over the Responses API it is HTTP: WebSocket mode is once's own saving)."""
    if api == "responses-ws":
        return {"once": ONCE, "naive": NAIVE}
    if api == "responses-http":
        return {"once": replace(ONCE, websocket=False), "naive": NAIVE}
    if api not in APIS:
        raise ValueError(f"unknown API {api!r}; one of {', '.join(APIS)}")
    return {
        "once": replace(ONCE, websocket=False, api=api),
        "naive": replace(NAIVE, api=api),
    }


def make_tiny_replay_model(folder: Path, max_model_len: int) -> Path:
    """A tiny random Llama that reads SmolLM2's ids: its vocabulary and tokenizer files."""
    from once.engine.loader import resolve_model_path
    from once.engine.testing import make_tiny_model

    make_tiny_model(folder, vocab_size=49152, max_position_embeddings=max_model_len)
    source = Path(resolve_model_path(TOKENIZER_MODEL))
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return folder


def load_served_runtime(model_folder: Path, max_model_len: int):
    from once.gateway.model import ModelRuntime

    # Requests name the model as the recorded payloads do; the folder decides what runs.
    return ModelRuntime.load(TOKENIZER_MODEL, model_folder, max_model_len=max_model_len)


class FullRenderBuilder:
    """A prompt builder whose continuations always fall back to a full render (ablation).

    The gateway treats `NotIncrementalError` as "render this continuation in full", so the
    WebSocket path stays incremental on the wire while the gateway re-tokenizes everything.
    """

    def __init__(self, inner):
        self._inner = inner

    def continuation(self, *args, **kwargs):
        raise NotIncrementalError("incremental tokenization is off (ablation)")

    def __getattr__(self, name):
        return getattr(self._inner, name)


class LoggingBuilder:
    """Logs each build's tokenization count by prompt ids, so that a request can be matched
    to its own gateway work when sessions run at once (the gateway's counters are global).
    Only the first build of a prompt is kept: a verification re-render comes after it."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.num_tokenized_by_prompt: dict[int, int] = {}  # hash of the prompt ids -> count

    def _log(self, built):
        self.num_tokenized_by_prompt.setdefault(hash(tuple(built.prompt_ids)), built.num_tokenized)
        return built

    def full(self, *args, **kwargs):
        return self._log(self._inner.full(*args, **kwargs))

    def continuation(self, *args, **kwargs):
        return self._log(self._inner.continuation(*args, **kwargs))

    def take(self, prompt_ids) -> int | None:
        return self.num_tokenized_by_prompt.pop(hash(tuple(prompt_ids)), None)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@dataclass
class Stack:
    spec: StackSpec
    engine: AsyncEngine | Router | EngineClient  # in-process, the fleet's router, a peer's
    forced: ForcedOutputEngine
    gateway: ResponsePipeline
    client: openai.AsyncOpenAI
    builds: LoggingBuilder | None = None
    fleet: Fleet | VllmFleet | None = None  # the replicas and router, when routed
    anthropic_client: anthropic.AsyncAnthropic | None = None  # the Messages API's client
    timeouts: ClientTimeouts = PATIENT

    @property
    def session_namespace(self) -> str:
        """The stack part of the replay's prompt_cache_keys. Routed variants of a stack
        ("once/round_robin") share their stack's: every policy then routes the same
        session keys, and session-hash affinity places each session as it would anyway."""
        return self.spec.name.split("/")[0]

    @property
    def block_size(self) -> int:
        if self.fleet is not None:
            return self.fleet.block_size
        engine = cast("AsyncEngine", self.engine)  # without a fleet: the in-process engine
        return engine.engine.config.block_size

    async def engine_stats(self) -> dict:
        """The engine's stats; over replicas, their counters summed."""
        if self.fleet is not None:
            return await self.fleet.engine_stats()
        return await self.engine.stats()

    def replica_of(self, request_id: str) -> str | None:
        return None if self.fleet is None else self.fleet.replica_of(request_id)

    def transport(self) -> Transport:
        from once.agent.transport.chat import ChatCompletionsTransport
        from once.agent.transport.http import HttpTransport
        from once.agent.transport.messages import MessagesTransport
        from once.agent.transport.websocket import WebSocketTransport

        if self.spec.api == "chat":
            return ChatCompletionsTransport(self.client)
        if self.spec.api == "messages":
            assert self.anthropic_client is not None  # open_stack makes one for this API
            return MessagesTransport(self.anthropic_client)
        if self.spec.websocket:
            # No HTTP fallback: a silent fallback would hide a broken WebSocket path.
            return WebSocketTransport(
                self.client, http_fallback=False, options=self.timeouts.websocket_options()
            )
        return HttpTransport(self.client)

    async def counters(self) -> dict:
        """The engine's and the gateway's own counters, for reconciliation."""
        metrics = self.gateway.metrics
        value = metrics.value
        engine = await self.engine_stats()
        return {
            "engine": {
                key: engine[key]
                for key in (
                    "num_prompt_tokens",
                    "num_cached_prompt_tokens",
                    "num_computed_prompt_tokens",
                    "num_recomputed_tokens",
                    "num_generated_tokens",
                    "num_kv_evictions",
                    "num_requests_finished",
                )
            }
            | {
                key: value
                for key, value in engine.items()
                if key.startswith(("kv_tier_", "kv_pause_")) or key == "num_kv_keeps_broken"
            },
            "gateway": {
                "prompt_tokens": value(metrics.prompt_tokens),
                "tokenized_tokens": value(metrics.tokenized_tokens),
                "cached_tokens": value(metrics.cached_tokens),
                "output_tokens": value(metrics.output_tokens),
                "received_bytes_http": value(metrics.received_bytes, "http"),
                "received_bytes_websocket": value(metrics.received_bytes, "websocket"),
                "full_renders": value(metrics.renders, "full"),
                "incremental_renders": value(metrics.renders, "incremental"),
                "verifications": value(metrics.verifications),
                "divergences": value(metrics.divergences),
            },
        }


@contextlib.asynccontextmanager
async def open_stack(
    spec: StackSpec,
    runtime,
    model_folder: Path,
    *,
    max_model_len: int,
    kv_cache_gib: float = 0.25,
    num_kv_blocks: int = 0,
    verify_every: int = 32,
    replicas: int = 1,
    slow_replicas: int = 0,
    slowdown: float = 1.0,
    policy: str = "once",
    replica_threads: int = 1,
    kv_tiers: dict | None = None,
    pd: tuple[int, int] | None = None,
    pd_split=None,
    pd_transport: str = "shm",
    pd_shared_kv: bool = False,
    timeouts: ClientTimeouts = PATIENT,
    keep_alive_s: float = GatewayConfig.keep_alive_s,
    wrap_engine=None,
    vllm_pool: VllmPool | None = None,
) -> AsyncIterator[Stack]:
    """replicas == 1: one in-process engine (slow_replicas, slowdown, policy unused).
    replicas > 1: `once engine` processes (the last `slow_replicas` at 1/`slowdown`
    speed, `replica_threads` threads each) behind a router with `policy`; each stack
    starts its own, so every stack's caches start empty. `kv_tiers`: EngineConfig's kv_*
    settings of the in-process engine. pd = (P, D): the replicas are P prefill and D decode
    engines (open_fleet). `timeouts`: the clients' (timeouts.py); `keep_alive_s`: the
    gateway's; `wrap_engine`: wraps the engine the gateway reaches (tests: a slow one).
    `vllm_pool`: route over its live vLLM servers (their caches emptied first) instead."""
    from once.gateway.testing import serve_gateway

    builder = runtime.builder
    if not spec.incremental_tokenization:
        builder = FullRenderBuilder(builder)
    builds = LoggingBuilder(builder)
    runtime = replace(runtime, builder=builds)
    # The client shares the gateway's event loop: on a busy machine its reads and writes
    # may lag by far more than an open server allows a stranger.
    gateway_config = GatewayConfig(
        store="memory",
        verify_every=verify_every,
        max_body_bytes=256 * 1024 * 1024,
        keep_alive_s=keep_alive_s,
        default_max_output_tokens=0,  # a recorded output may be longer than any default
        send_timeout_s=timeouts.write_s,
        body_timeout_s=timeouts.write_s,
    )
    async with contextlib.AsyncExitStack() as stack_of_closers:
        fleet: Fleet | VllmFleet | None = None
        engine: AsyncEngine | Router | EngineClient
        as_constraint = None
        if vllm_pool is not None:
            prompt_text = functools.partial(runtime.tokenizer.decode, skip_special_tokens=False)
            fleet = await stack_of_closers.enter_async_context(
                open_vllm_fleet(
                    vllm_pool, policy=policy, prefix_caching=spec.prefix_caching,
                    prompt_text=prompt_text,
                )
            )  # fmt: skip
            engine = fleet.engine
            as_constraint = text_forcing(runtime)
        elif replicas > 1:
            fleet = await stack_of_closers.enter_async_context(
                open_fleet(
                    model_folder, count=replicas, num_slow=slow_replicas, slowdown=slowdown,
                    threads=replica_threads, policy=policy, max_model_len=max_model_len,
                    kv_cache_gib=kv_cache_gib, prefix_caching=spec.prefix_caching,
                    speculative_method=spec.speculative_method, pd=pd, pd_split=pd_split,
                    pd_transport=pd_transport, pd_shared_kv=pd_shared_kv,
                )
            )  # fmt: skip
            engine = fleet.router
        else:
            engine = _in_process_engine(
                spec, model_folder, max_model_len, kv_cache_gib, num_kv_blocks, kv_tiers or {}
            )
            stack_of_closers.push_async_callback(engine.close)
        forced = ForcedOutputEngine(
            engine if wrap_engine is None else wrap_engine(engine), as_constraint
        )
        url, gateway = await stack_of_closers.enter_async_context(
            serve_gateway(runtime, forced, gateway_config)
        )
        client = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="replay", max_retries=0, timeout=timeouts.sdk()
        )
        stack_of_closers.push_async_callback(client.close)
        anthropic_client = None
        if spec.api == "messages":
            anthropic_client = anthropic.AsyncAnthropic(
                base_url=url, api_key="replay", max_retries=0, timeout=timeouts.sdk()
            )
            stack_of_closers.push_async_callback(anthropic_client.close)
        yield Stack(
            spec, engine, forced, gateway, client, builds, fleet, anthropic_client, timeouts
        )


def forced_text(runtime):
    """Forced ids -> their text, without the eos that ends the turn: what a peer that
    takes text must be made to produce."""
    eos_ids = set(runtime.builder.eos_ids)

    def as_text(ids) -> str:
        ids = list(ids)
        while ids and ids[-1] in eos_ids:
            ids.pop()
        return runtime.tokenizer.decode(ids, skip_special_tokens=False)

    return as_text


def text_forcing(runtime):
    """Forced ids -> the Lark grammar of their text (forced_text)."""
    as_text = forced_text(runtime)
    return lambda ids: literal_grammar(as_text(ids))


def _in_process_engine(
    spec, model_folder, max_model_len, kv_cache_gib, num_kv_blocks, kv_tiers
) -> AsyncEngine:
    from once.engine.async_engine import AsyncEngine
    from once.engine.config import EngineConfig
    from once.engine.core import LLMEngine

    config = EngineConfig(
        model=str(model_folder),
        enable_prefix_caching=spec.prefix_caching,
        kv_cache_gib=kv_cache_gib,
        num_kv_blocks=num_kv_blocks,
        max_model_len=max_model_len,
        speculative_method=spec.speculative_method,
        **kv_tiers,
    )
    return AsyncEngine(LLMEngine(config))
