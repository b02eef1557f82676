"""Prometheus metrics counted as things happen (the scrape-time ones are in ``metrics.py``).

=============================================  =========  =================================
metric                                         type       labels
=============================================  =========  =================================
``quantroute_requests_total``                  counter    model, branch, tenant, status
``quantroute_prompt_tokens_total``             counter    model, branch, tenant
``quantroute_completion_tokens_total``         counter    model, branch, tenant
``quantroute_time_to_first_token_seconds``     histogram  model, branch
``quantroute_inter_token_latency_seconds``     histogram  model, branch
``quantroute_request_duration_seconds``        histogram  model, branch, status
``quantroute_queue_wait_seconds``              histogram  model
``quantroute_routing_decisions_total``         counter    model, branch, reason
``quantroute_fallback_total``                  counter    model, from, to, reason
``quantroute_worker_restarts_total``           counter    model, branch
``quantroute_hot_reloads_total``               counter    outcome
``quantroute_prompt_cache_hit_tokens_total``   counter    model, branch
``quantroute_speculative_drafted_tokens_total``  counter  model, reference, draft
``quantroute_speculative_accepted_tokens_total`` counter  model, reference, draft
``quantroute_gc_pause_seconds``                histogram  generation
``quantroute_event_loop_lag_seconds``          histogram  (none)
``quantroute_event_loop_lag_max_seconds``      gauge      (none)
=============================================  =========  =================================

The same requests under the OpenTelemetry GenAI conventions' names
(``gen_ai_server_time_to_first_token_seconds`` and the rest) are re-labelled from these at
scrape time (``genai.py``).

``status`` is the HTTP status of the answer (``200``, ``429``, ``503``...), ``499``
when the client left first, and ``502`` for a stream that ended in an engine
error after its first token. ``branch`` is the branch that answered, ``none``
when none did. A fallback's ``to`` is ``none`` when no branch was left to try.
The prompt-cache hit rate of a branch is
``rate(quantroute_prompt_cache_hit_tokens_total) / rate(quantroute_prompt_tokens_total)``.
A reference that speculates (its worker holds a draft branch: ``routing.speculation``)
counts the tokens its draft proposed and how many of them it kept; the draft's acceptance
rate is ``rate(..._accepted_tokens_total) / rate(..._drafted_tokens_total)``.
A garbage collection in the gateway's process stops its event loop, every stream with it:
``quantroute_gc_pause_seconds`` times each (``generation`` 2 is a full one). Anything
else that holds the loop shows in ``quantroute_event_loop_lag_seconds`` (``loop_lag.py``).
"""

from __future__ import annotations

import bisect
import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from quantroute.observability.genai import GenAiView
from quantroute.observability.loop_lag import LoopLag

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
DURATION_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
GC_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, int]]:
    """A histogram's ``le`` buckets from counts per bucket (the last one for +Inf)."""
    running, buckets = 0, []
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        running += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
    return buckets


class TokenGaps(Collector):
    """The inter-token latency histogram, merged in per request.

    A request counts its own gaps into a plain list (:meth:`local`, then
    :func:`bisect` per token: no lock, no label lookup on the hot path) and
    hands them over once, when it ends (:meth:`merge`).
    """

    name = "quantroute_inter_token_latency_seconds"

    def __init__(self, bounds: tuple[float, ...] = ITL_BUCKETS_S):
        self.bounds = bounds
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], tuple[list[int], list[float]]] = {}

    def local(self) -> list[int]:
        """Counts per bucket, the last one for +Inf."""
        return [0] * (len(self.bounds) + 1)

    def bucket(self, gap_s: float) -> int:
        return bisect.bisect_left(self.bounds, gap_s)

    def merge(self, model: str, branch: str, counts: list[int], total_s: float) -> None:
        with self._lock:
            mine, total = self._series.setdefault((model, branch), (self.local(), [0.0]))
            for i, c in enumerate(counts):
                mine[i] += c
            total[0] += total_s

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            self.name,
            "Time between two tokens of a stream, as the gateway received them.",
            labels=["model", "branch"],
        )
        with self._lock:
            series = [(k, list(c), t[0]) for k, (c, t) in self._series.items()]
        for (model, branch), counts, total in series:
            family.add_metric([model, branch], cumulative(self.bounds, counts), total)
        yield family


class GcPauses(Collector):
    """The garbage collector's pauses in this process, by generation, timed by a
    ``gc.callbacks`` hook while :meth:`install` ed.

    Without a lock: the hook runs inside a collection, which may start in any thread at
    any allocation, a scrape's own included (a lock held there would deadlock); the
    collector's phases never interleave, and a scrape copies the counts as they are."""

    name = "quantroute_gc_pause_seconds"

    def __init__(self, bounds: tuple[float, ...] = GC_BUCKETS_S):
        self.bounds = bounds
        self._counts = [[0] * (len(bounds) + 1) for _ in range(3)]  # per generation
        self._totals = [0.0, 0.0, 0.0]
        self._started = 0.0

    def install(self) -> None:
        if self._hook not in gc.callbacks:
            gc.callbacks.append(self._hook)

    def uninstall(self) -> None:
        if self._hook in gc.callbacks:
            gc.callbacks.remove(self._hook)

    def _hook(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = info["generation"]
        self._counts[generation][bisect.bisect_left(self.bounds, pause)] += 1
        self._totals[generation] += pause

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            self.name,
            "Garbage collections in the gateway's process (each stops its event loop).",
            labels=["generation"],
        )
        for generation in range(3):
            counts, total = list(self._counts[generation]), self._totals[generation]
            family.add_metric([str(generation)], cumulative(self.bounds, counts), total)
        yield family


class Instruments:
    """Every event-driven metric family, in a registry of their own (never the global one).

    :meth:`of` is ``family.labels(*values)`` with the child kept: a request's hooks
    find their series with one dict lookup (the label values are bounded: route and
    branch names, tenants, statuses, reasons; never a client's free text)."""

    def __init__(self, loop_lag_interval_s: float = 0.01) -> None:
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}
        self.registry = r = CollectorRegistry()
        req = ["model", "branch", "tenant"]
        self.requests = Counter(
            "quantroute_requests",
            "Generation requests answered, by the branch that answered and HTTP status.",
            [*req, "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "quantroute_prompt_tokens", "Prompt tokens of answered requests.", req, registry=r
        )
        self.completion_tokens = Counter(
            "quantroute_completion_tokens", "Tokens generated.", req, registry=r
        )
        self.ttft = Histogram(
            "quantroute_time_to_first_token_seconds",
            "Request arrival to its first token (queue, routing, prefill included).",
            ["model", "branch"],
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.token_gaps = TokenGaps()
        r.register(self.token_gaps)
        self.gc_pauses = GcPauses()  # counting once the gateway starts (Observer.start)
        r.register(self.gc_pauses)
        self.loop_lag = LoopLag(loop_lag_interval_s)  # sampling once the gateway starts
        r.register(self.loop_lag)
        self.duration = Histogram(
            "quantroute_request_duration_seconds",
            "Request arrival to its last token or error.",
            ["model", "branch", "status"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.queue_wait = Histogram(
            "quantroute_queue_wait_seconds",
            "Time a request waited in its model's admission queue.",
            ["model"],
            buckets=QUEUE_BUCKETS_S,
            registry=r,
        )
        self.decisions = Counter(
            "quantroute_routing_decisions",
            "Routing decisions, by the branch chosen first and the reason.",
            ["model", "branch", "reason"],
            registry=r,
        )
        self.fallbacks = Counter(
            "quantroute_fallback",
            "Requests moved off a branch before their first token.",
            ["model", "from", "to", "reason"],
            registry=r,
        )
        self.worker_restarts = Counter(
            "quantroute_worker_restarts",
            "Worker processes that died unasked (each is restarted unless its branch failed).",
            ["model", "branch"],
            registry=r,
        )
        self.hot_reloads = Counter(
            "quantroute_hot_reloads",
            "Reloads that swapped the route table (applied) or kept a model's old version "
            "(rejected).",
            ["outcome"],
            registry=r,
        )
        self.version_answers = Counter(
            "quantroute_version_answers",
            "Requests answered by each version of a model (traffic splits, canaries).",
            ["model", "version"],
            registry=r,
        )
        self.prompt_cache_hits = Counter(
            "quantroute_prompt_cache_hit_tokens",
            "Prompt tokens served from a reused KV prefix instead of prefilled.",
            ["model", "branch"],
            registry=r,
        )
        spec = ["model", "reference", "draft"]
        self.drafted_tokens = Counter(
            "quantroute_speculative_drafted_tokens",
            "Tokens a reference's draft proposed (speculative decoding).",
            spec,
            registry=r,
        )
        self.accepted_tokens = Counter(
            "quantroute_speculative_accepted_tokens",
            "Tokens a reference's draft proposed that the reference kept.",
            spec,
            registry=r,
        )
        # the GenAI conventions' names, re-labelled from the families above at scrape time
        genai = (self.ttft, self.token_gaps, self.duration, self.prompt_tokens)
        r.register(GenAiView((*genai, self.completion_tokens)))

    def of(self, family: Counter | Histogram, *values: str) -> Any:
        key = (family._name, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*values)
        return child
