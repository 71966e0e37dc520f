"""Mooncake and Azure trace loaders: small temp files, clear errors on malformed lines."""

import json

import pytest

from once.bench.production_traces import (
    TraceFormatError,
    load_azure,
    load_mooncake,
    trace_path,
)


def _jsonl(tmp_path, rows):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _mooncake(timestamp, length, hashes, output=5):
    return {"timestamp": timestamp, "input_length": length, "output_length": output,
            "hash_ids": hashes}  # fmt: skip


def test_mooncake_loads_sorted_with_blocks_and_window(tmp_path):
    path = _jsonl(
        tmp_path,
        [_mooncake(3000, 600, [0, 1]), _mooncake(0, 512, [0]), "", _mooncake(70_000, 10, [4])],
    )
    requests = load_mooncake(path)
    assert [r.arrival_s for r in requests] == [0.0, 3.0, 70.0]
    assert requests[0].block_hashes == (0,) and requests[1].block_hashes == (0, 1)
    assert requests[1].num_prompt_tokens == 600 and requests[1].num_output_tokens == 5
    assert requests[1].line == 1  # ids and errors point at the file's own lines
    assert [r.arrival_s for r in load_mooncake(path, minutes=1)] == [0.0, 3.0]
    assert len(load_mooncake(path, limit=1)) == 1


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ("{not json", "(line)"),
        ("[1, 2]", "(line)"),
        (_mooncake(-1, 10, [0]), "timestamp"),
        (_mooncake("0", 10, [0]), "timestamp"),
        (_mooncake(0, 0, []), "input_length"),
        (_mooncake(0, 10, [0], output=-2), "output_length"),
        (_mooncake(0, 10, ["a"]), "hash_ids"),
        (_mooncake(0, 1025, [0, 1]), "hash_ids"),  # 1025 tokens need 3 blocks of 512
        ({"timestamp": 0, "input_length": 10, "output_length": 1}, "hash_ids"),
    ],
)
def test_mooncake_malformed_line_names_file_line_and_field(tmp_path, row, field):
    path = _jsonl(tmp_path, [_mooncake(0, 10, [0]), row])
    with pytest.raises(TraceFormatError) as error:
        load_mooncake(path)
    assert error.value.field == field and error.value.line == 2
    assert str(path) in str(error.value) and f"{path}:2: field {field!r}" in str(error.value)


def _azure(tmp_path, lines, header="TIMESTAMP,ContextTokens,GeneratedTokens"):
    path = tmp_path / "azure.csv"
    path.write_text("\n".join([header, *lines]) + "\n")
    return path


def test_azure_arrivals_from_first_row_with_100ns_stamps(tmp_path):
    path = _azure(
        tmp_path,
        [
            "2023-11-16 18:17:03.9799600,4808,10",
            "2023-11-16 18:17:04.0319600,3180,8",
            "2023-11-16 18:19:03.9799600,100,0",
        ],
    )
    requests = load_azure(path)
    assert [round(r.arrival_s, 4) for r in requests] == [0.0, 0.052, 120.0]
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in requests][:2] == [
        (4808, 10),
        (3180, 8),
    ]
    assert requests[0].block_hashes == () and requests[1].line == 3
    assert len(load_azure(path, minutes=1)) == 2 and len(load_azure(path, limit=1)) == 1


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("yesterday,10,1", "TIMESTAMP"),
        ("2023-11-16 18:17:05.0,ten,1", "ContextTokens"),
        ("2023-11-16 18:17:05.0,0,1", "ContextTokens"),
        ("2023-11-16 18:17:05.0,10,-1", "GeneratedTokens"),
        ("2023-11-16 18:17:05.0,10", "GeneratedTokens"),
        ("2023-11-16 18:17:00.0,10,1", "TIMESTAMP"),  # before the first row
    ],
)
def test_azure_malformed_row_names_file_line_and_field(tmp_path, line, field):
    path = _azure(tmp_path, ["2023-11-16 18:17:03.9799600,4808,10", line])
    with pytest.raises(TraceFormatError, match=rf"azure\.csv:3: field '{field}'"):
        load_azure(path)


def test_azure_header_must_name_the_fields(tmp_path):
    path = _azure(tmp_path, ["2023-11-16 18:17:03.9,1,1"], header="TIME,Context,Generated")
    with pytest.raises(TraceFormatError, match="'TIMESTAMP'"):
        load_azure(path)


def test_named_traces_resolve_and_unknown_names_are_refused():
    assert trace_path("mooncake", "synthetic").name == "synthetic_trace.jsonl"
    assert trace_path("azure", "code").parent.name == "azure_llm_2023"
    with pytest.raises(ValueError, match="unknown trace"):
        trace_path("azure", "chat")


@pytest.mark.skipif(not trace_path("azure", "code").exists(), reason="shared data absent")
def test_the_shared_traces_load():
    assert len(load_azure(trace_path("azure", "code"))) == 8819
    assert len(load_mooncake(trace_path("mooncake", "conversation"), limit=200)) == 200
