"""Each branch's live end-to-end speed, as the requests it served saw it.

The profile's ``prefill_tps`` / ``decode_tps`` are the engine's speed alone, measured
idle; a request also pays the admission queue, the slot wait, batching with the other
sequences and the gateway, 3-8x slower on the demo machine. :class:`ObservedSpeeds`
keeps, per branch, an exponentially weighted mean of two figures fed when a request
finishes (``Gateway.finished``): its time to first token, from when the engine got it
(past the admission queue: a request that waited there is routed with the deadline it
has left), and its time per output token after the first. Requests whose reader fell
behind (the engine held them, or the run's buffer waited), and those a replaced worker
served, are left out. The deadline filter predicts with them once a
branch has observations, never a first token sooner than the profile's prefill of the
request's prompt (an average of short prompts says nothing of a long one), and with
the profile before (or after ``max_age_s``
without one: a branch that a slow burst made look slow gets traffic again, and so new
observations, rather than being shunned forever on old news).

Times per token are averaged rather than rates, because latency adds up per token: the
mean of 1 ms and 9 ms per token predicts 5 ms, the right mean time, where the mean of
1000 and 111 tok/s would predict 1.8 ms.

Routing reads the estimates in steps (:meth:`ObservedSpeeds.table`): a branch's entry
there is replaced only when one of its figures moved by more than :data:`STEP` of its
mean since the entry was published, or ``max_age_s / 8`` went by. Every finished request
moves the mean a little; were each move a new entry, the branch's routing record would be
rebuilt and ranked afresh on every request (about half of a decision's cost), for a
difference far inside the estimate's own noise.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["STEP", "ObservedSpeed", "ObservedSpeeds", "observe_finished"]

STEP = 1 / 16  # routing's table moves when a figure moved by more than this of its mean


@dataclass(frozen=True, slots=True)
class ObservedSpeed:
    """One branch's observed speed: ``ttft_ms`` (arrival to first token) and ``tpot_ms``
    (time per output token after the first; ``None`` until a request had two tokens),
    over ``samples`` requests, the last at ``at`` (monotonic seconds); ``*_dev_ms``
    their spread (weighted mean absolute deviation, as TCP's retransmit timer keeps)."""

    ttft_ms: float
    tpot_ms: float | None
    samples: int
    at: float
    ttft_dev_ms: float = 0.0  # mean absolute deviation of each (Jacobson's RTT estimator)
    tpot_dev_ms: float = 0.0

    @property
    def decode_tps(self) -> float | None:
        """Output tokens per second after the first, end to end."""
        return 1000.0 / self.tpot_ms if self.tpot_ms else None


class ObservedSpeeds:
    """``observe`` a finished request; ``get`` a branch's current estimate (or ``None``)."""

    def __init__(self, weight: float = 0.2, max_age_s: float = 60.0):
        if not 0.0 < weight <= 1.0:
            raise ValueError("weight must be in (0, 1]")
        self._weight = weight
        self._max_age_s = max_age_s
        self._speeds: dict[str, ObservedSpeed] = {}
        self._published: dict[str, ObservedSpeed] = {}  # what routing reads: see the module

    def observe(
        self,
        branch_id: str,
        ttft_s: float,
        completion_tokens: int,
        decode_s: float,
        now: float | None = None,
    ) -> ObservedSpeed:
        """A request on ``branch_id`` got its first token ``ttft_s`` after it arrived,
        then ``completion_tokens - 1`` more in ``decode_s``."""
        now = time.monotonic() if now is None else now
        ttft_ms = max(0.0, 1000.0 * ttft_s)
        # below two tokens there is no gap between tokens to learn from (-1)
        tpot_ms = (
            1000.0 * max(0.0, decode_s) / (completion_tokens - 1) if completion_tokens > 1 else -1.0
        )
        old = self.get(branch_id, now)
        if old is None:  # the spread starts at half the first sample, as Jacobson's does
            tpot = tpot_ms if tpot_ms >= 0 else None
            new = ObservedSpeed(ttft_ms, tpot, 1, now, ttft_ms / 2, (tpot or 0.0) / 2)
        else:
            w = self._weight
            tpot, tpot_dev = old.tpot_ms, old.tpot_dev_ms
            if tpot_ms >= 0 and tpot is None:
                tpot, tpot_dev = tpot_ms, tpot_ms / 2
            elif tpot_ms >= 0 and tpot is not None:
                tpot_dev += w * (abs(tpot_ms - tpot) - tpot_dev)
                tpot += w * (tpot_ms - tpot)
            new = ObservedSpeed(
                old.ttft_ms + w * (ttft_ms - old.ttft_ms),
                tpot,
                old.samples + 1,
                now,
                old.ttft_dev_ms + w * (abs(ttft_ms - old.ttft_ms) - old.ttft_dev_ms),
                tpot_dev,
            )
        self._speeds[branch_id] = new
        shown = self._published.get(branch_id)
        if shown is None or new.at - shown.at > self._max_age_s / 8 or _moved(shown, new):
            self._published[branch_id] = new
        return new

    def table(self) -> tuple[Mapping[str, ObservedSpeed], float]:
        """Every branch's estimate in steps (see the module: each figure within
        :data:`STEP` of :meth:`get`'s, the same object until it moves), read only, and
        ``max_age_s``: for routing, which reads many branches per request without a call
        per branch; an entry older than ``max_age_s`` counts as none, as in :meth:`get`."""
        return self._published, self._max_age_s

    def get(self, branch_id: str, now: float | None = None) -> ObservedSpeed | None:
        """The estimate, or ``None`` with no observation within ``max_age_s``."""
        speed = self._speeds.get(branch_id)
        if speed is None:
            return None
        now = time.monotonic() if now is None else now
        return speed if now - speed.at <= self._max_age_s else None

    def to_json(self, branch_id: str) -> dict[str, float | int | None] | None:
        """The branch's estimate for ``/v1/models`` (``None`` while it has none)."""
        speed = self.get(branch_id)
        if speed is None:
            return None
        return {
            "ttft_ms": round(speed.ttft_ms, 3),
            "decode_tps": None if speed.decode_tps is None else round(speed.decode_tps, 1),
            "ttft_dev_ms": round(speed.ttft_dev_ms, 3),
            "samples": speed.samples,
            "age_s": round(time.monotonic() - speed.at, 3),
        }

    def forget(self, branch_id: str) -> None:
        """A branch whose worker or file changed: what it did before says nothing now."""
        self._speeds.pop(branch_id, None)
        self._published.pop(branch_id, None)


def _moved(shown: ObservedSpeed, new: ObservedSpeed) -> bool:
    """Whether a figure of ``new`` is more than :data:`STEP` of its mean from ``shown``'s
    (a deviation counts against the mean it spreads around)."""
    ttft, tpot = shown.ttft_ms, shown.tpot_ms
    if (
        abs(new.ttft_ms - ttft) > STEP * ttft
        or abs(new.ttft_dev_ms - shown.ttft_dev_ms) > STEP * ttft
    ):
        return True
    if tpot is None or new.tpot_ms is None:
        return tpot is not new.tpot_ms
    return (
        abs(new.tpot_ms - tpot) > STEP * tpot
        or abs(new.tpot_dev_ms - shown.tpot_dev_ms) > STEP * tpot
    )


def observe_finished(
    speeds: ObservedSpeeds,
    branch_id: str,
    trace: object,
    completion_tokens: int,
    opened: float | None = None,
    held: bool = False,
) -> ObservedSpeed | None:
    """Feed ``speeds`` one request that just finished on ``branch_id``, from its trace
    (``observability.requests.RequestTrace``: ``t0`` its arrival and ``ttft_s`` on the
    ``perf_counter`` clock) and ``opened``, when the engine got it (``perf_counter``).

    The time to first token is counted from ``opened``, past the admission queue: a
    request is routed with what the queue left of its deadline, and the deadline filter
    adds the requests ahead on the branch itself, so a figure that held a queue would
    count it twice. Left out: a request that fell back (its first token waited for
    another branch's failure), one without a first token, and one ``held`` because its
    reader fell behind (its decode time is the client's reading time)."""
    ttft_s = getattr(trace, "ttft_s", None)
    t0 = getattr(trace, "t0", None)
    if ttft_s is None or t0 is None or held or getattr(trace, "fallbacks", None):
        return None
    first = t0 + ttft_s
    decode_s = time.perf_counter() - first
    since = t0 if opened is None else min(max(opened, t0), first)
    return speeds.observe(branch_id, first - since, completion_tokens, decode_s)
