"""Transfer settings: every wait has a timeout; a failed pull follows a stated policy. Also
the listener's fault-injection seam (TransferFaults), for tests only."""

from __future__ import annotations

import warnings
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MIN_MESSAGE_BYTES = 2**20


class KvTransferConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    connect_timeout_s: float = Field(5.0, gt=0, description="UCX endpoint connect")
    lease_request_timeout_s: float = Field(5.0, gt=0, description="pull request -> reply")
    data_timeout_s: float = Field(30.0, gt=0, description="whole payload receive")
    # recompute: the decode worker recomputes the prompt itself (same tokens, later);
    # fail: the request ends with UNAVAILABLE.
    failure_policy: Literal["recompute", "fail"] = "recompute"
    max_message_bytes: int = Field(
        256 * 2**20, ge=MIN_MESSAGE_BYTES, description="payload split above this size"
    )

    @model_validator(mode="before")
    @classmethod
    def _old_verify_checksum(cls, data):
        """`verify_checksum` (before wire protocol 2): true -> checksum always, false -> never."""
        if isinstance(data, dict) and "verify_checksum" in data:
            data = dict(data)
            old = data.pop("verify_checksum")
            if "checksum" in data:
                raise ValueError(
                    "kv_transfer.verify_checksum is replaced by kv_transfer.checksum: set only "
                    "checksum (between_hosts, always or never)"
                )
            warnings.warn(
                "kv_transfer.verify_checksum is deprecated: use kv_transfer.checksum "
                "(between_hosts, always or never)",
                DeprecationWarning,
                stacklevel=2,
            )
            data["checksum"] = "always" if old else "never"
        return data

    checksum: Literal["between_hosts", "always", "never"] = Field(
        "between_hosts",
        description="verify the payload's checksum: between_hosts (pulls from another host, "
        "TCP or RDMA; skipped on one host: shared memory, cuda_ipc), always or never",
    )
    streaming: bool = Field(
        True,
        description="streamed hand-over: the decode worker is called while the prompt is "
        "prefilled and receives each layer group's KV as it is written (a tensor-parallel "
        "prefill: one stream per rank); off: the pull after the prefill for every request",
    )
    stream_layer_groups: int = Field(
        64,
        ge=1,
        description="streamed hand-over: pieces per prefill step (layer groups, at most one "
        "per layer: the default sends each layer as soon as it is written, so only the last "
        "layer's transfer is left when the step ends)",
    )
    stream_reserve_wait_s: float = Field(
        10.0,
        gt=0,
        description="streamed hand-over: how long a decode worker waits for free blocks "
        "(backpressure) before it hands the request back to the pull after the prefill",
    )
    progress_wait_ms: int | None = Field(
        None,
        ge=-1,
        description="how long ucxx's progress thread sleeps when no UCX event wakes it "
        "(events wake it at once); None: 100, but ucxx's 1 on CUDA with poll_while_busy off; "
        "-1: events only. "
        "Longer waits let an idle worker sleep (kvtransfer/progress_wait.py)",
    )
    poll_while_busy: bool | None = Field(
        None,
        description="ucxx's progress thread polls while a KV transfer is in flight (and half a "
        "second after), then waits again: a CUDA copy's completion is otherwise found only when "
        "the wait ends. None: on for CUDA, off on CPU (TCP and shared memory wake the thread)",
    )
    listen_host: str | None = Field(
        None,
        min_length=1,
        description="address the UCX KV listener binds; None: the worker's own host "
        "(`server.host`: 127.0.0.1 keeps the KV port on loopback); 0.0.0.0: every interface. "
        "Where ucxx cannot bind one address (kvtransfer/bound_listener.py) it binds every "
        "interface and logs a warning",
    )
    max_connections: int = Field(
        512,
        ge=1,
        description="UCX KV connections one listener keeps (a decode worker opens up to 32 "
        "per prefill rank: 16 for pulls, 16 for streams); beyond it a new connection replaces "
        "the one idle the longest, or is refused while every one is mid-pull",
    )
    idle_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a UCX KV connection idle this long is closed by the listener (the decode "
        "side connects anew for its next pull)",
    )
    # peers dial the worker's advertised host
    listen_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="0 picks a free port; under tensor parallelism rank "
        "r of a prefill worker listens on listen_port + r",
    )

    @field_validator("progress_wait_ms")
    @classmethod
    def _no_spin(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError(
                "0 would make the progress thread spin; give -1 (events only) or >= 1 ms"
            )
        return v

    def message_limit(self, requested: int) -> int:
        """Bytes per payload message of one pull: ours, or the puller's if lower (0: none),
        never below the least a worker may configure (a peer asking for 1 byte would make a
        payload millions of messages)."""
        return max(MIN_MESSAGE_BYTES, min(self.max_message_bytes, requested or 2**62))

    def for_rank(self, rank: int) -> KvTransferConfig:
        """The settings of tensor-parallel rank `rank`'s listener: a fixed port moves up by the rank
        (every rank of a worker binds on the same host); 0 stays 0."""
        if not self.listen_port or not rank:
            return self
        return self.model_copy(update={"listen_port": self.listen_port + rank})


# the workers' start-up rehearsal requests (prefill_worker/rehearsal.py,
# decode_worker/rehearsal.py): no test fault ever hits them
REHEARSAL_ID = "splitserve-start-up-rehearsal"


class RequestFaults(BaseModel):
    """Base of the test-only fault seams (TransferFaults, PrefillFaults, DecodeFaults): which
    requests a seam's faults hit, by request id prefix (never the start-up rehearsal)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id_prefix: str = Field(
        "", description="test only: faults hit request ids with this prefix (empty: every request)"
    )

    def hits(self, request_id: str) -> bool:
        return request_id.startswith(self.request_id_prefix) and request_id != REHEARSAL_ID


class TransferFaults(RequestFaults):
    """For tests only (tests/faults, tests/kvtransfer): what the prefill side's listener does
    wrong on purpose. Every field off by default; never set in production."""

    corrupt_payload: bool = Field(False, description="test only: flip bytes of the payload sent")
    truncate_payload: bool = Field(
        False, description="test only: send only the first half of the last message"
    )
    misstate_payload_bytes: bool = Field(
        False, description="test only: announce one byte fewer than sent"
    )
    stall_before_payload_s: float = Field(
        0.0, ge=0, description="test only: sleep between reply and payload"
    )
    message_bytes: int = Field(
        0,
        ge=0,
        description="test only: split the payload into messages this small (0: as configured)",
    )
    stall_after_first_message_s: float = Field(
        0.0, ge=0, description="test only: sleep after the payload's first message"
    )
    stream_break_after_pieces: int = Field(
        0,
        ge=0,
        description="test only: a streamed pull's endpoint dies after this many pieces "
        "(between two layer groups); 0: never",
    )
    stream_break_rank: int = Field(
        -1,
        ge=-1,
        description="test only: the tensor-parallel rank whose streams stream_break_after_pieces "
        "breaks (-1: every rank)",
    )

    def for_stream_rank(self, rank: int) -> TransferFaults:
        """The faults tensor-parallel rank `rank`'s streamed pulls inject."""
        if self.stream_break_rank in (-1, rank):
            return self
        return self.model_copy(update={"stream_break_after_pieces": 0})
