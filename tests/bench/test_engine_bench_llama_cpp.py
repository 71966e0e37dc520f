"""llama.cpp as the engine bench's peer: the server's flags, and (where `make llamacpp` has
built it; it is not part of `make test`, a 15-minute build) a tiny run end to end."""

import json
from pathlib import Path

import pytest

from once.fleet.llama_server import (
    F32,
    Q8_0,
    LlamaServer,
    LlamaServerSpec,
    llamacpp_missing_reason,
)


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_server_runs_with_the_rows_precision_threads_and_one_shared_cache(tmp_path):
    spec = LlamaServerSpec(
        tmp_path / "m.gguf", threads=3, ctx_size=6144, parallel=32, kv_type="f32"
    )
    command = LlamaServer(spec, "s", 4242, tmp_path).command()
    assert _flag(command, "-m") == str(tmp_path / "m.gguf")
    assert _flag(command, "--host") == "127.0.0.1"  # loopback only
    assert _flag(command, "-t") == _flag(command, "-tb") == "3"
    assert _flag(command, "-ctk") == _flag(command, "-ctv") == "f32"
    assert _flag(command, "--parallel") == "32" and _flag(command, "--ctx-size") == "6144"
    assert "--kv-unified" in command and "--metrics" in command


def test_a_missing_build_names_the_command_that_makes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ONCE_LLAMACPP_HOME", str(tmp_path / "nowhere"))
    assert "make llamacpp" in (llamacpp_missing_reason() or "")
    from once.bench.engine_bench import llama_cpp_side

    result = llama_cpp_side.measure(tmp_path, 1, 64, {}, None, 256, "s", print)
    assert result["status"] == "skipped" and "make llamacpp" in result["reason"]


@pytest.mark.skipif(llamacpp_missing_reason() is not None, reason="llama.cpp is not built")
def test_the_llama_cpp_rows_run_once_prompts_and_count_its_cache(tmp_path):
    from once.bench.engine_bench import main
    from once.bench.replay.stacks import make_tiny_replay_model

    folder = make_tiny_replay_model(tmp_path / "tiny", 512)  # SmolLM2's tokenizer files
    out = tmp_path / "bench.json"
    argv = [
        "--model", str(folder), "--concurrency", "1,2", "--prompt-tokens", "16",
        "--output-tokens", "6", "--ctx-long", "48", "--decode-steps", "3",
        "--session-turns", "3", "--session-system", "64", "--session-task", "8",
        "--session-new", "40", "--session-output", "8", "--threads", "1",
        "--baseline", "llamacpp", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    results = json.loads(out.read_text())
    llama = results["llama_cpp"]
    assert llama["status"] == "ok", llama
    assert set(llama["rows"]) == {F32, Q8_0}  # no shipped Q4_1 file for this model
    assert Path(llama["rows"][F32]["gguf"]).is_file()
    for row in llama["rows"].values():
        assert set(row["throughput"]) == {"1", "2"}
        assert row["throughput"]["2"]["greedy_agreement"]["num_requests"] == 2
        assert row["decode"]["48"]["num_decode_steps"] == 3
        turns = row["session"]["turns"]
        assert turns[0]["computed_tokens"] == turns[0]["prompt_tokens"]
        # Its prompt cache keeps the conversation: a later turn computes its new tokens
        # (the previous output's last token, sampled but never fed back, among them).
        assert all(t["computed_tokens"] <= t["new_tokens"] + 1 for t in turns[1:])
    assert results["llamacpp_tok_s_ratio_c1"] > 0
    assert results["llamacpp_q8_0_tok_s_ratio_c1"] > 0


def test_a_row_that_fails_part_way_keeps_its_figures_and_the_other_rows(tmp_path, monkeypatch):
    import contextlib
    from types import SimpleNamespace

    from once.bench.engine_bench import llama_cpp_side
    from once.bench.engine_bench.once_side import SessionShape

    log_file = tmp_path / "llama-server.log"
    log_file.write_text("loading\nGGML_ASSERT failed\n")
    served: list[str] = []

    @contextlib.contextmanager
    def fake_servers(specs):
        served.append(specs[0].gguf.name)
        # A server process that has exited with status -11 (SIGSEGV).
        process = SimpleNamespace(poll=lambda: -11)
        yield [SimpleNamespace(url="http://127.0.0.1:1", log_path=log_file, process=process)]

    async def fake_session(url, shape, vocab, seed):
        if served[-1] == "q8_0.gguf":  # the server goes away in the last part of this row
            raise RuntimeError("Server disconnected without sending a response.")
        return {"turns": []}

    async def nothing(*args, **kwargs):
        return {"output_tok_s": 10.0, "decode_step_ms": 1.0, "prefill_tok_s": 1.0}

    files = {F32: tmp_path / "f32.gguf", Q8_0: tmp_path / "q8_0.gguf"}
    monkeypatch.setattr(llama_cpp_side, "llamacpp_missing_reason", lambda: None)
    monkeypatch.setattr(llama_cpp_side, "gguf_files", lambda folder, precisions: files)
    monkeypatch.setattr(llama_cpp_side, "llamacpp_version", lambda: "test")
    monkeypatch.setattr(llama_cpp_side, "llama_servers", fake_servers)
    monkeypatch.setattr(llama_cpp_side, "_warm_up", nothing)
    monkeypatch.setattr(llama_cpp_side, "measure_throughput", nothing)
    monkeypatch.setattr(llama_cpp_side, "measure_decode_step", nothing)
    monkeypatch.setattr(llama_cpp_side, "run_session", fake_session)
    workload = {"throughput": {"1": [[1, 2, 3]]}, "decode": [[1] * 8], "num_output": 2,
                "decode_steps": 2}  # fmt: skip
    result = llama_cpp_side.measure(
        tmp_path, 1, 64, workload, SessionShape(num_turns=2), 256, "s", print
    )
    assert result["status"] == "ok"
    f32, q8 = result["rows"][F32], result["rows"][Q8_0]
    assert f32["status"] == "ok" and "session" in f32
    assert q8["status"] == "error" and "Server disconnected" in q8["reason"]
    assert "GGML_ASSERT" in q8["server_log_tail"] and q8["server_exit_code"] == -11
    # What the failing row measured before its session is kept.
    assert q8["throughput"]["1"]["output_tok_s"] == 10.0 and "8" in q8["decode"]
