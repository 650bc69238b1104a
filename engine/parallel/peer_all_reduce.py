"""A one-shot all-reduce over peer memory, for the small all-reduces of a decode step.

NCCL's ring all-reduce of a decode step's activations (8 KiB at batch 1 for a 4096-wide model)
costs tens of microseconds of launch and protocol, about as much as reading half the layer's
weights, 65 times a step. Over NVLink a rank can read its peers' memory directly: each rank
copies its input into a buffer every rank has mapped (PyTorch's symmetric memory), then one
kernel reads every rank's copy and sums them (`symm_mem.one_shot_all_reduce_out`), a few
microseconds. It is what vLLM's and SGLang's custom all-reduces do; here PyTorch's maintained
kernel does it. It captures into CUDA graphs like any kernel.

Only tensors up to the buffer's size take it (one-shot reads `size - 1` full copies: past about
a megabyte a ring is cheaper); larger ones go to NCCL. Set up
fails (no peer access between the GPUs, a torch without symmetric memory) fall back to NCCL
with a warning: the engine runs either way.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# NOTE: past this, NCCL's ring wins on two NVLink-joined GPUs (bench/tensor_parallel measures it).
DEFAULT_MAX_BYTES = 1 << 20
# NOTE: the dtypes PyTorch's one-shot kernel sums.
_SUMMED = (torch.bfloat16, torch.float16, torch.float32)


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
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        """Map the buffer on every rank (a collective: every rank calls it, in the same
        order). `name` must be the same on every rank and unique on the host."""
        from torch.distributed import _symmetric_memory as symm

        self.name = name
        self.max_bytes = max_bytes
        # NOTE: the group's membership travels in our own store, under a prefix: symmetric
        # memory needs no torch.distributed default group (set_group_info is what
        # enable_symm_mem_for_group did for a registered one).
        prefixed = dist.PrefixStore(f"symm-mem/{name}/", store)
        symm._SymmetricMemory.set_group_info(name, rank, size, prefixed)
        self.buffer = symm.empty(max_bytes, dtype=torch.uint8, device=device)
        # NOTE: a plain name: torch 2.11 has no GroupName type (later ones accept a str too).
        self._handle = symm.rendezvous(self.buffer, name)  # type: ignore[arg-type]

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.dtype in _SUMMED
            and x.numel() * x.element_size() <= self.max_bytes
            and x.is_contiguous()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks, in place; returns it. The caller checked `fits`."""
        flat = x.view(-1)
        # NOTE: offset 0, so the slice starts where every rank's mapping does.
        slot = self.buffer.view(x.dtype)[: flat.numel()]
        slot.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(slot, "sum", self.name, flat)
        return x


def try_peer_all_reduce(
    store: dist.Store,
    name: str,
    rank: int,
    size: int,
    device: torch.device,
    max_bytes: int,
) -> PeerAllReduce | None:
    """A PeerAllReduce, or None (logged) when this host or torch cannot make one.

    Every rank must get the same answer or the next collective hangs: a rank whose set-up
    failed says so in the store, and each rank checks every rank's word before using it."""
    ok = True
    peer: PeerAllReduce | None = None
    try:
        peer = PeerAllReduce(store, name, rank, size, device, max_bytes)
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
