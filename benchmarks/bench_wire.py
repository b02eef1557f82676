"""Micro-benchmark of the llama.cpp worker's wire: encode + decode per message.

Compares, on the messages the serving path carries, four codecs:

* ``json dicts`` -- the protocol before ``engines/llamacpp/wire.py``: dicts built by
  hand, ``json.dumps`` / ``json.loads``, fields read back with ``d["key"]`` /
  ``d.get("key", default)``;
* ``dataclasses`` -- frozen dataclasses with one generic codec over their fields
  (``json`` underneath; it checks no types, so it is faster than a real one would be);
* ``msgspec`` -- ``wire.py`` itself: msgspec Structs, JSON objects, typed decoding;
* ``msgspec array`` -- the same Structs with ``array_like=True`` (positional arrays).

Each measures what one side does to send and the other to read back:

* ``token, N seqs``: one decode step's plain tokens for N sequences (one ``toks`` line),
  from the worker's list to the gateway's ``TokenEvent`` per token; reported per token;
* ``token with logprobs``: one ``tok`` event with 5 top logprobs, to its ``TokenEvent``;
* ``generate``: a ``gen`` command from the gateway's ``GenerationRequest`` to the worker
  reading every sampling field.

Reported: the best of ``--repeats`` runs of ``--number`` calls, in µs (the best, since the
machine is shared: noise only adds).

``--engine`` measures the serving path instead: a real ``LlamaCppEngine`` on the tiny-llama
demo model (q8_0, one thread, prompt cache off), ``--clients`` greedy generations of
``--max-tokens`` tokens at once, ``--rounds`` times; per round the gateway process's CPU
per token (its event loop: the pipe, decoding, delivering, the consumers' reads) and the
worker's over all rounds, and the median round's tokens per second. It uses only the engine's
public API, so the same command measures a checkout from before ``wire.py`` (put its
``src`` first on ``PYTHONPATH``). Run::

    .venv/bin/python benchmarks/bench_wire.py
    .venv/bin/python benchmarks/bench_wire.py --engine --clients 4 --rounds 7
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import psutil

import quantroute
from quantroute.engines.base import GenerationRequest, SamplingParams, TokenEvent

try:
    from quantroute.engines.llamacpp import wire
except ImportError:  # a checkout from before wire.py: only --engine runs
    wire = None  # type: ignore[assignment]

SAMPLING = SamplingParams(
    max_tokens=256,
    temperature=0.7,
    top_p=0.95,
    top_k=40,
    seed=1234,
    stop=("\n\n", "</s>"),
    logit_bias=((2, -100.0),),
    min_p=0.05,
    deadline=123456.789,
)
REQUEST = GenerationRequest(
    "chatcmpl-0123456789abcdef", "def fibonacci(n):\n    " * 8, SAMPLING, parse_special=True
)
TOP = ((101, "def", -0.25), (7, " x", -2.5), (9, "(", -3.0), (11, ":", -4.0), (13, " ", -4.5))


def _triples(n: int) -> list[tuple[str, str, int]]:
    return [(f"chatcmpl-{i:016x}.{i}", " token", 1000 + i) for i in range(n)]


# -- before: hand-built dicts -----------------------------------------------------


def _dicts_tokens(triples: list[tuple[str, str, int]], side: str) -> Callable[[], object]:
    flat: list[str | int] = [x for t in triples for x in t]
    out: list[tuple[str, TokenEvent]] = []

    def encode() -> bytes:  # the worker's end of a step
        return json.dumps({"ev": "toks", "b": flat}, separators=(",", ":")).encode() + b"\n"

    def decode(line: bytes) -> object:  # the gateway's reader
        event = json.loads(line)
        if isinstance(event, dict) and event.get("ev") == "toks":
            b = event["b"]
            for i in range(0, len(b), 3):
                out.append((b[i], TokenEvent(b[i + 1], b[i + 2])))
        out.clear()
        return event

    return _side(encode, decode, side)


def _side(
    encode: Callable[[], bytes], decode: Callable[[bytes], object], side: str
) -> Callable[[], object]:
    """Both ends of one line, or one of them (``worker``: encode; ``gateway``: decode)."""
    if side == "worker":
        return encode
    if side == "gateway":
        line = encode()
        return lambda: decode(line)
    return lambda: decode(encode())


def _dicts_logprobs() -> object:
    event: dict[str, Any] = {"ev": "tok", "id": "r1", "t": "def", "tok": 101}
    event["lp"] = -0.25
    event["p"] = "def"
    event["top"] = [list(t) for t in TOP]
    item = json.loads(json.dumps(event, separators=(",", ":")).encode() + b"\n")
    top = tuple((t, text, lp) for t, text, lp in item.get("top", ()))
    return TokenEvent(item["t"], item["tok"], item.get("lp"), item.get("p"), top)


def _dicts_generate() -> object:
    r, s = REQUEST, REQUEST.sampling
    command: dict[str, Any] = {
        "op": "gen",
        "id": f"{r.request_id}.1",
        "prompt": r.prompt,
        "special": r.parse_special,
        "s": {
            "max_tokens": s.max_tokens,
            "fit_context": s.fit_context,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "seed": s.seed,
            "stop": list(s.stop),
            "logprobs": s.logprobs,
            "top_logprobs": s.top_logprobs,
            "logit_bias": [list(pair) for pair in s.logit_bias],
            "ignore_eos": s.ignore_eos,
            "min_p": s.min_p,
            "min_tokens": s.min_tokens,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "repetition_penalty": s.repetition_penalty,
            "grammar": s.grammar,
            "deadline": s.deadline,
        },
    }
    line = json.dumps(command, separators=(",", ":")).encode() + b"\n"
    cmd = json.loads(line)
    d = cmd["s"]  # the worker's admit(), reading every field as it did
    return (
        cmd["id"],
        cmd["prompt"],
        bool(cmd.get("special")),
        int(d["max_tokens"]),
        d.get("fit_context"),
        float(d["temperature"]),
        float(d["top_p"]),
        int(d["top_k"]),
        None if d.get("seed") is None else int(d["seed"]),
        tuple(d["stop"]),
        bool(d["logprobs"]),
        int(d["top_logprobs"]),
        {int(t): float(b) for t, b in d.get("logit_bias", ())},
        bool(d.get("ignore_eos")),
        float(d.get("min_p", 0.0)),
        int(d.get("min_tokens", 0)),
        float(d.get("presence_penalty", 0.0)),
        float(d.get("frequency_penalty", 0.0)),
        float(d.get("repetition_penalty", 1.0)),
        d.get("grammar"),
        None if d.get("deadline") is None else float(d["deadline"]),
    )


# -- frozen dataclasses, one generic codec ------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _DTokens:
    batch: list[tuple[str, str, int]]


@dataclasses.dataclass(frozen=True, slots=True)
class _DToken:
    id: str
    text: str
    token: int
    logprob: float | None = None
    piece: str | None = None
    top: tuple[tuple[int, str, float], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class _DGenerate:
    id: str
    prompt: str
    sampling: SamplingParams
    special: bool = False


_D_TYPES: dict[str, type[Any]] = {"toks": _DTokens, "tok": _DToken, "gen": _DGenerate}
_D_TAGS = {cls: tag for tag, cls in _D_TYPES.items()}
_D_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _D_TYPES.values()}
_D_NESTED = {_DGenerate: {"sampling": SamplingParams}}
_S_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_S_TUPLES = {"stop", "logit_bias"}


def _d_encode(message: Any) -> bytes:
    cls = type(message)
    body: dict[str, Any] = {"_": _D_TAGS[cls]}
    for name in _D_FIELDS[cls]:
        value = getattr(message, name)
        if dataclasses.is_dataclass(value):
            value = {n: getattr(value, n) for n in _S_FIELDS}
        body[name] = value
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


def _d_decode(line: bytes) -> Any:
    body = json.loads(line)
    cls = _D_TYPES[body.pop("_")]
    for name, nested in _D_NESTED.get(cls, {}).items():
        fields = body[name]
        for key in _S_TUPLES & fields.keys():
            fields[key] = tuple(tuple(x) if isinstance(x, list) else x for x in fields[key])
        body[name] = nested(**fields)
    return cls(**body)


def _dataclass_tokens(triples: list[tuple[str, str, int]], side: str) -> Callable[[], object]:
    out: list[tuple[str, TokenEvent]] = []

    def decode(line: bytes) -> object:
        event = _d_decode(line)
        for rid, text, token in event.batch:
            out.append((rid, TokenEvent(text, token)))
        out.clear()
        return event

    return _side(lambda: _d_encode(_DTokens(triples)), decode, side)


def _dataclass_logprobs() -> object:
    e = _d_decode(_d_encode(_DToken("r1", "def", 101, -0.25, "def", TOP)))
    top = tuple((t, text, lp) for t, text, lp in e.top)
    return TokenEvent(e.text, e.token, e.logprob, e.piece, top)


def _dataclass_generate() -> object:
    r = REQUEST
    cmd = _d_decode(_d_encode(_DGenerate(f"{r.request_id}.1", r.prompt, r.sampling, True)))
    return cmd.sampling.max_tokens, cmd.sampling.temperature


# -- msgspec: wire.py ---------------------------------------------------------------


def _msgspec_tokens(triples: list[tuple[str, str, int]], side: str) -> Callable[[], object]:
    out: list[tuple[str, TokenEvent]] = []

    def decode(line: bytes) -> object:
        event = wire.decode_event(line)
        if type(event) is wire.Tokens:
            for rid, text, token in event.batch:
                out.append((rid, TokenEvent(text, token)))
        out.clear()
        return event

    return _side(lambda: wire.encode(wire.Tokens(list(triples))), decode, side)


def _msgspec_logprobs() -> object:
    event = wire.decode_event(wire.encode(wire.Token("r1", "def", 101, -0.25, "def", TOP)))
    assert type(event) is wire.Token
    return event.event()


def _msgspec_generate() -> object:
    r = REQUEST
    command = wire.Generate(f"{r.request_id}.1", r.prompt, r.sampling, r.parse_special)
    cmd = wire.decode_command(wire.encode(command))
    assert type(cmd) is wire.Generate
    return cmd.sampling.max_tokens, cmd.sampling.temperature


# -- msgspec, positional arrays -------------------------------------------------------


class _ATokens(msgspec.Struct, frozen=True, gc=False, array_like=True, tag="toks"):
    batch: list[tuple[str, str, int]]


class _AToken(msgspec.Struct, frozen=True, gc=False, array_like=True, tag="tok"):
    id: str
    text: str
    token: int
    logprob: float | None = None
    piece: str | None = None
    top: tuple[tuple[int, str, float], ...] = ()


class _AGenerate(msgspec.Struct, frozen=True, gc=False, array_like=True, tag="gen"):
    id: str
    prompt: str
    sampling: SamplingParams
    special: bool = False


_a_encoder = msgspec.json.Encoder()
_a_events = msgspec.json.Decoder(_ATokens | _AToken)
_a_commands = msgspec.json.Decoder(_AGenerate)


def _array_tokens(triples: list[tuple[str, str, int]], side: str) -> Callable[[], object]:
    out: list[tuple[str, TokenEvent]] = []

    def decode(line: bytes) -> object:
        event = _a_events.decode(line)
        if type(event) is _ATokens:
            for rid, text, token in event.batch:
                out.append((rid, TokenEvent(text, token)))
        out.clear()
        return event

    return _side(lambda: _a_encoder.encode(_ATokens(list(triples))) + b"\n", decode, side)


def _array_logprobs() -> object:
    line = _a_encoder.encode(_AToken("r1", "def", 101, -0.25, "def", TOP)) + b"\n"
    e = _a_events.decode(line)
    assert type(e) is _AToken
    return TokenEvent(e.text, e.token, e.logprob, e.piece, e.top)


def _array_generate() -> object:
    r = REQUEST
    line = _a_encoder.encode(_AGenerate(f"{r.request_id}.1", r.prompt, r.sampling, True))
    cmd = _a_commands.decode(line + b"\n")
    return cmd.sampling.max_tokens, cmd.sampling.temperature


# -- measuring ------------------------------------------------------------------------


def best_us(fn: Callable[[], object], number: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / number)
    return best / 1000


# -- the serving path -------------------------------------------------------------------


async def engine_path(clients: int, max_tokens: int, rounds: int) -> None:
    from quantroute.engines.llamacpp.engine import LlamaCppEngine, WorkerOptions
    from quantroute.engines.supervisor import RestartPolicy

    model = Path(quantroute.__file__).parent / "demo" / "repo" / "tiny-llama" / "q8_0.gguf"
    n_ctx = max(512, max_tokens + 64)  # past the model's 512: text, not quality, is measured
    options = WorkerOptions(parallel=clients, n_threads=1, n_ctx=n_ctx, prompt_cache=False)
    engine = LlamaCppEngine("tiny-llama:q8_0", model, options, RestartPolicy())
    await engine.start()
    assert engine.ready and engine.pid is not None
    worker = psutil.Process(engine.pid)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> int:
        request = GenerationRequest(f"b{i}", "def fibonacci(n):\n    ", sampling)
        return sum([isinstance(e, TokenEvent) async for e in engine.generate(request)])

    def worker_cpu() -> float:
        t = worker.cpu_times()
        return t.user + t.system

    try:
        await asyncio.gather(*(one(i) for i in range(clients)))  # warm
        gateway_s = worker_s = 0.0
        tokens, rates = 0, []
        for _ in range(rounds):
            # the gateway's CPU from the kernel's ns clock; the worker's in clock ticks
            g0, w0, t0 = time.process_time(), worker_cpu(), time.perf_counter()
            n = sum(await asyncio.gather(*(one(i) for i in range(clients))))
            rates.append(n / (time.perf_counter() - t0))
            gateway_s += time.process_time() - g0
            worker_s += worker_cpu() - w0
            tokens += n
    finally:
        await engine.stop()
    print(f"# engine path: tiny-llama q8_0, {clients} clients x {max_tokens} tokens, "
          f"{rounds} rounds, {tokens} tokens; wire.py: {wire is not None}")  # fmt: skip
    print("| gateway CPU µs/token | worker CPU µs/token | tokens/s (median round) |")
    print("|---|---|---|")
    print(f"| {gateway_s / tokens * 1e6:.1f} | {worker_s / tokens * 1e6:.1f} "
          f"| {statistics.median(rates):.0f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=500, help="calls per run")
    parser.add_argument("--repeats", type=int, default=200, help="runs; the best is kept")
    parser.add_argument("--engine", action="store_true", help="measure the serving path")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.engine:
        asyncio.run(engine_path(args.clients, args.max_tokens, args.rounds))
        return

    codecs: dict[str, dict[str, Callable[..., Any]]] = {
        "json dicts (before)": {
            "tokens": _dicts_tokens,
            "logprobs": lambda: _dicts_logprobs,
            "generate": lambda: _dicts_generate,
        },
        "dataclasses": {
            "tokens": _dataclass_tokens,
            "logprobs": lambda: _dataclass_logprobs,
            "generate": lambda: _dataclass_generate,
        },
        "msgspec (wire.py)": {
            "tokens": _msgspec_tokens,
            "logprobs": lambda: _msgspec_logprobs,
            "generate": lambda: _msgspec_generate,
        },
        "msgspec array": {
            "tokens": _array_tokens,
            "logprobs": lambda: _array_logprobs,
            "generate": lambda: _array_generate,
        },
    }
    rows: list[tuple[str, int, Callable[[dict[str, Callable[..., Any]]], Callable[[], object]]]]
    rows = [(f"token, {n} seqs (per token)", n, lambda c, n=n: c["tokens"](_triples(n), "both"))
            for n in (1, 4, 16)]  # fmt: skip
    rows += [(f"token, 4 seqs: {label}", 4, lambda c, side=side: c["tokens"](_triples(4), side))
             for side, label in (("worker", "the worker's encode"),
                                 ("gateway", "the gateway's decode"))]  # fmt: skip
    rows += [("token with logprobs", 1, lambda c: c["logprobs"]())]
    rows += [("generate", 1, lambda c: c["generate"]())]
    # the floor every codec pays on the token rows: building the TokenEvents
    floor = {n: best_us(lambda n=n: [TokenEvent(" token", i) for i in range(n)], args.number,
                        args.repeats) / n for n in (1, 4, 16)}  # fmt: skip

    print(f"# {platform.python_implementation()} {platform.python_version()}, "
          f"msgspec {msgspec.__version__}, {platform.machine()}; best of {args.repeats} x "
          f"{args.number}, µs")  # fmt: skip
    names = list(codecs)
    print("| message | " + " | ".join(names) + " | TokenEvent alone |")
    print("|---" * (len(names) + 2) + "|")
    for label, per, make in rows:
        cells = [best_us(make(codecs[name]), args.number, args.repeats) / per for name in names]
        base = cells[0]
        text = [f"{c:.2f}" + ("" if i == 0 else f" ({c / base:.2f}x)") for i, c in enumerate(cells)]
        alone = f"{floor[per]:.2f}" if "seqs" in label and "worker" not in label else ""
        print(f"| {label} | " + " | ".join(text) + f" | {alone} |")


if __name__ == "__main__":
    main()
