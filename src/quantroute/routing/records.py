"""The records routing reads and writes: a leaf module, imported by every other one.

:class:`BranchState` is what the policy knows of one branch at the moment of a
request; :class:`RequestShape` the size of the request; :data:`Row` one
branch's filter outcome, passed from the filters to the score.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantroute.types import Precision

__all__ = ["BranchState", "RequestShape", "Row"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BranchState:
    """What routing knows about one branch at the moment of a request.

    Static facts (from the route table and the profile): ``id``, ``model``,
    ``name``, ``precision``, ``is_reference``, ``mean_kld`` / ``top1`` /
    ``prefill_tps`` / ``decode_tps`` (``None`` when unprofiled or the profile is
    stale), ``kv_bytes_per_token`` (0 when it costs the device nothing, e.g. a
    remote engine), ``parallel`` (sequences decoded together).

    Live state: ``ready`` (takes routed traffic: loaded, warmed up, not draining,
    not failed), ``breaker_open`` (its circuit breaker turns requests away now),
    ``degraded`` (drift monitor), ``device`` and its
    ``device_free_bytes`` (already net of the safety margin: free *for
    routing*), ``device_total_bytes``, ``device_health`` in [0, 1], ``heat`` in
    [0, 1] (the device's thermal pressure: 0 cool, 1 at the throttle point; 0
    where unknown), ``running`` (sequences holding a slot), ``queued``
    (admitted, waiting for a slot), ``recent_rate`` (requests/s routed here
    lately: popularity), ``mean_service_ms`` (measured mean time a request
    holds a slot; ``None`` to estimate it from the profile), ``observed_ttft_ms``
    / ``observed_tpot_ms`` (time to first token and per output token after it, end
    to end, as recent requests on the branch saw them: ``routing.speeds``; ``None``
    before there are observations, and the deadline filter reads the profile), and
    their spread ``observed_*_dev_ms`` (the policy's deadline margin), and
    ``decode_speedup``: a reference that speculates decodes this many times its profile's
    ``decode_tps`` (its worker's measured speed-up, ``EngineInfo.speedup``; 1.0 otherwise).
    """

    id: str
    model: str
    name: str
    precision: Precision
    is_reference: bool = False
    ready: bool = True
    breaker_open: bool = False
    degraded: bool = False
    mean_kld: float | None = None
    top1: float | None = None
    prefill_tps: float | None = None
    decode_tps: float | None = None
    kv_bytes_per_token: int = 0
    device: str = "cpu"
    device_free_bytes: int = 0
    device_total_bytes: int = 0
    device_health: float = 1.0
    running: int = 0
    queued: int = 0
    parallel: int = 1
    recent_rate: float = 0.0
    heat: float = 0.0
    mean_service_ms: float | None = None
    observed_ttft_ms: float | None = None
    observed_tpot_ms: float | None = None
    observed_ttft_dev_ms: float = 0.0
    observed_tpot_dev_ms: float = 0.0
    decode_speedup: float = 1.0


@dataclass(frozen=True, slots=True)
class RequestShape:
    """The size of a request: prompt tokens (an estimate is fine), tokens to generate,
    and the prompt's prefix for cache affinity (empty: no affinity); ``drafted``: a
    reference that speculates would draft for it (``False`` for what decodes plainly:
    grammars, logprobs, penalties, seeded sampling), so its ``decode_speedup`` applies."""

    prompt_tokens: int
    max_tokens: int
    prefix: str = ""
    drafted: bool = True


# One branch's filter outcome: (failed filter bits, KV bytes needed, service ms or None,
# predicted latency ms or None).
Row = tuple[int, int, float | None, float | None]
