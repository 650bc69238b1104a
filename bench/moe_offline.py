"""Offline throughput of a Mixture-of-Experts model: the fused experts (kernels/fused_moe.py)
against a per-expert loop (kernels/moe_ref.py, what HF transformers runs), same run.

    python -m bench.moe_offline [--shape qwen3-30b-a3b] [--layers 12] [--num-requests 64]
        [--input-len 512] [--output-len 128] [--out F]

Random weights (bf16), random prompts, EOS ignored; output tokens/s of `LLM.generate` for:
  fused + graphs   the engine as it serves (decode steps replayed from CUDA graphs)
  fused, eager     the fused path without graphs (the loop cannot be captured: it reads the
                   routing on the host), so the two paths compare like for like
  per-expert loop  eager, every MoE layer's experts one after another
`--layers` cuts the shape's depth (every layer alike) so the loop finishes in minutes; the
ratios do not depend on it.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.common import SHAPES, device_name, model_dir, sync, table, write_results

QUICK = {  # --quick: the shape's kind, small enough for a CPU
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


class _LoopOps:
    """The platform's ops with the experts run by the per-expert reference loop."""

    def __init__(self, ops) -> None:
        self._ops = ops

    def __getattr__(self, name: str):
        return getattr(self._ops, name)

    def fused_moe(self, *args, **kwargs):
        from splitserve.engine.ops import TorchOps

        return TorchOps.fused_moe(self._ops, *args, **kwargs)


def run(path: Path, args, *, graphs: bool, loop: bool) -> float:
    from splitserve.engine import LLM, SamplingParams

    llm = LLM(
        str(path),
        dtype="bfloat16",
        device="cuda" if torch.cuda.is_available() else "cpu",
        load_format="dummy",
        enable_cuda_graphs=graphs,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=args.num_requests,
    )
    if loop:
        for layer in llm.engine.model.model.layers:
            if hasattr(layer.mlp, "experts"):
                layer.mlp.ops = _LoopOps(layer.mlp.ops)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, 10000) for _ in range(args.input_len)] for _ in range(args.num_requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", default="bench/results/moe_offline.json")
    parser.add_argument("--quick", action="store_true", help="a tiny shape and workload (CPU)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.num_requests, args.input_len, args.output_len = 2, 4, 24, 8
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(args.shape, Path(tmp))
        config = json.loads((path / "config.json").read_text())
        config["num_hidden_layers"] = args.layers
        if args.quick:
            config.update(QUICK)
        (path / "config.json").write_text(json.dumps(config))
        gpu = torch.cuda.is_available()
        rows = [
            {"path": "fused + graphs", "tok/s": run(path, args, graphs=gpu, loop=False)},
            {"path": "fused, eager", "tok/s": run(path, args, graphs=False, loop=False)},
            {"path": "per-expert loop", "tok/s": run(path, args, graphs=False, loop=True)},
        ]
    loop_rate = rows[-1]["tok/s"]
    for row in rows:
        row["x loop"] = row["tok/s"] / loop_rate
    results = {
        "benchmark": "moe_offline",
        "device": device_name(),
        "shape": args.shape,
        "layers": args.layers,
        "dtype": "bfloat16",
        "workload": {
            "requests": args.num_requests,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "ignore_eos": True,
        },
        "rows": rows,
    }
    write_results(args.out, results)
    print(
        f"device: {device_name()}  shape: {args.shape} ({args.layers} layers)  bf16  "
        f"{args.num_requests} requests {args.input_len} in / {args.output_len} out"
    )
    print(table(rows, ["path", "tok/s", "x loop"]))


if __name__ == "__main__":
    main()
