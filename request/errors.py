"""The two kinds of failure a serving process knows (docs/architecture.md, section 1).

* `RequestError`: one request is refused or ended; it carries the gRPC status and a
  message that says how to fix the request. The worker keeps serving.
* a fatal worker error: the engine cannot continue (a failed step, a broken invariant);
  the engine keeps the exception, health goes NOT_SERVING and every in-flight request
  gets `RequestError(UNAVAILABLE)`.
"""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A per-request failure that maps to one gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"RequestError({self.code.name}, {self.message!r})"

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        """Ends the RPC with this status (raises, as `context.abort` does)."""
        await context.abort(self.code, self.message)

    @classmethod
    def invalid(cls, message: str) -> RequestError:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, message)

    @classmethod
    def exhausted(cls, message: str) -> RequestError:
        return cls(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    @classmethod
    def unavailable(cls, message: str) -> RequestError:
        return cls(grpc.StatusCode.UNAVAILABLE, message)

    @classmethod
    def cancelled(cls, message: str) -> RequestError:
        return cls(grpc.StatusCode.CANCELLED, message)
