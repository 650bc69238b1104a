"""One snapshot of an engine's state: what metrics, the registry's heartbeats and GetStats read.

`LLMEngine.stats()` builds it on the engine thread, so its numbers agree with each other; every
reader (Prometheus collector, worker heartbeat, GetStats) converts this one object.
"""

from __future__ import annotations

from dataclasses import dataclass

# Upper bounds (seconds) of the serving step's histogram buckets.
# NOTE: 1 ms apart where GPU decode steps fall (5-12 ms), so a serving step compares with the
# offline one to a millisecond.
STEP_BUCKETS_S = (
    0.002, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.011, 0.012, 0.0135, 0.015, 0.0175,
    0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


@dataclass(frozen=True)
class EngineStats:
    num_requests_running: int
    num_requests_waiting: int  # queued, not yet scheduled (decode workers: prefilled, not admitted)
    num_reserved: int  # decode workers: reservations whose KV is still arriving
    num_requests: int  # known in any state: reserved, queued, running, held for sending
    num_total_blocks: int
    num_free_blocks: int  # free or held only by the prefix cache (reusable)
    num_cached_blocks: int  # held only by the prefix cache
    num_pinned_blocks: int  # held for a KV transfer in flight
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    block_size: int
    # Tokens computed to fill KV rather than to decode: prompts, and recomputes after a
    # preemption or of a resumed stream (not the KV a prefill worker pushed or a hand-off moved)
    num_prefill_tokens: int = 0
    # A serving loop's turns that stepped the engine: count, wall seconds, sequences run
    num_steps: int = 0
    step_seconds: float = 0.0
    num_step_seqs: int = 0
    # Those turns' wall times: how many fell in each of STEP_BUCKETS_S (the last count: above
    # them all), and the longest.
    step_bucket_counts: tuple[int, ...] = ()
    step_seconds_max: float = 0.0
    # Speculative decoding (engine/spec_decode/), named as vLLM's: verifications (one per
    # speculating sequence per step), draft tokens proposed, drafts accepted, and drafts
    # accepted at each position of a proposal.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # The LoRA adapters this engine serves (engine/lora), advertised in the registry.
    lora_adapters: tuple[str, ...] = ()
    # The host-memory KV tier (engine/host_tier.py): blocks held, blocks found by prefix
    # lookups, bytes copied each way, seconds spent issuing the copies.
    host_cache_blocks: int = 0
    host_cache_hits: int = 0
    host_cache_bytes_saved: int = 0
    host_cache_bytes_loaded: int = 0
    host_cache_copy_seconds: float = 0.0

    @property
    def kv_cache_usage_perc(self) -> float:
        """Fraction of blocks in use (1 = full); prefix-cached blocks count as free."""
        if not self.num_total_blocks:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def load(self) -> int:
        """Requests this engine is working on or holding, for routing."""
        return self.num_requests_running + self.num_requests_waiting + self.num_reserved
