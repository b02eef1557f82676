from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qrtest import demo_model_dir

pytestmark = pytest.mark.slow


def test_profile_command_writes_profile_and_plot(tmp_path: Path) -> None:
    target = tmp_path / "repo" / "tiny-llama"
    shutil.copytree(demo_model_dir(), target)
    (target / "profile.json").unlink()
    (target / "profile.png").unlink()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "quantroute.cli",
            "profile",
            str(tmp_path / "repo"),
            "--model",
            "tiny-llama",
            "--n-ctx",
            "128",
            "--max-chunks",
            "3",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert "q4_k_m" in out.stdout and "mean KLD" in out.stdout
    doc = json.loads((target / "profile.json").read_text())
    assert doc["method"]["n_ctx"] == 128 and doc["method"]["n_chunks"] == 3
    assert (target / "profile.png").stat().st_size > 1000
