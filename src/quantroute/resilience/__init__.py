"""Resilience: circuit breakers per branch, the retry budget, tenants, admission and
resumable streams."""

from __future__ import annotations

from quantroute.resilience.admission import Admission, Ticket
from quantroute.resilience.breaker import BreakerPolicy, Breakers, BreakerState, CircuitBreaker
from quantroute.resilience.budget import RetryBudget
from quantroute.resilience.resume import StreamStore
from quantroute.resilience.stream import Stream
from quantroute.resilience.tenants import OPEN, Tenant, TenantLimits, Tenants, load_tenants

__all__ = [
    "OPEN",
    "Admission",
    "BreakerPolicy",
    "BreakerState",
    "Breakers",
    "CircuitBreaker",
    "RetryBudget",
    "Stream",
    "StreamStore",
    "Tenant",
    "TenantLimits",
    "Tenants",
    "Ticket",
    "load_tenants",
]
