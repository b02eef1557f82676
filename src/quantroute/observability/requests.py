"""One request as metrics, spans and log lines see it: :class:`RequestTrace`.

The service and its runner call a request's trace at each step::

    begin ─ admitted ─ routed ─ attempt ─┬─ attempt_failed / skipped (a fallback) ─ attempt ...
                                          └─ first_token ─ token ... ─ choice_finished ─ done
    (any step may end in an error instead: ``failing`` records it)

With tracing on it keeps one server span per request (``chat tiny-llama``,
GenAI semantic conventions) with children ``quantroute.admission``,
``quantroute.routing``, one ``quantroute.generation`` per branch tried and,
inside it, the worker's ``quantroute.decode`` (timed by the worker itself).
Fallbacks are events on the request span. With tracing off none of that is
built. The per-token hook costs a clock read and a list increment.

The arguments are read structurally (:class:`BranchLike`, :class:`DecisionLike`,
:class:`FinishLike`): this package imports nothing above core.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from quantroute.errors import QuantrouteError
from quantroute.observability.logs import ACCESS, CURRENT, LogContext

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from quantroute.observability.observer import Observer

log = logging.getLogger(__name__)
_perf = time.perf_counter
R = TypeVar("R", bound="DataclassInstance")

CLIENT_GONE = 499  # nginx's word for it: the client closed the connection first
FAILED_MID_STREAM = 502


class ProfileLike(Protocol):
    @property
    def mean_kld(self) -> float: ...


class BranchLike(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def precision(self) -> str: ...
    @property
    def profile(self) -> ProfileLike | None: ...
    @property
    def draft(self) -> str | None: ...


class DecisionLike(Protocol):
    @property
    def model(self) -> str: ...
    @property
    def branch_ids(self) -> tuple[str, ...]: ...
    @property
    def reason(self) -> str: ...


class FinishLike(Protocol):
    @property
    def reason(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def worker_ns(self) -> tuple[int, ...]: ...
    @property
    def drafted(self) -> int: ...
    @property
    def accepted(self) -> int: ...
    @property
    def mean_k(self) -> float: ...


def reason_of(exc: BaseException) -> str:
    """A failure in a label's words: ``first_token_timeout``, ``device_out_of_memory``..."""
    if isinstance(exc.__cause__, TimeoutError):
        return "first_token_timeout"
    if isinstance(exc, QuantrouteError) and exc.error_code:
        return exc.error_code
    name = type(exc).__name__.removesuffix("Error")
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_") + "_error"


class RequestTrace:
    """The metrics, spans and log context of one generation request."""

    def __init__(
        self,
        observer: Observer,
        *,
        kind: str,
        tenant: str,
        n: int,
        stream: bool,
        headers: Mapping[str, str],
        attributes: Mapping[str, Any],
    ):
        self._obs = observer
        self.t0 = _perf()
        self.kind = kind
        self.model = "none"  # the route's name once admitted: never a client's free text
        self.tenant = tenant
        self.n = max(1, n)
        self.stream = stream
        self.request_id = ""
        self.reason = ""
        self.branch: BranchLike | None = None
        self.committed = False
        self.closed = False
        self.ttft_s: float | None = None
        self.fallbacks: list[tuple[str, str, str]] = []  # (from, to, reason)
        self._pending: list[tuple[str, str]] = []  # (from, reason): the next attempt is "to"
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish_reasons: list[str] = []
        self._stamps: dict[int, list[float]] = {}  # per choice: when each token came
        self.log = LogContext(tenant=tenant)
        CURRENT.set(self.log)
        self._span: Span | None = None
        self._gen: Span | None = None
        self._mark_ns = 0
        self._context: Context | None = None
        tracer = observer.tracing.tracer
        if tracer is not None:
            from opentelemetry.trace import SpanKind

            self._mark_ns = time.time_ns()
            operation = attributes.get("gen_ai.operation.name", kind)
            model = attributes.get("gen_ai.request.model")
            self._context = observer.tracing.extract(headers)  # with the client's baggage
            self._span = tracer.start_span(
                operation if model is None else f"{operation} {model}",
                context=self._context,
                kind=SpanKind.SERVER,
                attributes={k: v for k, v in attributes.items() if v is not None},
                start_time=self._mark_ns,
            )
            self.log.trace_id = format(self._span.get_span_context().trace_id, "032x")

    # -- the steps ------------------------------------------------------------

    def admitted(self, model: str, waited_s: float) -> None:
        """It got its place in ``model``'s admission queue after ``waited_s``."""
        self.model = model
        ins = self._obs.instruments
        ins.of(ins.queue_wait, model).observe(waited_s)
        self._child("quantroute.admission", {"quantroute.queue.wait_s": waited_s})

    def routed(self, decision: DecisionLike) -> None:
        self.reason = decision.reason
        first = decision.branch_ids[0].partition(":")[2] if decision.branch_ids else "none"
        ins = self._obs.instruments
        ins.of(ins.decisions, self.model, first, decision.reason).inc()
        self._child(
            "quantroute.routing",
            {
                "quantroute.route.reason": decision.reason,
                "quantroute.route.branches": list(decision.branch_ids),
            },
        )

    def bind(self, request_id: str) -> None:
        self.request_id = self.log.request_id = request_id
        if self._span is not None:
            self._span.set_attribute("gen_ai.response.id", request_id)

    def skipped(self, branch: BranchLike, reason: str) -> None:
        """Passed over without a try (``breaker_open``, ``retry_budget``)."""
        self._pending.append((branch.name, reason))

    def attempt(self, branch: BranchLike) -> None:
        """Trying ``branch`` now (after the fallbacks pending, if any)."""
        self._fall_to(branch.name)
        self.branch = branch
        self.log.branch = branch.id
        if self._span is not None and self._obs.tracing.tracer is not None:
            from opentelemetry.trace import set_span_in_context

            kld = branch.profile.mean_kld if branch.profile is not None else None
            attributes: dict[str, str | float] = {
                "quantroute.branch": branch.id,
                "quantroute.precision": str(branch.precision),
                "quantroute.device": self._obs.device_of(branch.id) or "",
                "gen_ai.response.model": branch.id,
            }
            if kld is not None:
                attributes["quantroute.profile.kld"] = kld
            self._gen = self._obs.tracing.tracer.start_span(
                "quantroute.generation",
                context=set_span_in_context(self._span),
                attributes=attributes,
            )

    def carry(self, request: R) -> R:
        """``request`` with this generation's trace context, for its engine to pass on."""
        if self._gen is None:
            return request
        from opentelemetry.trace import set_span_in_context

        context = self._obs.tracing.inject(set_span_in_context(self._gen, self._context))
        return dataclasses.replace(request, trace_context=context)

    def attempt_failed(self, branch: BranchLike, exc: BaseException) -> None:
        """``branch`` failed before its first token; the request may fall back."""
        reason = reason_of(exc)
        self._pending.append((branch.name, reason))
        self._end_generation(reason)

    def first_token(self, cached_tokens: int = 0) -> None:
        """Every choice has its first token: the commit point. ``cached_tokens`` of the
        prompt tokens (counted once per prompt) came from the engine's prompt cache."""
        self.committed = True
        self.ttft_s = _perf() - self.t0
        assert self.branch is not None
        ins = self._obs.instruments
        ins.of(ins.ttft, self.model, self.branch.name).observe(self.ttft_s)
        if cached_tokens:
            self._obs.prompt_cache_hit(self.model, self.branch.name, cached_tokens)
        if self._gen is not None:
            self._gen.add_event("gen_ai.first_token", {"quantroute.ttft_s": self.ttft_s})

    def token(self, index: int) -> None:
        """A token of choice ``index`` reached the gateway (the hot path: a clock read
        and an append; the gaps are counted when the request ends)."""
        try:
            self._stamps[index].append(_perf())
        except KeyError:
            self._stamps[index] = [_perf()]

    def choice_finished(self, index: int, event: FinishLike) -> None:
        if index % self.n == 0:
            self.prompt_tokens += event.prompt_tokens
        self.completion_tokens += event.completion_tokens
        self.finish_reasons.append(str(event.reason))
        draft = self.branch.draft if event.drafted and self.branch is not None else None
        if draft is not None:
            self._speculated(draft, event)
        if self._gen is not None and len(event.worker_ns) >= 3:
            self._decode_span(index, event, draft)

    def _speculated(self, draft: str, event: FinishLike) -> None:
        """Count what the branch's draft proposed and what the branch kept of it."""
        assert self.branch is not None
        ins, labels = (
            self._obs.instruments,
            (self.model, self.branch.name, draft.rpartition(":")[2]),
        )
        ins.of(ins.drafted_tokens, *labels).inc(event.drafted)
        ins.of(ins.accepted_tokens, *labels).inc(event.accepted)

    def choice_cut(self, index: int, prompt_tokens: int, completion_tokens: int) -> None:
        """Choice ``index`` ended unfinished (the client left, the engine failed): what it
        used counts all the same, its prompt (once per prompt) and the tokens it sent."""
        if index % self.n == 0:
            self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def done(self, ok: bool | None) -> None:
        """The run is over: every choice finished (``True``), the engine failed one
        (``False``), or the client left (``None``)."""
        self.finish(200 if ok else FAILED_MID_STREAM if ok is False else CLIENT_GONE)

    @contextlib.contextmanager
    def failing(self) -> Iterator[None]:
        """Around a step that may raise: an error ends the request with its status."""
        try:
            yield
        except QuantrouteError as exc:
            self.finish(exc.status, exc)
            raise
        except asyncio.CancelledError:
            self.finish(CLIENT_GONE)
            raise
        except BaseException as exc:
            self.finish(500, exc)
            raise

    # -- the end --------------------------------------------------------------

    def finish(self, status: int, error: BaseException | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self._fall_to("none")
        duration_s = _perf() - self.t0
        branch = self.branch.name if self.committed and self.branch is not None else "none"
        m, ins, code = self.model, self._obs.instruments, str(status)
        ins.of(ins.requests, m, branch, self.tenant, code).inc()
        ins.of(ins.duration, m, branch, code).observe(duration_s)
        if self.committed:
            ins.of(ins.prompt_tokens, m, branch, self.tenant).inc(self.prompt_tokens)
            ins.of(ins.completion_tokens, m, branch, self.tenant).inc(self.completion_tokens)
            self._merge_gaps(m, branch)
        self._obs.recent.add(self, status, duration_s, time.time())
        if self._obs.settings.access_log and ACCESS.isEnabledFor(logging.INFO):
            self._access(status, branch, duration_s, error)
        if self._span is not None:
            self._end_spans(status, error)
        self.log.open = False

    def _merge_gaps(self, model: str, branch: str) -> None:
        gaps = self._obs.instruments.token_gaps
        counts, total, bucket = gaps.local(), 0.0, gaps.bucket
        for stamps in self._stamps.values():
            for before, after in itertools.pairwise(stamps):
                counts[bucket(after - before)] += 1
                total += after - before
        if total or any(counts):
            gaps.merge(model, branch, counts, total)

    def _access(
        self, status: int, branch: str, duration_s: float, error: BaseException | None
    ) -> None:
        level = logging.INFO if status < 500 else logging.WARNING
        ACCESS.log(
            level,
            "%s %s %d %s tokens=%d+%d ttft_ms=%s duration_ms=%.1f",
            self.kind,
            self.model,
            status,
            branch,
            self.prompt_tokens,
            self.completion_tokens,
            "-" if self.ttft_s is None else f"{self.ttft_s * 1000:.1f}",
            duration_s * 1000,
            extra={
                "request_id": self.request_id,
                "trace_id": self.log.trace_id,
                "tenant": self.tenant,
                "branch": self.branch.id if self.branch is not None else "",
                "model": self.model,
                "kind": self.kind,
                "status": status,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "ttft_ms": None if self.ttft_s is None else round(self.ttft_s * 1000, 3),
                "duration_ms": round(duration_s * 1000, 3),
                "route_reason": self.reason,
                "fallbacks": len(self.fallbacks),
                "stream": self.stream,
                "error": None if error is None else reason_of(error),
            },
        )

    def _fall_to(self, to: str) -> None:
        for source, reason in self._pending:
            self.fallbacks.append((source, to, reason))
            ins = self._obs.instruments
            ins.of(ins.fallbacks, self.model, source, to, reason).inc()
            if self._span is not None:
                self._span.add_event(
                    "quantroute.fallback",
                    {
                        "quantroute.fallback.from": source,
                        "quantroute.fallback.to": to,
                        "quantroute.fallback.reason": reason,
                    },
                )
        self._pending.clear()

    # -- spans ------------------------------------------------------------------

    def _child(self, name: str, attributes: Mapping[str, Any]) -> None:
        """A finished child span of the request, from the last mark until now."""
        tracer = self._obs.tracing.tracer
        if self._span is None or tracer is None:
            return
        from opentelemetry.trace import set_span_in_context

        now = time.time_ns()
        span = tracer.start_span(
            name,
            context=set_span_in_context(self._span),
            attributes=attributes,
            start_time=self._mark_ns,
        )
        span.end(end_time=now)
        self._mark_ns = now

    def _decode_span(self, index: int, event: FinishLike, draft: str | None) -> None:
        tracer = self._obs.tracing.tracer
        assert tracer is not None and self._gen is not None
        from opentelemetry.trace import set_span_in_context

        admitted, slot, *_, end = event.worker_ns
        span = tracer.start_span(
            "quantroute.decode",
            context=set_span_in_context(self._gen),
            attributes={
                "quantroute.choice": index,
                "gen_ai.usage.input_tokens": event.prompt_tokens,
                "gen_ai.usage.output_tokens": event.completion_tokens,
                "quantroute.worker.queued_s": (slot - admitted) / 1e9,
            },
            start_time=slot,
        )
        if draft is not None:  # speculated: the draft, and how much of it the branch kept
            span.set_attributes(
                {
                    "quantroute.speculative.draft": draft,
                    "quantroute.speculative.drafted": event.drafted,
                    "quantroute.speculative.accepted": event.accepted,
                    "quantroute.speculative.acceptance_rate": event.accepted / event.drafted,
                    "quantroute.speculative.k": event.mean_k,
                }
            )
        span.add_event("quantroute.worker.admitted", timestamp=admitted)
        span.end(end_time=end)

    def _end_generation(self, error: str | None) -> None:
        if self._gen is None:
            return
        from opentelemetry.trace import Status, StatusCode

        if error is not None:
            self._gen.set_attribute("error.type", error)
            self._gen.set_status(Status(StatusCode.ERROR, error))
        self._gen.end()
        self._gen = None

    def _end_spans(self, status: int, error: BaseException | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        assert self._span is not None
        span = self._span
        span.set_attributes(
            {
                "http.response.status_code": status,
                "gen_ai.usage.input_tokens": self.prompt_tokens,
                "gen_ai.usage.output_tokens": self.completion_tokens,
                "gen_ai.response.finish_reasons": self.finish_reasons,
                "quantroute.tenant": self.tenant,
                "quantroute.route.reason": self.reason,
                "quantroute.fallbacks": len(self.fallbacks),
            }
        )
        if self.branch is not None and self.committed:
            span.set_attributes(
                {"quantroute.branch": self.branch.id, "gen_ai.response.model": self.branch.id}
            )
        failed = error is not None or status >= 500
        why = reason_of(error) if error is not None else str(status)
        self._end_generation(why if failed and not self.committed else None)
        if failed:
            span.set_attribute("error.type", why)
            span.set_status(Status(StatusCode.ERROR, why))
        span.end()
        self._span = None


class NullTrace(RequestTrace):
    """The trace of a job built without a service (tests): every step does nothing."""

    def __init__(self) -> None:
        self.closed = True

    def admitted(self, model: str, waited_s: float) -> None:
        pass

    def routed(self, decision: DecisionLike) -> None:
        pass

    def bind(self, request_id: str) -> None:
        pass

    def skipped(self, branch: BranchLike, reason: str) -> None:
        pass

    def attempt(self, branch: BranchLike) -> None:
        pass

    def carry(self, request: R) -> R:
        return request

    def attempt_failed(self, branch: BranchLike, exc: BaseException) -> None:
        pass

    def first_token(self, cached_tokens: int = 0) -> None:
        pass

    def token(self, index: int) -> None:
        pass

    def choice_finished(self, index: int, event: FinishLike) -> None:
        pass

    def choice_cut(self, index: int, prompt_tokens: int, completion_tokens: int) -> None:
        pass

    def finish(self, status: int, error: BaseException | None = None) -> None:
        pass


NULL_TRACE = NullTrace()
