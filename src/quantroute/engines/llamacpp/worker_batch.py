"""A llama.cpp worker's sequences and its decode step (worker process): continuous
batching over the model's slots.

Every step puts the next token of every decoding sequence and a slice of any waiting
prompt into one ``llama_decode``, then picks each sequence's next token
(:func:`~.worker_sequence.pick`) and sends what it adds (:class:`~.worker_output.Outbox`).

Slots keep finished sequences' KV cells (:mod:`.prompt_cache`; off with
``--no-prompt-cache``): a new sequence takes the free slot whose cells share the longest
prefix with its prompt (else the least recently used one), drops the cells past that
prefix and prefills only the rest, always feeding the last prompt token again. Its
``start`` says how many prompt tokens were reused. Scoring jobs reuse nothing and leave
nothing; a sequence that fails leaves its slot empty.

A scoring job's rows go to its job (:mod:`.scoring`) instead of a sampler: at most
``max(16, 2**22 // V)`` scored rows a step, so a replay neither holds a ``[T, V]``
array nor stalls the other sequences for long.

A speculating sequence (``--draft``; :mod:`.worker_speculative`) puts ``[last, d_1..d_k]``
into the step, each with its row, and may emit several tokens in one step; each goes
through :meth:`Batcher._emit`, which ends the sequence exactly where plain decoding would
(a stop, end-of-generation, ``max_tokens``, the context, the deadline). The cells of the
drafts it did not keep are dropped, in both models.
"""

from __future__ import annotations

import os
import resource
import signal
import time
from collections import deque

import msgspec

from quantroute.engines.base import FinishReason
from quantroute.engines.llamacpp import wire
from quantroute.engines.llamacpp.prompt_cache import PromptCache
from quantroute.engines.llamacpp.worker_admission import scoring_failed
from quantroute.engines.llamacpp.worker_model import Rows, WorkerModel
from quantroute.engines.llamacpp.worker_output import Outbox
from quantroute.engines.llamacpp.worker_sequence import Sequence, pick
from quantroute.engines.llamacpp.worker_speculative import Drafter
from quantroute.engines.sampling import Choice

_SCORE_BLOCK_ELEMENTS = 1 << 22  # scored logits per decode step, at most (16 MiB of float32)


class Batcher:
    """The sequences waiting for a slot and those holding one, and the decode step.

    ``fault`` (``--fault``) and ``oom_flag`` (``--oom-flag``) are the worker's test
    hooks that act at a decode; see :mod:`.worker`. ``drafter``: the draft model
    speculating sequences draft with (``--draft``)."""

    def __init__(
        self,
        model: WorkerModel,
        outbox: Outbox,
        *,
        prompt_cache: bool,
        fault: str,
        oom_flag: str,
        drafter: Drafter | None = None,
    ):
        self._model = model
        self.drafter = drafter
        self._timed: tuple[float, float, bool] | None = None  # last step: began, ended, counted
        self._out = outbox
        self._fault = fault
        self._oom_flag = oom_flag  # a simulated device's: allocations fail while it exists
        self.slots = PromptCache(model.parallel, enabled=prompt_cache)  # the free ones
        self.active: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        # Scored rows per step, at most: bounds llama.cpp's logits buffer and the time
        # one step spends comparing rows while other sequences wait for their tokens.
        self.score_rows_per_step = max(16, _SCORE_BLOCK_ELEMENTS // model.n_vocab)
        self.chains_open = 0  # sampler chains built and not yet freed (a test reads it)

    @property
    def idle(self) -> bool:
        """Nothing to decode (paused sequences wait for their readers)."""
        return not self.waiting and all(seq.paused for seq in self.active.values())

    def add(self, seq: Sequence) -> None:
        """A new sequence waits for a slot; its ``start`` goes out when it gets one."""
        if seq.chain is not None:
            self.chains_open += 1
        self.waiting.append(seq)

    def place_waiting(self) -> None:
        while self.waiting and len(self.slots):
            self.place(self.waiting.popleft())

    def place(self, seq: Sequence) -> None:
        """Give a waiting sequence a free slot (``prompt_cache.py``): keep the cells
        of the prefix it shares with what the slot holds, drop the rest, and say ``start``
        with how many prompt tokens it reuses. Scoring jobs reuse nothing."""
        take = self.slots.take(seq.prompt, reuse=seq.first_scored < 0)
        reused = take.reused
        if take.held > reused and not self._model.keep_prefix(take.slot, reused):
            # a memory that cannot cut a sequence in the middle (recurrent): start afresh
            self._model.clear(take.slot)
            reused = 0
        seq.slot, seq.reused, seq.fed, seq.n_past = take.slot, reused, reused, reused
        if seq.stamps is not None:
            seq.stamps.append(time.time_ns())
        self.active[seq.rid] = seq
        self._out.emit(wire.Started(seq.rid, len(seq.prompt), reused, seq.spec is not None))

    def release(self, seq: Sequence, *, keep: bool = False) -> None:
        """The sequence is done: forget it and free its slot. ``keep`` (a generation that
        finished) leaves its cells for the prompt cache; otherwise (an error, a scoring
        job) they are cleared, so what a slot holds is always what a finished sequence fed."""
        del self.active[seq.rid]
        if keep and self.slots.enabled and seq.first_scored < 0:
            if seq.spec is not None:  # it may have ended inside a kept run: drop the rest
                self._model.keep_prefix(seq.slot, seq.n_past)
            self.slots.put(seq.slot, (seq.prompt + seq.out)[: seq.n_past])
        else:
            self._model.clear(seq.slot)
            self.slots.put(seq.slot, [])
            if self.drafter is not None:
                self.drafter.forget(seq.slot)
        self.close_job(seq)

    def close_job(self, seq: Sequence) -> None:
        """Free what the sequence holds outside its slot: its chain, grammar, job."""
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

    def close_all(self) -> None:
        """Shutting down: leave no files."""
        for seq in [*self.active.values(), *self.waiting]:
            self.close_job(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        tail = seq.decoder.decode(b"", final=True)
        cancelled = reason is FinishReason.CANCELLED
        text = "" if cancelled else seq.stops.feed(tail) + seq.stops.flush()
        stamps = () if seq.stamps is None else (*seq.stamps, time.time_ns())
        fin = wire.Finished(seq.rid, reason, len(seq.prompt), seq.generated, text, stamps)
        if seq.spec is not None and seq.spec.cycles:
            spec = seq.spec
            speedup = self.drafter.control.speedup if self.drafter is not None else 0.0
            fin = msgspec.structs.replace(
                fin,
                drafted=spec.drafted,
                accepted=spec.accepted,
                mean_k=round(spec.mean_k, 3),
                speedup=round(speedup, 3),
            )
        self._out.emit(fin)
        self.release(seq, keep=True)

    def finish_score(self, seq: Sequence) -> None:
        assert seq.job is not None
        try:
            event = seq.job.result(seq.rid)
        except (OSError, ValueError) as exc:
            self.fail(seq, scoring_failed(exc))
            return
        self._out.emit(event)
        self.release(seq)

    def fail(self, seq: Sequence, words: str, code: str = "engine_error") -> None:
        """This sequence failed alone: say why, and forget it."""
        self._out.emit(wire.Error(seq.rid, code, words))
        self.release(seq)

    def cancel(self, rid: str) -> bool:
        """End ``rid`` (``fin`` with reason ``cancelled``) if it waits or decodes here."""
        seq = self.active.get(rid)
        if seq is not None:
            self.finish(seq, FinishReason.CANCELLED)
            return True
        for waiting in self.waiting:
            if waiting.rid == rid:
                self.waiting.remove(waiting)
                self.close_job(waiting)
                cancelled = FinishReason.CANCELLED
                self._out.emit(wire.Finished(rid, cancelled, len(waiting.prompt), 0))
                return True
        return False

    def drop(self, rid: str) -> None:
        """Forget ``rid`` without a word (its events were refused: its ``err`` went out)."""
        seq = self.active.get(rid)
        if seq is not None:
            self.release(seq)
        for waiting in [w for w in self.waiting if w.rid == rid]:
            self.waiting.remove(waiting)
            self.close_job(waiting)

    # -- the decode step ----------------------------------------------------------

    def step(self) -> None:
        """One decode (``llama_decode``, or the model's own) of every decoding sequence's
        next token and the prompt slices that fit, then every sequence's next token. With
        a drafter, a step's time is what its ``k`` is weighed by (:meth:`_time_last`)."""
        if self.drafter is None:
            self._step()
            return
        began = time.perf_counter()
        self._time_last(began)
        counted = not any(seq.prefilling for seq in self.active.values())
        self._step()
        self._timed = (began, time.perf_counter(), counted)

    def _time_last(self, now: float) -> None:
        """Tell the drafter the last step's time: from its start to this one's, so the
        loop's work between steps (sending the tokens, reading commands), a cost per
        step, counts too; its own time alone when the loop waited longer than it ran
        (idle, nothing to decode). Steps that fed prompts are not counted."""
        assert self.drafter is not None
        if self._timed is not None:
            began, ended, counted = self._timed
            took = now - began if now - ended <= ended - began else ended - began
            self.drafter.timed_step(took, counted=counted)
        self._timed = None

    def _step(self) -> int:
        """:meth:`step`; how many drafted tokens it checked."""
        if self._oom_flag and os.path.exists(self._oom_flag):
            self._refuse_new_sequences()
        model = self._model
        drafted = self._propose() if self.drafter is not None else 0
        n = rows_asked = 0
        outputs: list[tuple[int, Sequence]] = []
        scoring: list[tuple[int, Sequence]] = []
        for seq in self.active.values():  # decoding sequences first: one token each
            if seq.next_token is not None and not seq.paused:
                outputs.append((n, seq))
                model.put(n, seq.next_token, seq.n_past, seq.slot, True)
                n += 1
                if seq.spec is not None:  # [last, d_1..d_k]
                    for j, token in enumerate(seq.spec.drafts, 1):
                        model.put(n, token, seq.n_past + j, seq.slot, True)
                        n += 1
                seq.n_past += 1  # the drafts' cells count once kept (_advance_drafted)
                seq.next_token = None
        rows_asked = n
        budget = self.score_rows_per_step
        for seq in self.active.values():  # then prompt slices, as room allows
            if seq.prefilling and n < model.n_batch and not seq.paused:
                take = min(len(seq.prompt) - seq.fed, model.n_batch - n)
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
                    model.put(n, seq.prompt[pos], seq.n_past, seq.slot, last or scored)
                    if scored:
                        scoring.append((n, seq))
                    elif last:
                        outputs.append((n, seq))
                    rows_asked += last or scored
                    seq.n_past += 1
                    n += 1
                seq.fed += take
        if n == 0:  # every sequence left is paused (or was just refused): nothing to decode
            return drafted
        rc = self._decode(n)
        if rc != 0:
            # 1: no KV room for the batch; -2: a compute buffer could not be allocated.
            code = "device_out_of_memory" if rc in (1, -2) else "engine_error"
            words = model.decode_failure(rc)
            for seq in list(self.active.values()):
                self.fail(seq, words, code)
            return drafted
        argmax = any(seq.argmax or seq.spec is not None for _, seq in outputs)
        rows = model.rows(rows_asked) if argmax else None
        for index, seq in outputs:
            if seq.spec is not None and seq.spec.drafts and rows is not None:
                self._advance_drafted(seq, index, rows)
            else:
                self._advance(seq, index, rows)
        failed: set[str] = set()
        for index, seq in scoring:
            if seq.rid in failed or seq.job is None:
                continue
            try:
                seq.job.add(model.row(index))  # [V]
            except (OSError, ValueError) as exc:  # a full disk, a NaN row: this job fails
                failed.add(seq.rid)
                self.fail(seq, scoring_failed(exc))
        for seq in {id(s): s for _, s in scoring}.values():
            if seq.rid not in failed and seq.rid in self.active and not seq.prefilling:
                self.finish_score(seq)
        return drafted

    def _decode(self, n: int) -> int:
        """``llama_decode`` of the batch's ``n`` entries, or what a ``--fault`` makes of it."""
        fault = self._fault
        if fault and any(s.first_scored < 0 for s in self.active.values()):
            client = any(
                not s.rid.startswith("warmup") and s.first_scored < 0 for s in self.active.values()
            )
            if fault == "sigill-at-first-decode":
                _die_of(signal.SIGILL)
            if fault == "hang-at-decode" and client:
                self._out.flush()
                while True:
                    time.sleep(3600)
            if fault == "hang-up-at-decode" and client:
                self._out.flush()
                self._out.close()
                while True:
                    time.sleep(3600)
            if fault == "oom-at-decode" and client:
                return 1  # what llama_decode answers when the KV cache has no room
        return self._model.decode(n)

    def _refuse_new_sequences(self) -> None:
        """On a simulated device out of memory (its flag file exists), fail the KV allocation
        of each client sequence not yet in the cache, as ``llama_decode`` does when the
        cache has no room; sequences already decoding keep their cells and go on."""
        for seq in list(self.active.values()):
            new = seq.fed == seq.reused and seq.first_scored < 0
            if new and not seq.rid.startswith("warmup"):
                words = "out of memory: no room on the device for the sequence's KV cache"
                self.fail(seq, words, "device_out_of_memory")

    def _propose(self) -> int:
        """This step's drafts of the speculating sequences (the drafter's decodes), as many
        as the batch has room for beside every decoding sequence's token; how many."""
        drafter, model = self.drafter, self._model
        assert drafter is not None
        decoding = [s for s in self.active.values() if s.next_token is not None and not s.paused]
        room = model.n_batch - len(decoding)
        wanted: list[tuple[Sequence, int]] = []
        for seq in decoding:
            if seq.spec is None:
                continue
            wants = drafter.k_for(seq, model.n_ctx)
            k = min(wants, room)
            if k < wants:
                drafter.short_of_room()
            if k > 0:
                wanted.append((seq, k))
                room -= k
            else:
                seq.spec.drafts = []
        drafter.propose(wanted)
        return sum(len(s.spec.drafts) for s, _ in wanted if s.spec is not None)

    def _advance_drafted(self, seq: Sequence, index: int, rows: Rows) -> None:
        """A speculating sequence's step: entries ``index..index+k`` held its last token
        and its drafts; keep the drafts the model's own greedy tokens agree with, drop
        the cells of the rest (both models), and emit the kept ones and the model's next
        token, each as plain decoding would, until one ends the sequence."""
        assert self.drafter is not None and seq.spec is not None
        drafts = seq.spec.drafts
        verdict = self.drafter.verdict(self._model, seq, index, rows)
        base = seq.n_past  # the last token's cell is base - 1; the drafts' follow it
        if verdict.accepted < len(drafts):
            self._model.keep_prefix(seq.slot, base + verdict.accepted)
        for j, token in enumerate(verdict.emitted(drafts)):
            seq.n_past = base + j  # as plain decoding would have it at this token
            if not self._emit(seq, token, None):
                return

    def _advance(self, seq: Sequence, index: int, rows: Rows | None) -> None:
        """Take ``seq``'s next token from its row, send what it adds, and end it at a stop,
        its ``max_tokens``, the context's end or its deadline."""
        token, choice = pick(self._model, seq, index, rows)
        if token < 0:  # a grammar with no way on (the closing path said there was one)
            self.finish(seq, FinishReason.LENGTH)
            return
        self._emit(seq, token, choice)

    def _emit(self, seq: Sequence, token: int, choice: Choice | None) -> bool:
        """Emit ``token``; False when it ended the sequence (it is then finished)."""
        model = self._model
        if model.is_eog(token):
            closed = seq.grammar is not None and seq.grammar.closing
            self.finish(seq, FinishReason.LENGTH if closed else FinishReason.STOP)
            return False
        if seq.grammar is not None:
            seq.grammar.accept(token)
        if seq.counts is not None and seq.seen is not None:
            seq.counts[token] += 1
            seq.seen[token] = True
        seq.generated += 1
        if seq.generated == seq.sampling.min_tokens and seq.chain is not None:
            seq.chain.lift_ban()  # an argmax sequence checks the count itself
        seq.out.append(token)
        text = seq.stops.feed(seq.decoder.decode(model.piece_bytes(token)))
        if choice is None or (choice.logprob is None and not choice.top):
            self._out.token(seq.rid, text, token)
        else:
            piece = model.piece(token) if choice.logprob is not None else None
            top = tuple((t, model.piece(t), lp) for t, lp in choice.top)
            self._out.emit(wire.Token(seq.rid, text, token, choice.logprob, piece, top))
        deadline = seq.sampling.deadline
        if seq.stops.stopped:
            self.finish(seq, FinishReason.STOP)
        elif seq.generated >= seq.max_tokens or seq.n_past + 1 >= model.n_ctx:
            self.finish(seq, FinishReason.LENGTH)
        elif deadline is not None and time.monotonic() >= deadline:
            self.finish(seq, FinishReason.DEADLINE)  # the client stops waiting: so do we
        else:
            seq.next_token = token
            return True
        return False


def _die_of(sig: signal.Signals) -> None:
    """The ``--fault`` hook: exit as a real fault would (status ``-sig``), without a core."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.kill(os.getpid(), sig)
