"""Prompt lookup (n-gram) proposals: no extra model.

The sequence's last n tokens (n from `ngram_max` down to `ngram_min`) are looked up in its
prompt and output so far; the tokens that followed their most recent earlier occurrence are the
drafts. It pays off where the output copies its input: edits, summaries with quotes, code.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from splitserve.engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from splitserve.engine.scheduler import ScheduledSequence
    from splitserve.engine.sequence import Sequence


def ngram_lookup(token_ids: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
    n-gram (ngram_min <= n <= ngram_max) of `token_ids`; [] when none occurs."""
    num = len(token_ids)
    if k <= 0 or num < 2:
        return []
    # NOTE: searched as bytes (4 per token, C speed); a hit must start on a token boundary.
    data = array("i", token_ids).tobytes()
    limit = (num - 1) * 4  # a hit must end before the last token: something must follow it
    for n in range(min(ngram_max, num - 1), ngram_min - 1, -1):
        pattern = data[(num - n) * 4 :]
        end = limit
        while True:
            pos = data.rfind(pattern, 0, end)
            if pos < 0:
                break
            if pos % 4 == 0:
                start = pos // 4 + n
                return token_ids[start : start + k]
            end = pos + len(pattern) - 1
    return []


class NgramProposer(Proposer):
    """Proposals are found while planning (they need only the tokens) and kept for the step."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._planned: dict[str, list[int]] = {}

    def plan(self, seq: Sequence, k: int) -> int:
        drafts = ngram_lookup(seq.token_ids, k, self.ngram_min, self.ngram_max)
        if drafts:
            self._planned[seq.seq_id] = drafts
        else:
            self._planned.pop(seq.seq_id, None)
        return len(drafts)

    def propose(
        self, items: list[ScheduledSequence], block_tables: dict[str, list[int]]
    ) -> dict[str, list[int]]:
        planned, self._planned = self._planned, {}
        return {it.seq.seq_id: planned[it.seq.seq_id][: it.num_spec_tokens] for it in items}
