"""Waiting time before service on c identical servers fed by Poisson arrivals (M/G/c).

The chance of waiting is Erlang C, exact for exponential service (M/M/c). For other service
times, Allen-Cunneen's approximation scales the mean wait by (1 + scv) / 2, scv being the
squared coefficient of variation of the service time (0 for one fixed prompt length, so half
of M/M/c's wait); the wait, given that there is one, is taken as exponential with that mean:

    P(W > t) = C(c, a) · exp(-t / m),    m = (1 + scv) / 2 / (c·μ − λ),   a = λ / μ

Past saturation (λ ≥ c·μ) the queue grows without bound and every figure is infinite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def erlang_c(servers: int, offered: float) -> float:
    """The chance that an arrival waits, with `offered` = λ · mean service time (Erlangs)."""
    if servers < 1:
        raise ValueError(f"servers must be at least 1, got {servers}")
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    blocking = 1.0  # Erlang B by its recurrence, which does not overflow for large c
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    rho = offered / servers
    return blocking / (1 - rho * (1 - blocking))


@dataclass(frozen=True)
class ServerQueue:
    servers: int
    arrival_rate: float  # per second
    mean_service_s: float
    service_scv: float = 0.0

    def __post_init__(self) -> None:
        if self.arrival_rate < 0 or not self.mean_service_s > 0 or self.service_scv < 0:
            raise ValueError(f"invalid queue {self}")

    @property
    def utilization(self) -> float:
        return self.arrival_rate * self.mean_service_s / self.servers

    @property
    def stable(self) -> bool:
        return self.utilization < 1.0

    def _wait_chance_and_scale(self) -> tuple[float, float]:
        offered = self.arrival_rate * self.mean_service_s
        chance = erlang_c(self.servers, offered)
        spare = self.servers / self.mean_service_s - self.arrival_rate
        return chance, (1 + self.service_scv) / 2 / spare

    def mean_wait_s(self) -> float:
        if not self.stable:
            return math.inf
        chance, scale = self._wait_chance_and_scale()
        return chance * scale

    def wait_exceeds(self, t: float) -> float:
        """P(W > t)."""
        if not self.stable:
            return 1.0
        if t < 0:
            return 1.0
        chance, scale = self._wait_chance_and_scale()
        return chance * math.exp(-t / scale)

    def wait_quantile_s(self, q: float) -> float:
        """The q-quantile of the wait (q in (0, 1)); 0 when fewer than 1 − q of arrivals wait."""
        if not 0 < q < 1:
            raise ValueError(f"q must be in (0, 1), got {q}")
        if not self.stable:
            return math.inf
        chance, scale = self._wait_chance_and_scale()
        if chance <= 1 - q:
            return 0.0
        return scale * math.log(chance / (1 - q))
