"""The package's public API is exactly __all__, and its docstring examples hold."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import quantroute.telemetry as telemetry


def test_all_names_exist_and_are_public() -> None:
    for name in telemetry.__all__:
        assert hasattr(telemetry, name), name
    # constants first, then names in order (the project-wide rule of tests/core)
    assert telemetry.__all__ == sorted(telemetry.__all__, key=lambda n: (not n.isupper(), n))
    exported = {n for n in dir(telemetry) if not n.startswith("_")}
    modules = {m.name for m in pkgutil.iter_modules(telemetry.__path__)}
    assert exported - set(telemetry.__all__) - modules - {"annotations"} == set()


MODULES = sorted(m.name for m in pkgutil.iter_modules(telemetry.__path__))


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    module = importlib.import_module(f"quantroute.telemetry.{name}")
    failures, _ = doctest.testmod(module, verbose=False)
    assert failures == 0
