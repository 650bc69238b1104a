"""From measured curves to a prefill/decode split: the prediction for one split, and the search.

For P prefill workers and D decode workers at a request rate λ, prompts of length x (uniform in
the length mix) and replies of L_out tokens:

    TTFT = W + prefill(x) + kv_bytes(x) / transfer bandwidth
           W: the wait for one of the P prefill workers (queueing.py), service time prefill(x)
    TPOT = step(B, context),  B = λ · L_out · TPOT / D        (Little's law: the sequences
           a decode worker holds), context = mean prompt + L_out / 2; solved for TPOT

TTFT's p90 is that of the mix (each prompt's own prefill plus the shared wait); TPOT is one
figure, its p50. A split meets the targets when TTFT p90 ≤ --ttft-ms and TPOT p50 ≤ --tpot-ms;
its goodput is λ times the share of requests whose TTFT is within the target (none when TPOT
is over it), and its capacity the highest rate at which it still meets them. The recommendation
is the split on the fewest devices that meets them, the one with the most capacity among those.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.launch.profile.curves import Curves, Profile
from splitserve.launch.profile.queueing import ServerQueue

TTFT_QUANTILE = 0.9
MIX_POINTS = 9  # lengths the mix is integrated over
TOO_SLOW_S = 1e4  # a TPOT past this is the decode workers' saturation


@dataclass(frozen=True)
class Workload:
    request_rate: float  # requests per second (Poisson)
    input_len: int  # prompt tokens (the mix's mean)
    output_len: int  # reply tokens (the mix's mean)
    range_ratio: float = 0.0  # lengths uniform in [len·(1−r), len·(1+r)], as `bench serve`'s

    def __post_init__(self) -> None:
        if not (self.request_rate > 0 and math.isfinite(self.request_rate)):
            raise ValueError(f"--request-rate must be a positive number, got {self.request_rate}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be at least 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")

    def lengths(self, mean: int) -> list[float]:
        """The mix's lengths around `mean`: the midpoints of MIX_POINTS equal slices."""
        if self.range_ratio == 0:
            return [float(mean)]
        lo, width = mean * (1 - self.range_ratio), 2 * mean * self.range_ratio
        return [lo + width * (i + 0.5) / MIX_POINTS for i in range(MIX_POINTS)]


@dataclass(frozen=True)
class Targets:
    ttft_s: float  # p90
    tpot_s: float  # p50

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError("--ttft-ms and --tpot-ms must be positive")


@dataclass(frozen=True)
class Split:
    num_prefill: int
    prefill_tp: int
    num_decode: int
    decode_tp: int

    @property
    def devices(self) -> int:
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    @property
    def label(self) -> str:
        return f"{self.num_prefill}P×TP{self.prefill_tp} + {self.num_decode}D×TP{self.decode_tp}"


@dataclass(frozen=True)
class Prediction:
    split: Split
    ttft_p90_s: float
    tpot_p50_s: float
    prefill_utilization: float
    decode_batch: float  # sequences per decode worker (Little's law)
    goodput: float  # requests/s that meet both targets
    capacity: float  # the highest rate (requests/s) meeting both targets; 0: none
    meets: bool
    bottleneck: str  # "prefill" or "decode": the side that misses its target first as the
    # rate grows past the capacity (or, with no capacity, the one further past it)


def _ttft_p90(queue: ServerQueue, bases: list[float]) -> float:
    """The TTFT p90 of the mix: bisection on P(W + base > t) = 1 − TTFT_QUANTILE."""
    if not queue.stable:
        return math.inf

    def over(t: float) -> float:
        return sum(queue.wait_exceeds(t - b) for b in bases) / len(bases)

    lo, hi = min(bases), max(bases) + queue.wait_quantile_s(TTFT_QUANTILE)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if over(mid) > 1 - TTFT_QUANTILE else (lo, mid)
    return hi


def _tpot(step: Callable[[float], float], per_worker_rate: float, output_len: int) -> float:
    """The TPOT t with t = step(λ_d · L_out · t): the least fixed point, by bisection."""

    def short(t: float) -> bool:  # does a step at the batch this TPOT implies fit in t?
        return step(per_worker_rate * output_len * t) <= t

    lo = step(1.0)
    if short(lo):
        return lo
    hi = lo * 2
    while not short(hi):
        if hi > TOO_SLOW_S:
            return math.inf
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if short(mid) else (mid, hi)
    return hi


def _prefill_side(
    profile: Profile, split: Split, work: Workload, transfer_bytes_per_s: float
) -> tuple[ServerQueue, list[float]]:
    """The prefill workers' queue, and each mix length's TTFT less its wait."""
    pre: Curves = profile.at(split.prefill_tp)
    lengths = work.lengths(work.input_len)
    service = [pre.prefill_s(x) for x in lengths]
    mean = sum(service) / len(service)
    scv = sum((s - mean) ** 2 for s in service) / len(service) / mean**2
    queue = ServerQueue(split.num_prefill, work.request_rate, mean, scv)
    bases = [
        s + profile.kv_bytes_per_token * x / transfer_bytes_per_s
        for s, x in zip(service, lengths, strict=True)
    ]
    return queue, bases


def _figures(
    profile: Profile, split: Split, work: Workload, transfer_bytes_per_s: float
) -> tuple[float, float, float, float]:
    """(TTFT p90, TPOT, prefill utilization, sequences per decode worker)."""
    queue, bases = _prefill_side(profile, split, work, transfer_bytes_per_s)
    dec: Curves = profile.at(split.decode_tp)
    context = work.input_len + work.output_len / 2
    rate = work.request_rate / split.num_decode
    tpot = _tpot(lambda b: dec.decode_step_s(b, context), rate, work.output_len)
    batch = rate * work.output_len * tpot if math.isfinite(tpot) else math.inf
    return _ttft_p90(queue, bases), tpot, queue.utilization, batch


def _meets(profile: Profile, split: Split, work: Workload, targets: Targets, bw: float) -> bool:
    ttft, tpot, *_ = _figures(profile, split, work, bw)
    return ttft <= targets.ttft_s and tpot <= targets.tpot_s


def _capacity(profile: Profile, split: Split, work: Workload, targets: Targets, bw: float) -> float:
    def meets(rate: float) -> bool:
        return _meets(profile, split, _at_rate(work, rate), targets, bw)

    lo, hi = 0.0, work.request_rate
    if meets(hi):
        while meets(hi * 2):
            hi *= 2
            if hi > 1e9:
                return math.inf
        lo, hi = hi, hi * 2
    for _ in range(25):  # NOTE: to 3e-8 of the bracket: ample for a rate
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def _at_rate(work: Workload, rate: float) -> Workload:
    return Workload(rate, work.input_len, work.output_len, work.range_ratio)


def predict(
    profile: Profile, split: Split, work: Workload, targets: Targets, transfer_bytes_per_s: float
) -> Prediction:
    ttft, tpot, util, batch = _figures(profile, split, work, transfer_bytes_per_s)
    within = 0.0
    if tpot <= targets.tpot_s and math.isfinite(ttft):
        queue, bases = _prefill_side(profile, split, work, transfer_bytes_per_s)
        within = sum(1 - queue.wait_exceeds(targets.ttft_s - b) for b in bases) / len(bases)
    capacity = _capacity(profile, split, work, targets, transfer_bytes_per_s)
    # NOTE: the side that fails first as the rate grows: judged just past the capacity
    probe = capacity * 1.05 if 0 < capacity < math.inf else work.request_rate
    ttft_past, tpot_past, *_ = _figures(profile, split, _at_rate(work, probe), transfer_bytes_per_s)
    return Prediction(
        split=split,
        ttft_p90_s=ttft,
        tpot_p50_s=tpot,
        prefill_utilization=util,
        decode_batch=batch,
        goodput=work.request_rate * within,
        capacity=capacity,
        meets=ttft <= targets.ttft_s and tpot <= targets.tpot_s,
        bottleneck="prefill"
        if ttft_past / targets.ttft_s >= tpot_past / targets.tpot_s
        else "decode",
    )


def splits(degrees: tuple[int, ...], devices: int) -> list[Split]:
    """Every split of at least one worker a side on at most `devices` devices."""
    found = []
    for tp_p in degrees:
        for tp_d in degrees:
            for num_p in range(1, devices // tp_p + 1):
                for num_d in range(1, (devices - num_p * tp_p) // tp_d + 1):
                    found.append(Split(num_p, tp_p, num_d, tp_d))
    return found


def search(
    profile: Profile, devices: int, work: Workload, targets: Targets, transfer_bytes_per_s: float
) -> tuple[list[Prediction], Prediction | None]:
    """Every split's prediction (those that meet the targets first, fewest devices, most
    capacity) and the recommendation (None: no split on `devices` meets them)."""
    if devices < 2:
        raise ValueError(
            f"--gpus must be at least 2 (one prefill and one decode worker), got {devices}"
        )
    found = [
        predict(profile, s, work, targets, transfer_bytes_per_s)
        for s in splits(profile.degrees(), devices)
    ]
    found.sort(key=lambda p: (not p.meets, p.split.devices, -p.capacity, -p.goodput))
    best = found[0] if found and found[0].meets else None
    return found, best


def extrapolations(profile: Profile, best: Prediction, work: Workload) -> list[str]:
    """Where the recommendation's figures come from beyond the measured points."""
    found = []
    longest = work.lengths(work.input_len)[-1]
    context = work.input_len + work.output_len / 2
    for role, tp in (("prefill", best.split.prefill_tp), ("decode", best.split.decode_tp)):
        measured = profile.at(tp).measured_range()
        if role == "prefill" and longest > measured["prompt_len"][1]:
            found.append(
                f"prompts of {longest:.0f} tokens are past the longest measured at TP{tp} "
                f"({measured['prompt_len'][1]}): add longer --prefill-lens"
            )
        if role == "decode" and best.decode_batch > measured["batch"][1]:
            found.append(
                f"a decode batch of {best.decode_batch:.0f} is past the largest measured at "
                f"TP{tp} ({measured['batch'][1]}): add larger --decode-batches"
            )
        low, high = measured["context_len"]
        if role == "decode" and not 0.9 * low <= context <= 1.1 * high:  # NOTE: a 10% margin
            found.append(
                f"a decode context of {context:.0f} tokens is outside those measured at TP{tp} "
                f"({low}-{high}): "
                "adjust --decode-contexts"
            )
    return found
