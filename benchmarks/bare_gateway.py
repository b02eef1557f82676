"""A bare gateway: the floor of a Python HTTP process in front of quantroute's worker.

uvicorn (uvloop, httptools) and one raw ASGI function that streams ``POST /v1/completions``
from one ``quantroute.engines.llamacpp.worker`` process, driven over its stdin/stdout
protocol by the serving benchmark's own ceiling driver (``serving_systems.WorkerCeiling``),
with nothing else: no validation, routing, admission, tenants, resumable streams, metrics or
traces. The serving benchmark runs it as the system ``bare-gateway``: what quantroute costs
above it is its own request path, not the process hop or Python's HTTP stack. It is a
measuring device, not a server: it trusts its client.

    python benchmarks/bare_gateway.py --model FILE --port 8000 [--parallel 16 ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import uvicorn

from serving_systems import Settings, WorkerCeiling

START = {"type": "http.response.start", "status": 200,
         "headers": [(b"content-type", b"text/event-stream")]}  # fmt: skip


class Bare:
    def __init__(self, args: argparse.Namespace):
        cfg = Settings(
            args.threads, args.parallel, args.n_ctx, args.prompt_cache, args.n_gpu_layers
        )
        log = "bare-gateway-worker.log"
        self.worker = WorkerCeiling(Path(args.model), cfg, Path(args.logs), log)
        self.worker.start(120.0)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await self.worker.open()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.worker.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] != "/v1/completions":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await self.complete(json.loads(body), send)

    async def complete(self, req: dict[str, Any], send: Any) -> None:
        """The worker's events as OpenAI completion chunks: headers with the first event,
        one chunk per token, usage on the last, then ``[DONE]``."""
        bias = [(int(t), float(b)) for t, b in req.get("logit_bias", {}).items()]
        started = False
        async for event in self.worker.events(req["prompt"], int(req["max_tokens"]), bias):
            kind = event.get("ev")
            if kind not in ("tok", "fin", "err"):
                continue  # start
            if not started:
                await send(START)
                started = True
            if kind == "tok":
                chunk: dict[str, Any] = {
                    "choices": [{"index": 0, "text": event["t"], "finish_reason": None}]
                }
            elif kind == "fin":
                last = {"index": 0, "text": event.get("t", ""), "finish_reason": event["reason"]}
                usage = {"prompt_tokens": event["pt"], "completion_tokens": event["ct"]}
                chunk = {"choices": [last], "usage": usage}
            else:
                chunk = {"error": {"message": event.get("msg", ""), "code": event.get("code")}}
            frame = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            if kind == "tok":
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            else:
                await send({"type": "http.response.body", "body": frame + b"data: [DONE]\n\n"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument("--prompt-cache", action="store_true")
    parser.add_argument("--logs", default=".", help="folder for the worker's stderr log")
    args = parser.parse_args()
    uvicorn.run(
        Bare(args), host=args.host, port=args.port, loop="uvloop", http="httptools",
        log_level="warning", lifespan="on",
    )  # fmt: skip


if __name__ == "__main__":
    main()
