"""Small C kernels for the CPU path, built on first use with the system compiler.

They are loaded with ctypes (no torch headers, so a build takes about a second) and linked
against the OpenMP runtime torch already loaded, so both share one thread pool. When no
compiler is present the engine falls back to pure-torch attention (correct, slower).
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

_SOURCES = [Path(__file__).with_name(n) for n in ("cpu_kernels.c", "prefill_attention.c", "q8_0.c")]
_HEADERS = [Path(__file__).with_name("vec16.h")]
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _build_dir() -> Path:
    root = os.environ.get("ONCE_KERNEL_CACHE") or Path.home() / ".cache" / "once" / "kernels"
    return Path(root)


def load_cpu_kernels() -> ctypes.CDLL | None:
    """The compiled CPU kernels, or None when they cannot be built here."""
    with _lock:
        if "cpu" in _loaded:
            return _loaded["cpu"]
        lib = None
        if os.environ.get("ONCE_DISABLE_KERNELS") != "1":
            try:
                lib = _compile_and_load()
            except (OSError, subprocess.SubprocessError):
                lib = None
        _loaded["cpu"] = lib
        return lib


def _run_compiler(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=120)


def _compile_and_load() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    source = b"".join(path.read_bytes() for path in _SOURCES + _HEADERS)
    flags = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
    # -march=native: the build is only valid on this CPU, so its features are in the key.
    key = source + " ".join(flags).encode() + _cpu_features().encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    target = _build_dir() / f"cpu_kernels-{digest}.so"
    if not target.exists():
        if compiler is None:
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build into a temp file and rename, so concurrent builds never load a partial .so.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            objects = [str(Path(tmp) / f"{source.stem}.o") for source in _SOURCES]
            for path, obj in zip(_SOURCES, objects, strict=True):
                _run_compiler([compiler, *flags, "-c", str(path), "-o", obj])
            # Linked without -ffast-math: linking with it adds crtfastmath.o, whose
            # constructor sets flush-to-zero for the whole process when the library loads,
            # so every float in Python (and its tests' float generators) lost subnormals.
            _run_compiler([compiler, "-shared", "-fopenmp", *objects, "-o", str(out), "-lm"])
            os.replace(out, target)
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 8 + [ctypes.c_float, ctypes.c_int]
    fn = lib.small_batch_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    fn = lib.add_rms_norm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 + [ctypes.c_float]
    fn = lib.paged_prefill_attention
    fn.restype = ctypes.c_int
    fn.argtypes = (
        [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_long, ctypes.c_float, ctypes.c_int]
    )
    fn = lib.silu_mul
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2
    fn = lib.q8_0_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
    fn = lib.q8_0_dequantize
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    fn = lib.rope_in_place
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_int]
    return lib


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        import platform

        return platform.processor() or platform.machine()
