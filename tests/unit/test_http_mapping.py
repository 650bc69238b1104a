"""OpenAI request bodies become the gRPC API's GenerateRequest field for field; what can't be
served is refused naming it; responses and errors take OpenAI's shapes."""

from __future__ import annotations

import json

import grpc
import pytest

from splitserve.engine.errors import InvalidRequest
from splitserve.gateway.http_models import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_request,
    completion_request,
    tool_plan,
)
from splitserve.gateway.http_responses import Shaper, error_body, sse
from splitserve.protos import convert
from splitserve.protos.v1 import common_pb2, gateway_pb2


def _completion(**body):
    return completion_request(CompletionRequest(prompt="hi", **body))


def _chat(**body):
    messages = body.pop("messages", [{"role": "user", "content": "hi"}])
    return chat_request(ChatCompletionRequest(messages=messages, **body))


def test_completion_fields_map_to_sampling_params_and_unset_ones_stay_unset():
    req = _completion(
        max_tokens=7, temperature=0.5, top_p=0.9, n=2, seed=3, stop="END", logprobs=2,
        presence_penalty=0.1, frequency_penalty=0.2, top_k=-1, min_p=0.05,
        repetition_penalty=1.1, ignore_eos=True, min_tokens=1, stop_token_ids=[9],
    )  # fmt: skip
    assert req.text == "hi"
    params = convert.sampling_from_proto(req.sampling)
    assert (params.max_tokens, params.temperature, params.n) == (7, 0.5, 2)
    assert params.top_p == pytest.approx(0.9)
    assert (params.seed, params.stop, params.logprobs, params.top_k) == (3, ("END",), 2, 0)
    assert (params.presence_penalty, params.frequency_penalty) == pytest.approx((0.1, 0.2))
    assert (params.min_p, params.repetition_penalty) == pytest.approx((0.05, 1.1))
    assert (params.ignore_eos, params.min_tokens, params.stop_token_ids) == (True, 1, (9,))
    bare = _completion().sampling
    assert not any(bare.HasField(f) for f in ("temperature", "top_p", "max_tokens", "top_k"))


def test_completion_prompts_text_token_ids_or_a_batch_of_one():
    assert completion_request(CompletionRequest(prompt=[5, 6, 7])).token_ids.ids == [5, 6, 7]
    assert completion_request(CompletionRequest(prompt=["a"])).text == "a"
    assert completion_request(CompletionRequest(prompt=[[1, 2]])).token_ids.ids == [1, 2]
    with pytest.raises(InvalidRequest, match="one prompt per request"):
        completion_request(CompletionRequest(prompt=["a", "b"]))
    with pytest.raises(InvalidRequest, match="empty"):
        completion_request(CompletionRequest(prompt=[]))


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"echo": True, "logprobs": 1}, "echo with logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"n": 0}, "n must be >= 1"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex, guided_choice"),
        ({"guided_json": {"type": "strin"}}, "json_schema is not a valid JSON Schema"),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(body, named):
    with pytest.raises(InvalidRequest, match=named):
        _completion(**body)


def test_response_format_text_asks_for_nothing():
    request = _completion(response_format={"type": "text"})
    assert request.text == "hi" and request.sampling.WhichOneof("structured") is None


def test_structured_output_fields_reach_the_sampling_params():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    json_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    request = _chat(response_format=json_schema)
    assert json.loads(request.sampling.json_schema) == schema
    assert _completion(response_format={"type": "json_object"}).sampling.json_object
    assert _completion(guided_regex="a+").sampling.regex == "a+"
    assert list(_chat(guided_choice=["x", "y"]).sampling.choice.choices) == ["x", "y"]
    assert _completion(structured_outputs={"regex": "b"}).sampling.regex == "b"


def test_chat_messages_max_completion_tokens_and_logprobs():
    req = _chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": t} for t in "ab"]},
            {"role": "assistant", "content": "ok"},
        ],
        max_completion_tokens=5, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    assert [(m.role, m.content) for m in req.messages.messages] == [
        ("system", "be brief"), ("user", "ab"), ("assistant", "ok"),
    ]  # fmt: skip
    assert (req.sampling.max_tokens, req.sampling.logprobs) == (5, 3)
    assert _chat(logprobs=True).sampling.logprobs == 0
    assert not _chat().sampling.HasField("logprobs")
    assert not _chat().sampling.HasField("max_tokens")  # the gateway fills the context's rest


def test_chat_refusals():
    with pytest.raises(InvalidRequest, match="top_logprobs requires logprobs"):
        _chat(top_logprobs=2)
    with pytest.raises(InvalidRequest, match="disagree"):
        _chat(max_tokens=3, max_completion_tokens=4)
    with pytest.raises(InvalidRequest, match="tools"):
        tool_plan(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                        tool_choice="required"))  # fmt: skip
    with pytest.raises(ValueError):
        ChatCompletionRequest(messages=[])


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_errors_take_openais_shape_and_the_matching_status(code, status):
    got, body = error_body(code, "what happened")
    assert got == status
    assert (
        body["error"]["message"] == "what happened" and body["error"]["code"] == code.name.lower()
    )


def _finished(*reasons):
    return gateway_pb2.Finished(
        samples=[common_pb2.SampleFinish(index=i, finish_reason=r) for i, r in enumerate(reasons)],
        usage=common_pb2.Usage(prompt_tokens=4, completion_tokens=3, cached_prompt_tokens=2),
    )


def test_chat_stream_chunks_open_with_the_role_and_close_with_the_finish_reason():
    shaper = Shaper("m", chat=True, n=1, top_logprobs=None, token_text=str)
    first = shaper.chunk(common_pb2.SampleDelta(index=0, token_ids=[1], text="Hel"))
    second = shaper.chunk(common_pb2.SampleDelta(index=0, token_ids=[2], text="lo"))
    (last,) = shaper.final_chunks(_finished(common_pb2.FINISH_REASON_STOP))
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert second["choices"][0]["delta"] == {"content": "lo"}
    assert last["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    usage = shaper.usage_chunk(_finished(common_pb2.FINISH_REASON_STOP))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 7
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert sse("[DONE]") == b"data: [DONE]\n\n"


def test_completion_response_gathers_samples_with_logprobs():
    shaper = Shaper("m", chat=False, n=2, top_logprobs=1, token_text=lambda t: f"<{t}>")
    top = [
        common_pb2.TopLogprob(token_id=7, logprob=-0.1),
        common_pb2.TopLogprob(token_id=8, logprob=-2),
    ]
    lp = common_pb2.TokenLogprobs(token_id=8, logprob=-2.0, top=top)
    shaper.add(common_pb2.SampleDelta(index=1, token_ids=[8], text="<8>", logprobs=[lp]))
    shaper.add(common_pb2.SampleDelta(index=0, token_ids=[8], text="<8>", logprobs=[lp]))
    body = shaper.response(
        _finished(common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
    )
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "<8>", "length"), (1, "<8>", "stop"),
    ]  # fmt: skip
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["<8>"], "token_logprobs": [-2.0], "top_logprobs": [{"<7>": pytest.approx(-0.1)}],
        "text_offset": [0],
    }  # fmt: skip
    assert body["usage"]["completion_tokens"] == 3


def test_an_authorize_hook_guards_every_endpoint_but_health():
    import contextlib

    from fastapi.testclient import TestClient

    from splitserve.engine.errors import SplitserveError
    from splitserve.gateway.http_server import create_app
    from splitserve.gateway.servicer import ModelInfo

    class Unauthenticated(SplitserveError):
        status = "UNAUTHENTICATED"

    def authorize(headers):
        if headers.get("authorization") != "Bearer right":
            raise Unauthenticated("a valid API key is required")
        return contextlib.nullcontext()

    def generate(request, call):
        raise AssertionError("an unauthenticated request must not reach the servicer")

    info = ModelInfo(name="m", config=None, max_model_len=64, block_size=16)  # type: ignore[arg-type]
    app = create_app(generate, info, tokenizer=None, is_serving=lambda: True, authorize=authorize)
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        denied = http.post("/v1/completions", json={"prompt": "hi"})
        assert denied.status_code == 401
        assert denied.json()["error"]["type"] == "authentication_error"
        assert http.get("/v1/models").status_code == 401
        models = http.get("/v1/models", headers={"Authorization": "Bearer right"})
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"


def test_an_event_stays_one_line_for_every_line_splitting_client():
    text = "a\x85b\u2028c\u2029d\ne\u00e9\U0001f600"
    event = sse({"text": text}).decode()
    assert event.endswith("\n\n")
    (line,) = event[:-2].splitlines()  # str.splitlines breaks at \x85, \u2028, \u2029 too
    assert json.loads(line.removeprefix("data: "))["text"] == text
    assert "\u00e9\U0001f600" in line  # other characters stay UTF-8, unescaped
