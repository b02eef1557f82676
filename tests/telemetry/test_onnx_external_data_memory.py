"""The memory model of an ONNX branch whose weights lie in ``model.onnx.data``: ``W``
counts the tensors in the data file as well as those inline (``read_onnx_shape``, in
the registry's bounded child), so the estimate is the single-file folder's."""

from __future__ import annotations

from pathlib import Path

import pytest

from qrtest import demo_onnx_fp32
from quantroute.errors import ConfigError
from quantroute.registry.onnx_check import DataFile
from quantroute.telemetry.memory_onnx import estimate_onnx_footprint, read_onnx_shape

pytest.importorskip("onnx")

DATA = "model.onnx.data"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return demo_onnx_fp32(tmp_path_factory.mktemp("onnx"))


def test_w_counts_the_weights_in_the_data_file(folders: tuple[Path, Path]) -> None:
    single, external = folders
    one = read_onnx_shape(single / "model.onnx")
    size = (external / DATA).stat().st_size
    for data in (DataFile(DATA, size), None):  # None: the data file beside the graph
        split = read_onnx_shape(external / "model.onnx", data)
        assert split.weights_bytes == one.weights_bytes > size
        assert estimate_onnx_footprint(split, 64) == estimate_onnx_footprint(one, 64)


def test_a_data_file_too_short_for_the_graph_is_refused_in_words(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    graph = tmp_path / "model.onnx"  # a copy: no summary of it kept from another check
    graph.write_bytes((folders[1] / "model.onnx").read_bytes())
    with pytest.raises(ConfigError, match=r"lies past the end of the data file \(4096 bytes\)"):
        read_onnx_shape(graph, DataFile(DATA, 4096))
    with pytest.raises(ConfigError, match=r"declares no data file"):
        read_onnx_shape(graph)  # and no data file beside it
