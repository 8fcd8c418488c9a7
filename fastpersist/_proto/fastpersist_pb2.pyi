from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("version", "root", "staging_budget", "staging_in_use", "checkpoints_in_flight", "direct_io", "io_backend", "tier_url", "tier_pending", "tier_failing", "tier_uploaded", "tier_failures", "tier_last_error", "features", "client_budget", "memory_tier_count", "memory_tier_budget", "memory_tier_bytes", "memory_tier_copies", "node_name", "failure_domain", "job", "peers", "replicas", "replica_budget", "replica_bytes", "replicas_held", "replication_pending", "staging_in_use_peak", "staging_mapped_peak")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    STAGING_BUDGET_FIELD_NUMBER: _ClassVar[int]
    STAGING_IN_USE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DIRECT_IO_FIELD_NUMBER: _ClassVar[int]
    IO_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIER_URL_FIELD_NUMBER: _ClassVar[int]
    TIER_PENDING_FIELD_NUMBER: _ClassVar[int]
    TIER_FAILING_FIELD_NUMBER: _ClassVar[int]
    TIER_UPLOADED_FIELD_NUMBER: _ClassVar[int]
    TIER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    TIER_LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    CLIENT_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TIER_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TIER_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TIER_COPIES_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BUDGET_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_HELD_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_PENDING_FIELD_NUMBER: _ClassVar[int]
    STAGING_IN_USE_PEAK_FIELD_NUMBER: _ClassVar[int]
    STAGING_MAPPED_PEAK_FIELD_NUMBER: _ClassVar[int]
    version: str
    root: str
    staging_budget: int
    staging_in_use: int
    checkpoints_in_flight: int
    direct_io: bool
    io_backend: str
    tier_url: str
    tier_pending: int
    tier_failing: int
    tier_uploaded: int
    tier_failures: int
    tier_last_error: str
    features: _containers.RepeatedScalarFieldContainer[str]
    client_budget: int
    memory_tier_count: int
    memory_tier_budget: int
    memory_tier_bytes: int
    memory_tier_copies: int
    node_name: str
    failure_domain: str
    job: str
    peers: _containers.RepeatedScalarFieldContainer[str]
    replicas: int
    replica_budget: int
    replica_bytes: int
    replicas_held: int
    replication_pending: int
    staging_in_use_peak: int
    staging_mapped_peak: int
    def __init__(self, version: _Optional[str] = ..., root: _Optional[str] = ..., staging_budget: _Optional[int] = ..., staging_in_use: _Optional[int] = ..., checkpoints_in_flight: _Optional[int] = ..., direct_io: _Optional[bool] = ..., io_backend: _Optional[str] = ..., tier_url: _Optional[str] = ..., tier_pending: _Optional[int] = ..., tier_failing: _Optional[int] = ..., tier_uploaded: _Optional[int] = ..., tier_failures: _Optional[int] = ..., tier_last_error: _Optional[str] = ..., features: _Optional[_Iterable[str]] = ..., client_budget: _Optional[int] = ..., memory_tier_count: _Optional[int] = ..., memory_tier_budget: _Optional[int] = ..., memory_tier_bytes: _Optional[int] = ..., memory_tier_copies: _Optional[int] = ..., node_name: _Optional[str] = ..., failure_domain: _Optional[str] = ..., job: _Optional[str] = ..., peers: _Optional[_Iterable[str]] = ..., replicas: _Optional[int] = ..., replica_budget: _Optional[int] = ..., replica_bytes: _Optional[int] = ..., replicas_held: _Optional[int] = ..., replication_pending: _Optional[int] = ..., staging_in_use_peak: _Optional[int] = ..., staging_mapped_peak: _Optional[int] = ...) -> None: ...

class BeginRequest(_message.Message):
    __slots__ = ("path", "client_id", "staging_bytes", "file_count", "job_id", "rank", "compression", "frame_bytes", "durability")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILE_COUNT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    path: str
    client_id: str
    staging_bytes: int
    file_count: int
    job_id: str
    rank: int
    compression: str
    frame_bytes: int
    durability: str
    def __init__(self, path: _Optional[str] = ..., client_id: _Optional[str] = ..., staging_bytes: _Optional[int] = ..., file_count: _Optional[int] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., compression: _Optional[str] = ..., frame_bytes: _Optional[int] = ..., durability: _Optional[str] = ...) -> None: ...

class BeginResponse(_message.Message):
    __slots__ = ("checkpoint_id",)
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    def __init__(self, checkpoint_id: _Optional[str] = ...) -> None: ...

class DataFile(_message.Message):
    __slots__ = ("index", "header")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    index: int
    header: bytes
    def __init__(self, index: _Optional[int] = ..., header: _Optional[bytes] = ...) -> None: ...

class ShmRef(_message.Message):
    __slots__ = ("segment", "offset", "length")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    segment: str
    offset: int
    length: int
    def __init__(self, segment: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class SubmitShmRequest(_message.Message):
    __slots__ = ("checkpoint_id", "file", "data", "header_ref")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    HEADER_REF_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    file: DataFile
    data: ShmRef
    header_ref: ShmRef
    def __init__(self, checkpoint_id: _Optional[str] = ..., file: _Optional[_Union[DataFile, _Mapping]] = ..., data: _Optional[_Union[ShmRef, _Mapping]] = ..., header_ref: _Optional[_Union[ShmRef, _Mapping]] = ...) -> None: ...

class StreamChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: StreamHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[StreamHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StreamHeader(_message.Message):
    __slots__ = ("checkpoint_id", "file", "data_length", "header_length")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    DATA_LENGTH_FIELD_NUMBER: _ClassVar[int]
    HEADER_LENGTH_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    file: DataFile
    data_length: int
    header_length: int
    def __init__(self, checkpoint_id: _Optional[str] = ..., file: _Optional[_Union[DataFile, _Mapping]] = ..., data_length: _Optional[int] = ..., header_length: _Optional[int] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("checkpoint_id", "tree_json", "tensor_order", "after_commit")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ORDER_FIELD_NUMBER: _ClassVar[int]
    AFTER_COMMIT_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    tree_json: str
    tensor_order: _containers.RepeatedScalarFieldContainer[str]
    after_commit: AfterCommit
    def __init__(self, checkpoint_id: _Optional[str] = ..., tree_json: _Optional[str] = ..., tensor_order: _Optional[_Iterable[str]] = ..., after_commit: _Optional[_Union[AfterCommit, _Mapping]] = ...) -> None: ...

class AfterCommit(_message.Message):
    __slots__ = ("point_latest", "keep_last", "keep_every", "skip_tier")
    POINT_LATEST_FIELD_NUMBER: _ClassVar[int]
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    KEEP_EVERY_FIELD_NUMBER: _ClassVar[int]
    SKIP_TIER_FIELD_NUMBER: _ClassVar[int]
    point_latest: bool
    keep_last: int
    keep_every: int
    skip_tier: bool
    def __init__(self, point_latest: _Optional[bool] = ..., keep_last: _Optional[int] = ..., keep_every: _Optional[int] = ..., skip_tier: _Optional[bool] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommitChunk(_message.Message):
    __slots__ = ("header", "data", "payload_length")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LENGTH_FIELD_NUMBER: _ClassVar[int]
    header: CommitRequest
    data: bytes
    payload_length: int
    def __init__(self, header: _Optional[_Union[CommitRequest, _Mapping]] = ..., data: _Optional[bytes] = ..., payload_length: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("checkpoint_id",)
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    def __init__(self, checkpoint_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WaitRequest(_message.Message):
    __slots__ = ("checkpoint_id", "min_files_written")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_FILES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    min_files_written: int
    def __init__(self, checkpoint_id: _Optional[str] = ..., min_files_written: _Optional[int] = ...) -> None: ...

class CheckpointStatus(_message.Message):
    __slots__ = ("checkpoint_id", "path", "state", "bytes_written", "bytes_total", "error", "files_written", "files_total", "error_code", "part_json", "after_commit_error", "compression", "durability")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[CheckpointStatus.State]
        RECEIVING: _ClassVar[CheckpointStatus.State]
        WRITING: _ClassVar[CheckpointStatus.State]
        COMMITTED: _ClassVar[CheckpointStatus.State]
        FAILED: _ClassVar[CheckpointStatus.State]
        ABORTED: _ClassVar[CheckpointStatus.State]
    STATE_UNSPECIFIED: CheckpointStatus.State
    RECEIVING: CheckpointStatus.State
    WRITING: CheckpointStatus.State
    COMMITTED: CheckpointStatus.State
    FAILED: CheckpointStatus.State
    ABORTED: CheckpointStatus.State
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FILES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    FILES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    PART_JSON_FIELD_NUMBER: _ClassVar[int]
    AFTER_COMMIT_ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    path: str
    state: CheckpointStatus.State
    bytes_written: int
    bytes_total: int
    error: str
    files_written: int
    files_total: int
    error_code: str
    part_json: str
    after_commit_error: str
    compression: str
    durability: str
    def __init__(self, checkpoint_id: _Optional[str] = ..., path: _Optional[str] = ..., state: _Optional[_Union[CheckpointStatus.State, str]] = ..., bytes_written: _Optional[int] = ..., bytes_total: _Optional[int] = ..., error: _Optional[str] = ..., files_written: _Optional[int] = ..., files_total: _Optional[int] = ..., error_code: _Optional[str] = ..., part_json: _Optional[str] = ..., after_commit_error: _Optional[str] = ..., compression: _Optional[str] = ..., durability: _Optional[str] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class ListEntry(_message.Message):
    __slots__ = ("name", "state", "bytes", "created_unix", "note")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    bytes: int
    created_unix: float
    note: str
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., bytes: _Optional[int] = ..., created_unix: _Optional[float] = ..., note: _Optional[str] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("entries", "in_flight", "memory_only")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ONLY_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[ListEntry]
    in_flight: _containers.RepeatedCompositeFieldContainer[CheckpointStatus]
    memory_only: _containers.RepeatedCompositeFieldContainer[ListEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[ListEntry, _Mapping]]] = ..., in_flight: _Optional[_Iterable[_Union[CheckpointStatus, _Mapping]]] = ..., memory_only: _Optional[_Iterable[_Union[ListEntry, _Mapping]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BeginJobRequest(_message.Message):
    __slots__ = ("path", "client_id")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    path: str
    client_id: str
    def __init__(self, path: _Optional[str] = ..., client_id: _Optional[str] = ...) -> None: ...

class BeginJobResponse(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CommitJobRequest(_message.Message):
    __slots__ = ("job_id", "manifest", "node", "after_commit", "prepare_for", "files")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    AFTER_COMMIT_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FOR_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    manifest: bytes
    node: str
    after_commit: AfterCommit
    prepare_for: str
    files: _containers.ScalarMap[str, bytes]
    def __init__(self, job_id: _Optional[str] = ..., manifest: _Optional[bytes] = ..., node: _Optional[str] = ..., after_commit: _Optional[_Union[AfterCommit, _Mapping]] = ..., prepare_for: _Optional[str] = ..., files: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class CommitJobChunk(_message.Message):
    __slots__ = ("header", "data", "payload_length")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LENGTH_FIELD_NUMBER: _ClassVar[int]
    header: CommitJobRequest
    data: bytes
    payload_length: int
    def __init__(self, header: _Optional[_Union[CommitJobRequest, _Mapping]] = ..., data: _Optional[bytes] = ..., payload_length: _Optional[int] = ...) -> None: ...

class CommitJobResponse(_message.Message):
    __slots__ = ("after_commit_error", "prepared")
    AFTER_COMMIT_ERROR_FIELD_NUMBER: _ClassVar[int]
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    after_commit_error: str
    prepared: str
    def __init__(self, after_commit_error: _Optional[str] = ..., prepared: _Optional[str] = ...) -> None: ...

class AbortJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class AbortJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResolvePreparedRequest(_message.Message):
    __slots__ = ("path", "prepared", "publish")
    PATH_FIELD_NUMBER: _ClassVar[int]
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    path: str
    prepared: str
    publish: bool
    def __init__(self, path: _Optional[str] = ..., prepared: _Optional[str] = ..., publish: _Optional[bool] = ...) -> None: ...

class ResolvePreparedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemoryCopyRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class MemoryCopyResponse(_message.Message):
    __slots__ = ("directory", "manifest", "reason", "memory_only")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ONLY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    manifest: bytes
    reason: str
    memory_only: bool
    def __init__(self, directory: _Optional[str] = ..., manifest: _Optional[bytes] = ..., reason: _Optional[str] = ..., memory_only: _Optional[bool] = ...) -> None: ...

class ReplicaChunk(_message.Message):
    __slots__ = ("header", "data", "manifest")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    header: ReplicaHeader
    data: ReplicaData
    manifest: bytes
    def __init__(self, header: _Optional[_Union[ReplicaHeader, _Mapping]] = ..., data: _Optional[_Union[ReplicaData, _Mapping]] = ..., manifest: _Optional[bytes] = ...) -> None: ...

class ReplicaHeader(_message.Message):
    __slots__ = ("job", "node", "failure_domain", "path", "manifest", "files", "committed_unix", "manifest_bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    node: str
    failure_domain: str
    path: str
    manifest: bytes
    files: _containers.RepeatedCompositeFieldContainer[ReplicaFile]
    committed_unix: float
    manifest_bytes: int
    def __init__(self, job: _Optional[str] = ..., node: _Optional[str] = ..., failure_domain: _Optional[str] = ..., path: _Optional[str] = ..., manifest: _Optional[bytes] = ..., files: _Optional[_Iterable[_Union[ReplicaFile, _Mapping]]] = ..., committed_unix: _Optional[float] = ..., manifest_bytes: _Optional[int] = ...) -> None: ...

class ReplicaFile(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class ReplicaData(_message.Message):
    __slots__ = ("file", "offset", "data", "crc32c")
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    file: int
    offset: int
    data: bytes
    crc32c: int
    def __init__(self, file: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("node", "path", "bytes", "complete", "manifest", "failure_domain", "committed_unix", "files", "manifest_sha256", "manifest_bytes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    node: str
    path: str
    bytes: int
    complete: bool
    manifest: bytes
    failure_domain: str
    committed_unix: float
    files: _containers.RepeatedCompositeFieldContainer[ReplicaFile]
    manifest_sha256: bytes
    manifest_bytes: int
    def __init__(self, node: _Optional[str] = ..., path: _Optional[str] = ..., bytes: _Optional[int] = ..., complete: _Optional[bool] = ..., manifest: _Optional[bytes] = ..., failure_domain: _Optional[str] = ..., committed_unix: _Optional[float] = ..., files: _Optional[_Iterable[_Union[ReplicaFile, _Mapping]]] = ..., manifest_sha256: _Optional[bytes] = ..., manifest_bytes: _Optional[int] = ...) -> None: ...

class ReplicasResponse(_message.Message):
    __slots__ = ("replicas", "node", "failure_domain")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    node: str
    failure_domain: str
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ..., node: _Optional[str] = ..., failure_domain: _Optional[str] = ...) -> None: ...

class ReadRange(_message.Message):
    __slots__ = ("file", "offset", "length")
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    file: str
    offset: int
    length: int
    def __init__(self, file: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ReadReplicaRequest(_message.Message):
    __slots__ = ("node", "path", "manifest_sha256", "ranges")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    node: str
    path: str
    manifest_sha256: bytes
    ranges: _containers.RepeatedCompositeFieldContainer[ReadRange]
    def __init__(self, node: _Optional[str] = ..., path: _Optional[str] = ..., manifest_sha256: _Optional[bytes] = ..., ranges: _Optional[_Iterable[_Union[ReadRange, _Mapping]]] = ...) -> None: ...
