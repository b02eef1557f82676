"""Engines run branches: the ``Engine`` protocol and its implementations."""

from __future__ import annotations

from quantroute.engines.base import (
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
from quantroute.engines.chat_template import ChatPrompt, render_chat, render_chat_bounded
from quantroute.engines.exits import describe_exit
from quantroute.engines.fake import FakeEngine, FakeFaults
from quantroute.engines.llamacpp import LlamaCppEngine, WorkerOptions
from quantroute.engines.llamacpp_build import BuildInfo, DecodeCheck, decode_check, probe_build
from quantroute.engines.stops import StopMatcher
from quantroute.engines.supervisor import RestartPolicy, WorkerSupervisor
from quantroute.engines.template_pool import TemplatePool, close_default_pool

__all__ = [
    "BuildInfo",
    "ChatPrompt",
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
    "TemplatePool",
    "TokenEvent",
    "TokenScores",
    "WorkerOptions",
    "WorkerSupervisor",
    "close_default_pool",
    "decode_check",
    "describe_exit",
    "probe_build",
    "render_chat",
    "render_chat_bounded",
]
