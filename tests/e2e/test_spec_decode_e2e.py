"""Speculative decoding on the decode worker of the disaggregated path: with n-gram proposals
the streamed greedy tokens equal HF's, drafts were proposed and some rejected (the decode
worker's `splitserve:spec_decode_*` metrics), each request's decode span carries the
speculation it saw, and nothing stays behind."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack
from tests.e2e.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.e2e.test_metrics import scrape
from tests.engine.hf_oracle import hf_greedy, random_prompts

pytestmark = pytest.mark.slow

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
NGRAM = ("--speculative-method", "ngram", "--num-speculative-tokens", "4")


def _total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


@pytest.fixture(scope="module")
def traced_stack(tiny_models):
    """One prefill and one speculating decode worker, exporting spans to a receiver here."""
    with OtlpReceiver() as receiver:
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        with running_stack(
            tiny_models["llama"], 1, 1, worker_args=NGRAM, metrics=True, env=env
        ) as stack:
            yield stack, receiver


def _generate(stack, prompts: list[list[int]], request_ids: list[str]) -> list:
    stub = gateway(stack)
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(
            pool.map(
                lambda a: collect(stream(stub, a[0], GREEDY, a[1], timeout_s=120)),
                zip(prompts, request_ids, strict=True),
            )
        )


def test_ngram_speculation_on_decode_workers_equals_hf_and_leaks_nothing(tiny_models, traced_stack):
    stack, _ = traced_stack
    model_dir = tiny_models["llama"]
    spans = random_prompts([9, 20, 5, 13], 500, seed=41)
    prompts = [s * 3 for s in spans] + random_prompts([40, 130], 500, seed=42)
    expected = [hf_greedy(model_dir, tuple(p), MAX_NEW) for p in prompts]
    results = _generate(stack, prompts, [""] * len(prompts))
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


def _decode_spans(receiver: OtlpReceiver, request_ids: list[str], timeout_s: float = 15.0):
    """Each request's `decode` span (the decode worker's), once all have been exported."""
    deadline = time.monotonic() + timeout_s
    while True:
        found: dict[str, ReceivedSpan] = {}
        for s in receiver.snapshot():
            request_id = s.attributes.get("splitserve.request_id")
            if s.service == "splitserve-decode" and s.name == "decode" and request_id:
                found[request_id] = s
        if set(request_ids) <= found.keys() or time.monotonic() > deadline:
            return [found.get(r) for r in request_ids]
        time.sleep(0.1)


def test_each_decode_span_carries_the_speculation_its_request_saw(tiny_models, traced_stack):
    stack, receiver = traced_stack
    spans = random_prompts([7, 16, 11], 500, seed=43)
    prompts = [s * 3 for s in spans] + random_prompts([30], 500, seed=44)
    request_ids = [f"spec-traced-{i}" for i in range(len(prompts))]
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    before = scrape(stack.metrics_ports["decode-0"])
    results = _generate(stack, prompts, request_ids)
    after = scrape(stack.metrics_ports["decode-0"])
    assert all(len(r.token_ids[0]) == MAX_NEW for r in results)

    decode_spans = _decode_spans(receiver, request_ids)
    assert all(s is not None for s in decode_spans), "a request's decode span never came"
    counted = dict.fromkeys(names, 0)
    for span in decode_spans:
        assert span is not None
        a = span.attributes
        if "splitserve.spec_decode.num_drafts" not in a:
            continue  # nothing of it was verified (the n-gram found no match)
        n = {name: a[f"splitserve.spec_decode.{name}"] for name in names}
        assert 0 < n["num_drafts"] <= n["num_draft_tokens"] <= 4 * n["num_drafts"]
        assert 0 <= n["num_accepted_tokens"] <= n["num_draft_tokens"]
        assert n["num_drafts"] + n["num_accepted_tokens"] <= MAX_NEW - 1  # the first came from P
        mean = a["splitserve.spec_decode.mean_acceptance_length"]
        assert mean == pytest.approx(1 + n["num_accepted_tokens"] / n["num_drafts"])
        for name in names:
            counted[name] += n[name]
    assert counted["num_drafts"] > 0, "no request's span shows speculation"
    # The spans split the decode worker's counters by request: nothing else ran meanwhile.
    for name in names:
        metric = f"splitserve:spec_decode_{name}_total"
        assert counted[name] == _total(after, metric) - _total(before, metric), name
    assert_nothing_leaks(stack)


def test_draft_checkpoint_on_decode_workers_catches_up_in_chunks_equals_hf_and_leaks_nothing(
    tiny_models,
):
    model_dir = tiny_models["llama"]
    # The draft is the target's own checkpoint: every draft is accepted only if the prompt KV
    # the decode worker caught up on (in chunks of 8, decoding plainly meanwhile) is right.
    args = (
        "--speculative-method", "draft", "--speculative-model", str(model_dir),
        "--num-speculative-tokens", "3", "--speculative-draft-catch-up-tokens", "8",
    )  # fmt: skip
    prompts = random_prompts([40, 130], 500, seed=45)
    expected = [hf_greedy(model_dir, tuple(p), MAX_NEW) for p in prompts]
    with running_stack(model_dir, 1, 1, worker_args=args, metrics=True) as stack:
        results = _generate(stack, prompts, [""] * len(prompts))
        assert [r.token_ids[0] for r in results] == expected
        decode = scrape(stack.metrics_ports["decode-0"])
        drafts = _total(decode, "splitserve:spec_decode_num_draft_tokens_total")
        accepted = _total(decode, "splitserve:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and accepted == drafts, (drafts, accepted)
        assert_nothing_leaks(stack)
