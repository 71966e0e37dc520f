"""llama.cpp's `llama-server` on loopback, the CPU peer: its build, its GGUF files, its process.

    files = gguf_files(model_folder)          # {"f32": ..., "q8_0": ..., "q4_1": ...}
    spec = LlamaServerSpec(files["f32"], threads=2, ctx_size=8192, parallel=1)
    with llama_servers([spec]) as (server,):
        server.url                             # /completion, /v1/chat/completions, /metrics

`make llamacpp` builds llama-server and llama-quantize into `.llamacpp` beside the
virtualenv once runs from (another folder is named by `ONCE_LLAMACPP_HOME`), from the
llama.cpp tree that llama-cpp-python's source package vendors: PyPI has no wheel of
either, and Debian has no llama.cpp package.

The GGUF files of a model folder, made once and kept in `<folder>/gguf/`:
- `f32`: the folder's own weights, written by llama.cpp's `convert_hf_to_gguf.py` at
  fp32: the same numbers once's engine runs (the default model's folder is itself the
  fp32 dequantization of the shipped Q4_1 file), so this row compares like with like;
- `q8_0`: that file quantized by `llama-quantize`, llama.cpp's usual 8-bit setting;
- `q4_1`: the default model's shipped file as it is (another model has none).

A server is started as llama.cpp's users run it, with what a fair comparison needs said
explicitly: `-t`/`-tb` threads as once's engine, `--parallel` slots sharing one unified
KV cache of `--ctx-size` tokens (continuous batching is its default), K/V kept at the
precision of the row (f32 for the f32 file, llama.cpp's default f16 otherwise), prompt
caching on (its default per request), metrics on. Processes are spawned, watched and
reaped as vLLM's are (processes.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from once.fleet.processes import read_tail, spawn, stop_processes, wait_all_healthy
from once.fleet.vllm_server import free_port

STARTUP_TIMEOUT_S = 600.0  # a hang guard: llama-server loads a 540 MB file in seconds
STOP_TIMEOUT_S = 20.0
F32, Q8_0, Q4_1 = "f32", "q8_0", "q4_1"
PRECISIONS = (F32, Q8_0, Q4_1)


class LlamaCppUnavailableError(RuntimeError):
    """llama.cpp is not built: `make llamacpp` builds it."""


def llamacpp_home() -> Path:
    named = os.environ.get("ONCE_LLAMACPP_HOME")
    if named:
        return Path(named)
    return Path(sys.prefix).parent / ".llamacpp"


def llamacpp_binary(name: str) -> Path:
    return llamacpp_home() / "build" / "bin" / name


def llamacpp_missing_reason() -> str | None:
    for name in ("llama-server", "llama-quantize"):
        if not llamacpp_binary(name).exists():
            return (
                f"llama.cpp is not built ({llamacpp_binary(name)} is missing): run `make llamacpp`"
            )
    return None


def llamacpp_version() -> str:
    result = subprocess.run(
        [str(llamacpp_binary("llama-server")), "--version"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    lines = (result.stdout + result.stderr).strip().splitlines()
    return next((line for line in lines if line.startswith("version")), "unknown")


def gguf_files(model_folder: Path, precisions: Sequence[str] = PRECISIONS) -> dict[str, Path]:
    """The folder's GGUF file per precision asked for, made where missing (see above);
    a precision the model has no file for (q4_1 of another model) is left out."""
    reason = llamacpp_missing_reason()
    if reason:
        raise LlamaCppUnavailableError(reason)
    folder = Path(model_folder)
    out = folder / "gguf"
    out.mkdir(exist_ok=True)
    files: dict[str, Path] = {}
    f32 = out / "model-f32.gguf"
    if {F32, Q8_0} & set(precisions) and not f32.exists():
        _convert_to_f32(folder, f32)
    if F32 in precisions:
        files[F32] = f32
    if Q8_0 in precisions:
        q8 = out / "model-q8_0.gguf"
        if not q8.exists():
            _run([str(llamacpp_binary("llama-quantize")), str(f32), str(q8) + ".part", "Q8_0"])
            (Path(str(q8) + ".part")).rename(q8)
        files[Q8_0] = q8
    shipped = _shipped_q4_1(folder)
    if Q4_1 in precisions and shipped is not None:
        files[Q4_1] = shipped
    return files


def _convert_to_f32(folder: Path, target: Path) -> None:
    tree = llamacpp_home() / "llama.cpp"
    part = target.with_suffix(".part")
    env = os.environ | {"PYTHONPATH": str(tree / "gguf-py")}
    _run(
        [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(folder),
         "--outtype", "f32", "--outfile", str(part)],
        env=env,
    )  # fmt: skip
    part.rename(target)


def _shipped_q4_1(folder: Path) -> Path | None:
    """The default model's own GGUF (its folder is made from it); None for other models."""
    from once.model_files import DEFAULT_MODEL, default_model_gguf, model_cache_dir
    from once.protocol.errors import ModelLoadError

    if folder.resolve() != (model_cache_dir() / DEFAULT_MODEL).resolve():
        return None
    try:
        return default_model_gguf()
    except ModelLoadError:
        return None


def _run(command: list[str], env: dict[str, str] | None = None) -> None:
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr)[-3000:]
        raise RuntimeError(f"{Path(command[1]).name} failed ({result.returncode}):\n{tail}")


@dataclass(frozen=True)
class LlamaServerSpec:
    gguf: Path
    threads: int = 0  # 0: this machine's cores
    ctx_size: int = 4096  # the KV cache, in tokens, shared by all slots
    parallel: int = 1  # slots: requests decoded together
    kv_type: str = "f16"  # the K/V cache's type; "f32" for the f32 row
    batch_size: int = 512  # logical and physical batch: prompt tokens per forward
    extra_args: tuple[str, ...] = ()


@dataclass
class LlamaServer:
    spec: LlamaServerSpec
    name: str
    port: int
    folder: Path
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.url}/health"

    @property
    def log_path(self) -> Path:
        return self.folder / "llama-server.log"

    def command(self) -> list[str]:
        spec = self.spec
        threads = str(spec.threads or len(os.sched_getaffinity(0)))
        return [
            str(llamacpp_binary("llama-server")), "-m", str(spec.gguf),
            "--host", "127.0.0.1", "--port", str(self.port),
            "-t", threads, "-tb", threads,
            "--ctx-size", str(spec.ctx_size), "--parallel", str(spec.parallel),
            "--kv-unified",  # one cache for every slot: any slot may hold a long prompt
            "-ctk", spec.kv_type, "-ctv", spec.kv_type,
            "-b", str(spec.batch_size), "-ub", str(spec.batch_size),
            "--metrics", "--no-webui",
            *spec.extra_args,
        ]  # fmt: skip

    def start(self) -> None:
        self.process = spawn(self.command(), self.log_path, "start")

    def log_tail(self) -> str:
        return read_tail(self.log_path)


@contextlib.contextmanager
def _started(specs: Sequence[LlamaServerSpec]) -> Iterator[list[LlamaServer]]:
    """One llama-server per spec on loopback, started (not yet healthy); stopped together
    at the end, their logs in a temporary folder."""
    reason = llamacpp_missing_reason()
    if reason:
        raise LlamaCppUnavailableError(reason)
    with tempfile.TemporaryDirectory(prefix="llama-server-") as tmp:
        servers = []
        for i, spec in enumerate(specs):
            folder = Path(tmp) / f"llama-server-{i}"
            folder.mkdir()
            servers.append(LlamaServer(spec, folder.name, free_port(), folder))
        try:
            for server in servers:
                server.start()
            yield servers
        finally:
            stop_processes([server.process for server in servers], STOP_TIMEOUT_S)


@contextlib.contextmanager
def llama_servers(
    specs: Sequence[LlamaServerSpec], *, startup_timeout_s: float = STARTUP_TIMEOUT_S
) -> Iterator[list[LlamaServer]]:
    """The servers of `specs`, yielded once each answers /health (200 once its model is
    loaded)."""
    with _started(specs) as servers:
        wait_all_healthy(servers, startup_timeout_s)
        yield servers


@contextlib.asynccontextmanager
async def start_llama_servers(
    specs: Sequence[LlamaServerSpec], *, startup_timeout_s: float = STARTUP_TIMEOUT_S
) -> AsyncIterator[list[LlamaServer]]:
    """`llama_servers` for asyncio: started on the loop's thread (a server gets SIGTERM when
    the thread that forked it ends), waited for off it. Stopping blocks the loop: SIGTERM
    ends llama-server at once."""
    with _started(specs) as servers:
        await asyncio.to_thread(wait_all_healthy, servers, startup_timeout_s)
        yield servers
