from pathlib import Path

import pytest

from once.agent.tools.base import ToolContext
from once.agent.tools.patch import ApplyPatchTool, PatchError, parse_patch
from once.agent.tools.registry import ToolRegistry

MAIN = """import sys


def greet(name):
    print("hello", name)


def main():
    greet(sys.argv[1])
    return 0


if __name__ == "__main__":
    main()
"""


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "main.py").write_text(MAIN)
    (ws / "notes.txt").write_text("one\ntwo\nthree\n")
    return ws


async def apply(workspace: Path, patch: str):
    return await ApplyPatchTool()({"input": patch}, ToolContext(workspace=workspace))


def snapshot(workspace: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(workspace)): p.read_bytes() for p in workspace.rglob("*") if p.is_file()
    }


async def test_add_update_delete_in_one_patch(workspace):
    result = await apply(
        workspace,
        """*** Begin Patch
*** Add File: pkg/new.py
+VALUE = 1
+
*** Update File: notes.txt
@@
 one
-two
+TWO
 three
*** Delete File: src/main.py
*** End Patch
""",
    )
    assert not result.is_error, result.output
    assert (workspace / "pkg" / "new.py").read_text() == "VALUE = 1\n\n"
    assert (workspace / "notes.txt").read_text() == "one\nTWO\nthree\n"
    assert not (workspace / "src" / "main.py").exists()
    assert result.output.splitlines()[1:] == ["A pkg/new.py", "M notes.txt", "D src/main.py"]


async def test_multi_hunk_update_with_anchor_and_move(workspace):
    (workspace / "src" / "main.py").chmod(0o755)
    result = await apply(
        workspace,
        """*** Begin Patch
*** Update File: src/main.py
*** Move to: src/app.py
@@ def greet(name):
-    print("hello", name)
+    print("hi", name)
@@ def main():
     greet(sys.argv[1])
-    return 0
+    return 1
*** End Patch""",
    )
    assert not result.is_error, result.output
    assert not (workspace / "src" / "main.py").exists()
    moved = workspace / "src" / "app.py"
    assert moved.read_text() == MAIN.replace('"hello"', '"hi"').replace("return 0", "return 1")
    assert moved.stat().st_mode & 0o777 == 0o755
    assert "M src/app.py (moved from src/main.py)" in result.output


async def test_an_updated_file_keeps_its_mode_and_a_hard_link_keeps_the_old_text(workspace):
    script = workspace / "src" / "main.py"
    script.chmod(0o750)
    other_name = workspace / "main-link.py"
    other_name.hardlink_to(script)
    patch = (
        "*** Begin Patch\n*** Update File: src/main.py\n@@\n-import sys\n+import os\n*** End Patch"
    )
    assert not (await apply(workspace, patch)).is_error
    assert script.stat().st_mode & 0o777 == 0o750
    assert script.read_text().startswith("import os\n")
    # The file was replaced, not rewritten in place: the other link is the old file.
    assert other_name.read_text() == MAIN
    assert [p.name for p in workspace.rglob(".once-patch-*")] == []


async def test_end_of_file_hunk_and_whitespace_tolerance(workspace):
    (workspace / "notes.txt").write_text("x\nend\nmiddle\nend   \n")
    result = await apply(
        workspace,
        "*** Begin Patch\n*** Update File: notes.txt\n@@\n-end\n+END\n*** End of File\n"
        "*** End Patch",
    )
    assert not result.is_error, result.output
    # The end-of-file hunk matched the last "end" (with trailing spaces), not the first.
    assert (workspace / "notes.txt").read_text() == "x\nend\nmiddle\nEND\n"


async def test_typographic_quotes_match_plain_ones(workspace):
    (workspace / "notes.txt").write_text("say \u201chi\u201d \u2014 twice\n")
    patch = '*** Begin Patch\n*** Update File: notes.txt\n-say "hi" - twice\n+said\n*** End Patch'
    assert not (await apply(workspace, patch)).is_error
    assert (workspace / "notes.txt").read_text() == "said\n"


async def test_unified_diff_modify_add_delete_and_rename(workspace):
    (workspace / "old.txt").write_text("a\nb\n")
    diff = """diff --git a/notes.txt b/notes.txt
--- a/notes.txt
+++ b/notes.txt
@@ -1,3 +1,4 @@
 one
+one and a half
 two
 three
--- /dev/null
+++ b/docs/added.md
@@ -0,0 +1,2 @@
+# Added
+text
--- a/src/main.py
+++ /dev/null
@@ -1 +0,0 @@
-import sys
diff --git a/old.txt b/renamed.txt
similarity index 50%
rename from old.txt
rename to renamed.txt
--- a/old.txt
+++ b/renamed.txt
@@ -1,2 +1,2 @@
 a
-b
+c
"""
    result = await apply(workspace, diff)
    assert not result.is_error, result.output
    assert (workspace / "notes.txt").read_text() == "one\none and a half\ntwo\nthree\n"
    assert (workspace / "docs" / "added.md").read_text() == "# Added\ntext\n"
    assert not (workspace / "src" / "main.py").exists()
    assert not (workspace / "old.txt").exists()
    assert (workspace / "renamed.txt").read_text() == "a\nc\n"


async def test_unified_diff_hunks_use_line_numbers_then_search(workspace):
    (workspace / "rep.txt").write_text("x\ny\nx\ny\nx\ny\n")
    # Both hunks' context occurs three times: the line numbers pick the occurrence.
    diff = "--- rep.txt\n+++ rep.txt\n@@ -3,2 +3,2 @@\n x\n-y\n+Y\n@@ -5,2 +5,2 @@\n x\n-y\n+Z\n"
    assert not (await apply(workspace, diff)).is_error
    assert (workspace / "rep.txt").read_text() == "x\ny\nx\nY\nx\nZ\n"
    # Stale line numbers (the file grew at the top): found by searching instead.
    (workspace / "notes.txt").write_text("new\nlines\none\ntwo\nthree\n")
    diff = "--- a/notes.txt\n+++ b/notes.txt\n@@ -1,2 +1,2 @@\n one\n-two\n+2\n"
    assert not (await apply(workspace, diff)).is_error
    assert (workspace / "notes.txt").read_text() == "new\nlines\none\n2\nthree\n"


async def test_a_failing_hunk_changes_nothing_and_says_where(workspace):
    before = snapshot(workspace)
    result = await apply(
        workspace,
        """*** Begin Patch
*** Add File: created.txt
+should not appear
*** Update File: notes.txt
@@
-one
+ONE
*** Update File: src/main.py
@@ def greet(name):
-    print("hello", name)
+    print("hi", name)
@@
-    return 42
+    return 0
*** End Patch""",
    )
    assert result.is_error
    assert "src/main.py: hunk 2 of 2" in result.output
    assert "    return 42" in result.output  # the expected lines, for the model to fix
    assert "No file was changed" in result.output
    assert snapshot(workspace) == before


@pytest.mark.parametrize(
    "patch, message",
    [
        ("*** Begin Patch\n*** Add File: ../escape.txt\n+x\n*** End Patch", "outside"),
        ("*** Begin Patch\n*** Add File: /etc/once-x\n+x\n*** End Patch", "outside"),
        ("*** Begin Patch\n*** Delete File: .\n*** End Patch", "outside"),
        ("*** Begin Patch\n*** Add File: link/x.txt\n+x\n*** End Patch", "symlink"),
        (
            "*** Begin Patch\n*** Update File: notes.txt\n*** Move to: ../../moved\n@@\n-one\n"
            "+1\n*** End Patch",
            "outside",
        ),
        ("--- a/../../etc/passwd\n+++ b/../../etc/passwd\n@@ -1 +1 @@\n-x\n+y\n", "outside"),
    ],
)
async def test_paths_outside_the_workspace_are_refused(workspace, patch, message):
    outside = workspace.parent / "outside"
    outside.mkdir()
    (workspace / "link").symlink_to(outside)
    before = snapshot(workspace)
    result = await apply(workspace, patch)
    assert result.is_error and message in result.output
    assert snapshot(workspace) == before
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize(
    "patch, message",
    [
        ("just some text", "unknown patch format"),
        ("*** Begin Patch\n*** Add File: a\n+x\n", "last line"),
        ("*** Begin Patch\n*** End Patch", "changes no file"),
        ("*** Begin Patch\n*** Frobnicate: a\n*** End Patch", "not a file header"),
        ("*** Begin Patch\n*** Update File: notes.txt\n*** End Patch", "no hunk"),
        ("*** Begin Patch\n*** Update File: notes.txt\n@@\n?one\n*** End Patch", "must start"),
        ("*** Begin Patch\n*** Update File: gone.txt\n@@\n-x\n*** End Patch", "no such file"),
        ("*** Begin Patch\n*** Delete File: gone.txt\n*** End Patch", "no such file"),
        ("*** Begin Patch\n*** Update File: src\n@@\n-x\n*** End Patch", "is a directory"),
        ("*** Begin Patch\n*** Update File: notes.txt\n@@ nope\n-one\n*** End Patch", "nope"),
        ("--- /dev/null\n+++ b/notes.txt\n@@ -0,0 +1 @@\n+x\n", "already exists"),
        ("--- a/notes.txt\n+++ b/notes.txt\n@@ -1,3 +1,3 @@\n one\n", "not a valid unified diff"),
    ],
)
async def test_bad_patches_are_error_results(workspace, patch, message):
    before = snapshot(workspace)
    result = await apply(workspace, patch)
    assert result.is_error
    assert message in result.output
    assert snapshot(workspace) == before


async def test_binary_file_is_refused(workspace):
    (workspace / "blob.bin").write_bytes(b"\xff\xfe\x00")
    patch = "*** Begin Patch\n*** Update File: blob.bin\n@@\n-x\n+y\n*** End Patch"
    result = await apply(workspace, patch)
    assert result.is_error and "not UTF-8" in result.output


async def test_a_write_failure_rolls_back_what_was_written(workspace):
    # The plan is valid, but writing "src/main.py/inner.txt" fails (its parent is a file)
    # after notes.txt and the deletion were written: both must be restored.
    (workspace / "doomed.txt").write_text("still here\n")
    before = snapshot(workspace)
    patch = (
        "*** Begin Patch\n*** Update File: notes.txt\n@@\n-one\n+1\n"
        "*** Delete File: doomed.txt\n*** Add File: src/main.py/inner.txt\n+x\n*** End Patch"
    )
    result = await apply(workspace, patch)
    assert result.is_error and "could not write src/main.py/inner.txt" in result.output
    assert snapshot(workspace) == before


def test_parse_codex_patch_shapes():
    ops = parse_patch(
        "*** Begin Patch\n*** Update File: a.py\n@@ class A:\n context\n-old\n+new\n\n"
        "@@\n+tail\n*** End of File\n*** End Patch\n"
    )
    (op,) = ops
    first, second = op.hunks
    assert (first.anchor, first.old_lines, first.new_lines) == (
        "class A:",
        ["context", "old", ""],
        ["context", "new", ""],
    )
    assert (second.old_lines, second.new_lines, second.at_end_of_file) == ([], ["tail"], True)
    with pytest.raises(PatchError):
        parse_patch("")


async def test_through_the_registry_bad_arguments_get_the_schema(workspace):
    registry = ToolRegistry([ApplyPatchTool()])
    result = await registry.call("apply_patch", {"patch": "x"}, ToolContext(workspace=workspace))
    assert result.is_error and "full schema" in result.output
