"""The paged KV cache: one block-major tensor, sized from a memory budget.

A block holds the keys and values of `block_size` tokens in every layer, contiguously, so that
moving a block between workers is one descriptor (one copy) however many layers the model has:

    pool   [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
            └ block b ┘ = one run of `block_bytes` bytes
    layer l view  pool[:, l].transpose(0, 1)  ->  [2, num_blocks, block_size, heads, dim]
            (strided: consecutive blocks are `num_layers` layers apart)

The attention backends see the per-layer views and find each page through its block stride;
transports see the pool and move whole blocks.

Sliding-window layers (Gemma 3's five of six, gpt-oss's every other) keep only the blocks their
window still covers (engine/window_slots.py): with `window_slots`, their keys and values live
in a second, smaller block-major pool of slots, and the pool above holds the full layers only:

    pool          [num_blocks, full layers, 2, block_size, heads, dim]
    window pool   [num_slots, sliding layers, 2, block_size, heads, dim]   (slot 0: zeros)
    window map    [num_blocks] int32: the slot block b's sliding layers use (0: none)

The model reads a sliding layer's pages through the window map (`window_view`), on the device,
so CUDA graphs replay it; the block manager decides the map, the engine copies its changes in.

DeepSeek's latent attention (engine/mla.py) keeps one latent per token and layer, no per-head
keys and values: its pool has one plane of one "head" as wide as the latent (`kv_page`),

    pool   [num_blocks, num_layers, 1, block_size, 1, kv_lora_rank + qk_rope_head_dim]
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.window_slots import slots_needed


def kv_page(model: ModelConfig, block_size: int) -> tuple[int, int, int, int]:
    """One layer's page of one block: (planes, block_size, heads, dim). Keys and values
    (2 planes of the KV heads), or MLA's latent (1 plane of one latent-wide row)."""
    if model.mla is not None:
        return (1, block_size, 1, model.mla.latent_dim)
    return (2, block_size, model.num_kv_heads, model.head_dim)


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values (or MLA latents) of `block_size` tokens across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    planes, _, heads, dim = kv_page(model, block_size)
    return planes * model.num_layers * block_size * heads * dim * elem


def window_layers(model: ModelConfig, config: EngineConfig) -> tuple[int, ...]:
    """The sliding-window layers whose KV lives in the window pool; () keeps every block.

    NOTE: not yet with tensor parallelism, speculative decoding (a draft may attend over the
    target's pool) or a model whose every layer slides (no full layer to key blocks by)."""
    if not config.sliding_window_kv or config.tensor_parallel_size > 1 or config.speculative:
        return ()
    local = tuple(i for i in range(model.num_layers) if model.window(i) is not None)
    return local if 0 < len(local) < model.num_layers else ()


def size_kv_pool(model: ModelConfig, config: EngineConfig, budget: int) -> EngineConfig:
    """Return `config` with `num_kv_blocks` set from `budget` bytes (unless it is given), and
    with sliding-window layers (`window_layers`) `num_window_slots`: what every running
    sequence's window needs at most, the memory it saves going to more blocks."""
    local = window_layers(model, config)
    if not local:
        config = dataclasses.replace(config, num_window_slots=None)
    if config.num_kv_blocks is not None:
        if local and config.num_window_slots is None:
            slots = _window_slots(model, config, config.num_kv_blocks)
            config = dataclasses.replace(config, num_window_slots=slots)
        elif local:
            _check_window_slots(model, config)
        return config
    per_block = bytes_per_block(model, config.block_size, config.cache_dtype)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"no memory left for the KV cache: budget {budget} bytes, one block needs {per_block}"
        )
    if not local:
        return dataclasses.replace(config, num_kv_blocks=int(num_blocks))
    per_layer = per_block // model.num_layers
    slots = _window_slots(model, config, num_blocks)
    full = model.num_layers - len(local)
    more = (budget - slots * len(local) * per_layer) // (full * per_layer)
    assert config.max_model_len is not None
    most = config.max_num_seqs * -(-config.max_model_len // config.block_size)
    num_blocks = max(num_blocks, min(more, most))  # NOTE: more blocks than any batch fills
    return dataclasses.replace(config, num_kv_blocks=int(num_blocks), num_window_slots=slots)


def _window_slots(model: ModelConfig, config: EngineConfig, num_blocks: int) -> int:
    """Slots of the window pool: one per block at most, and the null slot."""
    window = model.sliding_window
    assert window is not None
    needed = slots_needed(
        window, config.block_size, config.max_num_seqs, config.max_num_batched_tokens
    )
    return min(num_blocks, needed) + 1


def fit_context_to_pool(config: EngineConfig) -> EngineConfig:
    """`config` serving at most what its sized pool holds of one sequence, when it asks for
    that (`fit_max_model_len_to_pool`, the context not set by the user) and holds fewer tokens
    than its `max_model_len`; one line says so."""
    assert config.num_kv_blocks is not None and config.max_model_len is not None
    holds = config.num_kv_blocks * config.block_size
    if not config.fit_max_model_len_to_pool or holds >= config.max_model_len:
        return config
    print(
        f"serving a context of {holds} tokens, what the KV pool holds ({config.num_kv_blocks}"
        f" blocks), not the model's {config.max_model_len}: give the cache more memory "
        "(--kv-cache-memory-bytes, --gpu-memory-utilization) to serve longer",
        file=sys.stderr,
        flush=True,
    )
    return dataclasses.replace(config, max_model_len=holds)


def _check_window_slots(model: ModelConfig, config: EngineConfig) -> None:
    """A `num_window_slots` given must hold one step of one sequence: the window before its
    longest chunk, the chunk, and the null slot (fewer, and a long prompt would wait forever)."""
    window, bs = model.sliding_window, config.block_size
    assert window is not None and config.num_window_slots is not None
    chunk = min(config.max_num_batched_tokens, config.max_model_len or model.max_model_len)
    least = -(-(window - 1 + chunk) // bs) + 2
    if config.num_window_slots < least:
        raise ValueError(
            f"num_window_slots {config.num_window_slots} cannot hold one sequence's window "
            f"({window} tokens) and a chunk of {chunk} tokens: give at least {least}"
        )


@dataclass(frozen=True)
class KVCache:
    """The pool tensor and the per-layer views the model attends over (sliding layers' in the
    window pool, when there is one)."""

    pool: torch.Tensor  # [num_blocks, full layers, 2 (MLA: 1), block_size, num_kv_heads, head_dim]
    layers: tuple[torch.Tensor, ...]  # per layer: [2, num_blocks or slots, block_size, heads, dim]
    window_pool: torch.Tensor | None = None  # [num_slots, sliding layers, 2, block_size, …]
    window_map: torch.Tensor | None = None  # [num_blocks] int32: block -> window slot

    @classmethod
    def allocate(cls, model: ModelConfig, config: EngineConfig) -> KVCache:
        assert config.num_kv_blocks is not None, "size the pool first"
        local = window_layers(model, config) if config.num_window_slots else ()
        page = kv_page(model, config.block_size)
        full = model.num_layers - len(local)
        dtype, device = config.cache_dtype, config.device
        pool = torch.zeros((config.num_kv_blocks, full, *page), dtype=dtype, device=device)
        if not local:
            return cls.over(pool)
        assert config.num_window_slots is not None
        window_pool = torch.zeros(
            (config.num_window_slots, len(local), *page), dtype=dtype, device=device
        )
        full_ids = iter(range(full))
        local_ids = iter(range(len(local)))
        layers = tuple(
            window_pool[:, next(local_ids)].transpose(0, 1)
            if layer in local
            else pool[:, next(full_ids)].transpose(0, 1)
            for layer in range(model.num_layers)
        )
        window_map = torch.zeros(config.num_kv_blocks, dtype=torch.int32, device=config.device)
        return cls(pool, layers, window_pool, window_map)

    @classmethod
    def over(cls, pool: torch.Tensor) -> KVCache:
        """Views of an existing block-major pool."""
        if pool.dim() != 6 or pool.shape[2] not in (1, 2) or not pool.is_contiguous():
            raise ValueError(
                "a KV pool is a contiguous [blocks, layers, 2, block_size, heads, dim] tensor "
                "(1 plane: MLA latents), "
                f"got shape {tuple(pool.shape)}"
            )
        layers = tuple(pool[:, layer].transpose(0, 1) for layer in range(pool.shape[1]))
        return cls(pool, layers)

    @property
    def latent(self) -> bool:
        """The pool holds MLA latents (DeepSeek-V2/V3), not keys and values."""
        return int(self.pool.shape[2]) == 1

    @property
    def num_blocks(self) -> int:
        return int(self.pool.shape[0])

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (every layer's keys and values): one contiguous run."""
        return int(self.pool[0].numel() * self.pool.element_size())

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy whole blocks src -> dst (copy-on-write of a shared last block), their window
        slots too (the window map already names dst's)."""
        if not copies:
            return
        device = self.pool.device
        src = torch.tensor([s for s, _ in copies], device=device)
        dst = torch.tensor([d for _, d in copies], device=device)
        self.pool[dst] = self.pool[src]
        if self.window_pool is not None and self.window_map is not None:
            wmap = self.window_map
            self.window_pool[wmap[dst].long()] = self.window_pool[wmap[src].long()]

    def apply_window_changes(self, changes: list[tuple[int, int]]) -> None:
        """Mirror the block manager's window-slot changes (block id, slot or 0) on the device."""
        if not changes or self.window_map is None:
            return
        blocks, slots = zip(*changes, strict=True)
        index = torch.tensor(blocks, dtype=torch.long)
        values = torch.tensor(slots, dtype=torch.int32)
        device = self.window_map.device
        pin = device.type == "cuda"
        if pin:
            index, values = index.pin_memory(), values.pin_memory()
        self.window_map[index.to(device, non_blocking=pin)] = values.to(device, non_blocking=pin)
