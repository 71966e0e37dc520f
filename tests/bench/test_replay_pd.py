"""`once replay --pd 1:1`: hand-made sessions over a prefill and a decode engine process,
beside the same stack colocated over two engines, in one run."""

import asyncio
import shutil

import pytest

from once.bench.replay import cli
from once.bench.replay.pd import COLOCATED, DISAGGREGATED, SHARED_KV, parse_pd
from tests.bench.test_replay_report import _args, _session


@pytest.fixture(scope="module")
def pd_report():
    sessions = [("folder-a", _session("a")), ("folder-b", _session("b"))]
    args = _args(pd="1:1", pd_min_uncached_tokens=64, pd_transport="shm")
    return asyncio.run(cli.run_replay(sessions, args))


def test_split_calls_are_decoded_from_the_prefill_engines_kv(pd_report):
    section = pd_report["pd"]
    assert section["num_split_calls"] >= 2  # at least each session's first call
    assert section["router"]["decisions"]["split"] == section["num_split_calls"]
    assert section["router"]["num_prefill_failures"] == 0
    assert section["max_decode_computed_tokens_of_split"] <= 1
    assert section["transfer_blocks"] > 0 and section["transfer_bytes"] > 0
    assert section["probe_gb_per_s"] > 0 and section["transfer_gb_per_s"] > 0
    assert section["outputs_identical"]
    colocated, split = section["variants"][COLOCATED], section["variants"][DISAGGREGATED]
    assert colocated["calls"] == split["calls"] == 8
    # The decode engine did not compute what came over: the split stack computed less.
    assert split["computed_tokens"] < colocated["computed_tokens"]
    assert split["itl_p50_s"] is not None and colocated["itl_p99_s"] is not None
    assert "shared_kv" not in section  # only with --pd-shared-kv
    # The ledger's checks hold with the prefill engine's work counted (a run exits 1 if not).
    bound = pd_report["shared_ideal"]
    assert bound["holds"], bound["beaten"]
    assert bound["computed"][DISAGGREGATED]["of_it_prefill_engines"] > 0
    assert pd_report["ledger_invariants"]["holds"]


def test_bad_pd_flags_are_refused():
    assert cli.main(["--pd", "1"]) == 2
    assert cli.main(["--pd", "0:1"]) == 2
    assert cli.main(["--pd", "1:1", "--replicas", "2"]) == 2
    assert cli.main(["--pd-shared-kv"]) == 2
    assert parse_pd("2:3") == (2, 3)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not on PATH")
def test_with_a_shared_kv_tier_every_engine_writes_there_and_outputs_hold():
    sessions = [("folder-a", _session("a"))]
    args = _args(pd="1:1", pd_min_uncached_tokens=64, pd_transport="tcp", pd_shared_kv=True)
    section = asyncio.run(cli.run_replay(sessions, args))["pd"]
    assert set(section["variants"]) == {COLOCATED, DISAGGREGATED, SHARED_KV}
    assert section["outputs_identical"]
    shared = section["shared_kv"]
    assert shared["num_split_calls"] >= 1 and shared["max_decode_computed_tokens_of_split"] <= 1
    # Every engine writes the blocks it fills to the shared tier. (Whether a given block
    # reached Redis before the next call asked for it is a race, so its hits are not
    # asserted.)
    assert shared["shared_saved_blocks"] > 0 and shared["prefill_computed_tokens"] > 0
    assert "shared_saved_blocks" not in section  # once/pd has no shared tier
