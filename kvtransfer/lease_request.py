"""The pull's one control round trip, decode side: KvPullRequest out, the reply header in
(its receive posted together with the send), a refusal mapped to KvTransferError."""

from __future__ import annotations

import asyncio

import grpc

from splitserve.kvtransfer import frames
from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.descriptor import PoolSpec
from splitserve.kvtransfer.errors import KvTransferError
from splitserve.protos import kv_pb2

_STATUS_REASON = {
    kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN: "lease_unknown",
    kv_pb2.KV_PULL_STATUS_LEASE_EXPIRED: "lease_expired",
    kv_pb2.KV_PULL_STATUS_INCOMPATIBLE: "incompatible",
}


async def request_lease(
    ep, handle: kv_pb2.KvHandle, spec: PoolSpec, cfg: KvTransferConfig, buf
) -> kv_pb2.KvPullReply:
    """The reply header (status OK), or KvTransferError: the pull was refused or unanswered."""
    request = kv_pb2.KvPullRequest(
        lease_id=handle.lease_id,
        request_id=handle.request_id,
        max_message_bytes=cfg.max_message_bytes,
        **spec.fields(),
    )
    try:  # the reply's receive is posted with the request: one round trip
        _, reply = await asyncio.wait_for(
            asyncio.gather(frames.send(ep, request), frames.recv(ep, kv_pb2.KvPullReply, buf)),
            cfg.lease_request_timeout_s,
        )
    except TimeoutError as exc:
        raise KvTransferError(
            "lease_timeout",
            f"no answer to the lease request within {cfg.lease_request_timeout_s}s",
        ) from exc
    except Exception as exc:
        raise KvTransferError(
            "peer_failed", f"prefill worker failed during the lease request: {exc}"
        ) from exc
    if reply.status != kv_pb2.KV_PULL_STATUS_OK:
        reason = _STATUS_REASON.get(reply.status, "rejected")
        status = (
            grpc.StatusCode.FAILED_PRECONDITION
            if reason == "incompatible"
            else grpc.StatusCode.UNAVAILABLE
        )
        raise KvTransferError(reason, reply.message or f"pull rejected ({reason})", status)
    return reply
