"""`once capacity`: replica counts and balancer weights for a fleet of gateway CPUs.

The costs come from each CPU's `CpuCostMeter` (capacity.py); the planner fills the
target load with the CPUs that spend the fewest CPU ms per request first.
"""

import argparse
import json
import math
import sys
import tomllib
from pathlib import Path

from once.gateway.admission.capacity import CpuCostMeter, _format_number
from once.protocol.errors import InvalidRequestError, OnceError

COST_KEYS = ("render", "tokenize", "detokenize", "request")
CPU_KEYS = ("cpu_model", "cores", "available", "costs")


def request_cpu_ms(costs: dict, new_prompt_tokens: float, output_tokens: float) -> float:
    # Render and tokenize scale with the *new* prompt tokens (a continuation sends only its
    # new items), detokenize with the output tokens; "request" is a fixed cost per request.
    token_ms = (costs["render"] + costs["tokenize"]) * new_prompt_tokens
    token_ms += costs["detokenize"] * output_tokens
    return token_ms / 1000 + costs["request"]


def plan_capacity(fleet: list[dict], target: dict) -> dict:
    """Replica counts and balancer weights that serve `target` with the fewest core-hours.

    Greedy, cheapest first: CPU models in order of CPU ms per request (ties: more capacity
    per replica first), each taking replicas (up to `available`) until the target is met.
    Weights are integers proportional to per-replica capacity, 100 for the largest in use
    and 0 for models not used. Ready for nginx, HAProxy or Envoy endpoint weights.
    """
    rps, new_prompt_tokens, output_tokens, max_utilization = _check_target(target)
    if not isinstance(fleet, list) or not fleet:
        raise InvalidRequestError("the fleet lists no CPUs", param="fleet")
    rows = []
    for index, entry in enumerate(fleet):
        cpu = _check_cpu(entry, index)
        ms = request_cpu_ms(cpu["costs"], new_prompt_tokens, output_tokens)
        if ms <= 0:
            raise InvalidRequestError(
                f"fleet[{index}] ({cpu['cpu_model']}): costs are all zero for this target, "
                "so its capacity would be unbounded",
                param=f"fleet[{index}].costs",
            )
        capacity = cpu["cores"] * 1000 * max_utilization / ms
        rows.append({**cpu, "cpu_ms_per_request": ms, "capacity_rps": capacity})

    rows.sort(key=lambda row: (row["cpu_ms_per_request"], -row["capacity_rps"]))
    remaining = rps
    for row in rows:
        # The epsilon keeps float noise (2.0000000001 replicas) from adding a replica.
        needed = math.ceil(remaining / row["capacity_rps"] - 1e-9) if remaining > 0 else 0
        row["count"] = min(row["available"], max(needed, 0))
        remaining -= row["count"] * row["capacity_rps"]

    used = [row["capacity_rps"] for row in rows if row["count"] > 0]
    largest = max(used, default=1.0)
    total = sum(row["count"] * row["capacity_rps"] for row in rows)
    replicas = [
        {
            "cpu_model": row["cpu_model"],
            "cores": row["cores"],
            "count": row["count"],
            "available": row["available"],
            "cpu_ms_per_request": row["cpu_ms_per_request"],
            "capacity_rps": row["capacity_rps"],
            "weight": max(1, round(100 * row["capacity_rps"] / largest)) if row["count"] else 0,
        }
        for row in rows
    ]
    meets_target = total >= rps * (1 - 1e-9)
    return {
        "replicas": replicas,
        "total_capacity_rps": total,
        "target_rps": rps,
        "meets_target": meets_target,
        "shortfall_rps": 0.0 if meets_target else rps - total,
        # With weights proportional to capacity every replica runs at the same utilization.
        "expected_utilization": max_utilization * rps / total if total > 0 else None,
    }


def _check_target(target: dict) -> tuple[float, float, float, float]:
    if not isinstance(target, dict):
        raise InvalidRequestError("the target must be a table of numbers", param="target")
    rps = _number(target.get("requests_per_s"), "target.requests_per_s", positive=True)
    new_prompt = _number(target.get("new_prompt_tokens"), "target.new_prompt_tokens")
    output = _number(target.get("output_tokens"), "target.output_tokens")
    utilization = _number(
        target.get("max_utilization", 0.7), "target.max_utilization", positive=True
    )
    if utilization > 1:
        raise InvalidRequestError(
            f"target.max_utilization must be in (0, 1], got {utilization}",
            param="target.max_utilization",
        )
    return rps, new_prompt, output, utilization


def _check_cpu(entry: dict, index: int) -> dict:
    where = f"fleet[{index}]"
    if not isinstance(entry, dict):
        raise InvalidRequestError(f"{where} must be a table", param=where)
    unknown = sorted(set(entry) - set(CPU_KEYS))
    missing = [key for key in CPU_KEYS if key not in entry]
    if unknown or missing:
        problems = [f"missing {', '.join(missing)}"] if missing else []
        problems += [f"unknown {', '.join(unknown)}"] if unknown else []
        raise InvalidRequestError(f"{where}: {'; '.join(problems)}", param=where)
    cpu_model = entry["cpu_model"]
    if not isinstance(cpu_model, str) or not cpu_model.strip():
        raise InvalidRequestError(f"{where}.cpu_model must be a name", param=f"{where}.cpu_model")
    available = entry["available"]
    if isinstance(available, bool) or not isinstance(available, int) or available < 0:
        raise InvalidRequestError(
            f"{where}.available must be a whole number >= 0, got {available!r}",
            param=f"{where}.available",
        )
    costs = entry["costs"]
    if not isinstance(costs, dict) or set(costs) != set(COST_KEYS):
        raise InvalidRequestError(
            f"{where}.costs must have exactly {', '.join(COST_KEYS)}, got "
            f"{sorted(costs) if isinstance(costs, dict) else type(costs).__name__}",
            param=f"{where}.costs",
        )
    return {
        "cpu_model": cpu_model.strip(),
        "cores": _number(entry["cores"], f"{where}.cores", positive=True),
        "available": available,
        "costs": {key: _number(costs[key], f"{where}.costs.{key}") for key in COST_KEYS},
    }


def _number(value, param: str, positive: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise InvalidRequestError(f"{param} must be a number {bound}, got {value!r}", param=param)
    return float(value)


def measure_tokenizer_costs(tokenizer, *, num_rounds: int = 30) -> CpuCostMeter:
    """Run the gateway's stages on a synthetic agent turn with a Hugging Face tokenizer.

    render = the chat template, tokenize = encoding the rendered prompt, detokenize = a
    `DecodeStream` over a 400-token answer, request = parsing the request body and encoding
    an SSE delta event per output token plus the final response. That last one is a floor
    for the rest of the pipeline: a gateway under real load reports the true figure.
    """
    from tokenizers.decoders import DecodeStream

    backend = tokenizer.backend_tokenizer
    tool_output = "\n".join(
        f"src/module_{i}.py:{i * 7}: def handler_{i}(request):" for i in range(40)
    )
    messages = [
        {"role": "system", "content": "You are a coding agent. Use the shell tool. " * 8},
        {"role": "user", "content": "Find where requests are handled and add a timeout."},
        {"role": "assistant", "content": "I will search the code for handlers first."},
        {"role": "user", "content": tool_output},
    ]
    answer_ids = tokenizer.encode(tool_output * 2, add_special_tokens=False)[:400]
    body = json.dumps({"model": "m", "input": messages, "tools": [], "store": True})
    prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    num_prompt_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
    num_tokens = num_prompt_tokens + len(answer_ids)
    meter = CpuCostMeter(half_life_s=None)
    for round_index in range(num_rounds + 3):
        sink = meter if round_index >= 3 else CpuCostMeter(half_life_s=None)  # 3 warm-ups
        # "request" encloses the three stages: it is the request's whole CPU.
        with sink.measure("request", num_tokens):
            json.loads(body)
            with sink.measure("render", num_prompt_tokens):
                prompt = tokenizer.apply_chat_template(messages, tokenize=False)
            with sink.measure("tokenize", num_prompt_tokens):
                tokenizer.encode(prompt, add_special_tokens=False)
            with sink.measure("detokenize", len(answer_ids)):
                stream = DecodeStream(skip_special_tokens=True)
                pieces = [stream.step(backend, token_id) or "" for token_id in answer_ids]
            for piece in pieces:
                event = {"type": "response.output_text.delta", "item_id": "msg", "delta": piece}
                f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            json.dumps({"id": "resp", "output": [{"type": "message", "content": "".join(pieces)}]})
    return meter


def _fleet_entry_toml(entry: dict) -> str:
    costs = entry["costs"]
    lines = [
        "[[cpu]]",
        f"cpu_model = {json.dumps(entry['cpu_model'])}",
        f"cores = {_format_number(entry['cores'])}",
        f"available = {entry['available']}",
        "[cpu.costs]  # CPU ms per 1k tokens; request: ms per request",
    ]
    lines += [f"{key} = {_format_number(costs[key])}" for key in COST_KEYS]
    return "\n".join(lines)


# -- once capacity --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """`once capacity`: 0 when the fleet meets the target, 1 when it falls short, 2 on bad
    input (a message on stderr, no traceback)."""
    parser = argparse.ArgumentParser(
        prog="once capacity",
        description="Replica counts and balancer weights for a fleet of gateway CPUs.",
    )
    parser.add_argument("--fleet", type=Path, help="TOML file of [[cpu]] entries")
    parser.add_argument("--rps", type=float, help="target requests per second")
    parser.add_argument("--new-prompt-tokens", type=float, help="new prompt tokens per request")
    parser.add_argument("--output-tokens", type=float, help="output tokens per request")
    parser.add_argument("--max-utilization", type=float, default=0.7)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--measure",
        metavar="MODEL",
        help="measure this machine with MODEL's tokenizer; print its [[cpu]] entry",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # usage errors (2) and --help (0) without leaving main
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        if args.measure:
            from once.model_files import find_model_folder, load_tokenizer

            tokenizer = load_tokenizer(find_model_folder(args.measure))
            print(_fleet_entry_toml(measure_tokenizer_costs(tokenizer).fleet_entry()))
            return 0
        needed = {"--fleet": args.fleet, "--rps": args.rps}
        needed |= {"--new-prompt-tokens": args.new_prompt_tokens}
        needed |= {"--output-tokens": args.output_tokens}
        if missing := [flag for flag, value in needed.items() if value is None]:
            raise InvalidRequestError(f"missing {', '.join(missing)} (or use --measure MODEL)")
        fleet = _read_fleet(args.fleet)
        target = {
            "requests_per_s": args.rps,
            "new_prompt_tokens": args.new_prompt_tokens,
            "output_tokens": args.output_tokens,
            "max_utilization": args.max_utilization,
        }
        plan = plan_capacity(fleet, target)
    except OnceError as exc:
        print(f"once capacity: {exc.message}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else _format_plan(plan, target))
    return 0 if plan["meets_target"] else 1


def _read_fleet(path: Path) -> list:
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read fleet file {str(path)!r}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InvalidRequestError(f"fleet file {str(path)!r} is not valid TOML: {exc}") from exc
    fleet = document.get("cpu")
    if not isinstance(fleet, list) or not fleet:
        raise InvalidRequestError(f"fleet file {str(path)!r} has no [[cpu]] entries")
    return fleet


def _format_plan(plan: dict, target: dict) -> str:
    width = max(len("cpu_model"), *(len(row["cpu_model"]) for row in plan["replicas"]))
    lines = [
        f"target: {target['requests_per_s']:g} req/s, {target['new_prompt_tokens']:g} new prompt"
        f" + {target['output_tokens']:g} output tokens per request, CPU utilization <= "
        f"{target['max_utilization']:.0%}",
        f"{'cpu_model':<{width}}  cores    ms/req  req/s each  count/avail  weight",
    ]
    for row in plan["replicas"]:
        lines.append(
            f"{row['cpu_model']:<{width}}  {row['cores']:>5g}  {row['cpu_ms_per_request']:>8.3f}"
            f"  {row['capacity_rps']:>10.1f}  {row['count']:>5}/{row['available']:<5}"
            f"  {row['weight']:>6}"
        )
    total = f"total capacity {plan['total_capacity_rps']:.1f} req/s"
    if plan["meets_target"]:
        utilization = plan["expected_utilization"]
        lines.append(f"{total}: meets the target; expected CPU utilization {utilization:.0%}")
    else:
        lines.append(f"{total}: SHORT of the target by {plan['shortfall_rps']:.1f} req/s")
    return "\n".join(lines)
