"""The replay's speculation counters and CPU seconds per layer, on the tiny model."""

from dataclasses import replace

import pytest

from once.bench.replay.cpu import CpuSnapshot, LayerCpuMeter
from once.bench.replay.ledger import merge, session_ledger
from once.bench.replay.plan import plan_session
from once.bench.replay.stacks import ONCE, load_served_runtime, make_tiny_replay_model, open_stack
from once.bench.replay.traffic import replay_sessions
from tests.bench.test_replay_stack import MAX_LEN, _session

needs_proc = pytest.mark.skipif(not LayerCpuMeter(lambda: 0.0).available, reason="needs /proc")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = make_tiny_replay_model(tmp_path_factory.mktemp("tiny") / "m", MAX_LEN)
    return folder, load_served_runtime(folder, MAX_LEN)


@needs_proc
async def test_speculating_stack_reports_its_drafts_and_each_layers_cpu(served):
    folder, runtime = served
    plans = [("hand", plan_session(_session("a"), runtime))]
    spec = replace(ONCE, speculative_method="ngram")
    async with open_stack(spec, runtime, folder, max_model_len=MAX_LEN) as stack:
        records, traffic = await replay_sessions(stack, plans)
        engine = await stack.engine_stats()
    rows = records["hand/a"]
    assert all(row["output_matches_recording"] for row in rows)  # speculation is exact
    # The recorded outputs repeat themselves: n-gram drafts are accepted.
    assert sum(row["num_accepted_tokens"] for row in rows) == engine["num_accepted_tokens"] > 0
    assert sum(row["num_drafts"] for row in rows) == engine["num_drafts"]
    total = merge([session_ledger(rows, block_size=16, prefix_caching=True)], rows)
    assert total["mean_acceptance_length"] == pytest.approx(
        1 + engine["num_accepted_tokens"] / engine["num_drafts"], abs=1e-4
    )
    cpu = traffic["cpu_s"]
    assert set(cpu) == {"harness", "gateway", "engine"}
    assert cpu["engine"] > 0 and cpu["gateway"] > 0 and cpu["harness"] >= 0
    per_session = traffic["cpu_s_by_session"]["hand/a"]  # one session: nearly the same span
    assert per_session == pytest.approx(cpu, abs=0.05)


# Run in a fresh interpreter: native threads that earlier tests left in this process (an
# engine's OpenMP workers, the tokenizer's pool) would count as engine threads here.
_THREADS_PROBE = """
import threading, time
from once.bench.replay.cpu import engine_threads_cpu_s
from once.engine.os_threads import ENGINE_THREAD_NAME, name_os_thread

def spin(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass

def engine_loop(done, stop):
    name_os_thread(ENGINE_THREAD_NAME)  # as the engine's step loop does
    spin(0.3)
    done.set()
    stop.wait()  # alive while measured, as the engine's thread is

before = engine_threads_cpu_s()
spin(0.3)  # the main thread: harness and gateway, never the engine
other = threading.Thread(target=spin, args=(0.3,), name="asyncio_0")  # a gateway worker
other.start()
other.join()
not_engine = engine_threads_cpu_s() - before
done, stop = threading.Event(), threading.Event()
engine = threading.Thread(target=engine_loop, args=(done, stop))  # Python's name: irrelevant
engine.start()
done.wait()
print(not_engine, engine_threads_cpu_s() - before)
stop.set()
engine.join()
"""


@needs_proc
def test_engine_threads_are_told_apart_from_the_main_thread():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _THREADS_PROBE], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    not_engine, with_engine = map(float, out.stdout.split())
    assert not_engine < 0.1
    assert with_engine >= 0.25


def test_layers_split_the_process_cpu():
    before = CpuSnapshot(process_s=10, engine_threads_s=4, replica_processes_s=0, gateway_s=1)
    after = CpuSnapshot(process_s=16, engine_threads_s=7, replica_processes_s=5, gateway_s=2.5)
    assert LayerCpuMeter.between(before, after) == {
        "harness": 1.5,  # 6 of process CPU, less 3 of engine threads and 1.5 of gateway
        "gateway": 1.5,
        "engine": 8.0,  # its threads here plus the replica processes
    }
