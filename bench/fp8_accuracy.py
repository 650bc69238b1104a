"""FP8 accuracy on a random-weight shape (no trained weights are reachable offline).

    python -m bench.fp8_accuracy [--shape llama-3-8b] [--prompts 8] [--steps 32] [--out F]
    python -m bench.fp8_accuracy --smoke      # CPU, tiny shape

The same dummy weights (drawn in float32, then cast) run as float32, bf16, FP8 weights over
bf16 activations (engine/quantization.py), and bf16 with an FP8 KV cache (`fp8 KV`). Each
engine decodes the same prompts greedily for `--steps` tokens with the top-20 logprobs; each
pair is compared where both have produced the same tokens so far:

- **logprob error**: mean and max |logprob_a(t) - logprob_b(t)| of the reference's next token t
  (when it is in a's top 20), in nats;
- **greedy agreement**: the share of the `--steps` positions where a's token equals b's, and
  the mean length of the common prefix.

The pairs are bf16 against float32 (bf16's own error), and FP8 weights and the FP8 KV cache
against bf16 and against float32.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import SHAPES, device_name, model_dir, table, write_results

MODES = {
    "float32": ("float32", None, "auto"),
    "bf16": ("bfloat16", None, "auto"),
    "fp8": ("bfloat16", "fp8", "auto"),
    "fp8 KV": ("bfloat16", None, "fp8"),
}
PAIRS = [
    ("bf16", "float32"),
    ("fp8", "bf16"),
    ("fp8", "float32"),
    ("fp8 KV", "bf16"),
    ("fp8 KV", "float32"),
]


def decode(path: Path, mode: str, prompts: list[list[int]], steps: int, device: str) -> list:
    """Per prompt: [(token, {token: logprob})] for each step."""
    from splitserve.engine import LLMEngine, SamplingParams
    from splitserve.engine.config import EngineConfig, parse_dtype

    dtype, quantization, kv_cache_dtype = MODES[mode]
    engine = LLMEngine(
        path,
        EngineConfig(
            dtype=parse_dtype(dtype),
            device=device,
            load_format="dummy",
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            max_num_seqs=len(prompts),
            max_model_len=max(map(len, prompts)) + steps + 16,
            enable_cuda_graphs=device != "cpu",
        ),
    )
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=20)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    results = []
    for rid in ids:
        sample = done[rid].outputs[0]
        results.append(list(zip(sample.token_ids, sample.logprobs, strict=True)))
    del engine
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()
    return results


def compare(a: list, b: list, steps: int) -> dict[str, float]:
    """a against reference b (see the module doc)."""
    errors, agree, prefixes = [], 0, []
    for seq_a, seq_b in zip(a, b, strict=True):
        prefix = 0
        for (tok_a, lp_a), (tok_b, lp_b) in zip(seq_a, seq_b, strict=True):
            if prefix >= 0 and tok_b in lp_a:  # same path so far: compare the next token
                errors.append(abs(lp_a[tok_b] - lp_b[tok_b]))
            agree += tok_a == tok_b
            if prefix >= 0 and tok_a == tok_b:
                prefix += 1
            elif prefix >= 0:
                prefixes.append(prefix)
                prefix = -1
        if prefix >= 0:
            prefixes.append(prefix)
    return {
        "logprob err mean": statistics.fmean(errors) if errors else float("nan"),
        "logprob err max": max(errors) if errors else float("nan"),
        "positions compared": len(errors),
        "greedy agreement %": 100 * agree / (steps * len(a)),
        "common prefix": statistics.fmean(prefixes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", default="bench/results/fp8_accuracy.json")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, few tokens")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.prompts, args.prompt_len, args.steps = 2, 12, 6
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            from splitserve.testing.tiny_model import make_tiny_model

            path, shape = make_tiny_model(Path(tmp) / "tiny", "llama"), "tiny llama"
        else:
            path, shape = model_dir(args.shape, Path(tmp)), args.shape
        vocab = 200 if args.smoke else 10000
        prompts = [
            torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist()
            for _ in range(args.prompts)
        ]
        runs = {mode: decode(path, mode, prompts, args.steps, device) for mode in MODES}
    rows = [
        {"a / reference": f"{a} / {b}", **compare(runs[a], runs[b], args.steps)} for a, b in PAIRS
    ]
    write_results(
        args.out,
        {
            "benchmark": "fp8_accuracy",
            "device": device_name(),
            "shape": shape,
            "prompts": args.prompts,
            "prompt_len": args.prompt_len,
            "steps": args.steps,
            "rows": rows,
        },
    )
    print(f"device: {device}  shape: {shape}  {args.prompts} prompts x {args.steps} greedy steps")
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
