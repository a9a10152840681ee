"""Brings a handed-off request's KV into this pool before it joins the batch.

    reserve blocks (engine thread) -> pull over UCX (kvtransfer) -> submit(input, blocks)
                                   └ failure: give the blocks back, then the policy:
                                     recompute (submit without blocks: the engine recomputes
                                     the prompt, same tokens) or fail (UNAVAILABLE)

An incompatible handle is FAILED_PRECONDITION whatever the policy: recomputing would hide a
deployment error. When the pool is short right now, the request is recomputed once blocks
free up (the scheduler queues it); the first chunk says kv_recomputed, so the router releases
the prefill lease.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from splitserve.decode_worker.config import DecodeFaults
from splitserve.decode_worker.engine_loop import EngineLoop
from splitserve.kvtransfer.client import KvTransferClient
from splitserve.kvtransfer.errors import KvTransferError
from splitserve.protos import kv_pb2
from splitserve.request.errors import RequestError

log = logging.getLogger(__name__)


class KvPuller:
    def __init__(
        self, client: KvTransferClient, policy: str, faults: DecodeFaults | None = None
    ) -> None:
        self.client = client
        self.policy = policy
        self.faults = faults or DecodeFaults()

    async def pull(self, kv: kv_pb2.KvHandle, loop: EngineLoop) -> tuple[list[int] | None, str]:
        """(block ids now holding the prompt's KV, ''), or (None, why): recompute it, and the
        client's last chunk says why (DecodeResponse.kv_recompute_reason)."""
        reserved = loop.reserve_blocks(kv.num_blocks)
        try:
            ids = await asyncio.shield(asyncio.wrap_future(reserved))
        except asyncio.CancelledError:
            # cancelled while the engine thread reserves: blocks it already took go back
            if not reserved.cancel():
                reserved.add_done_callback(lambda f: f.result() and loop.release_blocks(f.result()))
            raise
        if ids is None:
            self.client.metrics.failures.labels("pool_full").inc()
            log.info(
                "%s: no room for %d blocks now; recomputing once blocks free up",
                kv.request_id,
                kv.num_blocks,
            )
            return None, "pool_full"
        if delay := self.faults.pull_delay(kv.request_id):  # tests only: a window before the pull
            try:
                await asyncio.sleep(delay)
            except BaseException:
                loop.release_blocks(ids)
                raise
        # The pull runs as its own task and a cancelled caller does not cancel it: UCX may still
        # write into the pull's staging buffer, which must outlive every posted receive. The
        # pull ends on its own timeouts; only then do its blocks go back.
        task = asyncio.ensure_future(self.client.pull(kv, ids))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(
                lambda t: (t.cancelled() or t.exception(), loop.release_blocks(ids))
            )
            raise
        except KvTransferError as exc:
            loop.release_blocks(ids)
            if exc.status == grpc.StatusCode.FAILED_PRECONDITION:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"kv: {exc}") from None
            if self.policy == "fail":
                raise RequestError.unavailable(
                    f"KV transfer failed ({exc.reason}): {exc}; retry the request "
                    "or set kv_transfer.failure_policy=recompute"
                ) from None
            log.warning(
                "%s: KV transfer failed (%s: %s); recomputing the prompt",
                kv.request_id,
                exc.reason,
                exc,
            )
            return None, exc.reason
        except BaseException:
            loop.release_blocks(ids)
            raise
        return ids, ""

    def close(self) -> None:
        self.client.close()
