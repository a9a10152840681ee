"""The cluster secret on the workers' gRPC services: only the router (and other holders of the
deployment's secret) may call Prefill, Decode, Abort, ReleaseLease and GetLoad.

    RequireClusterSecret(secret)   server interceptor of a worker: a call without
                                   `authorization: Bearer <secret>` is UNAUTHENTICATED before
                                   its handler runs; health and reflection stay open for probes
    client_interceptors(secret)    client interceptors of the router's channels to workers
    bearer_interceptors(token)     the same for any bearer token (clients' API keys: cli/api_key.py)

Both sides take the secret from service/credentials.py's `cluster_secret()`; a worker started
without one serves every caller, as before (keep it on a private network, or use mutual TLS).
"""

from __future__ import annotations

import grpc

from splitserve.service.credentials import bearer, match_key

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _refuse(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler that answers UNAUTHENTICATED without reading the caller's message: registered
    as request-streaming, it aborts before taking the first message, so a stranger's bytes are
    neither parsed nor buffered whole (only what HTTP/2 flow control lets in)."""
    message = (
        "this worker takes calls only from its cluster (authorization: Bearer <cluster secret>); "
        "set SPLITSERVE_CLUSTER_SECRET to the same value on the router and the workers"
    )

    async def unary(requests, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(requests, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - an async generator that never yields

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, _ignore, handler.response_serializer)
    return grpc.stream_unary_rpc_method_handler(unary, _ignore, handler.response_serializer)


def _ignore(data: bytes) -> None:
    return None


class RequireClusterSecret(grpc.aio.ServerInterceptor):
    def __init__(self, secret: bytes) -> None:
        self._secret = (secret.decode(),)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str):
                token = bearer(value)
                if token is not None and match_key(token, self._secret) is not None:
                    return handler
        if handler.request_streaming:  # none of ours: refuse without guessing the shape
            return None
        return _refuse(handler)


class _SendBearer:
    def __init__(self, token: str) -> None:
        self._pair = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._pair)
        return details._replace(metadata=metadata)


class _SendBearerUnaryUnary(_SendBearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class _SendBearerUnaryStream(_SendBearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


def bearer_interceptors(token: str) -> list:
    """grpc.aio client interceptors adding `authorization: Bearer <token>` to every unary-unary
    and unary-stream call. One object per kind: grpc.aio files an interceptor under the first
    kind it implements only (its Channel tests them with elif), so a single object implementing
    both would send every stream (Decode, Generate) without the token."""
    return [_SendBearerUnaryUnary(token), _SendBearerUnaryStream(token)]


def client_interceptors(secret: bytes | None) -> list | None:
    """Interceptors for a channel to a worker (None: no secret, plain channel)."""
    return bearer_interceptors(secret.decode()) if secret else None
