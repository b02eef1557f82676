"""A sequence's sampling in C: one llama.cpp sampler chain per sequence.

The worker builds a :class:`SamplerChain` when it admits a ``gen`` (any
sampling but a grammar's, see ``engines/llamacpp/constrained.py``) and frees it when
the sequence ends. Each step ``llama_sampler_sample`` reads the sequence's row
of logits inside llama.cpp, so nothing vocabulary-sized is copied into Python.
The chain, in order, keeps the meanings of ``engines/sampling.py``:

1. ``logit_bias``: the request's biases (a token biased twice: the last one
   counts, as in numpy's ``row[ids] += values``), ``-inf`` on every
   end-of-generation token with ``ignore_eos``;
2. ``repetition_penalty`` (vLLM's meaning: over the prompt *and* the output):
   a penalties sampler that accepted the prompt's tokens when it was built
   and accepts each sampled one;
3. ``frequency_penalty`` / ``presence_penalty`` (over the output only): a
   second penalties sampler that accepts only sampled tokens;
4. with ``min_tokens``, ``-inf`` on end-of-generation, removed from the chain
   once that many tokens are out (:meth:`SamplerChain.lift_ban`);
5. greedy (``temperature`` below :data:`~quantroute.engines.sampling.GREEDY_BELOW`),
   else temperature, then top-k, top-p and min-p (temperature first, as
   ``sampling.py`` does), then a draw seeded by ``seed``.

Greedy picks the first token with the highest logit, as ``numpy.argmax``
does, so greedy text is what the numpy sampler gave. A seeded draw repeats
for the same seed, but uses llama.cpp's generator (``std::mt19937``), not
numpy's: sampled text for a given seed differs from what the numpy sampler
drew. Without a seed, llama.cpp seeds it from the system.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterable, Mapping
from typing import Any

import llama_cpp as lc
import numpy as np
import numpy.typing as npt

from quantroute.engines.sampling import GREEDY_BELOW, Penalties

__all__ = ["SamplerChain", "chain_seed"]

_NO_SEED = lc.LLAMA_DEFAULT_SEED  # llama.cpp: seed from the system
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data


def chain_seed(seed: int | None) -> int:
    """A request's ``seed`` (any int the schema admits) as llama.cpp's uint32 seed;
    never ``LLAMA_DEFAULT_SEED``, which would mean "no seed". ``None`` is no seed."""
    return _NO_SEED if seed is None else seed % _NO_SEED


class SamplerChain:
    """One sequence's llama.cpp sampler chain (module docstring); :meth:`close` frees it.

    ``window`` is the longest a sequence gets (its context): the penalties
    samplers count that many tokens back, i.e. all of them."""

    def __init__(
        self,
        *,
        n_vocab: int,
        temperature: float,
        top_p: float,
        top_k: int,
        min_p: float,
        seed: int | None,
        bias: Mapping[int, float],
        penalties: Penalties,
        prompt: Iterable[int],
        window: int,
        ban: Iterable[int] = (),
    ):
        params = lc.llama_sampler_chain_default_params()
        params.no_perf = True
        self._chain: Any = lc.llama_sampler_chain_init(params)
        self._ban_at = -1  # the index of the min_tokens ban in the chain, while it is there
        if bias:
            self._add(_logit_bias(n_vocab, bias))
        if penalties.repetition != 1.0:
            repeat = lc.llama_sampler_init_penalties(
                n_vocab, window, penalties.repetition, 0.0, 0.0
            )
            # only whether a token was seen counts here (no frequency or presence term,
            # and a window as long as the context never forgets): each distinct one once
            for token in set(prompt):
                lc.llama_sampler_accept(repeat, int(token))
            self._add(repeat)
        if penalties.frequency or penalties.presence:
            self._add(
                lc.llama_sampler_init_penalties(
                    n_vocab, window, 1.0, penalties.frequency, penalties.presence
                )
            )
        banned = {token: -math.inf for token in ban}
        if banned:
            self._ban_at = lc.llama_sampler_chain_n(self._chain)
            self._add(_logit_bias(n_vocab, banned))
        self.greedy = not temperature >= GREEDY_BELOW  # nan too, as sampling.sample does
        if self.greedy:
            self._add(lc.llama_sampler_init_greedy())
            return
        self._add(lc.llama_sampler_init_temp(temperature))
        if 0 < top_k < n_vocab:
            self._add(lc.llama_sampler_init_top_k(top_k))
        if top_p < 1.0:
            self._add(lc.llama_sampler_init_top_p(top_p, 1))
        if min_p > 0.0:
            self._add(lc.llama_sampler_init_min_p(min_p, 1))
        self._add(lc.llama_sampler_init_dist(chain_seed(seed)))

    def _add(self, sampler: Any) -> None:
        lc.llama_sampler_chain_add(self._chain, sampler)  # the chain owns it from here

    @property
    def closed(self) -> bool:
        return not self._chain

    def sample(self, ctx: Any, index: int) -> int:
        """The next token from the logits llama.cpp holds for batch row ``index``; the
        chain accepts it (the penalties count it)."""
        return int(lc.llama_sampler_sample(self._chain, ctx, index))

    def accept(self, token: int) -> None:
        """Count ``token`` as sampled, as :meth:`sample` and :meth:`draw` do themselves."""
        lc.llama_sampler_accept(self._chain, token)

    def draw(self, logits: npt.ArrayLike) -> int:
        """One token from a row of logits given here (``[V]``), accepted: :meth:`sample`
        without a model, for tests and benchmarks."""
        _data, arr = _token_data(logits)  # _data: the memory arr points at
        lc.llama_sampler_apply(self._chain, ctypes.byref(arr))
        token = int(_view(arr)["id"][arr.selected])
        self.accept(token)
        return token

    def distribution(self, logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """The probabilities the chain draws from for this row (``[V]``, zero outside the
        kept tokens): every sampler but the last (the draw) applied, then the softmax.
        Greedy is all mass on the token it picks."""
        data, arr = _token_data(logits)
        out = np.zeros(data.size)
        n = lc.llama_sampler_chain_n(self._chain)
        for i in range(n - 1):
            lc.llama_sampler_apply(lc.llama_sampler_chain_get(self._chain, i), ctypes.byref(arr))
        kept = _view(arr)
        values = kept["logit"].astype(np.float64)
        if self.greedy:
            out[kept["id"][int(np.argmax(values))]] = 1.0
            return out
        with np.errstate(over="ignore", under="ignore"):
            weights = np.exp(values - values.max())
        out[kept["id"]] = weights / weights.sum()
        return out

    def lift_ban(self) -> None:
        """``min_tokens`` tokens are out: end-of-generation may be sampled again."""
        if self._ban_at >= 0:
            lc.llama_sampler_free(lc.llama_sampler_chain_remove(self._chain, self._ban_at))
            self._ban_at = -1

    def close(self) -> None:
        """Free the chain and every sampler in it; a second call does nothing."""
        if self._chain:
            lc.llama_sampler_free(self._chain)
            self._chain = None


def _token_data(logits: npt.ArrayLike) -> tuple[npt.NDArray[Any], Any]:
    row = np.asarray(logits, dtype=np.float32).reshape(-1)
    data = np.zeros(row.size, dtype=_TOKEN_DATA)
    data["id"] = np.arange(row.size, dtype=np.int32)
    data["logit"] = row
    arr = lc.llama_token_data_array(
        data=data.ctypes.data_as(lc.llama_token_data_p), size=row.size, selected=-1, sorted=False
    )
    return data, arr  # `data` owns the memory `arr` points at


def _view(arr: Any) -> npt.NDArray[Any]:
    """The candidates a sampler left in ``arr`` (it may have moved and cut them)."""
    size = int(arr.size)
    raw = (ctypes.c_char * (size * _TOKEN_DATA.itemsize)).from_address(
        ctypes.cast(arr.data, ctypes.c_void_p).value or 0
    )
    return np.frombuffer(memoryview(raw), dtype=_TOKEN_DATA).copy()


def _logit_bias(n_vocab: int, bias: Mapping[int, float]) -> Any:
    entries = (lc.llama_logit_bias * len(bias))()
    for entry, (token, value) in zip(entries, bias.items(), strict=True):
        entry.token = token
        entry.bias = value
    # llama.cpp copies the entries: `entries` may go when this returns
    return lc.llama_sampler_init_logit_bias(n_vocab, len(bias), entries)
