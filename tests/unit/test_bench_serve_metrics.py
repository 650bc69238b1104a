"""`splitserve bench serve`'s arithmetic on hand-made timings: every expected value below was
worked out by hand from the definitions in splitserve/client/bench/metrics.py (vLLM's), with
numpy's linear percentile: the p-th percentile of n sorted values sits at rank p/100·(n−1)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from splitserve.cli.entry import build_parser
from splitserve.client.bench import datasets
from splitserve.client.bench.load import ClientRun, arrival_offsets, cpu_warning
from splitserve.client.bench.metrics import (
    RequestResult,
    compute,
    parse_goodput_item,
    percentile_key,
)


def _results() -> list[RequestResult]:
    return [
        # 5 tokens: TTFT 100 ms, E2EL 500 ms, TPOT (500 − 100) / 4 = 100 ms, 4 gaps of 100 ms
        RequestResult(0.0, 0.1, [0.1] * 4, 0.5, 10, 5, True),
        # 3 tokens: TTFT 300 ms, E2EL 1300 ms, TPOT (1300 − 300) / 2 = 500 ms, 2 gaps of 500 ms
        RequestResult(1.0, 0.3, [0.5, 0.5], 1.3, 20, 3, True),
        # 1 token: TTFT = E2EL = 200 ms, no TPOT, no gap
        RequestResult(0.5, 0.2, [], 0.2, 30, 1, True),
        RequestResult(0.7, error="UNAVAILABLE: gone"),  # failed: in no figure but `failed`
    ]


def test_throughputs_count_completed_requests_over_the_duration():
    got = compute(_results(), duration_s=2.0, metrics=())
    assert got["completed"] == 3 and got["failed"] == 1
    assert got["total_input_tokens"] == 60 and got["total_output_tokens"] == 9
    assert got["request_throughput"] == pytest.approx(1.5)  # 3 / 2 s
    assert got["output_throughput"] == pytest.approx(4.5)  # 9 / 2 s
    assert got["total_token_throughput"] == pytest.approx(34.5)  # (60 + 9) / 2 s
    assert "request_goodput" not in got  # only with SLOs


def test_latency_means_medians_and_percentiles_in_ms():
    got = compute(_results(), 2.0, percentiles=(50.0, 99.0))
    # TTFT 100, 300, 200: sorted 100, 200, 300; p99 at rank 1.98: 200 + 0.98·100
    assert got["mean_ttft_ms"] == pytest.approx(200)
    assert got["median_ttft_ms"] == pytest.approx(200) == got["p50_ttft_ms"]
    assert got["p99_ttft_ms"] == pytest.approx(298)
    # TPOT 100, 500 (the one-token request has none); p99 at rank 0.99: 100 + 0.99·400
    assert got["mean_tpot_ms"] == pytest.approx(300)
    assert got["median_tpot_ms"] == pytest.approx(300)
    assert got["p99_tpot_ms"] == pytest.approx(496)
    # ITL 100 ×4, 500 ×2: mean 1400/6; median at rank 2.5 between two 100s; p99 at rank 4.95
    assert got["mean_itl_ms"] == pytest.approx(1400 / 6)
    assert got["median_itl_ms"] == pytest.approx(100)
    assert got["p99_itl_ms"] == pytest.approx(500)
    # E2EL 500, 1300, 200: sorted 200, 500, 1300; p99 at rank 1.98: 500 + 0.98·800
    assert got["mean_e2el_ms"] == pytest.approx(2000 / 3)
    assert got["median_e2el_ms"] == pytest.approx(500)
    assert got["p99_e2el_ms"] == pytest.approx(1284)
    # standard deviation (population, as numpy's default): TTFT sqrt((100² + 0 + 100²) / 3)
    assert got["std_ttft_ms"] == pytest.approx((20000 / 3) ** 0.5)


def test_goodput_counts_completed_requests_meeting_every_slo():
    results = _results()
    # TTFT ≤ 250 ms: the first (100) and the third (200); 2 requests / 2 s
    assert compute(results, 2.0, (), slos_ms={"ttft": 250})["request_goodput"] == 1.0
    # TPOT ≤ 200 ms: the first (100) and the one-token request (no TPOT to miss)
    assert compute(results, 2.0, (), slos_ms={"tpot": 200})["request_goodput"] == 1.0
    # E2EL ≤ 400 ms as well: only the third (200 ms) is left
    both = {"ttft": 250, "e2el": 400}
    assert compute(results, 2.0, (), slos_ms=both)["request_goodput"] == 0.5
    # every completed request within generous SLOs: goodput is the request throughput
    loose = {"ttft": 1e4, "tpot": 1e4, "e2el": 1e4}
    assert compute(results, 2.0, (), slos_ms=loose)["request_goodput"] == 1.5


def test_percentile_keys_are_spelled_as_vllm_spells_them():
    assert percentile_key(99.0) == "p99" and percentile_key(99.9) == "p99.9"
    assert "p99.9_ttft_ms" in compute(_results(), 1.0, ("ttft",), (99.9,))


def test_goodput_specs_parse_and_bad_ones_say_why():
    assert parse_goodput_item("ttft:500") == ("ttft", 500.0)
    assert parse_goodput_item("tpot:12.5") == ("tpot", 12.5)
    for bad, says in [
        ("ttft", "KEY:MILLISECONDS"),
        ("itl:5", "KEY one of ttft, tpot, e2el"),
        ("ttft:fast", "not a number"),
        ("e2el:-1", "positive"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            parse_goodput_item(bad)


def test_a_bad_goodput_flag_is_a_usage_error(capsys):
    parser = build_parser({})
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["bench", "serve", "--goodput", "ttft:100", "latency:5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --goodput" in err and "'latency:5'" in err and "ttft, tpot, e2el" in err
    for flag, value in [("--percentile-metrics", "ttft,nope"), ("--metric-percentiles", "0")]:
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "serve", flag, value])


def test_arrival_times():
    assert arrival_offsets(3, float("inf")) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 4.0, fixed=True) == [0.0, 0.25, 0.5, 0.75]
    offsets = arrival_offsets(20001, 5.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / 20000 == pytest.approx(0.2, rel=0.03)  # mean gap 1/rate
    steady = arrival_offsets(20001, 5.0, burstiness=100.0, seed=1)
    steady_gaps = [b - a for a, b in zip(steady, steady[1:], strict=False)]
    assert max(steady_gaps) < 0.3 and min(steady_gaps) > 0.1  # shape 100: nearly fixed


def test_datasets_shape_their_prompts(tmp_path):
    rand = datasets.random_dataset(50, 100, 20, 0.5, seed=0)
    lens = [len(c.turns[0].text.split()) for c in rand]
    outs = [c.turns[0].output_tokens for c in rand]
    assert all(50 <= n <= 150 for n in lens) and len(set(lens)) > 1
    assert all(10 <= n <= 30 for n in outs)
    assert datasets.random_dataset(5, 8, 4, 0.0, seed=3) == datasets.random_dataset(5, 8, 4, 0.0, 3)

    shared = datasets.prefix_repetition_dataset(6, 10, 5, 2, 7, seed=0)
    heads = [" ".join(c.turns[0].text.split()[:10]) for c in shared]
    assert heads[0] == heads[2] == heads[4] != heads[1] == heads[3] == heads[5]
    assert all(len(c.turns[0].text.split()) == 15 for c in shared)

    chats = datasets.multi_turn_dataset(10, 4, 6, 3, seed=0)
    assert [len(c.turns) for c in chats] == [4, 4, 2] and datasets.requests_in(chats) == 10
    first, second = chats[0].prompt(0, []), chats[0].prompt(1, [" a reply"])
    assert second.startswith(first + " a reply\n") and second.endswith("Assistant:")

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hi there", "output_tokens": 3}) + "\n\n"
                    + json.dumps({"prompt": "bye"}) + "\n")  # fmt: skip
    custom = datasets.custom_dataset(str(path), 3, default_output=9)
    assert [(c.turns[0].text, c.turns[0].output_tokens) for c in custom] == [
        ("hi there", 3), ("bye", 9), ("hi there", 3)
    ]  # fmt: skip
    path.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:1: expected"):
        datasets.custom_dataset(str(path), 1, 9)


def test_a_client_process_that_saturates_a_core_is_warned_about():
    assert ClientRun(cpu_s=4.6, wall_s=5.0).cpu_fraction == pytest.approx(0.92)
    assert cpu_warning([0.3, 0.85]) is None
    warning = cpu_warning([0.3, 0.92])
    assert warning and "92% of a core" in warning and "--num-client-processes" in warning


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def test_the_docs_name_only_flags_the_command_has():
    serve = _subcommand(_subcommand(build_parser({}), "bench"), "serve")
    flags = {opt for action in serve._actions for opt in action.option_strings}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "bench-serve.md").read_text()
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])", doc))
    servers = {"--port", "--http-port", "--metrics"}  # the servers' own flags, in the examples
    assert named - servers <= flags, sorted(named - servers - flags)
