from google.protobuf import empty_pb2 as _empty_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ContextMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTEXT_MODE_DEFAULT: _ClassVar[ContextMode]
    CONTEXT_MODE_EXACT: _ClassVar[ContextMode]
    CONTEXT_MODE_BLEND: _ClassVar[ContextMode]
    CONTEXT_MODE_CONCAT: _ClassVar[ContextMode]

class RestoreMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESTORE_METHOD_AUTO: _ClassVar[RestoreMethod]
    RESTORE_METHOD_HIDDEN: _ClassVar[RestoreMethod]
    RESTORE_METHOD_KV: _ClassVar[RestoreMethod]
    RESTORE_METHOD_RECOMPUTE: _ClassVar[RestoreMethod]
CONTEXT_MODE_DEFAULT: ContextMode
CONTEXT_MODE_EXACT: ContextMode
CONTEXT_MODE_BLEND: ContextMode
CONTEXT_MODE_CONCAT: ContextMode
RESTORE_METHOD_AUTO: RestoreMethod
RESTORE_METHOD_HIDDEN: RestoreMethod
RESTORE_METHOD_KV: RestoreMethod
RESTORE_METHOD_RECOMPUTE: RestoreMethod

class CreateSessionRequest(_message.Message):
    __slots__ = ("system_prompt", "context_ids", "labels", "context_mode", "blend_fraction")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_MODE_FIELD_NUMBER: _ClassVar[int]
    BLEND_FRACTION_FIELD_NUMBER: _ClassVar[int]
    system_prompt: str
    context_ids: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.ScalarMap[str, str]
    context_mode: ContextMode
    blend_fraction: float
    def __init__(self, system_prompt: _Optional[str] = ..., context_ids: _Optional[_Iterable[str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., context_mode: _Optional[_Union[ContextMode, str]] = ..., blend_fraction: _Optional[float] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "num_tokens", "resident", "labels", "context_ids", "turns", "busy", "last_plan", "last_restore_ms", "created_unix", "updated_unix")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    LAST_PLAN_FIELD_NUMBER: _ClassVar[int]
    LAST_RESTORE_MS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_tokens: int
    resident: bool
    labels: _containers.ScalarMap[str, str]
    context_ids: _containers.RepeatedScalarFieldContainer[str]
    turns: int
    busy: bool
    last_plan: Plan
    last_restore_ms: float
    created_unix: float
    updated_unix: float
    def __init__(self, session_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., resident: _Optional[bool] = ..., labels: _Optional[_Mapping[str, str]] = ..., context_ids: _Optional[_Iterable[str]] = ..., turns: _Optional[int] = ..., busy: _Optional[bool] = ..., last_plan: _Optional[_Union[Plan, _Mapping]] = ..., last_restore_ms: _Optional[float] = ..., created_unix: _Optional[float] = ..., updated_unix: _Optional[float] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "message", "token_ids", "sampling", "context_ids", "context_mode", "blend_fraction")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_MODE_FIELD_NUMBER: _ClassVar[int]
    BLEND_FRACTION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    message: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    context_ids: _containers.RepeatedScalarFieldContainer[str]
    context_mode: ContextMode
    blend_fraction: float
    def __init__(self, session_id: _Optional[str] = ..., message: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., context_ids: _Optional[_Iterable[str]] = ..., context_mode: _Optional[_Union[ContextMode, str]] = ..., blend_fraction: _Optional[float] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("recompute", "hidden", "kv", "layers")
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    recompute: int
    hidden: int
    kv: int
    layers: str
    def __init__(self, recompute: _Optional[int] = ..., hidden: _Optional[int] = ..., kv: _Optional[int] = ..., layers: _Optional[str] = ...) -> None: ...

class GenerateStats(_message.Message):
    __slots__ = ("restore_ms", "prefill_ms", "ttft_ms", "plan", "prompt_tokens", "cached_tokens", "completion_tokens", "queue_ms", "decode_ms", "bytes_read", "fallback_layers", "placed_tokens", "recomputed_tokens", "context_fallbacks")
    RESTORE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PLACED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    restore_ms: float
    prefill_ms: float
    ttft_ms: float
    plan: Plan
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_ms: float
    decode_ms: float
    bytes_read: int
    fallback_layers: int
    placed_tokens: int
    recomputed_tokens: int
    context_fallbacks: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, restore_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., bytes_read: _Optional[int] = ..., fallback_layers: _Optional[int] = ..., placed_tokens: _Optional[int] = ..., recomputed_tokens: _Optional[int] = ..., context_fallbacks: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finished", "finish_reason", "stats", "session_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    stats: GenerateStats
    session_id: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("session_id", "method")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    method: RestoreMethod
    def __init__(self, session_id: _Optional[str] = ..., method: _Optional[_Union[RestoreMethod, str]] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("restore_ms", "plan", "bytes_read", "predicted_ms", "num_tokens", "fallback_layers", "already_resident")
    RESTORE_MS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    restore_ms: float
    plan: Plan
    bytes_read: int
    predicted_ms: float
    num_tokens: int
    fallback_layers: int
    already_resident: bool
    def __init__(self, restore_ms: _Optional[float] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., bytes_read: _Optional[int] = ..., predicted_ms: _Optional[float] = ..., num_tokens: _Optional[int] = ..., fallback_layers: _Optional[int] = ..., already_resident: _Optional[bool] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "next_page_token")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    next_page_token: str
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class PrecomputeContextRequest(_message.Message):
    __slots__ = ("text", "token_ids", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Context(_message.Message):
    __slots__ = ("context_id", "num_tokens", "labels", "reused")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    context_id: str
    num_tokens: int
    labels: _containers.ScalarMap[str, str]
    reused: bool
    def __init__(self, context_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., reused: _Optional[bool] = ...) -> None: ...

class ListContextsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListContextsResponse(_message.Message):
    __slots__ = ("contexts", "next_page_token")
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    contexts: _containers.RepeatedCompositeFieldContainer[Context]
    next_page_token: str
    def __init__(self, contexts: _Optional[_Iterable[_Union[Context, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DirStats(_message.Message):
    __slots__ = ("path", "used_bytes", "free_bytes", "bytes_written", "chunks")
    PATH_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    path: str
    used_bytes: int
    free_bytes: int
    bytes_written: int
    chunks: int
    def __init__(self, path: _Optional[str] = ..., used_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., bytes_written: _Optional[int] = ..., chunks: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("sessions", "resident_sessions", "resident_bytes", "budget_bytes", "contexts", "queue_depth", "evictions", "restores", "fallback_layers", "checksum_failures", "bytes_read", "dirs", "generated_tokens", "model", "draining")
    class QueueDepthEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    DIRS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    resident_sessions: int
    resident_bytes: int
    budget_bytes: int
    contexts: int
    queue_depth: _containers.ScalarMap[str, int]
    evictions: int
    restores: int
    fallback_layers: int
    checksum_failures: int
    bytes_read: int
    dirs: _containers.RepeatedCompositeFieldContainer[DirStats]
    generated_tokens: int
    model: str
    draining: bool
    def __init__(self, sessions: _Optional[int] = ..., resident_sessions: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., contexts: _Optional[int] = ..., queue_depth: _Optional[_Mapping[str, int]] = ..., evictions: _Optional[int] = ..., restores: _Optional[int] = ..., fallback_layers: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., bytes_read: _Optional[int] = ..., dirs: _Optional[_Iterable[_Union[DirStats, _Mapping]]] = ..., generated_tokens: _Optional[int] = ..., model: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...
