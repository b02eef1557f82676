"""The worker's tokenizer thread, in the real worker on the demo model: commands are
admitted in arrival order once their prompts are tokenized, a command cancelled while
held answers at once, and one cancelled before its turn is never tokenized."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from qrtest import demo_model_dir
from quantroute.engines.llamacpp.tokenizer import Pending
from quantroute.engines.llamacpp.worker import Worker, parse_args

pytestmark = pytest.mark.slow


def _gen(rid: str, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    s = {"max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
    s |= {"stop": [], "logprobs": False, "top_logprobs": 0}
    return {"op": "gen", "id": rid, "prompt": prompt, "s": s}


def _events(out: io.BytesIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def _arrive(worker: Worker, cmd: dict[str, Any]) -> None:
    """What the reader thread and then the loop do with a command."""
    worker._start_tokenizing(cmd)
    worker.handle(cmd)


def test_held_commands_are_admitted_in_order_and_cancelled_at_once() -> None:
    args = parse_args(["--model", str(demo_model_dir() / "q8_0.gguf"), "--parallel", "2"])
    args.n_threads, args.n_ctx = 1, 65536  # 5-byte tokens at most: 200 KB may fit
    out = io.BytesIO()
    worker = Worker(args, out)
    slow = _gen("slow", "\x7f" * 200_000)  # about 1.5 s of llama.cpp's tokenizer
    mid = _gen("mid", "import os\n" * 2_000)  # long too: behind slow, in the long lane
    fast = _gen("fast", "def ")  # short: the other lane, never held behind slow
    for cmd in (slow, mid, fast):
        _arrive(worker, cmd)
    assert [c["id"] for c in worker.held][:2] == ["slow", "mid"]  # still tokenizing

    worker.handle({"op": "cancel", "id": "mid"})  # held, its turn not come
    worker.flush()
    assert _events(out) == [
        {"ev": "fin", "id": "mid", "reason": "cancelled", "pt": 0, "ct": 0, "t": ""}
    ]
    assert [c["id"] for c in worker.held if c["id"] != "fast"] == ["slow"]

    while worker.held:  # the loop, woken by the tokenizer thread after each prompt
        worker.handle(worker.commands.get(timeout=30))
    worker.flush()
    refused = _events(out)[1]
    assert (refused["id"], refused["code"], refused["pt"]) == (
        "slow",
        "context_length_exceeded",
        200_001,
    )
    assert [seq.rid for seq in worker.waiting] == ["fast"] and worker.waiting[0].prompt
    skipped = mid["_pending"]
    assert isinstance(skipped, Pending) and skipped.done and skipped.tokens == []


def test_a_prompt_the_size_refuses_is_not_tokenized_and_ids_are_not_either() -> None:
    args = parse_args(["--model", str(demo_model_dir() / "q8_0.gguf"), "--parallel", "1"])
    args.n_threads, args.n_ctx = 1, 128
    worker = Worker(args, io.BytesIO())
    big = _gen("big", "x" * (128 * worker.max_piece_bytes))
    ids = _gen("ids", "") | {"prompt_ids": [1, 72, 105]}
    text = _gen("text", "def ")
    lying = _gen("lying", "def ") | {"_pending": "not ours"}  # from the pipe: dropped
    for cmd in (big, ids, text, lying):
        worker._start_tokenizing(cmd)
    assert "_pending" not in big and "_pending" not in ids
    assert isinstance(text["_pending"], Pending) and isinstance(lying["_pending"], Pending)
