"""When kernels launch with programmatic dependent launch: never in the interpreter or on a CPU,
only when asked for, and not when SPLITSERVE_PDL turns it off for a worker."""

from __future__ import annotations

import pytest
import torch

from splitserve.cli import build_parser
from splitserve.engine.config import EngineConfig
from splitserve.engine.platform import Platform
from splitserve.kernels.gemv import _gemv_kernel
from splitserve.kernels.pdl import launch_options, use_pdl
from splitserve.launch.workers import engine_config
from splitserve.runtime.settings import WorkerSettings, from_args


def test_no_pdl_off_the_gpu_or_in_the_interpreter():
    assert not use_pdl(_gemv_kernel, torch.device("cpu"), True)
    assert launch_options(False) == {}
    assert launch_options(True) == {"launch_pdl": True}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pdl_follows_the_request_on_a_gpu():
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert use_pdl(_gemv_kernel, torch.device("cuda"), True) == hopper
    assert not use_pdl(_gemv_kernel, torch.device("cuda"), False)
    on = Platform.resolve(EngineConfig(device="cuda", dtype=torch.bfloat16))
    off = Platform.resolve(EngineConfig(device="cuda", dtype=torch.bfloat16, enable_pdl=False))
    assert on.pdl and not off.pdl
    torch_backend = EngineConfig(device="cuda", dtype=torch.bfloat16, attention_backend="torch")
    assert not Platform.resolve(torch_backend).pdl  # the torch backend runs no Triton at all


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("0", False), ("off", False)])
def test_the_environment_switch_reaches_the_engine_config(value, enabled):
    env = {} if value is None else {"SPLITSERVE_PDL": value}
    args = build_parser(env).parse_args(["decode", "--redis-url", "redis://x"])
    config = engine_config(from_args(WorkerSettings, args))
    assert config.enable_pdl is enabled


def test_a_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="SPLITSERVE_PDL='maybe'"):
        build_parser({"SPLITSERVE_PDL": "maybe"})
