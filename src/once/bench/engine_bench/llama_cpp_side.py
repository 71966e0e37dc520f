"""Optional peer: llama.cpp (llama-cpp-python) on the same GGUF, batch 1 only.

llama-cpp-python takes ~13.5 minutes to build here, so it is never a dependency: when it
is not importable, or the model has no GGUF, this side reports "skipped" with the reason.
One llama.cpp context holds one sequence, so only concurrency 1 and the batch-1 decode
step are measured (greedy by argmax over the last row of logits, exactly num_output).
"""

import importlib.util
import time
from pathlib import Path


def find_gguf(model: str) -> Path | None:
    from once.model_files import DEFAULT_MODEL, DEFAULT_MODEL_GGUF, DEFAULT_MODEL_MODULE

    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if model != DEFAULT_MODEL:
        return None
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_GGUF
    return path if path.is_file() else None


def measure(model: str, prompt: list[int], num_output: int, num_threads: int) -> dict:
    if importlib.util.find_spec("llama_cpp") is None:
        return {"status": "skipped", "reason": "llama_cpp is not importable"}
    gguf = find_gguf(model)
    if gguf is None:
        return {"status": "skipped", "reason": f"no GGUF file for model {model!r}"}
    try:
        return _measure(gguf, prompt, num_output, num_threads)
    except Exception as exc:  # an optional peer never fails the benchmark
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}


def _measure(gguf: Path, prompt: list[int], num_output: int, num_threads: int) -> dict:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=len(prompt) + num_output + 16,
        n_batch=512,
        n_threads=num_threads,
        verbose=False,
    )
    llm.eval(prompt[:16])  # warm-up
    llm.reset()
    step_s: list[float] = []
    started = time.perf_counter()
    llm.eval(prompt)
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    for _ in range(num_output - 1):
        t0 = time.perf_counter()
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        step_s.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - started
    return {
        "status": "ok",
        "version": getattr(llama_cpp, "__version__", "unknown"),
        "gguf": str(gguf),
        "c1_output_tok_s": num_output / elapsed,
        "decode_step_ms_b1": 1000 * sum(step_s) / len(step_s) if step_s else None,
    }
