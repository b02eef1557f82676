"""A bare gateway: the floor of a Python HTTP process in front of quantroute's worker.

uvicorn (uvloop, httptools) and one raw ASGI function that streams ``POST /v1/completions``
from one ``quantroute.engines.llamacpp_worker`` process over its stdin/stdout protocol, the
way quantroute's gateway drives it, with nothing else: no validation, routing, admission,
tenants, resumable streams, metrics or traces. The serving benchmark runs it as the system
``bare-gateway``: what quantroute costs above it is its own request path, not the process
hop or Python's HTTP stack. It is a measuring device, not a server: it trusts its client.

    python benchmarks/bare_gateway.py --model FILE --port 8000 [--parallel 16 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from typing import Any

import uvicorn

ids = itertools.count()


class Bare:
    def __init__(self, args: argparse.Namespace):
        self.argv = [
            sys.executable, "-m", "quantroute.engines.llamacpp_worker", "--model", args.model,
            "--n-ctx", str(args.n_ctx), "--parallel", str(args.parallel),
            "--n-threads", str(args.threads), "--n-gpu-layers", str(args.n_gpu_layers),
            "--log-level", "warning", *(() if args.prompt_cache else ("--no-prompt-cache",)),
        ]  # fmt: skip
        self.proc: asyncio.subprocess.Process | None = None
        self.waiters: dict[str, asyncio.Queue[tuple[str, Any]]] = {}
        self.reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=1 << 24,
        )  # fmt: skip
        assert self.proc.stdout is not None
        ready = json.loads(await self.proc.stdout.readline())
        if ready.get("ev") != "ready":
            raise RuntimeError(f"the worker did not start: {ready}")
        self.reader = asyncio.create_task(self._read())

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(b'{"op":"shutdown"}\n')
            await self.proc.wait()

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            event = json.loads(line)
            if event.get("ev") == "toks":  # one step's tokens: id, text, token, ...
                batch = event["b"]
                for i in range(0, len(batch), 3):
                    waiter = self.waiters.get(batch[i])
                    if waiter is not None:
                        waiter.put_nowait(("tok", batch[i + 1]))
            else:
                waiter = self.waiters.get(event.get("id", ""))
                if waiter is not None:
                    waiter.put_nowait((event["ev"], event))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await self.start()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.stop()
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
        assert self.proc is not None and self.proc.stdin is not None
        rid = f"b{next(ids)}"
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.waiters[rid] = events
        command = {
            "op": "gen", "id": rid, "prompt": req["prompt"], "special": False,
            "s": {
                "max_tokens": int(req["max_tokens"]), "temperature": 0.0, "top_p": 1.0,
                "top_k": 0, "seed": None, "stop": [], "logprobs": False, "top_logprobs": 0,
                "logit_bias": [[int(t), float(b)] for t, b in req.get("logit_bias", {}).items()],
            },
        }  # fmt: skip
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")
        started = False
        try:
            while True:
                kind, value = await events.get()
                if not started:
                    headers = [(b"content-type", b"text/event-stream")]
                    await send({"type": "http.response.start", "status": 200, "headers": headers})
                    started = True
                if kind == "tok":
                    chunk = {"choices": [{"index": 0, "text": value, "finish_reason": None}]}
                elif kind == "fin":
                    last = {"index": 0, "text": value["t"], "finish_reason": value["reason"]}
                    usage = {"prompt_tokens": value["pt"], "completion_tokens": value["ct"]}
                    chunk = {"choices": [last], "usage": usage}
                elif kind == "err":
                    chunk = {"error": {"message": value.get("msg", ""), "code": value.get("code")}}
                else:
                    continue  # start
                frame = b"data: " + json.dumps(chunk).encode() + b"\n\n"
                if kind == "tok":
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
                    continue
                await send({"type": "http.response.body", "body": frame + b"data: [DONE]\n\n"})
                return
        finally:
            del self.waiters[rid]


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
    args = parser.parse_args()
    uvicorn.run(
        Bare(args), host=args.host, port=args.port, loop="uvloop", http="httptools",
        log_level="warning", lifespan="on",
    )  # fmt: skip


if __name__ == "__main__":
    main()
