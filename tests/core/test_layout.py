"""The code keeps the shape docs/architecture.md draws: these fail when it drifts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "quantroute"


def _imports(path: Path) -> set[str]:
    """Every ``quantroute.*`` module ``path`` imports, ``TYPE_CHECKING`` blocks included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("quantroute")
        ):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("quantroute"))
    return found


def test_routing_has_no_import_circle() -> None:
    modules = {p.stem: p for p in (SRC / "routing").glob("*.py") if p.stem != "__init__"}
    graph = {
        name: {m.split(".")[2] for m in _imports(path) if m.startswith("quantroute.routing.")}
        & set(modules)
        for name, path in modules.items()
    }
    assert not graph["records"], "records is the leaf"

    def visit(node: str, trail: tuple[str, ...]) -> None:
        assert node not in trail, " -> ".join((*trail, node))
        for nxt in graph[node]:
            visit(nxt, (*trail, node))

    for name in graph:
        visit(name, ())


@pytest.mark.parametrize("path", sorted((SRC / "api").glob("*.py")), ids=lambda p: p.name)
def test_api_modules_stay_under_400_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 400


def test_routes_call_only_the_service() -> None:
    routes = (SRC / "api" / "routes.py").read_text()
    assert "state.gateway" not in routes and "Gateway" not in routes
    assert "quantroute.api.gateway" not in _imports(SRC / "api" / "routes.py")


@pytest.mark.parametrize("package", ["telemetry", "engines", "registry", "observability"])
def test_inner_packages_import_nothing_above_them(package: str) -> None:
    above = {"quantroute.api", "quantroute.routing"}
    if package != "engines":
        above.add("quantroute.engines")
    for path in (SRC / package).glob("*.py"):
        bad = {m for m in _imports(path) if any(m.startswith(a) for a in above)}
        assert not bad, f"{path.name} imports {bad}"
