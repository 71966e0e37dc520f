"""The suite's own memory hygiene (tests/memory.py): what it releases is really freed."""

import gc
import weakref

from once.engine.scripted import ScriptedEngine
from once.engine_http.server import build_engine_app
from tests.memory import forget_endpoints, process_status


def test_an_app_nobody_holds_frees_its_engine_once_fastapi_forgets_its_endpoints():
    engine = ScriptedEngine([[1, 2]])
    app = build_engine_app(engine, model_name="scripted")
    engine_alive = weakref.ref(engine)
    del app, engine
    forget_endpoints()  # FastAPI's caches held the endpoints, closures over the engine
    gc.collect()
    assert engine_alive() is None


def test_the_rss_log_reads_this_process():
    status = process_status()
    assert status["VmRSS"] >= status["RssAnon"] > 0 and status["Threads"] >= 1
