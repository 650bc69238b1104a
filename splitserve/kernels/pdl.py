"""Programmatic dependent launch (PDL, Hopper and newer): the next kernel on the stream may be
scheduled while the current one drains, and waits for it before touching its results.

A batch-1 decode step is ~400 back-to-back kernels of a few µs each; without PDL every boundary
pays the launch and ramp-up of the next grid behind the tail of the last. Each of our kernels
starts with `pdl_start`:

    gdc_launch_dependents()   the next kernel may be scheduled on free SM slots now
    gdc_wait()                the previous kernel has finished and its writes are visible

A long, bandwidth-bound kernel (paged decode attention) waits first but lets the next kernel
launch only after its main loop: launched early, the next grid's waiting programs slowed it by up
to 20% at batch 16 with long contexts (bench/kernels.py).

Every kernel launched this way waits before it writes anything or reads anything a kernel of
the step may write, so the chain stays ordered transitively (C waits for B, which waited for
A). What no kernel of the step writes may be read before the wait: the batch-1 GEMV reads its
first weight tile there, and decode attention at small batches its first tile of older keys
(written by earlier steps). A kernel launched without PDL (torch,
cuBLAS) orders as usual. Each kernel wrapper takes `pdl=` from its caller: the engine's platform
decides it once (on by default; `SPLITSERVE_PDL=0` turns it off, e.g. to rule it out on a new
driver), and bench/decode_roofline.py passes both for A/B timing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from splitserve.kernels._validate import is_interpreted


def use_pdl(kernel: Any, device: torch.device, enabled: bool) -> bool:
    """Whether to launch `kernel` on `device` with PDL: asked for, compute capability 9.0+, and
    not interpreted."""
    if not enabled or is_interpreted(kernel) or device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(enabled: bool) -> dict[str, bool]:
    """Extra launch keywords: `launch_pdl` only when PDL is on (older launchers lack it)."""
    return {"launch_pdl": True} if enabled else {}


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """A kernel's first statement: let the next kernel launch, then wait for the previous one."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel (for kernels that let the next one launch only later)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel launch (after this kernel's main loop, in long kernels)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
