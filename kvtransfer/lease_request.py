"""The pull's one control round trip, decode side: KvPullRequest out, the reply header in
(its receive posted together with the send), a refusal mapped to KvTransferError."""

from __future__ import annotations

import grpc

from splitserve.kvtransfer import frames
from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.descriptor import PoolSpec
from splitserve.kvtransfer.errors import KvTransferError
from splitserve.kvtransfer.quiet_wait import post, post_frame, wait_all
from splitserve.protos import kv_pb2

_STATUS_REASON = {
    kv_pb2.KV_PULL_STATUS_LEASE_UNKNOWN: "lease_unknown",
    kv_pb2.KV_PULL_STATUS_LEASE_EXPIRED: "lease_expired",
    kv_pb2.KV_PULL_STATUS_INCOMPATIBLE: "incompatible",
}


async def request_lease(
    ep, handle: kv_pb2.KvHandle, spec: PoolSpec, cfg: KvTransferConfig, buf, verify: bool = True
) -> kv_pb2.KvPullReply:
    """The reply header (status OK), or KvTransferError: the pull was refused or unanswered.
    `verify`: whether this side checks the payload's checksum (else the sender may skip it)."""
    request = kv_pb2.KvPullRequest(
        lease_id=handle.lease_id,
        request_id=handle.request_id,
        max_message_bytes=cfg.max_message_bytes,
        skip_checksum=not verify,
        **spec.fields(),
    )
    timeout = cfg.lease_request_timeout_s
    posted = []
    try:  # the reply's receive posted first, then the request, now: one round trip
        posted.append(post(ep, [buf], receive=True))
        posted.append(post_frame(ep, request))
        await wait_all([posted[1], posted[0]], timeout)  # the request left, the reply came
        reply = frames.decode(buf, kv_pb2.KvPullReply)
    except TimeoutError as exc:
        raise KvTransferError(
            "lease_timeout", f"no answer to the lease request within {timeout}s"
        ) from exc
    except Exception as exc:
        raise KvTransferError(
            "peer_failed", f"prefill worker failed during the lease request: {exc}"
        ) from exc
    finally:
        for p in posted:  # a receive still posted must not write into `buf` later
            p.abandon()
    if reply.status != kv_pb2.KV_PULL_STATUS_OK:
        reason = _STATUS_REASON.get(reply.status, "rejected")
        status = (
            grpc.StatusCode.FAILED_PRECONDITION
            if reason == "incompatible"
            else grpc.StatusCode.UNAVAILABLE
        )
        raise KvTransferError(reason, reply.message or f"pull rejected ({reason})", status)
    return reply
