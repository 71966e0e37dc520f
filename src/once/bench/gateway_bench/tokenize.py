"""Incremental tokenization vs a full render+tokenize, at the last call of each session.

For every recorded session, the last call k and the previous call j of its chain (CodeR:
the same role's chat) are replayed through the gateway's `PromptBuilder`:

- full: render the whole conversation of call k with the chat template and tokenize it
  (what a stateless gateway does on every call);
- incremental: starting from the state after call j (its prompt ids plus its output ids,
  the output tokenized canonically and ended with eos, as a model that stops would),
  render and tokenize only call k's new items.

- stateless: what a client that resends the whole conversation costs (Chat Completions,
  Messages, a stateless Responses client): the states kept after call j
  (prefix_states.py), then call k's whole input hashed by messages, its longest kept
  prefix found, and only what follows it rendered and tokenized.

Each is timed (best of `repeats`), and the ids compared. The rule where the history is
not append-only (SWE-agent 1.0's elided tool outputs, a dropped failed reply): the
gateway receives a full request and renders it in full, so once and a naive stack do
the same work there; those calls are reported with their reason, outside the median.
"""

import statistics
import time

from once.bench.payloads import chains, full_request_reason, session_requests
from once.bench.traces import load_sessions
from once.gateway.prompt.tokens import ConversationState, render_key
from once.gateway.state.prefix_states import PrefixStates, find_prefix, states_after_response
from once.heap import freeze_startup_heap

TENANT = "bench"


def _best_of(repeats: int, fn, *args):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - start)
    return best, out


def measure_session(session, runtime, repeats: int = 5) -> dict:
    builder, renderer = runtime.builder, runtime.renderer
    requests = session_requests(session, model=runtime.name)
    last = len(requests) - 1
    chain = next(c for c in chains(session).values() if last in c)
    row = {"session_id": session.session_id, "source": session.source, "calls": len(requests)}
    if len(chain) < 2:
        return {**row, "incremental": False, "reason": "first_call"}
    previous = chain[-2]
    prev_request, prev_output = requests[previous]
    request, _ = requests[last]
    reason = full_request_reason(prev_request, prev_output, request)
    if reason is not None:
        return {**row, "incremental": False, "reason": reason}
    tools = request.get("tools") or []
    key = render_key(runtime.name, request.get("instructions"), tools)
    prev_built = builder.full(key, prev_request.get("instructions"), tools, prev_request["input"])
    output_text = renderer.item_messages(prev_output)[0]["content"]
    output_ids = builder.encode(output_text) + sorted(builder.eos_ids)[:1]
    state = ConversationState(key, prev_built.prompt_ids + output_ids, after_output=True)
    new_items = request["input"][len(prev_request["input"]) + len(prev_output) :]
    full_s, full = _best_of(
        repeats, builder.full, key, request.get("instructions"), tools, request["input"]
    )
    incremental_s, incremental = _best_of(repeats, builder.continuation, state, tools, new_items)
    states = _states_after(runtime, key, prev_built, state.token_ids, prev_request, prev_output)
    stateless_s, stateless = _best_of(
        repeats, _stateless, runtime, states, key, tools, request["input"]
    )
    return {
        **row,
        "incremental": True,
        "prompt_tokens": len(full.prompt_ids),
        "new_tokens": incremental.num_tokenized,
        "full_ms": 1000 * full_s,
        "incremental_ms": 1000 * incremental_s,
        "speedup": full_s / incremental_s,
        "identical": incremental.prompt_ids == full.prompt_ids,
        "stateless_ms": 1000 * stateless_s,
        "stateless_speedup": full_s / stateless_s,
        "stateless_identical": stateless.prompt_ids == full.prompt_ids,
    }


def _states_after(runtime, key, prev_built, token_ids, prev_request, prev_output):
    """The states the gateway keeps after call j (its response is done, before call k)."""
    states = PrefixStates()
    renderer = runtime.renderer
    hashes = find_prefix(states, renderer, TENANT, key, prev_request["input"]).hashes
    kept = states_after_response(
        renderer, hashes, key, prev_built.context_ids, token_ids, prev_output,
        prev_request["input"][-1:], runtime.builder.turn_end_ids,
    )  # fmt: skip
    for entry in kept:
        states.put(entry.key, entry.state, entry.boundaries)
    return states


def _stateless(runtime, states, key, tools, items):
    """The gateway's stateless path for call k's whole input: hash, find, continue."""
    lookup = find_prefix(states, runtime.renderer, TENANT, key, items)
    if lookup.state is None:
        raise RuntimeError("no kept prefix for an append-only call")
    return runtime.builder.continuation(lookup.state, tools, lookup.new_items)


def run(runtime, repeats: int = 5, limit: int | None = None) -> dict:
    # As the servers do before serving: the loaded tokenizer, template and SDK types leave
    # the collector's walk, so a full collection during a timing costs what it would cost
    # in the gateway, not a walk over the whole startup heap.
    freeze_startup_heap()
    rows = [measure_session(s, runtime, repeats) for s in load_sessions(limit=limit)]
    measured = [r for r in rows if r["incremental"]]
    speedups = [r["speedup"] for r in measured]
    return {
        "sessions": len(rows),
        "incremental_sessions": len(measured),
        "incremental_tokenize_speedup_median": statistics.median(speedups) if speedups else 0.0,
        "incremental_ids_identical": all(r["identical"] for r in measured),
        "stateless_incremental_tokenize_speedup_median": (
            statistics.median(r["stateless_speedup"] for r in measured) if measured else 0.0
        ),
        "stateless_ids_identical": all(r["stateless_identical"] for r in measured),
        "not_incremental": {r["session_id"]: r["reason"] for r in rows if not r["incremental"]},
        "rows": rows,
    }
