"""The planner's decision: given one snapshot of the signals the cluster already publishes, move a
worker between prefill and decode, or not. A pure function, so that it is tested on recorded
and synthetic signal sequences and the same decision can drive Kubernetes replica counts.

    prefill pressure = max(TTFT p90 / TTFT SLO, queued prompt tokens per prefill worker / high)
    decode pressure  = max(TPOT p90 / TPOT SLO, decode KV usage / high)

A side is short of workers when its pressure passes 1. One worker moves from the other side
only if that side keeps a worker and, by the simple proportional estimate (its pressure times
n / (n - 1)), stays under 1 after losing one: so a move never makes the other side the short
one, which is what would flap. After any move the split holds for `min_dwell_s` (a switch
drains, and the histograms need time to show its effect).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlannerConfig:
    """The SLO and the thresholds the planner holds the split to."""

    ttft_slo_s: float  # the TTFT target (p90 of the window)
    tpot_slo_s: float  # the time-per-output-token target (p90 of the gateway's ITL)
    min_dwell_s: float = 30.0  # no move within this long of the last one
    kv_usage_high: float = 0.9  # decode KV use (share of blocks) that counts as full
    queued_tokens_high: int = 16384  # prompt tokens waiting per prefill worker that count as full

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "tpot_slo_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.min_dwell_s < 0:
            raise ValueError(f"min_dwell_s must be >= 0, got {self.min_dwell_s!r}")
        if not 0 < self.kv_usage_high <= 1:
            raise ValueError(f"kv_usage_high must be in (0, 1], got {self.kv_usage_high!r}")
        if self.queued_tokens_high < 1:
            raise ValueError(f"queued_tokens_high must be >= 1, got {self.queued_tokens_high}")


@dataclass(frozen=True)
class Signals:
    """One snapshot: what the registry, the gateways' ledgers and /metrics say now.

    `ttft_p90_s` and `tpot_p90_s` are over the last window (None: no request finished a first
    token, or a second one, in it)."""

    at_s: float  # monotonic seconds of the snapshot
    num_prefill: int
    num_decode: int
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    prefill_queued_tokens: int = 0  # over every prefill worker
    decode_kv_usage: float = 0.0  # the fullest decode worker's share of blocks in use


@dataclass(frozen=True)
class Decision:
    """`move` is "to_prefill" (one decode worker becomes a prefill worker), "to_decode", or
    None; `num_prefill` and `num_decode` are the split after it."""

    move: str | None
    num_prefill: int
    num_decode: int
    prefill_pressure: float
    decode_pressure: float
    reason: str


def pressures(s: Signals, config: PlannerConfig) -> tuple[float, float]:
    """(prefill pressure, decode pressure): 1.0 is the SLO's edge."""
    prefill = max(
        (s.ttft_p90_s or 0.0) / config.ttft_slo_s,
        s.prefill_queued_tokens / max(1, s.num_prefill) / config.queued_tokens_high,
    )
    decode = max(
        (s.tpot_p90_s or 0.0) / config.tpot_slo_s, s.decode_kv_usage / config.kv_usage_high
    )
    return prefill, decode


def decide(s: Signals, config: PlannerConfig, last_move_at_s: float | None) -> Decision:
    """The move (if any) for snapshot `s`; `last_move_at_s` is when the last one was made."""
    p, d = pressures(s, config)
    stay = Decision(None, s.num_prefill, s.num_decode, p, d, "")
    if last_move_at_s is not None and s.at_s - last_move_at_s < config.min_dwell_s:
        return _why(stay, f"dwelling ({s.at_s - last_move_at_s:.0f} s of {config.min_dwell_s:.0f})")
    if p <= 1.0 and d <= 1.0:
        return _why(stay, "both sides within the SLO")
    if p > d:  # prefill is the short side
        if s.num_decode <= 1:
            return _why(stay, "prefill-bound, but decode has one worker only")
        after = d * s.num_decode / (s.num_decode - 1)
        if after >= 1.0:
            return _why(stay, f"prefill-bound, but decode would be too ({after:.2f})")
        return Decision(
            "to_prefill", s.num_prefill + 1, s.num_decode - 1, p, d,
            f"prefill-bound ({p:.2f}); decode keeps {after:.2f}",
        )  # fmt: skip
    if s.num_prefill <= 1:
        return _why(stay, "decode-bound, but prefill has one worker only")
    after = p * s.num_prefill / (s.num_prefill - 1)
    if after >= 1.0:
        return _why(stay, f"decode-bound, but prefill would be too ({after:.2f})")
    return Decision(
        "to_decode", s.num_prefill - 1, s.num_decode + 1, p, d,
        f"decode-bound ({d:.2f}); prefill keeps {after:.2f}",
    )  # fmt: skip


def _why(decision: Decision, reason: str) -> Decision:
    return Decision(
        decision.move,
        decision.num_prefill,
        decision.num_decode,
        decision.prefill_pressure,
        decision.decode_pressure,
        reason,
    )
