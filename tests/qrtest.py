from __future__ import annotations

from pathlib import Path

from quantroute.engines.base import Engine
from quantroute.engines.fake import FakeEngine
from quantroute.registry.manifest import BranchArtifact
from quantroute.routing.table import Branch, ModelRoute, RouteTable
from quantroute.types import Precision


def fake_table(engines: dict[str, Engine] | None = None, model: str = "tiny-llama") -> RouteTable:
    """A route table of one model whose branches run the given (fake) engines."""
    engines = engines or {n: FakeEngine() for n in ("f16", "q8_0", "q4_k_m")}
    branches = []
    for name, engine in engines.items():
        artifact = BranchArtifact(
            model=model,
            name=name,
            precision=Precision(name),
            engine="fake",
            path=Path(f"/nonexistent/{name}.gguf"),
            sha256="0" * 64,
            size_bytes=0,
            is_reference=name == "f16",
        )
        branches.append(Branch(model, name, Precision(name), artifact, engine))
    return RouteTable.build([ModelRoute(model, "f16", tuple(branches))])


def demo_model_dir() -> Path:
    from quantroute.config import DEMO_REPO

    return Path(__import__("os").environ.get("QR_DEMO", DEMO_REPO / "tiny-llama"))
