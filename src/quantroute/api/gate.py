"""What a browser on another origin could make a request do, refused before anything reads
it: a ``Host`` the server does not answer to (DNS rebinding), and a ``POST`` a page could
send without asking (a CSRF "simple request").

- **Host.** A page on ``evil.example`` whose name is made to resolve to 127.0.0.1 talks
  to a loopback server as its own origin; the one thing that tells is the ``Host`` it
  sends. ``server.allowed_hosts`` names the hosts answered (``*.x`` its subdomains,
  ``*`` any; a port is ignored). Unset: with an open API (no client keys), only the
  loopback names ``localhost``, ``127.0.0.1`` and ``[::1]``; with keys, any (a page has
  no key to send). Anything else, or no ``Host`` at all, is a 400 (``host_not_allowed``)
  that does not repeat the value.
- **POST.** A cross-origin page may send a ``POST`` without a preflight only with a
  form's or ``text/plain`` content type (or none) and no ``Authorization``. So a
  ``POST`` needs ``Content-Type: application/json`` (parameters allowed) or an
  ``Authorization`` header, else a 415 (``unsupported_media_type``). The ``openai``
  client sends both; ``PUT`` and the others always need a preflight.

It is a raw ASGI layer in front of the routes, on every request's path: the rules are
compiled once, a request's headers are scanned once, and a ``GET`` where any host is
answered passes without a scan. It never touches a response, so the direct body
(``api/direct.py``) passes it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from quantroute.errors import ConfigError, InvalidRequestError

__all__ = ["LOOPBACK_HOSTS", "HostRule", "RequestGate"]

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
_SEEN = 64  # host values whose verdict is remembered (a client sends one, again and again)


class HostNotAllowedError(InvalidRequestError):
    code = "host_not_allowed"


class UnsupportedMediaTypeError(InvalidRequestError):
    status = 415
    code = "unsupported_media_type"


def _name(host: bytes) -> bytes | None:
    """A ``Host`` value's name, lowercase, without its port or a trailing dot; ``None`` if
    it is not a host name and port (a port that is not digits, a bracket left open)."""
    host = host.strip().lower()
    if host.startswith(b"["):  # an IPv6 address: [::1]:8000
        end = host.find(b"]")
        if end < 0:
            return None
        name, rest = host[: end + 1], host[end + 1 :]
        if rest and not rest.startswith(b":"):
            return None
        port = rest[1:]
    else:
        name, _, port = host.partition(b":")
    if port and not (port.isdigit() and len(port) <= 5):
        return None
    name = name[:-1] if name.endswith(b".") else name  # "localhost." is localhost
    return name or None


class HostRule:
    """The hosts a server answers: exact names, and suffixes (``*.x``: ``.x``)."""

    __slots__ = ("_exact", "_seen", "_suffixes")

    def __init__(self, patterns: Iterable[str]):
        exact: set[bytes] = set()
        suffixes: list[bytes] = []
        for pattern in patterns:
            raw = pattern.strip().lower()
            wildcard = raw.startswith("*.")
            try:
                name = _name((raw[2:] if wildcard else raw).encode("idna"))
            except UnicodeError:
                name = None
            if name is None:
                raise ConfigError(f"server.allowed_hosts: {pattern!r} is not a host name")
            if wildcard:
                suffixes.append(b"." + name)
            else:
                exact.add(name)
        self._exact = frozenset(exact)
        self._suffixes = tuple(suffixes)
        self._seen: dict[bytes, bool] = {}

    @classmethod
    def of(cls, allowed: Sequence[str] | None, open_api: bool) -> HostRule | None:
        """The rule for ``server.allowed_hosts``; ``None``: any host is answered."""
        if allowed is None:
            return cls(LOOPBACK_HOSTS) if open_api else None
        if not allowed:  # it would answer nothing, /healthz included: a mistake, said at start
            raise ConfigError(
                "server.allowed_hosts is empty: list the names clients reach the server by, "
                "'*' for any, or leave it unset",
                param="server.allowed_hosts",
            )
        if any(pattern.strip() == "*" for pattern in allowed):
            return None
        return cls(allowed)

    def allows(self, host: bytes) -> bool:
        verdict = self._seen.get(host)
        if verdict is None:
            name = _name(host)
            verdict = name is not None and (
                name in self._exact
                or any(name.endswith(s) and len(name) > len(s) for s in self._suffixes)
            )
            if len(self._seen) < _SEEN:
                self._seen[host] = verdict
        return verdict


def _answer(err: InvalidRequestError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(err.to_openai(), separators=(",", ":")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"),  # its body, if any, is not read
    ]
    return err.status, headers, body


_BAD_HOST = _answer(
    HostNotAllowedError(
        "This server does not answer to that Host name (server.allowed_hosts).", param="Host"
    )
)
_NOT_JSON = _answer(
    UnsupportedMediaTypeError(
        "A POST body must be sent as Content-Type: application/json (or with an "
        "Authorization header).",
        param="Content-Type",
    )
)


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    media = content_type.partition(b";")[0].strip().lower()
    return media == b"application/json"


class RequestGate:
    """Refuses a request whose ``Host`` ``hosts`` does not allow (``None``: any), and a
    ``POST`` that neither is JSON nor carries ``Authorization`` (see the module)."""

    def __init__(self, app: ASGIApp, hosts: HostRule | None):
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hosts = self.hosts
        post = scope["method"] == "POST"
        if hosts is None and not post:
            await self.app(scope, receive, send)
            return
        host_ok = hosts is None  # restricted: no Host is no allowed Host
        host: bytes | None = None
        keyed = False
        content_type = None
        for name, value in scope["headers"]:
            if name == b"host" and hosts is not None:
                if host is None:
                    host = value
                    host_ok = hosts.allows(value)
                elif value != host:  # two different names: which one counts is a guess
                    host_ok = False
            elif name == b"content-type":
                content_type = value
            elif name == b"authorization":
                keyed = True
        if not host_ok:
            await _refuse(send, _BAD_HOST)
        elif post and not keyed and not _is_json(content_type):
            await _refuse(send, _NOT_JSON)
        else:
            await self.app(scope, receive, send)


async def _refuse(send: Send, answer: tuple[int, list[tuple[bytes, bytes]], bytes]) -> None:
    status, headers, body = answer
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
