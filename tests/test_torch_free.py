"""Only the engine imports torch: the layers above it start without it.

Each check runs in a fresh interpreter (an import in this test process would already
have loaded torch through the engine tests), then looks at `sys.modules`.
"""

import subprocess
import sys
import textwrap

import pytest

from once.model_files import DEFAULT_MODEL

TORCH_FREE_MODULES = [
    "once.agent.session",
    "once.router.router",
    "once.model_files",
    "once.engine_http.client",  # the remote engine's client, which `once serve` uses
    "once.gateway.app",
    "once.tool_search",  # the harness's and the gateway's tool search; embedders come in
]
PROTOCOL_MODULES = ["engine", "errors", "kv_blocks", "responses"]


def run_fresh(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:  # not an AssertionError: the xfail below expects only those
        raise RuntimeError(done.stderr[-3000:])
    return done.stdout.strip().splitlines()[-1]


def torch_after(code: str) -> bool:
    code = textwrap.dedent(code) + "\nimport sys\nprint('torch' in sys.modules)\n"
    return run_fresh(code) == "True"


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_importing_does_not_load_torch(module):
    assert not torch_after(f"import {module}")


def test_protocol_imports_nothing_else_from_once():
    imports = "\n".join(f"import once.protocol.{name}" for name in PROTOCOL_MODULES)
    loaded = run_fresh(
        imports + "\nimport sys\n"
        "print(sorted(m for m in sys.modules if m.startswith('once.')"
        " and not m.startswith('once.protocol')))\n"
    )
    assert loaded == "[]"
    assert not torch_after(imports)


@pytest.fixture(scope="module")
def default_model_converted():
    from once.engine.loader import resolve_model_path

    resolve_model_path(DEFAULT_MODEL)  # the gateway reads its tokenizer from the folder


@pytest.mark.slow
def test_the_default_tokenizer_loads_without_torch(default_model_converted):
    assert not torch_after(
        f"""
        from once.model_files import find_model_folder, load_tokenizer
        tokenizer = load_tokenizer(find_model_folder({DEFAULT_MODEL!r}))
        assert tokenizer.encode("hello") and tokenizer.apply_chat_template(
            [{{"role": "user", "content": "hi"}}], tokenize=False
        )
        """
    )


@pytest.mark.slow
def test_serve_with_a_remote_engine_starts_without_torch(default_model_converted):
    # `once serve` itself, all of its setup, with the server's run loop left out: nothing
    # listens, so nothing can race or collide. The engine URL is never dialled at setup.
    assert not torch_after(
        """
        import uvicorn
        uvicorn.run = lambda app, **options: None
        from once.cli import main
        argv = ["serve", "--engine-url", "http://127.0.0.1:9", "--no-safety", "--store", "memory"]
        assert main(argv) == 0
        """
    )
