"""Which sessions a replay runs: the named sample in the repository, or names given."""

from __future__ import annotations

from pathlib import Path

from once.bench.traces import TRAJECTORY_SUFFIXES, Session, default_traces_dir, load_session

SAMPLE_FILE = Path(__file__).with_name("sample_sessions.txt")


def sample_names(path: Path = SAMPLE_FILE) -> list[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def find_session(name: str, root: Path | None = None) -> tuple[str, Session]:
    """(source folder, session) for "<folder>/<stem>" or a bare stem (must be unique)."""
    root = root or default_traces_dir()
    folder, _, stem = name.rpartition("/")
    folders = [root / folder] if folder else sorted(p for p in root.iterdir() if p.is_dir())
    matches = [
        path
        for top in folders
        if top.is_dir()
        for path in sorted(top.rglob(f"{stem}*"))
        if path.name.endswith(TRAJECTORY_SUFFIXES)
        and path.name.removesuffix(".json").removesuffix(".traj") == stem
    ]
    if not matches:
        raise FileNotFoundError(f"no session {name!r} under {root}")
    if len(matches) > 1:
        found = ", ".join(str(m.relative_to(root)) for m in matches)
        raise ValueError(f"session name {name!r} is ambiguous: {found}; add its folder")
    path = matches[0]
    return path.relative_to(root).parts[0], load_session(path)
