"""Tool time between an agent's calls, for replaying sessions as production traffic.

What the recordings hold:

- SWE-agent 1.x (Claude, LM-32B): `trajectory[k].execution_time`, the seconds the tool of
  step k ran. Exit steps (no model call) are skipped as the loader skips them, so the k-th
  remaining step is call k's tool.
- mini-swe-agent: only `extra.response.created` per reply, whole seconds of the provider's
  clock; the gap between two calls mixes model latency with tool time and cannot be split.
- CodeR: no timing at all.

Where no tool time is recorded, every call is followed by `DEFAULT_TOOL_TIME_S`: a fixed,
documented stand-in (a typical shell command in a SWE-bench container).
"""

from __future__ import annotations

import json
from pathlib import Path

from once.bench.traces import SWEAGENT_1_0, SWEAGENT_1_1, Session

DEFAULT_TOOL_TIME_S = 2.0
RECORDED = "recorded"
FAST = "fast"
PACINGS = (RECORDED, FAST)


def recorded_tool_times(session: Session) -> list[float] | None:
    """Seconds of tool time after each call, or None when the format records none."""
    if session.source not in (SWEAGENT_1_0, SWEAGENT_1_1):
        return None
    data = json.loads(Path(session.path).read_text())
    times: list[float] = []
    for number, step in enumerate(data.get("trajectory") or []):
        if not step.get("action") and str(step.get("response", "")).startswith("Exit due to"):
            continue  # the loader's exit steps: SWE-agent wrote the reply itself
        value = step.get("execution_time")
        if not isinstance(value, int | float) or value < 0:
            raise ValueError(
                f"{session.path}: trajectory[{number}].execution_time must be seconds >= 0, "
                f"got {value!r}"
            )
        times.append(float(value))
    return times


def tool_times(
    session: Session, num_calls: int, *, pacing: str, time_scale: float
) -> tuple[list[float] | None, str]:
    """(seconds to wait after each call, where they came from) for one session."""
    if pacing not in PACINGS:
        raise ValueError(f"pacing must be one of {PACINGS}, got {pacing!r}")
    if not time_scale >= 0:
        raise ValueError(f"--time-scale must be >= 0, got {time_scale}")
    if pacing == FAST:
        return None, FAST
    recorded = recorded_tool_times(session)
    origin = "execution_time"
    if recorded is None:
        recorded, origin = [DEFAULT_TOOL_TIME_S] * num_calls, f"fixed {DEFAULT_TOOL_TIME_S} s"
    return [t * time_scale for t in recorded[:num_calls]], origin
