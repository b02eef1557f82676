"""``engine: openai``: a branch served by a remote OpenAI-compatible server (vLLM,
SGLang, llama-server, another quantroute).

The engine relays: a request goes upstream as an OpenAI request
(:mod:`.payload`), each upstream event comes back as an engine event the moment it
is read (:mod:`.sse`, bounded), and a client that leaves closes the upstream
request (its connection is dropped, which every one of those servers reads as a
cancel). Connections are pooled and kept alive, at most ``remote.max_connections``.

Failures, as the runner's commit-point rule needs them: anything before the first
token that is the server's fault — no connection, a 5xx or 429, a reset, no first
token within ``remote.first_token_timeout_s`` — is an ``EngineUnavailableError`` (the
request moves to the next branch, and the branch's breaker counts it); a 4xx the
request caused passes through in OpenAI's shape (``InvalidRequestError`` with the
remote's ``code``, such as ``context_length_exceeded``, and its message cut short); after
the first token an upstream failure is an ``EngineCrashedError`` (the stream ends with
an error event). A 401, 403 or 404 from the server is the branch's configuration
(its key, its ``remote_model``), never the client's: unavailable.

A probe task asks the server's health every ``remote.probe_interval_s`` (``/health``
beside the base URL, else ``{url}/models``) and reads its load from its
``/metrics`` (:mod:`.load`). One failed probe, or a request that finds no
connection, makes the branch unroutable; the next good probe makes it routable
again. The engine's ``in_flight`` is the larger of its own requests and the server's
running + waiting sequences (other gateways' too), and a full KV cache counts as
every slot busy: the routing score's load term reads it as it reads a local worker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from quantroute.engines.base import (
    EngineEvent,
    EngineInfo,
    EngineListener,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    PromptCacheStats,
    ReferenceLogits,
    StartEvent,
    TokenScores,
)
from quantroute.engines.openai.chunks import count, error_of, finish_of, tokens_of
from quantroute.engines.openai.load import RemoteLoad, parse_load
from quantroute.engines.openai.payload import body_of
from quantroute.engines.openai.sse import EventSplitter, EventTooLarge
from quantroute.engines.openai.topk import (
    NO_LOGPROBS,
    Endpoint,
    TopkClient,
    compare,
    dialect_for,
)
from quantroute.errors import (
    ConfigError,
    EngineCrashedError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
)
from quantroute.types import Offload

log = logging.getLogger(__name__)

__all__ = ["OpenAIEngine", "RemoteConfig"]

_ERROR_BODY_BYTES = 64 << 10  # what is read of an upstream's error body
_PROBE_BODY_BYTES = 4 << 20  # of a health, models or metrics answer
_UNKNOWN_VOCAB = 2**31 - 1  # a remote's vocabulary is its to check
# servers whose OpenAI API lists no token ids with its logprobs (docs/quality.md)
_UNMEASURABLE = frozenset({"sglang", "quantroute"})


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """One remote branch's server: where, as what, and how to talk to it. ``api_key`` is
    the key itself (read by the settings from the variable the manifest names); it goes
    only into the ``Authorization`` header, never into a log line or a repr."""

    url: str  # the OpenAI base URL, ``.../v1``
    model: str  # the name the server serves
    server: str = "auto"  # vllm, sglang, llama-server, quantroute, openai; auto: from /metrics
    api_key: str | None = None
    max_connections: int = 64
    connect_timeout_s: float = 5.0
    first_token_timeout_s: float = 60.0
    idle_timeout_s: float = 60.0
    probe_interval_s: float = 2.0
    logprobs: bool = True
    max_event_bytes: int = 1 << 20
    parallel: int | None = None  # sequences it decodes together, where declared

    def __repr__(self) -> str:  # never the key
        return f"RemoteConfig(url={self.url!r}, model={self.model!r}, server={self.server!r})"


class OpenAIEngine:
    """Runs one branch on a remote OpenAI-compatible server (see the module's text)."""

    def __init__(self, name: str, config: RemoteConfig):
        self._name = name
        self._config = config
        self._server = config.server if config.server != "auto" else "openai"
        base = config.url.rstrip("/")
        self._base = base
        self._root = base.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._headers = headers
        self._client: httpx.AsyncClient | None = None  # requests: the pool
        self._probes: httpx.AsyncClient | None = None  # probes: their own connection
        self._probe: asyncio.Task[None] | None = None
        self._listener: EngineListener | None = None
        self._healthy = False
        self._ever_ready = False
        self._down_since: float | None = time.monotonic()
        self._why_down: str | None = "not probed yet"
        self._health_path: str | None = None  # decided by the first probe
        self._metrics = True  # until the server says it has none
        self._load: RemoteLoad | None = None
        self._load_at = 0.0
        self._in_flight = 0
        self._info: EngineInfo | None = None
        self._stopped = False
        self._topk: TopkClient | None = None  # the drift monitor's, made on its first replay
        self._mute = False  # it answered that it gives no logprobs by ids

    # -- what the gateway reads ------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def ready(self) -> bool:
        return self._healthy and not self._stopped

    @property
    def info(self) -> EngineInfo | None:
        return self._info

    @property
    def in_flight(self) -> int:
        load = self._load
        if load is None or time.monotonic() - self._load_at > 3 * self._config.probe_interval_s:
            return self._in_flight
        parallel = self._info.parallel if self._info is not None else 1
        busy = load.running + load.waiting
        if load.kv_usage is not None and load.kv_usage >= 0.98:
            busy = max(busy, parallel + load.waiting)  # a full KV cache: every slot is taken
        return max(self._in_flight, busy)

    @property
    def pid(self) -> int | None:
        return None

    @property
    def model_path(self) -> Path | None:
        return None

    @property
    def failure(self) -> str | None:
        return None  # a remote is never failed: it is down while its probe says so

    @property
    def can_score(self) -> bool:
        """Compared through its top logprobs (topk.py): unless the manifest says it gives
        none, its kind of server gives none by ids (SGLang's OpenAI API, quantroute's), or
        it answered so."""
        return self._config.logprobs and self._server not in _UNMEASURABLE and not self._mute

    @property
    def writes_logits(self) -> bool:
        return False  # a server gives top logprobs, never whole rows

    @property
    def prompt_cache(self) -> PromptCacheStats | None:
        return None

    @property
    def url(self) -> str:
        return self._base

    @property
    def server(self) -> str:
        """The kind of server, as configured or as its metrics told."""
        return self._server

    def health(self) -> dict[str, Any]:
        """For ``/v1/devices`` and the status page: up or down (since when, why), load."""
        load = self._load
        return {
            "url": self._base,
            "server": self._server,
            "healthy": self._healthy,
            "down_since_s": (
                None if self._down_since is None else round(time.monotonic() - self._down_since, 3)
            ),
            "reason": self._why_down,
            "in_flight": self._in_flight,
            "running": load.running if load else None,
            "waiting": load.waiting if load else None,
            "kv_usage": load.kv_usage if load else None,
        }

    def listen(self, listener: EngineListener) -> None:
        self._listener = listener

    def offload(self, offload: Offload) -> None:
        """Nothing: the server places its own model."""

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Open the pool, probe once (ready if the server answers), then keep probing."""
        self._stopped = False
        if self._client is None:
            c = self._config
            self._client = httpx.AsyncClient(
                limits=httpx.Limits(
                    max_connections=c.max_connections,
                    max_keepalive_connections=c.max_connections,
                    keepalive_expiry=30.0,
                ),
                timeout=httpx.Timeout(
                    connect=c.connect_timeout_s,
                    read=c.idle_timeout_s,
                    write=c.idle_timeout_s,
                    pool=c.first_token_timeout_s,
                ),
                trust_env=False,  # no proxy or netrc from the environment: the manifest's URL
                follow_redirects=False,
            )
            # A pool busy with streams must not starve the probe (the branch would look
            # down while the server is fine): probes have a connection of their own.
            self._probes = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
                timeout=httpx.Timeout(c.connect_timeout_s + 1.0),
                trust_env=False,
                follow_redirects=False,
            )
        await self.probe()
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_loop(), name=f"probe {self._name}")

    async def stop(self) -> None:
        self._stopped = True
        self._healthy = False
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.wait({self._probe})  # its end, not its error: a cancel of stop() is
            self._probe = None  # stop()'s own, and goes on up
        for client in (self._client, self._probes):
            if client is not None:
                await client.aclose()
        self._client = self._probes = None
        if self._topk is not None:
            await self._topk.aclose()
            self._topk = None

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def _probe_loop(self) -> None:
        # ``_stopped`` too, not only the cancellation: Python 3.11's wait_for loses a cancel
        # that lands as the awaited call completes, and stop() would wait forever
        while not self._stopped:
            await asyncio.sleep(self._config.probe_interval_s)
            try:
                await self.probe()
            except Exception:  # the loop outlives any one bad answer
                log.exception("%s: probe failed", self._name)

    async def probe(self) -> bool:
        """Ask the server's health (and info, the first time) and load; returns healthy."""
        client = self._probes
        if client is None:
            return False
        timeout = min(
            max(self._config.probe_interval_s * 2, 1.0), self._config.connect_timeout_s + 1.0
        )
        try:
            ok, why = await asyncio.wait_for(self._check(client), timeout)
        except TimeoutError:
            ok, why = False, f"no health answer in {timeout:.3g} s"
        except httpx.HTTPError as exc:
            ok, why = False, _describe(exc)
        if ok and self._metrics:
            with contextlib.suppress(httpx.HTTPError, TimeoutError):
                await asyncio.wait_for(self._scrape(client), timeout)
        self._set_health(ok, why)
        return ok

    async def _check(self, client: httpx.AsyncClient) -> tuple[bool, str | None]:
        if self._health_path is None:  # /health beside the base URL, else {url}/models
            r = await client.get(self._root + "/health", headers=self._headers)
            if r.status_code not in (404, 405):
                self._health_path = self._root + "/health"
            else:
                self._health_path = self._base + "/models"
                r = await client.get(self._health_path, headers=self._headers)
        else:
            r = await client.get(self._health_path, headers=self._headers)
        if r.status_code != 200:
            return False, f"health answered {r.status_code}"
        if self._info is None:
            await self._learn(client)
        return True, None

    async def _learn(self, client: httpx.AsyncClient) -> None:
        """The server's context length, vocabulary and slots, where it says them
        (llama-server's ``/v1/models`` ``meta`` and ``/props``; vLLM's ``max_model_len``)."""
        n_ctx, n_vocab, parallel = 0, _UNKNOWN_VOCAB, self._config.parallel
        with contextlib.suppress(httpx.HTTPError, ValueError, TypeError, AttributeError):
            r = await client.get(self._base + "/models", headers=self._headers)
            if r.status_code == 200 and len(r.content) <= _PROBE_BODY_BYTES:
                for m in r.json().get("data", ()):
                    if isinstance(m, dict) and m.get("id") == self._config.model:
                        n_ctx = int(m.get("max_model_len") or 0)
                        meta = m.get("meta") or {}
                        n_ctx = n_ctx or int(meta.get("n_ctx_train") or 0)
                        n_vocab = int(meta.get("n_vocab") or n_vocab)
        with contextlib.suppress(httpx.HTTPError, ValueError, TypeError, AttributeError):
            r = await client.get(self._root + "/props", headers=self._headers)
            if r.status_code == 200 and len(r.content) <= _PROBE_BODY_BYTES:
                props = r.json()
                parallel = parallel or int(props.get("total_slots") or 0) or None
                settings = props.get("default_generation_settings") or {}
                n_ctx = int(settings.get("n_ctx") or 0) or n_ctx
        parallel = parallel or self._config.max_connections
        self._info = EngineInfo(
            n_ctx=n_ctx or 1 << 20,
            n_ctx_train=n_ctx or 1 << 20,
            n_vocab=n_vocab,
            parallel=parallel,
            chat_template=None,
            bos_token="",
            eos_token="",
            model_bytes=0,
        )

    async def _scrape(self, client: httpx.AsyncClient) -> None:
        r = await client.get(self._root + "/metrics", headers=self._headers)
        if r.status_code in (404, 405):
            self._metrics = False  # it has none: its load is our own in-flight count
            return
        if r.status_code != 200 or len(r.content) > _PROBE_BODY_BYTES:
            return
        load = parse_load(r.text)
        if load is not None:
            self._load, self._load_at = load, time.monotonic()
            if self._config.server == "auto":
                self._server = load.server

    def _set_health(self, ok: bool, why: str | None) -> None:
        if ok == self._healthy:
            return
        self._healthy = ok
        if ok:
            self._down_since, self._why_down = None, None
            log.info("%s: %s is up", self._name, self._base)
            if self._listener is not None and not self._ever_ready:
                self._listener.engine_ready(self)
            self._ever_ready = True
        else:
            self._down_since, self._why_down = time.monotonic(), why
            log.warning("%s: %s is down: %s", self._name, self._base, why)

    # -- generation ------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        if not self.ready or self._client is None:
            raise EngineUnavailableError(f"remote branch {self._name} is down")
        path, body = body_of(
            request, self._config.model, self._server, logprobs=self._config.logprobs
        )
        return self._relay(self._client, path, body, request)

    async def _relay(
        self,
        client: httpx.AsyncClient,
        path: str,
        body: dict[str, Any],
        request: GenerationRequest,
    ) -> AsyncIterator[EngineEvent]:
        headers = dict(self._headers)
        headers.update(request.trace_context)
        chat = "messages" in body
        deadline = request.sampling.deadline
        first_by = time.monotonic() + self._config.first_token_timeout_s
        if deadline is not None:
            first_by = min(first_by, deadline)
        self._in_flight += 1
        committed = False  # a token went out: failures from here on end the stream
        completion_tokens = 0
        prompt_tokens = 0
        reason = FinishReason.STOP
        try:
            try:
                async with asyncio.timeout_at(_loop_time(first_by)):
                    response = await client.send(
                        client.build_request("POST", self._base + path, json=body, headers=headers),
                        stream=True,
                    )
            except TimeoutError as exc:
                raise EngineUnavailableError(
                    f"remote branch {self._name} did not answer in time"
                ) from exc
            except httpx.HTTPError as exc:
                self._connection_failed(exc)
                raise EngineUnavailableError(
                    f"remote branch {self._name}: {_describe(exc)}"
                ) from exc
            try:
                if response.status_code != 200:
                    await self._refused(response)
                yield StartEvent(0)
                splitter = EventSplitter(self._config.max_event_bytes)
                chunks = response.aiter_raw()
                done = saw_done = finished = False
                while not done:
                    try:
                        if not committed:
                            async with asyncio.timeout_at(_loop_time(first_by)):
                                chunk = await anext(chunks)
                        elif deadline is not None:
                            async with asyncio.timeout_at(_loop_time(deadline)):
                                chunk = await anext(chunks)
                        else:
                            chunk = await anext(chunks)
                        events = splitter.feed(chunk)
                    except StopAsyncIteration:
                        events, done = splitter.close(), True
                    except TimeoutError as exc:
                        if committed:  # the request's deadline: what came is kept
                            reason, finished = FinishReason.DEADLINE, True
                            break
                        raise EngineUnavailableError(
                            f"remote branch {self._name} sent no first token in time"
                        ) from exc
                    except EventTooLarge as exc:
                        raise _failed(committed, f"remote branch {self._name}: {exc}") from exc
                    except httpx.HTTPError as exc:
                        raise _failed(
                            committed, f"remote branch {self._name}: {_describe(exc)}"
                        ) from exc
                    for data in events:
                        if data == b"[DONE]":
                            done = saw_done = True
                            break
                        try:
                            event = json.loads(data)
                        except (ValueError, RecursionError) as exc:  # too deep for Python
                            raise _failed(
                                committed, f"remote branch {self._name} sent a malformed event"
                            ) from exc
                        if not isinstance(event, dict):
                            raise _failed(
                                committed, f"remote branch {self._name} sent a malformed event"
                            )
                        if "error" in event:
                            raise _failed(
                                committed, f"remote branch {self._name} failed mid-stream"
                            )
                        usage = event.get("usage")
                        if isinstance(usage, dict):
                            prompt_tokens = count(usage.get("prompt_tokens"), prompt_tokens)
                            completion_tokens = count(
                                usage.get("completion_tokens"), completion_tokens
                            )
                        for token in tokens_of(event, chat):
                            committed = True
                            yield token
                        finish = finish_of(event)
                        if finish is not None:
                            reason, finished = finish, True
                if not (saw_done or finished):  # a body cut short is never a normal end
                    raise _failed(committed, f"remote branch {self._name} ended the stream early")
                yield FinishEvent(reason, prompt_tokens, completion_tokens)
            finally:
                await response.aclose()  # before its end: the connection goes, the server cancels
        finally:
            self._in_flight -= 1

    async def _refused(self, response: httpx.Response) -> None:
        """Raise the error an upstream's non-200 answer stands for."""
        status = response.status_code
        raw = b""
        with contextlib.suppress(httpx.HTTPError):
            async for chunk in response.aiter_raw():
                raw += chunk
                if len(raw) > _ERROR_BODY_BYTES:
                    break
        message, code = error_of(raw)
        if status in (400, 413, 422):
            text = f"the remote branch refused the request: {message}"
            raise InvalidRequestError(text, code=code if code else None)
        raise EngineUnavailableError(f"remote branch {self._name} answered {status}")

    def _connection_failed(self, exc: httpx.HTTPError) -> None:
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            self._set_health(False, _describe(exc))  # the next probe decides when it is back

    # -- scoring: through the server's top logprobs ---------------------------------

    async def write_logits(
        self,
        prompt: str,
        tokens: list[int],
        path: Path,
        *,
        parse_special: bool = False,
        text: str | None = None,
        limit: int = 0,
    ) -> ReferenceLogits:
        raise EngineError(f"remote branch {self._name} cannot write logits")

    async def score(
        self,
        prompt: str,
        tokens: list[int],
        reference: ReferenceLogits,
        *,
        parse_special: bool = False,
    ) -> TokenScores:
        """Teacher-force ``reference.ids`` (the reference's tokens of the prompt and of
        ``tokens``) on the server, read its top-k at each of ``tokens`` and compare
        with the reference's rows (:func:`~quantroute.engines.openai.topk.compare`, in
        a thread). The ids go as ids: the server's tokenizer is not involved."""
        ids, n = reference.ids, reference.n_tokens
        if not self._config.logprobs:
            raise EngineError(f"remote branch {self._name} gives no logprobs")
        if n < 1 or len(ids) <= n or list(ids[-n:]) != list(tokens):
            raise EngineError(f"remote branch {self._name}: the reference's ids do not match")
        if self._topk is None:
            endpoint = Endpoint(self._base, self._config.model, self._config.api_key)
            self._topk = TopkClient(endpoint, dialect=dialect_for(self._config.server))
        try:
            rows = await self._topk.score(ids, len(ids) - n - 1)  # [n, k+1]
        except ConfigError as exc:
            if exc.error_code == NO_LOGPROBS:  # not measurable: no more replays for it
                self._mute = True
                log.warning("%s: not watched for drift: %s", self._name, exc.message)
            raise EngineError(f"remote branch {self._name}: {exc.message}") from exc
        return await asyncio.to_thread(compare, reference, rows)


def _loop_time(monotonic_at: float) -> float:
    """A ``time.monotonic()`` instant on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_at - time.monotonic())


def _failed(committed: bool, message: str) -> EngineError:
    return EngineCrashedError(message) if committed else EngineUnavailableError(message)


def _describe(exc: BaseException) -> str:
    """An httpx failure in words, by its class (never its text: it may hold the URL's
    credentials or a server's echo)."""
    names = {
        httpx.ConnectError: "cannot connect",
        httpx.ConnectTimeout: "connection timed out",
        httpx.ReadTimeout: "no data in time",
        httpx.RemoteProtocolError: "the connection broke",
        httpx.ReadError: "the connection broke",
        httpx.PoolTimeout: "no free connection in time",
        httpx.WriteError: "the connection broke",
    }
    for kind, words in names.items():
        if isinstance(exc, kind):
            return words
    return type(exc).__name__
