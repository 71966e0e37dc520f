"""`once bench clients`: every real client against the real gateway, one tool round trip
each (registry.py), and a `clients` report keyed by client name with `clients_failed`;
`--real-codex` adds Codex CLI on SmolLM2 beside busy processes (codex_real.py), and
`--real-codex-only` runs that stage alone."""

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_OUT = _REPO_ROOT / "results" / "bench_clients.json"
DEFAULT_REAL_CODEX_OUT = _REPO_ROOT / "results" / "codex_real_busy.json"


async def run_clients(
    names: list[str],
    structured: bool,
    tool_search: bool = True,
    real_codex: bool = False,
    busy: int = 1,
    codex_modes: tuple[str, ...] = ("http", "websocket"),
    served_model: str | None = None,
    max_output_tokens: int | None = None,
    rope_scaling: str | None = None,
) -> dict:
    from once.gateway.testing import load_runtime

    report: dict = {}
    runtime = load_runtime() if names or tool_search else None  # the stages in this process
    if names and runtime is not None:
        from once.bench.clients.registry import CASES_BY_NAME, run_case

        clients = {}
        for name in names:
            print(f"{name} ...", file=sys.stderr, flush=True)
            clients[name] = (await run_case(CASES_BY_NAME[name], runtime)).to_dict()
        failed = sorted(name for name, result in clients.items() if not result["ok"])
        report.update({"clients": clients, "clients_failed": len(failed), "failed": failed})
    if structured:
        from once.bench.clients import structured as structured_outputs

        print("structured outputs on SmolLM2 ...", file=sys.stderr, flush=True)
        report.update(await structured_outputs.run())
    if tool_search and runtime is not None:
        from once.bench.clients import api_tool_search

        print("server-side tool search on LiveMCPBench ...", file=sys.stderr, flush=True)
        report.update(await api_tool_search.run(runtime))
    if real_codex:
        from once.bench.clients import codex_real

        served = codex_real.Served()
        if served_model:
            served = replace(served, model=served_model)
        if max_output_tokens is not None:
            served = replace(served, max_output_tokens=max_output_tokens)
        if rope_scaling is not None:
            served = replace(served, rope_scaling=rope_scaling)
        report.update(await codex_real.run(busy, codex_modes, served))
    return report


def main(argv: list[str] | None = None) -> int:
    from once.bench.clients.registry import CASES_BY_NAME

    parser = argparse.ArgumentParser(prog="once bench clients", description=__doc__)
    parser.add_argument("--clients", nargs="+", choices=list(CASES_BY_NAME))
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--no-structured", action="store_true", help="skip the structured outputs on SmolLM2"
    )
    parser.add_argument(
        "--no-tool-search", action="store_true", help="skip the API's tool search on LiveMCPBench"
    )
    real = parser.add_argument_group("Codex on SmolLM2 beside busy processes (issue 31)")
    real.add_argument(
        "--real-codex",
        action="store_true",
        help="also a whole `codex exec` on SmolLM2 per transport, against `once serve`",
    )
    real.add_argument(
        "--real-codex-only", action="store_true", help="only that stage (--out: " +
        f"{DEFAULT_REAL_CODEX_OUT.relative_to(_REPO_ROOT)})",
    )  # fmt: skip
    real.add_argument(
        "--busy", type=int, default=1, help="CPU-bound processes beside each run (default 1)"
    )
    real.add_argument(
        "--codex-modes", nargs="+", choices=["http", "websocket"], default=["http", "websocket"]
    )
    real.add_argument(
        "--served-model", default=None, help="the model `once serve` loads (default: SmolLM2-135M)"
    )
    real.add_argument(
        "--max-output-tokens",
        type=int,
        default=None,
        help="the server's budget for replies that set none (Codex sets none): default 256",
    )
    real.add_argument(
        "--rope-scaling",
        default=None,
        help="the server's --rope-scaling JSON (default: YaRN x4 over SmolLM2's 8,192 "
        "positions; '' serves the model unscaled)",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"default: {DEFAULT_OUT}")
    args = parser.parse_args(argv)
    if args.busy < 0:
        parser.error("--busy must be >= 0")
    only_codex = args.real_codex_only
    names = [] if only_codex else args.clients or list(CASES_BY_NAME)
    report = asyncio.run(
        run_clients(
            names,
            structured=not (only_codex or args.no_structured),
            tool_search=not (only_codex or args.no_tool_search),
            real_codex=args.real_codex or only_codex,
            busy=args.busy,
            codex_modes=tuple(args.codex_modes),
            served_model=args.served_model,
            max_output_tokens=args.max_output_tokens,
            rope_scaling=args.rope_scaling,
        )
    )
    out = args.out or (DEFAULT_REAL_CODEX_OUT if only_codex else DEFAULT_OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for name, result in report.get("clients", {}).items():
            flags = " ".join(
                f"{key}={'yes' if result[key] else 'no'}"
                for key in ("connected", "streamed", "tool_round_trip", "finished")
            )
            verdict = "ok" if result["ok"] else f"FAILED: {result['first_error']}"
            print(f"{name:22} {flags} errors={result['gateway_errors']} {verdict}")
        if "clients_failed" in report:
            print(f"clients_failed: {report['clients_failed']}")
        if "structured_valid_fraction" in report:
            print(
                f"structured outputs on SmolLM2: {report['structured_json_valid']}/"
                f"{report['structured_json_responses']} json_schema responses and "
                f"{report['structured_forced_calls_valid']}/{report['structured_forced_calls']}"
                f" forced strict calls and {report['structured_grammar_calls_valid']}/"
                f"{report['structured_grammar_calls']} Lark-grammar custom calls valid "
                f"({report['structured_wall_s']} s)"
            )
        if "api_tool_search_recall_at_5" in report:
            print(
                f"server-side tool search recall@5: {report['api_tool_search_recall_at_5']} "
                f"(held-out {report['api_tool_search_recall_at_5_heldout']}); the harness's "
                f"ranker {report['harness_tool_search_recall_at_5']}"
            )
        if "codex_real_model" in report:
            from once.bench.clients.codex_real import render_mode

            busy = report["codex_real_model_busy"]
            for mode, result in report["codex_real_model"].items():
                print(f"codex exec, {busy} busy, {render_mode(mode, result)}")
            print(f"codex_real_model_ok: {report['codex_real_model_ok']}")
    failed = report.get("clients_failed", 0) or not report.get("codex_real_model_ok", True)
    return 1 if failed else 0
