"""The measured curves of one model on one kind of device, and reading between their points.

Prefill: seconds to prefill one prompt (and sample its first token) against its length, the
engine otherwise idle. Decode: seconds per engine step against the running batch and the
tokens each sequence holds. One `Curves` per tensor-parallel degree measured.

Between points, lines; past the last point, the last segment's slope (a decode step grows about
linearly with the batch once the weights' read is shared; a prefill about linearly with the
prompt until attention dominates), below the first point, the first point's value.
`plan.extrapolations` says when a recommendation leaned on that.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT = "splitserve-profile/1"


@dataclass(frozen=True)
class PrefillPoint:
    prompt_len: int
    seconds: float


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    prompt_len: int  # the grid's context: what each sequence was prefilled with
    context_len: int  # the tokens each held on average while timed (prompt + generated)
    step_s: float


def linear(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), xs ascending; see the module's note on the ends."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    slope = max(0.0, (y1 - y0) / (x1 - x0)) if x > x1 else (y1 - y0) / (x1 - x0)
    return y0 + slope * (x - x0)


@dataclass(frozen=True)
class Curves:
    """One tensor-parallel degree's curves; a worker of this degree takes that many devices."""

    tensor_parallel_size: int
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    # One rank's weights on its device (0: not recorded): what a worker of this degree needs
    # before its KV pool, when workers must share GPUs (`report.placement`).
    weight_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError(
                f"TP {self.tensor_parallel_size}: need at least one prefill and one decode point"
            )
        bad = [p for p in self.prefill if not p.seconds > 0] + [
            d for d in self.decode if not d.step_s > 0
        ]
        if bad:
            raise ValueError(f"TP {self.tensor_parallel_size}: non-positive times in {bad}")

    def prefill_s(self, prompt_len: float) -> float:
        points = sorted(self.prefill, key=lambda p: p.prompt_len)
        return linear([p.prompt_len for p in points], [p.seconds for p in points], prompt_len)

    def decode_step_s(self, batch: float, context_len: float) -> float:
        """Step time at this batch (at least 1) and context: along the batch at each measured
        context (a row of the grid, at its mean measured context), then along the context."""
        rows = []
        for row in self.decode_rows().values():
            at = linear([d.batch for d in row], [d.step_s for d in row], max(1.0, batch))
            rows.append((sum(d.context_len for d in row) / len(row), at))
        rows.sort()
        return linear([c for c, _ in rows], [t for _, t in rows], context_len)

    def decode_rows(self) -> dict[int, list[DecodePoint]]:
        """The decode points by the grid's context, each row by batch."""
        return {
            n: sorted((d for d in self.decode if d.prompt_len == n), key=lambda d: d.batch)
            for n in sorted({d.prompt_len for d in self.decode})
        }

    def measured_range(self) -> dict[str, tuple[int, int]]:
        lens = [p.prompt_len for p in self.prefill]
        batches = [d.batch for d in self.decode]
        contexts = [d.context_len for d in self.decode]
        return {
            "prompt_len": (min(lens), max(lens)),
            "batch": (min(batches), max(batches)),
            "context_len": (min(contexts), max(contexts)),
        }


@dataclass(frozen=True)
class Profile:
    """What was measured, and on what: the JSON the planner (and `--from-curves`) reads."""

    model: str
    device: str  # "cpu" or "cuda"
    device_name: str
    dtype: str
    num_devices: int  # devices of this kind on the host that measured
    kv_bytes_per_token: int  # over every layer, K and V, the whole model (all TP ranks)
    max_model_len: int
    tensor_parallel_sizes_fit: tuple[int, ...]  # the degrees the model and host allow
    curves: tuple[Curves, ...]
    date: str = ""
    notes: tuple[str, ...] = field(default=())
    load_format: str = "safetensors"  # the engines' weights: the checkpoint's, or "dummy"
    device_memory_bytes: int = 0  # one device's memory (0: not recorded; the CPU)

    def degrees(self) -> tuple[int, ...]:
        return tuple(c.tensor_parallel_size for c in self.curves)

    def at(self, tensor_parallel_size: int) -> Curves:
        for c in self.curves:
            if c.tensor_parallel_size == tensor_parallel_size:
                return c
        raise KeyError(f"TP {tensor_parallel_size} was not measured")

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Profile:
        if raw.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file (format {raw.get('format')!r})")
        curves = tuple(
            Curves(
                c["tensor_parallel_size"],
                tuple(PrefillPoint(**p) for p in c["prefill"]),
                tuple(DecodePoint(**d) for d in c["decode"]),
                c.get("weight_bytes", 0),
            )
            for c in raw["curves"]
        )
        fields = {k: v for k, v in raw.items() if k not in ("format", "curves")}
        fields.update(
            tensor_parallel_sizes_fit=tuple(fields["tensor_parallel_sizes_fit"]),
            notes=tuple(fields.get("notes", ())),
        )
        allowed = set(cls.__dataclass_fields__)
        return cls(curves=curves, **{k: v for k, v in fields.items() if k in allowed})
