"""Validation and normalisation of SamplingParams."""

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams

INVALID = [
    ("n", 0),
    ("n", -1),
    ("n", 1.5),
    ("n", True),
    ("temperature", -1.0),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.1),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", True),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("min_p", math.inf),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", 1.0),
    ("seed", False),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("presence_penalty", 2.1),
    ("presence_penalty", -2.1),
    ("presence_penalty", math.nan),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -math.inf),
    ("stop", [""]),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 1]),
    ("stop", 5),
    ("stop", b"xy"),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", 3),
    ("stop_token_ids", "12"),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("max_tokens", 0),
    ("max_tokens", True),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("min_tokens", 17),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", True),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_value_error_naming_field(field, value):
    with pytest.raises(ValueError, match=field) as excinfo:
        SamplingParams(**{field: value})
    message = str(excinfo.value)
    # The message must let the caller see what was wrong without reading the code.
    assert " got " in message


def test_message_names_bad_value_and_allowed_range():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1\.0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1\.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_tokens=4\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_defaults_are_valid_and_not_greedy():
    params = SamplingParams()
    assert params.n == 1 and params.max_tokens == 16 and params.logprobs is None
    assert not params.is_greedy


def test_stop_accepts_str_or_iterable_and_normalises_to_tuple():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=(s for s in ["x"])).stop == ("x",)
    assert SamplingParams(stop=None).stop == ()


def test_stop_token_ids_normalise_to_tuple():
    params = SamplingParams(stop_token_ids=[2, 0, 7])
    assert params.stop_token_ids == (2, 0, 7)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


def test_top_k_minus_one_normalises_to_disabled():
    assert SamplingParams(top_k=-1).top_k == 0


def test_numbers_are_normalised_to_declared_types():
    params = SamplingParams(temperature=0, top_p=1, presence_penalty=1)
    assert type(params.temperature) is float and params.temperature == 0.0
    assert type(params.top_p) is float and type(params.presence_penalty) is float


def test_params_are_frozen_and_hashable():
    params = SamplingParams(stop=["a"], stop_token_ids=[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]
    assert hash(params) == hash(SamplingParams(stop=("a",), stop_token_ids=(1,)))


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.0, "top_k": 5}, True),
        ({"temperature": 0.7, "top_k": 2}, False),
        ({"temperature": 1e-6}, False),
        ({}, False),
    ],
)
def test_is_greedy_when_temperature_zero_or_top_k_one(kwargs, greedy):
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_check_token_ids_rejects_ids_outside_vocab():
    params = SamplingParams(stop_token_ids=[0, 99])
    params.check_token_ids(100)
    with pytest.raises(ValueError, match=r"stop_token_ids must be < vocab_size=99, got 99"):
        params.check_token_ids(99)
    with pytest.raises(ValueError, match="vocab_size"):
        params.check_token_ids(0)


def test_boundary_values_are_accepted():
    SamplingParams(
        temperature=0.0,
        top_p=1e-9,
        top_k=1,
        min_p=1.0,
        seed=2**64 - 1,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        max_tokens=1,
        min_tokens=1,
        logprobs=MAX_LOGPROBS,
    )
    SamplingParams(min_p=0.0, seed=0, logprobs=0, top_p=1.0)


valid_params = st.builds(
    SamplingParams,
    n=st.integers(1, 8),
    temperature=st.floats(0, 10),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(-1, 1000),
    min_p=st.floats(0, 1),
    seed=st.none() | st.integers(0, 2**64 - 1),
    repetition_penalty=st.floats(0, 10, exclude_min=True),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    stop=st.lists(st.text(min_size=1), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 10**6), max_size=3),
    ignore_eos=st.booleans(),
    max_tokens=st.integers(1, 10**5),
    logprobs=st.none() | st.integers(0, MAX_LOGPROBS),
)


@given(valid_params)
def test_valid_params_construct_and_normalise(params):
    assert isinstance(params.stop, tuple) and isinstance(params.stop_token_ids, tuple)
    assert params.top_k >= 0
    assert params == dataclasses.replace(params)  # re-validating a valid object is a no-op


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_temperature_accepted_iff_finite_and_non_negative(value):
    if math.isfinite(value) and value >= 0:
        assert SamplingParams(temperature=value).temperature == value
    else:
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=value)
