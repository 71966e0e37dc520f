"""Structured outputs on the tiny model (random weights, a byte vocabulary for llguidance):
masks applied, grammar completion, mixed batches, preemption, drafts, forced ids, failures.

A random model's greedy output matches no grammar by chance, so every test whose output
fullmatches its constraint fails when masks are not applied.
"""

import re

import pytest

from once.engine.async_engine import AsyncEngine
from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.grammar import GrammarCompiler
from once.engine.speculative import Draft
from once.engine.testing import byte_grammar_tokenizer
from once.protocol.engine import GenerateRequest, OutputConstraint, SamplingParams
from once.protocol.errors import InvalidRequestError

EOS = 2
PROMPT = tuple(range(40, 60))
LETTERS = OutputConstraint("regex", "[a-e]{3,12}")  # completes at 12 letters
DIGITS_THEN_BANG = OutputConstraint("lark", 'start: /[0-9]{2,6}/ "!"')


def make_engine(model_dir, **overrides) -> LLMEngine:
    config = dict(model=str(model_dir), block_size=4, num_kv_blocks=128)
    return LLMEngine(
        EngineConfig(**(config | overrides)), grammar_tokenizer=byte_grammar_tokenizer()
    )


def req(rid, constraint=None, prompt=PROMPT, **sampling) -> GenerateRequest:
    sampling = {"temperature": 0.0, "max_tokens": 24} | sampling
    return GenerateRequest(rid, tuple(prompt), SamplingParams(constraint=constraint, **sampling))


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def text_of(deltas) -> str:
    """The output's bytes, less the eos (id 2) that ends it when the model chose to stop."""
    ids = tokens_of(deltas)
    if ids and ids[-1] == EOS:
        ids = ids[:-1]
    return bytes(ids).decode("latin-1")


def test_masks_make_a_random_model_follow_a_regex(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    free = engine.generate([req("free", ignore_eos=True)])["free"]
    assert not re.fullmatch("[a-e]{3,12}", text_of(free))  # the test means something
    for seed in range(4):
        rid = f"sampled{seed}"
        out = engine.generate([req(rid, LETTERS, temperature=1.0, seed=seed)])[rid]
        assert re.fullmatch("[a-e]{3,12}", text_of(out)), text_of(out)
        assert out[-1].finish_reason == "stop"


def test_a_complete_grammar_stops_without_sampling_eos(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    out = engine.generate([req("abc", OutputConstraint("regex", "abc"))])["abc"]
    assert tokens_of(out) == list(b"abc")  # no eos appended: nothing else was allowed
    assert out[-1].finish_reason == "stop"
    assert out[-1].metrics.num_output_tokens == 3


def test_a_lark_grammar_is_followed(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    out = engine.generate([req("lark", DIGITS_THEN_BANG, temperature=1.0, seed=1)])["lark"]
    assert re.fullmatch("[0-9]{2,6}!", text_of(out)), text_of(out)


def test_free_requests_in_a_mixed_batch_are_token_identical(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    free = [req(f"free{i}", prompt=range(30 + i, 45 + i), ignore_eos=True) for i in range(3)]
    alone = {
        r.request_id: tokens_of(d)
        for r, d in zip(free, engine.generate(free).values(), strict=True)
    }
    constrained = [req("c0", LETTERS), req("c1", DIGITS_THEN_BANG, temperature=1.0, seed=3)]
    mixed = engine.generate([free[0], constrained[0], free[1], constrained[1], free[2]])
    assert {r.request_id: tokens_of(mixed[r.request_id]) for r in free} == alone
    assert re.fullmatch("[a-e]{3,12}", text_of(mixed["c0"]))
    assert re.fullmatch("[0-9]{2,6}!", text_of(mixed["c1"]))


def test_preemption_recompute_does_not_advance_the_matcher_twice(tiny_model_dir):
    # 12 blocks of 4 tokens for four 20-token prompts growing to 32: the newest requests
    # are preempted and recomputed (prompt + outputs prefilled again) mid-generation.
    constraint = OutputConstraint("regex", "[a-z]{28}")
    requests = [
        req(f"r{i}", constraint, prompt=range(30 + i, 50 + i), max_tokens=28) for i in range(4)
    ]
    roomy = make_engine(tiny_model_dir).generate(requests)
    engine = make_engine(tiny_model_dir, num_kv_blocks=12)
    states = {}
    add_request = engine.add_request

    def keep_state(request):
        add_request(request)
        states[request.request_id] = engine.requests[request.request_id]

    engine.add_request = keep_state
    tight = engine.generate(requests)
    assert engine.stats()["num_preemptions"] > 0
    for request in requests:
        rid = request.request_id
        assert tokens_of(tight[rid]) == tokens_of(roomy[rid])
        assert re.fullmatch("[a-z]{28}", text_of(tight[rid]))
        assert states[rid].grammar.num_consumed == len(states[rid].output_token_ids) == 28


class EveryoneDrafter:
    """Drafts 'aaaa' for every request it is asked about, and remembers who was asked."""

    def __init__(self):
        self.asked: set[str] = set()

    def propose(self, requests, max_tokens):
        self.asked.update(r.request_id for r in requests)
        return [Draft([ord("a")] * k) for k in max_tokens]

    def on_finished(self, request):
        pass


def test_constrained_requests_get_no_drafts(tiny_model_dir):
    baseline = make_engine(tiny_model_dir).generate(
        [req("c", LETTERS), req("free", ignore_eos=True)]
    )
    engine = make_engine(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=4)
    engine.drafter = EveryoneDrafter()
    out = engine.generate([req("c", LETTERS), req("free", ignore_eos=True)])
    assert engine.drafter.asked == {"free"}
    assert out["free"][-1].metrics.num_drafts > 0
    assert out["c"][-1].metrics.num_drafts == 0
    assert {k: tokens_of(v) for k, v in out.items()} == {
        k: tokens_of(v) for k, v in baseline.items()
    }


def test_forced_outputs_bypass_the_constraint(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    forced = (ord("Z"), ord("9"), 200)  # nothing the regex allows
    request = GenerateRequest(
        "replay", PROMPT, SamplingParams(max_tokens=8, constraint=LETTERS), forced_output_ids=forced
    )
    out = engine.generate([request])["replay"]
    assert tokens_of(out) == list(forced)
    assert engine.grammars.num_compiled == 0


def test_a_failed_matcher_fails_its_request_alone(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine.add_request(req("c", LETTERS))
    engine.add_request(req("free", ignore_eos=True))
    deltas = engine.step()  # both prefilled; each has its first id
    engine.requests["c"].grammar.matcher.consume_token(ord("Z"))  # puts it in its error state
    while engine.has_unfinished_requests():
        deltas += engine.step()
    last = {d.request_id: d for d in deltas if d.finished}
    assert last["c"].finish_reason == "error"
    assert "structured output failed" in last["c"].error["message"]
    assert last["free"].finish_reason == "length"
    assert len(tokens_of([d for d in deltas if d.request_id == "free"])) == 24


@pytest.mark.parametrize(
    "constraint",
    [
        OutputConstraint("regex", "(unclosed"),
        OutputConstraint("lark", "start: undefined_rule"),
        OutputConstraint("json_schema", '{"type": "strnig"}'),
        OutputConstraint("json_schema", '{"$ref": "#/nowhere"}'),
        OutputConstraint("json_schema", "false"),
    ],
)
def test_a_bad_constraint_is_rejected_at_admission(tiny_model_dir, constraint):
    engine = make_engine(tiny_model_dir)
    with pytest.raises(InvalidRequestError) as caught:
        engine.add_request(req("bad", constraint))
    assert caught.value.param == "constraint.text"
    assert not engine.requests and not engine.has_unfinished_requests()


async def test_the_async_engine_rejects_a_bad_constraint_before_admission(tiny_model_dir):
    engine = AsyncEngine(make_engine(tiny_model_dir))
    try:
        with pytest.raises(InvalidRequestError) as caught:
            async for _ in engine.generate(req("bad", OutputConstraint("regex", "[z-a]"))):
                pass
        assert caught.value.param == "constraint.text"
        out = [d async for d in engine.generate(req("good", LETTERS))]
        assert re.fullmatch("[a-e]{3,12}", text_of(out))
    finally:
        await engine.close()


def test_grammars_compile_once_per_distinct_constraint():
    compiler = GrammarCompiler(byte_grammar_tokenizer(), max_compiled=2)
    first = compiler.matcher(LETTERS)
    second = compiler.matcher(OutputConstraint("regex", "[a-e]{3,12}"))
    assert compiler.num_compiled == 1
    first.accept(ord("a"))  # copies advance on their own
    assert (first.num_consumed, second.num_consumed) == (1, 0)
    assert second.matcher.try_consume_tokens([ord("b")] * 12) == 12
    compiler.matcher(DIGITS_THEN_BANG)
    compiler.matcher(OutputConstraint("json_object"))  # evicts LETTERS, the least recent
    compiler.matcher(LETTERS)
    assert compiler.num_compiled == 4


def test_json_constraints_take_compact_separators():
    compiler = GrammarCompiler(byte_grammar_tokenizer())
    schema = OutputConstraint(
        "json_schema",
        '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],'
        ' "additionalProperties": false}',
    )
    assert compiler.matcher(schema).matcher.try_consume_tokens(list(b'{"n": 42}')) == 9
    assert compiler.matcher(schema).matcher.try_consume_tokens(list(b'{\n"n"')) == 1
    loose = compiler.matcher(OutputConstraint("json_object")).matcher
    assert loose.try_consume_tokens(list(b'{"a": [1, 2]}')) == 13 and loose.is_accepting()
