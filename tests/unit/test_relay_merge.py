"""Merging what queued up on a stream into one client message (gateway/coalesce.py
`merge_deltas`)."""

from __future__ import annotations

import pytest

from splitserve.gateway.coalesce import Coalescer, merge_deltas
from splitserve.protos.v1 import common_pb2
from tests.unit.relay_feeds import _delta


def test_merge_covers_every_field_a_sample_delta_has():
    # A field added to SampleDelta must be merged too: this fails until merge_deltas knows it.
    fields = {f.name for f in common_pb2.SampleDelta.DESCRIPTOR.fields}
    assert fields == {"index", "token_ids", "text", "logprobs"}


def test_one_chunk_is_passed_through_uncopied():
    chunk = _delta(0, [1])
    (out,) = merge_deltas([chunk])
    assert out is chunk
    assert merge_deltas([]) == []


def test_a_samples_chunks_join_in_order_with_text_and_logprobs():
    chunks = [_delta(0, [1], True), _delta(0, [2, 3], True), _delta(0, [4], True)]
    (out,) = merge_deltas(chunks)
    assert out.index == 0
    assert list(out.token_ids) == [1, 2, 3, 4]
    assert out.text == "<1><2><3><4>"
    assert [(lp.token_id, lp.logprob) for lp in out.logprobs] == [
        (i, pytest.approx(-i / 10)) for i in (1, 2, 3, 4)
    ]
    assert [list(c.token_ids) for c in chunks] == [[1], [2, 3], [4]]  # inputs unchanged


def test_samples_stay_apart_in_the_order_they_first_appear():
    chunks = [_delta(1, [10]), _delta(0, [20]), _delta(1, [11]), _delta(2, [30]), _delta(0, [21])]
    out = merge_deltas(chunks)
    assert [(d.index, list(d.token_ids)) for d in out] == [(1, [10, 11]), (0, [20, 21]), (2, [30])]
    assert out[2] is chunks[3]  # a sample with one chunk keeps it


def test_a_chunk_with_text_but_no_tokens_keeps_its_text():
    tail = common_pb2.SampleDelta(index=0, text="!")
    (out,) = merge_deltas([_delta(0, [5]), tail])
    assert list(out.token_ids) == [5] and out.text == "<5>!"


def test_merged_chunks_then_meet_the_stream_interval():
    coalescer = Coalescer(4)
    (first,) = merge_deltas([_delta(0, [1]), _delta(0, [2])])
    assert coalescer.add(first) is None  # 2 < 4: held
    (second,) = merge_deltas([_delta(0, [3]), _delta(0, [4]), _delta(0, [5])])
    out = coalescer.add(second)
    assert out is not None and list(out.token_ids) == [1, 2, 3, 4, 5]
