"""Model lookup and tokenizers without torch: once.model_files."""

import json
import re
import shutil
from pathlib import Path

import pytest

from once.engine.testing import make_tiny_model
from once.model_files import (
    DEFAULT_MODEL,
    GENERIC_TOKENIZER_MODEL_TYPES,
    find_model_folder,
    load_tokenizer,
    locate_model,
)
from once.protocol.errors import ModelNotFoundError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TEXT = "Hello world!  def f(x):\n\treturn x**2 # ünïcode 你好 <|im_end|>"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("ONCE_MODEL_CACHE", str(path))
    return path


def test_a_folder_is_found_where_it_is(tmp_path):
    tiny = make_tiny_model(tmp_path / "tiny")
    assert locate_model(str(tiny)).converted
    assert find_model_folder(str(tiny)) == tiny


def test_an_unconverted_gguf_is_located_in_the_cache_but_not_found(tmp_path, cache):
    gguf = tmp_path / "Some-Model.gguf"
    gguf.write_bytes(b"GGUF")
    location = locate_model(str(gguf))
    assert (location.converted, location.gguf) == (False, gguf)
    assert location.folder.parent == cache and location.folder.name.startswith("some-model-")
    hint = re.escape(f"`once model path {gguf}` converts it")
    with pytest.raises(ModelNotFoundError, match=hint):
        find_model_folder(str(gguf))
    assert not cache.exists()  # looking never writes


def test_the_default_model_names_the_pull_command_until_pulled(cache):
    with pytest.raises(ModelNotFoundError, match="`once model pull`"):
        find_model_folder(DEFAULT_MODEL)
    make_tiny_model(cache / DEFAULT_MODEL)
    assert find_model_folder(DEFAULT_MODEL) == cache / DEFAULT_MODEL


def test_unknown_names_and_folders_without_config(tmp_path, cache):
    with pytest.raises(ModelNotFoundError, match="not a known name"):
        locate_model("no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        find_model_folder(str(tmp_path / "empty"))


@pytest.fixture(scope="module")
def default_folder() -> Path:
    from once.engine.loader import resolve_model_path

    return resolve_model_path(DEFAULT_MODEL)  # converts (~25 s) only if the cache lacks it


def tokenizer_folder(default_folder: Path, root: Path, model_type: str) -> Path:
    """The default model's tokenizer files under a config.json of another model type."""
    folder = root / model_type
    folder.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(default_folder / name, folder / name)
    config = json.loads((default_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(GENERIC_TOKENIZER_MODEL_TYPES | {"qwen2"}))
def test_load_tokenizer_picks_the_class_autotokenizer_picks(default_folder, tmp_path, model_type):
    from transformers import AutoTokenizer

    folder = tokenizer_folder(default_folder, tmp_path, model_type)
    ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto)
    assert ours.encode(TEXT) == auto.encode(TEXT)
    assert ours.eos_token_id == auto.eos_token_id
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(
        messages, tokenize=False
    )
