"""The llama.cpp worker's wire (``engines/llamacpp/wire.py``): every message survives the
trip, a malformed one is an error naming the message and the field, a sampling field
declared once in ``SamplingParams`` reaches the worker decoded, and the real worker
answers a malformed command with an error instead of dying."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest

from qrtest import demo_model_dir
from quantroute.engines import base
from quantroute.engines.base import EngineInfo, FinishReason, SamplingParams
from quantroute.engines.inbox import Inbox
from quantroute.engines.llamacpp import wire
from quantroute.engines.llamacpp.engine import LlamaCppEngine, WorkerOptions
from quantroute.engines.supervisor import RestartPolicy
from quantroute.errors import EngineError

EVERY_KNOB = SamplingParams(
    max_tokens=7,
    fit_context=True,
    temperature=0.5,
    top_p=0.9,
    top_k=40,
    seed=-3,
    stop=("\n\n", "END"),
    logprobs=True,
    top_logprobs=3,
    logit_bias=((2, -100.0), (7, 1.5)),
    ignore_eos=True,
    min_p=0.05,
    min_tokens=2,
    presence_penalty=0.5,
    frequency_penalty=0.25,
    repetition_penalty=1.1,
    grammar='root ::= "a"',
    deadline=12345.5,
)
INFO = EngineInfo(128, 2048, 354, 4, None, "<s>", "</s>", 1 << 20, 4242)

COMMANDS: list[wire.Command] = [
    wire.Generate("r1", "def ", SamplingParams()),
    wire.Generate("r2", "", EVERY_KNOB, True, (1, 72, 105), {"traceparent": "00-ab-cd-01"}),
    wire.Generate("r3", "def ", SamplingParams(temperature=0.0), spec=8),
    wire.WriteLogits("l1", "import os", [101, 7], "/dev/shm/x.f32", special=True),
    wire.Score("s1", "import os", [101, 7], wire.Reference("/dev/shm/x.f32", (2, 354))),
    wire.Cancel("r1"),
    wire.Pause("r1"),
    wire.Resume("r1"),
    wire.Shutdown(),
]
EVENTS: list[wire.Event] = [
    wire.Ready(INFO),
    wire.Ready(INFO, "q4_k_m.gguf"),
    wire.Started("r1", 12, 8),
    wire.Tokens([("r1", "def", 101), ("r2", "", 7)]),
    wire.Token("r1", "x", 7, -0.25, "x", ((7, "x", -0.25), (9, "é", -3.0))),
    wire.Token("r1", "x", 7),
    wire.Finished("r1", FinishReason.DEADLINE, 12, 40, "tail", (1, 2, 3)),
    wire.Finished("r2", FinishReason.CANCELLED, 0, 0),
    wire.Finished("r3", FinishReason.STOP, 5, 9, drafted=30, accepted=24, mean_k=3.75),
    wire.Logits("l1", "/dev/shm/x.f32", (2, 354)),
    wire.Scores("s1", [0.0012, None], [True, False]),
    wire.Error("r1", "context_length_exceeded", "", 9, 300, 128, at_least=True),
    wire.Error("r2", "engine_error", "llama_decode returned -1"),
]


def _kinds(union: Any) -> set[type]:
    return set(union.__args__)


def test_the_samples_hold_every_message() -> None:
    """A new message must get a sample here, so the round trips below cover it."""
    assert {type(c) for c in COMMANDS} == _kinds(wire.Command)
    assert {type(e) for e in EVENTS} == _kinds(wire.Event)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: type(c).__name__)
def test_every_command_round_trips(command: wire.Command) -> None:
    line = wire.encode(command)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert wire.decode_command(line) == command


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_round_trips(event: wire.Event) -> None:
    line = wire.encode(event)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert wire.decode_event(line) == event


def test_events_become_the_engines_events_with_every_field() -> None:
    token = wire.Token("r1", "x", 7, -0.25, "x", ((7, "x", -0.25),))
    assert token.event() == base.TokenEvent("x", 7, -0.25, "x", ((7, "x", -0.25),))
    fin = wire.Finished("r1", FinishReason.STOP, 12, 40, "t", (1, 2, 3))
    want = base.FinishEvent(FinishReason.STOP, 12, 40, "t", (1, 2, 3), held=True)
    assert fin.event(held=True) == want
    assert wire.Started("r1", 12, 8).event() == base.StartEvent(12, 8)
    ref = wire.Logits("l1", "/dev/shm/x.f32", (2, 354)).reference()
    assert (str(ref.path), ref.n_tokens, ref.n_vocab) == ("/dev/shm/x.f32", 2, 354)


def test_the_lines_are_the_json_the_protocol_documents() -> None:
    """Short keys, defaults left out; the supervisor's own shutdown line is a command."""
    assert wire.encode(wire.Started("r1", 12)) == b'{"ev":"start","id":"r1","pt":12}\n'
    assert wire.encode(wire.Tokens([("r1", "a", 1)])) == b'{"ev":"toks","b":[["r1","a",1]]}\n'
    assert wire.encode(wire.Cancel("r1")) == b'{"op":"cancel","id":"r1"}\n'
    assert wire.decode_command(b'{"op":"shutdown"}\n') == wire.Shutdown()
    # a field the reader does not know is ignored: either side may add one first
    assert wire.decode_command(b'{"op":"cancel","id":"r1","later":1}') == wire.Cancel("r1")


def test_a_speculated_gen_asks_for_a_bounded_k_and_its_fin_counts_the_drafts() -> None:
    line = wire.encode(wire.Generate("r1", "def ", SamplingParams(), spec=3))
    assert b'"spec":3' in line
    assert b"spec" not in wire.encode(wire.Generate("r1", "def ", SamplingParams()))
    for bad in (-1, wire.MAX_SPEC + 1):
        with pytest.raises(wire.DecodeError) as caught:
            wire.decode_command(line.replace(b'"spec":3', b'"spec":%d' % bad))
        assert caught.value.where == "generate.spec" and caught.value.id == "r1"
    fin = wire.Finished("r1", FinishReason.STOP, 5, 9, drafted=30, accepted=24, mean_k=3.75)
    assert b'"dr":30,"ac":24,"k":3.75' in wire.encode(fin)
    assert b'"dr"' not in wire.encode(wire.Finished("r1", FinishReason.STOP, 5, 9))


def test_an_infinite_divergence_crosses_as_null() -> None:
    line = wire.encode(wire.Scores("s1", [float("inf"), 0.5], [False, True]))
    assert b'"kld":[null,0.5]' in line
    assert wire.decode_event(line) == wire.Scores("s1", [None, 0.5], [False, True])


GEN = wire.encode(wire.Generate("r9", "def ", SamplingParams(max_tokens=3, stop=("x",))))

MALFORMED_COMMANDS = [
    (
        GEN.replace(b'"max_tokens":3', b'"max_tokens":"3"'),
        "generate.sampling.max_tokens: expected int, got str",
        "r9",
    ),
    (
        GEN.replace(b'"stop":["x"]', b'"stop":["x",3]'),
        "generate.sampling.stop[1]: expected str, got int",
        "r9",
    ),
    (
        GEN.replace(b'"top_k":0', b'"top_k":1.5'),
        "generate.sampling.top_k: expected int, got float",
        "r9",
    ),
    (b'{"op":"gen","id":"r9","prompt":"x"}', "generate.sampling: missing", "r9"),
    (b'{"op":"cancel","id":5}', "cancel.id: expected str, got int", None),
    (
        b'{"op":"score","id":"s","prompt":"","tokens":[1],"ref":{"path":"x","shape":[1]}}',
        "score.reference.shape: expected array of length 2",
        "s",
    ),
    (
        b'{"op":"logits","id":"l","prompt":"","tokens":["a"],"path":"p"}',
        "write_logits.tokens[0]: expected int, got str",
        "l",
    ),
    (b'{"op":"gex","id":"r9"}', "command: unknown command 'gex'", "r9"),
    (b'{"id":"r9"}', "command: no 'op'", "r9"),
    (b"[1, 2]", "command: expected an object, got list", None),
]


@pytest.mark.parametrize(("line", "words", "rid"), MALFORMED_COMMANDS)
def test_a_malformed_command_names_the_message_and_field(
    line: bytes, words: str, rid: str | None
) -> None:
    with pytest.raises(wire.DecodeError) as caught:
        wire.decode_command(line)
    assert str(caught.value).startswith(words), str(caught.value)
    assert caught.value.id == rid


def test_a_line_that_is_not_json_says_so() -> None:
    with pytest.raises(wire.DecodeError, match=r"^command: not JSON") as caught:
        wire.decode_command(b'{"op": "gen", "id": ')
    assert caught.value.id is None and isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        (
            b'{"ev":"fin","id":"r","reason":"nope","pt":1,"ct":2}',
            "finished.reason: invalid enum value 'nope'",
        ),
        (b'{"ev":"toks","b":[["r","t","7"]]}', "tokens.batch[0][2]: expected int, got str"),
        (b'{"ev":"start","id":"r"}', "started.prompt_tokens: missing"),
        (b'{"ev":"ready","info":{"n_ctx":"x"}}', "ready.info.n_ctx: expected int, got str"),
    ],
)
def test_a_malformed_event_names_the_message_and_field(line: bytes, words: str) -> None:
    with pytest.raises(wire.DecodeError) as caught:
        wire.decode_event(line)
    assert str(caught.value) == words


# -- a new sampling field, declared once ----------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _WithTopA(SamplingParams):
    top_a: float = 0.0  # a new knob, declared here and nowhere else


def _wire_with(sampling: type, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A fresh copy of wire.py, unedited, built while ``SamplingParams`` is ``sampling``:
    what the module would be had that field been declared in engines/base.py."""
    spec = importlib.util.spec_from_file_location("wire_with_a_new_field", wire.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(base, "SamplingParams", sampling)
    monkeypatch.setitem(sys.modules, spec.name, module)  # where msgspec reads its types
    spec.loader.exec_module(module)
    return module


def test_a_sampling_field_declared_once_reaches_the_worker_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    declared = _WithTopA  # SamplingParams, had ``top_a`` been declared in it
    new_wire = _wire_with(declared, monkeypatch)

    sent = new_wire.Generate("r1", "def ", declared(max_tokens=5, top_a=0.25))
    line = new_wire.encode(sent)  # the gateway's side
    assert b'"top_a":0.25' in line
    got = new_wire.decode_command(line)  # the worker's side
    assert got.sampling.top_a == 0.25 and got.sampling.max_tokens == 5
    assert got == sent
    # checked like every other field, named the same way
    with pytest.raises(new_wire.DecodeError, match=r"^generate\.sampling\.top_a: expected float"):
        new_wire.decode_command(line.replace(b'"top_a":0.25', b'"top_a":"high"'))
    # and the wire as it is today does not know it: the field came from its declaration
    assert not hasattr(wire.decode_command(line).sampling, "top_a")


# -- both ends ------------------------------------------------------------------------


async def test_a_malformed_event_fails_its_request_alone() -> None:
    engine = LlamaCppEngine("t", demo_model_dir() / "q8_0.gguf", WorkerOptions(), RestartPolicy())
    mine: Inbox[object] = Inbox()
    other: Inbox[object] = Inbox()
    engine._streams["r1"] = mine  # type: ignore[assignment]
    engine._streams["r2"] = other  # type: ignore[assignment]
    with pytest.raises(wire.DecodeError) as caught:
        wire.decode_event(b'{"ev":"fin","id":"r1","reason":"stop","pt":"x","ct":1}')
    engine._malformed(caught.value)
    (failure,) = mine.items
    assert isinstance(failure, EngineError)
    assert "finished.prompt_tokens: expected int, got str" in str(failure)
    assert not other.items


@pytest.mark.slow
def test_the_worker_answers_a_malformed_command_and_goes_on() -> None:
    argv = [sys.executable, "-m", "quantroute.engines.llamacpp.worker", "--n-threads", "1"]
    argv += ["--model", str(demo_model_dir() / "q8_0.gguf"), "--parallel", "1"]
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert isinstance(wire.decode_event(proc.stdout.readline()), wire.Ready)
        good = wire.Generate("ok", "def ", SamplingParams(max_tokens=3, temperature=0.0))
        proc.stdin.write(GEN.replace(b'"max_tokens":3', b'"max_tokens":"3"'))
        proc.stdin.write(b"not json at all\n")
        proc.stdin.write(wire.encode(good))
        proc.stdin.flush()
        events: list[wire.Event] = []
        while not events or not isinstance(events[-1], wire.Finished):
            events.append(wire.decode_event(proc.stdout.readline()))
    finally:
        proc.stdin.close()
        assert proc.wait(60) == 0
        proc.stdout.close()
    first, second = events[:2]
    assert first == wire.Error(
        "r9", "bad_command", "generate.sampling.max_tokens: expected int, got str"
    )
    assert isinstance(second, wire.Error) and second.id == "" and second.code == "bad_command"
    assert "not JSON" in second.message
    last = events[-1]
    assert isinstance(last, wire.Finished) and last.id == "ok"
    assert (last.reason, last.completion_tokens) == (FinishReason.LENGTH, 3)
