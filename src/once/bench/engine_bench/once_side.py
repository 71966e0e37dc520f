"""The once engine's side: throughput, decode step time and the multi-turn session."""

import random
import statistics
import time
from dataclasses import dataclass

from once.bench.engine_bench.workloads import random_ids
from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.protocol.engine import GenerateRequest, RequestMetrics, SamplingParams


def greedy(num_tokens: int) -> SamplingParams:
    # ignore_eos: every request produces exactly num_tokens, as min_new_tokens does in HF.
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)


def make_engine(model: str, num_threads: int, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, num_threads=num_threads, **overrides))


def warm_up(engine: LLMEngine, vocab_size: int) -> None:
    """One short request so that first-call costs stay out of every measurement."""
    prompt = tuple(random_ids(random.Random("warm-up"), 32, vocab_size))
    engine.generate([GenerateRequest("warm-up", prompt, greedy(4))])


def _work_done(engine: LLMEngine) -> tuple[int, int, int]:
    stats = engine.stats()
    return (
        stats["num_computed_prompt_tokens"],
        stats["num_recomputed_tokens"],
        stats["num_generated_tokens"],
    )


def run_timed(engine: LLMEngine, requests: list[GenerateRequest]) -> dict:
    """Submit all requests at once and step until all finish, timing every step.

    A step is decode-only when the engine's counters show it prefilled no prompt token
    and recomputed none, yet generated some: chunked-prefill steps (which may also carry
    decodes) never enter the decode mean.
    """
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    metrics: dict[str, RequestMetrics] = {}
    decode_step_s: list[float] = []
    started = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    before = _work_done(engine)
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - t0
        after = _work_done(engine)
        if after[:2] == before[:2] and after[2] > before[2]:
            decode_step_s.append(elapsed)
        before = after
        for delta in deltas:
            outputs[delta.request_id].extend(delta.token_ids)
            if delta.metrics is not None:
                metrics[delta.request_id] = delta.metrics
    elapsed_s = time.perf_counter() - started
    num_output = sum(len(ids) for ids in outputs.values())
    return {
        "elapsed_s": elapsed_s,
        "num_output_tokens": num_output,
        "output_tok_s": num_output / elapsed_s,
        "num_decode_steps": len(decode_step_s),
        "decode_step_ms": 1000 * sum(decode_step_s) / len(decode_step_s) if decode_step_s else None,
        "outputs": outputs,
        "metrics": metrics,
    }


def measure_throughput(engine: LLMEngine, prompts: list[list[int]], num_output: int) -> dict:
    requests = [
        GenerateRequest(f"c{len(prompts)}-{i}", tuple(p), greedy(num_output))
        for i, p in enumerate(prompts)
    ]
    result = run_timed(engine, requests)
    expected = len(prompts) * num_output
    if result["num_output_tokens"] != expected:
        raise RuntimeError(
            f"once produced {result['num_output_tokens']} tokens, expected {expected}"
        )
    return {
        "concurrency": len(prompts),
        "elapsed_s": result["elapsed_s"],
        "output_tok_s": result["output_tok_s"],
        "decode_step_ms": result["decode_step_ms"],
        "num_decode_steps": result["num_decode_steps"],
        "num_cached_tokens": sum(m.num_cached_tokens for m in result["metrics"].values()),
        # In prompt order, for the greedy check against a peer; the CLI keeps them out of
        # the results file.
        "outputs": [result["outputs"][r.request_id] for r in requests],
    }


def measure_long_context(engine: LLMEngine, prompt: list[int], num_decode: int) -> dict:
    """Prefill `prompt`, then time `num_decode` single-sequence decode steps after it."""
    request = GenerateRequest(f"ctx-{len(prompt)}", tuple(prompt), greedy(num_decode + 1))
    result = run_timed(engine, [request])
    prefill_s = result["metrics"][request.request_id].ttft_s
    return {
        "context_tokens": len(prompt),
        "decode_step_ms": result["decode_step_ms"],
        "num_decode_steps": result["num_decode_steps"],
        "prefill_s": prefill_s,
        "prefill_tok_s": len(prompt) / prefill_s,
    }


@dataclass(frozen=True)
class SessionShape:
    num_turns: int = 20
    system_tokens: int = 1000
    task_tokens: int = 100
    new_tokens: int = 300  # appended by each later turn, after the previous output
    output_tokens: int = 64
    # Requests shaped like the last turn, sent after it (SessionPrompts.probe): its TTFT is
    # read as the median of the last turn and these, since one first token swings with
    # the machine's other load (vLLM's turn 20 read 1.5-1.8 s over quiet runs).
    last_turn_probes: int = 4

    @property
    def max_tokens(self) -> int:
        """Prompt plus output of the last turn: the context the engine must hold."""
        first = self.system_tokens + self.task_tokens
        return (
            first
            + (self.num_turns - 1) * (self.output_tokens + self.new_tokens)
            + (self.output_tokens)
        )


class SessionPrompts:
    """The session's prompts, turn by turn, for every engine measured: turn 1 is the
    system prompt plus the task, all of it new; turn k > 1 is turn k-1's prompt + its
    output + `new_tokens` fresh ids (new = output + fresh). The fresh ids come from one
    seeded stream, so every run sees the same text."""

    def __init__(self, shape: SessionShape, vocab_size: int, seed: str):
        self.shape, self.vocab_size, self.seed = shape, vocab_size, seed
        self.rng = random.Random(seed)
        self.prompt = random_ids(self.rng, shape.system_tokens + shape.task_tokens, vocab_size)
        self.num_new = len(self.prompt)

    def advance(self, output: list[int]) -> None:
        fresh = random_ids(self.rng, self.shape.new_tokens, self.vocab_size)
        self.prompt = self.prompt + output + fresh
        self.num_new = len(output) + len(fresh)

    def probe(self, k: int) -> list[int]:
        """The current prompt with its fresh ids swapped for the k-th other seeded draw of
        the same length: the same cached prefix and the same tokens to compute (nothing
        of one probe is cached for the next), so its first token times that turn again."""
        num_fresh = self.shape.new_tokens
        rng = random.Random(f"{self.seed}/probe-{k}")
        return self.prompt[:-num_fresh] + random_ids(rng, num_fresh, self.vocab_size)


def session_summary(
    turns: list[dict], prefix_caching: bool, started: float, probes: list[dict]
) -> dict:
    """The session's ledger from its turns (prompt, new, computed, cached, TTFT each), and
    the last turn's TTFT as the median of it and its probes (TTFT, computed tokens each)."""
    total_new = sum(t["new_tokens"] for t in turns)
    total_computed = sum(t["computed_tokens"] for t in turns)
    return {
        "prefix_caching": prefix_caching,
        "elapsed_s": time.perf_counter() - started,
        "total_prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "total_new_tokens": total_new,
        "total_computed_tokens": total_computed,
        "total_cached_tokens": sum(t["cached_tokens"] for t in turns),
        "computed_over_new": total_computed / total_new,
        "ttft_ratio_last_first": turns[-1]["ttft_ms"] / turns[0]["ttft_ms"],
        "last_turn_probes": probes,
        "last_turn_ttft_median_ms": statistics.median(
            [turns[-1]["ttft_ms"], *(probe["ttft_ms"] for probe in probes)]
        ),
        "turns": turns,
    }


def num_probes(shape: SessionShape) -> int:
    """Probes need a last turn with a cached prefix before its fresh ids (turn 2 on)."""
    return shape.last_turn_probes if shape.num_turns > 1 and shape.new_tokens > 0 else 0


def run_session(engine: LLMEngine, shape: SessionShape, vocab_size: int, seed: str) -> dict:
    """Play the session (SessionPrompts) turn by turn, one request at a time, and keep the
    ledger.

    With the cache a later turn computes its fresh ids plus the tail of the previous turn
    that fills no whole block (at least the last output token, sampled but never run
    through the model): between fresh + 1 and fresh + block_size tokens. The previous
    output counts as new yet its KV was computed while decoding it, so computed/new can
    sit a little below 1.
    """
    prompts = SessionPrompts(shape, vocab_size, seed)
    output: list[int] = []
    turns = []
    started = time.perf_counter()
    for turn in range(1, shape.num_turns + 1):
        if turn > 1:
            prompts.advance(output)
        prompt = prompts.prompt
        request = GenerateRequest(f"turn-{turn}", tuple(prompt), greedy(shape.output_tokens))
        deltas = engine.generate([request])[request.request_id]
        output = [t for d in deltas for t in d.token_ids]
        metrics = deltas[-1].metrics
        assert metrics is not None  # the finished delta carries them
        turns.append(
            {
                "turn": turn,
                "prompt_tokens": len(prompt),
                "new_tokens": prompts.num_new,
                "computed_tokens": metrics.num_computed_tokens,
                "cached_tokens": metrics.num_cached_tokens,
                "ttft_ms": 1000 * metrics.ttft_s,
                "e2e_ms": 1000 * metrics.e2e_s,
            }
        )
    probes = []
    # Without a prefix cache a probe recomputes the whole prompt: no probes there.
    for k in range(num_probes(shape) if engine.config.enable_prefix_caching else 0):
        probe = GenerateRequest(
            f"turn-{shape.num_turns}-probe-{k}", tuple(prompts.probe(k)), greedy(1)
        )
        metrics = engine.generate([probe])[probe.request_id][-1].metrics
        assert metrics is not None
        probes.append(
            {"ttft_ms": 1000 * metrics.ttft_s, "computed_tokens": metrics.num_computed_tokens}
        )
    return session_summary(turns, engine.config.enable_prefix_caching, started, probes)
