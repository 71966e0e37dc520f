"""Code Mode: the model writes one JavaScript program; every tool is an async function in it.

`CodeModeTool` (the `code` tool) runs the program in a fresh V8 isolate per call
(js_runtime's `ProgramRun`, live: each nested call runs when the program makes it), with a
wall-time limit, a V8 heap limit and a cap on nested tool calls. Inside,
`await tools.<function_name>({...})` goes through `ctx.registry.call(..., parent=<program>)`:
the same validation, approval policy and sandbox as a model's own call, recorded in
`ctx.transcript`. `Promise.all` runs independent calls concurrently. Only what the program
prints and returns comes back, capped head+tail to a token budget. Why the bridge to V8
looks as it does, and what a program can reach, is in js_runtime/runner.py and
prelude.py.
"""

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterable

from once.agent.tools.base import ToolCaller, ToolCallRecord, ToolContext, ToolResult, ToolSpec
from once.agent.tools.code_mode_description import (
    CODE_TOOL_NAME,
    CodeModeLimits,
    code_mode_tool_description,
)
from once.js_runtime.runner import Answer, ProgramCall, ProgramRun
from once.js_runtime.truncation import estimate_tokens, truncate_head_tail

CODE_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {
        "code": {
            "type": "string",
            "description": "JavaScript: the body of an async function (await, return).",
        }
    },
    "required": ["code"],
    "additionalProperties": False,
}


class CodeModeTool:
    """The `code` tool. `specs` are the tools its description lists (all registry tools are
    callable); the description is fixed at construction so the prompt prefix stays stable."""

    def __init__(
        self,
        specs: Iterable[ToolSpec] = (),
        *,
        limits: CodeModeLimits | None = None,
        count_tokens: Callable[[str], int] | None = None,
    ):
        self.limits = limits or CodeModeLimits()
        self.count_tokens = count_tokens or estimate_tokens
        description = code_mode_tool_description(specs, self.limits)
        self.spec = ToolSpec(CODE_TOOL_NAME, description, CODE_TOOL_PARAMETERS)

    async def __call__(self, args: dict, ctx: ToolContext) -> ToolResult:
        code = args.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResult("`code` must be a non-empty string of JavaScript", True)
        if ctx.registry is None:
            return ToolResult("code mode needs the tool registry in the tool context", True)
        # Nested calls name their program as parent: the model's call id when the loop puts
        # one in the context, else an id of our own, also returned in the metadata.
        program_id = getattr(ctx, "call_id", None) or f"code_{uuid.uuid4().hex[:12]}"
        program = _NestedCalls(ctx, ctx.registry, program_id, self.spec.function_name)
        run = ProgramRun(
            program.tool_names,
            self.limits.run_limits,
            call_tool=program.call,
            refuse=program.refuse,
        )
        start = time.perf_counter()
        await run.run(code)
        output, truncated = truncate_head_tail(
            run.output_text() or "(no output)", self.limits.max_output_tokens, self.count_tokens
        )
        metadata = {
            "program_id": program_id,
            "num_tool_calls": run.num_tool_calls,
            "elapsed_s": time.perf_counter() - start,
            "truncated": truncated,
            "stopped": run.stopped,  # None, "timeout", "memory", "output" or "bridge"
        }
        return ToolResult(output, run.error is not None, metadata)


class _NestedCalls:
    """A program's tool calls as registry calls, each recorded with the program as parent."""

    def __init__(self, ctx: ToolContext, registry: ToolCaller, program_id: str, own_name: str):
        self.ctx = ctx
        self.registry = registry
        self.program_id = program_id
        self.own_name = own_name  # a program must not start programs
        self.tool_names = [s.function_name for s in registry.specs() if s.function_name != own_name]

    def refuse(self, call: ProgramCall) -> str | None:
        if call.name == self.own_name:
            return f"tools.{call.name} cannot be called from inside a code program"
        return None

    async def call(self, call: ProgramCall) -> Answer:
        start = time.perf_counter()
        try:
            result = await self.registry.call(
                call.name, call.arguments, self.ctx, parent=self.program_id
            )
        except asyncio.CancelledError:
            # The registry records calls that end; one cut off by the program's end or its
            # limits is recorded here, so the transcript still shows every call.
            cancelled = ToolResult("cancelled: the code program stopped first", True)
            elapsed = time.perf_counter() - start
            record = ToolCallRecord(
                call.name, _json_object(call.arguments), cancelled, elapsed, self.program_id
            )
            self.ctx.transcript.append(record)
            raise
        return Answer(result.output, result.is_error)


def _json_object(text: str) -> dict:
    with contextlib.suppress(ValueError):
        value = json.loads(text)
        if isinstance(value, dict):
            return value
    return {}
