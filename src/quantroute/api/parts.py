"""Parts the composition root (``api/gateway.py``) builds from settings and route tables:
the circuit breakers, a route table of a catalog's builds, the drift monitor of a table,
the simulated devices among the device providers."""

from __future__ import annotations

import asyncio
import logging

from quantroute.api.catalog import ModelBuild
from quantroute.config import DriftSettings, ResilienceSettings
from quantroute.engines.llamacpp.build import probe_build
from quantroute.quality.drift import Baseline, DriftMonitor
from quantroute.resilience import BreakerPolicy, Breakers
from quantroute.routing.table import RouteTable
from quantroute.telemetry import DeviceProvider, SimDeviceProvider
from quantroute.telemetry.selection import CompositeProvider

log = logging.getLogger(__name__)


def find_sim(provider: DeviceProvider) -> SimDeviceProvider | None:
    """The simulated devices among ``provider``'s (``None``: none is simulated)."""
    if isinstance(provider, SimDeviceProvider):
        return provider
    if isinstance(provider, CompositeProvider):
        return next((p for p in provider.providers if isinstance(p, SimDeviceProvider)), None)
    return None


def breakers_from(settings: ResilienceSettings) -> Breakers:
    """One circuit breaker per branch, opened and probed as ``resilience.breaker_*`` say."""
    return Breakers(
        BreakerPolicy(
            failures_to_open=settings.breaker_failures,
            open_base_s=settings.breaker_open_s,
            open_max_s=settings.breaker_open_max_s,
            half_open_probes=settings.breaker_half_open_probes,
        )
    )


def table_of(builds: list[ModelBuild], generation: int = 0) -> RouteTable:
    """The route table of a catalog's builds: their routes and traffic splits."""
    routes = [r for b in builds for r in b.routes]
    return RouteTable.build(routes, generation, [b.split for b in builds if b.split])


def drift_monitor(settings: DriftSettings, table: RouteTable) -> DriftMonitor:
    """The drift monitor of ``table``: every branch whose engine can score, replayed
    through its route's reference where that one writes logits (a local one), against
    its profile (not started)."""
    scorers = {b.id: b.engine for b in table.branches() if b.engine.can_score}
    reference = {
        b.id: ref
        for route in table.models.values()
        for b in route.branches
        if b.id in scorers
        and (ref := f"{route.name}:{route.reference}") in scorers
        and scorers[ref].writes_logits
    }
    baselines = {
        b.id: Baseline(b.profile.mean_kld, b.profile.top1)
        for b in table.branches()
        if b.profile is not None
    }
    return DriftMonitor(settings, reference=reference, scorers=scorers, baselines=baselines)


async def gpu_offload() -> bool:
    """Whether the llama.cpp build can offload to a GPU (asked in a subprocess: a broken
    build must not kill the gateway); branches go on the GPUs only if so."""
    try:
        info = await asyncio.to_thread(probe_build)
    except Exception as exc:  # an unreadable build: place on the CPU, and say so
        log.error("llama.cpp build not probed (%s); placing branches on the CPU", exc)
        return False
    if not info.gpu_offload:
        log.warning("this machine has a GPU but the llama.cpp build has no CUDA: see doctor")
    return info.gpu_offload
