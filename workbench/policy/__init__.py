"""The policy: append-only conversation streams, the one log-prob forward the trainer and the
samplers share, and the engine protocol every sampler follows (`policy.engine`)."""

from workbench.policy.engine import Completion, SamplingParams
from workbench.policy.forward import Batch, make_batch, masked_log_softmax, token_logprobs
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
    "Batch", "ChatFormat", "Completion", "SamplingParams", "Stream", "VisionInput",
    "append_reply", "append_user", "chat_format", "encode_image", "keep_last_images", "make_batch",
    "masked_log_softmax", "start_stream", "token_logprobs",
]
