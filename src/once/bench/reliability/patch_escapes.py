"""Escape attempts through `apply_patch`: paths and links that lead out of the workspace.

apply_patch runs in the harness's own process, outside bubblewrap, so its path checks are
the whole defence. Each attempt applies real patches with the real tool (through the
registry) and checks the host afterwards: nothing new outside the workspace, the file a
link points at unchanged. The race attempt forces the window a concurrent command could
use (Code Mode runs calls in parallel): the patch is planned, then a directory it writes
into is swapped for a symlink out, then the plan is written.
"""

import os

from once.agent.tools.patch import PatchError, parse_patch, plan_patch
from once.bench.reliability.sandbox_arena import Arena, Attempt, Outcome, outcome

ORIGINAL = "original\n"


def _codex(*lines: str) -> str:
    return "\n".join(["*** Begin Patch", *lines, "*** End Patch"])


def _changed_outside(arena: Arena, expected: set[str]) -> list[str]:
    """Entries outside the workspace that are new or whose content changed."""
    found = []
    for path in sorted(arena.outside.iterdir()):
        if path.name not in expected:
            found.append(f"created {path}")
        elif path.read_text() != ORIGINAL:
            found.append(f"changed {path}")
    found += [f"created {p}" for p in sorted(arena.root.iterdir()) if p.name not in _ARENA_DIRS]
    return found


_ARENA_DIRS = {"workspace", "outside", "home"}


async def symlinks_out(arena: Arena) -> Outcome:
    name = "patch_symlinks_out"
    ws, target = arena.workspace, arena.outside / "target.txt"
    target.write_text(ORIGINAL)
    (ws / "notes.txt").write_text("one\n")
    (ws / "out").symlink_to(arena.outside)  # a directory link
    (ws / "linked.txt").symlink_to(target)  # a file link
    patches = {
        "add through a directory link": _codex("*** Add File: out/new.txt", "+x"),
        "update through a file link": _codex(
            "*** Update File: linked.txt", "@@", "-original", "+pwned"
        ),
        "replace a file link": _codex("*** Add File: linked.txt", "+pwned"),
        "move into a directory link": _codex(
            "*** Update File: notes.txt", "*** Move to: out/moved.txt", "@@", "-one", "+1"
        ),
        "unified diff through a file link": (
            "--- a/linked.txt\n+++ b/linked.txt\n@@ -1 +1 @@\n-original\n+pwned\n"
        ),
    }
    accepted = [what for what, text in patches.items() if not (await arena.patch(text)).is_error]
    escapes = _changed_outside(arena, {"target.txt"})
    escapes += [f"{what}: applied" for what in accepted]
    return outcome(name, escapes, f"{len(patches)} patches through symlinks refused")


async def paths_out(arena: Arena) -> Outcome:
    name = "patch_paths_out"
    (arena.workspace / "sub").mkdir()
    (arena.workspace / "notes.txt").write_text("one\n")
    absolute = arena.outside / "absolute.txt"
    patches = {
        "..": _codex("*** Add File: ../escaped.txt", "+x"),
        "sub/../..": _codex("*** Add File: sub/../../escaped.txt", "+x"),
        "an absolute path": _codex(f"*** Add File: {absolute}", "+x"),
        "move to ..": _codex(
            "*** Update File: notes.txt", "*** Move to: ../outside/moved.txt", "@@", "-one", "+1"
        ),
        "unified diff ..": "--- /dev/null\n+++ b/../outside/diffed.txt\n@@ -0,0 +1 @@\n+x\n",
        "unified diff absolute": f"--- /dev/null\n+++ {absolute}\n@@ -0,0 +1 @@\n+x\n",
    }
    accepted = [what for what, text in patches.items() if not (await arena.patch(text)).is_error]
    escapes = _changed_outside(arena, set()) + [f"{what}: applied" for what in accepted]
    return outcome(name, escapes, f"{len(patches)} patches with paths out refused")


async def symlink_swapped_after_planning(arena: Arena) -> Outcome:
    name = "patch_symlink_swapped_after_planning"
    ws = arena.workspace
    (ws / "pkg").mkdir()
    (ws / "pkg" / "mod.py").write_text(ORIGINAL)
    ops = parse_patch(
        _codex(
            *("*** Update File: pkg/mod.py", "@@", "-original", "+pwned"),
            *("*** Add File: pkg/new.py", "+x"),
        )
    )
    plan = plan_patch(ops, ws)  # checked: both paths are inside
    (arena.outside / "mod.py").write_text(ORIGINAL)
    os.rename(ws / "pkg", ws / "pkg-real")  # what a concurrent command could do
    (ws / "pkg").symlink_to(arena.outside)
    try:
        plan.write()
        wrote = "the plan was written"
    except PatchError as e:
        wrote = f"refused at write time: {e}"
    return outcome(name, _changed_outside(arena, {"mod.py"}), wrote)


async def hard_link_in_workspace(arena: Arena) -> Outcome:
    name = "patch_hard_link_in_workspace"
    target = arena.outside / "target.txt"
    target.write_text(ORIGINAL)
    # A link made outside the sandbox (the sandboxed shell cannot link across its mounts).
    os.link(target, arena.workspace / "linked.txt")
    result = await arena.patch(_codex("*** Update File: linked.txt", "@@", "-original", "+ours"))
    in_workspace = (arena.workspace / "linked.txt").read_text()
    escapes = _changed_outside(arena, {"target.txt"})
    if not result.is_error and in_workspace != "ours\n":
        escapes.append(f"the workspace file reads {in_workspace!r}")
    return outcome(name, escapes, "the workspace file was replaced; the linked one is unchanged")


PATCH_ATTEMPTS = [
    Attempt("patch_symlinks_out", symlinks_out),
    Attempt("patch_paths_out", paths_out),
    Attempt("patch_symlink_swapped_after_planning", symlink_swapped_after_planning),
    Attempt("patch_hard_link_in_workspace", hard_link_in_workspace),
]
