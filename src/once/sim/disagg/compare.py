"""Disaggregated against colocated serving, same replicas, same trace, same offered load.

`once sim --pd` runs the trace once colocated (every replica does both phases, the `once`
policy routes) and then over a grid of disaggregated setups: the P:D splits of the
replicas, the split policy's uncached-prompt threshold, and the decode replicas' token
budget per step. For each SLO it picks the setup with the highest goodput (requests within
both the TTFT and the TPOT SLO, per second) and reports its ratios to colocated:

- default SLOs (the profile's): `pd_goodput_ratio_default`, and the p99 inter-token
  latency and p90 TTFT of that pick against colocated;
- a tight TPOT SLO (25 ms by default), where a colocated step that carries a long
  prefill chunk misses it: `pd_goodput_ratio_tight`.

Goodput is counted over the run's whole span, so a setup that falls behind the arrivals
and finishes late loses on it, as it should.

The setup is chosen on one part of the trace and reported on another (`split_windows`):
the first half of its sessions by arrival is the choice window, where the whole grid runs
and the picks are made; the second half is the evaluation window, where colocated and the
two picks run again and every ratio above is measured. The choice window's own ratios
stay in the report (`choice`), so the gap between choosing and evaluating shows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from once.router.disagg.split import SplitPolicy
from once.sim.capacity import arrival_scale_for_load
from once.sim.compare import ONCE_POLICY, Scenario, ratio, run_cluster
from once.sim.disagg.transfer import PDConfig
from once.sim.metrics import latencies
from once.sim.workload import SimRequest, scale_arrivals

TIGHT_TPOT_SLO_S = 0.025
DEFAULT_THRESHOLDS = (1024, 4096)  # uncached prompt tokens on the decode replica
DEFAULT_DECODE_BUDGETS = (0, 2048)  # decode replicas' tokens per step; 0: the profile's


@dataclass(frozen=True)
class PDGrid:
    # Empty: 1 .. replicas / 2. More prefill than decode replicas starved decode on every
    # trace tried (results/sim_pd_all_splits.json: every split, three decode budgets), and
    # those runs are the slowest.
    num_prefill: tuple[int, ...] = ()
    thresholds: tuple[int, ...] = DEFAULT_THRESHOLDS
    decode_budgets: tuple[int, ...] = DEFAULT_DECODE_BUDGETS
    tight_tpot_slo_s: float = TIGHT_TPOT_SLO_S

    def setups(self, num_replicas: int) -> list[PDConfig]:
        counts = self.num_prefill or tuple(range(1, max(2, num_replicas // 2 + 1)))
        for count in counts:
            if not 1 <= count < num_replicas:
                raise ValueError(f"--pd-prefill {count}: need 1 <= P < {num_replicas} replicas")
        return [
            PDConfig(
                count,
                SplitPolicy(min_uncached_tokens=threshold, prefix_from_decode=True),
                budget or None,
            )
            for count, threshold, budget in itertools.product(
                counts, self.thresholds, self.decode_budgets
            )
        ]


def run_setup(
    requests: Sequence[SimRequest], scenario: Scenario, pd: PDConfig | None, tight_tpot_s: float
) -> dict:
    profile = scenario.profile
    result, row = run_cluster(requests, scenario, ONCE_POLICY, pd)
    served = [s for s in result.states if not s.rejected and s.finish_s is not None]
    num_tight = sum(
        ttft <= profile.ttft_slo_s and tpot <= tight_tpot_s for ttft, tpot in latencies(served)
    )
    row["goodput_rps_tight"] = num_tight / row["duration_s"]
    row["slo_attainment_tight"] = num_tight / len(result.states) if result.states else 0.0
    if pd is not None:
        row["setup"] = {
            "num_prefill": pd.num_prefill,
            "num_decode": scenario.num_replicas - pd.num_prefill,
            "min_uncached_tokens": pd.split.min_uncached_tokens,
            "decode_max_batched_tokens": pd.decode_max_batched_tokens
            or profile.max_num_batched_tokens,
        }
    return row


def split_windows(requests: Sequence[SimRequest]) -> tuple[list[SimRequest], list[SimRequest]]:
    """(choice window, evaluation window): the sessions whose first call arrives before the
    median first arrival, and the rest, with their arrival times moved to start at 0. A
    closed-loop call goes with the call it follows, so no session is cut in two."""
    by_id = {request.request_id: request for request in requests}
    roots = sorted((r for r in requests if r.after is None), key=lambda r: r.arrival_s)
    if len(roots) < 2:
        raise ValueError("the trace needs two sessions or more to choose on one, report on another")
    cut = roots[len(roots) // 2].arrival_s

    def root_arrival(request: SimRequest) -> float:
        seen = 0
        while request.after is not None and request.after in by_id and seen < len(by_id):
            request, seen = by_id[request.after], seen + 1
        return request.arrival_s

    choice, evaluation = [], []
    for request in requests:
        if root_arrival(request) < cut:
            choice.append(request)
        else:
            evaluation.append(replace(request, arrival_s=max(0.0, request.arrival_s - cut)))
    return choice, evaluation


def compare_pd(requests: Sequence[SimRequest], scenario: Scenario, grid: PDGrid) -> dict:
    if not requests:
        raise ValueError("the trace has no requests")
    choice, evaluation = split_windows(requests)
    tight = grid.tight_tpot_slo_s
    profile = scenario.profile
    scales = {}

    def at_load(window: list[SimRequest], name: str) -> list[SimRequest]:
        scales[name] = arrival_scale_for_load(window, profile, scenario.num_replicas, scenario.load)
        return scale_arrivals(window, scales[name])

    chosen_on = at_load(choice, "choice")
    setups = grid.setups(scenario.num_replicas)
    colocated_choice = run_setup(chosen_on, scenario, None, tight)
    sweep = [run_setup(chosen_on, scenario, pd, tight) for pd in setups]
    best_default = max(range(len(sweep)), key=lambda i: sweep[i]["goodput_rps"])
    best_tight = max(range(len(sweep)), key=lambda i: sweep[i]["goodput_rps_tight"])

    reported_on = at_load(evaluation, "evaluation")
    colocated = run_setup(reported_on, scenario, None, tight)
    pick_default = run_setup(reported_on, scenario, setups[best_default], tight)
    pick_tight = (
        pick_default
        if best_tight == best_default
        else run_setup(reported_on, scenario, setups[best_tight], tight)
    )
    return {
        "profile": profile.name,
        "num_replicas": scenario.num_replicas,
        "offered_load": scenario.load,
        "ttft_slo_s": profile.ttft_slo_s,
        "tpot_slo_s": profile.tpot_slo_s,
        "tight_tpot_slo_s": tight,
        "transfer_bandwidth_bytes_per_s": profile.transfer_bandwidth_bytes_per_s,
        "choice_window": _window(choice, scales["choice"]),
        "evaluation_window": _window(evaluation, scales["evaluation"]),
        "colocated": colocated,
        "pick_default": pick_default,
        "pick_tight": pick_tight,
        "pd_goodput_ratio_default": ratio(pick_default["goodput_rps"], colocated["goodput_rps"]),
        "pd_goodput_ratio_tight": ratio(
            pick_tight["goodput_rps_tight"], colocated["goodput_rps_tight"]
        ),
        "pd_p99_itl_ratio": ratio(pick_default["itl_p99_s"], colocated["itl_p99_s"]),
        "pd_p90_ttft_ratio": ratio(pick_default["ttft_p90_s"], colocated["ttft_p90_s"]),
        "choice": {
            "colocated": colocated_choice,
            "pd_goodput_ratio_default": ratio(
                sweep[best_default]["goodput_rps"], colocated_choice["goodput_rps"]
            ),
            "pd_goodput_ratio_tight": ratio(
                sweep[best_tight]["goodput_rps_tight"], colocated_choice["goodput_rps_tight"]
            ),
        },
        "sweep": [_brief(row) for row in sweep],
    }


def _window(requests: list[SimRequest], scale: float) -> dict:
    arrivals = [r.arrival_s for r in requests if r.after is None]
    return {
        "num_requests": len(requests),
        "num_sessions": len(arrivals),
        "trace_span_s": [min(arrivals), max(arrivals)] if arrivals else None,
        "arrival_scale": scale,
    }


def _brief(row: dict) -> dict:
    keys = ("goodput_rps", "goodput_rps_tight", "ttft_p90_s", "itl_p99_s", "tpot_mean_s")
    return {**row["setup"], **{key: row[key] for key in keys}, "pd": row.get("pd", {})}


def format_pd_report(report: dict) -> str:
    colocated = report["choice"]["colocated"]
    lines = [
        f"{report['num_replicas']} x {report['profile']}, offered load "
        f"{report['offered_load']:.2f}, choice window: colocated goodput "
        f"{colocated['goodput_rps']:.2f}/s "
        f"({colocated['goodput_rps_tight']:.2f}/s at TPOT <= "
        f"{report['tight_tpot_slo_s'] * 1000:.0f} ms), p90 TTFT {colocated['ttft_p90_s']:.2f} s, "
        f"p99 ITL {colocated['itl_p99_s'] * 1000:.0f} ms",
        f"{'P:D':>5} {'min tok':>8} {'D budget':>9} {'goodput':>8} {'tight':>7} "
        f"{'p90 TTFT':>9} {'p99 ITL':>8} {'split':>6}",
    ]
    for row in report["sweep"]:
        lines.append(
            f"{row['num_prefill']}:{row['num_decode']:<3} {row['min_uncached_tokens']:>8} "
            f"{row['decode_max_batched_tokens']:>9} {row['goodput_rps']:>8.2f} "
            f"{row['goodput_rps_tight']:>7.2f} {row['ttft_p90_s']:>9.2f} "
            f"{row['itl_p99_s'] * 1000:>7.0f}ms {row['pd']['num_split']:>6}"
        )
    windows = report["choice_window"], report["evaluation_window"]
    lines.append(
        f"chosen on the first {windows[0]['num_sessions']} sessions of the trace (the sweep "
        f"above), reported on the other {windows[1]['num_sessions']} (colocated goodput "
        f"{report['colocated']['goodput_rps']:.2f}/s):"
    )
    for name, key in (("default", "pick_default"), ("tight", "pick_tight")):
        setup = report[key]["setup"]
        lines.append(
            f"pick at {name} SLO: P:D {setup['num_prefill']}:{setup['num_decode']}, "
            f"threshold {setup['min_uncached_tokens']}, decode budget "
            f"{setup['decode_max_batched_tokens']}; goodput ratio "
            f"{report['pd_goodput_ratio_' + name]:.3f} (on the choice window "
            f"{report['choice']['pd_goodput_ratio_' + name]:.3f})"
        )
    lines.append(
        f"default pick vs colocated: p99 ITL {report['pd_p99_itl_ratio']:.3f}x, "
        f"p90 TTFT {report['pd_p90_ttft_ratio']:.3f}x"
    )
    return "\n".join(lines)
