"""Naming an adapter in a request, without torch: the gateway checks names with this too."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.errors import InvalidRequest, quoted

MAX_ADAPTER_NAME_CHARS = 256


def check_adapter_name(name: object) -> str:
    """`name` if it can name an adapter (a non-empty string of printable characters without
    spaces, at most MAX_ADAPTER_NAME_CHARS); InvalidRequest otherwise."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"an adapter name must be a non-empty string, got {quoted(name)}")
    if (
        len(name) > MAX_ADAPTER_NAME_CHARS
        or not name.isprintable()
        or any(c.isspace() for c in name)
    ):
        raise InvalidRequest(
            f"adapter name {quoted(name)} must be printable, without spaces, and at most "
            f"{MAX_ADAPTER_NAME_CHARS} characters"
        )
    return name


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs under, as vLLM names it: `lora_name` (what requests and
    `/v1/models` call it) and, optionally, the PEFT directory to load it from if this engine
    has not loaded it yet. `lora_int_id` is accepted for vLLM compatibility and unused."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None

    def __post_init__(self) -> None:
        check_adapter_name(self.lora_name)
