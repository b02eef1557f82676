"""Public API: every package re-exports its public names, and the docs list every setting."""

from __future__ import annotations

import enum
import functools
import importlib
import re
from pathlib import Path

import pytest

from quantroute.cli import _leaf_fields
from quantroute.config import Settings, default_settings

PACKAGES = [
    "quantroute.api",
    # quantroute.engines exports nothing: a worker imports its modules (test_layout.py)
    "quantroute.grpcapi",
    "quantroute.observability",
    "quantroute.registry",
    "quantroute.routing",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_names_exist_and_are_sorted(name: str) -> None:
    module = importlib.import_module(name)
    exported = module.__all__
    assert exported == sorted(exported, key=lambda n: (not n.isupper(), n))
    for member in exported:
        assert hasattr(module, member), f"{name}.{member}"
    public = {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and getattr(v, "__module__", "").startswith(name + ".")
    }
    assert public <= set(exported), public - set(exported)


def test_configuration_doc_lists_every_setting_with_its_default() -> None:
    """Each setting's row, and the default it shows: the one a fresh server has (a tier's
    bounds come from the tier, not from the field they share)."""
    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    shown = dict(
        re.findall(r"^\| `([a-z0-9_.]+)` \| `--[^`]*` \| `QUANTROUTE_\w*` \| (.*?) \|", doc, re.M)
    )
    defaults = default_settings()  # no environment, no file
    for path, _ in _leaf_fields(Settings):
        assert path in shown, path
        value = functools.reduce(getattr, path.split("."), defaults)
        if path == "repo":
            assert shown[path] == "`the packaged demo repository`"
            continue
        expected = value.value if isinstance(value, enum.Enum) else value
        assert shown[path] == f"`{expected}`", path
