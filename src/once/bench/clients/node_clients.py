"""Codex CLI and Claude Code, the real binaries from npm, run against a gateway.

Both are installed by the project's set-up into `clients/node_modules` (clients/
package.json pins the versions). Each run gets its own home folder (Codex's CODEX_HOME,
Claude Code's CLAUDE_CONFIG_DIR) under ~/.cache/once/client-homes: Codex refuses to set
up its sandbox helpers under a temporary folder. Nothing reaches the internet: Codex is
pointed at the gateway as a custom model provider, Claude Code by ANTHROPIC_BASE_URL with
its nonessential traffic off.
"""

import asyncio
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[4]
NODE_BIN = Path(os.environ.get("ONCE_CLIENTS_DIR", REPO_ROOT / "clients")) / "node_modules" / ".bin"
HOMES = Path.home() / ".cache" / "once" / "client-homes"
API_KEY = "sk-once-client-test"


@dataclass
class ClientRun:
    returncode: int | None  # None: it ran past its time limit and was killed
    stdout: str
    stderr: str
    seconds: float
    config: str = ""  # the configuration it ran with (Codex's config.toml)
    extra: dict = field(default_factory=dict)

    def first_error(self) -> str | None:
        """The first line the client printed as an error, verbatim."""
        for line in (self.stderr + "\n" + self.stdout).splitlines():
            if "ERROR" in line or "error" in line.lower().split(":")[0]:
                return line.strip()
        if self.returncode != 0:
            tail = (self.stderr or self.stdout).strip().splitlines()
            return tail[-1] if tail else f"exit status {self.returncode}"
        return None


def binary(name: str) -> Path:
    path = NODE_BIN / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make clients` (npm install in clients/)")
    return path


async def _run(command: list[str], cwd: Path, env: dict, timeout_s: float) -> ClientRun:
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        *command,
        cwd=cwd,
        env={**os.environ, **env},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout_s)
        code: int | None = process.returncode
    except TimeoutError:
        process.kill()
        out, err = await process.communicate()
        code = None
    elapsed = time.perf_counter() - started
    return ClientRun(code, out.decode(errors="replace"), err.decode(errors="replace"), elapsed)


def _home() -> Path:
    HOMES.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=HOMES))


def codex_config(
    base_url: str,
    *,
    websocket: bool = False,
    model: str | None = None,
    mcp_command: list[str] | None = None,
    provider_options: dict[str, int] | None = None,
) -> str:
    """Codex's config.toml: its defaults, with once as the model provider (plus
    `provider_options`, e.g. `stream_idle_timeout_ms`)."""
    lines = [f'model = "{model}"'] if model else []
    lines += [
        'model_provider = "once"',
        "",
        "[model_providers.once]",
        'name = "once"',
        f'base_url = "{base_url}/v1"',
        'wire_api = "responses"',
        'env_key = "ONCE_API_KEY"',
    ]
    if websocket:
        lines.append("supports_websockets = true")
    lines += [f"{key} = {value}" for key, value in (provider_options or {}).items()]
    if mcp_command:
        command, *args = mcp_command
        quoted = ", ".join(f'"{a}"' for a in args)
        # `required`: Codex waits for the server's start before the first turn (else a
        # server still starting, as on a loaded machine, has its tools deferred and the
        # turn's program finds no such function); a generous start-up bound for the same.
        lines += [
            "",
            "[mcp_servers.time]",
            f'command = "{command}"',
            f"args = [{quoted}]",
            "required = true",
            "startup_timeout_sec = 120",
        ]
    return "\n".join(lines) + "\n"


async def run_codex(
    base_url: str,
    workspace: Path,
    prompt: str,
    *,
    websocket: bool = False,
    model: str | None = None,
    mcp_command: list[str] | None = None,
    timeout_s: float = 180,
    provider_options: dict[str, int] | None = None,
) -> ClientRun:
    home = _home()
    config = codex_config(
        base_url,
        websocket=websocket,
        model=model,
        mcp_command=mcp_command,
        provider_options=provider_options,
    )
    (home / "config.toml").write_text(config)
    env = {"CODEX_HOME": str(home), "ONCE_API_KEY": API_KEY}
    command = [str(binary("codex")), "exec", "--skip-git-repo-check", prompt]
    try:
        run = await _run(command, workspace, env, timeout_s)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    run.config = config
    return run


async def run_claude_code(
    base_url: str, workspace: Path, prompt: str, *, model: str | None = None, timeout_s: float = 180
) -> ClientRun:
    home = _home()
    env = {
        "CLAUDE_CONFIG_DIR": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": API_KEY,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    command = [str(binary("claude")), "-p", prompt, "--output-format", "json"]
    if model:
        command += ["--model", model]
    try:
        return await _run(command, workspace, env, timeout_s)
    finally:
        shutil.rmtree(home, ignore_errors=True)
