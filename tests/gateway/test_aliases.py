"""Model names real clients send, mapped to the served model (aliases.py)."""

import httpx
import pytest

from once.gateway.aliases import DEFAULT_CLIENT_MODELS, ModelAliases
from once.gateway.config import GatewayConfig
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

SERVED = {MODEL: object()}


def test_the_default_names_of_codex_and_claude_code_reach_the_one_served_model():
    aliases = ModelAliases(SERVED)
    for name in ("gpt-6.2-sol", "claude-opus-4-8", "claude-haiku-4-5-20251001"):
        assert name in DEFAULT_CLIENT_MODELS and aliases.resolve(name) == MODEL
    assert aliases.resolve(MODEL) == MODEL
    assert aliases.resolve("gpt-nonexistent") is None  # still model_not_found


def test_a_table_maps_exact_names_before_patterns_in_order_and_can_turn_aliasing_off():
    aliases = ModelAliases(SERVED, {"claude-*": MODEL, "gpt-5.5": MODEL})
    assert aliases.resolve("claude-anything") == MODEL and aliases.resolve("gpt-5.5") == MODEL
    assert aliases.resolve("claude-opus-4-8") == MODEL
    assert ModelAliases(SERVED, {}).resolve("claude-opus-4-8") is None
    with pytest.raises(ValueError, match="not served"):
        ModelAliases(SERVED, {"x": "another-model"})


async def test_a_request_by_alias_is_served_and_echoes_the_name_it_came_with(runtime):
    engine = scripted_texts(runtime, ["Hi."])
    config = GatewayConfig(store="memory", aliases={"codex-*": MODEL})
    async with serve_gateway(runtime, engine, config) as (url, _):
        async with httpx.AsyncClient(base_url=f"{url}/v1", timeout=10) as http:
            reply = await http.post("/responses", json={"model": "codex-mini", "input": "hi"})
            models = (await http.get("/models")).json()["data"]
    assert reply.status_code == 200 and reply.json()["model"] == "codex-mini"
    assert [(m["id"], m["aliases"]) for m in models] == [(MODEL, ["codex-*"])]
