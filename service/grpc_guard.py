"""Request bytes that are no valid protobuf message get INVALID_ARGUMENT naming the message type.

grpc.aio runs the generated deserializer (`Msg.FromString`) before any handler: when it raises,
the client gets UNKNOWN ("Unexpected DecodeError") and the server logs a full traceback per
request, so any peer can fill the logs. `GrpcServer.add` hands the generated
`add_*_to_server` this stand-in for the server, which registers the same handlers with a
deserializer that returns a `Malformed` marker instead of raising, and a behaviour that answers
the marker with INVALID_ARGUMENT before the servicer runs (on a request stream: when the
servicer reads it). Health and reflection go through it too (grpc_service.py).
"""

from __future__ import annotations

import contextlib
import inspect

import grpc
from google.protobuf.message import DecodeError


class Malformed:
    def __init__(self, type_name: str, exc: Exception) -> None:
        self.message = (
            f"the request is not a valid {type_name} protobuf message ({exc}); send the message "
            "serialized by code generated from this service's .proto files"
        )


def _tolerant(deserialize):
    type_name = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    type_name = type_name.full_name if type_name is not None else "request"

    def parse(raw: bytes):
        try:
            return deserialize(raw)
        except DecodeError as exc:
            return Malformed(type_name, exc)

    return parse


def _guard(behavior):
    if inspect.isasyncgenfunction(behavior):

        async def stream(request, context):
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async with contextlib.aclosing(behavior(request, context)) as items:
                async for item in items:
                    yield item

        return stream

    async def call(request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return call


async def _well_formed(requests, context):
    """A request stream that ends the call with INVALID_ARGUMENT at its first malformed message."""
    async for request in requests:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        yield request


def _guard_streamed(behavior):
    if inspect.isasyncgenfunction(behavior):

        async def stream(requests, context):
            async with contextlib.aclosing(
                behavior(_well_formed(requests, context), context)
            ) as out:
                async for item in out:
                    yield item

        return stream
    if inspect.iscoroutinefunction(behavior):

        async def call(requests, context):
            return await behavior(_well_formed(requests, context), context)

        return call
    return None  # a synchronous handler: left alone


def guarded(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """The handler with a tolerant deserializer: a malformed unary request is answered before the
    servicer runs; a malformed message on a request stream (e.g. reflection's) ends the call."""
    if handler is None or handler.request_deserializer is None:
        return handler
    if handler.request_streaming:
        kind = "stream_stream" if handler.response_streaming else "stream_unary"
        wrapped = _guard_streamed(getattr(handler, kind))
        if wrapped is None:
            return handler
    else:
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        wrapped = _guard(getattr(handler, kind))
    return handler._replace(
        request_deserializer=_tolerant(handler.request_deserializer), **{kind: wrapped}
    )


class _GuardedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner
        self._cache: dict[str, grpc.RpcMethodHandler] = {}  # known methods only: bounded

    def service(self, handler_call_details):
        method = handler_call_details.method
        handler = self._cache.get(method)
        if handler is None:
            # an unknown method is not cached: a stranger calling random names must not grow it
            handler = guarded(self._inner.service(handler_call_details))
            if handler is not None:
                self._cache[method] = handler
        return handler


class RejectMalformed:
    """Stands in for a grpc.aio server while a generated `add_*_to_server` registers handlers."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(h) for h in handlers))

    def add_registered_method_handlers(self, service_name: str, handlers: dict) -> None:
        self._server.add_registered_method_handlers(
            service_name, {m: guarded(h) for m, h in handlers.items()}
        )
