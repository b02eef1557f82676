"""A call's key: the ``authorization: Bearer <key>`` metadata, read by HTTP's own rules
(``api/auth.py``): the same tenant lookup, the same admin and metrics keys, the same
answer to no key, a wrong one, or several."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

from starlette.requests import Request

from quantroute.api.auth import explainer, require_client, require_reader
from quantroute.config import Settings
from quantroute.resilience.tenants import Tenant, Tenants

__all__ = ["Keys"]


class Keys:
    """``api/auth.py``'s checks for gRPC metadata: each is handed a request that carries
    the call's ``authorization`` values and nothing else, over the settings and tenants
    the HTTP app's state holds."""

    def __init__(self, tenants: Tenants, settings: Settings):
        self._app = SimpleNamespace(state=SimpleNamespace(tenants=tenants, settings=settings))

    async def client(self, metadata: Sequence[tuple[str, str | bytes]]) -> Tenant:
        """The tenant of a generation's key (anyone while the API is open)."""
        return await require_client(self._request(metadata))

    async def reader(self, metadata: Sequence[tuple[str, str | bytes]]) -> Tenant:
        """Whose models a model list shows: a client key's tenant, every model for the
        admin or the metrics key."""
        return await require_reader(self._request(metadata))

    async def explainer(self, metadata: Sequence[tuple[str, str | bytes]]) -> Tenant:
        """Whose models a routing explanation may name (``auth.protect_explain``)."""
        return await explainer(self._request(metadata))

    def _request(self, metadata: Sequence[tuple[str, str | bytes]]) -> Request:
        headers = [
            (b"authorization", value.encode("latin-1", "replace"))
            for key, value in metadata
            if key == "authorization" and isinstance(value, str)
        ]
        return Request({"type": "http", "headers": headers, "app": self._app})
