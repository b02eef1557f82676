"""The GGUF check in a child process bounded in time and memory, and `quantroute validate`."""

from __future__ import annotations

import re
import shutil
import struct
from pathlib import Path

import pytest

from qrtest import demo_model_dir
from quantroute.cli import main
from quantroute.registry.gguf_check import check_gguf_isolated


def _first_tensor_offset_at(path: Path) -> int:
    """The file position of the first tensor's data-offset field (its last u64)."""
    from gguf import GGUFReader

    field = GGUFReader(path).tensors[0].field
    return int(field.offset) + sum(int(p.nbytes) for p in field.parts[:-1])


def test_sound_files_pass_and_bad_ones_are_refused_with_a_reason(tmp_path: Path) -> None:
    good = demo_model_dir() / "q8_0.gguf"
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    magic = tmp_path / "magic.gguf"
    magic.write_bytes(b"GGML" + data[4:])
    counts = tmp_path / "counts.gguf"
    counts.write_bytes(data[:8] + struct.pack("<Q", 1 << 40) + data[16:])
    at = _first_tensor_offset_at(good)
    past = tmp_path / "past.gguf"
    past.write_bytes(data[:at] + struct.pack("<Q", 1 << 33) + data[at + 8 :])
    skew = tmp_path / "skew.gguf"
    (offset,) = struct.unpack("<Q", data[at : at + 8])
    skew.write_bytes(data[:at] + struct.pack("<Q", offset + 1) + data[at + 8 :])
    found = check_gguf_isolated([good, cut, magic, counts, past, skew, tmp_path / "none.gguf"])
    assert found[0] is None
    assert "past the end of the file" in (found[1] or "")
    assert found[2] == "not a GGUF file (bad magic)"
    assert "tensors (absurd)" in (found[3] or "")
    assert "past the end of the file" in (found[4] or "")
    assert "not a multiple of the alignment" in (found[5] or "")
    assert "cannot read" in (found[6] or "")


def test_the_child_is_bounded_in_memory_and_time() -> None:
    good = demo_model_dir() / "f16.gguf"
    (starved,) = check_gguf_isolated([good], memory_bytes=32 << 20)
    assert starved is not None and "memory limit" in starved
    (slow,) = check_gguf_isolated([good], timeout_s=0.001)
    assert slow is not None and "took over" in slow


def test_validate_a_file_and_a_repository(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", str(demo_model_dir() / "q4_k_m.gguf")]) == 0
    assert capsys.readouterr().out.strip().endswith(": ok")
    repo = tmp_path / "repo"
    shutil.copytree(demo_model_dir(), repo / "tiny-llama")
    assert main(["validate", str(repo)]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama: manifest ok" in out
    ok = dict(re.findall(r"tiny-llama:(\w+): ok \(([^,]+), sha256", out))
    assert ok == {  # every branch: the GGUF files, and each ONNX folder's graph
        "f16": "f16.gguf",
        "q8_0": "q8_0.gguf",
        "q4_k_m": "q4_k_m.gguf",
        "onnx_fp16": "model.onnx",
        "onnx_int8": "model.onnx",
        "onnx_int4": "model.onnx",
    }
    data = (repo / "tiny-llama" / "q8_0.gguf").read_bytes()
    (repo / "tiny-llama" / "q8_0.gguf").write_bytes(data[:100])
    assert main(["validate", str(repo)]) == 1
    assert (
        "tiny-llama:q8_0: q8_0.gguf does not match the manifest's sha256" in capsys.readouterr().out
    )
    assert main(["validate", str(repo / "tiny-llama" / "q8_0.gguf")]) == 1
    assert "past the end" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["gguf", "onnx"])
def test_the_check_child_sees_no_secret_of_the_gateways(
    kind: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The child parses hostile bytes: it gets the workers' allowlisted environment,
    not the gateway's (the admin key, a cloud's credentials)."""
    import subprocess

    from quantroute.registry import gguf_check, onnx_pair

    monkeypatch.setenv("QUANTROUTE_SERVER__ADMIN_KEY", "sk-admin-secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    seen: list[dict[str, str]] = []

    def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[bytes]:
        env = kw["env"]
        assert isinstance(env, dict)
        seen.append(env)
        return subprocess.CompletedProcess(argv, 1, b"", b"")

    monkeypatch.setattr(subprocess, "run", run)
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF")
    if kind == "gguf":
        gguf_check.check_gguf_isolated([path])
    else:
        onnx_pair.check_onnx_isolated([(path, None)])
    (env,) = seen
    assert "PATH" in env and env["OMP_NUM_THREADS"] == "1"
    assert not any("secret" in v for v in env.values())


def test_a_child_that_dies_fails_only_the_file_that_killed_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch whose child runs out of time or memory is checked again a file at a time:
    the file that did it is refused, its siblings are not (they were all refused)."""
    from quantroute.registry import gguf_check

    real = gguf_check._run_child
    bad = demo_model_dir() / "q8_0.gguf"
    runs: list[int] = []

    def dying(paths: list[Path], timeout_s: float, memory_bytes: int) -> list[object]:
        runs.append(len(paths))
        if bad in paths:  # fault injection: this file "kills" any child that reads it
            return [f"{gguf_check._CHILD_FAILED}failed (signal 9; over its memory limit?)"] * len(
                paths
            )
        return real(paths, timeout_s, memory_bytes)

    monkeypatch.setattr(gguf_check, "_run_child", dying)
    good = [demo_model_dir() / n for n in ("f16.gguf", "q4_k_m.gguf")]
    found = check_gguf_isolated([good[0], bad, good[1]])
    assert found[0] is None and found[2] is None
    assert "over its memory limit" in (found[1] or "")
    assert runs == [3, 1, 1, 1]
