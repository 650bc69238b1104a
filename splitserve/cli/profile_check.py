"""`splitserve profile --check`: start the recommended split as real processes (what
`splitserve up` starts), send it `bench serve`'s load (random-word prompts, Poisson arrivals at
the planned rate, every reply as long as asked) and set the measured TTFT p90 and TPOT p50 beside
the predicted ones.

`bench serve`'s prompts are counted in words; the warm-up requests tell how many tokens a word
makes on this server (its tokenizer, and any template it adds), so that the timed prompts are
about --input-len tokens; the prediction is then made again at the mean lengths the server
reported reading and writing, so that the two figures compare like for like.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from splitserve.client.bench import datasets, load, metrics
from splitserve.client.bench.backends import Target
from splitserve.launch.profile import plan, report
from splitserve.launch.profile.curves import Profile
from splitserve.launch.up import StackSettings, start_stack

NUM_WARMUPS = 4


def _settings(prof: Profile, split: plan.Split) -> StackSettings:
    """What `splitserve up` would be given for the split: `report.check_commands` prints the
    same placement and worker flags (`report.placement`, `report.worker_args`)."""

    def tp(degree: int) -> tuple[str, ...]:
        return ("--tensor-parallel-size", str(degree)) if degree > 1 else ()

    where = report.placement(split, prof)
    return StackSettings(
        model=prof.model,
        prefill=split.num_prefill,
        decode=split.num_decode,
        gateways=1,
        devices=where.devices,
        extra_worker_args=(
            *report.worker_args(prof, where),
            *(("--device", "cpu") if prof.device == "cpu" else ()),
        ),
        extra_prefill_args=tp(split.prefill_tp),
        extra_decode_args=tp(split.decode_tp),
    )


def check(
    prof: Profile,
    best: plan.Prediction,
    work: plan.Workload,
    targets: plan.Targets,
    transfer_bytes_per_s: float,
    num_prompts: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Run the load on the recommended split; the predicted and measured figures."""
    progress(f"check: starting {best.split.label} …")
    stack = start_stack(_settings(prof, best.split))
    try:
        target = Target(backend="grpc", address=stack.address)
        warm = datasets.random_dataset(NUM_WARMUPS, work.input_len, work.output_len, 0.0, 1)
        results, _, _ = load.run_load(target, [(c, 0.0) for c in warm], 1)
        served = [r for r in results if r.success]
        if not served:
            raise RuntimeError(f"every warm-up request failed: {results[0].error}")
        per_word = sum(r.input_tokens for r in served) / len(served) / work.input_len
        num_words = max(1, round(work.input_len / per_word))
        progress(
            f"check: {num_prompts} requests at {work.request_rate:g} req/s, prompts of "
            f"{num_words} words (≈{num_words * per_word:.0f} tokens), {work.output_len} tokens out"
        )
        conversations = datasets.random_dataset(
            num_prompts, num_words, work.output_len, work.range_ratio, 0
        )
        offsets = load.arrival_offsets(num_prompts, work.request_rate)
        results, duration, _ = load.run_load(target, list(zip(conversations, offsets, strict=True)))
    finally:
        stack.stop()
    figures = metrics.compute(results, duration, ("ttft", "tpot"), (50.0, 90.0))
    ok = [r for r in results if r.success]
    if not ok:
        raise RuntimeError(f"no request of the check completed: {results[0].error}")
    served_work = plan.Workload(
        work.request_rate,
        max(1, round(sum(r.input_tokens for r in ok) / len(ok))),
        max(1, round(sum(r.output_tokens for r in ok) / len(ok))),
        work.range_ratio,
    )
    again = plan.predict(prof, best.split, served_work, targets, transfer_bytes_per_s)
    return {
        "split": best.split.label,
        "num_prompts": num_prompts,
        "completed": figures["completed"],
        "failed": figures["failed"],
        "served_input_len": served_work.input_len,
        "served_output_len": served_work.output_len,
        "predicted_p90_ttft_ms": report.json_number(again.ttft_p90_s * 1e3),
        "p90_ttft_ms": figures["p90_ttft_ms"],
        "predicted_median_tpot_ms": report.json_number(again.tpot_p50_s * 1e3),
        "median_tpot_ms": figures["median_tpot_ms"],
    }


def table(result: dict[str, Any]) -> str:
    rows = [
        f"check of {result['split']}: {result['completed']} of {result['num_prompts']} requests "
        f"completed; served {result['served_input_len']} prompt / "
        f"{result['served_output_len']} output tokens on average (predicted again at those)",
        f"{'':16}{'predicted':>11}{'measured':>11}{'measured/predicted':>20}",
    ]
    for name, key in (("TTFT p90 (ms)", "p90_ttft_ms"), ("TPOT p50 (ms)", "median_tpot_ms")):
        predicted, measured = float(result[f"predicted_{key}"]), result[key]
        ratio = measured / predicted if 0 < predicted < float("inf") else float("nan")
        rows.append(f"{name:<16}{predicted:>11.1f}{measured:>11.1f}{ratio:>20.2f}")
    return "\n".join(rows)
