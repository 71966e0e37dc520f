"""Code Mode: the model writes one JavaScript program; every tool is an async function in it.

`CodeModeTool` (the `code` tool) runs the program in a fresh V8 isolate (mini-racer) per
call, with a wall-time limit, a V8 heap limit and a cap on nested tool calls. Inside,
`await tools.<function_name>({...})` goes through `ctx.registry.call(..., parent=<program>)`:
the same validation, approval policy and sandbox as a model's own call, recorded in
`ctx.transcript`. `Promise.all` runs independent calls concurrently. Only what the program
prints and returns comes back, capped head+tail to a token budget.

The bridge between V8 and Python, and why it looks like this: mini-racer runs the isolate
on its own thread and runs promise continuations between tasks, where no task cancellation
reaches them; only closing the isolate stops them. Every synchronous Python-to-V8 call
(mini-racer's `wrap_py_function` resolves each promise with one) waits for that thread, so
a program that spins after calling a tool would freeze the event loop forever. Hence,
once the program has started, the only calls into V8 are `eval_cancelable` of source text
(non-blocking), and the only call out is mini-racer's one-way notification, which wakes
Python to drain a queue of messages (`print`, `call`, `timer`, `done`). A watchdog on the
event loop closes the isolate at the deadline, whatever it is running.

No file system, network or modules exist in plain V8 (no `require`, `fetch`, `process`,
`import()` fails). Off-heap allocators (ArrayBuffer, typed arrays, WebAssembly memory)
escape V8's heap accounting, so they are removed; `setTimeout` goes through the host.
"""

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterable
from typing import cast

from py_mini_racer import (
    JSEvalException,
    JSFunction,
    JSOOMException,
    JSParseException,
    MiniRacer,
)

from once.agent.tools.base import ToolCaller, ToolCallRecord, ToolContext, ToolResult, ToolSpec
from once.agent.tools.code_mode_description import (
    CODE_TOOL_NAME,
    CodeModeLimits,
    code_mode_tool_description,
)

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
_HOST = "__once_host"  # the bridge object inside V8; non-writable
_MEMORY_POLL_S = 0.05  # how often the heap-limit flag is checked while waiting
_TRUNCATION_MARKER = "\n... [{} tokens truncated] ...\n"


def estimate_tokens(text: str) -> int:
    return (len(text) + 3) // 4


def truncate_head_tail(
    text: str, max_tokens: int, count_tokens: Callable[[str], int] = estimate_tokens
) -> tuple[str, bool]:
    """Keep the head and the tail of `text` within `max_tokens`, with a marker between.

    Characters are kept in proportion to the token budget (less the marker's share), then
    shrunk by 10% until the counter agrees, so any tokenizer works.
    """
    num_tokens = count_tokens(text)
    if num_tokens <= max_tokens:
        return text, False
    budget = max_tokens - count_tokens(_TRUNCATION_MARKER.format(num_tokens))
    keep_chars = max(0, int(len(text) * budget / num_tokens))
    while True:
        head, tail = text[: keep_chars // 2], text[len(text) - keep_chars // 2 :]
        kept = count_tokens(head) + count_tokens(tail)
        truncated = head + _TRUNCATION_MARKER.format(num_tokens - kept) + tail
        if keep_chars == 0 or count_tokens(truncated) <= max_tokens:
            return truncated, True
        keep_chars = int(keep_chars * 0.9)


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
        program = _Program(ctx, ctx.registry, program_id, self.limits, self.spec.function_name)
        start = time.perf_counter()
        await program.run(code)
        output, truncated = truncate_head_tail(
            program.render(), self.limits.max_output_tokens, self.count_tokens
        )
        metadata = {
            "program_id": program_id,
            "num_tool_calls": program.num_tool_calls,
            "elapsed_s": time.perf_counter() - start,
            "truncated": truncated,
            "stopped": program.stopped,  # None, "timeout" or "memory"
        }
        return ToolResult(output, program.error is not None, metadata)


class _OutOfMemory(Exception):
    pass


class _Program:
    """One run of one program: a fresh isolate, the bridge to the registry, the limits."""

    def __init__(
        self,
        ctx: ToolContext,
        registry: ToolCaller,
        program_id: str,
        limits: CodeModeLimits,
        own_name: str,
    ):
        self.ctx = ctx
        self.registry = registry
        self.program_id = program_id
        self.limits = limits
        self.own_name = own_name  # a program must not start programs
        self.tool_names = [s.function_name for s in registry.specs() if s.function_name != own_name]
        self.printed: list[str] = []
        self.result: str | None = None
        self.error: str | None = None
        self.stopped: str | None = None
        self.num_tool_calls = 0
        self.finished = False
        self._wake = asyncio.Event()
        self._calls: set[asyncio.Task] = set()
        self._timers: set[asyncio.Task] = set()

    def render(self) -> str:
        parts = [*self.printed]
        if self.result is not None:
            parts.append(self.result)
        if self.error is not None:
            parts.append(self.error)
        return "\n".join(parts) or "(no output)"

    async def run(self, code: str) -> None:
        racer = MiniRacer()  # inside the running loop: mini-racer reports to this loop
        racer.set_hard_memory_limit(self.limits.max_heap_bytes)
        deadline = asyncio.timeout(self.limits.timeout_s)
        try:
            async with deadline:
                await self._run_in(racer, code)
        except TimeoutError:
            if not deadline.expired():
                raise
            self._stop("timeout", f"the {self.limits.timeout_s:g} s time limit")
        except (_OutOfMemory, JSOOMException):
            self._stop("memory", f"the {self.limits.max_heap_bytes / 2**20:g} MiB memory limit")
        finally:
            background = [*self._calls, *self._timers]
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            racer.close()  # terminates whatever JavaScript is still running

    def _stop(self, why: str, limit: str) -> None:
        self.stopped = why
        self.error = f"program stopped: it exceeded {limit}"

    async def _run_in(self, racer: MiniRacer, code: str) -> None:
        # mini-racer's one-way notification is private API (mini-racer 0.14): see the
        # module docstring for why the public wrap_py_function cannot be used.
        context = racer._ctx
        assert context is not None  # None only once the racer is closed
        with context._register_js_notification(lambda _args: self._wake.set()) as notify:
            install = cast(JSFunction, await racer.eval_cancelable(_PRELUDE))  # the installer
            await install.cancelable()(notify, json.dumps(self.tool_names))
            try:
                # On the prelude's line so that the program's line numbers are its own.
                await racer.eval_cancelable(f"{_HOST}.start(async () => {{{code}\n}})")
            except JSParseException as e:
                self.error = str(e)
                return
            except JSEvalException as e:
                if isinstance(e, JSOOMException):
                    raise
                self.error = f"Uncaught {e}"
                return
            while not self.finished:
                await self._wait_for_wake(racer)
                drained = cast(str, await racer.eval_cancelable(f"{_HOST}.drain()"))  # JSON
                for message in json.loads(drained):
                    await self._handle(racer, message)
            # A call the program started but did not await still completes, like pending
            # I/O in Node; timers still pending are dropped.
            if self._calls:
                await asyncio.wait(self._calls)

    async def _wait_for_wake(self, racer: MiniRacer) -> None:
        # The heap limit terminates JavaScript without telling anyone when it strikes
        # between tasks, so its flag is polled while waiting.
        while not self._wake.is_set():
            if racer.was_hard_memory_limit_reached():
                raise _OutOfMemory
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _MEMORY_POLL_S)
        self._wake.clear()
        if racer.was_hard_memory_limit_reached():
            raise _OutOfMemory

    async def _handle(self, racer: MiniRacer, message: list) -> None:
        kind = message[0]
        if kind == "print":
            self.printed.append(str(message[1]))
        elif kind == "call":
            call_id, name, args_json = int(message[1]), str(message[2]), str(message[3])
            refusal = None
            if name == self.own_name:
                refusal = f"tools.{name} cannot be called from inside a code program"
            elif self.num_tool_calls >= self.limits.max_tool_calls:
                refusal = f"too many tool calls: the limit is {self.limits.max_tool_calls}"
            if refusal is not None:
                await _settle(racer, call_id, ToolResult(refusal, True))
                return
            self.num_tool_calls += 1
            self._spawn(self._calls, self._nested_call(racer, call_id, name, args_json))
        elif kind == "timer":
            delay_s = min(max(float(message[2]), 0.0) / 1000, self.limits.timeout_s)
            self._spawn(self._timers, self._fire_timer(racer, int(message[1]), delay_s))
        elif kind == "done":
            self.finished = True
            if message[1]:
                self.result = message[2]
            else:
                self.error = str(message[2])

    def _spawn(self, tasks: set[asyncio.Task], coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _nested_call(self, racer: MiniRacer, call_id: int, name: str, args_json: str):
        start = time.perf_counter()
        try:
            result = await self.registry.call(name, args_json, self.ctx, parent=self.program_id)
        except asyncio.CancelledError:
            # The registry records calls that end; one cut off by the program's end or its
            # limits is recorded here, so the transcript still shows every call.
            cancelled = ToolResult("cancelled: the code program stopped first", True)
            elapsed = time.perf_counter() - start
            record = ToolCallRecord(
                name, _json_object(args_json), cancelled, elapsed, self.program_id
            )
            self.ctx.transcript.append(record)
            raise
        await self._into_v8(_settle(racer, call_id, result))

    async def _fire_timer(self, racer: MiniRacer, timer_id: int, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await self._into_v8(racer.eval_cancelable(f"{_HOST}.fire({timer_id})"))

    async def _into_v8(self, call) -> None:
        # A failure here is the program's own doing (it ran out of memory, or broke the
        # builtins the bridge uses); the main loop sees the heap flag, or this error.
        try:
            await call
        except JSEvalException as e:
            if not self.finished and not isinstance(e, JSOOMException):
                self.finished = True
                self.error = f"Uncaught {e}"
            self._wake.set()


async def _settle(racer: MiniRacer, call_id: int, result: ToolResult) -> None:
    ok = "false" if result.is_error else "true"
    await racer.eval_cancelable(f"{_HOST}.settle({call_id}, {ok}, {json.dumps(result.output)})")


def _json_object(text: str) -> dict:
    with contextlib.suppress(ValueError):
        value = json.loads(text)
        if isinstance(value, dict):
            return value
    return {}


# Evaluates to the installer, called once with the notification function and the tool
# names before the program starts. Everything the program can reach is defined here.
_PRELUDE = r"""
(notify, toolNamesJson) => {
  "use strict";
  const g = globalThis;
  const stringify = JSON.stringify;
  const withResolvers = Promise.withResolvers.bind(Promise);
  const outbox = [];
  const pending = new Map();
  const timers = new Map();
  let nextId = 0;
  let done = false;
  const post = (message) => { outbox.push(message); };
  const show = (value) => {
    if (typeof value === "string") return value;
    if (value instanceof Error) return String(value);
    try {
      const text = stringify(value, (_k, v) => (typeof v === "bigint" ? String(v) : v));
      return text === undefined ? String(value) : text;
    } catch (_e) {
      return String(value);
    }
  };
  const finish = (ok, text) => {
    if (done) return;
    done = true;
    post(["done", ok, text]);
    notify();
  };
  const callTool = (name, args) => {
    let argsJson;
    try {
      argsJson = stringify(args === undefined ? {} : args);
    } catch (e) {
      return Promise.reject(new TypeError(`arguments of tools.${name}: ${e.message}`));
    }
    const id = nextId++;
    const { promise, resolve, reject } = withResolvers();
    pending.set(id, { resolve, reject });
    post(["call", id, name, argsJson === undefined ? "null" : argsJson]);
    notify();
    return promise;
  };
  const known = {};
  for (const name of JSON.parse(toolNamesJson)) known[name] = (args) => callTool(name, args);
  // An unknown name still reaches the registry, whose error lists the known tools.
  g.tools = new Proxy(Object.freeze(known), {
    get: (target, key) =>
      typeof key !== "string" || key in target || key === "then" || key === "toJSON"
        ? target[key]
        : (args) => callTool(key, args),
  });
  const print = (...values) => { post(["print", values.map(show).join(" ")]); };
  g.print = print;
  g.console = Object.freeze({ log: print, info: print, warn: print, error: print, debug: print });
  g.setTimeout = (callback, delay, ...args) => {
    const id = nextId++;
    timers.set(id, () => callback(...args));
    post(["timer", id, Number(delay) || 0]);
    notify();
    return id;
  };
  g.clearTimeout = (id) => { timers.delete(id); };
  g.__timer_manager = undefined;
  for (const name of [
    "WebAssembly", "ArrayBuffer", "SharedArrayBuffer", "Atomics", "DataView",
    "Int8Array", "Uint8Array", "Uint8ClampedArray", "Int16Array", "Uint16Array",
    "Int32Array", "Uint32Array", "Float16Array", "Float32Array", "Float64Array",
    "BigInt64Array", "BigUint64Array",
  ]) Reflect.deleteProperty(g, name);
  const host = {
    start: (program) => {
      program().then(
        (value) => finish(true, value === undefined ? null : show(value)),
        (error) => finish(false, "Uncaught " + show(error)),
      );
    },
    drain: () => {
      const text = stringify(outbox);
      outbox.length = 0;
      return text;
    },
    settle: (id, ok, output) => {
      const call = pending.get(id);
      if (call === undefined) return;
      pending.delete(id);
      if (ok) call.resolve(output);
      else call.reject(new Error(output));
    },
    fire: (id) => {
      const callback = timers.get(id);
      if (callback === undefined) return;
      timers.delete(id);
      try {
        callback();
      } catch (error) {
        finish(false, "Uncaught " + show(error));
      }
    },
  };
  Object.defineProperty(g, "__once_host", { value: Object.freeze(host) });
}
"""
