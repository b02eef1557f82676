"""``GET /dashboard`` in a real browser: ``quantroute serve`` on the demo model as a process,
headless Chromium (Debian's ``chromium``) driven over the DevTools protocol. The page must
show the demo model's branches and the devices, and its numbers must move as requests
are served."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from base64 import b64decode
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

from qrtest import demo_model_dir, serve_process
from tools import need_tool

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class Browser:
    """One headless Chromium page, driven by DevTools protocol calls."""

    def __init__(self, ws: ClientConnection):
        self._ws = ws
        self._id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv(timeout=30))
            if message.get("id") == self._id:
                assert "error" not in message, message
                return dict(message["result"])

    def eval(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")


@contextlib.contextmanager
def _chromium() -> Iterator[Browser]:
    binary = need_tool("chromium", "chromium")
    profile = Path(tempfile.mkdtemp(prefix="qr-chromium-"))
    argv = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-dev-shm-usage", "--remote-debugging-port=0", "--window-size=1400,1100",
            f"--user-data-dir={profile}", "about:blank"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, "chromium exited while starting"
            assert time.monotonic() < deadline, "chromium did not start in 30 s"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(t for t in targets if t["type"] == "page")
        with connect(page["webSocketDebuggerUrl"], max_size=1 << 26) as ws:
            yield Browser(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


STATE = """(() => { try { return JSON.stringify({
  branches: [...document.querySelectorAll('tr.branch')].map(r => [r.dataset.branch,
             r.querySelector('.state').textContent]),
  devices: [...document.querySelectorAll('.device')].map(d => d.dataset.device),
  used: [...document.querySelectorAll('.device-used')].map(d => d.textContent),
  requests: Number(document.getElementById('requests-last-minute').textContent),
  polls: Number(document.getElementById('polls').textContent),
  verdict: document.getElementById('verdict').textContent,
  recent: document.querySelectorAll('#recent tbody tr').length,
  error: document.getElementById('error').textContent,
}) } catch (e) { return null } })()"""  # null until the page is there


def _wait(browser: Browser, ok: Any, timeout_s: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        raw = browser.eval(STATE)
        state: dict[str, Any] | None = None if raw is None else json.loads(raw)
        if state is not None and ok(state):
            return state
        assert time.monotonic() < deadline, f"the page never got there: {state}"
        time.sleep(0.25)


def test_the_status_page_shows_branches_devices_and_live_numbers() -> None:
    with (
        serve_process(
            demo_model_dir().parent, "--engine-parallel", "2", "--engine-n-threads", "1", ready_s=90
        ) as base,
        _chromium() as browser,
    ):
        devices = httpx.get(f"{base}/v1/devices").json()["data"]
        csp = httpx.get(f"{base}/dashboard").headers["content-security-policy"]
        assert "script-src 'sha256-" in csp  # the page below runs under it
        browser.call("Page.enable")
        browser.call("Page.navigate", url=f"{base}/dashboard")
        first = _wait(browser, lambda s: s["polls"] >= 1 and s["branches"])
        assert not first["error"]
        assert sorted(b for b, _ in first["branches"]) == [
            "tiny-llama:f16",
            "tiny-llama:onnx_fp16",
            "tiny-llama:onnx_int4",
            "tiny-llama:onnx_int8",
            "tiny-llama:q4_k_m",
            "tiny-llama:q8_0",
        ]
        assert {state for _, state in first["branches"]} == {"ready"}
        assert first["verdict"] == "every model served (1)"
        assert first["devices"] == [d["id"] for d in devices] and first["devices"]
        assert first["used"][0].endswith("B")
        # the router serves; the page's numbers follow within a refresh or two
        body = {"model": "tiny-llama", "prompt": "def main():", "max_tokens": 8}
        for _ in range(3):
            assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        later = _wait(
            browser, lambda s: s["requests"] >= first["requests"] + 3 and s["recent"] >= 3
        )
        assert later["polls"] > first["polls"]
        shot = browser.call("Page.captureScreenshot", format="png")["data"]
        target = os.environ.get("QUANTROUTE_DASHBOARD_SCREENSHOT")
        if target:  # docs/img/dashboard.png is made this way
            Path(target).write_bytes(b64decode(shot))
        assert b64decode(shot)[:8] == b"\x89PNG\r\n\x1a\n"
