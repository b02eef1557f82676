"""What the installed llama.cpp build is, and whether it runs on this CPU.

A llama.cpp compiled with ``-march=native`` carries every instruction set of the
machine that built it (AVX-512, AMX on Intel Xeons) and dies with SIGILL on the
next machine that lacks one. This module finds out, without ever running
llama.cpp in the caller's process: :func:`probe_build` and :func:`decode_check`
each start ``python -m quantroute.engines.llamacpp.build`` and read its answer,
so a build that crashes kills only that child, whose exit status is put in words
by :func:`~quantroute.engines.exits.describe_exit`.

::

    python -m quantroute.engines.llamacpp.build --json            # BuildInfo as JSON
    python -m quantroute.engines.llamacpp.build --decode F.gguf   # one-token decode
    python -m quantroute.engines.llamacpp.build --decode F.gguf --fault sigill

>>> compiled_cpu_features("CPU : SSE3 = 1 | AVX2 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | ")
('SSE3', 'AVX2', 'AMX_INT8', 'LLAMAFILE')
>>> missing_features(("AVX2", "AMX_INT8", "LLAMAFILE"), frozenset({"avx2"}))
('AMX_INT8',)
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from quantroute.engines.exits import describe_exit
from quantroute.errors import EngineCrashedError, EngineError

log = logging.getLogger(__name__)

RECORD_NAME = "llama-build.json"  # written into the venv by scripts/llama_build.sh
CPUINFO = Path("/proc/cpuinfo")
DECODE_PROMPT = "def main():\n    "
FAULTS = ("sigill",)

# ggml's feature names (``ggml_backend_cpu_get_features``) → the /proc/cpuinfo flag the
# CPU must list. Features absent here (LLAMAFILE, OPENMP, REPACK, SVE_CNT...) are not
# instruction sets and cannot be missing.
CPUINFO_FLAGS: Mapping[str, str] = {
    "SSE3": "pni",
    "SSSE3": "ssse3",
    "AVX": "avx",
    "AVX_VNNI": "avx_vnni",
    "AVX2": "avx2",
    "F16C": "f16c",
    "FMA": "fma",
    "BMI2": "bmi2",
    "AVX512": "avx512f",
    "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni",
    "AVX512_BF16": "avx512_bf16",
    "AMX_INT8": "amx_int8",
    "NEON": "asimd",
    "ARM_FMA": "asimd",
    "FP16_VA": "asimdhp",
    "MATMUL_INT8": "i8mm",
    "SVE": "sve",
    "DOTPROD": "asimddp",
    "SME": "sme",
    "SME2": "sme2",
}


@dataclass(frozen=True, slots=True)
class BuildRecord:
    """What ``scripts/llama_build.sh`` installed, from ``<venv>/llama-build.json``."""

    path: str
    key: str
    backend: str
    version: str
    wheel: str
    cmake_flags: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BuildInfo:
    """The llama.cpp build this interpreter imports, and this machine's CPU.

    ``cpu_features`` are the instruction sets compiled into the CPU backend (the
    ``CPU : ... = 1`` part of ``system_info``); ``machine_features`` are the ones
    this CPU has, in the same names; ``missing_features`` are compiled in but
    absent here: the build dies with SIGILL when it reaches them.
    """

    llama_cpp_python: str
    llama_version: str | None
    ggml_version: str | None
    ggml_commit: str | None
    system_info: str
    backends: tuple[str, ...]
    gpu_offload: bool
    cpu_features: tuple[str, ...]
    machine_features: tuple[str, ...]
    missing_features: tuple[str, ...]
    record: BuildRecord | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> BuildInfo:
        record = doc.get("record")
        return cls(
            llama_cpp_python=str(doc["llama_cpp_python"]),
            llama_version=doc.get("llama_version"),
            ggml_version=doc.get("ggml_version"),
            ggml_commit=doc.get("ggml_commit"),
            system_info=str(doc["system_info"]),
            backends=tuple(doc["backends"]),
            gpu_offload=bool(doc["gpu_offload"]),
            cpu_features=tuple(doc["cpu_features"]),
            machine_features=tuple(doc["machine_features"]),
            missing_features=tuple(doc["missing_features"]),
            record=None if record is None else _record_from_json(record),
        )


@dataclass(frozen=True, slots=True)
class DecodeCheck:
    """One GGUF file loaded and decoded for one token in a child process."""

    path: str
    ok: bool
    returncode: int
    detail: str  # the token decoded, or why not (describe_exit words for a crash)
    seconds: float


# -- parsers (pure) ---------------------------------------------------------------------


def parse_system_info(text: str) -> dict[str, dict[str, str]]:
    """``llama_print_system_info()`` → ``{backend: {feature: value}}``.

    >>> parse_system_info("CUDA : ARCHS = 900 | CPU : SSE3 = 1 | AVX = 1 | ")
    {'CUDA': {'ARCHS': '900'}, 'CPU': {'SSE3': '1', 'AVX': '1'}}
    """
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for item in text.split("|"):
        item = item.strip()
        if not item:
            continue
        if " : " in item:  # "CPU : SSE3 = 1" opens a backend's section
            backend, item = (part.strip() for part in item.split(" : ", 1))
            current = sections.setdefault(backend, {})
        if current is None or "=" not in item:
            continue
        name, value = (part.strip() for part in item.split("=", 1))
        current[name] = value
    return sections


def compiled_cpu_features(system_info: str) -> tuple[str, ...]:
    """The CPU backend's features that are on (``= 1``), in ggml's order."""
    cpu = parse_system_info(system_info).get("CPU", {})
    return tuple(name for name, value in cpu.items() if value == "1")


def parse_cpuinfo_flags(text: str) -> frozenset[str]:
    """The CPU flags of ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on Arm)."""
    flags: set[str] = set()
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def machine_features(flags: frozenset[str]) -> tuple[str, ...]:
    """The ggml features whose instructions this CPU has, given its cpuinfo flags."""
    return tuple(name for name, flag in CPUINFO_FLAGS.items() if flag in flags)


def missing_features(compiled: Sequence[str], flags: frozenset[str]) -> tuple[str, ...]:
    """Compiled-in instruction sets this CPU lacks; none when its flags are unknown."""
    if not flags:
        return ()
    return tuple(f for f in compiled if f in CPUINFO_FLAGS and CPUINFO_FLAGS[f] not in flags)


def read_cpu_flags(path: Path = CPUINFO) -> frozenset[str]:
    """This machine's CPU flags; empty where ``/proc/cpuinfo`` cannot be read."""
    try:
        return parse_cpuinfo_flags(path.read_text())
    except OSError:
        return frozenset()


def read_build_record(prefix: Path | None = None) -> BuildRecord | None:
    """``<prefix>/llama-build.json`` (``prefix``: this interpreter's venv), if present."""
    path = Path(sys.prefix if prefix is None else prefix) / RECORD_NAME
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("unreadable build record %s: %s", path, exc)
        return None
    return _record_from_json({**doc, "path": str(path)})


def _record_from_json(doc: Mapping[str, Any]) -> BuildRecord:
    return BuildRecord(
        path=str(doc.get("path", "")),
        key=str(doc.get("key", "")),
        backend=str(doc.get("backend", "")),
        version=str(doc.get("version", "")),
        wheel=str(doc.get("wheel", "")),
        cmake_flags=tuple(str(f) for f in doc.get("cmake_flags", ())),
    )


# -- the parent's side: run a child, read its answer ------------------------------------


def _child_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "quantroute.engines.llamacpp.build", *args]


def _fault_args(fault: str | None) -> list[str]:
    if fault is None:
        return []
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    return ["--fault", fault]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def probe_build(timeout_s: float = 60.0, *, fault: str | None = None) -> BuildInfo:
    """Describe the installed llama.cpp build, from a child process.

    Raises :class:`EngineCrashedError` (with :func:`describe_exit`'s words) when the
    child dies, :class:`EngineError` when it fails or does not answer in time.
    ``fault="sigill"``: the child dies of SIGILL before it loads llama.cpp (tests).
    """
    try:
        proc = subprocess.run(
            _child_command("--json", *_fault_args(fault)),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        raise EngineError(f"the llama.cpp build probe did not answer in {timeout_s:g} s") from exc
    if proc.returncode < 0:
        raise EngineCrashedError(
            f"the llama.cpp build probe died: {describe_exit(proc.returncode)}"
        )
    if proc.returncode != 0:
        why = _last_line(proc.stderr) or "no message"
        raise EngineError(
            f"the llama.cpp build probe failed ({describe_exit(proc.returncode)}): {why}"
        )
    try:
        return BuildInfo.from_json(json.loads(proc.stdout))
    except (ValueError, KeyError, TypeError) as exc:
        raise EngineError("the llama.cpp build probe answered something unreadable") from exc


def decode_check(
    model_path: Path | str,
    timeout_s: float = 120.0,
    n_threads: int = 1,
    *,
    fault: str | None = None,
) -> DecodeCheck:
    """Load ``model_path`` and decode one token after a short prompt, in a child process.

    ``fault="sigill"`` makes the child raise SIGILL on itself before decoding, as a
    build with instructions this CPU lacks would (for tests of what reports it).

    >>> decode_check("f16.gguf", fault="sigill").detail  # doctest: +SKIP
    'illegal instruction (SIGILL): this llama.cpp build uses CPU instructions ...'
    """
    path = str(model_path)
    args = ["--decode", path, "--n-threads", str(n_threads), *_fault_args(fault)]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            _child_command(*args), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        seconds = time.monotonic() - start
        detail = f"no answer within {timeout_s:g} s (killed)"
        return DecodeCheck(path, False, -signal.SIGKILL, detail, seconds)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        detail = describe_exit(proc.returncode)
        why = _last_line(proc.stderr)
        if proc.returncode > 0 and why:
            detail = f"{detail}: {why}"
        return DecodeCheck(path, False, proc.returncode, detail, seconds)
    try:
        answer = json.loads(proc.stdout)
        detail = (
            f"decoded token {answer['token']} ({answer['piece']!r}) "
            f"after a {answer['n_prompt']}-token prompt"
        )
    except (ValueError, KeyError, TypeError):
        return DecodeCheck(
            path, False, 0, "the decode child answered something unreadable", seconds
        )
    return DecodeCheck(path, True, 0, detail, seconds)


# -- the child's side: everything that touches llama.cpp --------------------------------


def _c_string(lib: Any, name: str) -> str | None:
    """``const char * name(void)`` from the loaded llama.cpp libraries, if exported."""
    try:
        fn = getattr(lib, name)
    except AttributeError:
        return None
    fn.argtypes, fn.restype = [], ctypes.c_char_p
    value = fn()
    return value.decode("utf-8", "replace") if value else None


def _registered_backends(lib: Any) -> tuple[str, ...]:
    """ggml's registered backends ("CUDA", "CPU", ...), via ggml_backend_reg_*."""
    try:
        count, get, name = (
            lib.ggml_backend_reg_count,
            lib.ggml_backend_reg_get,
            lib.ggml_backend_reg_name,
        )
    except AttributeError:
        return ()
    count.argtypes, count.restype = [], ctypes.c_size_t
    get.argtypes, get.restype = [ctypes.c_size_t], ctypes.c_void_p
    name.argtypes, name.restype = [ctypes.c_void_p], ctypes.c_char_p
    return tuple(name(get(i)).decode() for i in range(count()))


def collect_build_info() -> BuildInfo:
    """Build :class:`BuildInfo` by loading llama.cpp here. Only the child calls this."""
    import llama_cpp as lc
    from llama_cpp import llama_cpp as low

    lib = low._lib  # dlsym on it also finds libggml's and libggml-base's symbols
    lc.llama_backend_init()
    system_info = lc.llama_print_system_info().decode("utf-8", "replace")
    compiled = compiled_cpu_features(system_info)
    backends = _registered_backends(lib) or tuple(parse_system_info(system_info))
    flags = read_cpu_flags()
    return BuildInfo(
        llama_cpp_python=str(lc.__version__),
        llama_version=_c_string(lib, "llama_version"),
        ggml_version=_c_string(lib, "ggml_version"),
        ggml_commit=_c_string(lib, "ggml_commit"),
        system_info=system_info.strip(),
        backends=backends,
        gpu_offload=bool(lc.llama_supports_gpu_offload()),
        cpu_features=compiled,
        machine_features=machine_features(flags),
        missing_features=missing_features(compiled, flags),
        record=read_build_record(),
    )


def _decode_one(path: str, n_threads: int, fault: str | None) -> dict[str, Any]:
    """Prompt, then one single-token decode (greedy): the path a first reply takes."""
    import llama_cpp as lc

    lc.llama_backend_init()
    lc.llama_log_set(_errors_only_log(), ctypes.c_void_p(0))
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 64
    cparams.n_seq_max = 1
    cparams.n_threads = cparams.n_threads_batch = n_threads
    cparams.no_perf = True
    ctx = lc.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    data = DECODE_PROMPT.encode()
    buf = (lc.llama_token * 64)()
    n_prompt = lc.llama_tokenize(vocab, data, len(data), buf, 64, True, False)
    if n_prompt <= 0:
        raise RuntimeError(f"llama.cpp tokenized the prompt to {n_prompt} tokens")
    _suffer(fault)
    batch = lc.llama_batch_init(64, 0, 1)
    for i, tok in enumerate(buf[:n_prompt]):  # the prompt, logits for its last token
        _put(batch, i, tok, i, logits=i == n_prompt - 1)
    batch.n_tokens = n_prompt
    first = _decode_greedy(lc, ctx, batch, n_vocab)
    _put(batch, 0, first, n_prompt, logits=True)  # then one token alone: the gemv path
    batch.n_tokens = 1
    token = _decode_greedy(lc, ctx, batch, n_vocab)
    piece = ctypes.create_string_buffer(64)
    n = lc.llama_token_to_piece(vocab, token, piece, 64, 0, True)
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return {
        "token": token,
        "piece": piece.raw[: max(n, 0)].decode("utf-8", "replace"),
        "n_prompt": n_prompt,
    }


def _suffer(fault: str | None) -> None:
    if fault == "sigill":  # as a build with instructions this CPU lacks would
        signal.raise_signal(signal.SIGILL)


def _put(batch: Any, i: int, token: int, pos: int, *, logits: bool) -> None:
    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
    batch.seq_id[i][0] = 0


def _decode_greedy(lc: Any, ctx: Any, batch: Any, n_vocab: int) -> int:
    """Decode ``batch``; the most likely next token after its last one."""
    import numpy as np

    rc = lc.llama_decode(ctx, batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")
    ptr = lc.llama_get_logits_ith(ctx, batch.n_tokens - 1)
    return int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())  # [V]


@functools.cache
def _errors_only_log() -> Any:
    """llama.cpp's log callback: errors only, to stderr. Cached, so that it stays alive
    as long as llama.cpp may call it."""
    import llama_cpp as lc

    @lc.llama_log_callback  # type: ignore[untyped-decorator]
    def callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if level == _GGML_LOG_LEVEL_ERROR:
            sys.stderr.write(text.decode("utf-8", "replace"))

    return callback


_GGML_LOG_LEVEL_ERROR = 3


def _answer_channel() -> IO[str]:
    """The real stdout for the answer; fd 1 then points at stderr, so that anything
    llama.cpp prints cannot corrupt the JSON."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="probe the llama.cpp build (internal)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--json", action="store_true", help="print the build as JSON")
    mode.add_argument("--decode", metavar="GGUF", help="decode one token with this model")
    parser.add_argument("--n-threads", type=int, default=1)
    parser.add_argument("--fault", choices=FAULTS, default=None, help="(tests) crash on purpose")
    args = parser.parse_args(argv)
    out = _answer_channel()
    # A crash here is the expected failure, and a core file of a mapped model is huge.
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    try:
        if args.json:
            _suffer(args.fault)
            answer = collect_build_info().to_json()
        else:
            answer = _decode_one(args.decode, args.n_threads, args.fault)
    except RuntimeError as exc:
        print(f"llamacpp_build: {exc}", file=sys.stderr)
        return 3
    out.write(json.dumps(answer) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
