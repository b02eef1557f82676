"""``scripts/llama_server_build.sh``: the serving benchmark's llama-server, built portably.

It must compile the llama.cpp that llama-cpp-python vendors with exactly the ggml flags the
project's wheel gets (``scripts/llama_build.sh``), so the benchmark compares servers, not
kernels; build only the server; cache it by its flags; and fail loudly. The build runs for
real against a stand-in ``cmake`` (a compile takes minutes) and a small sdist of the same
shape; everything else is the script's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "llama_server_build.sh"
WHEEL_SCRIPT = ROOT / "scripts" / "llama_build.sh"
REVISION = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"

FAKE_CMAKE = """#!/usr/bin/env bash
printf '%s\\n' "$*" >>"$FAKE_CMAKE_LOG"
if [[ "$1" == --build ]]; then
  for ((i = 1; i <= 40; i++)); do echo "[$i/40] Building CXX object f$i.o"; done
  [[ -n "${FAKE_CMAKE_FAIL:-}" ]] && { echo "f.cpp:1:1: error: boom"; exit 1; }
  mkdir -p "$2/bin" && printf '#!/bin/sh\\necho fake\\n' >"$2/bin/llama-server"
  chmod +x "$2/bin/llama-server"
fi
exit 0
"""


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("QUANTROUTE_")}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=base | {"QUANTROUTE_LLAMA_BACKEND": "cpu"} | (env or {}),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def flags_of(script: Path, env: dict[str, str]) -> tuple[str, list[str]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("QUANTROUTE_")}
    out = subprocess.run(
        ["bash", str(script), "--flags"], env=base | env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return out[0].removeprefix("backend="), out[1:]


@pytest.fixture
def fake_nvcc(tmp_path: Path) -> dict[str, str]:
    nvcc = tmp_path / "cuda" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\nexit 0\n")
    nvcc.chmod(0o755)
    path = f"{nvcc.parent}{os.pathsep}{os.environ['PATH']}"
    return {"QUANTROUTE_LLAMA_BACKEND": "cuda", "QUANTROUTE_CUDA_ARCH": "90", "PATH": path}


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_ggml_flags_are_the_wheels_own(backend: str, fake_nvcc: dict[str, str]) -> None:
    env = fake_nvcc if backend == "cuda" else {"QUANTROUTE_LLAMA_BACKEND": "cpu"}
    wheel_backend, wheel_flags = flags_of(WHEEL_SCRIPT, env)
    server_backend, server_flags = flags_of(SCRIPT, env)
    assert server_backend == wheel_backend == backend
    assert server_flags[: len(wheel_flags)] == wheel_flags  # the same ggml build, first
    extra = server_flags[len(wheel_flags) :]
    assert not [f for f in extra if f.startswith("-DGGML_")], extra  # nothing ggml-level added
    assert "-DGGML_NATIVE=OFF" in server_flags
    if backend == "cuda":
        assert "-DGGML_CUDA=on" in server_flags


def test_server_only_no_ui_download_no_https() -> None:
    _, flags = flags_of(SCRIPT, {"QUANTROUTE_LLAMA_BACKEND": "cpu"})
    for flag in (
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",  # it would download the web UI at build time
        "-DLLAMA_OPENSSL=OFF",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
    ):
        assert flag in flags


def test_key_follows_the_flags(fake_nvcc: dict[str, str]) -> None:
    cpu = run("--key").stdout.strip()
    assert cpu == run("--key").stdout.strip()
    assert len(cpu) == 16
    assert run("--key", env=fake_nvcc).stdout.strip() != cpu


def fake_sdist(path: Path, version: str) -> Path:
    """A tarball shaped like llama-cpp-python's sdist: the submodule and its HEAD."""
    top = path / "src" / f"llama_cpp_python-{version}"
    (top / "vendor" / "llama.cpp").mkdir(parents=True)
    (top / "vendor" / "llama.cpp" / "CMakeLists.txt").write_text("# llama.cpp\n")
    head = top / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    head.parent.mkdir(parents=True)
    head.write_text(REVISION + "\n")
    tarball = path / f"llama_cpp_python-{version}.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    return tarball


@pytest.fixture
def box(tmp_path: Path) -> dict[str, str]:
    version = next(
        line.split('"')[1]
        for line in WHEEL_SCRIPT.read_text().splitlines()
        if line.startswith("version=")
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cmake").write_text(FAKE_CMAKE)
    (bin_dir / "cmake").chmod(0o755)
    return {
        "QUANTROUTE_CACHE": str(tmp_path / "cache"),
        "QUANTROUTE_LLAMA_SDIST": str(fake_sdist(tmp_path, version)),
        "FAKE_CMAKE_LOG": str(tmp_path / "cmake.log"),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "VERSION": version,
    }


def test_builds_the_server_target_once_and_records_the_revision(box: dict[str, str]) -> None:
    done = run(env=box)
    assert done.returncode == 0, done.stderr
    binary = Path(done.stdout.strip().splitlines()[-1])
    key = run("--key").stdout.strip()
    assert binary == Path(box["QUANTROUTE_CACHE"]) / "llama-server" / key / "llama-server"
    assert os.access(binary, os.X_OK)
    record = json.loads((binary.parent / "build.json").read_text())
    assert record["revision"] == REVISION
    assert record["llama_cpp_python"] == box["VERSION"]
    assert record["key"] == key
    configure, build = Path(box["FAKE_CMAKE_LOG"]).read_text().splitlines()
    _, flags = flags_of(SCRIPT, {"QUANTROUTE_LLAMA_BACKEND": "cpu"})
    assert all(flag in configure.split() for flag in flags)
    assert "vendor/llama.cpp" in configure
    assert "--target llama-server" in build  # the server alone
    assert "llama-server build  50%  (20/40)" in done.stderr  # progress, line by line
    assert "llama-server build 100%  (40/40)" in done.stderr
    assert not list(binary.parent.parent.glob("*.partial"))

    again = run(env=box)  # cached: no cmake call
    assert again.returncode == 0 and Path(again.stdout.strip()) == binary
    assert len(Path(box["FAKE_CMAKE_LOG"]).read_text().splitlines()) == 2


def test_a_failed_build_says_where_the_log_is_and_caches_nothing(box: dict[str, str]) -> None:
    done = run(env=box | {"FAKE_CMAKE_FAIL": "1"})
    assert done.returncode != 0
    assert "llama-server build failed; the full log:" in done.stderr
    assert "error: boom" in done.stderr  # the compile error reaches the user
    key = run("--key").stdout.strip()
    assert not (Path(box["QUANTROUTE_CACHE"]) / "llama-server" / key).exists()
