"""nvidia-smi parsers and provider, on outputs recorded in tests/telemetry/data/."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from quantroute.telemetry import (
    CommandResult,
    DeviceError,
    LinkKind,
    SmiProvider,
    parse_query_csv,
    parse_query_xml,
    parse_topo_matrix,
)
from quantroute.telemetry.smi import QUERY_ARGS, check_output, run_command

DATA = Path(__file__).parent / "data"
MiB = 1 << 20


def data(name: str) -> str:
    return (DATA / name).read_text()


# file, gpu count, (index, total MiB, used MiB, free MiB, util, temp, power, clock, ecc) of one row
CSV_CASES = [
    ("smi_query_1gpu.csv", 1, (0, 81920, 4, 81050, 0.0, 31.0, 62.48, 1410, 0)),
    ("smi_query_2gpu.csv", 2, (1, 24576, 18, 24255, 0.0, 34.0, None, 210, None)),
    ("smi_query_8gpu.csv", 8, (4, 81559, 40210, 40822, 0.57, 55.0, 401.95, 1755, 0)),
    ("smi_query_mig.csv", 1, (0, 40960, 38, 40315, None, 36.0, 66.92, 1410, 0)),
    ("smi_query_not_supported.csv", 1, (0, 2004, 312, 1692, None, 44.0, None, 1097, None)),
]


@pytest.mark.parametrize(("name", "count", "row"), CSV_CASES)
def test_query_csv(name: str, count: int, row: tuple[object, ...]) -> None:
    devices = parse_query_csv(data(name))
    assert len(devices) == count
    assert [d.id for d in devices] == [f"cuda:{i}" for i in range(count)]
    index, total, used, free, util, temp, power, clock, ecc = row
    d = devices[int(index)]
    assert (d.total_bytes, d.used_bytes, d.free_bytes) == (total * MiB, used * MiB, free * MiB)
    assert d.utilization == (None if util is None else pytest.approx(util))
    assert (d.temperature_c, d.power_w, d.sm_clock_mhz, d.ecc_errors) == (temp, power, clock, ecc)
    assert d.healthy and d.uuid is not None and d.uuid.startswith("GPU-")


def test_query_csv_keeps_names_and_uuids_distinct() -> None:
    devices = parse_query_csv(data("smi_query_8gpu.csv"))
    assert {d.name for d in devices} == {"NVIDIA H100 80GB HBM3"}
    assert len({d.uuid for d in devices}) == 8


def test_query_csv_lost_gpu_is_unhealthy_and_noise_lines_skipped() -> None:
    devices = parse_query_csv(data("smi_query_lost_gpu.csv"))
    assert [(d.id, d.healthy) for d in devices] == [("cuda:0", True), ("cuda:1", False)]
    assert devices[1].total_bytes == 0 and devices[1].detail is not None


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("smi_driver_failure.txt", "couldn't communicate with the NVIDIA driver"),
        ("smi_no_devices.txt", "No devices were found"),
        ("smi_version_mismatch.txt", "Driver/library version mismatch"),
    ],
)
def test_driver_errors_become_clear_device_errors(name: str, message: str) -> None:
    with pytest.raises(DeviceError, match=message):
        check_output(CommandResult(9, data(name)), "--query-gpu")
    # and the parser alone refuses them too, instead of returning nothing
    with pytest.raises(DeviceError):
        parse_query_csv(data(name))


def test_non_zero_exit_without_known_message_uses_stderr() -> None:
    with pytest.raises(DeviceError, match=r"exit 2\): Invalid combination"):
        check_output(CommandResult(2, "", "Invalid combination of input arguments."), "x")


# file, gpu index, (name, used MiB, util, power, ecc, sm clock, processes, mig count)
XML_CASES = [
    (
        "smi_q_a100_mig.xml",
        0,
        ("NVIDIA A100-SXM4-40GB", 9250, None, 66.92, None, 1410, [(48213, 9184)], 2),
    ),
    (
        "smi_q_2x3090.xml",
        0,
        (
            "NVIDIA GeForce RTX 3090",
            1321,
            0.37,
            118.47,
            None,
            1695,
            [(1874, 232), (30511, 1072)],
            0,
        ),
    ),
    ("smi_q_2x3090.xml", 1, ("NVIDIA GeForce RTX 3090", 18, 0.0, None, None, 210, [], 0)),
    (
        "smi_q_v100_driver470.xml",
        0,
        ("Tesla V100-SXM2-16GB", 15124, 1.0, 243.61, 2, 1530, [(9912, 15121)], 0),
    ),
    (
        "smi_q_8xh100.xml",
        4,
        ("NVIDIA H100 80GB HBM3", 40210, 0.57, 401.95, 0, 1755, [(70104, 40204)], 0),
    ),
]


@pytest.mark.parametrize(("name", "index", "expected"), XML_CASES)
def test_query_xml(name: str, index: int, expected: tuple[object, ...]) -> None:
    d = parse_query_xml(data(name))[index]
    gpu_name, used, util, power, ecc, clock, processes, mig = expected
    assert d.name == gpu_name and d.id == f"cuda:{index}"
    assert d.used_bytes == used * MiB
    assert d.utilization == (None if util is None else pytest.approx(util))
    assert (d.power_w, d.ecc_errors, d.sm_clock_mhz) == (power, ecc, clock)
    assert [(p.pid, p.used_bytes // MiB) for p in d.processes if p.used_bytes] == processes
    assert len(d.mig) == mig


def test_query_xml_mig_instances() -> None:
    (gpu,) = parse_query_xml(data("smi_q_a100_mig.xml"))
    assert [(m.index, m.gpu_instance_id, m.compute_instance_id) for m in gpu.mig] == [
        (0, 1, 0),
        (1, 2, 0),
    ]
    assert [(m.total_bytes // MiB, m.used_bytes // MiB, m.free_bytes // MiB) for m in gpu.mig] == [
        (19968, 9237, 10730),
        (19968, 13, 19954),
    ]


def test_query_xml_rejects_a_driver_error() -> None:
    with pytest.raises(DeviceError, match="printed no XML: NVIDIA-SMI has failed"):
        parse_query_xml(data("smi_driver_failure.txt"))


# file, {(a, b): (kind, nvlinks)} for some pairs, number of pairs
TOPO_CASES = [
    ("smi_topo_1gpu.txt", {}, 0),
    ("smi_topo_2gpu_phb.txt", {(0, 1): (LinkKind.PHB, 0)}, 1),
    (
        "smi_topo_4gpu_mixed.txt",
        {
            (0, 1): (LinkKind.NVLINK, 4),
            (0, 2): (LinkKind.PXB, 0),
            (1, 2): (LinkKind.PIX, 0),
            (2, 3): (LinkKind.SYS, 0),
        },
        6,
    ),
    ("smi_topo_4gpu_legacy.txt", {(0, 1): (LinkKind.PIX, 0), (1, 2): (LinkKind.SYS, 0)}, 6),
    (
        "smi_topo_8gpu_nvswitch.txt",
        {(0, 7): (LinkKind.NVLINK, 18), (3, 4): (LinkKind.NVLINK, 18)},
        28,
    ),
]


@pytest.mark.parametrize(("name", "pairs", "count"), TOPO_CASES)
def test_topo_matrix(
    name: str, pairs: dict[tuple[int, int], tuple[LinkKind, int]], count: int
) -> None:
    topo = parse_topo_matrix(data(name))
    assert len(topo) == count
    for (a, b), (kind, nvlinks) in pairs.items():
        assert topo.link(f"cuda:{a}", f"cuda:{b}") is kind
        assert topo.link(f"cuda:{b}", f"cuda:{a}") is kind
        assert topo.nvlinks(f"cuda:{a}", f"cuda:{b}") == nvlinks
    assert not any(d.startswith("NIC") or "mlx" in d for d in topo.devices())


def test_topo_matrix_without_header_is_an_error() -> None:
    with pytest.raises(DeviceError, match="no GPU matrix"):
        parse_topo_matrix(data("smi_driver_failure.txt"))


class Recorded:
    """A command runner answering from recorded files, keyed by the arguments."""

    def __init__(self, answers: dict[str, str], returncode: int = 0) -> None:
        self.answers = answers
        self.returncode = returncode
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str], timeout_s: float) -> CommandResult:
        self.calls.append(tuple(argv))
        key = " ".join(argv[1:])
        for prefix, name in self.answers.items():
            if key.startswith(prefix):
                return CommandResult(self.returncode, data(name))
        raise AssertionError(f"unexpected command {argv}")


EIGHT = {
    "--query-gpu": "smi_query_8gpu.csv",
    "-q -x": "smi_q_8xh100.xml",
    "topo -m": "smi_topo_8gpu_nvswitch.txt",
}


def test_provider_merges_xml_details_by_uuid_and_refreshes_them_every_n_reads() -> None:
    runner = Recorded(EIGHT)
    provider = SmiProvider(runner=runner, detail_every=3)
    devices = provider.read()
    assert runner.calls[0] == ("nvidia-smi", *QUERY_ARGS)
    assert [p.pid for p in devices[0].processes] == [70100]
    assert devices[1].processes == ()
    for _ in range(3):
        provider.read()
    xml_calls = [c for c in runner.calls if c[1:] == ("-q", "-x")]
    assert len(xml_calls) == 2  # reads 0 and 3
    assert provider.topology().nvlinks("cuda:0", "cuda:5") == 18


def test_provider_driver_failure_raises_and_topology_degrades_to_empty() -> None:
    runner = Recorded({"": "smi_driver_failure.txt"}, returncode=9)
    provider = SmiProvider(runner=runner)
    with pytest.raises(DeviceError, match="couldn't communicate"):
        provider.read()
    assert len(provider.topology()) == 0


def test_real_runner_reports_a_missing_binary() -> None:
    with pytest.raises(DeviceError, match="not found on PATH"):
        run_command(["nvidia-smi-does-not-exist-here"], 5.0)
    result = run_command(["sh", "-c", "echo out; echo err >&2; exit 3"], 5.0)
    assert result == CommandResult(3, "out\n", "err\n")
