"""Logs: JSON lines or plain text, each carrying the request it belongs to; the access log.

:func:`configure_logging` installs one handler on the root logger. Every
record gets ``request_id``, ``trace_id``, ``tenant`` and ``branch`` from the
request being served in this task (:data:`CURRENT`, set by the request's
trace; empty outside a request). The access log is the ``quantroute.access``
logger: one line per generation request with its status, tokens, TTFT and
duration, never its prompt or its key.

>>> import io, json, logging
>>> out = io.StringIO()
>>> handler = make_handler("json", out)
>>> _ = handler.handle(logging.makeLogRecord({"name": "x", "levelname": "INFO", "msg": "hi"}))
>>> json.loads(out.getvalue())["message"]
'hi'
"""

from __future__ import annotations

import contextvars
import datetime as dt
import json
import logging
import sys
from dataclasses import dataclass
from typing import IO, Any, Literal

ACCESS = logging.getLogger("quantroute.access")
CONTEXT_FIELDS = ("request_id", "trace_id", "tenant", "branch")
# what an access line carries beyond the context (``extra=`` of the log call)
ACCESS_FIELDS = (
    "model",
    "kind",
    "status",
    "prompt_tokens",
    "completion_tokens",
    "ttft_ms",
    "duration_ms",
    "route_reason",
    "fallbacks",
    "stream",
    "error",
)


@dataclass(slots=True)
class LogContext:
    """The request a task is serving, as its log lines name it."""

    request_id: str = ""
    trace_id: str = ""
    tenant: str = ""
    branch: str = ""
    open: bool = True  # the request is over: lines logged after it name no request


CURRENT: contextvars.ContextVar[LogContext | None] = contextvars.ContextVar(
    "quantroute_request", default=None
)


class ContextFilter(logging.Filter):
    """Adds the current request's fields to every record (empty strings outside one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = CURRENT.get()
        live = ctx is not None and ctx.open
        for name in CONTEXT_FIELDS:
            if not hasattr(record, name):
                setattr(record, name, getattr(ctx, name) if live else "")
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the request's fields and
    an access line's fields."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in (*CONTEXT_FIELDS, *ACCESS_FIELDS):
            value = getattr(record, name, None)
            if value not in (None, ""):
                body[name] = value
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, separators=(",", ":"), default=str)


class PlainFormatter(logging.Formatter):
    """Human lines; a request's id and branch in brackets when there is one."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", "")
        if rid:
            line += f" [request {rid} tenant {getattr(record, 'tenant', '')}"
            branch = getattr(record, "branch", "")
            line += f" branch {branch}]" if branch else "]"
        return line


LogFormat = Literal["auto", "json", "plain"]


def make_handler(fmt: LogFormat, stream: IO[str] | None = None) -> logging.Handler:
    """A stream handler writing ``fmt`` lines; ``auto`` is plain on a terminal, else JSON."""
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "plain" if stream.isatty() else "json"
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    return handler


def configure_logging(level: str, fmt: LogFormat, stream: IO[str] | None = None) -> None:
    """The process's logging (``quantroute serve``): one handler on the root logger."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(make_handler(fmt, stream))
    root.setLevel(level.upper())
    # httpx and httpcore log every request a remote branch and its probes make at info:
    # the engine says what matters (a server down, up again) itself
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, root.level))
