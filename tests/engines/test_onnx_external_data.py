"""An ONNX worker serving a graph whose weights lie in ``model.onnx.data``
(``engines/onnx/worker_model.py``'s ``_load`` with ``data``; the worker's
``--onnx-data``): it computes what the single-file folder computes, loads the verified
inodes even once other files were renamed over both names (the data file handed to ONNX
Runtime as a read-only mapping of its descriptor, unmapped once the session is built),
and refuses in words what it cannot serve. The worker
process is started as the gateway starts it (``WorkerFiles.launch``: the three files as
verified descriptors, ``--onnx-data /proc/self/fd/N``)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from qrtest import demo_model_dir, demo_onnx_fp32

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from quantroute.engines.base import SamplingParams
from quantroute.engines.llamacpp import wire
from quantroute.engines.llamacpp.model_file import WorkerFiles
from quantroute.engines.llamacpp.options import WorkerOptions
from quantroute.engines.llamacpp.worker_model import LoadError
from quantroute.engines.onnx.layout import MODEL_FILE, TOKENIZER_FILE
from quantroute.engines.onnx.worker_model import OnnxModel
from quantroute.registry.digests import identity
from quantroute.registry.manifest import sha256_file
from quantroute.registry.verified import VerifiedFile

DATA = "model.onnx.data"
GARBAGE = b"\x08\x07not a model" * 100
PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The demo's F16 GGUF as fp32 folders: one file, and weights in model.onnx.data."""
    single, external = demo_onnx_fp32(tmp_path_factory.mktemp("onnx"))
    assert (external / DATA).is_file() and not (single / DATA).exists()
    return single, external


def _model(path: Path | str, folder: Path, data: Path | str | None = None) -> OnnxModel:
    return OnnxModel(
        str(path),
        str(folder / TOKENIZER_FILE),
        n_ctx=64,
        parallel=1,
        n_threads=1,
        data=None if data is None else str(data),
    )


def _greedy(model: OnnxModel, n: int = 6) -> list[int]:
    """``n`` greedy tokens after :data:`PROMPT` (one slot, every step a decode)."""
    tokens = model.tokenize(PROMPT, False)
    out: list[int] = []
    for step in range(n):
        feed = tokens if step == 0 else out[-1:]
        start = len(tokens) + len(out) - len(feed) if step else 0
        for i, token in enumerate(feed):
            model.put(i, token, start + i, 0, i == len(feed) - 1)
        assert model.decode(len(feed)) == 0, model.decode_failure(0)
        out.append(int(model.row(len(feed) - 1).argmax()))
    return out


def _mapped(name: str) -> list[str]:
    """This process's mappings of files called ``name`` (/proc/self/maps)."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if name in line]


def test_the_data_file_serves_what_the_single_file_serves(folders: tuple[Path, Path]) -> None:
    single, external = folders
    model = _model(external / MODEL_FILE, external, external / DATA)
    sizes = (external / MODEL_FILE).stat().st_size + (external / DATA).stat().st_size
    assert model.model_bytes == sizes
    assert _greedy(model) == _greedy(_model(single / MODEL_FILE, single))
    assert _mapped(DATA) == []  # the mapping is gone once the session is built


def test_descriptors_serve_the_verified_files_though_others_replaced_them(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    single, external = folders
    served = tmp_path / "served"
    shutil.copytree(external, served)
    fds = [os.open(served / MODEL_FILE, os.O_RDONLY), os.open(served / DATA, os.O_RDONLY)]
    try:
        for name in (MODEL_FILE, DATA):  # garbage renamed over both names after the check
            (tmp_path / "garbage").write_bytes(GARBAGE)
            os.replace(tmp_path / "garbage", served / name)
        model = _model(f"/proc/self/fd/{fds[0]}", served, f"/proc/self/fd/{fds[1]}")
    finally:
        for fd in fds:
            os.close(fd)
    assert _greedy(model) == _greedy(_model(single / MODEL_FILE, single))
    with pytest.raises(LoadError):  # by the paths: the garbage now there
        _model(served / MODEL_FILE, served, served / DATA)


def test_what_it_cannot_serve_is_a_load_error_in_words(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    single, external = folders
    with pytest.raises(LoadError, match=r"the data file cannot be read \(No such file"):
        _model(external / MODEL_FILE, external, tmp_path / "missing.data")
    with pytest.raises(LoadError, match=r"model\.onnx keeps no tensor in another file"):
        _model(single / MODEL_FILE, single, external / DATA)
    short = tmp_path / DATA
    short.write_bytes((external / DATA).read_bytes()[:4096])
    with pytest.raises(LoadError, match=r"lies past the end of the data file \(4096 bytes\)"):
        _model(external / MODEL_FILE, external, short)
    # without its data file, ONNX Runtime refuses the graph (beside /proc/self/fd/M: none)
    with pytest.raises(LoadError, match=r"onnxruntime could not load model\.onnx"):
        _model(external / MODEL_FILE, external)


def _verified(path: Path) -> VerifiedFile:
    return VerifiedFile(path, path.name, sha256_file(path), identity(os.stat(path)), settled=False)


def _serve(argv: list[str], fds: tuple[int, ...], n: int = 6) -> tuple[int, list[int]]:
    """Run the worker ``argv``: its model size at ready and ``n`` greedy tokens."""
    gen = wire.Generate("g", PROMPT, SamplingParams(max_tokens=n, temperature=0.0))
    with subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=fds
    ) as worker:
        assert worker.stdin is not None and worker.stdout is not None
        try:
            ready = wire.decode_event(worker.stdout.readline())
            assert isinstance(ready, wire.Ready), ready
            worker.stdin.write(wire.encode(gen))
            worker.stdin.flush()
            tokens: list[int] = []
            while not isinstance(
                event := wire.decode_event(worker.stdout.readline()), wire.Finished
            ):
                if isinstance(event, wire.Tokens):
                    tokens += [token for _, _, token in event.batch]
                elif isinstance(event, wire.Token):
                    tokens.append(event.token)
            worker.stdin.close()
            assert worker.wait(timeout=60) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
    return ready.info.model_bytes, tokens


def test_the_worker_process_loads_its_verified_data_descriptor(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    single, external = folders
    served = tmp_path / "served"
    shutil.copytree(external, served)
    options = WorkerOptions(n_ctx=64, parallel=1, n_threads=1, backend="onnx")
    files = WorkerFiles(
        served / MODEL_FILE,
        _verified(served / MODEL_FILE),
        _verified(served / TOKENIZER_FILE),
        _verified(served / DATA),
    )
    sizes = (served / MODEL_FILE).stat().st_size + (served / DATA).stat().st_size
    launch = asyncio.run(files.launch(options))
    try:
        data_arg = launch.argv[launch.argv.index("--onnx-data") + 1]
        assert data_arg == f"/proc/self/fd/{launch.pass_fds[2]}"
        (tmp_path / "garbage").write_bytes(GARBAGE)
        os.replace(tmp_path / "garbage", served / DATA)  # after the check, before the load
        model_bytes, tokens = _serve(list(launch.argv), launch.pass_fds)
    finally:
        files.release()
    reference = WorkerFiles(single / MODEL_FILE, None, single / TOKENIZER_FILE)
    assert "--onnx-data" not in reference.argv(options)
    assert model_bytes == sizes
    assert len(tokens) == 6 and tokens == _serve(reference.argv(options), ())[1]


def test_a_gguf_worker_refuses_a_data_file(tmp_path: Path) -> None:
    gguf = demo_model_dir() / "q8_0.gguf"
    argv = WorkerFiles(gguf, None, None, tmp_path / DATA).argv(WorkerOptions(n_ctx=64))
    done = subprocess.run(argv, input=b"", capture_output=True, timeout=120, check=False)
    assert done.returncode == 1
    assert b"--onnx-data needs --backend onnx" in done.stdout
