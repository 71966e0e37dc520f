"""A client gone mid-response leaves no task pending to be destroyed (issue 33).

`Task was destroyed but it is pending!` appeared after disconnects: while the input check
ran, the generation waited for the next delta in a task of its own (the queue's getter,
raced against the check); a response cancelled there left that task waiting on a queue
nothing else held, and the garbage collector destroyed it pending. asyncio reports that
through the loop's exception handler, which this test records.
"""

import asyncio
import gc
from dataclasses import replace

from prometheus_client import CollectorRegistry

from once.gateway.app import create_gateway
from once.gateway.config import GatewayConfig
from once.gateway.safety.checker import SafetyChecker
from once.gateway.testing import prepare_request, response_events
from tests.gateway.conftest import MODEL, scripted_texts
from tests.gateway.test_safety_pipeline import SleepyClassifier

REPLY = " ".join(f"word{i}" for i in range(40))


async def test_a_response_cancelled_while_the_check_runs_leaves_no_pending_task(runtime):
    loop = asyncio.get_running_loop()
    reports: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda loop, context: reports.append(context))
    try:
        engine = scripted_texts(runtime, [REPLY], token_latency_s=0.5)
        model = replace(runtime, safety=SafetyChecker([SleepyClassifier(60.0)], policy="stream"))
        config = GatewayConfig(store="memory")
        pipeline = create_gateway(config, engine, {MODEL: model}, CollectorRegistry())
        prepared = await prepare_request(pipeline, {"model": MODEL, "input": "Hi."})
        first_text = asyncio.Event()

        async def client() -> None:
            async for event in response_events(pipeline, prepared):
                if event["type"] == "response.output_text.delta":
                    first_text.set()

        task = asyncio.create_task(client())
        async with asyncio.timeout(30):
            await first_text.wait()
        await asyncio.sleep(0.1)  # waiting for the next delta, the check still running
        task.cancel()  # the client's connection is gone
        await asyncio.gather(task, return_exceptions=True)
        del task
        for _ in range(5):
            await asyncio.sleep(0.05)
            gc.collect()
        await pipeline.close()
    finally:
        loop.set_exception_handler(previous)
    destroyed = [c for c in reports if "destroyed but it is pending" in str(c.get("message"))]
    assert destroyed == []
