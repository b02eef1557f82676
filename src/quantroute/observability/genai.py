"""The OpenTelemetry GenAI semantic conventions' server metrics, under the Prometheus names
an OTel-to-Prometheus exporter gives them, read at scrape time from quantroute's own series.

A request counts once, into quantroute's families (``instruments.py``); this collector
re-labels their samples when ``/metrics`` is read, so following the conventions costs a
request nothing. Each convention's metric and where its figures come from:

- ``gen_ai.server.time_to_first_token``: ``gen_ai_server_time_to_first_token_seconds``,
  from ``quantroute_time_to_first_token_seconds``;
- ``gen_ai.server.time_per_output_token``: ``gen_ai_server_time_per_output_token_seconds``,
  from ``quantroute_inter_token_latency_seconds`` (each gap, as vLLM counts it);
- ``gen_ai.server.request.duration``: ``gen_ai_server_request_duration_seconds``, from
  ``quantroute_request_duration_seconds``;
- token usage: ``gen_ai_server_token_usage_total``, from
  ``quantroute_prompt_tokens_total`` and ``quantroute_completion_tokens_total``.

Labels are the conventions' attributes with dots as underscores:
``gen_ai_provider_name`` (``quantroute``), ``gen_ai_request_model`` (the model asked for),
``gen_ai_response_model`` (the branch that answered), ``error_type`` (the HTTP status of a
request that did not end in 200, on the duration), ``gen_ai_token_type`` (``input``,
``output``). Token usage is a counter: the conventions' per-request histogram of tokens is
a client metric, and the totals are what a server's users sum.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prometheus_client.samples import Sample

PROVIDER = "quantroute"

# convention's Prometheus name, help, quantroute's family name
_HISTOGRAMS = (
    (
        "gen_ai_server_time_to_first_token_seconds",
        "gen_ai.server.time_to_first_token: time to generate the first token.",
        "quantroute_time_to_first_token_seconds",
    ),
    (
        "gen_ai_server_time_per_output_token_seconds",
        "gen_ai.server.time_per_output_token: time per output token after the first.",
        "quantroute_inter_token_latency_seconds",
    ),
    (
        "gen_ai_server_request_duration_seconds",
        "gen_ai.server.request.duration: generative AI server request duration.",
        "quantroute_request_duration_seconds",
    ),
)
_TOKENS = (("quantroute_prompt_tokens", "input"), ("quantroute_completion_tokens", "output"))
_HISTOGRAM_LABELS = (
    "gen_ai_provider_name",
    "gen_ai_request_model",
    "gen_ai_response_model",
    "error_type",
)
_TOKEN_LABELS = (
    "gen_ai_provider_name",
    "gen_ai_request_model",
    "gen_ai_response_model",
    "gen_ai_token_type",
)


class GenAiView(Collector):
    """The conventions' names over quantroute's own ``families`` (collectors of the same
    registry, read when this one is)."""

    def __init__(self, families: Iterable[Collector]):
        self._families = tuple(families)

    def collect(self) -> Iterator[Metric]:
        families = {m.name: m for c in self._families for m in c.collect()}
        for name, text, origin in _HISTOGRAMS:
            family = HistogramMetricFamily(name, text, labels=list(_HISTOGRAM_LABELS))
            if origin in families:
                _histograms(family, families[origin].samples)
            yield family
        sums: dict[tuple[str, ...], float] = {}
        for origin, kind in _TOKENS:
            for s in families[origin].samples if origin in families else ():
                if s.name.endswith("_total"):  # the tenant label is dropped: its series add up
                    key = (PROVIDER, s.labels["model"], s.labels["branch"], kind)
                    sums[key] = sums.get(key, 0.0) + s.value
        usage = CounterMetricFamily(
            "gen_ai_server_token_usage",
            "Tokens used by generative AI requests, by token type (input, output).",
            labels=list(_TOKEN_LABELS),
        )
        for labels, value in sums.items():
            usage.add_metric(list(labels), value)
        yield usage


def _histograms(family: HistogramMetricFamily, samples: Iterable[Sample]) -> None:
    """Regroup ``samples`` (``_bucket``, ``_sum``, ``_count`` per label set) into
    ``family``'s series, one per (model, branch, error)."""
    series: dict[tuple[str, ...], tuple[dict[str, float], list[float]]] = {}
    for s in samples:
        status = s.labels.get("status", "200")
        key = (
            PROVIDER,
            s.labels.get("model", ""),
            s.labels.get("branch", ""),
            "" if status == "200" else status,
        )
        buckets, total = series.setdefault(key, ({}, [0.0]))
        if s.name.endswith("_bucket"):
            le = s.labels["le"]
            buckets[le] = buckets.get(le, 0.0) + s.value
        elif s.name.endswith("_sum"):
            total[0] += s.value
    for labels, (buckets, total) in series.items():
        ordered = sorted(buckets.items(), key=lambda b: float(b[0]))  # "+Inf" parses
        family.add_metric(list(labels), ordered, total[0])
