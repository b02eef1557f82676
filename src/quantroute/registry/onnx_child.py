"""The child process of :func:`quantroute.registry.onnx_pair.check_onnx_isolated`: its
limits first, then :func:`~quantroute.registry.onnx_pair.check_onnx_pair` of each
``MODEL TOKENIZER DATA`` triple named on the command line (``-``: no tokenizer, no
external data file; DATA is the declared data file's ``SIZE:NAME``); on stdout a
JSON list with, per pair, the graph's summary or why the graph or the tokenizer is
refused (``onnx_pair.pair_json``)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

from quantroute.registry.gguf_check import CHILD_MEMORY_BYTES, CHILD_TIMEOUT_S
from quantroute.registry.onnx_pair import check_onnx_pair, pair_json, parse_data_arg


def main(argv: list[str]) -> int:
    """Set the limits, check each pair, write the JSON list."""
    memory = int(argv[1]) if argv[:1] == ["--memory-bytes"] else CHILD_MEMORY_BYTES
    names = argv[2:] if argv[:1] == ["--memory-bytes"] else argv
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu_s = int(CHILD_TIMEOUT_S) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    found = []
    for model, tokenizer, data in zip(names[::3], names[1::3], names[2::3], strict=True):
        pair = check_onnx_pair(
            Path(model), None if tokenizer == "-" else Path(tokenizer), parse_data_arg(data)
        )
        found.append(pair_json(pair))
    sys.stdout.write(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
