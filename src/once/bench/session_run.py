"""The main job until the gateway and replay land: one real agent session through the engine.

Each recorded call is rendered with the model's chat template; the recorded output is
forced (`forced_output_ids`), so every call costs one real forward per output token and
the conversation stays exactly as recorded. Calls run one after another, as an agent runs
them, and the report shows per call how many prompt tokens were new versus how many the
engine actually computed, with the prefix cache and (optionally) without.

Forced ids are cut from the next render, not tokenized on their own, so they are exactly
the ids the following request will carry for that assistant turn.
"""

import sys
import time
from dataclasses import dataclass

from once.bench.traces import MINI_SWE_AGENT, Session, default_traces_dir, load_sessions
from once.protocol.engine import GenerateRequest, SamplingParams


@dataclass
class CallPlan:
    index: int
    prompt_ids: list[int]
    forced_ids: list[int]


def _template_messages(messages) -> list[dict]:
    # The default model's template renders role and string content only.
    return [{"role": m["role"] if m["role"] != "tool" else "user", "content": m["content"]}
            for m in messages]  # fmt: skip


def plan_session(session: Session, tokenizer, max_len: int, max_calls: int) -> list[CallPlan]:
    plans = []
    for call in session.calls[:max_calls]:
        messages = _template_messages(call.messages)
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        with_output = tokenizer.apply_chat_template(
            messages + _template_messages([call.output]), tokenize=True, return_dict=False
        )
        if with_output[: len(prompt)] != prompt:
            raise ValueError(f"call {call.index}: the template does not extend the prompt")
        forced = with_output[len(prompt) :]
        # Keep the output through <|im_end|>; the newline after it belongs to the next turn.
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if end in forced:
            forced = forced[: forced.index(end) + 1]
        if len(prompt) + len(forced) > max_len:
            break
        plans.append(CallPlan(call.index, prompt, forced))
    return plans


def run_plans(engine, plans: list[CallPlan], label: str) -> list[dict]:
    rows = []
    previous: list[int] = []
    for plan in plans:
        # "New" tokens: what this request adds beyond the longest common prefix with the
        # previous request plus its output (what an ideal cache could already hold).
        shared = 0
        for a, b in zip(previous, plan.prompt_ids, strict=False):
            if a != b:
                break
            shared += 1
        request = GenerateRequest(
            f"{label}-{plan.index}",
            tuple(plan.prompt_ids),
            SamplingParams(temperature=0, max_tokens=len(plan.forced_ids)),
            forced_output_ids=tuple(plan.forced_ids),
        )
        started = time.perf_counter()
        deltas = engine.generate([request])[request.request_id]
        metrics = deltas[-1].metrics
        rows.append(
            {
                "call": plan.index,
                "prompt_tokens": len(plan.prompt_ids),
                "new_tokens": len(plan.prompt_ids) - shared,
                "cached_tokens": metrics.num_cached_tokens,
                "computed_tokens": metrics.num_computed_tokens,
                "output_tokens": metrics.num_output_tokens,
                "ttft_s": metrics.ttft_s,
                "wall_s": time.perf_counter() - started,
            }
        )
        previous = plan.prompt_ids + plan.forced_ids
    return rows


def print_report(session_id: str, runs: dict[str, list[dict]], out=sys.stdout) -> None:
    print(f"session {session_id}", file=out)
    header = f"{'call':>4} {'prompt':>7} {'new':>6}"
    for label in runs:
        header += f" | {label + ' computed':>18} {'cached':>7} {'ttft s':>7}"
    print(header, file=out)
    first = next(iter(runs.values()))
    for i, row in enumerate(first):
        line = f"{row['call']:>4} {row['prompt_tokens']:>7} {row['new_tokens']:>6}"
        for rows in runs.values():
            r = rows[i]
            line += f" | {r['computed_tokens']:>18} {r['cached_tokens']:>7} {r['ttft_s']:>7.2f}"
        print(line, file=out)
    total_new = sum(r["new_tokens"] for r in first)
    for label, rows in runs.items():
        computed = sum(r["computed_tokens"] for r in rows)
        ttft = sum(r["ttft_s"] for r in rows)
        print(
            f"{label}: prompt tokens computed {computed} for {total_new} new "
            f"({computed / max(total_new, 1):.2f}x), total TTFT {ttft:.1f} s",
            file=out,
        )


# A session whose first 16 calls fit the default model's 8k context.
DEFAULT_SESSION = "django__django-11179"


def pick_session(source: str = MINI_SWE_AGENT, name: str = DEFAULT_SESSION) -> Session:
    """The session of `source` whose id contains `name` (or the name-th one, if a number)."""
    sessions = load_sessions(default_traces_dir(), source=source)
    if not sessions:
        raise FileNotFoundError(f"no {source} sessions under {default_traces_dir()}")
    if name.isdigit():
        return sessions[int(name) % len(sessions)]
    matches = [s for s in sessions if name in s.session_id]
    if not matches:
        raise FileNotFoundError(f"no {source} session matches {name!r}")
    return matches[0]
