"""Where each branch lives and what it occupies there: placement, footprints, accounting.

:class:`Occupancy` owns one :class:`Placement` per branch. At start it places
every branch (:meth:`place_all`): the memory model estimates the footprint
from the model file's header, and :func:`~quantroute.telemetry.placement.place`
picks the device with the most headroom times health, reserving as it goes so
two branches never count the same free bytes. Then, as workers come and go:

- a branch that becomes ready is **measured** (:meth:`measure`): its worker's
  RSS on the CPU, or its per-process memory from NVML on a GPU, replaces the
  estimate (the estimate stays where the driver hides the process); an ONNX
  Runtime worker's KV cells and step buffers grow after that, so their estimate
  is added to its RSS (``Placement.grows_bytes``);
- on a simulated device the branch's bytes are attached while it is loaded
  and detached when it stops, so the device's used memory moves as a real
  one's would; while such a device is over its budget, its out-of-memory flag is set after each
  poll (:meth:`_on_snapshot`), so the workers on it fail their allocations themselves.

Devices a branch may use, in order: simulated devices when there are any
(tests and demos); else CUDA devices when the llama.cpp build can offload
(``gpu_offload``), fully offloaded (``n_gpu_layers == -1``) or, where no GPU
holds the whole branch, as many layers as fit on the roomiest one; else the
host ``cpu``. An ONNX Runtime branch (its file a ``.onnx`` graph:
``telemetry.memory_onnx``) is placed on the CPU only: its worker's CUDA
execution provider is not modelled (memory, layers) yet. A branch whose
manifest names a device (``device: cuda:1``) is placed there or not at all: a
device this server does not have, or one without room for it, fails the branch
with the reason in words, and it is never moved.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from quantroute.errors import ConfigError
from quantroute.telemetry.health import HealthTracker
from quantroute.telemetry.memory import (
    WORKER_RUNTIME_BYTES,
    Footprint,
    estimate_footprint,
    kv_cache_bytes,
    measure_process_rss,
    process_gpu_bytes,
    read_model_shape,
)
from quantroute.telemetry.memory_onnx import (
    ONNX_WORKER_RUNTIME_BYTES,
    estimate_onnx_footprint,
    is_onnx,
    onnx_growth_bytes,
    read_onnx_shape,
)
from quantroute.telemetry.placement import MarginPolicy, place
from quantroute.telemetry.poller import DevicePoller
from quantroute.telemetry.sim import SimDeviceProvider
from quantroute.telemetry.snapshot import DeviceSnapshot
from quantroute.telemetry.stats import DeviceKind, DeviceStats, InsufficientMemoryError
from quantroute.types import Offload

log = logging.getLogger(__name__)

__all__ = ["REMOTE_PREFIX", "Occupancy", "Placement", "PlacementRequest", "partial_offload"]

REMOTE_PREFIX = "remote:"  # a remote server's device id: ``remote:host:port``


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """A branch to place: its id and the local model file (``None``: costs nothing here).
    ``problem``: its file is known bad (the registry said why); it is not placed.
    ``device``: the device its manifest pins it to (``cpu``, ``cuda:N``, ``sim:N``), or
    the server of a remote branch (``remote:host:port``: placed there, costing nothing).
    ``draft_path``: the draft GGUF a reference's worker holds beside its model (speculative
    decoding): its weights and KV cells are the branch's too."""

    branch_id: str
    model_path: Path | None
    problem: str | None = None
    device: str | None = None
    draft_path: Path | None = None


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a branch runs. ``device`` is ``None`` when nothing had room (or its file could
    not be read: ``problem`` says why); the branch is then not started."""

    device: str | None
    footprint: Footprint
    kv_bytes_per_token: int = 0  # what one more token of context costs the device
    n_layer: int = 0
    n_gpu_layers: int = 0  # offloaded layers on a cuda device (-1: all)
    problem: str | None = None
    oom_flag: str = ""  # on a simulated device: its out-of-memory flag file
    grows_bytes: int = 0  # what its worker allocates after it is ready (ONNX: KV, steps)
    # a reference whose draft (PlacementRequest.draft_path) had no room beside it: why; its
    # worker is started without the draft (None: the draft is counted, or none was asked)
    draft_dropped: str | None = None

    @property
    def gpu(self) -> int | None:
        """The CUDA device index (NVML order) of a branch on ``cuda:N``."""
        if self.device is None or not self.device.startswith("cuda:"):
            return None
        return int(self.device.partition(":")[2])

    @property
    def offload(self) -> Offload:
        """What the engine is told: the GPU and its layers, or the CPU."""
        gpu = self.gpu
        layers = self.n_gpu_layers if gpu is not None else 0
        return Offload(gpu, layers, self.oom_flag, self.draft_dropped)


def partial_offload(footprint: Footprint, n_layer: int, layers: int) -> Footprint:
    """The GPU share of a branch with ``layers`` of ``n_layer`` offloaded: weights and KV
    cache by layer, the compute buffers and CUDA context whole."""
    share = min(max(layers, 0), n_layer) / n_layer if n_layer else 1.0
    return dataclasses.replace(
        footprint,
        weights_bytes=math.ceil(footprint.weights_bytes * share),
        kv_bytes=math.ceil(footprint.kv_bytes * share),
        measured_bytes=None,
    )


def layers_that_fit(footprint: Footprint, n_layer: int, room: int) -> int:
    """How many layers of a branch fit in ``room`` bytes of a GPU (0 to ``n_layer``)."""
    fixed = footprint.compute_bytes + footprint.overhead_bytes + footprint.runtime_bytes
    per_layer = (footprint.weights_bytes + footprint.kv_bytes) / max(n_layer, 1)
    if per_layer <= 0:
        return n_layer
    return max(0, min(n_layer, math.floor((room - fixed) / per_layer)))


class Occupancy:
    """The placements of all branches and the device accounting that goes with them."""

    def __init__(
        self,
        poller: DevicePoller,
        *,
        health: HealthTracker,
        margin: MarginPolicy,
        n_ctx: int,
        parallel: int,
        n_batch: int,
        n_gpu_layers: int = -1,
        gpu_offload: bool = False,
        sim: SimDeviceProvider | None = None,
        sim_weight_scale: float = 1.0,
    ):
        self._poller = poller
        self._health = health
        self._margin = margin
        self._n_ctx = n_ctx
        self._parallel = parallel
        self._n_batch = n_batch
        self._n_gpu_layers = n_gpu_layers
        self.gpu_offload = gpu_offload  # the llama.cpp build can offload (set once probed)
        self._sim = sim
        self._sim_weight_scale = sim_weight_scale
        self._placements: dict[str, Placement] = {}
        self.version = 0  # counts changes of any placement (routing rereads on one)
        if sim is not None:
            poller.listeners.append(self._on_snapshot)

    @property
    def placements(self) -> Mapping[str, Placement]:
        return self._placements

    def get(self, branch_id: str) -> Placement | None:
        return self._placements.get(branch_id)

    @property
    def sim(self) -> SimDeviceProvider | None:
        """The simulated devices, when there are any (tests, demos, admin pressure)."""
        return self._sim

    # -- placing --------------------------------------------------------------

    def estimate(self, path: Path | None, kind: DeviceKind) -> tuple[Footprint, int, int]:
        """``(footprint, KV bytes per token, layers)`` of a branch on a device of ``kind``.
        Raises :class:`ConfigError` when the model file can't be read."""
        if path is None:
            return Footprint(0, 0, 0, 0), 0, 0
        runtime = 0 if kind is DeviceKind.CUDA else WORKER_RUNTIME_BYTES
        if is_onnx(path):
            graph = read_onnx_shape(path)
            footprint = estimate_onnx_footprint(
                graph,
                self._n_ctx,
                n_parallel=self._parallel,
                n_batch=self._n_batch,
                runtime_bytes=ONNX_WORKER_RUNTIME_BYTES if runtime else 0,
            )
            return footprint, graph.kv_bytes_per_token, graph.n_layer
        shape = read_model_shape(path)
        n_ctx = self._n_ctx or shape.n_ctx_train
        footprint = estimate_footprint(
            shape,
            n_ctx,
            n_parallel=self._parallel,
            n_batch=self._n_batch,
            device=DeviceKind.CPU if kind is DeviceKind.SIM else kind,
            runtime_bytes=runtime,
        )
        return footprint, kv_cache_bytes(shape, 1), shape.n_layer

    def _with_draft(
        self, footprint: Footprint, kv_per_token: int, draft: Path, kind: DeviceKind
    ) -> tuple[Footprint, int]:
        """A reference's footprint with its draft's added: its weights, KV cells, compute
        buffers and, on a CPU, its context's fixed part (a second llama.cpp context
        reserves its own when it starts). The two models share one process, so its
        runtime, and on a GPU its CUDA context, count once."""
        extra, extra_kv, _ = self.estimate(draft, kind)
        shared_context = kind is DeviceKind.CUDA  # the overhead is the process's context
        added = dataclasses.replace(
            footprint,
            weights_bytes=footprint.weights_bytes + extra.weights_bytes,
            kv_bytes=footprint.kv_bytes + extra.kv_bytes,
            compute_bytes=footprint.compute_bytes + extra.compute_bytes,
            overhead_bytes=footprint.overhead_bytes
            + (0 if shared_context else extra.overhead_bytes),
        )
        return added, kv_per_token + extra_kv

    def device_bytes(self, footprint: Footprint) -> int:
        """What a branch occupies on its device: its footprint, with the weights scaled by
        ``sim_weight_scale`` on simulated devices."""
        if self._sim is None or self._sim_weight_scale == 1.0:
            return footprint.bytes
        return footprint.bytes + round(footprint.weights_bytes * (self._sim_weight_scale - 1.0))

    def place_all(self, branches: Sequence[PlacementRequest]) -> None:
        """Place every branch, in order, on the devices of the latest reading."""
        snapshot = self._poller.snapshot
        devices = list(snapshot.devices)
        for request in branches:
            placement = self._place_one(request, devices)
            placement = dataclasses.replace(placement, oom_flag=self._oom_flag(placement.device))
            self._placements[request.branch_id] = placement
            self.version += 1
            if placement.device is not None:
                need = self.device_bytes(placement.footprint)
                devices = [_reserve(d, need) if d.id == placement.device else d for d in devices]

    def _kinds(self, devices: Sequence[DeviceStats]) -> list[DeviceKind]:
        present = {d.kind for d in devices}
        if DeviceKind.SIM in present:
            return [DeviceKind.SIM]
        if self.gpu_offload and DeviceKind.CUDA in present and self._n_gpu_layers != 0:
            return [DeviceKind.CUDA, DeviceKind.CPU]
        return [DeviceKind.CPU]

    def _place_one(self, request: PlacementRequest, devices: Sequence[DeviceStats]) -> Placement:
        branch_id = request.branch_id
        if request.problem is not None:
            return Placement(None, Footprint(0, 0, 0, 0), problem=request.problem)
        if request.device is not None and request.device.startswith(REMOTE_PREFIX):
            return Placement(request.device, Footprint(0, 0, 0, 0))  # no local memory
        if not devices:  # no reading at all: the host, unaccounted
            return Placement("cpu", Footprint(0, 0, 0, 0))
        problem = "no device"
        onnx = request.model_path is not None and is_onnx(request.model_path)
        kinds = [k for k in self._kinds(devices) if not (onnx and k is DeviceKind.CUDA)]
        if request.device is not None:
            devices = [d for d in devices if d.id == request.device]
            pinned = self._pinned_kinds(request.device, devices, onnx=onnx)
            if isinstance(pinned, str):
                log.error("%s: not started: %s", branch_id, pinned)
                return Placement(None, Footprint(0, 0, 0, 0), problem=pinned)
            kinds = pinned
        topology = self._poller.snapshot.topology
        health = self._health.factors(d.id for d in devices)
        for kind in kinds:
            try:
                plain, plain_kv, n_layer = self.estimate(request.model_path, kind)
                # with its draft first, where it has one
                ways: list[tuple[Footprint, int, Path | None]] = [(plain, plain_kv, None)]
                if request.draft_path is not None:
                    drafted, drafted_kv = self._with_draft(
                        plain, plain_kv, request.draft_path, kind
                    )
                    ways.insert(0, (drafted, drafted_kv, request.draft_path))
            except ConfigError as exc:
                log.error("%s: not started: %s", branch_id, exc.message)
                return Placement(None, Footprint(0, 0, 0, 0), problem=exc.message)
            layers = self._n_gpu_layers if kind is DeviceKind.CUDA else 0
            for footprint, kv_per_token, draft in ways:
                if kind is DeviceKind.CUDA and layers > 0:  # a set number of layers
                    footprint = partial_offload(footprint, n_layer, layers)
                try:
                    device = place(
                        self.device_bytes(footprint),
                        devices,
                        topology,
                        health,
                        kinds={kind},
                        margin=self._margin,
                    )[0]
                except InsufficientMemoryError as exc:
                    problem = exc.message
                    continue
                dropped = None
                if request.draft_path is not None and draft is None:
                    dropped = _no_room_for(request.draft_path, device)
                    log.warning("%s: %s: it serves without speculation", branch_id, dropped)
                grows = onnx_growth_bytes(footprint) if onnx else 0
                return Placement(
                    device,
                    footprint,
                    kv_per_token,
                    n_layer,
                    layers,
                    grows_bytes=grows,
                    draft_dropped=dropped,
                )
            if kind is DeviceKind.CUDA and self._n_gpu_layers == -1:
                partial = self._partial(plain, plain_kv, n_layer, devices, health)
                if partial is not None:
                    if request.draft_path is not None:  # its layers hold what room there is
                        why = _no_room_for(request.draft_path, partial.device)
                        partial = dataclasses.replace(partial, draft_dropped=why)
                    return partial
        if request.device is not None:
            problem = f"its manifest's device {request.device}: {problem}"
        log.error("%s: not started: %s", branch_id, problem)
        return Placement(None, Footprint(0, 0, 0, 0), problem=problem)

    def _pinned_kinds(
        self, device_id: str, devices: Sequence[DeviceStats], *, onnx: bool = False
    ) -> list[DeviceKind] | str:
        """The kind a branch pinned to ``device_id`` is placed as, or why it cannot be."""
        if not devices:
            known = ", ".join(sorted(d.id for d in self._poller.snapshot.devices))
            return f"its manifest's device {device_id} is not one of this server's ({known})"
        kind = devices[0].kind
        if kind is DeviceKind.CUDA and onnx:
            return (
                f"its manifest's device {device_id} is a GPU, and an ONNX Runtime branch "
                "runs on the CPU here (its CUDA execution provider is not placed yet)"
            )
        if kind is DeviceKind.CUDA and not (self.gpu_offload and self._n_gpu_layers != 0):
            return (
                f"its manifest's device {device_id} is a GPU, and this server offloads no "
                "layers to one (a CPU-only llama.cpp build, or engine.n_gpu_layers 0)"
            )
        return [kind]

    def _partial(
        self,
        footprint: Footprint,
        kv_per_token: int,
        n_layer: int,
        devices: Sequence[DeviceStats],
        health: Mapping[str, float],
    ) -> Placement | None:
        """As many layers as fit on the GPU with the most room (scaled by health)."""
        gpus = [
            d
            for d in devices
            if d.kind is DeviceKind.CUDA and d.healthy and health.get(d.id, 1.0) > 0
        ]
        if not gpus:
            return None
        best = max(gpus, key=lambda d: (self._margin.headroom(d) * health.get(d.id, 1.0), d.id))
        layers = layers_that_fit(footprint, n_layer, self._margin.headroom(best))
        if layers < 1:
            return None
        log.info("partial offload: %d of %d layers fit on %s", layers, n_layer, best.id)
        return Placement(
            best.id,
            partial_offload(footprint, n_layer, layers),
            kv_per_token,
            n_layer,
            layers,
        )

    def restore(self, branch_id: str, placement: Placement | None) -> None:
        """Put a placement back (a reload that failed), or forget it (``None``: a branch
        that is gone)."""
        if placement is None:
            self._placements.pop(branch_id, None)
            self.version += 1
        else:
            self._placements[branch_id] = placement
            self.version += 1

    def move(self, branch_id: str, device: str) -> None:
        self._placements[branch_id] = dataclasses.replace(
            self._placements[branch_id], device=device, oom_flag=self._oom_flag(device)
        )
        self.version += 1

    def _oom_flag(self, device: str | None) -> str:
        if self._sim is None or device is None or device not in self._sim.device_ids:
            return ""
        return str(self._sim.oom_flag(device))

    # -- accounting -------------------------------------------------------------

    def loaded(self, branch_id: str) -> None:
        """The branch's worker is up: a simulated device holds its bytes from now on."""
        placement = self._placements.get(branch_id)
        if self._sim is not None and placement is not None and _local(placement.device):
            self._sim.attach(placement.device, branch_id, self.device_bytes(placement.footprint))

    def unloaded(self, branch_id: str, *, crashed: bool = False) -> None:
        """The branch's worker stopped (``crashed``: unasked, which counts against its
        device's health)."""
        placement = self._placements.get(branch_id)
        if placement is None or not _local(placement.device):
            return
        if self._sim is not None:
            self._sim.detach(placement.device, branch_id)
        if crashed:
            self._health.record_failure(placement.device, "worker_exit")

    async def measure(self, branch_id: str, pid: int | None) -> None:
        """Replace the branch's estimate by what its process really holds on its device."""
        placement = self._placements.get(branch_id)
        if placement is None or placement.device is None or pid is None:
            return
        try:
            if placement.gpu is not None:
                await self._poller.poll_once()
                device = self._poller.snapshot.device(placement.device)
                measured = process_gpu_bytes(device, pid) if device is not None else None
                if measured is None:
                    log.info("%s: the driver lists no memory for pid %d", branch_id, pid)
                    return
            else:  # what it will hold: RSS now, and what it allocates as its slots fill
                measured = measure_process_rss(pid) + placement.grows_bytes
        except (ProcessLookupError, OSError) as exc:
            log.warning("%s: footprint not measured: %s", branch_id, exc)
            return
        footprint = placement.footprint.with_measurement(measured)
        self._placements[branch_id] = dataclasses.replace(placement, footprint=footprint)
        self.version += 1
        self.loaded(branch_id)
        log.info(
            "%s: footprint %d MiB measured, %d MiB estimated",
            branch_id,
            footprint.bytes >> 20,
            footprint.estimated_bytes >> 20,
        )

    def _on_snapshot(self, snapshot: DeviceSnapshot) -> None:
        """A simulated device over its budget is out of memory until it is within it again."""
        assert self._sim is not None
        for device in snapshot.devices:
            if device.kind is DeviceKind.SIM:
                self._sim.set_out_of_memory(device.id, self._margin.balance(device) < 0)


def _no_room_for(draft: Path, device: str | None) -> str:
    """Why a reference is placed without its draft."""
    return f"its draft {draft.name} does not fit beside it on {device}"


def _reserve(device: DeviceStats, nbytes: int) -> DeviceStats:
    """The device as it will be once a branch of ``nbytes`` is loaded on it."""
    return dataclasses.replace(
        device,
        used_bytes=device.used_bytes + nbytes,
        free_bytes=max(device.free_bytes - nbytes, 0),
    )


def _local(device: str | None) -> TypeGuard[str]:
    """A device of this host (not ``None``, not a remote server's ``remote:host:port``)."""
    return device is not None and not device.startswith(REMOTE_PREFIX)
