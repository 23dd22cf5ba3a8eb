"""Is an adapter served as it was trained? The endpoint's log-probs of its own reply against the
trainer's log-probs of the same tokens, computed in this process.

    from openai import OpenAI
    check = check_served_logprobs(OpenAI(base_url=..., api_key=...), "tiny-sft:maze-v1",
                                  messages, base="tiny-sft", adapter="runs/x/exports/.../adapter")
    check.ok, check.max_diff, check.base_diff

One request for `model` (`<base>:<adapter>`, logprobs=true) gives the reply's tokens (each
token's exact `bytes`, mapped back to its id) and their served log-probs. The base is loaded here
with the exported adapter (`workbench.model.load_model` + `load_adapter`), the conversation is
rendered as the server renders it (`serve.chat.render_messages`), and the trainer's rule
(`workbench.policy.token_logprobs`: logits / temperature, banned tokens removed, log-softmax)
scores the reply tokens twice: with the adapter, and with it disabled (the base). The served
log-probs are those of the distribution sampled from, at the request's temperature; greedy
(temperature 0) reports them at temperature 1, and so does the trainer side here.

The check holds when the served log-probs are within `tolerance` of the adapter's and further
than `tolerance` from the base's: an endpoint that silently serves the base fails it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workbench.model import LoadedModel, load_adapter, load_model
from workbench.policy import append_reply, chat_format, token_logprobs
from workbench.serve.chat import render_messages, token_bytes


@dataclass(frozen=True)
class LogprobCheck:
    """Served log-probs of one reply against the trainer's, with and without the adapter."""

    model: str  # the model id the request named (<base>:<adapter>)
    tokens: int  # reply tokens compared
    temperature: float  # the temperature the log-probs are of (greedy: 1)
    max_diff: float  # max |served - trainer| over the reply, the adapter loaded in-process
    base_diff: float  # max |served - base| over the reply, the adapter disabled
    tolerance: float  # what max_diff may reach, and base_diff must pass

    @property
    def matches(self) -> bool:
        """The served log-probs are the trainer's, within tolerance."""
        return self.max_diff <= self.tolerance

    @property
    def not_base(self) -> bool:
        """The served log-probs are not the base model's (the adapter is applied)."""
        return self.base_diff > self.tolerance

    @property
    def ok(self) -> bool:
        """Both: served as trained, and not the base."""
        return self.matches and self.not_base


def _ids_of_bytes(tokenizer: Any) -> dict[bytes, int]:
    """Each token's exact bytes -> its id (the first id, where two share them)."""
    table: dict[bytes, int] = {}
    for token_id in range(len(tokenizer)):
        table.setdefault(token_bytes(tokenizer, token_id), token_id)
    return table


def served_reply(client: Any, model: str, messages: list[dict[str, Any]], temperature: float,
                 max_tokens: int, seed: int) -> list[tuple[bytes, float]]:
    """The reply's tokens (exact bytes) and served log-probs, from `client.chat.completions`
    (an openai.OpenAI) with logprobs=true."""
    reply = client.chat.completions.create(model=model, messages=messages, logprobs=True,
                                           temperature=temperature, max_tokens=max_tokens,
                                           seed=seed)
    return [(bytes(t.bytes), float(t.logprob)) for t in reply.choices[0].logprobs.content]


def trainer_logprobs(lm: LoadedModel, messages: list[dict[str, Any]], reply_R: list[int],
                     temperature: float) -> tuple[list[float], list[float]]:
    """The trainer's log-probs of `reply_R` after the conversation: (adapter, base). `lm.model`
    is a PeftModel (the adapter active)."""
    fmt = chat_format(lm.processor)
    prompt = render_messages(lm.processor, fmt, messages)
    stream = append_reply(prompt, fmt, reply_R, [0.0] * len(reply_R))
    span = slice(len(prompt), len(prompt) + len(reply_R))
    pad = lm.processor.tokenizer.pad_token_id
    with torch.no_grad():
        adapter_T = token_logprobs(lm.model, [stream], temperature, fmt.banned, pad)[0][0]
        with lm.model.disable_adapter():
            base_T = token_logprobs(lm.model, [stream], temperature, fmt.banned, pad)[0][0]
    return adapter_T[span].tolist(), base_T[span].tolist()


def check_served_logprobs(client: Any, model: str, messages: list[dict[str, Any]], base: str,
                          adapter: str | Path, temperature: float = 1.0, max_tokens: int = 8,
                          seed: int = 0, tolerance: float = 1e-4,
                          dtype: str = "float32") -> LogprobCheck:
    """Ask the endpoint for `model`'s reply to `messages`, and compare its log-probs with the
    trainer's of the same tokens: `base` (a model name or folder, in `dtype` on the CPU) with
    the exported `adapter` folder loaded in this process."""
    served = served_reply(client, model, messages, temperature, max_tokens, seed)
    if not served:
        raise ValueError(f"{model!r} replied with no tokens: nothing to compare")
    lm = load_model(base, dtype=dtype)
    lm.model = load_adapter(lm.model, adapter).eval()
    ids = _ids_of_bytes(lm.processor.tokenizer)
    reply_R = [ids[b] for b, _ in served]
    at = temperature if temperature > 0 else 1.0
    adapter_R, base_R = trainer_logprobs(lm, messages, reply_R, at)
    served_R = [lp for _, lp in served]
    return LogprobCheck(
        model, len(reply_R), at,
        max_diff=max(abs(s - a) for s, a in zip(served_R, adapter_R)),
        base_diff=max(abs(s - b) for s, b in zip(served_R, base_R)), tolerance=tolerance)
