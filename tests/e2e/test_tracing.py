"""One request is one trace: the gateway, prefill and decode processes export their spans over
OTLP/gRPC to a receiver in this test, and the spans link up across every hop, the KV push
included, with the GenAI attributes on them."""

from __future__ import annotations

import time

import pytest

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from tests.e2e.harness import gateway, running_stack
from tests.e2e.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

SERVER, CLIENT = 2, 3  # OTLP SpanKind values
PROMPT_LEN = 300  # > 2 chunks at the test workers' --max-num-batched-tokens 128
PARAMS = SamplingParams(temperature=0, top_p=0.9, max_tokens=12, ignore_eos=True)
EXPECTED = {
    ("splitserve-gateway", "text_completion llama"),
    ("splitserve-gateway", "splitserve.v1.DecodeWorker/Reserve"),
    ("splitserve-gateway", "splitserve.v1.PrefillWorker/Prefill"),
    ("splitserve-gateway", "splitserve.v1.DecodeWorker/Decode"),
    ("splitserve-decode", "decode.reserve"),
    ("splitserve-prefill", "prefill"),
    ("splitserve-prefill", "prefill.chunk"),
    ("splitserve-prefill", "kv.push"),
    ("splitserve-decode", "kv.receive"),
    ("splitserve-decode", "decode"),
    ("splitserve-decode", "decode.admission"),
}


def _trace_of(receiver: OtlpReceiver, request_id: str, timeout_s: float = 15.0):
    """The spans of the trace whose gateway span carries `request_id`, once all are in."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = receiver.snapshot()
        roots = [s for s in spans if s.attributes.get("splitserve.request_id") == request_id]
        trace_ids = {s.trace_id for s in roots if s.service == "splitserve-gateway"}
        trace = [s for s in spans if s.trace_id in trace_ids]
        if {(s.service, s.name) for s in trace} >= EXPECTED or time.monotonic() > deadline:
            return trace_ids, trace
        time.sleep(0.1)


def _one(trace: list[ReceivedSpan], name: str) -> ReceivedSpan:
    [span] = [s for s in trace if s.name == name]
    return span


def test_one_request_is_one_linked_trace_across_gateway_prefill_kv_and_decode(tiny_models):
    prompt = random_prompts([PROMPT_LEN], 500, seed=71)[0]
    with OtlpReceiver() as receiver:
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        with running_stack(tiny_models["llama"], prefill=1, decode=1, env=env) as stack:
            result = collect(stream(gateway(stack), prompt, PARAMS, "traced-1", timeout_s=60))
            assert len(result.token_ids[0]) == PARAMS.max_tokens
            trace_ids, trace = _trace_of(receiver, "traced-1")

    assert len(trace_ids) == 1, "the request's spans must form exactly one trace"
    assert {(s.service, s.name) for s in trace} >= EXPECTED
    assert {s.service for s in trace} == {
        "splitserve-gateway",
        "splitserve-prefill",
        "splitserve-decode",
    }

    # Links: one root (the gateway's), every other span's parent is in the same trace.
    by_id = {s.span_id: s for s in trace}
    roots = [s for s in trace if not s.parent_span_id]
    assert [r.name for r in roots] == ["text_completion llama"]
    root = roots[0]
    for span in trace:
        if span is not root:
            assert span.parent_span_id in by_id, f"{span.name} has a parent outside the trace"
            assert span.end_ns >= span.start_ns

    def parent(span: ReceivedSpan) -> ReceivedSpan:
        return by_id[span.parent_span_id]

    prefill = _one(trace, "prefill")
    assert prefill.kind == SERVER
    assert parent(prefill).name == "splitserve.v1.PrefillWorker/Prefill"
    assert parent(parent(prefill)) is root
    chunks = [s for s in trace if s.name == "prefill.chunk"]
    assert len(chunks) >= 2 and all(parent(c) is prefill for c in chunks)
    assert sum(c.attributes["splitserve.chunk.num_tokens"] for c in chunks) == PROMPT_LEN
    pushes = [s for s in trace if s.name == "kv.push"]
    receives = [s for s in trace if s.name == "kv.receive"]
    assert pushes and all(parent(p) is prefill and p.kind == CLIENT for p in pushes)
    assert len(receives) == len(pushes)
    assert all(parent(r).name == "kv.push" and r.service == "splitserve-decode" for r in receives)
    decode = _one(trace, "decode")
    assert parent(decode).name == "splitserve.v1.DecodeWorker/Decode"
    assert parent(_one(trace, "decode.admission")) is decode
    assert parent(_one(trace, "decode.reserve")).name == "splitserve.v1.DecodeWorker/Reserve"

    # GenAI semantic-convention attributes, and the KV transfer's.
    a = root.attributes
    assert a["gen_ai.request.model"] == "llama"
    assert a["gen_ai.request.max_tokens"] == PARAMS.max_tokens
    assert a["gen_ai.request.temperature"] == 0.0
    assert abs(a["gen_ai.request.top_p"] - 0.9) < 1e-6
    assert a["gen_ai.usage.input_tokens"] == PROMPT_LEN
    assert a["gen_ai.usage.output_tokens"] == PARAMS.max_tokens
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < a["gen_ai.server.time_to_first_token"] < 60
    num_bytes = sum(p.attributes["splitserve.kv.bytes"] for p in pushes)
    assert num_bytes > 0 and a["splitserve.kv.bytes"] == num_bytes
    assert sum(r.attributes["splitserve.kv.bytes"] for r in receives) == num_bytes
    assert all(p.attributes["splitserve.kv.transfer_seconds"] > 0 for p in pushes)
    # Both ends name the transport; only a two-sided one (gRPC) can time the receive.
    transport = pushes[0].attributes["splitserve.kv.transport"]
    assert transport in ("nixl", "grpc")
    assert all(r.attributes["splitserve.kv.transport"] == transport for r in receives)
    if transport == "grpc":
        assert all(r.attributes["splitserve.kv.transfer_seconds"] > 0 for r in receives)
    assert prefill.attributes["gen_ai.request.model"] == "llama"
    assert decode.attributes["gen_ai.usage.output_tokens"] == PARAMS.max_tokens
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["length"]
