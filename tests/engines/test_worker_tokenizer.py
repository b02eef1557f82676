"""The worker's tokenizer thread, in the real worker on the demo model: commands are
admitted in arrival order once their prompts are tokenized, a command cancelled while
held answers at once, and one cancelled before its turn is never tokenized."""

from __future__ import annotations

import io

import pytest

from qrtest import demo_model_dir
from quantroute.engines.base import FinishReason, SamplingParams
from quantroute.engines.llamacpp import wire
from quantroute.engines.llamacpp.tokenizer import Pending
from quantroute.engines.llamacpp.worker import Held, Worker, parse_args

pytestmark = pytest.mark.slow


def _gen(rid: str, prompt: str, max_tokens: int = 4) -> wire.Generate:
    return wire.Generate(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def _events(out: io.BytesIO) -> list[wire.Event]:
    return [wire.decode_event(line) for line in out.getvalue().splitlines()]


def _arrive(worker: Worker, cmd: wire.Generate) -> Held:
    """What the reader thread and then the loop do with a command."""
    held = worker.receive(cmd)
    assert isinstance(held, Held)
    worker.handle(held)
    return held


def test_held_commands_are_admitted_in_order_and_cancelled_at_once() -> None:
    args = parse_args(["--model", str(demo_model_dir() / "q8_0.gguf"), "--parallel", "2"])
    args.n_threads, args.n_ctx = 1, 65536  # 5-byte tokens at most: 200 KB may fit
    out = io.BytesIO()
    worker = Worker(args, out)
    slow = _gen("slow", "\x7f" * 200_000)  # about 1.5 s of llama.cpp's tokenizer
    mid = _gen("mid", "import os\n" * 2_000)  # long too: behind slow, in the long lane
    fast = _gen("fast", "def ")  # short: the other lane, never held behind slow
    _, held_mid, _ = (_arrive(worker, cmd) for cmd in (slow, mid, fast))
    assert [h.command.id for h in worker.held][:2] == ["slow", "mid"]  # still tokenizing

    worker.handle(wire.Cancel("mid"))  # held, its turn not come
    worker.flush()
    assert _events(out) == [wire.Finished("mid", FinishReason.CANCELLED, 0, 0)]
    assert [h.command.id for h in worker.held if h.command.id != "fast"] == ["slow"]

    while worker.held:  # the loop, woken by the tokenizer thread after each prompt
        worker.handle(worker.commands.get(timeout=30))
    worker.flush()
    refused = _events(out)[1]
    assert isinstance(refused, wire.Error)
    assert (refused.id, refused.code, refused.prompt_tokens) == (
        "slow",
        "context_length_exceeded",
        200_001,
    )
    waiting = worker.batcher.waiting
    assert [seq.rid for seq in waiting] == ["fast"] and waiting[0].prompt
    skipped = held_mid.pending
    assert isinstance(skipped, Pending) and skipped.done and skipped.tokens == []


def test_a_prompt_the_size_refuses_is_not_tokenized_and_ids_are_not_either() -> None:
    args = parse_args(["--model", str(demo_model_dir() / "q8_0.gguf"), "--parallel", "1"])
    args.n_threads, args.n_ctx = 1, 128
    worker = Worker(args, io.BytesIO())
    big = _gen("big", "x" * (128 * worker.model.max_piece_bytes))
    ids = wire.Generate("ids", "", SamplingParams(max_tokens=4), prompt_ids=(1, 72, 105))
    text = _gen("text", "def ")
    # a key the pipe brought that is not the command's (a worker's own state once was)
    lying = wire.encode(_gen("lying", "def ")).replace(b'"op"', b'"_pending":"not ours","op"')
    held = [worker.receive(cmd) for cmd in (big, ids, text, wire.decode_command(lying))]
    assert all(isinstance(h, Held) for h in held)
    pending = [h.pending for h in held if isinstance(h, Held)]
    assert pending[:2] == [None, None]  # refused by its size / ids as they are
    assert all(isinstance(p, Pending) for p in pending[2:])


def test_a_token_longer_than_the_piece_buffer_keeps_its_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """llama.cpp answers a piece longer than the buffer with minus its length. Before, such
    a token's text was empty: emitted as nothing, compared equal between a model and its
    draft, and left out of ``max_piece_bytes`` (the prompt's token bound)."""
    import ctypes
    from types import SimpleNamespace

    from quantroute.engines.llamacpp import worker_model

    pieces = {0: b"a", 1: b"x" * 300}

    def to_piece(vocab: object, token: int, buf: object, size: int, lstrip: int, sp: bool) -> int:
        piece = pieces[token]
        if len(piece) > size:
            return -len(piece)
        ctypes.memmove(buf, piece, len(piece))
        return len(piece)

    monkeypatch.setattr(worker_model, "lc", SimpleNamespace(llama_token_to_piece=to_piece))
    vocab = object.__new__(worker_model.Vocabulary)
    vocab.vocab, vocab._piece_buf = None, ctypes.create_string_buffer(256)
    assert [vocab.piece_bytes(t) for t in (0, 1, 0)] == [b"a", b"x" * 300, b"a"]
