"""A worker's exit status in words, for ``/v1/models``, ``/readyz``, the log and ``doctor``.

>>> describe_exit(-4).split(":")[0]
'illegal instruction (SIGILL)'
>>> describe_exit(1)
'exited with status 1'
"""

from __future__ import annotations

import signal

TROUBLESHOOTING = "docs/troubleshooting.md"

_SIGNAL_WORDS: dict[int, str] = {
    signal.SIGILL: (
        "illegal instruction (SIGILL): this llama.cpp build uses CPU instructions this machine "
        f"does not allow; see {TROUBLESHOOTING}#sigill"
    ),
    signal.SIGSEGV: f"segmentation fault (SIGSEGV) in the worker; see {TROUBLESHOOTING}#sigsegv",
    signal.SIGBUS: "bus error (SIGBUS): the model file changed or shrank while mapped",
    signal.SIGABRT: "aborted (SIGABRT): llama.cpp hit an assertion; the worker's log says which",
    signal.SIGFPE: "arithmetic fault (SIGFPE) in the worker",
    signal.SIGKILL: "killed (SIGKILL): often the kernel's out-of-memory killer",
    signal.SIGTERM: "terminated (SIGTERM)",
}


def crashed(returncode: int) -> bool:
    """Died of a signal (not asked to stop): the kind of exit that fails a branch."""
    return returncode < 0 and -returncode not in (signal.SIGTERM, signal.SIGINT)


def describe_exit(returncode: int) -> str:
    """What a subprocess return code means, e.g. ``-4`` → the SIGILL explanation."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    number = -returncode
    if number in _SIGNAL_WORDS:
        return _SIGNAL_WORDS[number]
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return f"killed by {name}"
