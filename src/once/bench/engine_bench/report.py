"""Headline ratios, the bars they are held to, machine facts and the table for humans."""

import os
import platform
import resource
import sys
import time

# name -> (comparison, threshold). Ratios are once / transformers unless named otherwise.
BARS = {
    "throughput_ratio_c32": (">=", 2.5),
    "step_ratio_b1": ("<=", 0.6),
    "step_ratio_b1_ctx8k": ("<=", 0.3),
    "session_computed_over_new": ("<=", 1.15),
    "session_ttft_ratio_20_1": ("<=", 2.0),
    # Prefill attention, 512-token chunks, once over torch SDPA (prefill_attention.py).
    "prefill_vs_sdpa_2k": (">=", 1.0),
    "prefill_vs_sdpa_8k": (">=", 1.0),
    # The serving peers (issue 29): once / vLLM's server and once / llama.cpp output tok/s,
    # and once's turn-20 TTFT over vLLM's on the same session.
    "vllm_tok_s_ratio_c1": (">=", 1.0),
    "vllm_tok_s_ratio_c32": (">=", 1.0),
    "vllm_ttft_ratio_turn20": ("<=", 0.8),
    # llama.cpp's f32 row: the same weights at the same precision as once's.
    "llamacpp_tok_s_ratio_c1": (">=", 1.0),
}


def _ratio(numerator, denominator):
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def headline(results: dict) -> dict:
    """The headline figures; None where the run did not measure them."""
    once, hf = results["once"], results.get("transformers") or {}
    max_c = max(once["throughput"], key=int, default=None)
    once_c = once["throughput"].get(max_c, {})
    hf_c = hf.get("throughput", {}).get(max_c, {})
    once_c1 = once["throughput"].get("1", {})
    hf_c1 = hf.get("throughput", {}).get("1", {})
    once_long = once.get("long_context") or {}
    hf_long = hf.get("long_context") or {}
    session = (results.get("session") or {}).get("cached") or {}
    return {
        # Named after the default run (c32, 8k, 20 turns); `sizes` says what was measured.
        "throughput_ratio_c32": _ratio(once_c.get("output_tok_s"), hf_c.get("output_tok_s")),
        "step_ratio_b1": _ratio(once_c1.get("decode_step_ms"), hf_c1.get("decode_step_ms")),
        "step_ratio_b1_ctx8k": _ratio(
            once_long.get("decode_step_ms"), hf_long.get("decode_step_ms")
        ),
        "session_computed_over_new": session.get("computed_over_new"),
        "session_ttft_ratio_20_1": session.get("ttft_ratio_last_first"),
        "prefill_vs_sdpa_2k": (once.get("prefill_attention") or {}).get("prefill_vs_sdpa_2k"),
        "prefill_vs_sdpa_8k": (once.get("prefill_attention") or {}).get("prefill_vs_sdpa_8k"),
        **peer_figures(results),
    }


def peer_figures(results: dict) -> dict:
    """once over each serving peer: vLLM (`vllm_*`), llama.cpp's like-for-like f32 row
    (`llamacpp_*`) and its quantized rows (`llamacpp_q8_0_*`, `llamacpp_q4_1_*`)."""
    figures = peer_ratios("vllm", results, results.get("vllm") or {})
    figures["vllm_session_computed_over_new"] = (
        (results.get("vllm") or {}).get("session") or {}
    ).get("computed_over_new")
    llama = results.get("llama_cpp") or {}
    rows = llama.get("rows") or {}
    for precision, row in rows.items():
        prefix = "llamacpp" if precision == llama.get("like_for_like") else f"llamacpp_{precision}"
        figures |= peer_ratios(prefix, results, row)
    if not rows:
        figures |= peer_ratios("llamacpp", results, {})
    return figures


def peer_ratios(prefix: str, results: dict, peer: dict) -> dict:
    """once / peer: output tok/s per concurrency (higher is better for once), decode step ms
    at the short and the long context and turn-20 TTFT (lower is better for once)."""
    once = results["once"]
    figures = {}
    for c, row in once["throughput"].items():
        other = peer.get("throughput", {}).get(c, {})
        figures[f"{prefix}_tok_s_ratio_c{c}"] = _ratio(
            row["output_tok_s"], other.get("output_tok_s")
        )
    # The bar's name is the default run's (c32), as throughput_ratio_c32's: the most
    # concurrent requests measured.
    max_c = max(once["throughput"], key=int, default=None)
    figures[f"{prefix}_tok_s_ratio_c32"] = figures.get(f"{prefix}_tok_s_ratio_c{max_c}")
    decode = peer.get("decode", {})
    once_c1 = once["throughput"].get("1", {})
    short = (results.get("options") or {}).get("prompt_tokens")
    figures[f"{prefix}_step_ratio_b1"] = _ratio(
        once_c1.get("decode_step_ms"), decode.get(str(short), {}).get("decode_step_ms")
    )
    once_long = once.get("long_context") or {}
    figures[f"{prefix}_step_ratio_b1_ctx_long"] = _ratio(
        once_long.get("decode_step_ms"),
        decode.get(str(once_long.get("context_tokens")), {}).get("decode_step_ms"),
    )
    once_session = (results.get("session") or {}).get("cached") or {}
    peer_session = peer.get("session") or {}
    once_turns, peer_turns = once_session.get("turns") or [], peer_session.get("turns") or []
    if once_turns and peer_turns:
        # The bar reads the median of the last turn and its probes on each side; the last
        # turn's one TTFT stays beside it.
        figures[f"{prefix}_ttft_ratio_turn20"] = _ratio(
            once_session.get("last_turn_ttft_median_ms", once_turns[-1]["ttft_ms"]),
            peer_session.get("last_turn_ttft_median_ms", peer_turns[-1]["ttft_ms"]),
        )
        figures[f"{prefix}_ttft_ratio_turn20_single"] = _ratio(
            once_turns[-1]["ttft_ms"], peer_turns[-1]["ttft_ms"]
        )
    else:
        figures[f"{prefix}_ttft_ratio_turn20"] = None
        figures[f"{prefix}_ttft_ratio_turn20_single"] = None
    return figures


def bars(figures: dict) -> dict:
    out = {}
    for name, (op, threshold) in BARS.items():
        value = figures.get(name)
        passed = None
        if value is not None:
            passed = value >= threshold if op == ">=" else value <= threshold
        out[name] = {"value": value, "op": op, "threshold": threshold, "pass": passed}
    return out


def cpu_snapshot() -> tuple[float, float, float]:
    """(wall s, machine busy CPU s, the bench's own CPU s), for `other_cpu_load`."""
    busy = 0.0
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # - idle, iowait
    except (OSError, ValueError, IndexError):
        pass
    # This process and its children once they ended (a peer's server the bench started and
    # stopped): a peer's work is the bench's own, not other load.
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        own += usage.ru_utime + usage.ru_stime
    return time.perf_counter(), busy, own


def other_cpu_load(start: tuple, end: tuple) -> float | None:
    """Cores kept busy by other processes during the run, on average (0 on a quiet box).

    Torch's OpenMP threads stall at every barrier when a core is taken by someone else,
    so a run with this above ~0.2 measures the neighbors as much as the engines.
    """
    wall = end[0] - start[0]
    if wall <= 0 or end[1] == 0.0:
        return None
    return max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / wall


def machine_info(num_threads: int) -> dict:
    import torch
    import transformers

    cpu_model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "num_threads": num_threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def _fmt(value, spec=".1f") -> str:
    return "-" if value is None else format(value, spec)


def render_table(results: dict) -> str:
    once, hf = results["once"], results.get("transformers") or {}
    lines = [f"once bench engine  model={results['model']}  threads={results['num_threads']}"]
    lines.append("")
    lines.append("throughput       once tok/s  hf tok/s  ratio   once step ms  hf step ms")
    for c, row in once["throughput"].items():
        peer = hf.get("throughput", {}).get(c, {})
        lines.append(
            f"  c{c:<13} {_fmt(row['output_tok_s']):>10}  {_fmt(peer.get('output_tok_s')):>8}"
            f"  {_fmt(_ratio(row['output_tok_s'], peer.get('output_tok_s')), '.2f'):>5}"
            f"   {_fmt(row['decode_step_ms']):>12}  {_fmt(peer.get('decode_step_ms')):>10}"
        )
    long_once, long_hf = once.get("long_context"), hf.get("long_context") or {}
    if long_once:
        lines.append(
            f"  b1 @ {long_once['context_tokens']} ctx: step ms once "
            f"{_fmt(long_once['decode_step_ms'])} hf {_fmt(long_hf.get('decode_step_ms'))}; "
            f"prefill tok/s once {_fmt(long_once['prefill_tok_s'])} "
            f"hf {_fmt(long_hf.get('prefill_tok_s'))}"
        )
    lines.extend(prefill_attention_lines(once.get("prefill_attention") or {}))
    session = results.get("session") or {}
    if session:
        lines.append("")
        lines.append(
            "session turn  prompt   new  | cache: computed cached ttft ms"
            " | no cache: computed ttft ms"
        )
        cached, uncached = session["cached"], session["uncached"]
        for a, b in zip(cached["turns"], uncached["turns"], strict=True):
            lines.append(
                f"  {a['turn']:>10}  {a['prompt_tokens']:>6} {a['new_tokens']:>5}  |"
                f" {a['computed_tokens']:>15} {a['cached_tokens']:>6} {a['ttft_ms']:>7.0f}"
                f" | {b['computed_tokens']:>18} {b['ttft_ms']:>7.0f}"
            )
        lines.append(
            f"  total computed/new: cache {cached['computed_over_new']:.3f}, "
            f"no cache {uncached['computed_over_new']:.3f}"
        )
    lines.extend(vllm_lines(results))
    lines.extend(llama_lines(results))
    lines.append("bars:")
    for name, bar in results["bars"].items():
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[bar["pass"]]
        lines.append(
            f"  {name:<28} {_fmt(bar['value'], '.3f'):>8} {bar['op']} {bar['threshold']:<5}"
            f" {verdict}"
        )
    return "\n".join(lines)


def prefill_attention_lines(prefill: dict) -> list[str]:
    lines = []
    for label in ("2k", "8k"):
        if f"prefill_vs_sdpa_{label}" in prefill:
            ways = ("once", "sdpa", "masked", "two_flash")
            rates = [prefill.get(f"prefill_attention_tok_s_{label}_{way}", 0) for way in ways]
            lines.append(
                f"  prefill attention @ {label} ctx, {prefill['chunk_tokens']}-token chunk, "
                f"tok/s per layer: once {rates[0]:.0f} torch SDPA {rates[1]:.0f} "
                f"(masked SDPA on the gathered context {rates[2]:.0f}, two flash calls "
                f"merged {rates[3]:.0f}); once / SDPA {prefill[f'prefill_vs_sdpa_{label}']:.3f}"
            )
    return lines


def vllm_lines(results: dict) -> list[str]:
    vllm = results.get("vllm")
    if vllm is None:
        return []
    if vllm.get("status") != "ok":
        return ["", f"vLLM: {vllm.get('status')} {vllm.get('reason', '')}".rstrip()]
    mode = "eager" if vllm.get("eager") else "compiled"
    dtype = vllm.get("dtype", "float32")
    like = " (like for like)" if dtype == "float32" else ", not like for like: once runs fp32"
    lines = ["", f"vLLM server ({mode}, {dtype}{like}, started in {vllm['startup_s']:.0f} s)"]
    return lines + peer_lines(results, vllm, "vLLM")


def llama_lines(results: dict) -> list[str]:
    llama = results.get("llama_cpp")
    if llama is None:
        return []
    if llama.get("status") != "ok":
        return ["", f"llama.cpp: {llama.get('status')} {llama.get('reason', '')}".rstrip()]
    lines = []
    for precision, row in llama["rows"].items():
        like = " (like for like)" if precision == llama.get("like_for_like") else ""
        lines += ["", f"llama-server {precision}{like}, K/V {row['kv_type']}, {llama['version']}"]
        if row.get("status") == "error":
            lines.append(f"  error, figures up to it kept: {row['reason']}")
        lines += peer_lines(results, row, "llama.cpp")
    return lines


def peer_lines(results: dict, peer: dict, name: str) -> list[str]:
    lines = []
    once_tp = results["once"]["throughput"]
    for c, row in peer["throughput"].items():
        agreement = row.get("greedy_agreement") or {}
        lines.append(
            f"  c{c:<4} tok/s once {_fmt(once_tp.get(c, {}).get('output_tok_s'))} "
            f"{name} {_fmt(row['output_tok_s'])}; greedy outputs equal "
            f"{agreement.get('num_equal', '-')}/{agreement.get('num_requests', '-')}"
        )
    for context, row in peer["decode"].items():
        lines.append(
            f"  decode @ {context} ctx: {name} step ms {_fmt(row['decode_step_ms'])}, "
            f"prefill tok/s {_fmt(row['prefill_tok_s'])}"
        )
    session = peer.get("session")
    if session:
        turns = session["turns"]
        lines.append(
            f"  session: computed/new {session['computed_over_new']:.3f}, TTFT turn 1 "
            f"{turns[0]['ttft_ms']:.0f} ms, turn {turns[-1]['turn']} {turns[-1]['ttft_ms']:.0f} ms"
        )
    return lines
