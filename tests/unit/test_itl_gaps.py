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


def test_global_stalls_are_matched_to_the_logged_stall_that_covers_them(tmp_path):
    from bench.itl_gaps import explain, global_stalls, read_stall_log

    requests = [_stream(n % 4, [(1.5, 0.03)]) for n in range(16)]
    requests += [_stream(n % 4, [(2.0, 0.04)]) for n in range(16)]
    stalls = global_stalls({"rate": 1.0, "requests": requests}, threshold_s=0.025)
    assert len(stalls) == 2 and 1.49 < stalls[0][0] < 1.51 and 1.99 < stalls[1][0] < 2.01
    log = tmp_path / "stack.log"
    log.write_text(
        "2026-11-30 01:00:00,000 decode-core WARNING splitserve.engine.engine_loop: slow engine "
        "turn 36.0 ms at monotonic 1.540: 2 commands 30.1 ms, housekeeping 0.0 ms, step 5.0 ms "
        "(16 sequences), outputs and hooks 0.9 ms (16 outputs); slowest command <lambda> 30.0 ms\n"
        "2026-11-30 01:00:00,000 prefill-core WARNING splitserve.engine.engine_loop: slow engine "
        "turn 90.0 ms at monotonic 1.600: 0 commands 0.0 ms, housekeeping 0.0 ms, step 90.0 ms "
        "(1 sequences), outputs and hooks 0.0 ms (1 outputs); slowest command - 0.0 ms\n"
        "2026-11-30 01:00:00,000 WARNING splitserve.runtime.loop_lag: splitserve.Gateway "
        "(pid 7): event loop woke 30.0 ms late at monotonic 1.200\n"
    )
    events = read_stall_log(log)
    assert [who for *_, who in events] == [
        "decode engine turn", "prefill engine turn", "splitserve.Gateway event loop"
    ]
    assert events[0][0] == 1.540 - 0.036
    # the first stall lies in the decode turn (and the prefill one); nothing covers the second
    assert explain(stalls, events) == {
        "global stalls": 2, "decode engine turn": 1, "prefill engine turn": 1, "nothing logged": 1
    }
