"""When kernels launch with programmatic dependent launch: never in the interpreter or on a CPU,
and not when SPLITSERVE_PDL turns it off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels.pdl
from kernels.gemv import _gemv_kernel
from kernels.pdl import launch_options, use_pdl


def test_no_pdl_off_the_gpu_or_in_the_interpreter():
    assert not use_pdl(_gemv_kernel, torch.device("cpu"))
    assert launch_options(False) == {}
    assert launch_options(True) == {"launch_pdl": True}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pdl_follows_the_switch_on_a_gpu(monkeypatch):
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert use_pdl(_gemv_kernel, torch.device("cuda")) == (hopper and kernels.pdl.ENABLED)
    monkeypatch.setattr(kernels.pdl, "ENABLED", False)
    assert not use_pdl(_gemv_kernel, torch.device("cuda"))


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("0", False), ("off", False)])
def test_the_environment_switch(value, enabled):
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_PDL"}
    if value is not None:
        env["SPLITSERVE_PDL"] = value
    code = "import kernels.pdl as p; print(p.ENABLED)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(enabled)
