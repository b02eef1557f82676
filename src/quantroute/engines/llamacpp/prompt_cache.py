"""A worker's prompt cache: which tokens each free slot's KV cells still hold, and which
slot a new sequence takes (pure bookkeeping; the worker makes the llama.cpp calls).

A finished sequence leaves its cells in place: its slot goes back to the free list
holding ``prompt + output`` (what was fed). A new sequence then takes a free slot by
these rules, as llama-server's slot reuse does:

1. the slot whose held tokens share the longest prefix with its prompt, if that
   prefix keeps at least half of what the slot holds (a short shared head, a system
   prompt say, does not wipe out a long conversation another client may continue);
2. else the least recently used slot, empty slots first (eviction, LRU).

Either way the sequence reuses the prefix it shares with the slot it took: the worker
drops the cells past it (``llama_memory_seq_rm``) and prefills only the rest. At least
the prompt's last token is always fed again, so its logits are fresh.

The KV budget is the worker's: ``parallel`` slots of ``n_ctx`` cells each
(``kv_unified`` off). A cached sequence holds only its own free slot's cells, and a
free slot is free whatever it holds: caching never makes a live sequence wait.

>>> cache = PromptCache(2)
>>> cache.take([1, 2, 3])  # cold: nothing to reuse
Take(slot=0, reused=0, held=0)
>>> cache.put(0, [1, 2, 3, 9])  # finished: prompt and one fed output token
>>> cache.take([1, 2, 3, 9, 4])  # the next turn of the conversation
Take(slot=0, reused=4, held=4)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PromptCache", "Take", "common_prefix"]


@dataclass(frozen=True, slots=True)
class Take:
    """A slot given to a new sequence: its cells ``[0, reused)`` are the prompt's first
    ``reused`` tokens (kept); ``[reused, held)`` must be dropped."""

    slot: int
    reused: int
    held: int


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (list slices compare in
    C, so a binary search over them costs a few passes, not a Python loop per token)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # invariant: a[:lo] == b[:lo]; the answer is at most hi
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PromptCache:
    """The free slots of one worker and what their cells hold. ``enabled=False``: every
    slot is cleared when it is freed and nothing is reused."""

    def __init__(self, n_slots: int, *, enabled: bool = True):
        self.enabled = enabled
        self._held: dict[int, list[int]] = {slot: [] for slot in range(n_slots)}  # free only
        self._used: dict[int, int] = dict.fromkeys(range(n_slots), 0)  # when last freed
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        """Free slots."""
        return len(self._held)

    def held(self, slot: int) -> list[int]:
        """The tokens a free slot's cells hold (empty when cleared)."""
        return self._held[slot]

    @property
    def cached_tokens(self) -> int:
        return sum(len(tokens) for tokens in self._held.values())

    def take(self, prompt: Sequence[int], *, reuse: bool = True) -> Take:
        """Give a free slot to a sequence with ``prompt`` (there must be one). With
        ``reuse`` false (a scoring job) the slot is the least recently used one and all
        its cells are dropped."""
        if not self._held:
            raise LookupError("no free slot")
        reuse = reuse and self.enabled
        limit = len(prompt) - 1  # the last prompt token is always fed again
        best, best_common = -1, 0
        if reuse:
            for slot, tokens in self._held.items():
                common = min(common_prefix(tokens, prompt), limit)
                if common > best_common and 2 * common >= len(tokens):
                    best, best_common = slot, common
        if best < 0:  # LRU: empty slots first, then the one freed longest ago
            best = min(self._held, key=lambda s: (bool(self._held[s]), self._used[s], s))
            best_common = min(common_prefix(self._held[best], prompt), limit) if reuse else 0
        tokens = self._held.pop(best)
        return Take(best, max(best_common, 0), len(tokens))

    def put(self, slot: int, tokens: list[int]) -> None:
        """A slot is free again, its cells holding ``tokens`` (positions ``0..n-1``);
        ``[]`` when they were cleared. With the cache off, pass ``[]``."""
        if slot in self._held:
            raise ValueError(f"slot {slot} is free already")
        self._held[slot] = tokens if self.enabled else []
        self._used[slot] = next(self._clock)
