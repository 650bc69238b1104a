"""What structured outputs cost the sampler per decode step.

    python -m bench.structured [--batch 64] [--vocab 128256] [--steps 200] [--out F] [--smoke]

A batch of `--batch` rows goes through the engine's `Sampler` each step, on random logits
(bf16 on the device, as a model's LM head gives them): once with every row free (the
baseline), then with half the rows constrained (JSON schemas, regexes and choices, compiled by
xgrammar) and their matchers advanced with each sampled token, as the scheduler does. Both in
the same run, greedy and sampled (temperature 1). The breakdown times the parts of the
constrained step alone, as the matchers advance: filling the bitmask (CPU, xgrammar; row by row
on one thread, then in xgrammar's threads as the sampler does), the sampler's fill, copy and
mask kernel, and advancing the matchers.

No model hub is needed: the vocabulary is synthetic (the 256 bytes, then seeded random strings
of 2 to 8 printable characters up to `--vocab` tokens), which keeps the grammars' token masks
as large and varied as a real tokenizer's. `--smoke` runs tiny shapes on any device.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import time
from collections.abc import Callable

import torch
import xgrammar as xgr

from bench.common import device_name, sync, table, write_results
from splitserve.engine.grammar import GrammarState, TokenBitmask, json_schema_ebnf
from splitserve.engine.sampler import Sampler, SamplingRow
from splitserve.engine.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{2,8}\\.com$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags"],
}
REGEX = r"\d{4}-\d{2}-\d{2}( [A-Z][a-z]{1,10}){0,3}"
CHOICES = ["positive", "negative", "neutral", "mixed", "unknown"]
EOS = 0


def synthetic_vocab(vocab_size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " " * 8
    vocab = [bytes([b]) for b in range(256)]
    seen = set(vocab)
    while len(vocab) < vocab_size:
        token = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8))).encode()
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    vocab[EOS] = b"</s>"
    return vocab


def compile_grammars(vocab_size: int) -> list[xgr.CompiledGrammar]:
    info = xgr.TokenizerInfo(synthetic_vocab(vocab_size), xgr.VocabType.RAW, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info)
    json_grammar = compiler.compile_grammar(json_schema_ebnf(json.dumps(SCHEMA), strict=True))
    regex = compiler.compile_regex(REGEX)
    choice = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in CHOICES))
    return [json_grammar, regex, choice]


class Workload:
    """`batch` rows, every other one constrained when `constrained`; grammars restart when done."""

    def __init__(self, batch: int, grammars: list[xgr.CompiledGrammar], constrained: bool, params):
        self.grammars = grammars
        self.states: list[GrammarState | None] = [
            GrammarState(grammars[(i // 2) % len(grammars)]) if constrained and i % 2 else None
            for i in range(batch)
        ]
        self.params = params

    def rows(self) -> list[SamplingRow]:
        return [SamplingRow(self.params, (), (), grammar=state) for state in self.states]

    def advance(self, token_ids: list[int]) -> None:
        for i, (state, token_id) in enumerate(zip(self.states, token_ids, strict=True)):
            if state is not None and state.advance(token_id):
                self.states[i] = GrammarState(self.grammars[(i // 2) % len(self.grammars)])


def time_steps(step: Callable[[int], None], steps: int, warmup: int = 5) -> float:
    """Milliseconds per step, the median of three runs of `steps` steps."""
    for i in range(warmup):
        step(i)
    runs = []
    for _ in range(3):
        sync()
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        sync()
        runs.append((time.perf_counter() - start) * 1e3 / steps)
    return sorted(runs)[1]


def bench(batch: int, vocab: int, steps: int, device: torch.device) -> dict:
    grammars = compile_grammars(vocab)
    gen = torch.Generator(device=device).manual_seed(0)
    pool = [
        (torch.randn(batch, vocab, device=device, generator=gen) * 4).to(torch.bfloat16)
        for _ in range(8)
    ]
    sampler = Sampler()
    rows = []
    for mode, params in [
        ("greedy", SamplingParams(temperature=0.0)),
        ("sampled", SamplingParams(temperature=1.0)),
    ]:
        timings = {}
        for constrained in (False, True):
            work = Workload(batch, grammars, constrained, params)

            def step(i: int, work: Workload = work) -> None:
                out = sampler(pool[i % len(pool)], work.rows())
                work.advance(out.token_ids)

            timings[constrained] = time_steps(step, steps)
        rows.append(
            {
                "sampling": mode,
                "free_ms": timings[False],
                "half_constrained_ms": timings[True],
                "mask_cost_ms": timings[True] - timings[False],
            }
        )
    return {"rows": rows, "breakdown": breakdown(batch, vocab, steps, grammars, pool)}


def breakdown(batch, vocab, steps, grammars, pool) -> dict:
    """The constrained step's grammar parts, timed one by one inside the advancing workload
    (ms per step): matchers move through their grammars as in a real run, so a fill is timed
    where it is dear (inside strings and regex classes), not only at a grammar's start."""
    work = Workload(batch, grammars, True, SamplingParams(temperature=0.0))
    bitmask = TokenBitmask()
    host = xgr.allocate_token_bitmask(batch, vocab)
    batch_matcher = xgr.BatchGrammarMatcher()
    totals = {"fill_one_thread_ms": 0.0, "fill_ms": 0.0, "fill_and_apply_ms": 0.0,
              "advance_ms": 0.0}  # fmt: skip
    for i in range(steps):
        logits = pool[i % len(pool)].float()
        states = [(row, s) for row, s in enumerate(work.states) if s is not None]
        start = time.perf_counter()
        for row, state in states:
            state.fill(host, row)
        one_thread = time.perf_counter()
        batch_matcher.batch_fill_next_token_bitmask(
            [s.matcher for _, s in states], host, [row for row, _ in states]
        )
        filled = time.perf_counter()
        bitmask.apply(logits, work.states)
        token_ids = logits.argmax(dim=-1).tolist()  # NOTE: waits for the copy and the kernel
        applied = time.perf_counter()
        work.advance(token_ids)
        advanced = time.perf_counter()
        totals["fill_one_thread_ms"] += one_thread - start
        totals["fill_ms"] += filled - one_thread
        totals["fill_and_apply_ms"] += applied - filled
        totals["advance_ms"] += advanced - applied
    return {name: seconds * 1e3 / steps for name, seconds in totals.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128256, help="Llama-3's vocabulary size")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device")
    parser.add_argument("--out", default="bench/results/structured.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.vocab, args.steps = 8, 1024, 10
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = bench(args.batch, args.vocab, args.steps, device)
    results = {
        "benchmark": "structured outputs: sampler step with half the rows constrained",
        "device": device_name(),
        "batch": args.batch,
        "num_constrained": args.batch // 2,
        "vocab_size": args.vocab,
        "logits_dtype": "bfloat16",
        "grammars": ["json_schema", "regex", "choice"],
        "steps": args.steps,
        **result,
    }
    print(
        f"{results['device']}: batch {args.batch}, {args.batch // 2} constrained, "
        f"vocab {args.vocab}"
    )
    print(table(result["rows"], ["sampling", "free_ms", "half_constrained_ms", "mask_cost_ms"]))
    print(table([result["breakdown"]], list(result["breakdown"])))
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main()
