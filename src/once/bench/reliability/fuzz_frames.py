"""WebSocket mode fuzzed: `response.create` frames, valid, mutated and malformed.

Frames are drawn by Hypothesis from: bodies valid by the gateway's own schema of
`POST /v1/responses` (half naming the served model), bodies that break it, random JSON
values, frames of the wrong type or with fields of the wrong types, text that is not
JSON, and binary frames. Each one is sent on a connection and must be answered within
ANSWER_TIMEOUT_S: by the events of a response up to its last (`response.completed`,
`.failed`, `.incomplete`) or by an `error` frame. Every frame received is checked against
the document: events against the SDK's `ResponseStreamEvent`, error frames against the
error frame of WebSocket mode (the HTTP error body plus `type` and `status`).
"""

import json
from dataclasses import dataclass, field
from typing import Any

import jsonschema_rs
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from schemathesis import GenerationMode
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.sync.client import ClientConnection, connect

ANSWER_TIMEOUT_S = 30.0  # a hang guard: a scripted response takes milliseconds
TERMINAL_EVENTS = {"response.completed", "response.failed", "response.incomplete"}
MAX_EXAMPLES_KEPT = 12
WEBSOCKET_ERROR_FRAME = {
    "type": "object",
    "required": ["type", "status", "error"],
    "properties": {
        "type": {"const": "error"},
        "status": {"type": "integer", "minimum": 400, "maximum": 599},
        "error": {"$ref": "#/components/schemas/OpenAIError/properties/error"},
    },
}


class DocumentValidator:
    """Validators for the components of an OpenAPI document, built on first use."""

    def __init__(self, document: dict):
        self.components = document["components"]
        self._validators: dict[str, Any] = {}

    def _validator(self, name: str):
        if name not in self._validators:
            if name == "WebSocketErrorFrame":
                schema = {**WEBSOCKET_ERROR_FRAME, "components": self.components}
            else:
                schema = {"$ref": f"#/components/schemas/{name}", "components": self.components}
            self._validators[name] = jsonschema_rs.Draft202012Validator(schema)
        return self._validators[name]

    def problem(self, name: str, body: bytes | str | Any) -> str | None:
        """What makes `body` (JSON text, or a decoded value) not a `name`; None: nothing."""
        if isinstance(body, bytes | str):
            try:
                body = json.loads(body)
            except ValueError:
                return "not JSON"
        errors = list(self._validator(name).iter_errors(body))
        return None if not errors else f"not a {name}: {errors[0].message[:300]}"


@dataclass
class FrameTally:
    sent: int = 0
    unanswered: int = 0
    responses: int = 0  # frames answered by a whole response
    errors: int = 0  # frames answered by an error frame
    schema_violations: int = 0
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < MAX_EXAMPLES_KEPT:
            self.examples.append(what[:600])


def _as_text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def frame_strategy(schema, model: str) -> st.SearchStrategy:
    create = schema["/v1/responses"]["POST"]

    def as_frame(body: Any) -> str:
        # A negative case's body may be raw bytes (not JSON at all): sent as the frame's text.
        if isinstance(body, bytes):
            return body.decode("utf-8", "replace")
        frame = {"type": "response.create", **body} if isinstance(body, dict) else body
        return json.dumps(frame, default=_as_text)

    valid = (
        create.as_strategy(GenerationMode.POSITIVE)
        .map(lambda case: case.body)
        .flatmap(lambda body: st.sampled_from([body, {**body, "model": model}]))
    )
    broken = create.as_strategy(GenerationMode.NEGATIVE).map(lambda case: case.body)
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
    json_values = st.recursive(
        scalars, lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=12
    )
    wrong_types = st.fixed_dictionaries(
        {"type": st.sampled_from(["response.create", "response.cancel", "", 5, None])},
        optional={"model": json_values, "input": json_values, "tools": json_values},
    )
    return st.one_of(
        valid.map(as_frame),
        valid.map(as_frame),  # twice: most frames a client sends are valid
        broken.map(as_frame),
        json_values.map(json.dumps),
        wrong_types.map(json.dumps),
        st.text(max_size=200),
        st.binary(max_size=100),
    )


class FrameSender:
    def __init__(self, url: str, validator: DocumentValidator, tally: FrameTally):
        self.url, self.validator, self.tally = url, validator, tally
        self.connection: ClientConnection | None = None

    def _connection(self) -> ClientConnection:
        if self.connection is None:
            self.connection = connect(self.url, max_size=None, open_timeout=ANSWER_TIMEOUT_S)
        return self.connection

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None

    def send(self, frame: str | bytes) -> None:
        tally = self.tally
        tally.sent += 1
        try:
            connection = self._connection()
            connection.send(frame)
            while True:
                event = json.loads(connection.recv(timeout=ANSWER_TIMEOUT_S))
                kind = event.get("type") if isinstance(event, dict) else None
                name = "WebSocketErrorFrame" if kind == "error" else "ResponseStreamEvent"
                problem = self.validator.problem(name, event)
                if problem is not None:
                    tally.schema_violations += 1
                    tally.note(f"frame {frame[:80]!r} -> {kind}: {problem}")
                if kind == "error":
                    tally.errors += 1
                    return
                if kind in TERMINAL_EVENTS:
                    tally.responses += 1
                    return
        except (TimeoutError, ConnectionClosed, InvalidHandshake, OSError) as e:
            tally.unanswered += 1
            tally.note(f"frame {frame[:80]!r}: unanswered ({type(e).__name__})")
            self.close()  # its state is unknown: the next frame gets a fresh connection


def fuzz_websocket(schema, base_url: str, count: int, seed: int, model: str) -> FrameTally:
    tally = FrameTally()
    if count <= 0:
        return tally
    sender = FrameSender(
        base_url.replace("http", "ws", 1) + "/v1/responses",
        DocumentValidator(schema.raw_schema),
        tally,
    )

    @hypothesis_seed(seed)
    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(frame_strategy(schema, model))
    def send(frame) -> None:
        if tally.sent < count:
            sender.send(frame)

    try:
        send()
    finally:
        sender.close()
    return tally
