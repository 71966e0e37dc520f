"""`once bench structured`: decode throughput of JSON-schema-constrained requests against
free ones, in the same run, at the same batch.

Two engines of the same config load the same model (they swap sides every round): one
runs a batch of greedy free requests (`ignore_eos`, so all run to max_tokens), the other
the same prompts, greedy, constrained by one JSON schema (they stop when their JSON is
complete). Both batches run
at once and the engines are stepped in turn, the first one alternating, so each free step
is paired with a constrained step taken within a tenth of a second of it: on a machine
shared with other work, load that stalls single steps by 10x then hits both sides of a
pair alike, where batches run one after the other drifted 4x apart. Only pairs where
both whole batches decoded count (no prefill, every request still running), so the
constrained batch shrinking as its requests finish never counts against it.

Headline: batch / median step time of each side (tokens/s) and their ratio; the median
of the per-pair ratios and the ratio of mean step times sit beside it. Every constrained
output is parsed and validated with jsonschema (`valid_fraction`). The constrained
engines' counters say whether the mask fill hid behind the forward (`mask_wait_s`: what
the steps waited for it after the forward).
"""

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jsonschema
import torch

from once.bench.engine_bench import report
from once.engine.config import DEFAULT_MODEL, EngineConfig
from once.engine.core import LLMEngine
from once.protocol.engine import GenerateRequest, OutputConstraint, SamplingParams

# src/once/bench/engine_bench/structured.py -> the repository root is four folders up.
DEFAULT_OUT = Path(__file__).resolve().parents[4] / "results" / "bench_structured.json"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "active"],
    "additionalProperties": False,
}
SUBJECTS = [
    "a new employee at a bakery",
    "the administrator of a small forum",
    "a retired teacher who edits a wiki",
    "a student who reads a news site",
    "a journalist with an editor account",
    "a teenager who just signed up",
    "a manager who reviews articles",
    "a guest who only browses",
]


@dataclass(frozen=True)
class StructuredOptions:
    model: str = DEFAULT_MODEL
    batch_size: int = 8
    max_tokens: int = 64
    num_rounds: int = 4  # even: each engine runs each side equally often
    num_threads: int = 0  # 0: torch's default
    kv_cache_gib: float = 0.5
    schema: dict = field(default_factory=lambda: SCHEMA)


def chat_prompts(tokenizer, num_prompts: int) -> list[tuple[int, ...]]:
    prompts = []
    for i in range(num_prompts):
        subject = SUBJECTS[i % len(SUBJECTS)]
        text = f"Describe {subject} as a JSON user record (name, age, email, role, active)."
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompts.append(tuple(ids))
    return prompts


class Arm:
    """One engine and the batch it runs this round."""

    def __init__(self, engine: LLMEngine, sampling: SamplingParams):
        self.engine = engine
        self.sampling = sampling
        self.outputs: dict[str, list[int]] = {}

    def start(self, prompts, tag: str) -> None:
        self.outputs = {f"{tag}-{i}": [] for i in range(len(prompts))}
        for request_id, prompt in zip(self.outputs, prompts, strict=True):
            self.engine.add_request(GenerateRequest(request_id, prompt, self.sampling))

    def step(self) -> float | None:
        """One step; its wall time when the whole batch decoded in it, else None."""
        engine = self.engine
        prefilled = engine.counters["num_computed_prompt_tokens"]
        started = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - started
        for delta in deltas:
            self.outputs[delta.request_id].extend(delta.token_ids)
        decode_only = engine.counters["num_computed_prompt_tokens"] == prefilled
        running = [d for d in deltas if d.token_ids and not d.finished]
        # The whole batch decoded: no prefill, each request one id, none finished by it.
        return elapsed if decode_only and len(running) == len(self.outputs) else None


def run_round(free: Arm, constrained: Arm, prompts, tag: str) -> list[tuple[float, float]]:
    """Both batches at once, the two engines stepped in turn (which one goes first
    alternates); returns (free, constrained) step times of the steps where both whole
    batches decoded, each pair measured within ~0.1 s of each other."""
    free.start(prompts, f"free-{tag}")
    constrained.start(prompts, f"json-{tag}")
    pairs, turn = [], 0
    while free.engine.has_unfinished_requests() or constrained.engine.has_unfinished_requests():
        times: dict[int, float | None] = {}
        for arm in (free, constrained) if turn % 2 == 0 else (constrained, free):
            times[id(arm)] = arm.step() if arm.engine.has_unfinished_requests() else None
        turn += 1
        free_s, constrained_s = times[id(free)], times[id(constrained)]
        if free_s is not None and constrained_s is not None:
            pairs.append((free_s, constrained_s))
    return pairs


def _valid(tokenizer, output: list[int], schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(tokenizer.decode(output, skip_special_tokens=True)), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_structured_benchmark(options: StructuredOptions, log=None) -> dict:
    from once.engine.loader import resolve_model_path
    from once.model_files import load_tokenizer

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cpu_start = report.cpu_snapshot()
    folder = resolve_model_path(options.model)
    config = EngineConfig(
        model=str(folder),
        num_threads=options.num_threads,
        kv_cache_gib=options.kv_cache_gib,
        max_num_seqs=max(64, options.batch_size),
    )
    tokenizer = load_tokenizer(folder)
    prompts = chat_prompts(tokenizer, options.batch_size)
    constraint = OutputConstraint("json_schema", json.dumps(options.schema))
    max_tokens = options.max_tokens
    engines = [LLMEngine(config), LLMEngine(config)]
    free = Arm(engines[0], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    constrained = Arm(
        engines[1], SamplingParams(temperature=0.0, max_tokens=max_tokens, constraint=constraint)
    )
    log("warm-up (builds the grammar tokenizers, compiles the schema) ...")
    for _ in engines:
        run_round(free, constrained, prompts[:2], "warm-up")
        free.engine, constrained.engine = constrained.engine, free.engine
    masks_before = [engine.masks.stats() for engine in engines]

    pairs: list[tuple[float, float]] = []
    outputs: list[list[int]] = []
    for round_index in range(options.num_rounds):
        log(f"round {round_index + 1}/{options.num_rounds} ...")
        pairs += run_round(free, constrained, prompts, str(round_index))
        outputs += constrained.outputs.values()
        # The engines swap sides every round: two copies of the weights need not stream
        # alike (one may have got huge pages, the other not), and that must not pass for
        # the constraint's cost.
        free.engine, constrained.engine = constrained.engine, free.engine

    batch = options.batch_size
    free_s = statistics.median(f for f, _ in pairs) if pairs else 0.0
    constrained_s = statistics.median(c for _, c in pairs) if pairs else 0.0
    valid = [_valid(tokenizer, o, options.schema) for o in outputs]
    masks = {
        key: sum(
            e.masks.stats()[key] - before[key]
            for e, before in zip(engines, masks_before, strict=True)
        )
        for key in masks_before[0]
    }
    return {
        "benchmark": "structured",
        "model": options.model,
        "options": asdict(options),
        "machine": report.machine_info(options.num_threads or torch.get_num_threads())
        | {"other_cpu_load": report.other_cpu_load(cpu_start, report.cpu_snapshot())},
        "num_step_pairs": len(pairs),
        "free_decode_tokens_per_s": batch / free_s if free_s else 0.0,
        "constrained_decode_tokens_per_s": batch / constrained_s if constrained_s else 0.0,
        "ratio": free_s / constrained_s if constrained_s else 0.0,
        "ratio_median_of_pairs": statistics.median(f / c for f, c in pairs) if pairs else 0.0,
        "ratio_of_means": sum(f for f, _ in pairs) / sum(c for _, c in pairs) if pairs else 0.0,
        "valid_fraction": sum(valid) / len(valid) if valid else 0.0,
        "num_constrained_outputs": len(valid),
        "mean_constrained_output_tokens": statistics.mean(len(o) for o in outputs),
        "mask_fill_s": masks["grammar_mask_fill_s_total"],
        "mask_wait_s": masks["grammar_mask_wait_s_total"],
        "num_masks": masks["num_grammar_masks"],
        "constrained_examples": [
            tokenizer.decode(o, skip_special_tokens=True) for o in outputs[:3]
        ],
    }


def build_parser() -> argparse.ArgumentParser:
    d = StructuredOptions()
    p = argparse.ArgumentParser(
        prog="once bench structured",
        description="decode throughput of JSON-schema-constrained vs free requests, one run",
    )
    p.add_argument("--model", default=d.model)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--rounds", type=int, default=d.num_rounds)
    p.add_argument("--threads", type=int, default=d.num_threads)
    p.add_argument("--json", action="store_true", help="print the results JSON to stdout")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size < 1 or args.max_tokens < 2 or args.rounds < 1:
        print("once bench structured: need --batch-size >= 1, --max-tokens >= 2, --rounds >= 1")
        return 2
    options = StructuredOptions(
        model=args.model,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        num_rounds=args.rounds,
        num_threads=args.threads,
    )
    results = run_structured_benchmark(options)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2)
    args.out.write_text(text + "\n")
    print(
        f"decode tokens/s at batch {options.batch_size}: free "
        f"{results['free_decode_tokens_per_s']:.1f}, json_schema "
        f"{results['constrained_decode_tokens_per_s']:.1f}, ratio {results['ratio']:.3f} "
        f"(median of {results['num_step_pairs']} paired steps "
        f"{results['ratio_median_of_pairs']:.3f}, of means {results['ratio_of_means']:.3f}); "
        f"valid JSON {results['valid_fraction']:.0%} of {results['num_constrained_outputs']}; "
        f"mask fill {results['mask_fill_s'] * 1e3:.0f} ms, "
        f"waited {results['mask_wait_s'] * 1e3:.0f} ms",
        file=sys.stderr,
    )
    print(f"results written to {args.out}", file=sys.stderr)
    if args.json:
        print(text)
    return 0
