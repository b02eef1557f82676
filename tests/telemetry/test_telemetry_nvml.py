"""NVML provider against a pynvml-shaped fake (no GPU on this machine)."""

from __future__ import annotations

from typing import Any

import pynvml
import pytest

from quantroute.telemetry import DeviceError, DeviceKind, LinkKind, NvmlProvider

GiB = 1 << 30


def two_gpus(kit: Any) -> Any:
    return kit.Nvml(
        [
            kit.Gpu(
                uuid="GPU-a", bus_id="00000000:18:00.0", used=30 * GiB, processes=[(4242, 29 * GiB)]
            ),
            kit.Gpu(uuid="GPU-b", bus_id="00000000:2A:00.0", used=2 * GiB, util=0, ecc=3),
        ],
        topology={(0, 1): pynvml.NVML_TOPOLOGY_HOSTBRIDGE},
    )


def test_reads_every_field_in_si_units(nvml_kit: Any) -> None:
    provider = NvmlProvider(two_gpus(nvml_kit))
    first, second = provider.read()
    assert (first.id, first.kind, first.name, first.uuid) == (
        "cuda:0",
        DeviceKind.CUDA,
        "NVIDIA H100 80GB HBM3",
        "GPU-a",
    )
    assert (first.total_bytes, first.used_bytes, first.free_bytes) == (80 * GiB, 30 * GiB, 50 * GiB)
    assert first.utilization == pytest.approx(0.12)
    assert first.temperature_c == 41
    assert first.power_w == pytest.approx(123.456)  # NVML reports milliwatts
    assert first.sm_clock_mhz == 1980
    assert first.ecc_errors == 0 and second.ecc_errors == 3
    assert first.xid_errors == 0
    assert [(p.pid, p.used_bytes) for p in first.processes] == [(4242, 29 * GiB)]
    assert second.processes == () and first.mig == ()


@pytest.mark.parametrize(
    ("function", "field"),
    [
        ("nvmlDeviceGetUtilizationRates", "utilization"),
        ("nvmlDeviceGetTemperature", "temperature_c"),
        ("nvmlDeviceGetPowerUsage", "power_w"),
        ("nvmlDeviceGetClockInfo", "sm_clock_mhz"),
        ("nvmlDeviceGetTotalEccErrors", "ecc_errors"),
    ],
)
def test_not_supported_becomes_none_for_that_field_only(
    nvml_kit: Any, function: str, field: str
) -> None:
    fake = two_gpus(nvml_kit)
    fake.faults[(function, 1)] = nvml_kit.not_supported()
    first, second = NvmlProvider(fake).read()
    assert getattr(second, field) is None
    assert getattr(first, field) is not None
    assert second.healthy


def test_memory_v2_keeps_reserved_memory_out_of_used_and_v1_is_the_fallback(
    nvml_kit: Any,
) -> None:
    fake = nvml_kit.Nvml([nvml_kit.Gpu(total=40 * GiB, used=9 * GiB, reserved=GiB // 2)])
    provider = NvmlProvider(fake)
    (gpu,) = provider.read()
    assert (gpu.used_bytes, gpu.free_bytes) == (9 * GiB, 40 * GiB - 9 * GiB - GiB // 2)
    fake.faults[("nvmlDeviceGetMemoryInfo_v2", None)] = pynvml.NVMLError(
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    )
    (gpu,) = NvmlProvider(fake).read()  # an old driver: used includes the reserved memory
    assert (gpu.used_bytes, gpu.free_bytes) == (9 * GiB + GiB // 2, 40 * GiB - 9 * GiB - GiB // 2)


def test_lost_gpu_is_reported_unhealthy_and_others_still_read(nvml_kit: Any) -> None:
    fake = two_gpus(nvml_kit)
    fake.faults[("nvmlDeviceGetMemoryInfo", 0)] = nvml_kit.gpu_is_lost()
    first, second = NvmlProvider(fake).read()
    assert not first.healthy and first.total_bytes == 0
    assert first.detail is not None and "GPU is lost" in first.detail
    assert second.healthy and second.used_bytes == 2 * GiB


def test_init_failure_is_a_clear_device_error(nvml_kit: Any) -> None:
    fake = two_gpus(nvml_kit)
    fake.fail_init = pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(DeviceError, match="NVML failed to initialise: Driver Not Loaded"):
        NvmlProvider(fake)


def test_real_pynvml_without_a_gpu_fails_cleanly(nvml_kit: Any) -> None:
    with pytest.raises(DeviceError, match="NVML failed to initialise"):
        NvmlProvider()


def test_zero_gpus_is_an_error_and_shuts_nvml_down(nvml_kit: Any) -> None:
    fake = nvml_kit.Nvml([])
    with pytest.raises(DeviceError, match="no GPU"):
        NvmlProvider(fake)
    assert fake.shutdowns == 1


def test_mig_instances_are_listed_with_their_own_memory(nvml_kit: Any) -> None:
    fake = nvml_kit.Nvml([nvml_kit.Gpu(mig=[(1, 0, 20 * GiB, 9 * GiB), (2, 0, 20 * GiB, 0)])])
    (gpu,) = NvmlProvider(fake).read()
    assert [
        (m.index, m.gpu_instance_id, m.total_bytes, m.used_bytes, m.free_bytes) for m in gpu.mig
    ] == [
        (0, 1, 20 * GiB, 9 * GiB, 11 * GiB),
        (1, 2, 20 * GiB, 0, 20 * GiB),
    ]
    assert gpu.mig[0].uuid == "MIG-0-0"


def test_xid_events_are_counted_per_device_between_reads(nvml_kit: Any) -> None:
    fake = two_gpus(nvml_kit)
    provider = NvmlProvider(fake)
    assert [d.xid_errors for d in provider.read()] == [0, 0]
    fake.emit_xid(1, 79)  # "GPU has fallen off the bus"
    fake.emit_xid(1, 48)
    assert [d.xid_errors for d in provider.read()] == [0, 2]
    assert [d.xid_errors for d in provider.read()] == [0, 2]


def test_xid_is_none_where_events_are_unsupported(nvml_kit: Any) -> None:
    fake = two_gpus(nvml_kit)
    fake.faults[("nvmlDeviceRegisterEvents", 0)] = nvml_kit.not_supported()
    assert [d.xid_errors for d in NvmlProvider(fake).read()] == [None, 0]
    fake = two_gpus(nvml_kit)
    fake.event_support = False
    assert [d.xid_errors for d in NvmlProvider(fake).read()] == [None, None]


def test_topology_from_common_ancestor_without_nvlink(nvml_kit: Any) -> None:
    topo = NvmlProvider(two_gpus(nvml_kit)).topology()
    assert topo.link("cuda:0", "cuda:1") is LinkKind.PHB


def test_topology_counts_direct_nvlinks_to_peer_bus_ids(nvml_kit: Any) -> None:
    fake = nvml_kit.Nvml(
        [
            nvml_kit.Gpu(
                bus_id="00000000:18:00.0",
                nvlinks={0: ("gpu", "0000:2A:00.0"), 1: ("gpu", "00000000:2a:00.0")},
            ),
            nvml_kit.Gpu(
                bus_id="00000000:2A:00.0",
                nvlinks={0: ("gpu", "00000000:18:00.0"), 1: ("gpu", "00000000:18:00.0")},
            ),
            nvml_kit.Gpu(bus_id="00000000:3A:00.0"),
        ],
        topology={(0, 1): 30, (0, 2): 50, (1, 2): 10},
    )
    topo = NvmlProvider(fake).topology()
    assert (topo.link("cuda:0", "cuda:1"), topo.nvlinks("cuda:0", "cuda:1")) == (LinkKind.NVLINK, 2)
    assert topo.link("cuda:0", "cuda:2") is LinkKind.SYS
    assert topo.link("cuda:1", "cuda:2") is LinkKind.PIX


def test_topology_through_nvswitch_links_every_pair(nvml_kit: Any) -> None:
    links = {i: ("switch", None) for i in range(18)}
    fake = nvml_kit.Nvml(
        [nvml_kit.Gpu(bus_id=f"00000000:{b}:00.0", nvlinks=dict(links)) for b in ("18", "2A", "3A")]
    )
    topo = NvmlProvider(fake).topology()
    assert all(topo.nvlinks(a, b) == 18 for a, b in [("cuda:0", "cuda:1"), ("cuda:1", "cuda:2")])


def test_close_shuts_down_once_and_reads_after_close_fail(nvml_kit: Any) -> None:
    fake = two_gpus(nvml_kit)
    provider = NvmlProvider(fake)
    provider.close()
    provider.close()
    assert fake.shutdowns == 1
    with pytest.raises(DeviceError, match="closed"):
        provider.read()
