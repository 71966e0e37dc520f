"""What the input safety check adds to time-to-first-token when it runs beside prefill.

Requests are new items of recorded mini-swe-agent calls (real agent text). The engine is
scripted with a prefill time longer than the check (a sleep: on a GPU server prefill
leaves the gateway's CPU free, which a sleep models and this 2-core CPU box running the
real engine would not). TTFT is measured at the gateway's event stream (first
`response.output_text.delta`) with the default model classifier on, under the `hold`
policy (output released only after the check passes), and off. The figure:
(median TTFT on - median TTFT off) / the classifier's standalone median time.
"""

import asyncio
import statistics
import time

from once.bench.payloads import session_requests
from once.bench.traces import MINI_SWE_AGENT, load_sessions
from once.engine.embedding import SentenceEmbedder, limit_this_thread_to_one_core
from once.gateway.app import create_gateway
from once.gateway.config import GatewayConfig
from once.gateway.safety.checker import build_safety_checker, time_standalone
from once.gateway.testing import prepare_request, response_events
from once.protocol.responses import message_text
from once.protocol.scripted_engine import ScriptedEngine


def sample_requests(num: int) -> list[dict]:
    """Single-turn requests whose input is the new user item of recorded calls."""
    bodies = []
    for session in load_sessions(source=MINI_SWE_AGENT, limit=8):
        for request, _ in session_requests(session)[1:]:
            item = request["input"][-1]
            text = message_text(item) if item.get("type", "message") == "message" else ""
            if text:
                bodies.append({"model": request["model"], "input": text[:4000], "store": False})
        if len(bodies) >= num:
            break
    return bodies[:num]


async def _ttfts(gateway, bodies) -> list[float]:
    ttfts = []
    for body in bodies:
        started = time.perf_counter()
        prepared = await prepare_request(gateway, body)
        first = None
        async for event in response_events(gateway, prepared):
            if first is None and event["type"] == "response.output_text.delta":
                first = time.perf_counter() - started
        ttfts.append(first if first is not None else float("nan"))
    return ttfts


async def measure(runtime, num_requests: int = 12) -> dict:
    from dataclasses import replace

    bodies = sample_requests(num_requests)
    checker = build_safety_checker(
        {"policy": "hold", "classifiers": ["embedding"]},
        embedder_factory=SentenceEmbedder,
        worker_initializer=limit_this_thread_to_one_core,
    )
    if checker is None:
        raise RuntimeError("the safety config above names a classifier: a checker is built")
    texts = [[b["input"]] for b in bodies]
    standalone = statistics.median([await time_standalone(checker, t, repeats=3) for t in texts])
    prefill_s = max(0.2, 3 * standalone)  # every prefill outlasts the check
    eos = runtime.tokenizer.eos_token_id
    output = runtime.builder.encode("Let me look at the repository first.") + [eos]
    results = {}
    for name, safety in (("off", None), ("on", checker)):
        engine = ScriptedEngine(lambda r: output, eos_token_id=eos, ttft_s=prefill_s)
        model = replace(runtime, safety=safety)
        gateway = create_gateway(GatewayConfig(store="memory"), engine, {runtime.name: model})
        await _ttfts(gateway, bodies[:2])  # warm
        results[name] = await _ttfts(gateway, bodies)
        await gateway.close()
    added = statistics.median(results["on"]) - statistics.median(results["off"])
    return {
        "requests": len(bodies),
        "policy": "hold",
        "classifier_standalone_ms": 1000 * standalone,
        "scripted_prefill_ms": 1000 * prefill_s,
        "ttft_off_ms_p50": 1000 * statistics.median(results["off"]),
        "ttft_on_ms_p50": 1000 * statistics.median(results["on"]),
        "safety_ttft_added_ms": 1000 * added,
        "safety_ttft_added_fraction": added / standalone,
    }


def run(runtime, num_requests: int = 12) -> dict:
    return asyncio.run(measure(runtime, num_requests))
