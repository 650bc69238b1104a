"""A prompt's chained block hashes, computed only as far as a lookup needs them.

The router walks the prefix index block by block and stops where no worker can still use the
prompt (`prefix_view.PrefixView.match`): a miss needs the first block's hash only, a hit the
hashes of its own length (and the rest of its segment's). A prompt that starts as a recently
routed one takes those hashes from a memo (`ChainMemo`) instead. Digests are exactly
`prefix_block_hashes`' (the engine keys its prefix cache by them): the same blake2b over parent
and packed tokens.
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections import OrderedDict
from collections.abc import Sequence

# NOTE: blocks hashed at once when the walk needs more: 1, then doubling up to a segment, so a
# miss hashes one block and a long hit pays one extension per segment; and the memo's unit.
SEGMENT = 64


def pack(token_ids: Sequence[int]) -> bytes:
    """Token ids as 4-byte little-endian words, as `prefix_hash._pack` (twice as fast)."""
    words = array.array("I", token_ids)
    if sys.byteorder != "little":  # pragma: no cover
        words.byteswap()
    return words.tobytes()


assert array.array("I").itemsize == 4, "array's 'I' must be 4 bytes here"


class ChainMemo:
    """Recently routed prompts' hashes, by segment of `SEGMENT` blocks, so that a prompt that
    starts as a recent one did (a multi-turn conversation, a shared document) reuses them.

    A segment is keyed by the hash before it and its first block's tokens, and holds its packed
    tokens and hashes: a prompt reuses a segment's leading blocks whose tokens are the same
    (compared, not assumed), so the digests are the ones it would compute. Least recently used
    first out, at most `segments` kept (about 8 KB each at 16-token blocks). Not thread-safe:
    used under the prefix view's lock."""

    def __init__(self, segments: int = 2048) -> None:
        if segments < 1:
            raise ValueError(f"segments must be >= 1, got {segments!r}")
        self._cap = segments
        self._segments: OrderedDict[bytes, tuple[bytes, list[bytes]]] = OrderedDict()
        self.reused = 0  # blocks taken from here rather than hashed
        self.hashed = 0  # blocks hashed by chains using it

    def __len__(self) -> int:
        return len(self._segments)

    def get(self, key: bytes) -> tuple[bytes, list[bytes]] | None:
        found = self._segments.get(key)
        if found is not None:
            self._segments.move_to_end(key)
        return found

    def put(self, key: bytes, packed: bytes, hashes: list[bytes]) -> None:
        self._segments[key] = (packed, hashes)
        self._segments.move_to_end(key)
        while len(self._segments) > self._cap:
            self._segments.popitem(last=False)


class PromptChain:
    """The chained hashes of one prompt's full blocks (`prefix_block_hashes`), on demand:
    `hashes` holds those computed so far; `extend` computes more (from `memo` where it can)."""

    def __init__(
        self,
        token_ids: Sequence[int],
        block_size: int,
        root: bytes | None = None,
        memo: ChainMemo | None = None,
    ) -> None:
        self.num_blocks = max(0, (len(token_ids) - 1) // block_size)
        self.hashes: list[bytes] = []
        self._tokens = token_ids
        self._block_size = block_size
        self._root = root or b""
        self._parent = self._root
        self._step = 1
        self._memo = memo

    def extend(self) -> None:
        """The next blocks' hashes: a memo's segment's, or hashed (1, 2, 4, ... up to
        `SEGMENT` at once, never past the segment's end or `num_blocks`)."""
        start = len(self.hashes)
        seg_end = min(self.num_blocks, (start // SEGMENT + 1) * SEGMENT)
        if self._memo is not None and start % SEGMENT == 0 and self._reuse(start, seg_end):
            return
        stop = min(seg_end, start + self._step)
        self._step = min(SEGMENT, 2 * self._step)
        bs = self._block_size
        self._hash(pack(self._tokens[start * bs : stop * bs]))
        if self._memo is not None and stop == seg_end:
            self._remember(seg_end)

    def all(self) -> list[bytes]:
        """Every hash (what `prefix_block_hashes` returns)."""
        while len(self.hashes) < self.num_blocks:
            self.extend()
        return self.hashes

    def _hash(self, packed: bytes) -> None:
        width = 4 * self._block_size
        parent = self._parent
        blake2b = hashlib.blake2b
        append = self.hashes.append
        for offset in range(0, len(packed), width):
            parent = blake2b(parent + packed[offset : offset + width], digest_size=16).digest()
            append(parent)
        self._parent = parent
        if self._memo is not None:
            self._memo.hashed += len(packed) // width

    def _reuse(self, start: int, seg_end: int) -> bool:
        """Take the segment at `start` from the memo, as far as its tokens are ours (the rest
        of it hashed); False if the memo has none."""
        assert self._memo is not None
        bs = self._block_size
        width = 4 * bs
        packed = pack(self._tokens[start * bs : seg_end * bs])
        found = self._memo.get(_key(bs, self._parent, packed[:width]))
        if found is None:
            return False
        same = _same_blocks(found[0], packed, width)
        self.hashes.extend(found[1][:same])
        self._parent = self.hashes[-1]
        self._memo.reused += same
        if start + same < seg_end:
            self._hash(packed[same * width :])
            self._remember(seg_end)
        return True

    def _remember(self, seg_end: int) -> None:
        """Keep the segment that ends at `seg_end` (all of it hashed here) in the memo."""
        assert self._memo is not None
        seg_start = (seg_end - 1) // SEGMENT * SEGMENT
        bs = self._block_size
        packed = pack(self._tokens[seg_start * bs : seg_end * bs])
        parent = self.hashes[seg_start - 1] if seg_start else self._root
        self._memo.put(_key(bs, parent, packed[: 4 * bs]), packed, self.hashes[seg_start:seg_end])


def _key(block_size: int, parent: bytes, first_block: bytes) -> bytes:
    """A segment's key in the memo: the block size, the hash before it, its first block."""
    return struct.pack("<IB", block_size, len(parent)) + parent + first_block


def _same_blocks(a: bytes, b: bytes, width: int) -> int:
    """How many leading `width`-byte blocks `a` and `b` have alike."""
    n = min(len(a), len(b)) // width
    if a[: n * width] == b[: n * width]:
        return n
    lo, hi = 0, n  # NOTE: blocks [0, lo) alike, block hi - 1 not: halve (memcmp on each)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * width] == b[: mid * width]:
            lo = mid
        else:
            hi = mid
    return lo
