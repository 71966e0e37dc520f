"""The fixed workload: calls sampled with a seed from the mini-swe-agent dev sessions, each
prompt rendered with the model's chat template and cut to its last `prompt_tokens` ids,
each paired with the first `output_tokens` ids of the output the model really wrote."""

import random
from dataclasses import dataclass

from once.bench.traces import MINI_SWE_AGENT, load_sessions


@dataclass(frozen=True)
class SpecCall:
    call_id: str
    session_key: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]  # recorded output, forced during timed runs


def sample_calls(
    tokenizer, num_calls: int, prompt_tokens: int, output_tokens: int, seed: int
) -> list[SpecCall]:
    sessions = load_sessions(source=MINI_SWE_AGENT)
    pool = [
        (session, call)
        for session in sessions
        for call in session.calls
        if isinstance(call.output.get("content"), str) and call.output["content"].strip()
    ]
    if not pool:
        raise ValueError("no mini-swe-agent calls found in the agent traces")
    rng = random.Random(seed)
    chosen = rng.sample(pool, min(num_calls, len(pool)))
    calls = []
    for session, call in chosen:
        messages = [{"role": m["role"], "content": m["content"]} for m in call.messages]
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        output = tokenizer.encode(call.output["content"], add_special_tokens=False)
        calls.append(
            SpecCall(
                call_id=f"{session.session_id}#{call.index}",
                session_key=session.session_id,
                prompt_ids=tuple(prompt[-prompt_tokens:]),
                output_ids=tuple(output[:output_tokens]),
            )
        )
    return calls
