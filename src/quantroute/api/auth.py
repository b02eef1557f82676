"""Keys: client keys name a tenant; the admin key opens ``/admin/*``.

- ``/v1/*`` completions, chat, models (and explain, ``/metrics`` where the
  settings say): ``Authorization: Bearer <key>`` of a tenant
  (``auth.tenants_file``); without tenants configured the API is open. The admin
  key reads the model list too (not generate: it is not a tenant's).
- ``/admin/*``: ``Authorization: Bearer <server.admin_key>``; without a
  configured key they are closed (403), so a fresh install exposes no
  operator action.

Keys are compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request

from quantroute.errors import AuthenticationError, PermissionDeniedError
from quantroute.resilience.tenants import OPEN, Tenant, Tenants


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _is_admin(request: Request, token: str | None) -> bool:
    key = request.app.state.settings.server.admin_key
    return (
        key is not None
        and token is not None
        and hmac.compare_digest(token.encode(), key.get_secret_value().encode())
    )


async def require_admin(request: Request) -> None:
    """A FastAPI dependency: pass only with the admin key."""
    if request.app.state.settings.server.admin_key is None:
        raise PermissionDeniedError(
            "admin endpoints are closed: no admin key is configured (server.admin_key)"
        )
    if not _is_admin(request, bearer_token(request)):
        raise AuthenticationError("admin endpoints need the admin key as a Bearer token")


async def require_client(request: Request) -> Tenant:
    """A FastAPI dependency: the tenant of the request's key (anyone while the API is open)."""
    tenants: Tenants = request.app.state.tenants
    if tenants.open:
        return OPEN
    tenant = tenants.find(bearer_token(request))
    if tenant is None:
        raise AuthenticationError("a valid API key is needed (Authorization: Bearer <key>)")
    return tenant


async def require_reader(request: Request) -> Tenant:
    """A dependency for the model list: the tenant of a client key, or, for the admin key,
    every model (the status page reads it with whichever key it was given)."""
    if _is_admin(request, bearer_token(request)):
        return OPEN
    return await require_client(request)


def sees_everyone(request: Request) -> bool:
    """Whether the caller may see other tenants' requests: the admin, or anyone while the
    API is open."""
    tenants: Tenants = request.app.state.tenants
    return tenants.open or _is_admin(request, bearer_token(request))


def require_key_if(setting: str) -> Callable[[Request], Awaitable[None]]:
    """A dependency for read endpoints: a client or the admin key, when ``auth.<setting>``
    says so and tenants are configured."""

    async def check(request: Request) -> None:
        if not getattr(request.app.state.settings.auth, setting):
            return
        tenants: Tenants = request.app.state.tenants
        token = bearer_token(request)
        if tenants.open or _is_admin(request, token) or tenants.find(token) is not None:
            return
        raise AuthenticationError("a valid API key is needed (Authorization: Bearer <key>)")

    return check
