"""The bytes of events a stream store keeps, all its streams together, and what goes once
they pass ``streams.max_bytes`` (``resilience/resume.py``).

Each append adds its bytes to the one :class:`KeptBytes` its store's streams share and
compares the sum with the bound: an add and a compare per token. Past the bound,
:func:`shed` forgets down to 15/16 of it (so that shedding is rare): the oldest
finished streams whole, then the oldest events of live ones, first those every reader
following them has passed, then unread ones (their reader learns they are gone).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quantroute.resilience.resume import Stream

log = logging.getLogger(__name__)

UNBOUNDED = 1 << 62
_STEP = 64  # events trimmed at a time, between looks at the sum


class KeptBytes:
    """A sum of bytes kept and its ``limit``; ``shed`` is called once past the limit."""

    __slots__ = ("limit", "shed", "used")

    def __init__(self, limit: int = UNBOUNDED, shed: Callable[[], None] | None = None):
        self.limit = limit
        self.used = 0
        self.shed = shed or (lambda: None)


def shed(
    kept: KeptBytes,
    finished: Iterable[str],
    streams: Mapping[str, Stream],
    drop: Callable[[str], None],
) -> None:
    """Forget down to 15/16 of ``kept.limit``: the ``finished`` streams (oldest first,
    each forgotten with ``drop``), then the oldest events of ``streams`` (oldest first),
    read ones before unread ones. A live stream keeps its newest event."""
    target = kept.limit - kept.limit // 16
    for key in list(finished):
        if kept.used <= target:
            return
        drop(key)
    for unread in (False, True):
        for stream in list(streams.values()):
            if kept.used <= target:
                return
            n = stream.kept_events - 1 if unread else stream.read_by_all()
            freed = 0
            while n > 0 and kept.used > target:
                freed += stream.trim(min(n, _STEP))
                n -= _STEP
            if freed and unread:
                stream.wake()  # a reader behind what is kept learns it now
                log.warning(
                    "stream %s: %d bytes of unread events forgotten (streams.max_bytes)",
                    stream.key,
                    freed,
                )
