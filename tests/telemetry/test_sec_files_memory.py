"""M2 (issue 32): a model file's metadata never costs the gateway's memory.

The memory model reads a GGUF's shape through the registry's bounded header check
in a child process; the gateway process builds no object per array element. Each
bomb below took ``gguf.GGUFReader`` (what the gateway used to call) hundreds of MiB
to 1.5 GiB and seconds to minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from quantroute.registry.gguf_check import check_gguf
from sec_files_gguf import BOMBS, write_gguf

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1]
MiB = 1 << 20

# In a fresh interpreter: the peak RSS the read adds to the process that asks for it
# (its child's memory is the child's), the time it took, and the shape it found.
_MEASURE = """
import json, resource, sys, time
from quantroute.telemetry.memory import read_model_shape
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.monotonic()
shape = read_model_shape(sys.argv[1])
took = time.monotonic() - start
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
print(json.dumps({"grew": grew, "took": took, "n_layer": shape.n_layer, "n_vocab": shape.n_vocab}))
"""


@pytest.mark.parametrize("name", BOMBS)
def test_a_metadata_bomb_costs_the_gateway_no_memory(name: str, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bomb.gguf", BOMBS[name])
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    found = json.loads(done.stdout)
    assert found["grew"] < 8 * MiB  # GGUFReader: +1533 MiB for the million strings
    assert found["took"] < 20  # the child's parse; GGUFReader: 80 s for the million strings
    assert found["n_layer"] == 2
    if name == "a million empty strings":
        assert found["n_vocab"] == 1_000_000  # counted, never listed


@pytest.mark.parametrize("name", BOMBS)
def test_the_bounded_check_keeps_what_the_memory_model_needs_in_small_memory(
    name: str, tmp_path: Path
) -> None:
    path = write_gguf(tmp_path / "bomb.gguf", BOMBS[name])
    tracemalloc.start()
    try:
        summary = check_gguf(path, metadata=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MiB  # a kept string is cut at 1 MiB; arrays are never listed
    assert summary.metadata["llama.block_count"] == 2
    assert summary.metadata["general.architecture"] == "llama"
    template = summary.metadata.get("tokenizer.chat_template")
    assert template is None or len(str(template)) == 1 << 20  # cut to MAX_KEPT_STRING
