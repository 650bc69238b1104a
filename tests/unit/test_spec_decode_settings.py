"""The `--speculative-*` worker flags become the engine's `SpeculativeConfig`; bad ones are
refused with the flag's name; the spec_decode counters are exported as `splitserve:` metrics."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client.core import Metric

from splitserve.engine.spec_decode.config import SpeculativeConfig
from splitserve.engine.stats import EngineStats
from splitserve.launch.workers import engine_config
from splitserve.runtime.engine_metrics import EngineCollector
from splitserve.runtime.settings import WorkerSettings, add_flags, from_args


def _worker(*argv: str) -> WorkerSettings:
    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerSettings, {})
    return from_args(WorkerSettings, parser.parse_args(list(argv)))


def test_speculative_flags_reach_the_engine_config():
    assert engine_config(_worker()).speculative is None
    worker = _worker("--speculative-method", "ngram", "--num-speculative-tokens", "3")
    assert engine_config(worker).speculative == SpeculativeConfig("ngram", 3)
    worker = _worker("--speculative-method", "draft", "--speculative-draft-layers", "2")
    assert engine_config(worker).speculative == SpeculativeConfig("draft", 4, draft_layers=2)
    worker = _worker("--speculative-method", "draft", "--speculative-model", "/models/draft")
    assert engine_config(worker).speculative == SpeculativeConfig("draft", 4, model="/models/draft")
    worker = _worker(
        "--speculative-method", "draft", "--speculative-model", "/models/draft",
        "--speculative-draft-catch-up-tokens", "64",
    )  # fmt: skip
    assert engine_config(worker).speculative == SpeculativeConfig(
        "draft", 4, model="/models/draft", draft_catch_up_tokens=64
    )


def test_bad_speculative_flags_are_refused():
    with pytest.raises(ValueError, match="speculative method must be one of"):
        engine_config(_worker("--speculative-method", "eagle"))
    with pytest.raises(ValueError, match="exactly one of"):
        engine_config(_worker("--speculative-method", "draft"))
    with pytest.raises(ValueError, match="at least 1"):
        engine_config(_worker("--speculative-method", "ngram", "--num-speculative-tokens", "0"))
    with pytest.raises(ValueError, match="draft_catch_up_tokens must be at least 1"):
        SpeculativeConfig("draft", model="/models/draft", draft_catch_up_tokens=0)


def test_spec_decode_counters_are_exported():
    stats = EngineStats(
        **{f: 0 for f in ("num_requests_running", "num_requests_waiting", "num_reserved",
                          "num_requests", "num_total_blocks", "num_free_blocks",
                          "num_cached_blocks", "num_pinned_blocks", "num_preemptions",
                          "prefix_cache_queries", "prefix_cache_hits")},
        block_size=16,
        spec_decode_num_drafts=5,
        spec_decode_num_draft_tokens=20,
        spec_decode_num_accepted_tokens=7,
        spec_decode_num_accepted_tokens_per_pos=(4, 2, 1, 0),
    )  # fmt: skip
    collector = EngineCollector.__new__(EngineCollector)  # how it reads stats is beside the point
    collector.model_name = "m"
    families: list[Metric] = list(collector._families(stats))
    samples = {(s.name, s.labels.get("position")): s.value for f in families for s in f.samples}
    assert samples[("splitserve:spec_decode_num_drafts_total", None)] == 5
    assert samples[("splitserve:spec_decode_num_draft_tokens_total", None)] == 20
    assert samples[("splitserve:spec_decode_num_accepted_tokens_total", None)] == 7
    per_pos = "splitserve:spec_decode_num_accepted_tokens_per_pos_total"
    assert [samples[(per_pos, str(i))] for i in range(4)] == [4, 2, 1, 0]
