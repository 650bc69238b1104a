"""`bench/serving.py --ratio-sweep` and `--phased`: the P:D split against the traffic mix.

One stack of four `--role-switch` workers is started once; each configuration sets the workers'
roles (a switch of idle workers takes milliseconds), then runs the same schedule of requests:

    static splits   4 colocated, 1P+3D, 2P+2D, 3P+1D (`--ratio-sweep`; or `--split-configs`)
    planner         starts at 2P+2D; `splitserve planner`'s loop (in this process) moves workers

`--phased` makes the schedule phases of different traffic back to back (default 512/512, then
4096/256, then mixed, `--phase-s` each, Poisson arrivals at each phase's rate); without it, each
`--workloads` entry at each rate is a schedule of its own. Goodput (requests meeting the SLO per
second of arrivals) under three SLOs:

    relaxed      TTFT <= 1 s, TPOT <= 40 ms
    interactive  TTFT <= 1 s, TPOT <= 15 ms
    smooth       TTFT <= 2 s, TPOT <= 20 ms, no gap between tokens over 100 ms

and the split over time (sampled from the registry; the planner's moves with their reasons), as
a JSON series, a text timeline and, when matplotlib is installed, a plot.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import table, write_results
from bench.serving_load import Record, run_schedule
from bench.split_control import SPLITS, PlannerThread, SplitSampler, set_split

SLOS = {  # name: (TTFT s, TPOT s, largest gap s or None)
    "relaxed": (1.0, 0.040, None),
    "interactive": (1.0, 0.015, None),
    "smooth": (2.0, 0.020, 0.100),
}
PLANNER = "planner"
PLANNER_START = "2P+2D"
DEFAULT_PHASES = ("512/512@48", "4096/256@16", "mixed@20")
SMOKE_PHASES = ("24/16@3", "120/4@2", "48/8@3")


@dataclass(frozen=True)
class Phase:
    spec: str  # IN/OUT@RATE or mixed@RATE
    duration_s: float


def meets(r: Record, slo: str) -> bool:
    ttft, tpot, gap = SLOS[slo]
    if r.status != "OK" or not r.token_times or r.ttft > ttft or r.tpot > tpot:
        return False
    if gap is None:
        return True
    times = r.token_times
    return all(b - a <= gap for a, b in zip(times, times[1:], strict=False))


def schedule(
    phases: list[Phase], vocab: int, seed: int, workload_cls: Any
) -> tuple[list[tuple[list[int], int, float]], list[int]]:
    """Every request (prompt, max tokens, arrival offset) of the phases back to back, and the
    phase index of each."""
    import random

    items, phase_of, start = [], [], 0.0
    for i, phase in enumerate(phases):
        workload = workload_cls.parse(phase.spec)
        rate = workload.rates[0]
        rng = random.Random(seed + i)
        offsets, t = [], rng.expovariate(rate)
        while t < phase.duration_s:
            offsets.append(start + t)
            t += rng.expovariate(rate)
        for (prompt, out), offset in zip(
            workload.requests(len(offsets), vocab, seed + 100 * i), offsets, strict=True
        ):
            items.append((prompt, out, offset))
            phase_of.append(i)
        start += phase.duration_s
    return items, phase_of


def fresh_prompts(
    items: list[tuple[list[int], int, float]], vocab: int, seed: int
) -> list[tuple[list[int], int, float]]:
    """The same schedule with new random token ids in every prompt (same lengths)."""
    import random

    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in p], out, at) for p, out, at in items]


def summarize(records: list[Record], phase_of: list[int], phases: list[Phase]) -> dict[str, Any]:
    from bench.serving import summarize as base

    window = sum(p.duration_s for p in phases)
    out = base(records, window)
    out["goodput"] = {slo: sum(meets(r, slo) for r in records) / window for slo in SLOS}
    out["attainment"] = {
        slo: sum(meets(r, slo) for r in records) / max(1, len(records)) for slo in SLOS
    }
    out["phases"] = []
    for i, phase in enumerate(phases):
        mine = [r for r, p in zip(records, phase_of, strict=True) if p == i]
        out["phases"].append({
            "phase": phase.spec, "requests": len(mine),
            **{f"goodput_{slo}": sum(meets(r, slo) for r in mine) / phase.duration_s
               for slo in SLOS},
        })  # fmt: skip
    return out


def timeline(series: list[dict[str, Any]], moves: list[dict[str, Any]]) -> str:
    """The split over time as text: one entry per change, the planner's moves beside."""
    parts = []
    for p in series:
        split = (f"{p['colocated']} colocated" if p["colocated"]
                 else f"{p['prefill']}P+{p['decode']}D")  # fmt: skip
        parts.append(f"{p['t_s']:.0f}s {split}")
    text = " -> ".join(parts) or "(no samples)"
    for m in moves:
        text += f"\n    {m['t_s']:.0f}s {m.get('move', m.get('error'))}: {m.get('reason', '')}"
    return text


def plot(results: list[dict[str, Any]], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (the text timeline above)"
    fig, ax = plt.subplots(figsize=(8, 3))
    for r in results:
        xs = [p["t_s"] for p in r["split_series"]] + [r["window_s"]]
        ys = [p["prefill"] for p in r["split_series"]]
        ax.step(xs, [*ys, ys[-1]] if ys else [0], where="post", label=r["config"])
    ax.set_xlabel("seconds")
    ax.set_ylabel("prefill workers")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return f"plot: {path}"


def _row(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "config": r["config"], "schedule": r["schedule"], "ok": f"{r['ok']}/{r['requests']}",
        "TTFT p50/p90 ms": f"{r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p90_s'] * 1e3:.0f}",
        "TPOT p50/p90 ms": f"{r['tpot_p50_s'] * 1e3:.1f} / {r['tpot_p90_s'] * 1e3:.1f}",
        **{f"{slo} req/s": round(r["goodput"][slo], 2) for slo in SLOS},
        "errors": ",".join(f"{k}:{v}" for k, v in r["errors"].items()) or "-",
    }  # fmt: skip


def verdict(results: list[dict[str, Any]]) -> list[str]:
    """The issue's acceptance, read off this run: planner vs the best static split and
    colocated, per schedule."""
    lines = []
    for name in dict.fromkeys(r["schedule"] for r in results):
        runs = {r["config"]: r for r in results if r["schedule"] == name}
        if PLANNER not in runs:
            continue
        planner = runs[PLANNER]["goodput"]
        statics = {k: v["goodput"] for k, v in runs.items() if k not in (PLANNER, "4 colocated")}
        if statics:
            best = max(statics, key=lambda k: statics[k]["interactive"])
            ratio = planner["interactive"] / max(statics[best]["interactive"], 1e-9)
            lines.append(f"{name}: interactive goodput planner/best static ({best}) = {ratio:.2f}x "
                         f"(want >= 1.2)")  # fmt: skip
        if "4 colocated" in runs:
            colo = runs["4 colocated"]["goodput"]
            ratio = planner["interactive"] / max(colo["interactive"], 1e-9)
            lines.append(f"{name}: interactive goodput planner/colocated = {ratio:.2f}x (want >= "
                         f"1.5); relaxed {planner['relaxed']:.2f} vs {colo['relaxed']:.2f} req/s "
                         "(want no worse)")  # fmt: skip
    return lines


def schedules(args: argparse.Namespace, workload_cls: Any) -> list[tuple[str, list[Phase]]]:
    if args.phased:
        specs = SMOKE_PHASES if args.smoke and not args.phases else (args.phases or DEFAULT_PHASES)
        duration_s = min(args.phase_s, 2.0) if args.smoke else args.phase_s
        phases = [Phase(s, duration_s) for s in specs]
        return [("phased " + " | ".join(specs), phases)]
    out = []
    for spec in args.workloads:
        w = workload_cls.parse(spec)
        for rate in w.rates or args.rates:
            out.append((f"{w.name}@{rate:g}", [Phase(f"{w.name}@{rate:g}", args.duration_s)]))
    return out


def warm_up(stack: Any, phases: list[Phase], vocab: int, args: argparse.Namespace) -> None:
    """A few requests of every phase's shape with every worker colocated, then split: each
    worker has run prefill and decode (kernels compiled, graphs captured) and every KV path
    is open before anything is measured."""
    from bench.serving import Workload

    items = []
    for i, phase in enumerate(phases):
        for prompt, _ in Workload.parse(phase.spec).requests(4, vocab, seed=900 + i):
            items.append((prompt, 8, 0.05 * len(items)))
    for split in ("4 colocated", PLANNER_START):
        set_split(stack, split, 4)
        run_schedule(stack.address, items, args.timeout_s, 1)


def run(args: argparse.Namespace, model: Path, vocab: int) -> dict[str, Any]:
    """Every configuration on every schedule, on one stack of `--role-switch` workers."""
    from bench.serving import Workload, _stack

    configs = list(args.split_configs) or ([*SPLITS, PLANNER] if args.phased else [*SPLITS])
    unknown = set(configs) - {*SPLITS, PLANNER}
    if unknown:
        raise SystemExit(f"--split-configs: unknown {sorted(unknown)}; choose from "
                         f"{[*SPLITS, PLANNER]}")  # fmt: skip
    args.worker_args = [*args.worker_args, "--role-switch"]
    if args.local_prefill_tokens:
        args.gateway_args = [*args.gateway_args, "--local-prefill-tokens",
                             str(args.local_prefill_tokens)]  # fmt: skip
    stack = _stack(args, model, PLANNER_START)
    results: list[dict[str, Any]] = []
    try:
        warm_up(stack, [p for _, ps in schedules(args, Workload) for p in ps], vocab, args)
        for name, phases in schedules(args, Workload):
            items, phase_of = schedule(phases, vocab, args.seed, Workload)
            for k, config in enumerate(configs):
                # NOTE: the same lengths and arrivals, fresh token ids: no configuration finds
                # another's prompts in a prefix cache.
                items = fresh_prompts(items, vocab, args.seed + 1000 * (k + 1))
                set_split(stack, PLANNER_START if config == PLANNER else config, 4)
                sampler = SplitSampler(stack).start()
                planner = PlannerThread(stack, args).start() if config == PLANNER else None
                t0 = time.monotonic()
                records = run_schedule(stack.address, items, args.timeout_s, args.client_processes)
                moves = planner.stop() if planner is not None else []
                pages = len(planner.source.metrics_urls) if planner is not None else 0
                series = sampler.stop()
                s = summarize(records, phase_of, phases)
                r = {"config": config, "schedule": name, "wall_s": time.monotonic() - t0,
                     "split_series": series, "planner_moves": moves,
                     "planner_metrics_pages": pages, **s}  # fmt: skip
                results.append(r)
                print(table([_row(r)], list(_row(r))))
                print("  split: " + timeline(series, moves), flush=True)
                write_results(args.out, _result(args, results))
    finally:
        stack.stop()
    rows = [_row(r) for r in results]
    if rows:
        print("\n" + table(rows, list(rows[0])))
    for line in verdict(results):
        print(line)
    print(plot(results, args.out.with_suffix(".png")))
    result = _result(args, results)
    write_results(args.out, result)
    return result


def _result(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "benchmark": "serving ratio sweep" + (" (phased)" if args.phased else ""),
        "shape": "tiny llama" if args.smoke else args.shape,
        "smoke": args.smoke,
        "slos": {k: {"ttft_s": a, "tpot_s": b, "max_gap_s": c} for k, (a, b, c) in SLOS.items()},
        "planner": {
            "ttft_slo_s": args.planner_ttft_slo_s,
            "tpot_slo_s": args.planner_tpot_slo_s,
            "min_dwell_s": args.planner_dwell_s,
            "start": PLANNER_START,
        },  # fmt: skip
        "local_prefill_tokens": args.local_prefill_tokens,
        "workers": "4 --role-switch workers, one per GPU, roles set per configuration",
        "prompts": "random token ids, no shared prefix; greedy; EOS ignored",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": results,
        "verdict": verdict(results),
    }


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ratio-sweep", action="store_true",
                        help="run the static splits (4 colocated, 1P+3D, 2P+2D, 3P+1D) on four "
                        "role-switch workers")  # fmt: skip
    parser.add_argument("--phased", action="store_true",
                        help="phases of different traffic back to back, static splits and the "
                        "planner")  # fmt: skip
    parser.add_argument(
        "--phases",
        nargs="+",
        default=[],
        help=f"IN/OUT@RATE or mixed@RATE per phase (default {DEFAULT_PHASES})",
    )
    parser.add_argument("--phase-s", type=float, default=25.0, help="seconds of arrivals each")
    parser.add_argument("--split-configs", nargs="+", default=[],
                        help=f"of {[*SPLITS, PLANNER]} (default: all)")  # fmt: skip
    parser.add_argument(
        "--gateways", type=int, default=0,
        help="gateway processes (0: sized to the host, as `splitserve up` does)",
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--planner-ttft-slo-s", type=float, default=1.0)
    parser.add_argument("--planner-tpot-slo-s", type=float, default=0.015)
    parser.add_argument("--planner-dwell-s", type=float, default=8.0)
    parser.add_argument("--planner-interval-s", type=float, default=2.0)
    parser.add_argument("--planner-drain-s", type=float, default=2.0,
                        help="a planner switch's drain before streams move")  # fmt: skip
    parser.add_argument("--local-prefill-tokens", type=int, default=0,
                        help="the gateway prefills prompts this short on the decode worker "
                        "(conditional disaggregation; 0: off, the default)")  # fmt: skip
