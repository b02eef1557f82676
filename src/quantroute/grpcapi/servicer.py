"""The ``quantroute.v1.Quantroute`` service: parse, call the one service object, render,
as the HTTP routes do (``api/routes.py``), with a call's metadata for headers and its
deadline for the request's."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from quantroute.api.errors import internal_error
from quantroute.api.run import Tick
from quantroute.api.schemas import ChatCompletionRequest, CompletionRequest
from quantroute.api.service import Service
from quantroute.errors import InvalidRequestError, QuantrouteError
from quantroute.grpcapi import convert
from quantroute.grpcapi.keys import Keys
from quantroute.grpcapi.proto import pb, pb_grpc
from quantroute.grpcapi.status import status_of
from quantroute.routing.requirement import DEADLINE_MS_MAX, DEADLINE_MS_MIN

__all__ = ["Call", "Servicer"]

log = logging.getLogger(__name__)

Request = ChatCompletionRequest | CompletionRequest
Context = grpc.aio.ServicerContext[Any, Any]


@dataclass(frozen=True, slots=True)
class Call:
    """What a call brings besides its message: its metadata (the headers a request's
    routing reads: ``x-quantroute-quality``, ``x-quantroute-user``, ...), and its deadline.

    ``deadline`` is ``time.monotonic()``'s; ``timeout_s`` is the time left as the request's
    ``timeout``, which routing, the admission queue and the generation all keep to (the
    earlier of it and an ``x-quantroute-deadline-ms`` metadata value counts, as over HTTP).
    A deadline past the HTTP API's longest (an hour) is left to gRPC alone."""

    metadata: tuple[tuple[str, str | bytes], ...]
    headers: dict[str, str]
    deadline: float | None
    timeout_s: float | None

    @classmethod
    def of(cls, context: Context) -> Call:
        metadata = tuple((m[0], m[1]) for m in context.invocation_metadata() or ())
        headers: dict[str, str] = {}
        for key, value in metadata:
            if isinstance(value, str):  # "-bin" values are bytes: no header of ours
                headers.setdefault(key, value)  # the first, as Starlette's Headers.get
        left_s = context.time_remaining()
        if left_s is None:
            return cls(metadata, headers, None, None)
        timeout_s = left_s if left_s <= DEADLINE_MS_MAX / 1000.0 else None
        return cls(metadata, headers, time.monotonic() + left_s, timeout_s)

    @property
    def expired(self) -> bool:
        """Too little time is left for any request (less than the least HTTP deadline)."""
        return self.timeout_s is not None and self.timeout_s < DEADLINE_MS_MIN / 1000.0


class Servicer(pb_grpc.QuantrouteServicer):
    """Each RPC as its HTTP endpoint: the key's tenant (``Keys``), a request the HTTP
    schema validated (``convert``), the service's answer, and an error as a status
    (``status``). A generation's initial metadata names its branch; a client that cancels
    closes the run, which cancels the generation."""

    def __init__(self, service: Service, keys: Keys):
        self._service = service
        self._keys = keys

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.Chunk]:
        async for chunk in self._generate(
            context, lambda timeout_s: convert.completion_request(request, timeout_s)
        ):
            yield chunk

    async def Chat(self, request: pb.ChatRequest, context: Context) -> AsyncIterator[pb.Chunk]:
        async for chunk in self._generate(
            context, lambda timeout_s: convert.chat_request(request, timeout_s)
        ):
            yield chunk

    async def ListModels(
        self, request: pb.ListModelsRequest, context: Context
    ) -> pb.ListModelsResponse:
        call = Call.of(context)
        try:
            tenant = await self._keys.reader(call.metadata)
            body = self._service.models(tenant)
        except Exception as exc:
            await _abort(context, exc, call)
        models = [pb.Model(id=entry["id"], detail=convert.struct(entry)) for entry in body["data"]]
        return pb.ListModelsResponse(data=models)

    async def Explain(self, request: pb.ExplainRequest, context: Context) -> pb.ExplainResponse:
        call = await _in_time(context)
        try:
            tenant = await self._keys.explainer(call.metadata)
            kind = request.WhichOneof("request")
            req: Request
            if kind == "completion":
                req = convert.completion_request(request.completion, call.timeout_s)
            elif kind == "chat":
                req = convert.chat_request(request.chat, call.timeout_s)
            else:
                raise InvalidRequestError("give a completion or a chat request", param="request")
            decision = self._service.explain(req, call.headers, tenant)
        except Exception as exc:
            await _abort(context, exc, call)
        return pb.ExplainResponse(decision=convert.struct(decision))

    async def _generate(
        self, context: Context, build: Callable[[float | None], Request]
    ) -> AsyncIterator[pb.Chunk]:
        """Prepare and start the request ``build`` makes, then stream its run's events;
        an error before the first chunk, or after it, ends the call with its status."""
        call = await _in_time(context)
        service = self._service
        try:
            tenant = await self._keys.client(call.metadata)
            job = await service.prepare(build(call.timeout_s), call.headers, tenant)
            run = await service.start(job)
        except Exception as exc:
            await _abort(context, exc, call)
        try:
            await context.send_initial_metadata(convert.branch_metadata(run))
            chunks = convert.Chunks(run)
            async with contextlib.aclosing(run.batches()) as batches:
                async for batch in batches:
                    if isinstance(batch, Tick):
                        continue
                    chunk = chunks.of(batch)
                    if chunk is not None:
                        yield chunk
        except Exception as exc:
            await _abort(context, exc, call)
        finally:
            await run.close()  # a cancelled call (the client left) cancels its generation


async def _in_time(context: Context) -> Call:
    """The call, unless its deadline is (all but) gone: then ``DEADLINE_EXCEEDED`` now."""
    call = Call.of(context)
    if call.expired:
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline has passed")
    return call


async def _abort(context: Context, exc: Exception, call: Call) -> NoReturn:
    """End the call with ``exc``'s status (a bug's: INTERNAL, its cause logged only)."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc  # already the call's end
    if not isinstance(exc, QuantrouteError):
        log.error("gRPC call failed", exc_info=exc)
        exc = internal_error()
    status = status_of(exc, call.deadline)
    await context.abort(status.code, status.details, status.trailing)
