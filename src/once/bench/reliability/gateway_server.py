"""The gateway process of the load and rejection measurements, around a scripted engine.

    python -m once.bench.reliability.gateway_server --port N [--token-rate 50]

Every response is the same `--output-tokens` ids (ended with eos), streamed at
`--token-rate` tokens per second per response, so the engine's cost is fixed and known and
everything else the process spends is the gateway's. The engine keeps no history and a
bounded prefix cache, so nothing in the process grows with the requests it served unless
the gateway itself keeps it. SIGUSR1 runs a full garbage collection: the load client
sends it before reading the process's memory, so a checkpoint does not count garbage a
collection has not reached yet.
"""

import argparse
import gc
import signal

import uvicorn

from once.bench.gateway_bench.scripted_server import MODEL, output_ids
from once.engine.loader import resolve_model_path
from once.heap import freeze_startup_heap, keep_freed_memory
from once.protocol.scripted_engine import ScriptedEngine

# The engine's prefix cache: enough blocks for every session of a load run to hit its
# prefix, bounded so the engine's memory is flat once it is full.
MAX_CACHED_BLOCKS = 50_000


def build_app(token_rate: float, num_output_tokens: int, max_model_len: int):
    from once.gateway.app import build_gateway_app, create_gateway
    from once.gateway.config import GatewayConfig
    from once.gateway.model import ModelRuntime
    from once.protocol.responses import warm_up

    runtime = ModelRuntime.load(MODEL, resolve_model_path(MODEL), max_model_len=max_model_len)
    eos = runtime.tokenizer.eos_token_id
    ids = output_ids(runtime.builder, eos)[: num_output_tokens - 1] + [eos]
    engine = ScriptedEngine(
        lambda request: ids,
        eos_token_id=eos,
        token_latency_s=1 / token_rate if token_rate > 0 else 0.0,
        ttft_s=1 / token_rate if token_rate > 0 else 0.0,
        max_model_len=max_model_len,
        max_cached_blocks=MAX_CACHED_BLOCKS,
        keep_history=False,
    )
    warm_up()
    config = GatewayConfig.load(store="memory", verify_every=32)
    return build_gateway_app(create_gateway(config, engine, {MODEL: runtime})), config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-rate", type=float, default=50.0, help="tokens/s a response")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=8192, help="SmolLM2's: 8192")
    args = parser.parse_args()
    keep_freed_memory()  # as `once serve` does
    app, config = build_app(args.token_rate, args.output_tokens, args.max_model_len)
    signal.signal(signal.SIGUSR1, lambda signum, frame: gc.collect())
    freeze_startup_heap()  # as `once serve` does
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        ws_max_size=config.max_body_bytes,  # as `once serve`: a frame may be as big as a body
    )


if __name__ == "__main__":
    main()
