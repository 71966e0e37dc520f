"""A whole `codex exec` on the real model (`codex_exec_real_model`).

Codex CLI with its default configuration (its default model, which the gateway's aliases
map to SmolLM2) and one MCP server (`mcp-server-time`) runs one task against the gateway
in front of the in-process engine, sampling: no scripted replies. Codex's first prompt is
about 14k tokens (its instructions and tool list), past SmolLM2's 8,192 trained
positions, so the engine runs with a 32k window (RoPE past its training length: the
model's answers are poor there, which is not what this measures), and replies that set
no budget (Codex sets none) are capped at 256 tokens by the gateway's
`default_max_output_tokens`. The figure is what
the gateway answered: every response by outcome, and none may be an error; plus Codex's
exit status and its first error line, verbatim.
"""

import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from once.bench.clients.node_clients import run_codex
from once.bench.clients.python_clients import git_workspace
from once.gateway.aliases import default_table
from once.gateway.config import GatewayConfig
from once.gateway.model import ModelRuntime
from once.gateway.testing import serve_gateway
from once.model_files import DEFAULT_MODEL

MAX_MODEL_LEN = 32768
DEFAULT_MAX_OUTPUT_TOKENS = 256
PROMPT = "What time is it in UTC? Use the time tool."


def _outcomes(gateway) -> dict[str, int]:
    counts: dict[str, int] = {}
    for family in gateway.metrics.requests.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                outcome = sample.labels["outcome"]
                counts[outcome] = counts.get(outcome, 0) + int(sample.value)
    return counts


async def run(runtime: ModelRuntime, timeout_s: float = 900) -> dict:
    from once.engine.async_engine import AsyncEngine
    from once.engine.config import EngineConfig

    started = time.perf_counter()
    engine = AsyncEngine.from_config(
        EngineConfig(
            model=DEFAULT_MODEL, max_model_len=MAX_MODEL_LEN, kv_cache_gib=1.5, max_num_seqs=4
        )
    )
    runtime = replace(runtime, max_model_len=MAX_MODEL_LEN)
    # Codex sets no output budget; past its trained positions the model rarely ends a
    # reply, so the server caps replies that set none (an operator's setting).
    config = GatewayConfig(
        store="memory",
        aliases=default_table(runtime.name),
        default_max_output_tokens=DEFAULT_MAX_OUTPUT_TOKENS,
    )
    mcp = [str(Path(sys.executable).parent / "mcp-server-time"), "--local-timezone", "UTC"]
    try:
        with tempfile.TemporaryDirectory(prefix="once-codex-real-") as folder:
            workspace = git_workspace(Path(folder) / "repo")
            async with serve_gateway(runtime, engine, config) as (url, gateway):
                done = await run_codex(url, workspace, PROMPT, mcp_command=mcp, timeout_s=timeout_s)
                outcomes = _outcomes(gateway)
    finally:
        await engine.close()
    errors = sum(n for outcome, n in outcomes.items() if outcome in ("error", "response.failed"))
    return {
        "codex_exec_real_model": {
            "returncode": done.returncode,
            "responses_by_outcome": outcomes,
            "gateway_errors": errors,
            "first_error": done.first_error(),
            "errors_printed": [
                line for line in done.stderr.splitlines() if "ERROR" in line or "error" in line
            ][:10],
            "final_message": done.stdout.strip()[-500:],
            "codex_seconds": round(done.seconds, 1),
        },
        "codex_exec_real_model_ok": done.returncode == 0 and errors == 0 and bool(outcomes),
        "codex_exec_real_model_wall_s": round(time.perf_counter() - started, 1),
    }
