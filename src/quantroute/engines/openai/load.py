"""A remote server's load, from its Prometheus metrics: sequences running and waiting,
and how full its KV cache is. The names are each server's own:

- vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc``;
- llama-server (``--metrics``): ``llamacpp:requests_processing``,
  ``llamacpp:requests_deferred``, ``llamacpp:kv_cache_usage_ratio`` (older builds only);
- SGLang: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``;
- quantroute: ``quantroute_model_running_requests``, ``quantroute_queue_depth``.

Values are summed over label sets (a vLLM serving one model has one). Parsing is one
pass over lines with ``str`` methods (no regular expression touches what a server
sent), bounded by the probe's byte limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["METRIC_NAMES", "RemoteLoad", "parse_load"]

# server kind -> (running, waiting, kv usage)
METRIC_NAMES: dict[str, tuple[str, str, str | None]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    "llama-server": (
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:kv_cache_usage_ratio",
    ),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
    "quantroute": ("quantroute_model_running_requests", "quantroute_queue_depth", None),
}


@dataclass(frozen=True, slots=True)
class RemoteLoad:
    """What a server said of its load, and which kind of server said it."""

    server: str
    running: int
    waiting: int
    kv_usage: float | None  # 0-1; None where the server does not say


def parse_load(text: str) -> RemoteLoad | None:
    """The load in a Prometheus exposition, or ``None`` when it has none of the known
    names (a server without metrics, or one we do not know)."""
    sums: dict[str, float] = {}
    wanted = {name for names in METRIC_NAMES.values() for name in names if name}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        name = line[: brace if 0 <= brace < space else space]
        if name not in wanted:
            continue
        value_text = line[line.rfind("}") + 1 :] if brace >= 0 else line[space:]
        parts = value_text.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if math.isfinite(value):
            sums[name] = sums.get(name, 0.0) + value
    for server, (running, waiting, kv) in METRIC_NAMES.items():
        if running in sums or waiting in sums:
            usage = sums.get(kv) if kv is not None else None
            return RemoteLoad(
                server,
                _count(sums.get(running, 0.0)),
                _count(sums.get(waiting, 0.0)),
                None if usage is None or math.isnan(usage) else min(1.0, max(0.0, usage)),
            )
    return None


_MAX_COUNT = 1 << 31  # more sequences than any server runs: a number past it is nonsense


def _count(value: float) -> int:
    """A sum of sequences as a count, in ``[0, 2**31]`` (a sum may overflow to inf)."""
    return 0 if not value > 0 else int(min(value, _MAX_COUNT))
