"""Code Mode: JavaScript in a fresh V8 isolate where every registry tool is an async function."""

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from once.agent.tools.base import ToolContext, ToolResult, ToolSpec
from once.agent.tools.code_mode import (
    CodeModeLimits,
    CodeModeTool,
    code_mode_tool_description,
    estimate_tokens,
    truncate_head_tail,
)
from once.agent.tools.registry import ToolRegistry

TEXT_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}


class EchoTool:
    def __init__(self, name: str = "echo", delay_s: float = 0.0, namespace: str = ""):
        self.spec = ToolSpec(name, "Echo the text back. Nothing else.", TEXT_SCHEMA, namespace)
        self.delay_s = delay_s
        self.num_runs = 0

    async def __call__(self, args: dict, ctx: ToolContext) -> ToolResult:
        self.num_runs += 1
        await asyncio.sleep(self.delay_s)
        return ToolResult(f"echo: {args['text']}")


class FailingTool:
    spec = ToolSpec("fail", "Always fails.", {"type": "object", "properties": {}})

    async def __call__(self, args: dict, ctx: ToolContext) -> ToolResult:
        return ToolResult("exit status 2: no such file", True)


@dataclass
class Decision:
    allowed: bool
    reason: str = ""


class DenyingPolicy:
    def __init__(self, denied: set[str]):
        self.denied = denied
        self.asked: list[tuple[str, dict]] = []

    async def authorize(self, spec: ToolSpec, args: dict, ctx: ToolContext) -> Decision:
        self.asked.append((spec.name, args))
        return Decision(spec.name not in self.denied, f"{spec.name} is denied by the test policy")


def make(limits: CodeModeLimits | None = None, *tools, policy=None, **kwargs):
    code = CodeModeTool(limits=limits, **kwargs)
    registry = ToolRegistry([code, EchoTool(), EchoTool("slow", 0.2), FailingTool(), *tools])
    ctx = ToolContext(Path("."), policy=policy, registry=registry)
    return registry, ctx


async def run(registry, ctx, code: str) -> ToolResult:
    return await registry.call("code", {"code": code}, ctx)


QUICK = CodeModeLimits(timeout_s=0.5)


async def test_prints_and_return_value_come_back_as_text_and_json():
    registry, ctx = make()
    result = await run(
        registry, ctx, 'print("a", 1, {x: 1}); console.log([1, 2]); return {ok: true, n: 10n}'
    )
    assert not result.is_error
    assert result.output == 'a 1 {"x":1}\n[1,2]\n{"ok":true,"n":"10"}'
    empty = await run(registry, ctx, "const x = 1;")
    assert empty.output == "(no output)" and not empty.is_error


async def test_nested_calls_run_concurrently_under_promise_all():
    registry, ctx = make()
    start = time.perf_counter()
    result = await run(
        registry,
        ctx,
        "const texts = ['1', '2', '3', '4', '5', '6'];\n"
        "const outs = await Promise.all(texts.map((text) => tools.slow({text})));\n"
        "return outs.join(',');",
    )
    elapsed = time.perf_counter() - start
    assert result.output == "echo: 1,echo: 2,echo: 3,echo: 4,echo: 5,echo: 6"
    assert elapsed < 1.0, f"6 x 0.2 s calls took {elapsed:.2f} s: not concurrent"
    assert result.metadata["num_tool_calls"] == 6


async def test_nested_calls_are_recorded_with_the_program_as_parent():
    registry, ctx = make()
    result = await run(registry, ctx, 'await tools.echo({text: "a"}); await tools.fail({});')
    program_id = result.metadata["program_id"]
    nested = [r for r in ctx.transcript if r.parent == program_id]
    assert [(r.name, r.arguments, r.result.is_error) for r in nested] == [
        ("echo", {"text": "a"}, False),
        ("fail", {}, True),
    ]
    assert ctx.transcript[-1].name == "code" and ctx.transcript[-1].parent is None
    # The model sees the program's output only, not the nested outputs.
    assert result.output == "Uncaught Error: exit status 2: no such file"


async def test_nested_arguments_are_validated_by_the_registry():
    registry, ctx = make()
    caught = await run(
        registry, ctx, "try { await tools.echo({text: 5}) } catch (e) { return e.message }"
    )
    assert not caught.is_error
    assert caught.output.startswith("invalid arguments for echo at text: 5 is not of type 'string'")
    assert "full schema:" in caught.output
    uncaught = await run(registry, ctx, "await tools.echo({wrong: 'x'})")
    assert uncaught.is_error and uncaught.output.startswith("Uncaught Error: invalid arguments")
    # Functions are dropped when the arguments become JSON; an extra key fails the schema.
    extra_key = await run(registry, ctx, "await tools.echo({text: 'x', f: () => 1, extra: null})")
    assert extra_key.is_error and "'extra' was unexpected" in extra_key.output


async def test_tool_error_output_rejects_and_unknown_tools_name_the_known_ones():
    registry, ctx = make()
    result = await run(registry, ctx, "try { await tools.fail({}) } catch (e) { return e.message }")
    assert result.output == "exit status 2: no such file"
    unknown = await run(registry, ctx, "return await tools.nope({})")
    assert unknown.is_error and "unknown tool 'nope'" in unknown.output
    assert "echo" in unknown.output


async def test_approval_policy_applies_to_nested_calls():
    danger = EchoTool("danger")
    policy = DenyingPolicy({"danger"})
    registry, ctx = make(None, danger, policy=policy)
    result = await run(
        registry,
        ctx,
        "const ok = await tools.echo({text: 'fine'});\n"
        "try { await tools.danger({text: 'rm -rf'}) } catch (e) { return ok + ' | ' + e.message }",
    )
    assert result.output == "echo: fine | not run: danger is denied by the test policy"
    assert danger.num_runs == 0
    assert ("danger", {"text": "rm -rf"}) in policy.asked
    assert ("echo", {"text": "fine"}) in policy.asked
    denied = [r for r in ctx.transcript if r.name == "danger"]
    assert denied[0].result.metadata == {"denied": True}


async def test_the_code_tool_cannot_call_itself_and_tool_calls_are_capped():
    registry, ctx = make(CodeModeLimits(max_tool_calls=3))
    nested = await run(registry, ctx, "return await tools.code({code: 'return 1'})")
    assert nested.is_error and "cannot be called from inside a code program" in nested.output
    capped = await run(
        registry,
        ctx,
        "const rs = await Promise.allSettled([1, 2, 3, 4, 5].map(() => tools.echo({text: 'x'})));\n"
        "return rs.map((r) => r.status === 'fulfilled' ? 'ok' : r.reason.message).join('; ')",
    )
    parts = capped.output.split("; ")
    assert parts[:3] == ["ok", "ok", "ok"]
    assert parts[3:] == ["too many tool calls: the limit is 3"] * 2
    assert capped.metadata["num_tool_calls"] == 3


@pytest.mark.parametrize(
    "code",
    [
        "while (true) {}",
        # Spinning after an await runs between V8 tasks, where only closing the isolate
        # stops it; spinning while a tool call is in flight must not freeze the event loop.
        "await tools.echo({text: 'x'}); while (true) {}",
        # slow is still running when the spin starts; its result arrives during the spin.
        "tools.slow({text: 'x'}); await tools.echo({text: 'y'}); while (true) {}",
        "print('before'); for (;;) { JSON.stringify({a: [1, 2, 3]}) }",
    ],
)
async def test_an_endless_program_is_stopped_by_the_time_limit(code):
    registry, ctx = make(QUICK)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticking = asyncio.create_task(ticker())
    start = time.perf_counter()
    result = await run(registry, ctx, code)
    elapsed = time.perf_counter() - start
    ticking.cancel()
    assert result.is_error and result.metadata["stopped"] == "timeout"
    assert "exceeded the 0.5 s time limit" in result.output
    assert 0.5 <= elapsed < 5.0  # a busy machine may close the isolate late, not never
    assert ticks >= 10, "the event loop was blocked while the program ran"
    after = await run(registry, ctx, "return 1 + 1")
    assert after.output == "2" and not after.is_error


async def test_a_pending_nested_call_is_cancelled_and_recorded_at_the_time_limit():
    registry, ctx = make(CodeModeLimits(timeout_s=2.0), EchoTool("forever", 60.0))
    result = await run(registry, ctx, "await tools.forever({text: 'x'})")
    assert result.metadata["stopped"] == "timeout"
    record = next(r for r in ctx.transcript if r.name == "forever")
    assert record.parent == result.metadata["program_id"]
    assert record.result.is_error and record.result.output.startswith("cancelled")


@pytest.mark.parametrize(
    "code",
    [
        "let a = []; while (true) a.push(new Array(1e6).fill(1));",
        "await null; let a = []; while (true) a.push(new Array(1e6).fill(1));",
        "await tools.echo({text: 'x'}); let s = []; for (;;) s.push('x'.repeat(1e5) + s.length);",
    ],
)
async def test_memory_exhaustion_is_stopped_by_the_heap_limit(code):
    registry, ctx = make(CodeModeLimits(timeout_s=10.0, max_heap_bytes=32 << 20))
    start = time.perf_counter()
    result = await run(registry, ctx, code)
    assert result.is_error and result.metadata["stopped"] == "memory"
    assert "exceeded the 32 MiB memory limit" in result.output
    assert time.perf_counter() - start < 5.0
    after = await run(registry, ctx, "return [1, 2, 3].length")
    assert after.output == "3"


async def test_off_heap_allocators_are_absent():
    # ArrayBuffers and wasm memory live outside the V8 heap the limit measures.
    registry, ctx = make()
    names = ["ArrayBuffer", "SharedArrayBuffer", "Uint8Array", "Float64Array", "DataView"]
    names += ["WebAssembly", "Atomics"]
    result = await run(registry, ctx, f"return {names}.map((n) => typeof globalThis[n])")
    assert result.output == '["undefined","undefined","undefined","undefined","undefined",' + (
        '"undefined","undefined"]'
    )


async def test_no_file_system_network_or_modules_inside_v8():
    registry, ctx = make()
    names = ["require", "fetch", "process", "Deno", "Bun", "XMLHttpRequest", "WebSocket"]
    names += ["read", "readFile", "readline", "load", "os", "module", "exports"]
    result = await run(registry, ctx, f"return {names}.map((n) => typeof globalThis[n])")
    assert result.output == "[" + ",".join(['"undefined"'] * len(names)) + "]"
    for specifier in ["fs", "/etc/passwd", "file:///etc/passwd", "https://example.com/x.js"]:
        imported = await run(
            registry,
            ctx,
            f"try {{ await import({specifier!r}); return 'loaded' }} "
            "catch (e) { return 'refused' }",
        )
        assert imported.output == "refused", specifier


async def test_output_is_capped_head_and_tail():
    registry, ctx = make(CodeModeLimits(max_output_tokens=100))
    result = await run(registry, ctx, "return 'HEAD' + 'x'.repeat(100000) + 'TAIL'")
    assert result.metadata["truncated"] is True
    assert estimate_tokens(result.output) <= 100
    assert result.output.startswith("HEAD") and result.output.endswith("TAIL")
    assert "tokens truncated" in result.output


async def test_a_tokenizer_passed_in_sets_the_budget():
    def count_words(text: str) -> int:
        return len(text.split())

    registry, ctx = make(CodeModeLimits(max_output_tokens=50), count_tokens=count_words)
    result = await run(
        registry, ctx, "return Array.from({length: 1000}, (_, i) => 'w' + i).join(' ')"
    )
    assert count_words(result.output) <= 50
    assert result.output.startswith("w0 w1") and result.output.endswith("w998 w999")


def test_truncate_head_tail_keeps_short_text_and_fits_long_text_to_the_budget():
    assert truncate_head_tail("short", 10) == ("short", False)
    text, truncated = truncate_head_tail("a" * 4000, 20)
    assert truncated and estimate_tokens(text) <= 20


async def test_a_syntax_error_is_an_error_result():
    registry, ctx = make()
    result = await run(registry, ctx, "return (")
    assert result.is_error and "SyntaxError" in result.output
    thrown = await run(registry, ctx, "print('partial'); null.x")
    assert thrown.is_error
    assert thrown.output.startswith("partial\nUncaught TypeError: Cannot read properties of null")


async def test_each_program_gets_a_fresh_isolate():
    registry, ctx = make()
    first = await run(registry, ctx, "globalThis.leak = 42; tools.extra = 1; return leak")
    assert first.output == "42"
    second = await run(registry, ctx, "return [typeof leak, typeof tools.extra]")
    assert second.output == '["undefined","function"]'  # unknown names route to the registry


async def test_timers_go_through_the_host_and_unawaited_calls_still_finish():
    slow = EchoTool("slow_side_effect", 0.1)
    registry, ctx = make(None, slow)
    result = await run(
        registry,
        ctx,
        "await new Promise((resolve) => setTimeout(resolve, 50));\n"
        "tools.slow_side_effect({text: 'fire and forget'}); return 'done'",
    )
    assert result.output == "done"
    assert slow.num_runs == 1
    assert any(r.name == "slow_side_effect" and not r.result.is_error for r in ctx.transcript)


async def test_bad_code_arguments_are_error_results():
    registry, ctx = make()
    not_a_string = await registry.call("code", {"code": 5}, ctx)
    assert not_a_string.is_error and "invalid arguments" in not_a_string.output
    code_tool = registry.get("code")
    blank = await code_tool({"code": "  "}, ctx)
    assert blank.is_error and "non-empty" in blank.output
    no_registry = await code_tool({"code": "return 1"}, ToolContext(Path(".")))
    assert no_registry.is_error and "registry" in no_registry.output


def test_description_lists_compact_signatures():
    specs = [
        EchoTool().spec,
        ToolSpec(
            "create_issue",
            "Create an issue in a repository. Long details follow.",
            {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "labels": {"type": "array", "items": {"type": "string"}},
                    "state": {"enum": ["open", "closed"]},
                    "meta": {"type": "object", "properties": {"x": {"type": "integer"}}},
                },
                "required": ["title"],
            },
            namespace="github",
        ),
        ToolSpec("list-files", "", {"type": "object", "properties": {}}),
        CodeModeTool().spec,
    ]
    text = code_mode_tool_description(specs, CodeModeLimits(timeout_s=5, max_output_tokens=500))
    lines = text.split("\n")
    assert lines[1:] == [
        "tools.echo({text: string}) - Echo the text back.",
        'tools.github__create_issue({title: string, labels?: string[], state?: "open"|"closed", '
        "meta?: {x?: number}}) - Create an issue in a repository.",
        'tools["list-files"]()',
    ]
    assert "5 s" in lines[0] and "500 tokens" in lines[0] and "Promise.all" in lines[0]


def test_limits_reject_nonsense():
    with pytest.raises(ValueError):
        CodeModeLimits(timeout_s=0)
    with pytest.raises(ValueError):
        CodeModeLimits(max_output_tokens=1)
