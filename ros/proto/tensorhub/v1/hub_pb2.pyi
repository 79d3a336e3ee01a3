from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HolderState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HOLDER_STATE_UNSPECIFIED: _ClassVar[HolderState]
    PARTIAL: _ClassVar[HolderState]
    COMPLETE: _ClassVar[HolderState]
HOLDER_STATE_UNSPECIFIED: HolderState
PARTIAL: HolderState
COMPLETE: HolderState

class Holder(_message.Message):
    __slots__ = ("name", "endpoints", "topology", "state", "session_id", "fence", "shard")
    class EndpointsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class TopologyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    name: str
    endpoints: _containers.ScalarMap[str, str]
    topology: _containers.ScalarMap[str, str]
    state: HolderState
    session_id: int
    fence: int
    shard: int
    def __init__(self, name: _Optional[str] = ..., endpoints: _Optional[_Mapping[str, str]] = ..., topology: _Optional[_Mapping[str, str]] = ..., state: _Optional[_Union[HolderState, str]] = ..., session_id: _Optional[int] = ..., fence: _Optional[int] = ..., shard: _Optional[int] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes", "global_shape", "global_offsets")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    global_shape: _containers.RepeatedScalarFieldContainer[int]
    global_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., global_shape: _Optional[_Iterable[int]] = ..., global_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("tensors", "total_bytes", "chunk_size", "chunk_xxh3", "metadata", "checksum", "delta")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_XXH3_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    total_bytes: int
    chunk_size: int
    chunk_xxh3: _containers.RepeatedScalarFieldContainer[int]
    metadata: _containers.ScalarMap[str, str]
    checksum: str
    delta: Delta
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., chunk_size: _Optional[int] = ..., chunk_xxh3: _Optional[_Iterable[int]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., checksum: _Optional[str] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("base", "encoding", "encoded_bytes", "encoded_xxh3", "base_checksum", "companion", "result_xxh3")
    BASE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    ENCODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODED_XXH3_FIELD_NUMBER: _ClassVar[int]
    BASE_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    COMPANION_FIELD_NUMBER: _ClassVar[int]
    RESULT_XXH3_FIELD_NUMBER: _ClassVar[int]
    base: int
    encoding: str
    encoded_bytes: _containers.RepeatedScalarFieldContainer[int]
    encoded_xxh3: _containers.RepeatedScalarFieldContainer[int]
    base_checksum: _containers.RepeatedScalarFieldContainer[int]
    companion: str
    result_xxh3: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, base: _Optional[int] = ..., encoding: _Optional[str] = ..., encoded_bytes: _Optional[_Iterable[int]] = ..., encoded_xxh3: _Optional[_Iterable[int]] = ..., base_checksum: _Optional[_Iterable[int]] = ..., companion: _Optional[str] = ..., result_xxh3: _Optional[_Iterable[int]] = ...) -> None: ...

class ReadKey(_message.Message):
    __slots__ = ("id", "key")
    ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    id: int
    key: bytes
    def __init__(self, id: _Optional[int] = ..., key: _Optional[bytes] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("ttl_seconds",)
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: int
    def __init__(self, ttl_seconds: _Optional[int] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "ttl_seconds", "read_key", "revision", "read_keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READ_KEY_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    READ_KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    ttl_seconds: int
    read_key: bytes
    revision: int
    read_keys: _containers.RepeatedCompositeFieldContainer[ReadKey]
    def __init__(self, session_id: _Optional[int] = ..., ttl_seconds: _Optional[int] = ..., read_key: _Optional[bytes] = ..., revision: _Optional[int] = ..., read_keys: _Optional[_Iterable[_Union[ReadKey, _Mapping]]] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    def __init__(self, session_id: _Optional[int] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("session_id", "ttl_seconds", "read_keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READ_KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    ttl_seconds: int
    read_keys: _containers.RepeatedCompositeFieldContainer[ReadKey]
    def __init__(self, session_id: _Optional[int] = ..., ttl_seconds: _Optional[int] = ..., read_keys: _Optional[_Iterable[_Union[ReadKey, _Mapping]]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    def __init__(self, session_id: _Optional[int] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("model", "version", "manifest", "holder", "shard_index", "shard_count", "views", "shards", "declared_revision", "layout_sums", "layout_parts")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    VIEWS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    DECLARED_REVISION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_SUMS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_PARTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    manifest: Manifest
    holder: Holder
    shard_index: int
    shard_count: int
    views: _containers.RepeatedCompositeFieldContainer[PublishView]
    shards: _containers.RepeatedCompositeFieldContainer[PublishRequest]
    declared_revision: int
    layout_sums: _containers.RepeatedCompositeFieldContainer[LayoutSums]
    layout_parts: _containers.RepeatedCompositeFieldContainer[LayoutPart]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., holder: _Optional[_Union[Holder, _Mapping]] = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., views: _Optional[_Iterable[_Union[PublishView, _Mapping]]] = ..., shards: _Optional[_Iterable[_Union[PublishRequest, _Mapping]]] = ..., declared_revision: _Optional[int] = ..., layout_sums: _Optional[_Iterable[_Union[LayoutSums, _Mapping]]] = ..., layout_parts: _Optional[_Iterable[_Union[LayoutPart, _Mapping]]] = ...) -> None: ...

class PublishView(_message.Message):
    __slots__ = ("format", "manifest")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    format: str
    manifest: Manifest
    def __init__(self, format: _Optional[str] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("version", "revision", "visible")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_FIELD_NUMBER: _ClassVar[int]
    version: int
    revision: int
    visible: bool
    def __init__(self, version: _Optional[int] = ..., revision: _Optional[int] = ..., visible: bool = ...) -> None: ...

class ShardOutcome(_message.Message):
    __slots__ = ("shard_index", "revision", "visible", "error", "message", "fields")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    revision: int
    visible: bool
    error: str
    message: str
    fields: str
    def __init__(self, shard_index: _Optional[int] = ..., revision: _Optional[int] = ..., visible: bool = ..., error: _Optional[str] = ..., message: _Optional[str] = ..., fields: _Optional[str] = ...) -> None: ...

class PublishShardsResponse(_message.Message):
    __slots__ = ("version", "outcomes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    version: int
    outcomes: _containers.RepeatedCompositeFieldContainer[ShardOutcome]
    def __init__(self, version: _Optional[int] = ..., outcomes: _Optional[_Iterable[_Union[ShardOutcome, _Mapping]]] = ...) -> None: ...

class LatestRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class LatestResponse(_message.Message):
    __slots__ = ("version", "revision")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    version: int
    revision: int
    def __init__(self, version: _Optional[int] = ..., revision: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("model", "start_revision", "versions_only")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    START_REVISION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_ONLY_FIELD_NUMBER: _ClassVar[int]
    model: str
    start_revision: int
    versions_only: bool
    def __init__(self, model: _Optional[str] = ..., start_revision: _Optional[int] = ..., versions_only: bool = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("kind", "version", "revision", "holder", "holder_name", "holders", "holder_versions")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[WatchEvent.Kind]
        VERSION_PUBLISHED: _ClassVar[WatchEvent.Kind]
        HOLDER_UPDATED: _ClassVar[WatchEvent.Kind]
        HOLDER_REMOVED: _ClassVar[WatchEvent.Kind]
        RESYNC: _ClassVar[WatchEvent.Kind]
    KIND_UNSPECIFIED: WatchEvent.Kind
    VERSION_PUBLISHED: WatchEvent.Kind
    HOLDER_UPDATED: WatchEvent.Kind
    HOLDER_REMOVED: WatchEvent.Kind
    RESYNC: WatchEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    HOLDER_NAME_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    HOLDER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    kind: WatchEvent.Kind
    version: int
    revision: int
    holder: Holder
    holder_name: str
    holders: _containers.RepeatedCompositeFieldContainer[Holder]
    holder_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[WatchEvent.Kind, str]] = ..., version: _Optional[int] = ..., revision: _Optional[int] = ..., holder: _Optional[_Union[Holder, _Mapping]] = ..., holder_name: _Optional[str] = ..., holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ..., holder_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class ResolveRequest(_message.Message):
    __slots__ = ("model", "version", "shard", "omit_manifest", "topology", "fence", "holder", "min_revision", "with_companion")
    class TopologyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    OMIT_MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    MIN_REVISION_FIELD_NUMBER: _ClassVar[int]
    WITH_COMPANION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    shard: int
    omit_manifest: bool
    topology: _containers.ScalarMap[str, str]
    fence: int
    holder: str
    min_revision: int
    with_companion: bool
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., shard: _Optional[int] = ..., omit_manifest: bool = ..., topology: _Optional[_Mapping[str, str]] = ..., fence: _Optional[int] = ..., holder: _Optional[str] = ..., min_revision: _Optional[int] = ..., with_companion: bool = ...) -> None: ...

class ResolveResponse(_message.Message):
    __slots__ = ("version", "manifest", "holders", "read_token", "token_expiry_unix", "revision", "shards", "shard_count", "total_holders", "manifest_digest", "manifest_omitted", "companion")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    READ_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_EXPIRY_UNIX_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_OMITTED_FIELD_NUMBER: _ClassVar[int]
    COMPANION_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest: Manifest
    holders: _containers.RepeatedCompositeFieldContainer[Holder]
    read_token: bytes
    token_expiry_unix: int
    revision: int
    shards: _containers.RepeatedCompositeFieldContainer[Manifest]
    shard_count: int
    total_holders: int
    manifest_digest: bytes
    manifest_omitted: bool
    companion: ResolveResponse
    def __init__(self, version: _Optional[int] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ..., read_token: _Optional[bytes] = ..., token_expiry_unix: _Optional[int] = ..., revision: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[Manifest, _Mapping]]] = ..., shard_count: _Optional[int] = ..., total_holders: _Optional[int] = ..., manifest_digest: _Optional[bytes] = ..., manifest_omitted: bool = ..., companion: _Optional[_Union[ResolveResponse, _Mapping]] = ...) -> None: ...

class RegisterHolderRequest(_message.Message):
    __slots__ = ("model", "version", "holder")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    holder: Holder
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., holder: _Optional[_Union[Holder, _Mapping]] = ...) -> None: ...

class RegisterHolderResponse(_message.Message):
    __slots__ = ("fence", "revision", "candidates", "total_holders")
    FENCE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    fence: int
    revision: int
    candidates: _containers.RepeatedCompositeFieldContainer[Holder]
    total_holders: int
    def __init__(self, fence: _Optional[int] = ..., revision: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ..., total_holders: _Optional[int] = ...) -> None: ...

class UpdateHolderRequest(_message.Message):
    __slots__ = ("model", "version", "holder")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    holder: Holder
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., holder: _Optional[_Union[Holder, _Mapping]] = ...) -> None: ...

class UpdateHolderResponse(_message.Message):
    __slots__ = ("revision",)
    REVISION_FIELD_NUMBER: _ClassVar[int]
    revision: int
    def __init__(self, revision: _Optional[int] = ...) -> None: ...

class ReleaseHolderRequest(_message.Message):
    __slots__ = ("model", "version", "holder", "force", "session_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    holder: str
    force: bool
    session_id: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., holder: _Optional[str] = ..., force: bool = ..., session_id: _Optional[int] = ...) -> None: ...

class ReleaseHolderResponse(_message.Message):
    __slots__ = ("revision",)
    REVISION_FIELD_NUMBER: _ClassVar[int]
    revision: int
    def __init__(self, revision: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("model", "version", "pin_id", "session_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    pin_id: str
    session_id: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., pin_id: _Optional[str] = ..., session_id: _Optional[int] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("revision",)
    REVISION_FIELD_NUMBER: _ClassVar[int]
    revision: int
    def __init__(self, revision: _Optional[int] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("model", "version", "pin_id", "session_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    pin_id: str
    session_id: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., pin_id: _Optional[str] = ..., session_id: _Optional[int] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("revision",)
    REVISION_FIELD_NUMBER: _ClassVar[int]
    revision: int
    def __init__(self, revision: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelSummary(_message.Message):
    __slots__ = ("name", "latest", "versions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    latest: int
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., latest: _Optional[int] = ..., versions: _Optional[_Iterable[int]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "revision")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelSummary]
    revision: int
    def __init__(self, models: _Optional[_Iterable[_Union[ModelSummary, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("model", "version", "page_size", "page_token", "omit_manifest")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OMIT_MANIFEST_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    page_size: int
    page_token: str
    omit_manifest: bool
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., omit_manifest: bool = ...) -> None: ...

class InspectResponse(_message.Message):
    __slots__ = ("version", "latest", "manifest", "holders", "pins", "published_revision", "revision", "retained", "shards", "next_page_token", "total_holders", "shard_count")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_REVISION_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    version: int
    latest: int
    manifest: Manifest
    holders: _containers.RepeatedCompositeFieldContainer[Holder]
    pins: _containers.RepeatedScalarFieldContainer[str]
    published_revision: int
    revision: int
    retained: bool
    shards: _containers.RepeatedCompositeFieldContainer[Manifest]
    next_page_token: str
    total_holders: int
    shard_count: int
    def __init__(self, version: _Optional[int] = ..., latest: _Optional[int] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ..., pins: _Optional[_Iterable[str]] = ..., published_revision: _Optional[int] = ..., revision: _Optional[int] = ..., retained: bool = ..., shards: _Optional[_Iterable[_Union[Manifest, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total_holders: _Optional[int] = ..., shard_count: _Optional[int] = ...) -> None: ...

class Quotas(_message.Message):
    __slots__ = ("max_models", "max_retained_versions", "max_sessions", "max_etcd_bytes", "max_publishes_per_minute", "max_history_bytes")
    MAX_MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_RETAINED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_ETCD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PUBLISHES_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    MAX_HISTORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_models: int
    max_retained_versions: int
    max_sessions: int
    max_etcd_bytes: int
    max_publishes_per_minute: int
    max_history_bytes: int
    def __init__(self, max_models: _Optional[int] = ..., max_retained_versions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_etcd_bytes: _Optional[int] = ..., max_publishes_per_minute: _Optional[int] = ..., max_history_bytes: _Optional[int] = ...) -> None: ...

class CreateTenantRequest(_message.Message):
    __slots__ = ("name", "quotas")
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUOTAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    quotas: Quotas
    def __init__(self, name: _Optional[str] = ..., quotas: _Optional[_Union[Quotas, _Mapping]] = ...) -> None: ...

class CreateTenantResponse(_message.Message):
    __slots__ = ("name", "token", "warning")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    name: str
    token: str
    warning: str
    def __init__(self, name: _Optional[str] = ..., token: _Optional[str] = ..., warning: _Optional[str] = ...) -> None: ...

class DeleteTenantRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteTenantResponse(_message.Message):
    __slots__ = ("revision",)
    REVISION_FIELD_NUMBER: _ClassVar[int]
    revision: int
    def __init__(self, revision: _Optional[int] = ...) -> None: ...

class DeleteModelRequest(_message.Message):
    __slots__ = ("model", "tenant")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    model: str
    tenant: str
    def __init__(self, model: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class DeleteModelResponse(_message.Message):
    __slots__ = ("revision", "versions_deleted")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_DELETED_FIELD_NUMBER: _ClassVar[int]
    revision: int
    versions_deleted: int
    def __init__(self, revision: _Optional[int] = ..., versions_deleted: _Optional[int] = ...) -> None: ...

class RegisterLayoutHolderRequest(_message.Message):
    __slots__ = ("model", "version", "layout", "block_set", "holder", "block_sums", "blocks")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SET_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SUMS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    layout: str
    block_set: str
    holder: Holder
    block_sums: _containers.RepeatedScalarFieldContainer[int]
    blocks: bytes
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., layout: _Optional[str] = ..., block_set: _Optional[str] = ..., holder: _Optional[_Union[Holder, _Mapping]] = ..., block_sums: _Optional[_Iterable[int]] = ..., blocks: _Optional[bytes] = ...) -> None: ...

class RegisterLayoutHolderResponse(_message.Message):
    __slots__ = ("fence", "revision", "block_sums", "holders", "total_holders", "publisher_sums")
    FENCE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SUMS_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_SUMS_FIELD_NUMBER: _ClassVar[int]
    fence: int
    revision: int
    block_sums: _containers.RepeatedScalarFieldContainer[int]
    holders: _containers.RepeatedCompositeFieldContainer[Holder]
    total_holders: int
    publisher_sums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, fence: _Optional[int] = ..., revision: _Optional[int] = ..., block_sums: _Optional[_Iterable[int]] = ..., holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ..., total_holders: _Optional[int] = ..., publisher_sums: _Optional[_Iterable[int]] = ...) -> None: ...

class ResolveLayoutRequest(_message.Message):
    __slots__ = ("model", "version", "layout", "block_set", "topology", "holder")
    class TopologyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SET_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    layout: str
    block_set: str
    topology: _containers.ScalarMap[str, str]
    holder: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., layout: _Optional[str] = ..., block_set: _Optional[str] = ..., topology: _Optional[_Mapping[str, str]] = ..., holder: _Optional[str] = ...) -> None: ...

class ResolveLayoutResponse(_message.Message):
    __slots__ = ("holders", "block_sums", "revision", "total_holders", "publisher_sums")
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SUMS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_SUMS_FIELD_NUMBER: _ClassVar[int]
    holders: _containers.RepeatedCompositeFieldContainer[Holder]
    block_sums: _containers.RepeatedScalarFieldContainer[int]
    revision: int
    total_holders: int
    publisher_sums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ..., block_sums: _Optional[_Iterable[int]] = ..., revision: _Optional[int] = ..., total_holders: _Optional[int] = ..., publisher_sums: _Optional[_Iterable[int]] = ...) -> None: ...

class ResolveLayoutCoverRequest(_message.Message):
    __slots__ = ("model", "version", "layout", "topology", "holder")
    class TopologyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    layout: str
    topology: _containers.ScalarMap[str, str]
    holder: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., layout: _Optional[str] = ..., topology: _Optional[_Mapping[str, str]] = ..., holder: _Optional[str] = ...) -> None: ...

class LayoutBlockSet(_message.Message):
    __slots__ = ("block_set", "blocks", "block_sums", "holders", "publisher_sums")
    BLOCK_SET_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SUMS_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_SUMS_FIELD_NUMBER: _ClassVar[int]
    block_set: str
    blocks: bytes
    block_sums: _containers.RepeatedScalarFieldContainer[int]
    holders: _containers.RepeatedCompositeFieldContainer[Holder]
    publisher_sums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_set: _Optional[str] = ..., blocks: _Optional[bytes] = ..., block_sums: _Optional[_Iterable[int]] = ..., holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ..., publisher_sums: _Optional[_Iterable[int]] = ...) -> None: ...

class ResolveLayoutCoverResponse(_message.Message):
    __slots__ = ("block_sets", "revision")
    BLOCK_SETS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    block_sets: _containers.RepeatedCompositeFieldContainer[LayoutBlockSet]
    revision: int
    def __init__(self, block_sets: _Optional[_Iterable[_Union[LayoutBlockSet, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...

class ReleaseLayoutHolderRequest(_message.Message):
    __slots__ = ("model", "version", "layout", "block_set", "holder", "session_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SET_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    layout: str
    block_set: str
    holder: str
    session_id: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., layout: _Optional[str] = ..., block_set: _Optional[str] = ..., holder: _Optional[str] = ..., session_id: _Optional[int] = ...) -> None: ...

class ReleaseLayoutHolderResponse(_message.Message):
    __slots__ = ("revision",)
    REVISION_FIELD_NUMBER: _ClassVar[int]
    revision: int
    def __init__(self, revision: _Optional[int] = ...) -> None: ...

class LayoutSums(_message.Message):
    __slots__ = ("layout", "block_set", "sums")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SET_FIELD_NUMBER: _ClassVar[int]
    SUMS_FIELD_NUMBER: _ClassVar[int]
    layout: str
    block_set: str
    sums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layout: _Optional[str] = ..., block_set: _Optional[str] = ..., sums: _Optional[_Iterable[int]] = ...) -> None: ...

class DeclareLayoutRequest(_message.Message):
    __slots__ = ("model", "layout", "block_sets")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SETS_FIELD_NUMBER: _ClassVar[int]
    model: str
    layout: str
    block_sets: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, model: _Optional[str] = ..., layout: _Optional[str] = ..., block_sets: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeclareLayoutResponse(_message.Message):
    __slots__ = ("revision",)
    REVISION_FIELD_NUMBER: _ClassVar[int]
    revision: int
    def __init__(self, revision: _Optional[int] = ...) -> None: ...

class RetireLayoutRequest(_message.Message):
    __slots__ = ("model", "layout")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    model: str
    layout: str
    def __init__(self, model: _Optional[str] = ..., layout: _Optional[str] = ...) -> None: ...

class RetireLayoutResponse(_message.Message):
    __slots__ = ("revision", "retired")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    RETIRED_FIELD_NUMBER: _ClassVar[int]
    revision: int
    retired: bool
    def __init__(self, revision: _Optional[int] = ..., retired: bool = ...) -> None: ...

class DeclaredLayoutsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class DeclaredLayout(_message.Message):
    __slots__ = ("layout", "block_sets")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SETS_FIELD_NUMBER: _ClassVar[int]
    layout: str
    block_sets: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, layout: _Optional[str] = ..., block_sets: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeclaredLayoutsResponse(_message.Message):
    __slots__ = ("layouts", "revision")
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    layouts: _containers.RepeatedCompositeFieldContainer[DeclaredLayout]
    revision: int
    def __init__(self, layouts: _Optional[_Iterable[_Union[DeclaredLayout, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...

class LayoutPart(_message.Message):
    __slots__ = ("layout", "block_set", "tensor", "offsets", "shape", "chunks", "sums")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SET_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SUMS_FIELD_NUMBER: _ClassVar[int]
    layout: str
    block_set: str
    tensor: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    chunks: _containers.RepeatedScalarFieldContainer[int]
    sums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layout: _Optional[str] = ..., block_set: _Optional[str] = ..., tensor: _Optional[str] = ..., offsets: _Optional[_Iterable[int]] = ..., shape: _Optional[_Iterable[int]] = ..., chunks: _Optional[_Iterable[int]] = ..., sums: _Optional[_Iterable[int]] = ...) -> None: ...
