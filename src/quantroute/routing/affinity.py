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


def prefix_key(prefix: str) -> bytes:
    """A 32-byte key for ``prefix`` (any text; lone surrogates from JSON included)."""
    data = prefix.encode("utf-8", "surrogatepass")
    return blake2b(data, digest_size=32, person=_PERSON).digest()


def weight(key: bytes, branch_id: str) -> int:
    """The rendezvous weight of ``branch_id`` for ``key``: 64 bits, stable everywhere."""
    digest = blake2b(branch_id.encode("utf-8", "surrogatepass"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "big")


def pick(key: bytes, branch_ids: Sequence[str]) -> int:
    """Index of the winner among ``branch_ids`` (ties, which need equal ids, go to the first)."""
    best = 0
    best_weight = -1
    for n, branch_id in enumerate(branch_ids):
        w = weight(key, branch_id)
        if w > best_weight:
            best, best_weight = n, w
    return best
