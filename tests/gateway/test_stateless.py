"""Stateless clients tokenize only what is new: prefix states found by message hashes.

The reference is a full render of the same conversation (`runtime.builder.full`): every
prompt the engine gets through the incremental path must equal it token for token.
"""

from prometheus_client import CollectorRegistry

from once.gateway.admission.auth import Tenant
from once.gateway.app import create_gateway
from once.gateway.config import GatewayConfig
from once.gateway.prompt.tokens import INCREMENTAL, ConversationState, render_key
from once.gateway.state.prefix_states import PrefixStates, chain, chain_seed
from once.gateway.testing import prepare_request, response_events
from tests.gateway.conftest import MODEL, scripted_texts

CALL = '<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls"}}\n</tool_call>'
TOOLS = [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def gateway_for(runtime, engine, **config):
    config = GatewayConfig(store="memory", verify_every=1, **config)
    return create_gateway(config, engine, {MODEL: runtime}, CollectorRegistry())


async def respond(gateway, items, tenant_key=None):
    body = {"model": MODEL, "input": items, "tools": TOOLS, "store": False}
    prepared = await prepare_request(gateway, body)
    events = [event async for event in response_events(gateway, prepared)]
    return prepared, events[-1]["response"]


def full_prompt(runtime, items) -> list[int]:
    key = render_key(MODEL, None, TOOLS)
    return runtime.builder.full(key, None, TOOLS, items).prompt_ids


async def test_a_resent_conversation_is_tokenized_from_its_last_kept_state(runtime):
    engine = scripted_texts(runtime, [CALL, "Two files.", "Bye."])
    gateway = gateway_for(runtime, engine)
    items = [user("What is here?")]
    first, reply = await respond(gateway, items)
    assert first.built.mode == "full"
    items += reply["output"]  # the client keeps the reply as it came
    call_id = items[-1]["call_id"]  # an output answers a call the conversation holds
    items.append({"type": "function_call_output", "call_id": call_id, "output": "a.py b.py"})
    second, reply = await respond(gateway, items)
    assert second.built.mode == INCREMENTAL
    assert second.built.num_tokenized < len(second.built.prompt_ids) // 3
    items += reply["output"] + [user("Thanks.")]
    third, _ = await respond(gateway, items)
    assert third.built.mode == INCREMENTAL
    for request, prepared in zip(engine.requests[1:], (second, third), strict=True):
        assert list(request.prompt_token_ids) == full_prompt(runtime, prepared.request.input_items)
    await gateway.drain_verifications()
    metrics = gateway.metrics
    assert metrics.value(metrics.verifications) == 2 and metrics.value(metrics.divergences) == 0


async def test_an_edited_reply_continues_from_the_prompt_and_tokenizes_the_edit(runtime):
    engine = scripted_texts(runtime, ["The answer is four.", "Right."])
    gateway = gateway_for(runtime, engine)
    items = [user("2+2?")]
    await respond(gateway, items)
    edited = [*items, {"type": "message", "role": "assistant", "content": "It is 4."}]
    second, _ = await respond(gateway, [*edited, user("Sure?")])
    assert second.built.mode == INCREMENTAL  # from the first prompt's context
    assert list(engine.requests[1].prompt_token_ids) == full_prompt(
        runtime, [*edited, user("Sure?")]
    )


async def test_a_changed_history_renders_in_full(runtime):
    engine = scripted_texts(runtime, ["A.", "B."])
    gateway = gateway_for(runtime, engine)
    await respond(gateway, [user("one")])
    second, _ = await respond(gateway, [user("other"), user("two")])
    assert second.built.mode == "full"


async def test_tenants_never_share_states(runtime):
    key = render_key(MODEL, None, TOOLS)
    messages = [{"role": "user", "content": "hi"}]
    acme = chain(chain_seed("acme", key), messages)
    other = chain(chain_seed("other", key), messages)
    assert acme != other
    states = PrefixStates()
    states.put(acme[-1], ConversationState(key, [1, 2, 3], False))
    assert states.longest(other) is None
    assert states.longest(acme).state.token_ids == [1, 2, 3]
    assert Tenant("acme") != Tenant("other")


def test_states_are_bounded_by_count_and_by_tokens_least_recently_used_first():
    states = PrefixStates(max_states=2, max_tokens=10)
    keys = [bytes([i]) * 16 for i in range(4)]
    for i, key in enumerate(keys[:2]):
        states.put(key, ConversationState("k", [i] * 4, False))
    assert states.longest([keys[0]]) is not None  # 0 is now the most recently used
    states.put(keys[2], ConversationState("k", [2] * 4, False))
    assert states.longest([keys[1]]) is None and len(states) == 2
    states.put(keys[3], ConversationState("k", [3] * 9, False))  # 4 + 9 > 10 ids
    assert len(states) == 1 and states.num_tokens == 9
    states.put(keys[0], ConversationState("k", [0] * 11, False))  # larger than the bound
    assert states.longest([keys[0]]) is None


async def test_a_divergence_drops_the_states_it_left(runtime):
    # Sampled ids that are not the text's canonical tokenization: a full render differs.
    eos = runtime.tokenizer.eos_token_id
    text_ids = runtime.builder.encode("Hello there")
    odd = [t for t in runtime.builder.encode("Hel")] + runtime.builder.encode("lo there")
    assert odd != text_ids
    from once.protocol.scripted_engine import ScriptedEngine

    engine = ScriptedEngine(
        [odd + [eos], runtime.builder.encode("Ok.") + [eos]] * 2, eos_token_id=eos
    )
    gateway = gateway_for(runtime, engine)
    items = [user("Greet me.")]
    _, reply = await respond(gateway, items)
    items += reply["output"] + [user("Again.")]
    second, _ = await respond(gateway, items)
    assert second.built.mode == INCREMENTAL  # built on the odd ids the model sampled
    await gateway.drain_verifications()
    assert gateway.metrics.value(gateway.metrics.divergences) == 1
    third, _ = await respond(gateway, items)
    # The state it was built on was dropped: from the first prompt's context now, the
    # reply tokenized from its text, as a full render does.
    assert third.built.mode == INCREMENTAL
    assert list(engine.requests[2].prompt_token_ids) == full_prompt(runtime, items)
    await gateway.drain_verifications()
    assert gateway.metrics.value(gateway.metrics.divergences) == 1


async def test_an_edited_earlier_message_reuses_the_ids_before_it(runtime):
    engine = scripted_texts(runtime, ["One.", "Two.", "Three."])
    gateway = gateway_for(runtime, engine)
    items = [user("first question " * 50)]
    _, reply = await respond(gateway, items)
    items += reply["output"] + [user("second question " * 50)]
    _, reply = await respond(gateway, items)
    # The client elides its second question (as SWE-agent trims old observations).
    edited = [*items[:2], user("(elided)"), *reply["output"], user("third")]
    third, _ = await respond(gateway, edited)
    assert third.built.mode == INCREMENTAL
    assert list(engine.requests[2].prompt_token_ids) == full_prompt(runtime, edited)
    assert third.built.num_tokenized < len(third.built.prompt_ids) // 3
