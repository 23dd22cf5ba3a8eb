"""Plain records crossing the session boundary (the same for in-process and Ray backends)."""

from __future__ import annotations

from dataclasses import dataclass, field

from workbench.policy.stream import Stream


@dataclass(frozen=True)
class Datum:
    """One training sequence: the stream (tokens, images, loss mask, sampler log-probs) plus
    per-token advantages and weights (both length T; weights default to the loss mask)."""

    stream: Stream
    advantages_T: tuple[float, ...]
    weights_T: tuple[float, ...]

    def __repr__(self) -> str:
        """One line: length, weighted tokens, the advantage range."""
        weighted = [a for a, w in zip(self.advantages_T, self.weights_T) if w != 0]
        span = f"[{min(weighted):+.3g}, {max(weighted):+.3g}]" if weighted else "none"
        return f"Datum(T={len(self.stream)}, {len(weighted)} weighted tokens, advantages {span})"

    def __post_init__(self) -> None:
        T = len(self.stream)
        if len(self.advantages_T) != T or len(self.weights_T) != T:
            raise ValueError(f"datum tables must have the stream's length {T}: advantages "
                             f"{len(self.advantages_T)}, weights {len(self.weights_T)}")


def datum_from_stream(stream: Stream, advantage: float = 0.0) -> Datum:
    """A datum whose reply tokens (loss mask 1) all carry `advantage` and weight 1."""
    mask = tuple(float(m) for m in stream.loss_mask_T)
    return Datum(stream=stream, advantages_T=tuple(advantage * m for m in mask), weights_T=mask)


def per_reply(stream: Stream, values_R) -> tuple[float, ...]:
    """A per-token table carrying values_R[r] on the tokens of the stream's r-th reply and 0.0
    off the replies (`Stream.reply_index_T`)."""
    return tuple(float(values_R[r]) if r >= 0 else 0.0 for r in stream.reply_index_T())


@dataclass(frozen=True)
class AdamParams:
    """One optimiser step's hyper-parameters (Tinker's AdamParams)."""

    learning_rate: float = 1e-4  # step size for this step (an LR schedule sets it per step)
    beta1: float = 0.9  # first-moment decay
    beta2: float = 0.95  # second-moment decay
    eps: float = 1e-8  # denominator epsilon
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay
    grad_clip_norm: float = 1.0  # clip the global grad norm to this (0 = no clipping)


@dataclass(frozen=True)
class ForwardBackwardOutput:
    """Loss and diagnostics of one forward(_backward) call; logprobs_B_T are the trainer's."""

    loss: float
    metrics: dict[str, float]
    logprobs_B_T: list[list[float]] = field(default_factory=list)
    empty: bool = False  # the call got no datums: nothing was computed, no gradient (loss 0.0)

    def __repr__(self) -> str:
        """One line: loss, sequences, tokens, KL, clip fraction, entropy (no log-prob lists)."""
        if self.empty:
            return "ForwardBackwardOutput(empty: 0 datums, nothing computed, no gradient)"
        m = self.metrics
        return (f"ForwardBackwardOutput(loss {self.loss:+.4g}, B={len(self.logprobs_B_T)} "
                f"sequences, {m.get('tokens', 0)} tokens, kl "
                f"{m.get('kl_sampler_trainer', 0.0):.2g}, clip {m.get('clip_fraction', 0.0):.3f},"
                f" entropy {m.get('entropy', 0.0):.3g})")


def empty_output() -> ForwardBackwardOutput:
    """What a forward of no datums returns: marked empty (nothing computed)."""
    return ForwardBackwardOutput(0.0, {"loss": 0.0, "kl_sampler_trainer": 0.0,
                                       "clip_fraction": 0.0, "entropy": 0.0, "tokens": 0}, [],
                                 empty=True)


@dataclass(frozen=True)
class OptimStepOutput:
    """What one optimiser step did."""

    step: int  # optimiser steps taken so far
    grad_norm: float  # global grad norm before clipping
    learning_rate: float


@dataclass(frozen=True)
class SampleResponse:
    """Completions for one prompt (see workbench.policy.Completion)."""

    sequences: list  # list[Completion]
