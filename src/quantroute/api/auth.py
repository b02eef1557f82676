"""Keys: client keys name a tenant; the admin key opens ``/admin/*``.

- ``/v1/*`` completions, chat, models (and explain, where the settings say):
  ``Authorization: Bearer <key>`` of a tenant (``auth.tenants_file``); without
  tenants configured the API is open. A tenant sees only the models its key may
  use, in lists, 404s and explanations alike. The admin key reads the model list
  too (not generate: it is not a tenant's).
- What shows every tenant and model (``/metrics``, ``/dashboard/data``,
  ``/v1/devices``, ``/readyz``'s details), with tenants configured and
  ``auth.protect_metrics`` (the default): the admin key or the read-only
  ``server.metrics_key``, never a client key.
- ``/admin/*``: ``Authorization: Bearer <server.admin_key>``; without a
  configured key they are closed (403), so a fresh install exposes no
  operator action.
- Request ids (the status page's last requests) only to the admin or the
  metrics key, an open API included: an id is what a stream is resumed by.
- A stream is resumed by its tenant only; with an open API, where everyone is
  the same ``anonymous``, only with the secret its first response carried
  (``x-quantroute-stream-token``).

Keys are compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request
from pydantic import SecretStr

from quantroute.errors import AuthenticationError, PermissionDeniedError
from quantroute.resilience.tenants import OPEN, Tenant, Tenants


def bearer_token(request: Request) -> str | None:
    """The request's Bearer key; none when it sends no ``Authorization`` or several (which
    one counts would be a guess, and a proxy that adds its own must not pass for a key)."""
    values = request.headers.getlist("authorization")
    if len(values) != 1:
        return None
    scheme, _, token = values[0].partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _is_admin(request: Request, token: str | None) -> bool:
    return _matches(request.app.state.settings.server.admin_key, token)


def _is_operator(request: Request, token: str | None) -> bool:
    """The admin key or the read-only metrics key."""
    server = request.app.state.settings.server
    return _matches(server.admin_key, token) or _matches(server.metrics_key, token)


def _matches(key: SecretStr | None, token: str | None) -> bool:
    # both digested first, so the comparison's time tells nothing, not even the length
    return (
        key is not None
        and token is not None
        and hmac.compare_digest(_digest(token), _digest(key.get_secret_value()))
    )


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


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
    """A dependency for the model list: the tenant of a client key, or, for the admin or
    the metrics key, every model (the status page reads it with the key it was given)."""
    if _is_operator(request, bearer_token(request)):
        return OPEN
    return await require_client(request)


def sees_everyone(request: Request) -> bool:
    """Whether the caller may see every tenant's requests: the admin or the metrics key,
    or anyone while the API is open."""
    tenants: Tenants = request.app.state.tenants
    return tenants.open or _is_operator(request, bearer_token(request))


def sees_request_ids(request: Request) -> bool:
    """Whether the caller may see request ids (which name streams): the admin or the
    metrics key only, whether the API is open or not."""
    return _is_operator(request, bearer_token(request))


def is_open(request: Request) -> bool:
    """Whether the API is open (no client keys): every caller is ``anonymous``."""
    tenants: Tenants = request.app.state.tenants
    return tenants.open


def sees_everything(request: Request) -> bool:
    """Whether the caller may read what shows every tenant and model: as
    :func:`sees_everyone`, or anyone with ``auth.protect_metrics`` off."""
    return not request.app.state.settings.auth.protect_metrics or sees_everyone(request)


async def require_operator(request: Request) -> None:
    """A dependency for what shows every tenant and model (``/metrics``, the status page's
    data, ``/v1/devices``): the admin or the metrics key, when tenants are configured and
    ``auth.protect_metrics`` is on (the default)."""
    if not sees_everything(request):
        raise AuthenticationError(
            "this endpoint needs the admin key or server.metrics_key (Authorization: Bearer)"
        )


async def explainer(request: Request) -> Tenant:
    """A dependency for ``/v1/route/explain``: whose models it may explain. A client key's
    tenant; every model for the admin or the metrics key, an open API, or anyone when
    ``auth.protect_explain`` is off and no client key is given."""
    tenants: Tenants = request.app.state.tenants
    token = bearer_token(request)
    if tenants.open or _is_operator(request, token):
        return OPEN
    tenant = tenants.find(token)
    if tenant is not None:
        return tenant
    if not request.app.state.settings.auth.protect_explain:
        return OPEN
    raise AuthenticationError("a valid API key is needed (Authorization: Bearer <key>)")
