"""A worker left to its defaults serves the context its KV pool holds (one line says so) rather
than refusing to start; a context or pool size the user set is never changed."""

from __future__ import annotations

from splitserve.engine import LLMEngine
from splitserve.engine.config import EngineConfig
from splitserve.launch.workers import engine_config
from splitserve.runtime.settings import WorkerSettings


def test_an_unset_context_is_fitted_to_the_pool_and_said(tiny_models, capsys):
    engine = LLMEngine(
        tiny_models["llama"], EngineConfig(num_kv_blocks=8, fit_max_model_len_to_pool=True)
    )
    assert engine.max_model_len == 8 * engine.config.block_size == 128
    assert "serving a context of 128 tokens" in capsys.readouterr().err
    assert engine.scheduler.max_model_len == 128


def test_an_asked_context_is_kept(tiny_models, capsys):
    engine = LLMEngine(
        tiny_models["llama"],
        EngineConfig(num_kv_blocks=8, max_model_len=1024, fit_max_model_len_to_pool=True),
    )
    assert engine.max_model_len == 1024
    assert "serving a context" not in capsys.readouterr().err


def test_workers_fit_only_when_neither_context_nor_pool_was_asked_for():
    assert engine_config(WorkerSettings()).fit_max_model_len_to_pool
    assert not engine_config(WorkerSettings(max_model_len=512)).fit_max_model_len_to_pool
    assert not engine_config(WorkerSettings(num_kv_blocks=64)).fit_max_model_len_to_pool
