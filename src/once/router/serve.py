"""`once router`: the router as a server speaking the `once engine` HTTP API.

    once router --engine-url http://127.0.0.1:8001 --engine-url http://127.0.0.1:8002 \\
        --policy once --port 8000
    once serve --engine-url http://127.0.0.1:8000      # the gateway in front of it

Replicas are `once engine` servers (`--engine-url`) and/or OpenAI-compatible vLLM/SGLang
servers (`--openai-url`, with `--openai-model`), in the order given; their block size must
be the router's (`--block-size`; left out, it is read from the first vLLM server's
`/metrics`, as is its pool size for `--kv-blocks`, else 16 and 2000).

Indices: approximate (from the prompts the router sent) unless a replica publishes KV
events. `--openai-kv-events ENDPOINT`, once per `--openai-url` in the same order (`-` for
none), subscribes to a vLLM server's ZMQ publisher (`--kv-events-config '{"enable_kv_
cache_events": true, "publisher": "zmq", "endpoint": ...}'` on the vLLM side) and keeps an
exact index re-hashed from the events' token ids. Load: the policies see the requests this
router has in flight, plus what each vLLM server reports beyond them on `/metrics`.

Disaggregated: `--prefill-engine-url` (a `once engine --role prefill`) and
`--prefill-openai-url` (a vLLM prefill instance) add prefill replicas; requests the split
policy picks (`--pd-min-uncached-tokens`, ...) are prefilled there and decoded on the
others (disagg/routing.py).
"""

import argparse
import contextlib
import functools
from collections.abc import Sequence

import httpx

from once.engine_http.client import RemoteEngineClient
from once.protocol.engine import EngineClient
from once.router.disagg.split import SplitPolicy
from once.router.index import ExactPrefixIndex, zmq_event_subscriber
from once.router.openai_replica import OpenAICompletionsClient
from once.router.policies import POLICIES
from once.router.replicas import Replica
from once.router.router import Router, RouterConfig
from once.router.vllm_metrics import parse_vllm_metrics


def parse_policy_param(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, float(value) if "." in value or "e" in value else int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: {value!r} is not a number") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="once router", description=__doc__.split("\n")[0])
    parser.add_argument("--engine-url", action="append", default=[], help="a once engine")
    parser.add_argument("--openai-url", action="append", default=[], help="a vLLM/SGLang")
    parser.add_argument("--openai-model", default="", help="model name the OpenAI replicas serve")
    parser.add_argument(
        "--openai-kv-events",
        action="append",
        default=[],
        help="a vLLM server's ZMQ KV-events endpoint, per --openai-url in order ('-': none)",
    )
    parser.add_argument(
        "--prefill-engine-url", action="append", default=[], help="a once engine --role prefill"
    )
    parser.add_argument(
        "--prefill-openai-url", action="append", default=[], help="a vLLM prefill instance"
    )
    parser.add_argument("--pd-min-uncached-tokens", type=int, default=2048)
    parser.add_argument("--pd-min-decoding", type=int, default=1)
    parser.add_argument("--pd-max-slowdown", type=float, default=1.5)
    parser.add_argument("--pd-ttft-budget", type=float, default=0.0, help="seconds")
    parser.add_argument("--policy", default="once", choices=sorted(POLICIES))
    parser.add_argument(
        "--policy-param",
        action="append",
        default=[],
        type=parse_policy_param,
        help="NAME=VALUE passed to the policy, e.g. cache_threshold=0.5",
    )
    parser.add_argument("--block-size", type=int, default=None, help="default: vLLM's, or 16")
    parser.add_argument(
        "--kv-blocks", type=int, default=None, help="per replica (default: vLLM's, or 2000)"
    )
    parser.add_argument("--first-delta-timeout", type=float, default=None)
    parser.add_argument("--delta-timeout", type=float, default=None)
    parser.add_argument("--health-interval", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--served-model-name", default="once-router")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    return parser


def build_router(args: argparse.Namespace) -> Router:
    if not args.engine_url and not args.openai_url:
        raise ValueError("give at least one replica (--engine-url or --openai-url)")
    if (args.openai_url or args.prefill_openai_url) and not args.openai_model:
        raise ValueError("--openai-url needs --openai-model")
    if len(args.openai_kv_events) > len(args.openai_url):
        raise ValueError("give at most one --openai-kv-events per --openai-url")
    block_size, kv_blocks = kv_layout(args)
    config = RouterConfig(
        policy=args.policy,
        policy_params=dict(args.policy_param),
        block_size=block_size,
        first_delta_timeout_s=args.first_delta_timeout,
        delta_timeout_s=args.delta_timeout,
        health_interval_s=args.health_interval,
        seed=args.seed,
        pd_split=SplitPolicy(
            min_uncached_tokens=args.pd_min_uncached_tokens,
            min_decoding=args.pd_min_decoding,
            max_slowdown=args.pd_max_slowdown,
            ttft_budget_s=args.pd_ttft_budget,
        ),
    )
    clients: list[tuple[str, EngineClient]] = [
        (url, RemoteEngineClient(url)) for url in args.engine_url
    ]
    clients += [(url, OpenAICompletionsClient(url, args.openai_model)) for url in args.openai_url]
    events = [""] * len(args.engine_url) + [
        "" if endpoint == "-" else endpoint for endpoint in args.openai_kv_events
    ]
    roles = ["both"] * len(clients)
    clients += [(url, RemoteEngineClient(url)) for url in args.prefill_engine_url]
    clients += [
        (url, OpenAICompletionsClient(url, args.openai_model)) for url in args.prefill_openai_url
    ]
    roles += ["prefill"] * (len(clients) - len(roles))
    events += [""] * (len(clients) - len(events))
    replicas = [
        Replica(url, client, index=i, block_size=block_size, kv_blocks_total=kv_blocks,
                role=role, **event_index(endpoint))
        for i, ((url, client), role, endpoint)
        in enumerate(zip(clients, roles, events, strict=True))
    ]  # fmt: skip
    return Router(replicas, config)


def event_index(endpoint: str) -> dict:
    """A replica's exact index fed by its vLLM server's KV events, or nothing (approximate)."""
    if not endpoint:
        return {}
    return {
        "prefix_index": ExactPrefixIndex(rehash=True),  # vLLM hashes otherwise: re-derive
        "index_feed": functools.partial(zmq_event_subscriber, endpoint),
    }


def kv_layout(args: argparse.Namespace) -> tuple[int, int]:
    """(block size, KV blocks per replica): as given, else the first vLLM server's own."""
    block_size, kv_blocks = args.block_size, args.kv_blocks
    if (block_size is None or kv_blocks is None) and args.openai_url:
        try:
            reply = httpx.get(f"{args.openai_url[0].rstrip('/')}/metrics", timeout=30.0)
            metrics = parse_vllm_metrics(reply.text) if reply.status_code == 200 else None
        except httpx.HTTPError:
            metrics = None
        if metrics is not None:
            block_size = block_size or metrics.block_size
            kv_blocks = kv_blocks or metrics.num_blocks
    return block_size or 16, kv_blocks or 2000


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        router = build_router(args)
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2 and the usage line
    import uvicorn  # noqa: PLC0415 - only when serving

    from once.engine_http.server import build_engine_app  # noqa: PLC0415
    from once.heap import freeze_startup_heap  # noqa: PLC0415

    app = build_engine_app(router, model_name=args.served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await router.start()  # KV-event feeds and health from the start
        try:
            yield
        finally:
            await router.aclose()

    app.router.lifespan_context = lifespan
    freeze_startup_heap()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
