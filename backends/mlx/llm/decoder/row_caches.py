"""The prompt cache: what each row's KV cache still holds after its request ends, and which free row a
new prompt should take.

A decoder program's KV cache is one mutable buffer per layer with a slot per row (kv_cache.py). A
request writes its tokens at positions 0.. of its row, and nothing clears them when it ends; a query at
position q sees only positions <= q, every one of which a request has written itself or shares with
the tokens already there. So a new prompt that starts with tokens a row already holds (the longest
common prefix) can start at that position and prefill only the rest: the same positions end up
holding the same tokens, and step 0 (seed, penalty reset) is still the call that prefills.

Rules that keep a reused prefix exact:
- At least the prompt's last token is fed again: its logits give the first sampled token.
- A sliding-window layer whose cache is a ring (kv_cache.py, `ring_cache` in the metadata) keeps only
  the latest position of each slot, and a call assumes its ring holds the positions just before its
  start. A ring row is reused only where positions continue: the prompt extends everything the row
  holds. Programs that do not say (exported before the field) are treated as ring programs.
- A row with no request still takes part in every call (the program decodes all rows). Its throwaway
  token goes at the first position past what it holds, which nothing cached depends on: a full cache
  never reads past the prefix it reuses, and a ring row reused there is overwritten at that position
  before any query could see it (its window excludes the stale slot). Padding of a wider call lands
  past that too; when the call would run past max_seq_len, the held tokens are cut short (a ring row
  is dropped: it cannot be cut).
- Anything that loses the program's state (a failed call, a restarted worker) forgets every row.

Choosing a row: the free row with the longest reusable prefix; among rows with nothing to reuse, the
least recently used (LRU eviction).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class RowCache:
    tokens: list[int] = field(default_factory=list)  # the token at cache positions 0 .. len - 1
    used: int = 0  # when a request last took the row (a clock, for LRU)


class RowCaches:
    def __init__(self, batch: int, max_seq_len: int, ring: bool, enabled: bool = True):
        self.rows = [RowCache() for _ in range(batch)]
        self.max_seq_len, self.ring, self.enabled = max_seq_len, ring, enabled
        self._clock = 0

    def reusable(self, slot: int, prompt: list[int]) -> int:
        """Prompt tokens row `slot` already holds at their positions (0 when caching is off)."""
        if not self.enabled:
            return 0
        held = self.rows[slot].tokens
        n = min(common_prefix(held, prompt), len(prompt) - 1)
        if self.ring and n != len(held):
            return 0
        return n

    def choose(self, prompt: list[int], free: list[int]) -> tuple[int, int]:
        """(slot, reusable tokens) among the `free` slots: the longest reuse, then the least recently used."""
        return max(((slot, self.reusable(slot, prompt)) for slot in free),
                   key=lambda pair: (pair[1], -self.rows[pair[0]].used))

    def taken(self, slot: int) -> None:
        self._clock += 1
        self.rows[slot].used = self._clock

    def wrote(self, slot: int, pos: int, tokens: list[int]) -> None:
        """A call wrote `tokens` at positions pos.. of row `slot` (everything after them is stale)."""
        if self.enabled:
            row = self.rows[slot]
            row.tokens = row.tokens[:pos] + list(tokens)

    def idle_position(self, slot: int, width: int) -> int:
        """Where row `slot`, with no request, writes its throwaway token in a call `width` tokens wide."""
        if not self.enabled:
            return 0
        row = self.rows[slot]
        if len(row.tokens) + width > self.max_seq_len:
            row.tokens = [] if self.ring else row.tokens[:self.max_seq_len - width]
        return len(row.tokens)

    def held(self, slot: int) -> list[int]:
        return list(self.rows[slot].tokens)

    def forget(self) -> None:
        for row in self.rows:
            row.tokens = []
