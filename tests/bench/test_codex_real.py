"""`once bench clients --real-codex`'s verdict pieces, without Codex or a model (the real
run is a benchmark stage, not part of the suite)."""

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from once.bench import clients
from once.bench.clients import codex_real
from once.bench.clients.codex_real import (
    Reading,
    busy_beside,
    error_lines,
    first_call_prompt_tokens,
    first_response_s,
    metric_samples,
    mode_ok,
    responses_by_outcome,
)
from once.bench.clients.node_clients import ClientRun
from once.gateway.metrics import GatewayMetrics

IDLE_ERROR = "ERROR: stream disconnected before completion: idle timeout waiting for SSE"


def test_error_lines_are_every_line_with_error_in_capitals_from_both_streams():
    run = ClientRun(
        returncode=1,
        stdout="The time is 12:00.\nno ERROR here? ERROR all the same\n",
        stderr=f"[2026-12-05T17:00:00] codex\n{IDLE_ERROR}\nwarning: an error in lower case\n",
        seconds=1.0,
    )
    assert error_lines(run) == [IDLE_ERROR, "no ERROR here? ERROR all the same"]
    assert error_lines(ClientRun(0, "It is noon.\n", "tokens used: 14,012\n", 1.0)) == []


def result(**changes) -> dict:
    passing = {
        "returncode": 0,
        "error_lines": [],
        "responses_by_outcome": {"response.completed": 2, "response.incomplete": 1},
    }
    return passing | changes


def test_a_mode_passes_only_on_exit_0_no_error_line_and_every_response_answered():
    assert mode_ok(result())
    assert not mode_ok(result(returncode=1))
    assert not mode_ok(result(returncode=None))  # the hang guard fired
    assert not mode_ok(result(error_lines=[IDLE_ERROR]))
    assert not mode_ok(result(responses_by_outcome={}))  # Codex never reached the server
    for bad in ("disconnected", "error", "response.failed"):
        outcomes = {"response.completed": 1, bad: 1}
        assert not mode_ok(result(responses_by_outcome=outcomes)), bad


def test_responses_by_outcome_reads_the_gateways_own_metrics():
    metrics = GatewayMetrics(CollectorRegistry())
    metrics.requests.labels("http", "response.completed").inc(2)
    metrics.requests.labels("websocket", "response.completed").inc()
    metrics.requests.labels("websocket", "disconnected").inc()
    metrics.renders.labels("full").inc()
    metrics.prompt_tokens.inc(14_012)
    samples = metric_samples(generate_latest(metrics.registry).decode())
    assert responses_by_outcome(samples) == {"response.completed": 3, "disconnected": 1}
    assert samples["once_gateway_prompt_tokens_total"] == {(): 14_012}
    assert samples["once_gateway_renders_total"] == {(("mode", "full"),): 1}


def test_first_call_prompt_tokens_skips_empty_warm_ups_and_refuses_to_guess():
    assert first_call_prompt_tokens([(0, 0), (0, 0), (1, 14_012), (2, 14_300)]) == 14_012
    # Codex's WebSocket warm-up renders nothing; the call after it is the first.
    assert first_call_prompt_tokens([(0, 0), (1, 0), (2, 14_012)]) == 14_012
    # Two calls between readings: which one came first is unknown.
    assert first_call_prompt_tokens([(0, 0), (2, 28_000)]) is None
    assert first_call_prompt_tokens([(0, 0), (1, 0)]) is None  # no call with a prompt
    assert first_call_prompt_tokens([]) is None


def test_busy_processes_run_during_the_block_and_are_stopped_however_it_ends():
    with pytest.raises(RuntimeError), busy_beside(2) as processes:
        assert len(processes) == 2 and all(p.poll() is None for p in processes)
        raise RuntimeError("codex failed")
    assert all(p.returncode is not None for p in processes)
    with busy_beside(0) as none:
        assert none == []


def stage_report(ok: bool) -> dict:
    mode = result(first_call_prompt_tokens=14_012, first_response_s=181.5, ok=ok)
    mode |= {"codex_s": 200.0, "load_avg_1m": 3.1}
    return {
        "codex_real_model": {"http": mode},
        "codex_real_model_busy": 1,
        "codex_real_model_ok_http": ok,
        "codex_real_model_ok": ok,
    }


@pytest.mark.parametrize("ok", [True, False])
def test_real_codex_only_runs_that_stage_alone_and_exits_on_its_verdict(monkeypatch, tmp_path, ok):
    asked = []

    async def fake_run(num_busy, modes, served):
        asked.append((num_busy, modes, served))
        return stage_report(ok)

    def no_runtime(*args, **kwargs):
        raise AssertionError("the stage alone loads no model in this process")

    monkeypatch.setattr(codex_real, "run", fake_run)
    monkeypatch.setattr("once.gateway.testing.load_runtime", no_runtime)
    out = tmp_path / "codex.json"
    argv = ["--real-codex-only", "--busy", "2", "--codex-modes", "http", "--out", str(out)]
    assert clients.main([*argv, "--max-output-tokens", "4096"]) == (0 if ok else 1)
    assert asked == [(2, ("http",), codex_real.Served(max_output_tokens=4096))]
    assert json.loads(out.read_text())["codex_real_model_ok"] is ok


def test_an_unknown_mode_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="mode must be one of"):
        asyncio.run(codex_real.run_mode("grpc", num_busy=1))


def test_first_response_s_runs_from_the_first_prompt_to_the_first_response_ended():
    readings = [
        Reading(0.0, 0, 0, 0),
        Reading(1.0, 1, 0, 0),  # Codex's WebSocket warm-up: nothing to prefill
        Reading(2.0, 2, 14_012, 1),  # the warm-up's response ended, the first call's not
        Reading(3.0, 2, 14_012, 1),
        Reading(183.5, 2, 14_012, 2),
    ]
    assert first_response_s(readings) == 181.5
    assert first_response_s(readings[:4]) is None  # still prefilling when Codex ended
    http = [Reading(0.0, 0, 0, 0), Reading(1.0, 1, 14_012, 0), Reading(90.0, 1, 14_012, 1)]
    assert first_response_s(http) == 89.0
    # The warm-up and the first call between two readings: the warm-up's end is not it.
    both = [Reading(0.0, 0, 0, 0), Reading(1.0, 2, 14_012, 1), Reading(200.0, 2, 14_012, 2)]
    assert first_response_s(both) == 199.0


def test_the_server_is_stretched_by_yarn_unless_told_otherwise(tmp_path):
    from once.engine.config import EngineConfig

    command = codex_real.serve_command(8000, tmp_path / "c.toml")
    scaling = command[command.index("--rope-scaling") + 1]
    assert json.loads(scaling)["factor"] * 8192 == codex_real.MAX_MODEL_LEN
    EngineConfig(rope_scaling=scaling)  # a setting the engine takes as it is
    assert "--rope-scaling" not in codex_real.serve_command(8000, tmp_path / "c", rope_scaling="")
