"""What `splitserve profile` shows and writes: the candidates' table, the commands that check
the recommendation against a real run, the JSON (curves, candidates, recommendation) and a
PNG of the curves when matplotlib is installed (`pip install 'splitserve[bench]'`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.launch.profile.curves import Profile
from splitserve.launch.profile.plan import Prediction, Split, Targets, Workload


def _ms(seconds: float) -> str:
    return "inf" if not math.isfinite(seconds) else f"{seconds * 1e3:.1f}"


def _rate(value: float) -> str:
    return "inf" if not math.isfinite(value) else f"{value:.2f}"


def table(found: list[Prediction], best: Prediction | None, limit: int = 20) -> str:
    head = (
        f"{'':2}{'split':<22}{'devices':>8}{'TTFT p90':>10}{'TPOT p50':>10}{'prefill':>9}"
        f"{'decode':>8}{'goodput':>9}{'capacity':>10}  meets"
    )
    unit = f"{'':2}{'':<22}{'':>8}{'(ms)':>10}{'(ms)':>10}{'busy':>9}{'batch':>8}{'(req/s)':>9}"
    rows = [head, unit + f"{'(req/s)':>10}", "-" * len(head)]
    for p in found[:limit]:
        mark = "* " if p is best else "  "
        batch = "inf" if not math.isfinite(p.decode_batch) else f"{p.decode_batch:.1f}"
        rows.append(
            f"{mark}{p.split.label:<22}{p.split.devices:>8}{_ms(p.ttft_p90_s):>10}"
            f"{_ms(p.tpot_p50_s):>10}{min(p.prefill_utilization, 9.99):>9.0%}{batch:>8}"
            f"{p.goodput:>9.2f}{_rate(p.capacity):>10}  "
            + ("yes" if p.meets else f"no ({p.bottleneck})")
        )
    if len(found) > limit:
        rows.append(f"  … {len(found) - limit} more in the JSON")
    return "\n".join(rows)


# Workers that share a GPU split this much of it between them (a worker alone takes as much
# through --gpu-memory-utilization's default), each keeping `WORKER_OVERHEAD_BYTES` beside its
# weights and KV pool (CUDA context, activations, CUDA graphs, the allocator's slack).
SHARED_GPU_UTILIZATION = 0.9
WORKER_OVERHEAD_BYTES = 2 * 2**30


def worker_devices(split: Split, num_gpus: int = 0) -> list[str]:
    """Each worker's first GPU, decode workers first (`splitserve up --devices`' order): a TP
    worker takes its device's GPU and the next ones. With fewer than `split.devices` GPUs
    (`num_gpus` > 0), round-robin over them (GPU i % num_gpus): the workers share GPUs."""
    first = [i * split.decode_tp for i in range(split.num_decode)]
    base = split.num_decode * split.decode_tp
    first += [base + j * split.prefill_tp for j in range(split.num_prefill)]
    if 0 < num_gpus < split.devices:
        tps = [split.decode_tp] * split.num_decode + [split.prefill_tp] * split.num_prefill
        first = [i % num_gpus for i in first]
        if any(i + tp > num_gpus for i, tp in zip(first, tps, strict=True)):
            raise ValueError(
                f"{split.label} does not wrap onto {num_gpus} GPU(s): a TP worker would run "
                "past the last one"
            )
    return [f"cuda:{i}" for i in first]


@dataclass(frozen=True)
class Placement:
    """Where `--check` (and the printed `splitserve up`) puts the recommended split's workers."""

    devices: tuple[str, ...]  # `--devices`, decode workers first; empty: each worker picks
    workers_per_gpu: int  # the most workers (TP ranks) on one GPU: above 1, they share it
    # Each worker's KV pool where they share GPUs (an equal share of the memory left after
    # every sharer's weights); None where each has GPUs of its own (or nothing to size it by).
    kv_cache_memory_bytes: int | None = None

    @property
    def shared(self) -> bool:
        return self.workers_per_gpu > 1


def placement(split: Split, profile: Profile) -> Placement:
    """The split on the measuring host's GPUs (`profile.num_devices`): one worker a GPU where
    there are enough, else round-robin over them, each worker given an equal KV pool: a GPU
    worker's pool is otherwise what the card has free once its weights are in, which counts
    the other sharers' memory too, and the first to size its pool would leave none."""
    if profile.device != "cuda":
        return Placement((), 1)
    devices = worker_devices(split, profile.num_devices)
    tps = [split.decode_tp] * split.num_decode + [split.prefill_tp] * split.num_prefill
    ranks: dict[str, int] = {}
    for device, tp in zip(devices, tps, strict=True):
        first = int(device.removeprefix("cuda:"))
        for gpu in range(first, first + tp):
            ranks[f"cuda:{gpu}"] = ranks.get(f"cuda:{gpu}", 0) + 1
    sharers = max(ranks.values())
    if sharers == 1:
        return Placement(tuple(devices), 1)
    weights = max(
        profile.at(split.prefill_tp).weight_bytes, profile.at(split.decode_tp).weight_bytes
    )
    if not (weights and profile.device_memory_bytes):
        raise ValueError(
            f"{split.label} needs {split.devices} GPUs and {profile.num_devices} were "
            "visible: to share them the workers need the weights' and the GPU's sizes, which "
            "this profile does not record (measure it again)"
        )
    usable = SHARED_GPU_UTILIZATION * profile.device_memory_bytes
    pool = int(usable / sharers - weights - WORKER_OVERHEAD_BYTES)
    if pool <= 0:
        raise ValueError(
            f"{split.label} on {profile.num_devices} GPU(s): {sharers} workers of "
            f"{weights / 1e9:.1f} GB of weights each do not fit one GPU of "
            f"{profile.device_memory_bytes / 1e9:.1f} GB"
        )
    return Placement(tuple(devices), sharers, pool)


def sharing_note(where: Placement, profile: Profile) -> str:
    """What a check on shared GPUs measures that the plan does not model."""
    pool = where.kv_cache_memory_bytes or 0
    return (
        f"the split needs more GPUs than the {profile.num_devices} visible: its workers share "
        f"them ({where.workers_per_gpu} a GPU, {','.join(where.devices)}), each with a KV pool "
        f"of {pool / 2**30:.1f} GiB; a check measures their contention "
        "for the GPU, which the plan does not model (it assumes a GPU a worker)"
    )


def worker_args(profile: Profile, where: Placement) -> list[str]:
    """The worker flags the profile implies beyond the split: its weights and context, and the
    KV pool of workers that share GPUs (`splitserve up`'s flags, which it hands every worker)."""
    args = []
    if profile.load_format != "safetensors":
        args += ["--load-format", profile.load_format]
    if profile.max_model_len:
        args += ["--max-model-len", str(profile.max_model_len)]
    if where.kv_cache_memory_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(where.kv_cache_memory_bytes)]
    return args


def json_number(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"  # NOTE: JSON has no infinity


def check_commands(
    best: Prediction, profile: Profile, work: Workload, targets: Targets
) -> list[str]:
    """`splitserve up` on the recommended split and the `bench serve` load to compare with.

    NOTE: `bench serve` counts prompt lengths in words, one token each in the usual BPE
    vocabularies (not in the tiny test model's: docs/bench-serve.md)."""
    s = best.split
    up = f"splitserve up --model {profile.model} --prefill {s.num_prefill} --decode {s.num_decode}"
    if s.prefill_tp > 1:
        up += f" --prefill-tensor-parallel-size {s.prefill_tp}"
    if s.decode_tp > 1:
        up += f" --decode-tensor-parallel-size {s.decode_tp}"
    where = placement(s, profile)
    if where.devices:
        up += " --devices " + ",".join(where.devices)
    up = " ".join([up, *worker_args(profile, where)])
    bench = (
        f"splitserve bench serve --random-input-len {work.input_len} "
        f"--random-output-len {work.output_len} --random-range-ratio {work.range_ratio:g} "
        f"--request-rate {work.request_rate:g} --num-prompts "
        f"{max(200, math.ceil(60 * work.request_rate))} --metric-percentiles 50,90,99 "
        f"--goodput ttft:{targets.ttft_s * 1e3:g} tpot:{targets.tpot_s * 1e3:g} --save-result"
    )
    return [up, bench]


def summary(best: Prediction | None, work: Workload, targets: Targets) -> list[str]:
    want = (
        f"TTFT p90 ≤ {targets.ttft_s * 1e3:g} ms and TPOT p50 ≤ {targets.tpot_s * 1e3:g} ms at "
        f"{work.request_rate:g} req/s, {work.input_len} prompt / {work.output_len} output tokens"
    )
    if best is None:
        return [f"no split on these devices meets {want}"]
    return [
        f"recommended: {best.split.label} on {best.split.devices} device(s), for {want}",
        f"predicted: TTFT p90 {_ms(best.ttft_p90_s)} ms, TPOT p50 {_ms(best.tpot_p50_s)} ms, "
        f"goodput {best.goodput:.2f} req/s, capacity {_rate(best.capacity)} req/s "
        f"(past it, {best.bottleneck} misses its target first)",
    ]


def _prediction(p: Prediction) -> dict[str, Any]:
    num = json_number
    s = p.split
    return {
        "split": s.label,
        "num_prefill": s.num_prefill,
        "prefill_tensor_parallel_size": s.prefill_tp,
        "num_decode": s.num_decode,
        "decode_tensor_parallel_size": s.decode_tp,
        "devices": s.devices,
        # NOTE: named as `bench serve --metric-percentiles 50,90` names its figures
        "predicted_p90_ttft_ms": num(p.ttft_p90_s * 1e3),
        "predicted_median_tpot_ms": num(p.tpot_p50_s * 1e3),
        "prefill_utilization": num(p.prefill_utilization),
        "decode_batch": num(p.decode_batch),
        "request_goodput": p.goodput,
        "capacity": num(p.capacity),
        "meets": p.meets,
        "bottleneck": p.bottleneck,
    }


def save(
    path: str,
    profile: Profile,
    work: Workload,
    targets: Targets,
    devices: int,
    transfer_gb_per_s: float,
    found: list[Prediction],
    best: Prediction | None,
    check: dict[str, Any] | None = None,
) -> None:
    raw = {
        **profile.to_json(),
        "plan": {
            "devices": devices,
            "request_rate": work.request_rate,
            "input_len": work.input_len,
            "output_len": work.output_len,
            "range_ratio": work.range_ratio,
            "ttft_p90_target_ms": targets.ttft_s * 1e3,
            "tpot_p50_target_ms": targets.tpot_s * 1e3,
            "transfer_gb_per_s": transfer_gb_per_s,
        },
        "candidates": [_prediction(p) for p in found],
        "recommendation": _prediction(best) if best is not None else None,
        "check": check,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(raw, indent=2) + "\n")


def plot(profile: Profile, path: str) -> str:
    """Prefill time against prompt length and decode step time against batch (a line per
    context), a line per TP degree. ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for c in profile.curves:
        pts = sorted(c.prefill, key=lambda p: p.prompt_len)
        left.plot(
            [p.prompt_len for p in pts],
            [p.seconds * 1e3 for p in pts],
            "o-",
            label=f"TP{c.tensor_parallel_size}",
        )
        for context, row in c.decode_rows().items():
            right.plot(
                [d.batch for d in row],
                [d.step_s * 1e3 for d in row],
                "o-",
                label=f"TP{c.tensor_parallel_size}, context {context}",
            )
    left.set(xlabel="prompt length (tokens)", ylabel="prefill time (ms)", title="prefill")
    right.set(xlabel="decode batch (sequences)", ylabel="step time (ms)", title="decode step")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{Path(profile.model).name} · {profile.device_name} · {profile.dtype}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
