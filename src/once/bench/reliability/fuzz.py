"""The API fuzzed: every HTTP route of the gateway from its own OpenAPI document, and
WebSocket mode's `response.create` frames (fuzz_frames.py).

The gateway is the real one (uvicorn on a loopback port, on a thread and event loop of
its own) around a ScriptedEngine that answers every request (gateway/testing.py). HTTP
cases come from schemathesis's Hypothesis strategies for each operation: positive (valid
by the schema; half of them name the served model, so they get past model lookup and are
generated) and negative (each breaking the schema somewhere). Beside them go bodies no
schema describes (not JSON, not UTF-8, nested too deep, over the size limit, JSON that is
not an object) and every method a path does not take. Every answer is checked as the
contract test checks it: no 5xx; status, content type, body (each SSE event too) and
headers as documented; a 405 lists the methods its path takes.

The HTTP budget is shared among the operations by weight (the POST routes, whose bodies
are large, take more), in rounds: an operation whose cases run out (a route without
parameters has one) gives its share back to the others.
"""

import asyncio
import contextlib
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import requests as http
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.errors import UnsupportedSchema
from schemathesis.core.failures import FailureGroup, ServerError
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from once.bench.reliability.fuzz_frames import DocumentValidator, fuzz_websocket
from once.gateway.app import build_gateway_app, create_gateway
from once.gateway.config import GatewayConfig
from once.gateway.testing import cycling_texts, load_runtime, offline_hosted, serve_app

REQUEST_TIMEOUT_S = 30.0  # a hang guard: the scripted engine answers in milliseconds
START_TIMEOUT_S = 30.0
MAX_BODY_BYTES = 256 * 1024  # small, so an over-limit body is cheap to send
CONFIG = GatewayConfig(store="memory", verify_every=1, max_body_bytes=MAX_BODY_BYTES)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
POST_WEIGHT = 4  # a POST operation's share of the budget against a GET's or DELETE's
RAW_SHARE = 0.1  # of the budget: bodies no schema describes
MAX_EXAMPLES_KEPT = 12


@dataclass
class Tally:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    no_answer: int = 0  # the request failed on the wire or hit the hang guard
    schema_violations: int = 0
    unsupported_draws: int = 0  # case runs cut short by schemathesis's UnsupportedSchema
    examples: list[str] = field(default_factory=list)

    def answered(self, status: int) -> None:
        self.requests += 1
        self.statuses[status // 100] += 1

    def note(self, what: str) -> None:
        if len(self.examples) < MAX_EXAMPLES_KEPT:
            self.examples.append(what[:600])


@contextlib.contextmanager
def running_gateway(runtime) -> Iterator[str]:
    """The gateway on 127.0.0.1 in a thread of its own; yields its base URL."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def serve() -> None:
        stop = asyncio.Event()
        box["stop"], box["loop"] = stop, asyncio.get_running_loop()
        engine = cycling_texts(runtime)
        gateway = create_gateway(CONFIG, engine, {runtime.name: runtime}, hosted=offline_hosted())
        try:
            app = build_gateway_app(gateway)
            async with serve_app(app, ws_max_size=CONFIG.max_body_bytes) as (url, _):
                box["url"] = url
                ready.set()
                await stop.wait()
        finally:
            await gateway.close()

    def main() -> None:
        try:
            asyncio.run(serve())
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            box["error"] = e
        finally:
            ready.set()

    thread = threading.Thread(target=main, name="fuzz-gateway", daemon=True)
    thread.start()
    if not ready.wait(START_TIMEOUT_S) or "url" not in box:
        raise RuntimeError(f"the fuzzed gateway did not start: {box.get('error')!r}")
    try:
        yield box["url"]
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(START_TIMEOUT_S)


def served_model_bodies(model: str) -> Callable:
    def flatmap_body(context, body):
        if isinstance(body, dict) and "model" in body:
            return st.sampled_from([body, {**body, "model": model}])
        return st.just(body)

    return flatmap_body


UNSUPPORTED_RETRIES = 5


def run_cases(strategy, quota: int, seed: int, on_case: Callable) -> tuple[int, int]:
    """Draw up to `quota` cases from `strategy` (fewer when it runs out): how many ran,
    and how many draws were cut short.

    Schemathesis builds nested negative schemas lazily, and a few draws reach a `not` it
    cannot complement (UnsupportedSchema, which ends the whole run): the rest of the quota
    is then drawn under another seed, a few times at most."""
    ran = num_cut_short = 0

    def attempt(attempt_seed: int, attempt_quota: int) -> None:
        @hypothesis_seed(attempt_seed)
        @settings(
            max_examples=attempt_quota,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(strategy)
        def run(case) -> None:
            nonlocal ran
            if ran < quota:
                ran += 1
                on_case(case)

        run()

    for retry in range(UNSUPPORTED_RETRIES):
        try:
            attempt(seed + retry * 1_000_003, quota - ran)
        except Unsatisfiable:
            break  # no case of this kind exists (a negative case of a route without inputs)
        except UnsupportedSchema:
            num_cut_short += 1
            continue
        break
    return ran, num_cut_short


def send_case(case, session: http.Session, tally: Tally) -> None:
    try:
        response = case.call(session=session, timeout=REQUEST_TIMEOUT_S)
    except http.RequestException as e:
        tally.no_answer += 1
        tally.note(f"{case.operation.label}: no answer ({type(e).__name__})")
        return
    tally.answered(response.status_code)
    try:
        case.validate_response(response, checks=CHECKS)
    except FailureGroup as group:
        if any(not isinstance(failure, ServerError) for failure in group.exceptions):
            tally.schema_violations += 1
        tally.note(f"{case.operation.label} -> {response.status_code}: {group.exceptions[0]}")


def fuzz_operations(schema, budget: int, seed: int, send: Callable, tally: Tally) -> int:
    """Schemathesis cases for every operation, both modes, `budget` in all; how many."""
    plan = [
        (operation, mode, POST_WEIGHT if operation.method.upper() == "POST" else 1)
        for operation in (result.ok() for result in schema.get_all_operations())
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    ]
    left, round_number = budget, 0
    while left > 0 and plan:
        round_budget, total_weight, still_going = left, sum(w for _, _, w in plan), []
        for index, (operation, mode, weight) in enumerate(plan):
            quota = min(left, max(1, round_budget * weight // total_weight))
            if quota == 0:
                break
            case_seed = seed * 7919 + round_number * 131 + index
            ran, cut_short = run_cases(operation.as_strategy(mode), quota, case_seed, send)
            tally.unsupported_draws += cut_short
            left -= ran
            if ran == quota:
                still_going.append((operation, mode, weight))
        plan, round_number = still_going, round_number + 1
    return budget - left


def raw_bodies(example: bytes, rng: random.Random) -> bytes:
    """A body no schema describes, from the operation's example body."""
    kind = rng.randrange(9)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 200))
    if kind == 1:
        return example[: rng.randrange(len(example))]  # truncated JSON
    if kind == 2:
        flipped = bytearray(example)
        for _ in range(rng.randrange(1, 4)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        return bytes(flipped)
    if kind == 3:
        return b"\xff\xfe" + example  # not UTF-8
    if kind == 4:
        depth = rng.randrange(90, 400)
        return b"[" * depth + b"]" * depth
    if kind == 5:
        return example.replace(b'"Say', b'"\\ud800Say')  # a lone surrogate escape
    if kind == 6:
        return b" " * (MAX_BODY_BYTES + 1)
    if kind == 7:
        return rng.choice([b"", b"null", b"[]", b"1", b'"text"', b"{}", b"true"])
    return example.replace(b"{", b'{"unknown_field": {"x": [1, null]}, ', 1)


def fuzz_raw(
    document: dict, base_url: str, count: int, seed: int, session: http.Session, tally: Tally
) -> None:
    validator = DocumentValidator(document)
    posts = [
        (path, item["post"]) for path, item in sorted(document["paths"].items()) if "post" in item
    ]
    rng = random.Random(seed)
    for index in range(count):
        path, operation = posts[index % len(posts)]
        example = json.dumps(operation["requestBody"]["content"]["application/json"]["example"])
        body = raw_bodies(example.encode(), rng)
        check_answer(
            session, "POST", base_url, path, operation["responses"], validator, tally, body
        )


def fuzz_methods(document: dict, base_url: str, session: http.Session, tally: Tally) -> None:
    validator = DocumentValidator(document)
    for path, item in sorted(document["paths"].items()):
        concrete = path.replace("{response_id}", "resp_fuzz")
        allowed = {method.upper() for method in item}
        for method in METHODS:
            if method in allowed:
                continue
            answer = check_answer(session, method, base_url, concrete, None, validator, tally)
            if answer is None:
                continue
            listed = {m.strip() for m in answer.headers.get("allow", "").split(",") if m.strip()}
            if answer.status_code != 405 or not allowed <= listed:
                tally.schema_violations += 1
                tally.note(f"{method} {path} -> {answer.status_code}, allow {sorted(listed)}")


def check_answer(session, method, base_url, path, responses, validator, tally, body=None):
    """Send one request no schemathesis case describes; check its error answer."""
    try:
        answer = session.request(method, base_url + path, data=body, timeout=REQUEST_TIMEOUT_S)
    except http.RequestException as e:
        tally.no_answer += 1
        tally.note(f"{method} {path}: no answer ({type(e).__name__})")
        return None
    tally.answered(answer.status_code)
    problem = None
    if responses is not None and str(answer.status_code) not in responses:
        problem = "undocumented status"
    elif not answer.headers.get("content-type", "").startswith("application/json"):
        problem = f"content type {answer.headers.get('content-type')!r}"
    else:
        name = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
        problem = validator.problem(name, answer.content) if answer.status_code >= 400 else None
    if problem is not None or answer.status_code >= 500:
        tally.schema_violations += problem is not None
        tally.note(f"{method} {path} ({(body or b'')[:60]!r}) -> {answer.status_code}: {problem}")
    return answer


def run_fuzz(requests: int = 5000, seed: int = 0, ws_frames: int | None = None) -> dict:
    """Fuzz the gateway with `requests` HTTP requests and `ws_frames` WebSocket frames
    (default: a tenth as many); the counts, and examples of what failed."""
    ws_frames = requests // 10 if ws_frames is None else ws_frames
    started = time.perf_counter()
    runtime = load_runtime()
    tally = Tally()
    with running_gateway(runtime) as base_url, http.Session() as session:
        config = schemathesis.Config.from_dict({"seed": seed})
        schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", config=config)
        schema.hook(served_model_bodies(runtime.name))
        document = schema.raw_schema
        fuzz_methods(document, base_url, session, tally)
        raw_budget = int(max(0, requests - tally.requests) * RAW_SHARE)
        fuzz_raw(document, base_url, raw_budget, seed, session, tally)
        left = max(0, requests - tally.requests - tally.no_answer)
        fuzz_operations(schema, left, seed, lambda case: send_case(case, session, tally), tally)
        frames = fuzz_websocket(schema, base_url, ws_frames, seed, runtime.name)
    return {
        "fuzz_requests": tally.requests + tally.no_answer,
        "fuzz_5xx": tally.statuses[5],
        "ws_requests": frames.sent,
        "ws_unanswered": frames.unanswered,
        "schema_violations": tally.schema_violations + frames.schema_violations,
        "fuzz_seconds": round(time.perf_counter() - started, 1),
        "fuzz_2xx": tally.statuses[2],
        "fuzz_4xx": tally.statuses[4],
        "fuzz_no_answer": tally.no_answer,
        "fuzz_unsupported_draws": tally.unsupported_draws,
        "http_schema_violations": tally.schema_violations,
        "ws_schema_violations": frames.schema_violations,
        "ws_responses": frames.responses,
        "ws_errors": frames.errors,
        "failure_examples": tally.examples + frames.examples,
    }
