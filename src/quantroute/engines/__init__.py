"""Engines run branches: the ``Engine`` protocol and its implementations."""

from __future__ import annotations

from quantroute.engines.base import (
    ChatInput,
    Engine,
    EngineEvent,
    EngineInfo,
    EngineListener,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    PromptCacheStats,
    ReferenceLogits,
    SamplingParams,
    StartEvent,
    TokenEvent,
    TokenScores,
)
from quantroute.engines.exits import describe_exit
from quantroute.engines.fake import FakeEngine, FakeFaults
from quantroute.engines.llamacpp.build import BuildInfo, DecodeCheck, decode_check, probe_build
from quantroute.engines.llamacpp.engine import LlamaCppEngine, WorkerOptions
from quantroute.engines.stops import StopMatcher
from quantroute.engines.supervisor import RestartPolicy, WorkerSupervisor

__all__ = [
    "BuildInfo",
    "ChatInput",
    "DecodeCheck",
    "Engine",
    "EngineEvent",
    "EngineInfo",
    "EngineListener",
    "FakeEngine",
    "FakeFaults",
    "FinishEvent",
    "FinishReason",
    "GenerationRequest",
    "LlamaCppEngine",
    "PromptCacheStats",
    "ReferenceLogits",
    "RestartPolicy",
    "SamplingParams",
    "StartEvent",
    "StopMatcher",
    "TokenEvent",
    "TokenScores",
    "WorkerOptions",
    "WorkerSupervisor",
    "decode_check",
    "describe_exit",
    "probe_build",
]
