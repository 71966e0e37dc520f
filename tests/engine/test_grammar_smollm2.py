"""Structured outputs on the real model: sampled JSON validates, grammars and regexes
match, and free requests beside constrained ones are untouched."""

import json
import re

import jsonschema
import pytest

from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.loader import resolve_model_path
from once.model_files import load_tokenizer
from once.protocol.engine import GenerateRequest, OutputConstraint, SamplingParams
from once.protocol.errors import InvalidRequestError

pytestmark = pytest.mark.slow

NUM_SAMPLES = 6

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
SCORES = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 100},
    "minItems": 2,
    "maxItems": 5,
}
TASKS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 20},
            "done": {"type": "boolean"},
        },
        "required": ["title", "done"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 3,
}
SCHEMAS = {
    "person": (PERSON, "Describe one user of a website as JSON: name, age and role."),
    "scores": (SCORES, "Give the test scores of a few students as a JSON array."),
    "tasks": (TASKS, "List two tasks of a to-do list as JSON."),
}


@pytest.fixture(scope="module")
def smollm2():
    folder = resolve_model_path("smollm2-135m-instruct")
    config = EngineConfig(model=str(folder), kv_cache_gib=0.25, max_num_batched_tokens=512)
    return LLMEngine(config), load_tokenizer(folder)


def chat_ids(tokenizer, text) -> tuple[int, ...]:
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return tuple(ids)


def output_text(tokenizer, deltas) -> str:
    return tokenizer.decode([t for d in deltas for t in d.token_ids], skip_special_tokens=True)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_json_always_validates(smollm2, name):
    engine, tokenizer = smollm2
    schema, instruction = SCHEMAS[name]
    constraint = OutputConstraint("json_schema", json.dumps(schema))
    prompt = chat_ids(tokenizer, instruction)
    requests = [
        GenerateRequest(
            f"{name}{seed}",
            prompt,
            SamplingParams(temperature=1.0, seed=seed, max_tokens=96, constraint=constraint),
        )
        for seed in range(NUM_SAMPLES)
    ]
    out = engine.generate(requests)
    texts = set()
    for request in requests:
        deltas = out[request.request_id]
        text = output_text(tokenizer, deltas)
        assert deltas[-1].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
        texts.add(text)
    assert len(texts) > 1  # sampled, not one answer forced six times


def test_lark_and_regex_constraints_match(smollm2):
    engine, tokenizer = smollm2
    date = OutputConstraint("regex", r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])")
    rules = [
        'start: answer " because " reason "."',
        'answer: "yes" | "no"',
        "reason: /[a-z ]{3,40}/",
    ]
    verdict = OutputConstraint("lark", "\n".join(rules))
    requests = []
    for seed in range(3):
        sampling = dict(temperature=1.0, seed=seed, max_tokens=48)
        requests += [
            GenerateRequest(
                f"date{seed}",
                chat_ids(tokenizer, "When did the last Olympic games start? Answer with a date."),
                SamplingParams(constraint=date, **sampling),
            ),
            GenerateRequest(
                f"verdict{seed}",
                chat_ids(tokenizer, "Is the sky blue? Answer yes or no and say why."),
                SamplingParams(constraint=verdict, **sampling),
            ),
        ]
    out = engine.generate(requests)
    for seed in range(3):
        assert re.fullmatch(
            r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])",
            output_text(tokenizer, out[f"date{seed}"]),
        )
        text = output_text(tokenizer, out[f"verdict{seed}"])
        assert re.fullmatch(r"(yes|no) because [a-z ]{3,40}\.", text), text


def test_free_requests_beside_constrained_ones_are_token_identical(smollm2):
    engine, tokenizer = smollm2
    free = [
        GenerateRequest(
            f"free{i}",
            chat_ids(tokenizer, text),
            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        )
        for i, text in enumerate(["Name three rivers.", "What is a prime number?"])
    ]
    alone = {r.request_id: engine.generate([r])[r.request_id] for r in free}
    constraint = OutputConstraint("json_schema", json.dumps(PERSON))
    constrained = [
        GenerateRequest(
            f"json{i}",
            chat_ids(tokenizer, SCHEMAS["person"][1]),
            SamplingParams(temperature=t, seed=i, max_tokens=64, constraint=constraint),
        )
        for i, t in enumerate([0.0, 1.0])
    ]
    mixed = engine.generate([constrained[0], free[0], constrained[1], free[1]])
    for request in free:
        got = [t for d in mixed[request.request_id] for t in d.token_ids]
        want = [t for d in alone[request.request_id] for t in d.token_ids]
        assert got == want
    for request in constrained:
        jsonschema.validate(json.loads(output_text(tokenizer, mixed[request.request_id])), PERSON)


@pytest.mark.parametrize(
    "constraint",
    [
        OutputConstraint("json_schema", '{"type": "object", "properties": {"a": {"type": 7}}}'),
        OutputConstraint("json_schema", '{"type": "string", "format": "no-such-format"}'),
        OutputConstraint("lark", 'start: "a" rule_never_defined'),
        OutputConstraint("regex", "[0-9"),
    ],
)
def test_a_bad_schema_or_grammar_is_an_invalid_request(smollm2, constraint):
    engine, tokenizer = smollm2
    request = GenerateRequest(
        "bad", chat_ids(tokenizer, "hi"), SamplingParams(constraint=constraint)
    )
    with pytest.raises(InvalidRequestError) as caught:
        engine.add_request(request)
    assert caught.value.param == "constraint.text"
    assert not engine.has_unfinished_requests()
