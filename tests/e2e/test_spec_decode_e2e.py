"""Speculative decoding on the decode worker of the disaggregated path: with n-gram proposals
the streamed greedy tokens equal HF's, drafts were proposed and some rejected (the decode
worker's `splitserve:spec_decode_*` metrics), and nothing stays behind."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack
from tests.e2e.test_metrics import scrape
from tests.engine.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
NGRAM = ("--speculative-method", "ngram", "--num-speculative-tokens", "4")


def _total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_ngram_speculation_on_decode_workers_equals_hf_and_leaks_nothing(tiny_models):
    model_dir = tiny_models["llama"]
    spans = random_prompts([9, 20, 5, 13], 500, seed=41)
    prompts = [s * 3 for s in spans] + random_prompts([40, 130], 500, seed=42)
    expected = [hf_greedy(model_dir, tuple(p), MAX_NEW) for p in prompts]
    with running_stack(model_dir, 1, 1, worker_args=NGRAM, metrics=True) as stack:
        stub = gateway(stack)
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(lambda p: collect(stream(stub, p, GREEDY, timeout_s=120)), prompts)
            )
        assert [r.token_ids[0] for r in results] == expected
        decode = scrape(stack.metrics_ports["decode-0"])
        drafts = _total(decode, "splitserve:spec_decode_num_draft_tokens_total")
        accepted = _total(decode, "splitserve:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and 0 < accepted < drafts, (drafts, accepted)
        per_pos = _total(decode, "splitserve:spec_decode_num_accepted_tokens_per_pos_total")
        assert per_pos == accepted
        prefill = scrape(stack.metrics_ports["prefill-0"])
        assert _total(prefill, "splitserve:spec_decode_num_drafts_total") == 0  # prefill only
        assert_nothing_leaks(stack)
