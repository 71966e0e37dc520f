"""The approval policy: live harness state deciding, per call, whether a tool may run and how.

The four modes Codex users know:

- `never`: never ask. Shell commands run in the sandbox; a failure goes back to the model.
- `on-request`: shell commands run in the sandbox; the model may ask to run one outside it
  (`with_escalated_permissions` plus a `justification`), and the user decides.
- `untrusted`: ask before anything that is not a known-safe read-only command (`ls`, `cat`,
  `grep`, `rg`, `git status`, ...); known-safe ones run in the sandbox, and a command the
  user approved runs outside it, as the user saw it.
- `on-failure`: run in the sandbox; when a command fails the way a sandbox denial looks,
  the shell tool asks (through `approve_unsandboxed_retry`) whether to rerun it outside.

Escalation is only for `on-request`; in other modes a call that asks for it is refused with
a reason, so the model retries without it. `apply_patch` (confined to the workspace by the
tool itself) asks only under `untrusted`; other tools likewise, except the read-only ones
in `trusted_tools`.

Nothing here reaches the prompt: `mode` can change between two calls, and the next call
follows the new mode. The registry calls `authorize` before the tool runs and does not
hand the decision over, so an allowed decision is kept for the tool under the identity of
its arguments dict (the registry passes the same dict to both) until `take_decision`.
"""

import functools
import inspect
from collections import OrderedDict

import tree_sitter as ts
import tree_sitter_bash

from once.agent.tools.base import Decision, ToolContext, ToolSpec

NEVER = "never"
ON_REQUEST = "on-request"
ON_FAILURE = "on-failure"
UNTRUSTED = "untrusted"
APPROVAL_MODES = (NEVER, ON_REQUEST, ON_FAILURE, UNTRUSTED)

SHELL = "shell"
APPLY_PATCH = "apply_patch"
TRUSTED_TOOLS = frozenset({"tool_search", "code"})  # read-only, or whose nested calls ask

# Decisions kept for tools to take; Code Mode runs calls in parallel, so more than one.
MAX_PENDING_DECISIONS = 256


class ApprovalPolicy:
    def __init__(self, mode: str = ON_REQUEST, *, trusted_tools=TRUSTED_TOOLS):
        self.mode = mode
        self.trusted_tools = frozenset(trusted_tools)
        self._pending: OrderedDict[int, tuple[dict, Decision]] = OrderedDict()

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in APPROVAL_MODES:
            raise ValueError(f"approval mode must be one of {APPROVAL_MODES}, got {mode!r}")
        self._mode = mode

    async def authorize(self, spec: ToolSpec, args: dict, ctx: ToolContext) -> Decision:
        builtin = spec.namespace == ""
        if builtin and spec.name == SHELL:
            decision = await self._authorize_shell(spec, args, ctx)
            if decision.allowed:  # the shell tool takes it to know whether to sandbox
                self._pending[id(args)] = (args, decision)
                while len(self._pending) > MAX_PENDING_DECISIONS:
                    self._pending.popitem(last=False)
            return decision
        if self.mode == UNTRUSTED and not (builtin and spec.name in self.trusted_tools):
            return await self._ask(spec, args, ctx, sandboxed=True)
        return Decision(True, f"allowed by approval policy {self.mode}")

    def take_decision(self, args: dict) -> Decision | None:
        """The decision `authorize` made for this very arguments dict, once."""
        entry = self._pending.pop(id(args), None)
        return entry[1] if entry is not None and entry[0] is args else None

    async def approve_unsandboxed_retry(
        self, spec: ToolSpec, args: dict, ctx: ToolContext, failure: str
    ) -> bool:
        """on-failure: after a sandboxed run failed, may it run again outside the sandbox?"""
        if self.mode != ON_FAILURE:
            return False
        request = {**args, "retry_without_sandbox": True, "sandbox_failure": failure}
        return (await self._ask(spec, request, ctx, sandboxed=False)).allowed

    async def _authorize_shell(self, spec: ToolSpec, args: dict, ctx: ToolContext) -> Decision:
        escalate = bool(args.get("with_escalated_permissions"))
        if self.mode == UNTRUSTED:
            if not escalate and is_known_safe_command(args.get("command")):
                return Decision(True, "known-safe read-only command")
            return await self._ask(spec, args, ctx, sandboxed=False)
        if not escalate:
            return Decision(True, f"runs in the sandbox under approval policy {self.mode}")
        if self.mode != ON_REQUEST:
            return Decision(
                False,
                f"approval policy is {self.mode}: escalated permissions cannot be granted; "
                "run the command again without with_escalated_permissions",
            )
        return await self._ask(spec, args, ctx, sandboxed=False)

    async def _ask(self, spec: ToolSpec, args: dict, ctx: ToolContext, *, sandboxed: bool):
        if ctx.approve is None:
            return Decision(False, f"approval policy {self.mode} requires approval; none given")
        try:
            answer = ctx.approve(spec.display_name, args)
            if inspect.isawaitable(answer):
                answer = await answer
        except Exception as e:  # noqa: BLE001 - a broken prompt must not end the session
            return Decision(False, f"asking for approval failed: {type(e).__name__}: {e}")
        if answer is not True:
            return Decision(False, "the user declined")
        return Decision(True, "approved by the user", sandboxed=sandboxed)


# --- known-safe commands ---------------------------------------------------------------
#
# As Codex does: the command (a string run by `bash -lc`, or an argv, possibly
# `bash -lc SCRIPT`) is parsed with tree-sitter-bash; it is safe only if the script is
# plain words joined by `&&`, `||`, `;` and `|` (no redirection, substitution, expansion,
# subshell, background job or comment), and every command in it is read-only.

SAFE_COMMANDS = frozenset(
    "cat cd echo false grep head id ls nl pwd tail true wc which whoami stat uname du "
    "basename dirname realpath".split()
)
GIT_READ_ONLY = frozenset({"status", "log", "diff", "show"})
GIT_BRANCH_LISTING = frozenset({"-a", "--all", "-r", "--remotes", "-v", "-vv", "--list"})
FIND_UNSAFE = frozenset("-exec -execdir -ok -okdir -delete -fls -fprint -fprint0 -fprintf".split())
RG_UNSAFE = ("--pre", "--hostname-bin", "--search-zip")  # and -z, also inside -uz
SHELLS = frozenset({"bash", "sh", "zsh"})
# Node kinds a plain command sequence consists of; anything else makes it unsafe.
PLAIN_NODES = frozenset(
    "program list pipeline command command_name word string string_content raw_string "
    "number && || ; | \" '".split()
)
WORD_NODES = frozenset({"word", "string", "raw_string", "number"})
GLOB_CHARS = frozenset("*?[{")
# Commands whose options can execute or write: their words may not be globs (a file
# named "-delete" would otherwise become an option of `find`).
OPTION_CHECKED = frozenset({"find", "rg", "git", "sed"})


def is_known_safe_command(command: object) -> bool:
    """A command (a script string or an argv, as the model sent it) that only reads."""
    if isinstance(command, str):
        return _is_safe_script(command)
    if (
        not isinstance(command, list)
        or not command
        or not all(isinstance(word, str) for word in command)
    ):
        return False
    if (
        len(command) == 3
        and command[0].rsplit("/", 1)[-1] in SHELLS
        and command[1]
        in (
            "-c",
            "-lc",
        )
    ):
        return _is_safe_script(command[2])
    return _is_safe_argv(command)


@functools.cache
def _bash_parser() -> ts.Parser:
    return ts.Parser(ts.Language(tree_sitter_bash.language()))


def _is_safe_script(script: str) -> bool:
    if not script.strip():
        return False
    root = _bash_parser().parse(script.encode()).root_node
    if root.has_error:
        return False
    commands = []
    stack = [root]
    while stack:
        node = stack.pop()
        if node.type not in PLAIN_NODES:
            return False
        if node.type == "command":
            commands.append(node)
        else:
            stack.extend(node.children)
    for node in commands:
        argv = _command_words(node)
        if argv is None or not _is_safe_argv(argv):
            return False
    return bool(commands)


def _command_words(command: ts.Node) -> list[str] | None:
    words = []
    for child in command.children:
        node = child.children[0] if child.type == "command_name" else child
        if node.type not in WORD_NODES:
            return None
        text = _source_text(node)
        if node.type == "raw_string":
            words.append(text[1:-1])
            continue
        if node.type == "string" and any(
            part.type not in ('"', "string_content") for part in node.children
        ):
            return None
        if "\\" in text:
            return None  # an escape changes the word bash sees
        if node.type == "string":
            text = text[1:-1]
        elif GLOB_CHARS & set(text) and _command_name(command) in OPTION_CHECKED:
            return None  # a glob expands to file names, and a name can be an option
        words.append(text)
    return words


def _source_text(node: ts.Node) -> str:
    # tree-sitter types `text` as optional: it is None only for a tree parsed without its
    # source bytes, and every tree here is parsed from the script's bytes.
    return (node.text or b"").decode()


def _command_name(command: ts.Node) -> str:
    for child in command.children:
        if child.type == "command_name":
            return _source_text(child)
    return ""


def _is_safe_argv(argv: list[str]) -> bool:
    name, args = argv[0], argv[1:]
    if name in SAFE_COMMANDS:
        return True
    if name == "find":
        return not any(arg in FIND_UNSAFE for arg in args)
    if name == "rg":
        return not any(_is_unsafe_rg_option(arg) for arg in args)
    if name == "git":
        return _is_safe_git(args)
    if name == "sed":
        # Only `sed -n Np FILE` / `sed -n M,Np FILE`: printing a range of lines.
        return (
            len(args) in (2, 3)
            and args[0] == "-n"
            and args[1].endswith("p")
            and all(part.isdigit() for part in args[1][:-1].split(","))
            and args[1][:-1].count(",") <= 1
        )
    return False


def _is_safe_git(args: list[str]) -> bool:
    if not args:
        return False
    subcommand, options = args[0], args[1:]
    # --output writes a file; --ext-diff and --textconv run configured programs.
    if any(o.startswith(("--output", "--ext-diff", "--textconv", "--exec")) for o in options):
        return False
    if subcommand in GIT_READ_ONLY:
        return True
    if subcommand == "branch":
        return all(option in GIT_BRANCH_LISTING for option in options)
    return False


def _is_unsafe_rg_option(arg: str) -> bool:
    if arg.startswith("--"):
        return any(arg == opt or arg.startswith(opt + "=") for opt in RG_UNSAFE)
    return arg.startswith("-") and "z" in arg
