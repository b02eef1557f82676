"""One sequence a llama.cpp worker decodes (worker process): its state, and how its next
token is picked from its row of logits.

A sequence samples one of four ways, chosen when it is admitted
(:mod:`.worker_admission`): llama.cpp's sampler chain (:mod:`.sampler_chain`; the row
never leaves llama.cpp), numpy's argmax over the row where llama.cpp holds it (greedy
with nothing but biases), a grammar's masked row (:mod:`.constrained`), or numpy's
sampler (``--sampler numpy``, the reference the chain is tested against). A request
with logprobs reads its row in numpy too, biased and penalized as its chain sees it.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quantroute.engines.base import SamplingParams
from quantroute.engines.llamacpp.constrained import Grammar
from quantroute.engines.llamacpp.sampler_chain import SamplerChain
from quantroute.engines.llamacpp.scoring import ScoringJob
from quantroute.engines.llamacpp.worker_model import Rows, WorkerModel
from quantroute.engines.llamacpp.worker_speculative import SpecState
from quantroute.engines.sampling import (
    Choice,
    Penalties,
    choice_of,
    greedy_in_place,
    penalize,
    sample,
)
from quantroute.engines.stops import StopMatcher

SCORING = SamplingParams(max_tokens=0, temperature=0.0)
"""A scoring job's sampling: it samples nothing (its rows go to its job)."""


def _utf8_decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")("replace")


@dataclass(slots=True)
class Sequence:
    rid: str
    prompt: list[int]
    sampling: SamplingParams  # as the command carried it; SCORING for a scoring job
    max_tokens: int  # sampling.max_tokens, or what the context leaves (fit_context)
    rng: np.random.Generator
    stops: StopMatcher
    bias_ids: np.ndarray[Any, Any] | None = None
    bias_values: np.ndarray[Any, Any] | None = None
    penalties: Penalties = field(default_factory=Penalties)
    counts: np.ndarray[Any, Any] | None = None  # [V] generated tokens, with penalties
    seen: np.ndarray[Any, Any] | None = None  # [V] prompt or generated, with penalties
    grammar: Grammar | None = None  # response_format / a forced tool call
    chain: SamplerChain | None = None  # llama.cpp's sampling, for every gen but a grammar's
    argmax: bool = False  # greedy, biases at most: the argmax of llama.cpp's row, in place
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
    decoder: codecs.IncrementalDecoder = field(default_factory=_utf8_decoder)
    # a traced request (its gen command carried a trace context): wall-clock ns when
    # admitted, given a slot, finished; sent back on "fin" for the gateway's decode span
    stamps: list[int] | None = None
    spec: SpecState | None = None  # speculative decoding (worker_speculative.py)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    @property
    def wants_choice(self) -> bool:
        """Whether its tokens carry logprobs (so its row is read in numpy)."""
        return self.sampling.logprobs or self.sampling.top_logprobs > 0

    @property
    def banned_eog(self) -> bool:
        """End-of-generation is banned (``min_tokens`` not yet reached)."""
        s = self.sampling
        return self.generated < s.min_tokens and not s.ignore_eos


def pick(
    model: WorkerModel, seq: Sequence, index: int, rows: Rows | None
) -> tuple[int, Choice | None]:
    """``seq``'s next token from batch entry ``index``'s logits, and its logprobs when it
    wants them (``rows``: this step's rows, for an argmax sequence). A negative token:
    a grammar with no way on."""
    s = seq.sampling
    if seq.argmax and rows is not None:
        return _argmax(model, seq, index, rows), None
    if seq.chain is not None:
        token = model.sample(seq.chain, index)  # llama.cpp's: the row stays there
        if not seq.wants_choice:
            return token, None
        row = _row(model, seq, index)
        return token, choice_of(row, token, want_logprob=s.logprobs, n_top=s.top_logprobs)
    if seq.grammar is not None:
        return _constrained(model, seq, _row(model, seq, index), index)
    choice = sample(  # --sampler numpy: the reference the chain is tested against
        _row(model, seq, index),
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        rng=seq.rng,
        min_p=s.min_p,
        want_logprob=s.logprobs,
        n_top=s.top_logprobs,
    )
    return choice.token, choice


def _row(model: WorkerModel, seq: Sequence, index: int) -> Any:
    """The sequence's row of logits in numpy, biased, penalized and with the
    ``min_tokens`` ban, as its chain sees it: for a grammar, or for logprobs. # [V]"""
    logits = model.row(index)  # [V], a view
    if seq.bias_ids is not None:
        logits = logits.copy()
        logits[seq.bias_ids] += seq.bias_values
    if seq.counts is not None and seq.seen is not None:
        logits = penalize(logits, seq.penalties, seq.counts, seq.seen)
    if seq.banned_eog and model.eog_tokens:
        logits = np.array(logits, dtype=np.float64)
        logits[model.eog_tokens] = -np.inf
    return logits


def _argmax(model: WorkerModel, seq: Sequence, index: int, rows: Rows) -> int:
    """A greedy sequence's token: its biases and ``min_tokens`` ban written into its row
    (llama.cpp's buffer, read by nothing else before the next decode), then the first
    highest logit, as llama.cpp's greedy sampler picks it."""
    row = model.row_in(rows, index)  # [V]
    banned = seq.banned_eog and model.eog_tokens
    return greedy_in_place(row, seq.bias_ids, seq.bias_values, model.eog_tokens if banned else None)


def _constrained(model: WorkerModel, seq: Sequence, logits: Any, index: int) -> tuple[int, Choice]:
    """The next token of a sequence with a grammar: sampled among the tokens the
    grammar allows while the closing path fits in the tokens left after it, else the
    closing path's (``engines/llamacpp/constrained.py``)."""
    grammar = seq.grammar
    assert grammar is not None
    s = seq.sampling
    masked = grammar.mask(logits)
    if not np.isfinite(masked).any():  # min_tokens banned the only way out: let it end
        masked = grammar.mask(model.row(index))
    left = min(seq.max_tokens - seq.generated, model.n_ctx - seq.n_past)
    token = -1
    if not grammar.closing:
        token = sample(
            masked,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            rng=seq.rng,
            min_p=s.min_p,
        ).token
        fits = token in model.eog_set or (grammar.closing_length(left - 1, after=token) is not None)
        grammar.closing = not fits
    if grammar.closing:
        token = grammar.closing_token(left)
    return token, choice_of(masked, token, want_logprob=s.logprobs, n_top=s.top_logprobs)
