"""A simulated device runs out of memory inside the worker, as a real one does: its
flag file exists while it is over budget, new sequences fail their KV allocation with
``device_out_of_memory``, and sequences already decoding go on."""

from __future__ import annotations

from pathlib import Path

import pytest

from qrtest import ADMIN_KEY, demo_repo_copy, serving, set_headroom
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.engines.base import FinishEvent, GenerationRequest, SamplingParams, StartEvent
from quantroute.telemetry.sim import SimDeviceProvider

MiB = 1 << 20


def _exists(path: str) -> bool:
    return Path(path).exists()


def test_the_flag_file_follows_the_device_and_goes_with_the_provider() -> None:
    sim = SimDeviceProvider.from_spec("sim:2x1GiB")
    flag = sim.oom_flag("sim:1")
    assert flag != sim.oom_flag("sim:0") and not flag.exists()
    sim.set_out_of_memory("sim:1", True)
    assert flag.exists() and not sim.oom_flag("sim:0").exists()
    sim.set_out_of_memory("sim:1", True)  # idempotent
    sim.set_out_of_memory("sim:1", False)
    assert not flag.exists()
    sim.set_out_of_memory("sim:1", True)
    sim.close()
    assert not flag.parent.exists()
    with pytest.raises(KeyError):
        SimDeviceProvider.from_spec("sim:1x1GiB").oom_flag("sim:7")


@pytest.mark.slow
async def test_a_device_over_budget_fails_new_sequences_in_the_worker(tmp_path: Path) -> None:
    settings = load_settings(
        server={"admin_key": ADMIN_KEY},
        repo=demo_repo_copy(tmp_path),
        engine={"parallel": 2, "n_threads": 1},
        telemetry={"devices": "sim:1x8GiB", "sim_weight_scale": 100},
        routing={"residency": False},
        drift={"fraction": 0.0},
    )
    async with serving(create_app(settings)) as (http, gateway):
        q4 = gateway.routes.current.models["tiny-llama"].branch("q4_k_m")
        assert q4 is not None and q4.engine.ready
        pid = q4.engine.pid
        flag = gateway.occupancy.placements[q4.id].oom_flag
        assert flag.endswith("sim_0.oom") and not _exists(flag)
        # A long generation in flight (driven on the engine: ASGI buffers whole responses).
        request = GenerationRequest("long", "x", SamplingParams(max_tokens=200, ignore_eos=True))
        stream = q4.engine.generate(request)
        assert isinstance(await anext(stream), StartEvent)

        await set_headroom(http, gateway, -MiB)  # over budget: the poll sets the flag
        assert _exists(flag)
        body = {"model": "tiny-llama:q4_k_m", "prompt": "x", "max_tokens": 2}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "device_out_of_memory" and "KV cache" in error["message"]
        events = [e async for e in stream]  # the sequence already decoding went on
        assert isinstance(events[-1], FinishEvent) and events[-1].completion_tokens == 200

        await set_headroom(http, gateway, 64 * MiB)  # within budget: allocations succeed
        assert not _exists(flag)
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert q4.engine.pid == pid  # one worker throughout
