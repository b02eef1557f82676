from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from quantroute.api.gateway import Gateway
from quantroute.engines.base import Engine
from quantroute.engines.fake import FakeEngine
from quantroute.registry.manifest import BranchArtifact
from quantroute.routing.table import Branch, ModelRoute, RouteTable
from quantroute.types import Precision

ADMIN_KEY = "qr-test-admin-key"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}  # headers of an operator's request


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


def fake_app(**app: Any) -> FastAPI:
    """The real app over fake engines, with the admin key and small limits: fast enough for
    the property and hostile-input tests to send it thousands of requests (``app``: more of
    ``create_app``'s arguments)."""
    from quantroute.api.app import create_app
    from quantroute.config import load_settings

    settings = load_settings(
        telemetry={"devices": "sim:1x24GiB"},
        server={"admin_key": ADMIN_KEY, "max_body_bytes": 1 << 20},
        limits={"max_tokens": 64},
    )
    return create_app(settings, fake_table(), **app)


def demo_model_dir() -> Path:
    from quantroute.config import DEMO_REPO

    return DEMO_REPO / "tiny-llama"


def demo_onnx_fp32(out: Path) -> tuple[Path, Path]:
    """The demo's F16 GGUF exported as two fp32 ONNX folders under ``out``: ``single``
    (the weights inside ``model.onnx``) and ``external`` (in ``model.onnx.data``)."""
    from quantroute.demo.onnx_export import GgufSource, export_onnx

    source = GgufSource.read(demo_model_dir() / "f16.gguf")
    export_onnx(source, out / "single", "fp32")
    export_onnx(source, out / "external", "fp32", external_data=True)
    return out / "single", out / "external"


def demo_repo_copy(root: Path, *, engine: str | None = None) -> Path:
    """A model repository holding a copy of the demo model (tests may change it);
    ``engine``: only its branches run by that engine (``llamacpp``: the three GGUF
    files, for tests whose subject is one engine's branches, not the mix)."""
    import shutil

    import yaml

    dst = root / "repo" / "tiny-llama"
    shutil.copytree(demo_model_dir(), dst)
    if engine is not None:
        manifest = yaml.safe_load((dst / "quantroute.yaml").read_text())
        for name, spec in list(manifest["branches"].items()):
            if spec.get("engine", "llamacpp") != engine:
                del manifest["branches"][name]
                target = dst / spec["file"]
                if target.parent == dst:
                    target.unlink()
                else:  # an ONNX branch's folder
                    shutil.rmtree(target.parent)
        (dst / "quantroute.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return root / "repo"


@contextlib.asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    """The app with its lifespan running, and an HTTP client talking to it in-process.
    (ASGI transports deliver a streamed response whole: stream timing needs e2e.)"""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        base = "http://localhost"  # a loopback name: an open API answers no other Host
        async with httpx.AsyncClient(transport=transport, base_url=base, timeout=60) as c:
            yield c, app.state.gateway


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def live(app: FastAPI, **config: Any) -> AsyncIterator[int]:
    """The app under uvicorn in this event loop, on a real loopback socket: its port
    (``config``: more of ``uvicorn.Config``'s arguments, ``http=`` say)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="critical", lifespan="on", **config
        )
    )
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:  # noqa: ASYNC110 (uvicorn has no event to wait on)
            await asyncio.sleep(0.01)
        yield port
    finally:
        server.should_exit = True
        await task


async def set_headroom(client: httpx.AsyncClient, gateway: Gateway, headroom: int) -> None:
    """Put simulated pressure on sim:0 so that ``headroom`` bytes are free for routing
    (negative: over budget), then take a fresh reading. The app needs ``ADMIN_KEY``."""
    sim = gateway.occupancy.sim
    assert sim is not None
    device = gateway.poller.snapshot.device("sim:0")
    assert device is not None
    margin = device.free_bytes - gateway.margin.balance(device)
    mine = sum(sim.attached("sim:0").values())
    pressure = max(0, device.total_bytes - mine - margin - headroom)
    r = await client.put("/admin/devices/sim:0/pressure", json={"bytes": pressure}, headers=ADMIN)
    assert r.status_code == 200
    await gateway.poller.poll_once()


def realistic_repo() -> Path:
    """The model repository holding the realistic demo model, ``stdlib-bpe-llama``
    (32,000-token BPE vocabulary, 8 layers, grouped-query attention, ChatML, 20.8 M
    params), from the demo build cache. The first call builds it (about 10 minutes on
    2 cores); later calls reuse it, and so do later sessions."""
    from quantroute.demo import BPE_MODEL_NAME, ensure_demo_repo

    return ensure_demo_repo(BPE_MODEL_NAME, progress=False)


@contextlib.contextmanager
def serve_process(repo: Path, *flags: str, ready_s: float = 180) -> Iterator[str]:
    """``quantroute serve --repo REPO FLAGS...`` as its own process on a free port: the base
    URL once ``/readyz`` says ready; SIGTERM (then a kill) at the end."""
    import signal
    import subprocess
    import sys
    import time

    import pytest

    port = free_port()
    argv = [sys.executable, "-m", "quantroute.cli", "serve", "--repo", str(repo),
            "--port", str(port), *flags]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None, "the server exited while starting"
            time.sleep(0.2)
        else:
            pytest.fail(f"the server did not become ready in {ready_s:g} s")
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ec_keys(root: Path, name: str) -> tuple[Path, Path]:
    """A fresh EC P-256 key pair written as PEM files: (private, public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = root / f"{name}.pem", root / f"{name}.pub.pem"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


class StreamSource:
    """A stream store producer fed by a test: ``put`` events, ``finish`` to end; records
    its close and how many events it produced."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | list[bytes] | None] = asyncio.Queue()
        self.closed = asyncio.Event()
        self.produced = 0

    async def events(self) -> AsyncIterator[bytes | list[bytes]]:
        while (item := await self.queue.get()) is not None:
            self.produced += 1 if isinstance(item, bytes) else len(item)
            yield item

    async def close(self) -> None:
        self.closed.set()

    def put(self, *items: bytes) -> None:
        for item in items:
            self.queue.put_nowait(item)

    def put_together(self, *items: bytes) -> None:
        """Events produced in one step (a stream's last chunk, usage and ``[DONE]``)."""
        self.queue.put_nowait(list(items))

    def finish(self) -> None:
        self.queue.put_nowait(None)
