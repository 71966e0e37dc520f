import json
from pathlib import Path

import pytest

from once.agent.policy import (
    APPROVAL_MODES,
    MAX_PENDING_DECISIONS,
    ApprovalPolicy,
    is_known_safe_command,
)
from once.agent.tools.base import ToolContext, ToolResult, ToolSpec
from once.agent.tools.patch import ApplyPatchTool
from once.agent.tools.registry import ToolRegistry
from once.agent.tools.shell import ShellTool

SHELL = ShellTool.spec
PATCH = ApplyPatchTool.spec
MCP_TOOL = ToolSpec("create_issue", "Create an issue", {"type": "object"}, namespace="github")
SEARCH = ToolSpec("tool_search", "Search tools", {"type": "object"})


class FakeApprover:
    """Records what it was asked; answers from a fixed reply (or raises)."""

    def __init__(self, reply=True):
        self.reply = reply
        self.asked: list[tuple[str, dict]] = []

    def __call__(self, name: str, args: dict):
        self.asked.append((name, args))
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply


class AsyncApprover(FakeApprover):
    async def __call__(self, name: str, args: dict):
        return super().__call__(name, args)


def context(approve=None) -> ToolContext:
    return ToolContext(workspace=Path("."), approve=approve)


def shell(command, **extra) -> dict:
    return {"command": command, **extra}


ESCALATED = {"with_escalated_permissions": True, "justification": "needs the network"}


async def test_never_runs_sandboxed_without_asking_and_refuses_escalation():
    policy, approver = ApprovalPolicy("never"), FakeApprover()
    decision = await policy.authorize(SHELL, shell("rm -rf build"), context(approver))
    assert (decision.allowed, decision.sandboxed) == (True, True)
    refused = await policy.authorize(SHELL, shell("curl x", **ESCALATED), context(approver))
    assert not refused.allowed
    assert "without with_escalated_permissions" in refused.reason
    assert approver.asked == []


async def test_on_request_asks_only_for_escalation():
    policy, approver = ApprovalPolicy("on-request"), FakeApprover(True)
    plain = await policy.authorize(SHELL, shell("make"), context(approver))
    assert (plain.allowed, plain.sandboxed) == (True, True)
    assert approver.asked == []
    args = shell("pip install x", **ESCALATED)
    escalated = await policy.authorize(SHELL, args, context(approver))
    assert (escalated.allowed, escalated.sandboxed) == (True, False)
    assert approver.asked == [("shell", args)]  # the justification reaches the user

    declined = await policy.authorize(SHELL, args, context(FakeApprover(False)))
    assert not declined.allowed and "declined" in declined.reason


async def test_untrusted_asks_for_anything_not_known_safe():
    policy, approver = ApprovalPolicy("untrusted"), AsyncApprover(True)
    safe = await policy.authorize(SHELL, shell("git status && ls -la"), context(approver))
    assert (safe.allowed, safe.sandboxed) == (True, True)
    assert approver.asked == []
    approved = await policy.authorize(SHELL, shell("python setup.py"), context(approver))
    assert (approved.allowed, approved.sandboxed) == (True, False)
    # A known-safe command that asks for escalation is asked about too.
    await policy.authorize(SHELL, shell("ls", **ESCALATED), context(approver))
    assert [args["command"] for _, args in approver.asked] == ["python setup.py", "ls"]
    denied = await policy.authorize(SHELL, shell("rm x"), context(AsyncApprover(False)))
    assert not denied.allowed


async def test_untrusted_asks_for_patches_and_mcp_tools_but_not_tool_search():
    policy, approver = ApprovalPolicy("untrusted"), FakeApprover(True)
    for spec in (PATCH, MCP_TOOL, SEARCH):
        assert (await policy.authorize(spec, {"x": 1}, context(approver))).allowed
    assert [name for name, _ in approver.asked] == ["apply_patch", "github.create_issue"]
    for mode in ("never", "on-request", "on-failure"):
        policy.mode = mode
        assert (await policy.authorize(PATCH, {"input": "p"}, context(None))).allowed
    assert len(approver.asked) == 2


async def test_on_failure_runs_sandboxed_and_asks_only_for_a_retry():
    policy, approver = ApprovalPolicy("on-failure"), FakeApprover(True)
    args = shell("touch /etc/x")
    decision = await policy.authorize(SHELL, args, context(approver))
    assert (decision.allowed, decision.sandboxed) == (True, True)
    assert approver.asked == []
    assert await policy.approve_unsandboxed_retry(SHELL, args, context(approver), "Read-only")
    name, request = approver.asked[0]
    assert name == "shell" and request["retry_without_sandbox"] is True
    assert request["sandbox_failure"] == "Read-only" and request["command"] == "touch /etc/x"
    # Escalation is for on-request only.
    refused = await policy.authorize(SHELL, shell("x", **ESCALATED), context(approver))
    assert not refused.allowed


async def test_retry_is_offered_only_under_on_failure():
    approver = FakeApprover(True)
    for mode in ("never", "on-request", "untrusted"):
        policy = ApprovalPolicy(mode)
        assert not await policy.approve_unsandboxed_retry(SHELL, {}, context(approver), "x")
    assert approver.asked == []
    assert not await ApprovalPolicy("on-failure").approve_unsandboxed_retry(
        SHELL, {}, context(FakeApprover(False)), "x"
    )


@pytest.mark.parametrize(
    "approve, reason",
    [
        (None, "none given"),
        (FakeApprover(RuntimeError("terminal closed")), "terminal closed"),
        (FakeApprover("yes"), "declined"),  # only True approves
    ],
)
async def test_no_usable_approver_means_deny(approve, reason):
    decision = await ApprovalPolicy("untrusted").authorize(SHELL, shell("rm x"), context(approve))
    assert not decision.allowed
    assert reason in decision.reason


def test_unknown_modes_are_rejected():
    with pytest.raises(ValueError, match="approval mode"):
        ApprovalPolicy("always")
    policy = ApprovalPolicy("never")
    with pytest.raises(ValueError):
        policy.mode = "on_request"
    assert policy.mode == "never"


async def test_decisions_are_handed_to_the_tool_by_identity_once():
    policy = ApprovalPolicy("on-request")
    args = shell("curl x", **ESCALATED)
    decision = await policy.authorize(SHELL, args, context(FakeApprover(True)))
    assert policy.take_decision(dict(args)) is None  # an equal dict is not the same call
    assert policy.take_decision(args) == decision
    assert policy.take_decision(args) is None
    denied_args = shell("curl x", **ESCALATED)
    await policy.authorize(SHELL, denied_args, context(FakeApprover(False)))
    assert policy.take_decision(denied_args) is None
    kept = [shell(f"ls {i}") for i in range(MAX_PENDING_DECISIONS + 50)]
    for args in kept:
        await policy.authorize(SHELL, args, context())
    assert policy.take_decision(kept[0]) is None  # the oldest were dropped, memory is bounded
    assert policy.take_decision(kept[-1]) is not None


class Recorder:
    spec = ToolSpec("shell", "runs", ShellTool.spec.parameters)

    def __init__(self):
        self.ran: list[dict] = []

    async def __call__(self, args, ctx):
        self.ran.append(args)
        return ToolResult("ok")


async def test_mode_change_takes_effect_at_the_next_call_and_not_in_the_prompt():
    policy = ApprovalPolicy("never")
    recorder = Recorder()
    registry = ToolRegistry([recorder])
    ctx = ToolContext(workspace=Path("."), policy=policy, approve=FakeApprover(True))

    def prompt_tools() -> str:
        tools = [ShellTool.spec.to_function_tool(), ApplyPatchTool.spec.to_function_tool()]
        return json.dumps(tools, sort_keys=True, separators=(",", ":"))

    before = prompt_tools()
    first = await registry.call("shell", json.dumps(shell("curl x", **ESCALATED)), ctx)
    assert first.is_error and "not run" in first.output and recorder.ran == []
    policy.mode = "on-request"
    second = await registry.call("shell", json.dumps(shell("curl x", **ESCALATED)), ctx)
    assert not second.is_error and len(recorder.ran) == 1
    assert prompt_tools() == before
    for word in (*APPROVAL_MODES, "approval", "policy"):
        assert word not in before


@pytest.mark.parametrize(
    "command",
    [
        "ls -la",
        "git status",
        "git diff HEAD~1 -- src",
        "git log --oneline -5",
        "git branch -a",
        "cat README.md | grep -n once | head -n 5",
        "ls && pwd; echo done || true",
        "rg -n 'def main' src",
        'grep -r "plain string" .',
        "find . -name '*.py'",
        "sed -n 1,20p setup.py",
        "ls *.py",
        ["ls", "-la"],
        ["bash", "-lc", "git status && wc -l README.md"],
        ["/bin/sh", "-c", "cat a"],
    ],
)
def test_known_safe_commands(command):
    assert is_known_safe_command(command)


@pytest.mark.parametrize(
    "command",
    [
        "rm -rf build",
        "ls > listing.txt",
        "cat < /etc/passwd",
        "echo $(rm x)",
        "echo `rm x`",
        'echo "$HOME"',
        "ls; rm x",
        "ls\nrm x",
        "ls & rm x",
        "(ls)",
        "FOO=1 ls",
        "ls # comment",
        "ls 'unterminated",
        "find . -name x -delete",
        "find . -exec rm {} +",
        "find . *",  # a file named "-delete" would become an option
        "find . -de\\lete",
        "git push",
        "git -c core.pager=sh log",
        "git diff --output=x",
        "git branch new-branch",
        "rg --pre cat x",
        "rg --pre=cat x",
        "rg -uz x",
        "sed -i s/a/b/ file",
        "sed -n 1p;w/tmp/x file",
        "python -c 'print(1)'",
        "",
        ["rm", "x"],
        ["bash", "-lc", "rm x"],
        [],
        None,
        42,
    ],
)
def test_unsafe_commands(command):
    assert not is_known_safe_command(command)
