"""A server process for the overhead benchmark: the gateway, or the bare engine server,
each around a scripted engine at zero latency (so all measured time is the serving stack).

    python -m once.bench.gateway_bench.scripted_server --mode gateway|engine --port N
"""

import argparse

import uvicorn

from once.engine.loader import resolve_model_path
from once.engine.scripted import ScriptedEngine
from once.heap import freeze_startup_heap

MODEL = "smollm2-135m-instruct"
OUTPUT_TOKENS = 128
OUTPUT_TEXT = (
    "I will look at the failing test first, then read the module it imports and compare "
    "the expected value with what the function returns. After that I will run the test "
    "suite again to check that nothing else broke, and finally I will summarize the fix "
    "for the reviewer with the exact commands I ran and their output. Café ☕ done."
)


def output_ids(builder, eos_id: int) -> list[int]:
    ids = builder.encode(OUTPUT_TEXT * 4)[: OUTPUT_TOKENS - 1]
    return ids + [eos_id]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["gateway", "engine"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tls-certfile", default=None)
    parser.add_argument("--tls-keyfile", default=None)
    args = parser.parse_args()

    from once.gateway.model import ModelRuntime

    runtime = ModelRuntime.load(MODEL, resolve_model_path(MODEL), max_model_len=8192)
    eos = runtime.tokenizer.eos_token_id
    ids = output_ids(runtime.builder, eos)
    engine = ScriptedEngine(lambda request: ids, eos_token_id=eos)
    if args.mode == "engine":
        from once.engine_http.server import build_engine_app

        app = build_engine_app(engine, model_name=MODEL)
    else:
        from once.gateway.app import build_gateway_app, create_gateway
        from once.gateway.config import GatewayConfig
        from once.protocol.responses import warm_up

        warm_up()
        config = GatewayConfig.load(store="memory", verify_every=0)
        app = build_gateway_app(create_gateway(config, engine, {MODEL: runtime}))
    freeze_startup_heap()  # as `once serve` and `once engine` do
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        ssl_certfile=args.tls_certfile,
        ssl_keyfile=args.tls_keyfile,
    )


if __name__ == "__main__":
    main()
