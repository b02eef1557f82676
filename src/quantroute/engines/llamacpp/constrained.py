"""A sequence's grammar in the worker: llama.cpp's GBNF sampler, driven from numpy.

Each step the grammar masks the row of logits (tokens it does not allow get
``-inf``; end-of-generation only where the grammar may end; and any token after
which the output would not be UTF-8, which llama.cpp's sampler does not check), the
worker's own sampler picks among the rest, and the grammar accepts the pick.

A grammar alone does not make generation end: a model can stay inside a string
for ever, and ``max_tokens`` would then cut the value in half. So each step
also keeps the *closing path* in reach: a short way (found greedily, see
:meth:`Grammar.closing_length`, and out of loops: a state met again takes the next
allowed token) from the grammar's state to its end. A token is
taken only if, after it, the closing path still fits in the tokens left;
otherwise the sequence *closes*: from then on it follows the closing path —
end-of-generation where allowed, else ``"``, ``}``, ``]``, a digit, then any
allowed token — and ends complete, with ``finish_reason`` ``"length"`` (the
budget, not the model, ended it). By induction every sequence ends with output
the grammar accepts, within ``max_tokens``, whatever the model samples. A
request whose ``max_tokens`` is shorter than the grammar's shortest output is
refused before it starts.
"""

from __future__ import annotations

import codecs
import ctypes
from typing import Any

import llama_cpp as lc
import numpy as np

__all__ = ["ClosingOrder", "Grammar", "GrammarError"]

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
# The closing path prefers these, in order, after end-of-generation: each closes a
# string (or opens one that the next step closes),
# value, a string, a container; the printable rest follows (forced literals).
_PREFERRED = '"}]0123456789ntf,:'


_NO_LOOPS: dict[bytes, int] = {}  # the greedy path's visits: none are counted


class GrammarError(ValueError):
    """llama.cpp could not parse the grammar."""


class ClosingOrder:
    """The tokens a closing path may take, in order of preference, for one vocabulary:
    end-of-generation tokens, then the single-character tokens of :data:`_PREFERRED`,
    then every other printable ASCII one (space and newline last); where none of them
    is allowed, the lowest token id that is."""

    def __init__(self, pieces: list[bytes], eog: list[int]):
        by_piece: dict[bytes, int] = {}
        for token, piece in enumerate(pieces):
            if len(piece) == 1 and token not in eog:
                by_piece.setdefault(piece, token)
        chars = [c.encode() for c in _PREFERRED]
        chars += [bytes([b]) for b in range(0x21, 0x7F) if bytes([b]) not in chars]
        chars += [b" ", b"\n", b"\t"]
        ordered = list(eog) + [by_piece[c] for c in chars if c in by_piece]
        self.tokens = np.array(ordered, dtype=np.int32)  # [C]
        self.eog = frozenset(eog)
        self.pieces = pieces
        # [V] what a token may follow a whole character with: its bytes begin UTF-8 text.
        # Not a control token (<s>, <unk>): the worker writes nothing for it, where the
        # grammar would read its special text ("<s>" in a string), so the two part ways.
        self.fresh = np.array(
            [
                utf8_after(b"", p) is not None and (p != b"" or t in eog)
                for t, p in enumerate(pieces)
            ],
            dtype=bool,
        )


def utf8_after(pending: bytes, piece: bytes) -> bytes | None:
    """The bytes of a character still incomplete once ``piece`` follows ``pending`` (the
    incomplete one before it), or ``None`` when they are not UTF-8, or cannot become
    it: an overlong form, a surrogate, past U+10FFFF. llama.cpp's grammar sampler reads
    bytes leniently (``E0 92 BC`` passes as U+04BC), and the worker would decode each
    bad byte as U+FFFD, which a string's ``maxLength`` or pattern does not count on."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    decoder.setstate((pending, 0))
    try:
        decoder.decode(piece)
    except UnicodeDecodeError:
        return None
    rest: bytes = decoder.getstate()[0]
    if rest[:1] == b"\xed" and rest[1:2] >= b"\xa0":  # a surrogate: refused only at its end
        return None
    return rest


class Grammar:
    """One sequence's grammar state (``llama_sampler_init_grammar``); :meth:`close`
    frees it."""

    def __init__(self, vocab: Any, n_vocab: int, gbnf: str, order: ClosingOrder):
        self._smpl = lc.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
        if not self._smpl:
            raise GrammarError("llama.cpp could not parse the grammar")
        self._order = order
        self._row = np.zeros(n_vocab, dtype=_TOKEN_DATA)  # [V]
        self._row["id"] = np.arange(n_vocab, dtype=np.int32)
        self._few = np.zeros(order.tokens.size, dtype=_TOKEN_DATA)  # [C]
        self._few["id"] = order.tokens
        self.closing = False  # following the closing path (the budget ran short)
        self._pending = b""  # the output's last character, while its bytes are incomplete
        self._visits: dict[bytes, int] | None = None  # closing: the path's states so far
        self._loops_first = False  # the greedy path was seen stuck in a loop: try that last

    def close(self) -> None:
        if self._smpl:
            lc.llama_sampler_free(self._smpl)
            self._smpl = None

    def mask(self, logits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """``logits`` (``[V]``) with every token the grammar does not allow now at ``-inf``."""
        self._row["logit"] = logits
        _apply(self._smpl, self._row)
        masked = self._row["logit"].astype(np.float64)
        if not _keep_utf8(masked, self._pending, self._order):
            masked = self._row["logit"].astype(np.float64)  # what the grammar allowed
        return masked

    def accept(self, token: int) -> None:
        """Advance past ``token``, which :meth:`mask` allowed (llama.cpp aborts the
        process on a token its grammar does not allow)."""
        lc.llama_sampler_accept(self._smpl, token)
        if token not in self._order.eog:
            self._pending = utf8_after(self._pending, self._order.pieces[token]) or b""

    def allows(self, token: int) -> bool:
        one = np.zeros(1, dtype=_TOKEN_DATA)
        one["id"] = token
        _apply(self._smpl, one)
        return bool(np.isfinite(one["logit"][0]))

    def closing_token(self, limit: int) -> int:
        """The next token of the closing path (end-of-generation when the grammar may
        end); -1 when no token is allowed. The path is the one :meth:`closing_length`
        found within ``limit`` tokens from the state where closing began."""
        if self._visits is None:  # closing begins here: the first way that fits, as checked
            for visits in self._ways():
                if self._walk(limit, None, visits) is not None:
                    break
            self._visits = visits if visits is _NO_LOOPS else {}
        return self._closing_step(self._smpl, self._visits, self._pending)

    def closing_length(self, limit: int, after: int | None = None) -> int | None:
        """How many tokens the closing path takes (end-of-generation not counted), from
        the current state or, with ``after``, from the state after that token; ``None``
        when it takes more than ``limit`` or gets stuck. Two ways are tried: the greedy
        path (the first token the closing order allows, each step) and the one that
        leaves a state met again by another token (:meth:`_closing_step`); the greedy
        first, until it was once seen stuck where the other was not."""
        greedy_stuck = False
        for visits in self._ways():
            steps = self._walk(limit, after, visits)
            if steps is not None:
                self._loops_first = self._loops_first or greedy_stuck
                return steps
            greedy_stuck = visits is _NO_LOOPS
        return None

    def _ways(self) -> tuple[dict[bytes, int], dict[bytes, int]]:
        """The visits of the two ways, in the order they are tried (a fresh count for
        the loop-leaving one)."""
        return ({}, _NO_LOOPS) if self._loops_first else (_NO_LOOPS, {})

    def _walk(self, limit: int, after: int | None, visits: dict[bytes, int]) -> int | None:
        clone = lc.llama_sampler_clone(self._smpl)
        pieces, pending = self._order.pieces, self._pending
        try:
            if after is not None:
                lc.llama_sampler_accept(clone, after)
                if after not in self._order.eog:
                    pending = utf8_after(pending, pieces[after]) or b""
            for steps in range(limit + 1):
                token = self._closing_step(clone, visits, pending)
                if token < 0:
                    return None
                if token in self._order.eog:
                    return steps
                lc.llama_sampler_accept(clone, token)
                if pending or not pieces[token].isascii():  # else nothing is pending after
                    pending = utf8_after(pending, pieces[token]) or b""
            return None
        finally:
            lc.llama_sampler_free(clone)

    def _closing_step(self, smpl: Any, visits: dict[bytes, int], pending: bytes) -> int:
        """The closing path's next token: the first the closing order allows. Counting
        ``visits`` (not :data:`_NO_LOOPS`), a state met before on this path (known by the
        order's tokens it allows) takes, on its k-th visit, the k-th allowed token, so
        that a loop the first choice never leaves is left by another (in ``[^@]+@``,
        ``}`` stays in the class for ever). End-of-generation whenever allowed. Inside a
        character (``pending``), only the tokens that go on with it as UTF-8."""
        few = self._few
        few["logit"] = 0.0
        if not pending:  # the order's tokens are one ASCII byte or end-of-generation
            _apply(smpl, few)
        ok = np.isfinite(few["logit"]) & (not pending)
        allowed = np.flatnonzero(ok)
        data = few
        if not allowed.size:  # none of the closing order: the tokens allowed at all
            data = self._row
            data["logit"] = 0.0
            _apply(smpl, data)
            logits = data["logit"].astype(np.float64)
            if not _keep_utf8(logits, pending, self._order):
                logits = data["logit"].astype(np.float64)  # what the grammar allowed
            ok = np.isfinite(logits)
            allowed = np.flatnonzero(ok)
            if not allowed.size:
                return -1
        first = int(data["id"][allowed[0]])
        if first in self._order.eog or visits is _NO_LOOPS:
            return first
        key = np.packbits(ok).tobytes()
        seen = visits.get(key, 0)
        visits[key] = seen + 1
        return int(data["id"][allowed[seen % allowed.size]])


def _keep_utf8(logits: np.ndarray[Any, Any], pending: bytes, order: ClosingOrder) -> bool:
    """``-inf``, in place, for each token after which the output would not be UTF-8:
    following a whole character, those whose bytes do not begin UTF-8 text; inside one
    (``pending``), those allowed that do not go on with it, and end-of-generation; and
    control tokens, which write nothing where the grammar reads their text. Whether any
    token is left: when none is (a class whose only way on, read leniently, is an
    overlong form) the caller takes what the grammar allowed, a byte the worker decodes
    as U+FFFD, not a row with no token to take (llama.cpp aborts on a token its grammar
    does not allow)."""
    if not pending:
        logits[~order.fresh] = -np.inf
    else:
        for token in np.flatnonzero(np.isfinite(logits)):
            piece = order.pieces[token]
            if token in order.eog or not piece or utf8_after(pending, piece) is None:
                logits[token] = -np.inf
    return bool(np.isfinite(logits).any())


def _apply(smpl: Any, data: np.ndarray[Any, Any]) -> None:
    """``llama_sampler_apply`` over a ``_TOKEN_DATA`` array, in place."""
    arr = lc.llama_token_data_array(
        data=data.ctypes.data_as(lc.llama_token_data_p),
        size=data.size,
        selected=-1,
        sorted=False,
    )
    lc.llama_sampler_apply(smpl, ctypes.byref(arr))
