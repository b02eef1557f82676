"""``scripts/llama_build.sh VENV``: build once, cache by key, record, keep; fail loudly.

The script runs for real against a venv whose ``pip`` is a stand-in (building
llama.cpp takes minutes): it prints ninja-shaped lines and writes an empty wheel,
or fails like a compile error does. Everything else (the cache folder, the
record, the fast path, the messages) is the script's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "llama_build.sh"

FAKE_PIP = """#!/usr/bin/env bash
printf '%s CMAKE_ARGS=%s\\n' "$*" "${CMAKE_ARGS:-}" >>"$FAKE_PIP_LOG"
[[ "$1" == wheel ]] || exit 0
for ((i = 1; i <= 40; i++)); do echo "  [$i/40] Building C object f$i.c.o"; done
if [[ -n "${FAKE_PIP_FAIL:-}" ]]; then
  echo "  vendor/llama.cpp/ggml/src/f.c:1:1: error: boom"
  echo "ERROR: Failed building wheel for llama-cpp-python"
  exit 1
fi
spec="${*: -1}"  # llama-cpp-python==VERSION
while [[ "$1" != -w ]]; do shift; done
touch "$2/llama_cpp_python-${spec#*==}-py3-none-linux_x86_64.whl"
"""


@dataclass(frozen=True, slots=True)
class Box:
    """A venv with a stand-in pip, a cache folder, and the log of pip's calls."""

    venv: Path
    cache: Path
    pip_log: Path
    env: dict[str, str]

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SCRIPT), *args],
            env=self.env | env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def pip_calls(self) -> list[str]:
        return self.pip_log.read_text().splitlines() if self.pip_log.exists() else []


@pytest.fixture
def box(tmp_path: Path) -> Box:
    venv, site = tmp_path / "venv", tmp_path / "site"
    (venv / "bin").mkdir(parents=True)
    (site / "llama_cpp").mkdir(parents=True)
    (site / "llama_cpp" / "__init__.py").write_text("")  # what `import llama_cpp` finds
    pip = venv / "bin" / "pip"
    pip.write_text(FAKE_PIP)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for exe in (pip, python):
        exe.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QUANTROUTE_", "FAKE_"))}
    env |= {
        "QUANTROUTE_LLAMA_BACKEND": "cpu",
        "QUANTROUTE_CACHE": str(tmp_path / "cache"),
        "FAKE_PIP_LOG": str(tmp_path / "pip.log"),
        "PYTHONPATH": str(site),
    }
    return Box(venv, tmp_path / "cache", tmp_path / "pip.log", env)


def test_builds_caches_records_then_keeps(box: Box) -> None:
    key = box.run("--key", str(box.venv)).stdout.strip()
    flags = box.run("--flags").stdout.splitlines()[1:]
    done = box.run(str(box.venv))
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0].startswith("==> building llama.cpp (cpu, no -march=native)")
    assert [line for line in out if "llama.cpp build" in line][-1].endswith("100%  (40/40)")
    assert len([line for line in out if "llama.cpp build" in line]) == 20

    folder = box.cache / "llama-wheels" / key
    wheel = folder / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    assert out[-1] == f"==> llama-cpp-python 0.3.36 (cpu) installed from {folder}"
    assert wheel.is_file() and (folder / "build.log").is_file()
    assert not folder.with_name(f"{key}.partial").exists()
    assert json.loads((folder / "build.json").read_text())["key"] == key
    record = json.loads((box.venv / "llama-build.json").read_text())
    assert record == {
        "key": key,
        "backend": "cpu",
        "version": "0.3.36",
        "wheel": str(wheel),
        "cmake_flags": flags,
    }
    build, *installs = box.pip_calls()
    assert build.startswith("wheel -v --no-deps --no-cache-dir --no-binary llama-cpp-python")
    assert build.endswith(f"llama-cpp-python==0.3.36 CMAKE_ARGS={' '.join(flags)}")
    assert installs[0].startswith(f"install -q --force-reinstall --no-deps {wheel}")

    again = box.run(str(box.venv))  # the record matches: nothing to do, nothing said
    assert (again.returncode, again.stdout, len(box.pip_calls())) == (0, "", 1 + len(installs))


def test_a_new_venv_gets_the_cached_wheel_without_a_build(box: Box) -> None:
    assert box.run(str(box.venv)).returncode == 0
    (box.venv / "llama-build.json").unlink()
    calls = len(box.pip_calls())
    done = box.run(str(box.venv))
    assert done.returncode == 0, done.stderr
    assert "building" not in done.stdout
    new = box.pip_calls()[calls:]
    assert new and all(c.startswith("install ") for c in new)
    assert (box.venv / "llama-build.json").is_file()


def test_a_failed_build_says_so_and_keeps_its_log(box: Box) -> None:
    done = box.run(str(box.venv), FAKE_PIP_FAIL="1")
    assert done.returncode == 1
    assert "  vendor/llama.cpp/ggml/src/f.c:1:1: error: boom" in done.stdout.splitlines()
    assert "ERROR: Failed building wheel for llama-cpp-python" in done.stdout.splitlines()
    key = box.run("--key", str(box.venv)).stdout.strip()
    log = box.cache / "llama-wheels" / f"{key}.partial" / "build.log"
    assert f"llama-cpp-python build failed; the full log: {log}" in done.stderr
    assert "error: boom" in log.read_text()
    assert not (box.cache / "llama-wheels" / key).exists()
    assert not (box.venv / "llama-build.json").exists()


def test_usage(box: Box) -> None:
    for args in ((), ("--bogus",)):
        done = box.run(*args)
        assert done.returncode == 2 and done.stderr.startswith("usage:")
