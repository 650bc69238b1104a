"""LoRA adapters through the disaggregated path: gateway -> prefill worker -> KV pushed ->
decode worker, real processes and a real redis-server. Requests mixing three adapters and the
base model give what HF + peft give; workers advertise their adapters; an adapter no worker
serves is NOT_FOUND with its name, and the stack leaks nothing."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from splitserve.client import collect
from splitserve.engine import LLM, SamplingParams
from splitserve.protos import convert
from splitserve.protos.v1 import gateway_pb2
from splitserve.testing.tiny_lora import make_tiny_lora
from tests.e2e.harness import assert_nothing_leaks, gateway, running_stack, stats, workers
from tests.engine.hf_oracle import hf_greedy, random_prompts
from tests.engine.lora_oracle import peft_greedy

pytestmark = pytest.mark.slow

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
NAMES = ("all", "attn", "mlp")
MIX = ["all", None, "attn", "mlp", "all", None]


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e-loras")
    specs = {
        "all": {},
        "attn": {"rank": 4, "target_modules": ("q_proj", "v_proj", "o_proj")},
        "mlp": {"rank": 16, "target_modules": ("gate_proj", "up_proj", "down_proj")},
    }
    return {
        name: make_tiny_lora(model_dir, root / name, seed=i + 11, **spec)
        for i, (name, spec) in enumerate(specs.items())
    }


@pytest.fixture(scope="module")
def stack(model_dir, adapters):
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    args = ("--lora-modules", modules, "--max-loras", "2")
    with running_stack(
        model_dir, prefill=1, decode=1, kv_transport="grpc", worker_args=args, http_port=0
    ) as s:
        yield s


def _request(prompt: list[int], adapter: str | None) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling=convert.sampling_to_proto(GREEDY),
        adapter=adapter or "",
    )


def test_mixed_adapters_through_the_disaggregated_path_equal_peft(stack, model_dir, adapters):
    assert {w.kind: w.adapters for w in workers(stack)} == {
        "prefill": NAMES,
        "decode": NAMES,
    }
    prompts = random_prompts([7, 30, 19, 45, 12, 26], 500, seed=41)
    stub = gateway(stack)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(lambda p, a: collect(stub.Generate(_request(p, a), timeout=120)), p, a)
            for p, a in zip(prompts, MIX, strict=True)
        ]
        results = [f.result() for f in futures]
    for prompt, name, result in zip(prompts, MIX, results, strict=True):
        if name is None:
            want = hf_greedy(model_dir, tuple(prompt), MAX_NEW)
        else:
            want = peft_greedy(model_dir, adapters[name], prompt, MAX_NEW)
        assert result.token_ids[0] == want, f"adapter {name} diverged from HF + peft"
    # The KV went from the prefill worker to the decode worker.
    assert any(stats(w, stack).kv_bytes_received for w in workers(stack) if w.kind == "decode")
    assert_nothing_leaks(stack)


def test_unknown_adapter_is_not_found_with_its_name(stack):
    with pytest.raises(grpc.RpcError) as err:
        collect(gateway(stack).Generate(_request([5, 6, 7], "no-such-adapter"), timeout=30))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-adapter" in err.value.details()
    assert_nothing_leaks(stack)


def test_openai_model_field_names_an_adapter_and_models_lists_them(stack, model_dir, adapters):
    listed = httpx.get(f"{stack.http_url}/models", timeout=30).json()["data"]
    base = listed[0]["id"]
    assert [m["id"] for m in listed] == [base, *NAMES]
    assert all(m["parent"] == base for m in listed[1:])
    prompt = random_prompts([21], 500, seed=43)[0]
    body = {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{stack.http_url}/completions", json={**body, "model": "attn"}, timeout=60)
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["text"]
    offline = LLM(model_dir, lora_modules=(("attn", str(adapters["attn"])),))
    out = offline.generate([prompt], GREEDY, use_tqdm=False, lora_request="attn")[0].outputs[0]
    assert out.token_ids == peft_greedy(model_dir, adapters["attn"], prompt, MAX_NEW)
    assert text == out.text
    unknown = httpx.post(
        f"{stack.http_url}/completions", json={**body, "model": "nope"}, timeout=60
    )
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]["message"]
    assert_nothing_leaks(stack)


def test_load_and_unload_at_run_time_with_requests_in_flight(stack, model_dir, tmp_path):
    late = make_tiny_lora(model_dir, tmp_path / "late", seed=99, rank=8)
    stub = gateway(stack)
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)

    def run(prompt: list[int], adapter: str | None, params: SamplingParams = GREEDY):
        request = _request(prompt, adapter)
        request.sampling.CopyFrom(convert.sampling_to_proto(params))
        return collect(stub.Generate(request, timeout=300))

    prompts = random_prompts([15, 22, 9], 500, seed=45)
    with ThreadPoolExecutor(4) as pool:
        # Requests in flight under other adapters and the base model while "late" loads.
        busy = [
            pool.submit(run, p, a, long) for p, a in zip(prompts, ["all", None, "mlp"], strict=True)
        ]
        reply = stub.LoadLoRAAdapter(
            gateway_pb2.LoadLoRAAdapterRequest(lora_name="late", lora_path=str(late)), timeout=60
        )
        assert sorted(reply.worker_ids) == sorted(w.worker_id for w in workers(stack))
        prompt = random_prompts([18], 500, seed=46)[0]
        assert run(prompt, "late").token_ids[0] == peft_greedy(model_dir, late, prompt, MAX_NEW)
        # An unload while a request uses the adapter is refused; the request finishes.
        request = _request(prompt, "late")
        request.sampling.CopyFrom(convert.sampling_to_proto(long))
        using = stub.Generate(request, timeout=300)
        first = next(using)  # decoding on the decode worker now
        refused = httpx.post(
            f"{stack.http_url}/unload_lora_adapter", json={"lora_name": "late"}, timeout=60
        )
        rest = collect(itertools.chain([first], using))
        assert rest.finished.usage.completion_tokens == long.max_tokens
        for future in busy:
            assert future.result().finished.usage.completion_tokens == long.max_tokens
    if refused.status_code != 200:  # the decode worker still ran the request then
        assert "in use" in refused.json()["error"]["message"], refused.text
        done = httpx.post(
            f"{stack.http_url}/unload_lora_adapter", json={"lora_name": "late"}, timeout=60
        )
        assert done.status_code == 200, done.text
    listed = httpx.get(f"{stack.http_url}/models", timeout=30).json()["data"]
    assert "late" not in [m["id"] for m in listed]
    with pytest.raises(grpc.RpcError) as err:
        run([5, 6, 7], "late")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert_nothing_leaks(stack)
