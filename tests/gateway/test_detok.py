import random

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models

from once.engine.loader import resolve_model_path
from once.gateway.detok import IncrementalDetokenizer
from once.protocol.errors import InvalidRequestError

IM_START, IM_END = 1, 2  # SmolLM2's ChatML special tokens

FRAGMENTS = [
    "Hello", " world", ",", " naïve café", " Ærøskøbing", " Straße", " 世界", "你好，世界！",
    " 日本語のテキスト", " 😀", "👍🏽", " 👨‍👩‍👧", "🇫🇷", " 🧪🔬", "\n", "\n\n", "    ", "\t",
    "def f(x):\n    return x ** 2\n", ' {"key": [1, 2]}', " <b>bold</b>", " ü", "é", " Ω≈ç√",
    " ```python\nprint('hi')\n```", " 1234567", " ĝ", " \u200b", " ﷽", " 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> tokenizers.Tokenizer:
    folder = resolve_model_path("smollm2-135m-instruct")
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    pieces, start = [], 0
    for size in chunk_sizes:
        pieces.append(detok.push(ids[start : start + size]))
        start += size
    pieces.append(detok.push(ids[start:]))
    pieces.append(detok.flush())
    return pieces


def random_chunks(rng: random.Random, num_ids: int) -> list[int]:
    sizes = []
    while sum(sizes) < num_ids:
        sizes.append(rng.randint(0, 5))  # 0: an empty delta must be harmless too
    return sizes


def test_fixture_texts_split_characters_across_tokens(tokenizer):
    # The parity tests below are only meaningful if characters really are split.
    ids = tokenizer.encode(" 😀 世界").ids
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([token_id]) for token_id in ids]
    assert "" in pieces
    assert "".join(pieces) + detok.flush() == " 😀 世界"


def test_one_id_at_a_time_matches_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        ids = tokenizer.encode(random_text(rng)).ids
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.push([token_id]) for token_id in ids]
        assert detok.num_pending_tokens == 0  # canonical ids always end on a whole char
        pieces.append(detok.flush())
        assert "".join(pieces) == tokenizer.decode(ids)
        assert detok.num_tokens == len(ids)
        # Never emits U+FFFD for a character that later completes.
        assert "\ufffd" not in "".join(pieces)


def test_random_chunks_match_full_decode(tokenizer):
    rng = random.Random(1)
    for _ in range(200):
        ids = tokenizer.encode(random_text(rng)).ids
        detok = IncrementalDetokenizer(tokenizer)
        pieces = stream(detok, ids, random_chunks(rng, len(ids)))
        assert "".join(pieces) == tokenizer.decode(ids)
        assert detok.num_tokens == len(ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_follow_skip_flag(tokenizer, skip_special_tokens):
    rng = random.Random(2)
    for _ in range(100):
        ids = tokenizer.encode(random_text(rng)).ids
        # Special tokens anywhere, including between the bytes of one character.
        for _ in range(rng.randint(1, 3)):
            ids.insert(rng.randint(0, len(ids)), rng.choice([IM_START, IM_END]))
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        text = "".join(stream(detok, ids, random_chunks(rng, len(ids))))
        assert text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ("<|im_end|>" in text or "<|im_start|>" in text) is not skip_special_tokens


def test_eos_alone_yields_no_text_when_skipped(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(tokenizer.encode("Done.").ids) == "Done."
    assert detok.push([IM_END]) == ""
    assert detok.flush() == ""
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert kept.push([IM_END]) == "<|im_end|>"


def test_prefix_ids_give_text_in_context(tokenizer):
    rng = random.Random(3)
    for _ in range(100):
        prefix = tokenizer.encode(random_text(rng)).ids
        ids = tokenizer.encode(random_text(rng)).ids
        detok = IncrementalDetokenizer(tokenizer, prefix_ids=prefix)
        text = "".join(stream(detok, ids, random_chunks(rng, len(ids))))
        expected = tokenizer.decode(prefix + ids)[len(tokenizer.decode(prefix)) :]
        assert text == expected
        assert detok.num_tokens == len(ids)  # the prefix is context, not output


def metaspace_tokenizer() -> tokenizers.Tokenizer:
    # A SentencePiece-style decoder strips the leading space of the first token decoded.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return tokenizer


def test_prefix_ids_keep_leading_space_with_metaspace_decoder():
    tokenizer = metaspace_tokenizer()
    without_context = IncrementalDetokenizer(tokenizer)
    assert without_context.push([2]) == "world"
    in_context = IncrementalDetokenizer(tokenizer, prefix_ids=[1])
    assert in_context.push([2]) + in_context.push([1]) == " world Hello"


def test_incomplete_character_at_end_is_flushed_like_decode(tokenizer):
    ids = tokenizer.encode("ok 😀").ids
    truncated = ids[:-1]  # the output was cut (max_tokens) inside the emoji
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(truncated) == "ok"
    assert detok.num_pending_tokens > 0
    tail = detok.flush()
    assert "ok" + tail == tokenizer.decode(truncated)
    assert tail.endswith("\ufffd")
    assert detok.flush() == ""  # flushing twice does not repeat the tail


def test_generated_replacement_character_is_flushed(tokenizer):
    # A real U+FFFD looks like an incomplete character to DecodeStream, which holds it.
    ids = tokenizer.encode("a\ufffd").ids
    detok = IncrementalDetokenizer(tokenizer)
    text = detok.push(ids)
    assert text + detok.flush() == "a\ufffd"


def test_numpy_ids_are_accepted(tokenizer):
    ids = tokenizer.encode("Hello 世界").ids
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(np.array(ids, dtype=np.int64)) + detok.flush() == "Hello 世界"


@pytest.mark.parametrize("bad_id", [-1, 49152, 10**12])
def test_invalid_id_is_rejected_without_losing_state(tokenizer, bad_id):
    ids = tokenizer.encode("😀!").ids
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[:1]) == ""  # first byte of the emoji pending
    with pytest.raises(InvalidRequestError, match=str(bad_id)) as caught:
        detok.push([ids[1], bad_id])
    assert caught.value.param == "token_ids"
    assert caught.value.status == 400
    # The failed push changed nothing: the rest of the stream still decodes exactly.
    assert detok.push(ids[1:]) + detok.flush() == "😀!"
    assert detok.num_tokens == len(ids)


def test_non_integer_ids_are_rejected(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    with pytest.raises(InvalidRequestError, match="integers"):
        detok.push([1.5])
    with pytest.raises(InvalidRequestError) as caught:
        IncrementalDetokenizer(tokenizer, prefix_ids=[49152])
    assert caught.value.param == "prefix_ids"


def test_prefix_ending_inside_a_character_does_not_leak_into_output(tokenizer):
    ids = tokenizer.encode("ab 😀 c").ids  # "ab", " " + 😀's first bytes, 😀's last byte, " c"
    prompt, output = ids[:2], ids[2:]
    detok = IncrementalDetokenizer(tokenizer, prefix_ids=prompt)
    text = detok.push(output) + detok.flush()
    # The context is cut back to "ab"; the orphaned last byte decodes as U+FFFD.
    assert text == tokenizer.decode(ids[:1] + output)[len("ab") :]
    assert not text.startswith("ab")


def test_long_prefix_keeps_only_recent_context(tokenizer):
    prompt = tokenizer.encode("word " * 5000 + "end").ids
    ids = tokenizer.encode(" and 世界").ids
    detok = IncrementalDetokenizer(tokenizer, prefix_ids=prompt)
    assert len(detok._group_ids) <= 16  # the prompt is not decoded again in full
    assert detok.push(ids) + detok.flush() == " and 世界"
