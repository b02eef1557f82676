"""The runner's rules, on plain data (``api/runner.py``): a :class:`Runner` built from a
route table of fake engines, circuit breakers, a retry budget and a decision.

- Before a branch's first token (the commit point) its failure moves the job to the
  decision's next branch, within the retry budget, and counts on its breaker; except a
  ``device_out_of_memory`` (the device's state), which moves on uncounted, and a request
  error (the context length, any ``InvalidRequestError``), which ends the job there.
- After the first token an error ends the stream: no fallback.
- A branch whose breaker is open is passed over, uncounted; that is no retry.
- A pinned request's decision holds its one branch: it never falls back.
- A job's deadline passing before its first token is a 503 of its own: no fallback.
- A lone branch's failure is its own error; several branches' failures are a 503.
- A branch a reload replaced runs on its successor where that is as faithful (a pinned
  one: whatever its id names now), and its old worker's failure counts on no breaker.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from quantroute.api.jobs import Job
from quantroute.api.run import Run
from quantroute.api.runner import Runner
from quantroute.engines.base import (
    EngineEvent,
    GenerationRequest,
    SamplingParams,
    StartEvent,
    TokenEvent,
)
from quantroute.engines.fake import FakeEngine, FakeFaults
from quantroute.errors import (
    ContextLengthExceededError,
    DeviceOutOfMemoryError,
    EngineCrashedError,
    EngineUnavailableError,
    InvalidRequestError,
    QuantrouteError,
    ServiceUnavailableError,
    UnsupportedByBranchError,
)
from quantroute.registry.manifest import BranchArtifact
from quantroute.resilience import BreakerPolicy, Breakers, RetryBudget, TenantLimits
from quantroute.routing.policy import Decision, pinned
from quantroute.routing.table import Branch, ModelRoute, RouteTable, RouteTableRef
from quantroute.types import Precision

MODEL = "m"
RETRY_AFTER_S = 7.0
FIRST_TOKEN_TIMEOUT_S = 0.2


class _Failing(FakeEngine):
    """Starts every request, then fails it with ``error`` before its first token."""

    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        self.requests.append(request)
        yield StartEvent(1)
        raise self.error


def _branch(
    name: str,
    engine: FakeEngine,
    *,
    sha: str = "0" * 64,
    kld: float | None = None,
    kind: str = "fake",
) -> Branch:
    artifact = BranchArtifact(
        MODEL, name, Precision(name), kind, Path(f"/{name}.gguf"), sha, 0, name == "f16"
    )
    profile = None if kld is None else SimpleNamespace(mean_kld=kld, top1=0.99)
    return Branch(MODEL, name, Precision(name), artifact, engine, profile)  # type: ignore[arg-type]


def _table(*branches: Branch) -> RouteTable:
    return RouteTable.build([ModelRoute(MODEL, "f16", tuple(branches))])


@dataclass
class _Parts:
    """A runner and the parts it was handed."""

    runner: Runner
    breakers: Breakers
    budget: RetryBudget
    routes: RouteTableRef
    finished: list[tuple[str, list[int]]] = field(default_factory=list)


def _parts(
    table: RouteTable, *, budget: RetryBudget | None = None, failures_to_open: int = 5
) -> _Parts:
    routes = RouteTableRef(table)
    breakers = Breakers(BreakerPolicy(failures_to_open=failures_to_open))
    budget = budget or RetryBudget(ratio=0.2, min_retries=3)
    finished: list[tuple[str, list[int]]] = []

    def on_finished(run: Run, tokens: list[int]) -> None:
        finished.append((run.branch.id, list(tokens)))

    runner = Runner(
        routes,
        breakers,
        budget,
        TenantLimits(),
        first_token_timeout_s=FIRST_TOKEN_TIMEOUT_S,
        retry_after_s=RETRY_AFTER_S,
        finished=on_finished,
    )
    return _Parts(runner, breakers, budget, routes, finished)


def _job(
    branches: Sequence[Branch],
    *,
    pin: bool = False,
    deadline: float | None = None,
    max_tokens: int = 4,
) -> Job:
    ids = tuple(b.id for b in branches)
    decision = (
        pinned(MODEL, ids[0], ready=True, retry_after_s=RETRY_AFTER_S)
        if pin
        else Decision(MODEL, ids, "test")
    )
    sampling = SamplingParams(max_tokens=max_tokens, deadline=deadline)
    request = GenerationRequest("job.0", "hello", sampling)
    return Job(
        id="job",
        kind="completion",
        decision=decision,
        branches=tuple(branches),
        requests=(request,),
        n=1,
        stream=False,
        include_usage=False,
        logprobs=False,
        deadline=deadline,
    )


async def _started(*engines: FakeEngine) -> None:
    for engine in engines:
        await engine.start()


async def _read(run: Run) -> list[EngineEvent]:
    return [event async for _, event in run.events()]


def _failures(parts: _Parts, *branches: Branch) -> list[int]:
    return [parts.breakers.get(b.id).failures for b in branches]


FIRST_FAILS: list[tuple[str, Callable[[], FakeEngine], int, type[QuantrouteError] | None]] = [
    # (what the first branch does, failures on its breaker, what the job raises: None when
    # the next branch answers)
    ("refused", lambda: FakeEngine(faults=FakeFaults(refuse=True)), 1, None),
    ("crashed", lambda: _Failing(EngineCrashedError("died")), 1, None),
    ("no-first-token-in-time", lambda: FakeEngine(token_delay_s=10.0), 1, None),
    ("device-out-of-memory", lambda: _Failing(DeviceOutOfMemoryError("no memory")), 0, None),
    (
        "context-length",
        lambda: _Failing(ContextLengthExceededError(prompt_tokens=9, max_tokens=9, n_ctx=8)),
        0,
        ContextLengthExceededError,
    ),
    ("request-error", lambda: _Failing(InvalidRequestError("bad")), 0, InvalidRequestError),
]


@pytest.mark.parametrize(
    ("make", "counted", "raised"),
    [pytest.param(*row[1:], id=row[0]) for row in FIRST_FAILS],
)
async def test_a_failure_before_the_first_token(
    make: Callable[[], FakeEngine], counted: int, raised: type[QuantrouteError] | None
) -> None:
    first, second = make(), FakeEngine()
    await _started(first, second)
    a, b = _branch("q8_0", first), _branch("q4_k_m", second)
    parts = _parts(_table(_branch("f16", FakeEngine()), a, b))
    job = _job([a, b])
    if raised is None:  # the next branch answers, as one retry of the budget
        run = await parts.runner.start(job)
        assert run.branch is b
        assert parts.budget.retrying == 1
        assert len(await _read(run)) == 1 + 4 + 1  # start, 4 tokens, finish
        assert parts.finished == [(b.id, [ord(c) for c in second.text[:4]])]
    else:  # the request's fault: not the branch's, and no other branch would take it
        with pytest.raises(raised) as info:
            await parts.runner.start(job)
        assert second.requests == []
        if raised is ContextLengthExceededError:
            assert info.value.param == "prompt"  # a completion's; a chat's: "messages"
    assert _failures(parts, a, b) == [counted, 0]
    assert (parts.budget.active, parts.budget.retrying) == (0, 0)


async def test_after_the_first_token_an_error_ends_the_stream() -> None:
    first, second = FakeEngine(faults=FakeFaults(crash_after=2)), FakeEngine()
    await _started(first, second)
    a, b = _branch("q8_0", first), _branch("q4_k_m", second)
    parts = _parts(_table(a, b))
    run = await parts.runner.start(_job([a, b]))
    assert run.branch is a  # committed: its first token came
    events: list[EngineEvent] = []
    with pytest.raises(EngineCrashedError):
        async for _, event in run.events():
            events.append(event)
    assert sum(isinstance(e, TokenEvent) for e in events) == 2
    assert second.requests == []  # no fallback after the commit point
    assert _failures(parts, a, b) == [1, 0]  # counted on the branch that failed
    assert parts.finished == []  # it never finished
    assert (parts.budget.active, parts.budget.retrying) == (0, 0)


async def test_a_branch_whose_breaker_is_open_is_passed_over_and_that_is_no_retry() -> None:
    first, second = FakeEngine(), FakeEngine()
    await _started(first, second)
    a, b = _branch("q8_0", first), _branch("q4_k_m", second)
    # a budget that allows no retry at all: a skipped branch takes none of it
    parts = _parts(_table(a, b), budget=RetryBudget(ratio=0.0, min_retries=0), failures_to_open=1)
    parts.breakers.failure(a.id)
    assert parts.breakers.is_open(a.id)
    run = await parts.runner.start(_job([a, b]))
    assert run.branch is b and first.requests == []
    await _read(run)
    breaker = parts.breakers.get(a.id)
    assert (breaker.opens, breaker.failures) == (1, 0)  # its own rejection counts nothing
    assert parts.budget.refused == 0


@pytest.mark.parametrize(("min_retries", "tried"), [(0, 1), (1, 2), (2, 3)])
async def test_the_retry_budget_bounds_the_fallbacks(min_retries: int, tried: int) -> None:
    engines = [_Failing(EngineCrashedError("died")) for _ in range(3)]
    await _started(*engines)
    branches = [_branch(n, e) for n, e in zip(("f16", "q8_0", "q4_k_m"), engines, strict=True)]
    parts = _parts(_table(*branches), budget=RetryBudget(ratio=0.0, min_retries=min_retries))
    with pytest.raises(ServiceUnavailableError) as info:
        await parts.runner.start(_job(branches))
    assert info.value.retry_after_s == RETRY_AFTER_S
    assert [len(e.requests) for e in engines] == [1] * tried + [0] * (3 - tried)
    assert _failures(parts, *branches) == [1] * tried + [0] * (3 - tried)
    assert parts.budget.refused == (1 if tried < 3 else 0)
    assert (parts.budget.active, parts.budget.retrying) == (0, 0)


@pytest.mark.parametrize(
    ("pin", "n_branches", "raised"),
    [
        (True, 1, EngineUnavailableError),  # pinned: its branch alone, its own error
        (False, 1, EngineUnavailableError),  # a decision of one branch: the same
        (False, 2, ServiceUnavailableError),  # several failed: a 503 with Retry-After
    ],
)
async def test_a_failure_with_nothing_to_fall_back_to(
    pin: bool, n_branches: int, raised: type[QuantrouteError]
) -> None:
    refusing, spare = FakeEngine(faults=FakeFaults(refuse=True)), FakeEngine()
    others = [FakeEngine(faults=FakeFaults(refuse=True)) for _ in range(n_branches - 1)]
    await _started(refusing, spare, *others)
    a = _branch("q8_0", refusing)
    rest = [_branch(n, e) for n, e in zip(("q4_k_m", "q6_k"), others, strict=False)]
    spare_branch = _branch("f16", spare)  # in the table, never in the decision
    parts = _parts(_table(spare_branch, a, *rest))
    with pytest.raises(raised):
        await parts.runner.start(_job([a, *rest], pin=pin))
    assert spare.requests == []
    assert _failures(parts, a) == [1]


async def test_a_deadline_passing_before_the_first_token_does_not_fall_back() -> None:
    slow, second = FakeEngine(token_delay_s=10.0), FakeEngine()
    await _started(slow, second)
    a, b = _branch("q8_0", slow), _branch("q4_k_m", second)
    parts = _parts(_table(a, b))
    job = _job([a, b], deadline=time.monotonic() + 0.05)  # sooner than the first token's
    with pytest.raises(ServiceUnavailableError, match="deadline"):
        await parts.runner.start(job)
    assert second.requests == []
    assert _failures(parts, a, b) == [0, 0]  # the client's deadline, not the branch's fault


@pytest.mark.parametrize(
    ("new_sha", "new_kld", "pin", "runs_on"),
    [
        ("b" * 64, 0.05, False, "new"),  # the same file: its successor takes it
        ("c" * 64, 0.0005, False, "new"),  # a more faithful file: so does it
        ("c" * 64, 0.05, False, "old"),  # less faithful than the bound was checked against
        ("c" * 64, 0.05, True, "new"),  # pinned: whatever the id names now
    ],
)
async def test_a_job_routed_before_a_reload_runs_where_its_bound_holds(
    new_sha: str, new_kld: float, pin: bool, runs_on: str
) -> None:
    old, new = FakeEngine(), FakeEngine()
    await _started(old, new)
    routed = _branch("q8_0", old, sha="b" * 64, kld=0.001)
    successor = _branch("q8_0", new, sha=new_sha, kld=new_kld)
    parts = _parts(_table(_branch("f16", FakeEngine()), successor))  # after the swap
    run = await parts.runner.start(_job([routed], pin=pin))
    assert run.branch is (successor if runs_on == "new" else routed)
    await _read(run)
    assert [len(old.requests), len(new.requests)] == ([0, 1] if runs_on == "new" else [1, 0])


@pytest.mark.parametrize("pin", [False, True])
async def test_a_job_stays_on_the_engine_it_was_shaped_for(pin: bool) -> None:
    """A reload that makes the id another engine's (llama.cpp → a remote): the job's
    requests were built for the old one (a rendered prompt, no messages), so it runs
    there while that worker drains."""
    old, new = FakeEngine(), FakeEngine()
    await _started(old, new)
    routed = _branch("q8_0", old, sha="b" * 64, kld=0.001)
    successor = _branch("q8_0", new, sha="b" * 64, kld=0.001, kind="openai")
    parts = _parts(_table(_branch("f16", FakeEngine()), successor))
    run = await parts.runner.start(_job([routed], pin=pin))
    assert run.branch is routed
    await _read(run)
    assert [len(old.requests), len(new.requests)] == [1, 0]


async def test_a_replaced_workers_failure_counts_on_no_breaker() -> None:
    old, new = FakeEngine(faults=FakeFaults(refuse=True)), FakeEngine()
    await _started(old, new)
    routed = _branch("q8_0", old, sha="b" * 64, kld=0.001)
    successor = _branch("q8_0", new, sha="c" * 64, kld=0.05)  # less faithful: not taken
    parts = _parts(_table(_branch("f16", FakeEngine()), successor))
    with pytest.raises(ServiceUnavailableError):  # not the old worker's own error: a 503
        await parts.runner.start(_job([routed]))
    assert _failures(parts, routed) == [0]  # the id's breaker is its new worker's
    assert new.requests == []


async def test_a_finished_run_closes_its_branchs_half_open_breaker() -> None:
    engine = FakeEngine()
    await _started(engine)
    a = _branch("q8_0", engine)
    parts = _parts(_table(a), failures_to_open=1)
    breaker = parts.breakers.get(a.id)
    breaker.record_failure(time.monotonic() - 3600.0)  # opened an hour ago: half-open now
    run = await parts.runner.start(_job([a]))
    await _read(run)
    assert parts.breakers.closed(a.id) and breaker.opens == 0
    assert parts.finished == [(a.id, [ord(c) for c in engine.text[:4]])]


class _Unsupported(FakeEngine):
    """Refuses what the request asks at once, as a remote branch refuses ``tools``."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        raise UnsupportedByBranchError("tools are served by local branches only", param="tools")


async def test_a_branch_that_cannot_do_it_passes_the_request_on_uncounted() -> None:
    first, second = _Unsupported(), FakeEngine()
    await _started(first, second)
    a, b = _branch("q8_0", first), _branch("q4_k_m", second)
    parts = _parts(_table(_branch("f16", FakeEngine()), a, b))
    run = await parts.runner.start(_job([a, b]))
    assert run.branch is b
    assert parts.budget.retrying == 0  # the next branch is the first that ran: no retry
    assert _failures(parts, a, b) == [0, 0]
    assert len(await _read(run)) == 1 + 4 + 1


async def test_pinned_or_alone_what_a_branch_cannot_do_is_the_400() -> None:
    only = _Unsupported()
    await _started(only)
    a = _branch("q8_0", only)
    for pin in (True, False):
        parts = _parts(_table(_branch("f16", FakeEngine()), a))
        with pytest.raises(UnsupportedByBranchError) as info:
            await parts.runner.start(_job([a], pin=pin))
        assert info.value.status == 400 and info.value.param == "tools"
        assert _failures(parts, a) == [0]
