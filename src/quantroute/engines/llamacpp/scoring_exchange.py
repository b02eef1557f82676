"""The scoring exchange of :class:`~quantroute.engines.llamacpp.engine.LlamaCppEngine`
(gateway side): ``write_logits`` and ``score``, each one command and one answer.

A mixin, so the engine's module stays about the worker's lifecycle and generation; it
uses the engine's exchange plumbing (``_enter`` / ``_send`` / ``_leave``), declared
below for the type checker.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from quantroute.engines.base import ReferenceLogits, TokenScores
from quantroute.engines.inbox import Inbox
from quantroute.engines.llamacpp import wire
from quantroute.engines.llamacpp.exchange_timer import ExchangeTimer
from quantroute.engines.llamacpp.generation import Item, worker_error
from quantroute.engines.llamacpp.options import WorkerOptions
from quantroute.errors import EngineError

_Answer = TypeVar("_Answer", wire.Logits, wire.Scores)


class ScoringExchange:
    """Teacher-forced scoring over the worker's pipe (see ``Engine.write_logits`` and
    ``Engine.score``)."""

    if TYPE_CHECKING:
        name: str
        _options: WorkerOptions
        _ids: itertools.count[int]

        async def _send(self, command: wire.Command, timeout_s: float | None) -> None: ...

        def _enter(
            self, rid: str, idle_s: float | None, total_s: float | None
        ) -> tuple[asyncio.subprocess.Process, Inbox[Item], ExchangeTimer]: ...

        def _leave(
            self,
            rid: str,
            inbox: Inbox[Item],
            timer: ExchangeTimer,
            proc: asyncio.subprocess.Process,
            *,
            done: bool,
        ) -> None: ...

        def _timed_out(
            self, proc: asyncio.subprocess.Process, wait_s: float, stuck_after_s: float
        ) -> EngineError: ...

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
        """Teacher-force ``tokens`` (or ``text``'s first ``limit`` tokens) after
        ``prompt``; the worker writes the float32 logits that predicted each of them to
        ``path`` (see ``Engine.write_logits``)."""
        rid = f"logits.{next(self._ids)}"
        command = wire.WriteLogits(rid, prompt, tokens, str(path), parse_special, text, limit)
        event = await self._exchange(command, wire.Logits, timeout_s=self._options.score_timeout_s)
        return event.reference()

    async def score(
        self,
        prompt: str,
        tokens: list[int],
        reference: ReferenceLogits,
        *,
        parse_special: bool = False,
    ) -> TokenScores:
        """Teacher-force ``tokens`` after ``prompt``; the worker compares each row with
        ``reference``'s and returns per-token KLD and top-1 (see ``Engine.score``)."""
        ref = wire.Reference(str(reference.path), (reference.n_tokens, reference.n_vocab))
        command = wire.Score(f"score.{next(self._ids)}", prompt, tokens, ref, parse_special)
        event = await self._exchange(command, wire.Scores, timeout_s=self._options.score_timeout_s)
        if len(event.kld) != len(tokens) or len(event.top1) != len(tokens):
            raise EngineError(f"branch {self.name}: scores for the wrong number of tokens")
        return event.scores()

    async def _exchange(
        self,
        command: wire.WriteLogits | wire.Score,
        last: type[_Answer],
        *,
        timeout_s: float,
    ) -> _Answer:
        """Send a scoring command and wait for its answer, the event of type ``last``.
        An ``err`` event, a dead worker or ``timeout_s`` in all raises; leaving early
        (cancelled) cancels the command."""
        rid = command.id
        proc, stream, timer = self._enter(rid, None, timeout_s)
        done = False
        try:
            await self._send(command, timer.wait_s())
            while True:
                if not stream.items:
                    timer.waiting()
                    item = await stream.get()
                    timer.got()
                else:
                    item = stream.items.popleft()
                if timer.expired is not None:
                    raise self._timed_out(proc, timer.expired, timeout_s)
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if isinstance(item, wire.Error):
                    done = True
                    raise worker_error(self.name, item)
                if isinstance(item, last):
                    done = True
                    return item
        finally:
            self._leave(rid, stream, timer, proc, done=done)
