"""A request's ``priority`` can lower its tenant's place, never raise it past the tenant's
``max_priority`` (by default the tenant's own priority): before, it was added as it came,
so a priority-0 tenant sending ``priority: 10`` jumped a priority-5 one (issue 32, L1).
``Tenant.priority_for`` is what admission is given (``Service._admit``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantroute.errors import ConfigError
from quantroute.resilience import OPEN, Tenant, load_tenants

FILE = """
tenants:
  gold:   {keys: ["sk-gold"], priority: 5}
  free:   {keys: ["sk-free"]}
  burst:  {keys: ["sk-burst"], priority: 1, max_priority: 4}
"""


@pytest.mark.parametrize(
    ("tenant", "requested", "admitted"),
    [
        (Tenant("free"), None, 0),
        (Tenant("free"), 0, 0),
        (Tenant("free"), 10, 0),  # it cannot raise itself over anyone
        (Tenant("free"), -3, -3),  # but it may step back
        (Tenant("gold", priority=5), 10, 5),
        (Tenant("gold", priority=5), -10, -5),
        (Tenant("burst", priority=1, max_priority=4), 2, 3),  # up to its ceiling
        (Tenant("burst", priority=1, max_priority=4), 10, 4),
        (Tenant("burst", priority=1, max_priority=4), None, 1),
        (OPEN, 10, 0),  # an open API: every caller is one tenant, nobody jumps the queue
    ],
)
def test_a_request_priority_is_clamped_to_the_tenants_ceiling(
    tenant: Tenant, requested: int | None, admitted: int
) -> None:
    assert tenant.priority_for(requested) == admitted


def test_no_request_of_a_lower_tenant_outranks_a_higher_tenants_plain_request() -> None:
    gold, free = Tenant("gold", priority=5), Tenant("free")
    assert all(free.priority_for(p) < gold.priority_for(None) for p in range(-10, 11))


def test_the_tenants_file_sets_max_priority(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(FILE)
    tenants = load_tenants(path)
    burst, free = tenants.find("sk-burst"), tenants.find("sk-free")
    assert burst is not None and burst.max_priority == 4 and burst.priority_for(9) == 4
    assert free is not None and free.max_priority is None and free.priority_for(9) == 0


@pytest.mark.parametrize(
    "text",
    [
        "tenants: {a: {keys: [k], priority: 3, max_priority: 2}}",  # below its own
        "tenants: {a: {keys: [k], max_priority: 11}}",
    ],
)
def test_a_bad_max_priority_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError):
        load_tenants(path)


async def test_admission_is_given_the_clamped_priority(tmp_path: Path) -> None:
    """Through the real app: what the model's admission queue is told, for a low tenant
    asking for the top priority and a high one asking for nothing."""
    from qrtest import fake_table, serving
    from quantroute.api.app import create_app
    from quantroute.config import load_settings
    from quantroute.engines.fake import FakeEngine

    path = tmp_path / "tenants.yaml"
    path.write_text(FILE)
    settings = load_settings(auth={"tenants_file": str(path)}, telemetry={"devices": "sim:1x8GiB"})
    app = create_app(settings, fake_table({"q4_k_m": FakeEngine()}))  # type: ignore[arg-type]
    seen: list[tuple[str, int]] = []
    async with serving(app) as (client, gateway):
        enter = gateway.admission.enter

        async def recording(model: str, **kwargs: object):  # type: ignore[no-untyped-def]
            seen.append((str(kwargs["tenant"]), int(kwargs["priority"])))  # type: ignore[call-overload]
            return await enter(model, **kwargs)  # type: ignore[arg-type]

        gateway.admission.enter = recording  # type: ignore[method-assign]
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "quality": "fast"}
        for key, priority in (("sk-free", 10), ("sk-gold", None), ("sk-burst", 10)):
            ask = body if priority is None else body | {"priority": priority}
            r = await client.post(
                "/v1/completions", json=ask, headers={"authorization": f"Bearer {key}"}
            )
            assert r.status_code == 200, r.text
    assert seen == [("free", 0), ("gold", 5), ("burst", 4)]
