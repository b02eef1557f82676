"""Device telemetry and the memory model.

Providers (:class:`NvmlProvider`, :class:`SmiProvider`, :class:`CpuProvider`,
:class:`SimDeviceProvider`) read devices behind one :class:`DeviceProvider`
protocol; :class:`DevicePoller` publishes immutable :class:`DeviceSnapshot`\\ s;
the memory model (:func:`estimate_footprint`, an ONNX Runtime branch's
:func:`estimate_onnx_footprint`, :func:`free_for_routing`),
:class:`HealthTracker` and :func:`place` turn readings into placement
decisions. See ``docs/telemetry.md`` and ``docs/memory-model.md``.
"""

from __future__ import annotations

from quantroute.telemetry.affinity import parse_cpulist, plan_cpu_affinity, read_numa_nodes
from quantroute.telemetry.cpu import CgroupMemory, CpuProvider, read_cgroup_memory
from quantroute.telemetry.health import HealthTracker
from quantroute.telemetry.memory import (
    WORKER_RUNTIME_BYTES,
    Footprint,
    ModelShape,
    estimate_footprint,
    free_for_routing,
    kv_cache_bytes,
    llamacpp_compute_bytes,
    measure_process_rss,
    process_gpu_bytes,
    read_model_shape,
    safety_margin_bytes,
    torch_fragmentation_bytes,
    used_delta,
)
from quantroute.telemetry.memory_onnx import (
    ONNX_WORKER_RUNTIME_BYTES,
    estimate_onnx_footprint,
    read_onnx_shape,
)
from quantroute.telemetry.nvml import NvmlProvider
from quantroute.telemetry.occupancy import Occupancy, Placement, PlacementRequest
from quantroute.telemetry.placement import MarginPolicy, place
from quantroute.telemetry.poller import DevicePoller, backoff_delay
from quantroute.telemetry.protocol import DeviceProvider
from quantroute.telemetry.report import format_table, snapshot_to_json
from quantroute.telemetry.selection import (
    CompositeProvider,
    health_from_settings,
    margin_from_settings,
    open_provider,
    poller_from_settings,
    provider_from_settings,
)
from quantroute.telemetry.settings import TelemetrySettings
from quantroute.telemetry.sim import SimDeviceProvider, SimSpec, parse_sim_spec
from quantroute.telemetry.smi import (
    CommandResult,
    SmiProvider,
    parse_query_csv,
    parse_query_xml,
    parse_topo_matrix,
)
from quantroute.telemetry.snapshot import DeviceSnapshot
from quantroute.telemetry.stats import (
    DeviceError,
    DeviceKind,
    DeviceStats,
    GpuProcess,
    InsufficientMemoryError,
    MigInstance,
)
from quantroute.telemetry.topology import Link, LinkKind, Topology
from quantroute.telemetry.units import format_bytes, parse_size

__all__ = [
    "ONNX_WORKER_RUNTIME_BYTES",
    "WORKER_RUNTIME_BYTES",
    "CgroupMemory",
    "CommandResult",
    "CompositeProvider",
    "CpuProvider",
    "DeviceError",
    "DeviceKind",
    "DevicePoller",
    "DeviceProvider",
    "DeviceSnapshot",
    "DeviceStats",
    "Footprint",
    "GpuProcess",
    "HealthTracker",
    "InsufficientMemoryError",
    "Link",
    "LinkKind",
    "MarginPolicy",
    "MigInstance",
    "ModelShape",
    "NvmlProvider",
    "Occupancy",
    "Placement",
    "PlacementRequest",
    "SimDeviceProvider",
    "SimSpec",
    "SmiProvider",
    "TelemetrySettings",
    "Topology",
    "backoff_delay",
    "estimate_footprint",
    "estimate_onnx_footprint",
    "format_bytes",
    "format_table",
    "free_for_routing",
    "health_from_settings",
    "kv_cache_bytes",
    "llamacpp_compute_bytes",
    "margin_from_settings",
    "measure_process_rss",
    "open_provider",
    "parse_cpulist",
    "parse_query_csv",
    "parse_query_xml",
    "parse_sim_spec",
    "parse_size",
    "parse_topo_matrix",
    "place",
    "plan_cpu_affinity",
    "poller_from_settings",
    "process_gpu_bytes",
    "provider_from_settings",
    "read_cgroup_memory",
    "read_model_shape",
    "read_numa_nodes",
    "read_onnx_shape",
    "safety_margin_bytes",
    "snapshot_to_json",
    "torch_fragmentation_bytes",
    "used_delta",
]
