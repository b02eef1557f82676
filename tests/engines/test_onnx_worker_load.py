"""How an ONNX worker loads ``model.onnx`` (``engines/onnx/worker_model.py``'s ``_load``):
ONNX Runtime reads the one file the worker opened, through ``/proc/self/fd``, so a
verified descriptor serves the bytes it was verified for even once the folder's file is
replaced; every file it cannot serve is a ``LoadError`` in words; and the session holds
the weights without the copy a session created from bytes keeps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qrtest import demo_model_dir

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import onnx

from quantroute.demo.onnx_export import export_onnx
from quantroute.engines.llamacpp.worker_model import LoadError
from quantroute.engines.onnx.layout import MODEL_FILE, TOKENIZER_FILE
from quantroute.engines.onnx.worker_model import OnnxModel


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's F16 GGUF as an fp32 ONNX folder."""
    out = tmp_path_factory.mktemp("onnx") / "onnx_fp32"
    export_onnx(demo_model_dir() / "f16.gguf", out, "fp32")
    return out


def _model(path: Path | str, folder: Path) -> OnnxModel:
    return OnnxModel(str(path), str(folder / TOKENIZER_FILE), n_ctx=64, parallel=1, n_threads=1)


def _greedy(model: OnnxModel, prompt: list[int]) -> int:
    for i, token in enumerate(prompt):
        model.put(i, token, i, 0, i == len(prompt) - 1)
    assert model.decode(len(prompt)) == 0, model.decode_failure(0)
    return int(model.row(len(prompt) - 1).argmax())


def test_a_descriptor_serves_the_file_it_holds_though_another_replaced_it(
    folder: Path, tmp_path: Path
) -> None:
    """The gateway's ``/proc/self/fd/N``: what loads is the inode it opened and verified,
    not the file renamed over the folder's ``model.onnx`` since."""
    served = tmp_path / "onnx_fp32"
    shutil.copytree(folder, served)
    original = served / MODEL_FILE
    size = original.stat().st_size
    fd = os.open(original, os.O_RDONLY)
    try:
        swapped = served / "swapped.onnx"
        swapped.write_bytes(b"\x08\x07not a model" * 100)
        os.replace(swapped, original)  # the folder's model.onnx is now another file
        model = _model(f"/proc/self/fd/{fd}", served)
    finally:
        os.close(fd)
    assert model.model_bytes == size != original.stat().st_size
    reference = _model(folder / MODEL_FILE, folder)
    prompt = model.tokenize("def add(a, b):\n    return", False)
    assert _greedy(model, prompt) == _greedy(reference, prompt)
    with pytest.raises(LoadError, match=r"onnxruntime could not load model\.onnx"):
        _model(original, served)  # by its path: the file that replaced it


def _external_data(folder: Path, out: Path) -> Path:
    """``folder``'s graph with its weights in ``model.onnx.data`` beside it."""
    out.mkdir()
    shutil.copy(folder / TOKENIZER_FILE, out / TOKENIZER_FILE)
    graph = onnx.load(str(folder / MODEL_FILE))
    onnx.save_model(
        graph, str(out / MODEL_FILE), save_as_external_data=True, location="model.onnx.data"
    )
    assert (out / "model.onnx.data").stat().st_size > (out / MODEL_FILE).stat().st_size
    return out / MODEL_FILE


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("missing", r"model\.onnx cannot be read \(No such file or directory\)"),
        ("directory", r"model\.onnx cannot be read \(not a regular file\)"),
        ("under a file", r"model\.onnx cannot be read \(Not a directory\)"),
        ("garbage", r"onnxruntime could not load model\.onnx: .*Protobuf parsing failed"),
        ("external data", r"onnxruntime could not load model\.onnx: .*[Ee]xternal data"),
    ],
)
def test_a_file_it_cannot_serve_is_a_load_error_in_words(
    folder: Path, tmp_path: Path, kind: str, words: str
) -> None:
    path = tmp_path / MODEL_FILE
    if kind == "directory":
        path.mkdir()
    elif kind == "under a file":
        (tmp_path / "folder").write_bytes(b"")
        path = tmp_path / "folder" / MODEL_FILE
    elif kind == "garbage":
        path.write_bytes(b"\x08\x07not a model" * 100)
    elif kind == "external data":
        path = _external_data(folder, tmp_path / "external")
    with pytest.raises(LoadError, match=words):
        _model(path, folder)
    if kind == "external data":  # through a descriptor too: beside /proc/self/fd, not the folder
        fd = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(LoadError, match=words):
                _model(f"/proc/self/fd/{fd}", folder)
        finally:
            os.close(fd)


_GROWTH = """
import json, os, sys
import onnxruntime as ort
from quantroute.engines.onnx.worker_model import _load

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

path, how = sys.argv[1], sys.argv[2]
ort.InferenceSession  # imported; the first session's thread pool is counted in both
before = rss()
if how == "worker":
    fd = os.open(path, os.O_RDONLY)
    size, session = _load(f"/proc/self/fd/{fd}", 1, False, True)
else:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    with open(path, "rb") as f:
        session = ort.InferenceSession(f.read(), options, providers=["CPUExecutionProvider"])
print(json.dumps(rss() - before))
"""


def _growth(path: Path, how: str) -> int:
    """The resident bytes a fresh process gains loading ``path`` (``worker``: as the worker
    does; ``bytes``: a session created from the file's bytes)."""
    done = subprocess.run(
        [sys.executable, "-c", _GROWTH, str(path), how],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(json.loads(done.stdout.splitlines()[-1]))


def test_the_session_holds_the_weights_without_a_copy_of_the_bytes(folder: Path) -> None:
    """A session created from bytes keeps them (and glibc keeps the load's freed heap):
    the worker's load holds at least the weights' size less."""
    path = folder / MODEL_FILE
    weights = path.stat().st_size
    worker, from_bytes = _growth(path, "worker"), _growth(path, "bytes")
    assert worker + weights <= from_bytes, (worker, from_bytes, weights)


def test_the_worker_does_not_import_the_registry_package() -> None:
    """The registry package (manifests, signing, the watcher) would add ~20 MiB to every
    ONNX worker's resident set, which the memory model's runtime does not count: the
    worker imports its external-data reader only when it is given a data file."""
    code = (
        "import sys\n"
        "import quantroute.engines.llamacpp.worker, quantroute.engines.onnx.worker_model\n"
        "print(sorted(m for m in sys.modules if m.startswith('quantroute.registry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
