"""One step's model inputs, sent from rank 0 (which schedules) to the follower ranks.

A plan is int64 tensors, never pickle: a fixed header, then the lists the model runner builds
from the scheduler's output, back to back. Two broadcasts per step (header, then payload):

    header   [op, num_copies, num_tokens, num_seqs, table_width, num_logits]
    payload  copies (src, dst)* | input_ids | positions | slot_mapping | query_lens | seq_lens
             | table_lens | block_tables (num_seqs x table_width, 0-padded) | logits_indices

Followers run the same forward (the all-reduces inside it pair up with rank 0's) and the LM
head's gather when rank 0 samples; only rank 0 samples. The same channel carries the KV
transfers' block reads and writes (`KVBlocksOp`: header [op, num_blocks, 0…], payload the block
ids), so that they are ordered with the steps (engine/parallel/kv_shards.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from splitserve.engine.parallel.group import ParallelGroup

_HEADER = 6
_OP_STOP = 0
_OP_STEP = 1
_OP_KV_READ = 2
_OP_KV_WRITE = 3


@dataclass
class StepPlan:
    """What a rank needs to run one step's forward: the model runner's inputs."""

    block_copies: tuple[tuple[int, int], ...] = ()
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class KVBlocksOp:
    """Read (gather every rank's heads of) or write (scatter heads into) these pool blocks."""

    write: bool
    block_ids: tuple[int, ...]


class StepPlanSink(Protocol):
    """Where rank 0's model runner sends each step's plan."""

    def send(self, plan: StepPlan) -> None: ...


def encode(plan: StepPlan) -> tuple[list[int], list[int]]:
    """(header, payload) as int lists."""
    width = max((len(t) for t in plan.tables), default=0)
    header = [
        _OP_STEP,
        len(plan.block_copies),
        len(plan.input_ids),
        len(plan.query_lens),
        width,
        len(plan.logits_indices),
    ]
    payload: list[int] = [v for pair in plan.block_copies for v in pair]
    payload += plan.input_ids + plan.positions + plan.slots + plan.query_lens + plan.seq_lens
    payload += [len(t) for t in plan.tables]
    for t in plan.tables:
        payload += t + [0] * (width - len(t))
    payload += plan.logits_indices
    return header, payload


def decode(header: list[int], payload: list[int]) -> StepPlan:
    _, num_copies, num_tokens, num_seqs, width, num_logits = header
    pos = 0

    def take(n: int) -> list[int]:
        nonlocal pos
        part = payload[pos : pos + n]
        pos += n
        return part

    flat = take(2 * num_copies)
    copies = tuple((flat[i], flat[i + 1]) for i in range(0, len(flat), 2))
    input_ids, positions, slots = take(num_tokens), take(num_tokens), take(num_tokens)
    query_lens, seq_lens, table_lens = take(num_seqs), take(num_seqs), take(num_seqs)
    tables = [take(width)[:n] for n in table_lens]
    return StepPlan(
        copies, input_ids, positions, slots, query_lens, seq_lens, tables, take(num_logits)
    )


class StepPlanChannel:
    """Broadcasts plans from rank 0 over `group` (the same group the model's collectives use:
    plans and all-reduces are ordered on one stream)."""

    def __init__(self, group: ParallelGroup, device: torch.device) -> None:
        self.group = group
        self.device = device

    def send(self, plan: StepPlan) -> None:
        header, payload = encode(plan)
        self._send(header, payload)

    def send_kv(self, op: KVBlocksOp) -> None:
        code = _OP_KV_WRITE if op.write else _OP_KV_READ
        self._send([code, len(op.block_ids)] + [0] * (_HEADER - 2), list(op.block_ids))

    def send_stop(self) -> None:
        self._send([_OP_STOP] + [0] * (_HEADER - 1), [])

    def _send(self, header: list[int], payload: list[int]) -> None:
        self.group.broadcast(torch.tensor(header, dtype=torch.int64, device=self.device))
        if payload:
            self.group.broadcast(torch.tensor(payload, dtype=torch.int64, device=self.device))

    def recv(self) -> StepPlan | KVBlocksOp | None:
        """The next plan or KV op, or None when rank 0 stops the group."""
        buf = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        # NOTE: an idle engine sends nothing for as long as it idles.
        header = self.group.broadcast(buf, wait_forever=True).tolist()
        if header[0] == _OP_STOP:
            return None
        if header[0] in (_OP_KV_READ, _OP_KV_WRITE):
            ids = torch.empty(header[1], dtype=torch.int64, device=self.device)
            block_ids = tuple(self.group.broadcast(ids).tolist())
            return KVBlocksOp(header[0] == _OP_KV_WRITE, block_ids)
        _, num_copies, num_tokens, num_seqs, width, num_logits = header
        size = 2 * num_copies + 3 * num_tokens + 3 * num_seqs + num_seqs * width + num_logits
        payload: list[int] = []
        if size:
            buf = torch.empty(size, dtype=torch.int64, device=self.device)
            payload = self.group.broadcast(buf).tolist()
        return decode(header, payload)
