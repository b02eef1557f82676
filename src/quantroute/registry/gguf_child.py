"""The child process of :func:`quantroute.registry.gguf_check.check_gguf_isolated`:
its limits first, then :func:`~quantroute.registry.gguf_check.check_gguf` of each
file named on the command line, its wanted metadata kept; on stdout a JSON list
with, per file, the reason it is refused (a string) or its summary (an object:
:class:`~quantroute.registry.gguf_check.GgufSummary`'s fields)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

from quantroute.errors import ArtifactIntegrityError
from quantroute.registry.gguf_check import (
    CHILD_MEMORY_BYTES,
    CHILD_TIMEOUT_S,
    check_gguf,
    summary_json,
)


def main(argv: list[str]) -> int:
    """Set the limits, check each file, write the JSON list."""
    memory = int(argv[1]) if argv[:1] == ["--memory-bytes"] else CHILD_MEMORY_BYTES
    paths = argv[2:] if argv[:1] == ["--memory-bytes"] else argv
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu_s = int(CHILD_TIMEOUT_S) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    found: list[str | dict[str, Any]] = []
    for name in paths:
        try:
            found.append(summary_json(check_gguf(Path(name), metadata=True)))
        except ArtifactIntegrityError as exc:
            found.append(exc.message)
    sys.stdout.write(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
