"""`splitserve profile`'s planning on hand-made curves: the queueing figures match their closed
forms, the split follows the side that is short (decode-bound: more decode workers, and the
other way round), a recommendation meets its own targets, and a saved profile plans again
(`--from-curves`) with no engine; a split on fewer GPUs than it needs shares them (the check's
placement and pools, as printed), and dummy weights reach the engines."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest

from splitserve.cli.entry import main
from splitserve.cli.profile_check import _settings
from splitserve.launch.profile import measure, report
from splitserve.launch.profile.curves import Curves, DecodePoint, PrefillPoint, Profile, linear
from splitserve.launch.profile.plan import Split, Targets, Workload, predict, search
from splitserve.launch.profile.queueing import ServerQueue, erlang_c


def _profile(prefill_s_per_token: float, step_base_s: float, step_per_seq_s: float) -> Profile:
    """Prefill linear in the prompt, a decode step linear in the batch and flat in context."""
    prefill = tuple(PrefillPoint(n, n * prefill_s_per_token) for n in (128, 512, 2048))
    decode = tuple(
        DecodePoint(b, c, c, step_base_s + step_per_seq_s * b)
        for c in (512, 2048)
        for b in (1, 8, 64)
    )
    return Profile(
        model="hand-made",
        device="cuda",
        device_name="a made-up GPU",
        dtype="bfloat16",
        num_devices=8,
        kv_bytes_per_token=1024,
        max_model_len=4096,
        tensor_parallel_sizes_fit=(1,),
        curves=(Curves(1, prefill, decode),),
    )


def test_erlang_c_matches_its_closed_forms():
    assert erlang_c(1, 0.3) == pytest.approx(0.3)  # M/M/1: the utilization
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # a = 1 on two servers
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(4, 0.0) == 0.0


def test_an_exponential_server_waits_as_mm1_does():
    queue = ServerQueue(1, arrival_rate=5.0, mean_service_s=0.1, service_scv=1.0)
    # M/M/1: P(W > t) = ρ·exp(−(μ − λ)·t); mean wait ρ / (μ − λ)
    assert queue.wait_exceeds(0.2) == pytest.approx(0.5 * math.exp(-5 * 0.2))
    assert queue.mean_wait_s() == pytest.approx(0.5 / 5)
    assert queue.wait_quantile_s(0.9) == pytest.approx(math.log(0.5 / 0.1) / 5)
    assert ServerQueue(1, 10.0, 0.1).wait_quantile_s(0.9) == math.inf  # saturated


def test_lines_between_points_and_the_last_slope_past_them():
    xs, ys = [1, 8, 64], [10.0, 24.0, 136.0]
    assert linear(xs, ys, 4.5) == pytest.approx(17.0)
    assert linear(xs, ys, 128) == pytest.approx(136.0 + 2 * 64)
    assert linear(xs, ys, 0.5) == 10.0


def test_decode_bound_load_gets_more_decode_than_prefill_workers():
    # prefill 10 ms a prompt; decode 10 ms + 2 ms a sequence: at 10 req/s of 100 tokens,
    # TPOT = 10 ms / (1 − 2/D): D ≤ 2 never keeps up, D = 3 gives 30 ms, D = 4 gives 20 ms
    prof = _profile(10e-3 / 1024, 10e-3, 2e-3)
    work, targets = Workload(10.0, 1024, 100), Targets(ttft_s=0.5, tpot_s=0.025)
    found, best = search(prof, 5, work, targets, 10e9)
    assert best is not None and best.split == Split(1, 1, 4, 1)
    assert best.tpot_p50_s == pytest.approx(0.020, rel=1e-3)
    assert best.split.num_decode > best.split.num_prefill
    three = predict(prof, Split(1, 1, 3, 1), work, targets, 10e9)
    assert three.tpot_p50_s == pytest.approx(0.030, rel=1e-3) and not three.meets
    assert three.bottleneck == "decode" and three.goodput == 0.0
    # Little's law: the sequences a decode worker holds
    assert best.decode_batch == pytest.approx(10 / 4 * 100 * best.tpot_p50_s)
    assert len(found) == 10  # every split of 1..4 prefill and 1..4 decode workers on 5 devices


def test_prefill_bound_load_gets_more_prefill_than_decode_workers():
    # 100 ms a prompt at 15 req/s: one prefill worker would be 150% busy
    prof = _profile(100e-3 / 1024, 1e-3, 1e-5)
    work, targets = Workload(15.0, 1024, 32), Targets(ttft_s=0.4, tpot_s=0.05)
    _, best = search(prof, 6, work, targets, 10e9)
    assert best is not None
    assert best.split.num_prefill > best.split.num_decode
    assert best.ttft_p90_s <= targets.ttft_s and best.tpot_p50_s <= targets.tpot_s
    assert best.bottleneck == "prefill"
    assert 0 < best.goodput <= work.request_rate
    assert best.capacity >= work.request_rate


def test_recommendation_is_the_cheapest_split_meeting_both_targets():
    prof = _profile(5e-3 / 1024, 5e-3, 1e-4)
    work, targets = Workload(2.0, 1024, 64, range_ratio=0.5), Targets(ttft_s=0.2, tpot_s=0.02)
    found, best = search(prof, 4, work, targets, 10e9)
    assert best is not None and best.split.devices == 2 and best is found[0]
    meeting = [p for p in found if p.meets]
    assert all(p.split.devices >= best.split.devices for p in meeting)
    assert all(p.ttft_p90_s <= 0.2 and p.tpot_p50_s <= 0.02 for p in meeting)


def test_no_recommendation_when_no_split_meets_the_targets():
    prof = _profile(1.0 / 1024, 1e-3, 1e-5)  # one second a prompt
    _, best = search(prof, 4, Workload(1.0, 1024, 16), Targets(0.5, 0.05), 10e9)
    assert best is None


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="request-rate"):
        Workload(0.0, 128, 16)
    with pytest.raises(ValueError, match="range-ratio"):
        Workload(1.0, 128, 16, range_ratio=1.0)
    with pytest.raises(ValueError, match="ttft-ms"):
        Targets(0.0, 0.05)
    with pytest.raises(ValueError, match="gpus"):
        search(_profile(1e-6, 1e-3, 1e-5), 1, Workload(1.0, 128, 16), Targets(1, 1), 1e9)


def test_a_saved_profile_plans_again_without_an_engine(tmp_path, capsys):
    saved = tmp_path / "curves.json"
    saved.write_text(json.dumps(_profile(10e-3 / 1024, 10e-3, 2e-3).to_json()))
    out = tmp_path / "plan.json"
    rc = main(["profile", "--from-curves", str(saved), "--gpus", "5", "--request-rate", "10",
               "--input-len", "1024", "--output-len", "100", "--ttft-ms", "500", "--tpot-ms", "25",
               "--result-filename", str(out), "--no-plot"])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "* 1P×TP1 + 4D×TP1" in text and "recommended: 1P×TP1 + 4D×TP1" in text
    assert "splitserve up --model hand-made --prefill 1 --decode 4" in text
    raw = json.loads(out.read_text())
    assert raw["recommendation"]["num_decode"] == 4
    assert raw["recommendation"]["predicted_median_tpot_ms"] == pytest.approx(20.0, rel=1e-3)
    assert Profile.from_json(raw).curves == Profile.from_json(json.loads(saved.read_text())).curves
    assert not (tmp_path / "plan.png").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ttft-ms", "0"], "must be positive"),
        (["--tpot-ms", "-5"], "must be positive"),
        (["--request-rate", "abc"], "expected a number"),
        (["--decode-batches", "0"], "must be at least 1"),
    ],
)
def test_bad_flags_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["profile", "--model", "tiny", *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_model_directory_is_named(tmp_path, capsys):
    rc = main(["profile", "--model", str(tmp_path / "nowhere"), "--device", "cpu"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "splitserve profile: error: --model" in err and "nowhere" in err


def _gpu_profile(num_devices: int, load_format: str = "safetensors") -> Profile:
    """A profile measured on `num_devices` 80 GB GPUs of a model of 16 GB of weights."""
    prof = _profile(10e-3 / 1024, 10e-3, 2e-3)
    curves = dataclasses.replace(prof.curves[0], weight_bytes=16 * 10**9)
    return dataclasses.replace(
        prof,
        num_devices=num_devices,
        device_memory_bytes=80 * 10**9,
        curves=(curves,),
        load_format=load_format,
    )


def _flag(args: tuple[str, ...], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_a_split_on_too_few_gpus_shares_them_round_robin_with_equal_kv_pools():
    one_gpu = _settings(_gpu_profile(1), Split(1, 1, 1, 1))
    assert one_gpu.devices == ("cuda:0", "cuda:0")
    share = int(0.9 * 80e9 / 2 - 16e9 - report.WORKER_OVERHEAD_BYTES)
    assert _flag(one_gpu.extra_worker_args, "--kv-cache-memory-bytes") == str(share)
    assert share > 15 * 10**9  # room for a Llama-3-8B pool beside both workers' weights
    # decode workers first, then prefill: the third worker wraps onto the first GPU
    two_gpus = _settings(_gpu_profile(2), Split(1, 1, 2, 1))
    assert two_gpus.devices == ("cuda:0", "cuda:1", "cuda:0")
    assert _flag(two_gpus.extra_worker_args, "--kv-cache-memory-bytes") == str(share)
    # enough GPUs: one a worker, each its own default pool
    own = _settings(_gpu_profile(3), Split(1, 1, 2, 1))
    assert own.devices == ("cuda:0", "cuda:1", "cuda:2")
    assert "--kv-cache-memory-bytes" not in own.extra_worker_args


def test_the_printed_check_command_is_what_the_check_runs(tmp_path, capsys):
    saved = tmp_path / "curves.json"
    saved.write_text(json.dumps(_gpu_profile(1).to_json()))
    rc = main(["profile", "--from-curves", str(saved), "--gpus", "2", "--request-rate", "1",
               "--input-len", "1024", "--output-len", "100", "--ttft-ms", "500", "--tpot-ms", "25",
               "--load-format", "dummy", "--result-filename", str(tmp_path / "plan.json"),
               "--no-plot"])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert text.count("share") == 1 and "contention" in text  # one note, saying what it adds
    share = int(0.9 * 80e9 / 2 - 16e9 - report.WORKER_OVERHEAD_BYTES)
    assert (
        "splitserve up --model hand-made --prefill 1 --decode 1 --devices cuda:0,cuda:0 "
        f"--load-format dummy --max-model-len 4096 --kv-cache-memory-bytes {share}"
    ) in text
    settings = _settings(_gpu_profile(1, "dummy"), Split(1, 1, 1, 1))
    assert settings.extra_worker_args == (
        "--load-format", "dummy", "--max-model-len", "4096", "--kv-cache-memory-bytes", str(share)
    )  # fmt: skip
    assert json.loads((tmp_path / "plan.json").read_text())["load_format"] == "dummy"


def test_a_profile_without_the_sizes_to_share_gpus_says_so(tmp_path, capsys):
    saved = tmp_path / "curves.json"
    saved.write_text(
        json.dumps(dataclasses.replace(_gpu_profile(1), device_memory_bytes=0).to_json())
    )
    rc = main(["profile", "--from-curves", str(saved), "--gpus", "2", "--request-rate", "1",
               "--input-len", "1024", "--output-len", "100", "--ttft-ms", "500", "--tpot-ms", "25",
               "--check", "--result-filename", str(tmp_path / "plan.json"),
               "--no-plot"])  # fmt: skip
    assert rc == 1
    captured = capsys.readouterr()
    assert "cannot check it on this host" in captured.out and "measure it again" in captured.err
    assert "splitserve up" not in captured.out


def test_dummy_weights_reach_the_profiling_engine(tiny_models, tmp_path):
    # a model directory without weights loads only as "dummy"
    bare = tmp_path / "bare"
    shutil.copytree(tiny_models["llama"], bare, ignore=shutil.ignore_patterns("*.safetensors*"))
    engine = measure.build_engine(str(bare), "cpu", "auto", 256, 1, 4, "dummy")
    try:
        assert engine.config.load_format == "dummy"
        assert measure.prefill_seconds(engine, 16, 1) > 0
    finally:
        engine.shutdown()
