"""The context budget: tokens per turn against the context length the engine serves.

    limit = context_limit(config.engine, lm.model.config)  # vLLM's max_model_len, or the model's
    rows = turn_budget(ro.flat[0], limit)                   # one dict per turn (turn 0: system)
    worst_case_tokens(config, lm.processor)                 # the longest episode config allows

`turn_budget` reads an episode's stream: each turn's image tokens, text tokens (the user
message's markup, feedback and budget text, the assistant opener and the reply's closing) and
reply tokens, the context the engine held after that reply and what is left of the limit.
`worst_case_tokens` builds the first prompt of the config's first training maze exactly as a
rollout does (system prompt, rendered image through the processor, text), and each later turn
from the observation after a reply the environment cannot parse, with every reply at
generator.max_tokens. `context_line` says in one line, before a run starts, when that passes the
limit (`rl.train.start`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.envs.env import budget_text
from workbench.policy import Stream, chat_format, start_stream
from workbench.policy.engine import EngineSettings, context_len, model_max_len
from workbench.rl.rollout import ObserveCache, observe
from workbench.rl.schedule import step_mazes


def context_limit(settings: EngineSettings, model_config: Any) -> int:
    """The context length the engine serves: vLLM's max_model_len (`policy.engine.context_len`
    of engine.max_model_len), or the model's max_position_embeddings for the transformers
    engine."""
    model_len = model_max_len(model_config)
    return context_len(settings.max_model_len, model_len) if settings.name == "vllm" \
        else model_len


def turn_budget(episode: Any, limit: int) -> list[dict[str, int]]:
    """One row per turn of a model episode (`rl.rollout.Episode`; row 0 is the system prompt):
    image_tokens, text_tokens, reply_tokens, context (the conversation's tokens once the turn's
    reply is closed: with an image window, that turn's windowed prompt and reply,
    `Episode.turn_streams`) and left (limit - context). The rows' tokens add up to the stream's
    length."""
    stream: Stream = episode.stream
    tokens_T, reply_T = stream.tokens_T, stream.reply_index_T()
    im_start = tokens_T[0]  # a stream opens with <|im_start|> (policy.start_stream)
    bounds = [next((t for t in range(1, len(tokens_T)) if tokens_T[t] == im_start),
                   len(tokens_T))]
    ends = [t + 1 for t in range(len(tokens_T)) if reply_T[t] >= 0 and (
        t + 1 == len(tokens_T) or reply_T[t + 1] != reply_T[t])]  # one past each reply
    for end in ends:  # a turn runs to the next message's <|im_start|> (its closing included)
        bounds.append(next((t for t in range(end, len(tokens_T)) if tokens_T[t] == im_start),
                           len(tokens_T)))
    rows = [{"turn": 0, "image_tokens": 0, "text_tokens": bounds[0], "reply_tokens": 0,
             "context": bounds[0], "left": limit - bounds[0]}]
    for r, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        image = sum(stream.mm_types_T[lo:hi])
        reply = sum(1 for t in range(lo, hi) if reply_T[t] == r)
        held = len(episode.turn_streams[r]) if episode.turn_streams else hi
        rows.append({"turn": r + 1, "image_tokens": image, "text_tokens": hi - lo - image - reply,
                     "reply_tokens": reply, "context": held, "left": limit - held})
    return rows


def worst_case_tokens(config: Any, processor: Any) -> int:
    """The most tokens an episode of a run config can reach: the system prompt and first
    observation of its first training maze, then generator.max_turns - 1 observations after an
    unparseable reply (feedback and the turn's budget text), and generator.max_turns replies of
    generator.max_tokens tokens, each closed by <|im_end|> and a newline."""
    task, g, fmt = config.task, config.generator, chat_format(processor)
    env = task.make_env()
    obs, info = env.reset(options={"init_state": step_mazes(config, 1)[0]})
    cache = ObserveCache()
    first = len(observe(start_stream(processor, fmt, task.rules()), processor, fmt, obs, info,
                        task, cache))
    obs, _, _, _, info = env.step("?")
    later = sum(len(observe(Stream(), processor, fmt, obs,
                            info | {"budget_text": budget_text(turn, g.max_turns)}, task, cache))
                for turn in range(1, g.max_turns))
    return first + later + g.max_turns * (g.max_tokens + 1 + len(fmt.newline))


def context_line(config: Any, processor: Any, model_config: Any) -> str | None:
    """One line when an episode of the config could pass the engine's context limit, else
    None."""
    limit = context_limit(config.engine, model_config)
    worst = worst_case_tokens(config, processor)
    if worst <= limit:
        return None
    g = config.generator
    return (f"context: an episode can reach {worst} tokens ({g.max_turns} turns, replies of up "
            f"to {g.max_tokens} tokens), above the {config.engine.name} engine's limit of "
            f"{limit}: lower generator.max_turns or generator.max_tokens, or raise "
            "engine.max_model_len (vllm)")


def check_context(config: Any, log: Callable[[str], Any] = print) -> None:
    """Log `context_line` for a run config whose model is a local folder (tiny, tiny-sft or a
    path; its processor and config are read, not its weights); hub ids and random shapes are
    not checked."""
    from transformers import AutoConfig, AutoProcessor

    from workbench.model.load import resolve_model_path

    path = resolve_model_path(config.model.name)
    if not Path(path).is_dir():
        return
    line = context_line(config, AutoProcessor.from_pretrained(path),
                        AutoConfig.from_pretrained(path))
    if line:
        log(line)
