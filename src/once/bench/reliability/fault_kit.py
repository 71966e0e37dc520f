"""What the fault scenarios share: their context, their result, and small helpers."""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from once.gateway.model import ModelRuntime


@dataclass
class FaultContext:
    """What scenarios share: a scratch folder and the served model (its tokenizer)."""

    tmp: Path
    loaded_runtime: ModelRuntime | None = None  # loaded on first use when not given

    @property
    def runtime(self) -> ModelRuntime:
        if self.loaded_runtime is None:
            from once.gateway.testing import load_runtime

            self.loaded_runtime = load_runtime()
        return self.loaded_runtime

    def folder(self, name: str) -> Path:
        path = self.tmp / name
        path.mkdir(parents=True, exist_ok=True)
        return path


@dataclass
class FaultResult:
    name: str
    checks: dict[str, bool]  # what must hold, by name
    sessions_lost: int = 0  # sessions that could not go on after the fault
    stored_responses_lost: int = 0  # responses acknowledged as stored, then not found
    detail: dict = field(default_factory=dict)  # the scenario's figures
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(self.checks.values()) and not self.sessions_lost + self.stored_responses_lost

    def failed_checks(self) -> list[str]:
        return [name for name, held in self.checks.items() if not held]

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


async def stream_response(http: httpx.AsyncClient, url: str, body: dict) -> list[dict]:
    """POST /v1/responses with stream: true; the SSE events, parsed (a non-200 answer is
    one event, {"type": "http_error", "status": ..., "error": ...})."""
    async with http.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}) as reply:
        if reply.status_code != 200:
            error = json.loads(await reply.aread()).get("error")
            return [{"type": "http_error", "status": reply.status_code, "error": error}]
        return [
            json.loads(line.removeprefix("data: "))
            async for line in reply.aiter_lines()
            if line.startswith("data: ")
        ]


def final_response(events: list[dict]) -> dict | None:
    """The response of a stream's terminal event, or None when the stream had none."""
    for event in reversed(events):
        if event.get("type") in ("response.completed", "response.incomplete", "response.failed"):
            return event["response"]
    return None


def output_text(response: dict) -> str:
    """The text of a response's messages (what a client compares across a fault: the
    SDK's dumps and the server's JSON differ in which empty fields they carry)."""
    return "".join(
        part.get("text", "")
        for item in response.get("output") or ()
        if item.get("type") == "message"
        for part in item.get("content") or ()
    )
