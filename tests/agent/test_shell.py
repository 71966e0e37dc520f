import asyncio
import os
import re
import tempfile
import time
from pathlib import Path

import pytest

from once.agent.policy import ApprovalPolicy
from once.agent.tools.base import ToolContext
from once.agent.tools.registry import ToolRegistry
from once.agent.tools.sandbox import NoSandbox, Sandbox
from once.agent.tools.shell import HeadTailBuffer, ShellTool
from tests.agent.test_sandbox import no_process_with

SEQ_100K_BYTES = 9 * 2 + 90 * 3 + 900 * 4 + 9000 * 5 + 90000 * 6 + 7  # `seq 1 100000`
CUT_MARKER = re.compile(r"\[\.\.\. (\d+) bytes \((\d+) lines\) cut of (\d+) \.\.\.\]")


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


def context(workspace: Path, sandbox=None, **kwargs) -> ToolContext:
    return ToolContext(workspace=workspace, sandbox=sandbox or NoSandbox(), **kwargs)


async def run(workspace: Path, command, sandbox=None, tool=None, **args):
    tool = tool or ShellTool(login_shell=False)
    return await tool({"command": command, **args}, context(workspace, sandbox))


async def test_output_interleaves_stdout_and_stderr_with_exit_code(workspace):
    result = await run(workspace, "echo a; echo b >&2; echo c")
    assert result.output == "Exit code: 0\nOutput:\na\nb\nc\n"
    assert not result.is_error and result.metadata["sandbox"] == "none"
    failed = await run(workspace, "echo nope >&2; exit 3")
    assert failed.is_error and failed.output.startswith("Exit code: 3\n")
    assert "nope" in failed.output


async def test_argv_commands_and_missing_programs(workspace):
    result = await run(workspace, ["printf", "%s-%s", "a", "b"])
    assert result.output.endswith("Output:\na-b")
    missing = await run(workspace, ["/nonexistent/program"])
    assert missing.is_error and missing.metadata["exit_code"] == 127
    assert "could not start" in missing.output


async def test_credentials_in_the_environment_do_not_reach_commands(workspace, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("GH_TOKEN", "ghp-secret")
    monkeypatch.setenv("ONCE_VISIBLE", "visible")
    result = await run(workspace, "env")
    assert "ONCE_VISIBLE=visible" in result.output
    assert "sk-secret" not in result.output and "ghp-secret" not in result.output
    permissive = ShellTool(login_shell=False, secret_env_markers=())
    assert "sk-secret" in (await run(workspace, "env", tool=permissive)).output


async def test_workdir_is_relative_to_the_workspace(workspace):
    (workspace / "sub").mkdir()
    result = await run(workspace, "pwd", workdir="sub")
    assert result.output.rstrip().endswith(str(workspace / "sub"))
    missing = await run(workspace, "pwd", workdir="nowhere")
    assert missing.is_error and "not a directory" in missing.output


async def test_timeout_kills_the_process_group(workspace):
    start = time.perf_counter()
    result = await run(workspace, "sleep 100.4375 & sleep 100", timeout_ms=300)
    assert time.perf_counter() - start < 5
    assert result.is_error and result.metadata["timed_out"]
    assert result.output.startswith("Exit code: 124\nTimed out after 0.3 s")
    assert await no_process_with("sleep 100.4375")


async def test_a_background_process_does_not_hang_the_call(workspace):
    start = time.perf_counter()
    result = await run(workspace, "sleep 100.5625 & echo started")
    assert time.perf_counter() - start < 5
    assert "started" in result.output and not result.is_error
    assert await no_process_with("sleep 100.5625")  # no process outlives its call


async def test_cancelling_the_call_kills_the_command(workspace):
    task = asyncio.create_task(run(workspace, "sleep 100.6875"))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await no_process_with("sleep 100.6875")


async def test_long_output_keeps_head_and_tail_within_budget(workspace):
    tool = ShellTool(max_output_bytes=1000, login_shell=False)
    result = await run(workspace, "seq 1 100000", tool=tool)
    body = result.output.split("Output:\n", 1)[1]
    assert body.startswith("1\n2\n3\n") and body.endswith("99999\n100000\n")
    (marker,) = CUT_MARKER.findall(body)
    num_cut, num_cut_lines, total = map(int, marker)
    assert total == SEQ_100K_BYTES == result.metadata["num_output_bytes"]
    kept = CUT_MARKER.sub("", body).replace("\n\n", "\n", 1)
    assert len(kept.encode()) + num_cut == total
    assert len(kept.encode()) <= 1000
    assert kept.count("\n") + num_cut_lines == 100000
    assert result.metadata["num_cut_bytes"] == num_cut


def test_head_tail_buffer_is_chunking_independent():
    data = "".join(f"line {i} \u00e9\n" for i in range(500)).encode()
    whole = HeadTailBuffer(300)
    whole.feed(data)
    chunked = HeadTailBuffer(300)
    for i in range(0, len(data), 7):
        chunked.feed(data[i : i + 7])
    assert whole.render() == chunked.render()
    text, num_cut = whole.render()
    assert text.startswith("line 0 \u00e9\n") and text.endswith("line 499 \u00e9\n")
    assert num_cut > 0
    small = HeadTailBuffer(300)
    small.feed(b"short\n")
    assert small.render() == ("short\n", 0)
    with pytest.raises(ValueError):
        HeadTailBuffer(1)


@pytest.mark.parametrize(
    "args",
    [
        {"command": ""},
        {"command": 42},
        {"command": []},
        {"command": "ls", "timeout_ms": 0},
        {"command": "ls", "timeout_ms": 10**9},
        {"command": "ls", "unknown": True},
        {"timeout_ms": 5},
    ],
)
async def test_bad_arguments_are_error_results(workspace, args):
    registry = ToolRegistry([ShellTool()])
    result = await registry.call("shell", args, context(workspace))
    assert result.is_error and "full schema" in result.output


# --- the policy's decisions, carried out by a real sandbox -----------------------------


@pytest.fixture
def sandbox() -> Sandbox:
    sandbox = Sandbox()
    if not sandbox.enforced:
        pytest.skip(f"no working bubblewrap ({sandbox.reason}); test_sandbox.py reports it")
    return sandbox


@pytest.fixture
def outside():
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="once-outside-") as path:
        yield Path(path)


class Approver:
    def __init__(self, reply: bool):
        self.reply = reply
        self.asked: list[tuple[str, dict]] = []

    def __call__(self, name, args):
        self.asked.append((name, args))
        return self.reply


async def call(registry, workspace, sandbox, policy, approver, **args):
    ctx = ToolContext(workspace=workspace, sandbox=sandbox, policy=policy, approve=approver)
    return await registry.call("shell", args, ctx)


async def test_escalation_runs_outside_only_when_approved(workspace, sandbox, outside):
    registry = ToolRegistry([ShellTool(login_shell=False)])
    policy, approver = ApprovalPolicy("on-request"), Approver(True)
    touch = f"touch {outside}/made"
    sandboxed = await call(registry, workspace, sandbox, policy, approver, command=touch)
    assert sandboxed.is_error and "Read-only file system" in sandboxed.output
    assert approver.asked == []
    escalated = await call(
        registry, workspace, sandbox, policy, approver,
        command=touch, with_escalated_permissions=True, justification="write a cache",
    )  # fmt: skip
    assert not escalated.is_error and escalated.metadata["sandbox"] == "none"
    assert (outside / "made").exists()
    assert approver.asked[0][1]["justification"] == "write a cache"


async def test_mode_switch_applies_to_the_next_call(workspace, sandbox, outside):
    registry = ToolRegistry([ShellTool(login_shell=False)])
    policy, approver = ApprovalPolicy("never"), Approver(True)
    args = {"command": f"touch {outside}/x", "with_escalated_permissions": True}
    refused = await call(registry, workspace, sandbox, policy, approver, **args)
    assert refused.is_error and "not run" in refused.output
    policy.mode = "on-request"
    allowed = await call(registry, workspace, sandbox, policy, approver, **args)
    assert not allowed.is_error and (outside / "x").exists()


@pytest.mark.parametrize("approve", [True, False])
async def test_on_failure_offers_an_unsandboxed_retry(workspace, sandbox, outside, approve):
    registry = ToolRegistry([ShellTool(login_shell=False)])
    approver = Approver(approve)
    result = await call(
        registry, workspace, sandbox, ApprovalPolicy("on-failure"), approver,
        command=f"touch {outside}/retried",
    )  # fmt: skip
    ((name, request),) = approver.asked
    assert name == "shell" and request["retry_without_sandbox"]
    assert "Read-only file system" in request["sandbox_failure"]
    assert (outside / "retried").exists() == approve
    assert result.is_error != approve
    assert ("rerun outside the sandbox" in result.output) == approve


async def test_on_failure_does_not_ask_about_ordinary_failures(workspace, sandbox):
    registry = ToolRegistry([ShellTool(login_shell=False)])
    approver = Approver(True)
    result = await call(
        registry, workspace, sandbox, ApprovalPolicy("on-failure"), approver,
        command="grep -q absent /etc/hostname",
    )  # fmt: skip
    assert result.is_error and approver.asked == []
    assert result.metadata["sandbox"] == "bubblewrap"


async def test_without_a_configured_sandbox_the_probed_one_is_used(workspace, sandbox, outside):
    ctx = ToolContext(workspace=workspace)  # sandbox=None: the default, never "no sandbox"
    result = await ShellTool(login_shell=False)({"command": f"touch {outside}/y"}, ctx)
    assert result.metadata["sandbox"] == "bubblewrap"
    assert not (outside / "y").exists()
    assert os.listdir(outside) == []
