"""The two kinds of failure a serving process knows (docs/architecture.md, section 1).

* `RequestError`: one request is refused or ended; it carries the gRPC status and a
  message that says how to fix the request. The worker keeps serving.
* a fatal worker error: the engine cannot continue (a failed step, a broken invariant);
  the engine keeps the exception, health goes NOT_SERVING and every in-flight request
  gets `RequestError(UNAVAILABLE)`.
"""

from __future__ import annotations

import grpc

RETRY_AFTER_MS = "retry-after-ms"  # trailing metadata key (the name OpenAI's clients read)


def retry_after_ms(seconds: float) -> str:
    return str(max(1, round(seconds * 1000)))


class RequestError(Exception):
    """A per-request failure that maps to one gRPC status."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # when retrying later can succeed (a full queue, a rate limit): sent as the trailing
        # metadata `retry-after-ms` over gRPC and the `Retry-After` header over HTTP
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        return f"RequestError({self.code.name}, {self.message!r})"

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        """Ends the RPC with this status (raises, as `context.abort` does)."""
        if self.retry_after_s is not None:
            context.set_trailing_metadata(((RETRY_AFTER_MS, retry_after_ms(self.retry_after_s)),))
        await context.abort(self.code, self.message)

    @classmethod
    def invalid(cls, message: str) -> RequestError:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, message)

    @classmethod
    def exhausted(cls, message: str, retry_after_s: float | None = None) -> RequestError:
        """RESOURCE_EXHAUSTED; `retry_after_s` only when waiting can help (never for a request
        too big for the server at all)."""
        return cls(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after_s)

    @classmethod
    def unauthenticated(cls, message: str) -> RequestError:
        return cls(grpc.StatusCode.UNAUTHENTICATED, message)

    @classmethod
    def denied(cls, message: str) -> RequestError:
        return cls(grpc.StatusCode.PERMISSION_DENIED, message)

    @classmethod
    def unavailable(cls, message: str) -> RequestError:
        return cls(grpc.StatusCode.UNAVAILABLE, message)

    @classmethod
    def cancelled(cls, message: str) -> RequestError:
        return cls(grpc.StatusCode.CANCELLED, message)
