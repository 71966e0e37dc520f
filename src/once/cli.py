"""once: the command line. The only module that wires layers together."""

import argparse
import sys

# On SIGTERM (or ^C) the servers stop taking connections, give the requests in flight this
# long, then cancel them, which aborts their engine requests. uvicorn's default waits for
# every open connection: a busy `once serve` outlived its SIGTERM by minutes (issue 33).
SHUTDOWN_GRACE_S = 3


def _engine_config(args):
    """The engine's config from flags and ONCE_ENGINE_* variables; a bad value (say, in
    the environment, which argparse never sees) is a one-line error, not a traceback."""
    from once.engine.config import EngineConfig

    try:
        return EngineConfig.from_env(
            model=args.model,
            device=args.device,
            max_model_len=args.max_model_len,
            kv_cache_gib=args.kv_cache_gib,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_waiting=args.max_num_waiting,
            enable_prefix_caching=False if args.no_prefix_caching else None,
            num_threads=args.threads,
            slowdown=args.slowdown,
            speculative_method=args.speculative_method,
            num_speculative_tokens=args.num_speculative_tokens,
            draft_model=args.draft_model,
            kv_events_endpoint=args.kv_events_endpoint,
            speculative_adaptive=True if args.speculative_adaptive else None,
            cpu_gemm=args.cpu_gemm,
            weights=args.weights,
            rope_scaling=args.rope_scaling,
            kv_host_blocks=args.kv_host_blocks,
            kv_disk_path=args.kv_disk_path,
            kv_disk_gib=args.kv_disk_gib,
            kv_shared_url=args.kv_shared_url,
            kv_offload=args.kv_offload,
            kv_eviction=args.kv_eviction,
            kv_host_eviction=args.kv_host_eviction,
            kv_pause_keep_s=args.kv_pause_keep_s,
            kv_pause_hints=True if args.kv_pause_hints else None,
            role=args.role,
            kv_transfer=args.kv_transfer,
            kv_transfer_host=args.kv_transfer_host,
            kv_transfer_port=args.kv_transfer_port,
            kv_transfer_blocks=args.kv_transfer_blocks,
        )
    except ValueError as exc:
        raise SystemExit(f"once: error: bad engine setting: {exc}") from None


def _slowdown(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 1.0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1.0, got {text}")
    return value


def _add_engine_flags(parser):
    from once.engine.config import CPU_GEMMS, ONLINE_EVICTION_POLICIES, WEIGHT_FORMATS

    parser.add_argument("--model", default=None, help="model name, HF folder or .gguf file")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--rope-scaling",
        default=None,
        help='the model\'s rope_scaling replaced, JSON (e.g. {"rope_type": "yarn", '
        '"factor": 4.0, "original_max_position_embeddings": 8192} to serve past its '
        "trained context)",
    )
    parser.add_argument("--kv-cache-gib", type=float, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--max-num-waiting", type=int, default=None, help="queued requests before 503 (0: any)"
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--slowdown",
        type=_slowdown,
        default=None,
        help="run the engine at 1/X speed (X >= 1; a throttled replica for routing tests)",
    )
    parser.add_argument(
        "--speculative-method",
        choices=["ngram", "suffix", "draft"],
        default=None,
        help="speculative decoding's drafter (default: off)",
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=None)
    parser.add_argument("--draft-model", default=None, help='the draft model of method "draft"')
    parser.add_argument(
        "--speculative-adaptive",
        action="store_true",
        help="draft only as many ids per step as pay for their rows (speculative/governor.py)",
    )
    parser.add_argument(
        "--cpu-gemm",
        choices=CPU_GEMMS,
        default=None,
        help="CPU fp32 matmuls: oneDNN over packed weights (default) or torch's own",
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default=None,
        help="matmul weights: fp32 as loaded (default) or q8_0, llama.cpp's 8-bit blocks",
    )
    tiers = parser.add_argument_group("KV tiers below the device pool (off by default)")
    tiers.add_argument("--kv-host-blocks", type=int, default=None, help="L2: host-memory slots")
    tiers.add_argument("--kv-disk-path", default=None, help="L3: a folder for KV block files")
    tiers.add_argument("--kv-disk-gib", type=float, default=None, help="L3's bound (8)")
    tiers.add_argument("--kv-shared-url", default=None, help="L4: redis://... shared by replicas")
    tiers.add_argument(
        "--kv-offload",
        choices=["write_through", "write_back"],
        default=None,
        help="blocks go down as they fill (default) or as they are evicted",
    )
    pd = parser.add_argument_group("prefill/decode disaggregation (off by default)")
    pd.add_argument(
        "--role",
        choices=["both", "prefill", "decode"],
        default=None,
        help="prefill: prompts only, KV kept for a decode engine; decode: loads it (both)",
    )
    pd.add_argument(
        "--kv-transfer", choices=["shm", "tcp"], default=None,
        help="a prefill engine's KV store: shared memory on this host (default) or TCP",
    )  # fmt: skip
    pd.add_argument("--kv-transfer-host", default=None, help="tcp: the store's address")
    pd.add_argument("--kv-transfer-port", type=int, default=None, help="tcp: 0 picks one")
    pd.add_argument(
        "--kv-transfer-blocks", type=int, default=None, help="the store's bound (2x the pool)"
    )
    cache = parser.add_argument_group("KV eviction and session pause hints")
    for flag, where in (("--kv-eviction", "the device pool"), ("--kv-host-eviction", "L2")):
        cache.add_argument(
            flag, choices=ONLINE_EVICTION_POLICIES, default=None, help=f"{where}'s policy (lru)"
        )
    cache.add_argument(
        "--kv-pause-hints",
        action="store_true",
        help="act on the sessions' tool pause hints (off: they are counted and ignored)",
    )
    cache.add_argument(
        "--kv-pause-keep-s",
        type=float,
        default=None,
        help="a session pause hinted up to this long keeps its blocks in the pool (10)",
    )
    parser.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish KV events over ZMQ as vLLM does (e.g. tcp://127.0.0.1:5557)",
    )


def cmd_model(args) -> int:
    from once.engine.loader import pull_default_model, resolve_model_path

    path = pull_default_model() if args.action == "pull" else resolve_model_path(args.name)
    print(path)
    return 0


def cmd_engine(args) -> int:
    import uvicorn

    from once.engine.async_engine import AsyncEngine
    from once.engine_http.server import build_engine_app
    from once.heap import freeze_startup_heap

    config = _engine_config(args)
    engine = AsyncEngine.from_config(config)
    app = build_engine_app(engine, model_name=config.model)
    freeze_startup_heap()
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    return 0


def _gateway_config(args):
    from once.gateway.config import GatewayConfig

    overrides = dict(
        host=args.host,
        port=args.port,
        model=args.model,
        engine_url=args.engine_url,
        openai_url=args.openai_url,
        openai_model=args.openai_model,
        max_model_len=args.max_model_len,
        api_keys_file=args.api_keys,
        store=args.store,
        tls_certfile=args.tls_certfile,
        tls_keyfile=args.tls_keyfile,
        keep_alive_s=args.keep_alive_s,
    )
    config = GatewayConfig.load(args.config, **overrides)
    if args.no_safety:
        return _replace(config, safety={})
    if args.safety_policy or not config.safety:
        safety = dict(config.safety) or {"classifiers": ["embedding"]}
        safety["policy"] = args.safety_policy or safety.get("policy", "stream")
        config = _replace(config, safety=safety)
    return config


def _replace(config, **changes):
    from dataclasses import replace

    return replace(config, **changes)


def build_gateway(config, engine_config, registry=None):
    """The wiring of `once serve`: an engine client, the served model, the gateway.

    With a remote engine nothing here imports torch (tests/test_torch_free.py), unless the
    model's GGUF still has to be converted or the embedding safety classifier is on: both
    run a torch model."""
    from once.gateway.app import create_gateway
    from once.gateway.model import ModelRuntime
    from once.gateway.safety.checker import build_safety_checker
    from once.protocol import responses

    if config.engine_url or config.openai_url:
        engine, folder, max_len = _remote_engine(config)
    else:
        from once.engine.async_engine import AsyncEngine

        engine = AsyncEngine.from_config(engine_config)
        folder, max_len = engine.engine.model_path, engine.engine.max_model_len
    from once.engine.embedding import SentenceEmbedder, limit_this_thread_to_one_core

    safety = build_safety_checker(
        config.safety,
        embedder_factory=SentenceEmbedder,
        worker_initializer=limit_this_thread_to_one_core,
    )
    if safety is not None:
        safety.warm_up()
    model = ModelRuntime.load(config.model, folder, max_len, safety=safety)
    responses.warm_up()
    return create_gateway(config, engine, {config.model: model}, registry)


def _remote_engine(config):
    """The engine client, model folder and context length of a gateway whose engine is a
    server: a `once engine` or router (`engine_url`), or vLLM (`openai_url`, sent token
    ids, its context length and served name read from its /v1/models)."""
    from once.engine.models.config import ModelConfig
    from once.model_files import locate_model, read_hf_config

    location = locate_model(config.model)
    if location.converted:
        folder = location.folder
    else:
        from once.engine.loader import resolve_model_path  # converts the GGUF: torch

        folder = resolve_model_path(config.model)
    max_len = config.max_model_len
    if config.openai_url:
        from once.router.openai_replica import OpenAICompletionsClient, served_model

        name, served_len = served_model(config.openai_url, config.openai_model)
        engine = OpenAICompletionsClient(config.openai_url, name)
        max_len = max_len or served_len
    else:
        from once.engine_http.client import RemoteEngineClient

        engine = RemoteEngineClient(config.engine_url)
    max_len = max_len or ModelConfig.from_hf(read_hf_config(folder)).max_position_embeddings
    return engine, folder, max_len


def cmd_serve(args) -> int:
    import uvicorn

    from once.gateway.app import build_gateway_app
    from once.heap import freeze_startup_heap, keep_freed_memory

    keep_freed_memory()  # large bodies reuse memory instead of faulting it in each time
    config = _gateway_config(args)
    gateway = build_gateway(config, _engine_config(args))
    scheme = "https" if config.tls_certfile else "http"
    print(f"once gateway: {scheme}://{config.host}:{config.port}/v1 serving {config.model}")
    app = build_gateway_app(gateway)
    freeze_startup_heap()
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        ws_max_size=config.max_body_bytes,
        ssl_certfile=config.tls_certfile,
        ssl_keyfile=config.tls_keyfile,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    return 0


def cmd_agent(args) -> int:
    import asyncio
    from collections.abc import Iterable
    from pathlib import Path

    from once.agent.session import AgentOptions, run_cli_session

    options = AgentOptions(
        base_url=args.base_url,
        api_key=args.api_key,
        model=args.model,
        transport=args.transport,
        approval=args.approval,
        workspace=Path(args.workspace).resolve(),
        max_steps=args.max_steps,
        max_output_tokens=args.max_output_tokens,
        code_mode=args.code_mode,
    )
    tasks: Iterable[str]
    if args.task:
        tasks = [args.task]
    else:  # interactive: one task per line, in one session
        tasks = (line.strip() for line in sys.stdin if line.strip())
    result = asyncio.run(run_cli_session(options, tasks, args.mcp))
    return 0 if result is None or result.stopped == "answer" else 3


def cmd_run(args) -> int:
    from dataclasses import replace

    from once.bench.session_run import pick_session, plan_session, print_report, run_plans
    from once.engine.core import LLMEngine
    from once.model_files import load_tokenizer

    config = _engine_config(args)
    engine = LLMEngine(config)
    tokenizer = load_tokenizer(engine.model_path)
    session = pick_session(args.source, args.session)
    plans = plan_session(session, tokenizer, engine.max_model_len, args.calls)
    print(
        f"engine: {engine.model_path.name}, {engine.pool.num_blocks} KV blocks of "
        f"{config.block_size} tokens; replaying {len(plans)} calls of {session.session_id}"
    )
    runs = {"once": run_plans(engine, plans, "once")}
    if args.compare_naive:
        naive = LLMEngine(replace(config, enable_prefix_caching=False))
        runs["naive"] = run_plans(naive, plans, "naive")
    print_report(session.session_id, runs)
    return 0


def cmd_bench(args, rest) -> int:
    if args.target == "engine":
        from once.bench.engine_bench import main as bench_main
    elif args.target == "agent":
        from once.bench.agent_bench.cli import main as bench_main
    elif args.target == "spec":
        from once.bench.spec_bench.cli import main as bench_main
    elif args.target == "clients":
        from once.bench.clients import main as bench_main
    elif args.target == "structured":
        from once.bench.engine_bench.structured import main as bench_main
    elif args.target == "reliability":
        from once.bench.reliability.cli import main as bench_main
    else:
        from once.bench.gateway_bench import main as bench_main
    return bench_main(rest)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="once", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="obtain or locate models")
    model.add_argument("action", choices=["pull", "path"])
    model.add_argument("name", nargs="?", default="smollm2-135m-instruct")

    engine = sub.add_parser("engine", help="serve the engine over HTTP (token ids in/out)")
    _add_engine_flags(engine)
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--port", type=int, default=8100)

    run = sub.add_parser("run", help="replay a recorded agent session; print the cache report")
    _add_engine_flags(run)
    run.add_argument("--source", default="mini-swe-agent")
    run.add_argument("--session", default="django__django-11179", help="id substring or index")
    run.add_argument("--calls", type=int, default=12)
    run.add_argument("--compare-naive", action="store_true", help="also run without the cache")

    serve = sub.add_parser("serve", help="the Responses API gateway (HTTP+SSE, WebSocket)")
    _add_engine_flags(serve)
    serve.add_argument("--config", default=None, help="TOML file with a [gateway] table")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--engine-url", default=None, help="a `once engine` or router instead")
    serve.add_argument("--openai-url", default=None, help="a vLLM server instead (token ids)")
    serve.add_argument("--openai-model", default=None, help="its served name (default: asked)")
    serve.add_argument("--api-keys", default=None, help="TOML file of API keys per tenant")
    serve.add_argument("--store", default=None, help="sqlite:///path.db | memory | redis://...")
    serve.add_argument("--safety-policy", choices=["stream", "hold"], default=None)
    serve.add_argument("--no-safety", action="store_true", help="no input safety check")
    serve.add_argument("--tls-certfile", default=None)
    serve.add_argument("--tls-keyfile", default=None)
    serve.add_argument(
        "--keep-alive-s",
        type=float,
        default=None,
        help="seconds of silence before a streamed response gets a keep-alive (default 10; 0: off)",
    )

    agent = sub.add_parser("agent", help="the coding agent (one task, or interactive)")
    agent.add_argument("task", nargs="?", help="the task; without it, one task per input line")
    agent.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    agent.add_argument("--api-key", default="unused")
    agent.add_argument("--model", default="smollm2-135m-instruct")
    agent.add_argument("--transport", choices=["ws", "http"], default="ws")
    modes = ["never", "on-request", "untrusted", "on-failure"]
    agent.add_argument("--approval", choices=modes, default="on-request")
    agent.add_argument("--workspace", default=".")
    agent.add_argument("--max-steps", type=int, default=30)
    agent.add_argument("--max-output-tokens", type=int, default=None)
    agent.add_argument("--code-mode", action="store_true", help="add the `code` tool (V8)")
    agent.add_argument(
        "--mcp", action="append", default=[], help="name=command args (stdio) or name=URL"
    )

    sub.add_parser("capacity", help="replicas and weights for a fleet (see --help)", add_help=False)
    sub.add_parser("sim", help="the cluster simulator on production traces", add_help=False)
    sub.add_parser("router", help="the cache-aware router over engine replicas", add_help=False)
    sub.add_parser(
        "fleet", help="gateway + router + N vLLM replicas from a fleet file", add_help=False
    )
    sub.add_parser("replay", help="replay recorded agent sessions: the ledger", add_help=False)
    sub.add_parser(
        "replay-failover", help="a session moved to another replica: KV it reloads", add_help=False
    )

    bench = sub.add_parser("bench", help="benchmarks (see `once bench engine --help`)")
    bench.add_argument(
        "target",
        choices=["engine", "gateway", "agent", "spec", "clients", "structured", "reliability"],
    )

    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(args, rest)
    if args.command == "replay":
        from once.bench.replay.cli import main as replay_main

        return replay_main(rest)
    if args.command == "replay-failover":
        from once.bench.replay.kv_failover import main as failover_main

        return failover_main(rest)
    if args.command == "router":
        from once.router.serve import main as router_main

        return router_main(rest)
    if args.command == "fleet":
        from once.fleet.cli import main as fleet_main

        return fleet_main(rest)
    if args.command == "sim":
        from once.sim import main as sim_main

        return sim_main(rest)
    if args.command == "capacity":
        from once.gateway.admission.capacity_plan import main as capacity_main

        return capacity_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    handlers = {
        "model": cmd_model,
        "engine": cmd_engine,
        "run": cmd_run,
        "serve": cmd_serve,
        "agent": cmd_agent,
    }
    try:
        return handlers[args.command](args)
    except Exception as exc:
        from once.engine.config import EngineSettingError
        from once.protocol.errors import OnceError

        if isinstance(exc, OnceError):
            print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
            return 1
        if isinstance(exc, EngineSettingError):
            raise SystemExit(f"once: error: {exc}") from None
        raise


if __name__ == "__main__":
    sys.exit(main())
