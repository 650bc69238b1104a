"""All-reduces over peer memory (NVLink), for tensor parallelism's per-layer sums.

NCCL's ring all-reduce of a decode step's activations (8 KiB at batch 1 for a 4096-wide model)
costs tens of microseconds of launch and protocol, about as much as reading half the layer's
weights, 65 times a step. Over NVLink a rank can read its peers' memory directly: each rank
copies its input into a buffer every rank has mapped (PyTorch's symmetric memory), then one
kernel reads every rank's copy and sums them (`symm_mem.one_shot_all_reduce_out`), a few
microseconds. It is what vLLM's and SGLang's custom all-reduces do; here PyTorch's maintained
kernel does it. It captures into CUDA graphs like any kernel.

Up to a megabyte one-shot (each rank reads `size - 1` full copies); above it, up to the buffer's
size, two-shot (reduce-scatter then all-gather over the same mapping, for a prefill's
all-reduces); larger ones go to NCCL. A set-up that fails (no peer access between the GPUs, a
torch without symmetric memory) falls back to NCCL with a warning: the engine runs either way.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

log = logging.getLogger(__name__)

# NOTE: up to this, one-shot (least latency: a decode step's all-reduces); past it two-shot,
# up to the buffer's size (a prefill's); past that, NCCL. bench/tensor_parallel times all three.
ONE_SHOT_MAX_BYTES = 1 << 20
DEFAULT_MAX_BYTES = 64 << 20
# NOTE: the dtypes PyTorch's one-shot kernel sums.
_SUMMED = (torch.bfloat16, torch.float16, torch.float32)
# NOTE: how many peer-memory set-ups this process has tried (see try_peer_all_reduce).
_SETUPS = 0


class PeerAllReduce:
    """Rank `rank` of `size`'s side of one symmetric buffer of `max_bytes` (viewed as each
    input's dtype)."""

    def __init__(
        self,
        store: dist.Store,
        name: str,
        rank: int,
        size: int,
        device: torch.device,
        backend: Any,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        """Map the buffer on every rank (a collective: every rank calls it, in the same
        order). `name` must be the same on every rank and unique on the host; `backend` is the
        group's own (NCCL) backend, registered under `name` for the kernel to find."""
        from torch.distributed import _symmetric_memory as symm

        self.name = name
        self.size = size
        self.max_bytes = max_bytes
        # NOTE: symmetric memory finds its group by name among torch.distributed's registered
        # process groups; ours has no default group, so a process group around this engine's
        # backend is registered under its own name (membership travels in our store).
        prefixed = dist.PrefixStore(f"symm-mem/{name}/", store)
        # NOTE: held: the registry keeps only a weak reference.
        self._group = _register_group(name, prefixed, rank, size, device, backend)
        set_info = getattr(symm._SymmetricMemory, "set_group_info", None)
        if set_info is not None and not symm.is_symm_mem_enabled_for_group(name):  # type: ignore[arg-type]
            set_info(name, rank, size, prefixed)
        self.buffer = symm.empty(max_bytes, dtype=torch.uint8, device=device)
        # NOTE: a plain name: torch 2.11 has no GroupName type (later ones accept a str too).
        self._handle = symm.rendezvous(self.buffer, name)  # type: ignore[arg-type]

    def close(self) -> None:
        """Forget the group's name (its buffer goes with this object)."""
        with contextlib.suppress(Exception):
            c10d._unregister_process_group(self.name)  # type: ignore[arg-type]

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in _SUMMED
            and nbytes <= self.max_bytes
            and x.is_contiguous()
            and (nbytes <= ONE_SHOT_MAX_BYTES or x.numel() % self.size == 0)
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks, in place; returns it. The caller checked `fits`."""
        if x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES:
            return self.one_shot(x)
        return self.two_shot(x)

    def _slot(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.view(-1)
        # NOTE: offset 0, so the slice starts where every rank's mapping does.
        slot = self.buffer.view(x.dtype)[: flat.numel()]
        slot.copy_(flat)
        return flat, slot

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank reads every peer's whole copy and sums: one kernel, least latency."""
        flat, slot = self._slot(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(slot, "sum", self.name, flat)
        return x

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank sums its 1/size share from every peer, then gathers the others' sums:
        each byte crosses the link once each way, for the larger (prefill) all-reduces."""
        flat, slot = self._slot(x)
        torch.ops.symm_mem.two_shot_all_reduce_(slot, "sum", self.name)
        flat.copy_(slot)
        return x


def _register_group(
    name: str, store: dist.Store, rank: int, size: int, device: torch.device, backend: Any
) -> dist.ProcessGroup:
    kind = (
        dist.ProcessGroup.BackendType.NCCL
        if device.type == "cuda" and isinstance(backend, dist.ProcessGroupNCCL)
        else dist.ProcessGroup.BackendType.GLOO
    )
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(kind)
    group._register_backend(
        device if kind == dist.ProcessGroup.BackendType.NCCL else torch.device("cpu"), kind, backend
    )
    group._set_group_name(name)  # type: ignore[arg-type]
    c10d._register_process_group(name, group)  # type: ignore[arg-type]
    return group


def try_peer_all_reduce(
    store: dist.Store,
    name: str,
    rank: int,
    size: int,
    device: torch.device,
    backend: Any,
    max_bytes: int,
) -> PeerAllReduce | None:
    """A PeerAllReduce, or None (logged) when this host or torch cannot make one.

    Every rank must get the same answer or the next collective hangs: a rank whose set-up
    failed says so in the store, and each rank checks every rank's word before using it.

    PyTorch pairs the ranks' symmetric-memory set-ups by their order in each process (a count
    per process, not per group), so ranks whose processes have made different numbers of them
    (an engine started again in a process whose followers are new) would wait on each other
    until the store's timeout: each rank first says how many its process made, and unless
    every count agrees no rank tries (NCCL)."""
    global _SETUPS
    store.set(f"symm-mem/{name}/setups/{rank}", str(_SETUPS))
    counts = {int(store.get(f"symm-mem/{name}/setups/{r}")) for r in range(size)}
    if len(counts) > 1:
        log.warning(
            "tensor-parallel rank %d: the ranks' processes made different numbers of "
            "peer-memory set-ups before (%s; PyTorch pairs them by that order); using NCCL",
            rank,
            sorted(counts),
        )
        return None
    _SETUPS += 1
    ok = True
    peer: PeerAllReduce | None = None
    try:
        peer = PeerAllReduce(store, name, rank, size, device, backend, max_bytes)
    except Exception as exc:  # noqa: BLE001 - any failure means "use NCCL"
        ok = False
        log.warning(
            "tensor-parallel rank %d: no peer-memory all-reduce (%s); using NCCL", rank, exc
        )
    store.set(f"symm-mem/{name}/ok/{rank}", "1" if ok else "0")
    words = [store.get(f"symm-mem/{name}/ok/{r}") for r in range(size)]
    if all(w == b"1" for w in words):
        return peer
    if ok:
        log.warning(
            "tensor-parallel rank %d: a peer has no peer-memory all-reduce; using NCCL", rank
        )
    return None
