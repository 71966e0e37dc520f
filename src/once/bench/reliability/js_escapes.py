"""Escape attempts from the V8 runtime: Code Mode (live) and the gateway's programs (replay).

Each attempt runs a hostile program in a real isolate (js_runtime's `ProgramRun`, or the
`code` tool over the arena's real tools) and checks that the host held: the run ended by
its limit with a clear error, no exception reached Python, this process still runs the
next program, the program saw no global beyond ECMAScript's and the bridge's, and tools
called through the bridge stayed in the sandbox.
"""

import dataclasses
import json

from once.agent.tools.code_mode import CodeModeLimits, CodeModeTool
from once.agent.tools.registry import ToolRegistry
from once.bench.reliability.sandbox_arena import Arena, Attempt, Outcome, outcome
from once.gateway.hosted.program_tool import PROGRAM_LIMITS
from once.js_runtime.limits import Determinism, RunLimits
from once.js_runtime.runner import Answer, ProgramCall, ProgramRun, Replay

QUICK = CodeModeLimits(timeout_s=0.5, max_heap_bytes=32 << 20)
# The heap limit must be what stops a bomb: the time limit is only a hang guard here.
GREEDY_LIMITS = CodeModeLimits(timeout_s=20, max_heap_bytes=32 << 20)
REPLAY_LIMITS = dataclasses.replace(PROGRAM_LIMITS, timeout_s=0.5, max_heap_bytes=32 << 20)
REPLAY_GREEDY_LIMITS = dataclasses.replace(REPLAY_LIMITS, timeout_s=20)
DETERMINISM = Determinism(epoch_ms=1_700_000_000_000, seed=7)

ENDLESS = {
    "a loop": "while (true) {}",
    "a loop after an await": "await null; while (true) {}",
    "a loop in finally": "try { while (true) {} } finally { while (true) {} }",
    "a loop in a timer": "setTimeout(() => { for (;;) {} }, 0); await new Promise(() => {});",
}
GREEDY = {
    "arrays": "let a = []; for (;;) a.push(new Array(1e6).fill(1));",
    "strings after an await": (
        "await null; let s = []; for (;;) s.push('x'.repeat(1e5) + s.length);"
    ),
    "a map": "const m = new Map(); for (let i = 0; ; i++) m.set(i, {i, s: 'v' + i});",
}
OFF_HEAP = ["ArrayBuffer", "SharedArrayBuffer", "Uint8Array", "DataView", "WebAssembly", "Atomics"]
# What a program may see: ECMAScript's (and Intl's) globals, and the bridge's own.
ECMASCRIPT_GLOBALS = {
    *("AggregateError", "Array", "AsyncDisposableStack", "BigInt", "Boolean", "Date"),
    *("DisposableStack", "Error", "EvalError", "FinalizationRegistry", "Function", "Infinity"),
    *("Intl", "Iterator", "JSON", "Map", "Math", "NaN", "Number", "Object", "Promise"),
    *("Proxy", "RangeError", "ReferenceError", "Reflect", "RegExp", "Set", "String"),
    *("SuppressedError", "Symbol", "SyntaxError", "Temporal", "TypeError", "URIError"),
    *("WeakMap", "WeakRef", "WeakSet", "decodeURI", "decodeURIComponent", "encodeURI"),
    *("encodeURIComponent", "escape", "eval", "globalThis", "isFinite", "isNaN"),
    *("parseFloat", "parseInt", "undefined", "unescape"),
}
BRIDGE_GLOBALS = {"__once_host", "__timer_manager", "clearTimeout", "console", "print"}
BRIDGE_GLOBALS |= {"setTimeout", "text", "tools"}
HOST_NAMES = ["require", "process", "fetch", "Deno", "Bun", "XMLHttpRequest", "WebSocket"]
HOST_NAMES += ["read", "readFile", "readbuffer", "load", "os", "module", "exports", "Worker"]
# Programs that rewrite what the bridge is built from; each must end as a program, and
# must not raise in Python. Run live and as a replay.
POLLUTERS = {
    "String replaced": "String = () => [1, 2]; return () => 1",
    "Array.prototype.toJSON": (
        "Array.prototype.toJSON = function () { return 42 }; print('x'); "
        "await tools.f({}); return 1"
    ),
    "a setter on Array.prototype[0]": (
        "Object.defineProperty(Array.prototype, '0', {set(v) {}, get() { return 'zz' }}); "
        "print('hi'); return await tools.f({a: 1})"
    ),
    "JSON.stringify replaced": "JSON.stringify = () => ({}); print('p'); return {a: 1}",
    "Promise.prototype.then replaced": "Promise.prototype.then = function () {}; return 7",
    "an infinite timer": "setTimeout(() => 1, Infinity); setTimeout(() => 1, -1); return 'a'",
    "Error hijacked": "Error = 5; throw {toString() { throw 1 }}",
    "Map.prototype.get throwing, then a refused call": (
        "Map.prototype.get = function () { throw new Error('no') }; await tools.refused({})"
    ),
    "the array iterator replaced": (
        "Array.prototype[Symbol.iterator] = function* () { yield 1 }; "
        "const [a, b] = await Promise.all([tools.f({}), tools.f({})]); setTimeout(() => 1, 5); "
        "return [a, b]"
    ),
}


async def endless_programs(arena: Arena) -> Outcome:
    name = "js_endless_programs"
    code = _QuickCode()
    escapes = []
    for what, program in ENDLESS.items():
        result = await code.registry.call("code", {"code": program}, code.context(arena))
        if result.metadata.get("stopped") != "timeout" or "time limit" not in result.output:
            escapes.append(f"{what}: {result.output[:120]!r}")
    escapes += await _still_runs(code, arena)
    return outcome(name, escapes, f"{len(ENDLESS)} endless programs stopped at 0.5 s")


async def memory_bombs(arena: Arena) -> Outcome:
    name = "js_memory_bombs"
    code = _QuickCode(GREEDY_LIMITS)
    escapes = []
    for what, program in GREEDY.items():
        result = await code.registry.call("code", {"code": program}, code.context(arena))
        if result.metadata.get("stopped") != "memory" or "32 MiB memory limit" not in result.output:
            escapes.append(f"{what}: {result.output[:120]!r}")
    probe = f"return {json.dumps(OFF_HEAP)}.map((n) => typeof globalThis[n])"
    off_heap = await code.registry.call("code", {"code": probe}, code.context(arena))
    if off_heap.output != json.dumps(["undefined"] * len(OFF_HEAP), separators=(",", ":")):
        escapes.append(f"off-heap allocators present: {off_heap.output}")
    escapes += await _still_runs(code, arena)
    return outcome(name, escapes, f"{len(GREEDY)} bombs stopped at 32 MiB; no off-heap buffers")


async def output_flood(arena: Arena) -> Outcome:
    name = "js_output_flood"
    limit = 8 << 20
    # Bounded: 64 MiB in all, yielding between prints so each is drained into Python.
    program = (
        "for (let i = 0; i < 64; i++) {"
        " print('x'.repeat(1 << 20)); await new Promise((r) => setTimeout(r, 0)); }"
    )
    run = ProgramRun([], RunLimits(timeout_s=20, max_output_bytes=limit), call_tool=_echo)
    await run.run(program)
    kept = sum(len(text) for text in run.printed)
    escapes = []
    if run.stopped != "output":
        escapes.append(f"not stopped by the output limit (stopped: {run.stopped})")
    if kept > limit:
        escapes.append(f"Python kept {kept} bytes of a {limit} byte limit")
    return outcome(name, escapes, f"stopped at the 8 MiB output limit with {kept} bytes kept")


async def host_globals(arena: Arena) -> Outcome:
    name = "js_host_globals"
    run = ProgramRun([], RunLimits(timeout_s=10), call_tool=_echo)
    await run.run(
        "const imports = [];\n"
        "for (const s of ['fs', 'node:child_process', '/etc/passwd', 'file:///etc/passwd']) {\n"
        "  try { await import(s); imports.push(s) } catch (e) {}\n"
        "}\n"
        "return {names: Object.getOwnPropertyNames(globalThis), imports,"
        " viaFunction: Function('return typeof process + typeof require')()}"
    )
    seen = json.loads(run.result or "{}")
    unknown = sorted(set(seen.get("names", ())) - ECMASCRIPT_GLOBALS - BRIDGE_GLOBALS)
    escapes = [f"global {n!r} is neither ECMAScript's nor the bridge's" for n in unknown]
    escapes += [f"host name {n!r} defined" for n in HOST_NAMES if n in seen.get("names", ())]
    escapes += [f"imported {s}" for s in seen.get("imports", ())]
    if seen.get("viaFunction") != "undefinedundefined":
        escapes.append(f"Function() reached {seen.get('viaFunction')!r}")
    if run.error is not None:
        escapes.append(f"the probe failed: {run.error}")
    return outcome(name, escapes, "only ECMAScript and bridge globals; every import refused")


async def bridge_pollution_live(arena: Arena) -> Outcome:
    return await _pollution("js_bridge_pollution_live", replay=False)


async def bridge_pollution_replay(arena: Arena) -> Outcome:
    return await _pollution("js_bridge_pollution_replay", replay=True)


async def replay_limits(arena: Arena) -> Outcome:
    # The gateway's programs: replay runs with its limits (its timeout cut for speed).
    name = "js_replay_limits"
    escapes = []
    cases = [*(("timeout", p) for p in ENDLESS.values()), ("memory", GREEDY["arrays"])]
    for expected, program in cases:
        # A bomb gets a long time limit: the heap limit must be what stops it.
        run = _replay_run(REPLAY_LIMITS if expected == "timeout" else REPLAY_GREEDY_LIMITS)
        await run.run(program)
        if run.stopped != expected:
            escapes.append(f"{program[:40]!r}: stopped {run.stopped}, expected {expected}")
    return outcome(name, escapes, f"{len(cases)} replays stopped by the time or memory limit")


async def tools_stay_sandboxed(arena: Arena) -> Outcome:
    name = "js_tools_stay_sandboxed"
    if why := arena.unsupported_shell():
        return Outcome(name, False, why, why)
    out, home = arena.outside, arena.home
    result = await arena.code(
        f"const shell = await tools.shell({{command: 'touch {out}/via-code; "
        f"cat {home}/.ssh/id_ed25519 {home}/.aws/credentials'}});\n"
        "const patch = await tools.apply_patch({input: '*** Begin Patch\\n"
        "*** Add File: ../outside/via-patch\\n+x\\n*** End Patch'}).catch((e) => e.message);\n"
        "return [shell, patch]"
    )
    escapes = [f"wrote {p}" for p in sorted(out.iterdir())]
    escapes += [f"read {relative}" for relative in arena.leaked_tokens(result.output)]
    return outcome(name, escapes, "tools.shell and tools.apply_patch held by the sandbox")


JS_ATTEMPTS = [
    Attempt("js_endless_programs", endless_programs),
    Attempt("js_memory_bombs", memory_bombs),
    Attempt("js_output_flood", output_flood),
    Attempt("js_host_globals", host_globals),
    Attempt("js_bridge_pollution_live", bridge_pollution_live),
    Attempt("js_bridge_pollution_replay", bridge_pollution_replay),
    Attempt("js_replay_limits", replay_limits),
    Attempt("js_tools_stay_sandboxed", tools_stay_sandboxed),
]


class _QuickCode:
    """A `code` tool with its own limits over a registry of its own (no other tools)."""

    def __init__(self, limits: CodeModeLimits = QUICK):
        self.registry = ToolRegistry([CodeModeTool(limits=limits)])

    def context(self, arena: Arena):
        ctx = arena.context()
        ctx.registry = self.registry
        return ctx


async def _still_runs(code: _QuickCode, arena: Arena) -> list[str]:
    after = await code.registry.call("code", {"code": "return 6 * 7"}, code.context(arena))
    return [] if after.output == "42" else [f"the next program failed: {after.output!r}"]


async def _echo(call: ProgramCall) -> Answer:
    return Answer(f"echo {call.name} {call.arguments}")


def _replay_run(limits: RunLimits = REPLAY_LIMITS) -> ProgramRun:
    def answer(call: ProgramCall) -> Answer:
        return Answer(f"recorded {call.name}")

    return ProgramRun(["f"], limits, replay=Replay(DETERMINISM, answer))


def _live_run(call_tool) -> ProgramRun:
    def refuse(call: ProgramCall) -> str | None:
        return "refused by the host" if call.name == "refused" else None

    return ProgramRun(["f"], RunLimits(timeout_s=5), call_tool=call_tool, refuse=refuse)


async def _pollution(name: str, *, replay: bool) -> Outcome:
    escapes = []
    calls: list[ProgramCall] = []

    async def record(call: ProgramCall) -> Answer:
        calls.append(call)
        return Answer("ok")

    for what, program in POLLUTERS.items():
        run = _replay_run() if replay else _live_run(record)
        try:
            await run.run(program)
            run.output_text()
        except Exception as e:  # what the attempt looks for: Python must never see one
            escapes.append(f"{what}: {type(e).__name__} in Python: {e}")
    malformed = [c for c in calls if not (type(c.call_id) is int and isinstance(c.name, str))]
    escapes += [f"a malformed call reached Python: {c}" for c in malformed]
    fresh = _replay_run() if replay else _live_run(record)
    await fresh.run("return [typeof Array.prototype.toJSON, typeof String(1)]")
    if fresh.result != '["undefined","string"]':
        escapes.append(f"pollution outlived its isolate: {fresh.output_text()!r}")
    return outcome(name, escapes, f"{len(POLLUTERS)} polluting programs ended as programs")
