"""The mission end to end: gateway -> prefill worker -> KV pushed -> decode worker -> tokens,
across real processes with a real redis-server; outputs equal the offline engine's."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from splitserve.client import collect, stream
from splitserve.engine import LLM, SamplingParams
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, stats, workers
from tests.engine.hf_oracle import random_prompts

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LENGTHS = [1, 3, 17, 40, 64, 90, 130, 200, 250, 300, 12, 33, 77, 150, 5, 48]


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model_dir)
    prompts = random_prompts(LENGTHS, llm.engine.model_config.vocab_size, seed=21)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=["nixl", "grpc"])
def stack(model_dir, request):
    """Two prefill and two decode workers moving KV over one transport (each module's tests
    run once per transport)."""
    with running_stack(model_dir, prefill=2, decode=2, kv_transport=request.param) as s:
        offered = {w.kv_transports for w in workers(s)}
        assert offered == {(request.param,)}, offered
        yield s


def _generate_all(stub, prompts, params):
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(lambda p: collect(stream(stub, p, params, timeout_s=120)), p)
            for p in prompts
        ]
        return [f.result() for f in futures]


def test_concurrent_disaggregated_greedy_equals_offline(stack, offline):
    prompts, expected = offline
    results = _generate_all(gateway(stack), prompts, GREEDY)
    assert [r.token_ids[0] for r in results] == expected
    for r, prompt in zip(results, prompts, strict=True):
        assert r.finished.usage.prompt_tokens == len(prompt)
        assert r.finished.usage.completion_tokens == GREEDY.max_tokens
        assert r.finished.samples[0].finish_reason == 2  # FINISH_REASON_LENGTH
    # Both prefill and both decode workers took part.
    roles = {w.worker_id: stats(w) for w in workers(stack)}
    assert sum(1 for k, s in roles.items() if k.startswith("decode") and s.kv_bytes_received) == 2
    assert sum(1 for k, s in roles.items() if k.startswith("prefill") and s.kv_bytes_sent) == 2
    assert_nothing_leaks(stack)


def test_shared_prefix_sends_fewer_bytes_to_a_decode_worker_holding_it(stack, model_dir):
    stub = gateway(stack)
    vocab = LLM.__name__ and 500
    shared = random_prompts([96], vocab, seed=31)[0]
    first, second = (shared + tail for tail in random_prompts([10, 12], vocab, seed=32))

    def received() -> int:
        return sum(stats(w).kv_bytes_received for w in workers(stack) if w.kind == "decode")

    before = received()
    one = collect(stream(stub, first, GREEDY, timeout_s=60))
    time.sleep(1.0)  # the decode worker publishes its prefix index on its next heartbeat
    middle = received()
    two = collect(stream(stub, second, GREEDY, timeout_s=60))
    after = received()
    assert one.finished.usage.cached_prompt_tokens == 0
    assert two.finished.usage.cached_prompt_tokens == 96
    # The first prompt (106 tokens) sent all its 7 blocks; the second (108 tokens) only the
    # one its cached 96-token prefix (6 blocks) does not cover.
    block_bytes = (middle - before) // 7
    assert (middle - before) == 7 * block_bytes > 0
    assert after - middle == block_bytes, "only the missing block is sent"
    assert_nothing_leaks(stack)


BAD_REQUESTS = [
    ({"text": ""}, {}, "prompt is empty"),
    ({"token_ids": [5, 10**6]}, {}, "outside the vocabulary"),
    ({"token_ids": [5, 6]}, {"temperature": -1.0}, "temperature"),
    ({"token_ids": [5, 6]}, {"top_p": 1.5}, "top_p"),
    ({"token_ids": [5, 6]}, {"logprobs": 50}, "logprobs"),
    ({"token_ids": [5, 6]}, {"max_tokens": 5000}, "exceeds the model's context"),
    ({"token_ids": [5, 6]}, {"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({}, {}, "prompt is missing"),
]


def test_bad_inputs_get_invalid_argument_while_other_requests_keep_running(stack):
    from splitserve.protos.v1 import common_pb2, gateway_pb2

    stub = gateway(stack)
    long_params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(lambda: collect(stream(stub, [7] * 50, long_params, timeout_s=120)))
        time.sleep(0.3)
        for prompt, sampling, message in BAD_REQUESTS:
            request = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling))
            if "text" in prompt:
                request.text = prompt["text"]
            if "token_ids" in prompt:
                request.token_ids.ids.extend(prompt["token_ids"])
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (prompt, sampling)
            assert message in err.value.details(), err.value.details()
        done = running.result()
    assert len(done.token_ids[0]) == 150
    assert_nothing_leaks(stack)


def test_cancel_during_decode_frees_blocks_everywhere(stack):
    stub = gateway(stack)
    params = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
    call = stream(stub, [9] * 30, params, timeout_s=120)
    got = 0
    for msg in call:
        got += len(msg.chunk.token_ids)
        if got >= 5:
            break
    call.cancel()
    assert_nothing_leaks(stack)


def test_cancel_during_prefill_frees_blocks_everywhere(stack):
    stub = gateway(stack)
    prompt = random_prompts([1900], 500, seed=41)[0]
    call = stream(stub, prompt, SamplingParams(max_tokens=8), request_id="cancel-me", timeout_s=120)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until a prefill worker is busy with it
        if any(stats(w).num_running for w in workers(stack) if w.kind == "prefill"):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the prefill never started")
    from splitserve.protos.v1 import common_pb2

    assert stub.Abort(common_pb2.AbortRequest(request_id="cancel-me"), timeout=10).aborted
    final = list(call)[-1]  # an aborted stream ends with its final message, not an error
    assert final.HasField("finished")
    assert [s.finish_reason for s in final.finished.samples] == [common_pb2.FINISH_REASON_ABORT]
    assert_nothing_leaks(stack)


def test_model_info_describes_the_model(stack):
    from splitserve.protos.v1 import gateway_pb2

    info = gateway(stack).GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10)
    assert info.architecture == "LlamaForCausalLM"
    assert info.max_model_len == 2048 and info.vocab_size > 0 and info.block_size == 16


def test_every_server_serves_health_and_reflection(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    addresses = [stack.address] + [w.address for w in workers(stack)]
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
            names = {s.name for r in replies for s in r.list_services_response.service}
            assert "grpc.health.v1.Health" in names
            assert names & {
                "splitserve.v1.Gateway",
                "splitserve.v1.PrefillWorker",
                "splitserve.v1.DecodeWorker",
            }


def test_deadline_is_enforced_and_frees_everything(stack):
    params = SamplingParams(temperature=0, max_tokens=1900, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as err:
        collect(stream(gateway(stack), [11] * 40, params, timeout_s=1.0))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_nothing_leaks(stack)


def test_the_gateway_and_worker_fronts_serve_without_loading_torch(stack, offline):
    """The gateway and each worker's front tokenize (transformers' tokenizers, torch-free) and
    load no torch at all: none of libtorch is mapped into their processes once they have served,
    while each worker's engine core (a child of its front) has it."""
    prompts, expected = offline
    assert _generate_all(gateway(stack), prompts[:2], GREEDY)[0].token_ids[0] == expected[0]
    for name in ("gateway", "prefill-0", "decode-0"):
        pid = stack.process(name).pid
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps and "/torch/" not in maps, name
        assert "tokenizers" in maps, name  # NOTE: the check sees the process's native libraries
        if name != "gateway":
            tasks = Path(f"/proc/{pid}/task").iterdir()
            cores = [c for t in tasks for c in (t / "children").read_text().split()]
            core_maps = [Path(f"/proc/{c}/maps").read_text() for c in cores]
            assert any("libtorch" in m for m in core_maps), name
