"""`once bench engine --weights q8_0`: once's own rows run Q8_0 weights, and say so."""

import json

import pytest

from once.bench.engine_bench import cli, main, once_side
from once.engine.quant_q8_0 import Q8_0Linear
from once.engine.testing import make_tiny_model


def test_q8_0_weights_reach_the_engine_and_the_report(tmp_path, monkeypatch):
    model = make_tiny_model(tmp_path / "m")
    built = []
    real = once_side.make_engine

    def recording(*args, **kwargs):
        engine = real(*args, **kwargs)
        built.append(engine)
        return engine

    monkeypatch.setattr(once_side, "make_engine", recording)
    out = tmp_path / "bench.json"
    argv = [
        "--model", str(model), "--concurrency", "1", "--prompt-tokens", "8",
        "--output-tokens", "4", "--ctx-long", "0", "--session-turns", "0",
        "--block-size", "4", "--kv-cache-gib", "0.01", "--threads", "1",
        "--baseline", "transformers", "--skip-hf", "--weights", "q8_0", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    results = json.loads(out.read_text())
    assert results["once_weights"] == "q8_0"
    assert built and all(isinstance(e.model.lm_head, Q8_0Linear) for e in built)


def test_fp32_is_the_default_and_a_bad_format_is_refused(capsys):
    assert cli.options_from_args(cli.build_parser().parse_args([])).weights == "fp32"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--weights", "q4_1"])
    assert "--weights" in capsys.readouterr().err
