"""The one place that decides how an engine runs on its device.

Device, dtype, which kernels the model calls (`Ops`), the attention backend, CUDA graph capture,
programmatic dependent launch and the KV-cache memory budget are all settled here, once, from
an `EngineConfig`. Model code asks the platform's `ops`; it never tests `x.is_cuda` itself.

    EngineConfig ──Platform.resolve──▶ Platform ──ops()──▶ TorchOps | TritonOps ──▶ model layers
                                                ──attention_backend──▶ paged attention backend
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from splitserve.engine.attention import get_attention_backend
from splitserve.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, parse_dtype
from splitserve.engine.ops import TorchOps, TritonOps

# Room kept on a GPU for activations and the sampler beyond the KV pool.
GPU_ACTIVATION_RESERVE = 512 * 1024 * 1024


def resolve_device(device: str) -> str:
    """ "auto" picks the GPU when there is one."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(
    dtype: str | torch.dtype, device: str, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """ "auto" is the checkpoint's `torch_dtype` (float16 or bfloat16), as in HF and vLLM; a
    float32 checkpoint, or one that names none, runs in bfloat16 on a GPU and float32 on the
    CPU (where HF parity is checked in float32). Any other name as `parse_dtype` reads it."""
    if dtype != "auto":
        return parse_dtype(dtype)
    if checkpoint_dtype in ("float16", "bfloat16"):
        return parse_dtype(checkpoint_dtype)
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


@dataclass(frozen=True)
class Platform:
    """How one engine runs. Build it with `Platform.resolve`."""

    device: torch.device
    dtype: torch.dtype
    attention_backend: str  # "torch" | "triton"
    triton_ops: bool  # norms, rotary, GEMV, activation and argmax from kernels/
    cuda_graphs: bool
    pdl: bool
    merge_projections: bool  # one GEMM for q/k/v and one for gate/up

    @classmethod
    def resolve(cls, config: EngineConfig) -> Platform:
        """Decide everything `config` leaves to the device ("auto" backend, graphs, PDL)."""
        device = torch.device(config.device)
        on_gpu = device.type == "cuda"
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if on_gpu else "torch"
        backend_cls = get_attention_backend(backend)
        # NOTE: the plain-torch backend on a GPU runs no Triton at all (a reference to compare
        # against); Triton ops on the CPU only run under the interpreter, in kernel tests.
        triton_ops = on_gpu and backend == "triton"
        return cls(
            device=device,
            dtype=config.dtype,
            attention_backend=backend,
            triton_ops=triton_ops,
            # NOTE: at TP > 1 every rank captures the same graphs in the same order and
            # replays the one rank 0's step picks (engine/parallel/follower.py).
            cuda_graphs=config.enable_cuda_graphs
            and on_gpu
            and backend_cls.graph_safe
            and (config.tensor_parallel_size == 1 or config.tensor_parallel_cuda_graphs),
            pdl=config.enable_pdl and triton_ops,
            merge_projections=on_gpu,
        )

    @property
    def is_gpu(self) -> bool:
        return self.device.type == "cuda"

    def activate(self) -> None:
        """Make this engine's GPU the current one on the calling thread: Triton launches on the
        current device, whatever device its tensors are on (cuda:1 beside a default cuda:0)."""
        if self.is_gpu and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def ops(self) -> TorchOps:
        """The elementwise/GEMV kernels the model layers call."""
        return TritonOps(pdl=self.pdl) if self.triton_ops else TorchOps()

    def kv_cache_budget(self, config: EngineConfig) -> int:
        """Bytes the KV pool may take. A GPU gives `gpu_memory_utilization` of the card minus
        what is already in use (the weights are loaded by now) and an activation reserve,
        unless `kv_cache_memory_bytes` is set; the CPU gives `kv_cache_memory_bytes`."""
        if config.kv_cache_memory_bytes is not None:
            return config.kv_cache_memory_bytes
        if not self.is_gpu:
            return DEFAULT_CPU_KV_CACHE_BYTES
        # NOTE: what the caching allocator holds but no tensor uses counts as used below. Loading
        # leaves much of it (merging q/k/v and gate/up frees the parts into blocks the merged
        # tensors don't fit: ~0.3 GB a Llama-3-8B layer), which took that much from the pool.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        return int(total * config.gpu_memory_utilization) - used - GPU_ACTIVATION_RESERVE

    def apply(self, config: EngineConfig) -> EngineConfig:
        """`config` with what was decided written back (the backend name)."""
        return dataclasses.replace(config, attention_backend=self.attention_backend)
