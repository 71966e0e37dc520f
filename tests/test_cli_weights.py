"""`--weights` on the engine commands (`once serve`, `once engine`, `once run`)."""

import argparse

import pytest

from once.cli import _add_engine_flags, _engine_config


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="once serve")
    _add_engine_flags(parser)
    return parser.parse_args(argv)


def test_weights_flag_reaches_the_engine_config(monkeypatch):
    monkeypatch.delenv("ONCE_ENGINE_WEIGHTS", raising=False)
    assert _engine_config(_parse(["--weights", "q8_0"])).weights == "q8_0"
    assert _engine_config(_parse([])).weights == "fp32"


def test_a_bad_weights_value_names_the_setting(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _parse(["--weights", "q4_0"])
    assert "--weights" in capsys.readouterr().err
    monkeypatch.setenv("ONCE_ENGINE_WEIGHTS", "int4")
    with pytest.raises(SystemExit, match="weights must be one of"):
        _engine_config(_parse([]))
