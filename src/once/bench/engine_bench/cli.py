"""Flags, the order of the measurements, and where the results go.

once and transformers are loaded side by side and measured interleaved (once c1,
transformers c1, once c8, ...), so a drift in machine load hits both rather than one. The
serving peers (vLLM's server, llama.cpp) run after once's engines are freed, on the same
token ids and thread count (peers.py).
"""

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from once.bench.engine_bench import (
    contention,
    hf_baseline,
    once_side,
    peers,
    prefill_attention,
    report,
    step_profile,
)
from once.bench.engine_bench.workloads import random_prompts
from once.cpus import usable_cores
from once.engine.config import WEIGHT_FORMATS
from once.model_files import DEFAULT_MODEL

# src/once/bench/engine_bench/cli.py -> the repository root is four folders up.
_REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_OUT = _REPO_ROOT / "results" / "bench_engine.json"
CONTENTION_OUT = _REPO_ROOT / "results" / "bench_engine_contention.json"
PREFILL_ATTENTION_OUT = _REPO_ROOT / "results" / "bench_prefill_vs_sdpa.json"


@dataclass(frozen=True)
class BenchOptions:
    model: str = DEFAULT_MODEL
    concurrency: tuple[int, ...] = (1, 8, 32)
    prompt_tokens: int = 128
    output_tokens: int = 64
    ctx_long: int = 8000  # 0: skip the long-context decode measurement
    decode_steps: int = 32  # timed decode steps at the long context
    session: once_side.SessionShape = field(default_factory=once_side.SessionShape)
    num_threads: int = field(default_factory=usable_cores)
    block_size: int = 16
    max_num_batched_tokens: int = 512
    kv_cache_gib: float = 1.0
    skip_hf: bool = False
    baselines: tuple[str, ...] = peers.DEFAULT_BASELINES
    vllm_compiled: bool = False  # vLLM's torch.compile (minutes to start) instead of eager
    vllm_dtype: str = "float32"  # "bfloat16": vLLM's bf16 CPU path (not like for like)
    seed: int = 0
    # once's matmul weights (EngineConfig.weights): with "q8_0" it is the llamacpp_q8_0_*
    # ratios that compare like with like.
    weights: str = "fp32"


def run_benchmark(options: BenchOptions, log=None) -> dict:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    from once.engine.loader import resolve_model_path

    folder = resolve_model_path(options.model)
    engine_kwargs = {
        "block_size": options.block_size,
        "max_num_batched_tokens": options.max_num_batched_tokens,
        "kv_cache_gib": options.kv_cache_gib,
        "weights": options.weights,
    }
    started = time.perf_counter()
    cpu_start = report.cpu_snapshot()
    engine = once_side.make_engine(
        str(folder),
        options.num_threads,
        max_num_seqs=max(64, *options.concurrency),
        enable_prefix_caching=True,  # every prompt is fresh random ids: nothing hits
        **engine_kwargs,
    )
    vocab = engine.model_config.vocab_size
    max_model_len = engine.max_model_len
    _check_fits(options, max_model_len)
    once_side.warm_up(engine, vocab)
    hf_model = None
    skip_hf = options.skip_hf or "transformers" not in options.baselines
    workload: dict = {"throughput": {}, "decode": [], "once_outputs": {}}
    if not skip_hf:
        hf_model = hf_baseline.load_model(folder, options.num_threads)
        hf_baseline.warm_up(hf_model)

    once_res: dict = {"throughput": {}}
    hf_res: dict = {"throughput": {}}
    short_prompt = None
    for c in options.concurrency:
        prompts = random_prompts(c, options.prompt_tokens, vocab, f"{options.seed}/throughput/c{c}")
        short_prompt = short_prompt or prompts[0]
        log(f"throughput c{c}: once ...")
        once_res["throughput"][str(c)] = once_side.measure_throughput(
            engine, prompts, options.output_tokens
        )
        workload["throughput"][str(c)] = prompts
        workload["once_outputs"][str(c)] = once_res["throughput"][str(c)].pop("outputs")
        if hf_model is not None:
            log(f"throughput c{c}: transformers ...")
            hf_res["throughput"][str(c)] = hf_baseline.measure_throughput(
                hf_model, prompts, options.output_tokens
            )
    if hf_model is not None and short_prompt is not None:
        # Cross-check of the streamed step time by the manual loop.
        hf_res["decode_loop_short"] = hf_baseline.measure_decode_loop(
            hf_model, short_prompt, options.decode_steps
        )
    workload["decode"] = [short_prompt] if short_prompt is not None else []
    if options.ctx_long:
        prompt = random_prompts(1, options.ctx_long, vocab, f"{options.seed}/long-context")[0]
        workload["decode"].append(prompt)
        log(f"decode at {options.ctx_long} context: once ...")
        once_res["long_context"] = once_side.measure_long_context(
            engine, prompt, options.decode_steps
        )
        if hf_model is not None:
            log(f"decode at {options.ctx_long} context: transformers ...")
            hf_res["long_context"] = hf_baseline.measure_decode_loop(
                hf_model, prompt, options.decode_steps
            )
    once_res["engine_stats"] = engine.stats()
    heads = engine.model_config
    log("prefill attention at 2k and 8k context: once vs torch SDPA ...")
    once_res["prefill_attention"] = prefill_attention.measure(
        heads.num_heads, heads.num_kv_heads, heads.head_dim, log
    )
    del engine, hf_model
    gc.collect()

    session = None
    shape = options.session
    if shape.num_turns:
        session = {"shape": asdict(shape)}
        for name, caching in (("cached", True), ("uncached", False)):
            log(f"session of {shape.num_turns} turns, prefix cache {'on' if caching else 'off'}")
            engine = once_side.make_engine(
                str(folder),
                options.num_threads,
                enable_prefix_caching=caching,
                **engine_kwargs,
            )
            once_side.warm_up(engine, vocab)
            session[name] = once_side.run_session(engine, shape, vocab, f"{options.seed}/session")
            del engine
            gc.collect()

    workload |= {"num_output": options.output_tokens, "decode_steps": options.decode_steps}
    peer_session = shape if shape.num_turns else None
    llama = None
    if "llamacpp" in options.baselines:
        llama = peers.run_llamacpp(
            folder, options.num_threads, max_model_len, workload, peer_session, vocab,
            f"{options.seed}/session", log,
        )  # fmt: skip
    vllm = None
    if "vllm" in options.baselines:
        vllm = peers.run_vllm(
            folder,
            options.num_threads,
            options.kv_cache_gib,
            max_model_len,
            not options.vllm_compiled,
            workload,
            peer_session,
            vocab,
            f"{options.seed}/session",
            log,
            options.vllm_dtype,
        )
    machine = report.machine_info(options.num_threads)
    machine["other_cpu_load"] = report.other_cpu_load(cpu_start, report.cpu_snapshot())
    results = {
        "benchmark": "engine",
        "model": options.model,
        "model_path": str(folder),
        "num_threads": options.num_threads,
        "once_weights": options.weights,
        "options": asdict(options),
        "machine": machine,
        "once": once_res,
        "transformers": None if skip_hf else hf_res,
        "llama_cpp": llama,
        "vllm": vllm,
        "session": session,
    }
    figures = report.headline(results)
    results.update(figures)
    results["bars"] = report.bars(figures)
    results["elapsed_s"] = time.perf_counter() - started
    return results


def _check_fits(options: BenchOptions, max_model_len: int) -> None:
    """Fail before any measurement rather than after minutes of them."""
    checks = [
        (options.prompt_tokens + options.output_tokens, "--prompt-tokens + --output-tokens"),
        (options.session.max_tokens if options.session.num_turns else 0, "the session"),
    ]
    if options.ctx_long:
        checks.append((options.ctx_long + options.decode_steps + 1, "--ctx-long + steps"))
    for num_tokens, what in checks:
        if num_tokens > max_model_len:
            raise ValueError(f"{what} needs {num_tokens} positions; the model has {max_model_len}")


def _int_list(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected positive integers separated by commas")
    return values


def build_parser() -> argparse.ArgumentParser:
    d, s = BenchOptions(), once_side.SessionShape()
    p = argparse.ArgumentParser(
        prog="once bench engine",
        description="once engine vs transformers, llama.cpp and vLLM, one run.",
    )
    p.add_argument("--model", default=d.model)
    p.add_argument("--concurrency", type=_int_list, default=d.concurrency, help="e.g. 1,8,32")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--output-tokens", type=int, default=d.output_tokens)
    p.add_argument("--ctx-long", type=int, default=d.ctx_long, help="0 skips it")
    p.add_argument("--decode-steps", type=int, default=d.decode_steps)
    p.add_argument("--session-turns", type=int, default=s.num_turns, help="0 skips it")
    p.add_argument("--session-system", type=int, default=s.system_tokens)
    p.add_argument("--session-task", type=int, default=s.task_tokens)
    p.add_argument("--session-new", type=int, default=s.new_tokens)
    p.add_argument("--session-output", type=int, default=s.output_tokens)
    p.add_argument(
        "--session-probes",
        type=int,
        default=s.last_turn_probes,
        help="requests shaped like the last turn after it; its TTFT is their median",
    )
    p.add_argument("--threads", type=int, default=d.num_threads)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--kv-cache-gib", type=float, default=d.kv_cache_gib)
    p.add_argument("--skip-hf", action="store_true", help="leave transformers out")
    p.add_argument(
        "--baseline",
        type=peers.parse_baselines,
        default=peers.DEFAULT_BASELINES,
        help="peers to measure, comma list of transformers, llamacpp (llama-server from "
        "`make llamacpp`, at f32, Q8_0 and Q4_1), vllm (its CPU server from `make vllm`)",
    )
    p.add_argument(
        "--vllm-compiled",
        action="store_true",
        help="run vLLM compiled (its default; minutes to start) rather than eager",
    )
    p.add_argument(
        "--vllm-dtype",
        choices=("float32", "bfloat16"),
        default=d.vllm_dtype,
        help="vLLM's precision: float32 (like for like with once, the default) or bfloat16",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default=d.weights,
        help="once's matmul weights: fp32 (default) or q8_0 (compare with llama.cpp's Q8_0 row)",
    )
    p.add_argument("--json", action="store_true", help="print the results JSON to stdout")
    p.add_argument("--out", type=Path, default=None, help="results file")
    p.add_argument(
        "--prefill-attention-only",
        action="store_true",
        help="only prefill attention at 2k and 8k context, once vs torch SDPA (seconds)",
    )
    contention.add_arguments(p)
    step_profile.add_arguments(p)
    return p


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    if args.output_tokens < 2 or args.decode_steps < 1 or args.prompt_tokens < 1:
        raise ValueError("need --output-tokens >= 2, --decode-steps >= 1, --prompt-tokens >= 1")
    if args.session_probes < 0:
        raise ValueError("need --session-probes >= 0")
    return BenchOptions(
        model=args.model,
        concurrency=args.concurrency,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        ctx_long=args.ctx_long,
        decode_steps=args.decode_steps,
        session=once_side.SessionShape(
            num_turns=args.session_turns,
            system_tokens=args.session_system,
            task_tokens=args.session_task,
            new_tokens=args.session_new,
            output_tokens=args.session_output,
            last_turn_probes=args.session_probes,
        ),
        num_threads=args.threads,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_gib=args.kv_cache_gib,
        skip_hf=args.skip_hf,
        baselines=args.baseline,
        vllm_compiled=args.vllm_compiled,
        vllm_dtype=args.vllm_dtype,
        seed=args.seed,
        weights=args.weights,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.contention:
        return _contention(args)
    if args.prefill_attention_only:
        return _prefill_attention_only(args)
    if args.profile:
        return step_profile.main(args)
    args.out = args.out or DEFAULT_OUT
    try:
        options = options_from_args(args)
        results = run_benchmark(options)
    except ValueError as exc:
        print(f"once bench engine: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2, default=str)
    args.out.write_text(text + "\n")
    print(report.render_table(results), file=sys.stderr)
    print(f"results written to {args.out}", file=sys.stderr)
    if args.json:
        print(text)
    return 0


def _contention(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.output_tokens < 2:
        print("once bench engine: need --repeats >= 1 and --output-tokens >= 2", file=sys.stderr)
        return 2
    results = contention.run(args)
    out = args.out or CONTENTION_OUT
    contention.write(results, out)
    print(contention.render(results), file=sys.stderr)
    print(f"results written to {out}", file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def _prefill_attention_only(args: argparse.Namespace) -> int:
    """The prefill-attention part of the run alone: the model's head shape, no engine."""
    import torch

    from once.engine.loader import model_config_from_hf, resolve_model_path

    folder = resolve_model_path(args.model)
    config = model_config_from_hf(json.loads((folder / "config.json").read_text()), folder)
    torch.set_num_threads(args.threads)
    started, cpu_start = time.perf_counter(), report.cpu_snapshot()
    measured = prefill_attention.measure(
        config.num_heads, config.num_kv_heads, config.head_dim, _log_stderr
    )
    machine = report.machine_info(args.threads)
    machine["other_cpu_load"] = report.other_cpu_load(cpu_start, report.cpu_snapshot())
    figures = {name: measured[name] for name in ("prefill_vs_sdpa_2k", "prefill_vs_sdpa_8k")}
    results = {
        "benchmark": "engine",
        "part": "prefill_attention",
        "model": args.model,
        "num_threads": args.threads,
        "machine": machine,
        "once": {"prefill_attention": measured},
        **figures,
        "bars": {n: bar for n, bar in report.bars(figures).items() if n in figures},
        "elapsed_s": time.perf_counter() - started,
    }
    out = args.out or PREFILL_ATTENTION_OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2)
    out.write_text(text + "\n")
    print("\n".join(report.prefill_attention_lines(measured)), file=sys.stderr)
    for name, bar in results["bars"].items():
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[bar["pass"]]
        line = f"  {name:<28} {bar['value']:.3f} {bar['op']} {bar['threshold']} {verdict}"
        print(line, file=sys.stderr)
    print(f"results written to {out}", file=sys.stderr)
    if args.json:
        print(text)
    return 0


def _log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
