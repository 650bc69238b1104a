"""The OpenAI-compatible HTTP API on a real stack (redis-server, a prefill and a decode worker,
the gateway), driven by the official `openai` client: greedy text equals the offline engine's,
usage counts are right, streaming equals not streaming, a disconnect frees every block; errors
come in OpenAI's shape with the matching HTTP status (httpx)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.launch.up import free_port
from tests.e2e.harness import assert_nothing_leaks, leftovers, running_stack, stats, workers

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def stack(model_dir):
    with running_stack(model_dir, prefill=1, decode=1, http_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir)


@pytest.fixture(scope="module")
def chat_ids(llm):
    rendered = llm.engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    return list(rendered if isinstance(rendered, list) else rendered["input_ids"])


def _offline(llm, prompt, **params):
    params = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **params}
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def test_models_and_health(stack, client, model_dir):
    assert [m.id for m in client.models.list().data] == [model_dir.name]
    assert httpx.get(stack.http_url.removesuffix("/v1") + "/health").status_code == 200


def test_completion_greedy_equals_offline_with_usage(client, llm, model_dir):
    want = _offline(llm, PROMPT)
    got = client.completions.create(
        model=model_dir.name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert got.choices[0].text == want.outputs[0].text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == MAX_TOKENS
    assert got.usage.total_tokens == len(want.prompt_token_ids) + MAX_TOKENS


def test_completion_stream_equals_offline_and_reports_usage(client, llm, model_dir):
    want = _offline(llm, PROMPT)
    chunks = list(
        client.completions.create(
            model=model_dir.name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


def test_chat_greedy_equals_offline_on_the_chat_template(client, llm, model_dir, chat_ids):
    want = _offline(llm, chat_ids)
    got = client.chat.completions.create(
        model=model_dir.name, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(chat_ids)
    assert got.usage.completion_tokens == MAX_TOKENS
    chunks = list(
        client.chat.completions.create(
            model=model_dir.name, messages=CHAT, max_completion_tokens=MAX_TOKENS,
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n2_seeded_samples_are_reproducible(client, model_dir):
    def sample():
        return client.completions.create(
            model=model_dir.name, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=7,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    first, second = sample(), sample()
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 16


def test_stop_string_cuts_the_text_streaming_or_not(client, llm, model_dir):
    text = _offline(llm, PROMPT).outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"no usable stop string in {text!r}"
    expected = text[: text.index(stop)]
    kwargs = dict(model=model_dir.name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                  stop=[stop], extra_body={"ignore_eos": True})  # fmt: skip
    got = client.completions.create(**kwargs)
    assert (got.choices[0].text, got.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_logprobs_match_the_offline_engine(client, llm, model_dir, chat_ids):
    want = _offline(llm, PROMPT, logprobs=3).outputs[0]
    got = client.completions.create(
        model=model_dir.name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    ).choices[0].logprobs  # fmt: skip
    assert len(got.tokens) == MAX_TOKENS and "".join(got.tokens) == want.text
    for lp, token_id, entry in zip(got.token_logprobs, want.token_ids, want.logprobs, strict=True):
        assert lp == pytest.approx(entry[token_id], abs=1e-4)
    assert all(1 <= len(top) <= 3 for top in got.top_logprobs)
    chat = client.chat.completions.create(
        model=model_dir.name, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2,
    ).choices[0].logprobs.content  # fmt: skip
    assert len(chat) == 5 and all(len(t.top_logprobs) == 2 for t in chat)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in chat)


LONG = {"prompt": PROMPT, "max_tokens": 1900, "temperature": 0, "ignore_eos": True}


def _assert_freed_soon(stack) -> None:
    """Nothing held anywhere within 2.5 s: far sooner than the request's 1900 tokens take on
    the CPU (about 6 s alone), so it was aborted, not finished."""
    started = time.monotonic()
    while leftovers(stack) and time.monotonic() - started < 2.5:
        time.sleep(0.05)
    assert_nothing_leaks(stack, timeout_s=0)


def _holds_blocks(stack) -> bool:
    return any(stats(w).num_free_blocks != stats(w).num_total_blocks for w in workers(stack))


def test_disconnect_mid_stream_frees_every_block(stack):
    with (
        httpx.Client(base_url=stack.http_url, timeout=60) as http,
        http.stream("POST", "/completions", json={**LONG, "stream": True}) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        data = [line for line in (next(lines) for _ in range(6)) if line.startswith("data:")]
        assert data and json.loads(data[0][5:])["choices"]
        assert _holds_blocks(stack), "the request should hold blocks while it streams"
    _assert_freed_soon(stack)


def test_disconnect_while_waiting_for_a_whole_answer_frees_every_block(stack):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.http_url + "/completions", json=LONG, timeout=httpx.Timeout(60, read=1.0))
    _assert_freed_soon(stack)


def _post(url, path, **body):
    return httpx.post(url + path, json=body, timeout=30)


def test_errors_have_openai_shape_and_status(stack, model_dir):
    url = stack.http_url
    bad = _post(url, "/completions", model=model_dir.name, prompt=PROMPT, temperature=-1)
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
    assert bad.json()["error"]["type"] == "invalid_request_error"
    missing = _post(url, "/chat/completions", model=model_dir.name)
    assert missing.status_code == 400 and "messages" in missing.json()["error"]["message"]
    unknown = _post(url, "/completions", model="gpt-4", prompt=PROMPT)
    assert unknown.status_code == 404 and "gpt-4" in unknown.json()["error"]["message"]
    long = _post(url, "/completions", model=model_dir.name, prompt=PROMPT, max_tokens=10**6)
    assert long.status_code == 400 and "context" in long.json()["error"]["message"]
    assert_nothing_leaks(stack)


def test_no_workers_is_503_and_no_chat_template_is_400(tmp_path):
    from splitserve.kv_transfer.redis_server import RedisServer
    from splitserve.launch.services import start_gateway
    from splitserve.runtime.settings import GatewaySettings, ServiceSettings
    from splitserve.testing.tiny_model import make_tiny_model

    bare = make_tiny_model(tmp_path / "bare", "llama", chat_template=None)
    with RedisServer() as empty_redis:
        port = free_port("127.0.0.1")
        lonely = start_gateway(
            ServiceSettings(model=str(bare), redis_url=empty_redis.url),
            GatewaySettings(http_port=port),
        )
        try:
            url = f"http://127.0.0.1:{port}/v1"
            none = _post(url, "/completions", prompt=PROMPT, max_tokens=4)
            assert none.status_code == 503, none.text
            assert "no decode worker" in none.json()["error"]["message"]
            chat = _post(url, "/chat/completions", messages=CHAT)
            assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
        finally:
            lonely.stop()


def test_grpc_messages_take_the_same_chat_path(stack, llm, chat_ids):
    from splitserve.client import collect
    from splitserve.protos.v1 import common_pb2, gateway_pb2
    from tests.e2e.harness import gateway

    want = _offline(llm, chat_ids)
    request = gateway_pb2.GenerateRequest(
        messages=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in CHAT]),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    got = collect(gateway(stack).Generate(request, timeout=60))
    assert got.token_ids[0] == want.outputs[0].token_ids
    assert got.finished.usage.prompt_tokens == len(chat_ids)


def test_the_in_flight_limit_answers_429(stack, model_dir):
    from splitserve.launch.services import start_gateway
    from splitserve.runtime.settings import GatewaySettings, ServiceSettings

    port = free_port("127.0.0.1")
    small = start_gateway(
        ServiceSettings(model=str(model_dir), redis_url=stack.redis_url),
        GatewaySettings(max_inflight=1, http_port=port),
    )
    url = f"http://127.0.0.1:{port}/v1"
    # The first stream holds the only slot while the second request is refused. It must still
    # be running then: 300 tokens of the tiny model could finish first (their events fit the
    # socket buffers, so nothing waits for this client to read), so it asks for nearly the
    # model's whole length (2048).
    body = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            with http.stream("POST", "/completions", json=body) as first:
                assert first.status_code == 200
                busy = _post(url, "/completions", prompt=PROMPT, max_tokens=2)
                assert busy.status_code == 429, busy.text
                assert busy.json()["error"]["type"] == "rate_limit_error"
                events = [line for line in first.iter_lines() if line.startswith("data:")]
            assert events[-1] == "data: [DONE]"
            assert _post(url, "/completions", prompt=PROMPT, max_tokens=2).status_code == 200
    finally:
        small.stop()
    assert_nothing_leaks(stack)
