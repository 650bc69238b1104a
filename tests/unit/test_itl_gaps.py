"""bench/itl_gaps.py tells a stall that every stream sees from one client process's."""

from __future__ import annotations

from bench.itl_gaps import analyse


def _stream(client: int, stalls: list[tuple[float, float]]) -> dict:
    times = [1.0 + 0.008 * i for i in range(200)]
    for at, length in stalls:
        times = [t + length if t > at else t for t in times]
    return {"client": client, "sent": 0.9, "times": times, "status": "OK"}


def test_a_stall_of_every_stream_and_one_of_a_single_client_are_told_apart():
    requests = [_stream(n % 4, [(1.5, 0.03)]) for n in range(16)]  # every stream, at 1.5 s
    requests += [_stream(1, [(1.2, 0.04)]) for _ in range(4)]  # client 1 alone, at 1.2 s
    row = analyse({"rate": 1.0, "requests": requests}, threshold_s=0.025)
    assert row["long_gaps"] == 16 + 4
    assert row["per_client"] == {0: 4, 1: 8, 2: 4, 3: 4}
    assert row["in_global_stalls"] == 0.8  # the 16 gaps at 1.5 s: one stall across clients
    assert row["one_client_only"] == 0.2  # client 1's four streams at 1.2 s


def test_tokens_of_one_message_are_not_gaps():
    times = [1.0, 1.0, 1.0, 1.05, 1.06]  # three tokens in the first message
    row = analyse({"rate": 1.0, "requests": [{"client": 0, "sent": 0.9, "times": times}]}, 0.025)
    assert row["messages"] == 2 and row["long_gaps"] == 1
