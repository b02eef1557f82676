"""Tenants on plain data: the file, key lookup, and the limits over a sliding minute."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantroute.errors import ConfigError
from quantroute.resilience import Tenant, TenantLimits, load_tenants

FILE = """
tenants:
  acme:
    keys: ["sk-acme-1", "sk-acme-2"]
    priority: 5
    requests_per_minute: 2
    models: ["tiny-llama"]
  free:
    keys: ["sk-free"]
    tokens_per_minute: 100
    max_concurrency: 1
"""


def test_keys_find_their_tenant_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(FILE)
    tenants = load_tenants(path)
    assert not tenants.open and tenants.names() == ["acme", "free"]
    acme = tenants.find("sk-acme-2")
    assert acme is not None and acme.name == "acme" and acme.priority == 5
    assert acme.may_use("tiny-llama") and not acme.may_use("other")
    free = tenants.find("sk-free")
    assert free is not None and free.may_use("anything")
    for wrong in ("sk-acme", "sk-acme-1 ", "", None, "SK-FREE"):
        assert tenants.find(wrong) is None
    assert load_tenants(None).open


@pytest.mark.parametrize(
    "text",
    [
        "tenants: {}",
        "tenants: {a: {keys: []}}",
        "tenants: {a: {keys: [k]}, b: {keys: [k]}}",  # one key, two tenants
        "tenants: {a: {keys: [k], priority: 99}}",
        "tenants: {a: {keys: [k], colour: red}}",
        "[not, a, mapping",
    ],
)
def test_a_bad_tenants_file_is_a_config_error_that_never_shows_a_key(
    tmp_path: Path, text: str
) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_tenants(path)
    assert "k]" not in info.value.message


def test_limits_over_a_sliding_minute() -> None:
    limits = TenantLimits(window_s=60.0)
    t = Tenant("t", requests_per_minute=2, tokens_per_minute=100, max_concurrency=2)
    assert limits.check(t, now=0.0) is None
    limits.started(t, now=0.0)
    limits.started(t, now=1.0)
    assert limits.check(t, now=2.0) == ("max_concurrency", 1.0)
    limits.finished(t, 10, now=2.0)
    over = limits.check(t, now=2.0)
    assert over is not None and over[0] == "requests_per_minute" and over[1] == pytest.approx(58.0)
    assert limits.check(t, now=60.5) is None  # the first request left the window
    limits.finished(t, 95, now=61.0)  # 105 tokens in the last minute
    over = limits.check(t, now=61.5)
    assert over is not None and over[0] == "tokens_per_minute"
    assert limits.check(t, now=121.5) is None
    assert limits.in_flight("t") == 0
