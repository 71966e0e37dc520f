"""Drive one planned session through one stack, call by call, as its agent did.

Request k is the recorded request. When it continues its chain's previous call (the
incremental rule holds on the recording), the recorded output items in it are replaced
by the items the server returned for that call, and recorded tool-call ids by the
server's: that is what a harness appends, so the chain stays exact and the transport can
send it incrementally. Where the recording broke the prefix (CodeR role switches, LM-32B
elision) the request goes as recorded and the caches miss, as they did.

Per call it records each layer's work: bytes on the wire and the bytes that were new,
tokens tokenized (gateway counter deltas), the engine's own accounting for the request
(through `ForcedOutputEngine`), the cache doctor's verdict, TTFT and wall time.

Failover. A call that fails with a retriable error (`engine_unavailable`: a replica died
and the router could not hide it, because output had already streamed) is sent again,
the same request, up to `MAX_ATTEMPTS` times; the record keeps `retries` and the error
codes. TTFT and wall time then run from the first attempt, as the agent waited. Any other
failure (the server's, the transport's, the client's) raises `ReplayCallError`, which names
the stack, the session and the call, and carries the records of the calls before it.
Routed stacks also record the `replica` that served it.

A call waits as long as the server takes (timeouts.py); while it waits past a minute,
`notice` hears about it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from once.agent.doctor import CacheDoctor
from once.agent.pauses import ToolPauseEstimates
from once.agent.transport.base import TransportError, payload_bytes
from once.agent.transport.rule import full_request_reason, non_input_fields
from once.bench.replay.plan import SessionPlan
from once.bench.replay.stacks import Stack
from once.bench.replay.timeouts import waiting_notices
from once.protocol.errors import EngineDeadError
from once.protocol.responses import canonical_json

STARTING_EVENTS = ("response.created", "response.in_progress")
MAX_ATTEMPTS = 3  # sends of one call, the first included
RETRIABLE_CODES = frozenset({EngineDeadError.code})
# Present in a record only when set: the default (one replica, no failure) JSON keeps its
# shape.
OPTIONAL_FIELDS = ("replica", "retries", "error_codes")


class ReplayCallError(RuntimeError):
    """A call failed for a reason a retry cannot fix (or failed every attempt)."""

    def __init__(self, message: str, records: list[dict] | None = None, index: int = -1):
        super().__init__(message)
        self.records = records or []  # the session's calls measured before this one
        self.index = index  # the recorded call's index


@dataclass
class CallRecord:
    stack: str
    session_id: str
    source: str
    index: int
    bytes_sent: int  # what the client put on the wire (JSON, uncompressed)
    bytes_received: int  # what the gateway counted (its received_bytes counter)
    bytes_new: int  # the request's items past what its chain already held
    incremental: bool
    break_cause: str | None  # the cache doctor's cause when the prefix broke
    tokens_tokenized: int  # gateway: ids produced by tokenization for this call
    prompt_tokens: int  # engine: prompt it received
    cached_tokens: int  # engine: served from its prefix cache
    computed_tokens: int  # engine: prefilled (with recompute after preemption)
    recomputed_tokens: int  # engine: of computed, prefilled again after a preemption
    tier_cached_tokens: int  # engine: of cached, brought in from a KV tier (or a peer)
    output_tokens: int
    prompt_matches_plan: bool  # the engine got the canonical (full render) prompt ids
    output_matches_recording: bool  # the server's output items say what was recorded
    ideal_cached: int
    previous_shared: int
    previous_length: int
    evictions_before: int  # engine evictions counted before this call
    # ... and after it: sessions side by side evict while the call waits for its turn.
    evictions_after: int
    ttft_s: float  # client: send -> first output event
    engine_ttft_s: float
    wall_s: float
    replica: str | None = None  # routed stacks: the replica that served the call
    retries: int = 0  # sends after the first (retriable failures)
    error_codes: tuple[str, ...] = ()  # of the failed sends, in order
    # Speculating stacks: the engine's verifications, drafted ids and accepted ids.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def to_dict(self) -> dict:
        row = {**self.__dict__, "error_codes": list(self.error_codes)}
        return {key: value for key, value in row.items() if value or key not in OPTIONAL_FIELDS}


async def replay_session(
    stack: Stack,
    plan: SessionPlan,
    key: str | None = None,
    *,
    tool_times_s: list[float] | None = None,
    concurrent: bool = False,
    on_call=None,
    notice=None,
) -> list[dict]:
    """tool_times_s[k]: seconds to wait after call k (the agent running its tool).

    concurrent: other sessions share the stack, so the gateway's global counters cannot
    be read as before/after deltas; take this request's tokenization from the build log
    and its received bytes from what the client sent (the same JSON body).
    """
    key = key or f"replay/{stack.session_namespace}/{plan.session_id}"
    stack.forced.expect(key, [call.forced_ids for call in plan.calls])
    transport = stack.transport()
    doctor = CacheDoctor()
    metrics = stack.gateway.metrics
    sent: dict[int, dict] = {}  # call index -> the full request as sent
    returned: dict[int, list[dict]] = {}  # call index -> output items the server returned
    id_map: dict[str, str] = {}  # recorded tool-call id -> the server's
    matches: dict[int, bool] = {}
    records: list[dict] = []
    # A harness's running estimate of its tools' times (the waits it has seen so far).
    pauses = ToolPauseEstimates() if stack.spec.pause_hints and tool_times_s else None
    try:
        for position, (call, reference) in enumerate(zip(plan.calls, plan.reference, strict=True)):
            previous = call.previous_in_chain
            request = _request_to_send(plan, position, sent, returned, matches, id_map)
            request["prompt_cache_key"] = key
            if pauses is not None and pauses.seconds:
                request["metadata"] = pauses.metadata()
            bytes_new = _new_bytes(
                request,
                sent.get(previous) if previous is not None else None,
                returned.get(previous) if previous is not None else None,
            )
            doctor_break = doctor.observe(request)
            before_bytes = transport.stats.bytes_sent
            before_incremental = transport.stats.incremental_calls
            before_tokenized = metrics.value(metrics.tokenized_tokens)
            before_received = _received_bytes(metrics)
            evictions_before = (await stack.engine_stats())["num_kv_evictions"]
            first_event: list[float] = []
            started = time.perf_counter()

            def on_event(event, first_event=first_event, started=started):
                if not first_event and event.get("type") not in STARTING_EVENTS:
                    first_event.append(time.perf_counter() - started)

            what = f"{stack.spec.name}: {plan.session_id} call {call.index}"
            try:
                async with waiting_notices(what, notice):
                    response, error_codes = await _send_with_retries(
                        transport, request, on_event, first_event, what
                    )
            except ReplayCallError as e:
                raise ReplayCallError(str(e), records, call.index) from e
            except Exception as e:  # noqa: BLE001 - the client or the connection failed
                message = f"{what} failed: {type(e).__name__}: {e}"
                raise ReplayCallError(message, records, call.index) from e
            wall_s = time.perf_counter() - started
            evictions_after = (await stack.engine_stats())["num_kv_evictions"]
            output = response.get("output") or []
            doctor.record_output(output)
            sent[position], returned[position] = request, output
            matches[position] = _same_meaning(call.output_items, output)
            if matches[position]:
                id_map.update(_call_id_pairs(call.output_items, output))
            engine = stack.forced.last_record(key)
            engine_metrics = engine.metrics
            assert engine_metrics is not None  # the finished delta carried them
            bytes_sent = transport.stats.bytes_sent - before_bytes
            if concurrent:
                assert stack.builds is not None  # open_stack always logs the builds
                tokenized = stack.builds.take(engine.prompt_ids) or 0
                received = bytes_sent
            else:
                tokenized = int(metrics.value(metrics.tokenized_tokens) - before_tokenized)
                received = int(_received_bytes(metrics) - before_received)
            records.append(
                CallRecord(
                    stack=stack.spec.name,
                    session_id=plan.session_id,
                    source=plan.session.source,
                    index=call.index,
                    bytes_sent=bytes_sent,
                    bytes_received=received,
                    bytes_new=bytes_new,
                    incremental=transport.stats.incremental_calls > before_incremental,
                    break_cause=None if doctor_break is None else doctor_break.cause,
                    tokens_tokenized=tokenized,
                    prompt_tokens=len(engine.prompt_ids),
                    cached_tokens=engine_metrics.num_cached_tokens,
                    computed_tokens=engine_metrics.num_computed_tokens,
                    recomputed_tokens=engine_metrics.num_recomputed_tokens,
                    tier_cached_tokens=engine_metrics.num_tier_cached_tokens,
                    output_tokens=engine_metrics.num_output_tokens,
                    prompt_matches_plan=list(engine.prompt_ids) == call.prompt_ids,
                    output_matches_recording=matches[position],
                    ideal_cached=reference.num_ideal_cached,
                    previous_shared=reference.num_previous_shared,
                    previous_length=reference.previous_length,
                    evictions_before=evictions_before,
                    evictions_after=evictions_after,
                    ttft_s=first_event[0] if first_event else wall_s,
                    engine_ttft_s=engine_metrics.ttft_s,
                    wall_s=wall_s,
                    replica=stack.replica_of(engine.request_id),
                    retries=len(error_codes),
                    error_codes=tuple(error_codes),
                    num_drafts=engine_metrics.num_drafts,
                    num_draft_tokens=engine_metrics.num_draft_tokens,
                    num_accepted_tokens=engine_metrics.num_accepted_tokens,
                ).to_dict()
            )
            if on_call is not None:
                on_call()
            if tool_times_s and position + 1 < len(plan.calls):
                wait_s = tool_times_s[min(position, len(tool_times_s) - 1)]
                if pauses is not None:
                    names: list[str | None] = [*_tool_names(output)] or [None]
                    for name in names:
                        pauses.observe(name, wait_s)  # None: a text action
                await asyncio.sleep(wait_s)
    finally:
        await transport.close()
    return records


def _tool_names(output: list[dict]) -> list[str]:
    return [item.get("name", "") for item in output if item.get("type") == "function_call"]


async def _send_with_retries(transport, request, on_event, first_event, what: str):
    """(the response, the codes of the failed sends before it). A failure is either a
    `response.failed` (the gateway's answer when the engine fails mid-response) or a
    `TransportError` (an `error` event or frame, an HTTP error status)."""
    error_codes: list[str] = []
    while True:
        try:
            response = await transport.create(request, on_event)
            failed = response.get("status") == "failed"
            error = response.get("error") or {}
            code, message = error.get("code"), error.get("message")
        except TransportError as exc:
            failed, code, message = True, exc.code, str(exc)
        if not failed:
            return response, error_codes
        if code not in RETRIABLE_CODES:
            raise ReplayCallError(f"{what} failed: [{code}] {message}")
        error_codes.append(code)
        if len(error_codes) >= MAX_ATTEMPTS:
            raise ReplayCallError(f"{what} failed {MAX_ATTEMPTS} times, last: [{code}] {message}")
        first_event.clear()  # TTFT counts from the first send to the retry's first output


def _request_to_send(plan, position, sent, returned, matches, id_map) -> dict:
    call = plan.calls[position]
    recorded = call.request
    previous = call.previous_in_chain
    if previous is None or not matches.get(previous):
        return dict(recorded)
    before = plan.calls[previous]
    if full_request_reason(before.request, before.output_items, recorded) is not None:
        return dict(recorded)  # the recording broke the prefix: replay it as it was
    num_kept = len(before.request["input"]) + len(before.output_items)
    new_items = [_with_call_ids(item, id_map) for item in recorded["input"][num_kept:]]
    request = dict(recorded)
    request["input"] = [*sent[previous]["input"], *returned[previous], *new_items]
    return request


def _with_call_ids(item: dict, id_map: dict[str, str]) -> dict:
    call_id = item.get("call_id")
    if call_id in id_map:
        return {**item, "call_id": id_map[call_id]}
    return item


def _call_id_pairs(recorded: list[dict], returned: list[dict]) -> dict[str, str]:
    calls_recorded = [i for i in recorded if i.get("type") == "function_call"]
    calls_returned = [i for i in returned if i.get("type") == "function_call"]
    return {
        a["call_id"]: b["call_id"] for a, b in zip(calls_recorded, calls_returned, strict=False)
    }


def _same_meaning(recorded: list[dict], returned: list[dict]) -> bool:
    """The server said what was recorded: same texts, same calls with equal arguments."""
    return _meaning(recorded) == _meaning(returned)


def _meaning(items: list[dict]) -> list[tuple[object, ...]]:
    meaning: list[tuple[object, ...]] = []
    for item in items:
        if item.get("type") == "message":
            text = "".join(part.get("text", "") for part in item.get("content") or [])
            if text:
                meaning.append(("text", text))
        elif item.get("type") == "function_call":
            try:
                arguments = json.loads(item.get("arguments") or "{}")
            except ValueError:
                arguments = item.get("arguments")
            meaning.append(("call", item.get("name"), canonical_json(arguments)))
    return meaning


def _new_bytes(request: dict, previous: dict | None, previous_output: list | None) -> int:
    """Bytes of the items past the longest item prefix the chain already held."""
    if previous is None:
        return payload_bytes(request)
    held = [*previous["input"], *(previous_output or [])]
    items = request["input"]
    kept = 0
    for old, new in zip(held, items, strict=False):
        if old is not new and canonical_json(old) != canonical_json(new):
            break
        kept += 1
    size = payload_bytes({"input": items[kept:]})
    if canonical_json(non_input_fields(previous)) != canonical_json(non_input_fields(request)):
        size += payload_bytes(non_input_fields(request))
    return size


def _received_bytes(metrics) -> float:
    return metrics.value(metrics.received_bytes, "http") + metrics.value(
        metrics.received_bytes, "websocket"
    )
