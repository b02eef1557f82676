"""One immutable picture of every device, published by the poller and read without locks."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from quantroute.telemetry.stats import DeviceStats
from quantroute.telemetry.topology import Topology


@dataclass(frozen=True, slots=True)
class DeviceSnapshot:
    """Devices as read at ``taken_at`` (``time.monotonic()``), never edited after creation.

    ``stale_after_s`` is the poll interval * the configured number of missed
    intervals; a snapshot older than that is stale and routing should not
    trust its free-memory figures. ``taken_at=None`` is the empty snapshot a
    poller holds before its first reading: infinitely old, always stale.
    ``last_error`` says why the latest poll failed, when it did (the devices
    are then those of the last good poll).
    """

    taken_at: float | None
    devices: tuple[DeviceStats, ...] = ()
    topology: Topology = field(default_factory=Topology)
    stale_after_s: float = 3.0
    provider: str = ""
    last_error: str | None = None
    consecutive_failures: int = 0
    _by_id: dict[str, DeviceStats] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {d.id: d for d in self.devices})

    def age_s(self, now: float | None = None) -> float:
        """Seconds since the reading (``math.inf`` before the first one)."""
        if self.taken_at is None:
            return math.inf
        return (time.monotonic() if now is None else now) - self.taken_at

    def is_stale(self, now: float | None = None) -> bool:
        return self.age_s(now) > self.stale_after_s

    @property
    def stale(self) -> bool:
        """Older than ``stale_after_s`` right now."""
        return self.is_stale()

    def device(self, device_id: str) -> DeviceStats | None:
        """The reading of one device, ``None`` if the snapshot has no such device."""
        return self._by_id.get(device_id)

    @property
    def device_ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.devices)
