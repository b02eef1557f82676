"""The retry budget: retries may be at most a share of the requests in flight.

A failing branch makes every request it was given retry on the next one; without a
budget, an outage doubles the load on what is left. As in Envoy's retry budgets,
retries in flight may be at most ``ratio`` of the active requests, but never fewer
than ``min_retries`` (so a quiet server can still retry).

>>> budget = RetryBudget(ratio=0.2, min_retries=1)
>>> budget.start(); budget.start(); budget.try_retry(), budget.try_retry()
(True, False)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["RetryBudget"]


@dataclass(slots=True)
class RetryBudget:
    ratio: float = 0.2
    min_retries: int = 3
    active: int = field(default=0, init=False)  # requests being served
    retrying: int = field(default=0, init=False)  # retries in flight
    refused: int = field(default=0, init=False)  # retries the budget turned away, ever

    def start(self) -> None:
        self.active += 1

    def finish(self, retries: int) -> None:
        """A request is done; it had taken ``retries`` retries."""
        self.active = max(0, self.active - 1)
        self.retrying = max(0, self.retrying - retries)

    @property
    def limit(self) -> int:
        return max(self.min_retries, math.floor(self.ratio * self.active))

    def try_retry(self) -> bool:
        if self.retrying >= self.limit:
            self.refused += 1
            return False
        self.retrying += 1
        return True
