"""The adapters a worker serves: all of them in host memory, `max_loras` on the device.

    load(name, dir) ──▶ host (LoRAAdapter + its slot image, pinned on a GPU)
    prepare(step's sequences) ──▶ each adapter of the step in a device slot (LRU swap-in)
                              ──▶ LoRABatch for the model's projections

The scheduler never puts more distinct adapters in one step than there are slots
(`Scheduler`), so a step's adapters always fit: a swap-in evicts the least recently used slot
whose adapter the step does not use. A swap-in is one host-to-device copy of the adapter's
slot image on the engine's stream, so it lands after any step still in flight.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from splitserve.engine.errors import AlreadyExists, FailedPrecondition, InvalidRequest, NotFound
from splitserve.engine.lora.adapter import LoRAAdapter, load_adapter
from splitserve.engine.lora.batch import LoRAContext, LoRALayer
from splitserve.engine.lora.weights import SlotLayout, module_views
from splitserve.engine.model import CausalLM, DecoderLayer
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.prefix_hash import adapter_root


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """`max_loras` device slots of rank up to `max_lora_rank`."""

    max_loras: int
    max_lora_rank: int


class LoRAManager:
    """Loads adapters, keeps them on the host, swaps them into device slots in LRU order and
    describes each step's batch to the model (`attach` hooks it into the layers)."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model_config = model_config
        self.config = config
        self.dtype = dtype
        self.device = device
        self.layout = SlotLayout(model_config, config.max_lora_rank)
        self.buffer = torch.zeros(config.max_loras, self.layout.numel, dtype=dtype, device=device)
        self.context = LoRAContext(torch.zeros(config.max_loras, device=device))
        self.adapters: dict[str, LoRAAdapter] = {}
        self._images: dict[str, torch.Tensor] = {}  # name -> packed slot image (host)
        self._slots: OrderedDict[str, int] = OrderedDict()  # resident adapters, LRU first
        self._free_slots = list(range(config.max_loras))
        self.num_swaps = 0

    def attach(self, model: CausalLM) -> None:
        """Give each decoder layer's attention and MLP its `LoRALayer` (`lora` attribute):
        the Triton kernels when the model runs Triton ops, the torch reference otherwise."""
        for i, layer in enumerate(model.model.layers):
            assert isinstance(layer, DecoderLayer)
            views = module_views(self.layout, self.buffer, i)
            pdl = getattr(model.ops, "pdl", False)
            hook = LoRALayer(self.context, views, model.ops.triton, pdl)
            layer.self_attn.lora = hook
            layer.mlp.lora = hook

    # -- adapters -------------------------------------------------------------------------------

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read an adapter into host memory. Loading the same weights under a name again is a
        no-op; other weights under a name in use are AlreadyExists."""
        adapter = load_adapter(name, path, self.model_config, self.config.max_lora_rank, self.dtype)
        return self.add(adapter)

    def add(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Keep an adapter already read (checked against this model) in host memory."""
        name = adapter.name
        if adapter.rank > self.config.max_lora_rank:
            raise InvalidRequest(
                f"LoRA adapter {name!r}: rank {adapter.rank} is above --max-lora-rank "
                f"{self.config.max_lora_rank}"
            )
        known = self.adapters.get(name)
        if known is not None:
            if known.digest == adapter.digest:
                return known
            raise AlreadyExists(
                f"LoRA adapter {name!r} is already loaded from {known.path} with other weights; "
                "unload it first"
            )
        pin = self.device.type == "cuda"
        self._images[name] = self.layout.pack(adapter, self.dtype, pin)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Forget an adapter (the caller has checked no request uses it)."""
        if name not in self.adapters:
            raise NotFound(f"LoRA adapter {name!r} is not loaded")
        del self.adapters[name]
        del self._images[name]
        self.evict(name)

    def evict(self, name: str) -> None:
        """Give up an adapter's device slot (it stays loaded; the next step that uses it swaps
        it in again)."""
        slot = self._slots.pop(name, None)
        if slot is not None:
            self._free_slots.append(slot)

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise NotFound(f"LoRA adapter {name!r} is not loaded")
        return adapter

    def prefix_root(self, name: str) -> bytes:
        """What a sequence under this adapter chains its prefix-cache hashes from: its name
        and weights, so no block is shared across adapters or with the base model."""
        adapter = self.get(name)
        return adapter_root(adapter.name, adapter.digest)

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def resident(self) -> list[str]:
        """Adapters in device slots, least recently used first."""
        return list(self._slots)

    # -- steps ----------------------------------------------------------------------------------

    def slots_for(self, names: Iterable[str]) -> dict[str, int]:
        """Each adapter's device slot, swapping in those not resident (LRU eviction)."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.config.max_loras:
            raise FailedPrecondition(
                f"{len(wanted)} adapters in one step but only {self.config.max_loras} slots"
            )
        result = {}
        for name in wanted:
            slot = self._slots.get(name)
            if slot is None:
                slot = self._swap_in(name, keep=wanted)
            self._slots.move_to_end(name)
            result[name] = slot
        return result

    def _swap_in(self, name: str, keep: list[str]) -> int:
        image = self._images.get(name)
        if image is None:
            raise NotFound(f"LoRA adapter {name!r} is not loaded")
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next(n for n in self._slots if n not in keep)
            slot = self._slots.pop(victim)
        self.buffer[slot].copy_(image, non_blocking=True)
        self.context.scales[slot] = self.adapters[name].scale
        self._slots[name] = slot
        self.num_swaps += 1
        return slot

    def row_slots(self, names: Sequence[str | None]) -> list[int | None]:
        """The device slot of each sequence's adapter (None for the base model)."""
        slots = self.slots_for(n for n in names if n is not None)
        return [None if n is None else slots[n] for n in names]

    def begin(self, query_lens: Sequence[int], names: Sequence[str | None]) -> list[int | None]:
        """Describe this step to the model: sequences of `query_lens` tokens, adapters `names`;
        returns each sequence's device slot (None: the base model)."""
        slots = self.row_slots(names)
        self.context.describe(query_lens, slots)
        return slots

    def end(self) -> None:
        self.context.batch = None
