import copy
import random

import pytest

from once.agent.doctor import (
    HISTORY_EDITED,
    HISTORY_TRUNCATED,
    INSTRUCTIONS_CHANGED,
    MODEL_OR_PARAMS_CHANGED,
    OUTPUT_NOT_APPENDED,
    ROLE_SWITCH,
    TOOLS_CHANGED,
    CacheDoctor,
)
from once.agent.prefix import common_prefix_len, serialize_request
from once.bench.traces import CODER, MINI_SWE_AGENT, SWEAGENT_1_0, default_traces_dir

TOOLS = [
    {
        "type": "function",
        "name": name,
        "description": f"the {name} tool",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        "strict": False,
    }
    for name in ("apply_patch", "shell", "tool_search")
]
INSTRUCTIONS = "You are a coding agent. Approval policy: on-request."


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def assistant(text: str) -> dict:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def call(call_id: str, cmd: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "shell", "arguments": cmd}


def result(call_id: str, output: str) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


# Three calls of an append-only session: each request is the previous one + its output +
# new items. OUTPUTS[k] is what call k returned.
OUTPUTS = [[call("c1", "ls")], [call("c2", "cat a.py")], [assistant("the bug is in a.py")]]
REQUEST_0 = {
    "model": "m",
    "instructions": INSTRUCTIONS,
    "tools": TOOLS,
    "input": [user("fix the bug in a.py")],
}
REQUEST_1 = {**REQUEST_0, "input": REQUEST_0["input"] + OUTPUTS[0] + [result("c1", "a.py\nb.py")]}
REQUEST_2 = {
    **REQUEST_1,
    "input": REQUEST_1["input"] + OUTPUTS[1] + [result("c2", "def f():\n    return 1\n")],
}
REQUEST_3 = {**REQUEST_2, "input": REQUEST_2["input"] + OUTPUTS[2] + [user("now fix it")]}
SESSION = [REQUEST_0, REQUEST_1, REQUEST_2, REQUEST_3]


def doctor_before_last() -> CacheDoctor:
    doctor = CacheDoctor()
    for request, output in zip(SESSION[:-1], OUTPUTS, strict=True):
        assert doctor.observe(request) is None
        doctor.record_output(output)
    return doctor


def diagnose(mutate):
    # The last request of SESSION, mutated once; the expected byte offset is where the
    # canonical texts of the clean and the mutated request first differ.
    mutated = copy.deepcopy(REQUEST_3)
    mutate(mutated)
    brk = doctor_before_last().observe(mutated)
    expected_offset = common_prefix_len(
        serialize_request(REQUEST_3).encode(), serialize_request(mutated).encode()
    )
    assert brk is not None and brk.call_index == 3
    assert brk.byte_offset == expected_offset
    return brk, serialize_request(mutated).encode()


# --- no break ---


def test_append_only_continuation_reports_no_break():
    doctor = doctor_before_last()
    assert doctor.observe(REQUEST_3) is None
    assert doctor.breaks == [] and len(doctor.calls) == 4


def test_a_history_list_appended_in_place_is_still_append_only():
    # The harness keeps one list and appends to it: the doctor must not see its own
    # copy of the previous request grow.
    history = [user("fix the bug")]
    doctor = CacheDoctor()
    for k in range(4):
        request = {"model": "m", "instructions": INSTRUCTIONS, "input": history}
        assert doctor.observe(request) is None
        output = [call(f"c{k}", "ls")]
        doctor.record_output(output)
        history += output + [result(f"c{k}", "ok")]


def test_without_a_recorded_output_any_suffix_continues():
    doctor = CacheDoctor()
    doctor.observe(REQUEST_0)
    assert doctor.observe(REQUEST_1) is None


# --- each cause, with its exact item and byte offset ---


def test_tools_reordered():
    brk, text = diagnose(lambda r: r.__setitem__("tools", [TOOLS[1], TOOLS[0], TOOLS[2]]))
    assert (brk.cause, brk.item) == (TOOLS_CHANGED, "tools[0]")
    assert "order only" in brk.detail and "'shell', was 'apply_patch'" in brk.detail
    # the offset lands inside tools[0]'s name, where "apply_patch" and "shell" part
    assert text[brk.byte_offset : brk.byte_offset + 5] == b"shell"


def test_tool_content_changed_names_the_tool_and_field():
    def mutate(request):
        request["tools"][2]["description"] = "search the catalog"

    brk, _ = diagnose(mutate)
    assert (brk.cause, brk.item) == (TOOLS_CHANGED, "tools[2]")
    assert "content of 'tool_search' changed (description)" in brk.detail


def test_tool_added_and_removed():
    extra = {**TOOLS[0], "name": "zz_new"}
    brk, _ = diagnose(lambda r: r["tools"].append(extra))
    assert (brk.cause, brk.item, brk.detail) == (TOOLS_CHANGED, "tools[3]", "added 'zz_new'")
    brk, _ = diagnose(lambda r: r["tools"].pop(1))
    assert (brk.cause, brk.item) == (TOOLS_CHANGED, "tools[1]")
    assert "removed 'shell'" in brk.detail


def test_timestamp_in_instructions():
    def mutate(request):
        request["instructions"] = INSTRUCTIONS.replace(". ", ". Time: 2026-11-05T10:42:17Z. ", 1)

    brk, text = diagnose(mutate)
    assert (brk.cause, brk.item) == (INSTRUCTIONS_CHANGED, "instructions")
    assert "iso_date '2026-11-05'" in brk.detail
    assert text[brk.byte_offset :].startswith(b"Time: 2026")


def test_changed_policy_text_in_instructions():
    brk, text = diagnose(lambda r: r.__setitem__("instructions", INSTRUCTIONS.replace("on-", "")))
    assert (brk.cause, brk.item) == (INSTRUCTIONS_CHANGED, "instructions")
    assert text[brk.byte_offset :].startswith(b"request.")


def test_model_changed():
    brk, _ = diagnose(lambda r: r.__setitem__("model", "m2"))
    assert (brk.cause, brk.item, brk.detail) == (
        MODEL_OR_PARAMS_CHANGED,
        "model",
        "model: 'm' -> 'm2'",
    )


def test_sampling_param_added():
    brk, _ = diagnose(lambda r: r.__setitem__("temperature", 0.5))
    assert (brk.cause, brk.item) == (MODEL_OR_PARAMS_CHANGED, "temperature")
    assert brk.detail == "temperature: (absent) -> 0.5"


def test_earlier_tool_output_replaced():
    brk, text = diagnose(lambda r: r["input"][2].__setitem__("output", "a.py\nc.py"))
    assert (brk.cause, brk.item) == (HISTORY_EDITED, "input[2]")
    assert "tool output replaced" in brk.detail
    assert text[brk.byte_offset :].startswith(b'c.py"')


def test_earlier_output_elided_like_swe_agent():
    elided = "Old environment output: (2 lines omitted)"
    brk, _ = diagnose(lambda r: r["input"][4].__setitem__("output", elided))
    assert (brk.cause, brk.item) == (HISTORY_EDITED, "input[4]")
    assert "elided" in brk.detail and "(2 lines omitted)" in brk.detail


def test_earlier_item_edited_in_place_is_caught():
    # The harness edits an item dict the doctor has already seen: its digest was taken
    # when the request was observed, so the edit still shows.
    first = user("fix the bug in a.py")
    doctor = CacheDoctor()
    doctor.observe({"model": "m", "input": [first]})
    doctor.record_output(OUTPUTS[0])
    first["content"] = "fix the bug in b.py"
    brk = doctor.observe({"model": "m", "input": [first, *OUTPUTS[0], result("c1", "ok")]})
    assert (brk.cause, brk.item) == (HISTORY_EDITED, "input[0]")
    assert "user message edited at character 15: 'fix the bug in a.py' -> " in brk.detail


def test_earlier_items_dropped():
    brk, text = diagnose(lambda r: r["input"].__delitem__(slice(1, 3)))
    assert (brk.cause, brk.item) == (HISTORY_TRUNCATED, "input[1]")
    assert "input[1..2] (2 items) dropped" in brk.detail


def test_history_cut_short():
    brk, _ = diagnose(lambda r: r.__setitem__("input", r["input"][:2]))
    assert (brk.cause, brk.item) == (HISTORY_TRUNCATED, "input[2]")


def test_previous_output_dropped():
    # REQUEST_2 had 5 items; call 2's output belongs at input[5]
    brk, _ = diagnose(lambda r: r["input"].pop(5))
    assert (brk.cause, brk.item) == (OUTPUT_NOT_APPENDED, "input[5]")
    assert "output item 0 of the previous response (assistant message) is missing" in brk.detail


def test_previous_output_appended_without_its_id():
    brk, _ = diagnose(lambda r: r["input"][5].pop("id"))
    assert (brk.cause, brk.item) == (OUTPUT_NOT_APPENDED, "input[5]")
    assert brk.detail.endswith("appended without id")


def test_a_different_conversation_is_a_role_switch():
    brk, _ = diagnose(lambda r: r.__setitem__("input", [user("write the release notes")]))
    assert (brk.cause, brk.item) == (ROLE_SWITCH, "input[0]")
    assert "a new conversation" in brk.detail


def test_role_switch_and_back_names_the_earlier_conversation():
    manager = {"model": "m", "instructions": "You manage.", "input": [user("plan the fix")]}
    programmer = {"model": "m", "instructions": "You program.", "input": [user("edit a.py")]}
    doctor = CacheDoctor()
    doctor.observe(manager)
    doctor.record_output([assistant("ask the programmer")])
    brk = doctor.observe(programmer)
    assert (brk.cause, brk.item) == (ROLE_SWITCH, "instructions")
    assert "instructions and input[0] differ" in brk.detail
    doctor.record_output([assistant("done")])
    back = {**manager, "input": manager["input"] + [assistant("ask the programmer"), user("ok")]}
    brk = doctor.observe(back)
    assert brk.cause == ROLE_SWITCH and "back to the conversation of call 0" in brk.detail
    # the manager's prefix is still reusable although the previous call was the programmer's
    assert doctor.calls[-1].expected_cached_bytes > 0.8 * doctor.calls[-1].prompt_bytes


def test_a_small_edit_of_a_lone_first_item_is_an_edit_not_a_switch():
    doctor = CacheDoctor()
    doctor.observe(REQUEST_0)
    brk = doctor.observe({**REQUEST_0, "input": [user("fix the bug in a.py!")]})
    assert (brk.cause, brk.item) == (HISTORY_EDITED, "input[0]")


# --- cached tokens ---


def test_expected_and_actual_cache_hits_and_unexplained_misses():
    doctor = CacheDoctor()
    for request, output, cached in zip(SESSION, OUTPUTS + [[]], (0, 90, 0, 95), strict=True):
        doctor.observe(request)
        doctor.record_output(output)
        doctor.record_usage(
            {"input_tokens": 100, "input_tokens_details": {"cached_tokens": cached}}
        )
    first, _, third, _ = doctor.calls
    assert first.expected_hit == 0 and first.actual_hit == 0
    assert third.expected_hit > 0.5 and third.actual_hit == 0
    assert [c.index for c in doctor.unexplained_misses()] == [2]
    report = doctor.report()
    assert "4 calls, 0 prefix breaks" in report and "call 2: expected" in report


def test_expected_hit_counts_bytes_up_to_the_break():
    doctor = doctor_before_last()
    mutated = copy.deepcopy(REQUEST_3)
    mutated["input"][4]["output"] = "changed"
    brk = doctor.observe(mutated)
    record = doctor.calls[-1]
    # the shared prompt bytes end inside input[4], well before the end of the prompt
    assert 0 < record.expected_cached_bytes < record.prompt_bytes
    assert record.brk is brk


def test_chat_completions_usage_is_read_too():
    doctor = CacheDoctor()
    doctor.observe(REQUEST_0)
    doctor.record_usage({"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 10}})
    assert doctor.calls[0].actual_hit == 0.25


def test_report_lists_each_break_with_cause_item_and_byte():
    doctor = doctor_before_last()
    doctor.observe({**REQUEST_3, "model": "m2"})
    report = doctor.report()
    assert "1 prefix breaks (model_or_params_changed 1)" in report
    assert "call 3: model_or_params_changed at model, byte " in report


# --- bad input ---


def test_bad_requests_and_records_are_refused():
    doctor = CacheDoctor()
    with pytest.raises(ValueError, match="record_usage before"):
        doctor.record_usage({"input_tokens": 1})
    with pytest.raises(ValueError, match="record_output before"):
        doctor.record_output([])
    with pytest.raises(ValueError, match="dict"):
        doctor.observe("hello")
    with pytest.raises(ValueError, match="full request"):
        doctor.observe({"model": "m", "previous_response_id": "resp_1", "input": []})
    with pytest.raises(ValueError, match="input"):
        doctor.observe({"model": "m", "input": [1, 2]})
    doctor.observe({"model": "m", "input": "hello"})  # a string input is one user message
    with pytest.raises(ValueError, match="integer"):
        doctor.record_usage({"input_tokens": "many"})
    with pytest.raises(ValueError, match="list of dicts"):
        doctor.record_output({"type": "message"})
    assert doctor.observe({"model": "m", "input": [user("hello"), user("more")]}) is None


# --- the bench, on real sessions ---


def _one_session(source: str):
    from once.bench.traces import load_sessions

    root = default_traces_dir()
    if not root.is_dir():
        pytest.skip(f"no agent traces at {root} (set ONCE_SHARED_DATA)")
    return next(s for s in load_sessions(root, source=source) if len(s.calls) >= 8)


def test_bench_on_a_real_coder_session_explains_every_role_switch():
    from once.bench.agent_bench.doctor import coder_breaks, real_breaks

    session = _one_session(CODER)
    expected = coder_breaks(session)
    assert expected and all(cause == ROLE_SWITCH for cause, _ in expected.values())
    counts = real_breaks(session, expected)
    assert counts["real_breaks"] == counts["reported_breaks"] == len(expected)
    assert counts["unexplained"] == 0
    # the comparison is not vacuous: with no real breaks declared, each report is spurious
    assert real_breaks(session, {})["spurious"] == len(expected)


def test_bench_on_a_real_lm32b_session_explains_every_elision():
    from once.bench.agent_bench.doctor import elision_breaks, real_breaks

    session = _one_session(SWEAGENT_1_0)
    expected = elision_breaks(session)
    assert expected and all(cause == HISTORY_EDITED for cause, _ in expected.values())
    assert real_breaks(session, expected)["unexplained"] == 0
    shifted = {call: (cause, "input[0]") for call, (cause, _) in expected.items()}
    assert real_breaks(session, shifted)["wrong_cause_or_item"] == len(expected)


def test_bench_run_on_one_session_per_source_has_no_unexplained_break():
    from once.bench.agent_bench.doctor import run

    _one_session(MINI_SWE_AGENT)
    result = run(max_sessions=1)
    assert result["cache_doctor_unexplained_breaks"] == 0
    assert result["injected_cases"] >= 27 and result["injected_failed"] == 0
    assert result["real"]["coder"]["real_breaks"] > 0
    assert result["real"]["sweagent_lm_32b"]["real_breaks"] > 0


def test_random_single_edits_are_placed_exactly():
    # One character changed anywhere in what the last request repeats: the doctor names the part
    # that holds it and the byte where the canonical texts part.
    rng = random.Random(7)
    targets = [("instructions", None)] + [("tools", i) for i in range(3)]
    # the last item is new in this call: editing it breaks nothing
    targets += [("input", i) for i in range(len(REQUEST_3["input"]) - 1)]
    for _ in range(60):
        section, i = rng.choice(targets)
        mutated = copy.deepcopy(REQUEST_3)
        if section == "instructions":
            mutated["instructions"] = _flip(rng, mutated["instructions"])
            item = "instructions"
        else:
            holder = mutated[section][i]
            key = rng.choice([k for k, v in holder.items() if isinstance(v, str) and v])
            holder[key] = _flip(rng, holder[key])
            item = f"{section}[{i}]"
        brk = doctor_before_last().observe(mutated)
        expected_offset = common_prefix_len(
            serialize_request(REQUEST_3).encode(), serialize_request(mutated).encode()
        )
        assert (brk.item, brk.byte_offset) == (item, expected_offset)


def _flip(rng: random.Random, text: str) -> str:
    at = rng.randrange(len(text))
    return text[:at] + ("#" if text[at] != "#" else "%") + text[at + 1 :]
