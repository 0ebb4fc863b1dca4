from google.protobuf import wrappers_pb2 as _wrappers_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorPB(_message.Message):
    __slots__ = ("data_type", "shape", "fp32_data", "int32_data", "fp16_data", "bf16_data")
    class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FP32: _ClassVar[TensorPB.DataType]
        INT32: _ClassVar[TensorPB.DataType]
        FP16: _ClassVar[TensorPB.DataType]
        BF16: _ClassVar[TensorPB.DataType]
    FP32: TensorPB.DataType
    INT32: TensorPB.DataType
    FP16: TensorPB.DataType
    BF16: TensorPB.DataType
    DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FP32_DATA_FIELD_NUMBER: _ClassVar[int]
    INT32_DATA_FIELD_NUMBER: _ClassVar[int]
    FP16_DATA_FIELD_NUMBER: _ClassVar[int]
    BF16_DATA_FIELD_NUMBER: _ClassVar[int]
    data_type: TensorPB.DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    fp32_data: bytes
    int32_data: bytes
    fp16_data: bytes
    bf16_data: bytes
    def __init__(self, data_type: _Optional[_Union[TensorPB.DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., fp32_data: _Optional[bytes] = ..., int32_data: _Optional[bytes] = ..., fp16_data: _Optional[bytes] = ..., bf16_data: _Optional[bytes] = ...) -> None: ...

class IntVector(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Iterable[int]] = ...) -> None: ...

class IntMatrix(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[IntVector]
    def __init__(self, rows: _Optional[_Iterable[_Union[IntVector, _Mapping]]] = ...) -> None: ...

class GenerateConfigPB(_message.Message):
    __slots__ = ("max_new_tokens", "num_beams", "num_return_sequences", "min_new_tokens", "top_k", "top_p", "temperature", "repetition_penalty", "random_seed", "task_id", "return_incremental", "is_streaming", "timeout_ms", "stop_words_list", "can_use_pd_separation", "global_request_id", "inter_request_id", "ignore_eos", "presence_penalty", "frequency_penalty", "do_sample", "reuse_cache")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BEAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_RETURN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    RANDOM_SEED_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    RETURN_INCREMENTAL_FIELD_NUMBER: _ClassVar[int]
    IS_STREAMING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    STOP_WORDS_LIST_FIELD_NUMBER: _ClassVar[int]
    CAN_USE_PD_SEPARATION_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INTER_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    REUSE_CACHE_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    num_beams: int
    num_return_sequences: int
    min_new_tokens: int
    top_k: int
    top_p: float
    temperature: float
    repetition_penalty: float
    random_seed: _wrappers_pb2.Int64Value
    task_id: _wrappers_pb2.StringValue
    return_incremental: bool
    is_streaming: bool
    timeout_ms: int
    stop_words_list: IntMatrix
    can_use_pd_separation: bool
    global_request_id: int
    inter_request_id: int
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    do_sample: bool
    reuse_cache: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., num_beams: _Optional[int] = ..., num_return_sequences: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., temperature: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., random_seed: _Optional[_Union[_wrappers_pb2.Int64Value, _Mapping]] = ..., task_id: _Optional[_Union[_wrappers_pb2.StringValue, _Mapping]] = ..., return_incremental: _Optional[bool] = ..., is_streaming: _Optional[bool] = ..., timeout_ms: _Optional[int] = ..., stop_words_list: _Optional[_Union[IntMatrix, _Mapping]] = ..., can_use_pd_separation: _Optional[bool] = ..., global_request_id: _Optional[int] = ..., inter_request_id: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., do_sample: _Optional[bool] = ..., reuse_cache: _Optional[bool] = ...) -> None: ...

class GenerateInputPB(_message.Message):
    __slots__ = ("request_id", "token_ids", "generate_config", "client_id", "start_time")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    generate_config: GenerateConfigPB
    client_id: str
    start_time: int
    def __init__(self, request_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., generate_config: _Optional[_Union[GenerateConfigPB, _Mapping]] = ..., client_id: _Optional[str] = ..., start_time: _Optional[int] = ...) -> None: ...

class AuxInfoPB(_message.Message):
    __slots__ = ("cost_time_us", "iter_count", "input_len", "reuse_len", "output_len", "step_output_len", "first_token_cost_time_us", "wait_time_us")
    COST_TIME_US_FIELD_NUMBER: _ClassVar[int]
    ITER_COUNT_FIELD_NUMBER: _ClassVar[int]
    INPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    REUSE_LEN_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    STEP_OUTPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_COST_TIME_US_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIME_US_FIELD_NUMBER: _ClassVar[int]
    cost_time_us: int
    iter_count: int
    input_len: int
    reuse_len: int
    output_len: int
    step_output_len: int
    first_token_cost_time_us: int
    wait_time_us: int
    def __init__(self, cost_time_us: _Optional[int] = ..., iter_count: _Optional[int] = ..., input_len: _Optional[int] = ..., reuse_len: _Optional[int] = ..., output_len: _Optional[int] = ..., step_output_len: _Optional[int] = ..., first_token_cost_time_us: _Optional[int] = ..., wait_time_us: _Optional[int] = ...) -> None: ...

class GenerateOutputPB(_message.Message):
    __slots__ = ("finished", "aux_info", "output_ids")
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    AUX_INFO_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    finished: bool
    aux_info: AuxInfoPB
    output_ids: TensorPB
    def __init__(self, finished: _Optional[bool] = ..., aux_info: _Optional[_Union[AuxInfoPB, _Mapping]] = ..., output_ids: _Optional[_Union[TensorPB, _Mapping]] = ...) -> None: ...

class GenerateOutputsPB(_message.Message):
    __slots__ = ("request_id", "generate_outputs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    generate_outputs: _containers.RepeatedCompositeFieldContainer[GenerateOutputPB]
    def __init__(self, request_id: _Optional[int] = ..., generate_outputs: _Optional[_Iterable[_Union[GenerateOutputPB, _Mapping]]] = ...) -> None: ...
