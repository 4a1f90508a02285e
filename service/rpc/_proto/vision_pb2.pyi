from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class ImageOptions(_message.Message):
    __slots__ = ("exif_transpose", "max_tokens", "resize")
    EXIF_TRANSPOSE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    exif_transpose: bool
    max_tokens: int
    resize: str
    def __init__(self, exif_transpose: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., resize: _Optional[str] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "mime_type", "options", "uuid", "detail")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    options: ImageOptions
    uuid: str
    detail: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ..., options: _Optional[_Union[ImageOptions, _Mapping]] = ..., uuid: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: Image
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    name: str
    tool_call_id: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    reasoning_content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "tools_json", "thinking_effort", "chat_kwargs_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    THINKING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    CHAT_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    thinking_effort: str
    chat_kwargs_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., thinking_effort: _Optional[str] = ..., chat_kwargs_json: _Optional[str] = ...) -> None: ...

class PreprocessRequest(_message.Message):
    __slots__ = ("image", "return_pixels", "pixel_format")
    class PixelFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PIXEL_FORMAT_UINT8_IMAGE: _ClassVar[PreprocessRequest.PixelFormat]
        PIXEL_FORMAT_FLOAT32_PATCHES: _ClassVar[PreprocessRequest.PixelFormat]
    PIXEL_FORMAT_UINT8_IMAGE: PreprocessRequest.PixelFormat
    PIXEL_FORMAT_FLOAT32_PATCHES: PreprocessRequest.PixelFormat
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    RETURN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    PIXEL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    image: Image
    return_pixels: bool
    pixel_format: PreprocessRequest.PixelFormat
    def __init__(self, image: _Optional[_Union[Image, _Mapping]] = ..., return_pixels: _Optional[bool] = ..., pixel_format: _Optional[_Union[PreprocessRequest.PixelFormat, str]] = ...) -> None: ...

class PreprocessResponse(_message.Message):
    __slots__ = ("orig_width", "orig_height", "width", "height", "padded_width", "padded_height", "grid_thw", "num_tokens", "prompt", "pixel_values")
    ORIG_WIDTH_FIELD_NUMBER: _ClassVar[int]
    ORIG_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    PADDED_WIDTH_FIELD_NUMBER: _ClassVar[int]
    PADDED_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    orig_width: int
    orig_height: int
    width: int
    height: int
    padded_width: int
    padded_height: int
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    prompt: str
    pixel_values: Tensor
    def __init__(self, orig_width: _Optional[int] = ..., orig_height: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., padded_width: _Optional[int] = ..., padded_height: _Optional[int] = ..., grid_thw: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., prompt: _Optional[str] = ..., pixel_values: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class CountTokensRequest(_message.Message):
    __slots__ = ("image", "chat")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    image: Image
    chat: Chat
    def __init__(self, image: _Optional[_Union[Image, _Mapping]] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ...) -> None: ...

class CountTokensResponse(_message.Message):
    __slots__ = ("num_tokens", "image_tokens", "text_tokens")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    image_tokens: _containers.RepeatedScalarFieldContainer[int]
    text_tokens: int
    def __init__(self, num_tokens: _Optional[int] = ..., image_tokens: _Optional[_Iterable[int]] = ..., text_tokens: _Optional[int] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("image", "dtype")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    image: Image
    dtype: str
    def __init__(self, image: _Optional[_Union[Image, _Mapping]] = ..., dtype: _Optional[str] = ...) -> None: ...

class EmbedHeader(_message.Message):
    __slots__ = ("num_tokens", "hidden_size", "dtype", "shape", "grid_thw", "prompt", "content_hash", "nbytes", "cached")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    hidden_size: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    content_hash: str
    nbytes: int
    cached: bool
    def __init__(self, num_tokens: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., grid_thw: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ..., content_hash: _Optional[str] = ..., nbytes: _Optional[int] = ..., cached: _Optional[bool] = ...) -> None: ...

class EmbedChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: EmbedHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[EmbedHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "logit_bias", "skip_special_tokens", "min_p", "include_stop_str_in_output", "spaces_between_special_tokens", "allowed_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    ignore_eos: bool
    logit_bias: _containers.ScalarMap[int, float]
    skip_special_tokens: bool
    min_p: float
    include_stop_str_in_output: bool
    spaces_between_special_tokens: bool
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., skip_special_tokens: _Optional[bool] = ..., min_p: _Optional[float] = ..., include_stop_str_in_output: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("messages", "tools_json", "thinking_effort", "max_new_tokens", "sampling", "chat_kwargs_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    THINKING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CHAT_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    thinking_effort: str
    max_new_tokens: int
    sampling: Sampling
    chat_kwargs_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., thinking_effort: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., chat_kwargs_json: _Optional[str] = ...) -> None: ...

class ToolCallStart(_message.Message):
    __slots__ = ("index", "name")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class ToolArgumentDelta(_message.Message):
    __slots__ = ("index", "key", "type", "text")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    index: int
    key: str
    type: str
    text: str
    def __init__(self, index: _Optional[int] = ..., key: _Optional[str] = ..., type: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class ToolArgumentError(_message.Message):
    __slots__ = ("index", "key", "type", "message", "raw")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    index: int
    key: str
    type: str
    message: str
    raw: str
    def __init__(self, index: _Optional[int] = ..., key: _Optional[str] = ..., type: _Optional[str] = ..., message: _Optional[str] = ..., raw: _Optional[str] = ...) -> None: ...

class ToolCallEnd(_message.Message):
    __slots__ = ("index", "name", "arguments_json")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    arguments_json: str
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "image_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    image_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., image_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("reason", "usage")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    usage: Usage
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "bytes", "logprob", "token_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token: str
    bytes: bytes
    logprob: float
    token_id: int
    def __init__(self, token: _Optional[str] = ..., bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ..., token_id: _Optional[int] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("chosen", "top")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    chosen: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, chosen: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("reasoning_delta", "content_delta", "tool_call_start", "argument_delta", "argument_error", "finish", "tool_call_end", "protocol_error", "logprobs", "index")
    REASONING_DELTA_FIELD_NUMBER: _ClassVar[int]
    CONTENT_DELTA_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_START_FIELD_NUMBER: _ClassVar[int]
    ARGUMENT_DELTA_FIELD_NUMBER: _ClassVar[int]
    ARGUMENT_ERROR_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_END_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_ERROR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    reasoning_delta: str
    content_delta: str
    tool_call_start: ToolCallStart
    argument_delta: ToolArgumentDelta
    argument_error: ToolArgumentError
    finish: Finish
    tool_call_end: ToolCallEnd
    protocol_error: str
    logprobs: Logprobs
    index: int
    def __init__(self, reasoning_delta: _Optional[str] = ..., content_delta: _Optional[str] = ..., tool_call_start: _Optional[_Union[ToolCallStart, _Mapping]] = ..., argument_delta: _Optional[_Union[ToolArgumentDelta, _Mapping]] = ..., argument_error: _Optional[_Union[ToolArgumentError, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., tool_call_end: _Optional[_Union[ToolCallEnd, _Mapping]] = ..., protocol_error: _Optional[str] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("messages", "tools_json", "thinking_effort", "chat_kwargs_json", "dtype", "export_vllm_ec")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    THINKING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    CHAT_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EXPORT_VLLM_EC_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    thinking_effort: str
    chat_kwargs_json: str
    dtype: str
    export_vllm_ec: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., thinking_effort: _Optional[str] = ..., chat_kwargs_json: _Optional[str] = ..., dtype: _Optional[str] = ..., export_vllm_ec: _Optional[bool] = ...) -> None: ...

class ImageSpan(_message.Message):
    __slots__ = ("offset", "length", "content_hash", "grid_thw", "ec_path", "mm_hash")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    EC_PATH_FIELD_NUMBER: _ClassVar[int]
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    content_hash: str
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    ec_path: str
    mm_hash: str
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., content_hash: _Optional[str] = ..., grid_thw: _Optional[_Iterable[int]] = ..., ec_path: _Optional[str] = ..., mm_hash: _Optional[str] = ...) -> None: ...

class EncodeHeader(_message.Message):
    __slots__ = ("input_ids", "position_ids", "spans", "hidden_size", "dtype", "num_rows", "nbytes", "media_pad_id")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITION_IDS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    MEDIA_PAD_ID_FIELD_NUMBER: _ClassVar[int]
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    position_ids: _containers.RepeatedScalarFieldContainer[int]
    spans: _containers.RepeatedCompositeFieldContainer[ImageSpan]
    hidden_size: int
    dtype: str
    num_rows: int
    nbytes: int
    media_pad_id: int
    def __init__(self, input_ids: _Optional[_Iterable[int]] = ..., position_ids: _Optional[_Iterable[int]] = ..., spans: _Optional[_Iterable[_Union[ImageSpan, _Mapping]]] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_rows: _Optional[int] = ..., nbytes: _Optional[int] = ..., media_pad_id: _Optional[int] = ...) -> None: ...

class EncodeChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: EncodeHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[EncodeHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("fingerprint", "hidden_size", "components", "devices", "image_options", "model_id", "served_model_names", "hash_algorithm", "max_image_bytes", "max_image_pixels", "max_message_bytes")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    hidden_size: int
    components: str
    devices: _containers.RepeatedScalarFieldContainer[str]
    image_options: str
    model_id: str
    served_model_names: _containers.RepeatedScalarFieldContainer[str]
    hash_algorithm: str
    max_image_bytes: int
    max_image_pixels: int
    max_message_bytes: int
    def __init__(self, fingerprint: _Optional[str] = ..., hidden_size: _Optional[int] = ..., components: _Optional[str] = ..., devices: _Optional[_Iterable[str]] = ..., image_options: _Optional[str] = ..., model_id: _Optional[str] = ..., served_model_names: _Optional[_Iterable[str]] = ..., hash_algorithm: _Optional[str] = ..., max_image_bytes: _Optional[int] = ..., max_image_pixels: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...
