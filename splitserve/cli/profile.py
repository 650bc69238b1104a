"""`splitserve profile`: measure a model's prefill time against prompt length and decode step
time against batch and context on this host's devices (each tensor-parallel degree asked for),
then recommend the prefill and decode workers that meet a TTFT p90 and TPOT p50 target at a
request rate and length mix, with the expected goodput (docs/profile.md).

Writes the curves, every candidate split and the recommendation as JSON (--result-filename)
and the curves as a PNG (with matplotlib); `--from-curves F` plans again from such a JSON
without measuring; `--check` runs the recommended split as real processes under `bench
serve`'s load and prints the measured figures beside the predicted ones. Exits 0 with a
recommendation, 1 when no split meets the targets (or the check could not run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.launch.profile import plan, report
    from splitserve.launch.profile.curves import Profile


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive and finite")
    return value


def add_profile_command(sub: Any, env: Mapping[str, str]) -> None:
    """Add `profile` to the `splitserve` command's subparsers."""
    p = sub.add_parser(
        "profile",
        help="measure prefill/decode curves; recommend a P/D split for a TTFT/TPOT target",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = p.add_argument_group("what to measure")
    what.add_argument(
        "--model",
        default=env.get("SPLITSERVE_MODEL"),
        help="an HF model directory, or 'tiny' (or SPLITSERVE_MODEL)",
    )
    what.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda when there is a GPU",
    )
    what.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    what.add_argument(
        "--load-format",
        choices=("safetensors", "dummy"),
        help="safetensors (default: read the checkpoint) or dummy (random weights of its shape: "
        "a directory of config.json and tokenizer is enough); --check's workers load the same "
        "(with --from-curves, the profile's unless given)",
    )
    what.add_argument("--max-model-len", type=_positive_int, help="the engines' context")
    what.add_argument(
        "--tensor-parallel-sizes",
        type=_positive_int,
        nargs="+",
        help="TP degrees to measure (default: on cuda every power of two that fits the GPUs "
        "and the model; on the CPU 1)",
    )
    what.add_argument(
        "--prefill-lens",
        type=_positive_int,
        nargs="+",
        default=[128, 512, 1024, 2048, 4096],
        help="prompt lengths (tokens)",
    )
    what.add_argument(
        "--decode-batches",
        type=_positive_int,
        nargs="+",
        default=[1, 4, 16, 64, 128],
        help="decode batch sizes",
    )
    what.add_argument(
        "--decode-contexts",
        type=_positive_int,
        nargs="+",
        default=[512, 2048],
        help="prompt tokens of each decoding sequence",
    )
    what.add_argument("--decode-steps", type=_positive_int, default=16, help="steps timed a point")
    what.add_argument("--repeats", type=_positive_int, default=3, help="prefills timed a length")
    what.add_argument(
        "--from-curves",
        metavar="JSON",
        help="plan from the curves of an earlier run's JSON; measure nothing",
    )

    plan = p.add_argument_group("what to plan for")
    plan.add_argument(
        "--gpus",
        type=_positive_int,
        help="devices to plan for (default: the GPUs here; on the CPU 2)",
    )
    plan.add_argument("--request-rate", type=_positive_float, default=1.0, help="requests/s")
    plan.add_argument("--input-len", type=_positive_int, default=1024, help="prompt tokens")
    plan.add_argument("--output-len", type=_positive_int, default=128, help="reply tokens")
    plan.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len·(1−r), len·(1+r)], as bench serve's",
    )
    plan.add_argument("--ttft-ms", type=_positive_float, default=1000.0, help="TTFT p90 target")
    plan.add_argument("--tpot-ms", type=_positive_float, default=40.0, help="TPOT p50 target")
    plan.add_argument(
        "--transfer-gb-per-s",
        type=_positive_float,
        default=10.0,
        help="KV transfer bandwidth prefill→decode (GB/s; python -m bench.kv_transfer "
        "measures it), counted whole in TTFT",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="then start the recommended split (as splitserve up does), send it bench serve's "
        "load at --request-rate, and print the measured TTFT p90 and TPOT p50 beside the "
        "predicted ones",
    )
    p.add_argument(
        "--check-num-prompts", type=_positive_int, default=200, help="requests the check sends"
    )
    out = p.add_argument_group("the results")
    out.add_argument("--result-filename", default="profile.json", help="the JSON written")
    out.add_argument("--plot-filename", help="the PNG of the curves (default: beside the JSON)")
    out.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.set_defaults(func=profile)


def _measured(args: argparse.Namespace) -> Profile:
    from splitserve.engine import ModelConfig
    from splitserve.launch.default_model import resolve_model_arg
    from splitserve.launch.profile import measure
    from splitserve.launch.profile.curves import Profile

    if not args.model:
        raise ValueError("give --model (a model directory, or 'tiny') or --from-curves")
    model = resolve_model_arg(args.model)
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"--model {args.model}: no model directory (config.json) there")
    device = measure.resolve_device(args.device)
    config = ModelConfig.from_pretrained(model)
    count = measure.device_count(device)
    if device == "cuda" and count == 0:
        raise ValueError("--device cuda: no CUDA device is visible")
    fit = measure.fitting_degrees(config, count)
    degrees = tuple(args.tensor_parallel_sizes or (fit if device == "cuda" else (1,)))
    for tp in degrees:
        if device == "cuda" and tp > count:
            raise ValueError(f"--tensor-parallel-sizes {tp}: only {count} GPU(s) here")
        measure.check_divisible(config, tp)
    grid = measure.Grid(
        tuple(args.prefill_lens),
        tuple(args.decode_batches),
        tuple(args.decode_contexts),
        args.decode_steps,
        args.repeats,
    )
    name = measure.device_name(device)
    print(
        f"profiling {model} on {count} × {name}; TP degrees that fit: "
        f"{', '.join(map(str, fit))}; measuring: {', '.join(map(str, degrees))}",
        flush=True,
    )

    def progress(line: str) -> None:
        print(line, flush=True)

    load_format = args.load_format or "safetensors"
    curves, skipped, model_len = measure.measure_degrees(
        model, device, args.dtype, args.max_model_len, degrees, grid, progress, load_format
    )
    unmeasured = [tp for tp in fit if tp not in degrees]
    notes = [*skipped]
    if unmeasured:
        notes.append(
            f"TP {', '.join(map(str, unmeasured))} fit(s) but was not measured, so is not planned"
        )
    return Profile(
        model=model,
        device=device,
        device_name=name,
        dtype=measure.dtype_name(config, args.dtype, device),
        num_devices=count,
        kv_bytes_per_token=measure.kv_bytes_per_token(config, args.dtype, device),
        max_model_len=model_len,
        tensor_parallel_sizes_fit=fit,
        curves=tuple(curves),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        notes=tuple(notes),
        load_format=load_format,
        device_memory_bytes=measure.device_memory_bytes(device),
    )


def _show_check_commands(
    prof: Profile, best: plan.Prediction, work: plan.Workload, targets: plan.Targets
) -> tuple[report.Placement | None, str]:
    """Print how to check `best` by hand (what `--check` runs); its placement on this host's
    GPUs, or None and why it cannot run here."""
    from splitserve.launch.profile import report

    try:
        where = report.placement(best.split, prof)
    except ValueError as exc:  # NOTE: a TP worker past the GPUs, or weights too large to share
        print(f"note: cannot check it on this host: {exc}")
        return None, str(exc)
    if where.shared:
        print(f"note: {report.sharing_note(where, prof)}")
    print(
        "check it against a real run (then compare bench serve's p90_ttft_ms and "
        "median_tpot_ms with the predictions):"
    )
    for command in report.check_commands(best, prof, work, targets):
        print(f"  {command}")
    print("  (bench serve's lengths are words: one token each in the usual BPE vocabularies)")
    return where, ""


def profile(args: argparse.Namespace) -> int:
    from splitserve.launch.profile import plan, report
    from splitserve.launch.profile.curves import Profile

    work = plan.Workload(args.request_rate, args.input_len, args.output_len, args.range_ratio)
    targets = plan.Targets(args.ttft_ms / 1e3, args.tpot_ms / 1e3)
    if args.from_curves:
        try:
            prof = Profile.from_json(json.loads(Path(args.from_curves).read_text()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"--from-curves {args.from_curves}: cannot read it ({exc})") from None
        if args.load_format:  # NOTE: the check's weights; the curves stay what was measured
            prof = dataclasses.replace(prof, load_format=args.load_format)
    else:
        prof = _measured(args)
    devices = args.gpus or (prof.num_devices if prof.device == "cuda" else 2)
    for note in prof.notes:
        print(f"note: {note}", flush=True)
    found, best = plan.search(prof, devices, work, targets, args.transfer_gb_per_s * 1e9)
    print(
        f"\n{len(found)} splits on {devices} device(s), best first "
        f"(* recommended; busy: prefill utilization; decode batch: per worker):"
    )
    print(report.table(found, best))
    print()
    for line in report.summary(best, work, targets):
        print(line)
    where, unplaced = None, ""
    if best is not None:
        for note in plan.extrapolations(prof, best, work):
            print(f"note: extrapolated: {note}")
        where, unplaced = _show_check_commands(prof, best, work, targets)
    checked, failed = None, False
    if args.check and best is None:
        print("splitserve profile: --check: no recommendation to check", file=sys.stderr)
    elif args.check and where is None:
        print(f"splitserve profile: --check: {unplaced}", file=sys.stderr)
        failed = True
    elif args.check and best is not None:
        from splitserve.cli import profile_check

        try:
            checked = profile_check.check(
                prof, best, work, targets, args.transfer_gb_per_s * 1e9, args.check_num_prompts,
                lambda line: print(line, flush=True),
            )  # fmt: skip
            print(profile_check.table(checked))
        except RuntimeError as exc:  # the stack did not start, or served nothing
            print(f"splitserve profile: --check failed: {exc}", file=sys.stderr)
            failed = True
    report.save(
        args.result_filename, prof, work, targets, devices, args.transfer_gb_per_s, found, best,
        checked,
    )  # fmt: skip
    print(f"wrote {args.result_filename}")
    if not args.no_plot:
        png = args.plot_filename or str(Path(args.result_filename).with_suffix(".png"))
        try:
            print(f"wrote {report.plot(prof, png)}")
        except ImportError:
            print(
                "splitserve profile: the plot needs matplotlib, which is not installed: "
                "pip install 'splitserve[bench]' (the JSON is complete)",
                file=sys.stderr,
            )
    return 0 if best is not None and not failed else 1
