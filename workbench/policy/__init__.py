"""The policy: append-only conversation streams and a batched sampler with log-probabilities."""

from workbench.policy.forward import Batch, make_batch, masked_log_softmax, token_logprobs
from workbench.policy.sampler import (
    Completion,
    LiveBatch,
    SamplingParams,
    decode,
    extend,
    open_batch,
    repeat_rows,
    sample,
    select_rows,
)
from workbench.policy.stream import (
    ChatFormat,
    Stream,
    VisionInput,
    append_reply,
    append_user,
    chat_format,
    encode_image,
    keep_last_images,
    start_stream,
)

__all__ = [
    "Batch", "ChatFormat", "Completion", "LiveBatch", "decode", "extend", "open_batch",
    "repeat_rows", "select_rows", "SamplingParams", "Stream", "VisionInput",
    "append_reply", "append_user", "chat_format", "encode_image", "keep_last_images", "make_batch",
    "masked_log_softmax", "sample", "start_stream", "token_logprobs",
]
