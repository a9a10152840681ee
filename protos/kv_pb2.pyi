from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_LAYOUT_UNSPECIFIED: _ClassVar[KvLayout]
    KV_LAYOUT_LAYER_KV_BLOCK_TOKEN_HEAD_DIM: _ClassVar[KvLayout]

class KvDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KvDtype]
    KV_DTYPE_FP32: _ClassVar[KvDtype]
    KV_DTYPE_FP16: _ClassVar[KvDtype]
    KV_DTYPE_BF16: _ClassVar[KvDtype]

class KvPullStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_PULL_STATUS_UNSPECIFIED: _ClassVar[KvPullStatus]
    KV_PULL_STATUS_OK: _ClassVar[KvPullStatus]
    KV_PULL_STATUS_LEASE_UNKNOWN: _ClassVar[KvPullStatus]
    KV_PULL_STATUS_LEASE_EXPIRED: _ClassVar[KvPullStatus]
    KV_PULL_STATUS_INCOMPATIBLE: _ClassVar[KvPullStatus]
    KV_PULL_STATUS_ABORTED: _ClassVar[KvPullStatus]
KV_LAYOUT_UNSPECIFIED: KvLayout
KV_LAYOUT_LAYER_KV_BLOCK_TOKEN_HEAD_DIM: KvLayout
KV_DTYPE_UNSPECIFIED: KvDtype
KV_DTYPE_FP32: KvDtype
KV_DTYPE_FP16: KvDtype
KV_DTYPE_BF16: KvDtype
KV_PULL_STATUS_UNSPECIFIED: KvPullStatus
KV_PULL_STATUS_OK: KvPullStatus
KV_PULL_STATUS_LEASE_UNKNOWN: KvPullStatus
KV_PULL_STATUS_LEASE_EXPIRED: KvPullStatus
KV_PULL_STATUS_INCOMPATIBLE: KvPullStatus
KV_PULL_STATUS_ABORTED: KvPullStatus

class UcxAddress(_message.Message):
    __slots__ = ("host", "port", "worker_address")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    worker_address: bytes
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., worker_address: _Optional[bytes] = ...) -> None: ...

class KvShard(_message.Message):
    __slots__ = ("tp_rank", "tp_size", "kv_head_start", "kv_head_end", "address")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    tp_size: int
    kv_head_start: int
    kv_head_end: int
    address: UcxAddress
    def __init__(self, tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ..., address: _Optional[_Union[UcxAddress, _Mapping]] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("address", "lease_id", "request_id", "num_blocks", "block_size", "num_tokens", "layout", "dtype", "num_layers", "num_kv_heads", "head_dim", "model_compat_hash", "expires_at_unix_ms", "ttl_ms", "shards")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MODEL_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    address: UcxAddress
    lease_id: str
    request_id: str
    num_blocks: int
    block_size: int
    num_tokens: int
    layout: KvLayout
    dtype: KvDtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_compat_hash: str
    expires_at_unix_ms: int
    ttl_ms: int
    shards: _containers.RepeatedCompositeFieldContainer[KvShard]
    def __init__(self, address: _Optional[_Union[UcxAddress, _Mapping]] = ..., lease_id: _Optional[str] = ..., request_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, str]] = ..., dtype: _Optional[_Union[KvDtype, str]] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., model_compat_hash: _Optional[str] = ..., expires_at_unix_ms: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[KvShard, _Mapping]]] = ...) -> None: ...

class KvPullRequest(_message.Message):
    __slots__ = ("lease_id", "request_id", "layout", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "model_compat_hash", "max_message_bytes", "stream", "num_tokens", "stream_token", "skip_checksum")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MODEL_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SKIP_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    request_id: str
    layout: KvLayout
    dtype: KvDtype
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_compat_hash: str
    max_message_bytes: int
    stream: bool
    num_tokens: int
    stream_token: str
    skip_checksum: bool
    def __init__(self, lease_id: _Optional[str] = ..., request_id: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, str]] = ..., dtype: _Optional[_Union[KvDtype, str]] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., model_compat_hash: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., stream: _Optional[bool] = ..., num_tokens: _Optional[int] = ..., stream_token: _Optional[str] = ..., skip_checksum: _Optional[bool] = ...) -> None: ...

class KvPullReply(_message.Message):
    __slots__ = ("status", "message", "payload_bytes", "num_messages", "num_blocks", "checksum")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    status: KvPullStatus
    message: str
    payload_bytes: int
    num_messages: int
    num_blocks: int
    checksum: int
    def __init__(self, status: _Optional[_Union[KvPullStatus, str]] = ..., message: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., num_messages: _Optional[int] = ..., num_blocks: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class KvPullDone(_message.Message):
    __slots__ = ("lease_id", "ok")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ok: bool
    def __init__(self, lease_id: _Optional[str] = ..., ok: _Optional[bool] = ...) -> None: ...

class KvStreamPiece(_message.Message):
    __slots__ = ("layer_start", "layer_end", "block_start", "block_end", "payload_bytes", "checksum", "final", "status", "message", "first_token_id", "finished", "lease_id")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_END_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_end: int
    block_start: int
    block_end: int
    payload_bytes: int
    checksum: int
    final: bool
    status: KvPullStatus
    message: str
    first_token_id: int
    finished: bool
    lease_id: str
    def __init__(self, layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., block_start: _Optional[int] = ..., block_end: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., final: _Optional[bool] = ..., status: _Optional[_Union[KvPullStatus, str]] = ..., message: _Optional[str] = ..., first_token_id: _Optional[int] = ..., finished: _Optional[bool] = ..., lease_id: _Optional[str] = ...) -> None: ...
