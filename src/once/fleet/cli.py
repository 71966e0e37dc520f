"""`once fleet`: a gateway, a router and N vLLM replicas on this machine, from a fleet file.

    once fleet check examples/vllm-fleet.toml     # validate it and print the plan
    once fleet up examples/vllm-fleet.toml        # run it until ^C or SIGTERM

Logs go to --log-dir, by default a new folder under the system's temporary folder (kept
after the fleet stops; its path is printed first): vllm-i/vllm.log, router.log,
gateway.log. Exit status: 0 stopped by a signal, 1 a server failed to start or died,
2 a bad fleet file or command line.
"""

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from once.fleet.fleet_file import FleetFile, FleetFileError, load_fleet_file
from once.fleet.vllm_server import vllm_missing_reason, vllm_python


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="once fleet", description=__doc__.split("\n")[0])
    actions = parser.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="start the fleet; ^C or SIGTERM stops it")
    up.add_argument("fleet_file", metavar="FLEET.toml")
    up.add_argument("--log-dir", default=None, help="default: a new folder under the temp dir")
    check = actions.add_parser("check", help="validate a fleet file and print its plan")
    check.add_argument("fleet_file", metavar="FLEET.toml")
    return parser


def plan_lines(spec: FleetFile) -> list[str]:
    from once.model_files import locate_model  # noqa: PLC0415
    from once.protocol.errors import OnceError  # noqa: PLC0415

    try:
        location = locate_model(spec.model)
        folder = f"{location.folder}" + ("" if location.converted else " (converted at start)")
    except OnceError as exc:
        folder = f"not found: {exc.message}"
    gateway, router = spec.gateway, spec.router

    def port(number: int) -> str:
        return f"port {number}" if number else "any free port"

    lines = [
        f"fleet file  {spec.path}",
        f"model       {spec.model}, served as {spec.served_model_name}; folder {folder}",
    ]
    for i, replica in enumerate(spec.replicas):
        extra = "".join(f" {arg}" for arg in replica.extra_args)
        lines.append(
            f"vllm-{i:<6} 127.0.0.1 {port(replica.port)}; KV cache {replica.kv_cache_mib} MiB, "
            f"{replica.threads} thread(s), block size {replica.block_size}, max_model_len "
            f"{replica.max_model_len}, prefix caching {_on(replica.prefix_caching)}, KV events "
            f"{_on(replica.kv_events)}{extra}"
        )
    params = "".join(f", {name}={value}" for name, value in router.policy_params.items())
    lines.append(f"router      127.0.0.1 {port(router.port)}; policy {router.policy}{params}")
    lines.append(
        f"gateway     {gateway.host} {port(gateway.port)}; store {gateway.store or 'default'}, "
        f"safety {gateway.safety}, max_model_len {spec.max_model_len}"
        + (f", API keys {gateway.api_keys}" if gateway.api_keys else "")
    )
    missing = vllm_missing_reason()
    lines.append(f"vLLM        {missing or vllm_python()}")
    return lines


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def say(line: str) -> None:
    print(line, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = load_fleet_file(args.fleet_file)
    except FleetFileError as exc:
        print(f"once fleet: {exc}", file=sys.stderr)
        return 2
    if args.action == "check":
        for line in plan_lines(spec):
            say(line)
        return 0
    from once.fleet.launcher import FleetStartError, run_fleet  # noqa: PLC0415
    from once.protocol.errors import OnceError  # noqa: PLC0415

    reason = vllm_missing_reason()
    if reason:
        print(f"once fleet: {reason}", file=sys.stderr)
        return 1
    if args.log_dir:
        log_dir = Path(args.log_dir).resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="once-fleet-"))
    try:
        return run_fleet(spec, log_dir, say)
    except FleetStartError as exc:
        print(f"once fleet: {exc}", file=sys.stderr)
        return 1
    except OnceError as exc:  # the model cannot be found or converted
        print(f"once fleet: {exc.message}", file=sys.stderr)
        return 1
