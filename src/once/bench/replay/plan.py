"""A recorded session as what the replay sends: requests, forced outputs, reference ids.

Each call becomes the Responses request the original agent sent (`payloads`), the
recorded output items, and two id sequences rendered with the served model's own
renderer (the gateway's full path): the prompt, and the output ids to force. The forced
ids are cut from the render of the request followed by its output, so they are exactly
the ids a later request carries for that assistant turn (its canonical tokenization),
ending with the eos that closes the turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from once.bench.payloads import chains, session_requests
from once.bench.replay.reference import ReferenceCall, reference_calls
from once.bench.traces import Session


@dataclass(frozen=True)
class PlannedCall:
    index: int
    request: dict  # the recorded request, full (model, instructions, tools, input)
    output_items: list[dict]  # the recorded output as Responses items
    prompt_ids: list[int]  # the gateway's full render of the request
    forced_ids: list[int]  # the output to force, through the eos closing the turn
    canonical_output: bool  # forced_ids are what a full render of a later request carries
    previous_in_chain: int | None  # the call this one continues (CodeR: same role)


@dataclass(frozen=True)
class SessionPlan:
    session: Session
    calls: list[PlannedCall]
    reference: list[ReferenceCall]
    num_cut_by_context: int = 0  # recorded calls dropped: the first did not fit the context

    @property
    def session_id(self) -> str:
        return self.session.session_id


def plan_session(
    session: Session,
    runtime,
    *,
    max_calls: int | None = None,
    max_model_len: int | None = None,
) -> SessionPlan:
    """Render every call; stop before the first call that would not fit max_model_len."""
    builder = runtime.builder
    eos_ids = builder.eos_ids
    previous_in_chain: dict[int, int] = {}
    for positions in chains(session).values():
        for earlier, later in zip(positions, positions[1:], strict=False):
            previous_in_chain[later] = earlier
    calls: list[PlannedCall] = []
    requests = session_requests(session, model=runtime.name)[:max_calls]
    num_cut = 0
    for index, (request, output_items) in enumerate(requests):
        instructions, tools = request.get("instructions"), request.get("tools") or []
        prompt = builder.full("", instructions, tools, request["input"]).prompt_ids
        with_output = builder.full(
            "", instructions, tools, [*request["input"], *output_items]
        ).context_ids
        canonical = with_output[: len(prompt)] == prompt
        if canonical:
            forced = with_output[len(prompt) :]
        else:
            # An output that starts with whitespace merges with the generation prompt's
            # "\n" in a full render; a model emits it after the prompt, so tokenize the
            # output text on its own (as sampled ids would be): not canonical.
            forced = _output_after_prompt(runtime, request, output_items, session, index)
        end = next((i for i, t in enumerate(forced) if t in eos_ids), None)
        if end is not None:
            forced = forced[: end + 1]  # what follows the eos belongs to the next turn
        if not forced:
            raise ValueError(f"{session.session_id} call {index}: empty output")
        if max_model_len is not None and len(prompt) + len(forced) >= max_model_len:
            num_cut = len(requests) - index
            break
        calls.append(
            PlannedCall(
                index,
                request,
                output_items,
                prompt,
                forced,
                canonical,
                previous_in_chain.get(index),
            )
        )
    reference = reference_calls(
        [c.prompt_ids for c in calls],
        [c.forced_ids for c in calls],
        [c.previous_in_chain for c in calls],
    )
    return SessionPlan(session, calls, reference, num_cut)


def _output_after_prompt(runtime, request, output_items, session, index) -> list[int]:
    renderer, tools = runtime.renderer, request.get("tools") or []
    instructions = request.get("instructions")
    prompt_text = renderer.render(
        renderer.messages(instructions, tools, request["input"]), True, tools
    )
    items = [*request["input"], *output_items]
    full_text = renderer.render(renderer.messages(instructions, tools, items), False, tools)
    if not full_text.startswith(prompt_text):
        raise ValueError(
            f"{session.session_id} call {index}: the render of request+output does not "
            "start with the request's render"
        )
    return runtime.builder.encode(full_text[len(prompt_text) :])
