from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConstraintKindPB(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONSTRAINT_KIND_UNSPECIFIED: _ClassVar[ConstraintKindPB]
    CONSTRAINT_KIND_JSON_SCHEMA: _ClassVar[ConstraintKindPB]
    CONSTRAINT_KIND_REGEX: _ClassVar[ConstraintKindPB]
    CONSTRAINT_KIND_LARK: _ClassVar[ConstraintKindPB]

class FinishReasonPB(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReasonPB]
    FINISH_REASON_STOP: _ClassVar[FinishReasonPB]
    FINISH_REASON_LENGTH: _ClassVar[FinishReasonPB]

class ErrorCodePB(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCodePB]
    INVALID_ARGUMENT: _ClassVar[ErrorCodePB]
    CONTEXT_LENGTH_EXCEEDED: _ClassVar[ErrorCodePB]
    OUT_OF_KV_CACHE: _ClassVar[ErrorCodePB]
    OVERLOADED: _ClassVar[ErrorCodePB]
    TIMEOUT: _ClassVar[ErrorCodePB]
    CANCELLED: _ClassVar[ErrorCodePB]
    INTERNAL: _ClassVar[ErrorCodePB]
    UNAVAILABLE: _ClassVar[ErrorCodePB]
    MODEL_NOT_FOUND: _ClassVar[ErrorCodePB]

class PoolTaskPB(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_TASK_EMBED: _ClassVar[PoolTaskPB]
    POOL_TASK_SPARSE: _ClassVar[PoolTaskPB]
    POOL_TASK_COLBERT: _ClassVar[PoolTaskPB]
    POOL_TASK_CLASSIFY: _ClassVar[PoolTaskPB]
CONSTRAINT_KIND_UNSPECIFIED: ConstraintKindPB
CONSTRAINT_KIND_JSON_SCHEMA: ConstraintKindPB
CONSTRAINT_KIND_REGEX: ConstraintKindPB
CONSTRAINT_KIND_LARK: ConstraintKindPB
FINISH_REASON_UNSPECIFIED: FinishReasonPB
FINISH_REASON_STOP: FinishReasonPB
FINISH_REASON_LENGTH: FinishReasonPB
ERROR_CODE_UNSPECIFIED: ErrorCodePB
INVALID_ARGUMENT: ErrorCodePB
CONTEXT_LENGTH_EXCEEDED: ErrorCodePB
OUT_OF_KV_CACHE: ErrorCodePB
OVERLOADED: ErrorCodePB
TIMEOUT: ErrorCodePB
CANCELLED: ErrorCodePB
INTERNAL: ErrorCodePB
UNAVAILABLE: ErrorCodePB
MODEL_NOT_FOUND: ErrorCodePB
POOL_TASK_EMBED: PoolTaskPB
POOL_TASK_SPARSE: PoolTaskPB
POOL_TASK_COLBERT: PoolTaskPB
POOL_TASK_CLASSIFY: PoolTaskPB

class TokenIdsPB(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateConfigPB(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_words_list", "return_logprobs", "top_logprobs", "timeout_ms", "stop_token_ids", "ignore_eos", "min_new_tokens", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "num_return_sequences", "constraint", "typical_p", "allowed_token_ids", "bad_words_ids", "adapter_name")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_WORDS_LIST_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    NUM_RETURN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_NAME_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_words_list: _containers.RepeatedCompositeFieldContainer[TokenIdsPB]
    return_logprobs: bool
    top_logprobs: int
    timeout_ms: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_new_tokens: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    num_return_sequences: int
    constraint: ConstraintPB
    typical_p: float
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words_ids: _containers.RepeatedCompositeFieldContainer[TokenIdsPB]
    adapter_name: str
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_words_list: _Optional[_Iterable[_Union[TokenIdsPB, _Mapping]]] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_new_tokens: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., num_return_sequences: _Optional[int] = ..., constraint: _Optional[_Union[ConstraintPB, _Mapping]] = ..., typical_p: _Optional[float] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words_ids: _Optional[_Iterable[_Union[TokenIdsPB, _Mapping]]] = ..., adapter_name: _Optional[str] = ...) -> None: ...

class ConstraintPB(_message.Message):
    __slots__ = ("kind", "text")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    kind: ConstraintKindPB
    text: str
    def __init__(self, kind: _Optional[_Union[ConstraintKindPB, str]] = ..., text: _Optional[str] = ...) -> None: ...

class GenerateInputPB(_message.Message):
    __slots__ = ("request_id", "token_ids", "generate_config", "decode_address", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    generate_config: GenerateConfigPB
    decode_address: str
    images: _containers.RepeatedCompositeFieldContainer[ImagePB]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., generate_config: _Optional[_Union[GenerateConfigPB, _Mapping]] = ..., decode_address: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImagePB, _Mapping]]] = ...) -> None: ...

class ImagePB(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class TopLogprobPB(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobPB(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobPB]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobPB, _Mapping]]] = ...) -> None: ...

class AuxInfoPB(_message.Message):
    __slots__ = ("input_len", "output_len", "iter_count", "reuse_len", "cost_time_us", "first_token_cost_time_us", "wait_time_us", "kv_transfer_bytes", "kv_blocks_sent", "kv_blocks_skipped", "kv_transfer_time_us")
    INPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    ITER_COUNT_FIELD_NUMBER: _ClassVar[int]
    REUSE_LEN_FIELD_NUMBER: _ClassVar[int]
    COST_TIME_US_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_COST_TIME_US_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIME_US_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_TIME_US_FIELD_NUMBER: _ClassVar[int]
    input_len: int
    output_len: int
    iter_count: int
    reuse_len: int
    cost_time_us: int
    first_token_cost_time_us: int
    wait_time_us: int
    kv_transfer_bytes: int
    kv_blocks_sent: int
    kv_blocks_skipped: int
    kv_transfer_time_us: int
    def __init__(self, input_len: _Optional[int] = ..., output_len: _Optional[int] = ..., iter_count: _Optional[int] = ..., reuse_len: _Optional[int] = ..., cost_time_us: _Optional[int] = ..., first_token_cost_time_us: _Optional[int] = ..., wait_time_us: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_blocks_sent: _Optional[int] = ..., kv_blocks_skipped: _Optional[int] = ..., kv_transfer_time_us: _Optional[int] = ...) -> None: ...

class GenerateOutputPB(_message.Message):
    __slots__ = ("index", "output_ids", "finished", "finish_reason", "logprobs", "aux_info")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    AUX_INFO_FIELD_NUMBER: _ClassVar[int]
    index: int
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: FinishReasonPB
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobPB]
    aux_info: AuxInfoPB
    def __init__(self, index: _Optional[int] = ..., output_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReasonPB, str]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobPB, _Mapping]]] = ..., aux_info: _Optional[_Union[AuxInfoPB, _Mapping]] = ...) -> None: ...

class ErrorDetailsPB(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCodePB
    message: str
    def __init__(self, code: _Optional[_Union[ErrorCodePB, str]] = ..., message: _Optional[str] = ...) -> None: ...

class GenerateOutputsPB(_message.Message):
    __slots__ = ("request_id", "generate_outputs", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generate_outputs: _containers.RepeatedCompositeFieldContainer[GenerateOutputPB]
    error: ErrorDetailsPB
    def __init__(self, request_id: _Optional[str] = ..., generate_outputs: _Optional[_Iterable[_Union[GenerateOutputPB, _Mapping]]] = ..., error: _Optional[_Union[ErrorDetailsPB, _Mapping]] = ...) -> None: ...

class ScoreInputPB(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "scored_ids", "top_logprobs", "adapter_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORED_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    scored_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: int
    adapter_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., scored_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[int] = ..., adapter_name: _Optional[str] = ...) -> None: ...

class ScoreOutputPB(_message.Message):
    __slots__ = ("logprobs", "error", "aux_info")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    AUX_INFO_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobPB]
    error: ErrorDetailsPB
    aux_info: AuxInfoPB
    def __init__(self, logprobs: _Optional[_Iterable[_Union[TokenLogprobPB, _Mapping]]] = ..., error: _Optional[_Union[ErrorDetailsPB, _Mapping]] = ..., aux_info: _Optional[_Union[AuxInfoPB, _Mapping]] = ...) -> None: ...

class PoolItemPB(_message.Message):
    __slots__ = ("token_ids", "pair_start")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAIR_START_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    pair_start: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., pair_start: _Optional[int] = ...) -> None: ...

class PoolInputPB(_message.Message):
    __slots__ = ("request_id", "items", "task", "timeout_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[PoolItemPB]
    task: PoolTaskPB
    timeout_ms: int
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[PoolItemPB, _Mapping]]] = ..., task: _Optional[_Union[PoolTaskPB, str]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class PooledPB(_message.Message):
    __slots__ = ("values", "token_ids", "rows")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    rows: int
    def __init__(self, values: _Optional[_Iterable[float]] = ..., token_ids: _Optional[_Iterable[int]] = ..., rows: _Optional[int] = ...) -> None: ...

class PoolOutputPB(_message.Message):
    __slots__ = ("outputs", "error", "aux_info")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    AUX_INFO_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[PooledPB]
    error: ErrorDetailsPB
    aux_info: AuxInfoPB
    def __init__(self, outputs: _Optional[_Iterable[_Union[PooledPB, _Mapping]]] = ..., error: _Optional[_Union[ErrorDetailsPB, _Mapping]] = ..., aux_info: _Optional[_Union[AuxInfoPB, _Mapping]] = ...) -> None: ...

class WorkerStatusRequestPB(_message.Message):
    __slots__ = ("latest_version",)
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    def __init__(self, latest_version: _Optional[int] = ...) -> None: ...

class WorkerStatusPB(_message.Message):
    __slots__ = ("role", "running", "waiting", "queued_prefill_tokens", "step_latency_ms", "prefill_tokens_per_s", "free_blocks", "total_blocks", "block_size", "version", "iterate_count", "alive", "cache_version", "model_kind", "adapters")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ITERATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    CACHE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_KIND_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    role: str
    running: int
    waiting: int
    queued_prefill_tokens: int
    step_latency_ms: float
    prefill_tokens_per_s: float
    free_blocks: int
    total_blocks: int
    block_size: int
    version: int
    iterate_count: int
    alive: bool
    cache_version: int
    model_kind: str
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., step_latency_ms: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., version: _Optional[int] = ..., iterate_count: _Optional[int] = ..., alive: _Optional[bool] = ..., cache_version: _Optional[int] = ..., model_kind: _Optional[str] = ..., adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class CacheStatusRequestPB(_message.Message):
    __slots__ = ("since_version",)
    SINCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    since_version: int
    def __init__(self, since_version: _Optional[int] = ...) -> None: ...

class CacheStatusPB(_message.Message):
    __slots__ = ("version", "is_diff", "cached_keys", "added_keys", "removed_keys", "block_size")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    IS_DIFF_FIELD_NUMBER: _ClassVar[int]
    CACHED_KEYS_FIELD_NUMBER: _ClassVar[int]
    ADDED_KEYS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    version: int
    is_diff: bool
    cached_keys: _containers.RepeatedScalarFieldContainer[int]
    added_keys: _containers.RepeatedScalarFieldContainer[int]
    removed_keys: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    def __init__(self, version: _Optional[int] = ..., is_diff: _Optional[bool] = ..., cached_keys: _Optional[_Iterable[int]] = ..., added_keys: _Optional[_Iterable[int]] = ..., removed_keys: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ...) -> None: ...

class KVTransferHeaderPB(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "first_token", "first_logprob", "generate_config", "block_size", "num_blocks", "block_keys", "dtype", "block_shape", "first_token_output_len", "image_digests", "image_grids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    GENERATE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_OUTPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    IMAGE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_GRIDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    first_logprob: TokenLogprobPB
    generate_config: GenerateConfigPB
    block_size: int
    num_blocks: int
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    block_shape: _containers.RepeatedScalarFieldContainer[int]
    first_token_output_len: int
    image_digests: _containers.RepeatedScalarFieldContainer[bytes]
    image_grids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., first_logprob: _Optional[_Union[TokenLogprobPB, _Mapping]] = ..., generate_config: _Optional[_Union[GenerateConfigPB, _Mapping]] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_keys: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., block_shape: _Optional[_Iterable[int]] = ..., first_token_output_len: _Optional[int] = ..., image_digests: _Optional[_Iterable[bytes]] = ..., image_grids: _Optional[_Iterable[int]] = ...) -> None: ...

class KVBlockPB(_message.Message):
    __slots__ = ("index", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVTransferPB(_message.Message):
    __slots__ = ("header", "block", "done")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    header: KVTransferHeaderPB
    block: KVBlockPB
    done: bool
    def __init__(self, header: _Optional[_Union[KVTransferHeaderPB, _Mapping]] = ..., block: _Optional[_Union[KVBlockPB, _Mapping]] = ..., done: _Optional[bool] = ...) -> None: ...

class RemoteDecodeReplyPB(_message.Message):
    __slots__ = ("need", "loaded", "outputs")
    NEED_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    need: BlockRequestPB
    loaded: bool
    outputs: GenerateOutputsPB
    def __init__(self, need: _Optional[_Union[BlockRequestPB, _Mapping]] = ..., loaded: _Optional[bool] = ..., outputs: _Optional[_Union[GenerateOutputsPB, _Mapping]] = ...) -> None: ...

class BlockRequestPB(_message.Message):
    __slots__ = ("indices", "skipped")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    skipped: int
    def __init__(self, indices: _Optional[_Iterable[int]] = ..., skipped: _Optional[int] = ...) -> None: ...

class EmbedImagesInputPB(_message.Message):
    __slots__ = ("request_id", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[ImagePB]
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImagePB, _Mapping]]] = ...) -> None: ...

class ImageEmbeddingPB(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedImagesOutputPB(_message.Message):
    __slots__ = ("embeddings", "error")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[ImageEmbeddingPB]
    error: ErrorDetailsPB
    def __init__(self, embeddings: _Optional[_Iterable[_Union[ImageEmbeddingPB, _Mapping]]] = ..., error: _Optional[_Union[ErrorDetailsPB, _Mapping]] = ...) -> None: ...
