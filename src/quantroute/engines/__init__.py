"""Engines run branches: the ``Engine`` protocol and its implementations."""

from __future__ import annotations

from quantroute.engines.base import (
    Engine,
    EngineEvent,
    EngineInfo,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StartEvent,
    TokenEvent,
)
from quantroute.engines.chat_template import ChatPrompt, render_chat
from quantroute.engines.fake import FakeEngine, FakeFaults
from quantroute.engines.llamacpp import LlamaCppEngine, WorkerOptions
from quantroute.engines.stops import StopMatcher
from quantroute.engines.supervisor import RestartPolicy, WorkerSupervisor

__all__ = [
    "ChatPrompt",
    "Engine",
    "EngineEvent",
    "EngineInfo",
    "FakeEngine",
    "FakeFaults",
    "FinishEvent",
    "FinishReason",
    "GenerationRequest",
    "LlamaCppEngine",
    "RestartPolicy",
    "SamplingParams",
    "StartEvent",
    "StopMatcher",
    "TokenEvent",
    "WorkerOptions",
    "WorkerSupervisor",
    "render_chat",
]
