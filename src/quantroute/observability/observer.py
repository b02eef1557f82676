"""The gateway's observer: where requests, workers and reloads report what happened.

One :class:`Observer` per gateway owns the event-driven metrics
(:class:`~quantroute.observability.instruments.Instruments`), the tracing
(:class:`~quantroute.observability.tracing.Tracing`, off without an
endpoint) and the last requests for the status page (:class:`RecentRequests`).
Each generation request gets a :class:`~quantroute.observability.requests.RequestTrace`
from :meth:`Observer.begin`.

Others call: :meth:`worker_restarted` (the gateway's engine listener),
:meth:`hot_reload` (the route-table reload, by outcome), :meth:`prompt_cache_hit`
(an engine that reused a KV prefix).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import generate_latest

from quantroute.observability.instruments import Instruments
from quantroute.observability.metrics import GatewayView, render_metrics
from quantroute.observability.requests import RequestTrace
from quantroute.observability.tracing import Tracing

if TYPE_CHECKING:
    from quantroute.config import ObservabilitySettings

HOT_RELOAD_OUTCOMES = ("applied", "rejected", "failed")


@dataclass(frozen=True, slots=True)
class Finished:
    """One finished request, as the status page lists it."""

    at: float  # unix seconds
    request_id: str
    model: str
    branch: str  # the branch that answered; "" when none did
    reason: str  # the routing decision's
    status: int
    fallbacks: tuple[tuple[str, str, str], ...]
    ttft_ms: float | None
    duration_ms: float
    tokens: int


class RecentRequests:
    """The last ``size`` finished requests (a ring), and what the router did lately."""

    def __init__(self, size: int):
        self._ring: deque[Finished] = deque(maxlen=size)

    def add(self, trace: RequestTrace, status: int, duration_s: float, now: float) -> None:
        self._ring.append(
            Finished(
                at=now,
                request_id=trace.request_id,
                model=trace.model,
                branch=trace.branch.name if trace.branch is not None and trace.committed else "",
                reason=trace.reason,
                status=status,
                fallbacks=tuple(trace.fallbacks),
                ttft_ms=None if trace.ttft_s is None else trace.ttft_s * 1000,
                duration_ms=duration_s * 1000,
                tokens=trace.completion_tokens,
            )
        )

    def summary(self, now: float, window_s: float = 60.0, last: int = 50) -> dict[str, Any]:
        """The last ``window_s``: requests by model, branch and reason; fallbacks; statuses;
        and the ``last`` requests, newest first."""
        recent = [f for f in self._ring if f.at >= now - window_s]
        decisions = Counter((f.model, f.branch or "none", f.reason or "none") for f in recent)
        fallbacks = Counter((f.model, *fb) for f in recent for fb in f.fallbacks)
        statuses = Counter(f.status for f in recent)
        return {
            "window_s": window_s,
            "requests": len(recent),
            "decisions": [
                {"model": m, "branch": b, "reason": r, "count": c}
                for (m, b, r), c in sorted(decisions.items())
            ],
            "fallbacks": [
                {"model": m, "from": a, "to": b, "reason": r, "count": c}
                for (m, a, b, r), c in sorted(fallbacks.items())
            ],
            "statuses": {str(s): c for s, c in sorted(statuses.items())},
            "recent": [
                {
                    "at": f.at,
                    "request_id": f.request_id,
                    "model": f.model,
                    "branch": f.branch,
                    "reason": f.reason,
                    "status": f.status,
                    "fallbacks": [list(fb) for fb in f.fallbacks],
                    "ttft_ms": f.ttft_ms,
                    "duration_ms": f.duration_ms,
                    "tokens": f.tokens,
                }
                for f in list(self._ring)[::-1][:last]
            ],
        }


class Observer:
    def __init__(
        self,
        settings: ObservabilitySettings,
        *,
        tracing: Tracing | None = None,
        device_of: Callable[[str], str | None] = lambda _branch_id: None,
        served: Callable[[str], bool] = lambda _model: True,
    ):
        self.settings = settings
        self.instruments = Instruments(settings.loop_lag_interval_s)
        self.tracing = tracing if tracing is not None else Tracing.from_settings(settings)
        self.recent = RecentRequests(settings.recent_decisions)
        self.device_of = device_of  # a branch's device, for its spans
        # whether a request's model is served here: only then does its text go into the
        # span's name and attributes (the client's free text never does)
        self.served = served

    def begin(self, req: Any, headers: Mapping[str, str], tenant: str) -> RequestTrace:
        """A generation request arrived (``req``: a chat or text completion body)."""
        chat = "messages" in getattr(type(req), "model_fields", ())  # no missed attribute
        attributes: dict[str, Any] = {}
        if self.tracing.tracer is not None:  # only traces read these
            attributes = {
                "gen_ai.operation.name": "chat" if chat else "text_completion",
                "gen_ai.provider.name": "quantroute",
                "gen_ai.request.model": req.model if self.served(req.model) else None,
                "gen_ai.request.temperature": req.temperature,
                "gen_ai.request.top_p": req.top_p,
                "gen_ai.request.seed": req.seed,
                "gen_ai.request.choice.count": req.n,
                "gen_ai.request.max_tokens": getattr(
                    req, "completion_limit" if chat else "max_tokens", None
                ),
                "quantroute.tenant": tenant,
                "quantroute.stream": req.stream,
            }
        return RequestTrace(
            self,
            kind="chat" if chat else "completion",
            tenant=tenant,
            n=req.n,
            stream=req.stream,
            headers=headers,
            attributes=attributes,
        )

    def worker_restarted(self, model: str, branch: str) -> None:
        self.instruments.worker_restarts.labels(model, branch).inc()

    def hot_reload(self, outcome: str) -> None:
        """A route-table reload ended: ``applied``, ``rejected`` (a bad repository or
        manifest; the old table serves on) or ``failed`` (it broke while swapping)."""
        if outcome not in HOT_RELOAD_OUTCOMES:
            raise ValueError(f"hot reload outcome {outcome!r} is not {HOT_RELOAD_OUTCOMES}")
        self.instruments.hot_reloads.labels(outcome).inc()

    def version_answered(self, model: str, version: str) -> None:
        """A request of ``model`` (the name clients use) was answered by ``version``."""
        self.instruments.version_answers.labels(model, version).inc()

    def prompt_cache_hit(self, model: str, branch: str, reused_tokens: int) -> None:
        """``reused_tokens`` of a prompt came from a cached KV prefix (not prefilled)."""
        self.instruments.prompt_cache_hits.labels(model, branch).inc(reused_tokens)

    def render(self, view: GatewayView) -> bytes:
        """The whole Prometheus exposition: what was counted, then what is read now."""
        return generate_latest(self.instruments.registry) + render_metrics(view)

    def recent_json(self) -> dict[str, Any]:
        return self.recent.summary(time.time())

    def start(self) -> None:
        """Start what counts on its own (the collector's pauses, the event loop's lag: the
        running loop's, so from inside it)."""
        self.instruments.gc_pauses.install()
        self.instruments.loop_lag.start()

    def shutdown(self) -> None:
        self.instruments.loop_lag.stop()
        self.instruments.gc_pauses.uninstall()
        self.tracing.shutdown()
