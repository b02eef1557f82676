"""The HTTP API over HTTP/2 through an ASGI server that speaks it: a real hypercorn process
serving ``quantroute.asgi:app()`` on the packaged demo model, over h2c (cleartext, prior
knowledge) and over TLS with ALPN (a self-signed certificate made here). Streaming and
resuming a stream (``GET /v1/streams/{id}`` with ``Last-Event-ID``) work over both."""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import ipaddress
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qrtest import demo_model_dir, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BODY = {
    "model": "tiny-llama:q8_0",
    "prompt": "def main():\n",
    "max_tokens": 24,
    "temperature": 0.0,
    "ignore_eos": True,
    "stream": True,
}


def _self_signed(root: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1 and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = root / "cert.pem", root / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


class Hypercorn:
    """Where the hypercorn process listens: h2c on ``h2c``, TLS on ``tls``."""

    def __init__(self, h2c: str, tls: str, cert: Path):
        self.h2c = h2c
        self.tls = tls
        self.cert = cert

    def client(self, tls: bool, http2: bool = True) -> httpx.Client:
        if tls:  # HTTP/2 if ALPN picks it, else HTTP/1.1
            verify = ssl.create_default_context(cafile=str(self.cert))
            return httpx.Client(base_url=self.tls, http2=http2, verify=verify, timeout=60)
        # cleartext HTTP/2 with prior knowledge: no HTTP/1.1 at all
        return httpx.Client(base_url=self.h2c, http1=False, http2=True, timeout=60)


@pytest.fixture(scope="module")
def hypercorn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hypercorn]:
    root = tmp_path_factory.mktemp("h2")
    cert, key = _self_signed(root)
    h2c_port, tls_port = free_port(), free_port()
    env = os.environ | {
        "QUANTROUTE_REPO": str(demo_model_dir().parent),
        "QUANTROUTE_ENGINE__PARALLEL": "2",
        "QUANTROUTE_ENGINE__N_THREADS": "1",
    }
    argv = [sys.executable, "-m", "hypercorn",
            "--bind", f"127.0.0.1:{tls_port}", "--insecure-bind", f"127.0.0.1:{h2c_port}",
            "--certfile", str(cert), "--keyfile", str(key),
            "quantroute.asgi:app()"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    served = Hypercorn(f"http://127.0.0.1:{h2c_port}", f"https://127.0.0.1:{tls_port}", cert)
    try:
        with served.client(tls=False) as client:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/readyz").status_code == 200:
                        break
                assert proc.poll() is None, "hypercorn exited while starting"
                time.sleep(0.2)
            else:
                pytest.fail("the app under hypercorn did not become ready in 180 s")
        yield served
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _events(lines: Iterator[str], limit: int | None = None) -> list[dict[str, str]]:
    """SSE events with data (their fields) off a line iterator; keep-alives skipped."""
    out: list[dict[str, str]] = []
    fields: dict[str, str] = {}
    for line in lines:
        if not line:
            if "data" in fields:
                out.append(fields)
                if limit is not None and len(out) == limit:
                    break
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")
    return out


def _text(events: list[dict[str, str]]) -> str:
    chunks = [json.loads(e["data"]) for e in events if e["data"] != "[DONE]"]
    return "".join(c.get("text", c.get("delta", {}).get("content", "")) for chunk in chunks
                   for c in chunk["choices"])  # fmt: skip


Events = list[dict[str, str]]


def _stream(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[httpx.Response, Events]:
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        events = _events(response.iter_lines())
    return response, events


@pytest.mark.parametrize("tls", [False, True], ids=["h2c", "tls-alpn"])
def test_a_stream_over_http2_and_its_resume(hypercorn: Hypercorn, tls: bool) -> None:
    with hypercorn.client(tls) as client:
        response, events = _stream(client, "/v1/completions", BODY)
        assert response.http_version == "HTTP/2"
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-quantroute-branch"] == "tiny-llama:q8_0"
        assert events[-1]["data"] == "[DONE]"
        text = _text(events)
        assert len(text) > 0 and len(events) > 3  # streamed, chunk by chunk

        # resumed after its second event, over HTTP/2 as well: exactly the rest
        stream_id = json.loads(events[0]["data"])["id"]
        headers = {
            "last-event-id": events[1]["id"],
            "x-quantroute-stream-token": response.headers["x-quantroute-stream-token"],
        }
        with client.stream("GET", f"/v1/streams/{stream_id}", headers=headers) as resumed:
            assert resumed.status_code == 200
            assert resumed.http_version == "HTTP/2"
            rest = _events(resumed.iter_lines())
        assert [e["id"] for e in rest] == [e["id"] for e in events[2:]]
        assert _text(events[:2]) + _text(rest) == text

        # a chat, streamed; and the same greedy text as over HTTP/1.1 (uvicorn's protocol)
        chat = {
            "model": "tiny-llama:q8_0",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "temperature": 0.0,
            "stream": True,
        }
        response, events = _stream(client, "/v1/chat/completions", chat)
        assert response.http_version == "HTTP/2"
        assert events[-1]["data"] == "[DONE]" and _text(events)


def test_alpn_still_offers_http1_and_h2c_streams_side_by_side(hypercorn: Hypercorn) -> None:
    """A TLS client that does not offer h2 gets HTTP/1.1; over one HTTP/2 connection,
    several streams run at once."""
    with hypercorn.client(tls=True, http2=False) as client:
        response = client.get("/healthz")
        assert (response.status_code, response.http_version) == (200, "HTTP/1.1")
    with hypercorn.client(tls=True) as client:
        assert client.get("/healthz").http_version == "HTTP/2"
    with hypercorn.client(tls=False) as client:
        body = BODY | {"max_tokens": 12}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda _: _stream(client, "/v1/completions", body), range(3)))
    texts = {_text(events) for _, events in results}
    assert len(texts) == 1 and texts != {""}  # greedy: the same text each time
    assert all(r.http_version == "HTTP/2" for r, _ in results)
