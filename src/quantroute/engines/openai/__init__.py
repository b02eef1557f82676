"""``engine: openai``: branches on remote OpenAI-compatible servers (vLLM, SGLang,
llama-server, another quantroute): the relaying engine (:mod:`.engine`), what each
server is sent (:mod:`.payload`), bounded event parsing (:mod:`.sse`) and load from
their metrics (:mod:`.load`)."""

from __future__ import annotations

from quantroute.engines.openai.engine import OpenAIEngine, RemoteConfig
from quantroute.engines.openai.load import RemoteLoad, parse_load

__all__ = ["OpenAIEngine", "RemoteConfig", "RemoteLoad", "parse_load"]
