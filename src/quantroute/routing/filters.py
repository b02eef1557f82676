"""The hard filters: which branches may serve a request at all.

A branch is *feasible* when it passes all five; no score can bring back one
that fails:

=========  ===================================================================================
filter     passes when
=========  ===================================================================================
ready      the branch takes routed traffic (loaded, warmed up, not draining, not failed)
breaker    its circuit breaker is not open (``resilience.breaker``; half-open lets probes by)
quality    the requirement has no bound; or the branch is the reference (it meets any bound);
           or it is profiled, not degraded, ``mean_kld <= max_kld`` and ``top1 >= min_top1``.
           ``max_kld == 0`` admits only the reference: a measured zero on the calibration text
           is a sample, not a proof of identical outputs. An unprofiled or degraded (drift
           monitor) non-reference branch fails every bound, so only an unbounded tier
           (``fast``) can use it.
memory     ``device_free_bytes >= kv_bytes_per_token * (prompt_tokens + max_tokens)``
deadline   no deadline; or unknown speeds (passes, marked "unknown"); or the predicted latency
           ``queue wait + service`` is at most ``deadline_ms``. ``service`` is the branch's
           observed end-to-end speed when it has one (``max(observed_ttft_ms,
           prompt_tokens / prefill_tps) + (max_tokens - 1) * observed_tpot_ms``,
           ``routing.speeds``), else the profile's engine-only speed,
           ``prompt_tokens / prefill_tps + max_tokens / (decode_tps * decode_speedup)``
           (``decode_speedup``: a speculating reference's measured speed-up, for a
           request it drafts, ``RequestShape.drafted``; else 1)
=========  ===================================================================================

Queue wait is ``ahead * service / parallel``: ``ahead`` is ``queued``, plus
one when every slot is busy (``running >= parallel``); ``service`` is the
branch's ``mean_service_ms`` when the caller measures it, else this request's
own service time (the best guess of what the requests ahead of it cost).

:func:`evaluate` is the hot path: one pass, plain tuples, no formatting.
:func:`describe` turns its numbers into the explanation's words, only when
someone asks.
"""

from __future__ import annotations

from collections.abc import Sequence

from quantroute.routing.records import BranchState, RequestShape, Row
from quantroute.routing.requirement import Requirement

READY = 1
BREAKER = 2
QUALITY = 4
MEMORY = 8
DEADLINE = 16

NAMES: tuple[tuple[int, str], ...] = (
    (READY, "ready"),
    (BREAKER, "breaker"),
    (QUALITY, "quality"),
    (MEMORY, "memory"),
    (DEADLINE, "deadline"),
)


def evaluate(
    requirement: Requirement, request: RequestShape, branches: Sequence[BranchState]
) -> list[Row]:
    """Every branch's :data:`Row`, in input order."""
    max_kld = requirement.max_kld
    min_top1 = requirement.min_top1
    bounded = max_kld is not None or min_top1 is not None
    reference_only = max_kld is not None and max_kld <= 0.0
    deadline = requirement.deadline_ms
    prompt = request.prompt_tokens
    generate = request.max_tokens
    tokens = prompt + generate
    drafted = request.drafted
    rows: list[Row] = []
    append = rows.append
    for b in branches:
        fails = 0 if b.ready else READY
        if b.breaker_open:
            fails |= BREAKER
        if bounded and not b.is_reference:
            if reference_only or b.degraded:
                fails |= QUALITY
            else:
                kld = b.mean_kld
                top1 = b.top1
                if (max_kld is not None and (kld is None or kld > max_kld)) or (
                    min_top1 is not None and (top1 is None or top1 < min_top1)
                ):
                    fails |= QUALITY
        need = b.kv_bytes_per_token * tokens
        if need > b.device_free_bytes:
            fails |= MEMORY
        decode = b.decode_tps and b.decode_tps * (b.decode_speedup if drafted else 1.0)
        ttft = b.observed_ttft_ms
        prefill = b.prefill_tps
        if ttft is not None:  # what requests on this branch saw lately, end to end
            if prefill:  # never sooner than the engine alone prefills this prompt
                ttft = max(ttft, 1000.0 * prompt / prefill)
            tpot = b.observed_tpot_ms
            if tpot is None and decode:
                tpot = 1000.0 / decode
            service = None if tpot is None else ttft + (generate - 1 if generate else 0) * tpot
        else:
            service = (
                1000.0 * (prompt / prefill + generate / decode) if prefill and decode else None
            )
        if service is not None:
            parallel = b.parallel if b.parallel > 0 else 1
            ahead = b.queued + (1 if b.running >= parallel else 0)
            if ahead:
                mean = b.mean_service_ms
                predicted = service + ahead * (service if mean is None else mean) / parallel
            else:
                predicted = service
            if deadline is not None and predicted > deadline:
                fails |= DEADLINE
            append((fails, need, service, predicted))
        else:
            append((fails, need, None, None))
    return rows


def spread_ms(b: BranchState, max_tokens: int) -> float:
    """The spread of ``b``'s observed prediction for ``max_tokens``: its first token's
    deviation plus one per-token deviation for each later token (0 before observations)."""
    return b.observed_ttft_dev_ms + max(0, max_tokens - 1) * b.observed_tpot_dev_ms


def describe(
    requirement: Requirement, branch: BranchState, row: Row, drafted: bool = True
) -> tuple[tuple[str, bool, str], ...]:
    """``(filter, passed, reason)`` for each filter, in the order of :data:`NAMES`
    (``drafted``: :attr:`RequestShape.drafted`)."""
    fails, need, _, predicted = row
    return tuple(
        (name, not fails & bit, _reason(bit, requirement, branch, need, predicted, drafted))
        for bit, name in NAMES
    )


def _reason(
    bit: int,
    requirement: Requirement,
    b: BranchState,
    need: int,
    predicted: float | None,
    drafted: bool = True,
) -> str:
    if bit == READY:
        return "ready" if b.ready else "not ready"
    if bit == BREAKER:
        return "open" if b.breaker_open else "closed"
    if bit == QUALITY:
        return _quality_reason(requirement, b)
    if bit == MEMORY:
        verdict = "<=" if need <= b.device_free_bytes else ">"
        return f"needs {need} B {verdict} {b.device_free_bytes} B free on {b.device}"
    if predicted is None:
        return "unknown speed"
    source = "observed" if b.observed_ttft_ms is not None else "profile"
    if source == "profile" and drafted and b.decode_speedup != 1.0:
        source = f"profile, drafting x{b.decode_speedup:.2f}"
    if requirement.deadline_ms is None:
        return f"predicted {predicted:.1f} ms ({source} speed), no deadline"
    verdict = "<=" if predicted <= requirement.deadline_ms else ">"
    return (
        f"predicted {predicted:.1f} ms ({source} speed) {verdict} "
        f"deadline {requirement.deadline_ms:g} ms"
    )


def _quality_reason(requirement: Requirement, b: BranchState) -> str:
    max_kld, min_top1 = requirement.max_kld, requirement.min_top1
    if max_kld is None and min_top1 is None:
        return "no bound"
    if b.is_reference:
        return "reference"
    if max_kld is not None and max_kld <= 0.0:
        return "only the reference meets max_kld 0"
    if b.degraded:
        return "degraded by the drift monitor"
    if (max_kld is not None and b.mean_kld is None) or (min_top1 is not None and b.top1 is None):
        return "unprofiled"
    parts = []
    if max_kld is not None and b.mean_kld is not None:
        parts.append(
            f"mean_kld {b.mean_kld:.3g} {'<=' if b.mean_kld <= max_kld else '>'} {max_kld:g}"
        )
    if min_top1 is not None and b.top1 is not None:
        parts.append(f"top1 {b.top1:.3g} {'>=' if b.top1 >= min_top1 else '<'} {min_top1:g}")
    return ", ".join(parts)
