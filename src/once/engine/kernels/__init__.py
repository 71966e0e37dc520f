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

_SOURCE = Path(__file__).with_name("paged_decode.c")
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _build_dir() -> Path:
    root = os.environ.get("ONCE_KERNEL_CACHE") or Path.home() / ".cache" / "once" / "kernels"
    return Path(root)


def load_paged_decode() -> ctypes.CDLL | None:
    """The compiled paged decode kernel, or None when it cannot be built here."""
    with _lock:
        if "paged_decode" in _loaded:
            return _loaded["paged_decode"]
        lib = None
        if os.environ.get("ONCE_DISABLE_KERNELS") != "1":
            try:
                lib = _compile_and_load()
            except (OSError, subprocess.SubprocessError):
                lib = None
        _loaded["paged_decode"] = lib
        return lib


def _compile_and_load() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    source = _SOURCE.read_bytes()
    flags = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target = _build_dir() / f"paged_decode-{digest}.so"
    if not target.exists():
        if compiler is None:
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build into a temp file and rename, so concurrent builds never load a partial .so.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            subprocess.run(
                [compiler, *flags, str(_SOURCE), "-o", str(out), "-lm"],
                check=True,
                capture_output=True,
                timeout=120,
            )
            os.replace(out, target)
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int]
    return lib
