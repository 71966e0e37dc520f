"""Where an engine step's time goes: `once bench engine --profile`.

The model's building blocks (each matmul by its role, attention, the norms, rope, the MLP
activation) are wrapped in wall-clock timers for a few steps; what the step spends outside
the model forward is charged to the engine around it (scheduling, sampling, Python). The
CPU ops are synchronous, so the wall time inside a block is its cost, and the C kernels
that torch's own profiler cannot see (they are called through ctypes) are counted too.

Three shapes, the ones where the peers are compared: a decode step at batch 1 after a short
and after a long context (llama.cpp's quantized rows are ahead at the short one), and one
prefill chunk after a cached prefix, which is what a replayed agent call computes (its
TTFT against vLLM's). Each matmul's weight bytes give the rate at which the step streams
weights, the figure that bounds a batch-1 decode.
"""

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from once.bench.engine_bench import report
from once.bench.engine_bench.once_side import greedy, make_engine, warm_up
from once.bench.engine_bench.workloads import random_ids
from once.engine.core import LLMEngine
from once.protocol.engine import GenerateRequest

PROFILE_OUT = Path("results/bench_engine_profile.json")
BLOCKS = ("paged_attention", "add_rms_norm", "silu_mul", "rope_leading_heads")
MODEL_MODULE = "once.engine.models.llama"
SHORT_CONTEXT = 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("profile (--profile)")
    group.add_argument(
        "--profile",
        action="store_true",
        help="only once's step broken down by block: decode at batch 1, a prefill chunk",
    )
    group.add_argument("--profile-steps", type=int, default=16, help="decode steps timed")
    group.add_argument("--profile-prefix", type=int, default=3000, help="cached prefix tokens")
    group.add_argument("--profile-new", type=int, default=300, help="new tokens after it")


class BlockTimers:
    """Seconds and calls per block name, while `installed`."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.roles = matmul_roles(engine.model)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def _timed(self, name_of, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                name = name_of(args)
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1

        return wrapper

    @contextlib.contextmanager
    def installed(self):
        import importlib

        module = importlib.import_module(MODEL_MODULE)
        saved = {name: getattr(module, name) for name in (*BLOCKS, "linear")}
        model = self.engine.model
        try:
            for name in BLOCKS:
                setattr(module, name, self._timed(lambda args, n=name: n, saved[name]))
            role = self.roles.get
            module.linear = self._timed(  # type: ignore[attr-defined]
                lambda args: "matmul." + role(id(args[1]), "other"), saved["linear"]
            )
            model.forward = self._timed(lambda args: "model_forward", model.forward)
            yield self
        finally:
            for name, fn in saved.items():
                setattr(module, name, fn)
            del model.forward  # back to the class's method


def matmul_roles(model) -> dict[int, str]:
    roles = {id(model.lm_head): "lm_head"}
    for layer in model.layers:
        for role in ("qkv", "o_proj", "gate_up", "down_proj"):
            roles[id(getattr(layer, role))] = role
    return roles


def weight_bytes_per_token(model) -> int:
    """Bytes of matmul weights one decode step reads (packed copies are alternatives, not
    extra reads: a batch-1 step uses one of them)."""

    def layer_bytes(layer) -> int:
        tensors = [v for k, v in vars(layer).items() if isinstance(v, torch.Tensor)]
        tensors = [t for t in tensors if t is not getattr(layer, "packed", None)]
        return sum(t.nbytes for t in tensors)

    total = layer_bytes(model.lm_head)
    for layer in model.layers:
        total += sum(
            layer_bytes(getattr(layer, r)) for r in ("qkv", "o_proj", "gate_up", "down_proj")
        )
    return total


def breakdown(timers: BlockTimers, step_s: list[float]) -> dict:
    """Per-step milliseconds by block; `engine_outside_model` is step minus forward."""
    steps = len(step_s)
    per_step = {name: 1000 * s / steps for name, s in sorted(timers.seconds.items())}
    forward = per_step.pop("model_forward", 0.0)
    step_ms = 1000 * sum(step_s) / steps
    blocks_ms = sum(per_step.values())
    per_step["model_other"] = max(0.0, forward - blocks_ms)  # embedding, residual adds, glue
    per_step["engine_outside_model"] = max(0.0, step_ms - forward)
    matmul_ms = sum(v for k, v in per_step.items() if k.startswith("matmul."))
    return {
        "steps": steps,
        "step_ms": step_ms,
        "step_ms_median": 1000 * statistics.median(step_s),
        "blocks_ms": {k: round(v, 3) for k, v in per_step.items()},
        "shares": {k: round(v / step_ms, 4) for k, v in per_step.items()},
        "matmul_ms": matmul_ms,
    }


def profile_decode(engine, timers, context: int, steps: int, vocab: int, tag: str) -> dict:
    prompt = tuple(random_ids(random.Random(tag), context, vocab))
    engine.add_request(GenerateRequest(tag, prompt, greedy(steps + 2)))
    generated = 0
    while generated < 2:  # the prefill (and its first token), then one untimed decode
        generated += sum(len(delta.token_ids) for delta in engine.step())
    timers.reset()
    step_s = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t0)
    result = breakdown(timers, step_s)
    result["context_tokens"] = context
    result["weight_bytes"] = weight_bytes_per_token(engine.model)
    result["weight_gb_s"] = result["weight_bytes"] / (result["matmul_ms"] / 1000) / 1e9
    return result


def profile_prefill(engine, timers, prefix: int, new: int, vocab: int) -> dict:
    rng = random.Random("profile-prefill")
    cached = random_ids(rng, prefix, vocab)
    engine.generate([GenerateRequest("prefix", tuple(cached), greedy(1))])
    prompt = tuple(cached + random_ids(rng, new, vocab))
    timers.reset()
    t0 = time.perf_counter()
    deltas = engine.generate([GenerateRequest("call", prompt, greedy(1))])["call"]
    wall = time.perf_counter() - t0
    metrics = deltas[-1].metrics
    result = breakdown(timers, [wall])
    result.update(
        prefix_tokens=prefix,
        new_tokens=new,
        computed_tokens=metrics.num_computed_tokens if metrics else None,
        ttft_ms=1000 * metrics.ttft_s if metrics else None,
    )
    return result


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    context = max(SHORT_CONTEXT, args.profile_prefix + args.profile_new)
    max_len = context + args.profile_steps + 64
    engine = make_engine(args.model, args.threads, max_model_len=max_len, weights=args.weights)
    vocab = engine.model.config.vocab_size
    warm_up(engine, vocab)
    started, cpu_start = time.perf_counter(), report.cpu_snapshot()
    timers = BlockTimers(engine)
    with timers.installed():
        decode_short = profile_decode(
            engine, timers, SHORT_CONTEXT, args.profile_steps, vocab, "dshort"
        )
        decode_long = profile_decode(
            engine, timers, args.profile_prefix, args.profile_steps, vocab, "dlong"
        )
        prefill = profile_prefill(engine, timers, args.profile_prefix, args.profile_new, vocab)
    machine = report.machine_info(args.threads)
    machine["other_cpu_load"] = report.other_cpu_load(cpu_start, report.cpu_snapshot())
    return {
        "benchmark": "engine",
        "part": "profile",
        "model": args.model,
        "num_threads": args.threads,
        "weights": args.weights,
        "machine": machine,
        f"decode_b1_ctx{SHORT_CONTEXT}": decode_short,
        f"decode_b1_ctx{args.profile_prefix}": decode_long,
        "prefill_after_prefix": prefill,
        "elapsed_s": time.perf_counter() - started,
    }


def render(results: dict) -> str:
    lines = []
    for name, part in results.items():
        if not isinstance(part, dict) or "blocks_ms" not in part:
            continue
        head = f"{name}: step {part['step_ms']:.1f} ms"
        if "weight_gb_s" in part:
            head += (
                f", weights {part['weight_bytes'] / 1e6:.0f} MB at {part['weight_gb_s']:.1f} GB/s"
            )
        lines.append(head)
        for block, ms in sorted(part["blocks_ms"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {block:<24} {ms:9.2f} ms  {100 * part['shares'][block]:5.1f}%")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    results = run(args)
    out = args.out or PROFILE_OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(render(results), file=sys.stderr)
    print(f"results written to {out}", file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0
