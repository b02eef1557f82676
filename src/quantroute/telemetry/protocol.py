"""The seam between quantroute and whatever tells it about device memory."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from quantroute.telemetry.stats import DeviceStats
from quantroute.telemetry.topology import Topology


@runtime_checkable
class DeviceProvider(Protocol):
    """Reads the devices quantroute may place branches on.

    Contract:

    - :meth:`read` returns one :class:`DeviceStats` per device, in a stable
      order with stable ids, every call a fresh reading. It blocks (NVML calls,
      a subprocess, file reads): async callers run it in a thread, as
      :class:`~quantroute.telemetry.poller.DevicePoller` does. It raises
      :class:`~quantroute.telemetry.stats.DeviceError` when it cannot read at
      all (driver gone, tool failed); a device that is readable but broken is
      reported with ``healthy=False`` instead.
    - :meth:`topology` returns the pairwise links between the devices of
      :meth:`read`; it may be expensive and is called rarely.
    - :attr:`name` names the provider for logs and ``GET /v1/devices``
      (``"nvml"``, ``"nvidia-smi"``, ``"cpu"``, ``"sim"``).
    - :meth:`close` releases what the provider holds (NVML handle); calling
      :meth:`read` afterwards is an error; calling :meth:`close` twice is not.
    - A provider may be called from one thread at a time; the simulated one is
      also safe to mutate from other threads while it is read.
    """

    @property
    def name(self) -> str: ...

    def read(self) -> list[DeviceStats]: ...

    def topology(self) -> Topology: ...

    def close(self) -> None: ...
