"""Tensor parallelism: TP=N against TP=1 in the same run, and a model too big for one GPU served.

    python -m bench.tensor_parallel [--tp 2] [--shape llama-3-8b] [--prompt-lens 4096 16384]
        [--batches 1 64] [--context 512] [--time-budget-s 420] [--out F]
    python -m bench.tensor_parallel --serve [--prefill-tp 2] [--decode-tp 2] [--layers N]
    python -m bench.tensor_parallel --smoke          # tiny shape, CPU (gloo) or GPU

Engine mode (the default): first the collectives, in a group of N processes of their own (NCCL's
all-reduce bus bandwidth on 256 MiB, as nccl-tests reports it: bytes x 2(N-1)/N / time; the
time of the all-reduces one step issues, 2 per layer + the embedding's, [tokens, hidden]
each; the device's copy bandwidth). Then one row per configuration, in this order: TP=1 with
its CUDA graphs (the baseline), TP=N eager, TP=N with graphs (`tensor_parallel_cuda_graphs`),
TP=1 eager; dummy bf16 weights of the shape, prefix caching off, no overlapped steps, EOS
ignored. Each row is a process of its own (bench/tensor_parallel_row.py) with a time limit:
  - prefill: TTFT of one prompt of each length (one engine step: max_num_batched_tokens is the
    longest prompt), median over `--reps` fresh random prompts after one warm-up;
  - decode: median engine-step time while `batch` sequences of `--context` tokens decode;
  - the floor of a decode step: this rank's weight bytes (all but the embedding) + KV bytes
    over the copy bandwidth, plus the step's all-reduces (both measured in the same run).
Every phase prints a timestamped line as it ends; a row that fails or runs out of time is kept
with its `error` (and whatever it measured first), and the run goes on to the next. Rows are
not started once less than 45 s of `--time-budget-s` is left.

Serve mode: a Llama-3-8B-width stack deep enough (`--layers`, default sized from the GPU's
memory) that its bf16 weights don't fit one GPU, served through the gateway by a prefill
worker at `--prefill-tp` and a decode worker at `--decode-tp` (dummy weights, gRPC KV
transport); reports TTFT and tokens of a few requests. P and D each hold the model, so this
needs prefill_tp + decode_tp GPUs (`--prefill 0` serves a colocated worker at `--decode-tp`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.common import SHAPES, device_name, model_dir, table, write_results
from bench.row_process import NO_MULTICAST, child_env, run_row
from bench.tensor_parallel_collectives import measure_collectives
from bench.tensor_parallel_row import progress

SMOKE_SHAPE = "tiny"
BIG_ALL_REDUCE_BYTES = 256 << 20


def _tiny_dir(root: Path) -> Path:
    from splitserve.testing.tiny_model import make_tiny_model

    return make_tiny_model(root / SMOKE_SHAPE, "llama")


# -- engine --------------------------------------------------------------------------------

_MIN_ROW_S = 45.0  # a row is not started with less of the time budget left


def _specs(args, path: Path, on_gpu: bool) -> list[dict]:
    """The rows in the order they run: the baseline, then what the acceptance asks of TP=N."""
    names = [("TP=1", 1, True, False, False)]
    if "tpN" in args.configs:
        names.append((f"TP={args.tp}", args.tp, True, False, False))
    if on_gpu and "tpN-graphs" in args.configs:  # the default (tensor_parallel_cuda_graphs)
        names.append((f"TP={args.tp} graphs", args.tp, True, True, False))
    if on_gpu and "tpN-peer" in args.configs:  # graphs + the peer-memory all-reduce
        names.append((f"TP={args.tp} graphs+peer", args.tp, True, True, True))
    if on_gpu and "tp1-eager" in args.configs:
        names.append(("TP=1 eager", 1, False, False, False))
    common = {
        "model": str(path),
        "on_gpu": on_gpu,
        "prompt_lens": args.prompt_lens,
        "batches": args.batches,
        "context": args.context,
        "steps": args.steps,
        "reps": args.reps,
        "num_kv_blocks": args.num_kv_blocks,
    }
    return [
        {**common, "name": name, "tp": tp, "graphs": graphs, "tp_graphs": tp_graphs, "peer": peer}
        for name, tp, graphs, tp_graphs, peer in names
    ]


def _prepare_model(args, root: Path) -> Path:
    path = _tiny_dir(root) if args.smoke else model_dir(args.shape, root)
    cfg = json.loads((path / "config.json").read_text())
    # NOTE: a 16k prompt outgrows the Llama-3-8B shape's 8192 positions; the rotary tables
    # extend to any length, and the timing does not depend on their values.
    need = max(*args.prompt_lens, args.context + args.steps) + 64
    if cfg["max_position_embeddings"] < need:
        cfg["max_position_embeddings"] = need
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def engine_mode(args) -> dict:
    started = time.monotonic()
    on_gpu = torch.cuda.is_available() and not args.cpu
    if on_gpu and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} GPUs; {torch.cuda.device_count()} seen")
    os.environ.update({k: v for k, v in child_env().items() if k in NO_MULTICAST})
    progress(f"torch {torch.__version__}, NCCL {_nccl_version(on_gpu)}, {args.tp} ranks")
    with tempfile.TemporaryDirectory() as tmp:
        path = _prepare_model(args, Path(tmp))
        cfg = json.loads((path / "config.json").read_text())
        progress(
            f"collectives: all-reduce in a group of {args.tp} ({'NCCL' if on_gpu else 'gloo'})"
        )
        try:
            collectives = measure_collectives(
                args.tp,
                "cuda" if on_gpu else "cpu",
                cfg["hidden_size"],
                cfg["num_hidden_layers"],
                sorted({*args.prompt_lens, *args.batches}),
                args.big_bytes,
                args.reps_collective,
                timeout_s=min(180.0, args.time_budget_s / 3),
            )
            progress(
                f"collectives: bus {collectives['bus_GB_per_s']:.1f} GB/s; "
                f"copy {collectives['copy_GB_per_s']} GB/s"
            )
        except RuntimeError as exc:
            collectives = {"error": str(exc), "step": {}, "copy_GB_per_s": None}
            progress(f"collectives failed: {exc}")
        rows = []
        for spec in _specs(args, path, on_gpu):
            left = args.time_budget_s - (time.monotonic() - started)
            if left < _MIN_ROW_S:
                rows.append(
                    {"config": spec["name"], "tp": spec["tp"], "error": "skipped: time budget"}
                )
                progress(f"{spec['name']}: skipped ({left:.0f} s of the budget left)")
                continue
            progress(f"{spec['name']}: starting (limit {min(args.row_timeout_s, left):.0f} s)")
            rows.append(run_row(spec, min(args.row_timeout_s, left)))
            progress(f"{spec['name']}: {json.dumps(rows[-1])}")
    return summarize(args, rows, collectives, on_gpu)


def _nccl_version(on_gpu: bool) -> str | None:
    if not on_gpu:
        return None
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def summarize(args, rows: list[dict], collectives: dict, on_gpu: bool) -> dict:
    """Speedups against the TP=1 row, decode floors, and the acceptance's checks."""
    base = rows[0]
    copy = collectives.get("copy_GB_per_s")
    checks: dict[str, dict[str, bool]] = {}
    for row in rows:
        for length in args.prompt_lens:
            key = f"ttft_{length}_ms"
            if key in row and key in base:
                row[f"ttft_{length}_speedup"] = base[key] / row[key]
        for batch in args.batches:
            key = f"step_b{batch}_ms"
            if key in row and key in base:
                row[f"step_b{batch}_speedup"] = base[key] / row[key]
            if key in row and copy and "weight_bytes_rank0" in row:
                read = row["weight_bytes_rank0"]
                read += batch * args.context * row["kv_bytes_per_token_rank0"]
                floor_ms = read / (copy * 1e9) * 1e3
                step = collectives["step"].get(str(batch))
                if row["tp"] > 1 and step is not None:
                    peer = row.get("peer_all_reduce") and "peer_per_step_ms" in step
                    floor_ms += step["peer_per_step_ms" if peer else "per_step_ms"]
                row[f"step_b{batch}_floor_ms"] = floor_ms
                row[f"step_b{batch}_vs_floor"] = row[key] / floor_ms
        if row["tp"] > 1:
            checks[row["config"]] = {
                name: bool(row[key] >= target if ge else row[key] <= target)
                for name, key, target, ge in TARGETS
                if key in row
            }
    return {
        "benchmark": "tensor_parallel",
        "device": next((r["device"] for r in rows if "device" in r), device_name_cpu(on_gpu)),
        "num_devices": torch.cuda.device_count() if on_gpu else 0,
        "torch": torch.__version__,
        "nccl": _nccl_version(on_gpu),
        "shape": SMOKE_SHAPE if args.smoke else args.shape,
        "dtype": "bfloat16" if on_gpu else "float32",
        "weights": "dummy",
        "ignore_eos": True,
        "async_scheduling": False,
        "tp": args.tp,
        "context": args.context,
        "copy_GB_per_s": copy,
        "collectives": collectives,
        "rows": rows,
        "targets": {name: target for name, _, target, _ in TARGETS},
        "checks": checks,
    }


# The acceptance's targets: (name, row key, value, True if the row must reach at least it).
TARGETS = (
    ("4k prefill >= 1.7x", "ttft_4096_speedup", 1.7, True),
    ("decode b1 >= 1.5x", "step_b1_speedup", 1.5, True),
    ("decode b1 <= 1.3x floor", "step_b1_vs_floor", 1.3, False),
)


def device_name_cpu(on_gpu: bool) -> str:
    """The device's name without touching the GPU here (rows name it from their own process)."""
    return "GPU (no row started)" if on_gpu else device_name()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--reps-collective", type=int, default=50)
    parser.add_argument("--big-bytes", type=int, default=BIG_ALL_REDUCE_BYTES)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument(
        "--time-budget-s", type=float, default=420.0, help="the whole run (rows not started)"
    )
    parser.add_argument("--row-timeout-s", type=float, default=240.0, help="one row's limit")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (gloo)")
    parser.add_argument("--smoke", action="store_true", help="tiny shape, few steps")
    parser.add_argument("--serve", action="store_true", help="serve a too-big model instead")
    parser.add_argument("--prefill", type=int, default=1, help="serve: prefill workers (0, 1)")
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None, help="serve: the stack's depth")
    parser.add_argument("--serve-requests", type=int, default=4)
    parser.add_argument("--serve-prompt-len", type=int, default=1024)
    parser.add_argument("--serve-tokens", type=int, default=32)
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=["tp1-eager", "tpN", "tpN-graphs", "tpN-peer"],
        default=["tp1-eager", "tpN", "tpN-graphs", "tpN-peer"],
        help="rows beside the TP=1 baseline (eager ones and graphs rows on GPUs only)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompt_lens, args.batches, args.context = [48, 96], [1, 4], 32
        args.steps, args.reps, args.reps_collective = 4, 2, 5
        args.big_bytes, args.num_kv_blocks = 1 << 20, 64
        args.serve_requests, args.serve_prompt_len, args.serve_tokens = 2, 40, 8
    if args.serve:
        from bench.tensor_parallel_serve import serve_mode

        result = serve_mode(args)
    else:
        result = engine_mode(args)
    out = args.out or f"bench/results/tensor_parallel{'_serve' if args.serve else ''}.json"
    write_results(out, result)
    progress(f"wrote {out}")
    if args.serve:
        print(
            f"{result['device']}: {result['shape']}, P TP={args.prefill_tp} x{args.prefill}, "
            f"D TP={args.decode_tp}"
        )
        print(table(result["rows"], ["request", "ttft_ms", "tokens", "e2e_ms"]))
        if result.get("error"):
            print(f"error: {result['error']}")
        return result
    print_engine_result(args, result)
    return result


def print_engine_result(args, result: dict) -> None:
    coll = result["collectives"]
    print(f"{result['device']} x{args.tp}, {result['shape']}, {result['dtype']}, dummy weights")
    if "error" in coll:
        print(f"collectives: {coll['error']}")
    else:
        print(
            f"all-reduce {coll['all_reduce_bytes'] >> 20} MiB: {coll['all_reduce_ms']:.3f} ms, "
            f"bus {coll['bus_GB_per_s']:.1f} GB/s ({coll['backend']}); "
            f"copy {result['copy_GB_per_s']} GB/s"
        )
        print(
            table(
                [{"tokens": k, **v} for k, v in coll["step"].items()],
                [
                    "tokens",
                    "bytes",
                    "one_all_reduce_us",
                    "per_step_ms",
                    "peer_all_reduce_us",
                    "peer_per_step_ms",
                    "one_shot_us",
                    "two_shot_us",
                    "peer_sum_ok",
                ],
            )
        )
    columns = ["config", "cuda_graphs", "peer_all_reduce", "engine_up_s"]
    columns += [f"ttft_{n}_{s}" for n in args.prompt_lens for s in ("ms", "speedup")]
    columns += [f"step_b{b}_{s}" for b in args.batches for s in ("ms", "speedup")]
    if result["copy_GB_per_s"] is not None:
        columns += [f"step_b{b}_{s}" for b in args.batches for s in ("floor_ms", "vs_floor")]
    print(table(result["rows"], columns))
    for row in result["rows"]:
        for key in ("error", "stop_error"):
            if key in row:
                print(f"{row['config']}: {key}: {row[key]}")
    for config, checks in result["checks"].items():
        print(
            f"{config}: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in checks.items())
        )


if __name__ == "__main__":
    main()
