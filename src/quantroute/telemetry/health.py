"""Per-device health: recent failures, decaying with time, as a factor in (0, 1].

``h = exp(-λ · recent_failures)`` where each failure counts 1 (or its weight)
at the moment it happens and half as much every ``half_life_s`` after. A
device with no recent trouble has h ≈ 1; three fresh failures at λ = 0.5 give
h ≈ 0.22. Failures come from engine errors (:meth:`HealthTracker.record_failure`)
and from XID / ECC counters that rose between two polls
(:meth:`HealthTracker.observe`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable

from quantroute.telemetry.stats import DeviceStats

logger = logging.getLogger(__name__)


class HealthTracker:
    """Decaying failure counts per device. Thread-safe; the clock is injectable.

    >>> now = [0.0]
    >>> tracker = HealthTracker(lam=0.5, half_life_s=60.0, clock=lambda: now[0])
    >>> tracker.record_failure("cuda:0", "engine_crash")
    >>> round(tracker.factor("cuda:0"), 3)
    0.607
    >>> now[0] = 60.0
    >>> round(tracker.recent_failures("cuda:0"), 3)
    0.5
    """

    def __init__(
        self,
        *,
        lam: float = 0.5,
        half_life_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lam < 0:
            raise ValueError(f"lambda must be ≥ 0, got {lam}")
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self._lam = lam
        self._decay_per_s = math.log(2) / half_life_s
        self._clock = clock
        self._lock = threading.Lock()
        self._score: dict[str, tuple[float, float]] = {}  # device → (value, as of)
        self._counters: dict[str, tuple[int | None, int | None]] = {}  # device → (xid, ecc)
        self._last_kind: dict[str, str] = {}

    def _decayed(self, device_id: str, now: float) -> float:
        value, since = self._score.get(device_id, (0.0, now))
        return value * math.exp(-self._decay_per_s * max(0.0, now - since))

    def record_failure(self, device_id: str, kind: str, weight: float = 1.0) -> None:
        """Count a failure on ``device_id`` now; ``kind`` names it (``"crash"``, ``"xid"``)."""
        if weight <= 0:
            return
        with self._lock:
            now = self._clock()
            self._score[device_id] = (self._decayed(device_id, now) + weight, now)
            self._last_kind[device_id] = kind
        logger.info("device %s: failure %s (weight %g)", device_id, kind, weight)

    def recent_failures(self, device_id: str) -> float:
        """The decayed failure count of ``device_id`` now."""
        with self._lock:
            return self._decayed(device_id, self._clock())

    def factor(self, device_id: str) -> float:
        """``exp(-λ · recent_failures)``: 1 for a device without recent failures."""
        return math.exp(-self._lam * self.recent_failures(device_id))

    def factors(self, device_ids: Iterable[str]) -> dict[str, float]:
        """:meth:`factor` for several devices at once."""
        return {device_id: self.factor(device_id) for device_id in device_ids}

    def last_failure_kind(self, device_id: str) -> str | None:
        with self._lock:
            return self._last_kind.get(device_id)

    def observe(self, devices: Iterable[DeviceStats]) -> None:
        """Compare XID and ECC counters with the previous reading; each increase is a failure.

        The first reading of a device only sets the baseline (counters count
        since driver load, not since quantroute started). A device the
        provider itself reports unhealthy counts one failure per reading.
        """
        for device in devices:
            with self._lock:
                previous = self._counters.get(device.id)
                self._counters[device.id] = (device.xid_errors, device.ecc_errors)
            if not device.healthy:
                self.record_failure(device.id, "unhealthy")
            if previous is None:
                continue
            for kind, before, after in (
                ("xid", previous[0], device.xid_errors),
                ("ecc", previous[1], device.ecc_errors),
            ):
                if before is not None and after is not None and after > before:
                    self.record_failure(device.id, kind, weight=float(after - before))
