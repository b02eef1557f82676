"""A chat template render process, and the messages it exchanges with the gateway.

The gateway (:mod:`~quantroute.shaping.template_pool`) writes one
:class:`RenderJob` at a time on the process's stdin; the process renders it
in the bounded sandbox (:func:`~quantroute.shaping.template_sandbox.render_text`)
and writes one reply on its stdout. Each message is a 4-byte big-endian
length and that many bytes of ASCII JSON.

Before each render the process limits its own address space to what it
uses now plus the job's ``max_bytes`` (``RLIMIT_AS``), and its CPU time to
what it has used plus the job's ``timeout_s`` and a second (``RLIMIT_CPU``,
a backstop: the gateway kills it at the wall-clock deadline). A render that
runs out of memory is answered ``memory``, and the process then exits, so
the next render starts on a fresh heap. It exits when its stdin closes, and
is killed with the gateway (``PR_SET_PDEATHSIG``) on Linux.

The process says ``{"ready": true}`` once it has imported what it needs, so
that the gateway's clock for a render never counts the process's start.
:data:`ARGV` starts it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import struct
import sys
from dataclasses import asdict, dataclass
from typing import IO, Any

from quantroute.shaping.template_sandbox import (
    Failed,
    LimitExceeded,
    Refused,
    Unsafe,
    render_text,
)

__all__ = ["ARGV", "RenderJob", "decode_reply", "encode_reply", "frame", "main", "read_frame"]

#: The render process's command line. Not ``-m``: ``quantroute.engines`` imports this
#: module (one run as ``__main__`` should not be imported twice), and its package's
#: ``__init__`` imports every engine; the process needs Jinja and three modules, so the
#: package is stood in for by a bare one with the same path (a start in ~0.1 s, not ~1 s).
ARGV = [
    sys.executable,
    "-c",
    "import importlib.util, sys, types; "
    "spec = importlib.util.find_spec('quantroute.engines'); "
    "package = types.ModuleType('quantroute.engines'); "
    "package.__path__ = list(spec.submodule_search_locations); "
    "sys.modules['quantroute.engines'] = package; "
    "from quantroute.shaping.template_worker import main; "
    "sys.exit(main(sys.argv[1:]))",
]
_HEAD = struct.Struct(">I")
MAX_FRAME = 1 << 30
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class RenderJob:
    """One render: the template, its variables and its budget."""

    source: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    bos_token: str
    eos_token: str
    timeout_s: float
    max_chars: int
    max_bytes: int

    def encode(self) -> bytes:
        return frame(asdict(self))


def frame(message: dict[str, Any]) -> bytes:
    """``message`` as one frame: its length, then its JSON (ASCII: a lone surrogate a
    client sent survives the trip)."""
    body = json.dumps(message, separators=(",", ":")).encode("ascii")
    return _HEAD.pack(len(body)) + body


def read_frame(stream: IO[bytes]) -> dict[str, Any] | None:
    """The next frame's message, or ``None`` at the end of the stream."""
    head = stream.read(_HEAD.size)
    if len(head) < _HEAD.size:
        return None
    (n,) = _HEAD.unpack(head)
    if n > MAX_FRAME:
        raise ValueError("frame too long")
    body = stream.read(n)
    if len(body) < n:
        return None
    message = json.loads(body)
    if not isinstance(message, dict):
        raise ValueError("a frame is a JSON object")
    return message


def encode_reply(render: RenderJob) -> dict[str, Any]:
    """Render ``render``; the reply: ``{"text"}`` or ``{"error", "detail"}``."""
    try:
        text = render_text(
            render.source,
            render.messages,
            render.tools,
            render.bos_token,
            render.eos_token,
            timeout_s=render.timeout_s,
            max_chars=render.max_chars,
            max_bytes=render.max_bytes,
        )
    except LimitExceeded as exc:
        return {"error": "limit", "detail": exc.what}
    except Refused as exc:
        return {"error": "refused", "detail": str(exc)}
    except Unsafe as exc:
        return {"error": "unsafe", "detail": str(exc)[:200]}
    except Failed as exc:
        return {"error": "failed", "detail": str(exc)}
    return {"text": text}


def decode_reply(reply: dict[str, Any]) -> str:
    """The rendered text of ``reply``, or the sandbox's exception it stands for."""
    text = reply.get("text")
    if isinstance(text, str):
        return text
    error, detail = reply.get("error"), str(reply.get("detail", ""))
    if error == "limit":
        raise LimitExceeded(detail)
    if error == "refused":
        raise Refused(detail)
    if error == "unsafe":
        raise Unsafe(detail)
    raise Failed(detail or "a malformed reply")


def _vm_bytes() -> int:
    """This process's address space now (``/proc/self/statm``'s first field)."""
    with open("/proc/self/statm", "rb") as fh:
        return int(fh.read().split()[0]) * resource.getpagesize()


def _die_with_parent(parent: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the line above
        os._exit(0)


def _limit(job: RenderJob) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_bytes() + job.max_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = int(usage.ru_utime + usage.ru_stime + job.timeout_s) + 2
    _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
    if cpu_hard != resource.RLIM_INFINITY:
        cpu_s = min(cpu_s, cpu_hard)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_hard))


def _unlimit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def main(argv: list[str]) -> int:
    """Render jobs from stdin until it closes (``argv``: the parent's pid)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the gateway's Ctrl-C is the gateway's
    if argv:
        _die_with_parent(int(argv[0]))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(frame({"ready": True}))  # imported: a render's clock may start
    stdout.flush()
    while True:
        message = read_frame(stdin)
        if message is None:
            return 0
        job = RenderJob(**message)
        recycle = False
        try:
            _limit(job)
            reply = encode_reply(job)
        except MemoryError:
            reply = {"error": "limit", "detail": "memory"}
        finally:
            _unlimit()
        if reply.get("detail") == "memory":
            recycle = True
        stdout.write(frame(reply | {"recycle": recycle}))
        stdout.flush()
        if recycle:
            return 0
