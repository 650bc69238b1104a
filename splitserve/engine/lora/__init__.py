"""Multi-LoRA: many PEFT adapters on one base model, mixed in one batch.

- `request.py`  — `LoRARequest` and adapter-name checks (torch-free: the gateway uses them).
- `adapter.py`  — reads and checks a PEFT adapter directory into host memory.
- `weights.py`  — the slot-major device layout every adapter is packed into.
- `batch.py`    — one step's segments, and the hook the model's projections call.
- `manager.py`  — host adapters, `max_loras` device slots swapped in LRU order.

The batched shrink/expand kernels are `kernels/lora.py` (torch reference `kernels/lora_ref.py`).
"""

from splitserve.engine.lora.request import LoRARequest, check_adapter_name

__all__ = ["LoRARequest", "check_adapter_name"]
