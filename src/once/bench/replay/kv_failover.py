"""`once replay-failover`: a session moves to another replica mid-task (its replica is
killed); how much of its prefix the new replica recomputes, with and without the shared
KV tier (L4, Redis), in the same run.

Two `once engine` processes serve the tiny replay model. A recorded session's first calls
(its prompts and recorded outputs, forced) run on replica 0, with a pause between calls as
a tool would make (the time the shared tier's writer has, too); replica 0 is then killed
with SIGKILL and the next call goes to replica 1. The figure is `recomputed_fraction`:
the prompt tokens replica 1 computed for that call, over the ones an unlimited cache of
the session would have held (the call's common prefix with the previous call's prompt and
output). The bar: <= 0.2 with the shared tier.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from once.bench.local_redis import RedisServer
from once.bench.replay.plan import plan_session
from once.bench.replay.reference import common_prefix_length
from once.bench.replay.replicas import start_replicas
from once.bench.replay.sessions import find_session
from once.bench.replay.stacks import load_served_runtime, make_tiny_replay_model
from once.engine_http.client import RemoteEngineClient
from once.protocol.engine import GenerateRequest, SamplingParams

DEFAULT_SESSION = "sweagent__claude-sonnet-4-20250514/django__django-15731"
MAX_MODEL_LEN = 32768
TOOL_PAUSE_S = 0.5


async def _call(client: RemoteEngineClient, request_id: str, call) -> dict:
    sampling = SamplingParams(temperature=0.0, max_tokens=len(call.forced_ids))
    request = GenerateRequest(
        request_id, tuple(call.prompt_ids), sampling, forced_output_ids=tuple(call.forced_ids)
    )
    first, last = None, None
    async for delta in client.generate(request):
        first = first or delta
        last = delta
    assert first is not None and last is not None and last.metrics is not None
    return {
        "prompt_tokens": len(call.prompt_ids),
        "cached_tokens": first.num_cached_tokens or 0,
        "computed_tokens": last.metrics.num_computed_tokens,
    }


async def move_session(folder: Path, calls, moved_at: int, shared_url: str | None) -> dict:
    flags = ["--kv-shared-url", shared_url] if shared_url else []
    async with start_replicas(
        folder, count=2, threads=1, max_model_len=MAX_MODEL_LEN, kv_cache_gib=1.0,
        extra_flags=flags,
    ) as replicas:  # fmt: skip
        first, second = (RemoteEngineClient(r.url) for r in replicas)
        try:
            for i, call in enumerate(calls[:moved_at]):
                await _call(first, f"call-{i}", call)
                await asyncio.sleep(TOOL_PAUSE_S)
            replicas[0].kill()
            moved = await _call(second, f"call-{moved_at}", calls[moved_at])
        finally:
            await first.aclose()
            await second.aclose()
    previous = calls[moved_at - 1]
    ideal = common_prefix_length(
        np.asarray(calls[moved_at].prompt_ids),
        np.asarray(previous.prompt_ids + previous.forced_ids),
    )
    moved["ideal_cached_tokens"] = ideal
    # What was computed beyond the call's new tokens is its cacheable prefix recomputed.
    recomputed = min(ideal, max(0, moved["computed_tokens"] - (moved["prompt_tokens"] - ideal)))
    moved["recomputed_prefix_tokens"] = recomputed
    moved["recomputed_fraction"] = round(recomputed / ideal, 4) if ideal else 0.0
    return moved


async def run_failover(session_name: str, moved_at: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="once-failover-") as tmp:
        folder = make_tiny_replay_model(Path(tmp) / "tiny", MAX_MODEL_LEN)
        runtime = load_served_runtime(folder, MAX_MODEL_LEN)
        _, session = find_session(session_name)
        plan = plan_session(session, runtime, max_model_len=MAX_MODEL_LEN)
        if not 1 <= moved_at < len(plan.calls):
            raise ValueError(f"--moved-at must lie in 1..{len(plan.calls) - 1}")
        without = await move_session(folder, plan.calls, moved_at, None)
        redis_dir = Path(tmp) / "redis"
        redis_dir.mkdir()
        server = RedisServer(redis_dir)
        await server.start()
        try:
            with_shared = await move_session(folder, plan.calls, moved_at, server.url)
        finally:
            server.kill()
    return {
        "session": session_name,
        "moved_at_call": moved_at,
        "without_shared_tier": without,
        "with_shared_tier": with_shared,
        "recomputed_fraction_shared": with_shared["recomputed_fraction"],
        "bar_met": with_shared["recomputed_fraction"] <= 0.2,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="once replay-failover", description=__doc__)
    parser.add_argument("--session", default=DEFAULT_SESSION)
    parser.add_argument("--moved-at", type=int, default=12, help="the first call on replica 1")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    try:
        result = asyncio.run(run_failover(args.session, args.moved_at))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
