"""The prompt cache's bookkeeping (pure): which slot a new sequence takes, and what it reuses."""

from __future__ import annotations

import pytest

from quantroute.engines.llamacpp.prompt_cache import PromptCache, Take, common_prefix


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [
        ([], [], 0),
        ([1], [], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2, 4], 2),
        ([1, 2, 3], [1, 2, 3, 4], 3),
        ([5, 2, 3], [1, 2, 3], 0),
        (list(range(1000)), [*range(999), -1], 999),
        (list(range(1000)), [*range(7), -1, *range(8, 1000)], 7),
    ],
)
def test_common_prefix(a: list[int], b: list[int], n: int) -> None:
    assert common_prefix(a, b) == n == common_prefix(b, a)


def _cache(held: dict[int, list[int]], n_slots: int = 3) -> PromptCache:
    """A cache whose slots were freed in the order of ``held`` (the first the oldest)."""
    cache = PromptCache(n_slots)
    taken = [cache.take([0]).slot for _ in range(n_slots)]
    assert sorted(taken) == list(range(n_slots))
    for slot in [*held, *(s for s in range(n_slots) if s not in held)]:
        cache.put(slot, held.get(slot, []))
    return cache


@pytest.mark.parametrize(
    ("held", "prompt", "take", "why"),
    [
        ({}, [1, 2, 3], Take(0, 0, 0), "all empty: the lowest slot, nothing reused"),
        ({2: [1, 2, 3, 4]}, [1, 2, 3, 4, 5], Take(2, 4, 4), "a conversation goes on"),
        ({2: [1, 2, 3]}, [1, 2, 3], Take(2, 2, 3), "the same prompt: its last token again"),
        ({1: [1, 2, 9], 2: [1, 2, 3, 9]}, [1, 2, 3, 4], Take(2, 3, 4), "the longest prefix"),
        (
            {1: [1, 2, 3, 4, 5, 6, 7, 8]},
            [1, 2, 9],
            Take(0, 0, 0),
            "a short shared head does not wipe out a long cache when a slot is empty",
        ),
        (
            {0: [7, 7, 7], 1: [1, 2, 3, 4, 5, 6, 7, 8], 2: [8, 8, 8]},
            [1, 2, 9],
            Take(0, 0, 3),
            "no good match, no empty slot: the least recently used one is evicted",
        ),
        (
            {1: [1, 2, 3, 4, 5, 6, 7, 8], 0: [7, 7, 7], 2: [8, 8, 8]},
            [1, 2, 9],
            Take(1, 2, 8),
            "the evicted (oldest) slot's shared head is still reused",
        ),
        ({0: [5], 1: [6], 2: [1, 2]}, [9], Take(0, 0, 1), "a one-token prompt reuses nothing"),
    ],
)
def test_which_slot_a_sequence_takes(
    held: dict[int, list[int]], prompt: list[int], take: Take, why: str
) -> None:
    assert _cache(held).take(prompt) == take, why


def test_scoring_and_a_disabled_cache_reuse_nothing() -> None:
    cache = _cache({1: [1, 2, 3, 4]})
    assert cache.take([1, 2, 3, 4, 5], reuse=False) == Take(0, 0, 0)  # empty first
    off = PromptCache(2, enabled=False)
    slot = off.take([1, 2, 3]).slot
    off.put(slot, [1, 2, 3])  # kept nothing: the cache is off
    assert off.held(slot) == [] and off.cached_tokens == 0
    assert off.take([1, 2, 3, 4]).reused == 0


def test_a_slot_is_taken_and_freed_once() -> None:
    cache = PromptCache(1)
    take = cache.take([1])
    assert len(cache) == 0
    with pytest.raises(LookupError):
        cache.take([1])
    cache.put(take.slot, [1])
    with pytest.raises(ValueError, match="free already"):
        cache.put(take.slot, [])
    assert cache.cached_tokens == 1
