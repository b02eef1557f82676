"""The admin key: ``/admin/*`` endpoints need ``Authorization: Bearer <server.admin_key>``.

Without a configured key they are closed (403), so a fresh install exposes no
operator action. Keys are compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from quantroute.errors import AuthenticationError, PermissionDeniedError


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def require_admin(request: Request) -> None:
    """A FastAPI dependency: pass only with the admin key."""
    key = request.app.state.settings.server.admin_key
    if key is None:
        raise PermissionDeniedError(
            "admin endpoints are closed: no admin key is configured (server.admin_key)"
        )
    token = bearer_token(request)
    if token is None or not hmac.compare_digest(token.encode(), key.get_secret_value().encode()):
        raise AuthenticationError("admin endpoints need the admin key as a Bearer token")
