"""Reading a remote server's top-k next-token log-probabilities along given tokens.

A remote branch is an OpenAI-compatible server (vLLM, SGLang, llama-server, another
quantroute) that serves a precision of the model. quantroute cannot read its logits,
only what ``/v1/completions`` returns: up to ``k`` (20) most likely tokens per
position with their log-probabilities. :class:`TopkClient` teacher-forces given
tokens (sent as ids, so the server's tokenizer is not involved) and reads, for every
scored position, the branch's top-k **and the log-probability of the token that
follows**, as a :class:`~quantroute.divergence.TopK`. Profiles
(:mod:`quantroute.quality.remote`) and the drift monitor (``OpenAIEngine.score``)
score those rows against the reference's full logits with
:func:`quantroute.divergence.kl_divergence_topk` (a lower bound of the full KLD).

Two ways to ask (:class:`Dialect`):

- ``echo``: one request per chunk, ``{"prompt": [ids], "echo": true, "logprobs": k,
  "max_tokens": 1, "return_tokens_as_token_ids": true}``. The server returns the
  prompt's log-probabilities: each prompt token's own and the top-k at its position,
  keyed ``"token_id:N"``. vLLM does this (``echo`` turns on ``prompt_logprobs``; k is
  capped by its ``--max-logprobs``, 20 by default).
- ``forced``: one request per scored position, ``{"prompt": ids[:i+1], "max_tokens": 1,
  "logprobs": k, "temperature": 0, "logit_bias": {"<next id>": 100}}``. The bias is a
  sampler step, applied after the log-probabilities are taken from the raw logits, so
  the one generated token is the reference's next token and its reported
  log-probability is the branch's unbiased ``log q(next)``, beside the unbiased top-k.
  llama-server (at llama.cpp 0c1e57098) answers this with token ids
  (``logprobs.content[0].id`` and ``top_logprobs[].id``) and reuses the previous
  request's KV cache, so each position costs one token's evaluation (about 4 ms for
  the demo model on this machine). Its ``/v1/completions`` ignores ``echo``.

With no ``dialect`` given, ``echo`` is tried on the first chunk and ``forced`` used if
the answer holds no prompt log-probabilities. A server whose answers list tokens as
text without ids, or hold no log-probabilities at all, cannot be measured: a
``ConfigError`` with code ``remote_no_logprobs`` says so, and the branch needs a
profile declared in its manifest.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Any

import httpx
import numpy as np

from quantroute.divergence import TopK, kl_divergence_topk, log_softmax, top1_agreement_topk
from quantroute.engines.base import ReferenceLogits, TokenScores
from quantroute.errors import ConfigError, EngineError

logger = logging.getLogger(__name__)

DEFAULT_TOP_K = 20  # OpenAI's chat top_logprobs cap, and vLLM's default --max-logprobs
FORCE_BIAS = 100.0  # OpenAI's largest logit_bias: enough to make any token the greedy one
NO_LOGPROBS = "remote_no_logprobs"
_TOKEN_ID = "token_id:"


class Dialect(StrEnum):
    """How a server is asked for teacher-forced log-probabilities (see the module)."""

    ECHO = "echo"
    FORCED = "forced"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """An OpenAI-compatible server: ``base_url`` is where ``/completions`` is appended
    (``http://gpu-box:8000/v1``); ``model`` is the served model's name (``None``: the one
    ``/models`` lists); ``api_key`` goes in ``Authorization: Bearer``."""

    base_url: str
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 120.0


def _no_logprobs(endpoint: Endpoint, what: str) -> ConfigError:
    return ConfigError(
        f"{endpoint.base_url} {what}, so its fidelity cannot be measured; declare the "
        "branch's profile in its manifest (profile: {mean_kld, top1})",
        code=NO_LOGPROBS,
    )


class TopkClient:
    """Reads a remote branch's top-k next-token log-probabilities along given tokens.

    Use as ``async with TopkClient(endpoint) as client: rows = await client.score(...)``.
    ``transport`` replaces the network (tests: ``httpx.MockTransport``).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        k: int = DEFAULT_TOP_K,
        dialect: Dialect | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if k < 1:
            raise ValueError("k must be at least 1")
        self.endpoint = endpoint
        self.k = k
        self.dialect = dialect
        self.unforced = 0  # forced positions whose token the server would not emit
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        self._http = httpx.AsyncClient(
            base_url=endpoint.base_url.rstrip("/"),
            headers=headers,
            timeout=endpoint.timeout_s,
            transport=transport,
            trust_env=False,  # no proxy or netrc from the environment: the manifest's URL
        )
        self._model = endpoint.model
        self._safe_token: int | None = None  # a one-byte ASCII token, to force instead

    async def __aenter__(self) -> TopkClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return await self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.endpoint.base_url}{path}: {type(exc).__name__}") from exc

    async def model(self) -> str:
        """The served model's name: the endpoint's, else the only one ``/models`` lists."""
        if self._model is None:
            try:
                r = await self._http.get("/models")
                r.raise_for_status()
                ids = [m["id"] for m in r.json()["data"]]
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                raise EngineError(f"{self.endpoint.base_url}/models: no model list") from exc
            if len(ids) != 1:
                raise ConfigError(
                    f"{self.endpoint.base_url} serves {len(ids)} models; name one (remote_model)"
                )
            self._model = str(ids[0])
        return self._model

    async def n_vocab(self) -> int | None:
        """The vocabulary size the server states (llama-server's ``/models`` ``meta``), if any."""
        try:
            r = await self._http.get("/models")
            meta = r.json()["data"][0].get("meta") or {}
            return int(meta["n_vocab"]) if "n_vocab" in meta else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError):
            return None

    async def score(self, tokens: Sequence[int], start: int) -> TopK:
        """The branch's rows at positions ``start .. len(tokens) - 2`` of ``tokens``, each
        predicting the next token: ``k`` listed tokens and, where not among them, that
        next token, so ``k + 1`` columns. ``tokens`` are sent as ids, exactly."""
        ids = [int(t) for t in tokens]
        if not 0 <= start < len(ids) - 1:
            raise ValueError(f"start {start} leaves nothing to score in {len(ids)} tokens")
        if self.dialect in (None, Dialect.ECHO):
            rows = await self._echo(ids, start)
            if rows is not None:
                self.dialect = Dialect.ECHO
                return rows
            if self.dialect is Dialect.ECHO:
                raise _no_logprobs(self.endpoint, "returns no prompt log-probabilities (echo)")
            self.dialect = Dialect.FORCED
        return await self._forced(ids, start)

    # ---- echo: one request, the prompt's own log-probabilities -------------------------------

    async def _echo(self, ids: list[int], start: int) -> TopK | None:
        body = {
            "model": await self.model(),
            "prompt": ids,
            "echo": True,
            "logprobs": self.k,
            "max_tokens": 1,
            "temperature": 0,
            "return_tokens_as_token_ids": True,
        }
        r = await self._post("/completions", body)
        if r.status_code >= 400:
            return None
        lp = _first_choice(r).get("logprobs")
        if not isinstance(lp, dict) or len(lp.get("top_logprobs") or []) < len(ids):
            return None  # no prompt log-probabilities: not an echo server
        tokens, own, tops = lp.get("tokens") or [], lp["token_logprobs"], lp["top_logprobs"]
        if [_token_id(t) for t in tokens[: len(ids)]] != ids:
            if not all(str(t).startswith(_TOKEN_ID) for t in tokens[: len(ids)]):
                raise _no_logprobs(self.endpoint, "lists tokens as text, not ids")
            raise EngineError(f"{self.endpoint.base_url} echoed other tokens than it was sent")
        rows = []
        for i in range(start + 1, len(ids)):
            listed = {_token_id(t): float(v) for t, v in (tops[i] or {}).items()}
            listed.setdefault(ids[i], float(own[i]))
            rows.append(listed)
        return _rows(rows, self.k + 1)

    # ---- forced: one request per position, the next token forced by logit_bias ---------------

    async def _forced(self, ids: list[int], start: int) -> TopK:
        rows = []
        for i in range(start, len(ids) - 1):
            rows.append(await self._position(ids[: i + 1], ids[i + 1]))
        return _rows(rows, self.k + 1)

    async def _position(self, prefix: list[int], nxt: int) -> dict[int, float]:
        # llama-server withholds the log-probabilities of a token that ends inside a UTF-8
        # character; then force a one-character token (or none): the list has to do.
        for force in dict.fromkeys((nxt, self._safe_token, None)):
            body: dict[str, Any] = {
                "model": await self.model(),
                "prompt": prefix,
                "max_tokens": 1,
                "logprobs": self.k,
                "temperature": 0,
                "return_tokens_as_token_ids": True,
            }
            if force is not None:
                body["logit_bias"] = {str(force): FORCE_BIAS}
            r = await self._post("/completions", body)
            if r.status_code in (400, 422):
                raise _no_logprobs(self.endpoint, f"refuses logprobs: {self.k} ({r.status_code})")
            if r.status_code >= 400:
                raise EngineError(f"{self.endpoint.base_url}/completions: {r.status_code}")
            parsed = self._parse_generated(_first_choice(r).get("logprobs"))
            if parsed is None:
                continue
            (token, logprob), listed = parsed
            if token == nxt:
                listed.setdefault(nxt, logprob)
            else:
                self.unforced += 1
            return listed
        raise _no_logprobs(self.endpoint, "returns no log-probabilities for a generated token")

    def _parse_generated(self, lp: Any) -> tuple[tuple[int, float], dict[int, float]] | None:
        """The generated token and its log-probability, and the top-k listed at its position:
        llama-server's ``{"content": [{id, logprob, top_logprobs: [{id, logprob}]}]}`` or the
        legacy ``{tokens, token_logprobs, top_logprobs: [{"token_id:N": lp}]}``."""
        if not isinstance(lp, dict):
            return None
        content = lp.get("content")
        if isinstance(content, list) and content:
            entry = content[0]
            if "id" not in entry:
                raise _no_logprobs(self.endpoint, "lists tokens as text, not ids")
            listed = {int(t["id"]): float(t["logprob"]) for t in entry.get("top_logprobs", [])}
            if self._safe_token is None:
                self._safe_token = next(
                    (int(t["id"]) for t in entry.get("top_logprobs", []) if _ascii(t)), None
                )
            return (int(entry["id"]), float(entry["logprob"])), listed
        tokens, own, tops = lp.get("tokens"), lp.get("token_logprobs"), lp.get("top_logprobs")
        if not tokens or not own or not tops:
            return None
        if not str(tokens[0]).startswith(_TOKEN_ID):
            raise _no_logprobs(self.endpoint, "lists tokens as text, not ids")
        listed = {_token_id(t): float(v) for t, v in (tops[0] or {}).items()}
        return (_token_id(tokens[0]), float(own[0])), listed


def _first_choice(r: httpx.Response) -> dict[str, Any]:
    try:
        choice = r.json()["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise EngineError(f"{r.request.url}: not a completion ({r.status_code})") from exc
    if not isinstance(choice, dict):
        raise EngineError(f"{r.request.url}: not a completion")
    return choice


def _token_id(token: object) -> int:
    text = str(token)
    if not text.startswith(_TOKEN_ID):
        return -1
    return int(text[len(_TOKEN_ID) :])


def _ascii(entry: Mapping[str, Any]) -> bool:
    data = entry.get("bytes")
    return isinstance(data, list) and len(data) == 1 and 0x20 <= int(data[0]) < 0x7F


def _rows(rows: Sequence[Mapping[int, float]], width: int) -> TopK:
    """``[T, width]`` arrays of the listed tokens, most likely first, ``-1``-padded."""
    ids = np.full((len(rows), width), -1, dtype=np.int64)  # [T, width]
    lps = np.full((len(rows), width), -np.inf, dtype=np.float64)  # [T, width]
    for t, row in enumerate(rows):
        best = sorted(row.items(), key=lambda kv: (-kv[1], kv[0]))[:width]
        for j, (tok, lp) in enumerate(best):
            ids[t, j], lps[t, j] = tok, lp
    return TopK(ids, lps)


def dialect_for(server: str) -> Dialect | None:
    """How to ask a kind of server (``RemoteOptions.server``); ``None``: find out."""
    return {"vllm": Dialect.ECHO, "llama-server": Dialect.FORCED}.get(server)


COMPARE_ROWS = 32  # reference rows turned into log-probabilities at a time


def compare(reference: ReferenceLogits, rows: TopK) -> TokenScores:
    """A remote branch's top-k ``rows`` (one per scored token) against the reference's
    logits file, per token: ``KL(reference ‖ branch)`` by
    :func:`~quantroute.divergence.kl_divergence_topk` (a lower bound of the full KLD)
    and top-1 agreement (exact). The file is read :data:`COMPARE_ROWS` rows at a time
    (``[T, V]`` never whole in memory). Blocking: call it in a thread."""
    n, v = reference.n_tokens, reference.n_vocab
    if rows.n_rows != n:
        raise EngineError(f"{rows.n_rows} rows of top logprobs for {n} reference tokens")
    if rows.ids.max(initial=-1) >= v:
        raise EngineError(
            f"the remote lists token ids beyond the reference's {v}: not the same vocabulary"
        )
    if os.stat(reference.path).st_size != reference.nbytes:
        raise EngineError("the reference's logits file is not the size its shape says")
    logits = np.memmap(reference.path, dtype=np.float32, mode="r", shape=(n, v))  # [T, V]
    kld = np.empty(n, dtype=np.float64)  # [T]
    top1 = np.empty(n, dtype=np.bool_)  # [T]
    for a in range(0, n, COMPARE_ROWS):
        b = min(a + COMPARE_ROWS, n)
        lp = log_softmax(logits[a:b])  # [B, V]
        part = TopK(rows.ids[a:b], rows.logprobs[a:b])
        kld[a:b] = kl_divergence_topk(lp, part)
        top1[a:b] = top1_agreement_topk(lp, part)
    del logits
    return TokenScores(kld, top1)
