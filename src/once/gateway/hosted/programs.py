"""Programmatic tool calling: the gateway runs the model's program; the client runs its tools.

The model's `program` call (program_tool.py) runs here, in a fresh V8 isolate per run
(js_runtime, a replay run: Date, Math.random and timers deterministic, calls answered in
rounds). A program that calls a client's function cannot go on inside this response: the
run suspends, the response ends with one `function_call` item per call the program is
waiting on (`caller` = the program), and the request that brings their
`function_call_output`s resumes it. V8 state cannot outlive a request, so a resume is a
replay: the program runs again from the start, and each call it makes, in order, is
answered from the conversation:

    call n of program P  ->  id P#n; the conversation's function_call P#n must be the
                             same call (name, namespace, arguments), else it diverged
                         ->  the function_call_output P#n answers it; none: a 400 naming it
                         ->  neither recorded: a new call; the round's new calls suspend
                             the run again

until it suspends again or ends. At its end the `program_output` item holds its text
output (what it printed, then what it returned; capped head and tail), `completed`, or
`incomplete` with the error when it threw or hit a limit, and the model continues in the
same response (the hosted loop). It all works the same whether the conversation comes
whole with the request (`store: false`), from the store (`store: true`), or from a
WebSocket connection's state: the pipeline hands over every item (HostedTurn).
"""

import json
from collections.abc import Sequence
from typing import NoReturn

from once.gateway.hosted.base import HostedOutcome, HostedTurn
from once.gateway.hosted.program_tool import (
    PROGRAM,
    PROGRAM_LIMITS,
    PROGRAM_MAX_OUTPUT_TOKENS,
    PROGRAM_OUTPUT,
    PROGRAM_TOOL_TYPE,
    FingerprintMismatch,
    nested_call_id,
    program_caller,
    programmable_functions,
    replay_determinism,
)
from once.js_runtime.limits import RunLimits
from once.js_runtime.runner import Answer, ProgramCall, ProgramRun, Replay
from once.js_runtime.truncation import truncate_head_tail
from once.protocol.errors import InvalidRequestError
from once.protocol.responses import (
    FUNCTION_CALL,
    FUNCTION_CALL_OUTPUT,
    ResponsesRequest,
    output_text,
)


class ProgrammaticToolCalling:
    """The hosted tool behind `{"type": "programmatic_tool_calling"}`."""

    tool_types: tuple[str, ...] = (PROGRAM_TOOL_TYPE,)

    def __init__(self, limits: RunLimits = PROGRAM_LIMITS):
        self.limits = limits

    def handles(self, item: dict, request: ResponsesRequest) -> bool:
        return item["type"] == PROGRAM

    async def run(self, call: dict, turn: HostedTurn) -> HostedOutcome:
        return await self._replay(call, turn)

    def prompt_functions(self, request: ResponsesRequest) -> Sequence[dict]:
        return ()

    def opens(self, request: ResponsesRequest) -> bool:
        return any(
            item["type"] == FUNCTION_CALL_OUTPUT and program_caller(item) is not None
            for item in request.input_items
        )

    async def open(self, turn: HostedTurn) -> HostedOutcome | None:
        """Resume the program whose calls the request answers, if it has not ended."""
        answered = {
            program_caller(item): item
            for item in turn.request.input_items
            if item["type"] == FUNCTION_CALL_OUTPUT and program_caller(item) is not None
        }
        programs = {item["call_id"]: item for item in turn.items if item["type"] == PROGRAM}
        ended = {item["call_id"] for item in turn.items if item["type"] == PROGRAM_OUTPUT}
        for caller_id, output in answered.items():
            if caller_id not in programs:
                raise InvalidRequestError(
                    f"a function_call_output answers a call of program {caller_id!r}, which "
                    "is not in the conversation",
                    param=turn.param_of(output, "call_id"),
                )
        waiting = [programs[c] for c in answered if c not in ended]
        if not waiting:
            return None  # outputs of a program that has ended: nothing to resume
        return await self._replay(waiting[-1], turn)

    async def _replay(self, program: dict, turn: HostedTurn) -> HostedOutcome:
        try:
            determinism = replay_determinism(program["fingerprint"], program["code"])
        except FingerprintMismatch as e:
            param = turn.param_of(program, e.field) or "previous_response_id"
            raise InvalidRequestError(f"program {program['call_id']!r}: {e}", param=param) from None
        calls = _RecordedCalls(program["call_id"], turn)
        run = ProgramRun(
            sorted(calls.functions), self.limits, replay=Replay(determinism, calls.answer)
        )
        await run.run(program["code"])
        if run.suspended:
            return HostedOutcome(calls.suspended_on([call for call, _ in run.suspended]), True)
        if run.stopped is None:  # a limit may cut a replay short; a program's end may not
            calls.check_all_replayed()
        text, _ = truncate_head_tail(run.output_text(), PROGRAM_MAX_OUTPUT_TOKENS)
        status = "completed" if run.error is None else "incomplete"
        result = {"type": PROGRAM_OUTPUT, "call_id": program["call_id"], "result": text}
        return HostedOutcome([{**result, "status": status}])


class _RecordedCalls:
    """One replay's answers: the program's calls as the conversation recorded them."""

    def __init__(self, caller_id: str, turn: HostedTurn):
        self.caller_id = caller_id
        self.turn = turn
        self.functions = programmable_functions(turn.request.tools)
        conversation = [*turn.items, *turn.output]
        mine = [item for item in conversation if program_caller(item) == caller_id]
        # By call id: call n of the program is P#n wherever the client put it.
        self.recorded = {item["call_id"]: item for item in mine if item["type"] == FUNCTION_CALL}
        self.outputs = {item["call_id"]: item for item in mine if item["type"] != FUNCTION_CALL}
        self.num_calls = 0
        self.new_calls: dict[int, dict] = {}  # V8 call id -> the function_call item to emit
        self.replayed: set[int] = set()  # V8 call ids answered from the conversation

    def answer(self, call: ProgramCall) -> Answer | None:
        function = self.functions.get(call.name)
        if function is None:
            known = ", ".join(f"tools.{name}" for name in sorted(self.functions)) or "none"
            return Answer(f"unknown tool {call.name!r}; the program can call: {known}", True)
        arguments = _json(call.arguments)
        if not isinstance(arguments, dict):
            return Answer(f"tools.{call.name} takes one arguments object", True)
        ordinal, self.num_calls = self.num_calls, self.num_calls + 1
        namespace, tool = function
        item = {
            "type": FUNCTION_CALL,
            "call_id": nested_call_id(self.caller_id, ordinal),
            "name": tool["name"],
            "arguments": call.arguments,
            "caller": {"type": "program", "caller_id": self.caller_id},
            "status": "completed",
        }
        if namespace is not None:
            item["namespace"] = namespace
        output = self.outputs.get(item["call_id"])
        recorded = self.recorded.get(item["call_id"])
        if recorded is not None:
            self._check_same(ordinal, recorded, item)
            if output is None:
                self._missing([item])
        elif output is None:  # a new call (an output without its call item still answers)
            self.new_calls[call.call_id] = item
            return None
        self.replayed.add(call.call_id)
        return Answer(output_text(output))

    def _missing(self, calls: list[dict]) -> NoReturn:
        ids = ", ".join(repr(c["call_id"]) for c in calls)
        names = ", ".join(f"tools.{c['name']}" for c in calls)
        raise InvalidRequestError(
            f"no function_call_output for call_id {ids} ({names} of program "
            f"{self.caller_id!r}): a program resumes only with the outputs of all the calls "
            "it waits on at once",
            param="input",
        )

    def _check_same(self, ordinal: int, recorded: dict, replayed: dict) -> None:
        same = (
            recorded.get("name") == replayed["name"]
            and recorded.get("namespace") == replayed.get("namespace")
            and _json(recorded.get("arguments") or "") == _json(replayed["arguments"])
        )
        if not same:
            raise InvalidRequestError(
                f"program {self.caller_id!r} diverged on replay: its call {ordinal} is now "
                f"{_shown(replayed)}, but the conversation's is {_shown(recorded)}",
                param=self.turn.param_of(recorded) or "input",
            )

    def suspended_on(self, waiting: list[ProgramCall]) -> list[dict]:
        """The round the run suspended in: its new calls, as the items the client runs. A
        round whose other calls were answered lacks these outputs (every call of a round
        went out at once), or the replay took another path."""
        new = [self.new_calls[call.call_id] for call in waiting if call.call_id in self.new_calls]
        if any(call.call_id in self.replayed for call in waiting):
            self._missing(new)
        return new

    def check_all_replayed(self) -> None:
        if self.num_calls < len(self.recorded):
            self._diverged(
                f"it ended after {self.num_calls} calls; the conversation holds "
                f"{len(self.recorded)}"
            )

    def _diverged(self, why: str) -> NoReturn:
        raise InvalidRequestError(
            f"program {self.caller_id!r} diverged on replay: {why}", param="input"
        )


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def _shown(call: dict) -> str:
    name = call.get("name")
    if call.get("namespace"):
        name = f"{call['namespace']}__{name}"
    return f"tools.{name}({call.get('arguments')}) ({call.get('call_id')})"
