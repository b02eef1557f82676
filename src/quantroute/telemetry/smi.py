"""NVIDIA GPUs through the ``nvidia-smi`` command, where NVML cannot be loaded in-process.

Three outputs are parsed, each by a pure function tested on recorded outputs:

- the CSV query (every read; cheap): memory, utilisation, temperature, power,
  SM clock, volatile uncorrected ECC errors;
- ``nvidia-smi -q -x`` XML (every ``detail_every`` reads; slow on big
  machines): processes and MIG instances, merged by GPU UUID;
- ``nvidia-smi topo -m`` (once): the GPU-to-GPU link matrix.

``[N/A]``, ``[Not Supported]`` and friends become ``None``. When nvidia-smi
prints a driver error instead of data ("NVIDIA-SMI has failed because it
couldn't communicate with the NVIDIA driver...") the read raises
:class:`DeviceError` with that message.
"""

from __future__ import annotations

import csv
import logging
import re
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from quantroute.telemetry.stats import DeviceError, DeviceKind, DeviceStats, GpuProcess, MigInstance
from quantroute.telemetry.topology import Link, LinkKind, Topology

logger = logging.getLogger(__name__)

QUERY_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "memory.free",
    "utilization.gpu",
    "temperature.gpu",
    "power.draw",
    "clocks.sm",
    "ecc.errors.uncorrected.volatile.total",
)
QUERY_ARGS = (f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits")
XML_ARGS = ("-q", "-x")
TOPO_ARGS = ("topo", "-m")

_MiB = 1 << 20
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FAILURE_MARKERS = (
    "NVIDIA-SMI has failed",
    "couldn't communicate with the NVIDIA driver",
    "No devices were found",
    "Failed to initialize NVML",
    "NVML library version mismatch",
)


@dataclass(frozen=True, slots=True)
class CommandResult:
    """What a finished command printed and returned."""

    returncode: int
    stdout: str
    stderr: str = ""


CommandRunner = Callable[[Sequence[str], float], CommandResult]
"""Runs ``argv`` with a timeout in seconds. Injectable so tests feed recorded outputs."""


def run_command(argv: Sequence[str], timeout_s: float) -> CommandResult:
    """The real runner: ``subprocess.run``, translating failures to :class:`DeviceError`."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except FileNotFoundError as exc:
        raise DeviceError(f"{argv[0]} not found on PATH") from exc
    except subprocess.TimeoutExpired as exc:
        raise DeviceError(f"{' '.join(argv)} did not answer within {timeout_s:g} s") from exc
    except OSError as exc:
        raise DeviceError(f"could not run {argv[0]}: {exc}") from exc
    return CommandResult(done.returncode, done.stdout, done.stderr)


def check_output(result: CommandResult, what: str) -> str:
    """``result.stdout`` if it holds data; :class:`DeviceError` carrying nvidia-smi's own
    message when it failed (it prints driver errors on stdout, exit status 9 or 6)."""
    text = result.stdout
    for marker in _FAILURE_MARKERS:
        for stream in (text, result.stderr):
            if marker in stream:
                line = next(ln for ln in stream.splitlines() if marker in ln).strip()
                raise DeviceError(f"nvidia-smi {what} failed (exit {result.returncode}): {line}")
    if result.returncode != 0:
        message = (result.stderr or text).strip().splitlines()
        first = message[0] if message else "no output"
        raise DeviceError(f"nvidia-smi {what} failed (exit {result.returncode}): {first}")
    return text


def _missing(value: str) -> bool:
    value = value.strip()
    return not value or value.startswith("[") or value.upper() in {"N/A", "NONE"}


def _number(value: str | None) -> float | None:
    """``"66.92 W"`` → 66.92; ``"[N/A]"``, ``"N/A"``, ``None`` → ``None``."""
    if value is None or _missing(value):
        return None
    match = _NUMBER.search(value)
    return float(match.group()) if match else None


def _int(value: str | None) -> int | None:
    number = _number(value)
    return None if number is None else round(number)


def _mib(value: str | None) -> int | None:
    number = _number(value)
    return None if number is None else round(number * _MiB)


def parse_query_csv(text: str) -> list[DeviceStats]:
    """Parse the output of ``nvidia-smi`` with :data:`QUERY_ARGS` (memory in MiB, no units).

    A row whose memory is unreadable yields an unhealthy device; lines that are
    not rows (``Unable to determine the device handle for GPU ...``) are logged
    and skipped. Raises :class:`DeviceError` when no row parses.
    """
    out: list[DeviceStats] = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if not row or not "".join(row).strip():
            continue
        if len(row) != len(QUERY_FIELDS) or _int(row[0]) is None:
            logger.warning("nvidia-smi: skipping line %r", ",".join(row)[:120])
            continue
        values = dict(zip(QUERY_FIELDS, (v.strip() for v in row), strict=True))
        index = int(values["index"])
        total, used, free = (
            _mib(values["memory.total"]),
            _mib(values["memory.used"]),
            _mib(values["memory.free"]),
        )
        healthy = total is not None and used is not None
        if free is None and total is not None and used is not None:
            free = max(0, total - used)
        util = _number(values["utilization.gpu"])
        out.append(
            DeviceStats(
                id=f"cuda:{index}",
                kind=DeviceKind.CUDA,
                name=values["name"],
                total_bytes=total or 0,
                used_bytes=used or 0,
                free_bytes=free or 0,
                utilization=None if util is None else min(1.0, util / 100.0),
                temperature_c=_number(values["temperature.gpu"]),
                power_w=_number(values["power.draw"]),
                sm_clock_mhz=_int(values["clocks.sm"]),
                ecc_errors=_int(values["ecc.errors.uncorrected.volatile.total"]),
                healthy=healthy,
                uuid=None if _missing(values["uuid"]) else values["uuid"],
                index=index,
                detail=None if healthy else f"memory unreadable: {values['memory.total']}",
            )
        )
    if not out:
        first = text.strip().splitlines()[0] if text.strip() else "empty output"
        raise DeviceError(f"nvidia-smi printed no GPU rows: {first[:200]}")
    return out


def _find(element: ET.Element, path: str) -> str | None:
    found = element.find(path)
    return found.text if found is not None and found.text is not None else None


def _ecc_uncorrected(gpu: ET.Element) -> int | None:
    """Volatile uncorrected ECC errors: ``*uncorrectable*`` counters (Ampere and later)
    or ``double_bit/total`` (earlier), ``None`` when ECC is off or unsupported."""
    volatile = gpu.find("ecc_errors/volatile")
    if volatile is None:
        return None
    counts = [_int(e.text) for e in volatile if "uncorrectable" in e.tag]
    counts.append(_int(_find(volatile, "double_bit/total")))
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


def _power(gpu: ET.Element) -> float | None:
    for path in (
        "gpu_power_readings/power_draw",  # driver 530+
        "gpu_power_readings/instant_power_draw",  # driver 550+, where power_draw is N/A
        "gpu_power_readings/average_power_draw",
        "power_readings/power_draw",  # before 530
    ):
        value = _number(_find(gpu, path))
        if value is not None:
            return value
    return None


def _processes(gpu: ET.Element) -> tuple[GpuProcess, ...]:
    out = []
    for proc in gpu.findall("processes/process_info"):
        pid = _int(_find(proc, "pid"))
        if pid is None:
            continue
        out.append(GpuProcess(pid, _mib(_find(proc, "used_memory")), _find(proc, "process_name")))
    return tuple(out)


def _mig(gpu: ET.Element) -> tuple[MigInstance, ...]:
    if (_find(gpu, "mig_mode/current_mig") or "").strip() != "Enabled":
        return ()
    out = []
    for i, dev in enumerate(gpu.findall("mig_devices/mig_device")):
        total = _mib(_find(dev, "fb_memory_usage/total")) or 0
        used = _mib(_find(dev, "fb_memory_usage/used")) or 0
        free = _mib(_find(dev, "fb_memory_usage/free"))
        index = _int(_find(dev, "index"))
        out.append(
            MigInstance(
                index=i if index is None else index,
                gpu_instance_id=_int(_find(dev, "gpu_instance_id")),
                compute_instance_id=_int(_find(dev, "compute_instance_id")),
                total_bytes=total,
                used_bytes=used,
                free_bytes=max(0, total - used) if free is None else free,
            )
        )
    return tuple(out)


def parse_query_xml(text: str) -> list[DeviceStats]:
    """Parse ``nvidia-smi -q -x``: the full record of every GPU, processes and MIG included.

    GPUs are indexed in document order, which is nvidia-smi's index order.
    Raises :class:`DeviceError` on output that is not an ``nvidia_smi_log``.
    """
    try:
        root = ET.fromstring(text.strip())
    except ET.ParseError as exc:
        first = text.strip().splitlines()[0] if text.strip() else "empty output"
        raise DeviceError(f"nvidia-smi -q -x printed no XML: {first[:200]}") from exc
    if root.tag != "nvidia_smi_log":
        raise DeviceError(f"nvidia-smi -q -x: unexpected root element <{root.tag}>")
    out = []
    for index, gpu in enumerate(root.findall("gpu")):
        total = _mib(_find(gpu, "fb_memory_usage/total"))
        used = _mib(_find(gpu, "fb_memory_usage/used"))
        free = _mib(_find(gpu, "fb_memory_usage/free"))
        healthy = total is not None and used is not None
        if free is None and total is not None and used is not None:
            free = max(0, total - used)
        util = _number(_find(gpu, "utilization/gpu_util"))
        uuid = _find(gpu, "uuid")
        out.append(
            DeviceStats(
                id=f"cuda:{index}",
                kind=DeviceKind.CUDA,
                name=(_find(gpu, "product_name") or "NVIDIA GPU").strip(),
                total_bytes=total or 0,
                used_bytes=used or 0,
                free_bytes=free or 0,
                utilization=None if util is None else min(1.0, util / 100.0),
                temperature_c=_number(_find(gpu, "temperature/gpu_temp")),
                power_w=_power(gpu),
                sm_clock_mhz=_int(_find(gpu, "clocks/sm_clock")),
                ecc_errors=_ecc_uncorrected(gpu),
                processes=_processes(gpu),
                mig=_mig(gpu),
                healthy=healthy,
                uuid=None if uuid is None or _missing(uuid) else uuid.strip(),
                index=index,
                detail=None if healthy else "memory unreadable",
            )
        )
    return out


_CELL = re.compile(r"^(?:X|NV(\d+)|PIX|PXB|PHB|NODE|SYS|SOC|CPU)$")
_KINDS = {
    "PIX": LinkKind.PIX,
    "PXB": LinkKind.PXB,
    "PHB": LinkKind.PHB,
    "NODE": LinkKind.NODE,
    "SYS": LinkKind.SYS,
    "SOC": LinkKind.SYS,  # drivers before 384 called SYS "SOC"
    "CPU": LinkKind.PHB,  # and PHB "CPU"
}


def parse_topo_matrix(text: str) -> Topology:
    """Parse ``nvidia-smi topo -m``: the GPUxGPU part of the matrix (NIC columns,
    affinity columns and the legend are ignored; ANSI bold codes are stripped)."""
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    # The header is the first line starting with GPU0; rows start with GPUn too,
    # but come after it and have "X" on the diagonal.
    header_at = next((i for i, ln in enumerate(lines) if ln.split()[:1] == ["GPU0"]), None)
    if header_at is None or lines[header_at].split()[1:2] == ["X"]:
        raise DeviceError("nvidia-smi topo -m: no GPU matrix header found")
    columns: list[str] = []
    for token in lines[header_at].split():
        if not re.fullmatch(r"GPU\d+", token):
            break
        columns.append(token)
    links: list[Link] = []
    for line in lines[header_at + 1 :]:
        tokens = line.split()
        if tokens[:1] == ["Legend:"]:
            break
        if not tokens or not re.fullmatch(r"GPU\d+", tokens[0]):
            continue  # blank, or a NIC row
        a = f"cuda:{tokens[0][3:]}"
        for column, cell in zip(columns, tokens[1 : 1 + len(columns)], strict=False):
            match = _CELL.match(cell)
            b = f"cuda:{column[3:]}"
            if match is None:
                logger.warning("nvidia-smi topo: unknown link %r between %s and %s", cell, a, b)
                links.append(Link(a, b, LinkKind.UNKNOWN))
            elif match.group(1) is not None:
                links.append(Link(a, b, LinkKind.NVLINK, int(match.group(1))))
            elif cell != "X":
                links.append(Link(a, b, _KINDS[cell]))
    return Topology.from_links(links)


class SmiProvider:
    """GPUs as ``cuda:N`` devices, read by running ``nvidia-smi``.

    ``runner`` is injectable (tests feed recorded outputs); ``detail_every``
    says how often (in reads) the slow XML query refreshes processes and MIG
    instances; 0 turns it off. Construction does not run anything.
    """

    def __init__(
        self,
        *,
        binary: str = "nvidia-smi",
        runner: CommandRunner | None = None,
        timeout_s: float = 10.0,
        detail_every: int = 5,
    ) -> None:
        self._binary = binary
        self._run: CommandRunner = runner or run_command
        self._timeout_s = timeout_s
        self._detail_every = detail_every
        self._reads = 0
        self._details: dict[str, DeviceStats] = {}

    @property
    def name(self) -> str:
        return "nvidia-smi"

    def _query(self, args: Sequence[str], what: str) -> str:
        return check_output(self._run([self._binary, *args], self._timeout_s), what)

    def _refresh_details(self) -> None:
        try:
            detailed = parse_query_xml(self._query(XML_ARGS, "-q -x"))
        except DeviceError as exc:
            logger.warning("nvidia-smi details unavailable: %s", exc)
            return
        self._details = {d.uuid: d for d in detailed if d.uuid}

    def read(self) -> list[DeviceStats]:
        devices = parse_query_csv(self._query(QUERY_ARGS, "--query-gpu"))
        if self._detail_every and self._reads % self._detail_every == 0:
            self._refresh_details()
        self._reads += 1
        out = []
        for device in devices:
            detail = self._details.get(device.uuid or "")
            if detail is not None:
                device = replace(device, processes=detail.processes, mig=detail.mig)
            out.append(device)
        return out

    def topology(self) -> Topology:
        try:
            return parse_topo_matrix(self._query(TOPO_ARGS, "topo -m"))
        except DeviceError as exc:
            logger.warning("GPU topology unknown: %s", exc)
            return Topology()

    def close(self) -> None:
        pass
