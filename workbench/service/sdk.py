"""The workbench's streams as the tinker SDK's types, for a loop that drives the session server
with the SDK's own classes (tests/test_service.py plays mazes this way).

    prompt = model_input(stream)                          # tokens + each image as a PNG chunk
    sampler.sample(prompt, 4, tinker.types.SamplingParams(max_tokens=8, seed=0))
    training_client.forward_backward([rl_datum(ep.stream, advantage)], "importance_sampling")

Needs the `tinker` package (the `service` extra).
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import numpy as np

from workbench.policy import Stream
from workbench.policy.engine import Completion
from workbench.service.wire import ImageCache
from workbench.session.types import Datum, datum_from_stream


def png(image_HW3: np.ndarray, cache: ImageCache | None = None) -> bytes:
    """An RGB uint8 image as PNG bytes (lossless: the server reads the same pixels back). With
    `cache` an image a conversation sends again is encoded once."""
    from PIL import Image

    pixels = np.ascontiguousarray(image_HW3)

    def encode() -> bytes:
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="PNG")
        return out.getvalue()

    if cache is None:
        return encode()
    return cache.get(hashlib.sha1(pixels.data).digest() + str(pixels.shape).encode(), encode)


def model_input(stream: Stream, end: int | None = None, pngs: ImageCache | None = None) -> Any:
    """The stream's tokens [0, end) as a tinker ModelInput: text as token chunks, each image's
    <|image_pad|> run as an image chunk of the RGB image it came from (`pngs`: `png`'s cache)."""
    from tinker import types

    tokens, kinds = stream.tokens_T[:end], stream.mm_types_T[:end]
    chunks: list[Any] = []
    text: list[int] = []
    t, image = 0, 0
    while t < len(tokens):
        if kinds[t] == 0:
            text.append(tokens[t])
            t += 1
            continue
        if text:
            chunks.append(types.EncodedTextChunk(tokens=text))
            text = []
        run = next((u for u in range(t, len(tokens)) if kinds[u] == 0), len(tokens)) - t
        pixels = stream.images[image].image_HW3
        if pixels is None:
            raise ValueError(f"image {image} of the stream keeps no RGB pixels to send")
        chunks.append(types.ImageChunk(data=png(pixels, pngs), format="png",
                                       expected_tokens=run))
        image, t = image + 1, t + run
    if text:
        chunks.append(types.EncodedTextChunk(tokens=text))
    return types.ModelInput(chunks=chunks)


def sdk_datum(datum: Datum, loss_fn: str, scale: float = 1.0, pngs: ImageCache | None = None
              ) -> Any:
    """A workbench datum as a tinker Datum for `loss_fn`: the stream's tokens but the last as
    model_input, the next tokens as targets; cross_entropy: its weights; importance_sampling,
    ppo, cispo: the sampler's log-probs and its advantages times its weights (tinker's
    advantages carry the mask); either times `scale` (a reduction's share, `service.remote`)."""
    from tinker import types

    s = datum.stream
    weights = np.asarray(datum.weights_T[1:], dtype=np.float32)
    inputs = {"target_tokens": types.TensorData.from_numpy(
        np.asarray(s.tokens_T[1:], dtype=np.int64))}
    if loss_fn == "cross_entropy":
        inputs["weights"] = types.TensorData.from_numpy(weights * np.float32(scale))
    else:
        inputs["logprobs"] = types.TensorData.from_numpy(
            np.asarray(s.logprobs_T[1:], dtype=np.float32) * (weights != 0))
        inputs["advantages"] = types.TensorData.from_numpy(
            np.asarray(datum.advantages_T[1:], dtype=np.float32) * weights * np.float32(scale))
    return types.Datum(model_input=model_input(s, len(s) - 1, pngs), loss_fn_inputs=inputs)


def rl_datum(stream: Stream, advantage: float) -> Any:
    """A tinker Datum for importance_sampling / ppo / cispo: `advantage` on every sampled token
    of the stream (`sdk_datum` of `datum_from_stream`)."""
    return sdk_datum(datum_from_stream(stream, advantage), "importance_sampling")


def completion(sequence: Any) -> Completion:
    """A tinker SampledSequence as the workbench's Completion."""
    return Completion(tokens=list(sequence.tokens), logprobs=list(sequence.logprobs or []),
                      stop_reason=sequence.stop_reason)
