"""The llama.cpp worker process: one branch, several sequences decoded together.

Run by the supervisor as ``python -m quantroute.engines.llamacpp.worker``. It reads
commands on stdin and writes events on the original stdout, one message a line, as
:mod:`.wire` defines them (file descriptor 1 is then pointed at stderr, so nothing
llama.cpp prints can corrupt the protocol). A line that is not a command is answered
with an ``err`` (code ``bad_command``) for its id, naming the field, and the worker
goes on. Its first line is ``ready``; a model that cannot load is instead an ``err``
(no id, code ``engine_error``) saying why, and the worker exits with status 1.

``--backend onnx`` serves an ONNX decoder folder instead of a GGUF: ``--model`` its
``model.onnx``, ``--tokenizer`` its ``tokenizer.gguf`` (and ``--onnx-data`` its
``model.onnx.data``, where its weights lie beside the graph). Only the forward pass differs
(``engines/onnx/worker_model.py``); everything below is the same code.

The process is four parts: this module (the argv, the command reader, the loop),
:mod:`.worker_model` (the loaded model, its context and vocabulary: the contract
``WorkerModel``, met by llama.cpp's ``Model`` and ONNX Runtime's ``OnnxModel``),
:mod:`.worker_admission` (a command into a sequence, or its refusal),
:mod:`.worker_batch` (the sequences and the decode step; each one's token picked by
:mod:`.worker_sequence`), writing through :mod:`.worker_output`.

Prompts are tokenized off the decode loop (:mod:`.tokenizer`): the reader thread hands
each command's text prompt to a tokenizer thread as it arrives (long ones to a second,
so they do not hold the short ones), and the loop admits the command once its tokens
are ready, stepping the other sequences meanwhile. A ``gen`` whose bytes alone say it
cannot fit the context is refused without tokenizing it.

``logits`` teacher-forces ``prompt + tokens`` and writes the raw float32 logits that
predicted each of ``tokens`` (``[T, V]``, row-major, no header) to a new file at
``path`` (created exclusively; removed again if the job fails or is cancelled).
``score`` teacher-forces the same and compares each row with the reference's, read
from its file a row at a time: per-token ``KL(ref ‖ this)`` and top-1 agreement
(``quantroute.divergence``, in float64), so only ``T``-long arrays go back.
Vocabulary-sized rows never cross the pipe.

A ``gen`` whose sampling has a ``grammar`` (GBNF text) samples only what the grammar
allows and always ends with output it accepts (:mod:`.constrained`); an ungrammatical
grammar is an ``err`` with code ``invalid_grammar``, one whose shortest output is
longer than ``max_tokens`` ``grammar_too_long``.

A traced ``gen`` (with a trace context) gets ``tm`` on its ``fin``: wall-clock
nanoseconds when it was admitted, got a slot and finished; the gateway turns them
into the request's decode span.

``--fault`` is a test hook, off by default: ``sigill-at-first-decode`` dies of SIGILL
right before the first ``llama_decode`` of a generation (as a build using
instructions the CPU lacks does); ``exit-at-load`` exits with status 3 before loading
the model; ``oom-at-decode`` fails every decode of a request (not the warm-up's) as
llama.cpp does when memory runs out, returning 1; ``oversize-line`` answers its first
scoring command (``logits`` or ``score``) with one line longer than the gateway's
16 MiB limit first, as vocabulary-sized rows once did; ``hang-up-at-decode`` closes
its output at a request's first decode (not the warm-up's) and then never exits, as a
worker wedged in a dying runtime can; ``hang-at-decode`` stops at a request's first
decode (not the warm-up's) for ever, its output open, as a worker spinning in a
runaway grammar did.

``--draft PATH`` loads a second GGUF of the same vocabulary beside the model, with the
same slots and cells, and speculates with it for each greedy ``gen`` that asks (``spec``;
:mod:`.worker_speculative`): it drafts up to ``spec`` tokens (at most ``--spec-k-max``),
the model checks them in its step, and the text is the model's own greedy text. A draft
whose vocabulary differs is refused in words (logged) and the worker serves plainly;
``ready`` names the draft it loaded. An ONNX worker takes no draft.

``--oom-flag PATH`` (set for a branch on a simulated device): while the file exists,
the device is out of memory, and each new client sequence fails its KV allocation
with ``device_out_of_memory`` before its first token, so the gateway falls back;
sequences already decoding go on.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import queue
import sys
import threading
from collections import deque
from dataclasses import dataclass
from typing import IO

import numpy as np

from quantroute.engines.base import FinishReason
from quantroute.engines.llamacpp import wire
from quantroute.engines.llamacpp.speculative import Draws
from quantroute.engines.llamacpp.tokenizer import Pending, PromptTokenizer
from quantroute.engines.llamacpp.worker_admission import Admission, Refused
from quantroute.engines.llamacpp.worker_batch import Batcher
from quantroute.engines.llamacpp.worker_model import LoadError, Model, WorkerModel
from quantroute.engines.llamacpp.worker_output import Outbox
from quantroute.engines.llamacpp.worker_sequence import Sequence
from quantroute.engines.llamacpp.worker_speculative import SPEC_MODES, Drafter, load_draft
from quantroute.types import WORKER_FAULTS

log = logging.getLogger("quantroute.worker")

MAX_EVENT_BYTES = 1 << 20
"""Default longest event line (``--max-event-bytes``); the gateway reads lines of up to
16 MiB (``engines/supervisor.py``), so a refused event never reaches that limit."""
OVERSIZE_LINE_BYTES = (1 << 24) + 1  # the ``oversize-line`` fault: past the gateway's limit

Prompted = wire.Generate | wire.WriteLogits | wire.Score
"""The commands that bring a prompt (tokenized before they are admitted)."""


@dataclass(slots=True)
class Held:
    """A command with a prompt, from its arrival until it is admitted: ``pending`` is its
    prompt's tokenization on the tokenizer thread (``None``: tokenized when admitted)."""

    command: Prompted
    pending: Pending | None = None


@dataclass(frozen=True, slots=True)
class Malformed:
    """A line that is not a command: answered with an ``err`` for its id, if it has one."""

    error: wire.DecodeError


class _Tokenized:
    """The tokenizer thread's wake-up: a held prompt is ready."""


_TOKENIZED = _Tokenized()
Queued = Held | Malformed | wire.Command | _Tokenized | None
"""What the reader thread hands the loop (``None``: stdin closed, shut down)."""


def load_model(args: argparse.Namespace) -> WorkerModel:
    """The model ``--backend`` names: llama.cpp's over a GGUF, or ONNX Runtime's over a
    ``model.onnx`` with ``--tokenizer``'s vocabulary (imported only then: a llama.cpp
    worker never loads ONNX Runtime). Raises :class:`LoadError`, in words."""
    sizes = {"n_ctx": args.n_ctx, "parallel": args.parallel, "n_batch": args.n_batch}
    sizes |= {"n_threads": args.n_threads, "n_gpu_layers": args.n_gpu_layers}
    quiet = args.log_level != "debug"
    if args.backend == "onnx":
        from quantroute.engines.onnx.worker_model import OnnxModel

        if not args.tokenizer:
            raise LoadError("an onnx worker needs --tokenizer (the folder's tokenizer.gguf)")
        data = args.onnx_data or None
        return OnnxModel(args.model, args.tokenizer, quiet=quiet, data=data, **sizes)
    if args.onnx_data:
        raise LoadError("--onnx-data needs --backend onnx (a GGUF holds its own weights)")
    return Model(args.model, quiet=quiet, **sizes)


def load_drafter(args: argparse.Namespace, model: WorkerModel) -> Drafter | None:
    """The ``--draft`` model's drafter, or ``None`` (no ``--draft``, or one refused: the
    worker serves plainly). Raises :class:`LoadError` for a draft an ONNX worker is given."""
    if not args.draft:
        return None
    if args.backend != "llamacpp":
        raise LoadError("--draft needs --backend llamacpp (an ONNX worker drafts nothing)")
    quiet = args.log_level != "debug"
    sizes = {"n_batch": args.n_batch, "n_threads": args.n_threads}
    draft = load_draft(args.draft, model, n_gpu_layers=args.draft_gpu_layers, quiet=quiet, **sizes)
    if draft is None:
        return None
    return Drafter(draft, args.draft, k_max=args.spec_k_max, mode=args.spec_mode)


class Worker:
    """The worker's loop: commands in, sequences decoded, events out."""

    def __init__(self, args: argparse.Namespace, out: IO[bytes]):
        self._fault = args.fault
        self.model = load_model(args)
        self.drafter = load_drafter(args, self.model)
        self.outbox = Outbox(out, args.max_event_bytes)
        self.admission = Admission(self.model, args.sampler)
        self.batcher = Batcher(
            self.model,
            self.outbox,
            prompt_cache=args.prompt_cache,
            fault=args.fault,
            oom_flag=args.oom_flag,
            drafter=self.drafter,
        )
        self.commands: queue.Queue[Queued] = queue.Queue()
        # Prompts are tokenized on a thread of their own (tokenizer.py); a command is
        # held here, in arrival order, until its prompt's tokens are ready.
        self._prompts = PromptTokenizer(self.model.tokenize, lambda: self.commands.put(_TOKENIZED))
        self.held: deque[Held] = deque()
        self.running = True

    # -- the reader thread --------------------------------------------------------

    def read_commands(self, stream: IO[bytes]) -> None:
        for line in stream:
            try:
                command = wire.decode_command(line)
            except wire.DecodeError as exc:
                log.error("worker: a malformed command: %s", exc)
                self.commands.put(Malformed(exc))
                continue
            self.commands.put(self.receive(command))
        self.commands.put(None)  # the gateway closed our stdin: shut down

    def receive(self, command: wire.Command) -> Held | wire.Command:
        """On the reader thread: a command with a text prompt is held, its prompt handed
        to the tokenizer thread; not a ``gen`` of ids, nor one whose size alone refuses
        it (admission says so, untokenized)."""
        if not isinstance(command, Prompted):
            return command
        if isinstance(command, wire.Generate) and (
            command.prompt_ids is not None
            or self.model.fewest_tokens(command.prompt) >= self.model.n_ctx
        ):
            return Held(command)
        return Held(command, self._prompts.submit(command.prompt, command.special))

    # -- the loop -------------------------------------------------------------------

    def run(self) -> None:
        batcher = self.batcher
        while self.running:
            try:
                self.handle(self.commands.get(block=batcher.idle))
                while self.running:
                    self.handle(self.commands.get_nowait())
            except queue.Empty:
                pass
            batcher.place_waiting()
            if self.running and any(not seq.paused for seq in batcher.active.values()):
                batcher.step()
            self.drop_refused()
            self.flush()
        batcher.close_all()

    def handle(self, item: Queued) -> None:
        if item is None or isinstance(item, wire.Shutdown):
            self.running = False
        elif isinstance(item, Held | Prompted):
            held = item if isinstance(item, Held) else Held(item)
            scoring = isinstance(held.command, wire.WriteLogits | wire.Score)
            if scoring and self._fault == "oversize-line":
                self._fault = ""  # once: the gateway kills this worker over it
                self.outbox.write_raw(
                    b'{"ev":"pad","data":"' + b"A" * OVERSIZE_LINE_BYTES + b'"}\n'
                )
            self.held.append(held)
            self.admit_held()
        elif isinstance(item, _Tokenized):
            self.admit_held()
        elif isinstance(item, wire.Cancel):
            self.cancel(item.id)
        elif isinstance(item, wire.Pause | wire.Resume):  # the gateway's buffer is full / drained
            seq = self.batcher.active.get(item.id)
            if seq is not None:
                seq.paused = isinstance(item, wire.Pause)
        elif isinstance(item, Malformed):
            self.outbox.emit(wire.Error(item.error.id or "", "bad_command", str(item.error)))

    def admit_held(self) -> None:
        """Admit the held commands whose prompts are tokenized (or that have none to
        tokenize), in the order they came; those still tokenizing stay held."""
        held, self.held = self.held, deque()
        for item in held:
            if item.pending is not None and not item.pending.done:
                self.held.append(item)
                continue
            command, tokens = item.command, functools.partial(self._tokens, item)
            try:
                if isinstance(command, wire.Generate):
                    seq = self.admission.generation(command, tokens)
                else:
                    seq = self.admission.scoring(command, tokens)
            except Refused as refused:
                self.outbox.emit(refused.event)
                continue
            except ValueError as exc:  # a command no gateway sends: it fails alone
                self.outbox.emit(wire.Error(command.id, "bad_command", str(exc)))
                continue
            if isinstance(command, wire.Generate) and command.spec > 0:
                self.speculate(seq, command.spec)
            self.batcher.add(seq)

    def speculate(self, seq: Sequence, spec: int) -> None:
        """Draft for ``seq`` if this worker has a draft and ``seq`` is greedy (the argmax of
        its row, biases at most) or samples in llama.cpp's chain with no penalties and no
        logprobs (its speculated tokens then follow ``engines/sampling.py``'s transformed
        row, drawn from :class:`Draws` keyed by its seed); grammars, logprobs, penalties
        and scoring decode plainly."""
        if self.drafter is None or seq.first_scored >= 0:
            return
        if seq.argmax:
            seq.spec = self.drafter.state(spec)
            return
        sampled = seq.chain is not None and not seq.wants_choice and not seq.penalties.active
        if not sampled:
            return
        s = seq.sampling
        bias = {t: b for t, b in s.logit_bias}
        if s.ignore_eos:
            bias |= dict.fromkeys(self.model.eog_tokens, -np.inf)
        if bias:
            seq.bias_ids = np.array(list(bias), dtype=np.int64)
            seq.bias_values = np.array(list(bias.values()), dtype=np.float32)
        key = int(seq.rng.integers(0, 2**63))  # the seed's own stream when seeded
        seq.spec = self.drafter.state(spec, Draws(key))

    def _tokens(self, item: Held) -> list[int]:
        """A held command's prompt tokens: the tokenizer thread's, else tokenized here."""
        if item.pending is not None:
            return item.pending.result()
        return self.model.tokenize(item.command.prompt, item.command.special)

    def cancel(self, rid: str) -> None:
        if self.batcher.cancel(rid):
            return
        for item in self.held:  # its prompt is still being tokenized
            if item.command.id == rid:
                self.held.remove(item)
                if item.pending is not None:
                    item.pending.cancelled = True  # not tokenized at all, if not begun
                self.outbox.emit(wire.Finished(rid, FinishReason.CANCELLED, 0, 0))
                return

    def drop_refused(self) -> None:
        """Forget the requests whose event was refused (their ``err`` went out instead)."""
        for rid in self.outbox.refused:
            self.batcher.drop(rid)
        self.outbox.refused.clear()

    def flush(self) -> None:
        self.outbox.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="quantroute llama.cpp worker (internal)")
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--backend",
        default="llamacpp",
        choices=("llamacpp", "onnx"),
        help="llamacpp: --model is a GGUF; onnx: --model is a model.onnx (ONNX Runtime)",
    )
    parser.add_argument("--tokenizer", default="", help="onnx: the folder's tokenizer.gguf")
    parser.add_argument(
        "--onnx-data", default="", help="onnx: the graph's external data file (model.onnx.data)"
    )
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
    parser.add_argument("--draft", default="", help="a GGUF of the same vocabulary to draft with")
    parser.add_argument("--draft-gpu-layers", type=int, default=0)
    parser.add_argument(
        "--spec-k-max", type=int, default=8, help="most draft tokens a step, whatever gen asks"
    )
    parser.add_argument(
        "--spec-mode",
        default="auto",
        choices=SPEC_MODES,
        help="auto: draft while it pays; always: at least 1; fixed: the request's spec",
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
    try:
        worker = Worker(args, out)
    except LoadError as exc:  # the gateway's start reads why, rather than an exit status
        log.error("worker: %s", exc)
        out.write(wire.encode(wire.Error("", "engine_error", str(exc))))
        out.flush()
        return 1
    draft = worker.drafter.name if worker.drafter is not None else None
    worker.outbox.emit(wire.Ready(worker.model.info(), draft))
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
