"""The code keeps the shape docs/architecture.md draws: these fail when it drifts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "quantroute"
MODULES = sorted(SRC.rglob("*.py"))
MAX_LINES = 600  # STYLE.md: aim for 150-400, split past 600
API_MAX_LINES = 400  # routes stay thin
CORE = (
    "quantroute.config",
    "quantroute.errors",
    "quantroute.types",
    "quantroute.divergence",
    "quantroute.tasks",
)


def _rel(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _package_imports(package: str) -> dict[str, set[str]]:
    """What each module of ``package`` imports, its subpackages' modules included."""
    return {_rel(path): _imports(path) for path in sorted((SRC / package).rglob("*.py"))}


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


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_every_module_stays_under_600_lines(path: Path) -> None:
    lines = _lines(path)
    assert lines <= MAX_LINES, f"src/quantroute/{_rel(path)}: {lines} lines > {MAX_LINES}; split it"


@pytest.mark.parametrize("path", sorted((SRC / "api").glob("*.py")), ids=lambda p: p.name)
def test_api_modules_stay_under_400_lines(path: Path) -> None:
    lines = _lines(path)
    assert lines <= API_MAX_LINES, f"src/quantroute/{_rel(path)}: {lines} lines > {API_MAX_LINES}"


def test_the_scan_sees_every_package() -> None:
    """The caps above read subpackages too (``engines/llamacpp/``), not only the top."""
    seen = {_rel(p) for p in MODULES}
    assert {"config/settings.py", "api/routes.py"} <= seen
    assert any(rel.startswith("engines/llamacpp/") for rel in seen)


def test_routes_call_only_the_service() -> None:
    routes = (SRC / "api" / "routes.py").read_text()
    assert "state.gateway" not in routes and "Gateway" not in routes
    assert "quantroute.api.gateway" not in _imports(SRC / "api" / "routes.py")


@pytest.mark.parametrize(
    "package", ["telemetry", "engines", "registry", "observability", "shaping"]
)
def test_inner_packages_import_nothing_above_them(package: str) -> None:
    above = {"quantroute.api", "quantroute.routing"}
    if package != "engines":
        above.add("quantroute.engines")
    # shaping and the registry run children beside the engines: render processes, file
    # checks; they hand them the workers' environment
    allowed = ("quantroute.engines.environment",) if package in ("shaping", "registry") else ()
    for rel, imported in _package_imports(package).items():
        bad = {
            m for m in imported if any(m.startswith(a) for a in above) and not m.startswith(allowed)
        }
        assert not bad, f"{rel} imports {sorted(bad)}"


def test_shaping_imports_only_the_core_and_the_workers_environment() -> None:
    own = ("quantroute.shaping", "quantroute.engines.environment", *CORE)
    for rel, imported in _package_imports("shaping").items():
        bad = {m for m in imported if not m.startswith(own)}
        assert not bad, f"{rel} imports {sorted(bad)}"


def test_engines_import_neither_quality_nor_shaping() -> None:
    """Both import engines; engines importing either back is the package circle that was
    removed (the fidelity math is the leaf ``divergence.py``)."""
    modules = _package_imports("engines")
    assert any(rel.startswith("engines/llamacpp/") for rel in modules)  # subpackages too
    for rel, imported in modules.items():
        bad = {m for m in imported if m.startswith(("quantroute.quality", "quantroute.shaping"))}
        assert not bad, f"{rel} imports {sorted(bad)}"


@pytest.mark.parametrize("leaf", ["divergence.py", "tasks.py"])
def test_the_leaf_modules_import_nothing_of_ours(leaf: str) -> None:
    assert not _imports(SRC / leaf), f"{leaf} imports nothing of quantroute"


def _environment_reads(path: Path) -> list[str]:
    """Where ``path`` reads an environment variable: ``os.getenv``, ``os.environ[...]``,
    ``os.environ.get(...)`` (any attribute), ``... in os.environ``, ``from os import environ``.
    Handing the whole environment to a child process (``worker_env(os.environ)``,
    ``os.environ | {...}``, ``{**os.environ}``) reads none of it."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            names = {a.name for a in node.names} & {"environ", "getenv", "environb"}
            found += [f"line {node.lineno}: from os import {n}" for n in sorted(names)]
        if not (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            continue
        parent = parents.get(node)
        if node.attr in ("getenv", "getenvb"):
            found.append(f"line {node.lineno}: os.{node.attr}")
        elif node.attr in ("environ", "environb") and (
            isinstance(parent, ast.Attribute | ast.Subscript)
            or (isinstance(parent, ast.Compare) and node in parent.comparators)
        ):
            found.append(f"line {node.lineno}: os.{node.attr} read")
    return found


def test_environment_variables_are_read_only_in_config() -> None:
    """STYLE.md: settings come from one tree, ``config/settings.py`` the only reader."""
    reads = {_rel(p): r for p in MODULES if (r := _environment_reads(p))}
    assert "config/settings.py" in reads  # the scan sees a read (a broken scan sees none)
    others = {rel: r for rel, r in reads.items() if rel != "config/settings.py"}
    assert not others, others


def test_a_worker_process_imports_only_its_side() -> None:
    """A worker's imports count in every branch's measured footprint (RSS): importing the
    worker in a fresh interpreter loads none of the gateway's side. A package ``__init__``
    that re-exports the engine, the registry or pydantic costs each worker ~16 MiB."""
    import subprocess
    import sys

    probe = (
        "import sys, quantroute.engines.llamacpp.worker\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('quantroute', 'pydantic', 'starlette', 'httpx', 'msgspec'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert "quantroute.engines.llamacpp.worker_batch" in out  # the probe saw the worker
    allowed = ("quantroute.engines.llamacpp.", "msgspec")
    own = {"quantroute", "quantroute.types", "quantroute.engines", "quantroute.engines.llamacpp"}
    own |= {f"quantroute.engines.{m}" for m in ("base", "sampling", "stops")}
    gateway_side = {m for m in out if m not in own and not m.startswith(allowed)} | {
        m for m in out if m.endswith((".engine", ".supervisor", ".options", ".build"))
    }
    assert not gateway_side, sorted(gateway_side)
