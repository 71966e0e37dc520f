"""once: the command line. The only module that wires layers together."""

import argparse
import sys


def _engine_config(args):
    from once.engine.config import EngineConfig

    return EngineConfig.from_env(
        model=args.model,
        device=args.device,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False if args.no_prefix_caching else None,
        num_threads=args.threads,
    )


def _add_engine_flags(parser):
    parser.add_argument("--model", default=None, help="model name, HF folder or .gguf file")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-gib", type=float, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--threads", type=int, default=None)


def cmd_model(args) -> int:
    from once.engine.loader import pull_default_model, resolve_model_path

    path = pull_default_model() if args.action == "pull" else resolve_model_path(args.name)
    print(path)
    return 0


def cmd_engine(args) -> int:
    import uvicorn

    from once.engine.async_engine import AsyncEngine
    from once.engine.server import build_engine_app

    config = _engine_config(args)
    engine = AsyncEngine.from_config(config)
    app = build_engine_app(engine, model_name=config.model)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_run(args) -> int:
    from dataclasses import replace

    from once.bench.session_run import pick_session, plan_session, print_report, run_plans
    from once.engine.core import LLMEngine
    from once.engine.loader import load_tokenizer

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

        return bench_main(rest)
    return 2


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

    bench = sub.add_parser("bench", help="benchmarks (see `once bench engine --help`)")
    bench.add_argument("target", choices=["engine"])

    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    handlers = {"model": cmd_model, "engine": cmd_engine, "run": cmd_run}
    try:
        return handlers[args.command](args)
    except Exception as exc:
        from once.protocol.errors import OnceError

        if isinstance(exc, OnceError):
            print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
