"""The one exception a KV pull raises (`KvTransferError`): a reason label plus a gRPC status."""

from __future__ import annotations

import grpc


class KvTransferError(RuntimeError):
    """A pull that did not deliver; `reason` labels the metric, `status` maps to gRPC."""

    def __init__(
        self,
        reason: str,
        message: str,
        status: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        payload_started: bool = False,
    ):
        super().__init__(message)
        self.reason = reason
        self.status = status
        self.payload_started = payload_started  # past the lease request: the lease may be consumed
