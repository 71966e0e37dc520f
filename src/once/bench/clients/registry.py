"""Every real client once is tested with, and what one tool round trip is for each.

A client passes when it connected (a request reached the gateway), got a streamed answer
(SSE or WebSocket) where it streams, sent a tool's real result back (the tool's output is
in a later prompt), finished (its exit status, or its final answer), and once answered
none of its requests with an error.
"""

import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from once.bench.clients import node_clients, python_clients
from once.bench.clients.scripted import TOOL_RESULT_MARK, client_gateway, tool_call_block
from once.gateway.model import ModelRuntime

FINAL = "I listed the files: hello.txt is among them."
LIST_JS = 'const r = await tools.exec_command({cmd: "ls"});\ntext(r.output);'
TIME_JS = (
    'const r = await tools.mcp__time__get_current_time({timezone: "UTC"});\n'
    "text(JSON.stringify(r));"
)
PYTHON_MODEL = "smollm2-135m-instruct"
ERROR_OUTCOMES = ("error", "response.failed")

Run = Callable[[str, Path], Awaitable[str]]  # (gateway URL, workspace) -> its final text


@dataclass(frozen=True)
class ClientCase:
    name: str
    call_text: str  # what the scripted model answers first: the client's tool call
    marker: str  # what the tool's result holds when it really ran
    run: Run
    final_text: str = FINAL
    streams: bool = True
    aliases: tuple[str, ...] = ()
    result_mark: str = TOOL_RESULT_MARK
    # Replies between the first and the last: (what the prompt holds, what the model says).
    steps: tuple[tuple[str, str], ...] = ()


@dataclass
class ClientResult:
    connected: bool
    streamed: bool
    tool_round_trip: bool
    finished: bool
    gateway_errors: int
    first_error: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return (
            self.connected
            and self.streamed
            and self.tool_round_trip
            and self.finished
            and not self.gateway_errors
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def _codex(websocket: bool = False, mcp: bool = False) -> Run:
    async def run(url: str, workspace: Path) -> str:
        command = [str(Path(_venv_bin()) / "mcp-server-time"), "--local-timezone", "UTC"]
        done = await node_clients.run_codex(
            url,
            workspace,
            "What time is it in UTC?" if mcp else "List the files here.",
            websocket=websocket,
            mcp_command=command if mcp else None,
        )
        if done.returncode != 0:
            raise RuntimeError(done.first_error() or f"codex exited with {done.returncode}")
        return done.stdout

    return run


async def _claude_code(url: str, workspace: Path) -> str:
    done = await node_clients.run_claude_code(url, workspace, "List the files here.")
    if done.returncode != 0:
        raise RuntimeError(done.first_error() or f"claude exited with {done.returncode}")
    return done.stdout


def _python(client: Callable[[str, Path, str], Awaitable[str]]) -> Run:
    async def run(url: str, workspace: Path) -> str:
        return await client(url, workspace, PYTHON_MODEL)

    return run


def _venv_bin() -> str:
    import sys

    return str(Path(sys.executable).parent)


LIST_CALL = tool_call_block("list_files", arguments={})
CASES = [
    ClientCase("codex-http", tool_call_block("functions.exec", input=LIST_JS), "hello.txt",
               _codex()),
    ClientCase("codex-websocket", tool_call_block("functions.exec", input=LIST_JS), "hello.txt",
               _codex(websocket=True)),
    ClientCase("codex-mcp-http", tool_call_block("functions.exec", input=TIME_JS), '"timezone"',
               _codex(mcp=True)),
    ClientCase("codex-mcp-websocket", tool_call_block("functions.exec", input=TIME_JS),
               '"timezone"', _codex(websocket=True, mcp=True)),
    ClientCase("claude-code",
               "I'll list the files.\n" + tool_call_block(
                   "Bash", arguments={"command": "ls", "description": "List files"}),
               "hello.txt", _claude_code),
    ClientCase("openai-responses", LIST_CALL, "hello.txt",
               _python(python_clients.openai_responses)),
    ClientCase("openai-chat", LIST_CALL, "hello.txt", _python(python_clients.openai_chat)),
    ClientCase("anthropic-messages", LIST_CALL, "hello.txt",
               _python(python_clients.anthropic_messages)),
    ClientCase("openai-agents", tool_call_block("list_workspace", arguments={}), "hello.txt",
               _python(python_clients.openai_agents), streams=False),
    ClientCase("openai-agents-tool-search",
               tool_call_block("tool_search", arguments={"query": "list the workspace files"}),
               "hello.txt", _python(python_clients.openai_agents_tool_search), streams=False,
               steps=(('"name":"list_workspace"', tool_call_block("list_workspace",
                                                                  arguments={})),)),
    ClientCase("openai-agents-programs",
               tool_call_block("program", input="text(await tools.list_workspace({}));"),
               "hello.txt", _python(python_clients.openai_agents_programs), streams=False),
    ClientCase("openai-structured", tool_call_block("list_files", arguments={"folder": "."}),
               "hello.txt", _python(python_clients.openai_structured),
               final_text=json.dumps({"files": ["README.md", "hello.txt"]}), streams=False),
    ClientCase("mini-swe-agent", tool_call_block("bash", arguments={"command": "ls"}), "hello.txt",
               _python(python_clients.mini_swe_agent),
               final_text=tool_call_block(
                   "bash", arguments={"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
               streams=False),
    ClientCase("smolagents", tool_call_block("list_workspace", arguments={}), "hello.txt",
               _python(python_clients.smolagents),
               final_text=tool_call_block("final_answer", arguments={"answer": FINAL}),
               streams=False, result_mark="<|im_start|>user\nObservation:"),
]  # fmt: skip
CASES_BY_NAME = {case.name: case for case in CASES}


async def run_case(case: ClientCase, runtime: ModelRuntime) -> ClientResult:
    started = time.perf_counter()
    error = None
    finished = False
    with tempfile.TemporaryDirectory(prefix=f"once-{case.name}-") as folder:
        workspace = python_clients.git_workspace(Path(folder) / "repo")
        async with client_gateway(
            runtime, case.call_text, case.final_text, case.aliases, case.result_mark, case.steps
        ) as gw:
            try:
                await case.run(gw.url, workspace)
                finished = True
            except Exception as e:  # noqa: BLE001 - the client's failure is the result
                error = f"{type(e).__name__}: {e}"[:2000]
            outcomes = gw.outcomes()
            metrics = gw.gateway.metrics
            streamed_count = sum(
                metrics.value(metrics.api_requests, api, mode)
                for api in ("responses", "chat", "messages")
                for mode in ("sse", "websocket")
            )
            round_trip = gw.tool_result_returned(case.marker)
    return ClientResult(
        connected=bool(gw.engine.requests) or bool(outcomes),
        streamed=streamed_count > 0 or not case.streams,
        tool_round_trip=round_trip,
        finished=finished,
        gateway_errors=sum(outcomes.get(kind, 0) for kind in ERROR_OUTCOMES),
        first_error=error,
        seconds=round(time.perf_counter() - started, 2),
    )
