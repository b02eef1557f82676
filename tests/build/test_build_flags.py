"""llama.cpp is built for a portable CPU baseline, never for the build machine.

ggml's native build (``-march=native``, ``GGML_NATIVE=ON``, also ggml's default when
the flag is not given) compiles every instruction set the build machine has: on an
Intel Xeon with AMX the wheel dies with SIGILL in ``ggml_backend_amx_mul_mat`` at the
first q8_0/q4_k_m decode, and an AVX-512 build dies on the next machine without it.
These tests fail on a change that brings it back: in the build files, in the flags
``scripts/llama_build.sh`` passes, and in the library the running interpreter loads.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import itertools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "llama_build.sh"
X86 = platform.machine().lower() in {"x86_64", "amd64"}

# What turns the native build on: the compiler flag, or ggml's option set to any of
# CMake's true values. "never -march=native" in a comment or a message is not a use.
NATIVE = re.compile(
    r"(?<!no )(?<!never )(?<!not )"
    r"(-march=native|-mcpu=native|GGML_NATIVE(:\w+)?\s*=\s*(on|1|true|yes|y)\b)",
    re.IGNORECASE,
)
COMMENT = re.compile(r"(^|\s)#.*$")
BUILD_FILES = ("Makefile", "pyproject.toml", "scripts", ".ci")

# AMX tile instructions (AMX-TILE, AMX-INT8, AMX-BF16, AMX-FP16) and AVX-512's registers.
FORBIDDEN_ASM = re.compile(
    r"\b(tilezero|ldtilecfg|sttilecfg|tilerelease|tileloadd\w*|tilestored"
    r"|tdpb[su][su]d|tdpbf16ps|tdpfp16ps)\b|%zmm\d+"
)


def native_uses(text: str) -> list[str]:
    """The lines of ``text`` that turn ggml's native build on, comments left out."""
    return [line for line in text.splitlines() if NATIVE.search(COMMENT.sub("", line))]


def script(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> str:
    """Run ``scripts/llama_build.sh`` and return its stdout (it must succeed)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("QUANTROUTE_")}
    done = subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=base | (env or {}),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def script_flags(env: dict[str, str]) -> tuple[str, list[str]]:
    """(backend, CMake flags) that the script would build with."""
    first, *flags = script("--flags", env=env).splitlines()
    assert first.startswith("backend="), first
    return first.removeprefix("backend="), flags


@pytest.fixture
def fake_nvcc(tmp_path: Path) -> Path:
    """An ``nvcc`` first on PATH, so the CUDA flags do not depend on a toolkit."""
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\nexit 0\n")
    nvcc.chmod(0o755)
    return nvcc


def cuda_env(nvcc: Path) -> dict[str, str]:
    return {
        "QUANTROUTE_LLAMA_BACKEND": "cuda",
        "QUANTROUTE_CUDA_ARCH": "90",
        "PATH": f"{nvcc.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


CPU = {"QUANTROUTE_LLAMA_BACKEND": "cpu"}


# -- the build files ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "native"),
    [
        ('CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python', True),
        ("flags=(-DGGML_NATIVE=on -DLLAMA_BUILD_TESTS=OFF)", True),
        ("cmake -D GGML_NATIVE=1 ..", True),
        ("-DGGML_NATIVE:BOOL=TRUE", True),
        ('export CFLAGS="-O3 -march=native"', True),
        ("CMAKE_ARGS=-DCMAKE_C_FLAGS=-march=NATIVE", True),
        ("flags=(-DGGML_NATIVE=OFF)", False),
        ("# Never -march=native: ggml's native build ...", False),
        ('echo "==> building llama.cpp (cpu, no -march=native)"', False),
        ("-DGGML_NATIVE=ONLY_KIDDING", False),
    ],
)
def test_native_detector(line: str, native: bool) -> None:
    assert bool(native_uses(line)) is native


def build_files() -> Iterator[Path]:
    for name in BUILD_FILES:
        path = ROOT / name
        if path.is_dir():
            yield from (p for p in sorted(path.rglob("*")) if p.is_file())
        elif path.is_file():
            yield path


def test_build_files_never_build_native() -> None:
    files = list(build_files())
    assert SCRIPT in files and ROOT / "Makefile" in files
    uses = {
        str(p.relative_to(ROOT)): found
        for p in files
        if (found := native_uses(p.read_text(encoding="utf-8", errors="replace")))
    }
    assert uses == {}


# -- the flags the script passes ------------------------------------------------------


def test_cpu_flags_are_the_portable_baseline() -> None:
    backend, flags = script_flags(CPU)
    assert backend == "cpu"
    assert "-DGGML_NATIVE=OFF" in flags  # ggml's default is ON: it must be said
    assert not native_uses("\n".join(flags))
    assert not any("CUDA" in f for f in flags)
    if not X86:
        pytest.skip(f"the x86 instruction-set flags apply to x86_64, not {platform.machine()}")
    for on in ("AVX", "AVX2", "FMA", "F16C", "BMI2", "SSE42"):
        assert f"-DGGML_{on}=ON" in flags
    for off in (
        "AVX512",
        "AVX512_VBMI",
        "AVX512_VNNI",
        "AVX512_BF16",
        "AMX_TILE",
        "AMX_INT8",
        "AMX_BF16",
        "AVX_VNNI",
    ):
        assert f"-DGGML_{off}=OFF" in flags
    enabled = [f for f in flags if re.match(r"-DGGML_(AVX512|AMX_)\w*=(?!OFF$)", f)]
    assert enabled == []


def test_cuda_flags_add_the_gpu_to_the_cpu_baseline(fake_nvcc: Path) -> None:
    backend, flags = script_flags(cuda_env(fake_nvcc))
    _, cpu_flags = script_flags(CPU)
    assert backend == "cuda"
    assert flags[: len(cpu_flags)] == cpu_flags
    assert flags[len(cpu_flags) :] == [
        "-DGGML_CUDA=on",
        "-DCMAKE_CUDA_ARCHITECTURES=90",
        f"-DCMAKE_CUDA_COMPILER={fake_nvcc}",
    ]


def test_keys_tell_the_backends_apart(fake_nvcc: Path) -> None:
    cpu = script("--key", env=CPU).strip()
    cuda = script("--key", env=cuda_env(fake_nvcc)).strip()
    other_arch = script("--key", env=cuda_env(fake_nvcc) | {"QUANTROUTE_CUDA_ARCH": "89"}).strip()
    assert re.fullmatch(r"[0-9a-f]{16}", cpu)
    assert cpu == script("--key", env=CPU).strip()  # stable
    assert len({cpu, cuda, other_arch}) == 3


def pinned_versions() -> set[str]:
    """Every version pyproject.toml pins llama-cpp-python to (main and extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        deps += extra
    pins = set()
    for dep in deps:
        if m := re.fullmatch(r"llama-cpp-python(\[[^\]]*\])?\s*(\S*)", dep.strip()):
            assert m[2].startswith("=="), f"llama-cpp-python must be pinned: {dep!r}"
            pins.add(m[2].removeprefix("=="))
    return pins


def script_version() -> str:
    m = re.search(r'^version="([^"]+)"', SCRIPT.read_text(), re.MULTILINE)
    assert m, "scripts/llama_build.sh has no version= line"
    return m[1]


def test_script_builds_the_pinned_version() -> None:
    assert pinned_versions() == {script_version()}


# -- the Makefile ---------------------------------------------------------------------


def test_make_runs_the_script_every_time() -> None:
    """`llama` is phony, and `make test` (what CI runs) reaches it even when every
    stamp is up to date: a build with the wrong flags cannot stay in .venv."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    makefile = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", makefile, re.MULTILINE)
    assert phony and "llama" in phony[1].split()
    for target in ("$(VENV)/.serve-deps", "$(VENV)/.test-deps", "serve"):
        rule = re.search(rf"^{re.escape(target)}:(.*)$", makefile, re.MULTILINE)
        assert rule and "llama" in rule[1].split(), target
    assert not re.search(r"QUANTROUTE_CACHE|XDG_CACHE_HOME", makefile)  # default cache
    for goal in ("llama", "test", "serve"):
        done = subprocess.run(
            ["make", "-n", "-C", str(ROOT), goal],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "bash scripts/llama_build.sh .venv" in done.stdout.splitlines(), goal


# -- the progress filter --------------------------------------------------------------


def ninja_log(total: int) -> str:
    """A build log shaped like ``pip wheel -v``'s: noise, then verbose ninja lines."""
    lines = [
        "  -- The C compiler identification is GNU 12.2.0",
        "  CMake Warning (dev) at CMakeLists.txt:10 (message):",
        "  warning: unused variable 'x' [-Wunused-variable]",
    ]
    for i in range(1, total + 1):
        kind = "Building C object" if i % 3 else "/usr/bin/g++ -O3 -c"
        lines.append(f"  [{i}/{total}] {kind} vendor/llama.cpp/ggml/src/f{i}.c.o")
    lines.append("  Successfully built llama-cpp-python")
    return "\n".join(lines) + "\n"


def progress(text: str) -> list[str]:
    return script("--progress-filter", stdin=text).splitlines()


@pytest.mark.parametrize("total", [212, 193, 7, 1])
def test_progress_is_one_line_per_five_percent(total: int) -> None:
    shown = progress(ninja_log(total))
    parsed = [re.fullmatch(r" {4}llama\.cpp build +(\d+)%  \((\d+)/(\d+)\)", s) for s in shown]
    assert all(parsed), shown
    pcts = [int(m[1]) for m in parsed if m]
    assert pcts == sorted(pcts) and len(set(pcts)) == len(pcts)
    assert all(b - a >= 5 for a, b in itertools.pairwise(pcts[:-1]))  # the last may be closer
    assert shown[-1] == f"    llama.cpp build 100%  ({total}/{total})"
    assert len(shown) <= 21
    if total >= 100:
        assert len(shown) == 20  # 5, 10, ..., 100
    for m in parsed:
        assert m and int(m[3]) == total and int(m[1]) == 100 * int(m[2]) // total


def test_progress_passes_errors_and_drops_the_rest() -> None:
    log = (
        "  -- Configuring done\n"
        "  [1/3] Building C object a.o\n"
        "  vendor/llama.cpp/ggml/src/x.c:12:3: error: unknown type name 'foo'\n"
        "  CMake Error at vendor/llama.cpp/CMakeLists.txt:3 (message):\n"
        "  ninja: build stopped: subcommand failed.\n"
        "ERROR: Failed building wheel for llama-cpp-python\n"
        "  x.c:1:1: warning: this is only a warning\n"
    )
    assert progress(log) == [
        "    llama.cpp build  33%  (1/3)",
        "  vendor/llama.cpp/ggml/src/x.c:12:3: error: unknown type name 'foo'",
        "  CMake Error at vendor/llama.cpp/CMakeLists.txt:3 (message):",
        "ERROR: Failed building wheel for llama-cpp-python",
    ]


def test_progress_of_nothing_is_nothing() -> None:
    assert progress("") == []


# -- the library this interpreter loads -----------------------------------------------


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    """``llama-build.json`` of the running interpreter's venv, written by the script."""
    if sys.prefix == sys.base_prefix:
        pytest.skip(f"{sys.executable} is not in a virtual environment")
    path = Path(sys.prefix) / "llama-build.json"
    if not path.is_file():
        pytest.skip(f"{sys.prefix} was not set up by scripts/llama_build.sh (no {path.name})")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


@pytest.fixture(scope="module")
def llama_lib_dir() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llama_cpp is not installed in this interpreter")
    return Path(next(iter(spec.submodule_search_locations)))


def test_venv_holds_the_build_the_script_would_make(record: dict[str, Any]) -> None:
    env = {"QUANTROUTE_LLAMA_BACKEND": record["backend"]}
    arch = [f for f in record["cmake_flags"] if f.startswith("-DCMAKE_CUDA_ARCHITECTURES=")]
    if arch:
        env["QUANTROUTE_CUDA_ARCH"] = arch[0].split("=", 1)[1]
    assert record["key"] == script("--key", sys.prefix, env=env).strip()
    assert script_flags(env) == (record["backend"], record["cmake_flags"])
    assert record["version"] == script_version()
    # The wheel cache lives outside the checkout: `git clean` or a fresh clone keeps it.
    assert not Path(record["wheel"]).resolve().is_relative_to(ROOT)


def test_installed_version_is_the_pin(record: dict[str, Any]) -> None:
    from importlib.metadata import version

    assert version("llama-cpp-python") == record["version"]


def wheel_library_hashes(wheel: Path) -> dict[str, str]:
    """The RECORD sha256 of each shared library under ``llama_cpp/`` in ``wheel``."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = csv.reader(io.TextIOWrapper(zf.open(name), encoding="utf-8"))
        return {
            path: digest.removeprefix("sha256=")
            for path, digest, *_ in rows
            if path.startswith("llama_cpp/") and ".so" in Path(path).suffixes
        }


def file_hash(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def test_installed_libraries_are_the_recorded_wheel(
    record: dict[str, Any], llama_lib_dir: Path
) -> None:
    """A llama-cpp-python installed over the script's (``pip install --force-reinstall``,
    a native wheel) leaves llama-build.json behind, and on a CPU without AVX-512 or AMX
    nothing else here would tell: the libraries themselves do."""
    wheel = Path(record["wheel"])
    if not wheel.is_file():
        pytest.skip(f"{wheel} is gone (cache cleared): nothing to compare the libraries with")
    expected = wheel_library_hashes(wheel)
    assert any(Path(p).name.startswith("libggml-cpu") for p in expected), expected
    site = llama_lib_dir.parent
    assert [p for p, h in expected.items() if file_hash(site / p) != h] == []


@pytest.mark.skipif(not X86, reason="x86 instruction sets")
def test_system_info_shows_avx2_and_no_avx512_or_amx(record: dict[str, Any]) -> None:
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    info = done.stdout
    assert re.search(r"\bAVX2 = 1\b", info), info
    assert not re.findall(r"\b(AVX512\w*|AMX\w*) = 1\b", info), info


def first_forbidden_instruction(lib: Path) -> tuple[str | None, int]:
    """The first AMX or AVX-512 instruction in ``lib``'s disassembly (or None), and how
    many instructions used a ymm register before it: objdump's output is streamed and
    stopped at the first hit."""
    with subprocess.Popen(
        ["objdump", "-d", "--no-show-raw-insn", str(lib)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        ymm = 0
        try:
            for line in proc.stdout:
                if FORBIDDEN_ASM.search(line):
                    return line.strip(), ymm
                ymm += "%ymm" in line
        finally:
            proc.kill()
    return None, ymm


@pytest.mark.skipif(not X86, reason="x86 instruction sets")
@pytest.mark.parametrize(
    ("asm", "forbidden"),
    [
        ("vaddps %zmm1, %zmm2, %zmm3", True),
        ("vpdpbusd %zmm1, %zmm2, %zmm3", True),
        ("tilezero %tmm0", True),
        ("ldtilecfg (%rax)", True),
        ("tdpbssd %tmm1, %tmm2, %tmm3", True),
        ("tdpbf16ps %tmm1, %tmm2, %tmm3", True),
        ("vaddps %ymm1, %ymm2, %ymm3", False),
        ("vfmadd231ps %ymm1, %ymm2, %ymm3", False),
    ],
)
def test_disassembly_check_finds_amx_and_avx512(tmp_path: Path, asm: str, forbidden: bool) -> None:
    if shutil.which("objdump") is None or shutil.which("as") is None:
        pytest.skip("binutils (as, objdump) is not installed")
    src, obj = tmp_path / "k.s", tmp_path / "k.o"
    src.write_text(f"vmovaps %ymm0, %ymm1\n{asm}\n")
    subprocess.run(["as", str(src), "-o", str(obj)], check=True, timeout=30)
    hit, ymm = first_forbidden_instruction(obj)
    assert (hit is not None) is forbidden, hit
    assert ymm == (1 if forbidden else 2)  # stopped at the hit; else read to the end


@pytest.mark.skipif(not X86, reason="x86 instruction sets")
def test_ggml_has_no_amx_or_avx512_instructions(
    record: dict[str, Any], llama_lib_dir: Path
) -> None:
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    libs = sorted(llama_lib_dir.rglob("libggml*.so"))
    assert any(p.name.startswith("libggml-cpu") for p in libs), libs
    ymm_total = 0
    for lib in libs:
        hit, ymm = first_forbidden_instruction(lib)
        assert hit is None, f"{lib.name}: {hit}"
        ymm_total += ymm
    assert ymm_total > 1000  # the AVX2 kernels are there: the disassembly was read
