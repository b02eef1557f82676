"""Shared fixtures for the telemetry tests, and a pynvml-shaped fake for machines without
an NVIDIA GPU.

It borrows the real module's constants and error classes (``pynvml`` imports
fine without a driver; only ``nvmlInit`` fails), so the provider's error
handling is exercised against the real exception hierarchy. Devices are
plain records; a test injects ``NotSupported`` or any other NVML error per
(function, device) pair.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pynvml
import pytest

GiB = 1 << 30


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    bus_id: str = "00000000:18:00.0"
    total: int = 80 * GiB
    used: int = 1 * GiB
    reserved: int = 0
    util: int = 12
    temp: int = 41
    power_mw: int = 123_456
    sm_clock: int = 1980
    ecc: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    mig: list[tuple[int, int, int, int]] | None = None  # (gi, ci, total, used)
    # link index -> ("gpu", bus id of the peer) or ("switch", None)
    nvlinks: dict[int, tuple[str, str | None]] = field(default_factory=dict)


class FakeNvml:
    """Module-like object: attribute access finds pynvml's constants and errors."""

    def __init__(self, gpus: list[FakeGpu], *, topology: dict[tuple[int, int], int] | None = None):
        self.gpus = gpus
        self.topology = topology or {}
        self.initialized = False
        self.shutdowns = 0
        self.fail_init: Exception | None = None
        # (function name, device index or None for all) -> exception to raise
        self.faults: dict[tuple[str, int | None], Exception] = {}
        self.events: list[SimpleNamespace] = []
        self.event_support = True

    def __getattr__(self, name: str) -> Any:
        # constants (NVML_*, nvmlEventType*) and error classes (NVMLError*)
        return getattr(pynvml, name)

    def _fault(self, fn: str, index: int | None) -> None:
        for key in ((fn, index), (fn, None)):
            if key in self.faults:
                raise self.faults[key]

    def _gpu(self, handle: Any, fn: str) -> FakeGpu:
        self._fault(fn, handle.index)
        if handle.mig is not None:
            raise AssertionError(f"{fn} called on a MIG handle")
        return self.gpus[handle.index]

    # lifecycle
    def nvmlInit(self) -> None:
        if self.fail_init is not None:
            raise self.fail_init
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1
        self.initialized = False

    # enumeration
    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> SimpleNamespace:
        return SimpleNamespace(index=i, mig=None)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return int(handle.index)

    def nvmlDeviceGetName(self, handle: Any) -> bytes:
        return self._gpu(handle, "nvmlDeviceGetName").name.encode()  # older bindings: bytes

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if handle.mig is not None:
            return f"MIG-{handle.index}-{handle.mig}"
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetPciInfo(self, handle: Any) -> SimpleNamespace:
        return SimpleNamespace(busId=self._gpu(handle, "nvmlDeviceGetPciInfo").bus_id.encode())

    # readings
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> SimpleNamespace:
        """v1: used = total - free (reserved included); v2: reserved reported apart."""
        self._fault("nvmlDeviceGetMemoryInfo", handle.index)
        if version is not None:
            self._fault("nvmlDeviceGetMemoryInfo_v2", handle.index)
            assert version == pynvml.nvmlMemory_v2
        if handle.mig is not None:
            _, _, total, used = self.gpus[handle.index].mig[handle.mig]
            return SimpleNamespace(total=total, used=used, free=total - used, reserved=0)
        gpu = self.gpus[handle.index]
        free = gpu.total - gpu.used - gpu.reserved
        if version is None:
            return SimpleNamespace(total=gpu.total, used=gpu.total - free, free=free)
        return SimpleNamespace(total=gpu.total, used=gpu.used, free=free, reserved=gpu.reserved)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> SimpleNamespace:
        return SimpleNamespace(
            gpu=self._gpu(handle, "nvmlDeviceGetUtilizationRates").util, memory=0
        )

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu(handle, "nvmlDeviceGetTemperature").temp

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetClockInfo(self, handle: Any, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return self._gpu(handle, "nvmlDeviceGetClockInfo").sm_clock

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter: int) -> int:
        assert error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter == pynvml.NVML_VOLATILE_ECC
        return self._gpu(handle, "nvmlDeviceGetTotalEccErrors").ecc

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        gpu = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in gpu.processes]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        self._gpu(handle, "nvmlDeviceGetGraphicsRunningProcesses")
        return []

    # MIG
    def nvmlDeviceGetMigMode(self, handle: Any) -> tuple[int, int]:
        gpu = self._gpu(handle, "nvmlDeviceGetMigMode")
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.mig is not None else 0
        return (mode, mode)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, i: int) -> SimpleNamespace:
        mig = self.gpus[handle.index].mig or []
        if i >= len(mig):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return SimpleNamespace(index=handle.index, mig=i)

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        return self.gpus[handle.index].mig[handle.mig][0]

    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int:
        return self.gpus[handle.index].mig[handle.mig][1]

    # topology
    def nvmlDeviceGetTopologyCommonAncestor(self, a: Any, b: Any) -> int:
        key = (min(a.index, b.index), max(a.index, b.index))
        if key not in self.topology:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.topology[key]

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetNvLinkState")
        if not gpu.nvlinks:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if link > max(gpu.nvlinks):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED if link in gpu.nvlinks else 0

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        kind, _ = self.gpus[handle.index].nvlinks[link]
        if kind == "switch":
            return pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
        return pynvml.NVML_NVLINK_DEVICE_TYPE_GPU

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> SimpleNamespace:
        _, bus = self.gpus[handle.index].nvlinks[link]
        return SimpleNamespace(busId=(bus or "").encode())

    # XID events
    def nvmlEventSetCreate(self) -> str:
        if not self.event_support:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: Any, types: int, event_set: str) -> None:
        self._fault("nvmlDeviceRegisterEvents", handle.index)

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0
        if not self.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass

    def emit_xid(self, index: int, xid: int) -> None:
        self.events.append(
            SimpleNamespace(
                device=SimpleNamespace(index=index, mig=None),
                eventType=pynvml.nvmlEventTypeXidCriticalError,
                eventData=xid,
            )
        )


def not_supported() -> Exception:
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def gpu_is_lost() -> Exception:
    return pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)


@pytest.fixture
def nvml_kit() -> SimpleNamespace:
    """The fake's parts: ``Nvml`` (module), ``Gpu`` (device record), ``GiB``, error makers."""
    return SimpleNamespace(
        Nvml=FakeNvml, Gpu=FakeGpu, GiB=GiB, not_supported=not_supported, gpu_is_lost=gpu_is_lost
    )


def write_llama_gguf(
    path: Path,
    *,
    n_embd: int = 128,
    n_layer: int = 4,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 384,
    n_ctx_train: int = 2048,
    extra_vocab: int = 0,
    seed: int = 0,
) -> Path:
    """A small random-weight llama GGUF (F16 matrices) that llama.cpp loads, with a byte
    vocabulary (259 tokens) plus ``extra_vocab`` normal tokens."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    tokens += [f"tok{i}" for i in range(extra_vocab)]
    types += [1] * extra_vocab
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * n_vocab)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(False)

    def tensor(name: str, shape: tuple[int, ...], norm: bool = False) -> None:
        if norm:
            writer.add_tensor(name, np.ones(shape, np.float32))
        else:
            writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float16))

    tensor("token_embd.weight", (n_vocab, n_embd))
    tensor("output_norm.weight", (n_embd,), norm=True)
    tensor("output.weight", (n_vocab, n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", (n_embd,), norm=True)
        tensor(p + "attn_q.weight", (n_embd, n_embd))
        tensor(p + "attn_k.weight", (n_head_kv * head_dim, n_embd))
        tensor(p + "attn_v.weight", (n_head_kv * head_dim, n_embd))
        tensor(p + "attn_output.weight", (n_embd, n_embd))
        tensor(p + "ffn_norm.weight", (n_embd,), norm=True)
        tensor(p + "ffn_gate.weight", (n_ff, n_embd))
        tensor(p + "ffn_up.weight", (n_ff, n_embd))
        tensor(p + "ffn_down.weight", (n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def make_gguf(tmp_path: Path) -> Callable[..., Path]:
    """``make_gguf(name, **shape)`` writes a small llama GGUF under ``tmp_path``."""

    def make(name: str = "model.gguf", **shape: int) -> Path:
        return write_llama_gguf(tmp_path / name, **shape)

    return make
