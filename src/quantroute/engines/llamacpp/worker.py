"""The llama.cpp worker process: one branch, several sequences decoded together.

Run by the supervisor as ``python -m quantroute.engines.llamacpp.worker``.
It speaks newline-delimited JSON: commands on stdin, events on the original
stdout (file descriptor 1 is then pointed at stderr, so nothing llama.cpp
prints can corrupt the protocol).

Commands::

    {"op": "gen", "id": "r1", "prompt": "...", "special": false, "s": {sampling}}
    {"op": "gen", "id": "r1", "prompt_ids": [1, 72, 105], "s": {sampling}}  (ids as they are)
    {"op": "gen", "id": "r1", "prompt": "...", "special": false, "s": {sampling},
     "tc": {"traceparent": "00-...", "baggage": "..."}}   ("tc" only when traced)
    {"op": "logits", "id": "r2", "prompt": "...", "special": false, "tokens": [101, 7],
     "path": "/dev/shm/quantroute-logits.<pid>.<hex>.f32"}
    {"op": "score", "id": "r3", "prompt": "...", "special": false, "tokens": [101, 7],
     "ref": {"path": "/dev/shm/quantroute-logits.<pid>.<hex>.f32", "shape": [2, 354]}}
    {"op": "cancel", "id": "r1"}
    {"op": "pause", "id": "r1"}      {"op": "resume", "id": "r1"}   (a slow reader's backpressure)
    {"op": "shutdown"}

Events::

    {"ev": "ready", "info": {...EngineInfo...}}
    {"ev": "start", "id": "r1", "pt": 12, "c": 8}   (when it gets a slot; c: reused tokens)
    {"ev": "toks", "b": ["r1", "def", 101, "r2", " x", 7]}   (one step's plain tokens)
    {"ev": "tok", "id": "r1", "t": "def", "tok": 101, "lp": -0.3, "p": "def", "top": [[7, "x", -2]]}
    {"ev": "fin", "id": "r1", "reason": "stop", "pt": 12, "ct": 40, "t": "", "tm": [ns, ns, ns]}
    {"ev": "logits", "id": "r2", "path": "...", "shape": [2, 354]}
    {"ev": "scores", "id": "r3", "kld": [0.0012, 0.0], "top1": [true, true]}
    {"ev": "err", "id": "r1", "code": "context_length_exceeded", "msg": "...", ...}

A step's tokens go out together: one ``toks`` line per decode step carries every
sequence's new token as a flat run of ``id, text, token`` triples (``text`` is what
the token adds to the output after stop-sequence hold-back; it may be empty), in
batch order; a token with logprobs has its own ``tok`` line (``lp``, ``p``: the
token's own text, ``top``). A sequence's events keep their order: its tokens of a
step precede its ``fin``, and any other event of the step (a ``tok``, ``start``,
``fin``) first ends the ``toks`` line gathered so far, so a step may write several.
The lines of a step are written with one ``write``.

Sampling (``engines/llamacpp/sampler_chain.py``): each ``gen`` gets its own llama.cpp sampler
chain when admitted (logit bias and ``ignore_eos``, the penalties, the ``min_tokens``
ban, then greedy or temperature / top-k / top-p / min-p and a draw seeded by
``seed``), freed when the sequence ends however it ends; ``llama_sampler_sample``
reads the row of logits inside llama.cpp, so a plain request copies nothing
vocabulary-sized into Python. Three cases read the row in numpy
(``engines/sampling.py``): a greedy request with no penalties and no logprobs (its
biases and ``min_tokens`` ban are added to llama.cpp's row where it lies, and numpy's
argmax picks the token: 18 µs at a 32k vocabulary, where the chain's greedy sampler
takes 80), a request with logprobs (the chain picks the token; the
row, biased and penalized the same way, gives the log-probabilities) and one with a
grammar (``engines/llamacpp/constrained.py``: the closing path needs the masked row).
``--sampler numpy`` samples every request in numpy, as before the chain: a reference
for tests (greedy text is the same; seeded text is not, the generators differ).

``logits`` teacher-forces ``prompt + tokens`` and writes the raw float32
logits that predicted each of ``tokens`` (``[T, V]``, row-major, no header) to
a new file at ``path`` (created exclusively; removed again if the job fails or
is cancelled). ``score`` teacher-forces the same and compares each row with
the reference's, read from its file a row at a time: per-token
``KL(ref ‖ this)`` and top-1 agreement (``quantroute.divergence``, in
float64), so only ``T``-long arrays go back. Vocabulary-sized rows never
cross the pipe, and at most ``max(16, 2**22 // V)`` rows are scored per
decode step, so a replay neither holds a ``[T, V]`` array nor stalls the
other sequences for long.

No event line is longer than ``--max-event-bytes`` (1 MiB): one that would be
is replaced by an ``err`` (``code`` ``event_too_large``) for its id, and that
request is dropped; everyone else's go on.

A ``gen`` whose sampling has a ``grammar`` (GBNF text) samples only what the
grammar allows and always ends with output it accepts (``engines/llamacpp/constrained.py``);
an ungrammatical grammar is an ``err`` with ``code`` ``invalid_grammar``, one whose
shortest output is longer than ``max_tokens`` ``grammar_too_long``.

Scheduling is continuous batching: every step puts the next token of every
decoding sequence and a slice of any waiting prompt into one ``llama_decode``.

Prompts are tokenized off the decode loop (``engines/llamacpp/tokenizer.py``): the reader
thread hands each command's text prompt to a tokenizer thread as it arrives (long
ones to a second, so they do not hold the short ones), and the loop admits the
command once its tokens are ready, stepping the other sequences meanwhile (a long
prompt, or one of llama.cpp's quadratic inputs, used to hold every sequence). A
``gen`` whose bytes alone say it cannot fit the context is refused without
tokenizing it.

Prompt caching (``engines/llamacpp/prompt_cache.py``; off with ``--no-prompt-cache``): a
finished generation leaves its KV cells in its slot; a new ``gen`` takes the free
slot whose cells share the longest prefix with its prompt (else the least recently
used one), drops the cells past that prefix and prefills only the rest, always
feeding the last prompt token again. ``start`` (sent once the sequence has a slot)
says how many prompt tokens were reused (``c``). Scoring jobs reuse nothing and
leave nothing; a sequence that fails leaves its slot empty.

A traced ``gen`` (with ``tc``, the W3C trace context of its generation span)
gets ``tm`` on its ``fin``: wall-clock nanoseconds when it was admitted, got a
slot and finished; the gateway turns them into the request's decode span.

``--fault`` is a test hook, off by default: ``sigill-at-first-decode`` dies of
SIGILL right before the first ``llama_decode`` of a generation (as a build
using instructions the CPU lacks does); ``exit-at-load`` exits with status 3
before loading the model; ``oom-at-decode`` fails every decode of a request (not the warm-up's) as
llama.cpp does when memory runs out, returning 1; ``oversize-line`` answers
its first scoring command
(``logits`` or ``score``) with one line longer than the gateway's 16 MiB
limit first, as vocabulary-sized rows once did; ``hang-up-at-decode`` closes its
output at a request's first decode (not the warm-up's) and then never exits, as a
worker wedged in a dying runtime can; ``hang-at-decode`` stops at a request's first
decode (not the warm-up's) for ever, its output open, as a worker spinning in a
runaway grammar did.

``--oom-flag PATH`` (set for a branch on a simulated device): while the file
exists, the device is out of memory, and each new client sequence fails its
KV allocation with ``device_out_of_memory`` before its first token, so the
gateway falls back; sequences already decoding go on.
"""

from __future__ import annotations

import argparse
import codecs
import ctypes
import json
import logging
import os
import queue
import resource
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any

import llama_cpp as lc
import numpy as np

from quantroute.engines.llamacpp.constrained import ClosingOrder, Grammar, GrammarError
from quantroute.engines.llamacpp.prompt_cache import PromptCache
from quantroute.engines.llamacpp.sampler_chain import SamplerChain
from quantroute.engines.llamacpp.scoring import Comparison, LogitsDump, ScoringJob
from quantroute.engines.llamacpp.tokenizer import Pending, PromptTokenizer
from quantroute.engines.sampling import (
    GREEDY_BELOW,
    Penalties,
    choice_of,
    greedy_in_place,
    penalize,
    sample,
)
from quantroute.engines.stops import StopMatcher
from quantroute.types import WORKER_FAULTS

log = logging.getLogger("quantroute.worker")

MAX_EVENT_BYTES = 1 << 20
"""Default longest event line (``--max-event-bytes``); the gateway reads lines of up to
16 MiB (``engines/supervisor.py``), so a refused event never reaches that limit."""
OVERSIZE_LINE_BYTES = (1 << 24) + 1  # the ``oversize-line`` fault: past the gateway's limit
_SCORE_BLOCK_ELEMENTS = 1 << 22  # scored logits per decode step, at most (16 MiB of float32)
_TOKENIZED = {"op": "tokenized"}  # the tokenizer thread's wake-up: a held prompt is ready
_ADMITTED = ("gen", "logits", "score")  # the commands that bring a prompt


@dataclass(slots=True)
class Sequence:
    rid: str
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    logprobs: bool
    n_top: int
    rng: np.random.Generator
    stops: StopMatcher
    bias_ids: np.ndarray[Any, Any] | None = None
    bias_values: np.ndarray[Any, Any] | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    min_tokens: int = 0  # end-of-generation is banned before this many tokens
    penalties: Penalties = field(default_factory=Penalties)
    counts: np.ndarray[Any, Any] | None = None  # [V] generated tokens, with penalties
    seen: np.ndarray[Any, Any] | None = None  # [V] prompt or generated, with penalties
    grammar: Grammar | None = None  # response_format / a forced tool call
    chain: SamplerChain | None = None  # llama.cpp's sampling, for every gen but a grammar's
    argmax: bool = False  # greedy, biases at most: the argmax of llama.cpp's row, in place
    deadline: float | None = None  # time.monotonic(); past it the sequence finishes "deadline"
    paused: bool = False  # its reader is slow: keep the slot, decode nothing until resumed
    first_scored: int = -1  # >= 0: a scoring job; its rows from this position on go to `job`
    job: ScoringJob | None = None
    slot: int = -1
    fed: int = 0  # prompt tokens already in the KV cache
    reused: int = 0  # of which came from the slot's prompt cache (not prefilled)
    n_past: int = 0
    generated: int = 0
    out: list[int] = field(default_factory=list)  # the sampled tokens
    next_token: int | None = None  # sampled, not yet fed
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    # a traced request (its gen command carried "tc"): wall-clock ns when admitted, given a
    # slot, finished; sent back on "fin" as "tm" for the gateway's decode span
    stamps: list[int] | None = None

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)


class Worker:
    def __init__(self, args: argparse.Namespace, out: IO[bytes]):
        self._out = out
        self._pending_out: list[bytes] = []
        self._tokens: list[str | int] = []  # this step's plain tokens: id, text, token, ...
        self._max_event_bytes = args.max_event_bytes
        self._refused: set[str] = set()  # ids whose event was too long: dropped at step end
        self._fault = args.fault
        self.sampler = args.sampler  # "chain" (llama.cpp's); "numpy", a reference for tests
        self._oom_flag = args.oom_flag  # a simulated device's: allocations fail while it exists
        lc.llama_backend_init()
        if args.log_level != "debug":
            lc.llama_log_set(_ERRORS_ONLY_LOG, ctypes.c_void_p(0))
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = args.n_gpu_layers
        self.model = lc.llama_model_load_from_file(args.model.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {args.model}")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = lc.llama_model_n_ctx_train(self.model)
        self.eog_tokens = [t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self.vocab, t)]
        self.eog_set = frozenset(self.eog_tokens)
        self.n_ctx = args.n_ctx or self.n_ctx_train
        self.parallel = args.parallel
        self.n_batch = args.n_batch
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = self.n_ctx * self.parallel
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = self.parallel
        cparams.kv_unified = False  # each sequence owns n_ctx cells
        threads = args.n_threads or os.cpu_count() or 1
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.mem = lc.llama_get_memory(self.ctx)
        # Scored rows per step, at most: bounds llama.cpp's logits buffer and the time
        # one step spends comparing rows while other sequences wait for their tokens.
        self.score_rows_per_step = max(16, _SCORE_BLOCK_ELEMENTS // self.n_vocab)
        self.batch = lc.llama_batch_init(self.n_batch, 0, 1)
        self._piece_buf = ctypes.create_string_buffer(256)
        # The longest token's text: a prompt of B bytes has at least B / this many tokens,
        # so one that cannot fit the context is refused without tokenizing it (llama.cpp's
        # tokenizer is quadratic in some long runs: 100 s for a megabyte of one character).
        self.max_piece_bytes = max(
            1, max((len(self.piece_bytes(t, True)) for t in range(self.n_vocab)), default=1)
        )
        self.slots = PromptCache(self.parallel, enabled=args.prompt_cache)  # the free ones
        self.active: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.commands: queue.Queue[dict[str, Any] | None] = queue.Queue()
        # Prompts are tokenized on a thread of their own (engines/llamacpp/tokenizer.py); a command
        # is held here, in arrival order, until its prompt's tokens are ready.
        self._prompts = PromptTokenizer(self.tokenize, lambda: self.commands.put(_TOKENIZED))
        self.held: deque[dict[str, Any]] = deque()
        self.running = True
        self._closing_order: ClosingOrder | None = None  # made with the first grammar
        self.chains_open = 0  # sampler chains built and not yet freed (a test reads it)

    # -- protocol -------------------------------------------------------------

    def emit_token(self, rid: str, text: str, token: int) -> None:
        """Queue a plain token (no logprobs): this step's go out together, one ``toks``."""
        if rid not in self._refused:
            self._tokens += (rid, text, token)

    def _emit_tokens(self) -> None:
        tokens, self._tokens = self._tokens, []
        line = json.dumps({"ev": "toks", "b": tokens}, separators=(",", ":")).encode() + b"\n"
        if len(line) <= self._max_event_bytes:
            self._pending_out.append(line)
            return
        for i in range(0, len(tokens), 3):  # too long together: one line each, each checked
            self.emit({"ev": "tok", "id": tokens[i], "t": tokens[i + 1], "tok": tokens[i + 2]})

    def emit(self, event: dict[str, Any]) -> None:
        """Queue one event line; one over the line limit becomes an ``err`` for its id."""
        if self._tokens:  # they came first
            self._emit_tokens()
        rid = event.get("id")
        if rid in self._refused:
            return
        line = json.dumps(event, separators=(",", ":")).encode() + b"\n"
        if len(line) > self._max_event_bytes:
            log.error(
                "worker: a %r event of %d bytes is over the %d-byte line limit; its request fails",
                event.get("ev"),
                len(line),
                self._max_event_bytes,
            )
            refusal = {
                "ev": "err",
                "id": rid or "",
                "code": "event_too_large",
                "msg": f"the worker's {event.get('ev')!r} event ({len(line)} bytes) is over its "
                f"{self._max_event_bytes}-byte line limit",
            }
            line = json.dumps(refusal, separators=(",", ":")).encode() + b"\n"
            if rid:
                self._refused.add(rid)
        self._pending_out.append(line)

    def drop_refused(self) -> None:
        """Forget the requests whose event was refused (their ``err`` went out instead)."""
        for rid in self._refused:
            seq = self.active.get(rid)
            if seq is not None:
                self.release(seq)
            for waiting in [w for w in self.waiting if w.rid == rid]:
                self.waiting.remove(waiting)
                self.close_job(waiting)
        self._refused.clear()

    def flush(self) -> None:
        if self._tokens:
            self._emit_tokens()
        if self._pending_out:
            self._out.write(b"".join(self._pending_out))
            self._out.flush()
            self._pending_out.clear()

    def info(self) -> dict[str, Any]:
        template = lc.llama_model_chat_template(self.model, None)
        return {
            "n_ctx": self.n_ctx,
            "n_ctx_train": self.n_ctx_train,
            "n_vocab": self.n_vocab,
            "parallel": self.parallel,
            "chat_template": template.decode("utf-8", "replace") if template else None,
            "bos_token": self.piece(lc.llama_vocab_bos(self.vocab), special=True),
            "eos_token": self.piece(lc.llama_vocab_eos(self.vocab), special=True),
            "model_bytes": int(lc.llama_model_size(self.model)),
            "pid": os.getpid(),
        }

    def read_commands(self, stream: IO[bytes]) -> None:
        for line in stream:
            try:
                cmd = json.loads(line)
            except json.JSONDecodeError:
                log.error("worker: unreadable command dropped")
                continue
            self._start_tokenizing(cmd)
            self.commands.put(cmd)
        self.commands.put(None)  # the gateway closed our stdin: shut down

    def _start_tokenizing(self, cmd: Any) -> None:
        """On the reader thread: hand a command's text prompt to the tokenizer thread, its
        ``Pending`` riding along as ``cmd["_pending"]``; not a ``gen`` whose size alone
        refuses it (``admit`` says so, untokenized)."""
        if not isinstance(cmd, dict):
            return
        cmd.pop("_pending", None)  # ours alone
        text = cmd.get("prompt")
        if cmd.get("op") not in _ADMITTED or not isinstance(text, str):
            return
        if cmd.get("op") == "gen" and (
            cmd.get("prompt_ids") is not None or self.fewest_tokens(text) >= self.n_ctx
        ):
            return
        cmd["_pending"] = self._prompts.submit(text, bool(cmd.get("special")))

    def fewest_tokens(self, text: str) -> int:
        """The fewest tokens ``text`` can be: its bytes over the longest token's."""
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_piece_bytes)

    def prompt_tokens(self, cmd: dict[str, Any], text: str) -> list[int]:
        """A command's prompt tokens: the tokenizer thread's, else tokenized here."""
        pending = cmd.get("_pending")
        if isinstance(pending, Pending):
            return pending.result()
        return self.tokenize(text, bool(cmd.get("special")))

    # -- vocabulary -----------------------------------------------------------

    def tokenize(self, text: str, special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, True, special)
        if n < 0:
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, True, special)
        return list(buf[:n])

    def piece_bytes(self, token: int, special: bool = False) -> bytes:
        n = lc.llama_token_to_piece(self.vocab, token, self._piece_buf, 256, 0, special)
        return self._piece_buf.raw[: max(n, 0)]

    def piece(self, token: int, special: bool = False) -> str:
        return self.piece_bytes(token, special).decode("utf-8", "replace")

    # -- commands -------------------------------------------------------------

    def handle(self, cmd: dict[str, Any] | None) -> None:
        if cmd is None or (isinstance(cmd, dict) and cmd.get("op") == "shutdown"):
            self.running = False
            return
        if not isinstance(cmd, dict):
            log.error("worker: a command that is not an object dropped")
            return
        op = cmd.get("op")
        if op in ("logits", "score") and self._fault == "oversize-line":
            self._fault = ""  # once: the gateway kills this worker over it
            self._out.write(b'{"ev":"pad","data":"' + b"A" * OVERSIZE_LINE_BYTES + b'"}\n')
            self._out.flush()
        if op in _ADMITTED:
            self.held.append(cmd)
            self.admit_held()
        elif op == "tokenized":
            self.admit_held()
        elif op == "cancel":
            self.cancel(str(cmd.get("id", "")))
        elif op in ("pause", "resume"):  # the gateway's buffer for it is full / drained
            seq = self.active.get(str(cmd.get("id", "")))
            if seq is not None:
                seq.paused = op == "pause"

    def admit_held(self) -> None:
        """Admit the held commands whose prompts are tokenized (or that have none to
        tokenize), in the order they came; those still tokenizing stay held."""
        held, self.held = self.held, deque()
        for cmd in held:
            pending = cmd.get("_pending")
            if isinstance(pending, Pending) and not pending.done:
                self.held.append(cmd)
                continue
            try:
                (self.admit if cmd["op"] == "gen" else self.admit_score)(cmd)
            except (KeyError, TypeError, ValueError) as exc:  # a malformed command fails alone
                self.emit(
                    {
                        "ev": "err",
                        "id": cmd.get("id", ""),
                        "code": "engine_error",
                        "msg": f"bad command: {type(exc).__name__}",
                    }
                )

    def admit(self, cmd: dict[str, Any]) -> None:
        rid, s = cmd["id"], cmd["s"]
        if cmd.get("prompt_ids") is not None:  # token ids, used as they are (no BOS added)
            prompt = [int(t) for t in cmd["prompt_ids"]]
            if not prompt or any(not 0 <= t < self.n_vocab for t in prompt):
                raise ValueError("a prompt token id is outside the vocabulary")
        else:
            text = cmd["prompt"]
            fewest = self.fewest_tokens(text)
            least = 1 if s.get("fit_context") else int(s["max_tokens"])
            if fewest + least > self.n_ctx:  # it cannot fit, whatever it tokenizes to
                self.emit(
                    {
                        "ev": "err",
                        "id": rid,
                        "code": "context_length_exceeded",
                        "pt": fewest,
                        "at_least": True,
                        "max_tokens": least,
                        "n_ctx": self.n_ctx,
                    }
                )
                return
            prompt = self.prompt_tokens(cmd, text)
        max_tokens = int(s["max_tokens"])
        if s.get("fit_context"):
            max_tokens = max(1, min(max_tokens, self.n_ctx - len(prompt)))
        if len(prompt) + max_tokens > self.n_ctx:
            self.emit(
                {
                    "ev": "err",
                    "id": rid,
                    "code": "context_length_exceeded",
                    "pt": len(prompt),
                    "max_tokens": max_tokens,
                    "n_ctx": self.n_ctx,
                }
            )
            return
        seq = Sequence(
            rid=rid,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=float(s["temperature"]),
            top_p=float(s["top_p"]),
            top_k=int(s["top_k"]),
            logprobs=bool(s["logprobs"]),
            n_top=int(s["top_logprobs"]),
            rng=np.random.default_rng(None if s.get("seed") is None else int(s["seed"]) % 2**64),
            stops=StopMatcher(tuple(s["stop"])),
            ignore_eos=bool(s.get("ignore_eos")),
            min_p=float(s.get("min_p", 0.0)),
            min_tokens=int(s.get("min_tokens", 0)),
            penalties=Penalties(
                float(s.get("presence_penalty", 0.0)),
                float(s.get("frequency_penalty", 0.0)),
                float(s.get("repetition_penalty", 1.0)),
            ),
            deadline=None if s.get("deadline") is None else float(s["deadline"]),
            stamps=[time.time_ns()] if cmd.get("tc") else None,
        )
        bias = {int(t): float(b) for t, b in s.get("logit_bias", ())}  # a repeat: the last
        if any(not 0 <= t < self.n_vocab for t in bias):
            raise ValueError("a logit_bias token id is outside the vocabulary")
        if seq.ignore_eos:
            bias |= dict.fromkeys(self.eog_tokens, -np.inf)
        grammar = s.get("grammar")
        # The numpy row (a grammar's sampling; logprobs, which need the row) is built only
        # for the requests that need it; everyone else samples in llama.cpp's chain.
        chained = not grammar and self.sampler == "chain"
        wants_row = not chained or seq.logprobs or seq.n_top > 0
        # Greedy with nothing but biases needs no chain: llama.cpp's greedy sampler first
        # copies the row into a V-long candidate array (80 µs at 32k tokens, measured),
        # numpy's argmax over the row where it lies takes 18. Same token: the first best.
        seq.argmax = chained and not wants_row and not seq.penalties.active
        seq.argmax = seq.argmax and not seq.temperature >= GREEDY_BELOW
        if bias and (wants_row or seq.argmax):
            seq.bias_ids = np.array(list(bias), dtype=np.int64)
            seq.bias_values = np.array(list(bias.values()), dtype=np.float32)
        if seq.penalties.active and wants_row:
            seq.counts = np.zeros(self.n_vocab, dtype=np.int32)
            seq.seen = np.zeros(self.n_vocab, dtype=np.bool_)
            seq.seen[prompt] = True
        if grammar:
            if not self.admit_grammar(seq, str(grammar)):
                return
        elif chained and not seq.argmax:
            seq.chain = SamplerChain(
                n_vocab=self.n_vocab,
                temperature=seq.temperature,
                top_p=seq.top_p,
                top_k=seq.top_k,
                min_p=seq.min_p,
                seed=None if s.get("seed") is None else int(s["seed"]),
                bias=bias,
                penalties=seq.penalties,
                prompt=prompt,
                window=self.n_ctx,
                ban=self.eog_tokens if seq.min_tokens > 0 and not seq.ignore_eos else (),
            )
            self.chains_open += 1
        self.waiting.append(seq)  # its "start" goes out when it gets a slot

    def admit_grammar(self, seq: Sequence, gbnf: str) -> bool:
        """Give ``seq`` its grammar; refuse it (an ``err``) when the grammar does not parse
        or its shortest output does not fit in ``max_tokens``."""
        if self._closing_order is None:
            pieces = [self.piece_bytes(t) for t in range(self.n_vocab)]
            self._closing_order = ClosingOrder(pieces, self.eog_tokens)
        try:
            seq.grammar = Grammar(self.vocab, self.n_vocab, gbnf, self._closing_order)
        except GrammarError as exc:
            self.emit({"ev": "err", "id": seq.rid, "code": "invalid_grammar", "msg": str(exc)})
            return False
        if seq.grammar.closing_length(seq.max_tokens) is None:
            seq.grammar.close()
            self.emit(
                {
                    "ev": "err",
                    "id": seq.rid,
                    "code": "grammar_too_long",
                    "msg": f"max_tokens ({seq.max_tokens}) is too small for the shortest "
                    "output the response format or tool call allows",
                }
            )
            return False
        return True

    def admit_score(self, cmd: dict[str, Any]) -> None:
        """Teacher-force ``prompt + tokens``; write the logits rows that predicted each of
        ``tokens`` to a file (``logits``), or compare them with a reference's file
        (``score``). The drift monitor does one, then the other."""
        rid = cmd["id"]
        prompt = self.prompt_tokens(cmd, cmd["prompt"])
        tokens = [int(t) for t in cmd["tokens"]]
        if any(not 0 <= t < self.n_vocab for t in tokens):
            raise ValueError("a token id is outside the vocabulary")
        if not tokens or len(prompt) + len(tokens) > self.n_ctx:
            self.emit(
                {
                    "ev": "err",
                    "id": rid,
                    "code": "context_length_exceeded",
                    "pt": len(prompt),
                    "max_tokens": len(tokens),
                    "n_ctx": self.n_ctx,
                }
            )
            return
        seq = Sequence(
            rid=rid,
            prompt=prompt + tokens[:-1],
            max_tokens=0,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            logprobs=False,
            n_top=0,
            rng=np.random.default_rng(0),
            stops=StopMatcher(()),
            first_scored=len(prompt) - 1,
        )
        try:
            if cmd["op"] == "logits":
                seq.job = LogitsDump(str(cmd["path"]), len(tokens), self.n_vocab)
            else:
                ref = cmd["ref"]
                shape = (int(ref["shape"][0]), int(ref["shape"][1]))
                seq.job = Comparison(str(ref["path"]), shape, len(tokens), self.n_vocab)
        except (OSError, ValueError) as exc:
            self.emit({"ev": "err", "id": rid, "code": "engine_error", "msg": _words(exc)})
            return
        self.waiting.append(seq)

    def finish_score(self, seq: Sequence) -> None:
        assert seq.job is not None
        try:
            event = seq.job.result()
        except (OSError, ValueError) as exc:
            self.fail(seq, _words(exc))
            return
        self.emit({**event, "id": seq.rid})
        self.release(seq)

    def fail(self, seq: Sequence, words: str) -> None:
        """This sequence failed alone: say why, and forget it."""
        self.emit({"ev": "err", "id": seq.rid, "code": "engine_error", "msg": words})
        self.release(seq)

    def place(self, seq: Sequence) -> None:
        """Give a waiting sequence a free slot (``prompt_cache.py``): keep the cells
        of the prefix it shares with what the slot holds, drop the rest, and say ``start``
        with how many prompt tokens it reuses (``c``). Scoring jobs reuse nothing."""
        take = self.slots.take(seq.prompt, reuse=seq.first_scored < 0)
        reused = take.reused
        if take.held > reused and not lc.llama_memory_seq_rm(self.mem, take.slot, reused, -1):
            # a memory that cannot cut a sequence in the middle (recurrent): start afresh
            lc.llama_memory_seq_rm(self.mem, take.slot, -1, -1)
            reused = 0
        seq.slot, seq.reused, seq.fed, seq.n_past = take.slot, reused, reused, reused
        if seq.stamps is not None:
            seq.stamps.append(time.time_ns())
        self.active[seq.rid] = seq
        self.emit({"ev": "start", "id": seq.rid, "pt": len(seq.prompt), "c": reused})

    def release(self, seq: Sequence, *, keep: bool = False) -> None:
        """The sequence is done: forget it and free its slot. ``keep`` (a generation that
        finished) leaves its cells for the prompt cache; otherwise (an error, a scoring
        job) they are cleared, so what a slot holds is always what a finished sequence fed."""
        del self.active[seq.rid]
        if keep and self.slots.enabled and seq.first_scored < 0:
            self.slots.put(seq.slot, (seq.prompt + seq.out)[: seq.n_past])
        else:
            lc.llama_memory_seq_rm(self.mem, seq.slot, -1, -1)
            self.slots.put(seq.slot, [])
        self.close_job(seq)

    def close_job(self, seq: Sequence) -> None:
        if seq.chain is not None:
            seq.chain.close()
            seq.chain = None
            self.chains_open -= 1
        if seq.grammar is not None:
            seq.grammar.close()
            seq.grammar = None
        if seq.job is not None:
            seq.job.close()
            seq.job = None

    def cancel(self, rid: str) -> None:
        seq = self.active.get(rid)
        if seq is not None:
            self.finish(seq, "cancelled")
            return
        for cmd in self.held:  # its prompt is still being tokenized
            if cmd.get("id") == rid:
                self.held.remove(cmd)
                pending = cmd.get("_pending")
                if isinstance(pending, Pending):
                    pending.cancelled = True  # not tokenized at all, if not begun
                self.emit(
                    {"ev": "fin", "id": rid, "reason": "cancelled", "pt": 0, "ct": 0, "t": ""}
                )
                return
        for waiting in self.waiting:
            if waiting.rid == rid:
                self.waiting.remove(waiting)
                self.close_job(waiting)
                self.emit(
                    {
                        "ev": "fin",
                        "id": rid,
                        "reason": "cancelled",
                        "pt": len(waiting.prompt),
                        "ct": 0,
                        "t": "",
                    }
                )
                return

    def finish(self, seq: Sequence, reason: str) -> None:
        tail = seq.decoder.decode(b"", final=True)
        text = seq.stops.feed(tail) + seq.stops.flush() if reason != "cancelled" else ""
        event: dict[str, Any] = {
            "ev": "fin",
            "id": seq.rid,
            "reason": reason,
            "pt": len(seq.prompt),
            "ct": seq.generated,
            "t": text,
        }
        if seq.stamps is not None:
            event["tm"] = [*seq.stamps, time.time_ns()]
        self.emit(event)
        self.release(seq, keep=True)

    # -- the decode loop ------------------------------------------------------

    def run(self) -> None:
        while self.running:
            # nothing to decode (paused sequences wait for their readers): block on commands
            idle = not self.waiting and all(seq.paused for seq in self.active.values())
            try:
                self.handle(self.commands.get(block=idle))
                while self.running:
                    self.handle(self.commands.get_nowait())
            except queue.Empty:
                pass
            while self.waiting and len(self.slots):
                self.place(self.waiting.popleft())
            if self.running and any(not seq.paused for seq in self.active.values()):
                self.step()
            self.drop_refused()
            self.flush()
        for seq in [*self.active.values(), *self.waiting]:  # shutting down: leave no files
            self.close_job(seq)

    def _refuse_new_sequences(self) -> None:
        """On a simulated device out of memory (its flag file exists), fail the KV allocation
        of each client sequence not yet in the cache, as ``llama_decode`` does when the
        cache has no room; sequences already decoding keep their cells and go on."""
        for seq in list(self.active.values()):
            new = seq.fed == seq.reused and seq.first_scored < 0
            if new and not seq.rid.startswith("warmup"):
                self.emit(
                    {
                        "ev": "err",
                        "id": seq.rid,
                        "code": "device_out_of_memory",
                        "msg": "out of memory: no room on the device for the sequence's KV cache",
                    }
                )
                self.release(seq)

    def step(self) -> None:
        if self._oom_flag and os.path.exists(self._oom_flag):
            self._refuse_new_sequences()
        batch, n = self.batch, 0
        outputs: list[tuple[int, Sequence]] = []
        scoring: list[tuple[int, Sequence]] = []
        for seq in self.active.values():  # decoding sequences first: one token each
            if seq.next_token is not None and not seq.paused:
                self._put(n, seq.next_token, seq.n_past, seq.slot, True)
                outputs.append((n, seq))
                seq.n_past += 1
                seq.next_token = None
                n += 1
        budget = self.score_rows_per_step
        for seq in self.active.values():  # then prompt slices, as room allows
            if seq.prefilling and n < self.n_batch and not seq.paused:
                take = min(len(seq.prompt) - seq.fed, self.n_batch - n)
                if seq.first_scored >= 0:  # a scoring job: its scored rows share a budget
                    first = max(seq.fed, seq.first_scored)
                    take = min(take, first + budget - seq.fed)
                    if take <= 0:
                        continue
                    budget -= max(0, seq.fed + take - first)
                for j in range(take):
                    pos = seq.fed + j
                    last = pos == len(seq.prompt) - 1
                    scored = 0 <= seq.first_scored <= pos
                    self._put(n, seq.prompt[pos], seq.n_past, seq.slot, last or scored)
                    if scored:
                        scoring.append((n, seq))
                    elif last:
                        outputs.append((n, seq))
                    seq.n_past += 1
                    n += 1
                seq.fed += take
        batch.n_tokens = n
        if n == 0:  # every sequence left is paused (or was just refused): nothing to decode
            return
        if self._fault == "sigill-at-first-decode" and any(
            s.first_scored < 0 for s in self.active.values()
        ):
            _die_of(signal.SIGILL)
        if self._fault == "hang-at-decode" and any(
            not s.rid.startswith("warmup") and s.first_scored < 0 for s in self.active.values()
        ):
            self.flush()
            while True:
                time.sleep(3600)
        if self._fault == "hang-up-at-decode" and any(
            not s.rid.startswith("warmup") and s.first_scored < 0 for s in self.active.values()
        ):
            self.flush()
            self._out.close()
            while True:
                time.sleep(3600)
        if self._fault == "oom-at-decode" and any(
            not s.rid.startswith("warmup") and s.first_scored < 0 for s in self.active.values()
        ):
            rc = 1  # what llama_decode answers when the KV cache has no room for the batch
        else:
            rc = lc.llama_decode(self.ctx, batch)
        if rc != 0:
            # 1: no KV slot for the batch; -2: a compute buffer could not be allocated.
            oom = rc in (1, -2)
            for seq in list(self.active.values()):
                self.emit(
                    {
                        "ev": "err",
                        "id": seq.rid,
                        "code": "device_out_of_memory" if oom else "engine_error",
                        "msg": (
                            "out of memory in llama_decode (no room for the batch)"
                            if oom
                            else f"llama_decode returned {rc}"
                        ),
                    }
                )
                self.release(seq)
            return
        argmax = any(seq.argmax for _, seq in outputs)
        rows = self._output_rows(len(outputs) + len(scoring)) if argmax else None
        for index, seq in outputs:
            self._advance(seq, index, rows)
        failed: set[str] = set()
        for index, seq in scoring:
            if seq.rid in failed or seq.job is None:
                continue
            ptr = lc.llama_get_logits_ith(self.ctx, index)
            try:
                seq.job.add(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)))  # [V]
            except (OSError, ValueError) as exc:  # a full disk, a NaN row: this job fails
                failed.add(seq.rid)
                self.fail(seq, _words(exc))
        for seq in {id(s): s for _, s in scoring}.values():
            if seq.rid not in failed and seq.rid in self.active and not seq.prefilling:
                self.finish_score(seq)

    def _put(self, i: int, token: int, pos: int, slot: int, logits: bool) -> None:
        b = self.batch
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = slot
        b.logits[i] = logits

    def _row(self, seq: Sequence, index: int) -> Any:
        """The sequence's row of logits in numpy, biased, penalized and with the
        ``min_tokens`` ban, as its chain sees it: for a grammar, or for logprobs. # [V]"""
        ptr = lc.llama_get_logits_ith(self.ctx, index)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))  # [V], a view
        if seq.bias_ids is not None:
            logits = logits.copy()
            logits[seq.bias_ids] += seq.bias_values
        if seq.counts is not None and seq.seen is not None:
            logits = penalize(logits, seq.penalties, seq.counts, seq.seen)
        if seq.generated < seq.min_tokens and self.eog_tokens and not seq.ignore_eos:
            logits = np.array(logits, dtype=np.float64)
            logits[self.eog_tokens] = -np.inf
        return logits

    def _output_rows(self, n: int) -> tuple[Any, int]:
        """This step's ``n`` rows of logits (one per token that asked for them) where
        llama.cpp holds them, as one view, and the address of the first."""
        base = lc.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(base, shape=(n, self.n_vocab)), ctypes.addressof(base.contents)

    def _argmax(self, seq: Sequence, index: int, rows: tuple[Any, int]) -> int:
        """A greedy sequence's token: its biases and ``min_tokens`` ban written into its row
        (llama.cpp's buffer, read by nothing else before the next decode), then the first
        highest logit, as llama.cpp's greedy sampler picks it."""
        view, base = rows
        ptr = lc.llama_get_logits_ith(self.ctx, index)
        row = view[(ctypes.addressof(ptr.contents) - base) // (4 * self.n_vocab)]  # [V]
        banned = seq.generated < seq.min_tokens and self.eog_tokens and not seq.ignore_eos
        return greedy_in_place(
            row, seq.bias_ids, seq.bias_values, self.eog_tokens if banned else None
        )

    def _advance(self, seq: Sequence, index: int, rows: tuple[Any, int] | None = None) -> None:
        choice = None
        if seq.argmax and rows is not None:
            token = self._argmax(seq, index, rows)
        elif seq.chain is not None:
            token = seq.chain.sample(self.ctx, index)  # the row stays in llama.cpp
            if seq.logprobs or seq.n_top:
                row = self._row(seq, index)
                choice = choice_of(row, token, want_logprob=seq.logprobs, n_top=seq.n_top)
        elif seq.grammar is not None:
            token, choice = self._constrained(seq, self._row(seq, index), index)
        else:  # --sampler numpy: the reference the chain is tested against
            choice = sample(
                self._row(seq, index),
                temperature=seq.temperature,
                top_p=seq.top_p,
                top_k=seq.top_k,
                rng=seq.rng,
                min_p=seq.min_p,
                want_logprob=seq.logprobs,
                n_top=seq.n_top,
            )
            token = choice.token
        if token < 0:  # a grammar with no way on (the closing path said there was one)
            self.finish(seq, "length")
            return
        if lc.llama_vocab_is_eog(self.vocab, token):
            closed = seq.grammar is not None and seq.grammar.closing
            self.finish(seq, "length" if closed else "stop")
            return
        if seq.grammar is not None:
            seq.grammar.accept(token)
        if seq.counts is not None and seq.seen is not None:
            seq.counts[token] += 1
            seq.seen[token] = True
        seq.generated += 1
        if seq.generated == seq.min_tokens and seq.chain is not None:
            seq.chain.lift_ban()  # an argmax sequence checks the count itself
        seq.out.append(token)
        text = seq.stops.feed(seq.decoder.decode(self.piece_bytes(token)))
        if choice is None or (choice.logprob is None and not choice.top):
            self.emit_token(seq.rid, text, token)
        else:
            event: dict[str, Any] = {"ev": "tok", "id": seq.rid, "t": text, "tok": token}
            if choice.logprob is not None:
                event["lp"] = choice.logprob
                event["p"] = self.piece(token)
            if choice.top:
                event["top"] = [[t, self.piece(t), lp] for t, lp in choice.top]
            self.emit(event)
        if seq.stops.stopped:
            self.finish(seq, "stop")
        elif seq.generated >= seq.max_tokens or seq.n_past + 1 >= self.n_ctx:
            self.finish(seq, "length")
        elif seq.deadline is not None and time.monotonic() >= seq.deadline:
            self.finish(seq, "deadline")  # the client stops waiting: so do we
        else:
            seq.next_token = token

    def _constrained(self, seq: Sequence, logits: Any, index: int) -> tuple[int, Any]:
        """The next token of a sequence with a grammar: sampled among the tokens the
        grammar allows while the closing path fits in the tokens left after it, else the
        closing path's (``engines/llamacpp/constrained.py``)."""
        grammar = seq.grammar
        assert grammar is not None
        masked = grammar.mask(logits)
        if not np.isfinite(masked).any():  # min_tokens banned the only way out: let it end
            raw = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, index), (self.n_vocab,))
            masked = grammar.mask(raw)
        left = min(seq.max_tokens - seq.generated, self.n_ctx - seq.n_past)
        token = -1
        if not grammar.closing:
            token = sample(
                masked,
                temperature=seq.temperature,
                top_p=seq.top_p,
                top_k=seq.top_k,
                rng=seq.rng,
                min_p=seq.min_p,
            ).token
            fits = token in self.eog_set or (
                grammar.closing_length(left - 1, after=token) is not None
            )
            grammar.closing = not fits
        if grammar.closing:
            token = grammar.closing_token(left)
        return token, choice_of(masked, token, want_logprob=seq.logprobs, n_top=seq.n_top)


@lc.llama_log_callback  # type: ignore[untyped-decorator]
def _ERRORS_ONLY_LOG(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if level == _GGML_LOG_LEVEL_ERROR:
        sys.stderr.write(text.decode("utf-8", "replace"))


_GGML_LOG_LEVEL_ERROR = 3


def _words(exc: BaseException) -> str:
    return f"scoring failed: {exc}" if str(exc) else f"scoring failed: {type(exc).__name__}"


def _die_of(sig: signal.Signals) -> None:
    """The ``--fault`` hook: exit as a real fault would (status ``-sig``), without a core."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.kill(os.getpid(), sig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="quantroute llama.cpp worker (internal)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--oom-flag", default="")
    parser.add_argument("--n-ctx", type=int, default=0)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--n-threads", type=int, default=0)
    parser.add_argument("--n-batch", type=int, default=512)
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--no-prompt-cache",
        dest="prompt_cache",
        action="store_false",
        help="clear a slot's KV cells when its sequence ends (no prefix reuse)",
    )
    parser.add_argument("--cpus", default="", help="comma-separated cores to pin to")
    parser.add_argument(
        "--max-event-bytes",
        type=int,
        default=MAX_EVENT_BYTES,
        help="longest event line; a longer one is an error for its request",
    )
    parser.add_argument(
        "--sampler",
        default="chain",
        choices=("chain", "numpy"),
        help="chain: llama.cpp's sampler chain; numpy: engines/sampling.py (a reference)",
    )
    parser.add_argument(
        "--fault",
        default="",
        choices=("", *WORKER_FAULTS),
        help="test hook: fail on purpose (see the module docstring)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(name)s %(levelname)s %(message)s"
    )
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # from here on, anything printed to stdout lands on stderr
    sys.stdout = sys.stderr
    if args.fault == "exit-at-load":
        return 3
    worker = Worker(args, out)
    worker.emit({"ev": "ready", "info": worker.info()})
    worker.flush()
    reader = threading.Thread(target=worker.read_commands, args=(sys.stdin.buffer,), daemon=True)
    reader.start()
    worker.run()
    worker.flush()
    # The reader thread is blocked in stdin.read: skip interpreter finalization,
    # which would otherwise wait on (and abort over) its buffer lock.
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
