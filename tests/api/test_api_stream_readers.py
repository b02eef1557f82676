"""How many clients may read one stream at once (``streams.max_readers``), over real
sockets: a burst of resumes of a live stream gets exactly the room left, the rest a 429
in OpenAI's shape with ``Retry-After``; once readers leave, a resume gets in again."""

from __future__ import annotations

import asyncio
import json

import httpx

from qrtest import fake_table, live
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine

BODY = {"model": "tiny-llama:q8_0", "prompt": "def ", "max_tokens": 64, "stream": True}


async def _first_event(
    http: httpx.AsyncClient, path: str, hold: asyncio.Event, token: dict[str, str]
) -> int:
    """Resume ``path`` (with the stream's ``token`` header: the API is open); on a 200,
    read one event and hold the stream until ``hold``."""
    async with http.stream("GET", path, headers=token) as r:
        if r.status_code != 200:
            await r.aread()
            error = r.json()["error"]
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
            assert "4 readers" in error["message"] and error["param"] is None
            return r.status_code
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break
        await hold.wait()
        return r.status_code


async def test_a_burst_of_resumes_gets_the_room_left_and_the_rest_a_429() -> None:
    table = fake_table({"q8_0": FakeEngine(token_delay_s=0.05)})  # 64 tokens: about 3 s
    settings = load_settings(telemetry={"devices": "sim:1x24GiB"}, streams={"max_readers": 4})
    async with live(create_app(settings, table)) as port:
        base = f"http://127.0.0.1:{port}"
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=base, timeout=20, limits=limits) as http:
            headers = {"x-quantroute-resumable": "true"}
            async with http.stream("POST", "/v1/completions", json=BODY, headers=headers) as r:
                assert r.status_code == 200
                job = r.headers["x-request-id"]
                token = {"x-quantroute-stream-token": r.headers["x-quantroute-stream-token"]}
                hold = asyncio.Event()
                path = f"/v1/streams/{job}"
                burst = [
                    asyncio.create_task(_first_event(http, path, hold, token)) for _ in range(9)
                ]
                refused: list[int] = []
                reading = set(burst)
                while len(refused) < 6:
                    done, reading = await asyncio.wait(
                        reading, timeout=10, return_when=asyncio.FIRST_COMPLETED
                    )
                    assert done, refused
                    refused += [t.result() for t in done]
                assert refused == [429] * 6, refused
                await asyncio.sleep(0.3)
                assert len(reading) == 3 and not any(t.done() for t in reading)  # reading on
                hold.set()
                assert sorted(await asyncio.gather(*burst)) == [200] * 3 + [429] * 6
                await asyncio.sleep(0.2)  # the three closed: room for three again
                again = await http.get(path, headers=token | {"last-event-id": f"{job}/0"})
                assert again.status_code == 200  # read to the end: the stream finished
                lines = [ln for ln in again.text.splitlines() if ln.startswith("data: ")]
                assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["id"]
