"""A recorded session rewritten so every output is cut to its first N tokens.

The second bar replays a long session with SmolLM2 against transformers, whose decode is
slow (~240 ms a step near 10k tokens here): outputs are cut to their first N tokens so the
measurement is about prefill and reuse, not hundreds of forced decode steps. A cut must
stay consistent along the session: the output of call k appears in the history of every
later call, so each later request carries the cut text, exactly as a harness would have
appended it. The recorded tool observations that follow are kept as they are.

Algorithm: plan the original session (the gateway's full render), take each output's
forced ids without the eos that closes the turn, and where there are more than N, decode
the first N (dropping tokens until the text is a prefix of the recorded text, so a cut
inside a multi-byte character never invents a character). Then every message of every
call that is a recorded output (the same dict, or an equal assistant message) is replaced
by its cut version. Planning the rewritten session gives forced ids of about N tokens plus
the eos (re-tokenizing the cut text can merge across the cut, rarely: one token more or
less).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from once.bench.replay.plan import plan_session
from once.bench.traces import Call, Session


def cut_outputs(session: Session, runtime, max_output_tokens: int) -> Session:
    """The session with each output's content cut to its first `max_output_tokens` tokens."""
    if max_output_tokens < 1:
        raise ValueError(f"max_output_tokens must be >= 1, not {max_output_tokens}")
    plan = plan_session(session, runtime)
    if len(plan.calls) != len(session.calls):
        raise ValueError(f"{session.session_id}: not every call could be planned")
    eos_ids = runtime.builder.eos_ids
    cut_by_call: dict[int, dict] = {}
    for planned, call in zip(plan.calls, session.calls, strict=True):
        content_ids = [t for t in planned.forced_ids if t not in eos_ids]
        if len(content_ids) <= max_output_tokens:
            continue
        if call.output.get("tool_calls"):
            raise ValueError(
                f"{session.session_id} call {call.index}: cutting an output with tool calls "
                "is not supported (the cut would break the call's JSON)"
            )
        text = _decoded_prefix(runtime.tokenizer, content_ids[:max_output_tokens], call.output)
        cut_by_call[call.index] = {**call.output, "content": text}
    if not cut_by_call:
        return session
    return replace(session, calls=tuple(_rewrite(session.calls, cut_by_call)))


def _decoded_prefix(tokenizer, ids: list[int], output: dict) -> str:
    content = output.get("content") or ""
    # The render puts the content right after "<|im_start|>assistant\n": the leading
    # whitespace of the content may merge into that token, so compare without it.
    stripped = content.lstrip()
    for num in range(len(ids), 0, -1):
        text = tokenizer.decode(ids[:num], skip_special_tokens=False)
        if stripped.startswith(text.lstrip()):
            return content[: len(content) - len(stripped)] + text.lstrip()
    raise ValueError("the output's tokens do not decode to a prefix of its recorded text")


def _rewrite(calls: tuple[Call, ...], cut_by_call: dict[int, dict]) -> list[Call]:
    originals = {index: calls[index].output for index in cut_by_call}
    by_identity = {id(output): cut_by_call[index] for index, output in originals.items()}
    rewritten: list[Call] = []
    for call in calls:
        messages = tuple(
            _replacement(message, by_identity, originals, cut_by_call) for message in call.messages
        )
        output = cut_by_call.get(call.index, call.output)
        rewritten.append(replace(call, messages=messages, output=output))
    return rewritten


def _replacement(message: dict, by_identity: dict, originals: dict, cut_by_call: dict) -> dict:
    if id(message) in by_identity:
        return by_identity[id(message)]
    if message.get("role") != "assistant":
        return message
    for index, original in originals.items():
        if message == original:
            return cut_by_call[index]
    return message


# The SmolLM2 session mode of `once replay`: a real model gets its outputs cut (the second
# bar's setting) and a KV cache sized for its longest request, unless flags say otherwise.
MODEL_ALIASES = {"smollm2": "smollm2-135m-instruct"}
DEFAULT_MAX_OUTPUT_TOKENS = 96
MIN_KV_CACHE_GIB = 0.25


def add_session_mode_arguments(parser) -> None:
    parser.add_argument(
        "--max-output-tokens",
        type=int,
        help="cut every recorded output to its first N tokens, later requests carrying the "
        f"cut text (default: {DEFAULT_MAX_OUTPUT_TOKENS} for a real model, no cut for tiny; "
        "0: no cut)",
    )
    parser.add_argument(
        "--baseline",
        type=parse_baselines,
        help="a comma list of named baselines on the same calls, same run: transformers "
        "(with manual prefix reuse), vllm (vLLM's OpenAI server, stateless Chat "
        "Completions, after once's stacks; the JSON gains vs_vllm), llamacpp (llama-server "
        "from `make llamacpp`, its OpenAI endpoint with prompt caching, f32; vs_llamacpp)",
    )


BASELINES = ("transformers", "vllm", "llamacpp")


def parse_baselines(text: str) -> list[str]:
    """`--baseline transformers,vllm,llamacpp` -> ["transformers", "vllm", "llamacpp"]."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BASELINES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"not a baseline: {', '.join(unknown) or repr(text)} (a comma list of "
            f"{', '.join(BASELINES)})"
        )
    return list(dict.fromkeys(names))


def resolve_session_mode(args, tiny: str) -> None:
    """Fill the flags the session mode decides: the model alias and the output cut."""
    args.model = MODEL_ALIASES.get(args.model, args.model)
    if args.max_output_tokens is None:
        args.max_output_tokens = 0 if args.model == tiny else DEFAULT_MAX_OUTPUT_TOKENS
    if args.max_output_tokens < 0:
        raise ValueError("--max-output-tokens must be >= 0")


def kv_cache_gib_for(model_folder, max_model_len: int) -> float:
    """Enough KV cache for one request of max_model_len tokens (+10%), at least 0.25 GiB."""
    import json
    from pathlib import Path

    config = json.loads((Path(model_folder) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    bytes_per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * 4  # K+V, fp32
    return max(MIN_KV_CACHE_GIB, round(1.1 * bytes_per_token * max_model_len / 2**30, 3))
