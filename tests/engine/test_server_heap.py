"""Servers freeze their startup heap before serving (see once.heap for why)."""

import asyncio
import gc

import uvicorn

from once import cli


def test_once_engine_freezes_its_startup_heap_before_it_serves(tiny_model_dir, monkeypatch):
    seen = {}

    def fake_run(app, **kwargs):
        # What a collection would still walk at the moment serving starts.
        seen["frozen"] = gc.get_freeze_count()
        seen["tracked"] = len(gc.get_objects())
        seen["engine"] = app.state.engine

    monkeypatch.setattr(uvicorn, "run", fake_run)
    gc.unfreeze()
    try:
        assert cli.main(["engine", "--model", str(tiny_model_dir), "--port", "0"]) == 0
    finally:
        gc.unfreeze()
        if "engine" in seen:  # a server would have run until exit: stop its engine thread
            asyncio.run(seen.pop("engine").close())
    assert seen["frozen"] > 10_000  # the interpreter, torch and the engine's modules
    assert seen["tracked"] < seen["frozen"] / 100
