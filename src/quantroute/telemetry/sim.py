"""Simulated devices: first-class, for tests and demos on machines without GPUs.

A simulated device's used memory is what is attached to it (the engine
supervisor calls :meth:`SimDeviceProvider.attach` with each branch's
footprint when it loads, :meth:`~SimDeviceProvider.detach` when it stops) plus
injected pressure, set by :meth:`~SimDeviceProvider.set_pressure` or written by
an operator into a JSON pressure file::

    {"sim:0": "6GiB", "sim:1": 1073741824}

The file is re-read whenever its modification time changes. Both sources add
up. Every method is thread-safe.

A simulated device runs out of memory where a real one does, inside the worker:
:meth:`~SimDeviceProvider.set_out_of_memory` creates (or removes) the device's
flag file (:meth:`~SimDeviceProvider.oom_flag`, in ``/dev/shm`` where there is
one), and a worker told that path fails the KV allocation of each new sequence
while it exists, as ``llama_decode`` does when the cache has no room.

Spec strings: ``sim:2x24GiB`` (two 24 GiB devices), ``sim:1x8GiB,1x16GiB``,
with optional ``;``-separated links: ``sim:4x80GiB;nvlink=0-1,2-3;default=sys``
(NVLink between 0-1 and 2-3, every other pair SYS; the default default is PHB).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

from quantroute.telemetry.stats import DeviceError, DeviceKind, DeviceStats
from quantroute.telemetry.topology import Link, LinkKind, Topology
from quantroute.telemetry.units import parse_size

logger = logging.getLogger(__name__)

_GROUP = re.compile(r"^\s*(\d+)\s*x\s*(.+?)\s*$", re.IGNORECASE)
_PAIR = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


@dataclass(frozen=True, slots=True)
class SimSpec:
    """What ``sim:...`` declares: each device's total memory, and the links."""

    totals: tuple[int, ...]
    topology: Topology


def parse_sim_spec(spec: str) -> SimSpec:
    """Parse ``sim:2x24GiB``, ``sim:1x8GiB,1x16GiB``, ``sim:4x80GiB;nvlink=0-1,2-3``.

    >>> parse_sim_spec("sim:2x1GiB").totals
    (1073741824, 1073741824)
    """
    body = spec.removeprefix("sim:") if spec.startswith("sim:") else None
    if not body:
        raise ValueError(f"not a sim device spec: {spec!r} (want e.g. 'sim:2x24GiB')")
    sizes, *options = body.split(";")
    totals: list[int] = []
    for group in sizes.split(","):
        match = _GROUP.match(group)
        if match is None:
            raise ValueError(f"bad device group {group!r} in {spec!r} (want COUNTxSIZE)")
        count, size = int(match.group(1)), parse_size(match.group(2))
        if count < 1 or size < 1:
            raise ValueError(f"empty device group {group!r} in {spec!r}")
        totals.extend([size] * count)
    nvlink_pairs: set[tuple[int, int]] = set()
    default = LinkKind.PHB
    for option in options:
        key, _, value = option.partition("=")
        key = key.strip().lower()
        if key == "nvlink":
            for pair in value.split(","):
                m = _PAIR.match(pair)
                if m is None:
                    raise ValueError(f"bad nvlink pair {pair!r} in {spec!r} (want A-B)")
                a, b = sorted((int(m.group(1)), int(m.group(2))))
                if a == b or b >= len(totals):
                    raise ValueError(f"nvlink pair {pair!r} names no device pair in {spec!r}")
                nvlink_pairs.add((a, b))
        elif key == "default":
            try:
                default = LinkKind(value.strip().lower())
            except ValueError:
                raise ValueError(f"unknown link kind {value!r} in {spec!r}") from None
        else:
            raise ValueError(f"unknown sim option {key!r} in {spec!r}")
    links = [
        Link(f"sim:{a}", f"sim:{b}", LinkKind.NVLINK, 1)
        if (a, b) in nvlink_pairs
        else Link(f"sim:{a}", f"sim:{b}", default)
        for a, b in combinations(range(len(totals)), 2)
    ]
    return SimSpec(tuple(totals), Topology.from_links(links))


class SimDeviceProvider:
    """Simulated devices whose used memory follows real branch loads and injected pressure.

    >>> sim = SimDeviceProvider.from_spec("sim:2x1GiB")
    >>> sim.attach("sim:0", "tiny-llama:q4_k_m", 300 << 20)
    >>> [d.free_bytes >> 20 for d in sim.read()]
    [724, 1024]
    """

    def __init__(
        self,
        totals: Sequence[int],
        *,
        topology: Topology | None = None,
        pressure_file: Path | None = None,
    ) -> None:
        if not totals:
            raise ValueError("a simulated provider needs at least one device")
        self._totals = {f"sim:{i}": int(total) for i, total in enumerate(totals)}
        self._topology = topology if topology is not None else Topology()
        self._pressure_file = pressure_file
        self._lock = threading.Lock()
        self._attached: dict[str, dict[str, int]] = {d: {} for d in self._totals}
        self._pressure: dict[str, int] = dict.fromkeys(self._totals, 0)
        self._file_pressure: dict[str, int] = {}
        self._file_stamp: tuple[int, int] | None = None
        self._xid: dict[str, int] = dict.fromkeys(self._totals, 0)
        self._unhealthy: set[str] = set()
        self._failing_reads = 0
        self._closed = False
        self._oom_dir: Path | None = None
        self._out_of_memory: set[str] = set()

    @classmethod
    def from_spec(cls, spec: str, *, pressure_file: Path | None = None) -> SimDeviceProvider:
        parsed = parse_sim_spec(spec)
        return cls(parsed.totals, topology=parsed.topology, pressure_file=pressure_file)

    @property
    def name(self) -> str:
        return "sim"

    @property
    def device_ids(self) -> tuple[str, ...]:
        return tuple(self._totals)

    def _check(self, device_id: str) -> None:
        if device_id not in self._totals:
            raise KeyError(f"no simulated device {device_id!r}; have {sorted(self._totals)}")

    def attach(self, device_id: str, owner: str, nbytes: int) -> None:
        """``owner`` (a branch) holds ``nbytes`` on ``device_id`` now, replacing its last figure."""
        if nbytes < 0:
            raise ValueError(f"negative footprint for {owner}: {nbytes}")
        with self._lock:
            self._check(device_id)
            self._attached[device_id][owner] = int(nbytes)

    def detach(self, device_id: str, owner: str) -> None:
        """``owner`` released its memory on ``device_id``; unknown owners are ignored."""
        with self._lock:
            self._check(device_id)
            self._attached[device_id].pop(owner, None)

    def set_pressure(self, device_id: str, nbytes: int) -> None:
        """Memory held on ``device_id`` by something outside quantroute (another tenant)."""
        if nbytes < 0:
            raise ValueError(f"negative pressure: {nbytes}")
        with self._lock:
            self._check(device_id)
            self._pressure[device_id] = int(nbytes)

    def inject_xid(self, device_id: str, count: int = 1) -> None:
        """Raise the device's XID error counter, as a GPU fault would."""
        with self._lock:
            self._check(device_id)
            self._xid[device_id] += count

    def set_healthy(self, device_id: str, healthy: bool) -> None:
        """Mark a device lost (``False``) or back (``True``)."""
        with self._lock:
            self._check(device_id)
            if healthy:
                self._unhealthy.discard(device_id)
            else:
                self._unhealthy.add(device_id)

    def fail_reads(self, count: int) -> None:
        """Make the next ``count`` reads raise :class:`DeviceError`, as a wedged driver would."""
        with self._lock:
            self._failing_reads = count

    def attached(self, device_id: str) -> dict[str, int]:
        """Owner → bytes currently attached to ``device_id``."""
        with self._lock:
            self._check(device_id)
            return dict(self._attached[device_id])

    def oom_flag(self, device_id: str) -> Path:
        """The file that exists while ``device_id`` is out of memory (its directory is made
        on first use and removed by :meth:`close`)."""
        with self._lock:
            self._check(device_id)
            if self._oom_dir is None:
                shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
                self._oom_dir = Path(tempfile.mkdtemp(prefix="quantroute-sim-", dir=shm))
            return self._oom_dir / f"{device_id.replace(':', '_')}.oom"

    def set_out_of_memory(self, device_id: str, out: bool) -> None:
        """Make the allocations of workers on ``device_id`` fail (``True``) or succeed again."""
        flag = self.oom_flag(device_id)
        with self._lock:
            if out == (device_id in self._out_of_memory):
                return
            if out:
                flag.touch()
                self._out_of_memory.add(device_id)
            else:
                flag.unlink(missing_ok=True)
                self._out_of_memory.discard(device_id)
        log = logger.warning if out else logger.info
        log("%s: %s", device_id, "out of memory" if out else "within its budget again")

    def _refresh_pressure_file(self) -> None:
        path = self._pressure_file
        if path is None:
            return
        try:
            stat = path.stat()
        except FileNotFoundError:
            if self._file_stamp is not None:
                logger.info("pressure file %s removed; file pressure cleared", path)
            self._file_pressure, self._file_stamp = {}, None
            return
        # size too: a rewrite within the filesystem's mtime granularity still shows
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._file_stamp:
            return
        self._file_stamp = stamp
        try:
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict):
                raise ValueError("want a JSON object of device id to bytes")
            pressure = {str(k): parse_size(v) for k, v in raw.items()}
        except (OSError, ValueError) as exc:
            logger.warning("ignoring pressure file %s: %s", path, exc)
            return
        unknown = sorted(set(pressure) - set(self._totals))
        if unknown:
            logger.warning("pressure file %s names unknown devices %s", path, unknown)
        self._file_pressure = {k: v for k, v in pressure.items() if k in self._totals}

    def read(self) -> list[DeviceStats]:
        with self._lock:
            if self._closed:
                raise DeviceError("simulated provider is closed")
            if self._failing_reads > 0:
                self._failing_reads -= 1
                raise DeviceError("simulated read failure (fail_reads)")
            self._refresh_pressure_file()
            out = []
            for i, (device_id, total) in enumerate(self._totals.items()):
                used = (
                    sum(self._attached[device_id].values())
                    + self._pressure[device_id]
                    + self._file_pressure.get(device_id, 0)
                )
                out.append(
                    DeviceStats(
                        id=device_id,
                        kind=DeviceKind.SIM,
                        name=f"simulated {total / (1 << 30):g} GiB",
                        total_bytes=total,
                        used_bytes=used,
                        free_bytes=max(0, total - used),
                        utilization=None,
                        ecc_errors=0,
                        xid_errors=self._xid[device_id],
                        healthy=device_id not in self._unhealthy,
                        index=i,
                        detail="over-committed" if used > total else None,
                    )
                )
            return out

    def topology(self) -> Topology:
        return self._topology

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._oom_dir is not None:
                shutil.rmtree(self._oom_dir, ignore_errors=True)
