"""A puller that will not verify the payload's checksum (kv_transfer.checksum: "never", or the
default between processes of one host) tells the sender (KvPullRequest.skip_checksum), which
then spares its reduction and read-back; one that verifies still gets it and still catches a
corrupted payload. Classic pulls over real UCX (TCP loopback)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_transfer_inprocess import _run

from splitserve.kvtransfer import server as server_module
from splitserve.kvtransfer.config import KvTransferConfig
from splitserve.kvtransfer.errors import KvTransferError
from splitserve.kvtransfer.server import TransferFaults


def _cfg(checksum: str) -> KvTransferConfig:
    return KvTransferConfig(
        max_message_bytes=2**20, data_timeout_s=3, lease_request_timeout_s=3, checksum=checksum
    )


@pytest.mark.parametrize("checksum, sums", [("never", 0), ("always", 1), ("between_hosts", 0)])
def test_the_sender_sums_only_for_a_puller_that_verifies(monkeypatch, checksum, sums):
    calls = []
    real = server_module.payload_checksum_async
    monkeypatch.setattr(
        server_module, "payload_checksum_async", lambda t: calls.append(1) or real(t)
    )
    src, dst, dest, blocks, leases, _ = asyncio.run(_run(cfg=_cfg(checksum)))
    assert torch.equal(dst[:, :, dest], src[:, :, list(blocks)])
    assert leases.pulled == [("L1", True)]
    assert len(calls) == sums  # 127.0.0.1: one host, so between_hosts does not verify


def test_a_verifying_puller_still_catches_corruption():
    faults = TransferFaults(corrupt_payload=True)
    with pytest.raises(KvTransferError) as err:
        asyncio.run(_run(cfg=_cfg("always"), faults=faults))
    assert err.value.reason == "checksum"
