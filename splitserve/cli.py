"""`splitserve <command>`: the console entry point.

Each subcommand lives in its own small function; services add theirs here as they land.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _make_tiny_model(args: argparse.Namespace) -> int:
    from engine.tiny_model import make_tiny_model

    path = make_tiny_model(args.dir, args.arch, seed=args.seed, num_shards=args.shards)
    print(f"wrote a tiny random-weight {args.arch} checkpoint to {path}")
    return 0


def _generate_offline(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for out in llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1):
        print(out.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from engine.tiny_model import SUPPORTED_TINY_ARCHS

    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser(
        "make-tiny-model", help="write a tiny random-weight HF checkpoint (no network needed)"
    )
    tiny.add_argument("dir", help="output directory")
    tiny.add_argument("--arch", choices=SUPPORTED_TINY_ARCHS, default="llama")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--shards", type=int, default=1, help="split the weights into N files")
    tiny.set_defaults(func=_make_tiny_model)

    offline = sub.add_parser("offline", help="generate in-process with the offline engine")
    offline.add_argument("prompts", nargs="+")
    offline.add_argument("--model", required=True, help="HF-format model directory")
    offline.add_argument("--dtype", default="float32")
    offline.add_argument("--temperature", type=float, default=0.0)
    offline.add_argument("--max-tokens", type=int, default=32)
    offline.set_defaults(func=_generate_offline)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"splitserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
