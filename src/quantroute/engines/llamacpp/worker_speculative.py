"""Speculative decoding in a llama.cpp worker (worker process): a draft model held beside
the served one proposes tokens, and the served one checks them in its own decode step.

A worker started with ``--draft PATH`` loads that GGUF as a second :class:`Model` with the
same slots, cells and batch (:func:`load_draft`; refused, in words, and the worker serves
plainly, when its vocabulary is not the served model's token for token). A ``gen`` with
``spec > 0`` whose tokens are the argmax of the row (greedy, biases at most: no penalties,
logprobs, grammar) gets a :class:`SpecState`; every step the batcher asks
:meth:`Drafter.propose` for its drafts, puts ``[last, d_1..d_k]`` with a row each into the
step, and :meth:`Drafter.verdict` decides what it keeps (``speculative.verify_greedy`` on
the served model's own greedy tokens, biases and the ``min_tokens`` ban applied as plain
decoding applies them). Other requests decode plainly beside it.

The draft's KV cells follow the text, not the prompt cache: :attr:`Drafter.held` is, per
slot, the tokens the draft's cells hold; each proposal keeps the longest prefix they share
with the sequence's text (``keep_prefix``) and feeds the rest in the first of its ``k``
draft decodes, batched across the speculating sequences (one ``llama_decode`` of the draft
per depth). A slot's cells that nobody vouches for are cleared (:meth:`Drafter.forget`).

How many to draft: ``--spec-mode auto`` asks the worker's :class:`AdaptiveK` once a step
(one ``k`` for every speculating sequence in it, 0: decode plainly), which measures the
tokens per second each ``k`` gives (:meth:`Drafter.timed_step`: the whole step, drafting
included; steps that also feed prompts are not counted); ``always`` the same without 0;
``fixed`` the request's ``spec`` itself (tests, benchmarks). Always at most ``spec``, and
never more than ``max_tokens`` or the context leaves.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llama_cpp as lc
import numpy as np

from quantroute.engines.llamacpp.speculative import (
    AdaptiveK,
    Draws,
    Verdict,
    verify,
    verify_greedy,
)
from quantroute.engines.llamacpp.worker_model import LoadError, Model, Rows, WorkerModel
from quantroute.engines.sampling import distribution, greedy_in_place

if TYPE_CHECKING:
    from quantroute.engines.llamacpp.worker_sequence import Sequence

log = logging.getLogger("quantroute.worker")

SPEC_MODES = ("auto", "always", "fixed")


@dataclass(slots=True)
class SpecState:
    """One speculating sequence's drafting: this step's drafts and the counts its ``fin``
    reports."""

    k_max: int  # the request's spec, capped by the worker's --spec-k-max
    draws: Draws | None = None  # a sampled sequence's uniforms (None: greedy)
    drafts: list[int] = field(default_factory=list)  # proposed for this step, not yet checked
    q: list[Any] = field(default_factory=list)  # sampled: the draft's rows they came from
    drafted: int = 0
    accepted: int = 0
    cycles: int = 0  # steps that drafted

    @property
    def mean_k(self) -> float:
        return self.drafted / self.cycles if self.cycles else 0.0


def vocabulary_mismatch(served: Any, draft: Any) -> str | None:
    """Why ``draft`` cannot draft for ``served`` (both llama.cpp vocabularies), in words,
    or ``None`` when every token id means the same text in both (as llama.cpp's
    ``common_speculative_are_compatible`` asks, but every token rather than a sample)."""
    if served.n_vocab != draft.n_vocab:
        return f"its vocabulary has {draft.n_vocab} tokens, the model's {served.n_vocab}"
    for t in range(served.n_vocab):
        if served.piece_bytes(t, True) != draft.piece_bytes(t, True):
            mine, theirs = served.piece_bytes(t, True), draft.piece_bytes(t, True)
            return f"token {t} is {theirs!r} in it, {mine!r} in the model"
    if served.eog_set != draft.eog_set:
        return "its end-of-generation tokens are not the model's"
    return None


def load_draft(path: str, served: WorkerModel, **sizes: Any) -> Model | None:
    """The draft GGUF at ``path``, loaded with the served model's slots, cells and batch;
    ``None`` (the refusal logged in words) when it cannot draft for it. Raises
    :class:`LoadError` for a served model that is not llama.cpp's."""
    if not isinstance(served, Model):
        raise LoadError("--draft needs --backend llamacpp (an ONNX worker drafts nothing)")
    try:
        draft = Model(path, n_ctx=served.n_ctx, parallel=served.parallel, **sizes)
    except LoadError as exc:
        log.error("worker: the draft %s is refused, serving without it: %s", path, exc)
        return None
    why = vocabulary_mismatch(served, draft)
    if why is None and (_recurrent(served) or _recurrent(draft)):
        why = "a recurrent model cannot drop rejected drafts from its memory"
    if why is not None:
        log.error("worker: the draft %s is refused, serving without it: %s", path, why)
        _free(draft)
        return None
    return draft


def _recurrent(model: Model) -> bool:
    return bool(lc.llama_model_is_recurrent(model.handle))


def _free(model: Model) -> None:
    lc.llama_batch_free(model.batch)
    lc.llama_free(model.ctx)
    lc.llama_model_free(model.handle)


# Tokens a draft catches up in a step whose time still measures its k: what the plain
# steps between two probes leave (one step in 32 while plain decoding is fastest, and
# each emits a token), with room; more is a prompt's prefill.
USUAL_CATCH_UP = 64


class Drafter:
    """The draft model's cells and decodes, and the choice of ``k``."""

    def __init__(self, draft: Model, path: str, *, k_max: int = 8, mode: str = "auto"):
        if mode not in SPEC_MODES:
            raise ValueError(f"spec mode {mode!r} is not one of {SPEC_MODES}")
        self.model = draft
        self.name = os.path.basename(path)
        self.k_max = k_max
        self.mode = mode
        self.held: list[list[int]] = [[] for _ in range(draft.parallel)]  # per slot
        self.control = AdaptiveK(k_max=k_max, floor=1 if mode == "always" else 0)
        self._arm: int | None = None  # this step's k (auto, always), once a sequence asked
        self._emitted = 0  # tokens the speculating sequences emit this step
        self._sequences = 0  # ... and how many of them there are
        self._capped = False  # a sequence drafted fewer than the step's k for want of room
        self.failures = 0  # draft decodes that failed (their sequences decoded plainly)

    def state(self, spec: int, draws: Draws | None = None) -> SpecState:
        """A new speculating sequence's state (``spec``: the request's most drafts;
        ``draws``: a sampled sequence's uniforms)."""
        k_max = max(1, min(spec, self.k_max))
        return SpecState(k_max, draws)

    # -- how many -------------------------------------------------------------------

    def k_for(self, seq: Sequence, n_ctx: int) -> int:
        """How many ``seq`` drafts this step: the step's ``k`` (module docstring), within
        what its ``max_tokens`` and the context leave (a step emits at most ``k + 1``).
        0: it decodes plainly this step."""
        spec = seq.spec
        assert spec is not None
        if self.mode == "fixed":
            k = spec.k_max
        else:
            if self._arm is None:
                self._arm = self.control.choose()
            k = self._arm
        room = min(seq.max_tokens - seq.generated - 1, n_ctx - seq.n_past - 2)
        if room < min(k, spec.k_max):
            self._capped = True  # its end cuts the step short: not a measure of k
        k = max(0, min(k, spec.k_max, room))
        self._sequences += 1
        if k == 0:
            self._emitted += 1
        return k

    def short_of_room(self) -> None:
        """The batch had no room for a sequence's ``k`` drafts: the step drafts fewer than
        its ``k``, so it is not a measure of it."""
        self._capped = True

    def timed_step(self, seconds: float, *, counted: bool = True) -> None:
        """The step (drafting, the served model's decode, picking and sending) took
        ``seconds``; ``counted``: it fed no prompt, so its time is its decoding's, and
        :attr:`control` learns the tokens per second of the step's ``k`` (unless a
        sequence's end left no room for ``k``), per speculating sequence: a rate a
        request sees, whether one or five shared the steps that measured it."""
        arm, emitted, capped, sequences = self._arm, self._emitted, self._capped, self._sequences
        self._arm, self._emitted, self._capped, self._sequences = None, 0, False, 0
        if arm is not None and counted and not capped and emitted and seconds > 0.0:
            self.control.observe(arm, emitted / max(1, sequences), seconds)

    # -- proposing --------------------------------------------------------------------

    def propose(self, wanted: list[tuple[Sequence, int]]) -> None:
        """Draft ``k`` tokens greedily for each ``(seq, k)`` into ``seq.spec.drafts``: the
        draft's cells catch up with the sequence's text (``prompt + out``; its last token
        not yet fed to the served model), then one draft decode per depth. A failed draft
        decode leaves those sequences without drafts (they decode plainly this step).

        The catch-up feeds at most the draft's ``n_batch`` tokens a step, all sequences
        together: a sequence further behind (a long prompt) feeds a part and decodes
        plainly until it has caught up, so one step never prefills a whole prompt in the
        draft while every other sequence waits. A step that catches up a prompt (over
        :data:`USUAL_CATCH_UP` tokens) is not a measure of its ``k``."""
        if not wanted:
            return
        model = self.model
        entries: list[tuple[Sequence, int, int, bool]] = []  # (seq, token, pos, logits)
        budget = model.n_batch  # catch-up tokens this step, every sequence's together
        for seq, _ in wanted:
            assert seq.spec is not None
            seq.spec.drafts, seq.spec.q = [], []
            text = seq.prompt + seq.out
            held = self._reconcile(seq.slot, text)
            missing = len(text) - len(held)
            if missing > USUAL_CATCH_UP:  # a prompt: its catch-up is in this step's time,
                self._capped = True  # which is then no measure of k
            if missing > budget:  # a part now, the rest in later steps: a long prompt
                for pos in range(len(held), len(held) + budget):  # never its last token
                    entries.append((seq, text[pos], pos, False))
                held.extend(text[len(held) : len(held) + budget])
                budget = 0
                self._emitted += 1  # no drafts: it decodes plainly this step
                continue
            budget -= missing
            for pos in range(len(held), len(text)):
                entries.append((seq, text[pos], pos, pos == len(text) - 1))
            held.extend(text[len(held) :])
        for start in range(0, len(entries), model.n_batch):  # catch-up, in batch-sized parts
            part = entries[start : start + model.n_batch]
            for i, (seq, token, pos, logits) in enumerate(part):
                model.put(i, token, pos, seq.slot, logits)
            if not self._decode(len(part)):
                return self._abandon(wanted)
            for i, (seq, _, _, logits) in enumerate(part):
                if logits:
                    self._pick(seq, model.row(i))
        ks = {id(seq): k for seq, k in wanted}
        for _depth in range(1, max(ks.values())):
            going = [s for s, k in wanted if s.spec and 0 < len(s.spec.drafts) < k]
            going = [s for s in going if s.spec and s.spec.drafts[-1] not in model.eog_set]
            if not going:
                break
            for i, seq in enumerate(going):
                assert seq.spec is not None
                held = self.held[seq.slot]
                model.put(i, seq.spec.drafts[-1], len(held), seq.slot, True)
                held.append(seq.spec.drafts[-1])
            if not self._decode(len(going)):
                return self._abandon(wanted)
            for i, seq in enumerate(going):
                self._pick(seq, model.row(i))
        return None

    def _reconcile(self, slot: int, text: list[int]) -> list[int]:
        """Keep the draft's cells of ``slot`` that ``text`` begins with, but never all of
        ``text`` (its last token is fed again, for its row); the tokens they hold."""
        held = self.held[slot]
        common = 0
        for a, b in zip(held, text[:-1], strict=False):
            if a != b:
                break
            common += 1
        if common < len(held) and not self.model.keep_prefix(slot, common):
            self.model.clear(slot)
            common = 0
        del held[common:]
        return held

    def _pick(self, seq: Sequence, row: Any) -> None:
        """The draft's next token from its row: the sequence's biases and ``min_tokens``
        ban applied, as the served model's token will be picked; a sampled sequence's
        drawn from the transformed row, which is kept for the check."""
        spec = seq.spec
        assert spec is not None
        ahead = len(spec.drafts)
        if spec.draws is None:
            banned = self._banned(seq, ahead)
            spec.drafts.append(greedy_in_place(row, seq.bias_ids, seq.bias_values, banned))
            return
        q = self._distribution(seq, row, ahead)  # [V]
        spec.q.append(q)
        spec.drafts.append(spec.draws.draft(q, seq.generated + ahead))

    def _distribution(self, seq: Sequence, row: Any, ahead: int) -> Any:
        """A sampled sequence's probabilities from a row of logits ``ahead`` tokens past
        what it generated: biases, the ``min_tokens`` ban, then temperature, top-k,
        top-p and min-p as ``engines/sampling.py`` applies them. # [V]"""
        logits = np.array(row, dtype=np.float64)
        if seq.bias_ids is not None and seq.bias_values is not None:
            logits[seq.bias_ids] += seq.bias_values
        banned = self._banned(seq, ahead)
        if banned:
            logits[banned] = -np.inf
        s = seq.sampling
        return distribution(
            logits, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p
        )

    def _banned(self, seq: Sequence, ahead: int) -> list[int] | None:
        """The tokens banned ``ahead`` tokens past what ``seq`` has generated."""
        s = seq.sampling
        banned = seq.generated + ahead < s.min_tokens and not s.ignore_eos
        return self.model.eog_tokens if banned and self.model.eog_tokens else None

    def _decode(self, n: int) -> bool:
        rc = self.model.decode(n)
        if rc == 0:
            return True
        self.failures += 1
        log.warning("worker: a draft decode failed (%s)", self.model.decode_failure(rc))
        return False

    def _abandon(self, wanted: list[tuple[Sequence, int]]) -> None:
        """A draft decode failed: no drafts this step, and the cells of every slot taking
        part are cleared (which of them the failed decode wrote is not known)."""
        for seq, _ in wanted:
            assert seq.spec is not None
            seq.spec.drafts, seq.spec.q = [], []
            self.forget(seq.slot)
            self._emitted += 1  # it decodes plainly this step

    def forget(self, slot: int) -> None:
        """Clear the draft's cells of ``slot`` (its sequence failed, or what they hold is
        not known)."""
        self.model.clear(slot)
        self.held[slot].clear()

    # -- checking -------------------------------------------------------------------

    def verdict(self, served: WorkerModel, seq: Sequence, index: int, rows: Rows) -> Verdict:
        """What ``seq`` keeps of its drafts, from the served model's rows at batch entries
        ``index..index+k`` (its greedy token at each place, picked as plain decoding picks
        it); the counts and the controller learn it, and the draft's cells past what was
        kept are dropped."""
        spec = seq.spec
        assert spec is not None
        drafts, spec.drafts = spec.drafts, []
        q, spec.q = spec.q, []
        if spec.draws is not None:  # the standard rule on the transformed rows
            places = range(len(drafts) + 1)
            p = [self._distribution(seq, served.row_in(rows, index + i), i) for i in places]
            verdict = verify(drafts, np.array(q), np.array(p), spec.draws, seq.generated)
        else:
            targets = []
            for i in range(len(drafts) + 1):
                banned = self._banned(seq, i)
                row = served.row_in(rows, index + i)  # [V]
                targets.append(greedy_in_place(row, seq.bias_ids, seq.bias_values, banned))
            verdict = verify_greedy(drafts, targets)
        spec.drafted += len(drafts)
        spec.accepted += verdict.accepted
        spec.cycles += 1
        self._emitted += len(verdict.emitted(drafts))
        # the draft fed the text, then d_1..d_{k-1}: keep the text and the kept drafts
        held = self.held[seq.slot]
        keep = len(seq.prompt) + len(seq.out) + verdict.accepted
        if len(held) > keep:
            if not self.model.keep_prefix(seq.slot, keep):
                self.forget(seq.slot)
            else:
                del held[keep:]
        return verdict
