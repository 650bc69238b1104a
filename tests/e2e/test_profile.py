"""`splitserve profile` end to end on the CPU: the tiny model is measured by the real engine in
a process of its own, and the JSON holds the curves, every candidate split and a
recommendation that meets the targets by its own prediction; the plot is written."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _without_weights(model, tmp_path):
    """The model's directory less its safetensors: only `--load-format dummy` runs it (as a
    large shape's config.json and tokenizer do, bench/common.py `model_dir`)."""
    bare = tmp_path / "bare-model"
    shutil.copytree(model, bare, ignore=shutil.ignore_patterns("*.safetensors*"))
    return bare


def test_profile_measures_the_tiny_model_and_recommends_a_split(tiny_models, tmp_path):
    out = tmp_path / "profile.json"
    model = _without_weights(tiny_models["llama"], tmp_path)
    command = [
        sys.executable, "-m", "splitserve.cli", "profile", "--model", str(model),
        "--load-format", "dummy", "--device", "cpu", "--max-model-len", "1536",
        "--prefill-lens", "16", "256", "1024", "--repeats", "3",
        "--decode-batches", "1", "8", "--decode-contexts", "64", "256", "--decode-steps", "8",
        "--gpus", "3", "--request-rate", "0.5", "--input-len", "256", "--output-len", "16",
        "--ttft-ms", "5000", "--tpot-ms", "1000", "--result-filename", str(out),
    ]  # fmt: skip
    # NOTE: one intra-op thread: on two cores shared with other work, a step of two threads
    # waits for whichever is descheduled, and a 1 ms prefill then reads 400 ms
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    # each measurement is shown as it completes, then the table and the recommendation
    assert "TP1 prefill   1024 tokens:" in text and "TP1 decode batch    8" in text
    assert "* 1P×TP1 + 1D×TP1" in text, text
    assert "recommended: 1P×TP1 + 1D×TP1 on 2 device(s)" in text
    assert "predicted: TTFT p90" in text and "splitserve bench serve" in text
    assert f"splitserve up --model {model} --prefill 1 --decode 1 --load-format dummy" in text

    raw = json.loads(out.read_text())
    assert raw["device"] == "cpu" and raw["dtype"] == "float32" and raw["load_format"] == "dummy"
    assert raw["tensor_parallel_sizes_fit"] == [1] and raw["max_model_len"] == 1536
    (curves,) = raw["curves"]
    prefill = sorted(curves["prefill"], key=lambda p: p["prompt_len"])
    assert [p["prompt_len"] for p in prefill] == [16, 256, 1024]
    seconds = [p["seconds"] for p in prefill]
    assert all(s > 0 for s in seconds)
    assert seconds[0] < seconds[-1] and seconds[1] < seconds[-1]  # longer prompts take longer
    decode = curves["decode"]
    assert {(d["batch"], d["prompt_len"]) for d in decode} == {(1, 64), (8, 64), (1, 256), (8, 256)}
    assert all(d["step_s"] > 0 and d["context_len"] > d["prompt_len"] for d in decode)

    assert len(raw["candidates"]) == 3  # 1P+1D, 2P+1D, 1P+2D on three devices
    best = raw["recommendation"]
    assert best["meets"] and best["devices"] == 2
    assert best["predicted_p90_ttft_ms"] <= 5000 and best["predicted_median_tpot_ms"] <= 1000
    assert 0 < best["request_goodput"] <= 0.5 and best["capacity"] >= 0.5
    assert raw["plan"]["ttft_p90_target_ms"] == 5000 and raw["plan"]["request_rate"] == 0.5
    if HAS_MATPLOTLIB:
        png = tmp_path / "profile.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"wrote {png}" in text


def test_check_runs_the_recommended_split_under_load_and_compares(tiny_models, tmp_path):
    # curves written by hand (the test above measures real ones): the check itself is what
    # runs here, on a real stack of the tiny model
    # and on dummy weights: a model directory without them starts only if the workers got
    # --load-format dummy
    model = _without_weights(tiny_models["llama"], tmp_path)
    curves = {
        "format": "splitserve-profile/1", "model": str(model), "device": "cpu",
        "device_name": "CPU", "dtype": "float32", "num_devices": 1, "kv_bytes_per_token": 1024,
        "max_model_len": 1024, "tensor_parallel_sizes_fit": [1],
        "curves": [{
            "tensor_parallel_size": 1,
            "prefill": [{"prompt_len": 16, "seconds": 0.002}, {"prompt_len": 512, "seconds": 0.02}],
            "decode": [{"batch": b, "prompt_len": 64, "context_len": 70, "step_s": 0.002 * b}
                       for b in (1, 8)],
        }],
    }  # fmt: skip
    saved, out = tmp_path / "curves.json", tmp_path / "checked.json"
    saved.write_text(json.dumps(curves))
    command = [
        sys.executable, "-m", "splitserve.cli", "profile", "--from-curves", str(saved),
        "--request-rate", "4", "--input-len", "64", "--output-len", "8", "--ttft-ms", "5000",
        "--tpot-ms", "1000", "--check", "--check-num-prompts", "12", "--load-format", "dummy",
        "--result-filename", str(out), "--no-plot",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "check of 1P×TP1 + 1D×TP1: 12 of 12 requests completed" in done.stdout
    assert "TTFT p90 (ms)" in done.stdout and "TPOT p50 (ms)" in done.stdout
    check = json.loads(out.read_text())["check"]
    assert check["completed"] == 12 and check["failed"] == 0
    assert check["served_output_len"] == 8 and check["served_input_len"] > 0
    assert check["p90_ttft_ms"] > 0 and check["median_tpot_ms"] > 0
    assert check["predicted_p90_ttft_ms"] > 0 and check["predicted_median_tpot_ms"] > 0
