"""One run of one JavaScript program: a fresh V8 isolate, the bridge to its tools, the limits.

The bridge between V8 and Python, and why it looks like this: mini-racer runs the isolate
on its own thread and runs promise continuations between tasks, where no task cancellation
reaches them; only closing the isolate stops them. Every synchronous Python-to-V8 call
(mini-racer's `wrap_py_function` resolves each promise with one) waits for that thread, so
a program that spins after calling a tool would freeze the event loop forever. Hence,
once the program has started, the only calls into V8 are `eval_cancelable` of source text
(non-blocking), and the only call out is mini-racer's one-way notification, which wakes
Python to drain a queue of messages (`print`, `call`, `timer`, `done`; prelude.py). A
watchdog on the event loop closes the isolate at the deadline, whatever it is running.

A program's tool calls are answered one of two ways:

- live (`call_tool`): each call runs as its own task the moment the program makes it and
  settles its promise when it ends; timers wait real time. Code Mode's calls go to the
  harness's real tools this way.
- replay (`Replay`): the program is deterministic (prelude.py: seeded Math.random, Date
  frozen, timers on a virtual clock) and its calls are answered in rounds. The loop:

      start -> drain the outbox -> done? stop
            -> calls waiting: answer each, in call order -> any unanswered? suspend
                                                         -> settle all at once, drain again
            -> none waiting: fire the next timer -> none left? the program waits on nothing

  A drain runs after every eval's microtasks (they run between V8 tasks), so when it
  finds no message the program is idle. Run again with the same answers, a program makes
  the same calls in the same rounds: a suspended run resumes by running again from the
  start (the gateway's programmatic tool calling).

No file system, network or modules exist in plain V8 (no `require`, `fetch`, `process`;
`import()` fails). What comes out of V8 is the program's to shape (it shares the isolate
with the bridge), so every message is checked before Python acts on it: a message of the
wrong shape stops the run ("bridge"), never raises here; and what a run sends out in all
is capped (`max_output_bytes`, "output"), since the heap limit bounds only one message.
"""

import asyncio
import contextlib
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

from py_mini_racer import (
    JSEvalException,
    JSFunction,
    JSOOMException,
    JSParseException,
    MiniRacer,
)

from once.js_runtime.limits import Determinism, RunLimits
from once.js_runtime.prelude import HOST, PRELUDE

_MEMORY_POLL_S = 0.05  # how often the heap-limit flag is checked while waiting


@dataclass(frozen=True)
class ProgramCall:
    """One `tools.<name>(args)` the program made: `call_id` is its promise's id in V8."""

    call_id: int
    name: str
    arguments: str  # JSON text ("null" for arguments JSON cannot hold)


@dataclass(frozen=True)
class Answer:
    """What settles a call's promise: resolved with `output`, or rejected with it."""

    output: str
    is_error: bool = False


CallTool = Callable[[ProgramCall], Awaitable[Answer]]
Refusal = Callable[[ProgramCall], str | None]  # an error to answer at once, or None


@dataclass(frozen=True)
class Replay:
    """A deterministic run. `answer` is asked once per call, in call order, for the calls of
    each round; None means the answer is not known yet (the run suspends on it)."""

    determinism: Determinism
    answer: Callable[[ProgramCall], Answer | None]


class _OutOfMemory(Exception):
    pass


class _BrokenBridge(Exception):
    """A message from V8 that is not one the prelude sends; the text says how."""


class _TooMuchOutput(Exception):
    pass


# The fields after each message's kind, by exact type (a bool is not a call id).
_MESSAGE_FIELDS: dict[str, tuple[tuple[type, ...], ...]] = {
    "print": ((str,),),
    "call": ((int,), (str,), (str,)),
    "timer": ((int,), (int, float)),
    "done": ((bool,), (str, type(None))),
}


class ProgramRun:
    def __init__(
        self,
        tool_names: list[str],
        limits: RunLimits,
        *,
        call_tool: CallTool | None = None,
        replay: Replay | None = None,
        refuse: Refusal | None = None,
    ):
        if (call_tool is None) == (replay is None):
            raise ValueError("a program run is either live (call_tool) or a replay")
        self.tool_names = tool_names
        self.limits = limits
        self.call_tool = call_tool
        self.replay = replay
        self.refuse = refuse
        self.printed: list[str] = []
        self.result: str | None = None
        self.error: str | None = None
        # None, "timeout", "memory", "output", "bridge" or (a replay) "stuck"
        self.stopped: str | None = None
        self.num_tool_calls = 0
        self.num_output_bytes = 0  # of messages drained from V8
        self.finished = False
        # A suspended replay: the round it stopped in, each call with its answer or None.
        self.suspended: list[tuple[ProgramCall, Answer | None]] = []
        self._waiting: list[tuple[ProgramCall, Answer | None]] = []  # a replay's round
        self._wake = asyncio.Event()
        self._calls: set[asyncio.Task] = set()
        self._timers: set[asyncio.Task] = set()

    def output_text(self) -> str:
        """What the program printed, then what it returned, then its error."""
        parts = [*self.printed]
        if self.result is not None:
            parts.append(self.result)
        if self.error is not None:
            parts.append(self.error)
        return "\n".join(parts)

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
        except _TooMuchOutput:
            self._stop("output", f"the {self.limits.max_output_bytes / 2**20:g} MiB output limit")
        except _BrokenBridge as e:
            self.stopped, self.suspended = "bridge", []
            self.error = f"program stopped: it broke the tool bridge ({e})"
        finally:
            background = [*self._calls, *self._timers]
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            racer.close()  # terminates whatever JavaScript is still running

    def _stop(self, why: str, limit: str) -> None:
        self.stopped = why
        self.suspended = []
        self.error = f"program stopped: it exceeded {limit}"

    async def _run_in(self, racer: MiniRacer, code: str) -> None:
        # mini-racer's one-way notification is private API (mini-racer 0.14): see the
        # module docstring for why the public wrap_py_function cannot be used.
        context = racer._ctx
        assert context is not None  # None only once the racer is closed
        with context._register_js_notification(lambda _args: self._wake.set()) as notify:
            install = cast(JSFunction, await racer.eval_cancelable(PRELUDE))  # the installer
            options: dict[str, object] = {"replay": None}
            if self.replay is not None:
                determinism = self.replay.determinism
                options["replay"] = {"epochMs": determinism.epoch_ms, "seed": determinism.seed}
            await install.cancelable()(notify, json.dumps(self.tool_names), json.dumps(options))
            try:
                # On the prelude's line so that the program's line numbers are its own.
                await racer.eval_cancelable(f"{HOST}.start(async () => {{{code}\n}})")
            except JSParseException as e:
                self.error = str(e)
                return
            except JSEvalException as e:
                if isinstance(e, JSOOMException):
                    raise
                self.error = f"Uncaught {e}"
                return
            if self.replay is None:
                await self._live(racer)
            else:
                await self._rounds(racer)

    # -- live ----------------------------------------------------------------------------

    async def _live(self, racer: MiniRacer) -> None:
        while not self.finished:
            await self._wait_for_wake(racer)
            await self._drain(racer)
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

    async def _live_call(self, racer: MiniRacer, call: ProgramCall) -> None:
        assert self.call_tool is not None
        answer = await self.call_tool(call)
        await self._into_v8(_settle(racer, call.call_id, answer))

    async def _fire_timer(self, racer: MiniRacer, timer_id: int, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await self._into_v8(racer.eval_cancelable(f"{HOST}.fire({timer_id})"))

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

    # -- replay --------------------------------------------------------------------------

    async def _rounds(self, racer: MiniRacer) -> None:
        assert self.replay is not None
        while True:
            await self._drain(racer)
            if self.finished:
                return
            if self._waiting:
                round_, self._waiting = self._waiting, []
                if any(answer is None for _, answer in round_):
                    self.suspended = round_
                    return
                answers = [[call.call_id, not a.is_error, a.output] for call, a in round_ if a]
                source = f"{HOST}.settleAll({json.dumps(json.dumps(answers))})"
                await self._replayed_eval(racer, source)
            elif not await self._replayed_eval(racer, f"{HOST}.advance()"):
                self.finished = True
                self.stopped = "stuck"
                self.error = "program stopped: it waits on a promise that nothing will settle"
                return

    async def _replayed_eval(self, racer: MiniRacer, source: str) -> object:
        try:
            value = await racer.eval_cancelable(source)
        except JSEvalException as e:
            if isinstance(e, JSOOMException) or racer.was_hard_memory_limit_reached():
                raise _OutOfMemory from None
            self.finished = True
            self.error = f"Uncaught {e}"
            return None
        if racer.was_hard_memory_limit_reached():
            raise _OutOfMemory
        return value

    # -- both ----------------------------------------------------------------------------

    async def _drain(self, racer: MiniRacer) -> None:
        # A program spinning between tasks holds the isolate: the drain waits behind it,
        # watched for the heap limit (the deadline is the run's).
        drain = asyncio.ensure_future(racer.eval_cancelable(f"{HOST}.drain()"))
        try:
            while not drain.done():
                await asyncio.wait({drain}, timeout=_MEMORY_POLL_S)
                if racer.was_hard_memory_limit_reached():
                    raise _OutOfMemory
        finally:
            if not drain.done():
                drain.cancel()
        try:
            drained = drain.result()  # JSON text, if the program left the bridge alone
        except JSEvalException as e:
            if racer.was_hard_memory_limit_reached():
                raise _OutOfMemory from None
            raise _BrokenBridge(f"the outbox could not be drained: {e}") from None
        if not isinstance(drained, str):
            raise _BrokenBridge(f"the outbox drained as {type(drained).__name__}, not text")
        self.num_output_bytes += len(drained)
        if self.num_output_bytes > self.limits.max_output_bytes:
            raise _TooMuchOutput
        for message in _parse_outbox(drained):
            await self._handle(racer, message)

    async def _handle(self, racer: MiniRacer, message: list) -> None:
        kind = message[0]
        if kind == "print":
            self.printed.append(str(message[1]))
        elif kind == "call":
            call = ProgramCall(int(message[1]), str(message[2]), str(message[3]))
            refusal = self.refuse(call) if self.refuse is not None else None
            if refusal is None and self.num_tool_calls >= self.limits.max_tool_calls:
                refusal = f"too many tool calls: the limit is {self.limits.max_tool_calls}"
            elif refusal is None:
                self.num_tool_calls += 1
            if self.replay is not None:
                answer = Answer(refusal, True) if refusal is not None else self.replay.answer(call)
                self._waiting.append((call, answer))
            elif refusal is not None:
                await self._into_v8(_settle(racer, call.call_id, Answer(refusal, True)))
            else:
                self._spawn(self._calls, self._live_call(racer, call))
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


def _parse_outbox(drained: str) -> list[list]:
    try:
        messages = json.loads(drained)
    except ValueError:
        raise _BrokenBridge("the outbox is not JSON") from None
    if not isinstance(messages, list):
        raise _BrokenBridge(f"the outbox is a JSON {type(messages).__name__}, not a list")
    for message in messages:
        kind = message[0] if isinstance(message, list) and message else None
        fields = _MESSAGE_FIELDS.get(kind) if isinstance(kind, str) else None
        if (
            fields is None
            or len(message) != len(fields) + 1
            or not all(type(v) in types for v, types in zip(message[1:], fields, strict=True))
            or (message[0] == "timer" and not math.isfinite(message[2]))
        ):
            raise _BrokenBridge(f"a message of unknown shape: {json.dumps(message)[:200]}")
    return messages


async def _settle(racer: MiniRacer, call_id: int, answer: Answer) -> None:
    ok = "false" if answer.is_error else "true"
    await racer.eval_cancelable(f"{HOST}.settle({call_id}, {ok}, {json.dumps(answer.output)})")
