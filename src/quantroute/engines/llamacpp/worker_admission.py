"""How a llama.cpp worker turns a command into a sequence (worker process): the checks
that refuse it (a context too short, token ids outside the vocabulary, a grammar that
does not parse or cannot end within ``max_tokens``) and the way it will sample.

A ``gen`` gets its own llama.cpp sampler chain (``sampler_chain.py``: logit bias and
``ignore_eos``, the penalties, the ``min_tokens`` ban, then greedy or temperature /
top-k / top-p / min-p and a draw seeded by ``seed``), built here and freed when the
sequence ends however it ends. Three kinds read the row in numpy instead
(``worker_sequence.py``): a greedy request with no penalties and no logprobs (numpy's
argmax over llama.cpp's row: 18 µs at a 32k vocabulary, where the chain's greedy
sampler copies the row into a candidate array and takes 80), a request with logprobs
(the chain picks; the row gives the log-probabilities) and one with a grammar
(``constrained.py``: the closing path needs the masked row). ``--sampler numpy``
samples every request in numpy, as a reference for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from quantroute.engines.llamacpp import wire
from quantroute.engines.llamacpp.constrained import ClosingOrder, Grammar, GrammarError
from quantroute.engines.llamacpp.sampler_chain import SamplerChain
from quantroute.engines.llamacpp.scoring import Comparison, LogitsDump
from quantroute.engines.llamacpp.worker_model import WorkerModel
from quantroute.engines.llamacpp.worker_sequence import SCORING, Sequence
from quantroute.engines.sampling import GREEDY_BELOW, Penalties
from quantroute.engines.stops import StopMatcher

Tokens = Callable[[], list[int]]
"""A command's prompt tokens, when asked (the tokenizer thread's, or tokenized then)."""


class Refused(Exception):
    """The command is refused; ``event`` says why, to the gateway."""

    def __init__(self, event: wire.Error):
        super().__init__(event.message or event.code)
        self.event = event


def scoring_failed(exc: BaseException) -> str:
    return f"scoring failed: {exc}" if str(exc) else f"scoring failed: {type(exc).__name__}"


class Admission:
    """Builds the sequences of one worker's commands (raises :class:`Refused`, or
    ``ValueError`` for a command no gateway sends)."""

    def __init__(self, model: WorkerModel, sampler: str):
        self._model = model
        self._sampler = sampler  # "chain" (llama.cpp's); "numpy", a reference for tests
        self._closing_order: ClosingOrder | None = None  # made with the first grammar

    def generation(self, cmd: wire.Generate, tokens: Tokens) -> Sequence:
        model, s = self._model, cmd.sampling
        if cmd.prompt_ids is not None:  # token ids, used as they are (no BOS added)
            prompt = list(cmd.prompt_ids)
            if not prompt or any(not 0 <= t < model.n_vocab for t in prompt):
                raise ValueError("a prompt token id is outside the vocabulary")
        else:
            fewest = model.fewest_tokens(cmd.prompt)
            least = 1 if s.fit_context else s.max_tokens
            if fewest + least > model.n_ctx:  # it cannot fit, whatever it tokenizes to
                raise Refused(_too_long(cmd.id, fewest, least, model.n_ctx, at_least=True))
            prompt = tokens()
        max_tokens = s.max_tokens
        if s.fit_context:
            max_tokens = max(1, min(max_tokens, model.n_ctx - len(prompt)))
        if len(prompt) + max_tokens > model.n_ctx:
            raise Refused(_too_long(cmd.id, len(prompt), max_tokens, model.n_ctx))
        seq = Sequence(
            rid=cmd.id,
            prompt=prompt,
            sampling=s,
            max_tokens=max_tokens,
            rng=np.random.default_rng(None if s.seed is None else s.seed % 2**64),
            stops=StopMatcher(s.stop),
            penalties=Penalties(s.presence_penalty, s.frequency_penalty, s.repetition_penalty),
            stamps=[time.time_ns()] if cmd.trace else None,
        )
        bias = {t: b for t, b in s.logit_bias}  # a repeat: the last
        if any(not 0 <= t < model.n_vocab for t in bias):
            raise ValueError("a logit_bias token id is outside the vocabulary")
        if s.ignore_eos:
            bias |= dict.fromkeys(model.eog_tokens, -np.inf)
        # The numpy row (a grammar's sampling; logprobs, which need the row) is built only
        # for the requests that need it; everyone else samples in llama.cpp's chain.
        chained = not s.grammar and self._sampler == "chain"
        wants_row = not chained or seq.wants_choice
        # Greedy with nothing but biases needs no chain: llama.cpp's greedy sampler first
        # copies the row into a V-long candidate array (80 µs at 32k tokens, measured),
        # numpy's argmax over the row where it lies takes 18. Same token: the first best.
        seq.argmax = chained and not wants_row and not seq.penalties.active
        seq.argmax = seq.argmax and not s.temperature >= GREEDY_BELOW
        if bias and (wants_row or seq.argmax):
            seq.bias_ids = np.array(list(bias), dtype=np.int64)
            seq.bias_values = np.array(list(bias.values()), dtype=np.float32)
        if seq.penalties.active and wants_row:
            seq.counts = np.zeros(model.n_vocab, dtype=np.int32)
            seq.seen = np.zeros(model.n_vocab, dtype=np.bool_)
            seq.seen[prompt] = True
        if s.grammar:
            seq.grammar = self._grammar(cmd.id, s.grammar, max_tokens)
        elif chained and not seq.argmax:
            seq.chain = SamplerChain(
                n_vocab=model.n_vocab,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                min_p=s.min_p,
                seed=s.seed,
                bias=bias,
                penalties=seq.penalties,
                prompt=prompt,
                window=model.n_ctx,
                ban=model.eog_tokens if s.min_tokens > 0 and not s.ignore_eos else (),
            )
        return seq

    def _grammar(self, rid: str, gbnf: str, max_tokens: int) -> Grammar:
        """The sequence's grammar; refused when it does not parse or its shortest output
        does not fit in ``max_tokens``."""
        model = self._model
        if self._closing_order is None:
            pieces = [model.piece_bytes(t) for t in range(model.n_vocab)]
            self._closing_order = ClosingOrder(pieces, model.eog_tokens)
        try:
            grammar = Grammar(model.vocab, model.n_vocab, gbnf, self._closing_order)
        except GrammarError as exc:
            raise Refused(wire.Error(rid, "invalid_grammar", str(exc))) from exc
        if grammar.closing_length(max_tokens) is None:
            grammar.close()
            words = (
                f"max_tokens ({max_tokens}) is too small for the shortest output the "
                "response format or tool call allows"
            )
            raise Refused(wire.Error(rid, "grammar_too_long", words))
        return grammar

    def scoring(self, cmd: wire.WriteLogits | wire.Score, tokens: Tokens) -> Sequence:
        """Teacher-force ``prompt + tokens``; write the logits rows that predicted each of
        ``tokens`` to a file (``logits``), or compare them with a reference's file
        (``score``). The drift monitor does one, then the other."""
        model = self._model
        prompt = tokens()
        scored = cmd.tokens
        if isinstance(cmd, wire.WriteLogits) and cmd.text is not None and not scored:
            # a remote branch's answer, as text (bounded by the gateway: limit tokens'
            # worth of characters); its ids go back with the logits
            scored = model.tokenize(cmd.text, False, bos=False)[: max(cmd.limit, 0)]
        if any(not 0 <= t < model.n_vocab for t in scored):
            raise ValueError("a token id is outside the vocabulary")
        if not scored or len(prompt) + len(scored) > model.n_ctx:
            raise Refused(_too_long(cmd.id, len(prompt), len(scored), model.n_ctx))
        seq = Sequence(
            rid=cmd.id,
            prompt=prompt + scored[:-1],
            sampling=SCORING,
            max_tokens=0,
            rng=np.random.default_rng(0),
            stops=StopMatcher(()),
            first_scored=len(prompt) - 1,
        )
        try:
            if isinstance(cmd, wire.WriteLogits):
                ids = (*prompt, *scored) if cmd.text is not None else ()  # what a remote needs
                seq.job = LogitsDump(cmd.path, len(scored), model.n_vocab, ids)
            else:
                ref = cmd.reference
                seq.job = Comparison(ref.path, ref.shape, len(scored), model.n_vocab)
        except (OSError, ValueError) as exc:
            raise Refused(wire.Error(cmd.id, "engine_error", scoring_failed(exc))) from exc
        return seq


def _too_long(
    rid: str, pt: int, max_tokens: int, n_ctx: int, *, at_least: bool = False
) -> wire.Error:
    return wire.Error(
        rid,
        "context_length_exceeded",
        prompt_tokens=pt,
        max_tokens=max_tokens,
        n_ctx=n_ctx,
        at_least=at_least,
    )
