"""Speculative steps over static buffers, replayed as CUDA graphs per batch bucket.

Two steps, each one replay:

    VerifySteps   the target over W = K + 1 query tokens per row (last token + drafts)
    DraftSteps    the draft's whole proposal: a 2-token forward (the tokens it has not seen:
                  one, or two when every draft of the last step was accepted), then K - 1
                  one-token forwards, each fed the previous argmax on the device; out [rows, K]

A row with fewer query tokens than the step's width is padded at the FRONT, so its real tokens
keep their causal place (row i's query j sits at context position seq_len - W + j):

    verify row, k = 2 of K = 4     [ pad | pad | last | d1 | d2 ]   slots [ -1 -1 s s s ]
    rows past the batch            [ pad ... ]                      slots -1, tiny seq_len

Padded tokens write no KV (slot -1) and their outputs are never read. Buckets and the capture
pattern are the plain decode graphs' (engine/cuda_graphs.py). With graphs off (a CPU) the same
function runs eagerly on the same buffers, so the CPU tests prove the layout the GPU replays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.cuda_graphs import BUCKETS
from splitserve.engine.model import CausalLM

_Fn = Callable[[int, list[AttentionMetadata]], torch.Tensor]


class _StaticSteps:
    """Static input buffers (host mirror -> device) and one captured function per bucket."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        max_model_len: int,
        int_rows: int,
        len_rows: int,
        width: int,
        slot_rows: tuple[int, ...],
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.width = width
        self.buckets = (*(b for b in BUCKETS if b < max_batch), max(1, max_batch))
        size = self.buckets[-1]
        self.device = kv_caches[0].device
        pin = self.device.type == "cuda"
        self._ints_host = torch.zeros(int_rows, size * width, dtype=torch.int64, pin_memory=pin)
        self._lens_host = torch.zeros(len_rows, size, dtype=torch.int32, pin_memory=pin)
        self._tables_host = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        # Warm-up and capture write no KV (slots -1) and see a few positions of some block.
        self._ints_host[list(slot_rows)] = -1
        self._lens_host[:] = width
        self.ints_np = self._ints_host.numpy()
        self.lens_np = self._lens_host.numpy()
        self.tables_np = self._tables_host.numpy()
        self.ints = self._ints_host.to(self.device)
        self.lens = self._lens_host.to(self.device)
        self.tables = self._tables_host.to(self.device)
        self._copied = torch.cuda.Event() if pin else None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def can_run(self, batch: int) -> bool:
        return 0 < batch <= self.buckets[-1]

    def bucket_for(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def meta(self, bucket: int, width: int, len_row: int, real: bool) -> AttentionMetadata:
        """Step metadata over the static buffers: `width` query tokens per row, seq lens from
        row `len_row`; host lengths real (an eager run) or the longest (a graph's capture: they
        only size launch grids there)."""
        seq_lens_cpu = (
            tuple(int(x) for x in self.lens_np[len_row, :bucket])
            if real
            else (self.max_model_len,) * bucket
        )
        return AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.int64),  # set by the caller
            cu_seqlens_q=self._cu(width)[: bucket + 1],
            seq_lens=self.lens[len_row, :bucket],
            block_tables=self.tables[:bucket],
            query_lens_cpu=(width,) * bucket,
            seq_lens_cpu=seq_lens_cpu,
            block_size=self.block_size,
        )

    def _cu(self, width: int) -> torch.Tensor:
        cache = self.__dict__.setdefault("_cu_cache", {})
        if width not in cache:
            size = self.buckets[-1]
            cache[width] = torch.arange(
                0, (size + 1) * width, width, dtype=torch.int32, device=self.device
            )
        return cache[width]

    def begin(self) -> None:
        """Before the host mirrors are rewritten: the last step's copies are done."""
        if self._copied is not None:
            self._copied.synchronize()

    def upload(self, bucket: int) -> None:
        """The host mirrors to the device (asynchronously from pinned memory)."""
        self.ints.copy_(self._ints_host, non_blocking=True)
        self.lens.copy_(self._lens_host, non_blocking=True)
        self.tables[:bucket].copy_(self._tables_host[:bucket], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    @torch.inference_mode()
    def capture(self, fn: _Fn, metas: Callable[[int], list[AttentionMetadata]]) -> None:
        """A CUDA graph of `fn` for every bucket (largest first, sharing one memory pool)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            meta = metas(bucket)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn(bucket, meta)  # warm-up: kernels compile, libraries make their handles
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = fn(bucket, meta)
            self._graphs[bucket] = (graph, out)
        torch.cuda.synchronize()

    def replay(
        self, bucket: int, fn: _Fn, metas: Callable[[int], list[AttentionMetadata]]
    ) -> torch.Tensor:
        """`fn`'s output for `bucket`: the graph's replay, or (none captured) `fn` itself."""
        captured = self._graphs.get(bucket)
        if captured is None:
            return fn(bucket, metas(bucket))
        captured[0].replay()
        return captured[1]

    def put_table(self, row: int, table: Sequence[int]) -> None:
        # NOTE: entries past a table's length keep older values (valid block ids): only padded
        # queries, whose outputs are never read, may look past a sequence's own blocks.
        self.tables_np[row, : len(table)] = table


class VerifySteps(_StaticSteps):
    """The target's verification forward: W = K + 1 query tokens per row, logits of all."""

    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], width: int, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(
            model, kv_caches, int_rows=3, len_rows=1, width=width, slot_rows=(2,), **kw
        )

    def _metas(self, bucket: int, real: bool) -> list[AttentionMetadata]:
        meta = self.meta(bucket, self.width, 0, real)
        n = bucket * self.width
        return [_with_slots(meta, self.ints[2, :n])]

    def _fn(self, bucket: int, metas: list[AttentionMetadata]) -> torch.Tensor:
        n = bucket * self.width
        hidden = self.model(self.ints[0, :n], self.ints[1, :n], self.kv_caches, metas[0])
        return self.model.compute_logits(hidden)

    def capture(self) -> None:  # type: ignore[override]
        super().capture(self._fn, lambda b: self._metas(b, real=False))

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
    ) -> tuple[torch.Tensor, list[int]]:
        """Logits [bucket * W, vocab] and, in the flattened order of the inputs, the row of
        each input token in them (each row's query padded at the front to W tokens)."""
        w = self.width
        batch = len(query_lens)
        bucket = self.bucket_for(batch)
        self.begin()
        q = np.asarray(query_lens, dtype=np.int64)
        ends = np.cumsum(q)
        # Token t of row i goes to column i * W + (W - q_i) + (t - first token of row i).
        shift = np.arange(batch, dtype=np.int64) * w + w - ends
        index = np.repeat(shift, q) + np.arange(int(ends[-1]), dtype=np.int64)
        used = bucket * w
        ids, pos, slot = self.ints_np[0], self.ints_np[1], self.ints_np[2]
        ids[:used], pos[:used], slot[:used] = 0, 0, -1
        ids[index], pos[index], slot[index] = input_ids, positions, slots
        self.lens_np[0, :batch] = seq_lens
        self.lens_np[0, batch:bucket] = w  # a padded row's W queries see W positions
        for i, table in enumerate(tables):
            self.put_table(i, table)
        self.upload(bucket)
        logits = self.replay(bucket, self._fn, lambda b: self._metas(b, real=True))
        return logits, index.tolist()


class DraftSteps(_StaticSteps):
    """A draft model's K proposals per row in one replay (see the module docstring)."""

    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], k: int, **kw) -> None:  # type: ignore[no-untyped-def]
        # ints rows: 0-2 the first forward's ids, positions, slots (2 per row); then the
        # positions and slots of each later one-token forward. lens rows: one per forward.
        slots = (2, *(2 + 2 * j for j in range(1, k)))
        super().__init__(
            model, kv_caches, int_rows=1 + 2 * k, len_rows=k, width=2, slot_rows=slots, **kw
        )
        self.k = k

    def _metas(self, bucket: int, real: bool) -> list[AttentionMetadata]:
        first = _with_slots(self.meta(bucket, 2, 0, real), self.ints[2, : 2 * bucket])
        later = [
            _with_slots(self.meta(bucket, 1, j, real), self.ints[2 + 2 * j, :bucket])
            for j in range(1, self.k)
        ]
        return [first, *later]

    def _fn(self, bucket: int, metas: list[AttentionMetadata]) -> torch.Tensor:
        model, ints = self.model, self.ints
        hidden = model(ints[0, : 2 * bucket], ints[1, : 2 * bucket], self.kv_caches, metas[0])
        hidden = hidden.view(bucket, 2, -1)[:, 1].contiguous()  # each row's last query
        token = model.ops.argmax(model.compute_logits(hidden))
        out = [token]
        for j in range(1, self.k):
            hidden = model(token, ints[1 + 2 * j, :bucket], self.kv_caches, metas[j])
            token = model.ops.argmax(model.compute_logits(hidden))
            out.append(token)
        return torch.stack(out, dim=1)

    def capture(self) -> None:  # type: ignore[override]
        super().capture(self._fn, lambda b: self._metas(b, real=False))

    def run(
        self,
        rows: list[tuple[list[int], int, list[int], int]],
    ) -> list[list[int]]:
        """Drafts for rows of (the 1 or 2 tokens the draft has not computed, the first one's
        position, block table, how many drafts the row wants); one read-back for all."""
        bs = self.block_size
        batch = len(rows)
        bucket = self.bucket_for(batch)
        self.begin()
        ints, lens, tables = self.ints_np, self.lens_np, self.tables_np
        for i, (_, _, table, _) in enumerate(rows):
            self.put_table(i, table)
        # First forward: each row's 1 or 2 tokens at the end of its 2 columns.
        n = np.fromiter((len(r[0]) for r in rows), np.int64, batch)
        start = np.fromiter((r[1] for r in rows), np.int64, batch)
        want = np.fromiter((r[3] for r in rows), np.int64, batch)
        assert ((n >= 1) & (n <= 2)).all() and ((want >= 1) & (want <= self.k)).all()
        ints[0, : 2 * bucket], ints[1, : 2 * bucket], ints[2, : 2 * bucket] = 0, 0, -1
        row = np.arange(batch, dtype=np.int64)
        for t in range(2):
            has = n > t  # row has a token t; its column is 2i + 2 - n + t
            r, col, p = row[has], (2 * row + 2 - n + t)[has], (start + t)[has]
            ints[0, col] = [rows[i][0][t] for i in r.tolist()]
            ints[1, col] = p
            ints[2, col] = tables[r, p // bs].astype(np.int64) * bs + p % bs
        end = start + n
        lens[0, :batch], lens[0, batch:bucket] = end, 2
        # Forward j takes draft j's token at position end - 1 + j; a row that wants no more
        # drafts (or a padded one) gets a padded token: no KV, one position of context.
        for j in range(1, self.k):
            p = end - 1 + j
            real = want > j
            slot = np.where(real, tables[row, np.where(real, p, 0) // bs] * bs + p % bs, -1)
            ints[1 + 2 * j, :batch] = np.where(real, p, 0)
            ints[2 + 2 * j, :batch] = slot
            lens[j, :batch] = np.where(real, p + 1, 1)
            ints[1 + 2 * j, batch:bucket], ints[2 + 2 * j, batch:bucket] = 0, -1
            lens[j, batch:bucket] = 1
        self.upload(bucket)
        out = self.replay(bucket, self._fn, lambda b: self._metas(b, real=True))
        drafts = out[:batch].tolist()  # the one read-back of the proposal
        return [d[:k] for d, (_, _, _, k) in zip(drafts, rows, strict=True)]


def _with_slots(meta: AttentionMetadata, slots: torch.Tensor) -> AttentionMetadata:
    import dataclasses

    return dataclasses.replace(meta, slot_mapping=slots)
