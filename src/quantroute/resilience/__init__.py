"""Resilience: circuit breakers per branch and the retry budget."""

from __future__ import annotations

from quantroute.resilience.breaker import BreakerPolicy, Breakers, BreakerState, CircuitBreaker
from quantroute.resilience.budget import RetryBudget

__all__ = ["BreakerPolicy", "BreakerState", "Breakers", "CircuitBreaker", "RetryBudget"]
