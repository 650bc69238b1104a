"""Prometheus /metrics on every service: vLLM-style `splitserve:` names, a `model_name` label on
every series, and values that move with traffic."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ENGINE_SERIES = [
    "splitserve:num_requests_running",
    "splitserve:num_requests_waiting",
    "splitserve:kv_cache_usage_perc",
    "splitserve:num_preemptions_total",
    "splitserve:prefix_cache_queries_total",
    "splitserve:prefix_cache_hits_total",
]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every `splitserve:` sample: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("splitserve:"):
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": "llama", **labels}.items())))
    assert key in samples, f"{name}{labels} not exported; have {sorted({k[0] for k in samples})}"
    return samples[key]


@pytest.fixture(scope="module")
def stack(tiny_models):
    with running_stack(tiny_models["llama"], prefill=1, decode=1, metrics=True) as s:
        yield s


def test_every_service_exports_named_metrics_that_move_with_traffic(stack):
    ports = stack.metrics_ports
    assert set(ports) == {"gateway", "prefill-0", "decode-0"}
    before = {name: scrape(port) for name, port in ports.items()}
    prompts = random_prompts([40, 150, 260], 500, seed=81)
    stub = gateway(stack)
    for prompt in prompts:
        assert len(collect(stream(stub, prompt, PARAMS, timeout_s=60)).token_ids[0]) == 8
    time.sleep(1.0)  # the decode worker indexes its cached prefix on its next heartbeat
    again = collect(stream(stub, prompts[2], PARAMS, timeout_s=60))
    assert again.finished.usage.cached_prompt_tokens > 0
    after = {name: scrape(port) for name, port in ports.items()}
    n = len(prompts) + 1

    gw, gw0 = after["gateway"], before["gateway"]
    success = "splitserve:request_success_total"
    assert value(gw, success, finished_reason="length") == n
    assert (success, (("finished_reason", "length"), ("model_name", "llama"))) not in gw0
    assert value(gw, "splitserve:time_to_first_token_seconds_count") == n
    assert value(gw0, "splitserve:time_to_first_token_seconds_count") == 0
    assert value(gw, "splitserve:time_to_first_token_seconds_sum") > 0
    assert value(gw, "splitserve:inter_token_latency_seconds_count") == n * 7
    assert value(gw, "splitserve:e2e_request_latency_seconds_count") == n
    decisions = "splitserve:routing_decisions_total"
    assert value(gw, decisions, kind="decode", reason="least_loaded") == n - 1
    assert value(gw, decisions, kind="decode", reason="prefix_hit") == 1
    assert value(gw, decisions, kind="prefill", reason="least_loaded") == n

    pf, dc = after["prefill-0"], after["decode-0"]
    sent = value(pf, "splitserve:kv_transfer_bytes_total")
    assert sent > 0 and value(before["prefill-0"], "splitserve:kv_transfer_bytes_total") == 0
    assert value(dc, "splitserve:kv_transfer_bytes_total") == sent
    # The sender times each push; a one-sided NIXL write can't be timed by its target.
    assert value(pf, "splitserve:kv_transfer_seconds_count") > 0
    for samples in (pf, dc):
        assert value(samples, "splitserve:kv_transfer_failures_total") == 0
        for name in ENGINE_SERIES:
            value(samples, name)
        assert value(samples, "splitserve:prefix_cache_queries_total") > 0
        assert value(samples, "splitserve:num_requests_running") == 0
    assert value(pf, "splitserve:request_queue_time_seconds_count") == n
    assert value(pf, "splitserve:request_prefill_time_seconds_count") == n
    assert value(dc, success, finished_reason="length") == n
    assert value(dc, "splitserve:inter_token_latency_seconds_count") == n * 7
    assert value(dc, "splitserve:prefix_cache_hits_total") > 0
    # The decode worker's serving steps: counted, timed, and the histogram agrees with them.
    steps = value(dc, "splitserve:num_steps_total")
    assert steps >= 7
    assert value(dc, "splitserve:step_duration_seconds_count") == steps
    assert value(dc, "splitserve:step_duration_seconds_bucket", le="+Inf") == steps
    assert value(dc, "splitserve:step_duration_seconds_sum") == pytest.approx(
        value(dc, "splitserve:step_seconds_total")
    )
    longest = value(dc, "splitserve:step_seconds_max")
    assert 0 < longest <= value(dc, "splitserve:step_seconds_total")

    # `model_name` on every series of every service.
    for name, samples in after.items():
        unlabelled = [k for k in samples if dict(k[1]).get("model_name") != "llama"]
        assert not unlabelled, (name, unlabelled)
    assert_nothing_leaks(stack)
