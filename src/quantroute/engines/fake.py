"""``FakeEngine``: a deterministic engine for tests and demos of everything
around generation (routing, fallbacks, fault injection), like httpx's
``MockTransport``. It "generates" by cycling through a fixed text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

from quantroute.engines.base import (
    EngineEvent,
    EngineInfo,
    EngineListener,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    PromptCacheStats,
    ReferenceLogits,
    StartEvent,
    TokenEvent,
    TokenScores,
)
from quantroute.engines.stops import StopMatcher
from quantroute.errors import ContextLengthExceededError, EngineCrashedError, EngineUnavailableError
from quantroute.types import Offload


@dataclass(slots=True)
class FakeFaults:
    """Faults to inject: not ready (``unavailable``); ready but refusing every request
    before its first token (``refuse``); or dying after ``crash_after`` tokens."""

    unavailable: bool = False
    refuse: bool = False
    crash_after: int | None = None


class FakeEngine:
    """Emits ``text`` one character per token; one "token" per character of the prompt."""

    def __init__(
        self,
        text: str = "def fake():\n    return 42\n",
        *,
        n_ctx: int = 512,
        token_delay_s: float = 0.0,
        faults: FakeFaults | None = None,
        name: str = "fake",
    ):
        self.name = name
        self.text = text
        self.faults = faults or FakeFaults()
        self.token_delay_s = token_delay_s
        self._info = EngineInfo(
            n_ctx=n_ctx,
            n_ctx_train=n_ctx,
            n_vocab=256,
            parallel=64,
            chat_template=None,
            bos_token="<s>",
            eos_token="</s>",
            model_bytes=0,
        )
        self._ready = False
        self._in_flight = 0
        self._listener: EngineListener | None = None
        self.requests: list[GenerationRequest] = []
        self.placement = Offload()

    @property
    def ready(self) -> bool:
        return self._ready and not self.faults.unavailable

    @property
    def info(self) -> EngineInfo | None:
        return self._info

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def pid(self) -> int | None:
        return None

    @property
    def model_path(self) -> Path | None:
        return None

    @property
    def failure(self) -> str | None:
        return None

    @property
    def can_score(self) -> bool:
        return False

    @property
    def writes_logits(self) -> bool:
        return False

    @property
    def prompt_cache(self) -> PromptCacheStats | None:
        return None  # no KV to keep

    def listen(self, listener: EngineListener) -> None:
        self._listener = listener

    def offload(self, offload: Offload) -> None:
        self.placement = offload

    async def start(self) -> None:
        self._ready = True
        if self._listener is not None:
            self._listener.engine_ready(self)

    async def stop(self) -> None:
        self._ready = False

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def write_logits(
        self,
        prompt: str,
        tokens: list[int],
        path: Path,
        *,
        parse_special: bool = False,
        text: str | None = None,
        limit: int = 0,
    ) -> ReferenceLogits:
        raise EngineUnavailableError("a fake engine does not score")

    async def score(
        self,
        prompt: str,
        tokens: list[int],
        reference: ReferenceLogits,
        *,
        parse_special: bool = False,
    ) -> TokenScores:
        raise EngineUnavailableError("a fake engine does not score")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        if not self.ready or self.faults.refuse:
            raise EngineUnavailableError("fake engine is unavailable")
        s = request.sampling
        prompt_tokens = (
            len(request.prompt_ids) if request.prompt_ids is not None else len(request.prompt) + 1
        )
        if s.fit_context:
            s = replace(s, max_tokens=max(1, min(s.max_tokens, self._info.n_ctx - prompt_tokens)))
        if prompt_tokens + s.max_tokens > self._info.n_ctx:
            raise ContextLengthExceededError(
                prompt_tokens=prompt_tokens, max_tokens=s.max_tokens, n_ctx=self._info.n_ctx
            )
        self.requests.append(request)
        self._in_flight += 1
        try:
            yield StartEvent(prompt_tokens)
            stops = StopMatcher(s.stop)
            for i in range(s.max_tokens):
                if self.faults.crash_after is not None and i >= self.faults.crash_after:
                    raise EngineCrashedError("fake engine crashed (injected)")
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                if s.deadline is not None and time.monotonic() >= s.deadline:
                    yield FinishEvent(FinishReason.DEADLINE, prompt_tokens, i, stops.flush())
                    return
                char = self.text[i % len(self.text)]
                yield TokenEvent(stops.feed(char), ord(char), -0.5 if s.logprobs else None, char)
                if stops.stopped:
                    yield FinishEvent(FinishReason.STOP, prompt_tokens, i + 1)
                    return
            yield FinishEvent(FinishReason.LENGTH, prompt_tokens, s.max_tokens, stops.flush())
        finally:
            self._in_flight -= 1
