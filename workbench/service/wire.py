"""The tinker SDK's wire format, read into the workbench's records and written back.

A tinker `ModelInput` is a list of chunks: token ids, and images (PNG or JPEG bytes). Read
here it becomes a `Stream`: each image goes through the policy's own image pipeline
(`policy.encode_image`) and stands in the tokens as its `<|image_pad|>` run, so a client sends
the chat markup around an image (`<|vision_start|>`, `<|vision_end|>`) as text, as the
workbench's streams hold it. A `Datum` of the SDK is tinker's next-token layout: `model_input`
holds tokens 0..N-1 of a sequence, and each of its `loss_fn_inputs` has N entries, entry t
about token t+1 (`target_tokens[t]`). The workbench's datum holds the whole sequence (T = N + 1
tokens) and per-token tables of length T. A weighted target must be the next input token (the
trainer scores the sequence's own tokens); the trainer log-prob of a target that is not is NaN.

The losses, as tinker defines them (every one summed over the tokens, `LossConfig.reduction`
"sum"): `cross_entropy` takes `target_tokens` and `weights`; `importance_sampling`, `ppo` and
`cispo` take `target_tokens`, `logprobs` (the sampler's) and `advantages`, with weight 1 where
the advantage is not 0 (the advantages carry the mask). ppo and cispo read `clip_low_threshold`
and `clip_high_threshold` (default 0.8 and 1.2: the ratio's bounds).

Every problem is a `WireError` (a ValueError) whose message names the field and what was
expected: the server answers it with 400 before the call is queued.
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.policy import ChatFormat, Stream, encode_image
from workbench.policy.engine import Completion
from workbench.session.losses import LOSSES, LossConfig
from workbench.session.types import Datum, ForwardBackwardOutput

IMAGE_FORMATS = ("png", "jpeg")
RL_INPUTS = ("target_tokens", "logprobs", "advantages")
LOSS_INPUTS = {"cross_entropy": ("target_tokens", "weights"), "importance_sampling": RL_INPUTS,
               "ppo": RL_INPUTS, "cispo": RL_INPUTS}
LOSS_KEYS = {"cross_entropy": (), "importance_sampling": (),
             "ppo": ("clip_low_threshold", "clip_high_threshold"),
             "cispo": ("clip_low_threshold", "clip_high_threshold")}
DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}  # tinker_public.DType


class WireError(ValueError):
    """A request the server cannot read; the message says which field and why."""


@dataclass(frozen=True)
class Text:
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Image:
    data: bytes
    format: str
    expected_tokens: int | None


Chunk = Text | Image


# ------------------------------------------------------------------------------------ reading

def chunks_from_json(chunks: Any, where: str = "prompt.chunks") -> list[Chunk]:
    """The chunks of a JSON `ModelInput` (asample's prompt)."""
    if not isinstance(chunks, list):
        raise WireError(f"{where} must be a list of chunks, got {type(chunks).__name__}")
    out: list[Chunk] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.get("type") if isinstance(chunk, dict) else None
        if kind == "encoded_text":
            out.append(Text(token_list(chunk.get("tokens"), f"{where}[{i}].tokens")))
        elif kind == "image":
            try:
                data = base64.b64decode(chunk.get("data", ""), validate=True)
            except (ValueError, TypeError):
                raise WireError(f"{where}[{i}].data is not base64") from None
            out.append(Image(data, chunk.get("format", ""), chunk.get("expected_tokens")))
        else:
            raise WireError(f"{where}[{i}] has type {kind!r}: this server takes 'encoded_text' "
                            "and 'image' chunks (no image_asset_pointer: send the bytes)")
    return out


def chunks_from_proto(chunks: Any, where: str) -> list[Chunk]:
    """The chunks of a protobuf `Datum.model_input`."""
    out: list[Chunk] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            out.append(Text(tuple(int(t) for t in packed(chunk.encoded_text.tokens, np.int32,
                                                          f"{where}[{i}].tokens"))))
        elif kind == "image":
            im = chunk.image
            out.append(Image(im.data, im.format,
                             im.expected_tokens if im.HasField("expected_tokens") else None))
        else:
            raise WireError(f"{where}[{i}] is a {kind!r} chunk: this server takes token and "
                            "image chunks")
    return out


def token_list(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in value):
        raise WireError(f"{where} must be a list of token ids")
    return tuple(value)


def packed(data: bytes, dtype: Any, where: str) -> np.ndarray:
    """Little-endian numbers packed in bytes (tinker's proto arrays)."""
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise WireError(f"{where} holds {len(data)} bytes, not a whole number of "
                        f"{np.dtype(dtype).name}")
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"))


def tensor_from_proto(t: Any, where: str) -> np.ndarray:
    """A tinker_public.Tensor (dense, or sparse CSR with 0 for the cells left out) as an array."""
    if t.dtype not in DTYPES:
        raise WireError(f"{where} has dtype {t.dtype}: float32, int64 or int32 only")
    dtype, shape = DTYPES[t.dtype], tuple(int(s) for s in t.shape)
    if t.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise WireError(f"{where} is sparse with shape {list(shape)}: 2-D only")
        values = packed(t.sparse_csr.values, dtype, where)
        rows = packed(t.sparse_csr.crow_indices, np.int64, where)
        cols = packed(t.sparse_csr.col_indices, np.int64, where)
        if len(rows) != shape[0] + 1 or len(cols) != len(values) or \
                (len(cols) and (cols.min() < 0 or cols.max() >= shape[1])):
            raise WireError(f"{where}'s sparse indices do not fit its shape {list(shape)}")
        dense = np.zeros(shape, dtype)
        for r in range(shape[0]):
            dense[r, cols[rows[r]:rows[r + 1]]] = values[rows[r]:rows[r + 1]]
        return dense
    flat = packed(t.dense, dtype, where)
    if shape and math.prod(shape) != flat.size:
        raise WireError(f"{where} holds {flat.size} numbers, not its shape {list(shape)}")
    return flat.reshape(shape) if shape else flat


def rgb_image(image: Image, max_pixels: int, where: str) -> np.ndarray:
    """An image chunk's pixels as RGB uint8 (H, W, 3); refused past `max_pixels` from its
    header, before it is decoded."""
    from PIL import Image as PILImage

    if image.format not in IMAGE_FORMATS:
        raise WireError(f"{where} has format {image.format!r}: png or jpeg")
    try:
        opened = PILImage.open(io.BytesIO(image.data))
        if opened.size[0] * opened.size[1] > max_pixels:
            raise WireError(f"{where} is {opened.size[0]} x {opened.size[1]} pixels: this "
                            f"server takes at most {max_pixels:,} pixels an image")
        return np.asarray(opened.convert("RGB"))
    except WireError:
        raise
    except PILImage.DecompressionBombError:
        raise WireError(f"{where} holds more pixels than a decompression-bomb check allows: "
                        f"this server takes at most {max_pixels:,} pixels an image") from None
    except Exception as err:  # PIL's many errors for bytes that are not an image
        raise WireError(f"{where} is not a readable {image.format} image "
                        f"({type(err).__name__})") from None


class ImageCache:
    """Images handled before, by a digest of their bytes: a multi-turn conversation sends its
    earlier images again with every turn, and each is read (on the server) or encoded (in the
    client, `sdk.png`) once. `size` kept, the least recently used dropped; thread-safe."""

    def __init__(self, size: int = 4096) -> None:
        self.size, self.images = size, OrderedDict[bytes, Any]()
        self.lock = threading.Lock()  # requests are read on several threads

    def get(self, key: bytes, make: Any) -> Any:
        """The value kept under `key`, else make()'s, kept."""
        with self.lock:
            if key in self.images:
                self.images.move_to_end(key)
                return self.images[key]
        value = make()  # outside the lock: other requests' images are read meanwhile
        with self.lock:
            self.images[key] = value
            if len(self.images) > self.size:
                self.images.popitem(last=False)
        return value


def read_stream(chunks: list[Chunk], processor: Any, fmt: ChatFormat, vocab: int,
                max_pixels: int, where: str, cache: ImageCache | None = None) -> Stream:
    """The stream of a ModelInput: its tokens (each below `vocab`, the model's embedding rows,
    which a sampler may emit beyond the tokenizer's), each image as its <|image_pad|> run (an
    image in `cache` is not read again)."""
    tokens: list[int] = []
    types: list[int] = []
    images = []
    for i, chunk in enumerate(chunks):
        if isinstance(chunk, Text):
            tokens += chunk.tokens
            types += [0] * len(chunk.tokens)
            continue
        def read(chunk: Image = chunk, i: int = i) -> Any:
            return encode_image(processor, rgb_image(chunk, max_pixels, f"{where}[{i}]"))
        key = hashlib.sha1(chunk.data).digest() + chunk.format.encode()
        vision = cache.get(key, read) if cache is not None else read()
        n = vision.n_patches // fmt.merge ** 2
        if chunk.expected_tokens is not None and chunk.expected_tokens != n:
            raise WireError(f"{where}[{i}]: expected_tokens is {chunk.expected_tokens}, but "
                            f"this image takes {n} tokens in this model")
        tokens += [fmt.image_pad] * n
        types += [1] * n
        images.append(vision)
    bad = next((t for t in tokens if t < 0 or t >= vocab), None)
    if bad is not None:
        raise WireError(f"{where} holds token id {bad}: the model's vocabulary has {vocab} "
                        "tokens")
    return Stream(tokens_T=tokens, mm_types_T=types, loss_mask_T=[0] * len(tokens),
                  logprobs_T=[0.0] * len(tokens), images=tuple(images))


def loss_config(loss_fn: str, config: dict[str, float]) -> LossConfig:
    """tinker's loss_fn_config as the workbench's LossConfig (summed losses)."""
    if loss_fn not in LOSS_INPUTS:
        raise WireError(f"loss_fn {loss_fn!r} is not served here: choose one of "
                        f"{', '.join(LOSSES)}")
    unknown = sorted(set(config) - set(LOSS_KEYS[loss_fn]))
    if unknown:
        raise WireError(f"loss_fn_config keys {unknown} are not known for {loss_fn}: it takes "
                        f"{list(LOSS_KEYS[loss_fn]) or 'none'}")
    low = float(config.get("clip_low_threshold", 0.8))
    high = float(config.get("clip_high_threshold", 1.2))
    if loss_fn == "ppo":
        return LossConfig(clip_low=1.0 - low, clip_high=high - 1.0, reduction="sum")
    if loss_fn == "cispo":
        return LossConfig(cispo_min=low, cispo_max=high, reduction="sum")
    return LossConfig(reduction="sum")


def read_datum(stream: Stream, inputs: dict[str, np.ndarray], loss_fn: str, where: str
               ) -> tuple[Datum, np.ndarray]:
    """A datum in tinker's layout as the workbench's -> (datum, per target: whether it is the
    next input token, so that the trainer's log-prob of it is known)."""
    n = len(stream)
    wanted = LOSS_INPUTS[loss_fn]
    missing = [k for k in wanted if k not in inputs]
    if missing:
        raise WireError(f"{where}: {loss_fn} needs loss_fn_inputs {list(wanted)}; {missing} "
                        "missing")
    extra = sorted(set(inputs) - set(wanted))
    if extra:
        raise WireError(f"{where}: loss_fn_inputs {extra} are not read by {loss_fn} (it "
                        f"takes {list(wanted)})")
    for key in wanted:
        if inputs[key].shape != (n,):
            raise WireError(f"{where}: loss_fn_inputs[{key!r}] has shape "
                            f"{list(inputs[key].shape)}; model_input has {n} tokens, so [{n}]")
    if n == 0:
        raise WireError(f"{where}: model_input is empty")
    targets = inputs["target_tokens"].astype(np.int64)
    if loss_fn == "cross_entropy":
        weights = inputs["weights"].astype(np.float64)
        advantages, sampler = np.zeros(n), np.zeros(n)
    else:
        advantages = inputs["advantages"].astype(np.float64)
        sampler = inputs["logprobs"].astype(np.float64)
        weights = (advantages != 0).astype(np.float64)
    following = np.asarray(stream.tokens_T[1:] + [int(targets[-1])])
    is_next = targets == following
    image_next = np.asarray(stream.mm_types_T[1:] + [0]) == 1
    off = np.flatnonzero((weights != 0) & (~is_next | image_next))
    if off.size:
        t = int(off[0])
        raise WireError(f"{where}: target_tokens[{t}] carries loss but is not model_input's "
                        f"next text token ({int(targets[t])} after position {t}): this server "
                        "trains on the sequence's own next tokens")
    if not np.isfinite(advantages).all() or not np.isfinite(sampler).all() or \
            not np.isfinite(weights).all():
        raise WireError(f"{where}: loss_fn_inputs hold NaN or infinite values")
    whole = Stream(tokens_T=stream.tokens_T + [int(targets[-1])],
                   mm_types_T=stream.mm_types_T + [0],
                   loss_mask_T=[0] + [int(w != 0) for w in weights],
                   logprobs_T=[0.0] + sampler.tolist(), images=stream.images)
    datum = Datum(stream=whole, advantages_T=(0.0, *advantages.tolist()),
                  weights_T=(0.0, *weights.tolist()))
    return datum, is_next


# ------------------------------------------------------------------------------------ writing

def forward_output(out: ForwardBackwardOutput, known_B: list[np.ndarray], loss_fn: str
                   ) -> bytes:
    """A ForwardBackwardOutput as tinker's protobuf: per datum the trainer's log-prob of each
    target (NaN where the target is not the next token), and the metrics as name:reduction."""
    from tinker.proto import tinker_public_pb2 as pb

    arrays = []
    for logprobs_T, known in zip(out.logprobs_B_T, known_B):
        values = np.asarray(logprobs_T[1:], dtype=np.float32)
        arrays.append(np.where(known, values, np.float32("nan")).astype("<f4"))
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = message.loss_fn_outputs.add()
    record.type_tag, record.num_datums = "ArrayRecord", len(arrays)
    field = record.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8").tobytes()
    for key, value in metric_keys(out, loss_fn).items():
        message.metrics[key] = value
    return message.SerializeToString()


def metric_keys(out: ForwardBackwardOutput, loss_fn: str) -> dict[str, float]:
    """The call's loss and metrics under tinker's name:reduction keys (how the SDK merges the
    chunks of a call: sums add, means weigh by datums); the sampler/trainer KL and the clip
    fraction for the losses that take the sampler's log-probs."""
    m = out.metrics
    keys = {"loss:sum": float(out.loss), "tokens:sum": float(m.get("tokens", 0)),
            "entropy:mean": float(m.get("entropy", 0.0))}
    if loss_fn != "cross_entropy":
        keys |= {"kl_sampler_trainer:mean": float(m.get("kl_sampler_trainer", 0.0)),
                 "clip_fraction:mean": float(m.get("clip_fraction", 0.0))}
    return keys


def sample_output(sequences: list[Completion], prompt_logprobs: list[float] | None) -> bytes:
    """Sampled sequences (and the prompt's log-probs, NaN at position 0) as tinker's protobuf."""
    from tinker.proto import tinker_public_pb2 as pb

    message = pb.SampleResponse()
    for completion in sequences:
        seq = message.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if completion.stop_reason == "stop" \
            else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(completion.tokens, dtype="<i4").tobytes()
        seq.logprobs = np.asarray(completion.logprobs, dtype="<f4").tobytes()
    if prompt_logprobs is not None:
        values = np.asarray(prompt_logprobs, dtype="<f4")
        values[:1] = np.nan
        message.prompt_logprobs = values.tobytes()
    return message.SerializeToString()
