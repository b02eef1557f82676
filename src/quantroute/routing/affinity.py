"""Prompt-prefix affinity: rendezvous (highest-random-weight) hashing over branch ids.

Requests that share a prompt prefix should land on the same branch, whose
prompt cache already holds it. Among near-tied candidates each id gets the
weight ``blake2b(id, key=blake2b(prefix))`` and the heaviest wins. The weights
depend only on the prefix and the id, so the pick does not change with the
order of the candidates, with the process (unlike ``hash()``), or when a
candidate that did not win comes or goes; different prefixes spread evenly.

>>> key = prefix_key("def main():")
>>> ids = ["m:a", "m:b", "m:c"]
>>> ids[pick(key, ids)] == ids[::-1][pick(key, ids[::-1])]
True
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

_PERSON = b"qr-affinity"


# Both hashes are pure, and a server sees the same prefixes and ids again and again (that
# is what affinity is for), so they are remembered: a blake2b costs about a microsecond, a
# lookup a tenth of that. Bounded: cleared when full.
_CACHE_MAX = 4096
_keys: dict[str, bytes] = {}
_weights: dict[tuple[bytes, str], int] = {}


def prefix_key(prefix: str) -> bytes:
    """A 32-byte key for ``prefix`` (any text; lone surrogates from JSON included)."""
    key = _keys.get(prefix)
    if key is None:
        data = prefix.encode("utf-8", "surrogatepass")
        key = blake2b(data, digest_size=32, person=_PERSON).digest()
        if len(_keys) >= _CACHE_MAX:
            _keys.clear()
        _keys[prefix] = key
    return key


def weight(key: bytes, branch_id: str) -> int:
    """The rendezvous weight of ``branch_id`` for ``key``: 64 bits, stable everywhere."""
    got = _weights.get((key, branch_id))
    if got is None:
        data = branch_id.encode("utf-8", "surrogatepass")
        got = int.from_bytes(blake2b(data, digest_size=8, key=key).digest(), "big")
        if len(_weights) >= _CACHE_MAX:
            _weights.clear()
        _weights[key, branch_id] = got
    return got


def pick(key: bytes, branch_ids: Sequence[str]) -> int:
    """Index of the winner among ``branch_ids`` (ties, which need equal ids, go to the first)."""
    best = 0
    best_weight = -1
    weights = _weights
    for n, branch_id in enumerate(branch_ids):
        w = weights.get((key, branch_id))
        if w is None:
            w = weight(key, branch_id)
        if w > best_weight:
            best, best_weight = n, w
    return best
