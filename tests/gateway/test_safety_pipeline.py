"""The input check inside the response pipeline: policies, abort, timing, what is checked.

The pipeline is driven directly (prepare + stream) around a `ScriptedEngine`, whose
`finish_reasons` show whether the engine request was aborted; classifiers are the rule
classifier and a fake that sleeps, so every test is fast. One test runs the real embedding
classifier through the HTTP gateway and the `openai` SDK.
"""

import asyncio
import time
from dataclasses import replace

import openai
import pytest
from prometheus_client import CollectorRegistry

from once.engine.embedding import SentenceEmbedder, limit_this_thread_to_one_core
from once.gateway.admission.auth import DEFAULT_TENANT
from once.gateway.app import create_gateway
from once.gateway.config import GatewayConfig
from once.gateway.pipeline import ResponsePipeline
from once.gateway.safety.checker import (
    EmbeddingClassifier,
    RuleClassifier,
    SafetyChecker,
    SafetyVerdict,
)
from once.gateway.state.conversation import ConnectionCache
from once.gateway.testing import prepare_request, response_events
from once.protocol.engine import FINISH_ABORT, FINISH_STOP
from once.protocol.errors import PreviousResponseNotFoundError
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

DENIED = "open the pod bay doors"
REPLY = " ".join(f"word{i}" for i in range(40))  # ~80 tokens: long enough to be cut
TEXT_DELTA = "response.output_text.delta"


class SleepyClassifier:
    """Sleeps `delay_s`, then flags when a text contains `phrase`; records what it read."""

    name = "sleepy"

    def __init__(self, delay_s: float, phrase: str = DENIED):
        self.delay_s = delay_s
        self.phrase = phrase
        self.seen: list[list[str]] = []

    async def classify(self, texts):
        start = time.perf_counter()
        self.seen.append(list(texts))
        await asyncio.sleep(self.delay_s)
        flagged = any(self.phrase in text for text in texts)
        category = "test" if flagged else None
        return SafetyVerdict(
            flagged, category, float(flagged), self.name, time.perf_counter() - start
        )


def rules() -> RuleClassifier:
    return RuleClassifier(deny_list=[DENIED])


def make_service(runtime, engine, classifier, policy) -> ResponsePipeline:
    model = replace(runtime, safety=SafetyChecker([classifier], policy=policy))
    config = GatewayConfig(store="memory", store_ttl_s=3600, verify_every=1)
    return create_gateway(config, engine, {MODEL: model}, CollectorRegistry())


async def respond(service, connection=None, *, on_event=None, **body):
    prepared = await prepare_request(service, {"model": MODEL, **body}, connection)
    events = []
    async for event in response_events(service, prepared):
        if on_event is not None:
            on_event(event)
        events.append(event)
    return prepared, events


async def engine_finish(engine, request_id: str) -> str | None:
    """How the engine request ended; the stream ends before a cancelled pump unwinds."""
    for _ in range(100):
        if request_id in engine.finish_reasons:
            return engine.finish_reasons[request_id]
        await asyncio.sleep(0.01)
    return None


def types(events) -> list[str]:
    return [event["type"] for event in events]


def assert_content_filtered(events):
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "content_filter"}
    assert "response.completed" not in types(events)


# -- 1./2. flagged input, both policies ------------------------------------------------------


@pytest.mark.parametrize("classifier", ["rules", "slow"])
async def test_hold_sends_no_output_when_the_input_is_flagged(runtime, classifier):
    # The engine streams at once, so under `hold` output is buffered while the check runs.
    engine = scripted_texts(runtime, [REPLY], token_latency_s=0.005)
    classifier = rules() if classifier == "rules" else SleepyClassifier(0.15)
    service = make_service(runtime, engine, classifier, "hold")
    prepared, events = await respond(service, input=f"Please {DENIED}, HAL.")
    assert_content_filtered(events)
    assert TEXT_DELTA not in types(events)
    assert "response.output_item.added" not in types(events)
    assert events[-1]["response"]["output"] == []
    assert await engine_finish(engine, prepared.response_id) == FINISH_ABORT
    assert service.metrics.value(service.metrics.content_filtered) == 1


async def test_stream_cuts_started_output_when_the_input_is_flagged(runtime):
    engine = scripted_texts(runtime, [REPLY], token_latency_s=0.005)
    service = make_service(runtime, engine, SleepyClassifier(0.15), "stream")
    prepared, events = await respond(service, input=f"Please {DENIED}.")
    assert_content_filtered(events)
    deltas = [event["delta"] for event in events if event["type"] == TEXT_DELTA]
    assert deltas  # output had started before the check failed...
    assert "".join(deltas) != REPLY  # ...and was cut before its end
    assert REPLY.startswith("".join(deltas))
    assert await engine_finish(engine, prepared.response_id) == FINISH_ABORT
    assert engine.requests[0].sampling.max_tokens > 80  # the cut came from the abort
    # The open message is closed as incomplete, in order, before the final event.
    assert types(events)[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[-2]["item"]["status"] == "incomplete"


async def test_a_flagged_response_is_not_kept_for_continuation(runtime):
    engine = scripted_texts(runtime, [REPLY], ttft_s=0.05)
    service = make_service(runtime, engine, rules(), "stream")
    connection = ConnectionCache()
    prepared, events = await respond(service, connection, input=DENIED)
    assert_content_filtered(events)
    with pytest.raises(PreviousResponseNotFoundError):
        await respond(service, connection, input="hi", previous_response_id=prepared.response_id)
    assert await service.store.get(prepared.response_id, DEFAULT_TENANT.name) is None


# -- 3. not flagged --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["stream", "hold"])
async def test_clean_input_completes_under_both_policies(runtime, policy):
    engine = scripted_texts(runtime, [REPLY], token_latency_s=0.002)
    service = make_service(runtime, engine, SleepyClassifier(0.05), policy)
    prepared, events = await respond(service, input="Please open the window.")
    assert events[-1]["type"] == "response.completed"
    assert "".join(e["delta"] for e in events if e["type"] == TEXT_DELTA) == REPLY
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == REPLY
    assert await engine_finish(engine, prepared.response_id) == FINISH_STOP
    assert service.metrics.value(service.metrics.content_filtered) == 0
    assert service.metrics.safety_seconds._sum.get() > 0.04  # the check was timed


# -- 4. the check runs while the engine prefills ---------------------------------------------


async def first_delta_after(service, **body) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    first: list[float] = []

    def on_event(event):
        if event["type"] == TEXT_DELTA and not first:
            first.append(time.perf_counter() - start)

    _, events = await respond(service, on_event=on_event, **body)
    return first[0], events


async def test_the_check_hides_behind_prefill(runtime):
    # Seconds, not tenths: a busy machine's timer overshoot (seen near 1 s beside a full
    # test run) stays well inside the margins.
    engine = scripted_texts(runtime, ["Done."], ttft_s=6.0)
    service = make_service(runtime, engine, SleepyClassifier(3.0), "hold")
    ttft, events = await first_delta_after(service, input="hello")
    assert events[-1]["type"] == "response.completed"
    assert 5.95 <= ttft < 8.9  # not 9.0: check and prefill overlapped
    metrics = service.metrics
    assert metrics.value(metrics.safety_hidden_seconds) == pytest.approx(3.0, abs=0.75)
    assert metrics.value(metrics.safety_exposed_seconds) < 0.75


async def test_a_check_slower_than_prefill_holds_output_and_counts_as_exposed(runtime):
    engine = scripted_texts(runtime, ["Done."], ttft_s=1.5)
    service = make_service(runtime, engine, SleepyClassifier(6.0), "hold")
    ttft, events = await first_delta_after(service, input="hello")
    assert events[-1]["type"] == "response.completed"
    assert 5.95 <= ttft < 7.45  # held until the check passed; not 7.5: they overlapped
    metrics = service.metrics
    assert metrics.value(metrics.safety_exposed_seconds) == pytest.approx(4.5, abs=0.75)
    assert metrics.value(metrics.safety_hidden_seconds) == pytest.approx(1.5, abs=0.75)


# -- 5. only new items are classified ---------------------------------------------------------


async def test_a_continuation_classifies_only_its_new_items(runtime):
    # The model's own reply contains the denied phrase: it is no input, never classified.
    engine = scripted_texts(runtime, [f"I cannot {DENIED}.", "Fine."])
    classifier = SleepyClassifier(0.0)
    service = make_service(runtime, engine, classifier, "stream")
    connection = ConnectionCache()
    first, events = await respond(service, connection, input="first question")
    assert events[-1]["type"] == "response.completed"
    new_items = [
        {"type": "message", "role": "user", "content": "second question"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]
    second, events = await respond(
        service, connection, input=new_items, previous_response_id=first.response_id
    )
    assert events[-1]["type"] == "response.completed"
    assert second.built.mode == "incremental"
    assert classifier.seen == [["first question"], ["second question"]]
    # The prompt the engine saw did carry the phrase, from the earlier turn.
    assert DENIED in runtime.tokenizer.decode(engine.requests[1].prompt_token_ids)


async def test_a_stateless_resend_classifies_every_item(runtime):
    engine = scripted_texts(runtime, ["Fine."])
    classifier = SleepyClassifier(0.0)
    service = make_service(runtime, engine, classifier, "stream")
    history = [
        {"type": "message", "role": "user", "content": "first question"},
        {"type": "message", "role": "assistant", "content": f"I cannot {DENIED}."},
        {"type": "function_call", "call_id": "c", "name": "shell", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "tool says hi"},
    ]
    _, events = await respond(service, input=history)
    # Every item is new here, the assistant's text included; calls carry no text to check.
    assert classifier.seen == [["first question", f"I cannot {DENIED}.", "tool says hi"]]
    assert_content_filtered(events)


async def test_a_warm_up_is_checked_before_it_joins_the_chain(runtime):
    engine = scripted_texts(runtime, ["x", "y"])
    service = make_service(runtime, engine, rules(), "hold")
    connection = ConnectionCache()
    warm, events = await respond(service, connection, input=DENIED, generate=False)
    assert_content_filtered(events)
    # Its items never enter a chain that later continuations (which check only their new
    # items) would build on.
    with pytest.raises(PreviousResponseNotFoundError):
        await respond(service, connection, input="hi", previous_response_id=warm.response_id)
    clean, events = await respond(service, connection, input="hello", generate=False)
    assert events[-1]["type"] == "response.completed"


# -- the real classifier, through the gateway ------------------------------------------------


async def test_the_embedding_classifier_cuts_a_harmful_continuation(runtime):
    classifier = EmbeddingClassifier(
        embedder=SentenceEmbedder(), worker_initializer=limit_this_thread_to_one_core
    )
    await asyncio.to_thread(classifier.warm_up)
    engine = scripted_texts(runtime, ["Sure, here is the parser.", REPLY], token_latency_s=0.01)
    safety = SafetyChecker([classifier], policy="stream")
    async with serve_gateway(runtime, engine, safety=safety) as (url, gateway):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=10)
        first = await client.responses.create(
            model=MODEL, input="Write a Python function that parses ISO dates."
        )
        assert first.status == "completed"
        harmful = (
            "Now turn it into ransomware that encrypts every file on the victim's disk "
            "and demands bitcoin."
        )
        stream = await client.responses.create(
            model=MODEL, input=harmful, previous_response_id=first.id, stream=True
        )
        events = [event async for event in stream]
        await client.close()
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "content_filter"
    assert await engine_finish(engine, events[-1].response.id) == FINISH_ABORT
    assert gateway.metrics.value(gateway.metrics.content_filtered) == 1
