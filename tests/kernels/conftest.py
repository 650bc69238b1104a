"""Kernel tests run on the GPU when there is one, else in Triton's interpreter on the CPU.

NOTE: Triton binds a kernel to the interpreter when its `@triton.jit` runs, i.e. when `kernels.*`
is first imported; pytest imports this file before any test module of this folder, so setting
the variable here is early enough.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
