"""The settings tree: everything quantroute can be told, and the only package that reads
environment variables (``config/settings.py``).

``Settings`` is the root; each section is a module named for the package that reads it::

    Settings                      settings.py  (load_settings, default_settings, otel_environment)
    ├── server, limits, auth      server.py
    ├── engine                    engine.py
    ├── telemetry                 telemetry.py
    ├── admission, resilience,    resilience.py
    │   streams
    ├── routing                   routing.py   (tiers, score weights, speeds)
    ├── drift                     quality.py
    ├── observability             observability.py
    ├── repository                registry.py
    └── cluster                   cluster.py   (etcd, Redis: what a fleet shares)

A section imports nothing of quantroute but ``types``; ``settings.py`` imports the
sections. Every name is re-exported here: ``from quantroute.config import X``.
"""

from __future__ import annotations

from quantroute.config.cluster import ClusterSettings
from quantroute.config.engine import EngineSettings
from quantroute.config.observability import ObservabilitySettings
from quantroute.config.quality import DriftSettings
from quantroute.config.registry import RepositorySettings
from quantroute.config.resilience import AdmissionSettings, ResilienceSettings, StreamSettings
from quantroute.config.routing import (
    GiB,
    OnInfeasible,
    RoutingSettings,
    ScoreWeights,
    SpeedSettings,
    Tier,
    TierSettings,
    TiersSettings,
)
from quantroute.config.server import AuthSettings, LimitSettings, ServerSettings
from quantroute.config.settings import (
    DEMO_REPO,
    ENV_PREFIX,
    OTEL_PREFIX,
    Settings,
    default_settings,
    load_settings,
    otel_environment,
)
from quantroute.config.telemetry import MiB, TelemetrySettings

__all__ = [
    "DEMO_REPO",
    "ENV_PREFIX",
    "OTEL_PREFIX",
    "AdmissionSettings",
    "AuthSettings",
    "ClusterSettings",
    "DriftSettings",
    "EngineSettings",
    "GiB",
    "LimitSettings",
    "MiB",
    "ObservabilitySettings",
    "OnInfeasible",
    "RepositorySettings",
    "ResilienceSettings",
    "RoutingSettings",
    "ScoreWeights",
    "ServerSettings",
    "Settings",
    "SpeedSettings",
    "StreamSettings",
    "TelemetrySettings",
    "Tier",
    "TierSettings",
    "TiersSettings",
    "default_settings",
    "load_settings",
    "otel_environment",
]
