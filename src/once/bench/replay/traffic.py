"""How sessions reach a stack: one at a time (the default), or interleaved like production.

With `concurrency` N > 1, up to N sessions run at once on the same stack, each a closed
loop: its next call goes out after its previous one finished plus its tool time
(`pacing.tool_times`, scaled). With pacing `fast` a session sends its next call at once.
Session i waits for a free slot, so arrivals are as a bounded pool of agents would make.

A session whose call fails (`ReplayCallError`) ends there: its calls before the failure
are kept and the failure is listed in the traffic facts (`failures`: stack, session,
call, error); the other sessions go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from once.bench.replay.cpu import LayerCpuMeter
from once.bench.replay.pacing import FAST, tool_times
from once.bench.replay.replay import ReplayCallError, replay_session


@contextlib.contextmanager
def progress_bars(enabled: bool):
    """rich progress bars on stderr (stdout stays clean for --json); None when disabled."""
    if not enabled:
        yield None
        return
    progress = Progress(
        TextColumn("{task.description:40}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("calls"),
        TimeElapsedColumn(),
        console=Console(file=sys.stderr),
        transient=False,
    )
    with progress:
        yield progress


async def replay_sessions(
    stack,
    plans,
    *,
    concurrency: int = 1,
    pacing: str = FAST,
    time_scale: float = 1.0,
    progress=None,
    log=None,
) -> tuple[dict[str, list[dict]], dict]:
    """(source folder, plan) pairs on one stack: records by session, and traffic facts
    (tool-time origin per session, the wall time of all sessions)."""
    if concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    name = stack.spec.name
    task = None
    if progress is not None:
        total = sum(len(plan.calls) for _, plan in plans)
        task = progress.add_task(f"{name}", total=total)

    def advance():
        if progress is not None:
            progress.advance(task)

    slots = asyncio.Semaphore(concurrency)
    records: dict[str, list[dict]] = {}
    origins: dict[str, str] = {}
    cpu = stack_cpu_meter(stack)
    cpu_by_session: dict[str, dict[str, float]] = {}  # sessions one at a time only
    failures: list[dict] = []
    notice = log
    if progress is not None:
        notice = progress.console.print  # above the live bars

    async def one(source_folder, plan):
        waits, origins[plan.session_id] = tool_times(
            plan.session, len(plan.calls), pacing=pacing, time_scale=time_scale
        )
        async with slots:
            started = time.perf_counter()
            before = cpu.snapshot()
            try:
                rows = await replay_session(
                    stack, plan, tool_times_s=waits, concurrent=concurrency > 1,
                    on_call=advance, notice=notice,
                )  # fmt: skip
            except ReplayCallError as e:
                rows = e.records
                failures.append(
                    {"stack": name, "session_id": plan.session_id, "call": e.index, "error": str(e)}
                )
                if notice is not None:
                    notice(f"error: {e}")
            if concurrency == 1:
                cpu_by_session[plan.session_id] = cpu.between(before, cpu.snapshot())
        for row in rows:
            row["source_folder"] = source_folder
        records[plan.session_id] = rows
        if log is not None:
            log(f"{name:5} {plan.session_id}: {len(rows)} calls in "
                f"{time.perf_counter() - started:.1f} s")  # fmt: skip

    started = time.perf_counter()
    cpu_before = cpu.snapshot()
    if concurrency == 1:
        for source_folder, plan in plans:
            await one(source_folder, plan)
    else:
        await asyncio.gather(*(one(folder, plan) for folder, plan in plans))
    stack_wall_s = time.perf_counter() - started
    cpu_s = cpu.between(cpu_before, cpu.snapshot())
    # Keep the plans' order: reports list sessions as the sample names them.
    ordered = {plan.session_id: records[plan.session_id] for _, plan in plans}
    facts = {"origins": origins, "stack_wall_s": round(stack_wall_s, 3), "cpu_s": cpu_s}
    facts["cpu_s_by_session"] = cpu_by_session
    facts["failures"] = failures
    return ordered, facts


def stack_cpu_meter(stack) -> LayerCpuMeter:
    """The CPU meter of a stack: its gateway's own meter, its replica processes."""
    registry = stack.gateway.meter.registry

    def gateway_cpu_s() -> float:
        value = registry.get_sample_value("once_gateway_cpu_seconds_total", {"stage": "request"})
        return value or 0.0

    fleet = getattr(stack, "fleet", None)
    pids = fleet.replica_pids() if fleet is not None else []
    return LayerCpuMeter(gateway_cpu_s, pids)
