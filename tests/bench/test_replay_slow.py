"""Slowness is not failure (issue 31): a replay call slower than its client's read timeout.

`make run` once died when the naive stack's second call took longer than the client's
fixed 600 s timeout. The same case, made cheap: an engine whose calls after the first wait
`DELAY_S` before their first token, and clients whose read timeout is shrunk below that
(`ClientTimeouts(read_s=...)`). With the gateway's keep-alives the call completes; without
them it fails, and the replay names the call and the cause and keeps what it measured.
"""

import argparse
import asyncio
from pathlib import Path

import pytest

from once.bench.replay import cli
from once.bench.replay.plan import plan_session
from once.bench.replay.replay import ReplayCallError, replay_session
from once.bench.replay.report import write_report
from once.bench.replay.stacks import (
    NAIVE,
    ONCE,
    load_served_runtime,
    make_tiny_replay_model,
    open_stack,
)
from once.bench.replay.timeouts import ClientTimeouts
from once.bench.traces import MINI_SWE_AGENT, Call, Session

MAX_LEN = 4096
DELAY_S = 6.0  # the slow calls' wait for their first token
SHORT_READ = ClientTimeouts(read_s=2.0)  # < DELAY_S; >> the keep-alive interval below
KEEP_ALIVE_S = 0.1


class SlowAfterFirst:
    """An engine whose requests after the first wait `delay_s` before they start."""

    def __init__(self, inner, delay_s: float):
        self.inner = inner
        self.delay_s = delay_s
        self.num_requests = 0

    async def generate(self, request):
        self.num_requests += 1
        if self.num_requests > 1:
            await asyncio.sleep(self.delay_s)
        async for delta in self.inner.generate(request):
            yield delta

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _session(name: str, num_calls: int = 3) -> Session:
    history: list[dict] = [
        {"role": "system", "content": "You are a careful agent. " * 10},
        {"role": "user", "content": f"Task {name}: fix the bug. " * 5},
    ]
    calls = []
    for index in range(num_calls):
        output = {"role": "assistant", "content": f"Step {index}: run `ls` " * 4}
        calls.append(Call(index=index, messages=tuple(history), output=output))
        history += [output, {"role": "user", "content": f"observation {index}\n" * 5}]
    return Session(f"hand/{name}", MINI_SWE_AGENT, Path(name), tuple(calls))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = make_tiny_replay_model(tmp_path_factory.mktemp("tiny") / "m", MAX_LEN)
    return folder, load_served_runtime(folder, MAX_LEN)


def slow(engine):
    return SlowAfterFirst(engine, DELAY_S)


@pytest.mark.parametrize("spec", [ONCE, NAIVE], ids=["websocket", "http"])
async def test_a_call_slower_than_the_read_timeout_completes_with_keep_alives(served, spec):
    folder, runtime = served
    plan = plan_session(_session("a", num_calls=2), runtime)
    async with open_stack(
        spec, runtime, folder, max_model_len=MAX_LEN, timeouts=SHORT_READ,
        keep_alive_s=KEEP_ALIVE_S, wrap_engine=slow,
    ) as stack:  # fmt: skip
        records = await replay_session(stack, plan)
    assert [r["index"] for r in records] == [0, 1]
    assert records[1]["wall_s"] > DELAY_S > SHORT_READ.read_s
    assert all(r["output_matches_recording"] for r in records)


async def test_without_keep_alives_the_failure_names_the_call_and_keeps_the_calls_before(served):
    folder, runtime = served
    plan = plan_session(_session("a"), runtime)
    async with open_stack(
        NAIVE, runtime, folder, max_model_len=MAX_LEN, timeouts=SHORT_READ, keep_alive_s=0,
        wrap_engine=slow,
    ) as stack:  # fmt: skip
        with pytest.raises(ReplayCallError) as failed:
            await replay_session(stack, plan)
    assert str(failed.value).startswith("naive: hand/a call 1 failed: APITimeoutError")
    assert failed.value.index == 1
    assert [r["index"] for r in failed.value.records] == [0]


def test_the_replay_still_reports_when_one_side_fails(monkeypatch, tmp_path):
    # The naive side's clients time out on its slow second call, as `make run`'s once did:
    # the report compares the calls both sides completed and lists the failure.
    def open_with_slow_naive(spec, *args, **kwargs):
        if spec.name == NAIVE.name:
            kwargs.update(timeouts=SHORT_READ, keep_alive_s=0, wrap_engine=slow)
        return open_stack(spec, *args, **kwargs)

    monkeypatch.setattr(cli, "open_stack", open_with_slow_naive)
    args = cli.build_parser().parse_args(["--max-model-len", str(MAX_LEN), "--no-progress"])
    assert isinstance(args, argparse.Namespace)
    report = asyncio.run(cli.run_replay([("folder-a", _session("a"))], args))

    [failure] = report["failures"]
    assert (failure["stack"], failure["session_id"], failure["call"]) == ("naive", "hand/a", 1)
    assert "APITimeoutError" in failure["error"]
    assert report["calls_compared"] == {"hand/a": 1}
    assert [len(report["calls"][name]["hand/a"]) for name in ("once", "naive")] == [3, 1]
    assert report["total"]["once"]["calls"] == report["total"]["naive"]["calls"] == 1
    write_report(report, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "## Failed calls" in text and "naive: hand/a call 1" in text
