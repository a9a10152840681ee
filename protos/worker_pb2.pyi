from splitserve.protos import generate_pb2 as _generate_pb2
from splitserve.protos import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "lease_ttl_ms", "kv_stream_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    KV_STREAM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParams
    lease_ttl_ms: int
    kv_stream_token: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., lease_ttl_ms: _Optional[int] = ..., kv_stream_token: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_token_logprob", "finish_reason", "stop_reason", "cached_prompt_tokens", "kv", "queue_time_ms", "compute_time_ms", "sampling_time_ms", "handover_start_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_START_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_token_logprob: _generate_pb2.TokenLogprob
    finish_reason: _generate_pb2.FinishReason
    stop_reason: _generate_pb2.StopReason
    cached_prompt_tokens: int
    kv: _kv_pb2.KvHandle
    queue_time_ms: float
    compute_time_ms: float
    sampling_time_ms: float
    handover_start_ms: float
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[_Union[_generate_pb2.TokenLogprob, _Mapping]] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., stop_reason: _Optional[_Union[_generate_pb2.StopReason, _Mapping]] = ..., cached_prompt_tokens: _Optional[int] = ..., kv: _Optional[_Union[_kv_pb2.KvHandle, _Mapping]] = ..., queue_time_ms: _Optional[float] = ..., compute_time_ms: _Optional[float] = ..., sampling_time_ms: _Optional[float] = ..., handover_start_ms: _Optional[float] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "request_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    request_id: str
    def __init__(self, lease_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token_id", "sampling", "kv", "kv_stream")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    KV_STREAM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: _generate_pb2.SamplingParams
    kv: _kv_pb2.KvHandle
    kv_stream: KvStreamSource
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., kv: _Optional[_Union[_kv_pb2.KvHandle, _Mapping]] = ..., kv_stream: _Optional[_Union[KvStreamSource, _Mapping]] = ...) -> None: ...

class KvStreamSource(_message.Message):
    __slots__ = ("address", "model_compat_hash", "token", "shards")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    address: _kv_pb2.UcxAddress
    model_compat_hash: str
    token: str
    shards: _containers.RepeatedCompositeFieldContainer[_kv_pb2.KvShard]
    def __init__(self, address: _Optional[_Union[_kv_pb2.UcxAddress, _Mapping]] = ..., model_compat_hash: _Optional[str] = ..., token: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[_kv_pb2.KvShard, _Mapping]]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "stop_reason", "transfer_time_ms", "queue_time_ms", "kv_recomputed", "kv_recompute_reason", "kv_stream_fallback", "kv_streamed", "admit_wait_ms", "local_prefill_ms", "reserve_wait_ms")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    KV_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    KV_RECOMPUTE_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_STREAM_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    KV_STREAMED_FIELD_NUMBER: _ClassVar[int]
    ADMIT_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    finish_reason: _generate_pb2.FinishReason
    stop_reason: _generate_pb2.StopReason
    transfer_time_ms: float
    queue_time_ms: float
    kv_recomputed: bool
    kv_recompute_reason: str
    kv_stream_fallback: str
    kv_streamed: bool
    admit_wait_ms: float
    local_prefill_ms: float
    reserve_wait_ms: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., stop_reason: _Optional[_Union[_generate_pb2.StopReason, _Mapping]] = ..., transfer_time_ms: _Optional[float] = ..., queue_time_ms: _Optional[float] = ..., kv_recomputed: _Optional[bool] = ..., kv_recompute_reason: _Optional[str] = ..., kv_stream_fallback: _Optional[str] = ..., kv_streamed: _Optional[bool] = ..., admit_wait_ms: _Optional[float] = ..., local_prefill_ms: _Optional[float] = ..., reserve_wait_ms: _Optional[float] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ("max_prefix_hashes",)
    MAX_PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    max_prefix_hashes: int
    def __init__(self, max_prefix_hashes: _Optional[int] = ...) -> None: ...

class PrefixCacheSummary(_message.Message):
    __slots__ = ("block_hashes", "num_cached_blocks", "block_keys")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    num_cached_blocks: int
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., num_cached_blocks: _Optional[int] = ..., block_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("role", "num_running", "num_waiting", "free_blocks", "total_blocks", "block_size", "prefix_cache", "leases_held", "model_compat_hash", "kv_address", "kv_streaming", "kv_shards")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    LEASES_HELD_FIELD_NUMBER: _ClassVar[int]
    MODEL_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_STREAMING_FIELD_NUMBER: _ClassVar[int]
    KV_SHARDS_FIELD_NUMBER: _ClassVar[int]
    role: _generate_pb2.WorkerRole
    num_running: int
    num_waiting: int
    free_blocks: int
    total_blocks: int
    block_size: int
    prefix_cache: PrefixCacheSummary
    leases_held: int
    model_compat_hash: str
    kv_address: _kv_pb2.UcxAddress
    kv_streaming: bool
    kv_shards: _containers.RepeatedCompositeFieldContainer[_kv_pb2.KvShard]
    def __init__(self, role: _Optional[_Union[_generate_pb2.WorkerRole, str]] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., prefix_cache: _Optional[_Union[PrefixCacheSummary, _Mapping]] = ..., leases_held: _Optional[int] = ..., model_compat_hash: _Optional[str] = ..., kv_address: _Optional[_Union[_kv_pb2.UcxAddress, _Mapping]] = ..., kv_streaming: _Optional[bool] = ..., kv_shards: _Optional[_Iterable[_Union[_kv_pb2.KvShard, _Mapping]]] = ...) -> None: ...
