"""The llama.cpp worker's wire: every message the gateway and its worker exchange.

Both sides import this module and nothing else of each other: the gateway
(:mod:`.engine`, :mod:`.generation`) encodes commands and decodes events, the
worker process (:mod:`.worker`) decodes commands and encodes events. Each message
is a `msgspec <https://jcristharif.com/msgspec/>`_ ``Struct``; a line on the pipe
is one message as a JSON object, tagged by ``op`` (commands) or ``ev`` (events),
with the short keys below. A field is declared once, here, or, for the sampling
parameters, in :class:`~quantroute.engines.base.SamplingParams` itself: a
``gen`` carries that dataclass as it is (``s``), so a new sampling field reaches
the worker, decoded and type-checked, with nothing added here.

Commands (the worker's stdin)::

    {"op": "gen", "id": "r1", "prompt": "...", "s": {SamplingParams}, "special": false}
    {"op": "gen", "id": "r1", "prompt": "", "s": {...}, "prompt_ids": [1, 72, 105]}
    {"op": "gen", ..., "tc": {"traceparent": "00-...", "baggage": "..."}}  (when traced)
    {"op": "gen", ..., "spec": 8}   (draft up to 8 tokens a step, where a draft is loaded)
    {"op": "logits", "id": "r2", "prompt": "...", "tokens": [101, 7], "path": "/dev/shm/..."}
    {"op": "score", "id": "r3", "prompt": "...", "tokens": [101, 7],
     "ref": {"path": "/dev/shm/...", "shape": [2, 354]}}
    {"op": "cancel", "id": "r1"}
    {"op": "pause", "id": "r1"}      {"op": "resume", "id": "r1"}   (a slow reader)
    {"op": "shutdown"}

Events (the worker's original stdout)::

    {"ev": "ready", "info": {EngineInfo}, "draft": "q4_k_m.gguf"}   (draft: when one is loaded)
    {"ev": "start", "id": "r1", "pt": 12, "c": 8, "d": true}   (a slot; c: reused; d: drafted)
    {"ev": "toks", "b": [["r1", "def", 101], ["r2", " x", 7]]}   (one step's plain tokens)
    {"ev": "tok", "id": "r1", "t": "def", "tok": 101, "lp": -0.3, "p": "def", "top": [[7, "x", -2]]}
    {"ev": "fin", "id": "r1", "reason": "stop", "pt": 12, "ct": 40, "t": "", "tm": [ns, ns, ns]}
    {"ev": "fin", ..., "dr": 30, "ac": 24, "k": 3.75, "sp": 1.2}   (a speculated gen: see Finished)
    {"ev": "logits", "id": "r2", "path": "...", "shape": [2, 354]}
    {"ev": "scores", "id": "r3", "kld": [0.0012, null], "top1": [true, false]}
    {"ev": "err", "id": "r1", "code": "context_length_exceeded", "msg": "...", "pt": 9, ...}

A field at its default is left out (``omit_defaults``), and a field the reader does
not know is ignored, so either side may add an optional field first. JSON has no
infinity: a ``kld`` of ``null`` is an infinite divergence (the branch gave no mass to
a token the reference did), and any other float that is not finite (a NaN, an
infinite temperature) encodes as ``null`` and fails its message's decoding.

A message that does not decode is a :class:`DecodeError` naming the message and the
field (``generate.sampling.max_tokens: expected int, got str``) and, when it could be
read, the message's ``id``: the worker answers a malformed command with an ``err``
event for that id (code ``bad_command``) and goes on; the gateway fails the request
a malformed event was for.

``benchmarks/bench_wire.py`` measures this codec against the hand-written JSON dicts it
replaced (docs/engines.md, "The worker wire").
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Final

import msgspec
import numpy as np

from quantroute.engines.base import (
    EngineInfo,
    FinishEvent,
    FinishReason,
    ReferenceLogits,
    SamplingParams,
    StartEvent,
    TokenEvent,
    TokenScores,
)

MAX_SPEC = 64
"""The most draft tokens a ``gen`` may ask for per step (``Generate.spec``)."""

__all__ = [
    "MAX_SPEC",
    "Cancel",
    "Command",
    "DecodeError",
    "Error",
    "Event",
    "Finished",
    "Generate",
    "Logits",
    "Message",
    "Pause",
    "Ready",
    "Reference",
    "Resume",
    "Score",
    "Scores",
    "Shutdown",
    "Started",
    "Token",
    "Tokens",
    "WriteLogits",
    "decode_command",
    "decode_event",
    "encode",
]


# -- commands: gateway → worker ---------------------------------------------------


class _Command(msgspec.Struct, frozen=True, gc=False, omit_defaults=True, tag_field="op"):
    pass


class Generate(_Command, tag="gen", frozen=True):
    """Generate from ``prompt`` (tokenized by the worker, BOS added) or from
    ``prompt_ids`` (taken as they are; ``prompt`` is then only their text)."""

    id: str
    prompt: str
    sampling: SamplingParams = msgspec.field(name="s")
    special: bool = False  # parse special-token text (a chat template's prompt)
    prompt_ids: tuple[int, ...] | None = None
    # the W3C trace context of the request's generation span: its "fin" then has "tm"
    trace: dict[str, str] | None = msgspec.field(default=None, name="tc")
    # speculative decoding: draft up to this many tokens a step with the worker's draft
    # model (0: plain; ignored by a worker without one, or for a sequence it cannot draft)
    spec: Annotated[int, msgspec.Meta(ge=0, le=MAX_SPEC)] = 0


class WriteLogits(_Command, tag="logits", frozen=True):
    """Teacher-force ``prompt + tokens``; write the float32 rows that predicted each of
    ``tokens`` to a new file at ``path``; answered by :class:`Logits`. With ``text``
    (and no ``tokens``), the tokens are ``text``'s, tokenized here without BOS or
    special tokens, the first ``limit`` of them: a remote branch's answer, whose
    token ids the gateway does not know."""

    id: str
    prompt: str
    tokens: list[int]
    path: str
    special: bool = False
    text: str | None = None
    limit: int = 0


class Reference(msgspec.Struct, frozen=True, gc=False):
    """A reference's logits file: ``shape`` is ``[T, V]`` float32 rows."""

    path: str
    shape: tuple[int, int]


class Score(_Command, tag="score", frozen=True):
    """Teacher-force ``prompt + tokens``; compare each row with ``reference``'s;
    answered by :class:`Scores`."""

    id: str
    prompt: str
    tokens: list[int]
    reference: Reference = msgspec.field(name="ref")
    special: bool = False


class Cancel(_Command, tag="cancel", frozen=True):
    id: str


class Pause(_Command, tag="pause", frozen=True):
    """The gateway's buffer for ``id`` is full: keep its slot, decode nothing for it."""

    id: str


class Resume(_Command, tag="resume", frozen=True):
    id: str


class Shutdown(_Command, tag="shutdown", frozen=True):
    pass


Command = Generate | WriteLogits | Score | Cancel | Pause | Resume | Shutdown


# -- events: worker → gateway -----------------------------------------------------


class _Event(msgspec.Struct, frozen=True, gc=False, omit_defaults=True, tag_field="ev"):
    pass


class Ready(_Event, tag="ready", frozen=True):
    """The model is loaded: the worker's first line (unless it could not load it: then
    an :class:`Error` with no id saying why, and it exits 1). ``draft``: the file name of
    the draft model it speculates with (``None``: none loaded, or one refused)."""

    info: EngineInfo
    draft: str | None = None


class Started(_Event, tag="start", frozen=True):
    """``id`` has a slot: its prompt's tokens, of which ``cached_tokens`` were reused;
    ``drafted``: the worker speculates for it (its draft proposes, the model verifies)."""

    id: str
    prompt_tokens: int = msgspec.field(name="pt")
    cached_tokens: int = msgspec.field(default=0, name="c")
    drafted: bool = msgspec.field(default=False, name="d")

    def event(self) -> StartEvent:
        return StartEvent(self.prompt_tokens, self.cached_tokens, self.drafted)


class Tokens(_Event, tag="toks", frozen=True):
    """One decode step's plain tokens (no logprobs), every sequence's, in batch order:
    ``(id, text, token)``; ``text`` is what the token adds to the output after stop-
    sequence hold-back, and may be empty."""

    batch: list[tuple[str, str, int]] = msgspec.field(name="b")


class Token(_Event, tag="tok", frozen=True):
    """A token with logprobs: ``piece`` is its own text, ``top`` the most likely ones."""

    id: str
    text: str = msgspec.field(name="t")
    token: int = msgspec.field(name="tok")
    logprob: float | None = msgspec.field(default=None, name="lp")
    piece: str | None = msgspec.field(default=None, name="p")
    top: tuple[tuple[int, str, float], ...] = ()

    def event(self) -> TokenEvent:
        return TokenEvent(self.text, self.token, self.logprob, self.piece, self.top)


class Finished(_Event, tag="fin", frozen=True):
    """``id`` ended; ``text`` is held-back text released at the end. ``stamps`` (a traced
    ``gen``): wall-clock ns when it was admitted, got a slot and finished. A speculated
    ``gen``: ``drafted`` tokens the draft proposed, ``accepted`` of them the model kept,
    ``mean_k`` drafts per step that drafted (all 0: it was decoded plainly), and
    ``speedup``: the worker's measured decode rate drafting over its plain rate now
    (``AdaptiveK.speedup``; 0: not measured, as under ``--spec-mode always``)."""

    id: str
    reason: FinishReason
    prompt_tokens: int = msgspec.field(name="pt")
    completion_tokens: int = msgspec.field(name="ct")
    text: str = msgspec.field(default="", name="t")
    stamps: tuple[int, ...] = msgspec.field(default=(), name="tm")
    drafted: int = msgspec.field(default=0, name="dr")
    accepted: int = msgspec.field(default=0, name="ac")
    mean_k: float = msgspec.field(default=0.0, name="k")
    speedup: float = msgspec.field(default=0.0, name="sp")

    def event(self, *, held: bool = False) -> FinishEvent:
        return FinishEvent(
            self.reason,
            self.prompt_tokens,
            self.completion_tokens,
            self.text,
            self.stamps,
            held,
            self.drafted,
            self.accepted,
            self.mean_k,
            self.speedup,
        )


class Logits(_Event, tag="logits", frozen=True):
    """A :class:`WriteLogits` is done: ``shape`` rows of float32 in the file at ``path``;
    for one given ``text``, taken on ``ids`` (the prompt's tokens, then the scored ones)."""

    id: str
    path: str
    shape: tuple[int, int]
    ids: tuple[int, ...] = ()

    def reference(self) -> ReferenceLogits:
        return ReferenceLogits(Path(self.path), *self.shape, ids=self.ids)


class Scores(_Event, tag="scores", frozen=True):
    """A :class:`Score` is done: per token, ``KL(ref ‖ this)`` in nats (``None``:
    infinite) and whether both put their maximum on the same token."""

    id: str
    kld: list[float | None]
    top1: list[bool]

    def scores(self) -> TokenScores:
        # [T]; None on the wire is an infinite divergence (JSON has no infinity)
        kld = np.array([math.inf if k is None else k for k in self.kld], dtype=np.float64)
        return TokenScores(kld, np.asarray(self.top1, dtype=np.bool_))


class Error(_Event, tag="err", frozen=True):
    """``id`` failed; nothing more comes for it. ``code`` says how (``engine_error``,
    ``context_length_exceeded`` with the counts, ``device_out_of_memory``,
    ``invalid_grammar``, ``grammar_too_long``, ``event_too_large``, ``bad_command``)."""

    id: str
    code: str
    message: str = msgspec.field(default="", name="msg")
    prompt_tokens: int | None = msgspec.field(default=None, name="pt")
    max_tokens: int | None = None
    n_ctx: int | None = None
    at_least: bool = False  # prompt_tokens is a lower bound (the prompt was not tokenized)


Event = Ready | Started | Tokens | Token | Finished | Logits | Scores | Error
Message = Command | Event


# -- the codec ----------------------------------------------------------------------

_encoder: Final = msgspec.json.Encoder()
_commands: Final = msgspec.json.Decoder(Command)
_events: Final = msgspec.json.Decoder(Event)


def encode(message: Message) -> bytes:
    """One message as one line (its newline included)."""
    return _encoder.encode(message) + b"\n"


def decode_command(line: bytes) -> Command:
    """The command on one line; raises :class:`DecodeError`, naming the field."""
    try:
        return _commands.decode(line)
    except msgspec.DecodeError as exc:
        raise _decode_error("command", "op", line, exc) from None


def decode_event(line: bytes) -> Event:
    """The event on one line; raises :class:`DecodeError`, naming the field."""
    try:
        return _events.decode(line)
    except msgspec.DecodeError as exc:
        raise _decode_error("event", "ev", line, exc) from None


class DecodeError(ValueError):
    """A line that is not a message: ``where`` names the message and field
    (``generate.sampling.max_tokens``; just ``command`` or ``event`` when even its kind
    is unknown), ``id`` is the message's id when it could be read (else ``None``)."""

    def __init__(self, where: str, what: str, rid: str | None):
        super().__init__(f"{where}: {what}")
        self.where = where
        self.what = what
        self.id = rid


# -- decode errors in words (the error path only: nothing here runs per message) --


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _by_tag(union: Any) -> dict[str, type[msgspec.Struct]]:
    members: tuple[type[msgspec.Struct], ...] = union.__args__
    return {str(m.__struct_config__.tag): m for m in members}


_KINDS: Final = {"command": _by_tag(Command), "event": _by_tag(Event)}
_AT = re.compile(r"^(?P<what>.*?)(?: - at `(?P<path>[^`]*)`)?$", re.S)
_STEP = re.compile(r"\.(?P<key>[^.\[]+)|\[(?P<index>\d+|\.\.\.)\]")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")


def _decode_error(kind: str, tag_field: str, line: bytes, exc: msgspec.DecodeError) -> DecodeError:
    try:
        raw = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return DecodeError(kind, f"not JSON ({exc})", None)
    if not isinstance(raw, dict):
        return DecodeError(kind, f"expected an object, got {type(raw).__name__}", None)
    rid = raw.get("id") if isinstance(raw.get("id"), str) else None
    tag = raw.get(tag_field)
    cls = _KINDS[kind].get(tag) if isinstance(tag, str) else None
    if cls is None:
        what = f"no {tag_field!r}" if tag is None else f"unknown {kind} {tag!r}"
        return DecodeError(kind, what, rid)
    match = _AT.match(str(exc))
    assert match is not None  # the pattern matches any text
    what, path = match["what"], match["path"] or "$"
    steps = [m["key"] or f"[{m['index']}]" for m in _STEP.finditer(path[1:])]
    missing = _MISSING.match(what)
    if missing:
        steps.append(missing["field"])
        what = "missing"
    else:
        what = what[:1].lower() + what[1:].replace("`", "")
    return DecodeError(".".join([_snake(cls.__name__), *_names(cls, steps)]), what, rid)


def _names(cls: Any, steps: list[str]) -> list[str]:
    """The path's wire keys as the fields' own names, as far as the types say them."""
    names: list[str] = []
    current: Any = cls
    for step in steps:
        if step.startswith("["):
            names[-1:] = [f"{names[-1] if names else ''}{step}"]
            current = None
            continue
        name, current = _field(current, step)
        names.append(name)
    return names


def _field(owner: Any, key: str) -> tuple[str, Any]:
    """A Struct's field by its wire key (its name and type); a dataclass's keys are its
    fields' names."""
    if isinstance(owner, type) and issubclass(owner, msgspec.Struct):
        for f in msgspec.structs.fields(owner):
            if f.encode_name == key:
                return f.name, f.type
    return key, None
