"""`once bench clients`: every real client against the real gateway, one tool round trip
each (registry.py), and a `clients` report keyed by client name with `clients_failed`."""

import argparse
import asyncio
import json
import sys
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_OUT = _REPO_ROOT / "results" / "bench_clients.json"


async def run_clients(
    names: list[str], structured: bool, tool_search: bool = True, real_codex: bool = False
) -> dict:
    from once.bench.clients.registry import CASES_BY_NAME, run_case
    from once.gateway.testing import load_runtime

    runtime = load_runtime()
    clients = {}
    for name in names:
        print(f"{name} ...", file=sys.stderr, flush=True)
        clients[name] = (await run_case(CASES_BY_NAME[name], runtime)).to_dict()
    failed = sorted(name for name, result in clients.items() if not result["ok"])
    report = {"clients": clients, "clients_failed": len(failed), "failed": failed}
    if structured:
        from once.bench.clients import structured as structured_outputs

        print("structured outputs on SmolLM2 ...", file=sys.stderr, flush=True)
        report.update(await structured_outputs.run())
    if tool_search:
        from once.bench.clients import api_tool_search

        print("server-side tool search on LiveMCPBench ...", file=sys.stderr, flush=True)
        report.update(await api_tool_search.run(runtime))
    if real_codex:
        from once.bench.clients import codex_real

        print("codex exec on SmolLM2 (sampled, ~5-10 min) ...", file=sys.stderr, flush=True)
        report.update(await codex_real.run(runtime))
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
    parser.add_argument(
        "--real-codex", action="store_true", help="also a whole `codex exec` on SmolLM2, sampled"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    names = args.clients or list(CASES_BY_NAME)
    report = asyncio.run(
        run_clients(
            names,
            structured=not args.no_structured,
            tool_search=not args.no_tool_search,
            real_codex=args.real_codex,
        )
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for name, result in report["clients"].items():
            flags = " ".join(
                f"{key}={'yes' if result[key] else 'no'}"
                for key in ("connected", "streamed", "tool_round_trip", "finished")
            )
            verdict = "ok" if result["ok"] else f"FAILED: {result['first_error']}"
            print(f"{name:22} {flags} errors={result['gateway_errors']} {verdict}")
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
        if "codex_exec_real_model" in report:
            real = report["codex_exec_real_model"]
            print(
                f"codex exec on SmolLM2: ok={report['codex_exec_real_model_ok']} "
                f"exit={real['returncode']} responses={real['responses_by_outcome']} "
                f"first error: {real['first_error']}"
            )
    return 0 if not report["clients_failed"] else 1
