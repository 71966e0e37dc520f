"""`once bench clients`: every real client against the real gateway, one tool round trip
each (registry.py), and a `clients` report keyed by client name with `clients_failed`."""

import argparse
import asyncio
import json
import sys
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_OUT = _REPO_ROOT / "results" / "bench_clients.json"


async def run_clients(names: list[str]) -> dict:
    from once.bench.clients.registry import CASES_BY_NAME, run_case
    from once.gateway.testing import load_runtime

    runtime = load_runtime()
    clients = {}
    for name in names:
        print(f"{name} ...", file=sys.stderr, flush=True)
        clients[name] = (await run_case(CASES_BY_NAME[name], runtime)).to_dict()
    failed = sorted(name for name, result in clients.items() if not result["ok"])
    return {"clients": clients, "clients_failed": len(failed), "failed": failed}


def main(argv: list[str] | None = None) -> int:
    from once.bench.clients.registry import CASES_BY_NAME

    parser = argparse.ArgumentParser(prog="once bench clients", description=__doc__)
    parser.add_argument("--clients", nargs="+", choices=list(CASES_BY_NAME))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    report = asyncio.run(run_clients(args.clients or list(CASES_BY_NAME)))
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
    return 0 if not report["clients_failed"] else 1
