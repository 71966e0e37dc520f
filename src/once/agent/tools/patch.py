"""The `apply_patch` tool: Codex's patch format or a unified diff, all or nothing.

Codex's format:

    *** Begin Patch
    *** Add File: path            then the file's lines, each prefixed with "+"
    *** Delete File: path
    *** Update File: path
    *** Move to: new/path         (optional)
    @@ def anchor():              (optional text: a line to find first)
     context line
    -removed line
    +added line
    *** End of File               (optional: this hunk ends at the end of the file)
    *** End Patch

A unified diff (git's rename headers too) is parsed by `unidiff` into the same hunks;
its line numbers are a hint tried first.

Applying, as Codex does: each hunk's old lines (context and removals) are searched for
from the end of the previous hunk, exactly, then ignoring trailing whitespace, then
surrounding whitespace, then with typographic punctuation made plain. Every file is
computed in memory before anything is written, so a hunk that does not apply fails the
whole patch, naming the file, the hunk and the lines it expected. Paths must resolve
(symlinks included) inside the workspace.

Writing re-checks what planning checked, without a window between check and use: each
directory is opened from the workspace down with O_NOFOLLOW (a directory a concurrent
command swapped for a symlink fails the write instead of being followed out), and a file
is replaced by a rename within its directory, never truncated in place (a symlink or a
hard link in its place is replaced, not written through).
"""

import contextlib
import io
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

import unidiff

from once.agent.tools.base import ToolContext, ToolResult, ToolSpec

BEGIN, END = "*** Begin Patch", "*** End Patch"
ADD, DELETE = "*** Add File: ", "*** Delete File: "
UPDATE, MOVE = "*** Update File: ", "*** Move to: "
END_OF_FILE = "*** End of File"

APPLY_PATCH_DESCRIPTION = (
    "Edit files with a patch. Format:\n*** Begin Patch\n*** Add File: path\n+line\n"
    "*** Update File: path\n*** Move to: new_path (optional)\n@@ optional line to anchor on\n"
    " context\n-removed\n+added\n*** Delete File: path\n*** End Patch\n"
    "Give about 3 lines of context around each change. A unified diff also works. Paths are "
    "relative to the workspace. If any hunk does not apply, no file is changed."
)
APPLY_PATCH_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The whole patch."}},
    "required": ["input"],
    "additionalProperties": False,
}


@dataclass
class Hunk:
    old_lines: list[str]
    new_lines: list[str]
    anchor: str | None = None  # Codex's "@@ text": a line to find before the hunk
    at_end_of_file: bool = False
    hint_index: int | None = None  # unified diff: where the old lines should start (0-based)
    header: str = "@@"


@dataclass
class FileOp:
    kind: str  # "add" | "delete" | "update"
    path: str
    move_to: str | None = None
    content: str = ""  # for "add"
    hunks: list[Hunk] = field(default_factory=list)
    may_overwrite: bool = True  # Codex's Add File replaces; a diff from /dev/null does not


class PatchError(ValueError):
    """A patch that cannot be applied; the message goes back to the model."""


class ApplyPatchTool:
    spec = ToolSpec(
        name="apply_patch", description=APPLY_PATCH_DESCRIPTION, parameters=APPLY_PATCH_PARAMETERS
    )

    async def __call__(self, args: dict, ctx: ToolContext) -> ToolResult:
        try:
            plan = plan_patch(parse_patch(args["input"]), Path(ctx.workspace))
            plan.write()
        except PatchError as e:
            return ToolResult(f"patch not applied: {e}\nNo file was changed.", True)
        summary = "\n".join(["Success. Updated the following files:", *plan.summary])
        return ToolResult(summary, metadata={"files": plan.summary})


def parse_patch(text: str) -> list[FileOp]:
    stripped = text.strip()
    if stripped.startswith(BEGIN):
        return parse_codex_patch(stripped)
    if any(line.startswith(("--- ", "+++ ", "diff --git ")) for line in stripped.splitlines()):
        return parse_unified_diff(text)
    raise PatchError(f"unknown patch format: expected '{BEGIN}' or a unified diff ('--- a/x')")


def parse_codex_patch(text: str) -> list[FileOp]:
    lines = [line.rstrip("\r") for line in text.strip().split("\n")]
    if lines[0].strip() != BEGIN:
        raise PatchError(f"the first line must be '{BEGIN}'")
    if lines[-1].strip() != END:
        raise PatchError(f"the last line must be '{END}'")
    body, ops, i = lines[1:-1], [], 0
    while i < len(body):
        line = body[i]
        if line.startswith(ADD):
            i, content = _collect_added(body, i + 1)
            ops.append(FileOp("add", _path(line, ADD), content=content))
        elif line.startswith(DELETE):
            ops.append(FileOp("delete", _path(line, DELETE)))
            i += 1
        elif line.startswith(UPDATE):
            op = FileOp("update", _path(line, UPDATE))
            i += 1
            if i < len(body) and body[i].startswith(MOVE):
                op.move_to = _path(body[i], MOVE)
                i += 1
            i = _collect_hunks(body, i, op)
            ops.append(op)
        elif not line.strip():
            i += 1
        else:
            raise PatchError(
                f"line {i + 2}: {line!r} is not a file header "
                f"('{ADD.strip()}', '{DELETE.strip()}' or '{UPDATE.strip()}')"
            )
    if not ops:
        raise PatchError("the patch changes no file")
    return ops


def parse_unified_diff(text: str) -> list[FileOp]:
    try:
        patch = unidiff.PatchSet(io.StringIO(text))
    except unidiff.UnidiffParseError as e:
        raise PatchError(f"not a valid unified diff: {e}") from None
    if not len(patch):
        raise PatchError("the diff changes no file")
    git_prefixes = all(
        f.source_file.startswith(("a/", "/dev/null"))
        and f.target_file.startswith(("b/", "/dev/null"))
        for f in patch
    )
    ops = []
    for patched in patch:
        source = _diff_path(patched.source_file, "a/", git_prefixes)
        target = _diff_path(patched.target_file, "b/", git_prefixes)
        hunks = [_unified_hunk(h) for h in patched]
        if patched.is_added_file:
            content = "".join(line.value for h in patched for line in h if line.is_added)
            ops.append(FileOp("add", target, content=content, may_overwrite=False))
        elif patched.is_removed_file:
            ops.append(FileOp("delete", source))
        else:
            move_to = target if target != source else None
            ops.append(FileOp("update", source, move_to=move_to, hunks=hunks))
    return ops


def _path(line: str, header: str) -> str:
    path = line[len(header) :].strip()
    if not path:
        raise PatchError(f"'{header.strip()}' without a path")
    return path


def _collect_added(body: list[str], i: int) -> tuple[int, str]:
    added = []
    while i < len(body) and body[i].startswith("+"):
        added.append(body[i][1:])
        i += 1
    return i, "".join(line + "\n" for line in added)


def _collect_hunks(body: list[str], i: int, op: FileOp) -> int:
    # A hunk: an optional "@@" line, then " "/"-"/"+" lines (an empty line is an empty
    # context line), until the next "@@" or "***" line.
    while i < len(body) and not body[i].startswith("***"):
        hunk = Hunk([], [])
        if body[i].startswith("@@"):
            hunk.header = body[i].strip()
            hunk.anchor = body[i][2:].strip() or None
            i += 1
        elif op.hunks:
            raise PatchError(f"{op.path}: expected '@@' before line {body[i]!r}")
        while i < len(body) and not body[i].startswith(("@@", "***")):
            line = body[i]
            marker, rest = (line[0], line[1:]) if line else (" ", "")
            if marker not in " -+":
                where = f"{op.path}: hunk {len(op.hunks) + 1}"
                raise PatchError(f"{where}: line {line!r} must start with ' ', '-' or '+'")
            if marker in " -":
                hunk.old_lines.append(rest)
            if marker in " +":
                hunk.new_lines.append(rest)
            i += 1
        if i < len(body) and body[i].strip() == END_OF_FILE:
            hunk.at_end_of_file = True
            i += 1
        if not hunk.old_lines and not hunk.new_lines:
            raise PatchError(f"{op.path}: hunk {len(op.hunks) + 1} ({hunk.header}) is empty")
        op.hunks.append(hunk)
    if not op.hunks and op.move_to is None:
        raise PatchError(f"'{UPDATE.strip()} {op.path}' has no hunk")
    return i


def _diff_path(name: str, prefix: str, strip_prefix: bool) -> str:
    name = name.split("\t")[0]
    return name[len(prefix) :] if strip_prefix and name.startswith(prefix) else name


def _unified_hunk(hunk: unidiff.Hunk) -> Hunk:
    old_lines = [line.value.rstrip("\n") for line in hunk if line.is_context or line.is_removed]
    new_lines = [line.value.rstrip("\n") for line in hunk if line.is_context or line.is_added]
    # "@@ -5,0 +6,2 @@" inserts after line 5; otherwise the old lines start at line l.
    start = hunk.source_start if hunk.source_length == 0 else hunk.source_start - 1
    header = str(hunk).split("\n", 1)[0].strip()
    return Hunk(old_lines, new_lines, hint_index=max(start, 0), header=header)


# --- applying --------------------------------------------------------------------------


@dataclass
class PatchPlan:
    """The final content of every touched file (None: deleted), computed before writing."""

    workspace: Path
    contents: dict[Path, str | None] = field(default_factory=dict)
    originals: dict[Path, bytes | None] = field(default_factory=dict)
    modes: dict[Path, int] = field(default_factory=dict)  # a moved file keeps its mode
    summary: list[str] = field(default_factory=list)

    def current(self, path: Path) -> str | None:
        if path in self.contents:
            return self.contents[path]
        if path.is_dir():
            raise PatchError(f"{self.display(path)} is a directory")
        data = path.read_bytes() if path.exists() else None
        self.originals.setdefault(path, data)
        try:
            return None if data is None else data.decode("utf-8")
        except UnicodeDecodeError:
            raise PatchError(f"{self.display(path)} is not UTF-8 text") from None

    def display(self, path: Path) -> str:
        return str(path.relative_to(self.workspace))

    def write(self) -> None:
        # Everything was validated; an OS error here (disk full, permissions) restores the
        # files written so far, so the patch is still all or nothing.
        done: list[Path] = []
        for path, content in self.contents.items():
            self.originals.setdefault(path, path.read_bytes() if path.is_file() else None)
            try:
                _write(self.workspace, path, content, self.modes.get(path))
            except OSError as e:
                for written in [*done, path]:
                    with contextlib.suppress(OSError):  # best effort: restore all we can
                        _write(self.workspace, written, self.originals[written], None)
                raise PatchError(f"could not write {self.display(path)}: {e}") from None
            done.append(path)


def plan_patch(ops: list[FileOp], workspace: Path) -> PatchPlan:
    plan = PatchPlan(workspace.resolve())
    for op in ops:
        path = resolve_in_workspace(plan.workspace, op.path)
        name = plan.display(path)
        current = plan.current(path)
        if op.kind == "add":
            if current is not None and not op.may_overwrite:
                raise PatchError(f"cannot add {name}: it already exists")
            plan.contents[path] = op.content
            plan.summary.append(f"A {name}")
            continue
        if current is None:
            raise PatchError(
                f"cannot {'delete' if op.kind == 'delete' else 'update'} {name}: no such file"
            )
        if op.kind == "delete":
            plan.contents[path] = None
            plan.summary.append(f"D {name}")
            continue
        new_content = apply_hunks(current, op.hunks, name)
        if op.move_to is None:
            plan.contents[path] = new_content
            plan.summary.append(f"M {name}")
            continue
        destination = resolve_in_workspace(plan.workspace, op.move_to)
        plan.current(destination)  # a directory there is an error; keep its original
        plan.contents[path] = None
        plan.contents[destination] = new_content
        plan.modes[destination] = path.stat().st_mode if path.exists() else 0o644
        plan.summary.append(f"M {plan.display(destination)} (moved from {name})")
    return plan


def resolve_in_workspace(workspace: Path, name: str) -> Path:
    lexical = Path(os.path.normpath(workspace / name))
    if not lexical.is_relative_to(workspace) or lexical == workspace:
        raise PatchError(f"path {name!r} is outside the workspace")
    if not lexical.resolve().is_relative_to(workspace):
        raise PatchError(f"path {name!r} leads outside the workspace through a symlink")
    return lexical


def apply_hunks(content: str, hunks: list[Hunk], name: str) -> str:
    lines = content.split("\n")
    final_newline = lines[-1] == ""
    if final_newline:
        lines.pop()
    replacements = []  # (start, number of old lines, new lines)
    index = 0
    for number, hunk in enumerate(hunks, 1):
        where = f"{name}: hunk {number} of {len(hunks)} ({hunk.header})"
        if hunk.anchor is not None:
            found = seek_lines(lines, [hunk.anchor], index)
            if found is None:
                raise PatchError(f"{where}: the line {hunk.anchor!r} was not found")
            index = found + 1
        if not hunk.old_lines:  # a pure addition: at the hinted line, else at the end
            at = len(lines) if hunk.hint_index is None else min(hunk.hint_index, len(lines))
            replacements.append((at, 0, hunk.new_lines))
            continue
        old, new = hunk.old_lines, hunk.new_lines
        found = _find_hunk(lines, old, index, hunk)
        if found is None and old[-1] == "":
            # A trailing empty context line often stands for the file's final newline.
            old, new = old[:-1], new[:-1] if new and new[-1] == "" else new
            found = _find_hunk(lines, old, index, hunk) if old else None
        if found is None:
            expected = "\n".join(hunk.old_lines[:40])
            raise PatchError(
                f"{where} does not apply: these lines were not found after line {index}:\n"
                f"{expected}"
            )
        replacements.append((found, len(old), new))
        index = found + len(old)
    for start, length, new in sorted(replacements, key=lambda r: r[0], reverse=True):
        lines[start : start + length] = new
    return "\n".join(lines) + ("\n" if final_newline else "")


# Passes from strict to lenient: models often get whitespace or typographic quotes wrong.
PLAIN_PUNCTUATION = str.maketrans(
    {c: "-" for c in "\u2010\u2011\u2012\u2013\u2014\u2015\u2212"}
    | {c: "'" for c in "\u2018\u2019\u201a\u201b"}
    | {c: '"' for c in "\u201c\u201d\u201e\u201f"}
    | {c: " " for c in "\u00a0\u2002\u2003\u2009\u202f\u3000"}
)
NORMALIZERS = (lambda s: s, str.rstrip, str.strip, lambda s: s.strip().translate(PLAIN_PUNCTUATION))


def seek_lines(lines: list[str], pattern: list[str], start: int, at_end: bool = False):
    """The first index >= start where `pattern` occurs in `lines`, or None."""
    last = len(lines) - len(pattern)
    if last < 0:
        return None
    starts = range(max(last, start), last + 1) if at_end else range(start, last + 1)
    for normalize in NORMALIZERS:
        wanted = [normalize(p) for p in pattern]
        for i in starts:
            if all(normalize(lines[i + j]) == w for j, w in enumerate(wanted)):
                return i
    return None


def _find_hunk(lines: list[str], old: list[str], index: int, hunk: Hunk) -> int | None:
    hint = hunk.hint_index  # a unified diff's line number, tried first (exactly there)
    if hint is not None and index <= hint == seek_lines(lines[: hint + len(old)], old, hint):
        return hint
    if hunk.at_end_of_file and (found := seek_lines(lines, old, index, at_end=True)) is not None:
        return found
    return seek_lines(lines, old, index)


def _write(workspace: Path, path: Path, content: str | bytes | None, mode: int | None) -> None:
    """Write (None: delete) `path`, inside `workspace`, as the module docstring says."""
    parts = path.relative_to(workspace).parts
    try:
        parent = _open_directory(workspace, parts[:-1], create=content is not None)
    except FileNotFoundError:
        if content is None:
            return  # deleting a file whose directory is gone: nothing to do
        raise
    name = parts[-1]
    try:
        if content is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=parent)
            return
        if mode is None:  # an existing regular file keeps its mode
            with contextlib.suppress(FileNotFoundError):
                existing = os.stat(name, dir_fd=parent, follow_symlinks=False)
                mode = existing.st_mode if stat.S_ISREG(existing.st_mode) else None
        temp = f".once-patch-{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(temp, flags, 0o666, dir_fd=parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
                if mode is not None:
                    os.fchmod(f.fileno(), mode & 0o7777)
            os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=parent)
            raise
    finally:
        os.close(parent)


def _open_directory(workspace: Path, parts: tuple[str, ...], *, create: bool) -> int:
    """A descriptor of workspace/parts..., each step opened without following a symlink."""
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd
