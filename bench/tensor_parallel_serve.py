"""Serve mode of bench/tensor_parallel.py (`--serve`): a model too big for one GPU, through
the gateway, with a prefill worker at `--prefill-tp` and a decode worker at `--decode-tp`."""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path

import torch

from bench.common import SHAPES, device_name, model_dir
from bench.row_process import NO_MULTICAST
from bench.tensor_parallel import SMOKE_SHAPE, _tiny_dir
from bench.tensor_parallel_row import progress, random_prompt


def layers_that_need_two_gpus(shape: dict, gpu_bytes: int) -> int:
    """Layers of `shape`'s width whose bf16 weights exceed one GPU by 15%."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    per_layer = 2 * (2 * h * h + 2 * h * kv + 3 * h * inter)
    embeddings = 2 * 2 * shape["vocab_size"] * h
    return math.ceil((1.15 * gpu_bytes - embeddings) / per_layer)


def serve_mode(args) -> dict:
    """Start the stack, send the requests, stop it; an error is recorded, not raised."""
    from splitserve.launch.up import StackSettings, start_stack

    on_gpu = torch.cuda.is_available() and not args.cpu
    need = args.decode_tp + (args.prefill_tp if args.prefill else 0)
    if on_gpu and torch.cuda.device_count() < need:
        raise SystemExit(
            f"--serve with P TP={args.prefill_tp} x{args.prefill} and D TP={args.decode_tp} needs "
            f"{need} GPUs; {torch.cuda.device_count()} seen (--prefill 0: one colocated worker)"
        )
    started = time.monotonic()
    rows: list[dict] = []
    error = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            path = _tiny_dir(Path(tmp))
            cfg = json.loads((path / "config.json").read_text())
            layers = cfg["num_hidden_layers"]
        else:
            path = model_dir(args.shape, Path(tmp))
            cfg = json.loads((path / "config.json").read_text())
            gpu_bytes = torch.cuda.get_device_properties(0).total_memory if on_gpu else 0
            layers = args.layers or layers_that_need_two_gpus(SHAPES[args.shape], gpu_bytes)
            cfg["num_hidden_layers"] = layers
            (path / "config.json").write_text(json.dumps(cfg))
        vocab = cfg["vocab_size"]
        max_len = args.serve_prompt_len + args.serve_tokens + 64
        worker = ["--load-format", "dummy", "--kv-transport", "grpc"]
        worker += ["--max-model-len", str(max_len)]
        if not on_gpu:
            worker += ["--device", "cpu"]
        devices: tuple[str, ...] = ()
        if on_gpu:  # decode workers are handed devices first, then prefill ones
            devices = ("cuda:0", f"cuda:{args.decode_tp}") if args.prefill else ("cuda:0",)
        settings = StackSettings(
            model=str(path),
            prefill=args.prefill,
            decode=1,
            extra_worker_args=tuple(worker),
            extra_prefill_args=("--tensor-parallel-size", str(args.prefill_tp)),
            extra_decode_args=("--tensor-parallel-size", str(args.decode_tp)),
            devices=devices,
            # NOTE: the whole run's budget, less what the requests need
            startup_timeout_s=max(60.0, args.time_budget_s - 90.0),
            env=NO_MULTICAST,
        )
        progress(
            f"serve: starting the stack ({layers} layers, P TP={args.prefill_tp} x{args.prefill}, "
            f"D TP={args.decode_tp}, devices {devices or 'cpu'})"
        )
        try:
            stack = start_stack(settings)
        except Exception as exc:  # noqa: BLE001 - a stack that can't start is a result too
            error = f"the stack did not start: {exc}"
            progress(f"serve: {error}")
            stack = None
        try:
            if stack is not None:
                progress(f"serve: stack ready in {time.monotonic() - started:.1f} s")
                deadline = started + args.time_budget_s
                rows = _requests(args, stack.address, vocab, deadline)
        except Exception as exc:  # noqa: BLE001
            error = f"requests failed: {exc!r}"[:600]
            progress(f"serve: {error}")
        finally:
            if stack is not None:
                progress("serve: stopping the stack")
                stack.stop()
                progress("serve: stopped")
    return {
        "benchmark": "tensor_parallel_serve",
        "device": device_name(),
        "shape": SMOKE_SHAPE if args.smoke else f"{args.shape} width, {layers} layers",
        "weights": "dummy",
        "layers": layers,
        "weight_GB": weight_bytes(cfg) / 1e9,
        "prefill": args.prefill,
        "prefill_tp": args.prefill_tp,
        "decode_tp": args.decode_tp,
        "ignore_eos": True,
        "rows": rows,
        "error": error,
    }


def weight_bytes(cfg: dict) -> int:
    """bf16 bytes of a Llama-family config's weights (untied embedding and LM head)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    return 2 * (layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + 2 * cfg["vocab_size"] * h)


def _requests(args, address: str, vocab: int, deadline: float) -> list[dict]:
    """`--serve-requests` prompts one after another through the gateway: TTFT and tokens
    (each within what is left of the run's budget, and at most 120 s)."""
    import grpc

    from splitserve.client import stream
    from splitserve.engine import SamplingParams
    from splitserve.protos.v1 import gateway_pb2_grpc

    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))
    params = SamplingParams(temperature=0, max_tokens=args.serve_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(args.serve_requests):
        prompt = random_prompt(args.serve_prompt_len, vocab, gen)
        start = time.perf_counter()
        first = None
        tokens = 0
        timeout_s = min(120.0, deadline - time.monotonic())
        if timeout_s < 5:
            raise RuntimeError(f"the time budget ran out after {i} requests")
        for msg in stream(stub, prompt, params, timeout_s=timeout_s):
            if msg.HasField("chunk"):
                first = first or time.perf_counter()
                tokens += len(msg.chunk.token_ids)
        end = time.perf_counter()
        if first is None or tokens != args.serve_tokens:
            raise RuntimeError(f"request {i}: {tokens} of {args.serve_tokens} tokens")
        rows.append(
            {
                "request": i,
                "ttft_ms": (first - start) * 1e3,
                "tokens": tokens,
                "e2e_ms": (end - start) * 1e3,
            }
        )
        progress(f"serve: request {i}: TTFT {rows[-1]['ttft_ms']:.1f} ms, {tokens} tokens")
    return rows
